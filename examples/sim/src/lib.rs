//! A discrete-event simulator of a GPU inference cluster behind several Envoy replicas.
//!
//! What it models, and where each part comes from:
//! - **GPU nodes**: the mock node's own engine model (`mock_gpu_node::engine`: continuous
//!   batching after Orca, chunked prefill after Sarathi-Serve, a KV cache that preempts by
//!   recomputation as vLLM does), advanced on a virtual clock: `Engine::step(now)` plans one
//!   iteration and the simulator delivers its tokens when it ends. No threads, no wall clock,
//!   deterministic for a seed.
//! - **Envoy replicas**: each holds its own `token_balancer_core::route::balancer::Balancer`, the filter's
//!   decision core itself, built from the same JSON configuration the filter takes. Every
//!   replica polls every node's health each `tick_ms` (at its own phase) in the seed JSON the
//!   mock node serves, routes its share of the requests, reports stream progress and ends, and
//!   holds requests under saturation as the filter's glue does (`admission`). Replicas know
//!   nothing of each other: between two polls each sees only its own dispatches, which is
//!   where herding comes from.
//! - **The same traffic for every policy**: arrival times, sizes, the replica each request
//!   enters and the poll phases come from their own generator, apart from the policies'
//!   random draws, so the policies of one run are compared on identical requests.
//! - **Requests**: sizes (prompt, true output) drawn from the Azure LLM inference trace
//!   (Splitwise, ISCA'24) when it is available, else from a log-normal fit; Poisson arrivals at
//!   a rate set as a share of the fleet's token capacity, or the same mean rate in bursts
//!   (`loadgen::trace::Bursts`); each replica gets a uniform share.
//!   The client's `max_tokens` cap is what the balancer sees of the output, as in real traffic.
//!
//! Policies: the token-balancer core (`tb`, with any configuration override); the same core
//! without its in-flight correction (`argmin-stale`: the dispatch is released at once, so each
//! decision sees only the last reports, and with `choices: 0` it is argmin on stale data);
//! Envoy's `least_request` (power of two choices over the replica's own active requests) and
//! `round_robin`; and an `oracle`: one central router that knows every node's outstanding
//! work exactly (the true output lengths included) and sends each request to the node that
//! finishes that work soonest among those whose cache holds it all at once. The oracle is a
//! reference point, not a bound: it is greedy, and it ignores batching effects.

pub mod workload;

use mock_gpu_node::engine::{Engine, EngineConfig, Event as EngineEvent, Request as EngineRequest};
use std::cmp::Reverse;
use std::collections::HashSet;
use std::collections::{BinaryHeap, VecDeque};
use token_balancer_core::config::{Config, WhenFull};
use token_balancer_core::fleet::node::Ticket;
use token_balancer_core::fleet::prefixes::PrefixIndex;
use token_balancer_core::ingest::prompt::Chain;
use token_balancer_core::ingest::request::Weight;
use token_balancer_core::rng::{Rng, SplitMix64};
use token_balancer_core::route::balancer::{Balancer, Outcome as Routed, OwnBooks};
use workload::Job;

/// KV bytes per token the simulated nodes report (Llama-2-7B fp16), as the mock does.
pub const KV_BYTES_PER_TOKEN: u64 = 512 * 1024;

/// How requests are routed.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// The filter's decision core with this plugin configuration (JSON object fields that
    /// override the simulator's defaults); `books: false` releases every dispatch at once.
    Tb {
        overrides: String,
        books: bool,
    },
    LeastRequest,
    RoundRobin,
    Oracle,
    /// Our re-implementation of the inference gateway's default scheduling profile: each
    /// candidate scored 2 x queue (the shortest reported queue 1, the longest 0) + 2 x KV
    /// (1 - reported KV-cache use) + 3 x prefix (the share of the prompt's blocks it is
    /// believed to hold, from an approximate index of this replica's routing history), the
    /// highest score wins, ties at random. It reads the same polls as `tb`.
    Gateway,
}

impl Policy {
    /// `tb`, `tb:{json}`, `argmin-stale`, `least-request`, `round-robin`, `oracle`, `gateway`.
    pub fn parse(s: &str) -> Result<(String, Policy), String> {
        let (name, json) = match s.split_once(':') {
            Some((n, j)) => (n, j.to_string()),
            None => (s, String::new()),
        };
        let policy = match name {
            "tb" => Policy::Tb {
                overrides: json,
                books: true,
            },
            "argmin-stale" => Policy::Tb {
                overrides: if json.is_empty() {
                    r#"{"choices":0}"#.to_string()
                } else {
                    json
                },
                books: false,
            },
            "least-request" => Policy::LeastRequest,
            "round-robin" => Policy::RoundRobin,
            "oracle" => Policy::Oracle,
            "gateway" => Policy::Gateway,
            other => return Err(format!("unknown policy {other:?}")),
        };
        Ok((s.to_string(), policy))
    }
}

/// One simulation's inputs.
#[derive(Debug, Clone)]
pub struct Setup {
    pub nodes: Vec<EngineConfig>,
    pub replicas: usize,
    /// Offered tokens (prompt + true output) per second as a share of the fleet's capacity.
    pub load: f64,
    /// Arrivals stop after this long (model ms); the first `warmup_ms` are not measured.
    pub duration_ms: f64,
    pub warmup_ms: f64,
    pub tick_ms: u64,
    /// The client's output cap (`max_tokens`): what the balancer sees of the output.
    pub max_tokens: u64,
    pub seed: u64,
    pub policy: Policy,
    /// Requests are the workload's jobs in order (a trace replayed), not drawn at random.
    pub in_order: bool,
    /// Arrivals in bursts (`loadgen::trace::Bursts`) at the same mean rate, not Poisson.
    pub bursts: bool,
}

