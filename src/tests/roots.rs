//! The root context: the stats it defines, the roles, and the callout answers (one for a node
//! that left the cluster is dropped).

use super::*;
use crate::request::SHARED_PROGRESS_STEP;
use proxy_wasm::types::MetricType;
use token_balancer_core::share::{books_key, Books, POLLER_ROOT_ID};

/// Every stat name the filter has always had: dashboards, the README and the integration
/// tests read them, so none may change.
const NAMES: &[&str] = &[
    "routed",
    "routed_over_vram_ceiling",
    "served_elsewhere",
    "stored.recorded",
    "stored.found",
    "stored.unknown",
    "stored.asked",
    "stored.asked_found",
    "fallback.no_fresh_nodes",
    "fallback.no_body",
    "fallback.body_unusable",
    "fallback.body_over_limit",
    "fallback.encoded_body",
    "fallback.internal",
    "fallback.unknown_model",
    "fallback.no_fleet",
    "rejected.unknown_model",
    "rejected.ttft_budget",
    "rejected.ttft_budget_held",
    "rejected.shed",
    "rejected.full",
    "admission.bad_header",
    "client_routing_header_removed",
    "explain.granted",
    "explain.refused",
    "held",
    "held_routed_over_ceiling",
    "held_queue_full",
    "held_client_gone",
    "held_reconfigured",
    "health.ok",
    "health.failed",
    "health.unparsable",
    "health.no_answer",
    "health.bad_status",
    "health.too_large",
    "telemetry.discovered",
    "telemetry.not_found",
    "telemetry.unfiltered",
    "nodes_ejected",
    "nodes_readmitted",
    "models.ok",
    "models.failed",
    "models.unparsable",
    "members.ok",
    "members.failed",
    "nodes_joined",
    "nodes_left",
    "shared.failed",
    "shared.cas_retries",
    "shared.cas_exhausted",
    "shared.books_missing",
    "shared.books_gone",
    "shared.published",
    "shared.imported",
    "shared.wakes_lost",
    "prefix.prompt_tokens",
    "prefix.cached_tokens",
    "prefix.shared_published",
    "prefix.shared_dropped",
    "prefix.shared_taken",
    "prefix.shared_missed",
    "output.chunks_unread",
];
const GAUGES: &[&str] = &[
    "held_now",
    "inflight_now",
    "vm_memory_bytes",
    "members_now",
    "shared.inflight_requests",
    "shared.inflight_tokens",
    "telemetry.not_found_now",
    "health.quiet_nodes",
    "prompt_ratio_permille",
    "prefix.blocks",
    "prefix.bytes",
];

#[test]
fn every_stat_keeps_its_name_and_kind() {
    let (host, _root) = configured(&config(""));
    let mut got = host.metric_names();
    let node = |a: &str, what: &str| {
        let kind = if what.starts_with("engine_") {
            MetricType::Gauge
        } else {
            MetricType::Counter
        };
        (kind, format!("token_balancer.node.{a}.{what}"))
    };
    let mut want: Vec<(MetricType, String)> = NAMES
        .iter()
        .map(|n| (MetricType::Counter, format!("token_balancer.{n}")))
        .chain(
            GAUGES
                .iter()
                .map(|n| (MetricType::Gauge, format!("token_balancer.{n}"))),
        )
        .chain([A, B].iter().flat_map(|a| {
            [
                node(a, "picks"),
                node(a, "health_failures"),
                node(a, "prompt_tokens"),
                node(a, "cached_tokens"),
                node(a, "engine_prefix_hit_tokens"),
                node(a, "engine_prefix_query_tokens"),
                node(a, "engine_prefix_hit_permille"),
            ]
        }))
        .collect();
    let key = |(k, n): &(MetricType, String)| (*k as u32, n.clone());
    got.sort_by_key(key);
    want.sort_by_key(key);
    assert_eq!(got, want);
}

#[test]
fn a_bad_configuration_is_refused() {
    let host = FakeHost::default();
    host.world().configuration = br#"{"nodes":[]}"#.to_vec();
    assert!(!Root::new(ROOT, host.clone()).on_configure(0));
    // The poller service needs `poller: singleton`.
    host.world().configuration = config("").into_bytes();
    host.world().root_id = Some(POLLER_ROOT_ID.as_bytes().to_vec());
    assert!(!Root::new(ROOT, host.clone()).on_configure(0));
}

