//! mock-gpu-node: serves one or more mock GPU inference nodes, each on its own port, each an
//! OpenAI-compatible API in front of the continuous-batching engine model (`engine.rs`).
//!
//! Endpoints per node: POST /v1/chat/completions and /v1/completions (streaming or not),
//! GET /health (the token-balancer seed format, every field), GET /metrics (vLLM's Prometheus
//! names), GET /v1/models, and for tests POST /admin/health (override or break /health) and
//! GET /admin/stats. Every response carries `x-mock-node: <name>`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use mock_gpu_node::engine::{Engine, EngineConfig, Event};
use mock_gpu_node::tokenize;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};

const KV_BYTES_PER_TOKEN: u64 = 512 * 1024;
const DEFAULT_MAX_TOKENS: u64 = 256;
/// Benchmark-only header carrying the true output length; the filter never reads it.
const OUTPUT_TOKENS_HEADER: &str = "x-mock-output-tokens";

const USAGE: &str = "\
usage: mock-gpu-node --node PORT[,key=value...] [--node ...] [--time-scale X] [--bind ADDR]

  --node PORT[,k=v...]  serve one node on PORT; keys:
                          name=NAME         (default node-PORT)
                          gpu=h100|a100|l4  speed and KV-cache preset (default h100)
                          floor_ms=F, per_token_ms=F, overhead_ms=F, kv_tokens=N,
                          max_running=N     override the preset
                          capacity=F        override the reported tokens_per_sec_capacity
  --time-scale X        run the model X times faster than real time (default 1); reported
                        rates are per wall-clock second
  --bind ADDR           address to listen on (default 127.0.0.1)";

struct NodeSpec {
    port: u16,
    name: String,
    gpu: String,
    config: EngineConfig,
    capacity: Option<f64>,
}

struct Args {
    nodes: Vec<NodeSpec>,
    time_scale: f64,
    bind: String,
}

fn parse_node(spec: &str) -> Result<NodeSpec, String> {
    let mut parts = spec.split(',');
    let port: u16 = parts
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| format!("--node {spec:?}: expected PORT first"))?;
    let kv: Vec<(&str, &str)> = parts
        .map(|p| {
            p.split_once('=')
                .ok_or_else(|| format!("--node {spec:?}: {p:?} is not key=value"))
        })
        .collect::<Result<_, _>>()?;
    let gpu = kv
        .iter()
        .find(|(k, _)| *k == "gpu")
        .map(|(_, v)| *v)
        .unwrap_or("h100");
    let mut config = EngineConfig::preset(gpu)
        .ok_or_else(|| format!("--node {spec:?}: unknown gpu {gpu:?} (h100, a100, l4)"))?;
    let mut name = format!("node-{port}");
    let mut capacity = None;
    let num = |k: &str, v: &str| -> Result<f64, String> {
        v.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| format!("--node {spec:?}: {k}={v:?} is not a non-negative number"))
    };
    for (k, v) in kv {
        match k {
            "gpu" => {}
            "name" => name = v.to_string(),
            "floor_ms" => config.floor_ms = num(k, v)?,
            "per_token_ms" => config.per_token_ms = num(k, v)?,
            "overhead_ms" => config.overhead_ms = num(k, v)?,
            "kv_tokens" => config.kv_capacity_tokens = num(k, v)? as u64,
            "max_running" => config.max_running = (num(k, v)? as usize).max(1),
            "capacity" => capacity = Some(num(k, v)?),
            _ => return Err(format!("--node {spec:?}: unknown key {k:?}")),
        }
    }
    Ok(NodeSpec {
        port,
        name,
        gpu: gpu.to_string(),
        config,
        capacity,
    })
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        nodes: vec![],
        time_scale: 1.0,
        bind: "127.0.0.1".to_string(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--node" => args.nodes.push(parse_node(&value()?)?),
            "--time-scale" => {
                let v = value()?;
                args.time_scale = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| format!("--time-scale {v:?} must be a positive number"))?;
            }
            "--bind" => args.bind = value()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    if args.nodes.is_empty() {
        return Err("at least one --node is needed".into());
    }
    Ok(args)
}

/// What a request's stream receives from the engine driver.
enum Delivery {
    Token(u64),
    Finished,
}

#[derive(Default)]
struct Overrides {
    fields: Map<String, Value>,
    fail: bool,
    hang: bool,
}

struct Node {
    name: String,
    engine: Mutex<Engine>,
    wake: Notify,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Delivery>>>,
    overrides: Mutex<Overrides>,
    capacity: Option<f64>,
    time_scale: f64,
    start: Instant,
    next_id: AtomicU64,
    requests_total: AtomicU64,
    health_requests_total: AtomicU64,
    /// Model times at which requests finished, over the last window (for the ORCA report).
    finished: Mutex<std::collections::VecDeque<f64>>,
}