/// Request sizes to draw from: (prompt tokens, true output tokens).
pub type Sizes = Vec<(u64, u64)>;

/// What a simulation measured.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Model ms, of the requests that arrived after the warm-up, sorted.
    pub ttft_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
    pub arrived: usize,
    pub completed: usize,
    pub overflows: u64,
    /// Per node: tokens served over the measured window per token of its saturated throughput.
    pub utilization: Vec<f64>,
    /// Largest queue seen at any node at a poll.
    pub peak_queue: usize,
    /// Largest number of requests held by a replica at once.
    pub peak_held: usize,
    /// Routing decisions the balancer could not make (fallback to least_request).
    pub fallbacks: u64,
    /// Requests arrived after the warm-up that the balancer refused
    /// (`admission.when_full: reject`).
    pub refused: u64,
    /// Requests routed over the VRAM ceiling: at once, every node being between the two
    /// ceilings for them, or once held for `max_hold_ms`.
    pub over_ceiling: u64,
    /// Per request routed by token-balancer: the first-token forecast made when it was sent
    /// (seconds) and its observed time to first token from then over that forecast.
    pub first_token_ratios: Vec<(f64, f64)>,
    /// Requests still booked in flight in the replicas' balancers at the end (0 when every
    /// stream's end was released).
    pub inflight_left: u64,
    /// Prompt tokens of the requests dispatched, the ones the engines found in their prefix
    /// caches, and the ones a cache that forgot nothing and sat on every node would have found
    /// (the leading blocks sent to any node before: the bound on what routing can reach).
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_bound_tokens: u64,
    /// Per GPU class (nodes of equal saturated throughput), fastest first: its throughput and
    /// its requests' TTFTs, sorted. Where a policy queues: a fast class waiting long while a
    /// slow one waits little is work that should have gone to the slow one.
    pub ttft_by_class: Vec<(f64, Vec<f64>)>,
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

impl Outcome {
    /// Share of prompt tokens the engines found cached.
    pub fn hit_rate(&self) -> f64 {
        self.prefix_hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// Share of prompt tokens that were sent to some node before (the bound of `hit_rate`).
    pub fn hit_bound(&self) -> f64 {
        self.prefix_bound_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    pub fn p(&self, which: &str, q: f64) -> f64 {
        match which {
            "ttft" => percentile(&self.ttft_ms, q),
            _ => percentile(&self.e2e_ms, q),
        }
    }

    /// p`q` TTFT of each GPU class, fastest first, `/`-separated (ms).
    pub fn ttft_by_class(&self, q: f64) -> String {
        let parts: Vec<String> = self
            .ttft_by_class
            .iter()
            .map(|(_, v)| format!("{:.0}", percentile(v, q)))
            .collect();
        parts.join(" / ")
    }

    /// The observed time to first token over its forecast, p10 / p50 / p90, of the requests
    /// whose forecast was at least `min_s` seconds ("-" without any): how far the forecasts
    /// that budgets are compared with are off.
    pub fn forecast_accuracy(&self, min_s: f64) -> [f64; 3] {
        let mut r: Vec<f64> = self
            .first_token_ratios
            .iter()
            .filter(|(f, _)| *f >= min_s)
            .map(|(_, r)| *r)
            .collect();
        r.sort_by(f64::total_cmp);
        [0.1, 0.5, 0.9].map(|q| percentile(&r, q))
    }

    /// Max over mean of the nodes' utilization: 1 is a perfectly even spread.
    pub fn imbalance(&self) -> f64 {
        let n = self.utilization.len().max(1) as f64;
        let mean = self.utilization.iter().sum::<f64>() / n;
        let max = self.utilization.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            max / mean
        } else {
            f64::NAN
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Arrive,
    Step(usize),
    Poll(usize),
}

#[derive(Debug, Clone)]
struct Req {
    /// Which job of the workload it is (its shape and shared segments).
    job: usize,
    arrive_ms: f64,
    prompt: u64,
    output: u64,
    replica: usize,
    node: Option<usize>,
    first_ms: Option<f64>,
    done_ms: Option<f64>,
    ticket: Option<Ticket>,
    generated: u64,
    /// The first-token forecast of the node it was sent to (seconds) and when it was sent
    /// (model ms), for the forecast's accuracy.
    forecast: Option<(f64, f64)>,
    /// Refused by the balancer (`admission.when_full: reject`): never sent.
    refused: bool,
}

struct Replica {
    balancer: Option<Balancer>,
    held: VecDeque<(usize, f64)>,
    rr_next: usize,
    /// Requests this replica has active on each node (its least_request view).
    active: Vec<u64>,
    /// The gateway profile's view: each node's (waiting, KV use) at the last poll, and its
    /// prefix index.
    gateway: Vec<(f64, f64)>,
    gateway_index: PrefixIndex,
}

/// The oracle's exact books per node: tokens of work left, and the KV the outstanding
/// requests will hold when they all reach their full length.
#[derive(Debug, Clone, Copy, Default)]
struct Exact {
    work: u64,
    kv_peak: u64,
}

struct Sim<'a> {
    setup: &'a Setup,
    now: f64,
    seq: u64,
    heap: BinaryHeap<Reverse<(u64, u64, Kind)>>,
    engines: Vec<Engine>,
    planned: Vec<Option<Vec<EngineEvent>>>,
    requests: Vec<Req>,
    replicas: Vec<Replica>,
    exact: Vec<Exact>,
    /// The traffic (arrival times, request sizes, replica, poll phases) and the policies'
    /// draws come from two generators, so every policy of a run sees the same requests at the
    /// same times: a policy that draws more random numbers does not change the traffic.
    traffic: SplitMix64,
    rng: SplitMix64,
    served: Vec<u64>,
    out: Outcome,
    max_hold_ms: f64,
    /// `admission.when_full: reject`: a request that no node has room for once it may wait
    /// no longer is refused rather than routed over the ceiling.
    reject_when_full: bool,
    /// Requests arrived and not finished.
    outstanding: usize,
    /// Each node's saturated throughput on this request mix, tokens/s.
    caps: Vec<f64>,
    jobs: &'a [Job],
    /// Engine block hashes sent to any node so far (for the hit-rate bound).
    seen_blocks: HashSet<u64>,
}

fn uniform(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The plugin configuration of one replica: the nodes as 10.x addresses and the shipped
/// settings (tick, staleness, holding), then the policy's overrides.
fn plugin_config(setup: &Setup, overrides: &str) -> Result<Config, String> {
    let nodes: Vec<serde_json::Value> = (0..setup.nodes.len())
        .map(|i| serde_json::json!({"address": address(i)}))
        .collect();
    let mut cfg = serde_json::json!({
        "nodes": nodes,
        "health_cluster": "gpu_health",
        "tick_ms": setup.tick_ms,
        "stale_after_ms": setup.tick_ms * 8,
        "max_hold_ms": 10000,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    });
    if !overrides.is_empty() {
        let extra: serde_json::Value =
            serde_json::from_str(overrides).map_err(|e| format!("policy overrides: {e}"))?;
        if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                c.insert(k.clone(), v.clone());
            }
        }
    }
    Config::parse(cfg.to_string().as_bytes()).map_err(|e| e.to_string())
}

fn address(i: usize) -> String {
    format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256)
}

