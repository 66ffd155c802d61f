//! loadgen: open-loop replay of a real LLM traffic trace against an OpenAI-compatible endpoint.
//!
//! Open loop: every request is sent at its trace time (divided by the rate multiplier and the
//! model's time scale), whether or not earlier ones have finished, as real users do; a closed
//! loop would slow down exactly when the system under test does and hide its queues. Requests
//! stream (`stream: true`); for each one it records the time to first token, the end-to-end
//! latency, the time per output token, the tokens received, the serving node (the mock's
//! `x-mock-node` header) and the status. Times are reported in model time (wall time multiplied
//! by the time scale) so runs at different scales compare.
//!
//! The body's `max_tokens` is a cap, as real clients send it; the trace's true output length
//! travels in the benchmark-only `x-mock-output-tokens` header, which the balancer never reads.

mod prompt;
use loadgen::trace;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

const USAGE: &str = "\
usage: loadgen --url http://HOST:PORT [--url http://HOST:PORT ...]
               --trace azure:PATH|mooncake:PATH|sharegpt:PATH|tenants:N|hot|prefill|decode|mixed|long|two-tenants
               [options]

  --start-s S        skip the trace's first S seconds (default 0)
  --duration-s S     replay S seconds of trace (default 60)
  --requests N       at most N requests
  --arrivals A       poisson (the trace's own times) or bursts: the same requests
                     re-timed into bursts of 20-60 within a second at the same mean
                     rate (default poisson)
  --rate X           offered-load multiplier: arrivals X times denser (default 1)
  --time-scale X     the nodes' model runs X times faster than real time (default 1)
  --max-tokens N     max_tokens cap in every body (default 1024)
  --max-prompt-tokens N  cut longer trace prompts to N tokens, keeping their leading
                     prefix blocks (default: no cut); for traces whose longest prompts
                     exceed every node's KV cache
  --timeout-s S      per-request timeout, wall seconds (default 300)
  --seed N           seed of the generated workloads (default 1)
  --only-tenant T    send only tenant T's requests (two-tenants: chat or docs)
  --objective T=NAME send tenant T's requests with x-gateway-inference-objective: NAME
                     (repeatable)
  --slo-ttft-ms MS   send every request with x-slo-ttft-ms, its time-to-first-token
                     budget: MS of model time (MS / time scale on the wall clock)
  --slo-tpot-ms MS   send every request with x-slo-tpot-ms, the longest time per output
                     token it accepts: MS of model time (scaled the same way)
  --api A           chat (POST /v1/chat/completions, max_tokens), responses
                     (POST /v1/responses: OpenAI's Responses API, the prompt as input,
                     the cap as max_output_tokens), messages (POST /v1/messages:
                     Anthropic's Messages API), generate (POST /generate: SGLang's
                     native endpoint, the prompt as text, the cap as
                     sampling_params.max_new_tokens) or tokens (POST /v1/completions with
                     the prompt as token ids, as clients with their own tokenizer send
                     it: the trace's length exactly, shared blocks as shared ids)
                     (default chat)
  --images N         every request's message opens with N images (PNG data URLs of
                     sizes from 640 x 480 to 1920 x 1080, each its own; a vision model
                     counts each at hundreds to thousands of tokens) (default 0)
  --tools N          every request offers an agent's N tools (the same list each time,
                     about 100 tokens each, which the engine renders into the prompt
                     ahead of the messages) (default 0)
  --turns K          with --api responses: the requests are conversations of K turns
                     (request i is turn i / C of conversation i % C, C the number of
                     conversations); a turn after the first waits for the one before it
                     and continues the answer it stored (previous_response_id), with
                     only its own input, as agents and chat front ends using the
                     server's store send it (default 1: no conversations)
  --url URL          where requests go; repeated, several Envoy replicas behind a load
                     balancer that keeps no affinity: request i goes to the (i mod n)-th,
                     and turn k of conversation c (--turns) to the ((c + k) mod n)-th, so
                     that each turn reaches another replica than the one before it
  --no-usage         chat and token-id streams do not ask for their usage
                     (stream_options.include_usage), as most clients do not; by default
                     they ask, and the server ends each with the counts of its prompt
                     and output
  --label NAME       name of this run in the output
  --out FILE         write every request and the summary as JSON";

