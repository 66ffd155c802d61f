//! Command line of the cluster simulator (see the library's doc for the model).
//!
//!     cargo run --release -p sim -- --nodes 100 --replicas 1,4,16 --load 0.85 \
//!         --policies tb,argmin-stale,least-request,oracle --duration-s 120 --out results/sim-x
//!
//! For every replica count, runs every policy on the same arrivals and prints one table:
//! p50/p99 TTFT and end-to-end latency (model time), p99 as a ratio to the oracle's, VRAM
//! overflows (engine preemptions) and the requests routed over the ceiling, the max/mean of
//! the nodes' utilization, token-balancer's first-token forecasts against what came, and what
//! completed.
//! Writes `table.md` and `results.json` under `--out`. `--arrivals bursts` sends the same mean
//! rate in bursts (the load generator's `Bursts`); `--fleet a100,l4` repeats those GPU classes
//! instead of the default mix.

use sim::workload::{self, Job};
use sim::{
    azure_sizes, capacity, fleet_of, mixed_fleet, run_jobs, synthetic_sizes, Outcome, Policy, Setup,
};
use std::path::PathBuf;
use std::time::Instant;

struct Args {
    nodes: Vec<usize>,
    replicas: Vec<usize>,
    load: f64,
    policies: Vec<String>,
    duration_s: f64,
    warmup_s: f64,
    tick_ms: u64,
    max_tokens: u64,
    seed: u64,
    data: PathBuf,
    out: Option<PathBuf>,
    workload: String,
    tenants: usize,
    bursts: bool,
    fleet: String,
}

fn usage() -> ! {
    eprintln!(
        "usage: sim [--nodes 10,100] [--replicas 1,4,16] [--load 0.85] \
         [--policies tb,argmin-stale,least-request,round-robin,oracle] [--duration-s 120] \
         [--warmup-s 20] [--tick-ms 250] [--max-tokens 1024] [--seed 1] \
         [--data ../shared/data] [--out results/sim-NAME] \
         [--workload azure|tenants|hot|mooncake|sharegpt|prefill|decode|mixed|long] [--tenants 40] \
         [--arrivals poisson|bursts] [--fleet mixed|h100:1,a100:2,l4:1]\n\
         a policy may carry configuration overrides: tb:{{\"choices\":0}}"
    );
    std::process::exit(2)
}

fn list<T: std::str::FromStr>(v: &str) -> Vec<T> {
    let parsed: Result<Vec<T>, _> = v.split(',').map(str::parse).collect();
    parsed.unwrap_or_else(|_| usage())
}

