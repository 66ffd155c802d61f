//! The per-request explanation: given to a request that asks from an allowed source, never to
//! one from elsewhere or one that does not ask, its header never sent upstream, and the
//! access-log copy in the filter state.

use super::*;
use crate::state::FILTER_STATE_KEY;

const EXPLAIN: &str = "x-token-balancer-explain";

/// Explanations allowed from 127.0.0.1 and fd00::/8 only; `extra` more fields.
fn explaining(extra: &str) -> String {
    config(&format!(
        r#","explain":{{"sources":["127.0.0.1/32","fd00::/8"]}}{extra}"#
    ))
}

/// A completions request `id` with `body` from `source`, asking for its explanation when
/// `ask`; its response has started with a 200. Returns the request and its response headers.
fn sent(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    source: &str,
    ask: bool,
    body: &str,
) -> (Request<FakeHost>, Vec<(String, String)>) {
    let len = body.len().to_string();
    let mut headers = vec![
        (":path", "/v1/completions"),
        ("content-length", len.as_str()),
    ];
    if ask {
        headers.push((EXPLAIN, "1"));
    }
    let mut req = request(host, root, id, &headers);
    {
        let mut s = host.stream(id);
        s.body = body.as_bytes().to_vec();
        s.source = Some(source.to_string());
    }
    host.enter(id);
    req.on_http_request_headers(0, false);
    req.on_http_request_body(body.len(), true);
    assert_eq!(
        host.request_header_of(id, EXPLAIN),
        None,
        "the explain header never goes upstream"
    );
    respond(host, &mut req, id, "200");
    let response = host.stream(id).response.clone();
    (req, response)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn an_allowed_source_gets_the_explanation_of_its_request() {
    let (host, root) = reported(&explaining(""), IDLE);
    let (_req, response) = sent(&host, &root, 2, "127.0.0.1:50000", true, BODY);
    let routed = host.request_header_of(2, ROUTING).expect("routed");
    let value = header(&response, EXPLAIN).expect("the explanation");
    assert!(
        value.starts_with(&format!(
            "decision=routed; why=shortest_predicted_time; model=m; node={routed}; prompt_tokens="
        )),
        "{value}"
    );
    // Both nodes were weighed and are listed, in the routing header's order, with their
    // predicted time and KV use (unknown: the nodes report no cache).
    let candidates = value.split("; candidates=").nth(1).expect("candidates");
    let listed: Vec<&str> = candidates
        .split(',')
        .map(|c| c.split(' ').next().unwrap())
        .collect();
    assert_eq!(listed.join(","), routed);
    assert!(candidates.contains(" predicted_ms=") && candidates.contains(" kv=unknown"));
    assert!(value.contains("; output_cap=20;"), "{value}");
    assert!(value.contains("; weight_tokens="), "{value}");
    assert_eq!(host.metric("token_balancer.explain.granted"), 1);
    assert_eq!(host.metric("token_balancer.explain.refused"), 0);
    // An IPv6 source inside fd00::/8 too.
    let (_req, response) = sent(&host, &root, 3, "[fd00::7]:4000", true, BODY);
    assert!(header(&response, EXPLAIN).is_some());
    assert_eq!(host.metric("token_balancer.explain.granted"), 2);
}

#[test]
fn another_source_gets_nothing_and_the_header_is_still_removed() {
    let (host, root) = reported(&explaining(""), IDLE);
    for (id, source) in [
        (2, "127.0.0.2:50000"),
        (3, "10.1.2.3:443"),
        (4, "[fe80::1]:80"),
        (5, "not an address"),
    ] {
        let (_req, response) = sent(&host, &root, id, source, true, BODY);
        assert_eq!(header(&response, EXPLAIN), None, "{source}");
        assert!(
            host.request_header_of(id, ROUTING).is_some(),
            "still routed"
        );
    }
    // No source address at all (Envoy could not say).
    let (_req, response) = {
        let mut req = request(
            &host,
            &root,
            6,
            &[(":path", "/v1/completions"), (EXPLAIN, "1")],
        );
        host.stream(6).body = BODY.as_bytes().to_vec();
        host.enter(6);
        req.on_http_request_headers(0, false);
        assert_eq!(host.request_header_of(6, EXPLAIN), None);
        req.on_http_request_body(BODY.len(), true);
        respond(&host, &mut req, 6, "200");
        let r = host.stream(6).response.clone();
        (req, r)
    };
    assert_eq!(header(&response, EXPLAIN), None);
    assert_eq!(host.metric("token_balancer.explain.refused"), 5);
    assert_eq!(host.metric("token_balancer.explain.granted"), 0);
}

#[test]
fn a_request_that_does_not_ask_gets_nothing() {
    let (host, root) = reported(&explaining(""), IDLE);
    let (_req, response) = sent(&host, &root, 2, "127.0.0.1:50000", false, BODY);
    assert_eq!(header(&response, EXPLAIN), None);
    assert!(host.stream(2).filter_state.is_empty());
    assert_eq!(host.metric("token_balancer.explain.granted"), 0);
    assert_eq!(host.metric("token_balancer.explain.refused"), 0);
}

#[test]
fn the_debug_header_and_the_explanation_tell_the_same_decision() {
    let (host, root) = reported(&explaining(r#","debug_header":"x-debug""#), IDLE);
    let (_req, response) = sent(&host, &root, 2, "127.0.0.1:1", true, BODY);
    let debug = header(&response, "x-debug").expect("debug header");
    let explained = header(&response, EXPLAIN).expect("explanation");
    assert!(debug.starts_with("node="), "{debug}");
    assert!(
        explained.contains(&format!("; {debug}; weight_tokens=")),
        "{explained} / {debug}"
    );
    // The debug header alone, for a request that does not ask.
    let (_req, response) = sent(&host, &root, 3, "127.0.0.1:1", false, BODY);
    assert!(header(&response, "x-debug").is_some());
    assert_eq!(header(&response, EXPLAIN), None);
}

#[test]
fn fallbacks_are_explained_with_their_reason() {
    // No report yet: the request falls back, and the explanation says why.
    let (host, root) = configured(&explaining(""));
    let (_req, response) = sent(&host, &root, 2, "127.0.0.1:1", true, BODY);
    assert_eq!(
        header(&response, EXPLAIN),
        Some("decision=fallback; why=no_fresh_nodes; model=m; prompt_tokens=3; output_cap=20")
    );
    // Without a body there is nothing to read but the reason.
    let mut bare = request(
        &host,
        &root,
        3,
        &[(":path", "/v1/completions"), (EXPLAIN, "yes")],
    );
    host.stream(3).source = Some("127.0.0.1:2".into());
    host.enter(3);
    assert_eq!(bare.on_http_request_headers(0, true), Action::Continue);
    assert_eq!(host.request_header_of(3, EXPLAIN), None);
    respond(&host, &mut bare, 3, "200");
    let response = host.stream(3).response.clone();
    assert_eq!(
        header(&response, EXPLAIN),
        Some("decision=fallback; why=no_body")
    );
}

#[test]
fn a_held_request_keeps_its_ask_until_it_is_routed() {
    let (host, mut root) = reported(&explaining(r#","max_hold_ms":10000,"choices":0"#), FULL);
    let mut req = request(
        &host,
        &root,
        2,
        &[(":path", "/v1/completions"), (EXPLAIN, "1")],
    );
    {
        let mut s = host.stream(2);
        s.body = BODY.as_bytes().to_vec();
        s.source = Some("127.0.0.1:9".into());
    }
    host.enter(2);
    req.on_http_request_headers(0, false);
    assert_eq!(req.on_http_request_body(BODY.len(), true), Action::Pause);
    host.advance(1000);
    tick(&host, &mut root);
    answer_health(&host, &mut root, IDLE);
    assert_eq!(host.stream(2).resumed, 1);
    respond(&host, &mut req, 2, "200");
    let response = host.stream(2).response.clone();
    let value = header(&response, EXPLAIN).expect("explanation");
    assert!(value.starts_with("decision=routed; "), "{value}");
    assert!(value.contains("; held_ms=1000; "), "{value}");
}

#[test]
fn a_rejected_request_carries_its_explanation_in_the_filters_own_answer() {
    let json = format!(
        r#"{{"nodes":[{{"address":"{A}","models":["m"]}}],"health_cluster":"h","unknown_model":"reject",
            "explain":{{"sources":["127.0.0.1"]}}}}"#
    );
    let (host, root) = reported(&json, IDLE);
    let body = r#"{"model":"other","prompt":"x"}"#;
    let mut req = request(
        &host,
        &root,
        2,
        &[(":path", "/v1/completions"), (EXPLAIN, "1")],
    );
    {
        let mut s = host.stream(2);
        s.body = body.as_bytes().to_vec();
        s.source = Some("127.0.0.1:9".into());
    }
    host.enter(2);
    req.on_http_request_headers(0, false);
    assert_eq!(req.on_http_request_body(body.len(), true), Action::Pause);
    let s = host.stream(2);
    assert_eq!(s.reply, Some(404));
    assert_eq!(
        header(&s.response, EXPLAIN),
        Some("decision=rejected; why=unknown_model; model=other; prompt_tokens=1; output_cap=256")
    );
}

#[test]
fn with_access_log_every_decision_goes_into_the_filter_state() {
    let (host, root) = reported(&config(r#","explain":{"access_log":true}"#), IDLE);
    // No source may ask (none listed): the header is dropped and refused...
    let (_req, response) = sent(&host, &root, 2, "127.0.0.1:1", true, BODY);
    assert_eq!(header(&response, EXPLAIN), None);
    assert_eq!(host.metric("token_balancer.explain.refused"), 1);
    // ...but every request's decision is in its filter state, asked for or not.
    let (_req, _) = sent(&host, &root, 3, "127.0.0.1:1", false, BODY);
    for id in [2, 3] {
        let state = host.stream(id).filter_state.clone();
        let value = state.get(FILTER_STATE_KEY).expect("filter state");
        assert!(value.starts_with("decision=routed; "), "{value}");
    }
}
