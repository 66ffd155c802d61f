//! What one routing decision costs, compiled to the filter's own target and run under a Wasm
//! engine (V8, through Node's WASI, the engine Envoy embeds), for fleets of 10 to 1,000 nodes.
//!
//!     cargo build --release --example choice_cost --target wasm32-wasip1
//!     node --no-warnings scripts/wasi-run.mjs target/wasm32-wasip1/release/examples/choice_cost.wasm
//!
//! or natively with `cargo run --release --example choice_cost`. Each fleet gets fresh reports
//! from every node (load, capacity, KV use, queue), then the balancer routes requests and
//! releases them, as the filter does per request; the time per `route` + `release` pair is the
//! median of several batches. Prints one line per fleet size, for the default power-of-two
//! choices (`choices: 2`) and for the comparison of every node (`choices: 0`), and for fleets
//! where only one node in 10 or in 100 has VRAM room (draws then often find none, and the
//! decision falls back to comparing every node). The runs marked `prefix` route prompts that
//! share long system prompts (50 tenants, 16 KiB each, 64 blocks of the prefix chain), priced on
//! each node by the prefix index after a warm-up that fills it: the decision with its prefix
//! lookups. Then the other pure work of a request: reading the weight and model from a 4 KiB
//! chat body, without and with its prefix chain. And the pure work of a poll: one health
//! answer taken in, for the simple JSON format, llama.cpp's page and vLLM's, whole and filtered;
//! of sharing the fleet: the snapshot encoded by the poller and taken in by a worker; and of
//! the room-now check's path (`route::survival`) over a node's streams, which a decision pays
//! only when every node compared is over the VRAM ceiling.

use std::time::Instant;
use token_balancer_core::config::Config;
use token_balancer_core::ingest::prompt::Chain;
use token_balancer_core::ingest::request::{self, Api, Pricing, Weight};
use token_balancer_core::rng::SplitMix64;
use token_balancer_core::route::balancer::{Balancer, Outcome, OwnBooks};
use token_balancer_core::route::survival::{peak, Lengths, Running};

/// `n` nodes with fresh reports; every `full_every`-th has room under the VRAM ceiling and the
/// others would overflow (1: all have room).
fn fleet(n: usize, choices: usize, full_every: usize) -> Balancer {
    let nodes: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"address":"10.{}.{}.{}:8000","kv_cache_tokens":100000}}"#,
                i / 65536,
                (i / 256) % 256,
                i % 256
            )
        })
        .collect();
    let cfg = format!(
        r#"{{"health_cluster":"h","nodes":[{}],"stale_after_ms":600000,"choices":{choices}}}"#,
        nodes.join(",")
    );
    let Ok(cfg) = Config::parse(cfg.as_bytes()) else {
        eprintln!("choice_cost: the generated configuration does not parse");
        std::process::exit(1);
    };
    let mut b = Balancer::new(&cfg);
    for i in 0..n {
        let body = format!(
            r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":{},"kv_cache_usage":{},"queue_depth":{}}}"#,
            (i * 37) % 5000,
            5000 + (i % 3) * 5000,
            if i % full_every == 0 {
                ((i * 13) % 80) as f64 / 100.0
            } else {
                0.99
            },
            i % 5
        );
        let _ = b.on_health(i, Some(body.as_bytes()), 0);
    }
    b
}

static NO_CHAIN: Chain = Chain::NONE;

/// Chat bodies of 50 tenants (a 16 KiB system prompt each) with four questions each, read
/// into their weights and prefix chains as the filter reads them.
fn tenant_prompts() -> Vec<(Weight, Chain)> {
    let pricing = Pricing::new(256);
    let mut out = Vec::new();
    for t in 0..50 {
        let system = format!("Tenant {t}: be brief and cite the handbook. ").repeat(400);
        let system = system.get(..16_000).unwrap_or(&system).to_string();
        for q in 0..4 {
            let body = serde_json::json!({"model": "m", "max_tokens": 256, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("question {q} of tenant {t}")}]});
            if let Some(e) = request::read_with_chain(
                Api::Chat,
                body.to_string().as_bytes(),
                &pricing,
                Some(256),
            ) {
                out.push((e.weight, e.chain));
            }
        }
    }
    out
}