/// The API a request speaks (`--api`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Responses,
    Messages,
    Generate,
    Tokens,
}

impl Api {
    const ALL: [Api; 5] = [
        Api::Chat,
        Api::Responses,
        Api::Messages,
        Api::Generate,
        Api::Tokens,
    ];

    fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::Generate => "generate",
            Api::Tokens => "tokens",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
            Api::Generate => "/generate",
            Api::Tokens => "/v1/completions",
        }
    }
}

struct Args {
    host: String,
    port: u16,
    /// Every `--url`'s host and port (the first is `host`, `port`).
    targets: Vec<(String, u16)>,
    trace: Vec<trace::TraceRequest>,
    start_s: f64,
    duration_s: f64,
    requests: Option<usize>,
    rate: f64,
    time_scale: f64,
    max_tokens: u64,
    max_prompt_tokens: Option<u64>,
    timeout_s: f64,
    label: String,
    out: Option<String>,
    seed: u64,
    bursts: bool,
    only_tenant: Option<String>,
    /// (tenant, objective name) pairs.
    objectives: Vec<(String, String)>,
    slo_ttft_ms: Option<f64>,
    slo_tpot_ms: Option<f64>,
    /// The API every request speaks.
    api: Api,
    /// Tools offered with every request.
    tools: usize,
    /// Images at the start of every request's message.
    images: usize,
    /// Turns per conversation (`--turns`; 1: none).
    turns: usize,
    /// Chat and token-id streams ask for their usage (not with `--no-usage`).
    usage: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut urls: Vec<String> = Vec::new();
    let mut trace_arg = None;
    let mut a = Args {
        host: String::new(),
        port: 0,
        targets: Vec::new(),
        trace: vec![],
        start_s: 0.0,
        duration_s: 60.0,
        requests: None,
        rate: 1.0,
        time_scale: 1.0,
        max_tokens: 1024,
        max_prompt_tokens: None,
        timeout_s: 300.0,
        label: "run".into(),
        out: None,
        seed: 1,
        bursts: false,
        only_tenant: None,
        objectives: vec![],
        slo_ttft_ms: None,
        slo_tpot_ms: None,
        api: Api::Chat,
        tools: 0,
        images: 0,
        turns: 1,
        usage: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let pos = |s: String, f: &str| -> Result<f64, String> {
            s.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("{f} {s:?} is not a non-negative number"))
        };
        match flag.as_str() {
            "--url" => urls.push(v()?),
            "--trace" => trace_arg = Some(v()?),
            "--start-s" => a.start_s = pos(v()?, "--start-s")?,
            "--duration-s" => a.duration_s = pos(v()?, "--duration-s")?,
            "--requests" => a.requests = Some(pos(v()?, "--requests")? as usize),
            "--rate" => a.rate = pos(v()?, "--rate")?.max(1e-6),
            "--time-scale" => a.time_scale = pos(v()?, "--time-scale")?.max(1e-6),
            "--max-tokens" => a.max_tokens = pos(v()?, "--max-tokens")?.max(1.0) as u64,
            "--max-prompt-tokens" => {
                a.max_prompt_tokens = Some(pos(v()?, "--max-prompt-tokens")?.max(1.0) as u64)
            }
            "--timeout-s" => a.timeout_s = pos(v()?, "--timeout-s")?,
            "--arrivals" => {
                a.bursts = match v()?.as_str() {
                    "poisson" => false,
                    "bursts" => true,
                    other => return Err(format!("--arrivals {other:?}: poisson or bursts")),
                }
            }
            "--only-tenant" => a.only_tenant = Some(v()?),
            "--objective" => {
                let spec = v()?;
                let (t, name) = spec
                    .split_once('=')
                    .ok_or_else(|| format!("--objective {spec:?}: TENANT=NAME"))?;
                a.objectives.push((t.to_string(), name.to_string()));
            }
            "--slo-ttft-ms" => a.slo_ttft_ms = Some(pos(v()?, "--slo-ttft-ms")?.max(1.0)),
            "--slo-tpot-ms" => a.slo_tpot_ms = Some(pos(v()?, "--slo-tpot-ms")?.max(1.0)),
            "--tools" => a.tools = pos(v()?, "--tools")? as usize,
            "--images" => a.images = pos(v()?, "--images")? as usize,
            "--turns" => a.turns = (pos(v()?, "--turns")? as usize).max(1),
            "--api" => {
                let name = v()?;
                a.api = Api::ALL
                    .into_iter()
                    .find(|api| api.name() == name)
                    .ok_or_else(|| {
                        format!("--api {name:?}: chat, responses, messages, generate or tokens")
                    })?;
            }
            "--no-usage" => a.usage = false,
            "--label" => a.label = v()?,
            "--seed" => a.seed = pos(v()?, "--seed")? as u64,
            "--out" => a.out = Some(v()?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    if urls.is_empty() {
        return Err("--url is required".into());
    }
    for url in &urls {
        let hostport = url
            .strip_prefix("http://")
            .ok_or("--url must start with http://")?
            .trim_end_matches('/');
        let (h, p) = hostport.rsplit_once(':').ok_or("--url needs a port")?;
        let port = p
            .parse()
            .map_err(|_| format!("bad port in --url {url:?}"))?;
        a.targets.push((h.to_string(), port));
    }
    if let Some((h, p)) = a.targets.first() {
        a.host = h.clone();
        a.port = *p;
    }
    let spec = trace_arg.ok_or("--trace is required")?;
    let (kind, path) = spec.split_once(':').unwrap_or((spec.as_str(), ""));
    let read =
        || std::fs::read_to_string(path).map_err(|e| format!("cannot read trace {path}: {e}"));
    a.trace = match kind {
        "azure" => trace::parse_azure(&read()?)?,
        "mooncake" => trace::parse_mooncake(&read()?)?,
        "sharegpt" => trace::parse_sharegpt(&read()?, a.seed)?,
        "tenants" => trace::tenants(
            path.parse().map_err(|_| {
                format!("--trace tenants:N needs a number of tenants, not {path:?}")
            })?,
            a.seed,
        ),
        "hot" => trace::hot(a.seed),
        "two-tenants" => trace::two_tenants(a.seed),
        shape => match trace::Shape::parse(shape) {
            Some(s) => trace::shaped(s, a.seed),
            None => {
                return Err(format!(
                    "unknown trace kind {kind:?} (azure, mooncake, sharegpt, tenants, hot, \
                     prefill, decode, mixed, long, two-tenants)"
                ))
            }
        },
    };
    if a.bursts {
        a.trace = trace::bursty(std::mem::take(&mut a.trace), a.seed);
    }
    if let Some(only) = &a.only_tenant {
        a.trace.retain(|r| r.tenant == Some(only.as_str()));
    }
    if (a.tools > 0 || a.images > 0) && matches!(a.api, Api::Generate | Api::Tokens) {
        return Err(format!(
            "--tools and --images: chat, responses and messages requests carry them, not {}",
            a.api.name()
        ));
    }
    if a.turns > 1 && a.api != Api::Responses {
        return Err(format!(
            "--turns: conversations continue stored answers, which only --api responses has, not {}",
            a.api.name()
        ));
    }
    Ok(a)
}

/// One conversation of `--turns`: how many of its turns are done, and the id its last answer
/// is stored under (none when that turn failed: the next one starts afresh).
type Conversation = tokio::sync::watch::Sender<(usize, Option<String>)>;

/// What happened to one request. Times are model-time milliseconds.
#[derive(Debug, Clone, Default)]
struct Record {
    index: usize,
    sent_ms: f64,
    prompt_tokens: u64,
    output_tokens: u64,
    status: u16,
    node: String,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    tokens_received: u64,
    /// Prompt tokens in leading blocks an earlier request sent (see `trace::seen_before`).
    seen_before: u64,
    /// Prompt tokens the serving engine found in its prefix cache (the mock's benchmark-only
    /// `x-mock-prefix-hit-tokens` header).
    cached: u64,
    /// The prompt's first shared block (what `x-prefix-key` carries), to tell which
    /// requests share a prefix.
    prefix_key: String,
    /// The tenant it was sent for, when the workload has tenants.
    tenant: String,
    /// The `Retry-After` the answer carried (seconds), when it carried one.
    retry_after_s: Option<u64>,
    /// It continued a stored answer (`previous_response_id`, see `--turns`).
    continued: bool,
    /// The id its answer is stored under (`response.created`), when it gave one.
    response_id: Option<String>,
    /// The `--url` it was sent to, by its place among them.
    replica: usize,
    error: Option<String>,
}

impl Record {
    fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.tokens_received > 0
    }
    fn tpot_ms(&self) -> Option<f64> {
        match (self.ttft_ms, self.e2e_ms) {
            (Some(t), Some(e)) if self.tokens_received > 1 => {
                Some((e - t) / (self.tokens_received - 1) as f64)
            }
            _ => None,
        }
    }
    fn to_json(&self) -> Value {
        json!({"index": self.index, "sent_ms": self.sent_ms, "prompt_tokens": self.prompt_tokens,
               "output_tokens": self.output_tokens, "status": self.status, "node": self.node,
               "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms, "tpot_ms": self.tpot_ms(),
               "tokens_received": self.tokens_received, "seen_before": self.seen_before,
               "cached": self.cached, "prefix_key": self.prefix_key, "tenant": self.tenant,
               "retry_after_s": self.retry_after_s, "continued": self.continued, "replica": self.replica,
               "error": self.error})
    }
}

async fn one(
    args: Arc<Args>,
    index: usize,
    body: Bytes,
    output: u64,
    prefix_key: String,
    sent: Instant,
    rec: &mut Record,
) -> Result<(), String> {
    let objective = args
        .objectives
        .iter()
        .find(|(t, _)| *t == rec.tenant)
        .map(|(_, name)| name.clone());
    let (host, port) = args
        .targets
        .get(rec.replica)
        .map_or((args.host.as_str(), args.port), |(h, p)| (h.as_str(), *p));
    let stream = TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let req = Request::post(args.api.path())
        .header("host", format!("{host}:{port}"))
        .header("content-type", "application/json")
        .header("x-mock-output-tokens", output.to_string())
        .header("x-request-index", index.to_string())
        // What a stock-Envoy user hashes on for affinity (ring_hash): the prompt's first
        // shared block, or the request's own index when it shares none.
        .header("x-prefix-key", prefix_key);
    let req = if rec.tenant.is_empty() {
        req
    } else {
        req.header("x-gateway-inference-fairness-id", rec.tenant.as_str())
    };
    let req = match objective {
        Some(name) => req.header("x-gateway-inference-objective", name),
        None => req,
    };
    // The filter's clock is the wall clock: budgets in model time, scaled to it.
    let wall = |ms: f64| ((ms / args.time_scale).round() as u64).max(1).to_string();
    let req = match args.slo_ttft_ms {
        Some(ms) => req.header("x-slo-ttft-ms", wall(ms)),
        None => req,
    };
    let req = match args.slo_tpot_ms {
        Some(ms) => req.header("x-slo-tpot-ms", wall(ms)),
        None => req,
    };
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    rec.status = resp.status().as_u16();
    rec.retry_after_s = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    rec.node = resp
        .headers()
        .get("x-mock-node")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    rec.cached = resp
        .headers()
        .get("x-mock-prefix-hit-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let scale = args.time_scale;
    let mut body = resp.into_body();
    let mut pending = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        let Some(data) = frame.data_ref() else {
            continue;
        };
        pending.extend_from_slice(data);
        while let Some(pos) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..pos + 2).collect();
            let text = String::from_utf8_lossy(&event);
            // A named event (the Responses API's) has its `event:` line first.
            let Some(payload) = text.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if payload == "[DONE]" {
                continue;
            }
            if rec.response_id.is_none() && payload.contains("\"response.created\"") {
                rec.response_id = serde_json::from_str::<Value>(payload).ok().and_then(|v| {
                    v.pointer("/response/id")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                });
            }
            let has_content = is_token_event(payload);
            if has_content {
                if rec.ttft_ms.is_none() {
                    rec.ttft_ms = Some(sent.elapsed().as_secs_f64() * 1000.0 * scale);
                }
                rec.tokens_received += 1;
            }
        }
    }
    rec.e2e_ms = Some(sent.elapsed().as_secs_f64() * 1000.0 * scale);
    if rec.status != 200 {
        return Err(format!("HTTP {}", rec.status));
    }
    Ok(())
}

