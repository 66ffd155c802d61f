//! Nodes to poll every tick again: a short list in shared data where a worker names a node it
//! sent a prompt to while the poller service polls that node at a longer period, with
//! `poller: singleton`.
//!
//! A quiet or slack node is polled less often, but not while a prompt sent there waits for its
//! first token (`fleet::polling`): what an engine does with prompts it has not started is what
//! the books cannot know. The poller service used to learn it by reading, every tick, the shared
//! books of every node it was not polling that tick: at a thousand idle nodes, four thousand
//! reads a second, each a crossing into Envoy and back into the VM for the copy, about 1% of a
//! core. Instead the worker that sends a prompt to such a node says so here, and the service
//! reads this one key per timer tick, the books of the nodes named (at their slices, until an
//! answer shows nothing waiting), and a node's books once at each answer that would let it wait
//! a longer period. Nodes nobody sent anything to are not read.
//!
//! - **The list** (`WAKE_KEY`): slots of the poller's fleet (as the books are keyed), at most
//!   `MAX_WAKES`, each once. The poller service creates it empty at start; workers never create
//!   it (as for the books).
//! - **A worker** adds a slot with compare-and-swap (`push`), retried up to `MAX_CAS_RETRIES`
//!   times. A slot already there costs the read alone. A full list is marked as overflowed
//!   rather than grown: the service then treats every node as named.
//! - **The service** takes the list and empties it with compare-and-swap (`take`): one read
//!   when it is empty, as it nearly always is.
//! - **What a lost name costs**: a name that could not be written (retries exhausted, a host
//!   call failed) is counted, not kept: the node is still polled at its longer period, at most
//!   `quiet_poll_ms` later, and its next answer's check of the books brings it back to every
//!   tick while the prompt waits.

use super::{SetError, Store, StoreFailed, MAX_CAS_RETRIES};

/// Key of the list.
pub const WAKE_KEY: &str = "token_balancer.wake";
/// Slots the list holds at most before it is marked as overflowed.
pub const MAX_WAKES: usize = 256;

/// The list's flags byte: set when a slot did not fit.
const OVERFLOWED: u8 = 1;

/// What the list named since the service last took it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Woken {
    /// The slots named, in the order they were added.
    pub slots: Vec<usize>,
    /// More were named than the list holds: every node counts as named.
    pub overflowed: bool,
}

/// What became of a `push`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pushed {
    /// Added (or already there, or the list overflowed), after `retries` CAS mismatches.
    Yes { retries: u32 },
    /// Not written: every attempt met a CAS mismatch, a host call failed, or there is no list
    /// (no poller service created it).
    Lost,
}

/// The list's bytes: the flags byte, then each slot as 4 bytes little-endian.
fn encode(woken: &Woken) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 4 * woken.slots.len());
    out.push(if woken.overflowed { OVERFLOWED } else { 0 });
    for &slot in &woken.slots {
        out.extend_from_slice(&u32::try_from(slot).unwrap_or(u32::MAX).to_le_bytes());
    }
    out
}

/// The list in `bytes`; `None` when they are not one (the service then counts every node as
/// named, and writes a good list over them).
fn decode(bytes: &[u8]) -> Option<Woken> {
    let (&flags, rest) = bytes.split_first()?;
    if rest.len() % 4 != 0 {
        return None;
    }
    let slots = rest
        .chunks_exact(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b.copy_from_slice(c);
            usize::try_from(u32::from_le_bytes(b)).unwrap_or(usize::MAX)
        })
        .collect();
    Some(Woken {
        slots,
        overflowed: flags & OVERFLOWED != 0,
    })
}

/// The service's start: an empty list (a list left by an earlier configuration is dropped
/// with what it named: its nodes are polled afresh anyway).
pub fn create<S: Store>(store: &mut S) -> Result<(), StoreFailed> {
    store
        .set(WAKE_KEY, &encode(&Woken::default()), None)
        .map_err(|_| StoreFailed)
}

/// A worker names `slot` (see the module's rules).
pub fn push<S: Store>(store: &mut S, slot: usize) -> Pushed {
    for retries in 0..=MAX_CAS_RETRIES {
        let Ok(Some((bytes, cas))) = store.get(WAKE_KEY) else {
            return Pushed::Lost;
        };
        let mut woken = decode(&bytes).unwrap_or(Woken {
            slots: Vec::new(),
            overflowed: true,
        });
        if woken.overflowed || woken.slots.contains(&slot) {
            return Pushed::Yes { retries };
        }
        if woken.slots.len() >= MAX_WAKES {
            woken.overflowed = true;
        } else {
            woken.slots.push(slot);
        }
        match store.set(WAKE_KEY, &encode(&woken), Some(cas)) {
            Ok(()) => return Pushed::Yes { retries },
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return Pushed::Lost,
        }
    }
    Pushed::Lost
}

