//! The callouts in flight to the nodes (health polls, model lists), and whom each answer is
//! for.
//!
//! A callout's answer comes back one tick or more after it was sent, and in between the
//! cluster's membership can change: a pod leaves, and its slot in the fleet goes to a new pod
//! at another address. An answer keyed by the slot alone would then land on the new pod: the
//! departed pod's report (or its failure) would count for a node it never came from, and a
//! pod that died would eject its successor. So each callout is remembered with the slot and
//! the tenant (`node::tenant_of` its address) it was sent for, and an answer whose slot now
//! holds another tenant is dropped (`Answer::Departed`).
//!
//! The table is also what keeps slow nodes from piling up callouts: a node with a callout
//! outstanding is not asked again until it answers (Envoy answers every callout, at the latest
//! with its timeout).

use std::collections::{HashMap, HashSet};

/// Whom one callout was sent for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Call {
    /// The node's slot in the fleet (its index in the balancer).
    pub slot: usize,
    /// `tenant_of` the node's address when the call was sent.
    pub tenant: u64,
}

/// What an answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The node it was sent for still holds its slot: apply the answer to `slot`.
    Current(usize),
    /// The slot has gone to another address (or no longer exists) since the call was sent:
    /// the answer is about a node that left, and is dropped.
    Departed(Call),
    /// Not a call of this table.
    Unknown,
}

/// The callouts in flight of one kind, by the host's token.
#[derive(Debug, Clone, Default)]
pub struct Outstanding {
    calls: HashMap<u32, Call>,
    /// The values of `calls`, so a tick asks "is this node asked?" without a scan per node.
    asked: HashSet<Call>,
}

impl Outstanding {
    /// A callout with `token` was sent to the node in `slot`, which is `tenant`.
    pub fn sent(&mut self, token: u32, slot: usize, tenant: u64) {
        let call = Call { slot, tenant };
        if let Some(old) = self.calls.insert(token, call) {
            // The host reused a token it already answered: the old entry is over.
            self.asked.remove(&old);
        }
        self.asked.insert(call);
    }

    /// Whether the node `tenant` in `slot` has a callout in flight. A slot's former tenant's
    /// call does not count: the new tenant is asked at once (its answer will be its own).
    pub fn is_asked(&self, slot: usize, tenant: u64) -> bool {
        self.asked.contains(&Call { slot, tenant })
    }

    /// The answer with `token` came; `tenant_now(slot)` says who holds the slot now (`None`:
    /// the slot no longer exists). The call is no longer outstanding whatever it was for.
    pub fn answer(&mut self, token: u32, tenant_now: impl FnOnce(usize) -> Option<u64>) -> Answer {
        let Some(call) = self.calls.remove(&token) else {
            return Answer::Unknown;
        };
        self.asked.remove(&call);
        if tenant_now(call.slot) == Some(call.tenant) {
            Answer::Current(call.slot)
        } else {
            Answer::Departed(call)
        }
    }

    /// Whether `token` is a call of this table.
    pub fn contains(&self, token: u32) -> bool {
        self.calls.contains_key(&token)
    }

    /// No callout in flight.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Callouts in flight.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Forgets every callout (a new configuration: their answers are ignored).
    pub fn clear(&mut self) {
        self.calls.clear();
        self.asked.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::node::tenant_of;

    #[test]
    fn an_answer_goes_to_the_node_it_was_asked_of() {
        let mut o = Outstanding::default();
        let a = tenant_of("10.0.0.1:8000");
        o.sent(7, 0, a);
        assert!(o.is_asked(0, a));
        assert!(o.contains(7));
        assert_eq!(o.answer(7, |_| Some(a)), Answer::Current(0));
        assert!(o.is_empty());
        assert!(!o.is_asked(0, a));
        assert_eq!(o.answer(7, |_| Some(a)), Answer::Unknown, "answered once");
    }

    #[test]
    fn a_departed_nodes_late_answer_does_not_land_on_its_slots_new_tenant() {
        let mut o = Outstanding::default();
        let (old, new) = (tenant_of("10.0.0.1:8000"), tenant_of("10.0.0.2:8000"));
        o.sent(1, 3, old);
        // Membership moved slot 3 to a new pod before the answer came: the new pod is not
        // waiting on the old pod's call, so it is asked at once.
        assert!(!o.is_asked(3, new));
        o.sent(2, 3, new);
        assert_eq!(o.len(), 2);
        assert_eq!(
            o.answer(1, |_| Some(new)),
            Answer::Departed(Call {
                slot: 3,
                tenant: old
            })
        );
        assert!(o.is_asked(3, new), "the new tenant's own call is still out");
        assert_eq!(o.answer(2, |_| Some(new)), Answer::Current(3));
        // A slot that no longer exists takes no answer either.
        o.sent(4, 9, old);
        assert!(matches!(o.answer(4, |_| None), Answer::Departed(_)));
        assert!(o.is_empty());
    }

    #[test]
    fn clear_forgets_every_call() {
        let mut o = Outstanding::default();
        o.sent(1, 0, 5);
        o.sent(2, 1, 6);
        o.clear();
        assert!(o.is_empty());
        assert!(!o.is_asked(0, 5));
        assert_eq!(o.answer(1, |_| Some(5)), Answer::Unknown);
        // A reused token replaces the old entry.
        o.sent(3, 0, 5);
        o.sent(3, 1, 6);
        assert!(!o.is_asked(0, 5));
        assert!(o.is_asked(1, 6));
        assert_eq!(o.len(), 1);
    }
}
