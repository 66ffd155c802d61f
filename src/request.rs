//! One request through the filter (the HTTP context): headers, body, decision, response,
//! end.
//!
//! 1. Request headers: any client-supplied routing header is removed (clients never pick
//!    their node), and the request pauses for its body, unless it cannot be read: no body,
//!    a compressed one, or one whose content-length is over `max_body_bytes` (which streams on
//!    untouched from the start; waiting for the body callbacks would let one large read push
//!    the paused buffer past the listener's limit).
//! 2. Request body: buffered up to the limit, read into a weight and a model, and routed:
//!    the routing header is set and the request continues, or it is held while every node is
//!    full (it then goes on when a callback admits it, see `state::admit_held`), or the filter
//!    answers it (`unknown_model: reject`).
//! 3. Response: its headers say which node served it, and a request Envoy retried past the
//!    chosen node is booked where it runs (`State::served_by`); they carry the debug header
//!    when configured, and the explanation when the request asked for it from an allowed
//!    source (`explain`); its body's output tokens advance the request's booking (and, for a
//!    reader, the shared books every `SHARED_PROGRESS_STEP` tokens). A stream's chunks of one
//!    token event each are mostly counted unread (`OutputMeter::may_skim`).
//! 4. End (`on_log`, or the context dropped without it): the booking is released exactly
//!    once, a request still held leaves the queue, and the room freed may admit a held one.
//!
//! Every step that cannot decide continues the request untouched (fail-open).

use crate::asking::{Asking, Heard};
use crate::host::Host;
use crate::metrics::Stat;
use crate::state::{admit_held, Placement, Replies, Shared, State, Waiting};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;
use token_balancer_core::config::Config;
use token_balancer_core::explain::{self, Asked, Decision, Verdict};
use token_balancer_core::fleet::node::Ticket;
use token_balancer_core::ingest::claim::{self, Claim};
use token_balancer_core::ingest::prompt::Chain;
use token_balancer_core::ingest::request::{self, Api, Unreadable, Weight};
use token_balancer_core::ingest::response::OutputMeter;
use token_balancer_core::ingest::stored::{self, IdScan};
use token_balancer_core::route::admission::Held;
use token_balancer_core::route::balancer::{Outcome, Terms};
use token_balancer_core::route::choice::Pin;
use token_balancer_core::share::stored::Stored;
use token_balancer_core::share::sync::Reads;
use token_balancer_core::share::Change;

/// Output tokens a stream delivers between two writes of its progress to the shared books: a
/// write is two host calls, and per token that would be most of a stream's cost.
pub(crate) const SHARED_PROGRESS_STEP: u64 = 16;

/// Output tokens a stream delivers between two measures of its node's pace (the time per
/// token it decodes at now): enough for a millisecond clock to tell 20 ms a token from 30.
const PACE_STEP: u64 = 8;

pub struct Request<H: Host> {
    context_id: u32,
    host: H,
    state: Shared<H>,
    /// Set while the request is held, until its placement is adopted.
    placement: Option<Placement>,
    api: Api,
    ticket: Option<Ticket>,
    /// What was decided, rendered only for a response that is to carry it.
    decision: Option<Decision>,
    /// The request asked for its explanation from an allowed source.
    explain: bool,
    /// The body's model and estimate (with its cap), for the explanation.
    model: Option<String>,
    asked: Option<Weight>,
    /// The request's prompt chain, until its response says which node served it (the
    /// booking follows Envoy's retries there, see `on_http_response_headers`).
    chain: Chain,
    /// The routing decision is made (or given up); later body chunks pass straight through.
    decided: bool,
    /// Output observed in the response so far (`meter.progress()` when last read), and what
    /// the response has shown of its output.
    received: u64,
    meter: OutputMeter,
    /// The prompt's tokens as estimated from its text, before the engines' ratio scaled them
    /// (`Balancer::prompt_tokens`); `None` for a prompt of token ids. With the server's count
    /// of it, a sample of that ratio.
    prompt_estimate: Option<u64>,
    /// Output count last written to the shared books (reader role).
    shared_received: u64,
    /// Response chunks counted as one token event without being read (`OutputMeter::skim`),
    /// added to their counter once, when the stream ends.
    unread_chunks: u64,
    /// When the first output token was seen (for the node's time per output token).
    first_token_ms: Option<u64>,
    /// When the stream's pace was last measured, and its output count then (see `progress`).
    paced: Option<(u64, u64)>,
    /// The response was a 200 and its body reached its end: a complete sample of output
    /// length.
    status_ok: bool,
    completed: bool,
    /// The id the answer is stored under, while its first bytes may still tell it (a
    /// Responses request the engine is asked to store, see `ingest::stored`).
    id_scan: Option<IdScan>,
    /// That id and what is noted under it, once seen.
    stored: Option<(String, Stored)>,
    /// The nodes asked where the stored response the request names is, and what it is routed
    /// with once they answer (see `asking`).
    asking: Option<(Asking, Deferred)>,
}