#[test]
fn the_first_tick_polls_every_node_and_sets_the_tick() {
    let (host, mut root) = configured(&config(r#","tick_ms":200"#));
    assert_eq!(
        host.world().tick,
        Some(std::time::Duration::from_millis(50))
    );
    tick(&host, &mut root);
    let calls = host.take_calls();
    let mut polled: Vec<&str> = calls.iter().map(|c| c.authority.as_str()).collect();
    polled.sort_unstable();
    assert_eq!(polled, [A, B]);
    assert!(calls.iter().all(|c| c.cluster == "gpu_health"));
    assert_eq!(
        host.world().tick,
        Some(std::time::Duration::from_millis(200))
    );
    // A node that has not answered is not asked again.
    host.advance(200);
    tick(&host, &mut root);
    assert!(host.take_calls().is_empty());
    // Failed answers count, per node too.
    for c in &calls {
        answer(&host, &mut root, c.token, None, "");
    }
    assert_eq!(host.metric("token_balancer.health.failed"), 2);
    assert_eq!(host.metric("token_balancer.health.no_answer"), 2);
    let failures = format!("token_balancer.node.{A}.health_failures");
    assert_eq!(host.metric(&failures), 1);
}

#[test]
fn a_departed_nodes_late_health_answer_does_not_land_on_its_slots_new_tenant() {
    let (host, mut root) = configured(FOLLOWING);
    tick(&host, &mut root);
    let calls = host.take_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].path, "/clusters?format=json");
    answer(
        &host,
        &mut root,
        calls[0].token,
        Some("200"),
        &members(&[A]),
    );
    assert_eq!(host.metric("token_balancer.nodes_joined"), 1);
    // The next tick asks A for its health and the admin for the members again.
    host.advance(100);
    tick(&host, &mut root);
    let calls = host.take_calls();
    let health = calls.iter().find(|c| c.path == "/health").unwrap();
    let admin = calls.iter().find(|c| c.cluster == "admin").unwrap();
    assert_eq!(health.authority, A);
    // A is replaced by B before its answer comes: B takes A's slot.
    answer(&host, &mut root, admin.token, Some("200"), &members(&[B]));
    assert_eq!(host.metric("token_balancer.nodes_joined"), 2);
    {
        let state = root.state().borrow();
        let nodes = state.as_ref().unwrap().balancer.nodes();
        assert_eq!((nodes.len(), nodes[0].address()), (1, B));
    }
    // A's answer comes late: it is not B's report.
    answer(&host, &mut root, health.token, Some("200"), IDLE);
    assert_eq!(host.metric("token_balancer.health.ok"), 0);
    {
        let state = root.state().borrow();
        let b = &state.as_ref().unwrap().balancer.nodes()[0];
        assert!(b.report_taken().is_none(), "A's report landed on B");
    }
    // B is asked for its own health on the next tick, and its answer is taken.
    host.advance(100);
    tick(&host, &mut root);
    let calls = host.take_calls();
    let health = calls.iter().find(|c| c.path == "/health").unwrap();
    assert_eq!(health.authority, B);
    answer(&host, &mut root, health.token, Some("200"), IDLE);
    assert_eq!(host.metric("token_balancer.health.ok"), 1);
}

#[test]
fn a_departed_nodes_failed_answer_does_not_eject_its_successor() {
    let json = FOLLOWING.replace(
        "\"tick_ms\":100",
        "\"tick_ms\":100,\"unhealthy_after_failures\":1",
    );
    let (host, mut root) = configured(&json);
    tick(&host, &mut root);
    let admin = host.take_calls().remove(0);
    answer(&host, &mut root, admin.token, Some("200"), &members(&[A]));
    host.advance(100);
    tick(&host, &mut root);
    let calls = host.take_calls();
    let health = calls.iter().find(|c| c.path == "/health").unwrap();
    let admin = calls.iter().find(|c| c.cluster == "admin").unwrap();
    answer(&host, &mut root, admin.token, Some("200"), &members(&[B]));
    answer(&host, &mut root, health.token, None, "");
    assert_eq!(host.metric("token_balancer.health.failed"), 0);
    assert_eq!(host.metric("token_balancer.nodes_ejected"), 0);
}

/// A poller service and a worker reading its fleet, over one Envoy's shared data.
fn singleton() -> (FakeHost, Root<FakeHost>, Root<FakeHost>) {
    singleton_with("")
}