fn main() {
    let mut rng = SplitMix64::new(7);
    let prompts = tenant_prompts();
    println!("choices  nodes  with room  prompts  route+release, median us (min us)");
    let runs = [
        (2, 10, 1, false),
        (2, 100, 1, false),
        (2, 1000, 1, false),
        (2, 1000, 10, false),
        (2, 1000, 100, false),
        // What `choices: auto` compares behind one or two routers.
        (16, 100, 1, false),
        (16, 1000, 1, false),
        (16, 1000, 10, false),
        (0, 10, 1, false),
        (0, 100, 1, false),
        (0, 1000, 1, false),
        (2, 10, 1, true),
        (2, 250, 1, true),
        (2, 1000, 1, true),
        (0, 1000, 1, true),
    ];
    for (choices, n, full_every, prefix) in runs {
        let mut b = fleet(n, choices, full_every);
        let per_batch = (20_000 / n).max(20);
        let mut k = 0usize;
        let mut next = |batch: usize, r: usize| -> (Weight, &Chain) {
            k += 1;
            match prompts.get(k % prompts.len().max(1)) {
                Some((w, c)) if prefix => (*w, c),
                _ => (
                    Weight {
                        prompt_tokens: 200 + ((batch * per_batch + r) % 2000) as u64,
                        output_tokens: 256,
                    },
                    &NO_CHAIN,
                ),
            }
        };
        // Fills the prefix index (where prompts have chains) before anything is timed.
        for r in 0..2000 {
            let (w, c) = next(0, r);
            if let Outcome::Routed { ticket, .. } =
                b.route(w, None, c, 1, &mut rng, false, &mut OwnBooks)
            {
                b.release(&ticket, 0);
            }
        }
        let mut batches = Vec::new();
        for batch in 0..15 {
            let start = Instant::now();
            for r in 0..per_batch {
                let (w, c) = next(batch, r);
                if let Outcome::Routed { ticket, .. } =
                    b.route(w, None, c, 1, &mut rng, false, &mut OwnBooks)
                {
                    b.release(&ticket, 0);
                }
            }
            batches.push(start.elapsed().as_secs_f64() * 1e6 / per_batch as f64);
        }
        batches.sort_by(f64::total_cmp);
        let median = batches.get(batches.len() / 2).copied().unwrap_or(f64::NAN);
        let min = batches.first().copied().unwrap_or(f64::NAN);
        let room = format!("1/{full_every}");
        let kind = if prefix { "tenants" } else { "plain" };
        println!("{choices:7}  {n:5}  {room:>9}  {kind:>7}  {median:8.2} ({min:.2})");
    }
    body_cost();
    answer_cost();
    share_cost();
    path_cost();
}

/// The room-now check's path over a node's streams (`survival::peak`): the answers' survival
/// built from 4,096 counted lengths, then the path of `n` streams at every stage of their
/// answers, as `choice::room_now` computes it for the least-full node when every node
/// compared is over the ceiling.
fn path_cost() {
    let mut lengths = Lengths::default();
    let mut rng = SplitMix64::new(11);
    for _ in 0..4096 {
        lengths.add(20 + token_balancer_core::rng::Rng::next_u64(&mut rng) % 1000);
    }
    println!("room-now path: streams on the node, median us (min us), survival built each time");
    for n in [10usize, 100, 1000] {
        let streams: Vec<Running> = (0..n)
            .map(|i| Running::one(500.0 + (i % 700) as f64, (i % 700) as f64, i % 10 != 0))
            .collect();
        let reps = (20_000 / n).max(10);
        let mut batches = Vec::new();
        let mut sink = 0.0;
        for _ in 0..15 {
            let start = Instant::now();
            for _ in 0..reps {
                if let Some(s) = lengths.survival() {
                    sink += peak(streams.iter().map(|r| (*r, Some(&s))), 2.0).unwrap_or(0.0);
                }
            }
            batches.push(start.elapsed().as_secs_f64() * 1e6 / reps as f64);
        }
        batches.sort_by(f64::total_cmp);
        let median = batches.get(batches.len() / 2).copied().unwrap_or(f64::NAN);
        let min = batches.first().copied().unwrap_or(f64::NAN);
        println!(
            "  {n:5} streams  {median:9.2} ({min:.2})   [{:.0}]",
            sink / 1e9
        );
    }
}

