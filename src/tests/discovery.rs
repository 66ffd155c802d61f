//! A node configured by its address only: the glue polls where the node's probe says
//! (`fleet::probe`), asks the next path at once when an answer is not telemetry, counts what
//! is found once, and leaves a node that is down a failed poll.

use super::*;
use crate::fake::Call;
use token_balancer_core::fleet::probe::RETRY_MS;

const VLLM: &str = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n\
                    vllm:kv_cache_usage_perc 0.1\nvllm:prompt_tokens_total 10\n\
                    vllm:generation_tokens_total 5\n";
/// The start of a vLLM node's filtered poll (`fleet::probe`).
const VLLM_FILTERED: &str = "/metrics?name%5B%5D=vllm%3Anum_requests_running&name%5B%5D=";
const LLAMACPP_HEALTH: &str = r#"{"status":"ok"}"#;

/// The one call sent to `address` since the last look.
fn call_to(host: &FakeHost, address: &str) -> Call {
    let mut calls: Vec<Call> = host
        .take_calls()
        .into_iter()
        .filter(|c| c.authority == address)
        .collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    calls.remove(0)
}

#[test]
fn an_empty_health_answer_sends_the_next_poll_to_the_metrics_at_once() {
    // Every node every tick (their answers do not move): the test is where the polls go.
    let (host, mut root) = configured(&config(r#","quiet_poll_ms":1000"#));
    tick(&host, &mut root);
    let calls = host.take_calls();
    assert!(calls.iter().all(|c| c.path == "/health"), "{calls:?}");
    let (a, b) = (&calls[0], &calls[1]);
    let (a, b) = if a.authority == A { (a, b) } else { (b, a) };
    // B serves the simple JSON format: settled there, nothing said.
    answer(&host, &mut root, b.token, Some("200"), IDLE);
    // A is an engine: its empty /health is no failure, and /metrics is asked at once.
    answer(&host, &mut root, a.token, Some("200"), "");
    assert_eq!(host.metric("token_balancer.health.unparsable"), 0);
    let m = call_to(&host, A);
    assert_eq!(m.path, "/metrics");
    answer(&host, &mut root, m.token, Some("200"), VLLM);
    assert_eq!(host.metric("token_balancer.health.ok"), 2);
    assert_eq!(host.metric("token_balancer.telemetry.discovered"), 1);
    assert_eq!(host.metric("token_balancer.telemetry.not_found"), 0);
    // From then on A is polled at /metrics, asked for the samples read alone, B at /health,
    // and nothing more is said.
    for _ in 0..3 {
        host.advance(1000);
        tick(&host, &mut root);
        let calls = host.take_calls();
        for c in &calls {
            let want = if c.authority == A {
                VLLM_FILTERED
            } else {
                "/health"
            };
            assert!(c.path.starts_with(want), "{c:?}");
            answer(
                &host,
                &mut root,
                c.token,
                Some("200"),
                if c.authority == A { VLLM } else { IDLE },
            );
        }
        assert_eq!(calls.len(), 2);
    }
    assert_eq!(host.metric("token_balancer.telemetry.discovered"), 1);
    assert_eq!(host.metric("token_balancer.health.ok"), 8);
}

#[test]
fn a_node_that_ignores_the_filter_is_polled_whole_at_once_and_from_then_on() {
    let (host, mut root) = configured(&format!(
        r#"{{"nodes":[{{"address":"{A}","health_path":"/metrics"}}],"health_cluster":"gpu_health","models_poll_ms":0,"quiet_poll_ms":1000}}"#
    ));
    tick(&host, &mut root);
    let c = call_to(&host, A);
    assert_eq!(c.path, "/metrics");
    answer(&host, &mut root, c.token, Some("200"), VLLM);
    host.advance(1000);
    tick(&host, &mut root);
    let c = call_to(&host, A);
    assert!(c.path.starts_with(VLLM_FILTERED), "{c:?}");
    // An exporter in front of the engine answers the query with an empty page: not a failed
    // poll, the whole page is asked at once.
    answer(&host, &mut root, c.token, Some("200"), "");
    assert_eq!(host.metric("token_balancer.telemetry.unfiltered"), 1);
    assert_eq!(host.metric("token_balancer.health.unparsable"), 0);
    let c = call_to(&host, A);
    assert_eq!(c.path, "/metrics");
    answer(&host, &mut root, c.token, Some("200"), VLLM);
    assert_eq!(host.metric("token_balancer.health.ok"), 2);
    for _ in 0..2 {
        host.advance(1000);
        tick(&host, &mut root);
        let c = call_to(&host, A);
        assert_eq!(c.path, "/metrics");
        answer(&host, &mut root, c.token, Some("200"), VLLM);
    }
    assert_eq!(host.metric("token_balancer.telemetry.unfiltered"), 1);
}

#[test]
fn filter_metrics_false_polls_the_whole_page() {
    let (host, mut root) = configured(&format!(
        r#"{{"nodes":[{{"address":"{A}","filter_metrics":false}}],"health_cluster":"gpu_health","models_poll_ms":0,"quiet_poll_ms":1000}}"#
    ));
    tick(&host, &mut root);
    let h = call_to(&host, A);
    answer(&host, &mut root, h.token, Some("200"), "");
    let m = call_to(&host, A);
    answer(&host, &mut root, m.token, Some("200"), VLLM);
    for _ in 0..2 {
        host.advance(1000);
        tick(&host, &mut root);
        let c = call_to(&host, A);
        assert_eq!(c.path, "/metrics");
        answer(&host, &mut root, c.token, Some("200"), VLLM);
    }
}

#[test]
fn a_node_without_telemetry_is_counted_once_and_looked_for_again() {
    let (host, mut root) = configured(&format!(
        r#"{{"nodes":[{{"address":"{A}"}}],"health_cluster":"gpu_health","models_poll_ms":0}}"#
    ));
    let not_found = |host: &FakeHost, root: &mut Root<FakeHost>| {
        let h = call_to(host, A);
        assert_eq!(h.path, "/health");
        answer(host, root, h.token, Some("200"), LLAMACPP_HEALTH);
        let m = call_to(host, A);
        assert_eq!(m.path, "/metrics");
        answer(host, root, m.token, Some("501"), "{}");
        let p = call_to(host, A);
        assert_eq!(p.path, "/prometheus/metrics");
        answer(host, root, p.token, Some("404"), "");
    };
    tick(&host, &mut root);
    not_found(&host, &mut root);
    assert_eq!(host.metric("token_balancer.telemetry.not_found"), 1);
    assert_eq!(host.metric("token_balancer.telemetry.not_found_now"), 1);
    // The steps of discovery are not health polls.
    for stat in ["ok", "failed", "unparsable", "bad_status"] {
        assert_eq!(
            host.metric(&format!("token_balancer.health.{stat}")),
            0,
            "{stat}"
        );
    }
    // Until the retry the node is polled at /health, and those are failed polls.
    host.advance(1000);
    tick(&host, &mut root);
    let h = call_to(&host, A);
    assert_eq!(h.path, "/health");
    answer(&host, &mut root, h.token, Some("200"), LLAMACPP_HEALTH);
    assert_eq!(host.metric("token_balancer.health.unparsable"), 1);
    assert!(
        host.take_calls().is_empty(),
        "no discovery before the retry"
    );
    // After RETRY_MS the metrics paths are tried again: still nothing, said no more.
    host.advance(RETRY_MS);
    tick(&host, &mut root);
    not_found(&host, &mut root);
    assert_eq!(host.metric("token_balancer.telemetry.not_found"), 1);
    // The engine restarted with its metrics: found on the next retry.
    host.advance(RETRY_MS);
    tick(&host, &mut root);
    let h = call_to(&host, A);
    answer(&host, &mut root, h.token, Some("200"), LLAMACPP_HEALTH);
    let m = call_to(&host, A);
    answer(
        &host,
        &mut root,
        m.token,
        Some("200"),
        "llamacpp:requests_processing 0\nllamacpp:prompt_tokens_total 3\n",
    );
    assert_eq!(host.metric("token_balancer.telemetry.discovered"), 1);
    assert_eq!(host.metric("token_balancer.telemetry.not_found_now"), 0);
    assert_eq!(host.metric("token_balancer.health.ok"), 1);
}

#[test]
fn a_node_that_does_not_answer_is_a_failed_poll_not_a_node_without_telemetry() {
    let (host, mut root) = configured(&config(""));
    for _ in 0..3 {
        tick(&host, &mut root);
        for c in host.take_calls() {
            assert_eq!(c.path, "/health");
            answer(
                &host,
                &mut root,
                c.token,
                if c.authority == A { None } else { Some("503") },
                "",
            );
        }
        assert!(host.take_calls().is_empty(), "nothing else asked");
        host.advance(1000);
    }
    assert_eq!(host.metric("token_balancer.health.no_answer"), 3);
    assert_eq!(host.metric("token_balancer.health.bad_status"), 3);
    assert_eq!(host.metric("token_balancer.nodes_ejected"), 2);
    assert_eq!(host.metric("token_balancer.telemetry.not_found"), 0);
}

#[test]
fn a_configured_health_path_is_polled_as_it_is() {
    let (host, mut root) = configured(&format!(
        r#"{{"nodes":[{{"address":"{A}","health_path":"/health"}},{{"address":"{B}","health_path":"/stats"}}],
            "health_cluster":"gpu_health","models_poll_ms":0}}"#
    ));
    tick(&host, &mut root);
    let calls = host.take_calls();
    let mut polled: Vec<(&str, &str)> = calls
        .iter()
        .map(|c| (c.authority.as_str(), c.path.as_str()))
        .collect();
    polled.sort_unstable();
    assert_eq!(polled, [(A, "/health"), (B, "/stats")]);
    for c in &calls {
        answer(&host, &mut root, c.token, Some("200"), "");
    }
    // Empty answers of a configured path are unreadable polls, not a reason to look further.
    assert_eq!(host.metric("token_balancer.health.unparsable"), 2);
    assert!(host.take_calls().is_empty());
    assert_eq!(host.metric("token_balancer.telemetry.discovered"), 0);
}

