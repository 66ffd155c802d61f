//! What the tests of the balancer and of the modules it ties together build fleets with:
//! configurations, fleets with reports, fixtures and a counting source of books; and the
//! nodes, reports and requests the tests of the choice and of the full comparison rank.

use crate::config::{Config, Rule};
use crate::fleet::node::NodeState;
use crate::fleet::node::Ticket;
pub(crate) use crate::ingest::prompt::Chain;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;
use crate::rng::SplitMix64;
use crate::route::balancer::{Balancer, BookSource, Outcome};
use crate::route::choice::{Ask, Growth, Params};
use crate::route::ranking::{decide, Decision};
use crate::share::Books;

/// `n` nodes at 127.0.0.1:8001 and up, with `extra` configuration fields.
pub(crate) fn cfg(n: usize, extra: &str) -> Config {
    let nodes: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"address":"127.0.0.1:{}"}}"#, 8001 + i))
        .collect();
    Config::parse(
        format!(
            r#"{{"nodes":[{}],"health_cluster":"h"{extra}}}"#,
            nodes.join(",")
        )
        .as_bytes(),
    )
    .unwrap()
}

/// A request of 100 prompt and 100 output tokens.
pub(crate) const W: Weight = Weight {
    prompt_tokens: 100,
    output_tokens: 100,
};

/// `n` idle nodes of capacity 1000, reported at 0.
pub(crate) fn idle_fleet(n: usize, extra: &str) -> Balancer {
    let mut b = Balancer::new(&cfg(n, extra));
    for i in 0..n {
        let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000}"#;
        b.on_health(i, Some(body), 0).unwrap();
    }
    b
}

/// `n` nodes of capacity 1000 at load `load(i)`, reported at 0.
pub(crate) fn sampled_fleet(n: usize, extra: &str, load: impl Fn(usize) -> u32) -> Balancer {
    let mut b = Balancer::new(&cfg(n, extra));
    for i in 0..n {
        let body = format!(
            r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":1000}}"#,
            load(i)
        );
        b.on_health(i, Some(body.as_bytes()), 0).unwrap();
    }
    b
}

/// The node a routed request went to.
pub(crate) fn routed_to(o: &Outcome) -> Option<usize> {
    match o {
        Outcome::Routed { ticket, .. } => Some(ticket.node),
        _ => None,
    }
}

/// The ticket of a routed request.
pub(crate) fn routed(o: &Outcome) -> Option<Ticket> {
    match o {
        Outcome::Routed { ticket, .. } => Some(*ticket),
        _ => None,
    }
}
/// A report of a node whose VRAM is all but full (at one byte a token).
pub(crate) const FULL: &[u8] = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"vram_used_bytes":990,"vram_total_bytes":1000}"#;
/// A report of a node whose VRAM has room for a few requests (at one byte a token).
pub(crate) const ROOM: &[u8] = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"vram_used_bytes":0,"vram_total_bytes":1000}"#;

/// Books from elsewhere, counted: empty, but for the nodes `full` says, whose books hold
/// enough prompt tokens to fill any cache.
pub(crate) struct Counting {
    pub(crate) reads: usize,
    full: fn(usize) -> bool,
}

impl Counting {
    pub(crate) fn new(full: fn(usize) -> bool) -> Self {
        Counting { reads: 0, full }
    }
}

impl BookSource for Counting {
    fn books(&mut self, node: usize, report_epoch: u64) -> Option<Books> {
        self.reads += 1;
        Some(Books {
            epoch: report_epoch,
            unreflected_prompt_tokens: if (self.full)(node) { 1_000_000 } else { 0 },
            ..Books::default()
        })
    }
}

/// A conversation of `context_tokens` stored at `address` (see `Balancer::pin_to`), whose
/// answer ended before any report.
pub(crate) fn stored(address: &str, context_tokens: u64) -> crate::share::stored::Stored {
    crate::share::stored::Stored {
        address: address.to_string(),
        context_tokens,
        ..Default::default()
    }
}