/// What sharing the fleet costs with `poller: singleton`: the poller encodes its view of every
/// node into the snapshot it publishes once a round, and each worker that sees a new version
/// decodes it and takes it in (`mirror_fleet`, `import_fleet`), on the thread that serves
/// requests.
fn share_cost() {
    use token_balancer_core::share::Snapshot;
    for n in [10, 100, 1000] {
        let poller = fleet(n, 2, 1);
        let mut reader = fleet(n, 2, 1);
        let time = |f: &mut dyn FnMut()| {
            let mut batches = Vec::new();
            for _ in 0..9 {
                let start = Instant::now();
                for _ in 0..20 {
                    f();
                }
                batches.push(start.elapsed().as_secs_f64() * 1e6 / 20.0);
            }
            batches.sort_by(f64::total_cmp);
            batches.get(batches.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let mut bytes = Vec::new();
        let encode = time(&mut || {
            bytes = Snapshot {
                nodes: poller.fleet_view(0),
                prompt_ratio: None,
            }
            .encode();
        });
        let take_in = time(&mut || {
            if let Ok(snapshot) = Snapshot::decode(&bytes) {
                reader.mirror_fleet(&snapshot);
                reader.import_fleet(&snapshot);
            }
        });
        println!(
            "{n} nodes, fleet snapshot of {} bytes: encoded by the poller {encode:.1} us, taken in by a worker {take_in:.1} us (median)",
            bytes.len()
        );
    }
}

/// The pure work of a poll: one node's health answer read and taken in (`on_health_answer`),
/// per kind of page, on a fleet of 100 nodes, the page the same each time (so the counters do
/// not move and the node stays as it is).
fn answer_cost() {
    use token_balancer_core::fleet::node::Polled;
    use token_balancer_core::ingest::engine::Engine;
    let vllm = include_str!("../core/tests/data/metrics/vllm_v1.prom");
    // What a vLLM server answers to the filtered poll: the samples read, with their families'
    // HELP and TYPE lines.
    let read: Vec<&str> = Engine::Vllm.names_read().collect();
    let mut filtered = String::new();
    let mut headers: Vec<&str> = Vec::new();
    for line in vllm.lines() {
        if line.starts_with('#') {
            headers.push(line);
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if read.contains(&name) {
            for h in headers.drain(..) {
                filtered.push_str(h);
                filtered.push('\n');
            }
            filtered.push_str(line);
            filtered.push('\n');
        }
        headers.clear();
    }
    let pages: [(&str, &str); 4] = [
        (
            "simple JSON health",
            r#"{"kv_cache_usage":0.0,"queue_depth":0,"running_requests":0,"tokens_per_sec_capacity":41141.7,"tokens_per_sec_load":0.0,"vram_total_bytes":68157440000,"vram_used_bytes":0}"#,
        ),
        (
            "llama.cpp /metrics",
            include_str!("../core/tests/data/metrics/llamacpp_real.prom"),
        ),
        ("vLLM /metrics, whole", vllm),
        ("vLLM /metrics, name[] filtered", &filtered),
    ];
    for size in [10, 1000] {
        let nodes: Vec<String> = (0..size)
            .map(|i| {
                format!(
                    r#"{{"address":"10.0.{}.{}:8000","kv_cache_tokens":100000}}"#,
                    i / 256,
                    i % 256
                )
            })
            .collect();
        let cfg = format!(
            r#"{{"health_cluster":"h","nodes":[{}],"stale_after_ms":600000}}"#,
            nodes.join(",")
        );
        let Ok(cfg) = Config::parse(cfg.as_bytes()) else {
            eprintln!("choice_cost: the generated configuration does not parse");
            std::process::exit(1);
        };
        for (kind, page) in pages {
            let mut b = Balancer::new(&cfg);
            let mut now = 0u64;
            let mut batches = Vec::new();
            for _ in 0..15 {
                let start = Instant::now();
                for i in 0..1000 {
                    now += 1;
                    let _ = b.on_health_answer(i % size, Polled::Body(page.as_bytes()), now);
                }
                batches.push(start.elapsed().as_secs_f64() * 1e6 / 1000.0);
            }
            batches.sort_by(f64::total_cmp);
            let median = batches.get(batches.len() / 2).copied().unwrap_or(f64::NAN);
            let min = batches.first().copied().unwrap_or(f64::NAN);
            println!(
                "{size} nodes, health answer taken in, {kind} ({} bytes): {median:.2} us median ({min:.2} min)",
                page.len()
            );
        }
    }
}

/// The other pure work of a request: reading the weight and model from a 4 KiB chat body.
fn body_cost() {
    let pricing = Pricing::new(256);
    let words = "the quick brown fox jumps over the lazy dog ".repeat(100);
    let content = words.get(..3990).unwrap_or(&words);
    let body = format!(
        r#"{{"model":"mock-model","max_tokens":16,"messages":[{{"role":"user","content":"{content}"}}]}}"#
    );
    for chain in [None, Some(256)] {
        let mut batches = Vec::new();
        let mut tokens = 0;
        for _ in 0..15 {
            let start = Instant::now();
            for _ in 0..1000 {
                tokens += request::read_with_chain(Api::Chat, body.as_bytes(), &pricing, chain)
                    .map_or(0, |e| e.weight.prompt_tokens);
            }
            batches.push(start.elapsed().as_secs_f64() * 1e6 / 1000.0);
        }
        batches.sort_by(f64::total_cmp);
        let median = batches.get(batches.len() / 2).copied().unwrap_or(f64::NAN);
        let min = batches.first().copied().unwrap_or(f64::NAN);
        let with = if chain.is_some() {
            "with its prefix chain"
        } else {
            "without a chain"
        };
        println!(
            "request::read of a {}-byte chat body, {with}: {median:.2} us median ({min:.2} min; {} tokens)",
            body.len(),
            tokens / 15_000
        );
    }
}
