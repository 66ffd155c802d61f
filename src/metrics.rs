//! The filter's Envoy stats: one table of every stat (`STATS`, and `NODE_STATS` per node),
//! defined together when the plugin is configured and updated by name (`Stat`) afterwards.
//!
//! Envoy shows them under `wasmcustom.` (`wasmcustom.token_balancer.routed`); the names are
//! part of the filter's interface (dashboards, the README, the integration tests read them),
//! so a name in this table never changes. Counters count events in this VM and Envoy sums
//! them over the VMs; a gauge is moved by deltas (`shift`) so that it too is the total over
//! every VM, except the few each VM sets to a value they all agree on (`record`).

use crate::host::Host;
use log::warn;
use proxy_wasm::types::MetricType;
use std::collections::HashMap;
use token_balancer_core::route::balancer::MAX_NODES;
use token_balancer_core::share::journal::JournalCounts;
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
    ServedElsewhere Counter "token_balancer.served_elsewhere",
    StoredRecorded Counter "token_balancer.stored.recorded",
    StoredFound Counter "token_balancer.stored.found",
    StoredUnknown Counter "token_balancer.stored.unknown",
    StoredAsked Counter "token_balancer.stored.asked",
    StoredAskedFound Counter "token_balancer.stored.asked_found",
    FallbackNoFreshNodes Counter "token_balancer.fallback.no_fresh_nodes",
    FallbackNoBody Counter "token_balancer.fallback.no_body",
    FallbackBodyUnusable Counter "token_balancer.fallback.body_unusable",
    FallbackBodyOverLimit Counter "token_balancer.fallback.body_over_limit",
    FallbackEncodedBody Counter "token_balancer.fallback.encoded_body",
    FallbackInternal Counter "token_balancer.fallback.internal",
    FallbackUnknownModel Counter "token_balancer.fallback.unknown_model",
    FallbackNoFleet Counter "token_balancer.fallback.no_fleet",
    RejectedUnknownModel Counter "token_balancer.rejected.unknown_model",
    RejectedTtftBudget Counter "token_balancer.rejected.ttft_budget",
    RejectedTtftBudgetHeld Counter "token_balancer.rejected.ttft_budget_held",
    RejectedShed Counter "token_balancer.rejected.shed",
    RejectedFull Counter "token_balancer.rejected.full",
    AdmissionBadHeader Counter "token_balancer.admission.bad_header",
    ClientRoutingHeaderRemoved Counter "token_balancer.client_routing_header_removed",
    ExplainGranted Counter "token_balancer.explain.granted",
    ExplainRefused Counter "token_balancer.explain.refused",
    Held Counter "token_balancer.held",
    HeldRoutedOverCeiling Counter "token_balancer.held_routed_over_ceiling",
    HeldNow Gauge "token_balancer.held_now",
    HeldQueueFull Counter "token_balancer.held_queue_full",
    HeldClientGone Counter "token_balancer.held_client_gone",
    HeldReconfigured Counter "token_balancer.held_reconfigured",
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
    TelemetryUnfiltered Counter "token_balancer.telemetry.unfiltered",
    HealthQuietNodes Gauge "token_balancer.health.quiet_nodes",
    PromptRatioPermille Gauge "token_balancer.prompt_ratio_permille",
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
    SharedWakesLost Counter "token_balancer.shared.wakes_lost",
    SharedInflightRequests Gauge "token_balancer.shared.inflight_requests",
    SharedInflightTokens Gauge "token_balancer.shared.inflight_tokens",
    PrefixPromptTokens Counter "token_balancer.prefix.prompt_tokens",
    PrefixCachedTokens Counter "token_balancer.prefix.cached_tokens",
    PrefixBlocks Gauge "token_balancer.prefix.blocks",
    PrefixBytes Gauge "token_balancer.prefix.bytes",
    PrefixSharedPublished Counter "token_balancer.prefix.shared_published",
    PrefixSharedDropped Counter "token_balancer.prefix.shared_dropped",
    PrefixSharedTaken Counter "token_balancer.prefix.shared_taken",
    PrefixSharedMissed Counter "token_balancer.prefix.shared_missed",
    OutputChunksUnread Counter "token_balancer.output.chunks_unread",
}