#[test]
fn a_node_without_telemetry_that_leaves_the_cluster_leaves_the_gauge() {
    let (host, mut root) = configured(FOLLOWING);
    tick(&host, &mut root);
    let admin = host.take_calls().remove(0);
    answer(&host, &mut root, admin.token, Some("200"), &members(&[A]));
    host.advance(100);
    tick(&host, &mut root);
    let calls = host.take_calls();
    let health = calls.iter().find(|c| c.path == "/health").unwrap();
    let admin = calls.iter().find(|c| c.cluster == "admin").unwrap();
    answer(&host, &mut root, health.token, Some("200"), LLAMACPP_HEALTH);
    let m = call_to(&host, A);
    answer(&host, &mut root, m.token, Some("501"), "");
    let p = call_to(&host, A);
    answer(&host, &mut root, p.token, Some("404"), "");
    assert_eq!(host.metric("token_balancer.telemetry.not_found_now"), 1);
    answer(&host, &mut root, admin.token, Some("200"), &members(&[]));
    assert_eq!(host.metric("token_balancer.nodes_left"), 1);
    assert_eq!(host.metric("token_balancer.telemetry.not_found_now"), 0);
}

/// Nodes whose reports move nothing are polled less often, up to `quiet_poll_ms`; one whose
/// report moves is polled every tick again (see `fleet::polling`).
#[test]
fn quiet_nodes_are_polled_less_often_until_their_reports_move() {
    let (host, mut root) = configured(&config(
        r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":400"#,
    ));
    const BUSY: &str =
        r#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000,"running_requests":3}"#;
    // 3 s of ticks, every answer at once; A turns busy (its report moves every poll) after 1.5 s.
    let mut polls = std::collections::HashMap::<(String, bool), u32>::new();
    for t in 0..30 {
        tick(&host, &mut root);
        let late = t >= 15;
        for c in host.take_calls() {
            let n = polls.entry((c.authority.clone(), late)).or_default();
            *n += 1;
            // A's reports alternate between busy and idle: each one moves.
            let body = if c.authority == A && late && *n % 2 == 1 {
                BUSY
            } else {
                IDLE
            };
            answer(&host, &mut root, c.token, Some("200"), body);
        }
        if t == 14 {
            assert_eq!(host.metric("token_balancer.health.quiet_nodes"), 2);
        }
        host.advance(100);
    }
    let count = |node: &str, late: bool| polls.get(&(node.to_string(), late)).copied().unwrap_or(0);
    // The first 1.5 s: polled at 100, 200, then 400 ms periods: 1 + 1 + 1 + 3 = 6, not 15.
    assert!((5..=7).contains(&count(A, false)), "{polls:?}");
    assert!((5..=7).contains(&count(B, false)), "{polls:?}");
    // B stays quiet: once every 400 ms. A moves: within a period, every tick from then on.
    assert!((3..=5).contains(&count(B, true)), "{polls:?}");
    assert!(count(A, true) >= 13, "{polls:?}");
    assert_eq!(host.metric("token_balancer.health.quiet_nodes"), 1);
    // Every report stays fresh: nothing went to Envoy's fallback for lack of one.
    assert_eq!(host.metric("token_balancer.health.failed"), 0);
}

