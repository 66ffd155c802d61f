//! The filter's Envoy stats: one table of every stat (`STATS`, and `NODE_STATS` per node),
//! defined together when the plugin is configured and updated by name (`Stat`) afterwards.
//!
//! Envoy shows them under `wasmcustom.` (`wasmcustom.token_balancer.routed`); the names are
//! part of the filter's interface (dashboards, the README, the integration tests read them),
//! so a name in this table never changes. Counters count events in this VM and Envoy sums
//! them over the VMs; a gauge is moved by deltas (`shift`) so that it too is the total over
//! every VM, except the few each VM sets to a value they all agree on (`record`).

use crate::host::Host;
use proxy_wasm::types::MetricType;
use token_balancer_core::share::sync::Counts;

/// Whether a stat counts events or holds a level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn metric_type(self) -> MetricType {
        match self {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
        }
    }
}

macro_rules! stats {
    ($($stat:ident $kind:ident $name:literal,)*) => {
        /// One of the filter's stats (see `STATS` for its name).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Stat {
            $($stat,)*
        }

        /// Every stat of the filter, with its kind and name, in `Stat`'s order.
        pub const STATS: &[(Stat, Kind, &str)] = &[$((Stat::$stat, Kind::$kind, $name),)*];
    };
}

stats! {
    Routed Counter "token_balancer.routed",
    RoutedOverVramCeiling Counter "token_balancer.routed_over_vram_ceiling",
    FallbackNoFreshNodes Counter "token_balancer.fallback.no_fresh_nodes",
    FallbackNoBody Counter "token_balancer.fallback.no_body",
    FallbackBodyUnusable Counter "token_balancer.fallback.body_unusable",
    FallbackBodyOverLimit Counter "token_balancer.fallback.body_over_limit",
    FallbackEncodedBody Counter "token_balancer.fallback.encoded_body",
    FallbackInternal Counter "token_balancer.fallback.internal",
    FallbackUnknownModel Counter "token_balancer.fallback.unknown_model",
    FallbackNoFleet Counter "token_balancer.fallback.no_fleet",
    RejectedUnknownModel Counter "token_balancer.rejected.unknown_model",
    ClientRoutingHeaderRemoved Counter "token_balancer.client_routing_header_removed",
    Held Counter "token_balancer.held",
    HeldRoutedOverCeiling Counter "token_balancer.held_routed_over_ceiling",
    HeldNow Gauge "token_balancer.held_now",
    InflightNow Gauge "token_balancer.inflight_now",
    VmMemoryBytes Gauge "token_balancer.vm_memory_bytes",
    HealthOk Counter "token_balancer.health.ok",
    HealthFailed Counter "token_balancer.health.failed",
    HealthUnparsable Counter "token_balancer.health.unparsable",
    HealthNoAnswer Counter "token_balancer.health.no_answer",
    HealthBadStatus Counter "token_balancer.health.bad_status",
    HealthTooLarge Counter "token_balancer.health.too_large",
    TelemetryDiscovered Counter "token_balancer.telemetry.discovered",
    TelemetryNotFound Counter "token_balancer.telemetry.not_found",
    TelemetryNotFoundNow Gauge "token_balancer.telemetry.not_found_now",
    NodesEjected Counter "token_balancer.nodes_ejected",
    NodesReadmitted Counter "token_balancer.nodes_readmitted",
    ModelsOk Counter "token_balancer.models.ok",
    ModelsFailed Counter "token_balancer.models.failed",
    ModelsUnparsable Counter "token_balancer.models.unparsable",
    MembersOk Counter "token_balancer.members.ok",
    MembersFailed Counter "token_balancer.members.failed",
    NodesJoined Counter "token_balancer.nodes_joined",
    NodesLeft Counter "token_balancer.nodes_left",
    MembersNow Gauge "token_balancer.members_now",
    SharedFailed Counter "token_balancer.shared.failed",
    SharedCasRetries Counter "token_balancer.shared.cas_retries",
    SharedCasExhausted Counter "token_balancer.shared.cas_exhausted",
    SharedBooksMissing Counter "token_balancer.shared.books_missing",
    SharedBooksGone Counter "token_balancer.shared.books_gone",
    SharedPublished Counter "token_balancer.shared.published",
    SharedImported Counter "token_balancer.shared.imported",
    SharedInflightRequests Gauge "token_balancer.shared.inflight_requests",
    SharedInflightTokens Gauge "token_balancer.shared.inflight_tokens",
}

/// A counter per node, named `token_balancer.node.<address>.<name>` with every character of
/// the address that is not a letter or digit as `_` (`token_balancer.node.10_0_0_1_8000.picks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeStat {
    /// Requests routed to the node (first in the routing header).
    Picks,
    /// Health polls of the node that failed.
    HealthFailures,
}

