//! The balancer: the fleet of nodes and the three things that happen to it — a health answer
//! arrives, a request is routed, a request ends.
//!
//! A fourth thing feeds it: a node's model list arrives (`on_models`). A request that names a
//! model is placed among the nodes that serve it; one whose model every node is known not to
//! serve is `UnknownModel`, for the caller to reject or leave to Envoy (see `models`).
//!
//! This is the whole decision core the Envoy glue drives. It is plain Rust: time comes in as
//! `now_ms` and randomness as a `Rng`, so every behaviour is tested natively and, compiled to
//! wasm32-wasip1, in the same instruction set the filter ships in.

use crate::config::{Config, NodeConfig};
use crate::fleet::models::{self, ListError, ServedModels, Serves};
pub use crate::fleet::node::HealthError;
use crate::fleet::node::{NodeState, Ticket, Transition};
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;
use crate::rng::Rng;
use crate::route::candidates::{self, Pool};
use crate::route::choice::{self, Ask, Decision, Growth, Params};
use crate::route::outputs::OutputModel;
use crate::share::{Books, NodeView, Snapshot};

/// Weight of the newest request in the running mean of request size (used to turn a reported
/// queue depth into tokens). An exponentially weighted mean forgets old traffic mixes in about
/// 1/alpha requests.
const MEAN_ALPHA: f64 = 0.05;
/// Standard deviations of the output of a node's in-flight requests, taken together, reserved
/// as KV growth beyond their means (2: a 2% chance a node's total outgrows it if lengths were
/// normal and independent; they are skewed right, so this is a floor, not a bound).
const RESERVE_SIGMAS: f64 = 2.0;

/// How a routed request left the filter.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Routed to the first node of the list; the value is the routing header.
    Routed {
        ticket: Ticket,
        header_value: String,
        predicted_seconds: f64,
        /// Every fresh node would overflow its VRAM; this is the least bad.
        over_ceiling: bool,
        /// Requests this filter had in flight on the chosen node before this one (visibility).
        inflight_before: u64,
    },
    /// No basis to choose: the routing header is not set and Envoy's fallback balancer routes.
    NoFreshNodes,
    /// Every fresh node would pass its VRAM ceiling and the caller may hold the request:
    /// nothing was booked; ask again when a stream ends or a report arrives (see `admission`).
    Saturated,
    /// Every node is known not to serve the request's model: nothing was booked.
    UnknownModel,
}

#[derive(Debug, Clone)]
pub struct Balancer {
    nodes: Vec<NodeState>,
    /// Each node's settings, index for index with `nodes`: the configured ones first, then the
    /// members learned from the cluster (`set_members`).
    configs: Vec<NodeConfig>,
    /// How many of `configs` come from the configuration's `nodes`.
    listed: usize,
    /// The configuration's `nodes`, for `mirror_fleet`, whose slots may hold them elsewhere.
    listed_configs: Vec<NodeConfig>,
    /// The settings of a member the configuration does not list; `None` when the nodes do not
    /// follow a cluster.
    defaults: Option<NodeConfig>,
    params: Params,
    max_hosts: usize,
    /// Predicted KV use the least-full node must pass before a request is held.
    hold_kv_ceiling: f64,
    mean_request_tokens: Option<f64>,
    /// Mean and variance of the output length of the streams seen to completion, and how many.
    /// Output lengths learned from the streams seen to completion.
    outputs: OutputModel,
    /// The candidates of the power-of-d choices and their drawing weights.
    pool: Pool,
    /// Failed and good polls in a row that eject and readmit a node.
    hysteresis: (u32, u32),
}

/// Most nodes a balancer follows: a cluster listing more is followed up to this many.
pub const MAX_NODES: usize = 4096;

/// What a new member list changed (node indices).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemberChange {
    /// Nodes that joined: new, back, or a slot reused for a new address.
    pub joined: Vec<usize>,
    /// Nodes that left the cluster: never chosen or polled until they are members again.
    pub left: Vec<usize>,
    /// Members not followed because the balancer already follows `MAX_NODES` nodes.
    pub over_limit: usize,
}

fn node_state(n: &NodeConfig, (unhealthy, healthy): (u32, u32)) -> NodeState {
    let state = NodeState::new(&n.address, n.capacity_tokens_per_sec, n.kv_cache_tokens)
        .with_hysteresis(unhealthy, healthy)
        .with_format(n.format);
    match &n.models {
        Some(names) => state.with_models(ServedModels::configured(names.clone())),
        None => state,
    }
}

impl Balancer {
    pub fn new(cfg: &Config) -> Self {
        Balancer {
            nodes: cfg
                .nodes
                .iter()
                .map(|n| {
                    node_state(
                        n,
                        (cfg.unhealthy_after_failures, cfg.healthy_after_successes),
                    )
                })
                .collect(),
            configs: cfg.nodes.clone(),
            listed: cfg.nodes.len(),
            listed_configs: cfg.nodes.clone(),
            defaults: cfg.membership.as_ref().map(|m| m.node_defaults.clone()),
            hysteresis: (cfg.unhealthy_after_failures, cfg.healthy_after_successes),
            params: Params {
                rule: cfg.policy,
                stale_after_ms: cfg.stale_after_ms,
                vram_ceiling: cfg.vram_ceiling,
                kv_bytes_per_token: cfg.kv_bytes_per_token,
                keep: cfg.max_hosts_in_header,
                choices: cfg.choices,
            },
            max_hosts: cfg.max_hosts_in_header,
            hold_kv_ceiling: cfg.hold_kv_ceiling,
            mean_request_tokens: None,
            outputs: OutputModel::default(),
            pool: Pool::default(),
        }
    }

    pub fn nodes(&self) -> &[NodeState] {
        &self.nodes
    }

    /// Node `node`'s settings: where to poll it, its format, its configured figures.
    pub fn node_config(&self, node: usize) -> Option<&NodeConfig> {
        self.configs.get(node)
    }

