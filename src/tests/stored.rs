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
fn with_asking_off_an_unknown_response_goes_on_as_any_request() {
    let (host, root) = reported(&config(r#","stored_responses":{"ask_nodes":0}"#), IDLE);
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
    assert!(host.take_calls().is_empty(), "no node asked");
    assert_eq!(host.metric("token_balancer.stored.asked"), 0);
}

/// Delivers the answer `(status, body)` to the callout `token` request `id` sent.
fn answer_ask(
    host: &FakeHost,
    req: &mut Request<FakeHost>,
    id: u32,
    token: u32,
    status: Option<&str>,
    body: &str,
) {
    host.world().answer = (status.map(str::to_string), body.as_bytes().to_vec());
    host.enter(id);
    req.on_http_call_response(token, 0, body.len(), 0);
}

/// The asks sent so far for `rid`, by the address asked: every node, each once.
fn asks(host: &FakeHost, rid: &str) -> Vec<(String, u32)> {
    let mut calls: Vec<(String, u32)> = host
        .take_calls()
        .into_iter()
        .map(|c| {
            assert_eq!(c.path, format!("/v1/responses/{rid}"), "{c:?}");
            (c.authority, c.token)
        })
        .collect();
    calls.sort();
    let asked: Vec<&str> = calls.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(asked, [A, B]);
    calls
}

/// A turn continuing a response this Envoy never saw stored (another replica did, or it was
/// stored before this Envoy started): the nodes are asked, and it goes to the one that has it,
/// priced with the conversation its answer counts; the response is noted, so the next turn
/// goes there at once.
#[test]
fn a_turn_this_envoy_has_not_seen_stored_goes_where_a_node_has_it() {
    let (host, root) = reported(&config(r#","choices":0"#), IDLE);
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_elsewhere"}"#;
    let (mut req, action) = send(&host, &root, 2, next);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    let calls = asks(&host, "resp_elsewhere");
    assert_eq!(host.metric("token_balancer.stored.asked"), 1);
    let (a, b) = (calls[0].1, calls[1].1);
    answer_ask(
        &host,
        &mut req,
        2,
        a,
        Some("404"),
        r#"{"detail":"not found"}"#,
    );
    assert_eq!(host.stream(2).resumed, 0, "B has yet to answer");
    let stored_answer = r#"{"id":"resp_elsewhere","object":"response","usage":{"input_tokens":300,"output_tokens":40}}"#;
    answer_ask(&host, &mut req, 2, b, Some("200"), stored_answer);
    assert_eq!(host.stream(2).resumed, 1);
    assert_eq!(host.request_header_of(2, ROUTING).as_deref(), Some(B));
    assert_eq!(host.metric("token_balancer.stored.asked_found"), 1);
    let kept = stored_at(&host, "resp_elsewhere").unwrap();
    assert_eq!((kept.address.as_str(), kept.context_tokens), (B, 340));
    // Priced with the stored conversation: its 340 tokens ahead of its own few.
    let prompt = books(&root, 1).unreflected_prompt_tokens;
    assert!(prompt > 340 && prompt < 360, "{prompt}");
    // The next turn goes there at once; a late answer to the first ask changes nothing.
    let (_req, routed) = respond_to(&host, &root, 3, next);
    assert_eq!(routed.as_deref(), Some(B));
    assert!(host.take_calls().is_empty());
    answer_ask(&host, &mut req, 2, a, Some("200"), stored_answer);
    assert_eq!(host.stream(2).resumed, 1);
    assert_eq!(host.metric("token_balancer.stored.asked"), 1);
}

/// A response no node has (every ask answered 404 or not at all): a turn naming it goes on as
/// any request, and its poll to Envoy's balancer.
#[test]
fn a_response_no_node_has_leaves_its_request_as_any_other() {
    let (host, root) = reported(&config(""), IDLE);
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_gone"}"#;
    let (mut req, action) = send(&host, &root, 2, next);
    assert_eq!(action, Action::Pause);
    for (at, (_, token)) in asks(&host, "resp_gone").into_iter().enumerate() {
        let status = if at == 0 { Some("404") } else { None };
        answer_ask(&host, &mut req, 2, token, status, "");
    }
    assert_eq!(host.stream(2).resumed, 1);
    assert!(
        host.request_header_of(2, ROUTING).is_some(),
        "routed by the balancer"
    );
    let mut poll = request(&host, &root, 3, &[(":path", "/v1/responses/resp_gone")]);
    host.enter(3);
    assert_eq!(poll.on_http_request_headers(0, true), Action::Pause);
    for (_, token) in asks(&host, "resp_gone") {
        answer_ask(&host, &mut poll, 3, token, Some("404"), "");
    }
    assert_eq!(host.stream(3).resumed, 1);
    assert_eq!(host.request_header_of(3, ROUTING), None);
    assert_eq!(host.metric("token_balancer.fallback.no_body"), 1);
    assert_eq!(host.metric("token_balancer.stored.asked"), 2);
    assert_eq!(host.metric("token_balancer.stored.asked_found"), 0);
    assert_eq!(stored_at(&host, "resp_gone"), None);
}

/// A background response's poll, at another replica than the one that saw it stored: the
/// nodes are asked, and the poll goes to the one that has it.
#[test]
fn a_poll_of_a_response_not_seen_here_goes_where_a_node_has_it() {
    let (host, root) = reported(&config(""), IDLE);
    let mut poll = request(
        &host,
        &root,
        2,
        &[(":path", "/v1/responses/resp_bg/cancel")],
    );
    host.enter(2);
    assert_eq!(poll.on_http_request_headers(0, true), Action::Pause);
    let calls = asks(&host, "resp_bg");
    answer_ask(
        &host,
        &mut poll,
        2,
        calls[0].1,
        Some("200"),
        r#"{"id":"resp_bg"}"#,
    );
    assert_eq!(host.stream(2).resumed, 1);
    assert_eq!(host.request_header_of(2, ROUTING).as_deref(), Some(A));
    assert_eq!(
        stored_at(&host, "resp_bg").map(|s| s.address),
        Some(A.to_string())
    );
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

/// The wait for the nodes' answers counts against a turn's first-token budget: one that
/// spent it asking is told to come back rather than sent.
#[test]
fn asking_counts_against_a_turns_first_token_budget() {
    let (host, root) = reported(&config(""), IDLE);
    let next = r#"{"model":"m","input":"And then?","previous_response_id":"resp_slow"}"#;
    let budget = [("x-slo-ttft-ms", "300")];
    let (mut req, action) = post_to(&host, &root, 2, "/v1/responses", next, &budget);
    assert_eq!(action, Action::Pause);
    let calls = asks(&host, "resp_slow");
    host.advance(400);
    answer_ask(
        &host,
        &mut req,
        2,
        calls[0].1,
        Some("200"),
        r#"{"id":"resp_slow"}"#,
    );
    assert_eq!(host.stream(2).reply, Some(429));
    assert_eq!(host.request_header_of(2, ROUTING), None);
    // The answer was noted all the same: the turn sent again goes to its node at once.
    let (_req, action) = post_to(&host, &root, 3, "/v1/responses", next, &budget);
    assert_eq!(action, Action::Continue);
    assert!(host.take_calls().is_empty());
    assert_eq!(
        host.request_header_of(3, ROUTING).as_deref(),
        Some(calls[0].0.as_str())
    );
}