/// Every per-node counter, with its name after the node's, in `NodeStat`'s order.
pub const NODE_STATS: [(NodeStat, &str); 2] = [
    (NodeStat::Picks, "picks"),
    (NodeStat::HealthFailures, "health_failures"),
];

/// The full name of node counter `what` of the node at `address`.
pub fn node_stat_name(address: &str, what: &str) -> String {
    let safe: String = address
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    format!("token_balancer.node.{safe}.{what}")
}

/// The stats' ids in one VM. An id of 0 (the host refused to define it) makes its updates
/// no-ops.
pub struct Metrics<H> {
    host: H,
    ids: [u32; STATS.len()],
    /// Each node's counters, by node index, in `NODE_STATS`' order.
    nodes: Vec<[u32; NODE_STATS.len()]>,
}

impl<H: Host> Metrics<H> {
    /// Defines every stat, and the node counters of the nodes at `addresses`.
    pub fn define<'a>(host: H, addresses: impl IntoIterator<Item = &'a str>) -> Metrics<H> {
        let mut ids = [0; STATS.len()];
        for ((_, kind, name), id) in STATS.iter().zip(ids.iter_mut()) {
            *id = host.define_metric(kind.metric_type(), name);
        }
        let mut m = Metrics {
            host,
            ids,
            nodes: Vec::new(),
        };
        for (i, address) in addresses.into_iter().enumerate() {
            m.name_node(i, address);
        }
        m
    }

    /// Node `i` has (a new) `address`: its counters are named after it.
    pub fn name_node(&mut self, i: usize, address: &str) {
        if self.nodes.len() <= i {
            self.nodes.resize(i + 1, [0; NODE_STATS.len()]);
        }
        let host = &self.host;
        if let Some(ids) = self.nodes.get_mut(i) {
            for ((_, what), id) in NODE_STATS.iter().zip(ids.iter_mut()) {
                *id = host.define_metric(MetricType::Counter, &node_stat_name(address, what));
            }
        }
    }

    fn id(&self, stat: Stat) -> u32 {
        self.ids.get(stat as usize).copied().unwrap_or(0)
    }

    /// Counts one event.
    pub fn bump(&self, stat: Stat) {
        self.shift(stat, 1);
    }

    /// Moves a counter or gauge by `delta`.
    pub fn shift(&self, stat: Stat, delta: i64) {
        let id = self.id(stat);
        if id != 0 {
            self.host.increment_metric(id, delta);
        }
    }

    /// Sets a gauge.
    pub fn record(&self, stat: Stat, value: u64) {
        let id = self.id(stat);
        if id != 0 {
            self.host.record_metric(id, value);
        }
    }

    /// Counts one event of node `node`.
    pub fn bump_node(&self, node: usize, stat: NodeStat) {
        let id = self
            .nodes
            .get(node)
            .and_then(|ids| ids.get(stat as usize))
            .copied()
            .unwrap_or(0);
        if id != 0 {
            self.host.increment_metric(id, 1);
        }
    }

    /// Adds what shared-data calls came to (`share::sync`) to the `shared.*` counters: one
    /// host call per counter that moved, none when nothing did.
    pub fn count(&self, c: &Counts) {
        for (stat, n) in [
            (Stat::SharedFailed, c.failed),
            (Stat::SharedCasRetries, c.cas_retries),
            (Stat::SharedCasExhausted, c.cas_exhausted),
            (Stat::SharedBooksMissing, c.books_missing),
            (Stat::SharedBooksGone, c.books_gone),
            (Stat::SharedPublished, c.published),
            (Stat::SharedImported, c.imported),
        ] {
            if n > 0 {
                self.shift(stat, i64::from(n));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_stat_order_and_names_are_unique() {
        for (i, (stat, _, _)) in STATS.iter().enumerate() {
            assert_eq!(*stat as usize, i, "{stat:?}");
        }
        for (i, (stat, _)) in NODE_STATS.iter().enumerate() {
            assert_eq!(*stat as usize, i, "{stat:?}");
        }
        let mut names: Vec<&str> = STATS.iter().map(|s| s.2).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), STATS.len());
    }

    #[test]
    fn node_names_keep_letters_and_digits_only() {
        assert_eq!(
            node_stat_name("10.0.0.1:8000", "picks"),
            "token_balancer.node.10_0_0_1_8000.picks"
        );
        assert_eq!(
            node_stat_name("[::1]:80", "health_failures"),
            "token_balancer.node.___1__80.health_failures"
        );
    }
}