/// A request naming a stored response this Envoy has not seen, as it is routed once the nodes
/// asked have answered.
#[derive(Debug)]
struct Deferred {
    /// The response's id.
    id: String,
    weight: Weight,
    model: Option<String>,
    chain: Chain,
    claim: Claim,
    bytes: u64,
    /// It has a body (a turn continuing the response); without, it is the response's poll or
    /// cancellation, routed at its headers.
    body: bool,
    /// When the nodes were asked: the wait counts against its first-token budget.
    asked_ms: u64,
}

impl<H: Host> Request<H> {
    pub fn new(context_id: u32, host: H, state: Shared<H>) -> Request<H> {
        Request {
            context_id,
            host,
            state,
            placement: None,
            api: Api::Other,
            ticket: None,
            decision: None,
            explain: false,
            model: None,
            asked: None,
            chain: Chain::NONE,
            decided: false,
            received: 0,
            meter: OutputMeter::new(),
            prompt_estimate: None,
            shared_received: 0,
            unread_chunks: 0,
            first_token_ms: None,
            paced: None,
            status_ok: false,
            completed: false,
            id_scan: None,
            stored: None,
            asking: None,
        }
    }

    /// The configuration; `None` when the plugin has none.
    fn config(&self) -> Option<Rc<Config>> {
        let guard = self.state.try_borrow().ok()?;
        guard.as_ref().map(|s| s.config.clone())
    }

    /// Runs `f` on the shared state; `None` when the plugin has no configuration.
    fn with<R>(&self, f: impl FnOnce(&mut State<H>) -> R) -> Option<R> {
        let mut guard = self.state.try_borrow_mut().ok()?;
        guard.as_mut().map(f)
    }

    /// Answers a GET of the beliefs path with the filter's beliefs as JSON; false when Envoy
    /// would not take the answer (the request then goes on as any other).
    fn answer_beliefs(&mut self) -> bool {
        let now = self.host.now_ms();
        let Some((body, new_reports)) = self.with(|s| {
            // A reader answers on the poller's latest fleet, as its next decision would.
            let (_, new_reports) = s.sync_fleet(now);
            (s.beliefs(now), new_reports)
        }) else {
            return false;
        };
        if new_reports {
            admit_held(&self.state, self.context_id, Replies::Later);
        }
        let headers = vec![
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ];
        self.decided = self.host.send_response(200, headers, &body).is_ok();
        self.decided
    }

    /// Asks the nodes where the stored response `d.id` is (see `asking`): `None` while they
    /// are asked, the request given back when none could be (`stored_responses.ask_nodes` is
    /// 0, no node has a fresh report, or no ask could be sent), to go on as it would have.
    fn ask(&mut self, d: Deferred) -> Option<Deferred> {
        let now = self.host.now_ms();
        let d = Deferred { asked_ms: now, ..d };
        let Some((config, (nodes, new_reports))) =
            self.with(|s| (s.config.clone(), s.nodes_to_ask(now)))
        else {
            return Some(d);
        };
        if new_reports {
            admit_held(&self.state, self.context_id, Replies::Later);
        }
        let Some(asking) = Asking::start(&self.host, &config, &d.id, nodes) else {
            return Some(d);
        };
        self.with(|s| s.metrics.bump(Stat::StoredAsked));
        self.asking = Some((asking, d));
        None
    }