/// A quiet node that runs one of this VM's requests whose first token has not come back is
/// polled every tick until the request ends: the burst's effect on it is followed as closely
/// as without quiet polling.
#[test]
fn a_quiet_node_with_a_request_in_flight_is_polled_every_tick() {
    let (host, mut root) = configured(&config(
        r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":400"#,
    ));
    // Quiet: the same idle report a few times over.
    for _ in 0..8 {
        tick(&host, &mut root);
        answer_health(&host, &mut root, IDLE);
        host.advance(100);
    }
    assert_eq!(host.metric("token_balancer.health.quiet_nodes"), 2);
    let (mut req, _, _) = post(&host, &root, 7, BODY);
    let node = if inflight(&root, 0) == 1 { A } else { B };
    let count = |host: &FakeHost, root: &mut Root<FakeHost>, ticks: usize| {
        let mut polls = std::collections::HashMap::<String, usize>::new();
        for _ in 0..ticks {
            tick(host, root);
            for c in host.take_calls() {
                *polls.entry(c.authority.clone()).or_default() += 1;
                answer(host, root, c.token, Some("200"), IDLE);
            }
            host.advance(100);
        }
        polls
    };
    let busy = count(&host, &mut root, 8);
    let other = if node == A { B } else { A };
    assert_eq!(busy.get(node).copied(), Some(8), "{busy:?}");
    assert!(busy.get(other).copied().unwrap_or(0) <= 3, "{busy:?}");
    // The request ends: quiet again, polled at the longer period.
    respond(&host, &mut req, 7, "200");
    end(&host, &mut req, 7);
    let _ = count(&host, &mut root, 4);
    let after = count(&host, &mut root, 8);
    assert!(after.get(node).copied().unwrap_or(0) <= 3, "{after:?}");
}

