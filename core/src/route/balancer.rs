//! The balancer: the fleet of nodes and the three things that happen to it — a health answer
//! arrives, a request is routed, a request ends.
//!
//! A fourth thing feeds it: a node's model list arrives (`on_models`). A request that names a
//! model is placed among the nodes that serve it; one whose model every node is known not to
//! serve is `UnknownModel`, for the caller to reject or leave to Envoy (see `models`).
//!
//! A decision draws a few candidates (`candidates`) and, when none of them has room, ranks the
//! whole fleet (`ranking`), each node weighed by its predicted time to serve (`choice`). The
//! books a node is weighed by come from a `BookSource` just before it is weighed: this
//! balancer's own (`OwnBooks`), or those every VM of the Envoy shares (`share`), read a bounded
//! number of times per decision (`COMPARISON_READS`). A routed request is booked on its node
//! (`fleet::books`) and its `Ticket` brings the booking back at its stream's progress and end;
//! a ticket carries the generation of the balancer that issued it, so one issued before the
//! glue rebuilt the balancer for a new configuration never changes the new one's books.
//!
//! This is the whole decision core the Envoy glue drives. It is plain Rust: time comes in as
//! `now_ms` and randomness as a `Rng`, so every behaviour is tested natively and, compiled to
//! wasm32-wasip1, in the same instruction set the filter ships in.

use crate::config::{Choices, Config, NodeConfig};
use crate::fleet::membership::Fleet;
pub use crate::fleet::membership::{MemberChange, MAX_NODES};
use crate::fleet::models::{self, ListError, Serves};
use crate::fleet::names::Named;
pub use crate::fleet::node::{Answered, HealthError, Polled};
use crate::fleet::node::{NodeState, Ticket, Transition};
use crate::fleet::prefixes::PrefixIndex;
pub use crate::fleet::probe::Step;
use crate::ingest::prompt::Chain;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;
use crate::rng::Rng;
use crate::route::candidates::{self, Pool};
use crate::route::choice::{self, Ask, AssumedCapacity, Growth, Params, Pin, Prefix, Ranked};
use crate::route::outputs::OutputModel;
use crate::route::prompt_scale::{PromptScale, PromptScales};
use crate::route::ranking::{self, Decision};
use crate::route::routers::{self, Routers};
pub use crate::share::fleet::Imported;
use crate::share::stored::Stored;
use crate::share::{self, Books, Change, NodeView, Snapshot};
use std::sync::atomic::{AtomicU64, Ordering};

/// Books a full comparison brings up to date at most (see `ranking`). With the drawn
/// candidates' (at most twice the number of choices, see `candidates::sample`), a decision
/// and the nodes a prompt's prefix adds (at most `1 + choice::LONGEST_JOINERS`), reads at
/// most `2 * choices + 3 + COMPARISON_READS` books from its `BookSource`, however large
/// the fleet.
pub const COMPARISON_READS: usize = 8;
/// Weight of the newest request in the running mean of request size (used to turn a reported
/// queue depth into tokens). An exponentially weighted mean forgets old traffic mixes in about
/// 1/alpha requests.
const MEAN_ALPHA: f64 = 0.05;

/// How a routed request left the filter.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Routed to the first node of the list; the value is the routing header.
    Routed {
        ticket: Ticket,
        header_value: Box<str>,
        predicted_seconds: f64,
        /// Every fresh node would overflow its VRAM; this is the least bad.
        over_ceiling: bool,
        /// Requests this filter had in flight on the chosen node before this one (visibility;
        /// `u32::MAX` for more).
        inflight_before: u32,
        /// The nodes of the routing header, in its order, as they were weighed (visibility).
        compared: Box<[Ranked]>,
        /// Candidates the choice drew for this request (0: every node), as `choices` and
        /// the traffic set it (see `routers`; visibility). At most 64.
        choices: u8,
    },
    /// No basis to choose: the routing header is not set and Envoy's fallback balancer routes.
    NoFreshNodes,
    /// Every fresh node would pass its VRAM ceiling and the caller may hold the request:
    /// nothing was booked; ask again when a stream ends or a report arrives (see `admission`).
    Saturated,
    /// Every fresh node would pass its VRAM ceiling, the caller may hold the request, and no
    /// node would hold it even with an empty cache (`choice::fits_empty`): no stream ending
    /// makes room for it, so it is not held. Nothing was booked; the caller routes it at once
    /// (asking again without holding), or with `admission.when_full: reject` answers it.
    Oversized,
    /// Every node is known not to serve the request's model: nothing was booked.
    UnknownModel,
    /// No node would give the request its first token within its budget: nothing was booked;
    /// the caller answers it at once, telling it to come back in `retry_after_ms`.
    TooLate { retry_after_ms: u64 },
    /// The request may be shed (its priority is below 0, or a higher one needs its place in
    /// the hold queue) and the fleet is saturated: the caller answers it at once, telling it to
    /// come back in `retry_after_ms` (see `admission`). Never the balancer's own answer.
    Shed { retry_after_ms: u64 },
    /// No node has room for the request and it may wait no longer (held `max_hold_ms`, or the
    /// hold queue full, or no node would hold it even empty), with `admission.when_full:
    /// reject`: the caller answers it at once, telling it to come back in `retry_after_ms`
    /// (see `admission`). `fits`: some node would hold it once room frees (false: none would
    /// even with an empty cache, see `Oversized`). Never the balancer's own answer.
    Full { retry_after_ms: u64, fits: bool },
}

/// When a request that no node would decode fast enough is told to come back: a batch's
/// time per token changes as its streams end, in seconds, not milliseconds.
const SLOW_DECODE_RETRY_MS: u64 = 1000;

/// What a request may be given besides a node now (see `Balancer::route_on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Terms {
    /// It may wait in the hold queue while every node is over the ceiling (`Saturated`).
    pub may_hold: bool,
    /// Its first token must come within this many more milliseconds.
    pub ttft_left_ms: Option<u64>,
    /// Its output tokens must come at most this many milliseconds apart.
    pub tpot_ms: Option<u64>,
    /// Other tenants than its own are active: with `admission.short_lane_ms`, a long request
    /// leaves them a node with a short queue (see `Bar::lane_limit`).
    pub lane: bool,
    /// The one node it may go to, whose stored conversation it continues (see `Pin`).
    pub pin: Option<Pin>,
}

/// What a node must offer to be given the request now: a first token within the budget
/// (seconds), and no more prompts queued than the limit (seconds), when either is set; and,
/// with a lane, that the lane allows it (`first`). A node with no forecast is taken at its
/// word.
#[derive(Debug, Clone, Copy, Default)]
struct Bar {
    budget: Option<f64>,
    queued: Option<f64>,
    /// The longest time per output token (seconds) the request accepts.
    tpot: Option<f64>,
    /// Seconds of queued prompts under which a node is in the short lane.
    lane: Option<f64>,
    /// Streams in flight have time-per-token budgets: a node takes no more prefill than they
    /// can absorb within them (`Ranked::prefill_room_seconds`).
    protect: bool,
}

impl Bar {
    fn is_set(&self) -> bool {
        self.budget.is_some()
            || self.queued.is_some()
            || self.tpot.is_some()
            || self.lane.is_some()
            || self.protect
    }

    /// With a lane, whether the request is short: its own prompt takes at most the lane to
    /// prefill on the node of `ranked` that would prefill it fastest. `None` without a lane.
    fn short(&self, ranked: &[Ranked]) -> Option<bool> {
        let lane = self.lane?;
        let own = |x: &Ranked| Some(x.first_token_seconds? - x.queued_seconds?);
        let fastest = ranked.iter().filter_map(own).reduce(f64::min)?;
        Some(fastest <= lane)
    }

    /// With a lane, the most queued (seconds) a node of `ranked` may have to be in it: the
    /// lane, or the least any node has queued when that is more. The node with the shortest
    /// queue stays the lane when short requests alone have taken it past the lane's seconds:
    /// else a long prompt took it next (no node was left in the lane to keep), and the short
    /// requests after it waited for a node to drain.
    fn lane_limit(&self, ranked: &[Ranked]) -> Option<f64> {
        let lane = self.lane?;
        let least = ranked
            .iter()
            .filter_map(|r| r.queued_seconds)
            .reduce(f64::min);
        Some(least.map_or(lane, |q| q.max(lane)))
    }

