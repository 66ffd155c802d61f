//! The choice: which node will serve this request soonest without overflowing its VRAM.
//!
//! For every node with a fresh report the filter predicts the time to serve the request:
//!
//! ```text
//!   spare    S = max(C - L, 5% of C)                tokens/s the node has free
//!   backlog  B = max(queue_depth * mean_request_tokens   work waiting at the node (reported)
//!                    + unreflected_tokens,             + work this filter sent since that report,
//!                    prefill_tokens)                   or its prompts not yet started there
//!              + running * mean_output / 2          output still to come where it runs
//!   time     T = (B + w) / S                        w = prompt + output tokens of the request
//! ```
//!
//! with `L` the reported token load and `C` the capacity (configured, else reported, else the
//! largest capacity known in the fleet, else twice the largest load, so that nodes reporting
//! only a load are ranked by load). This is the sojourn time of a work-conserving queue that
//! drains at the node's spare rate: a fast GPU with room beats a slow idle one, a node whose
//! queue is long loses even when its throughput looks fine (throughput saturates, the queue
//! does not), and the unreflected term moves a node down the ranking with every request sent to
//! it before the next report, so a burst spreads instead of herding. The output still to come
//! of the sequences the node reports running counts as work ahead too: an engine spends each
//! iteration's token budget on its decoders before any prefill, so a node busy decoding starts
//! a new prompt late (in the simulator, leaving it out tripled the p99 TTFT behind 16 replicas). The 5% floor keeps a
//! saturated node finite, ranked among saturated peers by its backlog. T is an ordering key, not
//! a latency forecast: only the order matters, which is why the rule stays robust to telemetry
//! that is off by a constant factor (the same spirit as tower's `Load` that only needs `Ord`).
//!
//! The prompts this filter sent that have not had their first token stay work after the report
//! (`prefill_tokens` above): an engine with room in its cache admits a burst to its running
//! batch at once and prefills it in order, so its report shows a short queue while seconds of
//! prefill remain. In the simulator counting them cut p99 TTFT by 8 to 19% on prefill-heavy
//! traffic and by 25% on the Azure trace behind 4 replicas, and cost 6% on Azure bursts with
//! 4 nodes (docs/BENCHMARKS.md).
//!
//! The predictive safety valve (the seed article's term): a node is excluded when admitting the
//! request would push its predicted KV-cache use over the ceiling. Predicted use is the reported
//! use plus what is still to come: the prompts the report does not show (sent since, or not
//! prefilled yet: `prompts_to_come`), the output the requests in
//! flight may still generate (running sequences hold one more token of KV per token generated;
//! ignoring that growth is how a node that looks 85% full overflows a minute later), and this
//! request's own prompt and output. Output is booked at the learned mean, and the uncertainty is reserved once per
//! node for everything in flight there: z standard deviations of one output times the square
//! root of the number in flight (the standard deviation of a sum of independent lengths), not
//! z deviations per request. The growth still to come is this router's books, or, when larger,
//! the node's reported running sequences times half a mean output: behind several Envoy
//! replicas each router's books hold only its own share of what runs there. Reserving each
//! request at its own 90th percentile assumes they all run long at once; with 60 sequences on a node that books several times the growth that
//! happens, keeps the cache a third empty and, with holding, makes requests wait for room that
//! is there. Before enough outputs are learned, each request books its cap instead.
//! When every fresh node would overflow, the decision says so (`AllOverCeiling`, least overflow
//! first): the caller either holds the request until a node has room (`admission`, when
//! `max_hold_ms` is set) or sends it to the one that overflows least. The growth reserved is
//! the sum of every sequence's output still to come, each as if at its end before any other
//! ended: safe, and tight for a cohort that started together, but a node decoding many streams
//! at every stage never holds it, so holding first asks whether the least-full node shows room
//! now (`room_now`: nothing queued at its engine, and this router's streams there followed by
//! their ages, `survival`, under a ceiling between `vram_ceiling` and the whole cache set by
//! how much of the node's work this router sees, `room_ceiling`) and sends it there if so.
//!
//! Which nodes are compared: by default two, drawn in proportion to their capacity
//! (`candidates::sample`, power-of-two choices; `candidates` says why). Every Envoy worker and every Envoy replica ranks
//! the same reports between two polls, and its own in-flight correction only sees its own
//! dispatches: comparing every node makes them all pick the same node (herding). Two random
//! candidates, the better one kept, spread independent routers and still steer away from
//! loaded nodes; a request the drawn nodes cannot take without passing the VRAM ceiling is
//! placed by comparing every node (`ranking`), which is also what tells a saturated fleet apart.
//! `choices: 0` compares every node on every request. This module is the cost of one request
//! on one node (`evaluate`); `ranking` orders the fleet by it.
//!
//! Exact ties are broken at random with the injected generator, so equal idle nodes share a
//! burst instead of the first one in the list taking it all.
//!
//! Prompts already cached (`fleet::prefixes`): the weight of a request is not one number but
//! one per node, the tokens it will cost there. On a node believed to hold the first k blocks
//! of the prompt's chain (`ingest::prompt`), `w` loses that share of the prompt, since the
//! engine's prefill skips it (vLLM's automatic prefix caching, SGLang's radix cache). Nothing
//! else changes: the node holding a tenant's system prompt wins while `B` there costs less than
//! the prefill it saves (`B_home + w - cached < B_other + w` at equal spare rates), and an idle
//! node wins once the backlog costs more. "Sticky until saturated" is the cost model's own
//! trade of queue against work, with no threshold to tune, which is simpler than the weighted
//! sum of a prefix score and a load score that the inference gateway and SGLang's router use
//! (their weights decide for the operator how many queued requests a cached prefix is worth).
//! Where it fails: the index believes a node holds what its engine may have evicted (a cache
//! smaller than assumed, or filled by other routers' traffic), and then one request pays a full
//! prefill where a short one was predicted; the saving is counted at the estimate's characters
//! per token, not the engine's tokens; and with several Envoy replicas each sees only its own
//! routing. The VRAM check still counts the whole prompt: cached blocks that no running
//! sequence shares are free memory to the engine and a hit takes them back, which the filter
//! cannot tell apart from blocks running sequences share.
//!
//! Agreement between routers that never talk (Envoy replicas): a prompt whose opening no node
//! holds, or one with a client's hint, prefers one node chosen by weighted rendezvous hashing
//! of its key (`Prefix::preferred`), whose time is let off by `PREFERENCE` (10%): independent
//! routers put the same new prefix on the same node when the costs are close, and the cost
//! model still overrules when they are not. Once a router knows the prefix somewhere (it sent
//! it there, perhaps because the preferred node was loaded at the time), the preferred node
//! stays its home: it is presumed to hold the prefix as deep as the longest run the router
//! knows on any node (`Prefix::presumed`), since the other routers put it there first, and it
//! is compared on every such request. A router that spilled thus goes back once the home is
//! the cheaper again, and the replicas' caches converge instead of splitting a tenant's prefix
//! over every node each of them spilled to. One router gains as well near saturation: its
//! tenants return home after a spill instead of drifting over the fleet and churning every
//! cache (docs/BENCHMARKS.md, "Replicas that agree"). The home is no longer special once the
//! router knows it holds the prefix and at least half the nodes do too: a hot prefix held
//! everywhere is priced the same everywhere, and a node compared on every request of it would
//! take more than its share. Where it is wrong: a prefix the home never got (every router
//! spilled it) or evicted costs one full prefill there, after which the presumption is true;
//! a key shared by prompts whose deeper blocks differ (one system prompt opening many
//! conversations) credits the home with the depth of this router's conversation, not only the
//! shared opening.
//!
//! Forecasts for admission (`route::admission`), beside the ordering key: the time to the
//! request's first token (`first_token`: the prompts queued at the node and its own uncached
//! prompt, at `NodeState::forecast_rate`: the configured capacity, else the rate the node was
//! seen to sustain over seconds of work, else the ranking's), the part of it that is already
//! queued, and the node's time
//! per output token as measured from the streams this filter saw complete there. A request's
//! budgets are compared with them; the ranking never is.
//!
//! A request that names a model is ranked among the nodes that serve it, or might (a node whose
//! set is not known, see `models`); the others are not candidates at all, as a stale node is
//! not. The capacity assumed for nodes that report none is still the fleet's: which nodes serve
//! a model says nothing about how fast an unreported one is.