    /// The members of the Envoy cluster are now `addresses` (see `membership`). A member the
    /// balancer knows keeps its state; a new one takes its settings from `nodes` when listed
    /// there, else from the defaults, and a slot left by a departed node with nothing in
    /// flight is reused before the list grows, so churn (pods replaced under new addresses)
    /// does not grow the state without bound. `busy(i)` says whether departed node `i` still
    /// has requests in flight that this balancer's own books do not show (the poller service
    /// routes nothing itself: the shared books know), so its slot is not reused yet; a
    /// balancer that routes for itself passes `|_| false`. A node that left keeps its books
    /// until its requests end, but it is never chosen, and its report is dropped, so that a
    /// node coming back is trusted only on a new report. Without `membership` configured this
    /// does nothing.
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
            let state = node_state(&config, self.hysteresis);
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
        if !change.joined.is_empty() || !change.left.is_empty() {
            self.pool.invalidate();
        }
        change
    }

    /// A health answer for node `node`: `Some(body)` for an HTTP 200, `None` for a failed or
    /// timed-out call or another status. The body is read in the node's format: the seed JSON
    /// is a report as it stands; an engine's metrics go through the node's tracker, which turns
    /// their counters into a rate. A good report replaces the old one; anything else leaves the
    /// last good report in place (and the tracker's baseline too).
    pub fn on_health(
        &mut self,
        node: usize,
        body: Option<&[u8]>,
        now_ms: u64,
    ) -> Result<Report, HealthError> {
        let stale_after = self.params.stale_after_ms;
        let Some(state) = self.nodes.get_mut(node) else {
            return Err(HealthError::UnknownNode);
        };
        // Only a change of whether the node is a candidate changes the pool; a new report of
        // a candidate is read where it stands when the node is drawn.
        let was_candidate = state.fresh_report(now_ms, stale_after).is_some();
        let result = state.take_health(body, now_ms);
        if state.fresh_report(now_ms, stale_after).is_some() != was_candidate {
            self.pool.invalidate();
        }
        result
    }

    /// A node's `GET /v1/models` answered 200 with `body`: a good list replaces the last one
    /// and its length is returned; a bad one changes nothing. A configured node keeps its
    /// configured set (the glue does not ask those).
    pub fn on_models(&mut self, node: usize, body: &[u8]) -> Result<usize, ListError> {
        let names = models::parse_model_list(body)?;
        let n = names.len();
        if let Some(state) = self.nodes.get_mut(node) {
            state.models_mut().set_list(names);
        }
        Ok(n)
    }

    /// Whether node `node`'s model list is worth asking for (its set is not configured).
    pub fn learns_models(&self, node: usize) -> bool {
        self.nodes
            .get(node)
            .is_some_and(|n| !n.models().is_configured())
    }

    /// Whether every node is known not to serve `model`. Staleness does not enter: a model
    /// served only by a node that is down for now is not unknown, only unavailable.
    pub fn model_unknown(&self, model: &str) -> bool {
        self.nodes
            .iter()
            .all(|n| n.models().serves(model) == Serves::No)
    }

    /// Whether node `node` was ejected or readmitted since this was last asked.
    pub fn take_transition(&mut self, node: usize) -> Option<Transition> {
        self.nodes
            .get_mut(node)
            .and_then(NodeState::take_transition)
    }

    /// What a request is expected to cost: its prompt, and as output the smaller of its cap and
    /// the mean output learned for its prompt's size class (see `output`; clients set caps far
    /// above what models generate: the Azure trace's outputs average a fifth of a typical 1024
    /// cap). Until enough streams have completed, the cap stands: the safe side for the VRAM
    /// guard.
    pub fn expected(&self, weight: Weight) -> Weight {
        match self.outputs.estimate(weight.prompt_tokens) {
            Some(e) => Weight {
                prompt_tokens: weight.prompt_tokens,
                output_tokens: weight.output_tokens.min(e.mean.ceil() as u64),
            },
            None => weight,
        }
    }

    /// KV growth to reserve for a request of `weight` (with its cap): its expected output, and
    /// the pooled margin of `RESERVE_SIGMAS` fleet-wide standard deviations per square root of
    /// the requests in flight (see `choice`); the cap and no margin until outputs are learned.
    pub fn growth(&self, weight: Weight) -> Growth {
        let fleet = self.outputs.fleet();
        Growth {
            own: self.expected(weight).output_tokens,
            margin_per_sqrt: fleet.map_or(0.0, |e| RESERVE_SIGMAS * e.sd),
            per_running: fleet.map_or(0.0, |e| e.mean / 2.0),
        }
    }

    /// A stream whose prompt was estimated at `prompt_tokens` completed normally with
    /// `tokens` output tokens.
    pub fn observe_output(&mut self, prompt_tokens: u64, tokens: u64) {
        self.outputs.observe(prompt_tokens, tokens);
    }

    /// Chooses the nodes for a request and books it as in flight on the first. `weight` is
    /// the request's estimate with its output cap; the books hold its expected cost. `model`,
    /// the body's, keeps the request to the nodes that serve it. With `may_hold`, a request
    /// every node would overflow is not routed: the answer is `Saturated` and the caller holds
    /// it; without, it goes to the node that overflows least. Each weighed node's books are
    /// taken from `books` just before it is weighed (`OwnBooks`: this balancer's own; the
    /// books every worker of the Envoy shares, see `share`): the drawn candidates' only,
    /// unless the draws fail and every candidate is compared.
    pub fn route(
        &mut self,
        weight: Weight,
        model: Option<&str>,
        now_ms: u64,
        rng: &mut dyn Rng,
        may_hold: bool,
        books: &mut dyn BookSource,
    ) -> Outcome {
        let growth = self.growth(weight);
        let weight = self.expected(weight);
        let mean = self.mean_request_tokens.unwrap_or(weight.total() as f64);
        let ask = Ask {
            weight,
            growth,
            model,
        };
        let sampled = if self.params.choices > 0 {
            self.pool
                .refresh(&self.nodes, now_ms, self.params.stale_after_ms);
            candidates::sample(
                &mut self.nodes,
                &self.pool,
                &ask,
                mean,
                now_ms,
                &self.params,
                rng,
                &mut |i, n| load_books(books, i, n),
            )
        } else {
            None
        };
        // A sampled node serves the model, or might: only without one is the model's fate
        // worth a walk over the fleet.
        let (ranked, over_ceiling) = match sampled {
            Some(r) => (r, false),
            None if model.is_some_and(|m| self.model_unknown(m)) => return Outcome::UnknownModel,
            None => {
                // Every candidate is compared, so every candidate's books are read.
                let stale_after_ms = self.params.stale_after_ms;
                for (i, n) in self.nodes.iter_mut().enumerate() {
                    if choice::may_serve(n, model)
                        && n.fresh_report(now_ms, stale_after_ms).is_some()
                    {
                        load_books(books, i, n);
                    }
                }
                match choice::decide(&self.nodes, &ask, mean, now_ms, &self.params, rng) {
                    Decision::Route(r) => (r, false),
                    Decision::AllOverCeiling(r)
                        if may_hold
                            && r.first()
                                .and_then(|x| x.kv_fraction)
                                .is_some_and(|f| f > self.hold_kv_ceiling) =>
                    {
                        return Outcome::Saturated
                    }
                    Decision::AllOverCeiling(r) => (r, true),
                    Decision::NoFreshNodes => return Outcome::NoFreshNodes,
                }
            }
        };
        let Some(first) = ranked.first().copied() else {
            return Outcome::NoFreshNodes;
        };
        let header_value = ranked
            .iter()
            .take(self.max_hosts)
            .filter_map(|r| self.nodes.get(r.node).map(NodeState::address))
            .collect::<Vec<_>>()
            .join(",");
        let Some(state) = self.nodes.get_mut(first.node) else {
            return Outcome::NoFreshNodes;
        };
        let inflight_before = state.books().inflight_requests;
        let ticket = state.dispatch(first.node, weight, growth.own);
        self.mean_request_tokens = Some(mean + MEAN_ALPHA * (weight.total() as f64 - mean));
        Outcome::Routed {
            ticket,
            header_value,
            predicted_seconds: first.seconds,
            over_ceiling,
            inflight_before,
        }
    }

    /// The request's stream has delivered `after` output tokens (it had `before`).
    pub fn progress(&mut self, ticket: &Ticket, before: u64, after: u64) {
        if let Some(state) = self.nodes.get_mut(ticket.node) {
            state.progress(ticket, before, after);
        }
    }

    /// The request's stream ended (completed, failed, reset or timed out) after `received`
    /// output tokens.
    pub fn release(&mut self, ticket: &Ticket, received: u64) {
        if let Some(state) = self.nodes.get_mut(ticket.node) {
            state.release(ticket, received);
        }
    }
}