    /// Whether node `r` is in the lane (`limit`, `lane_limit`): a short request starts there
    /// soonest.
    fn in_lane(limit: Option<f64>, r: &Ranked) -> bool {
        matches!((limit, r.queued_seconds), (Some(l), Some(q)) if q <= l)
    }

    /// With a lane, whether the request is long on node `r`: its own prompt takes more than
    /// the lane to prefill there. A prompt short on the fastest node may be long on a slow
    /// one, and taking a slow lane node with it puts as long a prefill ahead of the next short
    /// request as a long prompt would.
    fn long_on(&self, r: &Ranked) -> bool {
        match (self.lane, r.first_token_seconds, r.queued_seconds) {
            (Some(l), Some(t), Some(q)) => t - q > l,
            _ => false,
        }
    }

    fn passes(&self, r: &Ranked) -> bool {
        let within = |limit: Option<f64>, t: Option<f64>| match (limit, t) {
            (Some(l), Some(t)) => t <= l,
            _ => true,
        };
        within(self.budget, r.first_token_seconds)
            && within(self.queued, r.queued_seconds)
            && within(self.tpot, r.tpot_seconds)
            && (!self.protect || within(r.prefill_room_seconds, r.first_token_seconds))
    }

    /// The first of `ranked` that passes. With a lane, a request long on a node in the lane
    /// (`in_lane`, `long_on`) may take it only while another remains, and a short one goes to
    /// the node that passes with the soonest first token, which is in the lane when the other
    /// nodes are busy with long prompts (the ranking alone would trade its first token for a
    /// faster decode). This is size-interval task assignment (SITA, Harchol-Balter, Crovella and
    /// Murta, 1999) made dynamic: engines prefill first come, first served, so a short prompt
    /// behind a long one waits the long one's whole prefill, and one node kept free of long
    /// prompts bounds what the short ones wait while the long ones queue everywhere else.
    /// Linear in `ranked`.
    fn first(&self, ranked: &[Ranked]) -> Option<usize> {
        let short = self.short(ranked);
        let limit = self.lane_limit(ranked);
        let lanes = ranked.iter().filter(|r| Self::in_lane(limit, r)).count();
        // A request takes the last node of the lane only where it is short.
        let mut passing = ranked.iter().enumerate().filter(|(_, r)| {
            self.passes(r) && (!Self::in_lane(limit, r) || lanes >= 2 || !self.long_on(r))
        });
        if short == Some(true) {
            let soon = |r: &Ranked| r.first_token_seconds.unwrap_or(f64::INFINITY);
            return passing
                .min_by(|(_, a), (_, b)| soon(a).total_cmp(&soon(b)))
                .map(|(i, _)| i);
        }
        passing.next().map(|(i, _)| i)
    }
}

/// The first of `ranked` whose first-token forecast is within `budget` seconds.
fn meets(ranked: &[Ranked], budget: f64) -> Option<usize> {
    Bar {
        budget: Some(budget),
        ..Bar::default()
    }
    .first(ranked)
}

/// `TooLate` for a request none of `ranked` can start within `budget` seconds, with the
/// shortest forecast's excess as the time to come back; none when some node meets the budget
/// or has no forecast.
fn too_late(ranked: &[Ranked], budget: f64) -> Option<Outcome> {
    if meets(ranked, budget).is_some() {
        return None;
    }
    let soonest = ranked
        .iter()
        .map(|r| r.first_token_seconds)
        .try_fold(f64::INFINITY, |m, t| t.map(|t| m.min(t)))?;
    soonest.is_finite().then(|| Outcome::TooLate {
        retry_after_ms: ((soonest - budget).max(0.0) * 1000.0).ceil() as u64,
    })
}

#[derive(Debug, Clone)]
pub struct Balancer {
    /// Told apart from every other balancer of the process (see `generation`).
    generation: u64,
    /// The nodes followed, slot by slot, and their settings (see `membership`).
    fleet: Fleet,
    params: Params,
    max_hosts: usize,
    /// Predicted KV use the least-full node must pass before a request is held.
    hold_kv_ceiling: f64,
    mean_request_tokens: Option<f64>,
    /// Output lengths learned from the streams seen to completion.
    outputs: OutputModel,
    /// Engine tokens per estimated prompt token, the fleet's and each model's (`prompt_scale`).
    prompt_scales: PromptScales,
    /// The candidates of the power-of-d choices and their drawing weights.
    pool: Pool,
    /// How many routers share the fleet, as this one can tell (see `routers`): with
    /// `choices: "auto"` it decides each request's number of candidates (`auto_choices`), and
    /// holding counts the others' dispatches with it (`room_now`).
    routers: Routers,
    auto_choices: bool,
    /// The model names the fleet serves by name (see `names`).
    named: Named,
    /// Where the prompts routed so far are believed cached (see `prefixes`); `None` with
    /// prefix pricing off.
    prefixes: Option<PrefixIndex>,
    /// Characters of rendered prompt a chain's block covers (for a node's cache size in
    /// blocks).
    block_chars: usize,
    /// The placements made since the last `take_placements`, kept only while another VM
    /// shares this index (`share::journal`): (node, the chain's blocks).
    placements: Option<Vec<(usize, Vec<u64>)>>,
    /// When this balancer was first asked to route: its warm-up (see `warming`) starts then.
    first_asked_ms: Option<u64>,
    /// The node whose books a full comparison brings up to date next, besides the best few
    /// (see `route`): every node in turn.
    next_refresh: usize,
    /// Seconds of queued prompts past which a node takes no request that may wait
    /// (`admission.max_queued_ms`); none when off.
    max_queued_s: Option<f64>,
    /// Seconds of queued prompts under which a node is kept for short requests while other
    /// tenants are active (`admission.short_lane_ms`); none when off.
    short_lane_s: Option<f64>,
    /// Requests this balancer routed with a time-per-token budget that have not ended: while
    /// there are any, every request's prefill is kept from the nodes whose streams it would
    /// slow past their budgets (`Bar::protect`).
    budgets_held: u64,
    /// When this balancer last routed a request with a time-per-token budget.
    budget_routed_ms: Option<u64>,
}

/// Placements kept for `take_placements` at most; the glue takes them after every decision.
const MAX_PLACEMENTS: usize = 64;

/// Stale-after periods after the last request with a time-per-token budget during which the
/// pace of running streams is still measured (`Balancer::paces_wanted`).
const PACE_MEMORY: u64 = 30;