    /// Routes a request the nodes were asked for (`d`), pinned to the node that stores its
    /// response (`pin`) or, found nowhere, as it would have gone, and lets it go on unless it
    /// is held.
    fn after_asking(&mut self, d: Deferred, pin: Option<Pin>) {
        let waited = self.host.now_ms().saturating_sub(d.asked_ms);
        let claim = Claim {
            ttft_ms: d.claim.ttft_ms.map(|ms| ms.saturating_sub(waited)),
            ..d.claim
        };
        let d = Deferred { claim, ..d };
        let action = match (d.body, pin) {
            (true, pin) => self.route(d.weight, d.model, d.chain, d.claim, d.bytes, pin),
            (false, Some(pin)) => {
                let none = Weight::default();
                self.route(none, None, Chain::NONE, Claim::default(), 0, Some(pin))
            }
            (false, None) => self.fallback("no_body", Stat::FallbackNoBody),
        };
        if action == Action::Continue {
            self.host.resume_request();
        }
    }

    fn fallback(&mut self, why: &'static str, stat: Stat) -> Action {
        self.decided = true;
        self.with(|s| s.metrics.bump(stat));
        self.decision = Some(Decision::fallback(why));
        Action::Continue
    }

    /// Decides where the request goes, on its claims (`claim`, see `route::admission`):
    /// routed, held while the fleet is saturated, or answered at once (too late for its
    /// budget, shed, or an unknown model). `bytes` is the body's size, held while it waits.
    /// A pinned request (it names a stored response) goes to that response's node.
    fn route(
        &mut self,
        weight: Weight,
        model: Option<String>,
        chain: Chain,
        claim: Claim,
        bytes: u64,
        pin: Option<Pin>,
    ) -> Action {
        let now = self.host.now_ms();
        // A reader decides on the poller's fleet and every worker's books, or not at all.
        let (usable, new_reports) = self.with(|s| s.sync_fleet(now)).unwrap_or((true, false));
        if new_reports {
            admit_held(&self.state, self.context_id, Replies::Later);
        }
        // Before the poller's first snapshot a request may wait for it (a cold start, see
        // `Balancer::warming`); a fleet lost later is not waited for.
        let warming = !usable
            && self
                .with(|s| s.held.may_hold() && s.balancer.warming(now))
                .unwrap_or(false);
        if !usable && !warming {
            return self.fallback("no_fleet", Stat::FallbackNoFleet);
        }
        self.decided = true;
        let id = self.context_id;
        let explain = self.explain;
        let step = self.with(|s| {
            let m = model.as_deref();
            // Whether the fleet is saturated for the request is asked whenever holding is on:
            // the queue then says whether it takes it (it may shed a lower priority for it,
            // or be full). A sheddable request is asked even with holding off, and so is every
            // request with `when_full: reject`: it is then answered, never routed over the
            // ceiling.
            let rejects = s.held.rejects_when_full();
            let terms = Terms {
                may_hold: s.held.holds() || claim.sheddable() || rejects,
                ttft_left_ms: claim.ttft_ms,
                tpot_ms: claim.tpot_ms,
                lane: s.held.others_active(claim.tenant, now),
                pin,
            };
            let (outcome, reads) = s.decide(weight, m, &chain, now, terms);
            // A request that cannot wait for room (the queue is full, or no node would hold it
            // even empty): answered with `when_full: reject` unless nothing is known yet,
            // routed over the ceiling now otherwise.
            let without_waiting = |s: &mut State<H>, reads: Reads, fits: bool| {
                if rejects && !s.balancer.warming(now) {
                    let retry_after_ms = s.held.wait_ms(claim.priority, weight, &s.balancer, now);
                    let full = Outcome::Full {
                        retry_after_ms,
                        fits,
                    };
                    return s.place(full, weight, m, None, reads, explain);
                }
                let terms = Terms {
                    may_hold: false,
                    ..terms
                };
                let (outcome, reads) = s.decide(weight, m, &chain, now, terms);
                s.place(outcome, weight, m, None, reads, explain)
            };
            let placed = match outcome {
                // Cold starts are waited out whatever the priority: nothing is known yet. A
                // request no node would hold even empty finds the fleet saturated too.
                Outcome::Saturated | Outcome::Oversized
                    if claim.sheddable() && !s.balancer.warming(now) =>
                {
                    let retry_after_ms = s.held.wait_ms(claim.priority, weight, &s.balancer, now);
                    let shed = Outcome::Shed { retry_after_ms };
                    s.place(shed, weight, m, None, reads, explain)
                }
                Outcome::Saturated => {
                    let placement: Placement = Rc::new(RefCell::new(Waiting {
                        explain,
                        placed: None,
                    }));
                    // The queue keeps its own copy of the model: held requests are few.
                    let held = Held::new(
                        id,
                        weight,
                        model.clone(),
                        chain.clone(),
                        now,
                        placement.clone(),
                    )
                    .claiming(claim, bytes)
                    .pinned(pin);
                    match s.held.push(held) {
                        Ok(shed) => {
                            s.metrics.bump(Stat::Held);
                            s.metrics.shift(Stat::HeldNow, 1);
                            // Lower priorities shed to make room for this one are answered.
                            s.shed_held(shed, now, id, Replies::Later);
                            return Err(placement);
                        }
                        // Full (in count or bytes), or holding off (a sheddable request at a
                        // cold start, or any with `when_full: reject`).
                        Err(_) => {
                            if s.held.holds() {
                                s.metrics.bump(Stat::HeldQueueFull);
                            }
                            without_waiting(s, reads, true)
                        }
                    }
                }
                // Waiting makes no room for it (see `Outcome::Oversized`).
                Outcome::Oversized => without_waiting(s, reads, false),
                outcome => s.place(outcome, weight, m, None, reads, explain),
            };
            if let Some(ticket) = &placed.ticket {
                s.held.served(claim.tenant, ticket.weight.total(), now);
            }
            Ok(placed)
        });
        // Kept for the explanation (moved, not copied).
        self.model = model;
        self.asked = Some(weight);
        self.chain = chain;
        match step {
            Some(Ok(placed)) => {
                self.ticket = self.with_text_prompt(placed.ticket);
                self.decision = placed.decision;
                if placed.answered {
                    // The local reply is on its way; the request goes no further.
                    Action::Pause
                } else {
                    Action::Continue
                }
            }
            Some(Err(placement)) => {
                // Held: whoever admits it sets the header and resumes the request.
                self.placement = Some(placement);
                Action::Pause
            }
            None => Action::Continue,
        }
    }

