//! Admission on a request's claims: a budget no node meets is answered at once with 429 and
//! `Retry-After`, a sheddable request is shed under saturation while others are held, a held
//! request whose budget runs out is answered, the queue's byte bound, and every way out of the
//! queue counted.

use super::*;

/// A completions request `id` with `body` and the extra request `headers`.
fn post_with(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    body: &str,
    headers: &[(&str, &str)],
) -> (Request<FakeHost>, Action) {
    post_to(host, root, id, "/v1/completions", body, headers)
}

/// Stream `id` was answered with a 429's OpenAI-shaped error body whose message says `why`.
fn assert_error_body(host: &FakeHost, id: u32, why: &str) {
    let sent: serde_json::Value =
        serde_json::from_slice(&host.stream(id).response_body).expect("JSON error body");
    assert_eq!(sent["error"]["code"], "rate_limit_exceeded");
    let message = sent["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(why), "{message}");
}

/// Request 2 with `headers` is held at a full fleet (a short prompt: 1.5 s of budget or of
/// hold is enough to wait), still waits 1 s later, and is answered 429 with `Retry-After`
/// on the tick 2 s after it came, never resumed.
fn held_then_refused(host: &FakeHost, root: &mut Root<FakeHost>, headers: &[(&str, &str)]) {
    let (_req, action) = post_with(host, root, 2, BODY, headers);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(2).reply, None, "held first");
    host.advance(1000);
    tick(host, root);
    answer_health(host, root, FULL);
    assert_eq!(host.stream(2).reply, None, "1 s of 1.5 s");
    host.advance(1000);
    tick(host, root);
    assert_eq!(host.stream(2).reply, Some(429));
    assert_eq!(host.stream(2).resumed, 0, "answered, never resumed");
    assert!(host.response_header_of(2, "retry-after").is_some());
}

/// A prompt of about 2,600 tokens: 2.6 s of prefill at the fake nodes' 1,000 tokens/s.
fn long_body() -> String {
    format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":20}}"#,
        "word ".repeat(2000)
    )
}

#[test]
fn a_budget_no_node_meets_is_answered_429_with_retry_after_at_once() {
    let (host, root) = reported(&config(r#","debug_header":"x-debug""#), IDLE);
    let body = long_body();
    let (_req, action) = post_with(&host, &root, 2, &body, &[("x-slo-ttft-ms", "1000")]);
    assert_eq!(action, Action::Pause, "answered by the filter: not resumed");
    assert_eq!(host.stream(2).reply, Some(429));
    assert_eq!(host.request_header_of(2, ROUTING), None, "not routed");
    // 2.6 s forecast against a 1-s budget: come back in 2 s.
    assert_eq!(
        host.response_header_of(2, "retry-after").as_deref(),
        Some("2")
    );
    assert_eq!(
        host.response_header_of(2, "x-debug").as_deref(),
        Some("rejected=ttft_budget")
    );
    assert_error_body(&host, 2, "latency budget");
    assert_eq!(host.metric("token_balancer.rejected.ttft_budget"), 1);
    assert_eq!(host.metric("token_balancer.routed"), 0);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0, "nothing booked");
    // A budget it meets is routed as usual; so is a request without one.
    let (_r, action) = post_with(&host, &root, 3, &body, &[("x-slo-ttft-ms", "10000")]);
    assert_eq!(action, Action::Continue);
    let (_r, action) = post_with(&host, &root, 4, &body, &[]);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.metric("token_balancer.routed"), 2);
}

#[test]
fn the_refusal_status_is_configurable() {
    let (host, root) = reported(&config(r#","admission":{"reject_status":503}"#), IDLE);
    let (_req, _) = post_with(&host, &root, 2, &long_body(), &[("x-slo-ttft-ms", "5")]);
    assert_eq!(host.stream(2).reply, Some(503));
    assert!(host.response_header_of(2, "retry-after").is_some());
}

#[test]
fn under_saturation_a_sheddable_request_is_shed_and_others_are_held() {
    let json = config(
        r#","max_hold_ms":10000,"choices":0,"admission":{"objectives":{"batch":-10,"premium":100}}"#,
    );
    let (host, mut root) = reported(&json, FULL);
    let objective = "x-gateway-inference-objective";
    let (_shed, action) = post_with(&host, &root, 2, BODY, &[(objective, "batch")]);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(2).reply, Some(429));
    assert!(host.response_header_of(2, "retry-after").is_some());
    assert_eq!(host.metric("token_balancer.rejected.shed"), 1);
    let (mut held, action) = post_with(&host, &root, 3, BODY, &[]);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(3).reply, None, "held, not answered");
    let (_premium, _) = post_with(&host, &root, 4, BODY, &[(objective, "premium")]);
    assert_eq!(host.metric("token_balancer.held_now"), 2);
    // Room: both go, and nothing more is shed.
    host.advance(1000);
    tick(&host, &mut root);
    answer_health(&host, &mut root, IDLE);
    assert_eq!(host.stream(3).resumed, 1);
    assert_eq!(host.stream(4).resumed, 1);
    assert_eq!(host.metric("token_balancer.rejected.shed"), 1);
    // With room, a sheddable request is routed like any other.
    let (_r, action) = post_with(&host, &root, 5, BODY, &[(objective, "batch")]);
    assert_eq!(action, Action::Continue);
    end(&host, &mut held, 3);
}