impl Balancer {
    pub fn new(cfg: &Config) -> Self {
        Balancer {
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed).wrapping_add(1),
            fleet: Fleet::new(cfg),
            params: Params {
                rule: cfg.policy,
                stale_after_ms: cfg.stale_after_ms,
                vram_ceiling: cfg.vram_ceiling,
                kv_bytes_per_token: cfg.kv_bytes_per_token,
                keep: cfg.max_hosts_in_header,
                // With `auto`, `routers` decides per request.
                choices: match cfg.choices {
                    Choices::Auto => routers::MANY_CHOICES,
                    Choices::Fixed(d) => d,
                },
            },
            max_hosts: cfg.max_hosts_in_header,
            hold_kv_ceiling: cfg.hold_kv_ceiling,
            mean_request_tokens: None,
            first_asked_ms: None,
            next_refresh: 0,
            outputs: OutputModel::default(),
            prompt_scales: PromptScales::default(),
            pool: Pool::default(),
            routers: Routers::default(),
            auto_choices: cfg.choices == Choices::Auto,
            named: Named::default(),
            prefixes: cfg
                .prefix
                .enabled
                .then(|| PrefixIndex::new(cfg.prefix.max_blocks, cfg.prefix.blocks_per_node)),
            block_chars: cfg.prefix.block_chars,
            placements: None,
            max_queued_s: (cfg.admission.max_queued_ms > 0)
                .then(|| cfg.admission.max_queued_ms as f64 / 1000.0),
            short_lane_s: (cfg.admission.short_lane_ms > 0)
                .then(|| cfg.admission.short_lane_ms as f64 / 1000.0),
            budgets_held: 0,
            budget_routed_ms: None,
        }
    }

    /// Keeps the placements this balancer makes for `take_placements` (`on`), for another
    /// VM's index to learn them (`share::journal`).
    pub fn keep_placements(&mut self, on: bool) {
        self.placements = on.then(Vec::new);
    }

    /// The placements made since the last call: (node, the chain's blocks), in order.
    pub fn take_placements(&mut self) -> Vec<(usize, Vec<u64>)> {
        self.placements
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Another router sent a prompt with chain `blocks` to node `node`: it is believed
    /// cached there, as this balancer's own placements are.
    pub fn believe_placed(&mut self, node: usize, blocks: &[u64]) {
        if let Some(ix) = self.prefixes.as_mut() {
            if node < self.fleet.nodes().len() {
                ix.record(node, blocks);
            }
        }
    }

    /// Where the prompts routed so far are believed cached; `None` with prefix pricing off.
    pub fn prefixes(&self) -> Option<&PrefixIndex> {
        self.prefixes.as_ref()
    }

    /// Characters per block of a prompt's prefix chain, with prefix pricing on.
    pub fn chain_block_chars(&self) -> Option<usize> {
        self.prefixes.as_ref().map(|_| self.block_chars)
    }

    /// Node `node`'s cache, as the prefix index sizes it: its KV cache (`cache_tokens`:
    /// published, from its VRAM total, or configured) in blocks of about `block_chars / 4`
    /// tokens (the estimate's characters a token).
    fn size_prefixes(&mut self, node: usize) {
        let (Some(ix), Some(n)) = (self.prefixes.as_mut(), self.fleet.nodes().get(node)) else {
            return;
        };
        let report = n.report_taken().map(|(r, _)| r);
        if let Some(t) = n
            .cache_tokens(report.as_ref(), self.params.kv_bytes_per_token)
            .map(|t| t as u64)
        {
            let per_block = (self.block_chars as u64 / 4).max(1);
            ix.set_capacity(node, usize::try_from(t / per_block).unwrap_or(usize::MAX));
        }
    }

    /// The knobs of the rule, from the configuration.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The running mean of request size (prompt and expected output), tokens, once a request
    /// has been routed.
    pub fn mean_request_tokens(&self) -> Option<f64> {
        self.mean_request_tokens
    }

    /// The output lengths learned from the streams seen to completion.
    pub fn outputs(&self) -> &OutputModel {
        &self.outputs
    }

    pub fn nodes(&self) -> &[NodeState] {
        self.fleet.nodes()
    }

    /// Node `node`'s settings: where to poll it, its format, its configured figures.
    pub fn node_config(&self, node: usize) -> Option<&NodeConfig> {
        self.fleet.config(node)
    }

    /// The members of the Envoy cluster are now `addresses` (see `membership`, which says how
    /// slots are given and reused). `busy(i)` says whether departed node `i` still has
    /// requests in flight that this balancer's own books do not show (the poller service
    /// routes nothing itself: the shared books know), so its slot is not reused yet; a
    /// balancer that routes for itself passes `|_| false`. Without `membership` configured
    /// this does nothing.
    pub fn set_members(
        &mut self,
        addresses: &[String],
        busy: impl Fn(usize) -> bool,
    ) -> MemberChange {
        let change = self.fleet.set_members(addresses, busy);
        if change.moved() {
            self.pool.invalidate();
            self.named.invalidate();
        }
        self.forget_prefixes(&change);
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
        let Some(state) = self.fleet.nodes_mut().get_mut(node) else {
            return Err(HealthError::UnknownNode);
        };
        // Only a change of whether the node is a candidate changes the pool; a new report of
        // a candidate is read where it stands when the node is drawn.
        let was_candidate = state.fresh_report(now_ms, stale_after).is_some();
        let result = state.take_health(body, now_ms);
        if state.fresh_report(now_ms, stale_after).is_some() != was_candidate {
            self.pool.invalidate();
        }
        if state.take_models_changed() {
            self.named.invalidate();
        }
        self.size_prefixes(node);
        result
    }

    /// The answer to a poll of node `node`'s `health_path`: a health poll as `on_health`, or a
    /// step of finding its telemetry (see `probe`), which the answer's `step` says.
    pub fn on_health_answer(&mut self, node: usize, polled: Polled<'_>, now_ms: u64) -> Answered {
        let stale_after = self.params.stale_after_ms;
        let Some(state) = self.fleet.nodes_mut().get_mut(node) else {
            return Answered {
                result: Some(Err(HealthError::UnknownNode)),
                step: Step::Poll,
            };
        };
        let was_candidate = state.fresh_report(now_ms, stale_after).is_some();
        let answered = state.on_health_answer(polled, now_ms);
        if state.fresh_report(now_ms, stale_after).is_some() != was_candidate {
            self.pool.invalidate();
        }
        if state.take_models_changed() {
            self.named.invalidate();
        }
        self.size_prefixes(node);
        answered
    }

    /// Where node `node`'s health is polled now (see `probe`).
    pub fn health_path(&self, node: usize) -> Option<&str> {
        self.nodes().get(node).map(NodeState::health_path)
    }

    /// Members whose telemetry could not be found (see `probe`).
    pub fn without_telemetry(&self) -> usize {
        self.nodes()
            .iter()
            .filter(|n| n.member() && n.probe().not_found())
            .count()
    }

    /// A node's `GET /v1/models` answered 200 with `body`: a good list replaces the last one
    /// (with the per-slot context it gives, if any) and its length is returned; a bad one
    /// changes nothing. A configured node keeps its configured set (the glue does not ask
    /// those).
    pub fn on_models(&mut self, node: usize, body: &[u8]) -> Result<usize, ListError> {
        let list = models::read_model_list(body)?;
        let n = list.names.len();
        if let Some(state) = self.fleet.nodes_mut().get_mut(node) {
            state.models_mut().set_list(list.names);
            state.models_mut().set_context_tokens(list.context_tokens);
            self.named.invalidate();
        }
        Ok(n)
    }

    /// Whether node `node`'s model list is worth asking for: its set is not configured, or
    /// its engine's list gives its context (see `models`).
    pub fn learns_models(&self, node: usize) -> bool {
        self.nodes()
            .get(node)
            .is_some_and(|n| n.models().wants_list())
    }

    /// Whether every node is known not to serve `model`. Staleness does not enter: a model
    /// served only by a node that is down for now is not unknown, only unavailable.
    pub fn model_unknown(&self, model: &str) -> bool {
        self.nodes()
            .iter()
            .all(|n| n.models().serves(model) == Serves::No)
    }

    /// Whether node `node` was ejected or readmitted since this was last asked.
    pub fn take_transition(&mut self, node: usize) -> Option<Transition> {
        self.fleet
            .nodes_mut()
            .get_mut(node)
            .and_then(NodeState::take_transition)
    }

    /// What a request is expected to cost (see `outputs`): its prompt, and as output the
    /// smaller of its cap and the mean output learned for its prompt's size class.
    pub fn expected(&self, weight: Weight) -> Weight {
        self.outputs.expected(weight)
    }

    /// KV growth to reserve for a request of `weight` (with its cap), see `outputs`.
    pub fn growth(&self, weight: Weight) -> Growth {
        self.outputs.growth(weight)
    }

    /// A stream of `ticket` completed at `seconds` per output token (after its first). A
    /// ticket this balancer did not issue changes nothing.
    pub fn observe_tpot(&mut self, ticket: &Ticket, seconds: f64, now_ms: u64) {
        let bytes = self.params.kv_bytes_per_token;
        if let Some(state) = self.issued(ticket) {
            let cache = state.cache_tokens(state.last_report(), bytes);
            let long = state.is_long(ticket.weight.prompt_tokens, cache);
            state.observe_tpot(seconds, long, now_ms);
        }
    }

    /// Whether the pace of running streams is worth measuring at `now_ms` (`observe_pace`):
    /// only a time-per-token budget reads it, so only while this balancer routes requests with
    /// one (within `PACE_MEMORY` stale-after periods of the last), sparing every other stream
    /// a clock read every few tokens.
    pub fn paces_wanted(&self, now_ms: u64) -> bool {
        let memory = PACE_MEMORY.saturating_mul(self.params.stale_after_ms);
        self.budgets_held > 0
            || self
                .budget_routed_ms
                .is_some_and(|at| now_ms.saturating_sub(at) <= memory)
    }

    /// The stream of `ticket` delivered its last tokens at `seconds` a token: the pace its
    /// node decodes at now. A ticket this balancer did not issue changes nothing.
    pub fn observe_pace(&mut self, ticket: &Ticket, seconds: f64, now_ms: u64) {
        if let Some(state) = self.issued(ticket) {
            state.observe_pace(seconds, now_ms);
        }
    }

    /// A stream whose prompt was estimated at `prompt_tokens` completed normally with
    /// `tokens` output tokens.
    pub fn observe_output(&mut self, prompt_tokens: u64, tokens: u64) {
        self.outputs.observe(prompt_tokens, tokens);
    }

    /// An answer's server counted `reported` prompt tokens for a prompt of `model` (the
    /// request's) this filter estimated from its text at `estimated` (before `prompt_tokens`
    /// scaled it; see `prompt_scale`).
    pub fn observe_prompt(&mut self, model: Option<&str>, estimated: u64, reported: u64) {
        self.prompt_scales.observe(model, estimated, reported);
    }

    /// A prompt of `model` estimated from its text at `estimated` tokens, in the engines'
    /// tokens as their answers have counted that model's prompts, or the fleet's until they
    /// have counted enough (`prompt_scale`).
    pub fn prompt_tokens(&self, model: Option<&str>, estimated: u64) -> u64 {
        self.prompt_scales.of(model).apply(estimated)
    }

    /// Engine tokens per estimated prompt token for a prompt that names no model: the fleet's
    /// as its answers counted them, else the engines' counters' (1 until either is known).
    pub fn prompt_ratio(&self) -> f64 {
        self.prompt_scales.of(None).ratio()
    }

    /// `prompt_ratio` in thousandths.
    pub fn prompt_permille(&self) -> u64 {
        self.prompt_scales.of(None).permille()
    }

    /// The ratio the engines' counters gave, as the poller service published it.
    pub fn engine_prompt_ratio(&self) -> Option<f64> {
        self.prompt_scales.engine_ratio()
    }

    /// Answers that have counted a prompt this filter estimated.
    pub fn prompt_samples(&self) -> u32 {
        self.prompt_scales.fleet().samples()
    }

    /// Each model's own ratio, the most recently counted first.
    pub fn model_prompt_scales(&self) -> Vec<(&str, &PromptScale)> {
        self.prompt_scales.models()
    }

    /// Chooses the nodes for a request and books it as in flight on the first. `weight` is
    /// the request's estimate with its output cap; the books hold its expected cost. `model`,
    /// the body's, keeps the request to the nodes that serve it. With `may_hold`, a request
    /// every node would overflow is not routed: the answer is `Saturated` and the caller holds
    /// it; without, it goes to the node that overflows least. Each weighed node's books are
    /// taken from `books` just before it is weighed (`OwnBooks`: this balancer's own; the
    /// books every worker of the Envoy shares, see `share`): the drawn candidates' only,
    /// unless the draws fail and every candidate is compared. `chain` is the prompt's prefix
    /// chain (`Chain::NONE` for none): each node is charged the prompt tokens its prefix
    /// cache is not believed to hold, and the chosen node is then believed to hold it.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &mut self,
        weight: Weight,
        model: Option<&str>,
        chain: &Chain,
        now_ms: u64,
        rng: &mut dyn Rng,
        may_hold: bool,
        books: &mut dyn BookSource,
    ) -> Outcome {
        let terms = Terms {
            may_hold,
            ..Terms::default()
        };
        self.route_on(weight, model, chain, now_ms, rng, terms, books)
    }

    /// `route`, on the request's terms (none for a request of no weight): with a
    /// time-to-first-token budget (`ttft_left_ms`),
    /// a node whose forecast (`choice::first_token`) passes it is not chosen, and when no
    /// ranked node meets it the answer is `TooLate` (nothing booked), whether or not the fleet
    /// is also over the VRAM ceiling: the fleet is saturated for this request.
    #[allow(clippy::too_many_arguments)]
    pub fn route_on(
        &mut self,
        weight: Weight,
        model: Option<&str>,
        chain: &Chain,
        now_ms: u64,
        rng: &mut dyn Rng,
        terms: Terms,
        books: &mut dyn BookSource,
    ) -> Outcome {
        // A request that costs the GPU nothing (a prompt only counted or tokenized) has no
        // room to wait for and no token a node could be late with: it goes now, wherever.
        // A pinned one carries the stored turns in its prompt, and can only wait for room on
        // its own node (a lane is the whole fleet's).
        let (weight, terms) = match terms.pin {
            _ if weight.total() == 0 => (
                weight,
                Terms {
                    pin: terms.pin,
                    ..Terms::default()
                },
            ),
            Some(pin) => (
                Weight {
                    prompt_tokens: weight.prompt_tokens.saturating_add(pin.cached),
                    ..weight
                },
                Terms {
                    lane: false,
                    ..terms
                },
            ),
            None => (weight, terms),
        };
        let may_hold = terms.may_hold;
        let budget = terms.ttft_left_ms.map(|ms| ms as f64 / 1000.0);
        // Prompts queued at a node past the limit make it full for a request that may wait:
        // it waits here, in the hold queue's order, instead of in the engine's. A request with
        // a budget is instead sent as soon as a node meets it (it could miss it waiting).
        let bar = Bar {
            budget,
            queued: self.max_queued_s.filter(|_| may_hold && budget.is_none()),
            tpot: terms.tpot_ms.map(|ms| ms as f64 / 1000.0),
            lane: self
                .short_lane_s
                .filter(|_| terms.lane && may_hold && budget.is_none()),
            protect: self.budgets_held > 0,
        };
        self.first_asked_ms.get_or_insert(now_ms);
        let growth = self.growth(weight);
        let weight = self.expected(weight);
        let mean = self.mean_request_tokens.unwrap_or(weight.total() as f64);
        // Only in a fleet with nodes that serve any name does it matter whether some node
        // names the model (see `models`); the names are gathered when they change.
        let named = model.is_some_and(|m| self.named.named(self.fleet.nodes(), m));
        let rebuilt = self
            .pool
            .refresh(self.fleet.nodes(), now_ms, self.params.stale_after_ms);
        if rebuilt {
            self.routers
                .observe(self.fleet.nodes(), now_ms, self.params.stale_after_ms);
        }
        let chained = self.prefixes.is_some() && !chain.is_empty();
        let holders = self
            .prefixes
            .as_ref()
            .map_or(0, |index| index.holders_of_start(&chain.blocks));
        let held = holders > 0;
        // A lane is a property of the whole fleet (`Bar::first`): with one, every node
        // is compared, and ranked.
        let lane = bar.lane.is_some();
        let params = Params {
            choices: if lane || terms.pin.is_some() {
                0
            } else if self.auto_choices {
                self.routers.choices(chained)
            } else {
                self.params.choices
            },
            ..self.params
        };
        let prefix = match &self.prefixes {
            Some(index) if !chain.is_empty() => {
                // The node every router prefers for the prompt's key (see `choice`): where a
                // new prefix goes, and where a known one is presumed to be held as well.
                let home = chain.key().and_then(|k| self.pool.home(k));
                Some(Prefix {
                    index,
                    chain,
                    preferred: home.filter(|_| chain.hint.is_some() || !held),
                    // Not once the home is known to hold it and so are half the nodes: a
                    // hot prefix must not have one node compared on every request.
                    presumed: home
                        .filter(|_| held)
                        .map(|i| (i, index.longest(&chain.blocks).0))
                        .filter(|&(i, depth)| {
                            index.matched(i, &chain.blocks) < depth || 2 * holders < self.pool.len()
                        }),
                })
            }
            _ => None,
        };
        let ask = Ask {
            weight,
            growth,
            model,
            named,
            prefix,
            pin: terms.pin,
        };
        let sampled = if params.choices > 0 {
            candidates::sample(
                self.fleet.nodes_mut(),
                &self.pool,
                &ask,
                mean,
                now_ms,
                &params,
                rng,
                &mut |i, n| load_books(books, i, n),
            )
        } else {
            None
        };
        // Drawn candidates that all miss the budget leave the choice to a full comparison,
        // where a node that meets it may be found.
        let sampled = sampled.filter(|r| bar.first(r).is_some());
        // A sampled node serves the model, or might: only without one is the model's fate
        // worth a walk over the fleet.
        let (mut ranked, over_ceiling) = match sampled {
            Some(r) => (r, false),
            None if model.is_some_and(|m| self.model_unknown(m)) => return Outcome::UnknownModel,
            None => {
                // Every candidate is compared, on the books at hand; only the best few are
                // brought up to date (see `ranking`). One more node, each in turn, is too: a
                // node whose books at hand still show work it has since finished would
                // otherwise never be among the best few, and never be chosen again. (A fleet
                // no larger than the routing header has every node read already.)
                let count = self.fleet.nodes().len();
                if count > self.params.keep.max(1) {
                    let i = self.next_refresh % count;
                    self.next_refresh = i + 1;
                    if let Some(n) = self.fleet.nodes_mut().get_mut(i) {
                        load_books(books, i, n);
                    }
                }
                let compared = Params {
                    keep: if lane {
                        count.max(params.keep)
                    } else {
                        params.keep
                    },
                    ..params
                };
                let decision = ranking::compare(
                    self.fleet.nodes_mut(),
                    &ask,
                    mean,
                    now_ms,
                    &compared,
                    rng,
                    COMPARISON_READS,
                    &mut |i, n| load_books(books, i, n),
                );
                match decision {
                    Decision::Route(r) => (r, false),
                    Decision::AllOverCeiling(r)
                        if may_hold
                            && r.first()
                                .and_then(|x| x.kv_fraction)
                                .is_some_and(|f| f > self.hold_kv_ceiling)
                            && !self.room_now(r.first().map(|x| x.node), &ask, now_ms) =>
                    {
                        // Held, unless even the node with the most room would start it
                        // too late: waiting for room only adds to that.
                        if let Some(late) = budget.and_then(|b| too_late(&r, b)) {
                            return late;
                        }
                        // Nor is it held for room that cannot come.
                        if !self.fits_somewhere(&ask, now_ms) {
                            return Outcome::Oversized;
                        }
                        return Outcome::Saturated;
                    }
                    Decision::AllOverCeiling(r) => (r, true),
                    Decision::NoFreshNodes if may_hold && self.warming(now_ms) => {
                        return Outcome::Saturated
                    }
                    // A pinned request's node without a fresh report (or out of the choice
                    // after a failed request) is still the only one that can serve it.
                    Decision::NoFreshNodes => match terms.pin {
                        Some(pin) if pin.node < self.nodes().len() => (
                            vec![Ranked {
                                node: pin.node,
                                seconds: 0.0,
                                kv_fraction: None,
                                cached: pin.cached.min(weight.prompt_tokens),
                                first_token_seconds: None,
                                queued_seconds: None,
                                tpot_seconds: None,
                                prefill_room_seconds: None,
                            }],
                            false,
                        ),
                        _ => return Outcome::NoFreshNodes,
                    },
                }
            }
        };
        if bar.is_set() {
            // The best-ranked node that meets the budget and the queue limit goes first.
            match bar.first(&ranked) {
                Some(i) if i > 0 => {
                    let chosen = ranked.remove(i);
                    ranked.insert(0, chosen);
                }
                Some(_) => {}
                None => {
                    if let Some(late) = budget.and_then(|b| too_late(&ranked, b)) {
                        return late;
                    }
                    // A request with a budget of its own that no node compared serves within
                    // all of them (its first token, its time per token, and the budgets of the
                    // streams already there) is told to come back rather than sent where one
                    // of them would be missed: whichever node it went to, it or the streams
                    // running there would miss (in the benchmark, every long prompt sent so
                    // to a slow node missed its own). In a second the streams in flight have
                    // moved on.
                    if budget.is_some() || bar.tpot.is_some() {
                        return Outcome::TooLate {
                            retry_after_ms: SLOW_DECODE_RETRY_MS,
                        };
                    }
                    // Only the budgets of the streams in flight stop it: one that may wait,
                    // waits for them; any other goes as ranked.
                    let unprotected = Bar {
                        protect: false,
                        ..bar
                    };
                    if bar.protect && may_hold && unprotected.first(&ranked).is_some() {
                        return Outcome::Saturated;
                    }
                    if bar.queued.is_some() || bar.lane.is_some() {
                        return Outcome::Saturated;
                    }
                }
            }
        }
        let Some(first) = ranked.first().copied() else {
            return Outcome::NoFreshNodes;
        };
        let header_value = ranked
            .iter()
            .take(self.max_hosts)
            .filter_map(|r| self.nodes().get(r.node).map(NodeState::address))
            .collect::<Vec<_>>()
            .join(",")
            .into_boxed_str();
        let Some(inflight_before) = self
            .nodes()
            .get(first.node)
            .map(|n| n.books().inflight_requests)
        else {
            return Outcome::NoFreshNodes;
        };
        let inflight_before = u32::try_from(inflight_before).unwrap_or(u32::MAX);
        let booking = Booking {
            weight,
            reserved_output: growth.own,
            cached: first.cached,
            // Budgets are at most an hour (`ingest::claim`).
            tpot_ms: terms.tpot_ms.and_then(|ms| u32::try_from(ms).ok()),
            expected_tpot: first.tpot_seconds,
        };
        let Some(ticket) = self.book(first.node, booking, chain) else {
            return Outcome::NoFreshNodes;
        };
        if ticket.tpot_ms.is_some() {
            self.budgets_held = self.budgets_held.saturating_add(1);
            self.budget_routed_ms = Some(now_ms);
        }
        books.booked(first.node, &Change::dispatch(&ticket));
        // The share of reuse counts the prompts routed, not every attempt of a held one.
        if chained {
            self.routers.reuse_seen(held);
        }
        self.mean_request_tokens = Some(mean + MEAN_ALPHA * (weight.total() as f64 - mean));
        Outcome::Routed {
            ticket,
            header_value,
            predicted_seconds: first.seconds,
            over_ceiling,
            inflight_before,
            compared: ranked.into_boxed_slice(),
            choices: u8::try_from(params.choices).unwrap_or(u8::MAX),
        }
    }

    /// Whether node `node` shows room for the request now (`choice::room_now`), which
    /// holding asks before holding a request that the VRAM check passes nowhere. Only once
    /// the engines have reported running and queued counts (`routers` knows this router's
    /// share of them): without them a node's report cannot tell this router's requests from
    /// the others' there (`choice::prompts_to_come`).
    fn room_now(&self, node: Option<usize>, ask: &Ask, now_ms: u64) -> bool {
        if self.routers.share().is_none() {
            return false;
        }
        node.and_then(|i| Some((i, self.fleet.nodes().get(i)?)))
            .is_some_and(|(i, n)| {
                n.fresh_report(now_ms, self.params.stale_after_ms)
                    .is_some_and(|r| {
                        let ceiling = self.room_ceiling();
                        choice::room_now(i, n, r, ask, &self.params, &self.outputs, ceiling)
                    })
            })
    }

    /// The KV use up to which a node shows room now (`room_now`): from `vram_ceiling` to
    /// `hold_kv_ceiling` (the whole cache by default) in proportion to this router's share of
    /// the requests the engines report (`routers`). The room-now check follows this router's
    /// own streams by their ages, with a reserve for their lengths, and can let them fill the
    /// cache; what the margin under the whole cache is for is what it cannot see: the other
    /// routers' prompts sent since the last report and the ages of their streams. Alone
    /// before a fleet (one Envoy with the poller service), it sees everything; behind four
    /// replicas, about a quarter.
    ///
    /// In the simulator, against `vram_ceiling` alone: one router before four A100-like nodes
    /// on the Azure trace at load 0.93, p99 TTFT 0.57x to 0.73x over five seeds with no VRAM
    /// overflow either way; the whole cache behind four routers added overflows (121 to 190
    /// on Azure, 317 to 356 on ShareGPT over five seeds), which following the share avoids
    /// (docs/BENCHMARKS.md, "Room in a cache this router sees whole").
    fn room_ceiling(&self) -> f64 {
        choice::room_ceiling(
            self.params.vram_ceiling,
            self.hold_kv_ceiling,
            self.routers.share(),
        )
    }

    /// Whether some fresh node that may serve the request would hold it under the holding
    /// ceiling with nothing else in its cache (`choice::fits_empty`): whether holding it can
    /// ever find it room.
    fn fits_somewhere(&self, ask: &Ask, now_ms: u64) -> bool {
        let stale = self.params.stale_after_ms;
        self.fleet.nodes().iter().enumerate().any(|(i, n)| {
            choice::may_serve(i, n, ask)
                && n.fresh_report(now_ms, stale).is_some_and(|r| {
                    choice::fits_empty(n, r, ask, &self.params, self.hold_kv_ceiling)
                })
        })
    }

    /// How long the fresh nodes together take to serve `tokens` of work at their capacities,
    /// in milliseconds: the wait a request shed behind that much held work is told to come
    /// back after (`Retry-After`). None without a fresh node.
    pub fn drain_ms(&self, tokens: u64, now_ms: u64) -> Option<u64> {
        let stale = self.params.stale_after_ms;
        let fresh = || {
            self.nodes()
                .iter()
                .filter_map(move |n| n.fresh_report(now_ms, stale).map(|r| (n, r)))
        };
        let mut assumed = AssumedCapacity::default();
        fresh().for_each(|(n, r)| assumed.add(n, r));
        let total: f64 = fresh().map(|(n, r)| n.capacity(r, assumed.value())).sum();
        let ms = tokens as f64 / total * 1000.0;
        (total > 0.0 && ms.is_finite()).then(|| ms.ceil() as u64)
    }

    /// Cold start: no node has reported yet, and the first request came less than
    /// `stale_after_ms` ago. A request that finds no fresh node then may wait for the first
    /// reports (which come within a tick or two of a start) rather than go to Envoy's balancer
    /// blind, where a long prompt can land on the slowest node while fast ones idle. Past that
    /// window a fleet that never reports is routed by Envoy's balancer at once, as before.
    pub fn warming(&mut self, now_ms: u64) -> bool {
        let first = *self.first_asked_ms.get_or_insert(now_ms);
        now_ms < first.saturating_add(self.params.stale_after_ms)
            && self.fleet.nodes().iter().all(|n| n.reported_at().is_none())
    }

    /// The request's stream has delivered `after` output tokens (it had `before`). A ticket
    /// this balancer did not issue (see `generation`) changes nothing.
    pub fn progress(&mut self, ticket: &Ticket, before: u64, after: u64) {
        if let Some(state) = self.issued(ticket) {
            state.progress(ticket, before, after);
        }
    }

    /// Envoy sent the request to the node at `address` instead of the ticket's: its retries
    /// walk down the routing header when the chosen node refuses the connection or resets it
    /// (`retry_on` in envoy/envoy.yaml). The booking moves there: taken off the chosen node as
    /// if never sent, and dispatched on the node that serves it, priced as cached there as far
    /// as the prefix index believes (`chain`, the request's prompt), its prompt recorded there
    /// (and kept for the other workers' indexes, `take_placements`), its time-per-token budget
    /// held there. The index still believes the chosen node holds the prompt too: what other
    /// workers learned of that placement cannot be taken back. Returns the new ticket; `None`
    /// (nothing changed) for the ticket's own node, an address this balancer does not know, or
    /// a ticket it did not issue.
    pub fn moved(&mut self, ticket: &Ticket, address: &str, chain: &Chain) -> Option<Ticket> {
        let chosen = self.nodes().get(ticket.node).map(NodeState::address);
        if ticket.generation != self.generation || chosen.is_some_and(|c| same_address(c, address))
        {
            return None;
        }
        let to = self.index_of(address)?;
        let cached = self.prefixes.as_ref().map_or(0, |ix| {
            chain.cached(ix.matched(to, &chain.blocks), ticket.weight.prompt_tokens)
        });
        if let Some(from) = self.fleet.nodes_mut().get_mut(ticket.node) {
            from.release(ticket, 0);
        }
        let booking = Booking {
            weight: ticket.weight,
            reserved_output: ticket.reserved_output,
            cached,
            tpot_ms: ticket.tpot_ms,
            expected_tpot: None,
        };
        self.book(to, booking, chain)
    }

    /// The node at `address`, as this balancer numbers them.
    fn index_of(&self, address: &str) -> Option<usize> {
        self.nodes()
            .iter()
            .position(|n| same_address(n.address(), address))
    }

    /// The pin of a request continuing the conversation `stored` (see `Pin`); `None` for an
    /// address this balancer does not know.
    pub fn pin_to(&self, stored: &Stored) -> Option<Pin> {
        let node = self.index_of(&stored.address)?;
        let n = self.nodes().get(node)?;
        Some(Pin {
            node,
            cached: stored.context_tokens,
            shown: n.reported_at().map_or(0, |at| stored.shown_at(at)),
        })
    }

    /// The nodes to ask where a stored response this balancer has not seen is kept
    /// (`ingest::stored`): the addresses of those with a fresh report, at most `most`,
    /// from one drawn at random on, so that a fleet larger than `most` is asked a different
    /// part each time. A node without a fresh report may be down, and its answer would come
    /// late or never.
    pub fn nodes_to_ask(&self, now_ms: u64, most: usize, rng: &mut dyn Rng) -> Vec<String> {
        let stale = self.params.stale_after_ms;
        let nodes = self.nodes();
        let count = nodes.len();
        if count == 0 || most == 0 {
            return Vec::new();
        }
        let start = usize::try_from(rng.next_u64() % count as u64).unwrap_or(0);
        (0..count)
            .map(|k| (start + k) % count)
            .filter_map(|i| {
                let n = nodes.get(i)?;
                n.fresh_report(now_ms, stale)
                    .map(|_| n.address().to_string())
            })
            .take(most)
            .collect()
    }

    /// A request sent to node `node` failed there and was served elsewhere (see `moved`): the
    /// node is out of the choice until its next report (`NodeState::note_failed_request`).
    pub fn note_failed_request(&mut self, node: usize, now_ms: u64) {
        if let Some(n) = self.fleet.nodes_mut().get_mut(node) {
            n.note_failed_request(now_ms);
            self.pool.invalidate();
        }
    }

    /// Books a request on node `node` (its in-flight books, its time-per-token budget) and
    /// records its prompt there in the prefix index (kept for the other workers too, see
    /// `take_placements`): what routing a request there means to this balancer, whether it
    /// chose the node or Envoy's retries did. `None` for a node it does not have.
    fn book(&mut self, node: usize, b: Booking, chain: &Chain) -> Option<Ticket> {
        let horizon = self.outputs.short_answer(b.weight);
        let state = self.fleet.nodes_mut().get_mut(node)?;
        let ticket = Ticket {
            generation: self.generation,
            tpot_ms: b.tpot_ms,
            ..state.dispatch_cached(node, b.weight, b.reserved_output, b.cached)
        };
        if ticket.tpot_ms.is_some() {
            state.hold_budget(&ticket, b.expected_tpot.or(state.last_tpot()), horizon);
        }
        if let Some(ix) = self.prefixes.as_mut() {
            ix.record(node, &chain.blocks);
            if let Some(kept) = self.placements.as_mut() {
                if kept.len() < MAX_PLACEMENTS && !chain.blocks.is_empty() {
                    kept.push((node, chain.blocks.clone()));
                }
            }
        }
        Some(ticket)
    }

    /// The request's stream ended (completed, failed, reset or timed out) after `received`
    /// output tokens. A ticket this balancer did not issue changes nothing.
    pub fn release(&mut self, ticket: &Ticket, received: u64) {
        if let Some(state) = self.issued(ticket) {
            state.release(ticket, received);
            if ticket.tpot_ms.is_some() {
                self.budgets_held = self.budgets_held.saturating_sub(1);
            }
        }
    }

    /// The node whose books hold `ticket`, if this balancer issued it.
    fn issued(&mut self, ticket: &Ticket) -> Option<&mut NodeState> {
        if ticket.generation != self.generation {
            return None;
        }
        self.fleet.nodes_mut().get_mut(ticket.node)
    }

    /// This balancer's generation: no other balancer of this process has it, so a ticket
    /// issued by a balancer built from an earlier configuration (the glue builds a new one on
    /// every configuration) never changes this one's books, which never counted it.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The node of this balancer whose shared books hold `ticket`'s booking (see `share`):
    /// the ticket's own node if this balancer issued it; else, the shared books having
    /// outlived the balancer that booked it, the node with the ticket's address (`None` when
    /// this balancer does not follow it). The shared books' tenant rule still applies: a
    /// change for an address whose slot went to another is dropped when written.
    pub fn holder(&self, ticket: &Ticket) -> Option<usize> {
        if ticket.generation == self.generation {
            return Some(ticket.node);
        }
        self.nodes()
            .iter()
            .position(|n| n.tenant() == ticket.tenant)
    }
}