/// What a fleet snapshot changed (`Balancer::import_fleet`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Nodes whose report is new.
    pub new_reports: usize,
    /// Nodes of this balancer the snapshot does not have (the poller's configuration lists
    /// other nodes): they have no report, so they are not chosen.
    pub missing: usize,
}

/// Sharing the fleet between the VMs of one Envoy (see `shared`): the poller's balancer exports
/// what its health answers taught it; a filter VM's balancer takes that in place of polling,
/// and takes each node's books from the shared ones before deciding.
impl Balancer {
    /// Every node as this balancer sees it, for the snapshot. `epoch_base` is added to each
    /// node's report epoch: the poller's start time in ms, so that the epochs of a restarted
    /// poller are newer than any before (a node takes at most one report a tick, >= 10 ms).
    pub fn fleet_view(&self, epoch_base: u64) -> Vec<NodeView> {
        self.nodes
            .iter()
            .map(|n| NodeView {
                address: n.address().to_string(),
                report: n.report_taken(),
                epoch: epoch_base.saturating_add(n.epoch()),
                ejected: n.ejected(),
                member: n.member(),
                listed_models: n.models().listed().map(<[String]>::to_vec),
                seen_models: n.models().seen().to_vec(),
            })
            .collect()
    }

    /// Takes every node's report, epoch, health and models from `snapshot`, matched by
    /// address. A configured model set stays (it is this balancer's configuration). The books
    /// are not touched (see `set_books`).
    pub fn import_fleet(&mut self, snapshot: &Snapshot) -> Imported {
        let by_address: std::collections::HashMap<&str, &NodeView> = snapshot
            .nodes
            .iter()
            .map(|v| (v.address.as_str(), v))
            .collect();
        let mut imported = Imported::default();
        for n in &mut self.nodes {
            let Some(v) = by_address.get(n.address()) else {
                imported.missing += 1;
                let epoch = n.epoch();
                n.adopt_report(None, epoch);
                continue;
            };
            if v.report.is_some() && (v.epoch != n.epoch() || n.report_taken() != v.report) {
                imported.new_reports += 1;
            }
            n.adopt_report(v.report, v.epoch);
            n.adopt_status(v.ejected, v.member);
            if !n.models().is_configured() {
                let mut models = ServedModels::default();
                if let Some(list) = &v.listed_models {
                    models.set_list(list.clone());
                }
                models.observe_metrics(&v.seen_models);
                *n.models_mut() = models;
            }
        }
        self.pool.invalidate();
        imported
    }