/// The fleet's token capacity, tokens per model second: the sum over nodes of what each serves
/// when saturated with this request mix (`saturated_throughput`). A node's nominal figure
/// (`EngineConfig::capacity_tokens_per_sec`, a full prefill budget every iteration) is far above
/// what it sustains on real traffic, whose decode iterations are small batches that pay the
/// weights' read and the attention over a full cache: a load defined on the nominal figure
/// would be an overload for every policy.
pub fn capacity(nodes: &[EngineConfig], sizes: &[(u64, u64)], max_tokens: u64) -> f64 {
    node_capacities(nodes, sizes, max_tokens).iter().sum()
}

/// Each node's saturated throughput (computed once per kind of node).
pub fn node_capacities(nodes: &[EngineConfig], sizes: &[(u64, u64)], max_tokens: u64) -> Vec<f64> {
    let mut known: Vec<(EngineConfig, f64)> = Vec::new();
    nodes
        .iter()
        .map(|n| match known.iter().find(|(k, _)| k == n) {
            Some((_, c)) => *c,
            None => {
                let c = saturated_throughput(n, sizes, max_tokens);
                known.push((n.clone(), c));
                c
            }
        })
        .collect()
}

/// Tokens (prompt + output) per model second one engine completes with a queue that never
/// empties, over 60 s after 30 s of warm-up, on requests drawn from `sizes`.
pub fn saturated_throughput(config: &EngineConfig, sizes: &[(u64, u64)], max_tokens: u64) -> f64 {
    if sizes.is_empty() {
        return 0.0;
    }
    let mut e = Engine::new(config.clone());
    let mut rng = SplitMix64::new(99);
    let mut next_id = 0u64;
    let mut lengths = std::collections::HashMap::new();
    let (mut now, mut done_tokens) = (0.0, 0u64);
    let (warm, end) = (30_000.0, 90_000.0);
    while now < end {
        while e.waiting() < config.max_running {
            let pick = (rng.next_u64() % sizes.len() as u64) as usize;
            let (p, o) = sizes.get(pick).copied().unwrap_or((1, 1));
            let o = o.clamp(1, max_tokens.max(1));
            e.submit(next_id, p.max(1), o);
            lengths.insert(next_id, p.max(1) + o);
            next_id += 1;
        }
        let Some(it) = e.step(now) else { break };
        now += it.duration_ms;
        for ev in it.events {
            if let EngineEvent::Finished { id } = ev {
                let t = lengths.remove(&id).unwrap_or(0);
                if now >= warm {
                    done_tokens += t;
                }
            }
        }
    }
    done_tokens as f64 / ((end - warm) / 1000.0)
}

/// Runs one simulation of requests whose sizes are drawn from `sizes`, nothing shared.
pub fn run(setup: &Setup, sizes: &[(u64, u64)]) -> Result<Outcome, String> {
    run_jobs(setup, &workload::from_sizes(sizes))
}

