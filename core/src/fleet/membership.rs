//! Membership: which nodes a balancer follows, in which slot, with which settings.
//!
//! The nodes are the configuration's `nodes`, or, with `membership`, the members of an Envoy
//! cluster as Envoy's admin lists them (`ingest::members` reads that list). Requests are sent
//! with Envoy's `override_host`, which only takes a member of the cluster, so a node that is
//! not a member is never chosen. Each node has a slot (its index): the balancer's state, the
//! per-node counters and, with a shared poller, the key of its shared books (`share::books_key`)
//! are per slot.
//!
//! Churn is bounded: pods replaced under new addresses reuse the slots of departed nodes once
//! nothing is in flight there, and a departed node keeps its books until its requests end, so
//! that their releases find them. At most `MAX_NODES` nodes are followed. A node that leaves
//! drops its report: if it comes back (perhaps restarted) only a new report is trusted.
//!
//! With `poller: singleton`, the poller service follows the cluster (`set_members`) and every
//! filter VM takes the poller's slots as its own (`mirror`), so a node's books key is the same
//! in every VM.

use crate::config::{Config, NodeConfig};
use crate::fleet::models::ServedModels;
use crate::fleet::node::NodeState;
use crate::fleet::probe::Probe;

/// Most nodes a balancer follows: a cluster listing more is followed up to this many.
pub const MAX_NODES: usize = 4096;

/// What a new member list changed (slots).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemberChange {
    /// Nodes that joined: new, back, or a slot reused for a new address.
    pub joined: Vec<usize>,
    /// Nodes that left the cluster: never chosen or polled until they are members again.
    pub left: Vec<usize>,
    /// Members not followed because the balancer already follows `MAX_NODES` nodes.
    pub over_limit: usize,
}

impl MemberChange {
    /// Whether any node joined or left.
    pub fn moved(&self) -> bool {
        !self.joined.is_empty() || !self.left.is_empty()
    }
}

/// The nodes a balancer follows and the settings of each, slot for slot.
#[derive(Debug, Clone)]
pub struct Fleet {
    nodes: Vec<NodeState>,
    /// Each node's settings, slot for slot with `nodes`: the configured ones first, then the
    /// members learned from the cluster.
    configs: Vec<NodeConfig>,
    /// How many of `configs` come from the configuration's `nodes`.
    listed: usize,
    /// The configuration's `nodes`, for `mirror`, whose slots may hold them elsewhere.
    listed_configs: Vec<NodeConfig>,
    /// The settings of a member the configuration does not list; `None` when the nodes do not
    /// follow a cluster.
    defaults: Option<NodeConfig>,
    /// How each node starts: its hysteresis and what a report with room to spare is.
    start: Start,
}

/// The fleet-wide settings every node starts with.
#[derive(Debug, Clone, Copy)]
struct Start {
    /// Failed and good polls in a row that eject and readmit a node.
    unhealthy: u32,
    healthy: u32,
    /// KV-cache use at or below which a report shows room to spare: half the VRAM ceiling.
    slack_kv: f64,
    /// The polling periods, from which a quiet node's report stays fresh longer.
    tick_ms: u64,
    quiet_poll_ms: u64,
}

impl Fleet {
    /// The configuration's nodes, each in the slot of its place in the list.
    pub fn new(cfg: &Config) -> Fleet {
        let start = Start {
            unhealthy: cfg.unhealthy_after_failures,
            healthy: cfg.healthy_after_successes,
            slack_kv: cfg.vram_ceiling / 2.0,
            tick_ms: cfg.tick_ms,
            quiet_poll_ms: cfg.quiet_poll_ms,
        };
        Fleet {
            nodes: cfg.nodes.iter().map(|n| node_state(n, start)).collect(),
            configs: cfg.nodes.clone(),
            listed: cfg.nodes.len(),
            listed_configs: cfg.nodes.clone(),
            defaults: cfg.membership.as_ref().map(|m| m.node_defaults.clone()),
            start,
        }
    }

    pub fn nodes(&self) -> &[NodeState] {
        &self.nodes
    }

    /// The nodes, to change their state (not the set: that is `set_members` and `mirror`).
    pub fn nodes_mut(&mut self) -> &mut [NodeState] {
        &mut self.nodes
    }

    /// Node `node`'s settings: where to poll it, its format, its configured figures.
    pub fn config(&self, node: usize) -> Option<&NodeConfig> {
        self.configs.get(node)
    }