    /// A filter VM following a cluster with `poller: singleton` takes the poller's node slots
    /// as its own: its node `i` is the snapshot's node `i`, so a node's books key (per slot,
    /// see `shared::books_key`) is the same in every VM, and the VM follows the members the
    /// poller follows without asking Envoy's admin itself. A slot now holding another address
    /// starts afresh with that address's settings (from `nodes` when listed there, else the
    /// defaults); `import_fleet` then brings the reports. Returns what changed, as
    /// `set_members` does. Without `membership` configured this does nothing: the nodes are
    /// the configured ones, matched to the snapshot by address.
    pub fn mirror_fleet(&mut self, snapshot: &Snapshot) -> MemberChange {
        let mut change = MemberChange::default();
        let Some(defaults) = self.defaults.clone() else {
            return change;
        };
        for (i, v) in snapshot.nodes.iter().enumerate() {
            if i >= MAX_NODES {
                change.over_limit += 1;
                continue;
            }
            if let Some(n) = self.nodes.get_mut(i).filter(|n| n.address() == v.address) {
                if n.member() != v.member {
                    n.set_member(v.member);
                    if v.member {
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
                .find(|c| c.address == v.address)
                .cloned()
                .unwrap_or_else(|| NodeConfig {
                    address: v.address.clone(),
                    ..defaults.clone()
                });
            let state = node_state(&config, self.hysteresis).with_member(v.member);
            match (self.nodes.get_mut(i), self.configs.get_mut(i)) {
                (Some(n), Some(c)) => {
                    if n.member() && !v.member {
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
            if v.member {
                change.joined.push(i);
            }
        }
        // Slots past the snapshot's (a poller restarted with fewer) are out of the cluster.
        for i in snapshot.nodes.len()..self.nodes.len() {
            if let Some(n) = self.nodes.get_mut(i).filter(|n| n.member()) {
                n.set_member(false);
                change.left.push(i);
            }
        }
        if !change.joined.is_empty() || !change.left.is_empty() {
            self.pool.invalidate();
        }
        change
    }

    /// Node `node`'s books as this balancer holds them.
    pub fn books(&self, node: usize) -> Option<Books> {
        self.nodes.get(node).map(|n| *n.books())
    }

    /// Replaces node `node`'s books (the shared ones, under the epoch rule): the next
    /// decision and dispatch start from them, and a ticket takes their epoch.
    pub fn set_books(&mut self, node: usize, b: &Books) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.set_books(b);
        }
    }
}

/// Where a decision takes a node's books from just before it weighs the node
/// (`Balancer::route`).
pub trait BookSource {
    /// Node `node`'s current books, read under the epoch rule for `report_epoch` (the node's
    /// report epoch as this balancer knows it); `None` keeps the balancer's own.
    fn books(&mut self, node: usize, report_epoch: u64) -> Option<Books>;
}

/// The balancer's own books are the current ones: it is the only one dispatching.
pub struct OwnBooks;

impl BookSource for OwnBooks {
    fn books(&mut self, _node: usize, _report_epoch: u64) -> Option<Books> {
        None
    }
}

fn load_books(source: &mut dyn BookSource, node: usize, n: &mut NodeState) {
    if let Some(b) = source.books(node, n.epoch()) {
        n.set_books(&b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::engine::{self, FormatError};
    use crate::rng::SplitMix64;

    fn cfg(n: usize, extra: &str) -> Config {
        let nodes: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"address":"127.0.0.1:{}"}}"#, 8001 + i))
            .collect();
        Config::parse(
            format!(
                r#"{{"nodes":[{}],"health_cluster":"h"{extra}}}"#,
                nodes.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    const W: Weight = Weight {
        prompt_tokens: 100,
        output_tokens: 100,
    };

    #[test]
    fn header_lists_the_ranking_up_to_the_limit() {
        let mut b = Balancer::new(&cfg(4, r#","max_hosts_in_header":3,"choices":0"#));
        for (i, load) in [400, 100, 300, 200].iter().enumerate() {
            let body =
                format!(r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000}}"#);
            b.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        match b.route(W, None, 10, &mut SplitMix64::new(1), false, &mut OwnBooks) {
            Outcome::Routed {
                header_value,
                ticket,
                over_ceiling,
                ..
            } => {
                assert_eq!(header_value, "127.0.0.1:8002,127.0.0.1:8004,127.0.0.1:8003");
                assert_eq!(ticket.node, 1);
                assert!(!over_ceiling);
            }
            o => panic!("{o:?}"),
        }
        assert_eq!(b.nodes()[1].books().inflight_requests, 1);
    }

    /// Books from elsewhere: every node but `light` carries a large unreflected backlog; the
    /// nodes asked are recorded.
    struct Recording {
        asked: Vec<usize>,
        light: usize,
    }

    impl BookSource for Recording {
        fn books(&mut self, node: usize, report_epoch: u64) -> Option<Books> {
            self.asked.push(node);
            let backlog = if node == self.light { 0 } else { 1_000_000 };
            Some(Books {
                epoch: report_epoch,
                unreflected_tokens: backlog,
                unreflected_requests: u64::from(backlog > 0),
                ..Books::default()
            })
        }
    }

    fn idle_fleet(n: usize, extra: &str) -> Balancer {
        let mut b = Balancer::new(&cfg(n, extra));
        for i in 0..n {
            let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000}"#;
            b.on_health(i, Some(body), 0).unwrap();
        }
        b
    }

    #[test]
    fn a_decision_reads_the_books_of_the_nodes_it_weighs_only() {
        // Two choices over 1,000 nodes: a handful of books read per decision, and the choice
        // goes by them (a drawn node without backlog beats a drawn one with).
        let mut b = idle_fleet(1000, r#","max_hosts_in_header":3"#);
        let mut rng = SplitMix64::new(7);
        let mut light_drawn = 0;
        for round in 0..200 {
            let mut books = Recording {
                asked: vec![],
                light: round * 5,
            };
            let first = match b.route(W, None, 10, &mut rng, false, &mut books) {
                Outcome::Routed { ticket, .. } => ticket.node,
                o => panic!("{o:?}"),
            };
            // The two compared; more only when a drawn node had no room.
            assert_eq!(books.asked.len(), 2, "{:?}", books.asked);
            assert!(books.asked.contains(&first));
            // The two compared are the first two drawn.
            if books.asked[..2].contains(&books.light) {
                light_drawn += 1;
                assert_eq!(first, books.light);
            }
        }
        assert!(
            light_drawn > 0,
            "the light node was never among the first two drawn"
        );

        // Every node compared (choices: 0): every candidate's books are read.
        let mut b = idle_fleet(10, r#","choices":0"#);
        let mut books = Recording {
            asked: vec![],
            light: 6,
        };
        match b.route(W, None, 10, &mut rng, false, &mut books) {
            Outcome::Routed { ticket, .. } => assert_eq!(ticket.node, 6),
            o => panic!("{o:?}"),
        }
        books.asked.sort_unstable();
        assert_eq!(books.asked, (0..10).collect::<Vec<_>>());
    }

    /// Books replaced by shared figures at the top of the range (any VM may have written
    /// them): weighing the node, booking on it and releasing saturate, never wrap.
    #[test]
    fn shared_books_at_the_top_of_the_range_saturate() {
        let mut b = idle_fleet(1, "");
        let full = Books {
            epoch: b.nodes()[0].epoch(),
            tenant: b.nodes()[0].tenant(),
            inflight_requests: u64::MAX,
            inflight_tokens: u64::MAX,
            unreflected_tokens: u64::MAX,
            unreflected_requests: u64::MAX,
            unreflected_prompt_tokens: u64::MAX,
            growth_tokens: u64::MAX,
        };
        b.set_books(0, &full);
        let Outcome::Routed { ticket, .. } =
            b.route(W, None, 10, &mut SplitMix64::new(1), false, &mut OwnBooks)
        else {
            panic!("not routed")
        };
        assert_eq!(b.books(0), Some(full));
        b.progress(&ticket, 0, 10);
        b.release(&ticket, 10);
        assert_eq!(b.books(0).map(|x| x.inflight_requests), Some(u64::MAX - 1));
    }

    #[test]
    fn failed_or_garbage_polls_keep_the_last_good_report() {
        // Three failures to eject: two failed polls keep the last good report in use.
        let mut b = Balancer::new(&cfg(1, r#","unhealthy_after_failures":3"#));
        assert_eq!(
            b.route(W, None, 0, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        b.on_health(0, Some(br#"{"tokens_per_sec_load":5}"#), 0)
            .unwrap();
        assert_eq!(b.on_health(0, None, 100), Err(HealthError::CallFailed));
        assert_eq!(
            b.on_health(0, Some(b"<html>"), 200),
            Err(HealthError::Unparsable(FormatError::NotMetrics {
                skipped_lines: 1
            }))
        );
        assert_eq!(b.on_health(7, None, 200), Err(HealthError::UnknownNode));
        assert_eq!(b.nodes()[0].failures_in_row(), 2);
        assert!(matches!(
            b.route(W, None, 3000, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::Routed { .. }
        ));
        // The good report is now stale, and nothing replaced it.
        assert_eq!(
            b.route(W, None, 3001, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        assert_eq!(b.take_transition(0), None);
        // The third failure in a row takes the node out of the choice at once.
        assert_eq!(b.on_health(0, None, 300), Err(HealthError::CallFailed));
        assert_eq!(b.take_transition(0), Some(Transition::Ejected));
        assert_eq!(b.take_transition(0), None);
        b.on_health(0, Some(br#"{"tokens_per_sec_load":5}"#), 400)
            .unwrap();
        assert_eq!(
            b.route(W, None, 400, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::NoFreshNodes,
            "one good poll is not enough to come back"
        );
        b.on_health(0, Some(br#"{"tokens_per_sec_load":5}"#), 500)
            .unwrap();
        assert_eq!(b.take_transition(0), Some(Transition::Readmitted));
        assert!(matches!(
            b.route(W, None, 500, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::Routed { .. }
        ));
    }

    #[test]
    fn release_returns_inflight_to_zero() {
        let mut b = Balancer::new(&cfg(2, ""));
        for i in 0..2 {
            b.on_health(i, Some(br#"{"tokens_per_sec_load":0}"#), 0)
                .unwrap();
        }
        let mut rng = SplitMix64::new(3);
        let tickets: Vec<Ticket> = (0..10)
            .filter_map(
                |_| match b.route(W, None, 1, &mut rng, false, &mut OwnBooks) {
                    Outcome::Routed { ticket, .. } => Some(ticket),
                    _ => None,
                },
            )
            .collect();
        assert_eq!(tickets.len(), 10);
        let total: u64 = b.nodes().iter().map(|n| n.books().inflight_requests).sum();
        assert_eq!(total, 10);
        // A report arrives half way; releases still balance.
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0}"#), 2)
            .unwrap();
        for t in &tickets {
            b.release(t, 0);
        }
        for n in b.nodes() {
            assert_eq!(
                (
                    n.books().inflight_requests,
                    n.books().inflight_tokens,
                    n.books().unreflected_tokens
                ),
                (0, 0, 0)
            );
        }
    }

    #[test]
    fn learned_output_length_replaces_the_cap_once_enough_streams_completed() {
        let mut b = Balancer::new(&cfg(1, ""));
        let capped = Weight {
            prompt_tokens: 10,
            output_tokens: 1024,
        };
        for i in 0..crate::route::outputs::MIN_SAMPLES {
            assert_eq!(
                b.expected(capped),
                capped,
                "after {i} samples the cap stands"
            );
            b.observe_output(10, if i % 2 == 0 { 100 } else { 300 });
        }
        assert_eq!(b.expected(capped).output_tokens, 200);
        // Outputs of 100 and 300: each request books the mean, 200, and the node's pooled
        // margin is 2 sd = 200 per square root of its requests in flight.
        let g = b.growth(capped);
        assert_eq!(g.own, 200);
        assert!((g.margin_per_sqrt - 200.0).abs() < 1e-6, "{g:?}");
        assert_eq!(
            b.growth(Weight {
                prompt_tokens: 10,
                output_tokens: 150
            })
            .own,
            150
        );
        // Never above the request's own cap.
        let small = Weight {
            prompt_tokens: 10,
            output_tokens: 50,
        };
        assert_eq!(b.expected(small), small);
        // Routing books the expected cost, and progress plus release return it all.
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0}"#), 0)
            .unwrap();
        let Outcome::Routed { ticket, .. } = b.route(
            capped,
            None,
            1,
            &mut SplitMix64::new(1),
            false,
            &mut OwnBooks,
        ) else {
            panic!("not routed")
        };
        assert_eq!(ticket.weight.output_tokens, 200);
        assert_eq!(b.nodes()[0].books().growth_tokens, 200);
        b.progress(&ticket, 0, 150);
        assert_eq!(b.nodes()[0].books().growth_tokens, 50);
        b.release(&ticket, 150);
        assert_eq!(
            (
                b.nodes()[0].books().growth_tokens,
                b.nodes()[0].books().inflight_tokens
            ),
            (0, 0)
        );
    }

    const VLLM_V1: &str = include_str!("../../tests/data/metrics/vllm_v1.prom");

    fn engine_cfg(nodes: &[&str]) -> Config {
        let nodes: Vec<String> = nodes
            .iter()
            .enumerate()
            .map(|(i, extra)| format!(r#"{{"address":"127.0.0.1:{}"{extra}}}"#, 8001 + i))
            .collect();
        Config::parse(
            // Every node compared: these tests are about what the ranking knows, not sampling.
            format!(
                r#"{{"nodes":[{}],"health_cluster":"h","choices":0}}"#,
                nodes.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    /// The vLLM fixture with its token counters moved on by `prompt` and `generation`.
    fn vllm_later(prompt: u64, generation: u64) -> String {
        let labels = r#"{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}"#;
        VLLM_V1
            .replace(
                &format!("vllm:prompt_tokens_total{labels} 1234567.0"),
                &format!("vllm:prompt_tokens_total{labels} {}", 1234567 + prompt),
            )
            .replace(
                &format!("vllm:generation_tokens_total{labels} 456789.0"),
                &format!(
                    "vllm:generation_tokens_total{labels} {}",
                    456789 + generation
                ),
            )
    }

    #[test]
    fn engine_metrics_become_reports_with_a_rate() {
        let mut b = Balancer::new(&engine_cfg(&[r#","format":"vllm""#]));
        let first = b.on_health(0, Some(VLLM_V1.as_bytes()), 0).unwrap();
        assert_eq!(
            first,
            Report {
                load_tokens_per_sec: 0.0,
                capacity_tokens_per_sec: None,
                vram_used_bytes: None,
                vram_total_bytes: None,
                kv_cache_usage: Some(0.4375),
                kv_cache_tokens: Some(131072.0),
                queue_depth: Some(3.0),
                running_requests: Some(14.0),
            },
            "the first poll: gauges, no rate yet"
        );
        let second = b
            .on_health(0, Some(vllm_later(3000, 1000).as_bytes()), 2000)
            .unwrap();
        assert_eq!(second.load_tokens_per_sec, 2000.0);
        assert_eq!(second.capacity_tokens_per_sec, Some(2000.0));
        assert_eq!(b.nodes()[0].reported_at(), Some(2000));
        // A failed poll leaves the report and the baseline alone.
        assert!(b.on_health(0, Some(b"<html>"), 2500).is_err());
        let third = b
            .on_health(0, Some(vllm_later(4000, 2000).as_bytes()), 3000)
            .unwrap();
        assert_eq!(third.load_tokens_per_sec, 2000.0);
        // The engine restarted: counters from zero, no rate for that interval.
        let restarted = VLLM_V1
            .replace("} 1234567.0", "} 10.0")
            .replace("} 456789.0", "} 5.0");
        let r = b.on_health(0, Some(restarted.as_bytes()), 4000).unwrap();
        assert_eq!(r.load_tokens_per_sec, 0.0);
        assert_eq!(r.queue_depth, Some(3.0));
    }

    #[test]
    fn each_node_is_read_in_its_own_format() {
        let mut b = Balancer::new(&engine_cfg(&[
            "",
            r#","format":"seed""#,
            r#","format":"vllm""#,
            r#","format":"sglang","capacity_tokens_per_sec":900"#,
        ]));
        let seed = br#"{"tokens_per_sec_load": 7}"#;
        assert_eq!(
            b.on_health(0, Some(seed), 0).unwrap().load_tokens_per_sec,
            7.0
        );
        assert_eq!(
            b.on_health(0, Some(VLLM_V1.as_bytes()), 0)
                .unwrap()
                .queue_depth,
            Some(3.0)
        );
        assert_eq!(
            b.on_health(1, Some(VLLM_V1.as_bytes()), 0),
            Err(HealthError::Unparsable(FormatError::Seed(
                crate::ingest::telemetry::ReportError::NotJson
            )))
        );
        assert_eq!(
            b.on_health(2, Some(seed), 0),
            Err(HealthError::Unparsable(FormatError::JsonNotMetrics(
                engine::Engine::Vllm
            )))
        );
        assert!(matches!(
            b.on_health(3, Some(VLLM_V1.as_bytes()), 0),
            Err(HealthError::Unparsable(FormatError::NothingUsable { .. }))
        ));
        let sglang = include_bytes!("../../tests/data/metrics/sglang.prom");
        let r = b.on_health(3, Some(sglang), 0).unwrap();
        assert_eq!(r.capacity_tokens_per_sec, None, "nothing learned yet");
        assert_eq!(b.nodes()[3].capacity(&r, 1.0), 900.0, "configured capacity");
        assert_eq!(b.nodes()[1].failures_in_row(), 1);
        assert_eq!(b.nodes()[3].failures_in_row(), 0);
    }

    #[test]
    fn engine_reports_steer_requests() {
        let mut b = Balancer::new(&engine_cfg(&[r#","format":"vllm""#, r#","format":"vllm""#]));
        // Node 0 has a long queue; node 1 the same engine, idle. First polls only: no rates
        // yet, but the queue alone already sends the request to node 1.
        let busy = VLLM_V1.replace(
            r#"vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0"#,
            r#"vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 60.0"#,
        );
        let idle = VLLM_V1.replace(
            r#"vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0"#,
            r#"vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0"#,
        );
        b.on_health(0, Some(busy.as_bytes()), 0).unwrap();
        b.on_health(1, Some(idle.as_bytes()), 0).unwrap();
        match b.route(W, None, 10, &mut SplitMix64::new(1), false, &mut OwnBooks) {
            Outcome::Routed { ticket, .. } => assert_eq!(ticket.node, 1),
            o => panic!("{o:?}"),
        }
        // A cache that the request would overflow excludes the node, sized by the geometry.
        let full = idle.replace(
            r#"vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4375"#,
            r#"vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.8999"#,
        );
        b.on_health(1, Some(full.as_bytes()), 1000).unwrap();
        let big = Weight {
            prompt_tokens: 2000,
            output_tokens: 100,
        };
        match b.route(
            big,
            None,
            1010,
            &mut SplitMix64::new(1),
            false,
            &mut OwnBooks,
        ) {
            Outcome::Routed { ticket, .. } => assert_eq!(ticket.node, 0),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn all_over_ceiling_still_routes_and_says_so() {
        let mut b = Balancer::new(&cfg(2, r#","kv_bytes_per_token":1"#));
        for i in 0..2 {
            b.on_health(
                i,
                Some(br#"{"tokens_per_sec_load":0,"vram_used_bytes":950,"vram_total_bytes":1000}"#),
                0,
            )
            .unwrap();
        }
        assert!(matches!(
            b.route(W, None, 1, &mut SplitMix64::new(1), false, &mut OwnBooks),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
    }

    fn routed_to(o: &Outcome) -> Option<usize> {
        match o {
            Outcome::Routed { ticket, .. } => Some(ticket.node),
            _ => None,
        }
    }

    /// Node 0 configured for m1, node 1 learns m2 and an adapter from its list, node 2 has no
    /// list; then node 2 learns one, and a bad answer changes nothing.
    #[test]
    fn models_narrow_the_route_and_unknown_models_are_told_apart() {
        let mut b = Balancer::new(&engine_cfg(&[r#","models":["m1"]"#, "", ""]));
        let mut rng = SplitMix64::new(11);
        // Loads 100, 200, 300: with no restriction node 0 would win.
        let load = |b: &mut Balancer, now: u64| {
            for i in 0..3 {
                let body = format!(
                    r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":1000}}"#,
                    100 * (i + 1)
                );
                b.on_health(i, Some(body.as_bytes()), now).unwrap();
            }
        };
        load(&mut b, 0);
        assert!(!b.learns_models(0) && b.learns_models(1) && !b.learns_models(7));
        assert_eq!(b.on_models(0, br#"{"data":[{"id":"m9"}]}"#), Ok(1));
        assert_eq!(
            b.nodes()[0].models().serves("m9"),
            Serves::No,
            "configured wins"
        );
        assert_eq!(
            b.on_models(
                1,
                br#"{"data":[{"id":"m2"},{"id":"sql-lora","parent":"m2"}]}"#
            ),
            Ok(2)
        );
        // (model, the node it goes to) while node 2's set is unknown: node 2, the most loaded,
        // only takes what no known node serves.
        let cases: &[(Option<&str>, usize)] = &[
            (None, 0),
            (Some("m1"), 0),
            (Some("m2"), 1),
            (Some("sql-lora"), 1),
            (Some("m3"), 2),
        ];
        for (model, want) in cases {
            let o = b.route(W, *model, 10, &mut rng, false, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(*want), "{model:?}: {o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // Node 2's list says m3: a model nobody serves is now unknown, with or without holding.
        assert_eq!(b.on_models(2, br#"{"data":[{"id":"m3"}]}"#), Ok(1));
        assert!(b.model_unknown("m4") && !b.model_unknown("m3"));
        assert_eq!(
            b.route(W, Some("m4"), 10, &mut rng, true, &mut OwnBooks),
            Outcome::UnknownModel
        );
        assert_eq!(
            routed_to(&b.route(W, Some("m3"), 10, &mut rng, false, &mut OwnBooks)),
            Some(2)
        );
        // Bad answers keep the last good list.
        for bad in [
            &b"<html>"[..],
            br#"{"data":[]}"#,
            br#"{"tokens_per_sec_load":1}"#,
        ] {
            assert!(b.on_models(2, bad).is_err());
        }
        assert_eq!(
            b.nodes()[2].models().listed(),
            Some(&["m3".to_string()][..])
        );
        // A known model whose nodes are all stale is no unknown model: Envoy routes it.
        assert_eq!(
            b.route(W, Some("m3"), 10_000, &mut rng, false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        // Nor is one whose only node has never reported, while another node is fresh.
        let mut e = Balancer::new(&engine_cfg(&[r#","models":["m1"]"#, r#","models":["m2"]"#]));
        e.on_health(1, Some(br#"{"tokens_per_sec_load":1}"#), 0)
            .unwrap();
        assert_eq!(
            e.route(W, Some("m1"), 10, &mut rng, false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        assert_eq!(
            routed_to(&e.route(W, Some("m2"), 10, &mut rng, false, &mut OwnBooks)),
            Some(1)
        );
        assert_eq!(
            e.route(W, Some("m3"), 10, &mut rng, false, &mut OwnBooks),
            Outcome::UnknownModel
        );
    }

    /// vLLM's metrics add what a list taken earlier does not show yet: an adapter loaded at
    /// runtime, running now.
    #[test]
    fn an_adapter_seen_in_the_metrics_is_routed_to_its_node() {
        let mut b = Balancer::new(&engine_cfg(&[r#","format":"vllm""#, r#","format":"vllm""#]));
        let mut rng = SplitMix64::new(12);
        for i in 0..2 {
            b.on_models(
                i,
                br#"{"data":[{"id":"meta-llama/Llama-3.1-8B-Instruct"}]}"#,
            )
            .unwrap();
        }
        let with_lora = format!(
            "{VLLM_V1}vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"hot-lora\",waiting_lora_adapters=\"\"}} 1.7e9\n"
        );
        b.on_health(0, Some(VLLM_V1.as_bytes()), 0).unwrap();
        b.on_health(1, Some(with_lora.as_bytes()), 0).unwrap();
        assert_eq!(b.nodes()[1].models().seen(), ["hot-lora"]);
        for _ in 0..5 {
            let o = b.route(W, Some("hot-lora"), 10, &mut rng, false, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(1), "{o:?}");
        }
        // The next list is complete as of its time: without the adapter, it is unknown.
        b.on_models(
            1,
            br#"{"data":[{"id":"meta-llama/Llama-3.1-8B-Instruct"}]}"#,
        )
        .unwrap();
        assert_eq!(
            b.route(W, Some("hot-lora"), 10, &mut rng, false, &mut OwnBooks),
            Outcome::UnknownModel
        );
    }

    /// `n` nodes of capacity 1000 at load `load(i)`, reported at 0.
    fn sampled_fleet(n: usize, extra: &str, load: impl Fn(usize) -> u32) -> Balancer {
        let mut b = Balancer::new(&cfg(n, extra));
        for i in 0..n {
            let body = format!(
                r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":1000}}"#,
                load(i)
            );
            b.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        b
    }

    /// Sixteen routers (replicas) hold the same reports: one node idle, 99 half loaded. Each
    /// sends one request before the next report. Comparing every node sends all sixteen to the
    /// idle one (herding); two choices spread them.
    #[test]
    fn two_choices_do_not_herd_on_the_same_stale_reports() {
        let idle = |i: usize| if i == 42 { 0 } else { 500 };
        let cases: &[(&str, usize, usize)] = &[
            // (config, fewest and most requests the idle node gets out of 16)
            (r#","choices":0"#, 16, 16),
            (r#","choices":2"#, 0, 3),
        ];
        for (extra, low, high) in cases {
            let mut at_idle = 0;
            for replica in 0..16u64 {
                let mut b = sampled_fleet(100, extra, idle);
                let o = b.route(
                    W,
                    None,
                    10,
                    &mut SplitMix64::new(replica),
                    false,
                    &mut OwnBooks,
                );
                at_idle += usize::from(routed_to(&o) == Some(42));
            }
            assert!(
                (*low..=*high).contains(&at_idle),
                "{extra}: {at_idle} of 16 at the idle node"
            );
        }
    }

    /// The drawn nodes are compared: with two choices a request never goes to the more
    /// loaded of its two candidates, so the most loaded nodes get the least.
    #[test]
    fn two_choices_prefer_the_less_loaded() {
        let mut b = sampled_fleet(10, r#","choices":2"#, |i| 100 * i as u32);
        let mut rng = SplitMix64::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..2000 {
            let o = b.route(W, None, 10, &mut rng, false, &mut OwnBooks);
            if let Outcome::Routed { ticket, .. } = o {
                counts[ticket.node] += 1;
                b.release(&ticket, 0);
            }
        }
        // Two distinct nodes drawn uniformly, the less loaded kept: node i wins the pairs with a
        // more loaded node, with probability (n-1-i) / (n(n-1)/2); the most loaded never wins.
        for (i, c) in counts.iter().enumerate() {
            let want = 2000.0 * (9 - i) as f64 / 45.0;
            assert!(
                (*c as f64 - want).abs() < 0.25 * want + 10.0,
                "node {i}: {c}, want about {want}: {counts:?}"
            );
        }
    }

    /// Drawing never bends the rules of the full comparison: no stale or ejected node, no node
    /// that would pass the ceiling, no node that does not serve the model, and a saturated
    /// fleet is still told apart (held) rather than routed by luck of the draw.
    #[test]
    fn two_choices_keep_the_rules() {
        let mut b = Balancer::new(&cfg(
            20,
            r#","choices":2,"kv_bytes_per_token":1,"max_hold_ms":1000"#,
        ));
        let full = br#"{"tokens_per_sec_load":0,"vram_used_bytes":990,"vram_total_bytes":1000}"#;
        let room = br#"{"tokens_per_sec_load":900,"tokens_per_sec_capacity":1000,"vram_used_bytes":0,"vram_total_bytes":100000}"#;
        for i in 0..20 {
            b.on_health(i, Some(&full[..]), 0).unwrap();
        }
        let mut rng = SplitMix64::new(5);
        assert_eq!(
            b.route(W, None, 10, &mut rng, true, &mut OwnBooks),
            Outcome::Saturated
        );
        // Only node 7 has room, and node 3 has room but stops answering (ejected).
        b.on_health(7, Some(&room[..]), 20).unwrap();
        b.on_health(3, Some(&room[..]), 20).unwrap();
        b.on_health(3, None, 30).unwrap_err();
        b.on_health(3, None, 40).unwrap_err();
        for _ in 0..50 {
            let o = b.route(W, None, 50, &mut rng, true, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(7), "{o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // Later every report but node 7's (taken at 20) is stale: only node 7 is drawn.
        let late = 20 + b.params.stale_after_ms;
        for _ in 0..20 {
            let o = b.route(W, None, late, &mut rng, false, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(7), "{o:?}");
        }
    }

    #[test]
    fn two_choices_respect_the_model() {
        let nodes: Vec<String> = (0..30)
            .map(|i| {
                let model = if i % 10 == 4 { "rare" } else { "common" };
                format!(
                    r#"{{"address":"127.0.0.1:{}","models":["{model}"]}}"#,
                    9000 + i
                )
            })
            .collect();
        let cfg = Config::parse(
            format!(r#"{{"nodes":[{}],"health_cluster":"h"}}"#, nodes.join(",")).as_bytes(),
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        for i in 0..30 {
            b.on_health(i, Some(br#"{"tokens_per_sec_load":1}"#), 0)
                .unwrap();
        }
        let mut rng = SplitMix64::new(9);
        for _ in 0..200 {
            let o = b.route(W, Some("rare"), 10, &mut rng, false, &mut OwnBooks);
            let node = routed_to(&o).unwrap();
            assert_eq!(node % 10, 4, "{o:?}");
            let o = b.route(W, Some("common"), 10, &mut rng, false, &mut OwnBooks);
            assert_ne!(routed_to(&o).unwrap() % 10, 4, "{o:?}");
        }
        assert_eq!(
            b.route(W, Some("none"), 10, &mut rng, false, &mut OwnBooks),
            Outcome::UnknownModel
        );
    }

    pub(super) fn members(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    pub(super) fn following(extra: &str) -> Balancer {
        Balancer::new(
            &Config::parse(
                format!(
                    r#"{{"health_cluster":"h","choices":0,"membership":{{"cluster":"c",
                       "admin_cluster":"a","node_defaults":{{"kv_cache_tokens":777}}}}{extra}}}"#
                )
                .as_bytes(),
            )
            .unwrap(),
        )
    }

    pub(super) const IDLE: &[u8] = br#"{"tokens_per_sec_load":1,"tokens_per_sec_capacity":1000}"#;

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
            let o = b.route(W, None, 10, &mut rng, false, &mut OwnBooks);
            assert!(matches!(routed_to(&o), Some(1 | 2)), "{o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // It joins and takes its listed settings; node 2 leaves with a request in flight.
        let on_2 = loop {
            if let Outcome::Routed { ticket, .. } =
                b.route(W, None, 10, &mut rng, false, &mut OwnBooks)
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
            let o = b.route(W, None, 30, &mut rng, false, &mut OwnBooks);
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
            b.route(W, None, 40, &mut rng, false, &mut OwnBooks),
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

#[cfg(test)]
mod shared_tests {
    use super::tests::{following, members, IDLE};
    use super::*;
    use crate::rng::SplitMix64;

    fn cfg(ports: &[u16]) -> Config {
        let nodes: Vec<String> = ports
            .iter()
            .map(|p| format!(r#"{{"address":"127.0.0.1:{p}"}}"#))
            .collect();
        Config::parse(
            format!(
                r#"{{"nodes":[{}],"health_cluster":"h","choices":0}}"#,
                nodes.join(",")
            )
            .as_bytes(),
        )
        .unwrap()
    }

    const W: Weight = Weight {
        prompt_tokens: 100,
        output_tokens: 100,
    };

    fn routed(o: &Outcome) -> Option<Ticket> {
        match o {
            Outcome::Routed { ticket, .. } => Some(*ticket),
            _ => None,
        }
    }

    /// The poller's view goes through the snapshot's bytes into a balancer that never polls,
    /// which then decides as the poller would; the shared books then steer it.
    #[test]
    fn a_reader_decides_from_the_poller_snapshot_and_the_shared_books() {
        let mut poller = Balancer::new(&cfg(&[8001, 8002, 8003]));
        for (i, load) in [300, 100, 200].iter().enumerate() {
            let body =
                format!(r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000}}"#);
            poller.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        poller.on_models(2, br#"{"data":[{"id":"m2"}]}"#).unwrap();
        let base = 1_000_000;
        let snap = Snapshot {
            nodes: poller.fleet_view(base),
        };
        let snap = Snapshot::decode(&snap.encode()).unwrap();
        let mut reader = Balancer::new(&cfg(&[8001, 8002, 8003]));
        let mut rng = SplitMix64::new(1);
        assert_eq!(
            reader.route(W, None, 10, &mut rng, false, &mut OwnBooks),
            Outcome::NoFreshNodes
        );
        assert_eq!(
            reader.import_fleet(&snap),
            Imported {
                new_reports: 3,
                missing: 0
            }
        );
        assert_eq!(reader.import_fleet(&snap).new_reports, 0, "nothing new");
        let t = routed(&reader.route(W, None, 10, &mut rng, false, &mut OwnBooks)).unwrap();
        assert_eq!((t.node, t.epoch), (1, base + 1));
        assert_eq!(
            routed(&reader.route(W, Some("m2"), 10, &mut rng, false, &mut OwnBooks))
                .map(|t| t.node),
            Some(2),
            "models come with the snapshot"
        );
        // Other workers have sent node 1 a lot since its report: the shared books say so.
        let mut books = reader.books(1).unwrap();
        assert_eq!(books.inflight_requests, 1);
        books.unreflected_tokens = 1_000_000;
        reader.set_books(1, &books);
        let t = routed(&reader.route(W, None, 10, &mut rng, false, &mut OwnBooks)).unwrap();
        assert_ne!(t.node, 1);
        // An ejection reaches the reader; a node the poller does not follow has no report.
        poller.on_health(2, None, 20).unwrap_err();
        poller.on_health(2, None, 30).unwrap_err();
        let snap = Snapshot {
            nodes: poller.fleet_view(base),
        };
        let mut other = Balancer::new(&cfg(&[8001, 8002, 8003, 8009]));
        assert_eq!(other.import_fleet(&snap).missing, 1);
        reader.import_fleet(&snap);
        for _ in 0..10 {
            let o = reader.route(W, None, 40, &mut rng, false, &mut OwnBooks);
            assert_ne!(routed(&o).map(|t| t.node), Some(2), "{o:?}");
        }
        // Books at a newer epoch than the snapshot's keep theirs (a ticket takes it).
        let mut b = reader.books(0).unwrap();
        b.epoch = base + 50;
        reader.set_books(0, &b);
        assert_eq!(reader.books(0).unwrap().epoch, base + 50);
    }

    /// With `membership`, a reader follows the poller's slots: its node `i` is the snapshot's
    /// node `i`, a slot the poller reused starts afresh with the new address's settings, and
    /// a release booked for the slot's former address does not touch the new one.
    #[test]
    fn a_reader_following_a_cluster_mirrors_the_pollers_slots() {
        let listed = r#","nodes":[{"address":"10.0.0.9:80","kv_cache_tokens":5}]"#;
        let mut poller = following(listed);
        let mut reader = following(listed);
        let mut rng = SplitMix64::new(3);
        let snap = |p: &Balancer| Snapshot {
            nodes: p.fleet_view(1_000),
        };
        poller.set_members(&members(&["10.0.0.1:80", "10.0.0.2:80"]), |_| false);
        for i in 0..3 {
            poller.on_health(i, Some(IDLE), 0).unwrap();
        }
        let c = reader.mirror_fleet(&snap(&poller));
        assert_eq!((c.joined, c.left), (vec![1, 2], vec![0]));
        assert_eq!(reader.import_fleet(&snap(&poller)).missing, 0);
        let addresses = |b: &Balancer| -> Vec<String> {
            b.nodes().iter().map(|n| n.address().to_string()).collect()
        };
        assert_eq!(addresses(&reader), addresses(&poller));
        assert_eq!(reader.node_config(1).unwrap().kv_cache_tokens, Some(777));
        assert_eq!(reader.mirror_fleet(&snap(&poller)), MemberChange::default());
        // The reader routes a request to node 2, then the poller reuses node 2's slot (its
        // shared books are empty: the busy check says so) for a new address.
        let on_2 = loop {
            let t = routed(&reader.route(W, None, 10, &mut rng, false, &mut OwnBooks)).unwrap();
            if t.node == 2 {
                break t;
            }
            reader.release(&t, 0);
        };
        poller.set_members(&members(&["10.0.0.1:80"]), |_| false);
        let busy = poller.set_members(&members(&["10.0.0.1:80", "10.0.0.3:80"]), |i| i == 2);
        assert_eq!(busy.joined, vec![3], "a busy slot is not reused");
        poller.set_members(&members(&["10.0.0.1:80"]), |_| false);
        let c = poller.set_members(
            &members(&["10.0.0.1:80", "10.0.0.4:80", "10.0.0.9:80"]),
            |_| false,
        );
        assert_eq!(c.joined, vec![0, 2]);
        poller.on_health(2, Some(IDLE), 20).unwrap();
        let c = reader.mirror_fleet(&snap(&poller));
        assert_eq!((c.joined, c.left), (vec![0, 2], Vec::<usize>::new()));
        reader.import_fleet(&snap(&poller));
        assert_eq!(addresses(&reader), addresses(&poller));
        assert_eq!(
            reader.node_config(0).unwrap().kv_cache_tokens,
            Some(5),
            "listed"
        );
        // The old address's release finds a new tenant in the slot: nothing is taken away.
        let on_new = routed(&reader.route(W, Some("x"), 30, &mut rng, false, &mut OwnBooks));
        let before = reader.nodes()[2].books().inflight_requests;
        reader.release(&on_2, 0);
        assert_eq!(reader.nodes()[2].books().inflight_requests, before);
        if let Some(t) = on_new {
            reader.release(&t, 0);
        }
        // A poller restarted with fewer slots: the reader's extra ones leave.
        let c = reader.mirror_fleet(&Snapshot {
            nodes: snap(&poller).nodes[..2].to_vec(),
        });
        assert_eq!(c.left, vec![2]);
        // Without `membership` the nodes are the configured ones, whatever the snapshot.
        let mut fixed = Balancer::new(&cfg(&[8001]));
        assert_eq!(fixed.mirror_fleet(&snap(&poller)), MemberChange::default());
        assert_eq!(fixed.nodes().len(), 1);
    }
}