/// Runs one simulation of requests drawn from `jobs` (see `workload`).
pub fn run_jobs(setup: &Setup, jobs: &[Job]) -> Result<Outcome, String> {
    let sizes: Vec<(u64, u64)> = jobs.iter().map(|j| (j.prompt, j.output)).collect();
    let sizes = &sizes[..];
    if sizes.is_empty() || setup.nodes.is_empty() || setup.replicas == 0 {
        return Err("nothing to simulate: no sizes, nodes or replicas".into());
    }
    let (balancer, books) = match &setup.policy {
        Policy::Tb { overrides, books } => (Some(plugin_config(setup, overrides)?), *books),
        _ => (None, true),
    };
    let n = setup.nodes.len();
    let replicas = (0..setup.replicas)
        .map(|_| Replica {
            balancer: balancer.as_ref().map(Balancer::new),
            held: VecDeque::new(),
            rr_next: 0,
            active: vec![0; n],
            gateway: vec![(0.0, 0.0); n],
            gateway_index: PrefixIndex::new(n.saturating_mul(31_250), 31_250),
        })
        .collect();
    let max_hold_ms = balancer.as_ref().map_or(0, |c| c.max_hold_ms) as f64;
    let reject_when_full = balancer
        .as_ref()
        .is_some_and(|c| c.admission.when_full == WhenFull::Reject);
    let caps = node_capacities(&setup.nodes, sizes, setup.max_tokens);
    let mut sim = Sim {
        setup,
        now: 0.0,
        seq: 0,
        heap: BinaryHeap::new(),
        engines: setup.nodes.iter().cloned().map(Engine::new).collect(),
        planned: vec![None; n],
        requests: Vec::new(),
        replicas,
        exact: vec![Exact::default(); n],
        traffic: SplitMix64::new(setup.seed),
        rng: SplitMix64::new(setup.seed ^ 0x9e37_79b9_7f4a_7c15),
        served: vec![0; n],
        out: Outcome::default(),
        max_hold_ms,
        reject_when_full,
        outstanding: 0,
        caps,
        jobs,
        seen_blocks: HashSet::new(),
    };
    let mean_tokens = sizes
        .iter()
        .map(|(p, o)| (p + o.clamp(&1, &setup.max_tokens.max(1))) as f64)
        .sum::<f64>()
        / sizes.len() as f64;
    let rate_per_ms = setup.load * sim.caps.iter().sum::<f64>() / mean_tokens / 1000.0;
    if rate_per_ms.is_nan() || rate_per_ms <= 0.0 {
        return Err("the load gives no arrivals".into());
    }
    let mut bursts = loadgen::trace::Bursts::default();
    let first = if setup.bursts {
        bursts.next_ms(rate_per_ms * 1000.0, &mut || uniform(&mut sim.traffic))
    } else {
        0.0
    };
    sim.schedule(first, Kind::Arrive);
    for r in 0..setup.replicas {
        let phase = uniform(&mut sim.traffic) * setup.tick_ms as f64;
        sim.schedule(phase, Kind::Poll(r));
    }
    // Arrivals stop at the duration; the rest drains, up to a limit.
    let end_ms = setup.duration_ms * 4.0 + 120_000.0;
    while let Some(Reverse((t_us, _, kind))) = sim.heap.pop() {
        let t = t_us as f64 / 1000.0;
        if t > end_ms {
            break;
        }
        sim.now = t;
        match kind {
            Kind::Arrive => {
                if t < setup.duration_ms {
                    sim.arrive(books);
                    let next = if setup.bursts {
                        bursts.next_ms(rate_per_ms * 1000.0, &mut || uniform(&mut sim.traffic))
                    } else {
                        t - (1.0 - uniform(&mut sim.traffic)).ln() / rate_per_ms
                    };
                    sim.schedule(next, Kind::Arrive);
                }
            }
            Kind::Step(node) => sim.step(node, books),
            Kind::Poll(r) => {
                sim.poll(r, books);
                sim.schedule(t + setup.tick_ms as f64, Kind::Poll(r));
            }
        }
        if t >= setup.duration_ms && sim.outstanding == 0 {
            break;
        }
    }
    Ok(sim.finish())
}