#[test]
fn a_held_request_whose_budget_runs_out_is_answered_on_the_next_event() {
    let (host, mut root) = reported(&config(r#","max_hold_ms":60000,"choices":0"#), FULL);
    held_then_refused(&host, &mut root, &[("x-slo-ttft-ms", "1500")]);
    assert_eq!(host.metric("token_balancer.rejected.ttft_budget_held"), 1);
    assert_eq!(host.metric("token_balancer.held_now"), 0);
}

#[test]
fn a_queue_full_in_bytes_routes_at_once_and_says_so() {
    let json = config(r#","max_hold_ms":60000,"choices":0,"admission":{"max_held_bytes":100}"#);
    let (host, root) = reported(&json, FULL);
    let (_a, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Pause, "{} bytes held", BODY.len());
    let (_b, action) = post_with(&host, &root, 3, BODY, &[]);
    assert_eq!(
        action,
        Action::Continue,
        "past 100 bytes: routed over the ceiling"
    );
    assert_eq!(host.metric("token_balancer.held_queue_full"), 1);
    assert_eq!(host.metric("token_balancer.routed_over_vram_ceiling"), 1);
}

#[test]
fn with_when_full_reject_a_request_held_out_is_answered_429_not_sent_over_the_ceiling() {
    let json = config(
        r#","max_hold_ms":1500,"choices":0,"debug_header":"x-debug","admission":{"when_full":"reject"}"#,
    );
    let (host, mut root) = reported(&json, FULL);
    held_then_refused(&host, &mut root, &[]);
    assert_eq!(
        host.response_header_of(2, "x-debug").as_deref(),
        Some("rejected=full; held_ms=2000")
    );
    assert_error_body(&host, 2, "could wait no longer");
    assert_eq!(host.metric("token_balancer.rejected.full"), 1);
    assert_eq!(host.metric("token_balancer.held_routed_over_ceiling"), 0);
    assert_eq!(host.metric("token_balancer.routed"), 0);
    assert_eq!(host.metric("token_balancer.held_now"), 0);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0, "nothing booked");
}

#[test]
fn with_when_full_reject_a_full_queue_or_no_holding_answers_at_once() {
    let json = config(
        r#","max_hold_ms":60000,"choices":0,"admission":{"max_held_bytes":100,"when_full":"reject"}"#,
    );
    let (host, root) = reported(&json, FULL);
    let (_a, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(2).reply, None, "held");
    let (_b, action) = post_with(&host, &root, 3, BODY, &[]);
    assert_eq!(action, Action::Pause, "answered by the filter");
    assert_eq!(host.stream(3).reply, Some(429));
    assert!(host.response_header_of(3, "retry-after").is_some());
    assert_eq!(host.metric("token_balancer.held_queue_full"), 1);
    assert_eq!(host.metric("token_balancer.rejected.full"), 1);
    assert_eq!(host.metric("token_balancer.routed_over_vram_ceiling"), 0);

    // Holding off: no room is answered at once, with the configured status.
    let json = config(r#","choices":0,"admission":{"when_full":"reject","reject_status":503}"#);
    let (host, root) = reported(&json, FULL);
    let (_c, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(2).reply, Some(503));
    assert_eq!(host.metric("token_balancer.rejected.full"), 1);
    assert_eq!(host.metric("token_balancer.held"), 0);
    // With room, it is routed as usual.
    let (host, root) = reported(&json, IDLE);
    let (_d, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.metric("token_balancer.rejected.full"), 0);
}

/// Node A routed stream 2 while it had room; then both nodes fill, request 3 is held, and its
/// hold runs out. Stream 2's first token tries the queue, and request 3 is to be refused. An
/// answer sent during stream 2's callback would stop stream 2 itself in Envoy, so request 3
/// is answered from the root context, which the wake-up queue brings.
fn held_out_during_another_streams_callback() -> (FakeHost, Root<FakeHost>, Request<FakeHost>) {
    let json = config(
        r#","max_hold_ms":1500,"stale_after_ms":60000,"choices":0,"admission":{"when_full":"reject"}"#,
    );
    let (host, mut root) = reported(&json, IDLE);
    let (mut running, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Continue);
    host.advance(1000);
    tick(&host, &mut root);
    answer_health(&host, &mut root, FULL);
    let (held, action) = post_with(&host, &root, 3, BODY, &[]);
    assert_eq!(action, Action::Pause, "held");
    host.advance(2000);
    respond(&host, &mut running, 2, "200");
    let event = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    host.stream(2).response_body = event.clone();
    host.enter(2);
    assert_eq!(
        running.on_http_response_body(event.len(), false),
        Action::Continue
    );
    assert_eq!(host.stream(3).reply, None, "not from stream 2's callback");
    assert!(host.world().answered_for_others.is_empty());
    assert_eq!(
        host.metric("token_balancer.held_now"),
        0,
        "it left the queue"
    );
    (host, root, held)
}

#[test]
fn a_refusal_let_go_in_another_streams_callback_is_answered_from_the_root_context() {
    let (host, mut root, _held) = held_out_during_another_streams_callback();
    assert_eq!(host.queued(), 1, "the root context is woken");
    host.enter(ROOT);
    root.on_queue_ready(1);
    assert_eq!(host.stream(3).reply, Some(429));
    assert_eq!(host.stream(3).resumed, 0);
    assert!(host.response_header_of(3, "retry-after").is_some());
    assert_eq!(host.metric("token_balancer.rejected.full"), 1);
    assert_eq!(host.queued(), 0, "the queue is emptied");
    // Nothing is left to answer on the next tick.
    host.advance(1000);
    tick(&host, &mut root);
    assert_eq!(host.metric("token_balancer.rejected.full"), 1);
}

#[test]
fn a_refusal_waiting_for_the_root_context_is_answered_on_the_tick_or_dropped_with_its_client() {
    // Without the wake-up, the next tick answers it.
    let (host, mut root, _held) = held_out_during_another_streams_callback();
    tick(&host, &mut root);
    assert_eq!(host.stream(3).reply, Some(429));
    // A client that leaves first is counted as gone and not answered.
    let (host, mut root, mut held) = held_out_during_another_streams_callback();
    end(&host, &mut held, 3);
    assert_eq!(host.metric("token_balancer.held_client_gone"), 1);
    host.enter(ROOT);
    root.on_queue_ready(1);
    assert_eq!(host.stream(3).reply, None);
    assert_eq!(host.metric("token_balancer.rejected.full"), 0);
}

#[test]
fn a_client_that_leaves_while_held_is_counted() {
    let (host, root) = reported(&config(r#","max_hold_ms":60000,"choices":0"#), FULL);
    let (mut req, _) = post_with(&host, &root, 2, BODY, &[]);
    end(&host, &mut req, 2);
    assert_eq!(host.metric("token_balancer.held_client_gone"), 1);
    assert_eq!(host.metric("token_balancer.held_now"), 0);
}

#[test]
fn an_unreadable_claim_is_counted_and_ignored() {
    let (host, root) = reported(&config(""), IDLE);
    let (_req, action) = post_with(&host, &root, 2, BODY, &[("x-slo-ttft-ms", "soon")]);
    assert_eq!(action, Action::Continue, "routed as without a budget");
    assert_eq!(host.metric("token_balancer.admission.bad_header"), 1);
}

/// A stream on the first node delivers 11 tokens 100 ms apart: its node decodes at 100 ms a
/// token. A request that accepts 50 ms a token then goes to the other node, which has no
/// figure and is taken at its word.
#[test]
fn a_time_per_token_budget_avoids_a_node_seen_decoding_slowly() {
    let (host, root) = reported(&config(r#","choices":0"#), IDLE);
    let (mut req, _) = post_with(&host, &root, 2, BODY, &[]);
    let first = host.request_header_of(2, ROUTING).unwrap();
    let slow = first.split(',').next().unwrap().to_string();
    respond(&host, &mut req, 2, "200");
    let event = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    for i in 0..11 {
        host.stream(2).response_body = event.clone();
        host.enter(2);
        assert_eq!(
            req.on_http_response_body(event.len(), i == 10),
            Action::Continue
        );
        host.advance(100);
    }
    end(&host, &mut req, 2);
    // The two nodes are otherwise equal: without the budget each would be chosen about half
    // the time; with it, never the slow one.
    let budget = [("x-slo-tpot-ms", "50")];
    for id in 3..11 {
        let (mut r, action) = post_with(&host, &root, id, BODY, &budget);
        assert_eq!(action, Action::Continue);
        let chosen = host.request_header_of(id, ROUTING).unwrap();
        assert!(!chosen.starts_with(&slow), "{chosen} after {slow}");
        end(&host, &mut r, id);
    }
    let picks = |node: &str| host.metric(&format!("token_balancer.node.{node}.picks"));
    let other = if slow == A { B } else { A };
    assert_eq!((picks(&slow), picks(other)), (1, 8));
}

/// Node A is configured ten times faster than B, so it ranks first. A stream running there
/// delivers its tokens 100 ms apart: before any stream there has completed, that pace keeps a
/// request that accepts 50 ms a token off A.
#[test]
fn a_time_per_token_budget_avoids_a_node_whose_running_streams_decode_slowly() {
    let json = format!(
        r#"{{"nodes":[{{"address":"{A}","capacity_tokens_per_sec":10000}},{{"address":"{B}","capacity_tokens_per_sec":1000}}],"health_cluster":"gpu_health","models_poll_ms":0,"choices":0}}"#
    );
    let (host, root) = reported(&json, IDLE);
    let (mut req, _) = post_with(&host, &root, 2, BODY, &[]);
    assert!(host.request_header_of(2, ROUTING).unwrap().starts_with(A));
    respond(&host, &mut req, 2, "200");
    let event = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    let deliver = |req: &mut crate::request::Request<crate::fake::FakeHost>| {
        host.stream(2).response_body = event.clone();
        host.enter(2);
        assert_eq!(
            req.on_http_response_body(event.len(), false),
            Action::Continue
        );
        host.advance(100);
    };
    // The first token: no pace yet, and A is still taken at its word.
    deliver(&mut req);
    let budget = [("x-slo-tpot-ms", "50")];
    let (mut r, _) = post_with(&host, &root, 3, BODY, &budget);
    assert!(host.request_header_of(3, ROUTING).unwrap().starts_with(A));
    end(&host, &mut r, 3);
    // Eight more, 100 ms apart: A decodes at 100 ms a token now.
    for _ in 0..8 {
        deliver(&mut req);
    }
    for id in 4..8 {
        let (mut r, action) = post_with(&host, &root, id, BODY, &budget);
        assert_eq!(action, Action::Continue);
        let chosen = host.request_header_of(id, ROUTING).unwrap();
        assert!(
            chosen.starts_with(B),
            "{chosen} beside a stream at 100 ms a token"
        );
        end(&host, &mut r, id);
    }
    // Without a budget, A is still the first.
    let (mut r, _) = post_with(&host, &root, 8, BODY, &[]);
    assert!(host.request_header_of(8, ROUTING).unwrap().starts_with(A));
    end(&host, &mut r, 8);
    end(&host, &mut req, 2);
}

#[test]
fn a_full_queue_sheds_a_lower_priority_for_a_higher_one() {
    let json = config(
        r#","max_hold_ms":60000,"max_held_requests":1,"choices":0,"admission":{"objectives":{"premium":100}}"#,
    );
    let (host, mut root) = reported(&json, FULL);
    let (_standard, action) = post_with(&host, &root, 2, BODY, &[]);
    assert_eq!(action, Action::Pause);
    let objective = "x-gateway-inference-objective";
    let (_premium, action) = post_with(&host, &root, 3, BODY, &[(objective, "premium")]);
    assert_eq!(action, Action::Pause, "held in its place");
    assert_eq!(host.stream(3).reply, None);
    // Shed during request 3's own callback, it is answered from the root context.
    assert_eq!(host.stream(2).reply, None);
    assert!(host.world().answered_for_others.is_empty());
    assert_eq!(
        host.world().current,
        3,
        "the effective context is the request's again"
    );
    host.enter(ROOT);
    root.on_queue_ready(1);
    assert_eq!(
        host.stream(2).reply,
        Some(429),
        "the lower priority was shed"
    );
    assert!(host.response_header_of(2, "retry-after").is_some());
    assert_eq!(host.stream(2).resumed, 0);
    assert_eq!(host.metric("token_balancer.rejected.shed"), 1);
    assert_eq!(host.metric("token_balancer.held_now"), 1);
    // Another standard request finds the queue full of a higher priority: routed at once.
    let (_late, action) = post_with(&host, &root, 4, BODY, &[]);
    assert_eq!(action, Action::Continue);
    assert_eq!(host.metric("token_balancer.held_queue_full"), 1);
}

#[test]
fn a_request_no_node_would_hold_even_empty_is_never_held() {
    // Caches of 1,000 tokens (1,000 bytes a token), 99% full: a short prompt waits for room,
    // a prompt of about 2,600 tokens never fits, however empty the nodes get.
    const SMALL_FULL: &str = r#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000,"vram_used_bytes":990000,"vram_total_bytes":1000000}"#;
    let long = long_body();
    for when_full in ["route", "reject"] {
        let json = config(&format!(
            r#","max_hold_ms":60000,"choices":0,"kv_bytes_per_token":1000,"admission":{{"when_full":"{when_full}"}}"#
        ));
        let (host, root) = reported(&json, SMALL_FULL);
        let (_a, action) = post_with(&host, &root, 2, BODY, &[]);
        assert_eq!(action, Action::Pause);
        assert_eq!(
            host.stream(2).reply,
            None,
            "{when_full}: the short prompt is held"
        );
        let (_b, action) = post_with(&host, &root, 3, &long, &[]);
        assert_eq!(
            host.metric("token_balancer.held"),
            1,
            "{when_full}: only the short one"
        );
        if when_full == "route" {
            assert_eq!(action, Action::Continue, "routed at once");
            assert_eq!(host.metric("token_balancer.routed_over_vram_ceiling"), 1);
        } else {
            assert_eq!(action, Action::Pause, "answered by the filter");
            assert_eq!(host.stream(3).reply, Some(429));
            assert!(host.response_header_of(3, "retry-after").is_some());
            assert_error_body(&host, 3, "even with nothing else running");
            assert_eq!(host.metric("token_balancer.rejected.full"), 1);
            assert_eq!(host.metric("token_balancer.routed_over_vram_ceiling"), 0);
        }
        assert_eq!(host.metric("token_balancer.held_queue_full"), 0);
        // A sheddable one is shed, as at any saturated fleet.
        let json = config(&format!(
            r#","max_hold_ms":60000,"choices":0,"kv_bytes_per_token":1000,"admission":{{"when_full":"{when_full}","objectives":{{"batch":-10}}}}"#
        ));
        let (host, root) = reported(&json, SMALL_FULL);
        let objective = [("x-gateway-inference-objective", "batch")];
        let (_c, action) = post_with(&host, &root, 4, &long, &objective);
        assert_eq!(action, Action::Pause, "answered by the filter");
        assert_eq!(host.stream(4).reply, Some(429));
        assert_eq!(host.metric("token_balancer.rejected.shed"), 1);
        assert_eq!(host.metric("token_balancer.routed"), 0);
    }
}

/// A request that only counts its prompt's tokens (`/v1/messages/count_tokens`) costs the GPU
/// nothing, however long the conversation it carries: at a full fleet with `when_full: reject`
/// and holding on, it is neither held nor refused but routed at once, and books no tokens.
#[test]
fn counting_a_prompt_is_never_held_nor_refused() {
    let json = config(r#","max_hold_ms":60000,"choices":0,"admission":{"when_full":"reject"}"#);
    let (host, root) = reported(&json, FULL);
    let body = format!(
        r#"{{"model":"m","max_tokens":4000,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a long conversation ".repeat(500)
    );
    let len = body.len().to_string();
    let mut req = request(
        &host,
        &root,
        2,
        &[
            (":path", "/v1/messages/count_tokens"),
            ("content-length", len.as_str()),
        ],
    );
    host.stream(2).body = body.as_bytes().to_vec();
    host.enter(2);
    assert_eq!(req.on_http_request_headers(0, false), Action::Pause);
    assert_eq!(req.on_http_request_body(body.len(), true), Action::Continue);
    assert_eq!(host.stream(2).reply, None, "not answered by the filter");
    assert!(host.request_header_of(2, ROUTING).is_some());
    assert_eq!(host.metric("token_balancer.routed"), 1);
    assert_eq!(host.metric("token_balancer.held"), 0);
    assert_eq!(host.metric("token_balancer.rejected.full"), 0);
    for node in 0..2 {
        let b = books(&root, node);
        assert_eq!(
            (b.inflight_tokens, b.growth_tokens, b.prefill_tokens),
            (0, 0, 0)
        );
    }
    // The same body to a generation endpoint is refused at the full fleet.
    let (_chat, action) = post_with(&host, &root, 3, &body, &[]);
    assert_eq!(action, Action::Pause);
    assert_eq!(host.stream(3).reply, Some(429));
}