use crate::config::Rule;
use crate::fleet::models::Serves;
use crate::fleet::node::{self, NodeState};
use crate::fleet::prefixes::PrefixIndex;
use crate::ingest::prompt::Chain;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;
use crate::route::outputs::{OutputModel, RESERVE_SIGMAS};
use crate::route::survival::{self, Running, Survival};

/// Knobs of the rule, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub rule: Rule,
    pub stale_after_ms: u64,
    pub vram_ceiling: f64,
    pub kv_bytes_per_token: u64,
    /// How many nodes of the ranking the caller uses (the routing header's length): only
    /// those are put in order, the rest are dropped unsorted, so a decision over a thousand
    /// nodes is a linear selection, not a sort.
    pub keep: usize,
    /// Candidates compared per request (power-of-d choices); 0 compares every node.
    pub choices: usize,
}

/// Share of capacity assumed free on a saturated node.
const MIN_SPARE_SHARE: f64 = 0.05;

/// One node in the ranking.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    pub node: usize,
    /// Predicted time to serve, seconds (an ordering key).
    pub seconds: f64,
    /// Predicted KV-cache use after admission, when the node reports enough to tell.
    pub kv_fraction: Option<f64>,
    /// Prompt tokens the node is believed to hold in its prefix cache.
    pub cached: u64,
    /// Forecast of the request's time to first token there, seconds (see `first_token`);
    /// none under the baseline rules, which forecast nothing.
    pub first_token_seconds: Option<f64>,
    /// The part of it that is prompts already queued there (see `route::admission`).
    pub queued_seconds: Option<f64>,
    /// The time per output token the request can expect there, seconds: the slower of the
    /// streams this filter saw complete there recently (`TPOT_MEMORY` reports' worth; for a
    /// long context, also its long contexts' figure, see `NodeState::tpot_for`) and the pace
    /// of the ones running there now.
    pub tpot_seconds: Option<f64>,
    /// How much prefill, in seconds at the node's rate, the streams in flight there can take
    /// before one of them passes its time-per-token budget (`prefill_room`); none when no
    /// stream there has a budget or the node's time per token is not known.
    pub prefill_room_seconds: Option<f64>,
}

/// How many stale-after periods a node's observed time per output token is believed.
pub const TPOT_MEMORY: u64 = 5;

/// Predicted KV-cache fraction on the node after admitting `extra_tokens` more context.
fn kv_fraction(node: &NodeState, r: &Report, extra_tokens: u64, p: &Params) -> Option<f64> {
    let extra = extra_tokens as f64;
    if let (Some(used), Some(total)) = (r.vram_used_bytes, r.vram_total_bytes) {
        return Some((used + extra * p.kv_bytes_per_token as f64) / total);
    }
    let usage = r.kv_cache_usage?;
    match node.cache_tokens(Some(r), p.kv_bytes_per_token) {
        Some(k) => Some(usage + extra / k),
        // Without the cache size the request cannot be sized: only a full cache is known.
        None => Some(usage),
    }
}

/// Output the sequences report `r` counts running still have to generate: half a mean output
/// each (`Growth::per_running`), whichever router sent them.
fn reported_growth(r: &Report, growth: &Growth) -> f64 {
    r.running_requests.unwrap_or(0.0) * growth.per_running
}

/// Prompt tokens node `n` (report `r`) is to hold that the report does not show: the prompts
/// sent since the report, or, when more, the prompts not prefilled yet (no first token):
/// queued at the engine, which reports KV for the sequences it runs only, or being
/// prefilled, whose KV grows chunk by chunk as the prefill runs. A 40,000-token prompt takes
/// an A100 seconds to prefill, so a report a tick after it was sent shows a fraction of what
/// it will hold, and a node that looks half full has no room (in the simulator, most
/// overflows of long-prompt traffic were nodes sent a prompt beside one still prefilling).
/// The larger of the two, not their sum: a prompt sent since the report and not started is
/// in both.
///
/// This router's books hold its own prompts. Other routers' are taken to be as many again
/// for each time the requests the node reports outnumber this router's there (`routers_at`):
/// behind four Envoy replicas a node runs about four times what each one sent it. Counted per
/// node and from its latest report, not from the fleet's share over the last seconds: a
/// router that sent a burst a moment ago and has stopped (the demo's round-robin Envoy,
/// between this one's bursts) shows in no report of a node it is done with, and must not make
/// this router's own burst count several times.
fn prompts_to_come(n: &NodeState, r: &Report) -> f64 {
    let books = n.books();
    let own = books.unreflected_prompt_tokens.max(books.prefill_tokens) as f64;
    own * routers_at(n, r)
}

/// How many routers' requests node `n` runs for each of this router's, as its report `r`
/// shows them: the requests it reports running and queued over this router's that the
/// report counts (`Books::in_report_requests`: in flight before it, or ended since); 1 when
/// this router has none there, at most `MAX_ROUTERS`.
fn routers_at(n: &NodeState, r: &Report) -> f64 {
    let own = n.books().in_report_requests() as f64;
    let there = r.running_requests.unwrap_or(0.0) + r.queue_depth.unwrap_or(0.0);
    if own < 1.0 || !there.is_finite() {
        return 1.0;
    }
    (there / own).clamp(1.0, MAX_ROUTERS)
}

/// Most routers `routers_at` counts behind one node.
const MAX_ROUTERS: f64 = 16.0;

/// The KV growth still to come on node `n`: what this router's books reserve for its requests
/// in flight there, or the reported estimate when larger (other routers' requests are in no
/// book of this one).
fn still_to_come(n: &NodeState, r: &Report, growth: &Growth) -> f64 {
    (n.books().growth_tokens as f64).max(reported_growth(r, growth))
}

/// Whether node `n` (report `r`) would hold the request under `ceiling` with nothing else in
/// its cache: its prompt, its own output reserve and the margin of one stream. A request that
/// no node would hold even empty waits in vain for room: no stream ending makes it (see
/// `Balancer::route_on`). A node whose cache size is not known is taken to hold it: nothing
/// says it cannot.
pub fn fits_empty(n: &NodeState, r: &Report, ask: &Ask, p: &Params, ceiling: f64) -> bool {
    let own = ask
        .weight
        .prompt_tokens
        .saturating_add(ask.growth.own)
        .saturating_add(ask.growth.margin_per_sqrt.ceil() as u64);
    let empty = Report {
        vram_used_bytes: r.vram_used_bytes.map(|_| 0.0),
        kv_cache_usage: r.kv_cache_usage.map(|_| 0.0),
        ..*r
    };
    kv_fraction(n, &empty, own, p).map_or(true, |f| f <= ceiling)
}