impl Sim<'_> {
    fn schedule(&mut self, at_ms: f64, kind: Kind) {
        self.seq += 1;
        let us = (at_ms.max(0.0) * 1000.0).round() as u64;
        self.heap.push(Reverse((us, self.seq, kind)));
    }

    fn arrive(&mut self, books: bool) {
        let drawn = (self.traffic.next_u64() % self.jobs.len().max(1) as u64) as usize;
        let pick = if self.setup.in_order {
            self.requests.len() % self.jobs.len().max(1)
        } else {
            drawn
        };
        let (prompt, output) = self.jobs.get(pick).map_or((1, 1), |j| (j.prompt, j.output));
        let replica = (self.traffic.next_u64() % self.setup.replicas as u64) as usize;
        let id = self.requests.len();
        self.outstanding += 1;
        self.requests.push(Req {
            job: pick,
            arrive_ms: self.now,
            prompt: prompt.max(1),
            output: output.clamp(1, self.setup.max_tokens.max(1)),
            replica,
            node: None,
            first_ms: None,
            done_ms: None,
            ticket: None,
            generated: 0,
            forecast: None,
            refused: false,
        });
        self.place(id, books, true);
    }

    /// Routes request `id`; `false` when it is held (saturated) and stays in the queue.
    fn place(&mut self, id: usize, books: bool, fresh: bool) -> bool {
        let Some(req) = self.requests.get(id).cloned() else {
            return true;
        };
        let now = self.now;
        let node = match &self.setup.policy {
            Policy::Oracle => self.oracle(req.prompt, req.output),
            Policy::RoundRobin => {
                let Some(r) = self.replicas.get_mut(req.replica) else {
                    return true;
                };
                r.rr_next = (r.rr_next + 1) % self.engines.len();
                r.rr_next
            }
            Policy::LeastRequest => self.least_request(req.replica),
            Policy::Gateway => self.gateway(id, req.replica, req.job),
            Policy::Tb { .. } => {
                let weight = Weight {
                    prompt_tokens: req.prompt,
                    output_tokens: self.setup.max_tokens,
                };
                let Some(rep) = self.replicas.get_mut(req.replica) else {
                    return true;
                };
                let Some(b) = rep.balancer.as_mut() else {
                    return true;
                };
                let waited = rep
                    .held
                    .front()
                    .filter(|(h, _)| *h == id)
                    .map_or(0.0, |(_, since)| now - since);
                let holding = self.max_hold_ms > 0.0 && waited < self.max_hold_ms;
                // Refusing is asked as holding is, so that "no room" comes back as such; a
                // cold start is not a full fleet.
                let refusing = self.reject_when_full && !b.warming(now as u64);
                let may_hold = holding || refusing;
                // The chain the filter would hash from this prompt, when it prices prefixes.
                // Every prompt has one, shared or not, as in the filter.
                let chain = match (b.chain_block_chars(), self.jobs.get(req.job)) {
                    (Some(chars), Some(job)) => {
                        Job::filter_chain(&job.tokens(id as u64), chars as u64)
                    }
                    _ => Chain::NONE,
                };
                let mut outcome = b.route(
                    weight,
                    None,
                    &chain,
                    now as u64,
                    &mut self.rng,
                    may_hold,
                    &mut OwnBooks,
                );
                // No node would hold it even empty: not held, routed at once (or refused).
                if matches!(outcome, Routed::Oversized) && !refusing {
                    outcome = b.route(
                        weight,
                        None,
                        &chain,
                        now as u64,
                        &mut self.rng,
                        false,
                        &mut OwnBooks,
                    );
                }
                let oversized = matches!(outcome, Routed::Oversized);
                match outcome {
                    Routed::Routed {
                        ticket,
                        over_ceiling,
                        compared,
                        ..
                    } => {
                        let node = ticket.node;
                        if let Some(r) = self.requests.get_mut(id) {
                            r.forecast = compared
                                .first()
                                .and_then(|c| c.first_token_seconds)
                                .map(|f| (f, now));
                        }
                        self.out.over_ceiling += u64::from(over_ceiling);
                        if books {
                            if let Some(r) = self.requests.get_mut(id) {
                                r.ticket = Some(ticket);
                            }
                        } else {
                            b.release(&ticket, 0);
                        }
                        node
                    }
                    Routed::Oversized | Routed::Saturated
                        if refusing && (!holding || oversized) =>
                    {
                        // It may wait no longer and no node has room: refused, never sent.
                        if let Some(r) = self.requests.get_mut(id) {
                            r.refused = true;
                        }
                        self.outstanding = self.outstanding.saturating_sub(1);
                        return true;
                    }
                    Routed::Saturated => {
                        if fresh {
                            rep.held.push_back((id, now));
                            self.out.peak_held = self.out.peak_held.max(rep.held.len());
                        }
                        return false;
                    }
                    // The simulator's requests carry no budget or priority: none is too late
                    // or shed.
                    Routed::NoFreshNodes
                    | Routed::UnknownModel
                    | Routed::TooLate { .. }
                    | Routed::Shed { .. }
                    | Routed::Full { .. }
                    | Routed::Oversized => {
                        self.out.fallbacks += 1;
                        self.least_request(req.replica)
                    }
                }
            }
        };
        self.dispatch(id, node);
        true
    }

    fn gateway(&mut self, id: usize, replica: usize, job: usize) -> usize {
        let chain = self
            .jobs
            .get(job)
            .map(|j| Job::filter_chain(&j.tokens(id as u64), 256))
            .unwrap_or_default();
        let Some(r) = self.replicas.get_mut(replica) else {
            return 0;
        };
        let (lo, hi) = r
            .gateway
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), (q, _)| {
                (lo.min(*q), hi.max(*q))
            });
        let blocks = chain.blocks.len().max(1) as f64;
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, (q, kv)) in r.gateway.iter().enumerate() {
            let queue = if hi > lo { (hi - q) / (hi - lo) } else { 1.0 };
            let prefix = r.gateway_index.matched(i, &chain.blocks) as f64 / blocks;
            let score = 2.0 * queue + 2.0 * (1.0 - kv.clamp(0.0, 1.0)) + 3.0 * prefix;
            let tie = self.rng.next_u64();
            if best.is_none_or(|(s, t, _)| score > s || (score == s && tie > t)) {
                best = Some((score, tie, i));
            }
        }
        let node = best.map_or(0, |(_, _, i)| i);
        r.gateway_index.record(node, &chain.blocks);
        node
    }

    fn least_request(&mut self, replica: usize) -> usize {
        let n = self.engines.len();
        let a = (self.rng.next_u64() % n as u64) as usize;
        let b = (self.rng.next_u64() % n as u64) as usize;
        let Some(r) = self.replicas.get(replica) else {
            return a;
        };
        let load = |i: usize| r.active.get(i).copied().unwrap_or(0);
        if load(b) < load(a) {
            b
        } else {
            a
        }
    }

    fn oracle(&self, prompt: u64, output: u64) -> usize {
        let mut best: Option<(bool, f64, usize)> = None;
        for (i, (e, x)) in self.engines.iter().zip(&self.exact).enumerate() {
            let cap = e.config.capacity_tokens_per_sec();
            let fits = x.kv_peak + prompt + output <= e.config.kv_capacity_tokens;
            let key = if fits {
                (x.work + prompt + output) as f64 / cap
            } else {
                (x.kv_peak + prompt + output) as f64 / e.config.kv_capacity_tokens as f64
            };
            let better = match best {
                None => true,
                Some((bf, bk, _)) => (fits && !bf) || (fits == bf && key < bk),
            };
            if better {
                best = Some((fits, key, i));
            }
        }
        best.map_or(0, |(_, _, i)| i)
    }

    fn dispatch(&mut self, id: usize, node: usize) {
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        req.node = Some(node);
        let (prompt, output, replica) = (req.prompt, req.output, req.replica);
        let req = req.clone();
        if let Some(c) = self
            .replicas
            .get_mut(replica)
            .and_then(|r| r.active.get_mut(node))
        {
            *c += 1;
        }
        if let Some(x) = self.exact.get_mut(node) {
            x.work += prompt + output;
            x.kv_peak += prompt + output;
        }
        // Every prompt is hashed, as an engine with prefix caching does (the control workload
        // without shared prefixes then pays the cache's bookkeeping too, and hits nothing).
        let block_hashes = match self.jobs.get(req.job) {
            Some(job) => {
                let block = self
                    .engines
                    .get(node)
                    .map_or(16, |e| e.config.prefix_block_tokens);
                Job::engine_blocks(&job.tokens(id as u64), block)
            }
            _ => vec![],
        };
        let block = self
            .engines
            .get(node)
            .map_or(16, |e| e.config.prefix_block_tokens);
        let seen = block_hashes
            .iter()
            .take_while(|h| self.seen_blocks.contains(h))
            .count() as u64;
        if req.arrive_ms >= self.setup.warmup_ms {
            self.out.prompt_tokens += prompt;
            self.out.prefix_bound_tokens += (seen * block).min(prompt.saturating_sub(1));
        }
        self.seen_blocks.extend(block_hashes.iter().copied());
        let Some(engine) = self.engines.get_mut(node) else {
            return;
        };
        engine.submit_request(EngineRequest {
            id: id as u64,
            prompt_tokens: prompt,
            output_tokens: output,
            block_hashes,
        });
        if self.planned.get(node).is_some_and(Option::is_none) {
            self.plan(node);
        }
    }

    /// Plans node `node`'s next iteration from now, or leaves it idle.
    fn plan(&mut self, node: usize) {
        let now = self.now;
        let Some(engine) = self.engines.get_mut(node) else {
            return;
        };
        match engine.step(now) {
            Some(it) => {
                for a in it.admitted.iter().filter(|a| a.first) {
                    let counted = usize::try_from(a.id)
                        .ok()
                        .and_then(|i| self.requests.get(i))
                        .is_some_and(|r| r.arrive_ms >= self.setup.warmup_ms);
                    if counted {
                        self.out.prefix_hit_tokens += a.cached_tokens;
                    }
                }
                if let Some(p) = self.planned.get_mut(node) {
                    *p = Some(it.events);
                }
                self.schedule(now + it.duration_ms, Kind::Step(node));
            }
            None => {
                if let Some(p) = self.planned.get_mut(node) {
                    *p = None;
                }
            }
        }
    }

    /// Node `node`'s iteration ends: its tokens reach the clients, then the next one starts.
    fn step(&mut self, node: usize, books: bool) {
        // The node stays busy while its tokens are delivered: a request they release may be
        // dispatched to it, and must wait for the next iteration, not start a second one.
        let events = self
            .planned
            .get_mut(node)
            .and_then(|p| p.replace(Vec::new()));
        for ev in events.into_iter().flatten() {
            match ev {
                EngineEvent::Token { id, index } => self.token(id as usize, node, index),
                EngineEvent::Finished { id } => self.finished(id as usize, node, books),
                EngineEvent::Preempted { .. } => {}
            }
        }
        self.plan(node);
    }

    fn token(&mut self, id: usize, node: usize, index: u64) {
        let now = self.now;
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        let before = req.generated;
        req.generated = req.generated.max(index + 1);
        if req.first_ms.is_none() {
            req.first_ms = Some(now);
            // Placed at arrival or when let out of the hold queue: the forecast was made then.
            if let Some((f, sent)) = req.forecast {
                if f > 0.0 && req.arrive_ms >= self.setup.warmup_ms {
                    self.out
                        .first_token_ratios
                        .push((f, (now - sent) / 1000.0 / f));
                }
            }
            if let Some(x) = self.exact.get_mut(node) {
                x.work = x.work.saturating_sub(req.prompt);
            }
        }
        if let Some(x) = self.exact.get_mut(node) {
            x.work = x.work.saturating_sub(req.generated - before);
        }
        if let (Some(t), Some(b)) = (
            req.ticket,
            self.replicas
                .get_mut(req.replica)
                .and_then(|r| r.balancer.as_mut()),
        ) {
            b.progress(&t, before, req.generated);
        }
    }

    fn finished(&mut self, id: usize, node: usize, books: bool) {
        let now = self.now;
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        req.done_ms = Some(now);
        self.outstanding = self.outstanding.saturating_sub(1);
        let (prompt, output, replica, generated) =
            (req.prompt, req.output, req.replica, req.generated);
        // Seconds per output token after the first, as the filter measures a completed stream.
        let tpot = req
            .first_ms
            .filter(|_| generated > 1)
            .map(|first| (now - first) / 1000.0 / (generated - 1) as f64);
        let ticket = req.ticket.take();
        if req.arrive_ms >= self.setup.warmup_ms {
            if let Some(s) = self.served.get_mut(node) {
                *s += prompt + generated;
            }
        }
        if let Some(x) = self.exact.get_mut(node) {
            x.kv_peak = x.kv_peak.saturating_sub(prompt + output);
        }
        let Some(rep) = self.replicas.get_mut(replica) else {
            return;
        };
        if let Some(c) = rep.active.get_mut(node) {
            *c = c.saturating_sub(1);
        }
        if let Some(b) = rep.balancer.as_mut() {
            if let Some(t) = ticket {
                if let Some(seconds) = tpot {
                    b.observe_tpot(&t, seconds, now as u64);
                }
                b.release(&t, generated);
            }
            b.observe_output(prompt, generated);
        }
        self.admit_held(replica, books);
    }

    fn admit_held(&mut self, replica: usize, books: bool) {
        loop {
            let Some(&(id, _)) = self.replicas.get(replica).and_then(|r| r.held.front()) else {
                return;
            };
            if !self.place(id, books, false) {
                return;
            }
            if let Some(r) = self.replicas.get_mut(replica) {
                r.held.pop_front();
            }
        }
    }

    fn poll(&mut self, replica: usize, books: bool) {
        let now = self.now;
        if let Some(b) = self
            .replicas
            .get_mut(replica)
            .and_then(|r| r.balancer.as_mut())
        {
            for (i, e) in self.engines.iter_mut().enumerate() {
                let kv_total = e.config.kv_capacity_tokens;
                self.out.peak_queue = self.out.peak_queue.max(e.waiting());
                let body = format!(
                    r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":{},"vram_used_bytes":{},"vram_total_bytes":{},"queue_depth":{},"running_requests":{}}}"#,
                    e.load_tokens_per_sec(now),
                    e.capacity_tokens_per_sec(),
                    e.kv_used_tokens() * KV_BYTES_PER_TOKEN,
                    kv_total * KV_BYTES_PER_TOKEN,
                    e.waiting(),
                    e.running()
                );
                let _ = b.on_health(i, Some(body.as_bytes()), now as u64);
            }
        } else {
            for e in &self.engines {
                self.out.peak_queue = self.out.peak_queue.max(e.waiting());
            }
            if let (Policy::Gateway, Some(r)) = (&self.setup.policy, self.replicas.get_mut(replica))
            {
                for (v, e) in r.gateway.iter_mut().zip(&self.engines) {
                    *v = (e.waiting() as f64, e.kv_cache_usage());
                }
            }
        }
        self.admit_held(replica, books);
    }

    fn finish(mut self) -> Outcome {
        let warm = self.setup.warmup_ms;
        let measured_s = ((self.setup.duration_ms - warm) / 1000.0).max(1e-9);
        let mut out = std::mem::take(&mut self.out);
        for r in self.requests.iter().filter(|r| r.arrive_ms >= warm) {
            out.arrived += 1;
            out.refused += u64::from(r.refused);
            if let (Some(first), Some(done)) = (r.first_ms, r.done_ms) {
                out.completed += 1;
                out.ttft_ms.push(first - r.arrive_ms);
                out.e2e_ms.push(done - r.arrive_ms);
                if let Some(cap) = r.node.and_then(|n| self.caps.get(n)) {
                    let class = out.ttft_by_class.iter().position(|(c, _)| c == cap);
                    match class.and_then(|i| out.ttft_by_class.get_mut(i)) {
                        Some((_, v)) => v.push(first - r.arrive_ms),
                        None => out.ttft_by_class.push((*cap, vec![first - r.arrive_ms])),
                    }
                }
            }
        }
        out.ttft_by_class.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, v) in &mut out.ttft_by_class {
            v.sort_by(f64::total_cmp);
        }
        out.ttft_ms.sort_by(f64::total_cmp);
        out.e2e_ms.sort_by(f64::total_cmp);
        out.overflows = self.engines.iter().map(|e| e.vram_overflow_events).sum();
        out.inflight_left = self
            .replicas
            .iter()
            .filter_map(|r| r.balancer.as_ref())
            .flat_map(|b| b.nodes().iter().map(|n| n.books().inflight_requests))
            .sum();
        out.utilization = self
            .caps
            .iter()
            .zip(&self.served)
            .map(|(c, s)| *s as f64 / measured_s / c.max(1e-9))
            .collect();
        out
    }
}