/// A node decoding this VM's stream, its prompt done, is polled at the longer period while
/// its reports show room to spare, though they move; every tick again once one shows a queue.
#[test]
fn a_node_decoding_with_room_to_spare_is_polled_less_often() {
    let (host, mut root) = configured(&config(
        r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":400"#,
    ));
    // Reports that move every poll (one or two running, KV use 20% or 25%) with room to spare,
    // and reports that move with requests waiting.
    let slack = |n: usize| {
        format!(
            r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":1000,"running_requests":{},"queue_depth":0,"kv_cache_usage":{}}}"#,
            100 + 100 * (n % 2),
            1 + n % 2,
            0.2 + 0.05 * (n % 2) as f64
        )
    };
    let queued = |n: usize| {
        format!(
            r#"{{"tokens_per_sec_load":900,"tokens_per_sec_capacity":1000,"running_requests":8,"queue_depth":{},"kv_cache_usage":0.3}}"#,
            3 + n % 2
        )
    };
    // Answers so far by node: each node's next report differs from its last.
    let mut answered = std::collections::HashMap::<String, usize>::new();
    let mut run = |host: &FakeHost, root: &mut Root<FakeHost>, ticks: usize, waiting: bool| {
        let mut polls = std::collections::HashMap::<String, usize>::new();
        for _ in 0..ticks {
            tick(host, root);
            for c in host.take_calls() {
                *polls.entry(c.authority.clone()).or_default() += 1;
                let n = answered.entry(c.authority.clone()).or_default();
                *n += 1;
                let body = if waiting { queued(*n) } else { slack(*n) };
                answer(host, root, c.token, Some("200"), &body);
            }
            host.advance(100);
        }
        polls
    };
    let _ = run(&host, &mut root, 8, false);
    let (mut req, _, _) = post(&host, &root, 7, BODY);
    let node = if inflight(&root, 0) == 1 { A } else { B };
    // Its prompt has not started: every tick.
    let prefilling = run(&host, &mut root, 6, false);
    assert_eq!(prefilling.get(node).copied(), Some(6), "{prefilling:?}");
    // The first token came back: the stream decodes, and the node is polled as a quiet one.
    respond(&host, &mut req, 7, "200");
    host.stream(7).response_body = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n".to_vec();
    host.enter(7);
    assert_eq!(req.on_http_response_body(40, false), Action::Continue);
    assert_eq!(inflight(&root, usize::from(node == B)), 1, "still running");
    let _ = run(&host, &mut root, 4, false);
    let decoding = run(&host, &mut root, 8, false);
    assert!(
        decoding.get(node).copied().unwrap_or(0) <= 3,
        "{decoding:?}"
    );
    // Requests wait there: every tick again, within a period.
    let _ = run(&host, &mut root, 4, true);
    let busy = run(&host, &mut root, 8, true);
    assert_eq!(busy.get(node).copied(), Some(8), "{busy:?}");
    end(&host, &mut req, 7);
}