/// Whether node `n` (report `r`) shows room for the request as it stands: nothing waiting at
/// its engine, and under `ceiling` its KV in use and what is still to come on it with the
/// request (`to_come_now`). The caller sets the ceiling by what this router can see of the
/// node (`Balancer::room_ceiling`).
///
/// The VRAM check reserves every stream's whole remaining output, as if every sequence reached
/// its end before any other ended and freed its context: right for a cohort that started
/// together (a burst), but on a node decoding many streams at every stage of their answers
/// the ends free as much as the others grow, and the cache never holds the sum (in the
/// simulator, decode-heavy traffic held every request for `max_hold_ms` while the nodes'
/// caches stayed half empty). An engine with a queue is the sign of a full cache. Holding asks
/// this before holding a request that the VRAM check passes nowhere; with room, the request
/// goes at once, over the ceiling, and is counted so (see `balancer`).
pub fn room_now(
    node: usize,
    n: &NodeState,
    r: &Report,
    ask: &Ask,
    p: &Params,
    outputs: &OutputModel,
    ceiling: f64,
) -> bool {
    let to_come = to_come_now(n, r, ask, outputs).saturating_sub(ask.shown(node));
    r.queue_depth.unwrap_or(0.0) < 1.0
        && kv_fraction(n, r, to_come, p).is_some_and(|f| f <= ceiling)
}

/// The KV use up to which `room_now` finds room: from `vram_ceiling` to `hold_kv_ceiling` in
/// proportion to this router's share of the requests the engines report (`routers`), the
/// lower ceiling when the share is not known yet (see `Balancer::room_ceiling`).
pub fn room_ceiling(vram_ceiling: f64, hold_kv_ceiling: f64, share: Option<f64>) -> f64 {
    let share = share
        .filter(|s| s.is_finite())
        .unwrap_or(0.0)
        .clamp(0.0, 1.0);
    vram_ceiling + (hold_kv_ceiling - vram_ceiling).max(0.0) * share
}

/// The KV still to come on node `n` (report `r`) with the request, as the room-now check
/// counts it. This router's streams there and the request follow their expected path
/// (`survival::peak`): each stream runs on as long as answers of its age do, and the highest
/// point of their summed contexts, less what the report already counts of them, is what they
/// add. The streams of other workers and other routers, whose ages this router does not know,
/// are taken to be like its own once it has `MIN_SAMPLE` of them there: each of its streams
/// stands for its share of the others too (the workers of one Envoy, and Envoys behind one
/// load balancer, get the same mix of traffic). With fewer, the others count as before: their
/// prompts the report does not show, and half of the output they still have to generate, the
/// most the cache rises when the remaining outputs are spread evenly and the ends free nothing
/// but what they grew. Without a path (too few answers seen to completion, or more streams
/// than are recorded), every stream is counted that way.
///
/// In the simulator, against half of every stream's output: decode-heavy traffic at full load
/// with one router, median first token 1.4 s -> 0.07 s and p99 6.4 s -> 2.6 s (four nodes),
/// and fewer overflows at load 1.0 over the whole grid (docs/BENCHMARKS.md, "How long each
/// stream will still run"). The others taken like this router's own, against the half rule
/// for them: behind four routers at full load, decode-heavy p99 first token 0.10x-0.67x; through
/// Envoy behind two workers, 0.14x at rate 4 ("The others' streams taken to be like this
/// router's own").
fn to_come_now(n: &NodeState, r: &Report, ask: &Ask, outputs: &OutputModel) -> u64 {
    let half_rule = || {
        ((prompts_to_come(n, r) + still_to_come(n, r, &ask.growth) / 2.0) as u64)
            .saturating_add(ask.weight.prompt_tokens)
            .saturating_add(ask.growth.own)
    };
    own_path(n, r, ask, outputs).map_or_else(half_rule, |path| {
        let others_prompts = (prompts_to_come(n, r) - path.unstarted_prompts).max(0.0);
        let others_growth = if path.sampled {
            0.0
        } else {
            path.others * ask.growth.per_running / 2.0
        };
        (path.rise + others_prompts + others_growth) as u64
    })
}

/// Fewest streams of this router's on a node for them to stand for the others' there.
pub const MIN_SAMPLE: usize = 4;

/// What `own_path` found.
struct Path {
    /// What the streams it followed and the request add over the report's count of them.
    rise: f64,
    /// Prompt tokens of this router's streams without a first token.
    unstarted_prompts: f64,
    /// Streams on the node that are not this router's.
    others: f64,
    /// Whether the path also stands for the others' streams.
    sampled: bool,
}

/// What this router's streams on node `n` and the request will add to its KV in use, over the
/// report's count of them (`Stream::shown`), at their expected path's highest point with
/// `RESERVE_SIGMAS` deviations, the others' streams included when there are enough of this
/// router's to stand for them; `None` without a path (see `to_come_now`).
fn own_path(n: &NodeState, r: &Report, ask: &Ask, outputs: &OutputModel) -> Option<Path> {
    let streams = n.streams()?;
    // The others: what the books and the report count beyond this router's streams.
    let count = streams.len() as f64;
    let reported = r.running_requests.unwrap_or(0.0) + r.queue_depth.unwrap_or(0.0);
    let others = (n.books().inflight_requests as f64 - count)
        .max(reported - count)
        .max(0.0);
    let sampled = streams.len() >= MIN_SAMPLE && others > 0.0;
    // Each of this router's streams also stands for `copies` of the others'. A copy of one
    // without its first token adds only its growth: the others' prompts not yet reported are
    // counted from the books (`to_come_now`).
    let copies = if sampled { others / count } else { 0.0 };
    // One survival per prompt class met, built once.
    let mut by_class: Vec<(usize, Option<Survival>)> = Vec::new();
    let mut class_of = |prompt: u64| {
        let c = OutputModel::class(prompt);
        match by_class.iter().position(|(k, _)| *k == c) {
            Some(i) => i,
            None => {
                by_class.push((c, outputs.survival(prompt)));
                by_class.len().saturating_sub(1)
            }
        }
    };
    let asked = class_of(ask.weight.prompt_tokens);
    let classes: Vec<usize> = streams.iter().map(|s| class_of(s.prompt)).collect();
    let survival_at = |i: usize| by_class.get(i).and_then(|(_, s)| s.as_ref());
    let running = streams
        .iter()
        .zip(&classes)
        .flat_map(|(s, &i)| {
            let started = s.started();
            let own = Running {
                stands_for: if started { 1.0 + copies } else { 1.0 },
                ..Running::one(s.context() as f64, s.generated as f64, started)
            };
            let waiting_copy = (!started && copies > 0.0).then_some(Running {
                stands_for: copies,
                ..Running::one(0.0, 0.0, false)
            });
            std::iter::once(own)
                .chain(waiting_copy)
                .map(move |r| (r, survival_at(i)))
        })
        .chain(std::iter::once((
            Running::one(ask.weight.prompt_tokens as f64, 0.0, false),
            survival_at(asked),
        )));
    let peak = survival::peak(running, RESERVE_SIGMAS)?;
    // What the report counts of the streams the path stands for.
    let shown: f64 = streams
        .iter()
        .map(|s| s.shown as f64 * if s.started() { 1.0 + copies } else { 1.0 })
        .sum();
    Some(Path {
        rise: (peak - shown).max(0.0),
        unstarted_prompts: streams
            .iter()
            .filter(|s| !s.started())
            .map(|s| s.prompt as f64)
            .sum(),
        others,
        sampled,
    })
}

/// The KV growth to reserve: this request's expected output, and the margin for the
/// uncertainty of the output of everything in flight on a node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Growth {
    /// Output tokens this request is expected to add to the cache.
    pub own: u64,
    /// Margin per square root of the number of requests in flight on the node (z times the
    /// standard deviation of one output length); 0 when nothing is learned yet.
    pub margin_per_sqrt: f64,
    /// Output still to come of one sequence the node reports running (half a mean output):
    /// the growth of the requests other routers sent, which this one has no books for.
    pub per_running: f64,
}