/// Whether two `ip:port` addresses name the same socket: equal as written (the common case,
/// one comparison), or once parsed (an IPv6 address configured in another spelling than the
/// one Envoy prints, `[fd00:0::2]:8000` for `[fd00::2]:8000`).
fn same_address(a: &str, b: &str) -> bool {
    a == b
        || matches!(
            (a.parse::<std::net::SocketAddr>(), b.parse::<std::net::SocketAddr>()),
            (Ok(x), Ok(y)) if x == y
        )
}

/// What a request books on the node it goes to (`Balancer::book`).
#[derive(Debug, Clone, Copy)]
struct Booking {
    weight: Weight,
    /// Output tokens booked as KV growth.
    reserved_output: u64,
    /// Prompt tokens the node is believed to hold already.
    cached: u64,
    /// The request's time-per-token budget, held on the node while it runs.
    tpot_ms: Option<u32>,
    /// The time per token the node was expected to decode at, if the ranking said; else the
    /// node's last measured one.
    expected_tpot: Option<f64>,
}

/// Balancers built so far in this process (in this VM, for Wasm), for their generations.
static GENERATIONS: AtomicU64 = AtomicU64::new(0);

/// Sharing the fleet between the VMs of one Envoy (see `share`): the poller's balancer exports
/// what its health answers taught it; a filter VM's balancer takes that in place of polling,
/// and takes each node's books from the shared ones before deciding.
impl Balancer {
    /// Every node as this balancer sees it, for the snapshot (see `share::fleet::view`).
    pub fn fleet_view(&self, epoch_base: u64) -> Vec<NodeView> {
        share::fleet::view(&self.fleet, epoch_base)
    }

