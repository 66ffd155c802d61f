//! Command line: `--node PORT[,key=value...]` (repeatable), `--time-scale X`, `--bind ADDR`.
//! Parsed by hand (no argument-parsing dependency); every mistake is a one-line message.

use hyper::header::HeaderValue;
use mock_gpu_node::engine::EngineConfig;
use mock_gpu_node::metrics::Flavour;

/// What `GET /health` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthMode {
    /// token-balancer's simple JSON report (the benchmarks' and most tests' node).
    Json,
    /// What the imitated engine answers: vLLM, SGLang, TGI and trtllm-serve an empty 200,
    /// llama.cpp `{"status":"ok"}`.
    Engine,
}

pub const USAGE: &str = "\
usage: mock-gpu-node --node PORT[,key=value...] [--node ...] [--time-scale X] [--bind ADDR]

Serves one mock GPU inference node per --node, all in this process.

  --node PORT[,k=v...]  serve a node on PORT; keys:
                          name=NAME            x-mock-node and /health name (default node-PORT)
                          gpu=h100|a100|l4     speed and KV-cache preset (default h100)
                          floor_ms=F           shortest iteration, ms
                          per_token_ms=F       compute per token in an iteration, ms
                          overhead_ms=F        fixed cost per iteration, ms
                          attention_ms_per_1k=F  cost per 1000 cached KV tokens, ms
                          kv_tokens=N          KV-cache size in tokens (x 512 KiB = VRAM)
                          max_running=N        most sequences in a batch
                          prefill_chunk=N      token budget of one iteration
                          capacity=F           override the reported tokens_per_sec_capacity
                                               (tokens per wall second)
                          prefix_block=N       tokens per prefix-cache (and KV) block (default 16)
                          prefix_cache_blocks=N  prefix-cache size in blocks (default: as many
                                               as the KV cache holds; 0 turns caching off)
                          metrics=FLAVOUR      the engine imitated: vllm (default), vllm-v0,
                                               sglang, tgi, trtllm, llamacpp; its /metrics
                                               format and, once named, its /health, model
                                               list and model names too
                          health=json|engine   /health: the seed JSON report (default without
                                               metrics=), or what the engine answers (default
                                               with metrics=: an empty 200, llama.cpp's
                                               {\"status\":\"ok\"})
                          metrics_off=1        the engine runs without its metrics endpoint
                                               (llama.cpp without --metrics: 501; else 404)
                          n_ctx=N              llamacpp: the per-slot context listed in
                                               /v1/models and enforced (default kv_tokens)
                          models=A|B|...       served model names (404 model_not_found for
                                               others; an engine that serves any name
                                               ignores it but lists them); default: any
                                               name, listed as mock-model
                          loras=X|Y|...        LoRA adapters served as models too
                          instant=1            answer every completion at once with one
                                               token, bypassing the engine (a fast upstream
                                               for measuring the proxy's own cost)
                          reasoning=F          a reasoning model: the first share F (0 to 1)
                                               of each streamed chat answer's tokens come as
                                               reasoning_content deltas (default 0)
                          tool_calls=1         an agent's turns: each streamed chat answer is
                                               one tool call, its tokens the arguments
                          token_scale=F        a chat prompt counts F times the tokens (0.25
                                               to 4; default 1): another model's tokenizer
                          force_usage=1        a streamed chat or text answer ends with its
                                               usage even when the client did not ask for it
                                               (stream_options.include_usage), as vLLM does
                                               with --enable-force-include-usage
                          instant_tokens=N     with instant=1: a streamed answer sends N
                                               token events, each its own chunk (default 1)
                          instant_gap_us=N     with instant=1: microseconds between those
                                               events (default 0: all at once)
  --time-scale X        run the model X times faster than real time (default 1); reported
                        rates are per wall-clock second
  --bind ADDR           address to listen on (default 127.0.0.1)
  -h, --help            this text

Prints `listening name=NAME port=PORT gpu=GPU` per node once all ports are bound.";

#[derive(Debug, Clone, PartialEq)]
pub struct NodeSpec {
    pub port: u16,
    pub name: String,
    pub gpu: String,
    pub config: EngineConfig,
    pub capacity: Option<f64>,
    pub metrics: Flavour,
    pub health: HealthMode,
    /// The engine's metrics endpoint is off (`metrics_off=1`).
    pub metrics_off: bool,
    /// llama.cpp's per-slot context (`n_ctx=`); `None`: the KV size.
    pub n_ctx: Option<u64>,
    /// Served model names; empty: any name is served.
    pub models: Vec<String>,
    pub loras: Vec<String>,
    /// Completions are answered at once, without the engine (`instant=1`).
    pub instant: bool,
    /// Token events of a streamed instant answer (`instant_tokens=`), and the pause between
    /// two of them (`instant_gap_us=`): what following a streamed answer costs a proxy.
    pub instant_tokens: u64,
    pub instant_gap_us: u64,
    /// The share of a streamed chat answer's tokens sent as thinking (`reasoning=`).
    pub reasoning: f64,
    /// Every streamed chat answer is a tool call (`tool_calls=1`).
    pub tool_calls: bool,
    /// Streamed chat and text answers carry their usage unasked (`force_usage=1`).
    pub force_usage: bool,
    /// A chat prompt's tokens, as a share of the mock's own count (`token_scale=`).
    pub token_scale: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub nodes: Vec<NodeSpec>,
    pub time_scale: f64,
    pub bind: String,
}

#[derive(Debug, PartialEq)]
pub enum Command {
    Run(Args),
    Help,
}

pub fn parse(argv: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut args = Args {
        nodes: vec![],
        time_scale: 1.0,
        bind: "127.0.0.1".to_string(),
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--node" => {
                let node = parse_node(&value()?)?;
                if args.nodes.iter().any(|n| n.port == node.port) {
                    return Err(format!("port {} is given to two nodes", node.port));
                }
                args.nodes.push(node);
            }
            "--time-scale" => {
                let v = value()?;
                args.time_scale = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| format!("--time-scale {v:?}: expected a positive number"))?;
            }
            "--bind" => args.bind = value()?,
            "-h" | "--help" => return Ok(Command::Help),
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if args.nodes.is_empty() {
        return Err("at least one --node PORT is needed".into());
    }
    Ok(Command::Run(args))
}

fn parse_node(spec: &str) -> Result<NodeSpec, String> {
    let err = |msg: String| format!("--node {spec:?}: {msg}");
    let mut parts = spec.split(',');
    let first = parts.next().unwrap_or_default();
    let port: u16 = first
        .parse()
        .map_err(|_| err(format!("{first:?} is not a port (0-65535)")))?;
    let mut pairs = vec![];
    for p in parts {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| err(format!("{p:?} is not key=value")))?;
        pairs.push((k, v));
    }
    // The preset first, so that the other keys override it whatever their order.
    let gpu = pairs
        .iter()
        .rev()
        .find(|(k, _)| *k == "gpu")
        .map_or("h100", |(_, v)| *v);
    let mut config = EngineConfig::preset(gpu)
        .ok_or_else(|| err(format!("unknown gpu {gpu:?} (h100, a100, l4)")))?;
    let mut name = format!("node-{port}");
    let mut capacity = None;
    let mut metrics = Flavour::Vllm;
    let mut metrics_named = false;
    let mut health = None;
    let mut metrics_off = false;
    let mut n_ctx = None;
    let (mut models, mut loras) = (vec![], vec![]);
    let mut instant = false;
    let (mut instant_tokens, mut instant_gap_us) = (None, None);
    let mut reasoning = 0.0;
    let mut tool_calls = false;
    let mut force_usage = false;
    let mut token_scale = 1.0;
    let float = |k: &str, v: &str| {
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| err(format!("{k}={v:?}: expected a non-negative number")))
    };
    let int = |k: &str, v: &str| {
        v.parse::<u64>()
            .ok()
            .filter(|x| *x > 0)
            .ok_or_else(|| err(format!("{k}={v:?}: expected a positive integer")))
    };
    let count = |k: &str, v: &str| {
        v.parse::<u64>()
            .map_err(|_| err(format!("{k}={v:?}: expected a whole number")))
    };
    let switch = |k: &str, v: &str| match v {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(err(format!("{k}={v:?}: expected 1 or 0"))),
    };
    // An empty name (`a||b`, a trailing `|`) is a typo, not a model.
    let names = |k: &str, v: &str| -> Result<Vec<String>, String> {
        let list: Vec<String> = v.split('|').map(String::from).collect();
        if list.iter().any(|n| n.trim().is_empty()) {
            return Err(err(format!("{k}={v:?}: empty name")));
        }
        Ok(list)
    };
    for (k, v) in pairs {
        match k {
            "gpu" => {}
            "name" => name = v.to_string(),
            "floor_ms" => config.floor_ms = float(k, v)?,
            "per_token_ms" => config.per_token_ms = float(k, v)?,
            "overhead_ms" => config.overhead_ms = float(k, v)?,
            "attention_ms_per_1k" => config.attention_ms_per_1k_ctx = float(k, v)?,
            "kv_tokens" => config.kv_capacity_tokens = int(k, v)?,
            "max_running" => config.max_running = usize::try_from(int(k, v)?).unwrap_or(usize::MAX),
            "prefill_chunk" => config.prefill_chunk_tokens = int(k, v)?,
            "capacity" => capacity = Some(float(k, v)?),
            "prefix_block" => config.prefix_block_tokens = int(k, v)?,
            "prefix_cache_blocks" => config.prefix_cache_blocks = Some(count(k, v)?),
            "metrics" => {
                metrics = Flavour::parse(v).ok_or_else(|| {
                    let all: Vec<&str> = Flavour::ALL.iter().map(|f| f.name()).collect();
                    err(format!("unknown metrics={v:?} ({})", all.join(", ")))
                })?;
                metrics_named = true;
            }
            "health" => {
                health = Some(match v {
                    "json" => HealthMode::Json,
                    "engine" => HealthMode::Engine,
                    _ => return Err(err(format!("health={v:?}: expected json or engine"))),
                })
            }
            "metrics_off" => metrics_off = switch(k, v)?,
            "n_ctx" => n_ctx = Some(int(k, v)?),
            "models" => models = names(k, v)?,
            "loras" => loras = names(k, v)?,
            "instant" => instant = switch(k, v)?,
            "instant_tokens" => instant_tokens = Some(int(k, v)?),
            "tool_calls" => tool_calls = switch(k, v)?,
            "force_usage" => force_usage = switch(k, v)?,
            "token_scale" => {
                token_scale = float(k, v)?;
                if !(0.25..=4.0).contains(&token_scale) {
                    return Err(err(format!("token_scale={v:?}: from 0.25 to 4")));
                }
            }
            "reasoning" => {
                reasoning = float(k, v)?;
                if reasoning > 1.0 {
                    return Err(err(format!("reasoning={v:?}: a share, from 0 to 1")));
                }
            }
            "instant_gap_us" => instant_gap_us = Some(count(k, v)?),
            _ => return Err(err(format!("unknown key {k:?}"))),
        }
    }
    if !instant && (instant_tokens.is_some() || instant_gap_us.is_some()) {
        return Err(err(
            "instant_tokens and instant_gap_us shape instant answers: they need instant=1".into(),
        ));
    }
    if name.is_empty() || HeaderValue::from_str(&name).is_err() {
        return Err(err(format!(
            "name={name:?} must be non-empty printable text (it is sent as a header)"
        )));
    }
    // A zero-length iteration would make the driver spin and the capacity infinite.
    if config.iteration_ms(1, 0) <= 0.0 {
        return Err(err(
            "floor_ms, per_token_ms and overhead_ms cannot all be 0".into(),
        ));
    }
    let mut all: Vec<&String> = models.iter().chain(&loras).collect();
    all.sort();
    if let Some(w) = all.windows(2).find(|w| w.first() == w.get(1)) {
        return Err(err(format!(
            "{:?} is named twice in models/loras",
            w.first().map_or("", |s| s.as_str())
        )));
    }
    Ok(NodeSpec {
        port,
        name,
        gpu: gpu.to_string(),
        config,
        capacity,
        metrics,
        health: health.unwrap_or(if metrics_named {
            HealthMode::Engine
        } else {
            HealthMode::Json
        }),
        metrics_off,
        n_ctx,
        models,
        loras,
        instant,
        instant_tokens: instant_tokens.unwrap_or(1),
        instant_gap_us: instant_gap_us.unwrap_or(0),
        reasoning,
        tool_calls,
        force_usage,
        token_scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn run(s: &str) -> Args {
        match parse(argv(s)) {
            Ok(Command::Run(a)) => a,
            other => panic!("{s}: {other:?}"),
        }
    }

    #[test]
    fn nodes_and_flags() {
        let a = run(
            "--node 8001 --node 8002,name=slow,gpu=l4,kv_tokens=1000,capacity=5e3 \
                     --time-scale 10 --bind 0.0.0.0",
        );
        assert_eq!((a.time_scale, a.bind.as_str()), (10.0, "0.0.0.0"));
        let [fast, slow] = &a.nodes[..] else {
            panic!("{a:?}")
        };
        assert_eq!(
            (fast.port, fast.name.as_str(), fast.gpu.as_str()),
            (8001, "node-8001", "h100")
        );
        assert_eq!(fast.config, EngineConfig::h100());
        assert_eq!((slow.name.as_str(), slow.capacity), ("slow", Some(5000.0)));
        assert_eq!(slow.config.kv_capacity_tokens, 1000);
        assert_eq!(slow.config.floor_ms, EngineConfig::l4().floor_ms);
    }

    #[test]
    fn keys_override_the_preset_in_any_order() {
        let a = run(
            "--node 1,floor_ms=3,gpu=a100,max_running=4,prefill_chunk=64,attention_ms_per_1k=0",
        );
        let c = &a.nodes[0].config;
        assert_eq!(
            (c.floor_ms, c.per_token_ms),
            (3.0, EngineConfig::a100().per_token_ms)
        );
        assert_eq!((c.max_running, c.prefill_chunk_tokens), (4, 64));
        assert_eq!(c.attention_ms_per_1k_ctx, 0.0);
    }

    #[test]
    fn prefix_metrics_and_model_keys() {
        let a = run(
            "--node 1 --node 2,prefix_block=32,prefix_cache_blocks=0,metrics=tgi,\
                     models=llama|qwen,loras=sql|chat --node 3,kv_tokens=1000,metrics=vllm-v0",
        );
        let [plain, custom, small] = &a.nodes[..] else {
            panic!("{a:?}")
        };
        assert_eq!(plain.metrics, Flavour::Vllm);
        assert!(plain.models.is_empty() && plain.loras.is_empty());
        assert_eq!(plain.config.prefix_capacity_blocks(), 130_000 / 16);
        assert_eq!(custom.config.prefix_block_tokens, 32);
        assert_eq!(custom.config.prefix_capacity_blocks(), 0);
        assert_eq!(custom.metrics, Flavour::Tgi);
        assert_eq!(custom.models, ["llama", "qwen"]);
        assert_eq!(custom.loras, ["sql", "chat"]);
        // The default cache size follows the KV size whatever the order of the keys.
        assert_eq!(small.config.prefix_capacity_blocks(), 1000 / 16);
        assert_eq!(small.metrics, Flavour::VllmV0);
        assert!(!plain.instant && !custom.instant);
        assert!(run("--node 1,instant=1").nodes[0].instant);
        assert!(!run("--node 1,instant=0").nodes[0].instant);
        let streamed = &run("--node 1,instant=1,instant_tokens=64,instant_gap_us=500").nodes[0];
        assert_eq!(
            (streamed.instant_tokens, streamed.instant_gap_us),
            (64, 500)
        );
        assert_eq!((plain.instant_tokens, plain.instant_gap_us), (1, 0));
        assert_eq!(run("--node 1,reasoning=0.75").nodes[0].reasoning, 0.75);
        assert_eq!(plain.reasoning, 0.0);
        assert!(run("--node 1,tool_calls=1").nodes[0].tool_calls && !plain.tool_calls);
        assert!(run("--node 1,force_usage=1").nodes[0].force_usage && !plain.force_usage);
        assert_eq!(run("--node 1,token_scale=1.5").nodes[0].token_scale, 1.5);
        assert_eq!(plain.token_scale, 1.0);
    }

    #[test]
    fn health_is_the_json_report_unless_an_engine_is_named() {
        let a = run(
            "--node 1 --node 2,metrics=vllm --node 3,metrics=llamacpp,health=json \
                     --node 4,health=engine --node 5,metrics=llamacpp,metrics_off=1,n_ctx=512",
        );
        let modes: Vec<HealthMode> = a.nodes.iter().map(|n| n.health).collect();
        use HealthMode::*;
        assert_eq!(modes, [Json, Engine, Json, Engine, Engine]);
        assert!(a
            .nodes
            .iter()
            .take(4)
            .all(|n| !n.metrics_off && n.n_ctx.is_none()));
        assert!(a.nodes[4].metrics_off);
        assert_eq!(a.nodes[4].n_ctx, Some(512));
    }

    #[test]
    fn help() {
        assert_eq!(parse(argv("--node 1 --help")), Ok(Command::Help));
        assert_eq!(parse(argv("-h")), Ok(Command::Help));
    }

    #[test]
    fn mistakes_are_explained() {
        for (args, needle) in [
            ("", "at least one --node"),
            ("--node", "--node needs a value"),
            ("--node x", "is not a port"),
            ("--node 70000", "is not a port"),
            ("--node 1,gpu=tpu", "unknown gpu"),
            ("--node 1,speed=3", "unknown key"),
            ("--node 1,name", "is not key=value"),
            ("--node 1,floor_ms=-1", "non-negative number"),
            ("--node 1,kv_tokens=1.5", "positive integer"),
            ("--node 1,max_running=0", "positive integer"),
            ("--node 1,name=", "non-empty"),
            (
                "--node 1,floor_ms=0,per_token_ms=0,overhead_ms=0",
                "cannot all be 0",
            ),
            ("--node 1 --node 1,name=b", "two nodes"),
            ("--node 1,metrics=prometheus", "unknown metrics"),
            ("--node 1,prefix_block=0", "positive integer"),
            ("--node 1,prefix_cache_blocks=-1", "whole number"),
            ("--node 1,models=a||b", "empty name"),
            ("--node 1,models=a|b,loras=b", "named twice"),
            ("--node 1,instant=yes", "expected 1 or 0"),
            ("--node 1,instant_tokens=8", "need instant=1"),
            ("--node 1,reasoning=1.5", "a share, from 0 to 1"),
            (
                "--node 1,instant=1,instant_tokens=0",
                "expected a positive integer",
            ),
            ("--node 1,health=seed", "expected json or engine"),
            ("--node 1,metrics_off=2", "expected 1 or 0"),
            ("--node 1,n_ctx=0", "positive integer"),
            ("--node 1 --time-scale 0", "positive number"),
            ("--node 1 --time-scale fast", "positive number"),
            ("--node 1 --verbose", "unknown argument"),
        ] {
            match parse(argv(args)) {
                Err(e) => assert!(e.contains(needle), "{args:?}: {e:?} lacks {needle:?}"),
                Ok(c) => panic!("{args:?} accepted: {c:?}"),
            }
        }
    }
}
