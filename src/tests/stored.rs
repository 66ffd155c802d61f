//! Responses stored by the node that answered them: the id is read from the answer as it
//! passes and noted in shared data, and what names it later (a turn that continues it, its
//! poll, its cancellation) goes to that node, even when another would be chosen.

use super::*;
use crate::fake::FakeHost;
use token_balancer_core::share::stored::{self, Stored};

/// Every health callout sent so far answered: node A with `a`, node B with `b`.
fn report_each(host: &FakeHost, root: &mut Root<FakeHost>, a: &str, b: &str) {
    host.advance(1000);
    tick(host, root);
    for call in host.take_calls() {
        let body = if call.authority == A { a } else { b };
        answer(host, root, call.token, Some("200"), body);
    }
}

/// A Responses request `id` with `body`, up to its body callback: the request and what that
/// callback said.
fn send(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    body: &str,
) -> (Request<FakeHost>, Action) {
    post_to(host, root, id, "/v1/responses", body, &[])
}

/// A Responses request `id` with `body`, routed: the request and where it was routed.
fn respond_to(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    body: &str,
) -> (Request<FakeHost>, Option<String>) {
    let (req, action) = send(host, root, id, body);
    assert_eq!(action, Action::Continue);
    (req, host.request_header_of(id, ROUTING))
}

/// The answer of stream `id`, served by `upstream`, in `chunks`, then its end.
fn answered(
    host: &FakeHost,
    req: &mut Request<FakeHost>,
    id: u32,
    upstream: &str,
    chunks: &[&str],
) {
    host.stream(id).upstream = Some(upstream.to_string());
    respond(host, req, id, "200");
    for (i, c) in chunks.iter().enumerate() {
        response_chunk(host, req, id, c.as_bytes(), i + 1 == chunks.len());
    }
    end(host, req, id);
}