/// A counter per node, named `token_balancer.node.<address>.<name>`
/// (`token_balancer.node.10.0.0.1:8000.picks`). Envoy takes a Wasm stat's name as it is, dots
/// and colons included, so the shipped YAML's tag extractor can make the address a tag:
/// `token_balancer_node_picks{node="10.0.0.1:8000"}` in `/stats/prometheus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeStat {
    /// Requests routed to the node (first in the routing header).
    Picks,
    /// Health polls of the node that failed.
    HealthFailures,
    /// Prompt tokens of the requests routed to the node.
    PromptTokens,
    /// The part of them its prefix cache was believed to hold (the predicted hits).
    CachedTokens,
    /// Gauges: the engine's own cumulative prefix-cache counters at its last scrape (vLLM
    /// v1), prompt tokens found cached and looked up. Every VM that polls records the same
    /// value (the engine's), so the gauge is the engine's figure, not a sum over VMs.
    EngineHitTokens,
    EngineQueryTokens,
    /// Gauge: the engine's own recent prefix-cache hit rate at its last scrape, in thousandths
    /// (SGLang's `cache_hit_rate`), for engines that publish a rate rather than counters.
    EngineHitPermille,
}

/// Every per-node stat, with its kind and its name after the node's, in `NodeStat`'s order.
pub const NODE_STATS: [(NodeStat, Kind, &str); 7] = [
    (NodeStat::Picks, Kind::Counter, "picks"),
    (NodeStat::HealthFailures, Kind::Counter, "health_failures"),
    (NodeStat::PromptTokens, Kind::Counter, "prompt_tokens"),
    (NodeStat::CachedTokens, Kind::Counter, "cached_tokens"),
    (
        NodeStat::EngineHitTokens,
        Kind::Gauge,
        "engine_prefix_hit_tokens",
    ),
    (
        NodeStat::EngineQueryTokens,
        Kind::Gauge,
        "engine_prefix_query_tokens",
    ),
    (
        NodeStat::EngineHitPermille,
        Kind::Gauge,
        "engine_prefix_hit_permille",
    ),
];

/// The distinct addresses a VM defines per-node counters for: twice the nodes it can follow,
/// so that a full fleet can be replaced once under new addresses. Envoy never deletes a stat,
/// so without a bound a fleet whose nodes come back under new addresses (replaced pods) would
/// add stats without end; the nodes at addresses past the bound count under `OTHER_NODE`.
pub const MAX_NODE_ADDRESSES: usize = 2 * MAX_NODES;

/// The node tag of the counters of the nodes past `MAX_NODE_ADDRESSES` (never an address:
/// every address has a port).
pub const OTHER_NODE: &str = "other";

/// The full name of node counter `what` of the node at `address`. An address is `ip:port` (or
/// `[ipv6]:port`) and stays as it is; any other character than those of an address becomes `_`.
pub fn node_stat_name(address: &str, what: &str) -> String {
    let safe: String = address
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | ':' | '[' | ']' | '%' | '-' | '_' => c,
            _ => '_',
        })
        .collect();
    format!("token_balancer.node.{safe}.{what}")
}

/// One node's counters' ids, in `NODE_STATS`' order.
type NodeIds = [u32; NODE_STATS.len()];