    /// The members of the Envoy cluster are now `addresses`. A member the fleet knows keeps
    /// its state; a new one takes its settings from `nodes` when listed there, else from the
    /// defaults, and a slot left by a departed node with nothing in flight is reused before
    /// the list grows. `busy(i)` says whether departed node `i` still has requests in flight
    /// that its own books do not show (the poller service routes nothing itself: the shared
    /// books know), so its slot is not reused yet. Without `membership` configured this does
    /// nothing.
    pub fn set_members(
        &mut self,
        addresses: &[String],
        busy: impl Fn(usize) -> bool,
    ) -> MemberChange {
        let mut change = MemberChange::default();
        let Some(defaults) = self.defaults.clone() else {
            return change;
        };
        let wanted: std::collections::HashSet<&str> =
            addresses.iter().map(String::as_str).collect();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            let member = wanted.contains(n.address());
            if n.member() && !member {
                n.set_member(false);
                change.left.push(i);
            } else if !n.member() && member {
                n.set_member(true);
                change.joined.push(i);
            }
        }
        let known: std::collections::HashSet<String> =
            self.nodes.iter().map(|n| n.address().to_string()).collect();
        for address in addresses {
            if known.contains(address) {
                continue;
            }
            let config = NodeConfig {
                address: address.clone(),
                ..defaults.clone()
            };
            let state = node_state(&config, self.start);
            let reusable = (self.listed..self.nodes.len()).find(|&i| {
                self.nodes
                    .get(i)
                    .is_some_and(|n| !n.member() && n.books().inflight_requests == 0)
                    && !busy(i)
            });
            let slot = match reusable {
                Some(i) => i,
                None if self.nodes.len() < MAX_NODES => {
                    self.nodes.push(state.clone());
                    self.configs.push(config.clone());
                    self.nodes.len() - 1
                }
                None => {
                    change.over_limit += 1;
                    continue;
                }
            };
            if let (Some(n), Some(c)) = (self.nodes.get_mut(slot), self.configs.get_mut(slot)) {
                *n = state;
                *c = config;
            }
            change.left.retain(|&i| i != slot);
            change.joined.push(slot);
        }
        change
    }

    /// A filter VM following a cluster with `poller: singleton` takes the poller's slots as
    /// its own: `slots` gives, slot by slot, the address the poller has there and whether it is
    /// a member. A slot now holding another address starts afresh with that address's settings
    /// (from `nodes` when listed there, else the defaults). Returns what changed, as
    /// `set_members` does. Without `membership` configured this does nothing: the nodes are
    /// the configured ones.
    pub fn mirror<'a>(&mut self, slots: impl IntoIterator<Item = (&'a str, bool)>) -> MemberChange {
        let mut change = MemberChange::default();
        let Some(defaults) = self.defaults.clone() else {
            return change;
        };
        let mut count = 0;
        for (i, (address, member)) in slots.into_iter().enumerate() {
            count = i + 1;
            if i >= MAX_NODES {
                change.over_limit += 1;
                continue;
            }
            if let Some(n) = self.nodes.get_mut(i).filter(|n| n.address() == address) {
                if n.member() != member {
                    n.set_member(member);
                    if member {
                        change.joined.push(i);
                    } else {
                        change.left.push(i);
                    }
                }
                continue;
            }
            let config = self
                .listed_configs
                .iter()
                .find(|c| c.address == address)
                .cloned()
                .unwrap_or_else(|| NodeConfig {
                    address: address.to_string(),
                    ..defaults.clone()
                });
            let state = node_state(&config, self.start).with_member(member);
            match (self.nodes.get_mut(i), self.configs.get_mut(i)) {
                (Some(n), Some(c)) => {
                    if n.member() && !member {
                        change.left.push(i);
                    }
                    *n = state;
                    *c = config;
                }
                _ => {
                    self.nodes.push(state);
                    self.configs.push(config);
                }
            }
            if member {
                change.joined.push(i);
            }
        }
        // Slots past the poller's (a poller restarted with fewer) are out of the cluster.
        for i in count..self.nodes.len() {
            if let Some(n) = self.nodes.get_mut(i).filter(|n| n.member()) {
                n.set_member(false);
                change.left.push(i);
            }
        }
        change
    }
}

