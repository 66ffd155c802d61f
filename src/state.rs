//! What the root context and its requests share in one VM (`State`), and how a routing
//! decision reaches a request: the routing header set and counted, or the request answered
//! by the filter itself (`place`), now or, for a held request, once it is admitted
//! (`admit_held`).
//!
//! One VM is single-threaded, so the state is an `Rc<RefCell<..>>` that every context of the
//! VM holds (`Shared`); a callback that finds it borrowed (it never should) or empty (no
//! configuration) does nothing, which leaves the request to Envoy's own balancer.

use crate::host::Host;
use crate::metrics::{Metrics, NodeStat, Stat};
use crate::roles::Role;
use log::info;
use std::cell::RefCell;
use std::rc::Rc;
use token_balancer_core::config::{Config, UnknownModel};
use token_balancer_core::explain::{Asked, Decision, Detail, Route, Verdict};
use token_balancer_core::fleet::node::Ticket;
use token_balancer_core::ingest::prompt::Chain;
use token_balancer_core::ingest::request::Weight;
use token_balancer_core::rng::SplitMix64;
use token_balancer_core::route::admission::{Held, HoldQueue};
use token_balancer_core::route::balancer::{Balancer, Outcome};
use token_balancer_core::route::choice::Pin;
use token_balancer_core::share::stored::{self, Stored};
use token_balancer_core::share::sync::Reads;
use token_balancer_core::share::Change;

/// The state of one VM's plugin configuration.
pub struct State<H> {
    pub host: H,
    /// Shared with the requests by reference count: no per-request copies of its strings.
    pub config: Rc<Config>,
    pub balancer: Balancer,
    pub rng: SplitMix64,
    pub metrics: Metrics<H>,
    /// Requests waiting for a node with VRAM room (see `admission`).
    pub held: HoldQueue<Placement>,
    /// Requests that left the hold queue to be answered by the filter, let go during another
    /// stream's callback: they are answered from the root context (see `Replies`).
    pub unanswered: Vec<(Held<Placement>, Outcome)>,
    /// The queue that wakes the root context to answer them (`None`: the next tick does).
    pub wake_queue: Option<u32>,
    /// What this VM does besides routing, with that role's own state.
    pub role: Role,
    /// The prompt ratio last recorded in its gauge, in thousandths (0: none yet): the gauge
    /// is moved when the ratio has moved by `PROMPT_RATIO_STEP`, not at every answer.
    pub prompt_permille: u64,
}

/// How far (thousandths) the learned prompt ratio moves before its gauge is recorded again.
pub const PROMPT_RATIO_STEP: u64 = 10;

/// The state every context of a VM holds; `None` until the plugin is configured.
pub type Shared<H> = Rc<RefCell<Option<State<H>>>>;

/// Where a held request finds its placement once it is admitted: written by whichever
/// callback admits it (a tick, a health answer, another request's end), read by the request.
pub type Placement = Rc<RefCell<Waiting>>;

/// A held request, as its admission needs it.
#[derive(Debug, Default)]
pub struct Waiting {
    /// The request asked for its explanation from an allowed source.
    pub explain: bool,
    /// Its placement, once it is admitted.
    pub placed: Option<Placed>,
}

/// A routed request's booking and decision.
#[derive(Debug, Default)]
pub struct Placed {
    pub ticket: Option<Ticket>,
    /// What was decided, for the debug header and the explanation; none when a host call
    /// failed (`fallback.internal`).
    pub decision: Option<Decision>,
    /// The filter answered the request itself: it must not be resumed.
    pub answered: bool,
}

impl<H: Host> State<H> {
    /// The state of a newly configured VM; `seed` starts its random sequence.
    pub fn new(host: H, config: Config, role: Role, seed: u64) -> State<H> {
        let metrics = Metrics::define(
            host.clone(),
            config.nodes.iter().map(|n| n.address.as_str()),
        );
        let mut balancer = Balancer::new(&config);
        // Unique to this VM: every worker's VM registers its own.
        let wake_queue = host.register_queue(&format!("token_balancer.wake.{seed:016x}"));
        // A reader's placements are published for the other workers' prefix indexes.
        balancer.keep_placements(matches!(role, Role::Reader(_)));
        State {
            host,
            balancer,
            rng: SplitMix64::new(seed),
            metrics,
            held: HoldQueue::new(config.max_held_requests, config.max_hold_ms)
                .with_max_bytes(config.admission.max_held_bytes)
                .when_full(config.admission.when_full),
            unanswered: Vec::new(),
            wake_queue,
            config: Rc::new(config),
            role,
            prompt_permille: 0,
        }
    }

