//! Node state: what the filter knows about one GPU node between two health reports.
//!
//! Two sources are combined. The node's last good report is the ground truth at the moment it
//! was taken; it is trusted until it is older than the staleness limit, and a failed poll never
//! overwrites it. The filter's own in-flight accounting covers the gap between reports: every
//! request sent to the node is added at dispatch and removed when its stream ends, whatever the
//! outcome. Work dispatched *after* the last report is not in that report yet, so it is kept
//! apart ("unreflected") and added to the reported load by the choice; this is what stops the
//! herding that other routers suffer, where every request between two scrapes lands on the node
//! that looked idlest at the last scrape. The accounting is `books`': the node holds one
//! `Books` and changes it only by the `Change` of a dispatch, a stream's progress or its end,
//! as the shared books of every VM are changed (see `share`).
//!
//! The books also carry each in-flight request's expected output still to come ("growth"):
//! a report's KV use is what the running sequences hold now, and they keep growing by one
//! token of KV per generated token until they finish. Engines admit on the KV in use, so a balancer
//! that only compares the present use with a ceiling fills a node until its running sequences
//! outgrow the cache and the engine preempts (the VRAM overflow). Counting the growth still to
//! come is what makes the ceiling predictive.
//!
//! Health has hysteresis, as Envoy's own active health checking does (unhealthy_threshold,
//! healthy_threshold): a node is taken out of the choice after a number of failed polls in a
//! row, well before its last report goes stale, and comes back only after a number of good
//! polls in a row, so a flapping node does not swing traffic back and forth on every answer.
//!
//! The node also carries the models it serves (`models`), which the choice uses to keep a
//! request off nodes that would answer it 404 `model_not_found`, and its capacity is resolved
//! here once (`capacity`: configured, else reported, else the fleet's assumption).

use crate::fleet::books::{Books, Change};
use crate::fleet::models::ServedModels;
use crate::fleet::polling;
use crate::fleet::probe::{Probe, Seen, Step};
use crate::ingest::engine::{self, Counter, Engine, FormatError, Health, HealthFormat};
use crate::ingest::rates::Tracker;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;

/// A node's identity where slots are reused for other addresses (the balancer's node slots,
/// the shared books' keys): FNV-1a, 64 bits, of the address. Two addresses of one fleet
/// colliding is a 1 in 2^64 event per pair; a collision would only let one node's stale release
/// reach the other's books.
pub fn tenant_of(address: &str) -> u64 {
    address.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Proof of one dispatch, handed back at release so the books balance exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub node: usize,
    /// Who held the node's slot at dispatch (`tenant_of` its address): a slot reused for
    /// another address (membership churn) must not take the old one's release.
    pub tenant: u64,
    /// The balancer that booked it (`Balancer::generation`): a balancer built from a newer
    /// configuration never booked it, and its books must not take its progress or release.
    pub generation: u64,
    /// The node's report epoch at dispatch: if no report has arrived since, the request's work
    /// is still counted as unreflected and must be taken out of that sum too.
    pub epoch: u64,
    /// Expected cost: prompt tokens and the output expected (not the cap).
    pub weight: Weight,
    /// Output tokens booked as KV growth: a high estimate, since a request longer than
    /// expected is what overflows a cache packed to the mean.
    pub reserved_output: u64,
    /// Prompt tokens the node is believed to hold in its prefix cache (see
    /// `fleet::prefixes`): work it will not do, though their KV is still counted.
    pub cached: u64,
    /// The request's time-per-output-token budget (ms), held on its node while it runs
    /// (`NodeState::tightest_budget_ms`).
    pub tpot_ms: Option<u32>,
    /// Its record among the node's streams (`NodeState::streams`); 0 when it has none.
    pub stream: u32,
    /// The prompt as the filter estimated it from its text, before scaling to the engines'
    /// tokens (`route::prompt_scale`); 0 for a prompt of token ids or one with parts not
    /// estimated. Set by the caller after routing. (32 bits, where the ticket has room: a
    /// body is far below four billion tokens.)
    pub text_prompt: u32,
}

impl Ticket {
    /// Tokens of work the request costs its node: prompt and expected output, less the prompt
    /// tokens its prefix cache is believed to hold.
    pub fn work(&self) -> u64 {
        self.weight.total().saturating_sub(self.cached)
    }

    /// Prompt tokens its node has to prefill: the prompt less what is believed cached.
    pub fn prefill(&self) -> u64 {
        self.weight.prompt_tokens.saturating_sub(self.cached)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeState {
    address: String,
    /// Configured capacity, which wins over a reported one.
    capacity_override: Option<f64>,
    /// Configured KV-cache size in tokens.
    kv_cache_tokens: Option<u64>,
    /// What the node's health endpoint serves.
    format: HealthFormat,
    /// Where its telemetry is polled, found when not configured (see `probe`).
    probe: Probe,
    /// Counter memory between scrapes, for engines that publish counters instead of a load.
    tracker: Tracker,
    /// What is known of the models the node serves.
    models: ServedModels,
    /// The models changed since this was last asked (`take_models_changed`).
    models_changed: bool,
    /// The engine's cumulative prefix-cache counters at its last scrape: prompt tokens found
    /// cached, prompt tokens looked up (vLLM v1); `None` when it publishes none.
    engine_prefix: Option<(f64, f64)>,
    /// The engine's own recent prefix-cache hit rate at its last scrape, 0..1 (SGLang).
    engine_hit_rate: Option<f64>,
    report: Option<(Report, u64)>,
    /// The in-flight books; their epoch is the node's report epoch and their tenant
    /// `tenant_of(address)`, so a ticket can be matched to the node that issued it.
    books: Books,
    /// Health polls failed in a row (reset by a good one).
    failures_in_row: u32,
    /// Good reports in a row that moved nothing since the one before (`Report::quiet_since`)
    /// or showed room to spare (`Report::slack`), ended by any other answer: how much less
    /// often the node is polled (see `polling`).
    quiet_reports: u32,
    /// KV-cache use at or below which a report shows room to spare (`Report::slack`).
    slack_kv: f64,
    /// The polling periods: the tick and the longest period of a quiet node (`polling`).
    tick_ms: u64,
    quiet_poll_ms: u64,
    /// How much longer than a tick the node waits for its next poll, for its quiet reports
    /// (`polling::grace_ms`): its report stays fresh that much longer (`fresh_report`). Taken
    /// from the poller with its report where another VM polls (`adopt_report`).
    grace_ms: u64,
    /// When a request sent here last failed there (Envoy served it on another node of the
    /// routing header: a refused or reset connection), ms: the node is out of the choice
    /// until a report taken after it (`fresh_report`).
    failed_at: Option<u64>,
    /// Good polls in a row (reset by a failed one).
    successes_in_row: u32,
    /// Taken out of the choice by failed polls, until enough good ones bring it back.
    ejected: bool,
    unhealthy_after: u32,
    healthy_after: u32,
    /// The last change of health not yet taken by the glue (for its stats and log).
    transition: Option<Transition>,
    /// A member of the Envoy cluster (see `membership`): a node that is not is never chosen,
    /// since override_host would ignore it.
    member: bool,
    /// Time per output token of the streams this filter saw complete there: a moving mean
    /// (seconds) and when it last moved (ms).
    tpot: Option<(f64, u64)>,
    /// The same, of the streams whose prompt alone is a long context there (`is_long`): each
    /// decode iteration reads the whole batch's context, so such a stream decodes slower than
    /// the short ones beside it, by its own context.
    tpot_long: Option<(f64, u64)>,
    /// The pace its streams decode at now, measured while they run (`observe_pace`): a moving
    /// mean (seconds a token) and when it last moved (ms).
    pace: Option<(f64, u64)>,
    /// The time-per-output-token budgets of this router's requests in flight there, lowest
    /// budget first.
    budgets: Vec<HeldBudget>,
    /// This router's streams in flight there, oldest first (`Stream`); at most `MAX_STREAMS`.
    streams: Vec<Stream>,
    /// Streams in flight there that found the record full (`MAX_STREAMS`) and have none.
    untracked: u64,
    /// The id of the last stream recorded.
    last_stream: u32,
}

/// One stream this router sent to a node, while it runs: its age and context, which tell how
/// much more of the node's KV it will take (`route::survival`, `choice::room_now`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    pub id: u32,
    /// Its prompt tokens, all of them (cached blocks are KV too).
    pub prompt: u64,
    /// Output tokens it has delivered.
    pub generated: u64,
    /// Its context as the node's latest report counts it in the KV in use, at least: its prompt
    /// and output when the report before came (a report is taken between the two), if its first
    /// token had come by then; else 0 (queued or prefilling, an engine reports no KV or only
    /// part of it).
    pub shown: u64,
    /// Its context when the latest report came, if its first token had come: what the next
    /// report will count at least.
    pub seen: u64,
}

impl Stream {
    /// Its first token has come.
    pub fn started(&self) -> bool {
        self.generated > 0
    }