/// The service takes what the list names and empties it. A list it cannot empty (retries
/// exhausted, a host call failed) is taken again at the next call, names and all: nothing
/// named is lost, a name may come twice.
pub fn take<S: Store>(store: &mut S) -> Result<Woken, StoreFailed> {
    let mut last = Woken::default();
    for _ in 0..=MAX_CAS_RETRIES {
        let Some((bytes, cas)) = store.get(WAKE_KEY)? else {
            return Ok(Woken::default());
        };
        let woken = decode(&bytes).unwrap_or(Woken {
            slots: Vec::new(),
            overflowed: true,
        });
        if woken == Woken::default() {
            return Ok(woken);
        }
        match store.set(WAKE_KEY, &encode(&Woken::default()), Some(cas)) {
            Ok(()) => return Ok(woken),
            Err(SetError::CasMismatch) => last = woken,
            Err(SetError::Failed) => return Ok(woken),
        }
    }
    // Every attempt lost a race with a worker adding a name: what was read is acted on now,
    // and the list (still holding it) is taken again next time.
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::testing::FakeStore;

    fn created() -> FakeStore {
        let mut store = FakeStore::default();
        create(&mut store).unwrap();
        store
    }

    #[test]
    fn names_are_taken_once_in_order_and_each_once() {
        let mut store = created();
        assert_eq!(take(&mut store).unwrap(), Woken::default());
        for slot in [3, 7, 3, 0] {
            assert_eq!(push(&mut store, slot), Pushed::Yes { retries: 0 });
        }
        let woken = take(&mut store).unwrap();
        assert_eq!(woken.slots, vec![3, 7, 0]);
        assert!(!woken.overflowed);
        assert_eq!(take(&mut store).unwrap(), Woken::default(), "emptied");
    }

    #[test]
    fn an_empty_list_costs_one_read_and_a_named_slot_a_read_again() {
        let mut store = created();
        store.calls = 0;
        take(&mut store).unwrap();
        assert_eq!(store.calls, 1);
        push(&mut store, 5);
        store.calls = 0;
        push(&mut store, 5);
        assert_eq!(store.calls, 1, "already named: no write");
    }

    #[test]
    fn a_full_list_overflows_and_every_node_counts_as_named() {
        let mut store = created();
        for slot in 0..MAX_WAKES {
            push(&mut store, slot);
        }
        assert_eq!(push(&mut store, MAX_WAKES), Pushed::Yes { retries: 0 });
        assert_eq!(push(&mut store, MAX_WAKES + 1), Pushed::Yes { retries: 0 });
        let woken = take(&mut store).unwrap();
        assert!(woken.overflowed);
        assert_eq!(woken.slots.len(), MAX_WAKES);
        assert_eq!(take(&mut store).unwrap(), Woken::default());
    }

    #[test]
    fn without_a_list_a_name_is_lost_and_nothing_is_created() {
        let mut store = FakeStore::default();
        assert_eq!(push(&mut store, 1), Pushed::Lost);
        assert!(store.data.is_empty(), "workers never create the list");
        assert_eq!(take(&mut store).unwrap(), Woken::default());
    }

    #[test]
    fn a_failing_host_loses_the_name_and_the_service_sees_the_failure() {
        let mut store = created();
        store.fail = true;
        assert_eq!(push(&mut store, 1), Pushed::Lost);
        assert_eq!(take(&mut store), Err(StoreFailed));
    }

    #[test]
    fn unreadable_bytes_count_as_every_node_named_and_are_replaced() {
        let mut store = created();
        store.set(WAKE_KEY, &[0, 1, 2], None).unwrap();
        let woken = take(&mut store).unwrap();
        assert!(woken.overflowed);
        assert_eq!(take(&mut store).unwrap(), Woken::default());
        store.set(WAKE_KEY, &[], None).unwrap();
        assert_eq!(push(&mut store, 4), Pushed::Yes { retries: 0 });
        assert!(take(&mut store).unwrap().overflowed);
    }

    /// Another worker names a node between a worker's read and its write: the write starts
    /// over from a fresh read and both names are kept.
    #[test]
    fn two_workers_naming_at_once_both_land() {
        let mut store = created();
        let mut once = true;
        store.interfere = Some(Box::new(move |data, next_cas| {
            if std::mem::take(&mut once) {
                *next_cas += 1;
                let other = encode(&Woken {
                    slots: vec![9],
                    overflowed: false,
                });
                data.insert(WAKE_KEY.to_string(), (other, *next_cas));
            }
        }));
        assert_eq!(push(&mut store, 2), Pushed::Yes { retries: 1 });
        assert_eq!(take(&mut store).unwrap().slots, vec![9, 2]);
    }

    /// A worker names a node while the service empties the list: the service's emptying starts
    /// over, so the late name is not wiped out unseen.
    #[test]
    fn a_name_added_while_the_service_takes_is_not_lost() {
        let mut store = created();
        push(&mut store, 1);
        let mut once = true;
        store.interfere = Some(Box::new(move |data, next_cas| {
            if std::mem::take(&mut once) {
                *next_cas += 1;
                let both = encode(&Woken {
                    slots: vec![1, 6],
                    overflowed: false,
                });
                data.insert(WAKE_KEY.to_string(), (both, *next_cas));
            }
        }));
        assert_eq!(take(&mut store).unwrap().slots, vec![1, 6]);
        assert_eq!(take(&mut store).unwrap(), Woken::default());
    }

    /// A list that stays contended past the retries is acted on as read, and still there to
    /// be taken again: a name may come twice, never not at all.
    #[test]
    fn a_list_contended_past_the_retries_is_taken_again() {
        let mut store = created();
        push(&mut store, 4);
        store.interfere = Some(Box::new(|data, next_cas| {
            *next_cas += 1;
            if let Some(v) = data.get_mut(WAKE_KEY) {
                v.1 = *next_cas;
            }
        }));
        assert_eq!(take(&mut store).unwrap().slots, vec![4]);
        store.interfere = None;
        assert_eq!(take(&mut store).unwrap().slots, vec![4]);
    }
}