/// A node's state as its settings start it.
fn node_state(n: &NodeConfig, start: Start) -> NodeState {
    let state = NodeState::new(&n.address, n.capacity_tokens_per_sec, n.kv_cache_tokens)
        .with_hysteresis(start.unhealthy, start.healthy)
        .with_slack_kv(start.slack_kv)
        .with_polling(start.tick_ms, start.quiet_poll_ms)
        .with_format(n.format)
        .with_probe(Probe::new(n.health_path.as_deref(), n.filter_metrics));
    match &n.models {
        Some(names) => state.with_models(ServedModels::configured(names.clone())),
        None => state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::route::balancer::{Balancer, Outcome, OwnBooks};
    use crate::route::testing::*;

    #[test]
    fn members_join_and_leave_and_only_members_are_chosen() {
        let mut b = following(r#","nodes":[{"address":"10.0.0.9:80","kv_cache_tokens":5}]"#);
        let mut rng = SplitMix64::new(1);
        // Before any member list, the listed node stands.
        assert_eq!(b.nodes().len(), 1);
        let c = b.set_members(&members(&["10.0.0.1:80", "10.0.0.2:80"]), |_| false);
        assert_eq!(
            c,
            MemberChange {
                joined: vec![1, 2],
                left: vec![0],
                over_limit: 0
            }
        );
        assert_eq!(b.node_config(1).unwrap().kv_cache_tokens, Some(777));
        for i in 0..3 {
            b.on_health(i, Some(IDLE), 0).unwrap();
        }
        // The listed node is no member: never chosen, whatever it reports.
        for _ in 0..20 {
            let o = b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
            assert!(matches!(routed_to(&o), Some(1 | 2)), "{o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // It joins and takes its listed settings; node 2 leaves with a request in flight.
        let on_2 = loop {
            if let Outcome::Routed { ticket, .. } =
                b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks)
            {
                if ticket.node == 2 {
                    break ticket;
                }
                b.release(&ticket, 0);
            }
        };
        let c = b.set_members(&members(&["10.0.0.9:80", "10.0.0.1:80"]), |_| false);
        assert_eq!(
            c,
            MemberChange {
                joined: vec![0],
                left: vec![2],
                over_limit: 0
            }
        );
        assert_eq!(b.node_config(0).unwrap().kv_cache_tokens, Some(5));
        b.on_health(0, Some(IDLE), 20).unwrap();
        for _ in 0..20 {
            let o = b.route(W, None, &Chain::NONE, 30, &mut rng, false, &mut OwnBooks);
            assert!(matches!(routed_to(&o), Some(0 | 1)), "{o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // A new address cannot take node 2's slot while its request is in flight...
        let c = b.set_members(
            &members(&["10.0.0.9:80", "10.0.0.1:80", "10.0.0.3:80"]),
            |_| false,
        );
        assert_eq!(c.joined, vec![3]);
        b.release(&on_2, 0);
        assert_eq!(b.nodes()[2].books().inflight_requests, 0);
        // ...and takes it once the request is done: the state does not grow with churn.
        let c = b.set_members(
            &members(&["10.0.0.9:80", "10.0.0.1:80", "10.0.0.4:80"]),
            |_| false,
        );
        assert_eq!(
            c,
            MemberChange {
                joined: vec![2],
                left: vec![3],
                over_limit: 0
            }
        );
        assert_eq!(b.nodes().len(), 4);
        assert_eq!(b.nodes()[2].address(), "10.0.0.4:80");
        // A node that comes back is trusted only on a new report.
        let c = b.set_members(
            &members(&["10.0.0.9:80", "10.0.0.1:80", "10.0.0.4:80", "10.0.0.3:80"]),
            |_| false,
        );
        assert_eq!(c.joined, vec![3]);
        assert_eq!(b.nodes()[3].reported_at(), None);
        // An empty cluster: nothing to choose, Envoy's fallback routes.
        b.set_members(&[], |_| false);
        assert_eq!(
            b.route(W, None, &Chain::NONE, 40, &mut rng, false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
    }

    #[test]
    fn members_are_followed_only_when_configured_and_up_to_the_limit() {
        let mut fixed = Balancer::new(&cfg(2, ""));
        assert_eq!(
            fixed.set_members(&members(&["10.0.0.1:80"]), |_| false),
            MemberChange::default()
        );
        assert!(fixed.nodes().iter().all(NodeState::member));
        let mut b = following("");
        let many: Vec<String> = (0..MAX_NODES + 5)
            .map(|i| format!("10.{}.{}.{}:80", i / 65536, (i / 256) % 256, i % 256))
            .collect();
        let c = b.set_members(&many, |_| false);
        assert_eq!((c.joined.len(), c.over_limit), (MAX_NODES, 5));
    }
}