/// Request sizes from the Azure conversation trace CSV (`TIMESTAMP,ContextTokens,
/// GeneratedTokens`).
pub fn azure_sizes(text: &str) -> Sizes {
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split(',');
            let _ = f.next()?;
            let p = f.next()?.trim().parse().ok()?;
            let o = f.next()?.trim().parse().ok()?;
            Some((p, o))
        })
        .collect()
}

/// Log-normal sizes with the Azure conversation trace's rough shape (median prompt ~1k tokens,
/// median output ~200), for machines without the trace.
pub fn synthetic_sizes(count: usize, seed: u64) -> Sizes {
    let mut rng = SplitMix64::new(seed);
    let mut normal = move || {
        let u1 = uniform(&mut rng).max(1e-12);
        let u2 = uniform(&mut rng);
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    };
    (0..count)
        .map(|_| {
            let p = (1000.0 * (0.9 * normal()).exp()).clamp(16.0, 12_000.0) as u64;
            let o = (200.0 * (0.9 * normal()).exp()).clamp(1.0, 2_000.0) as u64;
            (p, o)
        })
        .collect()
}

/// `count` nodes of the mixed fleet: half A100, a quarter H100, a quarter L4.
/// `count` nodes whose GPU classes repeat `pattern` (preset names, `EngineConfig::preset`), e.g.
/// `a100,l4` for half A100-like and half L4-like nodes.
pub fn fleet_of(pattern: &str, count: usize) -> Result<Vec<EngineConfig>, String> {
    let kinds: Vec<EngineConfig> = pattern
        .split(',')
        .map(|k| EngineConfig::preset(k.trim()).ok_or_else(|| format!("unknown GPU class {k:?}")))
        .collect::<Result<_, _>>()?;
    Ok(kinds.iter().cycle().take(count).cloned().collect())
}