    /// Says what was configured (one line).
    pub fn log_configured(&self) {
        let c = &self.config;
        match self.role {
            Role::Reader(_) => info!(
                "token-balancer configured: {} nodes, read from the poller service's snapshot",
                c.nodes.len()
            ),
            Role::Service(..) => info!(
                "token-balancer poller service configured: {} nodes, health via cluster {:?} every {} ms",
                c.nodes.len(),
                c.health_cluster,
                c.tick_ms
            ),
            Role::Vm(_) => info!(
                "token-balancer configured: {} nodes, health via cluster {:?} every {} ms",
                c.nodes.len(),
                c.health_cluster,
                c.tick_ms
            ),
        }
    }

    /// Applies a routing outcome to the effective request: sets the routing header and counts
    /// it, or answers the request itself. `model` is the body's; `held_ms` is how long the
    /// request waited in the hold queue, if it did; `reads` are the shared-books reads its
    /// decision made (the dispatch is written from the chosen node's); `explain`: the request
    /// asked for its explanation from an allowed source (a reply of the filter's own carries
    /// it at once).
    pub fn place(
        &mut self,
        outcome: Outcome,
        cap: Weight,
        model: Option<&str>,
        held_ms: Option<u64>,
        reads: Reads,
        explain: bool,
    ) -> Placed {
        let decided = |verdict| Some(Decision { verdict, held_ms });
        match outcome {
            Outcome::Routed {
                ticket,
                header_value,
                predicted_seconds,
                over_ceiling,
                inflight_before,
                compared,
                choices,
            } => {
                if self
                    .host
                    .set_request_header(&self.config.routing_header, &header_value)
                    .is_err()
                {
                    // Without the header Envoy balances on its own; undo the booking.
                    self.balancer.release(&ticket, 0);
                    self.metrics.bump(Stat::FallbackInternal);
                    return Placed::default();
                }
                self.metrics.bump(Stat::Routed);
                let known = reads.take(ticket.node);
                self.share(&ticket, Change::dispatch(&ticket), known);
                self.wake(ticket.node);
                self.metrics.shift(Stat::InflightNow, 1);
                self.metrics.bump_node(ticket.node, NodeStat::Picks);
                if self.balancer.prefixes().is_some() {
                    let (prompt, cached) = (ticket.weight.prompt_tokens, ticket.cached);
                    self.metrics.add(Stat::PrefixPromptTokens, prompt);
                    self.metrics.add(Stat::PrefixCachedTokens, cached);
                    self.metrics
                        .add_node(ticket.node, NodeStat::PromptTokens, prompt);
                    self.metrics
                        .add_node(ticket.node, NodeStat::CachedTokens, cached);
                }
                if over_ceiling {
                    self.metrics.bump(Stat::RoutedOverVramCeiling);
                    if held_ms.is_some() {
                        self.metrics.bump(Stat::HeldRoutedOverCeiling);
                    }
                }
                // Kept, not rendered: only a response that is to carry it renders it.
                let decision = decided(Verdict::Routed(Route {
                    header_value: header_value.into(),
                    weight: ticket.weight,
                    cached_tokens: ticket.cached,
                    output_cap: cap.output_tokens,
                    predicted_seconds,
                    inflight_before: u64::from(inflight_before),
                    over_ceiling,
                    compared,
                    choices: usize::from(choices),
                    served_by: None,
                }));
                Placed {
                    ticket: Some(ticket),
                    decision,
                    answered: false,
                }
            }
            Outcome::UnknownModel if self.config.unknown_model == UnknownModel::Reject => {
                let body = model_not_found_body(model.unwrap_or_default());
                let asked = Asked {
                    model,
                    weight: Some(cap),
                };
                self.answer(
                    Answer::UnknownModel,
                    404,
                    body,
                    None,
                    asked,
                    held_ms,
                    explain,
                )
            }
            Outcome::Shed { retry_after_ms } => {
                self.refuse(Answer::Shed, retry_after_ms, cap, model, held_ms, explain)
            }
            Outcome::Full {
                retry_after_ms,
                fits,
            } => {
                let why = if fits { Answer::Full } else { Answer::TooLarge };
                self.refuse(why, retry_after_ms, cap, model, held_ms, explain)
            }
            Outcome::TooLate { retry_after_ms } => {
                let why = if held_ms.is_some() {
                    Answer::LateWhileHeld
                } else {
                    Answer::Late
                };
                self.refuse(why, retry_after_ms, cap, model, held_ms, explain)
            }
            Outcome::UnknownModel => {
                self.metrics.bump(Stat::FallbackUnknownModel);
                Placed {
                    ticket: None,
                    decision: decided(Verdict::Fallback("unknown_model")),
                    answered: false,
                }
            }
            Outcome::NoFreshNodes | Outcome::Saturated | Outcome::Oversized => {
                self.metrics.bump(Stat::FallbackNoFreshNodes);
                Placed {
                    ticket: None,
                    decision: decided(Verdict::Fallback("no_fresh_nodes")),
                    answered: false,
                }
            }
        }
    }