/// A poisoned lock only means another request panicked mid-update; the mock keeps serving.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Node {
    fn model_now_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0 * self.time_scale
    }

    /// Drives the engine: one iteration, wait its (scaled) duration, deliver its events.
    async fn run(self: Arc<Self>) {
        loop {
            let step = {
                let mut e = lock(&self.engine);
                e.step(self.model_now_ms())
            };
            let Some(it) = step else {
                self.wake.notified().await;
                continue;
            };
            tokio::time::sleep(Duration::from_secs_f64(
                it.duration_ms / 1000.0 / self.time_scale,
            ))
            .await;
            let mut gone = vec![];
            {
                let streams = lock(&self.streams);
                for ev in &it.events {
                    let (id, d) = match *ev {
                        Event::Token { id, index } => (id, Delivery::Token(index)),
                        Event::Finished { id } => {
                            lock(&self.finished).push_back(self.model_now_ms());
                            (id, Delivery::Finished)
                        }
                        Event::Preempted { .. } => continue,
                    };
                    match streams.get(&id) {
                        Some(tx) if tx.send(d).is_ok() => {}
                        _ => gone.push(id),
                    }
                }
            }
            if !gone.is_empty() {
                let mut e = lock(&self.engine);
                for id in gone {
                    e.cancel(id);
                }
            }
        }
    }

    fn submit(&self, prompt: u64, output: u64) -> (u64, mpsc::UnboundedReceiver<Delivery>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.streams).insert(id, tx);
        lock(&self.engine).submit(id, prompt, output);
        self.wake.notify_one();
        (id, rx)
    }

    fn forget(&self, id: u64) {
        lock(&self.streams).remove(&id);
        lock(&self.engine).cancel(id);
    }

    fn health(&self) -> Value {
        let mut e = lock(&self.engine);
        let now = self.model_now_ms();
        let kv_total = e.config.kv_capacity_tokens;
        let used = e.kv_used_tokens();
        let capacity = self
            .capacity
            .unwrap_or(e.config.capacity_tokens_per_sec() * self.time_scale);
        let mut v = json!({
            "name": self.name,
            "tokens_per_sec_load": e.load_tokens_per_sec(now) * self.time_scale,
            "tokens_per_sec_capacity": capacity,
            "vram_used_bytes": used * KV_BYTES_PER_TOKEN,
            "vram_total_bytes": kv_total * KV_BYTES_PER_TOKEN,
            "kv_cache_usage": if kv_total > 0 { used as f64 / kv_total as f64 } else { 0.0 },
            "queue_depth": e.waiting(),
            "running_requests": e.running(),
            "vram_overflow_events": e.vram_overflow_events,
        });
        drop(e);
        if let Some(obj) = v.as_object_mut() {
            for (k, val) in &lock(&self.overrides).fields {
                obj.insert(k.clone(), val.clone());
            }
        }
        v
    }

    /// An ORCA load report for the `endpoint-load-metrics` response header, so that Envoy's
    /// client_side_weighted_round_robin can weigh nodes: utilization is the KV-cache use or the
    /// token-throughput use, whichever is higher, plus the queue relative to the batch size;
    /// rps is requests finished per wall second over the last window.
    fn orca(&self) -> String {
        let now = self.model_now_ms();
        let rps = {
            let mut f = lock(&self.finished);
            while matches!(f.front(), Some(t) if *t < now - mock_gpu_node::engine::LOAD_WINDOW_MS) {
                f.pop_front();
            }
            f.len() as f64 / (mock_gpu_node::engine::LOAD_WINDOW_MS / 1000.0) * self.time_scale
        };
        let mut e = lock(&self.engine);
        let kv = if e.config.kv_capacity_tokens > 0 {
            e.kv_used_tokens() as f64 / e.config.kv_capacity_tokens as f64
        } else {
            0.0
        };
        let busy = e.load_tokens_per_sec(now) / e.config.capacity_tokens_per_sec().max(1.0);
        let util = kv.max(busy) + e.waiting() as f64 / e.config.max_running.max(1) as f64;
        format!(
            "TEXT application_utilization={util:.4}, cpu_utilization={util:.4}, rps_fractional={rps:.3}, \
             named_metrics.kv_cache_usage={kv:.4}, named_metrics.num_requests_waiting={}",
            e.waiting()
        )
    }

    fn metrics(&self) -> String {
        let e = lock(&self.engine);
        let kv = if e.config.kv_capacity_tokens > 0 {
            e.kv_used_tokens() as f64 / e.config.kv_capacity_tokens as f64
        } else {
            0.0
        };
        let l = format!("{{model_name=\"mock-model\",node=\"{}\"}}", self.name);
        format!(
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{l} {}\n\
             # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{l} {}\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{l} {kv}\n\
             # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
             # TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{l} {}\n\
             # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
             # TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{l} {}\n\
             # HELP mock:vram_overflow_events_total Preemptions because the KV cache overflowed.\n\
             # TYPE mock:vram_overflow_events_total counter\nmock:vram_overflow_events_total{l} {}\n",
            e.running(),
            e.waiting(),
            e.prompt_tokens_total,
            e.generation_tokens_total,
            e.vram_overflow_events
        )
    }
}