    /// Takes every node's report, epoch, health and models from `snapshot`, matched by
    /// address (see `share::fleet::import`). The books are not touched (see `set_books`).
    pub fn import_fleet(&mut self, snapshot: &Snapshot) -> Imported {
        let imported = share::fleet::import(&mut self.fleet, snapshot);
        self.prompt_scales.set_engine(snapshot.prompt_ratio);
        self.pool.invalidate();
        self.named.invalidate();
        imported
    }

    /// A filter VM following a cluster with `poller: singleton` takes the poller's node slots
    /// as its own (see `membership`): its node `i` is the snapshot's node `i`, so a node's
    /// books key (per slot, see `share::books_key`) is the same in every VM, and the VM
    /// follows the members the poller follows without asking Envoy's admin itself;
    /// `import_fleet` then brings the reports. Returns what changed, as `set_members` does.
    /// Without `membership` configured this does nothing: the nodes are the configured ones,
    /// matched to the snapshot by address.
    pub fn mirror_fleet(&mut self, snapshot: &Snapshot) -> MemberChange {
        let change = self.fleet.mirror(
            snapshot
                .nodes
                .iter()
                .map(|v| (v.address.as_str(), v.member)),
        );
        if change.moved() {
            self.pool.invalidate();
            self.named.invalidate();
        }
        self.forget_prefixes(&change);
        change
    }