/// Whether an SSE event's data carries a token: of the answer, of a reasoning model's thinking
/// before it, or of a tool call's arguments, in a chat chunk's delta, as a Responses API
/// `….delta` event, a completion chunk's `text` or a native `/generate` event's. The first of
/// any is the first token, as engines count it.
fn is_token_event(payload: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(payload) else {
        return false;
    };
    // An Anthropic event: only its `content_block_delta` events carry tokens (text, thinking
    // or a tool use's input).
    if v.get("type").and_then(Value::as_str) == Some("content_block_delta") {
        return ["/delta/text", "/delta/thinking", "/delta/partial_json"]
            .iter()
            .any(|k| {
                v.pointer(k)
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty())
            });
    }
    // A Responses API event: only its `….delta` events carry tokens (the closing ones repeat
    // the whole text).
    if let Some(kind) = v
        .get("type")
        .and_then(Value::as_str)
        .filter(|t| t.starts_with("response."))
    {
        return kind.ends_with(".delta")
            && v.get("delta")
                .and_then(Value::as_str)
                .is_some_and(|s| !s.is_empty());
    }
    [
        "/choices/0/delta/content",
        "/choices/0/delta/reasoning_content",
        "/choices/0/delta/reasoning",
        "/choices/0/delta/tool_calls/0/function/arguments",
        "/choices/0/text",
        "/text",
    ]
    .iter()
    .any(|k| {
        v.pointer(k)
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty())
    })
}

fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i.min(sorted.len() - 1)).copied()
}

fn dist(mut xs: Vec<f64>) -> Value {
    xs.sort_by(f64::total_cmp);
    let mean = if xs.is_empty() {
        None
    } else {
        Some(xs.iter().sum::<f64>() / xs.len() as f64)
    };
    json!({"p50": percentile(&xs, 0.5), "p90": percentile(&xs, 0.9), "p99": percentile(&xs, 0.99),
           "mean": mean, "max": xs.last()})
}

fn summarize(records: &[Record], model_span_ms: f64) -> Value {
    let ok: Vec<&Record> = records.iter().filter(|r| r.ok()).collect();
    let tokens: u64 = ok.iter().map(|r| r.tokens_received).sum();
    let prompt: u64 = records.iter().map(|r| r.prompt_tokens).sum();
    let share = |n: u64| n as f64 / prompt.max(1) as f64;
    let mut nodes = std::collections::BTreeMap::new();
    for r in records {
        *nodes
            .entry(if r.node.is_empty() {
                "-".to_string()
            } else {
                r.node.clone()
            })
            .or_insert(0u64) += 1;
    }
    json!({
        "requests": records.len(),
        "ok": ok.len(),
        "errors": records.len() - ok.len(),
        // Of the errors, the requests the gateway refused (429 or 503 with Retry-After).
        "refused": records.iter().filter(|r| matches!(r.status, 429 | 503)).count(),
        // Turns that continued a stored answer (`--turns`), and those of them that failed.
        "continued": records.iter().filter(|r| r.continued).count(),
        "continued_errors": records.iter().filter(|r| r.continued && !r.ok()).count(),
        "ttft_ms": dist(ok.iter().filter_map(|r| r.ttft_ms).collect()),
        "e2e_ms": dist(ok.iter().filter_map(|r| r.e2e_ms).collect()),
        "tpot_ms": dist(ok.iter().filter_map(|r| r.tpot_ms()).collect()),
        "output_tokens_per_s": if model_span_ms > 0.0 { tokens as f64 / (model_span_ms / 1000.0) } else { 0.0 },
        "requests_per_node": nodes,
        // Prompt tokens the engines found cached, and the bound (leading blocks sent before).
        "prefix_hit_rate": share(records.iter().map(|r| r.cached).sum()),
        "prefix_bound": share(records.iter().map(|r| r.seen_before).sum()),
    })
}