/// A response body fed from a channel, so SSE events leave as the engine produces them.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn full(
    status: StatusCode,
    node: &str,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<BoxBody> {
    let mut r = Response::new(Full::new(body.into()).boxed_unsync());
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Ok(v) = content_type.parse() {
        h.insert("content-type", v);
    }
    if let Ok(v) = node.parse() {
        h.insert("x-mock-node", v);
    }
    r
}

fn json_response(status: StatusCode, node: &str, v: &Value) -> Response<BoxBody> {
    full(status, node, "application/json", v.to_string())
}

fn error(status: StatusCode, node: &str, message: &str) -> Response<BoxBody> {
    json_response(
        status,
        node,
        &json!({"error": {"message": message, "type": "invalid_request_error", "code": null}}),
    )
}

fn content_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => tokenize::count(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => tokenize::count(s),
                _ => p
                    .get("text")
                    .and_then(Value::as_str)
                    .map(tokenize::count)
                    .unwrap_or(0),
            })
            .sum(),
        _ => 0,
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completion(node: Arc<Node>, chat: bool, req: Request<Incoming>) -> Response<BoxBody> {
    let name = node.name.clone();
    let true_output: Option<u64> = req
        .headers()
        .get(OUTPUT_TOKENS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::BAD_REQUEST, &name, "could not read the body"),
    };
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, &name, "body is not valid JSON");
    };
    let prompt_tokens = if chat {
        match v.get("messages") {
            Some(Value::Array(msgs)) => msgs
                .iter()
                .map(|m| tokenize::PER_MESSAGE + m.get("content").map(content_tokens).unwrap_or(0))
                .sum(),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &name,
                    "`messages` must be an array",
                )
            }
        }
    } else {
        match v.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => content_tokens(p),
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &name,
                    "`prompt` must be a string or an array",
                )
            }
        }
    };
    let max_tokens = v
        .get("max_completion_tokens")
        .or_else(|| v.get("max_tokens"))
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let output = true_output.map_or(max_tokens, |t| t.clamp(1, max_tokens));
    let finish = if output >= max_tokens {
        "length"
    } else {
        "stop"
    };
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let model = v
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_string();
    node.requests_total.fetch_add(1, Ordering::Relaxed);

    let (id, mut rx) = node.submit(prompt_tokens, output);
    let rid = format!("{}-{}-{id}", if chat { "chatcmpl" } else { "cmpl" }, name);
    let created = unix_now();
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": output,
                       "total_tokens": prompt_tokens + output});
    let object = if chat {
        "chat.completion"
    } else {
        "text_completion"
    };

    if !stream {
        let mut text = String::new();
        while let Some(d) = rx.recv().await {
            match d {
                Delivery::Token(i) => text.push_str(&format!("tok{i} ")),
                Delivery::Finished => break,
            }
        }
        node.forget(id);
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": null})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": null})
        };
        let mut r = json_response(
            StatusCode::OK,
            &name,
            &json!({"id": rid, "object": object, "created": created, "model": model,
                    "choices": [choice], "usage": usage}),
        );
        if let Ok(v) = node.orca().parse() {
            r.headers_mut().insert("endpoint-load-metrics", v);
        }
        return r;
    }

    let (tx, body_rx) = mpsc::channel::<Bytes>(64);
    let chunk_object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let event = move |choices: Value, usage: Option<&Value>| {
        let mut v = json!({"id": rid, "object": chunk_object, "created": created, "model": model, "choices": choices});
        if let (Some(u), Some(obj)) = (usage, v.as_object_mut()) {
            obj.insert("usage".into(), u.clone());
        }
        Bytes::from(format!("data: {v}\n\n"))
    };
    let forward_node = node.clone();
    tokio::spawn(async move {
        let mut ok = true;
        while let Some(d) = rx.recv().await {
            let frame = match d {
                Delivery::Token(i) => {
                    let text = format!("tok{i} ");
                    if chat {
                        let delta = if i == 0 {
                            json!({"role": "assistant", "content": text})
                        } else {
                            json!({"content": text})
                        };
                        event(
                            json!([{"index": 0, "delta": delta, "finish_reason": null}]),
                            None,
                        )
                    } else {
                        event(
                            json!([{"index": 0, "text": text, "finish_reason": null, "logprobs": null}]),
                            None,
                        )
                    }
                }
                Delivery::Finished => break,
            };
            if tx.send(frame).await.is_err() {
                ok = false; // the client went away
                break;
            }
        }
        forward_node.forget(id);
        if ok {
            let last = if chat {
                json!([{"index": 0, "delta": {}, "finish_reason": finish}])
            } else {
                json!([{"index": 0, "text": "", "finish_reason": finish, "logprobs": null}])
            };
            for frame in [
                event(last, None),
                event(json!([]), Some(&usage)),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ] {
                if tx.send(frame).await.is_err() {
                    break;
                }
            }
        }
    });
    let mut r = Response::new(ChannelBody(body_rx).boxed_unsync());
    let h = r.headers_mut();
    h.insert(
        "content-type",
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        "cache-control",
        hyper::header::HeaderValue::from_static("no-cache"),
    );
    if let Ok(v) = name.parse() {
        h.insert("x-mock-node", v);
    }
    if let Ok(v) = node.orca().parse() {
        h.insert("endpoint-load-metrics", v);
    }
    r
}