    /// The request's claims at admission (`ingest::claim`); an unreadable header is counted
    /// and ignored.
    fn claim(&mut self, user: Option<&str>) -> Claim {
        let Some(config) = self.config() else {
            return Claim::default();
        };
        let fair = self.with(|s| s.held.holds()).unwrap_or(false);
        let host = &self.host;
        let (claim, bad) = claim::read(&config.admission, fair, |h| host.request_header(h), user);
        if bad {
            self.with(|s| s.metrics.bump(Stat::AdmissionBadHeader));
        }
        claim
    }

    /// Takes over the placement of a request that was held, once it has been admitted.
    fn adopt(&mut self) {
        let Some(placement) = &self.placement else {
            return;
        };
        let placed = placement
            .try_borrow_mut()
            .ok()
            .and_then(|mut w| w.placed.take());
        if let Some(placed) = placed {
            self.ticket = self.with_text_prompt(placed.ticket);
            self.decision = placed.decision;
            self.placement = None;
        }
    }

    /// The stream ends: a request still held leaves the queue (nothing was booked for it).
    fn leave_queue(&mut self) {
        self.adopt();
        if self.placement.take().is_some() {
            let id = self.context_id;
            self.with(|s| {
                if s.held.remove(id).is_some() {
                    s.metrics.shift(Stat::HeldNow, -1);
                    s.metrics.bump(Stat::HeldClientGone);
                } else if s.forget_unanswered(id) {
                    // It had left the queue, to be answered from the root context.
                    s.metrics.bump(Stat::HeldClientGone);
                }
            });
        }
    }