    /// Its context now: prompt and output so far.
    pub fn context(&self) -> u64 {
        self.prompt.saturating_add(self.generated)
    }
}

/// Most streams recorded per node: past it the KV path is not known and the room-now check
/// counts half of their output (see `choice::room_now`). It bounds that check's cost, which
/// grows with the streams it follows (about 0.2 us each inside the `.wasm` under V8,
/// `examples/choice_cost.rs`); vLLM runs at most 256 sequences at a time by default.
pub const MAX_STREAMS: usize = 512;

/// KV-cache use at or below which a report shows room to spare, until the fleet sets it
/// (half the VRAM ceiling; this is half the default ceiling).
pub const DEFAULT_SLACK_KV: f64 = 0.45;

/// A time-per-output-token budget held on a node while its stream runs (`hold_budget`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeldBudget {
    /// The budget, ms a token.
    pub ms: u32,
    /// The request's expected output, tokens (which request it is, with `ms`).
    pub output: u32,
    /// The output its room is reckoned over, tokens: a short answer for its prompt (see
    /// `choice::prefill_room`).
    pub horizon: u32,
    /// The time per token (seconds) the node was expected to decode at when the request was
    /// sent there; `None` when nothing was known of it.
    pub expected_tpot: Option<f64>,
}

/// Weight of the newest stream in a node's time per output token.
const TPOT_ALPHA: f64 = 0.2;

/// The slower of two times per token, either of which may be unknown.
pub fn slower(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// Share of a node's KV cache a prompt takes alone to be a long context there: on an L4-like
/// node a prompt of 6,000 tokens (30% of its cache) adds about 10 ms to every decode
/// iteration, one of 300 tokens nothing measurable.
const LONG_CONTEXT_SHARE: f64 = 0.1;

/// A change of a node's health, for the stats and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Ejected,
    Readmitted,
}

/// A health poll's outcome, as the caller got it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Polled<'a> {
    /// A 200 within the read limit, and its body.
    Body(&'a [u8]),
    /// Anything else: no answer, another status, a body over the limit (see `Seen`).
    Failed(Seen),
}

/// What became of a health answer (`NodeState::on_health_answer`).
#[derive(Debug, Clone, PartialEq)]
pub struct Answered {
    /// The health poll it was, as `take_health` gives it; `None` when the answer was a step
    /// of discovery rather than a poll (`Step::Next`, `Step::NotFound`).
    pub result: Option<Result<Report, HealthError>>,
    /// What discovery makes of it (`Step::Poll` for a node whose path is known).
    pub step: Step,
}

/// Why a health answer did not update a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthError {
    UnknownNode,
    CallFailed,
    /// The answer could not be read in the node's format; the error says why.
    Unparsable(FormatError),
}

impl NodeState {
    pub fn new(
        address: &str,
        capacity_override: Option<f64>,
        kv_cache_tokens: Option<u64>,
    ) -> Self {
        NodeState {
            address: address.to_string(),
            capacity_override,
            kv_cache_tokens,
            format: HealthFormat::Auto,
            probe: Probe::new(None, true),
            tracker: Tracker::default(),
            models: ServedModels::default(),
            models_changed: false,
            engine_prefix: None,
            engine_hit_rate: None,
            report: None,
            books: Books::of(tenant_of(address)),
            failures_in_row: 0,
            quiet_reports: 0,
            slack_kv: DEFAULT_SLACK_KV,
            tick_ms: 0,
            quiet_poll_ms: 0,
            grace_ms: 0,
            failed_at: None,
            successes_in_row: 0,
            ejected: false,
            unhealthy_after: 2,
            healthy_after: 2,
            transition: None,
            member: true,
            tpot: None,
            tpot_long: None,
            pace: None,
            budgets: Vec::new(),
            streams: Vec::new(),
            untracked: 0,
            last_stream: 0,
        }
    }

    /// A stream completed on the node at `seconds` per output token (after its first); `long`:
    /// its prompt was a long context there (`is_long`).
    pub fn observe_tpot(&mut self, seconds: f64, long: bool, now_ms: u64) {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let moved = |figure: Option<(f64, u64)>| {
            let mean = match figure {
                Some((m, _)) => m + TPOT_ALPHA * (seconds - m),
                None => seconds,
            };
            Some((mean, now_ms))
        };
        self.tpot = moved(self.tpot);
        if long {
            self.tpot_long = moved(self.tpot_long);
        }
    }