/// A member list.
pub(crate) fn members(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// A balancer following a cluster (no nodes yet, `kv_cache_tokens` 777 by default), every
/// node compared.
pub(crate) fn following(extra: &str) -> Balancer {
    Balancer::new(
        &Config::parse(
            format!(
                r#"{{"health_cluster":"h","choices":0,"membership":{{"cluster":"c",
                   "admin_cluster":"a","node_defaults":{{"kv_cache_tokens":777}}}}{extra}}}"#
            )
            .as_bytes(),
        )
        .unwrap(),
    )
}

/// A report of a nearly idle node of capacity 1000.
pub(crate) const IDLE: &[u8] = br#"{"tokens_per_sec_load":1,"tokens_per_sec_capacity":1000}"#;

/// A vLLM `/metrics` answer.
pub(crate) const VLLM_V1: &str = include_str!("../../tests/data/metrics/vllm_v1.prom");

/// One node per entry of `nodes` (its extra fields), every node compared.
pub(crate) fn engine_cfg(nodes: &[&str]) -> Config {
    let nodes: Vec<String> = nodes
        .iter()
        .enumerate()
        .map(|(i, extra)| format!(r#"{{"address":"127.0.0.1:{}"{extra}}}"#, 8001 + i))
        .collect();
    Config::parse(
        // Every node compared: these tests are about what the ranking knows, not sampling.
        format!(
            r#"{{"nodes":[{}],"health_cluster":"h","choices":0}}"#,
            nodes.join(",")
        )
        .as_bytes(),
    )
    .unwrap()
}

/// The vLLM fixture with its token counters moved on by `prompt` and `generation`.
pub(crate) fn vllm_later(prompt: u64, generation: u64) -> String {
    let labels = r#"{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"}"#;
    VLLM_V1
        .replace(
            &format!("vllm:prompt_tokens_total{labels} 1234567.0"),
            &format!("vllm:prompt_tokens_total{labels} {}", 1234567 + prompt),
        )
        .replace(
            &format!("vllm:generation_tokens_total{labels} 456789.0"),
            &format!(
                "vllm:generation_tokens_total{labels} {}",
                456789 + generation
            ),
        )
}

/// The rule's knobs the tests of the choice and of the full comparison rank with: the
/// token-throughput rule, every node compared and kept.
pub(crate) const P: Params = Params {
    rule: Rule::TokenThroughput,
    stale_after_ms: 3000,
    vram_ceiling: 0.9,
    kv_bytes_per_token: 1,
    keep: usize::MAX,
    choices: 0,
};

pub(crate) fn w(p: u64, o: u64) -> Weight {
    Weight {
        prompt_tokens: p,
        output_tokens: o,
    }
}

pub(crate) fn node(report: Option<Report>) -> NodeState {
    configured(report, None, None)
}

/// A node with a configured capacity and KV-cache size, reported at 1000.
pub(crate) fn configured(
    report: Option<Report>,
    capacity: Option<f64>,
    kv: Option<u64>,
) -> NodeState {
    let mut n = NodeState::new("127.0.0.1:1", capacity, kv);
    if let Some(r) = report {
        n.accept_report(r, 1000);
    }
    n
}

pub(crate) fn rep(load: f64, cap: Option<f64>) -> Report {
    Report {
        load_tokens_per_sec: load,
        capacity_tokens_per_sec: cap,
        ..Report::default()
    }
}

pub(crate) fn order(d: &Decision) -> Vec<usize> {
    match d {
        Decision::Route(r) | Decision::AllOverCeiling(r) => r.iter().map(|x| x.node).collect(),
        Decision::NoFreshNodes => vec![],
    }
}

/// A request of `weight` for `model`, reserving its whole output, no margin.
pub(crate) fn ask(weight: Weight, model: Option<&str>) -> Ask<'_> {
    Ask {
        weight,
        growth: Growth {
            own: weight.output_tokens,
            margin_per_sqrt: 0.0,
            per_running: 0.0,
        },
        model,
        named: false,
        prefix: None,
        pin: None,
    }
}

pub(crate) fn run(nodes: &[NodeState], weight: Weight, now: u64) -> Decision {
    run_for(nodes, weight, None, now)
}

pub(crate) fn run_for(
    nodes: &[NodeState],
    weight: Weight,
    model: Option<&str>,
    now: u64,
) -> Decision {
    decide(
        nodes,
        &ask(weight, model),
        100.0,
        now,
        &P,
        &mut SplitMix64::new(1),
    )
}