    /// A chunk of an answer to be stored: once it tells the answer's id, the id is noted at
    /// the node that serves it (the prompt so far; the output is added at the end).
    fn scan_id(&mut self, chunk: &[u8]) {
        let Some(scan) = self.id_scan.as_mut() else {
            return;
        };
        if !scan.feed(chunk) {
            return;
        }
        let Some(id) = scan.id().map(str::to_string) else {
            return;
        };
        let ticket = self.ticket;
        let address = match ticket {
            Some(t) => self.with(|s| s.address_of(&t)).flatten(),
            None => self.host.upstream_address(),
        };
        let Some(address) = address else {
            return;
        };
        let prompt = ticket.map_or(0, |t| t.weight.prompt_tokens);
        let entry = Stored {
            address,
            context_tokens: prompt,
            prompt_tokens: prompt,
            seen_ms: self.host.now_ms(),
            ended_ms: 0,
        };
        self.with(|s| s.note_stored(&id, &entry));
        self.stored = Some((id, entry));
    }

    fn release(&mut self) {
        // A stored answer read whole: its conversation is now its prompt and its output.
        if let (Some((id, entry)), Some(ticket)) = (self.stored.take(), self.ticket) {
            if self.status_ok && self.completed {
                // The server's count when it gave one, else the output events seen.
                let output = self.meter.finish(true, true).unwrap_or(self.received);
                let ended = Stored {
                    context_tokens: ticket.weight.prompt_tokens.saturating_add(output),
                    ended_ms: self.host.now_ms(),
                    ..entry
                };
                self.with(|s| s.note_stored(&id, &ended));
            }
        }
        if let Some(ticket) = self.ticket.take() {
            let sample = self.meter.finish(self.status_ok, self.completed);
            // The books are released by the count they were advanced by, so they balance
            // exactly; the sample is the meter's (the server's own count when it gave one).
            let progressed = self.received;
            let written = self.shared_received;
            let unread = self.unread_chunks;
            // A stream seen whole gives its node's time per output token, after the first.
            let now = self.host.now_ms();
            let tpot = self
                .first_token_ms
                .filter(|_| self.status_ok && self.completed && progressed > 1)
                .map(|first| now.saturating_sub(first) as f64 / 1000.0 / (progressed - 1) as f64);
            let prompt = self
                .prompt_estimate
                .zip(self.meter.prompt_reported(self.status_ok, self.completed));
            self.with(|s| {
                if let Some(output) = sample {
                    s.balancer
                        .observe_output(ticket.weight.prompt_tokens, output);
                }
                if let Some((estimated, reported)) = prompt {
                    s.balancer
                        .observe_prompt(self.model.as_deref(), estimated, reported);
                    s.note_prompt_ratio();
                }
                if let Some(seconds) = tpot {
                    s.balancer.observe_tpot(&ticket, seconds, now);
                }
                s.balancer.release(&ticket, progressed);
                // The engine began to answer: a first token came, or a whole answer.
                let started = progressed > 0 || (self.status_ok && self.completed);
                s.share(&ticket, Change::ended(&ticket, written, started), None);
                s.metrics.shift(Stat::InflightNow, -1);
                s.metrics.add(Stat::OutputChunksUnread, unread);
            });
        }
    }
}