/// The poller service and one worker, configured with `extra` fields too (see `config`),
/// after a first round of idle reports.
fn singleton_with(extra: &str) -> (FakeHost, Root<FakeHost>, Root<FakeHost>) {
    let json = config(&format!(r#","poller":"singleton"{extra}"#));
    service_and_worker(&json, |host, service| {
        tick(host, service);
        answer_health(host, service, IDLE);
        assert_eq!(
            host.metric("token_balancer.shared.published"),
            2,
            "at start, then the round"
        );
    })
}

/// The poller service configured with `json`, `first` done with it, then one worker.
fn service_and_worker(
    json: &str,
    first: impl FnOnce(&FakeHost, &mut Root<FakeHost>),
) -> (FakeHost, Root<FakeHost>, Root<FakeHost>) {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.configuration = json.as_bytes().to_vec();
        w.root_id = Some(POLLER_ROOT_ID.as_bytes().to_vec());
        w.now_ms = 1_000_000;
    }
    host.enter(ROOT);
    let mut service = Root::new(ROOT, host.clone());
    assert!(service.on_configure(0));
    first(&host, &mut service);
    host.world().root_id = None;
    host.enter(100);
    let mut worker = Root::new(100, host.clone());
    assert!(worker.on_configure(0));
    (host, service, worker)
}

/// A round of the poller service 100 ms after the last: its tick, every callout answered
/// with an idle report; the addresses it polled.
fn round(host: &FakeHost, service: &mut Root<FakeHost>) -> Vec<String> {
    host.advance(100);
    tick(host, service);
    let calls = host.take_calls();
    for c in &calls {
        answer(host, service, c.token, Some("200"), IDLE);
    }
    calls.into_iter().map(|c| c.authority).collect()
}

/// The poller service polls a quiet node every tick while a worker's request is in flight
/// there, as the node's shared books show it, and at the longer period again once it ends.
#[test]
fn the_service_polls_a_quiet_node_every_tick_while_a_workers_request_runs_there() {
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":400"#);
    for _ in 0..8 {
        round(&host, &mut service);
    }
    assert_eq!(host.metric("token_balancer.health.quiet_nodes"), 2);
    // A worker routes a request: its node is polled every tick from the next round on.
    host.advance(1);
    let (mut req, _, _) = post(&host, &worker, 7, BODY);
    let there = if shared_books(&host, 0).inflight_requests == 1 {
        A
    } else {
        B
    };
    let other = if there == A { B } else { A };
    let polled: Vec<Vec<String>> = (0..6).map(|_| round(&host, &mut service)).collect();
    let times = |who: &str| polled.iter().filter(|p| p.iter().any(|a| a == who)).count();
    assert_eq!(times(there), 6, "{polled:?}");
    assert!(times(other) <= 2, "{polled:?}");
    // The request ends: quiet again, polled at the longer period.
    respond(&host, &mut req, 7, "200");
    end(&host, &mut req, 7);
    for _ in 0..4 {
        round(&host, &mut service);
    }
    let polled: Vec<Vec<String>> = (0..8).map(|_| round(&host, &mut service)).collect();
    let times = |who: &str| polled.iter().filter(|p| p.iter().any(|a| a == who)).count();
    assert!(times(there) <= 3, "{polled:?}");
}

/// Between a quiet node's polls the poller service reads one key a tick, the wake list the
/// workers name nodes on (`share::wake`), and a node's books only at its answers: not, as it
/// did, every quiet node's books every tick.
#[test]
fn the_service_reads_no_quiet_nodes_books_between_their_polls() {
    let (host, mut service, _worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":800"#);
    for _ in 0..20 {
        round(&host, &mut service);
    }
    host.take_host_calls();
    let polls: usize = (0..40).map(|_| round(&host, &mut service).len()).sum();
    let calls = host.take_host_calls();
    let count = |prefix: &str| calls.iter().filter(|c| c.starts_with(prefix)).count();
    let books = count("shared get token_balancer.books.");
    let lists = count("shared get token_balancer.wake");
    // Two nodes every 800 ms for 4 s: about 10 polls, each answer's read of the books, and
    // the gauges' every four ticks (2 nodes x 10). Reading every quiet node's books every
    // tick was 2 x 40.
    assert!(polls <= 12, "{polls} polls");
    assert!(
        books <= polls + 2 * 10,
        "{books} reads of the books, {polls} polls"
    );
    assert_eq!(lists, 40, "the wake list once a tick");
}

/// A worker names a quiet node at its prompt, but the stream is under way before the
/// service's next tick (its first tokens booked in the shared books): the service reads the
/// node's books, finds no prompt waiting, and the node keeps its longer period (a poll per name
/// would cost a busy fleet more polls than reading the books did).
#[test]
fn a_named_node_whose_prompt_has_started_keeps_its_period() {
    const STREAM: &str = r#"{"model":"m","prompt":"hello there","max_tokens":40,"stream":true}"#;
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":800"#);
    for _ in 0..20 {
        round(&host, &mut service);
    }
    let mut polls = 0;
    for id in 0..8u32 {
        host.advance(1);
        let (mut req, _, _) = post(&host, &worker, 50 + id, STREAM);
        respond(&host, &mut req, 50 + id, "200");
        let token = r#"data: {"choices":[{"text":"a","index":0}]}"#.to_string() + "\n\n";
        for _ in 0..SHARED_PROGRESS_STEP {
            response_chunk(&host, &mut req, 50 + id, token.as_bytes(), false);
        }
        polls += round(&host, &mut service).len();
        end(&host, &mut req, 50 + id);
    }
    // Two nodes for 0.8 s at an 800-ms period: about two polls, not one a request.
    assert!(polls <= 4, "{polls} polls for 8 requests under way at once");
}

/// A worker names a node once per report of it. A prompt sent after the node's answer but
/// before the service publishes that answer is sent by a worker that already named the node
/// at that report: the service reads the named node's books once more when it publishes, and
/// polls it every tick while that prompt waits.
#[test]
fn a_prompt_sent_between_a_named_nodes_answer_and_the_snapshot_is_followed() {
    const STREAM: &str = r#"{"model":"m","prompt":"hello there","max_tokens":40,"stream":true}"#;
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":800"#);
    // B's cache is full (and moves, so B is polled every tick): every prompt goes to A.
    const NEARLY_FULL: &str = r#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000,"vram_used_bytes":950000000,"vram_total_bytes":1000000000}"#;
    let mut b_reports = 0u32;
    let mut report = |authority: &str| {
        if authority == A {
            return IDLE;
        }
        b_reports += 1;
        if b_reports % 2 == 0 {
            FULL
        } else {
            NEARLY_FULL
        }
    };
    let mut polled_round = |first: bool| {
        host.advance(100);
        tick(&host, &mut service);
        let mut calls = host.take_calls();
        // A's answer first, then B's: between them, the caller's prompt.
        calls.sort_by_key(|c| c.authority != A);
        let both = calls.len() == 2;
        let mut sent = None;
        for (k, c) in calls.iter().enumerate() {
            answer(
                &host,
                &mut service,
                c.token,
                Some("200"),
                report(&c.authority),
            );
            if first && k == 0 && both {
                host.advance(1);
                sent = Some(post(&host, &worker, 61, STREAM).0);
            }
        }
        (
            calls.into_iter().map(|c| c.authority).collect::<Vec<_>>(),
            sent,
        )
    };
    for _ in 0..20 {
        polled_round(false);
    }
    // A first stream, under way at once: A is named, its books read, nothing waiting.
    host.advance(1);
    let (mut first, _, _) = post(&host, &worker, 60, STREAM);
    assert_eq!(
        host.request_header_of(60, ROUTING)
            .map(|h| h.starts_with(A)),
        Some(true)
    );
    respond(&host, &mut first, 60, "200");
    let token = r#"data: {"choices":[{"text":"a","index":0}]}"#.to_string() + "\n\n";
    for _ in 0..SHARED_PROGRESS_STEP {
        response_chunk(&host, &mut first, 60, token.as_bytes(), false);
    }
    end(&host, &mut first, 60);
    // A round that polls both: A's answer, the second prompt, B's answer and the snapshot.
    let mut second = None;
    for _ in 0..20 {
        if let (_, Some(req)) = polled_round(true) {
            second = Some(req);
            break;
        }
    }
    let Some(mut second) = second else {
        panic!("no round polled both nodes")
    };
    assert_eq!(
        host.request_header_of(61, ROUTING)
            .map(|h| h.starts_with(A)),
        Some(true)
    );
    let polled: Vec<Vec<String>> = (0..6).map(|_| polled_round(false).0).collect();
    let times = polled.iter().filter(|p| p.iter().any(|a| a == A)).count();
    assert_eq!(times, 6, "{polled:?}");
    respond(&host, &mut second, 61, "200");
    end(&host, &mut second, 61);
}

/// A node the workers' snapshot shows busy (polled every tick, so a worker names it on no
/// list) whose answers then turn quiet while a prompt sent there waits: the answer's check of
/// its books keeps it polled every tick.
#[test]
fn a_node_turning_quiet_while_a_prompt_waits_is_polled_every_tick() {
    const BUSY: &str = r#"{"tokens_per_sec_load":900,"tokens_per_sec_capacity":1000}"#;
    const BUSIER: &str = r#"{"tokens_per_sec_load":700,"tokens_per_sec_capacity":1000}"#;
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":400"#);
    let round_of = |host: &FakeHost, service: &mut Root<FakeHost>, body: &str| {
        host.advance(100);
        tick(host, service);
        let calls = host.take_calls();
        for c in &calls {
            answer(host, service, c.token, Some("200"), body);
        }
        calls.into_iter().map(|c| c.authority).collect::<Vec<_>>()
    };
    // Reports that move and show no room to spare: every node polled every tick.
    for i in 0..6 {
        let polled = round_of(&host, &mut service, if i % 2 == 0 { BUSY } else { BUSIER });
        assert_eq!(polled.len(), 2, "round {i}");
    }
    host.advance(1);
    host.take_host_calls();
    let (mut req, _, _) = post(&host, &worker, 7, BODY);
    let named = host
        .take_host_calls()
        .iter()
        .filter(|c| c.starts_with("shared set token_balancer.wake"))
        .count();
    assert_eq!(named, 0, "a node polled every tick is named on no list");
    let there = if shared_books(&host, 0).inflight_requests == 1 {
        A
    } else {
        B
    };
    let other = if there == A { B } else { A };
    // The same report from now on: quiet, so polled at the longer period, but for the
    // prompt that waits there.
    let polled: Vec<Vec<String>> = (0..8)
        .map(|_| round_of(&host, &mut service, BUSIER))
        .collect();
    let times = |who: &str| polled.iter().filter(|p| p.iter().any(|a| a == who)).count();
    assert_eq!(times(there), 8, "{polled:?}");
    assert!(times(other) <= 4, "{polled:?}");
    respond(&host, &mut req, 7, "200");
    end(&host, &mut req, 7);
}

/// A quiet node polled less often than the staleness limit stays in a worker's choice: the
/// poller publishes each node's poll grace with its report, and the report stays fresh until
/// the next poll is late (`NodeState::fresh_until`).
#[test]
fn a_worker_keeps_a_quiet_node_polled_less_often_than_the_staleness_limit() {
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":300,"quiet_poll_ms":800"#);
    for _ in 0..20 {
        round(&host, &mut service);
    }
    assert_eq!(host.metric("token_balancer.health.quiet_nodes"), 2);
    // Two seconds more, a request each round, each answered and ended at once.
    let mut polls = 0;
    for id in 0..20u32 {
        polls += round(&host, &mut service).len();
        host.advance(1);
        let (mut req, _, body) = post(&host, &worker, 100 + id, BODY);
        assert_eq!(body, Action::Continue);
        assert!(
            host.request_header_of(100 + id, ROUTING).is_some(),
            "request {id}"
        );
        respond(&host, &mut req, 100 + id, "200");
        end(&host, &mut req, 100 + id);
    }
    assert_eq!(host.metric("token_balancer.fallback.no_fresh_nodes"), 0);
    assert_eq!(host.metric("token_balancer.routed"), 20);
    // Each node about once every 800 ms, not every 100 (a node whose request has just
    // ended may be polled at the next tick).
    assert!(polls <= 2 * 20 / 2, "{polls} polls");
}

fn shared_books(host: &FakeHost, slot: usize) -> Books {
    let data = host.world().shared[&books_key(slot)].0.clone();
    Books::decode(&data).unwrap()
}

#[test]
fn a_reader_routes_on_the_services_fleet_and_shares_its_books() {
    let (host, _service, mut worker) = singleton();
    host.enter(100);
    worker.on_tick();
    assert!(host.take_calls().is_empty(), "a reader polls nothing");
    assert_eq!(host.metric("token_balancer.shared.imported"), 1);
    let (mut req, _, body) = post(&host, &worker, 2, BODY);
    assert_eq!(body, Action::Continue);
    let first = host.request_header_of(2, ROUTING).unwrap();
    let slot = usize::from(first.starts_with(B));
    assert_eq!(shared_books(&host, slot).inflight_requests, 1);
    end(&host, &mut req, 2);
    assert_eq!(shared_books(&host, slot).inflight_requests, 0);
    assert_eq!(host.metric("token_balancer.shared.failed"), 0);
}

/// Envoy's retries served a request on the routing header's second node: the shared books
/// every worker reads show it there, not on the node that refused it, until it ends.
#[test]
fn a_request_served_on_another_node_is_booked_there_in_the_shared_books() {
    let (host, _service, worker) = singleton();
    let (mut req, _, _) = post(&host, &worker, 2, BODY);
    let header = host.request_header_of(2, ROUTING).unwrap();
    let chosen = usize::from(header.starts_with(B));
    let (other, other_address) = if chosen == 0 { (1, B) } else { (0, A) };
    assert!(header.contains(other_address), "{header}");
    assert_eq!(shared_books(&host, chosen).inflight_requests, 1);
    host.stream(2).upstream = Some(other_address.to_string());
    respond(&host, &mut req, 2, "200");
    assert_eq!(shared_books(&host, chosen).inflight_requests, 0);
    assert_eq!(shared_books(&host, other).inflight_requests, 1);
    assert_eq!(host.metric("token_balancer.served_elsewhere"), 1);
    end(&host, &mut req, 2);
    assert_eq!(shared_books(&host, chosen).inflight_requests, 0);
    assert_eq!(shared_books(&host, other).inflight_requests, 0);
    assert_eq!(host.metric("token_balancer.shared.failed"), 0);
    // The worker sends nothing more to the node that could not serve it while the poller's
    // fleet shows no report taken after that.
    let chosen_address = if chosen == 0 { A } else { B };
    for id in 3..9 {
        let (mut req, _, _) = post(&host, &worker, id, BODY);
        let header = host.request_header_of(id, ROUTING).unwrap();
        assert!(!header.starts_with(chosen_address), "{header}");
        end(&host, &mut req, id);
    }
}

#[test]
fn a_reader_without_a_live_service_falls_back() {
    let (host, _service, worker) = singleton();
    // The service's heartbeat goes stale (default stale_after_ms: 3 s).
    host.advance(5000);
    let (_req, _, body) = post(&host, &worker, 2, BODY);
    assert_eq!(body, Action::Continue);
    assert_eq!(host.request_header_of(2, ROUTING), None);
    assert_eq!(host.metric("token_balancer.fallback.no_fleet"), 1);
}

#[test]
fn a_model_list_answer_becomes_its_nodes_list() {
    let (host, mut root) =
        configured(&config("").replace(r#""models_poll_ms":0"#, r#""models_poll_ms":1000"#));
    tick(&host, &mut root);
    let calls = host.take_calls();
    let lists: Vec<_> = calls.iter().filter(|c| c.path == "/v1/models").collect();
    assert_eq!(lists.len(), 2, "{calls:?}");
    let a = lists.iter().find(|c| c.authority == A).unwrap();
    answer(
        &host,
        &mut root,
        a.token,
        Some("200"),
        r#"{"object":"list","data":[{"id":"m"}]}"#,
    );
    let b = lists.iter().find(|c| c.authority == B).unwrap();
    answer(&host, &mut root, b.token, Some("500"), "");
    assert_eq!(host.metric("token_balancer.models.ok"), 1);
    assert_eq!(host.metric("token_balancer.models.failed"), 1);
    let state = root.state().borrow();
    let nodes = state.as_ref().unwrap().balancer.nodes();
    assert_eq!(nodes[0].models().listed(), Some(&["m".to_string()][..]));
    assert_eq!(nodes[1].models().listed(), None);
}

#[test]
fn a_workers_placements_reach_the_other_workers_prefix_index() {
    let (host, _service, first) = singleton();
    host.enter(200);
    let mut second = Root::new(200, host.clone());
    assert!(second.on_configure(0));
    let long = format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":20}}"#,
        "You are a careful assistant. ".repeat(60)
    );
    let (mut req, _, body) = post(&host, &first, 2, &long);
    assert_eq!(body, Action::Continue);
    let routed = host.request_header_of(2, ROUTING).unwrap();
    end(&host, &mut req, 2);
    let (there, elsewhere) = if routed.starts_with(A) {
        (0, 1)
    } else {
        (1, 0)
    };
    assert_eq!(host.metric("token_balancer.prefix.shared_published"), 1);
    let held = |root: &Root<FakeHost>, node: usize| {
        let state = root.state().borrow();
        let ix = state.as_ref().unwrap().balancer.prefixes().unwrap().clone();
        ix.held_by(node)
    };
    assert_eq!(
        held(&second, there),
        0,
        "not before the second worker decides"
    );
    // The second worker's next decision takes the first's placement in first.
    host.advance(20);
    let (mut req, _, _) = post(&host, &second, 3, BODY);
    end(&host, &mut req, 3);
    assert!(held(&first, there) >= 6, "{}", held(&first, there));
    assert_eq!(held(&second, there), held(&first, there));
    assert_eq!(held(&second, elsewhere), 0);
    assert_eq!(host.metric("token_balancer.prefix.shared_taken"), 1);
    assert_eq!(host.metric("token_balancer.prefix.shared_missed"), 0);
    assert_eq!(host.metric("token_balancer.prefix.shared_dropped"), 0);
    // And prices the same prompt where it is held.
    host.advance(20);
    let (_req, _, _) = post(&host, &second, 4, &long);
    assert_eq!(host.request_header_of(4, ROUTING).unwrap(), routed);
}

/// A worker routing many requests a second publishes their placements in batches: the
/// requests within `FOLLOW_MS` of the last batch make no call on the journal, and what they
/// gathered goes out with the next request after it or at the worker's tick, where the other
/// workers find it.
#[test]
fn a_busy_worker_publishes_its_placements_in_batches() {
    let (host, _service, mut first) = singleton();
    host.enter(200);
    let mut second = Root::new(200, host.clone());
    assert!(second.on_configure(0));
    let prompt = |i: usize| {
        format!(
            r#"{{"model":"m","prompt":"{}","max_tokens":20}}"#,
            format!("Question {i} of many: tell me about routing. ").repeat(40)
        )
    };
    let journal = |calls: &[String]| {
        calls
            .iter()
            .filter(|c| c.contains("token_balancer.placements"))
            .count()
    };
    let published = || host.metric("token_balancer.prefix.shared_published");
    // A first request's placement goes out at once: a read and a swap of the head, a write
    // of the entry (after the look at the head for the others' placements).
    host.take_host_calls();
    let (mut req, _, _) = post(&host, &first, 2, &prompt(0));
    end(&host, &mut req, 2);
    assert_eq!(journal(&host.take_host_calls()), 1 + 3);
    assert_eq!(published(), 1);
    // Three more within FOLLOW_MS: no call on the journal.
    for id in 3..6 {
        host.advance(2);
        let (mut req, _, _) = post(&host, &first, id, &prompt(id as usize));
        end(&host, &mut req, id);
    }
    assert_eq!(journal(&host.take_host_calls()), 0);
    assert_eq!(published(), 1);
    // The worker's tick, past FOLLOW_MS, publishes the three as one entry.
    host.advance(10);
    host.enter(200);
    first.on_tick();
    assert_eq!(journal(&host.take_host_calls()), 3);
    assert_eq!(published(), 4);
    // The other worker's next decision takes in all four.
    let (mut req, _, _) = post(&host, &second, 7, BODY);
    end(&host, &mut req, 7);
    assert_eq!(host.metric("token_balancer.prefix.shared_taken"), 4);
    assert_eq!(host.metric("token_balancer.prefix.shared_dropped"), 0);
}

/// The host calls of one routed request in a worker of the poller service, from its headers
/// to its end: each is a crossing into Envoy, and Envoy's work on the filter's behalf is most
/// of what the filter costs there (docs/BENCHMARKS.md, "Cost inside Envoy").
#[test]
fn a_routed_request_costs_at_most_25_host_calls() {
    let (host, _service, mut worker) = singleton();
    host.enter(100);
    worker.on_tick();
    // A first request: what is built once (metric ids, books keys, the prompt ratio's gauge
    // from the first count of a prompt) is built.
    let usage = br#"{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;
    let (mut req, _, _) = post(&host, &worker, 2, BODY);
    respond(&host, &mut req, 2, "200");
    host.stream(2).response_body = usage.to_vec();
    host.enter(2);
    req.on_http_response_body(usage.len(), true);
    end(&host, &mut req, 2);
    host.take_host_calls();
    let (mut req, _, body) = post(&host, &worker, 3, BODY);
    assert_eq!(body, Action::Continue);
    let routed = host.take_host_calls();
    respond(&host, &mut req, 3, "200");
    host.stream(3).response_body = usage.to_vec();
    host.enter(3);
    req.on_http_response_body(80, true);
    end(&host, &mut req, 3);
    let answered = host.take_host_calls();
    // Today: six request header reads, the body, the clock, the two compared nodes' shared
    // books read and the chosen one's written, the routing header, five counters (six when
    // some prompt tokens were priced as cached: a counter moved by 0 is no call); then the
    // node the response came from (the booking follows Envoy's retries), the status, the body,
    // the clock twice, the books read and written, one counter. A change that adds crossings
    // to every request must say so here.
    assert!(
        routed.len() <= 17,
        "{} host calls to route:\n{routed:#?}",
        routed.len()
    );
    assert!(
        answered.len() <= 8,
        "{} host calls to answer:\n{answered:#?}",
        answered.len()
    );
    let books = |calls: &[String]| calls.iter().filter(|c| c.starts_with("shared")).count();
    assert_eq!(
        (books(&routed), books(&answered)),
        (3, 2),
        "{routed:#?}\n{answered:#?}"
    );
}

/// The poller service adds up every node's shared books for its gauges every four ticks (once
/// a second at the shipped tick), not every round: each is a read of a node's books (a
/// crossing into Envoy that returns data).
#[test]
fn the_service_reads_every_nodes_books_for_its_gauges_every_four_ticks() {
    let (host, mut service, worker) =
        singleton_with(r#","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":100"#);
    round(&host, &mut service);
    host.take_host_calls();
    // Two seconds of rounds, every node polled every tick: the only reads of the books are
    // the gauges' (no quiet node is asked whether prompts wait there).
    for _ in 0..20 {
        round(&host, &mut service);
    }
    let reads = host
        .take_host_calls()
        .iter()
        .filter(|c| c.starts_with("shared get token_balancer.books."))
        .count();
    assert!(
        reads <= 2 * 6,
        "{reads} reads of the books in 2 s of 20 rounds"
    );
    assert!(reads >= 2 * 4, "{reads}: the gauges are still kept");
    // A worker's request shows in the gauge within four ticks.
    let (mut req, _, _) = post(&host, &worker, 9, BODY);
    for _ in 0..10 {
        round(&host, &mut service);
    }
    assert_eq!(host.metric("token_balancer.shared.inflight_requests"), 1);
    end(&host, &mut req, 9);
}

/// A vLLM `/metrics` page: `running` requests, and `prompt` prompt tokens counted.
fn vllm_page(running: u64, prompt: u64) -> String {
    let l = r#"{engine="0",model_name="m"}"#;
    format!(
        "vllm:num_requests_running{l} {running}.0\nvllm:num_requests_waiting{l} 0.0\n\
         vllm:kv_cache_usage_perc{l} 0.1\nvllm:prompt_tokens_total{l} {prompt}.0\n\
         vllm:generation_tokens_total{l} 0.0\n"
    )
}

/// Streams that report no usage teach the filter nothing of how the engines count its
/// estimates; the engines' own prompt counters do. The poller service compares them with the
/// prompts its workers saw start (the shared books), publishes the ratio, and a worker scales
/// its prompts by it.
#[test]
fn the_engines_prompt_counters_scale_prompts_that_no_answer_counts() {
    let node = |a: &str| {
        format!(
            r#"{{"address":"{a}","health_path":"/metrics","format":"vllm","filter_metrics":false}}"#
        )
    };
    let json = format!(
        r#"{{"nodes":[{},{}],"health_cluster":"gpu_health","models_poll_ms":0,"poller":"singleton","tick_ms":100,"quiet_poll_ms":100}}"#,
        node(A),
        node(B)
    );
    let (host, mut service, mut worker) = service_and_worker(&json, |_, _| {});
    // The engines: each counts 1.3 tokens for every token the filter estimated of the
    // prompts that started there, and runs what the books hold in flight.
    let round = |service: &mut Root<FakeHost>, worker: &mut Root<FakeHost>| {
        host.advance(100);
        tick(&host, service);
        for c in host.take_calls() {
            assert_eq!(c.path, "/metrics", "{c:?}");
            let slot = usize::from(c.authority == B);
            let books = host
                .world()
                .shared
                .get(&books_key(slot))
                .and_then(|(b, _)| Books::decode(b))
                .unwrap_or_default();
            let counted = (books.started_text_prompt as f64 * 1.3).round() as u64;
            answer(
                &host,
                service,
                c.token,
                Some("200"),
                &vllm_page(books.inflight_requests, counted),
            );
        }
        host.enter(100);
        worker.on_tick();
    };
    round(&mut service, &mut worker);
    round(&mut service, &mut worker);
    // A request in flight on each node, that never starts: the engines run this router's work.
    let mut anchors = Vec::new();
    let mut id = 2;
    while (0..2).any(|slot| shared_books(&host, slot).inflight_requests == 0) {
        let (req, _, _) = post(&host, &worker, id, BODY);
        anchors.push(req);
        id += 1;
        assert!(id < 40, "both nodes chosen");
    }
    let prompt = format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":20}}"#,
        "a few words of text ".repeat(40)
    );
    let no_usage = r#"{"choices":[{"text":"an answer of some words"}]}"#;
    for r in 0..300 {
        if r % 5 == 0 {
            let (mut req, _, _) = post(&host, &worker, id, &prompt);
            respond(&host, &mut req, id, "200");
            host.stream(id).response_body = no_usage.as_bytes().to_vec();
            host.enter(id);
            req.on_http_response_body(no_usage.len(), true);
            end(&host, &mut req, id);
            id += 1;
        }
        round(&mut service, &mut worker);
    }
    let started: u64 = (0..2)
        .map(|s| shared_books(&host, s).started_text_prompt)
        .sum();
    assert!(started > 0, "the prompts that started are in the books");
    let ratio = worker
        .state()
        .borrow()
        .as_ref()
        .and_then(|s| s.balancer.engine_prompt_ratio());
    let ratio = ratio.expect("the engines' ratio reaches the worker");
    assert!((ratio - 1.3).abs() < 0.02, "{ratio}");
    let gauge = host.metric("token_balancer.prompt_ratio_permille");
    assert!((1280..=1320).contains(&gauge), "{gauge}");
    // A new prompt is booked in the engines' tokens.
    let before: Vec<u64> = (0..2)
        .map(|s| shared_books(&host, s).unreflected_prompt_tokens)
        .collect();
    let (_req, _, _) = post(&host, &worker, id, &prompt);
    let booked: u64 = (0..2)
        .map(|s| shared_books(&host, s).unreflected_prompt_tokens)
        .zip(&before)
        .map(|(after, before)| after.saturating_sub(*before))
        .sum();
    let estimate = token_balancer_core::ingest::request::estimate_text_tokens(
        &"a few words of text ".repeat(40),
    );
    assert!(
        booked as f64 > estimate as f64 * 1.2,
        "{booked} for an estimate of {estimate}"
    );
    drop(anchors);
}
