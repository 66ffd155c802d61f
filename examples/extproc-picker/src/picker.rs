//! One HTTP request's ext_proc messages, translated into calls of the decision core and back
//! into answers for Envoy (`Session::on_message`), on the picker's one balancer (`Picker`).
//!
//! This is the part of the Wasm filter's request path (`src/request.rs` and
//! `src/state.rs` of the filter) that an external picker can do, phase by phase:
//!
//! 1. Request headers: a client's copy of the routing header is removed (clients never pick
//!    their node), and a request whose body cannot be read (none, compressed, or announced
//!    over `max_body_bytes`) is left to Envoy's fallback balancer at once: the answer then
//!    also turns off this request's body and response phases (`mode_override`, which needs
//!    `allow_mode_override: true`), so Envoy neither buffers a body it would refuse past its
//!    buffer limit nor asks about a response nobody booked.
//! 2. Request body (buffered by Envoy): read with the core's request reader into a weight, a
//!    model and a prefix chain, and routed with `Balancer::route_on` on the picker's own books
//!    (`OwnBooks`, as the filter with `poller: vm`). A routed request gets the routing header
//!    (`ip:port[,ip:port...]`, the same value the filter writes); anything else gets no
//!    header, and Envoy's `override_host` fallback routes it (fail-open).
//! 3. Response headers: the request's booking is released (`Balancer::release`). The
//!    response body is not sent to the picker, so no output tokens are counted on the way
//!    and no output length is learned; a stream that ends without response headers (a reset)
//!    is released when its gRPC stream ends (`Session::end`).
//! 4. With `--follow-output` (Envoy sending the response body `STREAMED`), the picker follows
//!    the answer as the filter does instead: the booking stays through the response headers,
//!    each body message is read by the core's `OutputMeter` and advances the booking by the
//!    tokens it shows, and the last one releases it and teaches the balancer the output
//!    length. Each chunk of a streamed answer is then a message and an answer more.
//!
//! Not here, because an external picker would need more round trips for them and the
//! benchmark exercises none: holding requests while every node is full (a request over the
//! ceiling goes to the node that overflows least, as the filter does with holding off),
//! answering requests itself (429 for budgets, 404 for unknown models), the debug and
//! explanation headers, and the admission claims read from headers.
//!
//! Time comes in as `now_ms`, randomness from the picker's seeded `SplitMix64`: every answer
//! is reproducible in a test.

use crate::polls::Polls;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{
    BodySendMode, HeaderSendMode,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders, ProcessingRequest,
    ProcessingResponse, TrailersResponse,
};
use std::borrow::Cow;
use std::sync::{Mutex, MutexGuard, PoisonError};
use token_balancer_core::config::Config;
use token_balancer_core::fleet::node::Ticket;
use token_balancer_core::ingest::request::{self, Api};
use token_balancer_core::ingest::response::OutputMeter;
use token_balancer_core::rng::SplitMix64;
use token_balancer_core::route::balancer::{Balancer, Outcome, OwnBooks, Terms};

/// The picker's state: the configuration, the balancer the decisions and the health answers
/// go to, its polls, and what it counted. One per process, behind one mutex.
pub struct Picker {
    pub config: Config,
    pub balancer: Balancer,
    pub polls: Polls,
    rng: SplitMix64,
    pub counts: Counts,
    /// The routing header value of the last routed request (the benchmark checks that Envoy
    /// sent the request where it says).
    pub last_pick: Option<String>,
    /// Follow each answer's body (`--follow-output`) rather than release at its headers.
    pub follow_output: bool,
}

/// What the picker did, for its stats endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// ext_proc streams opened (one per HTTP request).
    pub streams: u64,
    /// Requests given the routing header.
    pub routed: u64,
    /// Requests left to Envoy's fallback balancer.
    pub fallback: u64,
    /// Bookings released.
    pub released: u64,
    /// Health polls answered with a usable report, and the others.
    pub health_ok: u64,
    pub health_failed: u64,
}