    /// Envoy's response to a routed request came from the node at `upstream` (its retries
    /// walk down the routing header past a node that refused or reset it): the booking moves
    /// there, in this balancer and in the shared books, and the prompt's placement with it
    /// (`Balancer::moved`). Returns the ticket to follow from now on; `None` when the response
    /// came from the chosen node (or from one the filter does not know).
    pub fn served_by(&mut self, ticket: &Ticket, upstream: &str, chain: &Chain) -> Option<Ticket> {
        let moved = self.balancer.moved(ticket, upstream, chain)?;
        // The chosen node refused or reset the request: none of this VM's requests go there
        // until a report taken after this shows it answering.
        let now = self.host.now_ms();
        self.balancer.note_failed_request(ticket.node, now);
        self.share(ticket, Change::release(ticket, 0), None);
        self.share(&moved, Change::dispatch(&moved), None);
        self.wake(moved.node);
        self.publish_placements(now);
        self.metrics.bump(Stat::ServedElsewhere);
        Some(moved)
    }

    /// Where the response `id` is stored (`ingest::stored`): the pin of a request that names
    /// it, counted as found or unknown. `None` for an id this Envoy has not seen answered (or
    /// whose slot a later one took), or stored at a node no longer in the fleet.
    pub fn pin_for(&mut self, id: &str) -> Option<Pin> {
        let slots = self.config.stored_responses.slots;
        let found = match stored::find(&mut self.host, slots, id) {
            Ok(found) => found,
            Err(_) => {
                self.metrics.bump(Stat::SharedFailed);
                None
            }
        };
        let pin = found.and_then(|s| self.balancer.pin_to(&s));
        self.metrics.bump(if pin.is_some() {
            Stat::StoredFound
        } else {
            Stat::StoredUnknown
        });
        pin
    }

    /// The nodes to ask where a stored response this Envoy has not seen is (see `asking`), on
    /// the fleet the poller last shared; and whether that brought new reports.
    pub fn nodes_to_ask(&mut self, now_ms: u64) -> (Vec<String>, bool) {
        let (_, new_reports) = self.sync_fleet(now_ms);
        let most = self.config.stored_responses.ask_nodes as usize;
        let nodes = self.balancer.nodes_to_ask(now_ms, most, &mut self.rng);
        (nodes, new_reports)
    }