pub fn mixed_fleet(count: usize) -> Vec<EngineConfig> {
    (0..count)
        .map(|i| match i % 4 {
            0 => EngineConfig::h100(),
            1 | 3 => EngineConfig::a100(),
            _ => EngineConfig::l4(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(nodes: usize, replicas: usize, load: f64, policy: &str) -> Setup {
        Setup {
            nodes: mixed_fleet(nodes),
            replicas,
            load,
            duration_ms: 20_000.0,
            warmup_ms: 5_000.0,
            tick_ms: 250,
            max_tokens: 1024,
            seed: 1,
            policy: Policy::parse(policy).unwrap().1,
            in_order: false,
            bursts: false,
        }
    }

    #[test]
    fn every_request_completes_once_and_runs_are_deterministic() {
        let sizes = synthetic_sizes(2000, 3);
        for policy in [
            "tb",
            "argmin-stale",
            "least-request",
            "round-robin",
            "oracle",
        ] {
            let s = setup(8, 2, 0.3, policy);
            let a = run(&s, &sizes).unwrap();
            assert!(a.arrived > 100, "{policy}: {}", a.arrived);
            assert_eq!(
                a.completed,
                a.arrived,
                "{policy}: slowest {:?}",
                a.e2e_ms.last()
            );
            let b = run(&s, &sizes).unwrap();
            assert_eq!(a.e2e_ms, b.e2e_ms, "{policy}: not deterministic");
            assert!(a
                .ttft_ms
                .iter()
                .zip(&a.e2e_ms)
                .all(|(t, e)| t.is_finite() && *e >= 0.0));
        }
    }

    #[test]
    fn books_return_to_zero() {
        let sizes = synthetic_sizes(2000, 4);
        for load in [0.5, 1.2] {
            let out = run(&setup(6, 3, load, "tb"), &sizes).unwrap();
            assert_eq!(out.completed, out.arrived, "load {load}");
            assert_eq!(out.inflight_left, 0, "load {load}");
        }
    }

    /// Far past saturation with `when_full: reject` some requests are refused and never sent;
    /// every other one completes, none is routed over the ceiling after a full hold, and with
    /// the default the same traffic is all served.
    #[test]
    fn refused_requests_are_counted_and_never_sent() {
        let sizes = synthetic_sizes(2000, 4);
        let mut s = setup(4, 1, 3.0, r#"tb:{"admission":{"when_full":"reject"}}"#);
        s.duration_ms = 60_000.0;
        let out = run(&s, &sizes).unwrap();
        assert!(out.refused > 0, "nothing refused at load 3");
        assert_eq!(out.completed as u64 + out.refused, out.arrived as u64);
        assert_eq!(out.inflight_left, 0);
        s.policy = Policy::parse("tb").unwrap().1;
        let routed = run(&s, &sizes).unwrap();
        assert_eq!((routed.refused, routed.completed), (0, routed.arrived));
    }

    #[test]
    fn unknown_policies_and_bad_overrides_are_errors() {
        assert!(Policy::parse("fastest").is_err());
        let mut s = setup(2, 1, 0.5, "tb");
        s.policy = Policy::parse(r#"tb:{"choices":"two"}"#).unwrap().1;
        let err = run(&s, &synthetic_sizes(10, 1)).unwrap_err();
        assert!(err.contains("choices"), "{err}");
    }

    /// Two nodes, one four times faster: at a moderate load the token-aware policies put most
    /// of the work on the fast one, round robin splits it evenly.
    #[test]
    fn a_fast_node_takes_more_from_token_aware_policies() {
        let sizes = synthetic_sizes(2000, 5);
        let mut s = setup(2, 1, 0.4, "tb");
        s.nodes = vec![EngineConfig::h100(), EngineConfig::l4()];
        let tokens = |policy: &str| {
            let mut s = s.clone();
            s.policy = Policy::parse(policy).unwrap().1;
            let o = run(&s, &sizes).unwrap();
            let caps = node_capacities(&s.nodes, &sizes, s.max_tokens);
            (o.utilization[0] * caps[0]) / (o.utilization[1] * caps[1])
        };
        assert!(tokens("tb") > 2.0, "tb {}", tokens("tb"));
        assert!(tokens("oracle") > 2.0, "oracle {}", tokens("oracle"));
        let rr = tokens("round-robin");
        assert!((0.7..1.4).contains(&rr), "round robin {rr}");
    }

    /// At a small scale: with many replicas on the same stale reports, two choices with the
    /// in-flight correction (what `choices: auto` uses behind many routers) beat argmin on
    /// stale data on the p99 latency and on the spread of the load.
    #[test]
    fn two_choices_beat_argmin_on_stale_data_with_many_replicas() {
        let sizes = synthetic_sizes(4000, 6);
        for replicas in [1, 16] {
            let s = setup(20, replicas, 0.85, r#"tb:{"choices":2}"#);
            let tb = run(&s, &sizes).unwrap();
            let stale = run(
                &Setup {
                    policy: Policy::parse("argmin-stale").unwrap().1,
                    ..s.clone()
                },
                &sizes,
            )
            .unwrap();
            assert!(
                tb.p("e2e", 0.99) < stale.p("e2e", 0.99),
                "{replicas} replicas: p99 {} against {}",
                tb.p("e2e", 0.99),
                stale.p("e2e", 0.99)
            );
            assert!(
                tb.imbalance() < stale.imbalance(),
                "{replicas} replicas: max/mean {} against {}",
                tb.imbalance(),
                stale.imbalance()
            );
        }
    }

    /// The shipped `choices: auto` follows the routers: behind one it compares every node
    /// and beats two choices on p99 TTFT; behind sixteen it is two choices, decision for
    /// decision.
    #[test]
    fn auto_choices_compare_more_behind_one_router_and_two_behind_many() {
        let sizes = synthetic_sizes(4000, 6);
        let one = run(&setup(20, 1, 0.85, "tb"), &sizes).unwrap();
        let two = run(&setup(20, 1, 0.85, r#"tb:{"choices":2}"#), &sizes).unwrap();
        assert!(
            one.p("ttft", 0.99) < two.p("ttft", 0.99),
            "one router: p99 TTFT {} against {}",
            one.p("ttft", 0.99),
            two.p("ttft", 0.99)
        );
        let many = run(&setup(20, 16, 0.85, "tb"), &sizes).unwrap();
        let two = run(&setup(20, 16, 0.85, r#"tb:{"choices":2}"#), &sizes).unwrap();
        assert_eq!(many.ttft_ms, two.ttft_ms, "sixteen routers");
    }
}