/// A whole answer stored under `rid` with `output` tokens, served by `upstream`, then its end.
fn answered_whole(
    host: &FakeHost,
    req: &mut Request<FakeHost>,
    id: u32,
    upstream: &str,
    rid: &str,
    output: u64,
) {
    let body = format!(r#"{{"id":"{rid}","usage":{{"output_tokens":{output}}}}}"#);
    answered(host, req, id, upstream, &[&body]);
}

fn stored_at(host: &FakeHost, id: &str) -> Option<Stored> {
    let mut store = host.clone();
    stored::find(&mut store, stored::DEFAULT_SLOTS, id).unwrap()
}

const FIRST: &str =
    r#"{"model":"m","input":"Tell me a story about a lighthouse keeper.","max_output_tokens":200}"#;

#[test]
fn a_conversation_goes_back_to_the_node_that_stores_it() {
    let (host, mut root) = reported(&config(r#","choices":0"#), IDLE);
    let (mut req, routed) = respond_to(&host, &root, 2, FIRST);
    let node = routed.unwrap();
    let other = if node.starts_with(A) { B } else { A };
    let node = if node.starts_with(A) { A } else { B };
    // The id comes in the stream's first event, split over two chunks.
    answered(
        &host,
        &mut req,
        2,
        node,
        &[
            "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"i",
            "d\":\"resp_7\",\"object\":\"response\"}}\n\n",
            "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Once\"}\n\n",
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_7\",\"usage\":{\"input_tokens\":20,\"output_tokens\":150}}}\n\n",
        ],
    );
    let kept = stored_at(&host, "resp_7").unwrap();
    assert_eq!(kept.address, node);
    // Its prompt as the filter priced it, and the server's count of its output.
    assert!(
        kept.context_tokens > 150 && kept.context_tokens < 200,
        "{kept:?}"
    );
    assert_eq!(host.metric("token_balancer.stored.recorded"), 2);

    // The node that stores it is now full, the other idle: a new conversation goes to the
    // other, the next turn of this one to its node, priced with the stored turns.
    let (a, b) = if node == A {
        (FULL, IDLE)
    } else {
        (IDLE, FULL)
    };
    report_each(&host, &mut root, a, b);
    assert_eq!(host.metric("token_balancer.health.ok"), 4);
    let (_new, routed) = respond_to(&host, &root, 3, FIRST);
    assert!(routed.unwrap().starts_with(other));
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_7","store":false}"#;
    let (mut req, routed) = respond_to(&host, &root, 4, next);
    assert_eq!(routed.as_deref(), Some(node));
    assert_eq!(host.metric("token_balancer.stored.found"), 1);
    // Not to be stored: its answer is not read for an id.
    answered_whole(&host, &mut req, 4, node, "resp_8", 3);
    assert_eq!(stored_at(&host, "resp_8"), None);

    // Its poll and its cancellation, with no body, go there too.
    for (id, path) in [
        (5, "/v1/responses/resp_7"),
        (6, "/v1/responses/resp_7/cancel?x=1"),
    ] {
        let mut req = request(&host, &root, id, &[(":path", path), (":method", "GET")]);
        host.enter(id);
        assert_eq!(req.on_http_request_headers(0, true), Action::Continue);
        assert_eq!(host.request_header_of(id, ROUTING).as_deref(), Some(node));
        end(&host, &mut req, id);
    }
    assert_eq!(host.metric("token_balancer.stored.found"), 3);
    assert_eq!(
        inflight(&root, 0) + inflight(&root, 1),
        1,
        "only request 3 runs"
    );
}

#[test]
fn an_unknown_response_goes_on_as_any_request() {
    let (host, root) = reported(&config(""), IDLE);
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_404"}"#;
    let (_req, routed) = respond_to(&host, &root, 2, next);
    assert!(routed.is_some(), "routed by the balancer");
    assert_eq!(host.metric("token_balancer.stored.unknown"), 1);
    let mut poll = request(&host, &root, 3, &[(":path", "/v1/responses/resp_404")]);
    host.enter(3);
    // No body, no stored node: Envoy's balancer.
    assert_eq!(poll.on_http_request_headers(0, true), Action::Continue);
    assert_eq!(host.request_header_of(3, ROUTING), None);
    assert_eq!(host.metric("token_balancer.stored.unknown"), 2);
    assert_eq!(host.metric("token_balancer.fallback.no_body"), 1);
}

#[test]
fn with_stored_responses_off_nothing_is_noted_or_pinned() {
    let json = config(r#","stored_responses":{"enabled":false}"#);
    let (host, root) = reported(&json, IDLE);
    let (mut req, routed) = respond_to(&host, &root, 2, FIRST);
    let node = if routed.unwrap().starts_with(A) { A } else { B };
    answered_whole(&host, &mut req, 2, node, "resp_1", 3);
    assert_eq!(stored_at(&host, "resp_1"), None);
    let mut poll = request(&host, &root, 3, &[(":path", "/v1/responses/resp_1")]);
    host.enter(3);
    assert_eq!(poll.on_http_request_headers(0, true), Action::Continue);
    assert_eq!(host.request_header_of(3, ROUTING), None);
    for stat in ["recorded", "found", "unknown"] {
        assert_eq!(host.metric(&format!("token_balancer.stored.{stat}")), 0);
    }
}

#[test]
fn a_turn_waits_for_room_on_the_node_that_stores_its_conversation() {
    let (host, mut root) = reported(&config(r#","choices":0,"max_hold_ms":10000"#), IDLE);
    let (mut req, routed) = respond_to(&host, &root, 2, FIRST);
    let node = if routed.unwrap().starts_with(A) { A } else { B };
    answered_whole(&host, &mut req, 2, node, "resp_1", 30);
    // Its node is full, the other idle: the next turn waits, for its node.
    let (a, b) = if node == A {
        (FULL, IDLE)
    } else {
        (IDLE, FULL)
    };
    report_each(&host, &mut root, a, b);
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_1"}"#;
    let (_req, action) = send(&host, &root, 3, next);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.metric("token_balancer.held"), 1);
    assert_eq!(host.request_header_of(3, ROUTING), None);
    // Its node has room again: it goes there.
    report_each(&host, &mut root, IDLE, IDLE);
    assert_eq!(host.stream(3).resumed, 1);
    assert_eq!(host.request_header_of(3, ROUTING).as_deref(), Some(node));
}