impl<H: Host> Context for Request<H> {
    /// The answer of a node asked where a stored response is (see `asking`).
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _: usize) {
        let Some((asking, _)) = self.asking.as_mut() else {
            return;
        };
        let pin = match asking.answer(&self.host, token, body_size) {
            Heard::Waiting => return,
            Heard::Nowhere => None,
            Heard::Found {
                address,
                context_tokens,
            } => {
                let now = self.host.now_ms();
                let id = self.asking.as_ref().map(|(_, d)| d.id.clone());
                id.and_then(|id| {
                    self.with(|s| s.found_stored(&id, &address, context_tokens, now))
                        .flatten()
                })
            }
        };
        if let Some((_, d)) = self.asking.take() {
            self.after_asking(d, pin);
        }
    }
}

impl<H: Host> HttpContext for Request<H> {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config() else {
            return Action::Continue;
        };
        let routing_header = config.routing_header.as_str();
        // Clients never pick their node: whatever they sent is dropped before anything else.
        if self.host.request_header(routing_header).is_some() {
            self.host.remove_request_header(routing_header);
            self.with(|s| s.metrics.bump(Stat::ClientRoutingHeaderRemoved));
        }
        if let Some(h) = &config.debug_header {
            self.host.remove_request_header(h);
        }
        // An explanation is asked for with its header, and given only to the configured
        // sources; the header never goes upstream.
        if let Some(ex) = &config.explain {
            if self.host.request_header(&ex.header).is_some() {
                self.host.remove_request_header(&ex.header);
                let source = self.host.source_address();
                let allowed = explain::allowed(&ex.sources, source.as_deref());
                self.explain = allowed;
                self.with(|s| {
                    s.metrics.bump(if allowed {
                        Stat::ExplainGranted
                    } else {
                        Stat::ExplainRefused
                    })
                });
            }
        }
        // The operator's beliefs path: looked at only where it is configured, so an ordinary
        // request on a listener without it costs no host call more.
        let mut path = None;
        if let Some(beliefs_path) = &config.beliefs_path {
            let p = self.host.request_header(":path").unwrap_or_default();
            if p == *beliefs_path
                && self
                    .host
                    .request_header(":method")
                    .is_some_and(|m| m == "GET")
                && self.answer_beliefs()
            {
                return Action::Pause;
            }
            path = Some(p);
        }
        // Header lookups one by one: inside Envoy an absent header costs 0.3 us and a present
        // one 1.4 us, while the whole map in one call costs 2 us with a handful of headers
        // and grows with every header a client sends.
        let path = path
            .or_else(|| self.host.request_header(":path"))
            .unwrap_or_default();
        // A request naming a stored response (its poll, its cancellation) goes to the node that
        // stores it, body or not; one this Envoy has not seen stored goes on as any other.
        if config.stored_responses.enabled {
            if let Some(id) = stored::path_id(&path) {
                if let Some(pin) = self.with(|s| s.pin_for(id)).flatten() {
                    let none = Weight::default();
                    return self.route(none, None, Chain::NONE, Claim::default(), 0, Some(pin));
                }
                // Not seen stored here: the nodes are asked, if it has no body to read.
                let d = Deferred {
                    id: id.to_string(),
                    weight: Weight::default(),
                    model: None,
                    chain: Chain::NONE,
                    claim: Claim::default(),
                    bytes: 0,
                    body: false,
                    asked_ms: 0,
                };
                if end_of_stream && self.ask(d).is_none() {
                    return Action::Pause;
                }
            }
        }
        match request::unreadable(
            end_of_stream,
            |h| self.host.request_header(h),
            config.max_body_bytes,
        ) {
            Some(Unreadable::NoBody) => return self.fallback("no_body", Stat::FallbackNoBody),
            Some(Unreadable::Encoded) => {
                return self.fallback("encoded_body", Stat::FallbackEncodedBody)
            }
            Some(Unreadable::OverLimit) => {
                return self.fallback("body_over_limit", Stat::FallbackBodyOverLimit)
            }
            None => {}
        }
        self.api = Api::from_path(&path);
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter config, or Envoy
        // stops all iteration and the body never comes (see docs/CONFIGURATION.md).
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let Some((limit, pricing, block_chars, session_header, follow_stored)) = self.with(|s| {
            (
                s.config.max_body_bytes,
                s.config.pricing(),
                s.balancer.chain_block_chars(),
                s.config.prefix.session_header.clone(),
                s.config.stored_responses.enabled,
            )
        }) else {
            return Action::Continue;
        };
        if body_size > limit {
            // Not buffered past the limit: the body streams on untouched.
            return self.fallback("body_over_limit", Stat::FallbackBodyOverLimit);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.host.request_body(body_size).unwrap_or_default();
        match request::read_with_chain(self.api, &body, &pricing, block_chars) {
            Some(mut e) => {
                // A prompt estimated from its text is counted in the engines' tokens, and
                // the engine's count of it is a sample of how, unless parts of it were not
                // estimated at all (images not priced, audio).
                if !e.ids {
                    let estimated = e.weight.prompt_tokens;
                    self.prompt_estimate = (!e.uncounted).then_some(estimated);
                    let model = e.model.as_deref();
                    if let Some(tokens) = self.with(|s| s.balancer.prompt_tokens(model, estimated))
                    {
                        e.weight.prompt_tokens = tokens;
                    }
                }
                // A session header is an affinity hint when the body gives none.
                let chain = match (&session_header, block_chars) {
                    (Some(h), Some(_)) => e
                        .chain
                        .with_hint(e.model.as_deref(), self.host.request_header(h).as_deref()),
                    _ => e.chain,
                };
                let claim = self.claim(e.user.as_deref());
                // A turn continuing a stored conversation goes where it is stored, priced with
                // it; an answer to be stored is followed for its id.
                let pin = match &e.continues {
                    Some(id) if follow_stored => self.with(|s| s.pin_for(id)).flatten(),
                    _ => None,
                };
                if follow_stored && e.stores {
                    self.id_scan = Some(IdScan::new());
                }
                // A turn continuing a response not seen stored here: the nodes are asked.
                if let (None, Some(id), true) = (pin, &e.continues, follow_stored) {
                    let d = Deferred {
                        id: id.clone(),
                        weight: e.weight,
                        model: e.model,
                        chain,
                        claim,
                        bytes: body_size as u64,
                        body: true,
                        asked_ms: 0,
                    };
                    let Some(d) = self.ask(d) else {
                        return Action::Pause;
                    };
                    return self.route(d.weight, d.model, d.chain, d.claim, d.bytes, None);
                }
                self.route(e.weight, e.model, chain, claim, body_size as u64, pin)
            }
            None => self.fallback("body_unusable", Stat::FallbackBodyUnusable),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.adopt();
        self.follow_upstream();
        self.status_ok = self
            .host
            .response_header(":status")
            .is_some_and(|s| s == "200");
        if let Some(decision) = &self.decision {
            let asked = Asked {
                model: self.model.as_deref(),
                weight: self.asked,
            };
            let headers = self
                .with(|s| s.told(decision, asked, self.explain))
                .unwrap_or_default();
            for (name, value) in headers {
                self.host.set_response_header(&name, &value);
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Only requests this filter routed feed the books; a chunk is read (or counted
        // unread), never held. An answer to be stored is read until its id is seen.
        let scanning = self.status_ok && self.id_scan.as_ref().is_some_and(IdScan::wants);
        if let Some(ticket) = self.ticket {
            if self.status_ok && body_size > 0 {
                // A chunk the size of the stream's single token events is counted unread,
                // which spares its copy into the VM (`OutputMeter::may_skim`).
                if !scanning && self.meter.may_skim(body_size, end_of_stream) {
                    self.meter.skim();
                    self.unread_chunks = self.unread_chunks.saturating_add(1);
                    self.progress(&ticket);
                } else if let Some(chunk) = self.host.response_body(body_size) {
                    self.meter.feed(&chunk);
                    self.scan_id(&chunk);
                    self.progress(&ticket);
                }
            }
            self.completed |= end_of_stream;
        } else if scanning && body_size > 0 {
            if let Some(chunk) = self.host.response_body(body_size) {
                self.scan_id(&chunk);
            }
        }
        if end_of_stream {
            if let Some(scan) = self.id_scan.as_mut() {
                scan.end();
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.leave_queue();
        self.release();
        // The room this stream held may let a held request go.
        admit_held(&self.state, self.context_id, Replies::Now);
    }
}

impl<H: Host> Request<H> {
    /// The response came from the node Envoy sent the request to: the chosen one, or a later
    /// one of the routing header if Envoy retried. A routed request's booking moves to the
    /// node that serves it (`State::served_by`), its debug header and explanation say where
    /// (`served_by=`), and the room it held on the chosen node may let a held request go. The
    /// prompt's chain is needed no longer.
    fn follow_upstream(&mut self) {
        let chain = std::mem::replace(&mut self.chain, Chain::NONE);
        let Some(ticket) = self.ticket else {
            return;
        };
        let Some(upstream) = self.host.upstream_address() else {
            return;
        };
        if let Some(moved) = self
            .with(|s| s.served_by(&ticket, &upstream, &chain))
            .flatten()
        {
            self.ticket = self.with_text_prompt(Some(moved));
            if let Some(Verdict::Routed(route)) = self.decision.as_mut().map(|d| &mut d.verdict) {
                route.served_by = Some(upstream);
            }
            admit_held(&self.state, self.context_id, Replies::Later);
        }
    }

    /// `ticket` with the prompt as estimated from its text, for the books' count of started
    /// prompts (`Ticket::text_prompt`).
    fn with_text_prompt(&self, ticket: Option<Ticket>) -> Option<Ticket> {
        let text_prompt = self
            .prompt_estimate
            .map_or(0, |e| u32::try_from(e).unwrap_or(u32::MAX));
        ticket.map(|t| Ticket { text_prompt, ..t })
    }

    /// A response chunk taken by the meter: its output events advance the booking, and a
    /// reader's shared books every `SHARED_PROGRESS_STEP` tokens (and once the reserved output
    /// is reached).
    fn progress(&mut self, ticket: &Ticket) {
        let before = self.received;
        self.received = self.meter.progress();
        if self.received > before {
            let (received, written) = (self.received, self.shared_received);
            let wrote = self
                .with(|s| {
                    s.balancer.progress(ticket, before, received);
                    let due = received.saturating_sub(written) >= SHARED_PROGRESS_STEP
                        || (received >= ticket.reserved_output && written < ticket.reserved_output);
                    if due {
                        s.share(ticket, Change::progress(ticket, written, received), None);
                    }
                    due
                })
                .unwrap_or(false);
            if wrote {
                self.shared_received = received;
            }
            // The first token: the prompt is prefilled, and the node's queue is shorter by it.
            if before == 0 {
                let now = self.host.now_ms();
                self.first_token_ms = Some(now);
                self.paced = Some((now, received));
                admit_held(&self.state, self.context_id, Replies::Later);
            } else if let Some((since, from)) = self.paced {
                // Every `PACE_STEP` tokens, the pace the node decodes at now, while budgets are
                // in use (a clock read each time).
                let tokens = received.saturating_sub(from);
                let wanted = || {
                    self.with(|s| s.balancer.paces_wanted(since))
                        .unwrap_or(false)
                };
                if tokens >= PACE_STEP && wanted() {
                    let now = self.host.now_ms();
                    let seconds = now.saturating_sub(since) as f64 / 1000.0 / tokens as f64;
                    self.paced = Some((now, received));
                    self.with(|s| s.balancer.observe_pace(ticket, seconds, now));
                }
            }
        }
    }
}

impl<H: Host> Drop for Request<H> {
    /// Belt and braces: a context destroyed without `on_log` still releases its booking.
    fn drop(&mut self) {
        self.leave_queue();
        self.release();
    }
}