impl Picker {
    /// A picker for `config`, its randomness seeded with `seed`.
    pub fn new(config: Config, seed: u64) -> Picker {
        let balancer = Balancer::new(&config);
        let polls = Polls::new(&config);
        Picker {
            config,
            balancer,
            polls,
            rng: SplitMix64::new(seed),
            counts: Counts::default(),
            last_pick: None,
            follow_output: false,
        }
    }

    /// The counters and the last pick as JSON, for the stats endpoint.
    pub fn stats_json(&self) -> String {
        let c = &self.counts;
        serde_json::json!({
            "streams": c.streams,
            "routed": c.routed,
            "fallback": c.fallback,
            "released": c.released,
            "health_ok": c.health_ok,
            "health_failed": c.health_failed,
            "last_pick": self.last_pick,
        })
        .to_string()
    }
}

/// The picker behind its mutex. A thread that panicked while holding it (the release build
/// aborts instead) left it consistent enough to go on: every change is a single core call.
pub fn lock(picker: &Mutex<Picker>) -> MutexGuard<'_, Picker> {
    picker.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One HTTP request's ext_proc stream, between its messages.
#[derive(Debug, Default)]
pub struct Session {
    api: Option<Api>,
    /// The request went to the fallback (or was routed): later body messages pass untouched.
    decided: bool,
    /// The body so far, when Envoy sends it in more than one message.
    body: Vec<u8>,
    /// The session header's value, an affinity hint for the prefix chain.
    hint: Option<String>,
    ticket: Option<Ticket>,
    /// With `follow_output`: what the answer has shown of its output, the count the booking
    /// was last advanced to, and whether the answer is a 200.
    meter: OutputMeter,
    received: u64,
    status_ok: bool,
}

impl Session {
    pub fn new(picker: &mut Picker) -> Session {
        picker.counts.streams += 1;
        Session::default()
    }

    /// The answer to one message of the stream; `None` for a message that carries nothing.
    pub fn on_message(
        &mut self,
        picker: &mut Picker,
        msg: ProcessingRequest,
        now_ms: u64,
    ) -> Option<ProcessingResponse> {
        let reply = match msg.request? {
            Message::RequestHeaders(h) => return Some(self.on_request_headers(picker, &h)),
            Message::RequestBody(b) => {
                let mutation = self.on_request_body(picker, &b.body, b.end_of_stream, now_ms);
                Reply::RequestBody(BodyResponse {
                    response: Some(common(mutation)),
                })
            }
            Message::ResponseHeaders(h) => {
                if picker.follow_output {
                    self.status_ok = header(&h, ":status").is_some_and(|s| s == "200");
                } else {
                    self.end(picker);
                }
                Reply::ResponseHeaders(HeadersResponse {
                    response: Some(common(None)),
                })
            }
            Message::ResponseBody(b) => {
                if picker.follow_output {
                    self.on_response_body(picker, &b.body, b.end_of_stream);
                }
                Reply::ResponseBody(BodyResponse {
                    response: Some(common(None)),
                })
            }
            Message::RequestTrailers(_) => Reply::RequestTrailers(TrailersResponse::default()),
            Message::ResponseTrailers(_) => Reply::ResponseTrailers(TrailersResponse::default()),
        };
        Some(answer(reply))
    }

    /// The stream is over (response headers seen, or the stream ended without them): the
    /// booking, if any, is released, exactly once, by the output it was advanced by.
    pub fn end(&mut self, picker: &mut Picker) {
        if let Some(ticket) = self.ticket.take() {
            picker.balancer.release(&ticket, self.received);
            picker.counts.released += 1;
        }
    }

    /// A piece of the answer (`follow_output`): the output it shows advances the booking; the
    /// last piece of a 200 is a sample of output length, and ends the booking.
    fn on_response_body(&mut self, picker: &mut Picker, chunk: &[u8], end_of_stream: bool) {
        let Some(ticket) = self.ticket else {
            return;
        };
        if self.status_ok {
            self.meter.feed(chunk);
            let after = self.meter.progress();
            if after > self.received {
                picker.balancer.progress(&ticket, self.received, after);
                self.received = after;
            }
        }
        if end_of_stream {
            if let Some(output) = self.meter.finish(self.status_ok, true) {
                picker
                    .balancer
                    .observe_output(ticket.weight.prompt_tokens, output);
            }
            self.end(picker);
        }
    }