/// The request being placed: its cost, the KV growth to reserve for it, and its model.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub weight: Weight,
    pub growth: Growth,
    /// The body's `model`; `None` puts no restriction on the nodes.
    pub model: Option<&'a str>,
    /// Some node serves `model` by name: a node that serves any name leaves it to those
    /// (see `models`).
    pub named: bool,
    /// What is known of where the prompt's prefix is cached; `None` prices the prompt the
    /// same on every node.
    pub prefix: Option<Prefix<'a>>,
    /// The one node the request may go to (see `Pin`).
    pub pin: Option<Pin>,
}

/// A request that can only be served by one node: a turn continuing a response that node
/// stores (`ingest::stored`). Its prompt includes the stored turns, which that node computed
/// last and is believed to hold in its prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub node: usize,
    /// Prompt tokens believed cached there: the stored conversation's.
    pub cached: u64,
    /// Prompt tokens the node's latest report still counts as KV in use: the turn before it
    /// was running when the report was taken (see `share::stored::Stored::shown_at`). Its
    /// blocks are this request's too, so they are not counted twice.
    pub shown: u64,
}

impl Ask<'_> {
    /// KV of the request's prompt that node `node`'s report already counts (see `Pin`).
    fn shown(&self, node: usize) -> u64 {
        self.pin
            .filter(|p| p.node == node)
            .map_or(0, |p| p.shown.min(self.weight.prompt_tokens))
    }
}

/// Share of its predicted time a node preferred for the request's prefix key is let off: the
/// preference only decides between nodes within that much of each other.
pub const PREFERENCE: f64 = 0.1;

/// The request's prompt as the prefix index sees it (see `fleet::prefixes`).
#[derive(Debug, Clone, Copy)]
pub struct Prefix<'a> {
    pub index: &'a PrefixIndex,
    pub chain: &'a Chain,
    /// The node independent routers prefer for the request's prefix key (rendezvous hashing
    /// over the candidates, see `candidates::Pool::preferred`), for a prompt whose opening no
    /// node is known to hold, or one with a client's hint. A prefix already held somewhere is
    /// priced where it is held: preferring one node for it would pull a hot prefix there.
    pub preferred: Option<usize>,
    /// For a prefix some node is known to hold: its home, the node its key prefers (as
    /// `preferred`), and the depth in blocks of the longest run known on any node, which the
    /// home is presumed to hold: other routers put the prefix there first (see the module).
    /// `None` once the home is known to hold that much and half the nodes hold the prefix.
    pub presumed: Option<(usize, usize)>,
}

/// Nodes of the longest match that join the drawn candidates.
pub const LONGEST_JOINERS: usize = 2;

impl<'a> Prefix<'a> {
    /// The nodes a decision compares before any drawn at random (see `candidates::sample`):
    /// the preferred node or the presumed home first, which takes the place of one random
    /// draw (a prefix-keyed draw: for a prompt nobody shares it is as random as any draw), then
    /// the nodes believed to hold the longest leading run of the prompt, which are compared
    /// besides the draws (power-of-two choices must not hide the node that holds the prefix).
    /// Each comes with whether it adds to the number of nodes compared.
    pub fn joiners(self) -> impl Iterator<Item = (usize, bool)> + 'a {
        let (_, longest) = self.index.longest(&self.chain.blocks);
        self.preferred
            .or(self.presumed.map(|(i, _)| i))
            .map(|i| (i, false))
            .into_iter()
            .chain(longest.take(LONGEST_JOINERS).map(|i| (i, true)))
    }

    /// Prompt tokens node `node` is believed to hold of a prompt of `prompt_tokens`.
    pub fn cached(&self, node: usize, prompt_tokens: u64) -> u64 {
        let mut matched = self.index.matched(node, &self.chain.blocks);
        if let Some((_, depth)) = self.presumed.filter(|&(i, _)| i == node) {
            matched = matched.max(depth);
        }
        self.chain.cached(matched, prompt_tokens)
    }
}

/// Whether node `n` may serve the request: it serves the request's model, or might (its set
/// is not known, or it serves any name and no node names the model), and the request's prompt
/// fits the node's per-slot context when its model list gives one (a longer prompt is refused
/// there before any work).
pub fn may_serve(i: usize, n: &NodeState, ask: &Ask) -> bool {
    // Only its node can serve a pinned request, whatever its model or length.
    if let Some(pin) = ask.pin {
        return pin.node == i;
    }
    let model = match ask.model {
        None => true,
        Some(m) => match n.models().serves(m) {
            Serves::Yes | Serves::Unknown => true,
            Serves::AnyName => !ask.named,
            Serves::No => false,
        },
    };
    model
        && n.models()
            .context_tokens()
            .map_or(true, |c| ask.weight.prompt_tokens <= c)
}

/// The capacity assumed for a node that reports none and has none configured: the largest
/// capacity known among the fresh nodes, else twice their largest load, so that nodes
/// reporting only a load are ranked by load. Every fresh node is `add`ed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AssumedCapacity {
    known: Option<f64>,
    max_load: f64,
}

impl AssumedCapacity {
    /// Takes fresh node `n`, whose report is `r`, into account.
    pub fn add(&mut self, n: &NodeState, r: &Report) {
        if let Some(c) = n.known_capacity(r) {
            self.known = Some(self.known.map_or(c, |m| m.max(c)));
        }
        self.max_load = self.max_load.max(r.load_tokens_per_sec);
    }

    /// The capacity assumed, tokens per second.
    pub fn value(&self) -> f64 {
        self.known.unwrap_or(2.0 * self.max_load + 1.0)
    }
}

/// What the fleet as a whole contributes to one node's evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FleetWide {
    /// Capacity assumed for a node that reports none and has none configured.
    pub assumed_capacity: f64,
    /// Running mean of request size, tokens: turns a reported queue depth into work.
    pub mean_request_tokens: f64,
}