fn fmt(v: &Value, path: &str) -> String {
    v.pointer(path)
        .and_then(Value::as_f64)
        .map_or("-".into(), |x| format!("{x:.0}"))
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => Arc::new(a),
        Err(e) => {
            eprintln!("loadgen: {e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    let start_ms = args.start_s * 1000.0;
    let end_ms = start_ms + args.duration_s * 1000.0;
    let mut selected: Vec<&trace::TraceRequest> = args
        .trace
        .iter()
        .filter(|r| r.at_ms >= start_ms && r.at_ms < end_ms)
        .collect();
    if let Some(n) = args.requests {
        selected.truncate(n);
    }
    if selected.is_empty() {
        eprintln!("loadgen: no requests in the selected slice of the trace");
        std::process::exit(2);
    }
    let seen = trace::seen_before(&selected);
    // Bodies are built before the clock starts, so building never delays an arrival.
    let shape = match args.api {
        Api::Responses => prompt::ToolShape::Responses,
        Api::Messages => prompt::ToolShape::Anthropic,
        _ => prompt::ToolShape::Chat,
    };
    let tools = (args.tools > 0).then(|| prompt::tools(args.tools, shape));
    let plan: Vec<(f64, Bytes, u64, u64, String, &'static str)> = selected
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let prompt_tokens = args
                .max_prompt_tokens
                .map_or(r.prompt_tokens, |cap| r.prompt_tokens.min(cap));
            let (seed, block) = (i as u64 + 1, trace::MOONCAKE_BLOCK_TOKENS);
            let text = || prompt::build(seed, prompt_tokens, &r.blocks, block);
            // The message: its text, after the request's images when it has any.
            let content = |api: Api| {
                if args.images == 0 {
                    return json!(text());
                }
                let mut parts: Vec<Value> = (0..args.images as u64)
                    .map(|k| {
                        let url = prompt::image(seed.wrapping_mul(64).wrapping_add(k));
                        match api {
                            Api::Responses => json!({"type": "input_image", "image_url": url}),
                            Api::Messages => json!({"type": "image", "source": {
                                "type": "base64", "media_type": "image/png",
                                "data": url.trim_start_matches("data:image/png;base64,")}}),
                            _ => json!({"type": "image_url", "image_url": {"url": url}}),
                        }
                    })
                    .collect();
                let text_part = if api == Api::Responses {
                    "input_text"
                } else {
                    "text"
                };
                parts.push(json!({"type": text_part, "text": text()}));
                Value::Array(parts)
            };
            let mut body = match args.api {
                Api::Chat => {
                    json!({"model": "mock-model", "stream": true, "max_tokens": args.max_tokens,
                           "messages": [{"role": "user", "content": content(Api::Chat)}]})
                }
                Api::Responses => json!({"model": "mock-model", "stream": true,
                                         "max_output_tokens": args.max_tokens,
                                         "input": [{"role": "user", "content": content(Api::Responses)}]}),
                Api::Messages => json!({"model": "mock-model", "stream": true,
                                        "max_tokens": args.max_tokens,
                                        "messages": [{"role": "user", "content": content(Api::Messages)}]}),
                Api::Generate => json!({"model": "mock-model", "stream": true, "text": text(),
                                        "sampling_params": {"max_new_tokens": args.max_tokens}}),
                Api::Tokens => json!({"model": "mock-model", "stream": true,
                                      "max_tokens": args.max_tokens,
                                      "prompt": prompt::ids(seed, prompt_tokens, &r.blocks, block)}),
            };
            if let (Some(tools), Some(o)) = (&tools, body.as_object_mut()) {
                o.insert("tools".into(), tools.clone());
            }
            if args.usage && matches!(args.api, Api::Chat | Api::Tokens) {
                if let Some(o) = body.as_object_mut() {
                    o.insert("stream_options".into(), json!({"include_usage": true}));
                }
            }
            let wall_ms = (r.at_ms - selected[0].at_ms) / args.rate / args.time_scale;
            let prefix_key = match r.blocks.first() {
                Some(b) if prompt_tokens >= trace::MOONCAKE_BLOCK_TOKENS => format!("b{b}"),
                _ => format!("r{i}"),
            };
            (
                wall_ms,
                Bytes::from(body.to_string()),
                r.output_tokens.min(args.max_tokens),
                prompt_tokens,
                prefix_key,
                r.tenant.unwrap_or(""),
            )
        })
        .collect();
    let n = plan.len();
    let wall_span = plan.last().map(|p| p.0).unwrap_or(0.0) / 1000.0;
    eprintln!(
        "loadgen {}: {n} requests over {wall_span:.1}s wall ({:.1} req/s model time), time scale {}",
        args.label,
        n as f64 / (wall_span * args.time_scale).max(1e-9),
        args.time_scale
    );
    // Conversations (`--turns`): each one's turns done so far and its last stored answer.
    let talks = n.div_ceil(args.turns);
    let conversations: Vec<Arc<Conversation>> = (0..if args.turns > 1 { talks } else { 0 })
        .map(|_| Arc::new(tokio::sync::watch::channel((0, None)).0))
        .collect();
    let t0 = Instant::now() + Duration::from_millis(50);
    let mut handles = Vec::with_capacity(n);
    for (i, (at, body, output, prompt_tokens, prefix_key, tenant)) in plan.into_iter().enumerate() {
        let args = args.clone();
        let seen_before = seen.get(i).copied().unwrap_or(0);
        let talk = conversations.get(i % talks.max(1)).cloned();
        let turn = i / talks.max(1);
        // Which replica (`--url`) it reaches: each turn another than the one before it.
        let replica = if talk.is_some() {
            (i % talks.max(1)) + turn
        } else {
            i
        } % args.targets.len().max(1);
        handles.push(tokio::spawn(async move {
            let when = t0 + Duration::from_secs_f64(at / 1000.0);
            tokio::time::sleep_until(when.into()).await;
            // A later turn waits for the one before it, and continues its stored answer.
            let mut body = body;
            let mut continued = false;
            if let Some(talk) = &talk {
                let mut rx = talk.subscribe();
                let previous = match rx.wait_for(|(done, _)| *done >= turn).await {
                    Ok(state) => state.1.clone(),
                    Err(_) => None,
                };
                if let (Some(id), Some(rest)) = (previous, body.strip_prefix(b"{")) {
                    let field = format!("{{\"previous_response_id\":{},", json!(id));
                    body = Bytes::from([field.as_bytes(), rest].concat());
                    continued = true;
                }
            }
            let sent = Instant::now();
            let mut rec = Record {
                index: i,
                sent_ms: sent.duration_since(t0).as_secs_f64() * 1000.0 * args.time_scale,
                prompt_tokens,
                output_tokens: output,
                seen_before,
                prefix_key: prefix_key.clone(),
                tenant: tenant.to_string(),
                replica,
                ..Record::default()
            };
            let timeout = Duration::from_secs_f64(args.timeout_s);
            match tokio::time::timeout(
                timeout,
                one(args.clone(), i, body, output, prefix_key, sent, &mut rec),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => rec.error = Some(e),
                Err(_) => rec.error = Some("timeout".into()),
            }
            rec.continued = continued;
            if let Some(talk) = &talk {
                // The next turn continues this answer, or starts afresh if it failed.
                let id = rec.response_id.clone().filter(|_| rec.ok());
                talk.send_replace((turn + 1, id));
            }
            rec
        }));
    }
    let mut records = Vec::with_capacity(n);
    for h in handles {
        match h.await {
            Ok(r) => records.push(r),
            Err(e) => records.push(Record {
                error: Some(format!("task: {e}")),
                ..Record::default()
            }),
        }
    }
    let span_ms = t0.elapsed().as_secs_f64() * 1000.0 * args.time_scale;
    let summary = summarize(&records, span_ms);
    eprintln!(
        "loadgen {}: {}/{} ok; TTFT p50/p99 {}/{} ms; e2e p50/p99 {}/{} ms; TPOT mean/p99 {}/{} ms (model time)",
        args.label,
        summary["ok"],
        n,
        fmt(&summary, "/ttft_ms/p50"),
        fmt(&summary, "/ttft_ms/p99"),
        fmt(&summary, "/e2e_ms/p50"),
        fmt(&summary, "/e2e_ms/p99"),
        fmt(&summary, "/tpot_ms/mean"),
        fmt(&summary, "/tpot_ms/p99"),
    );
    if let Some(path) = &args.out {
        let doc = json!({"label": args.label, "time_scale": args.time_scale, "rate": args.rate,
                         "start_s": args.start_s, "duration_s": args.duration_s,
                         "max_tokens": args.max_tokens,
                         "api": args.api.name(),
                         "tools": args.tools,
                         "images": args.images,
                         "summary": summary,
                         "requests": records.iter().map(Record::to_json).collect::<Vec<_>>()});
        if let Err(e) = std::fs::write(path, doc.to_string()) {
            eprintln!("loadgen: cannot write {path}: {e}");
            std::process::exit(1);
        }
    }
    println!("{summary}");
}

#[cfg(test)]
mod tests {
    use super::is_token_event;

    #[test]
    fn token_events_are_the_answer_the_thinking_and_tool_call_arguments() {
        let cases = [
            (r#"{"choices":[{"delta":{"content":"Hi"}}]}"#, true),
            (
                r#"{"choices":[{"delta":{"reasoning_content":"Hm"}}]}"#,
                true,
            ),
            (r#"{"choices":[{"delta":{"reasoning":"Hm"}}]}"#, true),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"delta":{"content":null,"reasoning":null}}]}"#,
                false,
            ),
            (r#"{"choices":[],"usage":{"completion_tokens":3}}"#, false),
            (
                r#"{"type":"response.output_text.delta","delta":"Hi"}"#,
                true,
            ),
            (
                r#"{"type":"response.reasoning_text.delta","delta":"Hm"}"#,
                true,
            ),
            (
                r#"{"type":"response.function_call_arguments.delta","delta":"{"}"#,
                true,
            ),
            (
                r#"{"type":"response.output_text.done","text":"Hi there"}"#,
                false,
            ),
            (r#"{"type":"response.created","response":{}}"#, false),
            // a completion chunk, a native /generate event (SGLang)
            (r#"{"choices":[{"index":0,"text":"Hi"}]}"#, true),
            (
                r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#,
                false,
            ),
            (r#"{"text":"Hi","meta_info":{"completion_tokens":1}}"#, true),
            // Anthropic's events
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
                true,
            ),
            (
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Hm"}}"#,
                true,
            ),
            (
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                false,
            ),
            (
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#,
                false,
            ),
            ("not json", false),
        ];
        for (payload, token) in cases {
            assert_eq!(is_token_event(payload), token, "{payload}");
        }
    }
}