/// What the engines say of their prefix caches reaches the per-node gauges: vLLM's counters
/// as tokens, SGLang's recent rate in thousandths (the mean over its data-parallel ranks).
#[test]
fn the_engines_own_prefix_cache_figures_become_per_node_gauges() {
    let (host, mut root) = configured(&format!(
        r#"{{"nodes":[{{"address":"{A}","health_path":"/metrics"}},{{"address":"{B}","health_path":"/metrics"}}],"health_cluster":"gpu_health","models_poll_ms":0}}"#
    ));
    tick(&host, &mut root);
    for c in host.take_calls() {
        let body = if c.authority == A {
            format!(
                "{VLLM}vllm:prefix_cache_hits_total 300\nvllm:prefix_cache_queries_total 1000\n"
            )
        } else {
            "sglang:num_running_reqs{dp_rank=\"0\"} 1\nsglang:num_running_reqs{dp_rank=\"1\"} 1\n\
             sglang:cache_hit_rate{dp_rank=\"0\"} 0.5\nsglang:cache_hit_rate{dp_rank=\"1\"} 0.75\n"
                .to_string()
        };
        answer(&host, &mut root, c.token, Some("200"), &body);
    }
    let node = |a: &str, what: &str| host.metric(&format!("token_balancer.node.{a}.{what}"));
    assert_eq!(node(A, "engine_prefix_hit_tokens"), 300);
    assert_eq!(node(A, "engine_prefix_query_tokens"), 1000);
    assert_eq!(node(B, "engine_prefix_hit_permille"), 625);
    assert_eq!(
        node(A, "engine_prefix_hit_permille"),
        0,
        "vLLM publishes counters, not a rate"
    );
}