    /// Node `address` answered that it stores the response `id`, whose conversation has
    /// `context_tokens` so far: it is noted as if this Envoy had seen it stored, and the pin of
    /// a request continuing it is given (`None` for a node no longer in the fleet).
    pub fn found_stored(
        &mut self,
        id: &str,
        address: &str,
        context_tokens: u64,
        now_ms: u64,
    ) -> Option<Pin> {
        let entry = Stored {
            address: address.to_string(),
            context_tokens,
            prompt_tokens: 0,
            seen_ms: now_ms,
            ended_ms: now_ms,
        };
        self.note_stored(id, &entry);
        self.metrics.bump(Stat::StoredAskedFound);
        self.balancer.pin_to(&entry)
    }

    /// Notes that the response `id` is stored as `entry` says.
    pub fn note_stored(&mut self, id: &str, entry: &Stored) {
        let slots = self.config.stored_responses.slots;
        if stored::record(&mut self.host, slots, id, entry) {
            self.metrics.bump(Stat::StoredRecorded);
        } else {
            self.metrics.bump(Stat::SharedFailed);
        }
    }

    /// The address of the node `ticket` is booked on.
    pub fn address_of(&self, ticket: &Ticket) -> Option<String> {
        self.balancer
            .nodes()
            .get(ticket.node)
            .map(|n| n.address().to_string())
    }

    /// Whether `place` answers a request with this outcome itself (a local reply).
    fn answers(&self, outcome: &Outcome) -> bool {
        match outcome {
            Outcome::Shed { .. } | Outcome::TooLate { .. } | Outcome::Full { .. } => true,
            Outcome::UnknownModel => self.config.unknown_model == UnknownModel::Reject,
            _ => false,
        }
    }

    /// Answers the effective request with the configured status (429 or 503), a
    /// `Retry-After` of `retry_after_ms` rounded up to whole seconds (at least 1), and an
    /// OpenAI-shaped error body saying why (`why`: too late for its budget, or shed).
    fn refuse(
        &mut self,
        why: Answer,
        retry_after_ms: u64,
        cap: Weight,
        model: Option<&str>,
        held_ms: Option<u64>,
        explain: bool,
    ) -> Placed {
        let seconds = retry_after_ms.div_ceil(1000).max(1);
        let status = self.config.admission.reject_status;
        let body = refused_body(why, status, seconds);
        let asked = Asked {
            model,
            weight: Some(cap),
        };
        self.answer(why, status, body, Some(seconds), asked, held_ms, explain)
    }

    /// Sends the filter's own answer to the effective request and counts it; if Envoy will
    /// not take it, the request goes on to Envoy's balancer (`fallback.internal`).
    #[allow(clippy::too_many_arguments)]
    fn answer(
        &mut self,
        why: Answer,
        status: u32,
        body: Vec<u8>,
        retry_after_s: Option<u64>,
        asked: Asked,
        held_ms: Option<u64>,
        explain: bool,
    ) -> Placed {
        let decision = Decision {
            verdict: Verdict::Rejected(why.name()),
            held_ms,
        };
        let mut headers = vec![("content-type".to_string(), "application/json".into())];
        if let Some(s) = retry_after_s {
            headers.push(("retry-after".to_string(), s.to_string()));
        }
        headers.extend(self.told(&decision, asked, explain));
        let headers = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if self.host.send_response(status, headers, &body).is_err() {
            // Envoy would not take the answer: let its balancer route the request.
            self.metrics.bump(Stat::FallbackInternal);
            return Placed::default();
        }
        self.metrics.bump(why.stat());
        Placed {
            ticket: None,
            decision: Some(decision),
            answered: true,
        }
    }

    /// What the effective request's response tells of `decision`, as (header, value) pairs:
    /// the debug header when configured, the explanation when the request asked for it
    /// (`explain`) from an allowed source; the explanation also goes into the stream's filter
    /// state with `explain.access_log`.
    pub fn told(&self, decision: &Decision, asked: Asked, explain: bool) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(name) = &self.config.debug_header {
            out.push((name.clone(), decision.render(Detail::Brief, asked)));
        }
        if let Some(ex) = &self.config.explain {
            if explain || ex.access_log {
                let value = decision.render(Detail::Full(self.config.policy), asked);
                if ex.access_log {
                    self.host.set_filter_state(FILTER_STATE_KEY, &value);
                }
                if explain {
                    out.push((ex.header.clone(), value));
                }
            }
        }
        out
    }
}