    fn on_request_headers(&mut self, picker: &mut Picker, h: &HttpHeaders) -> ProcessingResponse {
        let config = &picker.config;
        let mut removed = Vec::new();
        if header(h, &config.routing_header).is_some() {
            removed.push(config.routing_header.clone());
        }
        let mutation = (!removed.is_empty()).then(|| HeaderMutation {
            remove_headers: removed,
            ..HeaderMutation::default()
        });
        let unreadable = request::unreadable(
            h.end_of_stream,
            |name| header(h, name).map(Cow::into_owned),
            config.max_body_bytes,
        )
        .is_some();
        let mut out = answer(Reply::RequestHeaders(HeadersResponse {
            response: Some(common(mutation)),
        }));
        if unreadable {
            self.decided = true;
            picker.counts.fallback += 1;
            // Nothing more to do for this request: no body, no response phase.
            out.mode_override = Some(ProcessingMode {
                request_header_mode: HeaderSendMode::Send as i32,
                response_header_mode: HeaderSendMode::Skip as i32,
                request_body_mode: BodySendMode::None as i32,
                response_body_mode: BodySendMode::None as i32,
                request_trailer_mode: HeaderSendMode::Skip as i32,
                response_trailer_mode: HeaderSendMode::Skip as i32,
            });
            return out;
        }
        self.api = Some(Api::from_path(&header(h, ":path").unwrap_or_default()));
        if let Some(name) = &config.prefix.session_header {
            self.hint = header(h, name).map(Cow::into_owned);
        }
        out
    }

    /// A piece of the request body; the header mutation to send with its answer, if the
    /// request is routed now.
    fn on_request_body(
        &mut self,
        picker: &mut Picker,
        chunk: &[u8],
        end_of_stream: bool,
        now_ms: u64,
    ) -> Option<HeaderMutation> {
        if self.decided {
            return None;
        }
        if self.body.len().saturating_add(chunk.len()) > picker.config.max_body_bytes {
            self.decided = true;
            self.body = Vec::new();
            picker.counts.fallback += 1;
            return None;
        }
        self.body.extend_from_slice(chunk);
        if !end_of_stream {
            return None;
        }
        self.decided = true;
        let body = std::mem::take(&mut self.body);
        let api = self.api.unwrap_or(Api::Other);
        let block_chars = picker.balancer.chain_block_chars();
        let Some(e) = request::read_with_chain(api, &body, &picker.config.pricing(), block_chars)
        else {
            picker.counts.fallback += 1;
            return None;
        };
        let chain = match (&picker.config.prefix.session_header, block_chars) {
            (Some(_), Some(_)) => e.chain.with_hint(e.model.as_deref(), self.hint.as_deref()),
            _ => e.chain,
        };
        let Picker {
            balancer,
            rng,
            config,
            counts,
            last_pick,
            ..
        } = picker;
        let outcome = balancer.route_on(
            e.weight,
            e.model.as_deref(),
            &chain,
            now_ms,
            rng,
            Terms::default(),
            &mut OwnBooks,
        );
        match outcome {
            Outcome::Routed {
                ticket,
                header_value,
                ..
            } => {
                counts.routed += 1;
                self.ticket = Some(ticket);
                let set = set_header(&config.routing_header, &header_value);
                *last_pick = Some(header_value.into());
                Some(HeaderMutation {
                    set_headers: vec![set],
                    ..HeaderMutation::default()
                })
            }
            _ => {
                counts.fallback += 1;
                None
            }
        }
    }
}