/// One node's predicted time to serve the request and KV use after admitting it, and whether
/// that use passes the ceiling. `r` is the node's fresh report.
pub fn evaluate(
    node: usize,
    n: &NodeState,
    r: &Report,
    ask: &Ask,
    fleet: &FleetWide,
    p: &Params,
) -> (Ranked, bool) {
    let (weight, growth) = (ask.weight, ask.growth);
    let c = n.capacity(r, fleet.assumed_capacity);
    let books = n.books();
    let spare = (c - r.load_tokens_per_sec).max(MIN_SPARE_SHARE * c);
    // Output the running sequences still have to generate, estimated from the node's reported
    // running count (half a mean output each): the same figure behind any number of Envoy
    // replicas, where each router's books hold only its own share. It is work ahead of the
    // request: decode tokens take an iteration's budget before any prefill, so a node busy
    // decoding many sequences starts a new prompt late. (This router's books are not used
    // here: one long stream of its own is one token an iteration, not work ahead.) For the
    // KV the cache must still hold, the larger of books and estimate stands (`still_to_come`).
    let reported_growth = reported_growth(r, &growth);
    let still_to_come = still_to_come(n, r, &growth);
    // Work queued ahead: what the report shows waiting plus what was sent since, or the
    // prompts this router sent there that have not had their first token, whichever is more.
    // An engine may admit a burst to its running batch at once and prefill it in order
    // (reporting an empty queue), and a report is a tick old: the prefill still to do is in
    // this router's books either way.
    let reported_queue =
        r.queue_depth.unwrap_or(0.0) * fleet.mean_request_tokens + books.unreflected_tokens as f64;
    let backlog = reported_queue.max(books.prefill_tokens as f64) + reported_growth;
    // Prompt tokens the node's prefix cache holds are not work there: prefill skips them. They
    // are still KV: cached blocks that no running sequence shares are free memory the engine
    // counts as such, and a hit takes them back, so the VRAM check below counts the whole
    // prompt.
    let cached = ask
        .prefix
        .map_or(0, |x| x.cached(node, weight.prompt_tokens));
    let cached = match ask.pin {
        Some(pin) if pin.node == node => cached.max(pin.cached.min(weight.prompt_tokens)),
        _ => cached,
    };
    let work = weight.total().saturating_sub(cached) as f64;
    let mut seconds = (backlog + work) / spare;
    let queued = reported_queue.max(books.prefill_tokens as f64);
    let rate = n.forecast_rate(r, fleet.assumed_capacity);
    let first_token_seconds =
        first_token(queued, weight.prompt_tokens.saturating_sub(cached), rate);
    let queued_seconds = first_token(queued, 0, rate);
    // Measured against the node's report time: the report is fresh, so this is recent too.
    let since = n
        .reported_at()
        .unwrap_or(0)
        .saturating_sub(TPOT_MEMORY.saturating_mul(p.stale_after_ms));
    // A long context decodes slower than the short streams beside it: by its own context.
    let long = n.is_long(
        weight.prompt_tokens,
        n.cache_tokens(Some(r), p.kv_bytes_per_token),
    );
    // The pace its streams decode at now, when some ran within the last stale-after period:
    // what the long contexts admitted since the last stream completed have made of it.
    let pace = n.pace_since(
        n.reported_at()
            .unwrap_or(0)
            .saturating_sub(p.stale_after_ms),
    );
    let tpot_seconds = node::slower(n.tpot_for(long, since), pace);
    let prefill_room_seconds = prefill_room(n, pace.or(n.tpot_since(since)));
    if ask.prefix.is_some_and(|x| x.preferred == Some(node)) {
        seconds *= 1.0 - PREFERENCE;
    }
    // KV still to come: prompts the report does not show, the output reserved for everything
    // in flight, and this request's own prompt and reserved output.
    let margin = growth.margin_per_sqrt * (books.inflight_requests.saturating_add(1) as f64).sqrt();
    let kv_extra = ((prompts_to_come(n, r) + still_to_come) as u64)
        .saturating_add(weight.prompt_tokens)
        .saturating_add(growth.own)
        .saturating_add(margin.ceil() as u64)
        .saturating_sub(ask.shown(node));
    let kv = kv_fraction(n, r, kv_extra, p);
    let ranked = Ranked {
        node,
        seconds,
        kv_fraction: kv,
        cached,
        first_token_seconds,
        queued_seconds,
        tpot_seconds,
        prefill_room_seconds,
    };
    (ranked, matches!(kv, Some(f) if f > p.vram_ceiling))
}

/// The prefill node `n` can take, in seconds at its rate, before a stream in flight there
/// passes its time-per-output-token budget (`tpot` is the time per token the node decodes at).
/// An engine that batches continuously runs each prefill chunk in an iteration every decoding
/// stream waits for: `P` seconds of prefill while a stream of `N` tokens runs add about `P` to
/// its time and `P / N` to its time per token, so a stream with budget `b` lets the node take
/// `(b - tpot) * N` seconds of prefill. `N` is a short answer for its prompt (the lower
/// quartile of the outputs learned for its prompt size, `OutputModel::short_answer`): the
/// short answers are the ones a prefill slows most, and answers vary widely (from 20 to 400
/// tokens for one tenant in the benchmark), so the mean leaves the shorter half unprotected.
/// The least of that over the streams with a budget there is the node's room. Admission
/// checked each request's budget against the node as it was when it came in; the requests
/// sent after it are what slow it (Sarathi-Serve, OSDI'24, measures the same stall from the
/// other side: prefill chunks sized to a decode-latency target).
///
/// With nothing measured there lately (the first streams of a burst on a node that was idle),
/// the node's time per token is the slowest its streams in flight were expected to decode at
/// when they were sent (`HeldBudget::expected_tpot`): a node left unprotected until its first
/// stream is measured takes a burst's long prompts one after another, and the first stream
/// misses its budget.
fn prefill_room(n: &NodeState, tpot: Option<f64>) -> Option<f64> {
    let expected = || {
        n.budgets()
            .iter()
            .filter_map(|b| b.expected_tpot)
            .reduce(f64::max)
    };
    let tpot = tpot.or_else(expected)?;
    n.budgets()
        .iter()
        .map(|b| ((f64::from(b.ms) / 1000.0 - tpot) * f64::from(b.horizon)).max(0.0))
        .reduce(f64::min)
}