    /// A stream running there delivered its last tokens at `seconds` a token.
    pub fn observe_pace(&mut self, seconds: f64, now_ms: u64) {
        if !(seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let mean = match self.pace {
            Some((m, _)) => m + TPOT_ALPHA * (seconds - m),
            None => seconds,
        };
        self.pace = Some((mean, now_ms));
    }

    /// The figures a time-per-token budget is compared with, each as (seconds a token, when
    /// it last moved, ms): the streams completed there, the long contexts among them, and the
    /// pace of the ones running (for the beliefs).
    pub fn decoding(&self) -> [Option<(f64, u64)>; 3] {
        [self.tpot, self.tpot_long, self.pace]
    }

    /// The pace the node's streams decode at now (seconds a token), if one was measured since
    /// `since_ms`.
    pub fn pace_since(&self, since_ms: u64) -> Option<f64> {
        self.pace.filter(|(_, at)| *at >= since_ms).map(|(m, _)| m)
    }

    /// Whether a prompt of `prompt_tokens` is a long context on the node: at least
    /// `LONG_CONTEXT_SHARE` of its KV cache (`cache_tokens`), when that is known.
    pub fn is_long(&self, prompt_tokens: u64, cache_tokens: Option<f64>) -> bool {
        cache_tokens.is_some_and(|c| prompt_tokens as f64 >= LONG_CONTEXT_SHARE * c)
    }

    /// The lowest time-per-output-token budget (ms) among this router's requests in flight
    /// there: the stream a new request's prefill must not slow past its budget.
    pub fn tightest_budget_ms(&self) -> Option<u64> {
        self.budgets.first().map(|b| u64::from(b.ms))
    }

    /// The budgets held there (`hold_budget`), lowest first.
    pub fn budgets(&self) -> &[HeldBudget] {
        &self.budgets
    }

    /// The node's time per output token (seconds), if a stream completed there since
    /// `since_ms`: an older figure says nothing of the batch it runs now.
    pub fn tpot_since(&self, since_ms: u64) -> Option<f64> {
        self.tpot.filter(|(_, at)| *at >= since_ms).map(|(m, _)| m)
    }

    /// The node's time per output token (seconds) from the streams completed there, however
    /// old: the best guess left when nothing recent is known.
    pub fn last_tpot(&self) -> Option<f64> {
        self.tpot.map(|(m, _)| m)
    }

    /// The time per output token a stream with a prompt of this kind (`long`) can expect
    /// there: the node's recent figure (`tpot_since`), and for a long context the slower of
    /// that and its long contexts' own, however old (what a long context costs a node's
    /// decoding is the node's, not its batch's of the moment, and such streams end there
    /// seldom).
    pub fn tpot_for(&self, long: bool, since_ms: u64) -> Option<f64> {
        let all = self.tpot_since(since_ms);
        let own = self.tpot_long.filter(|_| long).map(|(m, _)| m);
        slower(all, own)
    }

    /// Sets the hysteresis: ejected after `unhealthy_after` failed polls in a row, readmitted
    /// after `healthy_after` good ones (each at least 1).
    pub fn with_hysteresis(mut self, unhealthy_after: u32, healthy_after: u32) -> Self {
        self.unhealthy_after = unhealthy_after.max(1);
        self.healthy_after = healthy_after.max(1);
        self
    }

    /// Sets the KV-cache use at or below which a report shows room to spare (half the VRAM
    /// ceiling, `Fleet`): such a node is polled as a quiet one is.
    pub fn with_slack_kv(mut self, slack_kv: f64) -> Self {
        self.slack_kv = slack_kv;
        self
    }

    /// Sets the polling periods (`tick_ms`, `quiet_poll_ms`): when the node is polled
    /// (`poll_due`) and how much longer a quiet node's report stays fresh (`fresh_report`).
    /// Without them it is polled every time it is asked and goes stale as any other.
    pub fn with_polling(mut self, tick_ms: u64, quiet_poll_ms: u64) -> Self {
        self.tick_ms = tick_ms;
        self.quiet_poll_ms = quiet_poll_ms;
        self
    }

    /// Sets what the node's health endpoint serves.
    pub fn with_format(mut self, format: HealthFormat) -> Self {
        self.format = format;
        self
    }

    /// Sets where the node's telemetry is polled (see `probe`).
    pub fn with_probe(mut self, probe: Probe) -> Self {
        self.probe = probe;
        self
    }

    /// The format the node's health answers are read in.
    pub fn format(&self) -> HealthFormat {
        self.format
    }

    /// Whether the node is polled in a slice of its due at `now_ms` (see `polling::due`):
    /// every tick while its reports move with no room to spare or prompts sent there have not
    /// started (`prefilling`, asked only of a quiet node), less often while it is quiet or
    /// slack and runs nothing of this router's but streams already decoding. The periods are
    /// the node's own (`with_polling`), the ones its report's freshness is judged by.
    pub fn poll_due(&self, now_ms: u64, prefilling: impl FnOnce() -> bool) -> bool {
        polling::due(
            self.report.as_ref().map(|(_, at)| *at),
            self.quiet_reports,
            now_ms,
            self.tick_ms,
            self.quiet_poll_ms,
        ) || prefilling()
    }

    /// Whether the poller may be polling the node less often than every tick, as far as this
    /// VM knows: it is waiting a longer period (`grace_ms`), or its latest report shows room to
    /// spare, so the next one may let it (`Report::slack`). A worker that sends a prompt to
    /// such a node names it on the wake list (`share::wake`).
    pub fn polled_late(&self) -> bool {
        self.grace_ms > 0
            || self
                .report
                .as_ref()
                .is_some_and(|(r, _)| r.slack(self.slack_kv))
    }

    /// Good reports in a row that moved nothing or showed room to spare (see `poll_due`).
    pub fn quiet_reports(&self) -> u32 {
        self.quiet_reports
    }

    /// The path to poll the node's health at now (see `probe`).
    pub fn health_path(&self) -> &str {
        self.probe.path()
    }

    /// Where the node's telemetry is polled, and whether it was found.
    pub fn probe(&self) -> &Probe {
        &self.probe
    }

    /// Sets what is known of the models the node serves (a configured set).
    pub fn with_models(mut self, models: ServedModels) -> Self {
        self.models = models;
        self
    }

    /// Sets whether the node is a member of the cluster, as it starts.
    pub fn with_member(mut self, member: bool) -> Self {
        self.member = member;
        self
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// `tenant_of(address)`, kept so a ticket can be matched to the node that issued it.
    pub fn tenant(&self) -> u64 {
        self.books.tenant
    }

    /// Whether the node is a member of the Envoy cluster (see `membership`).
    pub fn member(&self) -> bool {
        self.member
    }

    /// The node joined (`true`) or left the cluster. A node that leaves drops its report, so
    /// that a node coming back is trusted only on a new one.
    pub fn set_member(&mut self, member: bool) {
        if self.member && !member {
            self.forget_report();
        }
        self.member = member;
    }

    /// Taken out of the choice by failed polls.
    pub fn ejected(&self) -> bool {
        self.ejected
    }

    /// Health polls failed in a row.
    pub fn failures_in_row(&self) -> u32 {
        self.failures_in_row
    }

    /// What is known of the models the node serves.
    pub fn models(&self) -> &ServedModels {
        &self.models
    }

    pub fn models_mut(&mut self) -> &mut ServedModels {
        &mut self.models
    }

    /// The configured KV-cache size in tokens.
    pub fn kv_cache_tokens(&self) -> Option<u64> {
        self.kv_cache_tokens
    }

    /// The node's KV-cache size in tokens, the one place it is resolved: the size `report`
    /// publishes (an engine's cache geometry) is exact; else its VRAM total at
    /// `kv_bytes_per_token`, as the VRAM check counts it; else (or without a report) the
    /// configured size.
    pub fn cache_tokens(&self, report: Option<&Report>, kv_bytes_per_token: u64) -> Option<f64> {
        let positive = |t: &f64| t.is_finite() && *t > 0.0;
        let published = report.and_then(|r| r.kv_cache_tokens.filter(positive));
        let from_vram = || {
            report
                .and_then(|r| r.vram_total_bytes)
                .map(|b| b / kv_bytes_per_token.max(1) as f64)
                .filter(positive)
        };
        published
            .or_else(from_vram)
            .or(self.kv_cache_tokens.map(|k| k as f64))
            .filter(positive)
    }

    /// Tokens per second the node serves at most: the configured capacity, else the one
    /// `report` gives, else `assumed`, the fleet's figure for nodes that report none (see
    /// `choice::AssumedCapacity`). The one place a node's capacity is resolved.
    pub fn capacity(&self, report: &Report, assumed: f64) -> f64 {
        self.known_capacity(report).unwrap_or(assumed)
    }

    /// Tokens per second the first-token forecast drains queued prompts at: the configured
    /// capacity, else the rate the node was seen to sustain (learned from an engine's counters
    /// over windows of seconds, see `ingest::rates`), else the capacity the choice ranks with.
    /// A capacity learned from an engine is a peak over half-second windows, which for an
    /// engine that counts a prompt when it is done (llama.cpp) is many times what it serves.
    pub fn forecast_rate(&self, report: &Report, assumed: f64) -> f64 {
        self.capacity_override
            .or(report.sustained_tokens_per_sec)
            .unwrap_or_else(|| self.capacity(report, assumed))
    }

    /// The capacity configured or reported, without the fleet's assumption.
    pub fn known_capacity(&self, report: &Report) -> Option<f64> {
        self.capacity_override.or(report.capacity_tokens_per_sec)
    }

    /// The node's in-flight books.
    pub fn books(&self) -> &Books {
        &self.books
    }

    /// Replaces the books' figures by `b`'s (the shared ones, read under the epoch rule):
    /// the next decision and dispatch start from them, and a ticket takes their epoch if it is
    /// newer. The books keep counting for this node's address.
    pub fn set_books(&mut self, b: &Books) {
        let epoch = self.books.epoch;
        self.books = Books {
            tenant: self.books.tenant,
            ..*b
        }
        .at_epoch(epoch);
    }

    /// A health answer: `Some(body)` for an HTTP 200, `None` for a failed or timed-out call or
    /// another status. The body is read in the node's format: the seed JSON is a report as it
    /// stands; an engine's metrics go through the node's tracker, which turns their counters
    /// into a rate. A good report replaces the old one; anything else leaves the last good
    /// report in place (and the tracker's baseline too). Discovery is not consulted: this is
    /// the poll of a known path (see `on_health_answer`).
    pub fn take_health(&mut self, body: Option<&[u8]>, now_ms: u64) -> Result<Report, HealthError> {
        match body {
            Some(body) => self.take_read(engine::read(self.format, body), now_ms),
            None => {
                let _ = self.note_failure();
                Err(HealthError::CallFailed)
            }
        }
    }

    /// The answer to a poll of `health_path()`: what discovery makes of it (see `probe`), and
    /// when it is a health poll, the report or the failure it is.
    pub fn on_health_answer(&mut self, polled: Polled<'_>, now_ms: u64) -> Answered {
        let (seen, read) = match polled {
            Polled::Body(body) => {
                let read = engine::read(self.format, body);
                (Seen::of_read(&read), Some(read))
            }
            Polled::Failed(seen) => (seen, None),
        };
        let step = self.probe.on_answer(seen, now_ms);
        let result = match step {
            Step::Poll | Step::Found(_) => Some(match read {
                Some(read) => self.take_read(read, now_ms),
                None => {
                    let _ = self.note_failure();
                    Err(HealthError::CallFailed)
                }
            }),
            Step::Next | Step::Unfiltered(_) | Step::NotFound(_) => None,
        };
        Answered { result, step }
    }

    /// A 200 answer as read in the node's format: a report, or a failed poll.
    fn take_read(
        &mut self,
        read: Result<Health, FormatError>,
        now_ms: u64,
    ) -> Result<Report, HealthError> {
        let report = match read {
            Ok(Health::Seed(report)) => report,
            Ok(Health::Engine(scrape)) => {
                let added = self.models.observe_metrics(&scrape.models);
                let engine = self.models.set_engine(scrape.engine);
                self.models_changed |= added || engine;
                self.engine_hit_rate = scrape.prefix_hit_rate;
                self.engine_prefix = scrape
                    .prefix_hits
                    .zip(scrape.prefix_queries)
                    .map(|(h, q)| (h.total, q.total));
                self.tracker.observe(&scrape, now_ms, self.kv_cache_tokens)
            }
            Err(e) => {
                let _ = self.note_failure();
                return Err(HealthError::Unparsable(e));
            }
        };
        let _ = self.accept_report(report, now_ms);
        Ok(report)
    }

    /// The engine's cumulative prefix-cache counters at its last scrape, tokens: (found
    /// cached, looked up); `None` when it publishes none.
    pub fn engine_prefix(&self) -> Option<(f64, f64)> {
        self.engine_prefix
    }

    /// The engine's count of prompt tokens at its last scrape, and the engine
    /// (`route::prompt_scale::EngineCounts`).
    pub fn engine_prompt_counter(&self) -> Option<(Engine, Counter)> {
        self.tracker.prompt_counter()
    }

    /// The engine's recent prefix-cache hit rate at its last scrape, 0..1, when it publishes
    /// a rate rather than counters (SGLang).
    pub fn engine_hit_rate(&self) -> Option<f64> {
        self.engine_hit_rate
    }

    /// Whether the models changed (names seen in the metrics, the engine learned) since this
    /// was last asked.
    pub fn take_models_changed(&mut self) -> bool {
        std::mem::take(&mut self.models_changed)
    }

    /// A good report replaces the previous one; work dispatched so far is now in it. An
    /// ejected node keeps its report fresh but stays out until enough good polls in a row.
    pub fn accept_report(&mut self, report: Report, now_ms: u64) -> Option<Transition> {
        let quiet = self
            .report
            .as_ref()
            .is_some_and(|(before, _)| report.quiet_since(before) || report.slack(self.slack_kv));
        self.quiet_reports = if quiet {
            self.quiet_reports.saturating_add(1)
        } else {
            0
        };
        self.grace_ms = polling::grace_ms(self.quiet_reports, self.tick_ms, self.quiet_poll_ms);
        self.report = Some((report, now_ms));
        self.next_epoch();
        self.failures_in_row = 0;
        self.successes_in_row = self.successes_in_row.saturating_add(1);
        if self.ejected && self.successes_in_row >= self.healthy_after {
            self.ejected = false;
            self.transition = Some(Transition::Readmitted);
            return self.transition;
        }
        None
    }

    /// A failed or unparsable poll: the last good report stays, but enough failures in a row
    /// take the node out of the choice before that report goes stale.
    pub fn note_failure(&mut self) -> Option<Transition> {
        self.quiet_reports = 0;
        self.grace_ms = 0;
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        self.successes_in_row = 0;
        if !self.ejected && self.failures_in_row >= self.unhealthy_after {
            self.ejected = true;
            self.transition = Some(Transition::Ejected);
            return self.transition;
        }
        None
    }

    /// A request sent here at or before `now_ms` could not be served here: Envoy's retries
    /// took it to another node (the node refused or reset the connection). Until a report
    /// taken after this, the node is out of the choice, so that requests stop going to a node
    /// that may have died without waiting for failed polls to eject it; and it is polled at
    /// the next tick, whatever its period.
    pub fn note_failed_request(&mut self, now_ms: u64) {
        self.failed_at = Some(self.failed_at.map_or(now_ms, |t| t.max(now_ms)));
        self.quiet_reports = 0;
        self.grace_ms = 0;
    }

    /// Whether a request failed here after the last report (`note_failed_request`): the node
    /// is out of the choice until the next one.
    pub fn failed_since_report(&self) -> bool {
        match (self.failed_at, &self.report) {
            (Some(f), Some((_, at))) => *at <= f,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// The last change of health since this was last asked.
    pub fn take_transition(&mut self) -> Option<Transition> {
        self.transition.take()
    }

    /// The last report, if it is younger than `stale_after_ms` past when it was due (a quiet
    /// node's report stays fresh for its longer poll period too: `fresh_until`), was taken
    /// after any request failed there (`note_failed_request`), and the node is neither
    /// ejected nor out of the cluster.
    pub fn fresh_report(&self, now_ms: u64, stale_after_ms: u64) -> Option<&Report> {
        if self.ejected || !self.member {
            return None;
        }
        match &self.report {
            Some((r, _))
                if self
                    .fresh_until(stale_after_ms)
                    .is_some_and(|until| now_ms <= until)
                    && !self.failed_since_report() =>
            {
                Some(r)
            }
            _ => None,
        }
    }

    /// Drops the last report and the counter baseline: the node has left the cluster, and
    /// if it comes back (perhaps restarted) only a new report is to be trusted.
    pub fn forget_report(&mut self) {
        self.report = None;
        self.tracker = Tracker::default();
        self.next_epoch();
    }

    /// A new report epoch: what was unreflected is in the new report (or gone with the old).
    fn next_epoch(&mut self) {
        self.books = self.books.at_epoch(self.books.epoch.saturating_add(1));
        self.shown_in_report();
    }

    /// When the last good report arrived.
    pub fn reported_at(&self) -> Option<u64> {
        self.report.as_ref().map(|(_, at)| *at)
    }

    /// The node's last report, whatever its age.
    pub fn last_report(&self) -> Option<&Report> {
        self.report.as_ref().map(|(r, _)| r)
    }

    /// The report epoch: grows with every report taken (and when the report is forgotten).
    pub fn epoch(&self) -> u64 {
        self.books.epoch
    }

    /// The last good report and when it was taken.
    pub fn report_taken(&self) -> Option<(Report, u64)> {
        self.report
    }

    /// The last moment the last report is fresh, in ms (see `fresh_report`): `stale_after_ms`
    /// after it was taken, and the node's poll grace (`polling::grace_ms`) on top.
    pub fn fresh_until(&self, stale_after_ms: u64) -> Option<u64> {
        self.reported_at().map(|at| {
            at.saturating_add(stale_after_ms)
                .saturating_add(self.grace_ms)
        })
    }

    /// How much longer than a tick the node waits for its next poll (see `fresh_until`).
    pub fn grace_ms(&self) -> u64 {
        self.grace_ms
    }

    /// Takes a report, its epoch and the node's poll grace from elsewhere (the fleet snapshot
    /// another VM publishes, see `share`): the node's state as the poller has it, without the
    /// polling. The epoch
    /// never goes back, and a newer one reflects the unreflected part (the epoch rule).
    pub fn adopt_report(&mut self, report: Option<(Report, u64)>, epoch: u64, grace_ms: u64) {
        self.report = report;
        self.grace_ms = grace_ms;
        let before = self.books.epoch;
        self.books = self.books.at_epoch(epoch);
        if self.books.epoch > before {
            self.shown_in_report();
        }
    }

    /// A new report: it was taken after the report before came (a poll is sent on a tick after
    /// the last answer; a worker behind the poller takes each snapshot in at its next request,
    /// which under the load where this matters is milliseconds later), so it counts at least
    /// the context each stream had then.
    fn shown_in_report(&mut self) {
        for s in &mut self.streams {
            s.shown = s.seen;
            if s.started() {
                s.seen = s.context();
            }
        }
    }

    /// Takes the poller's view of the node's health and membership.
    pub fn adopt_status(&mut self, ejected: bool, member: bool) {
        self.ejected = ejected;
        self.member = member;
    }

    /// Books a request, reserving `reserved_output` tokens of KV growth for it (its expected
    /// output, or more). The ticket's generation and cached tokens are the caller's to set.
    pub fn dispatch(&mut self, node: usize, weight: Weight, reserved_output: u64) -> Ticket {
        self.dispatch_cached(node, weight, reserved_output, 0)
    }

    /// `dispatch` of a request whose first `cached` prompt tokens the node is believed to hold
    /// in its prefix cache: they are not work, but still KV.
    pub fn dispatch_cached(
        &mut self,
        node: usize,
        weight: Weight,
        reserved_output: u64,
        cached: u64,
    ) -> Ticket {
        // Ids only grow (the record is searched by them); a node that has run out of them
        // (four billion streams) records no more.
        let stream = if self.streams.len() < MAX_STREAMS && self.last_stream < u32::MAX {
            self.last_stream = self.last_stream.saturating_add(1);
            self.streams.push(Stream {
                id: self.last_stream,
                prompt: weight.prompt_tokens,
                generated: 0,
                shown: 0,
                seen: 0,
            });
            self.last_stream
        } else {
            self.untracked = self.untracked.saturating_add(1);
            0
        };
        let ticket = Ticket {
            node,
            tenant: self.books.tenant,
            generation: 0,
            epoch: self.books.epoch,
            weight,
            reserved_output,
            cached,
            tpot_ms: None,
            stream,
            text_prompt: 0,
        };
        self.books = self.books.apply(&Change::dispatch(&ticket));
        ticket
    }

    /// This router's streams in flight on the node, oldest first; `None` when some have no
    /// record (more than `MAX_STREAMS`).
    pub fn streams(&self) -> Option<&[Stream]> {
        (self.untracked == 0).then_some(self.streams.as_slice())
    }

    /// The record of `ticket`'s stream, if it has one here.
    fn stream_of(&mut self, ticket: &Ticket) -> Option<&mut Stream> {
        let at = self
            .streams
            .binary_search_by_key(&ticket.stream, |s| s.id)
            .ok()?;
        self.streams.get_mut(at)
    }

    /// Holds `ticket`'s time-per-token budget on the node until its release, with the time
    /// per token (seconds) the node was expected to decode at when it was sent
    /// (`expected_tpot`; `None` when unknown) and the output its room is reckoned over
    /// (`horizon`, tokens).
    pub fn hold_budget(&mut self, ticket: &Ticket, expected_tpot: Option<f64>, horizon: u64) {
        if let (Some(ms), true) = (ticket.tpot_ms, ticket.tenant == self.books.tenant) {
            let output = u32::try_from(ticket.weight.output_tokens).unwrap_or(u32::MAX);
            let horizon = u32::try_from(horizon).unwrap_or(u32::MAX);
            let at = self.budgets.partition_point(|b| b.ms <= ms);
            let expected_tpot = expected_tpot.filter(|t| t.is_finite() && *t >= 0.0);
            self.budgets.insert(
                at,
                HeldBudget {
                    ms,
                    output,
                    horizon,
                    expected_tpot,
                },
            );
        }
    }

    /// The request's stream has delivered `before` output tokens so far and now `after`:
    /// that much of its expected growth has happened (and is in the node's KV use). A ticket
    /// of another tenant (the slot was given to another address since) changes nothing.
    pub fn progress(&mut self, ticket: &Ticket, before: u64, after: u64) {
        if ticket.tenant == self.books.tenant {
            self.books = self.books.apply(&Change::progress(ticket, before, after));
            if let Some(s) = self.stream_of(ticket) {
                s.generated = s.generated.max(after);
            }
        }
    }

    /// The request's stream ended; `received` is the output count `progress` was last given.
    pub fn release(&mut self, ticket: &Ticket, received: u64) {
        if ticket.tenant == self.books.tenant {
            self.books = self.books.apply(&Change::release(ticket, received));
            if ticket.stream == 0 {
                self.untracked = self.untracked.saturating_sub(1);
            } else if let Ok(at) = self.streams.binary_search_by_key(&ticket.stream, |s| s.id) {
                self.streams.remove(at);
            }
            let output = u32::try_from(ticket.weight.output_tokens).unwrap_or(u32::MAX);
            if let Some(at) = ticket.tpot_ms.and_then(|ms| {
                self.budgets
                    .iter()
                    .position(|b| b.ms == ms && b.output == output)
            }) {
                self.budgets.remove(at);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::engine::{self, FormatError};
    use crate::route::balancer::Balancer;
    use crate::route::testing::*;

    /// Each stream this router sends is recorded while it runs: its output as it streams, and
    /// its context as reports count it, one report behind (a report is taken after the one
    /// before came, so it counts at least what the streams held then).
    #[test]
    fn streams_are_recorded_while_they_run() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let a = n.dispatch(0, w(100, 50), 50);
        let b = n.dispatch(0, w(300, 50), 50);
        assert!(a.stream != 0 && b.stream != a.stream);
        n.progress(&a, 0, 10);
        let view = |n: &NodeState| -> Vec<(u64, u64, u64)> {
            n.streams()
                .unwrap()
                .iter()
                .map(|s| (s.prompt, s.generated, s.shown))
                .collect()
        };
        assert_eq!(view(&n), vec![(100, 10, 0), (300, 0, 0)]);
        n.accept_report(rep(0.0, None), 1000);
        n.progress(&a, 10, 20);
        // The first report after its first token counts nothing of it yet, the next the
        // context it had at the first.
        assert_eq!(view(&n), vec![(100, 20, 0), (300, 0, 0)]);
        n.adopt_report(Some((rep(0.0, None), 1250)), n.epoch() + 1, 0);
        assert_eq!(view(&n), vec![(100, 20, 110), (300, 0, 0)]);
        // A report of an epoch already taken changes nothing.
        n.adopt_report(Some((rep(0.0, None), 1250)), n.epoch(), 0);
        assert_eq!(view(&n), vec![(100, 20, 110), (300, 0, 0)]);
        n.release(&a, 20);
        assert_eq!(view(&n), vec![(300, 0, 0)]);
        // Another tenant's ticket, or one released twice, takes nothing off.
        n.release(&Ticket { tenant: 1, ..b }, 0);
        n.release(&a, 20);
        assert_eq!(view(&n), vec![(300, 0, 0)]);
        n.release(&b, 0);
        assert_eq!(n.streams().map(<[Stream]>::len), Some(0));
    }

    /// Past `MAX_STREAMS` a stream has no record, and the node's streams are not known until it
    /// ends.
    #[test]
    fn streams_past_the_record_leave_them_unknown_until_they_end() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let tickets: Vec<Ticket> = (0..=MAX_STREAMS)
            .map(|_| n.dispatch(0, w(1, 1), 1))
            .collect();
        assert_eq!(tickets.last().map(|t| t.stream), Some(0));
        assert!(n.streams().is_none());
        n.release(tickets.last().unwrap(), 0);
        assert_eq!(n.streams().map(<[Stream]>::len), Some(MAX_STREAMS));
    }

    /// A node's cache size: the engine's geometry first, then the VRAM total at the
    /// configured bytes a token, then the configured size; nothing unusable counts.
    #[test]
    fn the_cache_size_is_resolved_in_one_order() {
        let report = |tokens: Option<f64>, vram: Option<f64>| Report {
            kv_cache_tokens: tokens,
            vram_total_bytes: vram,
            ..rep(0.0, None)
        };
        let configured = NodeState::new("10.0.0.1:80", None, Some(300));
        let bare = NodeState::new("10.0.0.1:80", None, None);
        let cases = [
            (&configured, report(Some(100.0), Some(4000.0)), Some(100.0)),
            (&configured, report(None, Some(4000.0)), Some(200.0)),
            (&configured, report(None, None), Some(300.0)),
            (&configured, report(Some(0.0), Some(f64::NAN)), Some(300.0)),
            (&bare, report(None, Some(4000.0)), Some(200.0)),
            (&bare, report(Some(-1.0), None), None),
        ];
        for (i, (n, r, want)) in cases.into_iter().enumerate() {
            assert_eq!(n.cache_tokens(Some(&r), 20), want, "case {i}");
        }
    }

    fn w(p: u64, o: u64) -> Weight {
        Weight {
            prompt_tokens: p,
            output_tokens: o,
        }
    }

    fn report(load: f64) -> Report {
        Report {
            load_tokens_per_sec: load,
            ..Report::default()
        }
    }

    /// Quiet reports in a row lengthen the node's poll period; a report that moves, or a
    /// failed poll, brings it back to every tick.
    #[test]
    fn quiet_reports_lengthen_the_poll_period_until_something_moves() {
        let (tick, quiet) = (100, 400);
        let mut n = NodeState::new("10.0.0.1:8000", None, None).with_polling(tick, quiet);
        assert!(n.poll_due(0, || false), "never heard from");
        // Reports 100 ms apart; the time of the last one.
        let mut at = 0;
        let mut step = |n: &mut NodeState, load: f64| -> u64 {
            at += 100;
            n.accept_report(report(load), at);
            at
        };
        let t = step(&mut n, 0.0);
        assert_eq!(n.quiet_reports(), 0, "the first report moves from nothing");
        assert!(n.poll_due(t + 100, || false));
        let t = step(&mut n, 0.0);
        assert_eq!(n.quiet_reports(), 1);
        assert!(!n.poll_due(t + 100, || false));
        assert!(n.poll_due(t + 200, || false));
        step(&mut n, 0.0);
        let t = step(&mut n, 0.0);
        assert_eq!(n.quiet_reports(), 3);
        assert!(!n.poll_due(t + 300, || false) && n.poll_due(t + 400, || false));
        // Load moved: every tick again.
        let t = step(&mut n, 500.0);
        assert_eq!(n.quiet_reports(), 0);
        assert!(n.poll_due(t + 100, || false));
        let t = step(&mut n, 500.0);
        assert_eq!(n.quiet_reports(), 1);
        // Prompts not started there: every tick, however quiet its reports.
        assert!(!n.poll_due(t + 100, || false));
        assert!(n.poll_due(t + 100, || true));
        let _ = n.note_failure();
        assert_eq!(n.quiet_reports(), 0);
        assert!(n.poll_due(t + 1, || false));
    }

    /// A quiet node's report stays fresh for `stale_after_ms` past when its next one is due,
    /// however long its poll period (`polling::grace_ms`), so that polling it less often does
    /// not take it out of the choice; a report that moves, a failed poll or a failed request
    /// take the grace back.
    #[test]
    fn a_quiet_nodes_report_stays_fresh_until_its_next_poll_is_late() {
        let (tick, quiet, stale) = (100, 1600, 300);
        let mut n = NodeState::new("10.0.0.1:8000", None, None).with_polling(tick, quiet);
        // (load of the report taken at `at`, its grace, fresh until)
        let table = [
            (0.0, 0, 400),     // the first report moves from nothing
            (0.0, 100, 600),   // quiet once: polled two ticks on
            (0.0, 300, 900),   // four ticks
            (0.0, 700, 1400),  // eight ticks
            (0.0, 1500, 2300), // sixteen ticks: quiet_poll_ms
            (0.0, 1500, 2400), // no longer than quiet_poll_ms
            (500.0, 0, 1000),  // the load moved: every tick, fresh for stale_after_ms
        ];
        for (i, (load, grace, until)) in table.into_iter().enumerate() {
            let at = 100 * (i as u64 + 1);
            n.accept_report(report(load), at);
            assert_eq!(n.grace_ms(), grace, "report {i}");
            assert_eq!(n.fresh_until(stale), Some(until), "report {i}");
            assert!(n.fresh_report(until, stale).is_some(), "report {i}");
            assert!(n.fresh_report(until + 1, stale).is_none(), "report {i}");
        }
        // Without the polling periods (a node built without them), no grace.
        let mut bare = NodeState::new("10.0.0.1:8000", None, None);
        bare.accept_report(report(0.0), 100);
        bare.accept_report(report(0.0), 200);
        assert_eq!((bare.quiet_reports(), bare.grace_ms()), (1, 0));
        // A failed poll, or a failed request, takes the grace back.
        for fail in [
            (|n: &mut NodeState| {
                let _ = n.note_failure();
            }) as fn(&mut NodeState),
            |n: &mut NodeState| n.note_failed_request(250),
        ] {
            let mut n = NodeState::new("10.0.0.1:8000", None, None).with_polling(tick, quiet);
            n.accept_report(report(0.0), 100);
            n.accept_report(report(0.0), 200);
            assert_eq!(n.grace_ms(), 100);
            fail(&mut n);
            assert_eq!((n.grace_ms(), n.fresh_until(stale)), (0, Some(500)));
        }
        // Taken with a report from the poller.
        let mut worker = NodeState::new("10.0.0.1:8000", None, None);
        worker.adopt_report(Some((report(0.0), 1000)), 5, 700);
        assert_eq!(worker.fresh_until(stale), Some(2000));
        assert!(worker.fresh_report(2000, stale).is_some());
    }

    /// A request that failed at the node takes it out of the choice until a report taken
    /// after the failure, and brings its polls back to every tick.
    #[test]
    fn a_failed_request_takes_the_node_out_until_a_later_report() {
        let mut n = NodeState::new("10.0.0.1:8000", None, None).with_polling(100, 400);
        n.accept_report(report(0.0), 1000);
        n.accept_report(report(0.0), 1100);
        assert_eq!(n.quiet_reports(), 1);
        assert!(n.fresh_report(1200, 3000).is_some());
        assert!(!n.failed_since_report());
        n.note_failed_request(1200);
        assert!(n.failed_since_report());
        assert_eq!(n.quiet_reports(), 0);
        assert!(n.poll_due(1250, || false));
        assert!(n.fresh_report(1250, 3000).is_none());
        // A report from before the failure (a snapshot taken earlier) does not bring it back.
        n.adopt_report(Some((report(0.0), 1150)), 7, 0);
        assert!(n.fresh_report(1250, 3000).is_none());
        // One taken after it does.
        n.accept_report(report(0.0), 1300);
        assert!(n.fresh_report(1300, 3000).is_some());
        assert!(!n.failed_since_report());
    }

    /// Reports that move but show room to spare (`Report::slack`) lengthen the period as quiet
    /// ones do, under the fleet's limit; one past it brings the node back to every tick.
    #[test]
    fn reports_with_room_to_spare_lengthen_the_poll_period_though_they_move() {
        let (tick, quiet) = (100, 400);
        let mut n = NodeState::new("10.0.0.1:8000", None, None)
            .with_slack_kv(0.3)
            .with_polling(tick, quiet);
        let busy = |running: f64, kv: f64| Report {
            load_tokens_per_sec: 1000.0 * running,
            capacity_tokens_per_sec: Some(20_000.0),
            kv_cache_usage: Some(kv),
            queue_depth: Some(0.0),
            running_requests: Some(running),
            ..Report::default()
        };
        n.accept_report(busy(1.0, 0.1), 100);
        n.accept_report(busy(3.0, 0.2), 200);
        n.accept_report(busy(2.0, 0.15), 300);
        assert_eq!(n.quiet_reports(), 2);
        assert!(!n.poll_due(400, || false));
        assert!(n.poll_due(700, || false));
        // KV use past the limit: every tick.
        n.accept_report(busy(4.0, 0.35), 700);
        assert_eq!(n.quiet_reports(), 0);
        assert!(n.poll_due(800, || false));
        // The same report under the default limit (half the default ceiling) has room.
        let mut d = NodeState::new("10.0.0.1:8000", None, None);
        d.accept_report(busy(1.0, 0.1), 100);
        d.accept_report(busy(4.0, 0.35), 200);
        assert_eq!(d.quiet_reports(), 1);
    }

    /// (polls, expected ejected after each) for a node ejected after 2 failures and readmitted
    /// after 3 successes.
    #[test]
    fn hysteresis_table() {
        let cases: &[(&str, &[bool])] = &[
            // one failure is not enough; two in a row are
            ("ok x ok x x", &[false, false, false, false, true]),
            // back only after three good polls in a row; a failure restarts the count
            (
                "x x ok ok x ok ok ok",
                &[false, true, true, true, true, true, true, false],
            ),
            // a flapping node stays out once it is out
            (
                "x x ok x ok x ok",
                &[false, true, true, true, true, true, true],
            ),
        ];
        for (polls, expected) in cases {
            let mut n = NodeState::new("a", None, None).with_hysteresis(2, 3);
            n.accept_report(report(1.0), 0);
            let mut t = 0;
            for (poll, want) in polls.split(' ').zip(expected.iter()) {
                t += 100;
                let transition = if poll == "ok" {
                    n.accept_report(report(1.0), t)
                } else {
                    n.note_failure()
                };
                assert_eq!(n.ejected(), *want, "{polls}: after {t} ms");
                assert_eq!(n.fresh_report(t, 1_000).is_none(), *want, "{polls}");
                if let Some(tr) = transition {
                    assert_eq!(tr == Transition::Ejected, *want, "{polls}");
                }
            }
        }
    }

    #[test]
    fn freshness_follows_the_staleness_limit() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        assert!(n.fresh_report(0, 1000).is_none());
        n.accept_report(report(5.0), 100);
        for (now, fresh) in [(100, true), (1100, true), (1101, false), (50, true)] {
            assert_eq!(n.fresh_report(now, 1000).is_some(), fresh, "now={now}");
        }
        // One failed poll leaves the last report in use (below the ejection threshold).
        n.note_failure();
        assert_eq!(n.failures_in_row(), 1);
        assert_eq!(
            n.fresh_report(200, 1000).map(|r| r.load_tokens_per_sec),
            Some(5.0)
        );
        n.accept_report(report(6.0), 300);
        assert_eq!(n.failures_in_row(), 0);
        assert_eq!(n.reported_at(), Some(300));
    }

    /// A prompt of a tenth of the cache or more is a long context; long contexts keep their
    /// own time per token, which judges a long prompt (the slower of it and the node's, however
    /// old) and never a short one; the pace of the streams running there is believed while
    /// recent.
    #[test]
    fn long_contexts_and_running_streams_give_their_own_time_per_token() {
        let ms = |t: Option<f64>| t.map(|t| (t * 1000.0).round());
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        assert!(n.is_long(2_000, Some(20_000.0)));
        assert!(!n.is_long(1_999, Some(20_000.0)));
        assert!(
            !n.is_long(1_000_000, None),
            "a cache of unknown size: nothing is long"
        );
        n.observe_tpot(0.020, false, 0);
        assert_eq!(
            ms(n.tpot_for(true, 0)),
            Some(20.0),
            "no long context seen yet"
        );
        n.observe_tpot(0.035, true, 10);
        // The node's figure moves by a fifth (20 -> 23 ms); the long contexts' is 35.
        assert_eq!(ms(n.tpot_for(false, 0)), Some(23.0));
        assert_eq!(ms(n.tpot_for(true, 0)), Some(35.0));
        assert_eq!(ms(n.tpot_for(false, 11)), None, "the node's figure is old");
        assert_eq!(
            ms(n.tpot_for(true, 11)),
            Some(35.0),
            "the long contexts' is not"
        );

        assert_eq!(n.pace_since(0), None);
        n.observe_pace(0.030, 100);
        n.observe_pace(0.040, 200);
        assert_eq!(ms(n.pace_since(150)), Some(32.0));
        assert_eq!(ms(n.pace_since(201)), None);
    }

    /// The tightest budget is the lowest held; a release takes its own budget off, once;
    /// a ticket of another tenant of the slot takes nothing off.
    #[test]
    fn the_tightest_time_per_token_budget_follows_the_streams_in_flight() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let book = |n: &mut NodeState, ms: Option<u32>| {
            let t = Ticket {
                tpot_ms: ms,
                ..n.dispatch(0, w(10, 10), 10)
            };
            n.hold_budget(&t, None, 10);
            t
        };
        let none = book(&mut n, None);
        assert_eq!(n.tightest_budget_ms(), None);
        let a = book(&mut n, Some(50));
        let b = book(&mut n, Some(30));
        let c = book(&mut n, Some(30));
        assert_eq!(n.tightest_budget_ms(), Some(30));
        n.release(&b, 10);
        assert_eq!(n.tightest_budget_ms(), Some(30), "c still runs at 30");
        let stranger = Ticket { tenant: 1, ..c };
        n.release(&stranger, 10);
        assert_eq!(n.tightest_budget_ms(), Some(30));
        n.release(&c, 10);
        n.release(&none, 10);
        assert_eq!(n.tightest_budget_ms(), Some(50));
        n.release(&a, 10);
        assert_eq!(n.tightest_budget_ms(), None);
    }

    #[test]
    fn inflight_books_balance_across_reports() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let a = n.dispatch(0, w(100, 10), 10);
        let b = n.dispatch(0, w(5, 5), 5);
        assert_eq!(
            (n.books().inflight_requests, n.books().inflight_tokens),
            (2, 120)
        );
        assert_eq!(
            (n.books().unreflected_requests, n.books().unreflected_tokens),
            (2, 120)
        );
        // A report now covers a and b.
        n.accept_report(report(1.0), 10);
        assert_eq!(
            (n.books().unreflected_requests, n.books().unreflected_tokens),
            (0, 0)
        );
        let c = n.dispatch(0, w(1, 1), 1);
        n.progress(&a, 0, 10);
        n.release(&a, 10);
        assert_eq!(n.books().unreflected_tokens, 2, "a was reflected already");
        assert_eq!(n.books().unreflected_prompt_tokens, 1);
        n.release(&c, 0);
        assert_eq!(n.books().unreflected_tokens, 0);
        n.progress(&b, 0, 2);
        n.release(&b, 2);
        assert_eq!(
            (
                n.books().inflight_requests,
                n.books().inflight_tokens,
                n.books().growth_tokens
            ),
            (0, 0, 0)
        );
        // Releasing twice never underflows.
        n.release(&b, 5);
        assert_eq!(
            (n.books().inflight_requests, n.books().inflight_tokens),
            (0, 0)
        );
    }

    #[test]
    fn growth_follows_the_reservation_not_the_expectation() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let t = n.dispatch(0, w(10, 100), 250);
        assert_eq!(n.books().growth_tokens, 250);
        n.progress(&t, 0, 120);
        assert_eq!(n.books().growth_tokens, 130);
        n.release(&t, 120);
        assert_eq!((n.books().growth_tokens, n.books().inflight_tokens), (0, 0));
    }

    #[test]
    fn growth_is_the_expected_output_still_to_come() {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        let a = n.dispatch(0, w(100, 50), 50);
        let b = n.dispatch(0, w(100, 20), 20);
        assert_eq!(n.books().growth_tokens, 70);
        n.progress(&a, 0, 30);
        assert_eq!(n.books().growth_tokens, 40);
        // Output past the expectation grows nothing the books hold.
        n.progress(&b, 0, 25);
        assert_eq!(n.books().growth_tokens, 20);
        n.release(&b, 25);
        assert_eq!(n.books().growth_tokens, 20);
        // A stream that ends early (aborted) returns what it never generated.
        n.release(&a, 30);
        assert_eq!(n.books().growth_tokens, 0);
    }

    #[test]
    fn capacity_is_configured_else_reported_else_assumed() {
        // (configured, reported, want) with 50 assumed for the fleet.
        let cases = [
            (Some(600.0), Some(900.0), 600.0),
            (Some(600.0), None, 600.0),
            (None, Some(900.0), 900.0),
            (None, None, 50.0),
        ];
        for (configured, reported, want) in cases {
            let n = NodeState::new("a", configured, None);
            let r = Report {
                capacity_tokens_per_sec: reported,
                ..report(1.0)
            };
            assert_eq!(n.capacity(&r, 50.0), want, "{configured:?} {reported:?}");
        }
    }

    /// Books taken from shared memory may hold anything: booking on top of them saturates.
    #[test]
    fn books_at_the_top_of_the_range_saturate() {
        let mut n = NodeState::new("a", None, None);
        let full = Books {
            epoch: 0,
            tenant: 0,
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
        n.set_books(&full);
        assert_eq!(
            n.books().tenant,
            tenant_of("a"),
            "the books stay this node's"
        );
        let t = n.dispatch(0, w(u64::MAX, u64::MAX), u64::MAX);
        assert_eq!(
            *n.books(),
            Books {
                tenant: tenant_of("a"),
                ..full
            }
        );
        n.progress(&t, 0, 10);
        n.release(&t, 10);
        assert_eq!(n.books().inflight_requests, u64::MAX - 1);
    }

    /// A ticket of another tenant (the slot's former address) changes nothing.
    #[test]
    fn a_ticket_of_another_tenant_changes_nothing() {
        let mut old = NodeState::new("10.0.0.1:80", None, None);
        let t = old.dispatch(0, w(10, 10), 10);
        let mut n = NodeState::new("10.0.0.2:80", None, None);
        n.dispatch(0, w(5, 5), 5);
        let before = *n.books();
        n.progress(&t, 0, 5);
        n.release(&t, 5);
        assert_eq!(*n.books(), before);
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
                sustained_tokens_per_sec: None,
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
}