/// The stats' ids in one VM. An id of 0 (the host refused to define it) makes its updates
/// no-ops.
pub struct Metrics<H> {
    host: H,
    ids: [u32; STATS.len()],
    /// Each node's counters, by node index.
    nodes: Vec<NodeIds>,
    /// The counters defined so far, by address: a node back at an address it had (or another
    /// node's old one) counts on where it left off, with no new definition. At most
    /// `MAX_NODE_ADDRESSES` of them.
    by_address: HashMap<String, NodeIds>,
    /// The `OTHER_NODE` counters, once a node past the bound needed them.
    other: Option<NodeIds>,
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
            by_address: HashMap::new(),
            other: None,
        };
        for (i, address) in addresses.into_iter().enumerate() {
            m.name_node(i, address);
        }
        m
    }

    fn define_node(&self, address: &str) -> NodeIds {
        let mut ids = [0; NODE_STATS.len()];
        for ((_, kind, what), id) in NODE_STATS.iter().zip(ids.iter_mut()) {
            *id = self
                .host
                .define_metric(kind.metric_type(), &node_stat_name(address, what));
        }
        ids
    }

    /// Node `i` has (a new) `address`: its counters are those of the address, defined the first
    /// time it is seen, or the `OTHER_NODE` ones once `MAX_NODE_ADDRESSES` are.
    pub fn name_node(&mut self, i: usize, address: &str) {
        let ids = if let Some(ids) = self.by_address.get(address) {
            *ids
        } else if self.by_address.len() < MAX_NODE_ADDRESSES {
            let ids = self.define_node(address);
            self.by_address.insert(address.to_string(), ids);
            ids
        } else if let Some(ids) = self.other {
            ids
        } else {
            warn!(
                "per-node stats are defined for {MAX_NODE_ADDRESSES} addresses already: nodes at new addresses count under node \"{OTHER_NODE}\""
            );
            let ids = self.define_node(OTHER_NODE);
            self.other = Some(ids);
            ids
        };
        if self.nodes.len() <= i {
            self.nodes.resize(i + 1, [0; NODE_STATS.len()]);
        }
        if let Some(slot) = self.nodes.get_mut(i) {
            *slot = ids;
        }
    }

    fn id(&self, stat: Stat) -> u32 {
        self.ids.get(stat as usize).copied().unwrap_or(0)
    }

    /// Counts one event.
    pub fn bump(&self, stat: Stat) {
        self.shift(stat, 1);
    }

    /// Moves a counter or gauge by `delta` (nothing when it is 0: no host call).
    pub fn shift(&self, stat: Stat, delta: i64) {
        let id = self.id(stat);
        if id != 0 && delta != 0 {
            self.host.increment_metric(id, delta);
        }
    }

    /// Adds `n` to a counter (nothing when `n` is 0).
    pub fn add(&self, stat: Stat, n: u64) {
        self.shift(stat, saturating_i64(n));
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
        self.add_node(node, stat, 1);
    }

    /// Adds `n` to node `node`'s counter `stat` (nothing when `n` is 0).
    pub fn add_node(&self, node: usize, stat: NodeStat, n: u64) {
        if n == 0 {
            return;
        }
        let id = self.node_id(node, stat);
        if id != 0 {
            self.host.increment_metric(id, saturating_i64(n));
        }
    }

    /// Sets node `node`'s gauge `stat` to `value`.
    pub fn record_node(&self, node: usize, stat: NodeStat, value: u64) {
        let id = self.node_id(node, stat);
        if id != 0 {
            self.host.record_metric(id, value);
        }
    }

    fn node_id(&self, node: usize, stat: NodeStat) -> u32 {
        self.nodes
            .get(node)
            .and_then(|ids| ids.get(stat as usize))
            .copied()
            .unwrap_or(0)
    }

    /// Adds what shared-data calls came to (`share::sync`) to the `shared.*` counters: one
    /// host call per counter that moved, none when nothing did.
    pub fn count(&self, c: &Counts) {
        self.shift_each(&[
            (Stat::SharedFailed, c.failed),
            (Stat::SharedCasRetries, c.cas_retries),
            (Stat::SharedCasExhausted, c.cas_exhausted),
            (Stat::SharedBooksMissing, c.books_missing),
            (Stat::SharedBooksGone, c.books_gone),
            (Stat::SharedPublished, c.published),
            (Stat::SharedImported, c.imported),
            (Stat::SharedWakesLost, c.wakes_lost),
        ]);
    }

    /// Counts what became of one step of the placements journal (`share::journal`); its
    /// CAS retries and host failures count with the books' (`shared.*`).
    pub fn count_journal(&self, c: &JournalCounts) {
        self.shift_each(&[
            (Stat::PrefixSharedPublished, c.published),
            (Stat::PrefixSharedDropped, c.dropped),
            (Stat::PrefixSharedTaken, c.taken),
            (Stat::PrefixSharedMissed, c.missed),
            (Stat::SharedCasRetries, c.cas_retries),
            (Stat::SharedFailed, c.failed),
        ]);
    }

    /// Moves each counter by its count, where that is not 0.
    fn shift_each(&self, counts: &[(Stat, u32)]) {
        for &(stat, n) in counts {
            if n > 0 {
                self.shift(stat, i64::from(n));
            }
        }
    }
}

/// A count as a metric delta, saturating at `i64::MAX`.
fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_stat_order_and_names_are_unique() {
        for (i, (stat, _, _)) in STATS.iter().enumerate() {
            assert_eq!(*stat as usize, i, "{stat:?}");
        }
        for (i, (stat, _, _)) in NODE_STATS.iter().enumerate() {
            assert_eq!(*stat as usize, i, "{stat:?}");
        }
        let mut names: Vec<&str> = STATS.iter().map(|s| s.2).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), STATS.len());
    }

    #[test]
    fn node_names_carry_the_address_as_it_is() {
        assert_eq!(
            node_stat_name("10.0.0.1:8000", "picks"),
            "token_balancer.node.10.0.0.1:8000.picks"
        );
        assert_eq!(
            node_stat_name("[fe80::1]:80", "health_failures"),
            "token_balancer.node.[fe80::1]:80.health_failures"
        );
        assert_eq!(
            node_stat_name("a b\"c\n", "picks"),
            "token_balancer.node.a_b_c_.picks"
        );
    }
}