/// The filter-state key of a request's explanation with `explain.access_log`; Envoy's access
/// log prints it as `%FILTER_STATE(wasm.token_balancer.decision:PLAIN)%`.
pub const FILTER_STATE_KEY: &str = "token_balancer.decision";

/// Why the filter answers a request itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// No node serves its model (`unknown_model: reject`).
    UnknownModel,
    /// No node would give it its first token within its budget, on arrival.
    Late,
    /// Its budget ran out while it was held.
    LateWhileHeld,
    /// Below priority 0, it arrived at a saturated fleet (or a full hold queue).
    Shed,
    /// No node had room for it and it could wait no longer (`admission.when_full: reject`).
    Full,
    /// No node would hold it even with an empty cache (`admission.when_full: reject`); counted
    /// and named as `Full`, with its own message.
    TooLarge,
}

impl Answer {
    /// The reason, as the decision names it (debug header, explanation).
    fn name(self) -> &'static str {
        match self {
            Answer::UnknownModel => "unknown_model",
            Answer::Late | Answer::LateWhileHeld => "ttft_budget",
            Answer::Shed => "shed",
            Answer::Full | Answer::TooLarge => "full",
        }
    }

    fn stat(self) -> Stat {
        match self {
            Answer::UnknownModel => Stat::RejectedUnknownModel,
            Answer::Late => Stat::RejectedTtftBudget,
            Answer::LateWhileHeld => Stat::RejectedTtftBudgetHeld,
            Answer::Shed => Stat::RejectedShed,
            Answer::Full | Answer::TooLarge => Stat::RejectedFull,
        }
    }
}

/// The error body of a request refused for its budget or shed, in OpenAI's error shape
/// (OpenAI's own 429s carry `rate_limit_exceeded`; a 503 is a `server_error`).
fn refused_body(why: Answer, status: u32, retry_after_s: u64) -> Vec<u8> {
    let message = match why {
        Answer::Shed => format!(
            "The service is saturated and this request's priority may be shed; retry after {retry_after_s} s."
        ),
        Answer::Full => format!(
            "Every server's memory is full and this request could wait no longer for room; retry after {retry_after_s} s."
        ),
        Answer::TooLarge => "No server's memory can hold this request, even with nothing else running: its prompt and the output it may generate are too large. A shorter prompt or a lower max_tokens may fit.".to_string(),
        _ => format!(
            "No server can serve this request within its latency budget (time to first token, time per output token); retry after {retry_after_s} s."
        ),
    };
    let (kind, code) = if status == 429 {
        ("rate_limit_exceeded", "rate_limit_exceeded")
    } else {
        ("server_error", "service_unavailable")
    };
    serde_json::json!({"error": {
        "message": message,
        "type": kind,
        "param": null,
        "code": code,
    }})
    .to_string()
    .into_bytes()
}

/// vLLM's answer to a model it does not serve (OpenAI's error shape), as JSON.
fn model_not_found_body(model: &str) -> Vec<u8> {
    serde_json::json!({"error": {
        "message": format!("The model `{model}` does not exist."),
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }})
    .to_string()
    .into_bytes()
}

impl<H: Host> State<H> {
    /// Answers the held requests the queue shed to make room for a higher priority
    /// (`HoldQueue::push`), each in its own stream (see `let_go`).
    pub fn shed_held(
        &mut self,
        shed: Vec<Held<Placement>>,
        now: u64,
        current: u32,
        replies: Replies,
    ) {
        let shed = shed
            .into_iter()
            .map(|held| {
                let retry_after_ms =
                    self.held
                        .wait_ms(held.claim.priority, held.weight, &self.balancer, now);
                (held, Outcome::Shed { retry_after_ms })
            })
            .collect();
        self.let_go(shed, now, current, replies);
    }

