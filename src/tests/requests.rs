//! A request's key paths: the client's routing header removed, the body read and routed, an
//! over-limit body left alone, a held request resumed once admitted, and the booking released
//! exactly once.

use super::*;

#[test]
fn a_client_supplied_routing_header_is_removed() {
    let (host, root) = configured(&config(r#","debug_header":"x-debug""#));
    let mut req = request(
        &host,
        &root,
        2,
        &[
            (":path", "/v1/completions"),
            (ROUTING, "6.6.6.6:666"),
            ("x-debug", "forged"),
        ],
    );
    host.enter(2);
    assert_eq!(req.on_http_request_headers(0, false), Action::Pause);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    assert_eq!(host.request_header_of(2, "x-debug"), None);
    assert_eq!(
        host.metric("token_balancer.client_routing_header_removed"),
        1
    );
    // Without a body there is nothing to route on: the request goes on, to Envoy's balancer.
    let mut bare = request(&host, &root, 3, &[(":path", "/v1/completions")]);
    host.enter(3);
    assert_eq!(bare.on_http_request_headers(0, true), Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.no_body"), 1);
    assert_eq!(
        host.metric("token_balancer.client_routing_header_removed"),
        1
    );
}

#[test]
fn a_read_body_is_routed_with_the_routing_header_set() {
    let (host, root) = reported(&config(""), IDLE);
    assert_eq!(host.metric("token_balancer.health.ok"), 2);
    let (_req, headers, body) = post(&host, &root, 2, BODY);
    assert_eq!((headers, body), (Action::Pause, Action::Continue));
    let routed = host.request_header_of(2, ROUTING).expect("routing header");
    let first = routed.split(',').next().unwrap().to_string();
    assert!(first == A || first == B, "{routed}");
    assert_eq!(host.metric("token_balancer.routed"), 1);
    assert_eq!(host.metric("token_balancer.inflight_now"), 1);
    let picks = format!("token_balancer.node.{first}.picks");
    assert_eq!(host.metric(&picks), 1);
    assert_eq!(host.stream(2).resumed, 0, "never paused past the body");
}

#[test]
fn with_no_fresh_node_the_request_falls_back_untouched() {
    let (host, root) = configured(&config(r#","debug_header":"x-debug""#));
    let (mut req, _, body) = post(&host, &root, 2, BODY);
    assert_eq!(body, Action::Continue);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    assert_eq!(host.metric("token_balancer.fallback.no_fresh_nodes"), 1);
    respond(&host, &mut req, 2, "200");
    let debug = host.stream(2).response.clone();
    assert!(debug.contains(&("x-debug".into(), "fallback=no_fresh_nodes".into())));
}

#[test]
fn an_unreadable_body_falls_back() {
    let (host, root) = reported(&config(""), IDLE);
    let (_req, _, body) = post(&host, &root, 2, "not json");
    assert_eq!(body, Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.body_unusable"), 1);
    assert_eq!(host.request_header_of(2, ROUTING), None);
}

#[test]
fn an_over_limit_content_length_falls_back_without_pausing() {
    let (host, root) = reported(&config(r#","max_body_bytes":100"#), IDLE);
    let mut req = request(
        &host,
        &root,
        2,
        &[(":path", "/v1/completions"), ("content-length", "1000")],
    );
    host.enter(2);
    assert_eq!(req.on_http_request_headers(0, false), Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.body_over_limit"), 1);
    // The body then streams through untouched, unread and uncounted.
    host.stream(2).body = vec![b'x'; 1000];
    assert_eq!(req.on_http_request_body(1000, true), Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.body_over_limit"), 1);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    // A body without a content-length that grows past the limit is let go at once too.
    let mut chunked = request(&host, &root, 3, &[(":path", "/v1/completions")]);
    host.enter(3);
    assert_eq!(chunked.on_http_request_headers(0, false), Action::Pause);
    assert_eq!(chunked.on_http_request_body(60, false), Action::Pause);
    assert_eq!(chunked.on_http_request_body(120, false), Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.body_over_limit"), 2);
}

#[test]
fn a_held_request_resumes_when_a_report_shows_room() {
    let (host, mut root) = reported(&config(r#","max_hold_ms":10000,"choices":0"#), FULL);
    let (mut req, _, body) = post(&host, &root, 2, BODY);
    assert_eq!(body, Action::Pause, "held: every node is full");
    assert_eq!(host.metric("token_balancer.held"), 1);
    assert_eq!(host.metric("token_balancer.held_now"), 1);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    // The next round of polls finds room: the held request is routed and resumed.
    host.advance(1000);
    tick(&host, &mut root);
    assert_eq!(host.stream(2).resumed, 0, "still full at the tick");
    answer_health(&host, &mut root, IDLE);
    assert_eq!(host.stream(2).resumed, 1);
    assert!(host.request_header_of(2, ROUTING).is_some());
    assert_eq!(host.metric("token_balancer.held_now"), 0);
    assert_eq!(host.metric("token_balancer.routed"), 1);
    assert_eq!(
        host.world().current,
        ROOT,
        "the root is the effective context again"
    );
    // The request takes its booking over, and gives it back at its end.
    respond(&host, &mut req, 2, "200");
    assert_eq!(host.metric("token_balancer.inflight_now"), 1);
    end(&host, &mut req, 2);
    assert_eq!(host.metric("token_balancer.inflight_now"), 0);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0);
}

#[test]
fn a_held_request_whose_stream_ends_leaves_the_queue() {
    let (host, root) = reported(&config(r#","max_hold_ms":10000,"choices":0"#), FULL);
    let (mut req, _, body) = post(&host, &root, 2, BODY);
    assert_eq!(body, Action::Pause);
    end(&host, &mut req, 2);
    assert_eq!(host.metric("token_balancer.held_now"), 0);
    drop(req);
    assert_eq!(host.metric("token_balancer.held_now"), 0);
    assert_eq!(host.metric("token_balancer.inflight_now"), 0);
}

#[test]
fn the_booking_is_released_exactly_once() {
    let (host, root) = reported(&config(""), IDLE);
    let (mut req, _, _) = post(&host, &root, 2, BODY);
    let node = usize::from(host.request_header_of(2, ROUTING).unwrap().starts_with(B));
    assert_eq!(inflight(&root, node), 1);
    respond(&host, &mut req, 2, "200");
    host.stream(2).response_body = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    assert_eq!(req.on_http_response_body(40, true), Action::Continue);
    end(&host, &mut req, 2);
    assert_eq!(inflight(&root, node), 0);
    assert_eq!(host.metric("token_balancer.inflight_now"), 0);
    drop(req);
    assert_eq!(
        host.metric("token_balancer.inflight_now"),
        0,
        "not released again"
    );
    // A context dropped without its end being seen still gives its booking back.
    let (req, _, _) = post(&host, &root, 3, BODY);
    assert_eq!(host.metric("token_balancer.inflight_now"), 1);
    drop(req);
    assert_eq!(host.metric("token_balancer.inflight_now"), 0);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0);
}

/// The booking follows the node the response came from: on the chosen node nothing moves;
/// on the next one of the routing header (Envoy retried there), it moves there, its stream's
/// progress and release land there, and a held request may take the room freed.
#[test]
fn the_booking_follows_the_node_that_served_the_request() {
    let (host, root) = reported(&config(r#","debug_header":"x-tb""#), IDLE);
    let (mut req, _, _) = post(&host, &root, 2, BODY);
    let header = host.request_header_of(2, ROUTING).unwrap();
    let chosen = usize::from(header.starts_with(B));
    let chosen_address = if chosen == 0 { A } else { B };
    host.stream(2).upstream = Some(chosen_address.to_string());
    respond(&host, &mut req, 2, "200");
    assert_eq!(inflight(&root, chosen), 1);
    assert_eq!(host.metric("token_balancer.served_elsewhere"), 0);
    let told = host.response_header_of(2, "x-tb").unwrap();
    assert!(!told.contains("served_by"), "{told}");
    end(&host, &mut req, 2);

    let (mut req, _, _) = post(&host, &root, 3, BODY);
    let header = host.request_header_of(3, ROUTING).unwrap();
    let chosen = usize::from(header.starts_with(B));
    let (other, other_address) = if chosen == 0 { (1, B) } else { (0, A) };
    host.stream(3).upstream = Some(other_address.to_string());
    respond(&host, &mut req, 3, "200");
    assert_eq!((inflight(&root, chosen), inflight(&root, other)), (0, 1));
    assert_eq!(host.metric("token_balancer.served_elsewhere"), 1);
    let told = host.response_header_of(3, "x-tb").unwrap();
    assert!(told.starts_with(&format!("node={header};")), "{told}");
    assert!(
        told.ends_with(&format!("; served_by={other_address}")),
        "{told}"
    );
    host.stream(3).response_body = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    assert_eq!(req.on_http_response_body(40, true), Action::Continue);
    end(&host, &mut req, 3);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0);
    assert_eq!(host.metric("token_balancer.inflight_now"), 0);
    let failed = if chosen == 0 { A } else { B };
    let failed_header = |host: &FakeHost, id: u32| {
        host.request_header_of(id, ROUTING)
            .is_some_and(|h| h.starts_with(failed))
    };
    // The node that could not serve it is out of the choice until a report taken after that.
    for id in 4..10 {
        let (mut req, _, _) = post(&host, &root, id, BODY);
        assert!(!failed_header(&host, id), "request {id} went to {failed}");
        end(&host, &mut req, id);
    }
    // It is polled at the next tick, and its answer brings it back.
    host.advance(1000);
    let mut root = root;
    tick(&host, &mut root);
    let calls = host.take_calls();
    assert!(calls.iter().any(|c| c.authority == failed), "{calls:?}");
    for c in calls {
        answer(&host, &mut root, c.token, Some("200"), IDLE);
    }
    let back = (10..30).any(|id| {
        let (mut req, _, _) = post(&host, &root, id, BODY);
        let there = failed_header(&host, id);
        end(&host, &mut req, id);
        there
    });
    assert!(back, "{failed} never chosen again");
}

#[test]
fn a_refused_routing_header_undoes_the_booking() {
    let (host, root) = reported(&config(""), IDLE);
    host.world().refuse_headers = true;
    let (_req, _, body) = post(&host, &root, 2, BODY);
    assert_eq!(body, Action::Continue);
    assert_eq!(host.metric("token_balancer.fallback.internal"), 1);
    assert_eq!(host.metric("token_balancer.routed"), 0);
    assert_eq!(inflight(&root, 0) + inflight(&root, 1), 0);
}

#[test]
fn an_unknown_model_is_answered_404_when_configured_to_reject() {
    let json = format!(
        r#"{{"nodes":[{{"address":"{A}","models":["m"]}}],"health_cluster":"h","unknown_model":"reject"}}"#
    );
    let (host, root) = reported(&json, IDLE);
    let (_req, _, body) = post(&host, &root, 2, r#"{"model":"other","prompt":"x"}"#);
    assert_eq!(body, Action::Pause, "answered by the filter: not resumed");
    assert_eq!(host.stream(2).reply, Some(404));
    assert_eq!(host.metric("token_balancer.rejected.unknown_model"), 1);
}

#[test]
fn without_a_configuration_every_callback_lets_the_request_go() {
    let host = FakeHost::default();
    let root = Root::new(ROOT, host.clone());
    let mut req = request(&host, &root, 2, &[(ROUTING, "6.6.6.6:666")]);
    host.enter(2);
    assert_eq!(req.on_http_request_headers(0, false), Action::Continue);
    assert_eq!(req.on_http_request_body(10, true), Action::Continue);
    assert_eq!(req.on_http_response_headers(0, false), Action::Continue);
    assert_eq!(req.on_http_response_body(10, true), Action::Continue);
    req.on_log();
}

#[test]
fn the_beliefs_path_is_answered_with_json_and_never_forwarded() {
    let (host, root) = reported(&config(r#","beliefs_path":"/tb/beliefs""#), IDLE);
    let (_routed, _, _) = post(&host, &root, 2, BODY);
    let mut req = request(
        &host,
        &root,
        3,
        &[(":path", "/tb/beliefs"), (":method", "GET")],
    );
    host.enter(3);
    assert_eq!(req.on_http_request_headers(0, true), Action::Pause);
    assert_eq!(host.stream(3).reply, Some(200));
    assert!(host
        .stream(3)
        .response
        .contains(&("content-type".to_string(), "application/json".to_string())));
    let body = host.stream(3).response_body.clone();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let nodes = v["nodes"].as_array().unwrap();
    let addresses: Vec<&str> = nodes.iter().filter_map(|n| n["address"].as_str()).collect();
    assert_eq!(addresses, vec![A, B]);
    let inflight: u64 = nodes
        .iter()
        .filter_map(|n| n["in_flight"]["requests"].as_u64())
        .sum();
    assert_eq!(inflight, 1, "the routed request is in flight");
    assert!(nodes.iter().all(|n| n["report"]["fresh"] == true));
    assert_eq!(host.metric("token_balancer.fallback.no_body"), 0);
    // Another path, another method, or the path with a query: not the beliefs.
    for (id, path, method) in [
        (4, "/tb/beliefs/x", "GET"),
        (5, "/tb/beliefs", "POST"),
        (6, "/tb/beliefs?x=1", "GET"),
    ] {
        let mut other = request(&host, &root, id, &[(":path", path), (":method", method)]);
        host.enter(id);
        assert_eq!(other.on_http_request_headers(0, true), Action::Continue);
        assert_eq!(host.stream(id).reply, None, "{path} {method}");
    }
}

#[test]
fn without_a_beliefs_path_the_path_is_an_ordinary_request() {
    let (host, root) = reported(&config(""), IDLE);
    let mut req = request(
        &host,
        &root,
        2,
        &[(":path", "/tb/beliefs"), (":method", "GET")],
    );
    host.enter(2);
    assert_eq!(req.on_http_request_headers(0, true), Action::Continue);
    assert_eq!(host.stream(2).reply, None);
    assert_eq!(host.metric("token_balancer.fallback.no_body"), 1);
}

/// The configured session header is an affinity hint: short prompts of one session (no
/// character block to match) go where the session's first went, whichever worker of a fleet
/// of equals, and the hint is priced nowhere as cached.
#[test]
fn a_session_header_keeps_a_sessions_short_prompts_together() {
    let (host, root) = reported(
        &config(r#","prefix":{"session_header":"x-session-id"}"#),
        IDLE,
    );
    let mut nodes = std::collections::BTreeMap::<String, std::collections::BTreeSet<String>>::new();
    for (id, session) in (2u32..).zip(["s1", "s2", "s1", "s3", "s2", "s1", "s3", "s4"]) {
        let len = BODY.len().to_string();
        let mut req = request(
            &host,
            &root,
            id,
            &[
                (":path", "/v1/completions"),
                ("content-length", &len),
                ("x-session-id", session),
            ],
        );
        host.stream(id).body = BODY.as_bytes().to_vec();
        host.enter(id);
        assert_eq!(req.on_http_request_headers(0, false), Action::Pause);
        assert_eq!(req.on_http_request_body(BODY.len(), true), Action::Continue);
        let routed = host.request_header_of(id, ROUTING).expect("routed");
        let first = routed.split(',').next().unwrap().to_string();
        nodes.entry(session.into()).or_default().insert(first);
        // The session header reaches the node as the client sent it.
        assert_eq!(
            host.request_header_of(id, "x-session-id").as_deref(),
            Some(session)
        );
        respond(&host, &mut req, id, "200");
        end(&host, &mut req, id);
    }
    assert!(nodes.values().all(|n| n.len() == 1), "{nodes:?}");
    assert_eq!(host.metric("token_balancer.prefix.cached_tokens"), 0);
}

/// A stream's token events, one a chunk as engines send them: after the first few, most
/// chunks are counted without being copied into the VM (`OutputMeter::may_skim`), and the
/// books follow every token all the same.
#[test]
fn most_of_a_streams_token_chunks_are_counted_unread() {
    let (host, root) = reported(&config(""), IDLE);
    let (mut req, node) = answering(&host, &root, 2);
    let growth = || books(&root, node).growth_tokens;
    let before = growth();
    host.take_host_calls();
    for i in 0..100 {
        // Texts of one to three characters: events of a few sizes.
        let text = "abc".get(..1 + i % 3).unwrap();
        let event = format!("data: {{\"choices\":[{{\"text\":\"{text}\",\"index\":0}}]}}\n\n");
        assert_eq!(
            response_chunk(&host, &mut req, 2, event.as_bytes(), false),
            Action::Continue
        );
    }
    let reads = |calls: Vec<String>| calls.iter().filter(|c| *c == "response_body").count();
    let read = reads(host.take_host_calls());
    assert!(read <= 16, "{read} of 100 chunks read");
    assert_eq!(before - growth(), 100, "every token is booked");
    // The last chunk is read, whatever its size.
    response_chunk(&host, &mut req, 2, b"data: [DONE]\n\n", true);
    assert_eq!(reads(host.take_host_calls()), 1);
    end(&host, &mut req, 2);
    assert_eq!(inflight(&root, node), 0);
    // Counted once the stream ends.
    assert_eq!(
        host.metric("token_balancer.output.chunks_unread"),
        100 - read as i64
    );
}

/// A reasoning model streams its thinking before its answer: the first thinking delta is its
/// first token, so the prompt's prefill leaves the books then, not when the answer starts.
#[test]
fn a_reasoning_models_thinking_is_output() {
    let (host, root) = reported(&config(""), IDLE);
    let (mut req, node) = answering(&host, &root, 2);
    let figures = || {
        let b = books(&root, node);
        (b.prefill_tokens, b.growth_tokens)
    };
    let (prefill, growth) = figures();
    assert!(prefill > 0, "the prompt waits for its prefill");
    for (i, key) in ["reasoning_content", "reasoning", "reasoning_content"]
        .iter()
        .enumerate()
    {
        let event = format!("data: {{\"choices\":[{{\"delta\":{{\"{key}\":\"hm{i}\"}}}}]}}\n\n");
        response_chunk(&host, &mut req, 2, event.as_bytes(), false);
    }
    assert_eq!(figures(), (0, growth - 3));
    end(&host, &mut req, 2);
}

/// A request to OpenAI's Responses API is priced as a generation (its prompt in `input`'s
/// items, its output cap in `max_output_tokens`), not as embeddings, and the `"delta"` events
/// of its stream are its output: the first ends its prefill in the books.
#[test]
fn a_responses_api_request_is_priced_and_its_stream_followed() {
    let (host, root) = reported(&config(""), IDLE);
    let body = r#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"hello there, how are you?"}]}],"max_output_tokens":4000,"stream":true}"#;
    let len = body.len().to_string();
    let mut req = request(
        &host,
        &root,
        2,
        &[(":path", "/v1/responses"), ("content-length", &len)],
    );
    host.stream(2).body = body.as_bytes().to_vec();
    host.enter(2);
    req.on_http_request_headers(0, false);
    assert_eq!(req.on_http_request_body(body.len(), true), Action::Continue);
    let routed = host
        .request_header_of(2, ROUTING)
        .expect("a Responses API request is routed");
    let node = usize::from(!routed.starts_with(A));
    respond(&host, &mut req, 2, "200");
    let figures = || {
        let b = books(&root, node);
        (b.prefill_tokens, b.growth_tokens)
    };
    let (prefill, growth) = figures();
    // Instructions and the message: 4 + 3 and 4 + 7 tokens; the answer's cap as its growth.
    assert_eq!(prefill, 18, "the prompt waits for its prefill");
    assert!(growth >= 3_000, "its output reserve: {growth}");
    for (kind, delta) in [
        ("reasoning_text", "Hm"),
        ("output_text", "Fine"),
        ("output_text", ", thanks"),
    ] {
        let event = format!(
            "event: response.{kind}.delta\ndata: {{\"type\":\"response.{kind}.delta\",\"delta\":\"{delta}\"}}\n\n"
        );
        response_chunk(&host, &mut req, 2, event.as_bytes(), false);
    }
    assert_eq!(figures(), (0, growth - 3));
    end(&host, &mut req, 2);
}

/// A prompt estimated from its text is booked in the engines' tokens once their answers have
/// counted enough prompts (`route::prompt_scale`): here the server counts half the estimate,
/// and after `MIN_SAMPLES` answers the next prompt is booked at half. A prompt of token ids is
/// counted exactly and never scaled; a failed answer's count is no sample.
#[test]
fn prompts_are_booked_in_the_engines_tokens_once_answers_count_them() {
    use token_balancer_core::ingest::request::{self as ingest, Api};
    use token_balancer_core::route::prompt_scale::MIN_SAMPLES;
    let (host, root) = reported(&config(""), IDLE);
    let text = format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":4}}"#,
        "hello there ".repeat(100)
    );
    let estimated = ingest::read(Api::Completions, text.as_bytes(), 256)
        .unwrap()
        .weight
        .prompt_tokens;
    assert!(estimated > 200, "{estimated}");
    // The prompt tokens the next request books, over both nodes.
    let booked = |id: u32, body: &str| {
        let before: u64 = (0..2)
            .map(|n| books(&root, n).unreflected_prompt_tokens)
            .sum();
        let (req, _, _) = post(&host, &root, id, body);
        let after: u64 = (0..2)
            .map(|n| books(&root, n).unreflected_prompt_tokens)
            .sum();
        (req, after - before)
    };
    let answered = |id: u32, mut req: Request<FakeHost>, status: &str| {
        respond(&host, &mut req, id, status);
        let usage = format!(
            r#"{{"choices":[{{"text":"a b c"}}],"usage":{{"prompt_tokens":{},"completion_tokens":3}}}}"#,
            estimated / 2
        );
        host.stream(id).response_body = usage.as_bytes().to_vec();
        host.enter(id);
        req.on_http_response_body(usage.len(), true);
        end(&host, &mut req, id);
    };
    let mut id = 2;
    // Failed answers count nothing.
    for _ in 0..MIN_SAMPLES {
        let (req, tokens) = booked(id, &text);
        assert_eq!(tokens, estimated, "as estimated until answers count it");
        answered(id, req, "500");
        id += 1;
    }
    let (req, tokens) = booked(id, &text);
    assert_eq!(tokens, estimated, "failed answers are no samples");
    assert_eq!(host.metric("token_balancer.prompt_ratio_permille"), 0);
    answered(id, req, "200");
    assert_eq!(
        host.metric("token_balancer.prompt_ratio_permille"),
        1000,
        "one answer: not used yet"
    );
    id += 1;
    for _ in 1..MIN_SAMPLES {
        let (req, _) = booked(id, &text);
        answered(id, req, "200");
        id += 1;
    }
    let (_req, tokens) = booked(id, &text);
    assert_eq!(tokens, estimated / 2, "in the engines' tokens");
    assert_eq!(host.metric("token_balancer.prompt_ratio_permille"), 500);
    // Token ids: one token an id, whatever the ratio.
    let ids = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10],"max_tokens":4}"#;
    let (_req, tokens) = booked(id + 1, ids);
    assert_eq!(tokens, 10);
}

/// A tokenizer is the model's: answers of model `a` count half the estimate and answers of
/// `b` twice it, and once each has counted `MIN_SAMPLES` prompts, each model's next prompt is
/// booked at its own ratio; a model no answer has counted is booked at the fleet's.
#[test]
fn each_models_prompts_are_booked_at_its_own_ratio() {
    use token_balancer_core::ingest::request::{self as ingest, Api};
    use token_balancer_core::route::prompt_scale::MIN_SAMPLES;
    let (host, root) = reported(&config(""), IDLE);
    let body = |model: &str| {
        format!(
            r#"{{"model":"{model}","prompt":"{}","max_tokens":4}}"#,
            "hello there ".repeat(100)
        )
    };
    let estimated = ingest::read(Api::Completions, body("a").as_bytes(), 256)
        .unwrap()
        .weight
        .prompt_tokens;
    let booked = |id: u32, model: &str| {
        let sum = || -> u64 {
            (0..2)
                .map(|n| books(&root, n).unreflected_prompt_tokens)
                .sum()
        };
        let before = sum();
        let (req, _, _) = post(&host, &root, id, &body(model));
        (req, sum() - before)
    };
    let answered = |id: u32, mut req: Request<FakeHost>, counted: u64| {
        respond(&host, &mut req, id, "200");
        let usage = format!(
            r#"{{"choices":[{{"text":"a b c"}}],"usage":{{"prompt_tokens":{counted},"completion_tokens":3}}}}"#
        );
        host.stream(id).response_body = usage.as_bytes().to_vec();
        host.enter(id);
        req.on_http_response_body(usage.len(), true);
        end(&host, &mut req, id);
    };
    // The fleet's ratio: (1/2 + 2) / 2, the answers weighed alike but for their fading.
    let fleet = estimated * 5 / 4;
    let mut id = 2;
    for pair in 0..MIN_SAMPLES {
        for (model, counted) in [("a", estimated / 2), ("b", estimated * 2)] {
            let (req, tokens) = booked(id, model);
            if pair < MIN_SAMPLES / 2 {
                assert_eq!(tokens, estimated, "as estimated until answers count it");
            } else {
                // The fleet has counted enough, each model not yet: the fleet's (its gauge,
                // which moves in steps of 0.01).
                let ratio = host
                    .metric("token_balancer.prompt_ratio_permille")
                    .unsigned_abs();
                let fleet_now = estimated * ratio / 1000;
                assert!(
                    tokens.abs_diff(fleet_now) <= estimated / 100 + 1,
                    "{tokens} against {fleet_now}"
                );
            }
            answered(id, req, counted);
            id += 1;
        }
    }
    let (_a, a) = booked(id, "a");
    let (_b, b) = booked(id + 1, "b");
    let (_c, c) = booked(id + 2, "c");
    assert_eq!((a, b), (estimated / 2, estimated * 2));
    assert!(c.abs_diff(fleet) <= 2, "{c} against {fleet}");
    assert!(
        host.metric("token_balancer.prompt_ratio_permille")
            .abs_diff(1250)
            <= 10,
        "the gauge is the fleet's"
    );
}

/// The engine's count of a prompt with an image it turns into tokens, while images are not
/// priced (the default), is no sample of how it counts text: 30 such answers, counted at
/// 1,000 tokens more than the text, leave the ratio unlearned (its gauge at 0: no sample).
#[test]
fn a_prompt_with_parts_not_priced_teaches_no_ratio() {
    let (host, root) = reported(&config(""), IDLE);
    let body = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hello there"},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}],"max_tokens":4}"#;
    let usage = br#"{"choices":[{"message":{"content":"a b c"}}],"usage":{"prompt_tokens":1010,"completion_tokens":3}}"#;
    for id in 2..32 {
        let (mut req, _, _) = post(&host, &root, id, body);
        respond(&host, &mut req, id, "200");
        host.stream(id).response_body = usage.to_vec();
        host.enter(id);
        req.on_http_response_body(usage.len(), true);
        end(&host, &mut req, id);
    }
    assert_eq!(host.metric("token_balancer.prompt_ratio_permille"), 0);
}