    /// A slot that another node took (or that a node came back to) holds no prefix yet.
    fn forget_prefixes(&mut self, change: &MemberChange) {
        if let Some(ix) = self.prefixes.as_mut() {
            for &i in &change.joined {
                ix.forget(i);
            }
        }
    }

    /// Node `node`'s books as this balancer holds them.
    pub fn books(&self, node: usize) -> Option<Books> {
        self.nodes().get(node).map(|n| *n.books())
    }

    /// Replaces node `node`'s books (the shared ones, under the epoch rule): the next
    /// decision and dispatch start from them, and a ticket takes their epoch.
    pub fn set_books(&mut self, node: usize, b: &Books) {
        if let Some(n) = self.fleet.nodes_mut().get_mut(node) {
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

    /// A request was just booked on node `node` (`change`, a dispatch), and is not written
    /// where `books` reads yet: the later decisions made with this source must count it.
    /// Held requests let out together are routed one after another before any of them is
    /// written to the shared books; read without them, each would find the same room.
    fn booked(&mut self, _node: usize, _change: &Change) {}
}

/// The balancer's own books are the current ones: it is the only one dispatching.
pub struct OwnBooks;

impl BookSource for OwnBooks {
    fn books(&mut self, _node: usize, _report_epoch: u64) -> Option<Books> {
        None
    }
}

/// Brings node `node`'s books up to date from `source`; says whether they changed.
fn load_books(source: &mut dyn BookSource, node: usize, n: &mut NodeState) -> bool {
    let Some(b) = source.books(node, n.epoch()) else {
        return false;
    };
    let before = *n.books();
    n.set_books(&b);
    *n.books() != before
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::engine::FormatError;
    use crate::rng::SplitMix64;
    use crate::route::testing::*;

    #[test]
    fn header_lists_the_ranking_up_to_the_limit() {
        let mut b = Balancer::new(&cfg(4, r#","max_hosts_in_header":3,"choices":0"#));
        for (i, load) in [400, 100, 300, 200].iter().enumerate() {
            let body =
                format!(r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000}}"#);
            b.on_health(i, Some(body.as_bytes()), 0).unwrap();
        }
        match b.route(
            W,
            None,
            &Chain::NONE,
            10,
            &mut SplitMix64::new(1),
            false,
            &mut OwnBooks,
        ) {
            Outcome::Routed {
                header_value,
                ticket,
                over_ceiling,
                ..
            } => {
                assert_eq!(
                    &*header_value,
                    "127.0.0.1:8002,127.0.0.1:8004,127.0.0.1:8003"
                );
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
            let first = match b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut books) {
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

        // Every node compared (choices: 0), on the books at hand: the best are read one at a
        // time until the header's three all have current books. The loaded ones fall behind
        // as they are read, and the light one leads.
        let mut b = idle_fleet(5, r#","choices":0"#);
        let mut books = Recording {
            asked: vec![],
            light: 3,
        };
        assert_eq!(
            routed_to(&b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut books)),
            Some(3)
        );
        assert!(books.asked.contains(&3), "{:?}", books.asked);
        // What was read stays: the next decision reads the header's nodes, and one more in
        // turn.
        books.asked.clear();
        assert_eq!(
            routed_to(&b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut books)),
            Some(3)
        );
        assert_eq!(books.asked.len(), 4, "{:?}", books.asked);
    }

    /// Every node compared, with books in shared data: a node whose books at hand still show
    /// work that has since ended (another worker released it) is read in its turn and
    /// chosen again, though it is never among the best few on the stale books.
    #[test]
    fn a_node_behind_stale_books_is_read_in_its_turn() {
        let mut rng = SplitMix64::new(11);
        let mut b = idle_fleet(10, r#","choices":0"#);
        let stale = Books {
            epoch: b.nodes()[7].epoch(),
            inflight_requests: 500,
            inflight_tokens: 500_000,
            prefill_tokens: 400_000,
            ..Books::of(b.nodes()[7].books().tenant)
        };
        b.set_books(7, &stale);
        // The shared books: every node empty.
        let mut shared = Counting::new(|_| false);
        let mut to_seven = 0;
        for t in 0..40 {
            let o = b.route(W, None, &Chain::NONE, 10 + t, &mut rng, false, &mut shared);
            let ticket = routed(&o).unwrap();
            to_seven += usize::from(ticket.node == 7);
            b.release(&ticket, 0);
        }
        assert!(to_seven > 0, "node 7 was never chosen");
        assert_eq!(b.nodes()[7].books().inflight_requests, 0);
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
            prefill_tokens: u64::MAX,
            ended_requests: u64::MAX,
            started_text_prompt: 0,
            started_other_prompt: 0,
        };
        b.set_books(0, &full);
        let Outcome::Routed { ticket, .. } = b.route(
            W,
            None,
            &Chain::NONE,
            10,
            &mut SplitMix64::new(1),
            false,
            &mut OwnBooks,
        ) else {
            panic!("not routed")
        };
        assert_eq!(b.books(0), Some(full));
        b.progress(&ticket, 0, 10);
        b.release(&ticket, 10);
        assert_eq!(b.books(0).map(|x| x.inflight_requests), Some(u64::MAX - 1));
    }

    /// A request routed under one configuration ends after the plugin was configured again
    /// (the glue then builds a new balancer): its progress and release leave the new
    /// balancer's books alone, which never counted it; its shared booking is found by its
    /// node's address.
    #[test]
    fn a_ticket_from_an_earlier_configuration_leaves_the_books_alone() {
        let mut before = idle_fleet(2, r#","choices":0"#);
        let mut rng = SplitMix64::new(1);
        let old = routed(&before.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks))
            .unwrap();
        let mut after = idle_fleet(2, r#","choices":0"#);
        assert_ne!(after.generation(), before.generation());
        let mine = loop {
            let t = routed(&after.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks))
                .unwrap();
            if t.node == old.node {
                break t;
            }
            after.release(&t, 0);
        };
        let booked = after.books(old.node);
        after.progress(&old, 0, 50);
        after.release(&old, 50);
        assert_eq!(
            after.books(old.node),
            booked,
            "the old ticket changed nothing"
        );
        after.release(&mine, 0);
        assert!(after.books(old.node).is_some_and(|b| b.is_zero()));
        // Where the old ticket's shared booking is: its node, by address; none when the new
        // configuration does not have it.
        assert_eq!(after.holder(&mine), Some(mine.node));
        assert_eq!(after.holder(&old), Some(old.node));
        let other = Balancer::new(
            &Config::parse(br#"{"nodes":[{"address":"10.9.9.9:80"}],"health_cluster":"h"}"#)
                .unwrap(),
        );
        assert_eq!(other.holder(&old), None);
        // The balancer that issued it still takes it.
        before.release(&old, 0);
        assert!(before.books(old.node).is_some_and(|b| b.is_zero()));
    }

    #[test]
    fn failed_or_garbage_polls_keep_the_last_good_report() {
        // Three failures to eject: two failed polls keep the last good report in use.
        let mut b = Balancer::new(&cfg(1, r#","unhealthy_after_failures":3"#));
        assert_eq!(
            b.route(
                W,
                None,
                &Chain::NONE,
                0,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
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
            b.route(
                W,
                None,
                &Chain::NONE,
                3000,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
            Outcome::Routed { .. }
        ));
        // The good report is now stale, and nothing replaced it.
        assert_eq!(
            b.route(
                W,
                None,
                &Chain::NONE,
                3001,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
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
            b.route(
                W,
                None,
                &Chain::NONE,
                400,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
            Outcome::NoFreshNodes,
            "one good poll is not enough to come back"
        );
        b.on_health(0, Some(br#"{"tokens_per_sec_load":5}"#), 500)
            .unwrap();
        assert_eq!(b.take_transition(0), Some(Transition::Readmitted));
        assert!(matches!(
            b.route(
                W,
                None,
                &Chain::NONE,
                500,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
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
            .filter_map(|_| {
                match b.route(W, None, &Chain::NONE, 1, &mut rng, false, &mut OwnBooks) {
                    Outcome::Routed { ticket, .. } => Some(ticket),
                    _ => None,
                }
            })
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

    /// A node whose VRAM check fails only on the growth reserved for its sequences in flight is
    /// not a reason to hold a request while it shows room for it now (half that growth
    /// counted) and nothing waiting: the request goes there at once (over the ceiling, and
    /// counted so). Once its engine reports a queue, or its KV in use leaves no room, it is held.
    #[test]
    fn a_node_with_room_now_and_no_queue_is_not_waited_for() {
        // Whatever the number of candidates: the routers' count is kept either way.
        for choices in ["", r#","choices":2"#, r#","choices":0"#] {
            room_now_case(choices);
        }
    }

    fn room_now_case(choices: &str) {
        let mut b = Balancer::new(&cfg(
            1,
            &format!(
                r#","kv_bytes_per_token":1,"max_hold_ms":10000,"default_max_tokens":1000{choices}"#
            ),
        ));
        let report = |used: u64, waiting: u64, running: u64| {
            format!(
                r#"{{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"vram_used_bytes":{used},"vram_total_bytes":10000,"queue_depth":{waiting},"running_requests":{running}}}"#
            )
        };
        b.on_health(0, Some(report(2000, 0, 0).as_bytes()), 0)
            .unwrap();
        let mut rng = SplitMix64::new(1);
        let long_answer = Weight {
            prompt_tokens: 100,
            output_tokens: 1000,
        };
        // Eight streams of 100 prompt tokens booked at their cap of 1000 output tokens each:
        // 8,800 tokens reserved beside 2,000 in use, over the 0.9 ceiling for any request.
        for _ in 0..8 {
            let routed = b.route(
                long_answer,
                None,
                &Chain::NONE,
                1,
                &mut rng,
                false,
                &mut OwnBooks,
            );
            let Outcome::Routed { ticket, .. } = routed else {
                panic!("routed: {routed:?}");
            };
            // Their first tokens came: their prompts are in the cache.
            b.progress(&ticket, 0, 1);
        }
        // The next report (a minute on, so that this router knows it sends all the requests
        // the engine runs: `routers`) shows their prompts in the cache and nothing waiting.
        let t = 60_000;
        b.on_health(0, Some(report(2800, 0, 8).as_bytes()), t)
            .unwrap();
        let ask = |b: &mut Balancer, rng: &mut SplitMix64, now: u64| {
            b.route(
                long_answer,
                None,
                &Chain::NONE,
                now,
                rng,
                true,
                &mut OwnBooks,
            )
        };
        assert!(matches!(
            ask(&mut b, &mut rng, t + 1),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
        // The engine now queues: the cache is full enough that it waits, so holding is right.
        b.on_health(0, Some(report(2800, 1, 8).as_bytes()), t + 2)
            .unwrap();
        assert!(matches!(ask(&mut b, &mut rng, t + 3), Outcome::Saturated));
        // No queue, but no room for the request's own prompt and output beside what is in use.
        b.on_health(0, Some(report(8500, 0, 8).as_bytes()), t + 4)
            .unwrap();
        assert!(matches!(ask(&mut b, &mut rng, t + 5), Outcome::Saturated));
        // Room for the request beside what is in use, but not beside half the output still to
        // come of the nine streams and the last one's prompt, not prefilled yet
        // (4,500 + 4,496 + 100 + 1,100 of 10,000).
        b.on_health(0, Some(report(4500, 0, 8).as_bytes()), t + 6)
            .unwrap();
        assert!(matches!(ask(&mut b, &mut rng, t + 7), Outcome::Saturated));
        // This router sends everything the node runs, so the room-now check may fill the
        // whole cache (`room_ceiling`): 4,000 + 4,496 + 100 + 1,100 is over the 0.9 ceiling
        // and under 10,000.
        b.on_health(0, Some(report(4000, 0, 8).as_bytes()), t + 8)
            .unwrap();
        assert!(matches!(
            ask(&mut b, &mut rng, t + 9),
            Outcome::Routed { .. }
        ));
    }

    /// A cold start: before any node has reported, a request that may be held waits for the
    /// first reports, for at most `stale_after_ms` (3 s here) from the first request; one that
    /// may not be held, or comes later, goes to Envoy's balancer as before.
    #[test]
    fn before_the_first_reports_a_request_waits_for_them() {
        let mut b = Balancer::new(&cfg(2, ""));
        let mut rng = SplitMix64::new(1);
        let mut ask = |b: &mut Balancer, now: u64, may_hold: bool| {
            b.route(
                W,
                None,
                &Chain::NONE,
                now,
                &mut rng,
                may_hold,
                &mut OwnBooks,
            )
        };
        assert!(matches!(ask(&mut b, 1_000, true), Outcome::Saturated));
        assert!(matches!(ask(&mut b, 1_000, false), Outcome::NoFreshNodes));
        assert!(matches!(ask(&mut b, 3_999, true), Outcome::Saturated));
        // The window is counted from the first request, not from each.
        assert!(matches!(ask(&mut b, 4_000, true), Outcome::NoFreshNodes));
        // Once a node has reported the start is over, even when the report goes stale.
        let mut b = Balancer::new(&cfg(2, ""));
        assert!(matches!(ask(&mut b, 0, true), Outcome::Saturated));
        b.on_health(1, Some(br#"{"tokens_per_sec_load":0}"#), 10)
            .unwrap();
        assert!(matches!(
            ask(&mut b, 20, true),
            Outcome::Routed { ref ticket, .. } if ticket.node == 1
        ));
        assert!(!b.warming(20));
        assert!(matches!(ask(&mut b, 20_000, true), Outcome::NoFreshNodes));
    }

    #[test]
    fn a_request_books_its_expected_output_and_returns_it_all() {
        let mut b = Balancer::new(&cfg(1, ""));
        let capped = Weight {
            prompt_tokens: 10,
            output_tokens: 1024,
        };
        for i in 0..crate::route::outputs::MIN_SAMPLES {
            b.observe_output(10, if i % 2 == 0 { 100 } else { 300 });
        }
        // Routing books the expected cost, and progress plus release return it all.
        b.on_health(0, Some(br#"{"tokens_per_sec_load":0}"#), 0)
            .unwrap();
        let Outcome::Routed { ticket, .. } = b.route(
            capped,
            None,
            &Chain::NONE,
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
        match b.route(
            W,
            None,
            &Chain::NONE,
            10,
            &mut SplitMix64::new(1),
            false,
            &mut OwnBooks,
        ) {
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
            &Chain::NONE,
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
            b.route(
                W,
                None,
                &Chain::NONE,
                1,
                &mut SplitMix64::new(1),
                false,
                &mut OwnBooks
            ),
            Outcome::Routed {
                over_ceiling: true,
                ..
            }
        ));
    }
}