    /// Lets requests out of the hold queue with their outcomes: each is placed in its own
    /// stream (`place`), its placement left for the request to adopt, and resumed unless the
    /// filter answered it. Envoy defers the resumption until this VM call returns, so no
    /// callback re-enters the VM here. `current` is the context this runs in, restored as the
    /// effective context afterwards. With `Replies::Later` the ones to be answered wait in
    /// `unanswered` for the root context, woken for them.
    fn let_go(
        &mut self,
        left: Vec<(Held<Placement>, Outcome)>,
        now: u64,
        current: u32,
        replies: Replies,
    ) {
        if left.is_empty() {
            return;
        }
        self.metrics.shift(Stat::HeldNow, -(left.len() as i64));
        let (later, now_too): (Vec<_>, Vec<_>) = left
            .into_iter()
            .partition(|(_, outcome)| replies == Replies::Later && self.answers(outcome));
        if !later.is_empty() {
            self.unanswered.extend(later);
            if let Some(queue) = self.wake_queue {
                self.host.wake(queue);
            }
        }
        self.release(now_too, now, current);
    }

    /// Answers the requests let go during another stream's callback (`Replies::Later`); from
    /// a root context callback.
    pub fn answer_unanswered(&mut self, now: u64, current: u32) {
        if let Some(queue) = self.wake_queue {
            self.host.drain_queue(queue);
        }
        let left = std::mem::take(&mut self.unanswered);
        self.release(left, now, current);
    }

    /// Takes a request waiting to be answered out of `unanswered` (its client left first).
    pub fn forget_unanswered(&mut self, id: u32) -> bool {
        let before = self.unanswered.len();
        self.unanswered.retain(|(h, _)| h.id != id);
        self.unanswered.len() < before
    }

    /// Places each request that left the queue in its own stream (see `let_go`).
    fn release(&mut self, left: Vec<(Held<Placement>, Outcome)>, now: u64, current: u32) {
        if left.is_empty() {
            return;
        }
        for (held, outcome) in left {
            if self.host.set_effective_context(held.id).is_err() {
                // The stream is gone without its end being seen: give the booking back.
                if let Outcome::Routed { ticket, .. } = &outcome {
                    self.balancer.release(ticket, 0);
                }
                continue;
            }
            let explain = held.payload.try_borrow().is_ok_and(|w| w.explain);
            let placed = self.place(
                outcome,
                held.weight,
                held.model.as_deref(),
                Some(now.saturating_sub(held.since_ms)),
                // Several may go at once, each changing the books the next read: no reuse.
                Reads::default(),
                explain,
            );
            let answered = placed.answered;
            if let Ok(mut waiting) = held.payload.try_borrow_mut() {
                waiting.placed = Some(placed);
            }
            if !answered {
                self.host.resume_request();
            }
        }
        let _ = self.host.set_effective_context(current);
    }
}

/// Whether the callback that lets held requests go may answer them itself now.
///
/// Envoy's proxy-wasm host stops the processing of the stream whose callback is running after
/// any local reply sent during it, whichever stream the reply was for (it raises one flag per
/// VM, `stopNextIteration`, that turns the callback's result into a stop). A request routed
/// in that callback would then never go upstream, and a response never reach its client. So
/// a stream's request and response callbacks answer no other stream: those answers wait for
/// the root context (`Later`), which a wake-up queue brings at once (the tick otherwise). Root
/// callbacks and a stream's `on_log`, whose results are not a filter status, answer `Now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replies {
    Now,
    Later,
}

/// Routes the held requests that now have a node (or have waited long enough, or can no
/// longer meet their budget) and lets them go (`State::let_go`). Called from the root's
/// callbacks and from a request's first token and end, which free room. `current` is the
/// context this runs in, and `replies` whether it may answer other streams now.
pub fn admit_held<H: Host>(state: &Shared<H>, current: u32, replies: Replies) {
    let Ok(mut guard) = state.try_borrow_mut() else {
        return;
    };
    let Some(s) = guard.as_mut() else { return };
    let answer = replies == Replies::Now && !s.unanswered.is_empty();
    let admit = !s.held.is_empty();
    if !(answer || admit) {
        return;
    }
    let now = s.host.now_ms();
    if answer {
        s.answer_unanswered(now, current);
    }
    if admit {
        let admitted = s.admit(now);
        s.let_go(admitted, now, current, replies);
    }
}