async fn admin_health(node: &Node, req: Request<Incoming>) -> Response<BoxBody> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let v: Value = if body.is_empty() {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(_) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &node.name,
                    "body is not valid JSON",
                )
            }
        }
    };
    let Some(obj) = v.as_object() else {
        return error(
            StatusCode::BAD_REQUEST,
            &node.name,
            "body must be a JSON object",
        );
    };
    let mut o = lock(&node.overrides);
    if obj.is_empty() || obj.get("reset").and_then(Value::as_bool) == Some(true) {
        *o = Overrides::default();
    } else {
        for (k, val) in obj {
            match k.as_str() {
                "fail" => o.fail = val.as_bool().unwrap_or(false),
                "hang" => o.hang = val.as_bool().unwrap_or(false),
                _ => {
                    o.fields.insert(k.clone(), val.clone());
                }
            }
        }
    }
    json_response(StatusCode::OK, &node.name, &json!({"ok": true}))
}

async fn handle(node: Arc<Node>, req: Request<Incoming>) -> Result<Response<BoxBody>, Infallible> {
    let name = node.name.clone();
    let path = req.uri().path().to_string();
    let r = match (req.method().clone(), path.as_str()) {
        (Method::POST, "/v1/chat/completions") => completion(node, true, req).await,
        (Method::POST, "/v1/completions") => completion(node, false, req).await,
        (Method::GET, "/health") => {
            node.health_requests_total.fetch_add(1, Ordering::Relaxed);
            let (fail, hang) = {
                let o = lock(&node.overrides);
                (o.fail, o.hang)
            };
            if hang {
                std::future::pending::<()>().await;
            }
            if fail {
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &name,
                    "health endpoint set to fail",
                )
            } else {
                json_response(StatusCode::OK, &name, &node.health())
            }
        }
        (Method::GET, "/metrics") => full(
            StatusCode::OK,
            &name,
            "text/plain; version=0.0.4",
            node.metrics(),
        ),
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            &name,
            &json!({"object": "list", "data": [{"id": "mock-model", "object": "model", "created": 0, "owned_by": "token-balancer"}]}),
        ),
        (Method::POST, "/admin/health") => admin_health(&node, req).await,
        (Method::GET, "/admin/stats") => json_response(
            StatusCode::OK,
            &name,
            &json!({"name": name, "requests_total": node.requests_total.load(Ordering::Relaxed),
                    "health_requests_total": node.health_requests_total.load(Ordering::Relaxed)}),
        ),
        _ => error(
            StatusCode::NOT_FOUND,
            &name,
            &format!("no route for {path}"),
        ),
    };
    Ok(r)
}

async fn serve(listener: TcpListener, node: Arc<Node>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let node = node.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(node.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("mock-gpu-node: {e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    for spec in args.nodes {
        let listener = match TcpListener::bind((args.bind.as_str(), spec.port)).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "mock-gpu-node: cannot listen on {}:{}: {e}",
                    args.bind, spec.port
                );
                std::process::exit(1);
            }
        };
        let node = Arc::new(Node {
            name: spec.name.clone(),
            engine: Mutex::new(Engine::new(spec.config)),
            wake: Notify::new(),
            streams: Mutex::new(HashMap::new()),
            overrides: Mutex::new(Overrides::default()),
            capacity: spec.capacity,
            time_scale: args.time_scale,
            start: Instant::now(),
            next_id: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            health_requests_total: AtomicU64::new(0),
            finished: Mutex::new(std::collections::VecDeque::new()),
        });
        tokio::spawn(node.clone().run());
        tokio::spawn(serve(listener, node));
        println!(
            "listening name={} port={} gpu={}",
            spec.name, spec.port, spec.gpu
        );
    }
    let _ = tokio::signal::ctrl_c().await;
}