/// A header of the message, by its (lower-case) name: Envoy sends values as `raw_value`
/// bytes, older versions as `value`.
fn header<'a>(h: &'a HttpHeaders, name: &str) -> Option<Cow<'a, str>> {
    let map = h.headers.as_ref()?;
    let v = map
        .headers
        .iter()
        .find(|v| v.key.eq_ignore_ascii_case(name))?;
    Some(if v.raw_value.is_empty() {
        Cow::Borrowed(v.value.as_str())
    } else {
        String::from_utf8_lossy(&v.raw_value)
    })
}

/// A header set to `value`, replacing any.
fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// Continue, with `mutation` if any. The route cache is left alone: `override_host` reads the
/// routing header when it picks the host, after the route was matched, and no route matches
/// on it.
fn common(mutation: Option<HeaderMutation>) -> CommonResponse {
    CommonResponse {
        header_mutation: mutation,
        ..CommonResponse::default()
    }
}

fn answer(reply: Reply) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(reply),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::envoy::service::ext_proc::v3::HttpBody;
    use token_balancer_core::fleet::node::Polled;

    const T0: u64 = 1_000_000;

    fn picker(nodes: &[&str]) -> Picker {
        let nodes: Vec<_> = nodes
            .iter()
            .map(|a| serde_json::json!({"address": a}))
            .collect();
        let config = serde_json::json!({"nodes": nodes, "health_cluster": "gpu_health"});
        let config = Config::parse(config.to_string().as_bytes()).unwrap();
        Picker::new(config, 7)
    }

    fn report(p: &mut Picker, node: usize, now_ms: u64) {
        let body = br#"{"tokens_per_sec_load": 100, "tokens_per_sec_capacity": 5000,
                        "kv_cache_usage": 0.1, "queue_depth": 0}"#;
        let a = p
            .balancer
            .on_health_answer(node, Polled::Body(body), now_ms);
        assert!(matches!(a.result, Some(Ok(_))), "{a:?}");
    }

    fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect();
        ProcessingRequest {
            request: Some(Message::RequestHeaders(HttpHeaders {
                headers: Some(HeaderMap { headers }),
                end_of_stream,
                ..HttpHeaders::default()
            })),
            ..ProcessingRequest::default()
        }
    }

    fn post() -> ProcessingRequest {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
            ],
            false,
        )
    }

    fn body(bytes: &[u8]) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Message::RequestBody(HttpBody {
                body: bytes.to_vec(),
                end_of_stream: true,
            })),
            ..ProcessingRequest::default()
        }
    }

    fn response_headers() -> ProcessingRequest {
        let mut r = headers(&[(":status", "200")], false);
        if let Some(Message::RequestHeaders(h)) = r.request.take() {
            r.request = Some(Message::ResponseHeaders(h));
        }
        r
    }

    const CHAT: &[u8] =
        br#"{"model":"m","max_tokens":16,"messages":[{"role":"user","content":"hello there"}]}"#;

    fn common_of(r: &ProcessingResponse) -> &CommonResponse {
        match &r.response {
            Some(Reply::RequestHeaders(h)) | Some(Reply::ResponseHeaders(h)) => {
                h.response.as_ref().unwrap()
            }
            Some(Reply::RequestBody(b)) => b.response.as_ref().unwrap(),
            other => panic!("not a headers or body answer: {other:?}"),
        }
    }

    /// The routing header the answer sets, if any.
    fn routed_to(r: &ProcessingResponse) -> Option<String> {
        let m = common_of(r).header_mutation.as_ref()?;
        let set = m.set_headers.iter().find_map(|o| o.header.as_ref())?;
        assert_eq!(set.key, "x-gateway-destination-endpoint");
        Some(String::from_utf8(set.raw_value.clone()).unwrap())
    }

    #[test]
    fn request_headers_continue_without_a_mutation_and_wait_for_the_body() {
        let mut p = picker(&["10.0.0.1:8000"]);
        let mut s = Session::new(&mut p);
        let r = s.on_message(&mut p, post(), T0).unwrap();
        assert!(
            matches!(r.response, Some(Reply::RequestHeaders(_))),
            "{r:?}"
        );
        let c = common_of(&r);
        assert_eq!(c.status, 0, "CONTINUE");
        assert!(c.header_mutation.is_none() && !c.clear_route_cache);
        assert!(r.mode_override.is_none(), "the body is still wanted");
        assert_eq!(p.counts.fallback, 0);
    }

    #[test]
    fn a_body_is_routed_to_a_node_that_reported_and_counted_in_flight() {
        let mut p = picker(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        // Only the second node has reported: it is the only fresh one.
        report(&mut p, 1, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0 + 5).unwrap();
        let r = s.on_message(&mut p, body(CHAT), T0 + 6).unwrap();
        assert!(matches!(r.response, Some(Reply::RequestBody(_))), "{r:?}");
        assert_eq!(routed_to(&r).as_deref(), Some("10.0.0.2:8000"));
        assert!(!common_of(&r).clear_route_cache);
        assert_eq!(p.counts.routed, 1);
        assert_eq!(p.last_pick.as_deref(), Some("10.0.0.2:8000"));
        let books = p.balancer.books(1).unwrap();
        assert_eq!(books.inflight_requests, 1);
    }

    #[test]
    fn without_reports_the_body_gets_no_mutation_and_falls_back() {
        let mut p = picker(&["10.0.0.1:8000", "10.0.0.2:8000"]);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        let r = s.on_message(&mut p, body(CHAT), T0 + 1).unwrap();
        assert!(matches!(r.response, Some(Reply::RequestBody(_))), "{r:?}");
        assert!(common_of(&r).header_mutation.is_none(), "{r:?}");
        assert_eq!((p.counts.routed, p.counts.fallback), (0, 1));
        assert!(p.last_pick.is_none());
    }

    #[test]
    fn a_report_gone_stale_routes_nothing() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let later = T0 + p.config.stale_after_ms + 1;
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), later).unwrap();
        let r = s.on_message(&mut p, body(CHAT), later).unwrap();
        assert_eq!(routed_to(&r), None);
        assert_eq!(p.counts.fallback, 1);
    }

    #[test]
    fn an_unreadable_body_gets_no_mutation() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        let r = s.on_message(&mut p, body(b"not json"), T0).unwrap();
        assert_eq!(routed_to(&r), None);
        assert_eq!((p.counts.routed, p.counts.fallback), (0, 1));
    }

    #[test]
    fn response_headers_release_the_booking_once() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        let r = s.on_message(&mut p, body(CHAT), T0).unwrap();
        assert_eq!(routed_to(&r).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 1);
        let r = s.on_message(&mut p, response_headers(), T0 + 3).unwrap();
        assert!(
            matches!(r.response, Some(Reply::ResponseHeaders(_))),
            "{r:?}"
        );
        assert!(common_of(&r).header_mutation.is_none());
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 0);
        assert_eq!(p.counts.released, 1);
        // The stream's end after that releases nothing more.
        s.end(&mut p);
        assert_eq!(p.counts.released, 1);
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 0);
    }

    fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(Message::ResponseBody(HttpBody {
                body: bytes.to_vec(),
                end_of_stream,
            })),
            ..ProcessingRequest::default()
        }
    }

    #[test]
    fn following_output_the_booking_advances_by_each_token_and_ends_with_the_body() {
        let mut p = picker(&["10.0.0.1:8000"]);
        p.follow_output = true;
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        s.on_message(&mut p, body(CHAT), T0).unwrap();
        let growth = |p: &Picker| p.balancer.books(0).unwrap().growth_tokens;
        let reserved = growth(&p);
        assert!(reserved >= 3, "{reserved}");
        s.on_message(&mut p, response_headers(), T0 + 1).unwrap();
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 1, "kept");
        let event = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        for _ in 0..3 {
            let r = s
                .on_message(&mut p, response_body(event, false), T0 + 2)
                .unwrap();
            assert!(matches!(r.response, Some(Reply::ResponseBody(_))), "{r:?}");
        }
        assert_eq!(reserved - growth(&p), 3);
        s.on_message(&mut p, response_body(b"data: [DONE]\n\n", true), T0 + 3)
            .unwrap();
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 0);
        assert_eq!(p.counts.released, 1);
        s.end(&mut p);
        assert_eq!(p.counts.released, 1, "once");
    }

    #[test]
    fn a_stream_that_ends_without_a_response_releases_its_booking() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        s.on_message(&mut p, body(CHAT), T0).unwrap();
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 1);
        s.end(&mut p);
        assert_eq!(p.balancer.books(0).unwrap().inflight_requests, 0);
        assert_eq!(p.counts.released, 1);
    }

    #[test]
    fn a_client_routing_header_is_removed() {
        let mut p = picker(&["10.0.0.1:8000"]);
        let mut s = Session::new(&mut p);
        let msg = headers(
            &[
                (":path", "/v1/chat/completions"),
                ("x-gateway-destination-endpoint", "10.9.9.9:1"),
            ],
            false,
        );
        let r = s.on_message(&mut p, msg, T0).unwrap();
        let m = common_of(&r).header_mutation.as_ref().unwrap();
        assert_eq!(m.remove_headers, vec!["x-gateway-destination-endpoint"]);
        assert!(m.set_headers.is_empty());
    }

    #[test]
    fn requests_whose_body_cannot_be_read_skip_the_remaining_phases() {
        let mut p = picker(&["10.0.0.1:8000"]);
        let over = (p.config.max_body_bytes + 1).to_string();
        let cases: Vec<ProcessingRequest> = vec![
            headers(&[(":path", "/v1/chat/completions")], true),
            headers(
                &[
                    (":path", "/v1/chat/completions"),
                    ("content-encoding", "gzip"),
                ],
                false,
            ),
            headers(
                &[(":path", "/v1/chat/completions"), ("content-length", &over)],
                false,
            ),
        ];
        for (i, msg) in cases.into_iter().enumerate() {
            let mut s = Session::new(&mut p);
            let r = s.on_message(&mut p, msg, T0).unwrap();
            let mode = r.mode_override.as_ref().expect("a mode override");
            assert_eq!(mode.request_body_mode, BodySendMode::None as i32);
            assert_eq!(mode.response_header_mode, HeaderSendMode::Skip as i32);
            assert_eq!(p.counts.fallback, i as u64 + 1);
        }
    }

    #[test]
    fn a_body_in_pieces_is_routed_at_its_end() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        let (a, b) = CHAT.split_at(20);
        let mut first = body(a);
        if let Some(Message::RequestBody(ref mut hb)) = first.request {
            hb.end_of_stream = false;
        }
        let r = s.on_message(&mut p, first, T0).unwrap();
        assert_eq!(routed_to(&r), None);
        let r = s.on_message(&mut p, body(b), T0).unwrap();
        assert_eq!(routed_to(&r).as_deref(), Some("10.0.0.1:8000"));
    }

    #[test]
    fn the_same_seed_and_clock_give_the_same_picks() {
        let run = || {
            let mut p = picker(&["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]);
            for n in 0..3 {
                report(&mut p, n, T0);
            }
            (0..12)
                .map(|i| {
                    let mut s = Session::new(&mut p);
                    s.on_message(&mut p, post(), T0 + i).unwrap();
                    routed_to(&s.on_message(&mut p, body(CHAT), T0 + i).unwrap())
                })
                .collect::<Vec<_>>()
        };
        let a = run();
        assert!(a.iter().all(Option::is_some), "{a:?}");
        assert_eq!(a, run());
    }

    #[test]
    fn stats_name_the_counters_and_the_last_pick() {
        let mut p = picker(&["10.0.0.1:8000"]);
        report(&mut p, 0, T0);
        let mut s = Session::new(&mut p);
        s.on_message(&mut p, post(), T0).unwrap();
        s.on_message(&mut p, body(CHAT), T0).unwrap();
        let v: serde_json::Value = serde_json::from_str(&p.stats_json()).unwrap();
        assert_eq!(v["routed"], 1);
        assert_eq!(v["streams"], 1);
        assert_eq!(v["last_pick"], "10.0.0.1:8000");
    }
}