fn parse_args() -> Args {
    let mut a = Args {
        nodes: vec![100],
        replicas: vec![1, 4, 16],
        load: 0.85,
        policies: ["tb", "argmin-stale", "least-request", "oracle"]
            .map(String::from)
            .to_vec(),
        duration_s: 120.0,
        warmup_s: 20.0,
        tick_ms: 250,
        max_tokens: 1024,
        seed: 1,
        data: PathBuf::from("../shared/data"),
        out: None,
        workload: "azure".to_string(),
        tenants: 40,
        bursts: false,
        fleet: "mixed".to_string(),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    while let Some(flag) = it.next() {
        let Some(v) = it.next() else { usage() };
        match flag.as_str() {
            "--nodes" => a.nodes = list(v),
            "--replicas" => a.replicas = list(v),
            "--load" => a.load = v.parse().unwrap_or_else(|_| usage()),
            // Policies are split on commas outside braces: overrides are JSON.
            "--policies" => a.policies = split_policies(v),
            "--duration-s" => a.duration_s = v.parse().unwrap_or_else(|_| usage()),
            "--warmup-s" => a.warmup_s = v.parse().unwrap_or_else(|_| usage()),
            "--tick-ms" => a.tick_ms = v.parse().unwrap_or_else(|_| usage()),
            "--max-tokens" => a.max_tokens = v.parse().unwrap_or_else(|_| usage()),
            "--seed" => a.seed = v.parse().unwrap_or_else(|_| usage()),
            "--data" => a.data = PathBuf::from(v),
            "--out" => a.out = Some(PathBuf::from(v)),
            "--workload" => a.workload = v.clone(),
            "--tenants" => a.tenants = v.parse().unwrap_or_else(|_| usage()),
            "--arrivals" => {
                a.bursts = match v.as_str() {
                    "poisson" => false,
                    "bursts" => true,
                    _ => usage(),
                }
            }
            "--fleet" => a.fleet = v.clone(),
            _ => usage(),
        }
    }
    a
}

fn split_policies(v: &str) -> Vec<String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    for c in v.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The text of `name` in the data folder and its path, or the simulator stops saying why.
fn data_file(args: &Args, name: &str) -> (String, String) {
    let path = args.data.join(name);
    match std::fs::read_to_string(&path) {
        Ok(text) => (text, path.display().to_string()),
        Err(e) => {
            eprintln!("sim: cannot read {}: {e}", path.display());
            std::process::exit(2)
        }
    }
}

fn main() {
    let args = parse_args();
    let trace = args.data.join("AzureLLMInferenceTrace_conv.csv");
    let (sizes, source) = match std::fs::read_to_string(&trace) {
        Ok(text) => (
            azure_sizes(&text),
            format!("sizes from {}", trace.display()),
        ),
        Err(_) => (
            synthetic_sizes(20_000, args.seed),
            "synthetic log-normal sizes (no trace found)".to_string(),
        ),
    };
    let policies: Vec<(String, Policy)> = args
        .policies
        .iter()
        .map(|p| {
            Policy::parse(p).unwrap_or_else(|e| {
                eprintln!("sim: {e}");
                std::process::exit(2)
            })
        })
        .collect();
    let (jobs, source): (Vec<Job>, String) = match args.workload.as_str() {
        "azure" => (workload::from_sizes(&sizes), source),
        "tenants" => (
            workload::tenants(args.tenants, 20_000, args.seed),
            format!(
                "{} tenants, each a 2k-6k-token system prompt, short questions (Zipf 0.8)",
                args.tenants
            ),
        ),
        "hot" => (
            workload::hot(&sizes, 20_000, args.seed),
            format!("one 2k-token system prompt in every request, then {source}"),
        ),
        "sharegpt" => {
            let (text, path) = data_file(&args, "sharegpt_8k_filtered_stats_llama2_tokenizer.csv");
            match loadgen::trace::parse_sharegpt(&text, args.seed) {
                Ok(t) => (
                    workload::from_trace(&t),
                    format!("ShareGPT lengths from {path}"),
                ),
                Err(e) => {
                    eprintln!("sim: {e}");
                    std::process::exit(2)
                }
            }
        }
        "mooncake" => {
            let (text, path) = data_file(&args, "mooncake_synthetic_trace.jsonl");
            (workload::mooncake(&text), path)
        }
        shape => match loadgen::trace::Shape::parse(shape) {
            Some(s) => (
                workload::shaped(s, args.seed),
                format!("the load generator's {shape} workload"),
            ),
            None => usage(),
        },
    };
    let sizes: Vec<(u64, u64)> = jobs.iter().map(|j| (j.prompt, j.output)).collect();
    let mean = sizes.iter().map(|(p, o)| (p + o) as f64).sum::<f64>() / sizes.len().max(1) as f64;
    println!(
        "cluster simulator: {source} ({} requests, mean {mean:.0} tokens incl. true output), \
         load {} of token capacity, {} s of arrivals ({} s warm-up), tick {} ms, max_tokens {}, seed {}",
        sizes.len(),
        args.load,
        args.duration_s,
        args.warmup_s,
        args.tick_ms,
        args.max_tokens,
        args.seed
    );
    let mut md = String::new();
    let mut json = Vec::new();
    for &nodes in &args.nodes {
        let fleet = if args.fleet == "mixed" {
            mixed_fleet(nodes)
        } else {
            fleet_of(&args.fleet, nodes).unwrap_or_else(|e| {
                eprintln!("sim: --fleet: {e}");
                std::process::exit(2)
            })
        };
        for &replicas in &args.replicas {
            println!(
                "\n{nodes} nodes ({}; {:.0} tokens/s saturated), {replicas} replicas",
                if args.fleet == "mixed" {
                    "1/4 h100, 1/2 a100, 1/4 l4"
                } else {
                    &args.fleet
                },
                capacity(&fleet, &sizes, args.max_tokens)
            );
            let mut rows: Vec<(String, Outcome, f64)> = Vec::new();
            for (name, policy) in &policies {
                let setup = Setup {
                    nodes: fleet.clone(),
                    replicas,
                    load: args.load,
                    duration_ms: args.duration_s * 1000.0,
                    warmup_ms: args.warmup_s * 1000.0,
                    tick_ms: args.tick_ms,
                    max_tokens: args.max_tokens,
                    seed: args.seed,
                    policy: policy.clone(),
                    in_order: args.workload == "mooncake",
                    bursts: args.bursts,
                };
                let start = Instant::now();
                match run_jobs(&setup, &jobs) {
                    Ok(o) => rows.push((name.clone(), o, start.elapsed().as_secs_f64())),
                    Err(e) => {
                        eprintln!("sim: {name}: {e}");
                        std::process::exit(1)
                    }
                }
            }
            let oracle = rows
                .iter()
                .find(|(n, _, _)| n == "oracle")
                .map(|(_, o, _)| (o.p("ttft", 0.99), o.p("e2e", 0.99)));
            let header = "| policy | TTFT p50 / p99 (ms) | e2e p50 / p99 (ms) | p99 TTFT / oracle | p99 e2e / oracle | VRAM overflows (routed over the ceiling) | max/mean utilization | prefix hits (bound) | p90 TTFT per GPU class, fast first (ms) | first token / forecast p10 / p50 / p90, forecasts >= 0.2 s | completed (refused) | held peak | wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
            let mut table = format!(
                "\n**{nodes} nodes, {replicas} replicas, load {}**\n\n{header}",
                args.load
            );
            for (name, o, wall) in &rows {
                let ratio =
                    |v: f64, r: Option<f64>| r.map_or("-".to_string(), |r| format!("{:.2}", v / r));
                let line = format!(
                    "| {name} | {:.0} / {:.0} | {:.0} / {:.0} | {} | {} | {} ({}) | {:.2} | {:.1}% ({:.1}%) | {} | {} | {}/{} ({}) | {} | {:.1} |\n",
                    o.p("ttft", 0.5),
                    o.p("ttft", 0.99),
                    o.p("e2e", 0.5),
                    o.p("e2e", 0.99),
                    ratio(o.p("ttft", 0.99), oracle.map(|x| x.0)),
                    ratio(o.p("e2e", 0.99), oracle.map(|x| x.1)),
                    o.overflows,
                    o.over_ceiling,
                    o.imbalance(),
                    100.0 * o.hit_rate(),
                    100.0 * o.hit_bound(),
                    o.ttft_by_class(0.9),
                    o.forecast_accuracy(0.2).map(|x| format!("{x:.2}")).join(" / "),
                    o.completed,
                    o.arrived,
                    o.refused,
                    o.peak_held,
                    wall
                );
                table.push_str(&line);
                json.push(serde_json::json!({
                    "nodes": nodes, "replicas": replicas, "load": args.load, "policy": name,
                    "ttft_p50_ms": o.p("ttft", 0.5), "ttft_p99_ms": o.p("ttft", 0.99),
                    "e2e_p50_ms": o.p("e2e", 0.5), "e2e_p99_ms": o.p("e2e", 0.99),
                    "overflows": o.overflows, "max_over_mean_utilization": o.imbalance(),
                    "arrived": o.arrived, "completed": o.completed, "peak_held": o.peak_held,
                    "peak_queue": o.peak_queue, "fallbacks": o.fallbacks, "over_ceiling": o.over_ceiling,
                    "refused": o.refused,
                    "inflight_left": o.inflight_left, "wall_s": wall,
                    "prefix_hit_rate": o.hit_rate(), "prefix_hit_bound": o.hit_bound(),
                    "ttft_p90_ms_by_class_fast_first": o.ttft_by_class(0.9),
                    "first_token_over_forecast_p10_p50_p90": o.forecast_accuracy(0.0),
                    "first_token_over_forecast_p10_p50_p90_from_200ms": o.forecast_accuracy(0.2),
                }));
            }
            print!("{table}");
            md.push_str(&table);
        }
    }
    if let Some(out) = &args.out {
        let argv: Vec<String> = std::env::args().collect();
        let doc = serde_json::json!({"command": argv.join(" "), "source": source, "runs": json});
        let written = std::fs::create_dir_all(out)
            .and_then(|_| std::fs::write(out.join("table.md"), &md))
            .and_then(|_| std::fs::write(out.join("results.json"), doc.to_string()));
        match written {
            Ok(()) => println!("\nresults in {}", out.display()),
            Err(e) => {
                eprintln!("sim: cannot write {}: {e}", out.display());
                std::process::exit(1)
            }
        }
    }
}