/// Forecast of a request's time to first token on a node: the prompts queued ahead of it and
/// its own uncached prompt, prefilled at the node's capacity `c` (tokens/s). Unlike the ranking
/// key above (which drains at the spare rate, so that load orders nodes), this is meant as a
/// time: a request's budget is compared with it (`route::admission`). It leaves out the decode
/// work the engine interleaves, so it errs short on a node busy decoding; docs/BENCHMARKS.md
/// measures how often an admitted request then misses its budget.
pub fn first_token(queued_ahead_tokens: f64, own_prompt_tokens: u64, c: f64) -> Option<f64> {
    let t = (queued_ahead_tokens.max(0.0) + own_prompt_tokens as f64) / c;
    (c > 0.0 && t.is_finite()).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::route::ranking::{decide, Decision};
    use crate::route::testing::{ask, configured, node, order, rep, run, w, P};

    #[test]
    fn table_of_choices() {
        let vram = |used: f64, total: f64| Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(1000.0),
            vram_used_bytes: Some(used),
            vram_total_bytes: Some(total),
            ..Report::default()
        };
        type Case = (&'static str, Vec<NodeState>, Weight, Vec<usize>);
        let cases: Vec<Case> = vec![
            (
                "lowest load wins at equal capacity",
                vec![
                    node(Some(rep(900.0, Some(1000.0)))),
                    node(Some(rep(100.0, Some(1000.0)))),
                    node(Some(rep(500.0, Some(1000.0)))),
                ],
                w(100, 100),
                vec![1, 2, 0],
            ),
            (
                "a fast busy GPU beats a slow idle one",
                vec![
                    node(Some(rep(0.0, Some(1000.0)))),
                    node(Some(rep(5000.0, Some(10000.0)))),
                ],
                w(100, 100),
                vec![1, 0],
            ),
            (
                "load only, no capacity anywhere: ranked by load",
                vec![
                    node(Some(rep(30.0, None))),
                    node(Some(rep(10.0, None))),
                    node(Some(rep(20.0, None))),
                ],
                w(1, 1),
                vec![1, 2, 0],
            ),
            (
                "stale and unreported nodes are not candidates",
                vec![node(None), node(Some(rep(999.0, Some(1000.0))))],
                w(1, 1),
                vec![1],
            ),
            (
                "queue depth counts as backlog",
                vec![
                    node(Some(Report {
                        queue_depth: Some(50.0),
                        ..rep(100.0, Some(1000.0))
                    })),
                    node(Some(rep(300.0, Some(1000.0)))),
                ],
                w(10, 10),
                vec![1, 0],
            ),
            (
                "VRAM ceiling excludes a node that would overflow",
                vec![
                    node(Some(vram(850.0, 1000.0))),
                    node(Some(Report {
                        load_tokens_per_sec: 900.0,
                        ..vram(0.0, 1000.0)
                    })),
                ],
                w(60, 0),
                vec![1],
            ),
            (
                "a small request still fits under the ceiling",
                vec![
                    node(Some(vram(850.0, 1000.0))),
                    node(Some(Report {
                        load_tokens_per_sec: 900.0,
                        ..vram(0.0, 1000.0)
                    })),
                ],
                w(20, 20),
                vec![0, 1],
            ),
        ];
        for (name, nodes, weight, want) in cases {
            assert_eq!(order(&run(&nodes, weight, 2000)), want, "{name}");
        }
    }

    #[test]
    fn capacity_override_wins_over_report() {
        let slow = configured(Some(rep(500.0, Some(100_000.0))), Some(600.0), None);
        let other = node(Some(rep(500.0, Some(2000.0))));
        assert_eq!(order(&run(&[slow, other], w(10, 10), 2000)), vec![1, 0]);
    }

    /// A burst sent to a node whose engine admits it to its running batch at once: the next
    /// report shows no queue and clears the unreflected part, but the prompts whose first
    /// token has not come back are still prefill to do there, and an idle peer ranks first.
    #[test]
    fn prompts_not_yet_started_stay_work_after_the_next_report() {
        let busy = |running: f64| Report {
            running_requests: Some(running),
            queue_depth: Some(0.0),
            ..rep(100.0, Some(1000.0))
        };
        let mut nodes = vec![node(Some(busy(0.0))), node(Some(busy(0.0)))];
        let tickets: Vec<_> = (0..10)
            .map(|_| nodes[0].dispatch(0, w(2000, 10), 10))
            .collect();
        nodes[0].accept_report(busy(10.0), 1000);
        assert_eq!(nodes[0].books().unreflected_tokens, 0);
        assert_eq!(nodes[0].books().prefill_tokens, 20_000);
        assert_eq!(order(&run(&nodes, w(2000, 10), 2000))[0], 1);
        // Their first tokens came: the prefill is done, and the nodes are equal again but for
        // the report's running sequences.
        for t in &tickets {
            nodes[0].progress(t, 0, 1);
        }
        assert_eq!(nodes[0].books().prefill_tokens, 0);
        nodes[1].accept_report(busy(10.0), 1000);
        let Decision::Route(r) = run(&nodes, w(2000, 10), 2000) else {
            panic!("routed")
        };
        assert_eq!(r[0].seconds, r[1].seconds, "{r:?}");
    }

    #[test]
    fn unreflected_dispatches_push_a_node_down() {
        let mut nodes = vec![
            node(Some(rep(100.0, Some(1000.0)))),
            node(Some(rep(150.0, Some(1000.0)))),
        ];
        assert_eq!(order(&run(&nodes, w(50, 50), 2000))[0], 0);
        // A burst between two reports spreads across both nodes instead of herding on node 0.
        let mut picks = [0usize; 2];
        for _ in 0..20 {
            let first = order(&run(&nodes, w(50, 50), 2000))[0];
            picks[first] += 1;
            nodes[first].dispatch(first, w(50, 50), 50);
        }
        assert!(picks[0] >= 5 && picks[1] >= 5, "burst split {picks:?}");
    }

    /// An idle node of 1,000 tokens/s whose cache holds 1,000 tokens (one byte each, as `P`
    /// counts them), `used` of them in use.
    fn kv_report(used: f64) -> Report {
        Report {
            vram_used_bytes: Some(used),
            vram_total_bytes: Some(1000.0),
            ..rep(0.0, Some(1000.0))
        }
    }

    #[test]
    fn unreflected_work_counts_against_the_vram_ceiling() {
        let mut n = node(Some(kv_report(0.0)));
        assert!(matches!(
            run(&[n.clone()], w(400, 0), 2000),
            Decision::Route(_)
        ));
        n.dispatch(0, w(600, 0), 0);
        assert!(matches!(
            run(&[n], w(400, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
    }

    /// A long prompt sent to a node is mostly not in the next report's KV: queued at its
    /// engine or a few chunks into its prefill. Until its first token comes back it counts in
    /// full against the ceiling, and a node that looks a tenth full is seen to have no room.
    #[test]
    fn prompts_not_yet_prefilled_count_against_the_vram_ceiling_after_the_next_report() {
        let report = kv_report;
        let mut n = node(Some(report(0.0)));
        let t = n.dispatch(0, w(600, 0), 0);
        // The next report clears what was sent since the last one, and shows a sixth of it.
        n.accept_report(report(100.0), 1500);
        assert_eq!(n.books().unreflected_prompt_tokens, 0);
        let over = |n: &NodeState| match run(std::slice::from_ref(n), w(300, 0), 2000) {
            Decision::AllOverCeiling(r) => Some(r[0].kv_fraction),
            _ => None,
        };
        assert_eq!(
            over(&n),
            Some(Some(1.0)),
            "100 shown + 500 to come + 300 asked"
        );
        // Its first token came: the report after that shows the whole prompt, and the rest of
        // the cache is room again.
        n.progress(&t, 0, 1);
        n.accept_report(report(600.0), 1800);
        assert_eq!(over(&n), None);
    }

    /// Behind several routers the others' prompts on the way to a node are in no book of this
    /// one: they are taken to be as many again for each time the requests the node reports
    /// outnumber this router's there.
    #[test]
    fn prompts_to_come_stand_for_every_router_the_node_reports() {
        let report = |running: f64| Report {
            running_requests: Some(running),
            ..kv_report(0.0)
        };
        let kv = |running: f64| {
            let mut n = node(Some(report(0.0)));
            // One request sent before the report, not started: its 150 tokens are still to
            // come.
            n.dispatch(0, w(150, 0), 0);
            n.accept_report(report(running), 1500);
            let (r, over) = evaluate(
                0,
                &n,
                &report(running),
                &ask(w(100, 0), None),
                &FleetWide {
                    assumed_capacity: 1000.0,
                    mean_request_tokens: 100.0,
                },
                &P,
            );
            (r.kv_fraction, over)
        };
        // Only this router's request runs there.
        assert_eq!(kv(1.0), (Some(0.25), false));
        // Four requests for its one: three other routers' prompts on the way too.
        assert_eq!(kv(4.0), (Some(0.7), false));
        assert_eq!(kv(6.0), (Some(1.0), true));
        // Fewer than its own (a report behind this router's books) read as its own.
        assert_eq!(kv(0.0), (Some(0.25), false));
        // At most sixteen routers.
        assert_eq!(kv(100.0), (Some(2.5), true));
    }

    /// A report taken before this router's streams there ended still counts them: they are
    /// its own, not other routers' work, until a newer report drops them.
    #[test]
    fn requests_ended_since_the_report_are_not_other_routers() {
        let report = |running: f64| Report {
            running_requests: Some(running),
            ..kv_report(0.0)
        };
        let fleet = FleetWide {
            assumed_capacity: 1000.0,
            mean_request_tokens: 100.0,
        };
        let mut n = node(Some(report(0.0)));
        // Four requests sent before the report, which shows the four running; three end.
        let tickets: Vec<_> = (0..4).map(|_| n.dispatch(0, w(150, 0), 0)).collect();
        n.accept_report(report(4.0), 1500);
        for t in tickets.iter().skip(1) {
            n.release(t, 0);
        }
        let kv = |n: &NodeState, running: f64| {
            let (r, _) = evaluate(0, n, &report(running), &ask(w(100, 0), None), &fleet, &P);
            r.kv_fraction
        };
        // The one left still to come, once: the report's four are all this router's.
        assert_eq!(kv(&n, 4.0), Some(0.25));
        // Four more than its own there, as the report saw them: other routers' too.
        assert_eq!(kv(&n, 8.0), Some(0.4));
        // A newer report shows only the one left.
        n.accept_report(report(1.0), 1750);
        assert_eq!(kv(&n, 1.0), Some(0.25));
        assert_eq!(kv(&n, 4.0), Some(0.7));
    }

    /// The room-now check follows this router's streams by their ages once answers have been
    /// seen to complete: streams at every stage of their answers leave room where half of
    /// their remaining output did not, and a cohort that has just started leaves none where
    /// that half did. Without learned answers it counts half of the output, as before.
    #[test]
    fn room_now_follows_each_stream_by_its_age() {
        // A 4,400-token cache, every answer 400 tokens.
        let report = |used: f64| Report {
            vram_used_bytes: Some(used),
            vram_total_bytes: Some(4400.0),
            ..rep(0.0, Some(1000.0))
        };
        let mut learned = OutputModel::default();
        for _ in 0..100 {
            learned.observe(100, 400);
        }
        let unlearned = OutputModel::default();
        // Ten streams of 100-token prompts that have generated `ages`, twice reported since.
        let streams = |ages: &[u64]| {
            let used: u64 = ages.iter().map(|g| 100 + g).sum();
            let mut n = node(Some(report(0.0)));
            for &g in ages {
                let t = n.dispatch(0, w(100, 400), 400);
                n.progress(&t, 0, g);
            }
            n.accept_report(report(used as f64), 1250);
            n.accept_report(report(used as f64), 1500);
            (n, report(used as f64))
        };
        let asked = ask(w(100, 400), None);
        let staged: Vec<u64> = (0..10).map(|i| 40 * i + 1).collect();
        let (n, r) = streams(&staged);
        assert_eq!(n.streams().map(|s| s.len()), Some(10));
        assert!(
            !room_now(0, &n, &r, &asked, &P, &unlearned, P.vram_ceiling),
            "half the output"
        );
        assert!(
            room_now(0, &n, &r, &asked, &P, &learned, P.vram_ceiling),
            "the ends free it"
        );
        let (n, r) = streams(&[1; 10]);
        assert!(
            room_now(0, &n, &r, &asked, &P, &unlearned, P.vram_ceiling),
            "half the output"
        );
        assert!(
            !room_now(0, &n, &r, &asked, &P, &learned, P.vram_ceiling),
            "they grow together"
        );
        // A queue at the engine: no room whatever the path.
        let (n, r) = streams(&staged);
        let queued = Report {
            queue_depth: Some(1.0),
            ..r
        };
        assert!(!room_now(
            0,
            &n,
            &queued,
            &asked,
            &P,
            &learned,
            P.vram_ceiling
        ));
    }

    /// The room-now ceiling: the whole of `hold_kv_ceiling` alone before the fleet,
    /// `vram_ceiling` when the share is unknown or nothing, in proportion between.
    #[test]
    fn room_ceiling_follows_the_share_this_router_sees() {
        let cases = [
            (0.9, 1.0, Some(1.0), 1.0),
            (0.9, 1.0, Some(0.25), 0.925),
            (0.9, 1.0, Some(0.0), 0.9),
            (0.9, 1.0, None, 0.9),
            (0.9, 1.0, Some(f64::NAN), 0.9),
            (0.9, 1.0, Some(3.0), 1.0),
            (0.8, 1.2, Some(0.5), 1.0),
            // A holding ceiling under the VRAM ceiling is not taken below it.
            (0.95, 0.9, Some(1.0), 0.95),
        ];
        for (vram, hold, share, want) in cases {
            let got = room_ceiling(vram, hold, share);
            assert!((got - want).abs() < 1e-9, "{vram} {hold} {share:?}: {got}");
        }
    }

    /// Where this router has enough streams on a node, the others' streams there (another
    /// worker's, another Envoy's) are taken to be like its own: at every stage of their
    /// answers they leave room that half their output would not, and as a cohort that started
    /// together they leave none where half their output would.
    #[test]
    fn the_others_streams_are_taken_to_be_like_this_routers_own() {
        let mut learned = OutputModel::default();
        for _ in 0..100 {
            learned.observe(100, 400);
        }
        // `mine` streams of 100-token prompts that have generated `ages` (in turn), twice
        // reported since, beside as many of another router's of the same ages when `others`:
        // the report shows both. What the room-now check counts still to come there.
        let asked = Ask {
            growth: Growth {
                own: 400,
                margin_per_sqrt: 0.0,
                per_running: 200.0,
            },
            ..ask(w(100, 400), None)
        };
        let to_come = |mine: usize, ages: &[u64], others: bool| {
            let routers = if others { 2 } else { 1 };
            let report = |used: u64, running: usize| Report {
                vram_used_bytes: Some(used as f64),
                vram_total_bytes: Some(1e6),
                running_requests: Some(running as f64),
                ..rep(0.0, Some(1000.0))
            };
            let mut n = node(Some(report(0, 0)));
            let mut used = 0;
            for i in 0..mine {
                let g = ages.get(i % ages.len()).copied().unwrap_or(1);
                let t = n.dispatch(0, w(100, 400), 400);
                n.progress(&t, 0, g);
                used += routers * (100 + g);
            }
            let r = report(used, routers as usize * mine);
            n.accept_report(r, 1250);
            n.accept_report(r, 1500);
            to_come_now(&n, &r, &asked, &learned) as f64
        };
        // The others at half of what they still have to generate: 200 tokens each.
        let half_rule =
            |mine: usize, ages: &[u64]| to_come(mine, ages, false) + mine as f64 * 100.0;
        let staged: Vec<u64> = (0..10).map(|i| 40 * i + 1).collect();
        let (mine, cohort) = (10, [1]);
        assert!(mine >= MIN_SAMPLE);
        assert!(to_come(mine, &staged, true) < half_rule(mine, &staged) - 500.0);
        assert!(to_come(mine, &cohort, true) > half_rule(mine, &cohort) + 2000.0);
        // Too few of this router's own to stand for them: the half rule.
        let few = MIN_SAMPLE - 1;
        for ages in [&staged[..], &cohort[..]] {
            assert!((to_come(few, ages, true) - half_rule(few, ages)).abs() < 1.0);
        }
    }

    #[test]
    fn growth_of_running_requests_counts_against_the_vram_ceiling() {
        let report = kv_report;
        let mut n = node(Some(report(0.0)));
        let t = n.dispatch(0, w(100, 500), 500);
        // The next report shows the prompt's KV; the 500 output tokens are still to come.
        n.accept_report(report(100.0), 1500);
        assert!(matches!(
            run(&[n.clone()], w(400, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // Once the stream has generated its output and ended, the room is back.
        n.progress(&t, 0, 500);
        n.release(&t, 500);
        n.accept_report(report(0.0), 1800);
        assert!(matches!(run(&[n], w(400, 0), 2000), Decision::Route(_)));
    }

    /// The uncertainty of in-flight output is pooled per node: sixteen requests booked at
    /// their mean of 100 leave room for one more with a margin of 2 sd x sqrt(17), where
    /// booking each at mean + 2 sd (17 x 300 tokens: 1.01 of the cache) would call it full.
    #[test]
    fn growth_margin_is_pooled_over_the_requests_in_flight() {
        let mut n = configured(
            Some(Report {
                kv_cache_usage: Some(0.5),
                ..rep(0.0, Some(1000.0))
            }),
            None,
            Some(10_000),
        );
        for _ in 0..16 {
            n.dispatch(0, w(0, 100), 100);
        }
        let decide_with = |margin_per_sqrt: f64| {
            decide(
                std::slice::from_ref(&n),
                &Ask {
                    weight: w(100, 100),
                    growth: Growth {
                        own: 100,
                        margin_per_sqrt,
                        per_running: 0.0,
                    },
                    model: None,
                    named: false,
                    prefix: None,
                    pin: None,
                },
                100.0,
                2000,
                &P,
                &mut SplitMix64::new(1),
            )
        };
        // sd 100: 0.5 + (1600 + 100 + 100 + 200 * sqrt(17)) / 10000 = 0.76
        let Decision::Route(r) = decide_with(200.0) else {
            panic!("the node has room")
        };
        let kv = r[0].kv_fraction.unwrap();
        assert!((kv - 0.7625).abs() < 1e-3, "{kv}");
        // sd 300: 0.5 + (1800 + 600 * sqrt(17)) / 10000 = 0.93, over the ceiling.
        assert!(matches!(decide_with(600.0), Decision::AllOverCeiling(_)));
    }

    /// Each stream with a budget leaves `(budget - time per token) x its expected output` of
    /// prefill; the node's room is the least of them, none without a budget or a time per token.
    #[test]
    fn the_prefill_room_is_the_least_any_budgeted_stream_leaves() {
        use crate::fleet::node::Ticket;
        let mut n = node(Some(rep(0.0, None)));
        let hold = |n: &mut NodeState, ms: u32, output: u64| {
            let t = Ticket {
                tpot_ms: Some(ms),
                ..n.dispatch(0, w(100, output), output)
            };
            n.hold_budget(&t, None, output);
            t
        };
        assert_eq!(prefill_room(&n, Some(0.020)), None);
        let long = hold(&mut n, 30, 200);
        let room = |n: &NodeState, t| prefill_room(n, t).map(|s| (s * 1000.0).round());
        assert_eq!(room(&n, Some(0.020)), Some(2000.0));
        assert_eq!(room(&n, None), None);
        // A short answer with a looser budget binds harder: 30 ms of slack over 20 tokens.
        let short = hold(&mut n, 50, 20);
        assert_eq!(room(&n, Some(0.020)), Some(600.0));
        // Past a budget already: no room at all.
        assert_eq!(room(&n, Some(0.040)), Some(0.0));
        n.release(&short, 20);
        n.release(&long, 200);
        assert_eq!(room(&n, Some(0.020)), None);
    }

    /// With nothing measured on the node, the room is reckoned at the slowest time per token
    /// its budgeted streams were expected to decode at when they were sent; a measured figure
    /// overrules it, and a stream sent with nothing known leaves the node unreckoned.
    #[test]
    fn the_prefill_room_falls_back_on_what_the_streams_expected() {
        use crate::fleet::node::Ticket;
        let mut n = node(Some(rep(0.0, None)));
        let hold = |n: &mut NodeState, ms: u32, output: u64, expected: Option<f64>| {
            let t = Ticket {
                tpot_ms: Some(ms),
                ..n.dispatch(0, w(100, output), output)
            };
            n.hold_budget(&t, expected, output);
            t
        };
        let room = |n: &NodeState, t| prefill_room(n, t).map(|s| (s * 1000.0).round());
        let blind = hold(&mut n, 30, 100, None);
        assert_eq!(room(&n, None), None);
        // (30 - 25) ms x 100 tokens, and (30 - 25) x 50 for the second stream.
        let a = hold(&mut n, 30, 100, Some(0.020));
        let b = hold(&mut n, 30, 50, Some(0.025));
        assert_eq!(room(&n, None), Some(250.0));
        // Measured now: (30 - 10) ms x 50.
        assert_eq!(room(&n, Some(0.010)), Some(1000.0));
        // Nonsense expectations are not kept.
        n.release(&b, 50);
        let c = hold(&mut n, 30, 50, Some(f64::NAN));
        assert_eq!(room(&n, None), Some(500.0));
        for (t, r) in [(a, 100), (c, 50), (blind, 100)] {
            n.release(&t, r);
        }
        assert!(n.budgets().is_empty());
    }

    #[test]
    fn kv_fraction_forms() {
        let frac = |usage: f64, k: Option<u64>| {
            configured(
                Some(Report {
                    kv_cache_usage: Some(usage),
                    ..rep(0.0, Some(1000.0))
                }),
                None,
                k,
            )
        };
        // Fraction plus a configured size: the request is sized.
        assert!(matches!(
            run(&[frac(0.5, Some(1000))], w(300, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[frac(0.5, Some(1000))], w(500, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // A size the node reports itself is used, ahead of the configured one.
        let reported = |usage: f64, k: Option<u64>| {
            let mut n = frac(usage, k);
            n.accept_report(
                Report {
                    kv_cache_tokens: Some(1000.0),
                    ..*n.fresh_report(1000, 3000).unwrap()
                },
                1000,
            );
            n
        };
        assert!(matches!(
            run(&[reported(0.5, None)], w(300, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[reported(0.5, Some(1_000_000))], w(500, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // Fraction alone: only an already-full cache excludes.
        assert!(matches!(
            run(&[frac(0.5, None)], w(1_000_000, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[frac(0.95, None)], w(1, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
    }

    /// The first-token forecast drains the queue at the rate the node was seen to sustain over
    /// seconds when an engine's counters taught one, not at the half-second peak the ranking
    /// uses (which a lumpy counter inflates); a configured capacity is the operator's word for
    /// both. The ranking's key is the same with or without the sustained rate.
    #[test]
    fn the_forecast_drains_at_the_sustained_rate() {
        let fleet = FleetWide {
            assumed_capacity: 1000.0,
            mean_request_tokens: 500.0,
        };
        let ask = Ask {
            weight: w(400, 0),
            growth: Growth {
                own: 0,
                margin_per_sqrt: 0.0,
                per_running: 0.0,
            },
            model: None,
            named: false,
            prefix: None,
            pin: None,
        };
        let report = |sustained: Option<f64>| Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(4000.0),
            sustained_tokens_per_sec: sustained,
            queue_depth: Some(2.0),
            ..Report::default()
        };
        let eval = |n: &NodeState, r: &Report| evaluate(0, n, r, &ask, &fleet, &P).0;
        let peak_only = eval(&node(Some(report(None))), &report(None));
        let sustained = eval(&node(Some(report(Some(400.0)))), &report(Some(400.0)));
        // 2 x 500 queued and 400 of its own: 0.35 s at 4000 tokens/s, 3.5 s at 400.
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(near(peak_only.first_token_seconds, 0.35), "{peak_only:?}");
        assert!(near(sustained.first_token_seconds, 3.5), "{sustained:?}");
        assert!(near(sustained.queued_seconds, 2.5), "{sustained:?}");
        assert_eq!(peak_only.seconds, sustained.seconds);
        let operator = configured(Some(report(Some(400.0))), Some(1000.0), None);
        let said = eval(&operator, &report(Some(400.0)));
        assert!(near(said.first_token_seconds, 1.4), "{said:?}");
    }

    /// Sequences another router sent grow too: a node reporting 40 running sequences and 60%
    /// KV use has no room for a request once their output still to come (half a mean output
    /// of 200 each) is counted, although this router's own books for it are empty.
    #[test]
    fn reported_running_sequences_count_as_growth() {
        let r = Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(1000.0),
            vram_used_bytes: Some(6000.0),
            vram_total_bytes: Some(10_000.0),
            running_requests: Some(40.0),
            ..Report::default()
        };
        let nodes = [node(Some(r))];
        let place = |per_running: f64| {
            let ask = Ask {
                weight: w(100, 100),
                growth: Growth {
                    own: 100,
                    margin_per_sqrt: 0.0,
                    per_running,
                },
                model: None,
                named: false,
                prefix: None,
                pin: None,
            };
            decide(&nodes, &ask, 100.0, 2000, &P, &mut SplitMix64::new(1))
        };
        // Without: 6000 + 200 of 10000 is under the 0.9 ceiling.
        assert!(matches!(place(0.0), Decision::Route(_)));
        // With: 6000 + 40 * 100 + 200 is over it.
        assert!(matches!(place(100.0), Decision::AllOverCeiling(_)));
    }
}
