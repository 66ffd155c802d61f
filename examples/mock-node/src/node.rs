//! One served node: its engine, the task that drives the engine in (scaled) real time, the
//! channels that carry each request's tokens to its HTTP response, the models it serves, and
//! what /health and /metrics report (the per-request timings behind the metrics' histograms
//! are taken here, where the engine's events meet the wall clock).

use crate::cli::{HealthMode, NodeSpec};
use mock_gpu_node::engine::{Admission, Engine, Event, Iteration, Request, LOAD_WINDOW_MS};
use mock_gpu_node::metrics::{self, Flavour, GaugeOverrides, Loras, Observed, Recorder, Snapshot};
use mock_gpu_node::prefix;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, Notify};

/// Llama-2-7B fp16: 2 (K, V) x 32 layers x 4096 x 2 bytes.
pub const KV_BYTES_PER_TOKEN: u64 = 512 * 1024;

/// The model name listed, reported and used by default when `models=` is not given.
pub const DEFAULT_MODEL: &str = "mock-model";

/// What a request's response receives from the engine driver.
pub enum Delivery {
    /// It joined the batch (the first time); this much of its prompt was in the prefix cache.
    Admitted {
        cached_tokens: u64,
    },
    Token(u64),
    Finished,
}

/// What a request asks for, once its body is read.
pub struct Submission<'a> {
    pub prompt_ids: &'a [u64],
    pub output_tokens: u64,
    /// The served model or adapter (see `Node::resolve_model`).
    pub model: &'a Served,
    /// Whether it ends at max_tokens (finish reason "length") rather than "stop".
    pub ends_at_length: bool,
}

/// A model name a request resolved to.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    pub name: String,
    pub lora: bool,
}

/// A request in flight, for the histograms and vLLM's LoRA report. Times are model ms.
struct Track {
    model: Served,
    prompt_tokens: u64,
    ends_at_length: bool,
    arrival_ms: f64,
    first_token_ms: Option<f64>,
    last_token_ms: f64,
    tokens: u64,
}

/// Per-request observations and how requests ended.
struct Stats {
    tracks: HashMap<u64, Track>,
    recorder: Recorder,
    finished_stop: u64,
    finished_length: u64,
    aborted: u64,
}

/// Test controls set through POST /admin/health.
#[derive(Default)]
pub struct Overrides {
    /// Fields that replace what /health would report; `queue_depth`, `running_requests` and
    /// `kv_cache_usage` also replace the matching gauges of /metrics.
    pub fields: Map<String, Value>,
    pub fail: bool,
    pub hang: bool,
}

impl Overrides {
    /// The gauges /metrics reports overridden (values of the wrong type are ignored).
    pub fn gauges(&self) -> GaugeOverrides {
        let count = |k: &str| {
            self.fields
                .get(k)
                .and_then(Value::as_f64)
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v.round() as u64)
        };
        GaugeOverrides {
            waiting: count("queue_depth"),
            running: count("running_requests"),
            kv_usage: self.fields.get("kv_cache_usage").and_then(Value::as_f64),
        }
    }
}

pub struct Node {
    pub name: String,
    /// Served model names (empty: any) and adapters.
    pub models: Vec<String>,
    pub loras: Vec<String>,
    /// Completions bypass the engine and answer at once (`instant=1`).
    pub instant: bool,
    /// A streamed instant answer's token events and the pause between two (`instant_tokens=`,
    /// `instant_gap_us=`).
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
    flavour: Flavour,
    /// What /health answers (the seed JSON, or the engine's own answer).
    pub health_mode: HealthMode,
    /// The engine's metrics endpoint is off.
    pub metrics_off: bool,
    /// llama.cpp's per-slot context.
    n_ctx: u64,
    stats: Mutex<Stats>,
    engine: Mutex<Engine>,
    wake: Notify,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Delivery>>>,
    pub overrides: Mutex<Overrides>,
    capacity: Option<f64>,
    time_scale: f64,
    start: Instant,
    pub next_id: AtomicU64,
    pub requests_total: AtomicU64,
    pub health_requests_total: AtomicU64,
    /// `GET /metrics` answered with the engine's text, and the bytes of those answers.
    pub metrics_requests_total: AtomicU64,
    pub metrics_bytes_total: AtomicU64,
    /// Model time, µs, the engine lost while busy because this process ran behind the wall
    /// clock by more than `MAX_LAG` (a host too loaded to keep the time scale): the node
    /// served less than its model says in that time. Benchmarks report it.
    pub lost_model_us: AtomicU64,
    /// Model times at which requests finished, over the last window (for the ORCA report).
    finished: Mutex<VecDeque<f64>>,
    /// Responses API answers kept in this node's memory (`store`), as vLLM keeps them: a
    /// later turn naming one (`previous_response_id`) is served only here.
    stored: Mutex<Stored>,
}

/// Stored conversations: each answer's id to its token ids (the prompt it continued, the
/// stored turns included, then its output), the oldest forgotten past `MAX_STORED`.
#[derive(Default)]
struct Stored {
    ids: HashMap<String, Arc<Vec<u64>>>,
    order: VecDeque<String>,
}

/// Stored answers a node keeps at most.
const MAX_STORED: usize = 20_000;

/// Seconds since the Unix epoch (0 if the clock is before it).
fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A poisoned lock only means a panic elsewhere mid-update; the mock keeps serving.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A request inside the engine. Dropping it (response done, or the client went away and
/// hyper dropped the handler) takes the request out of the engine and frees its KV.
pub struct Ticket {
    node: Arc<Node>,
    id: u64,
}

impl Ticket {
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.node.streams).remove(&self.id);
        lock(&self.node.engine).cancel(self.id);
        // Still tracked: it never finished, the client went away.
        let mut stats = lock(&self.node.stats);
        if stats.tracks.remove(&self.id).is_some() {
            stats.aborted += 1;
        }
    }
}

impl Node {
    pub fn new(spec: &NodeSpec, time_scale: f64) -> Arc<Node> {
        Arc::new(Node {
            name: spec.name.clone(),
            models: spec.models.clone(),
            loras: spec.loras.clone(),
            instant: spec.instant,
            instant_tokens: spec.instant_tokens,
            instant_gap_us: spec.instant_gap_us,
            reasoning: spec.reasoning,
            tool_calls: spec.tool_calls,
            force_usage: spec.force_usage,
            token_scale: spec.token_scale,
            flavour: spec.metrics,
            health_mode: spec.health,
            metrics_off: spec.metrics_off,
            n_ctx: spec.n_ctx.unwrap_or(spec.config.kv_capacity_tokens),
            stats: Mutex::new(Stats {
                tracks: HashMap::new(),
                // Token-count buckets up to the longest sequence the KV cache holds.
                recorder: Recorder::new(spec.metrics, spec.config.kv_capacity_tokens),
                finished_stop: 0,
                finished_length: 0,
                aborted: 0,
            }),
            engine: Mutex::new(Engine::new(spec.config.clone())),
            wake: Notify::new(),
            streams: Mutex::new(HashMap::new()),
            overrides: Mutex::new(Overrides::default()),
            capacity: spec.capacity,
            time_scale,
            start: Instant::now(),
            next_id: AtomicU64::new(0),
            requests_total: AtomicU64::new(0),
            health_requests_total: AtomicU64::new(0),
            metrics_requests_total: AtomicU64::new(0),
            metrics_bytes_total: AtomicU64::new(0),
            lost_model_us: AtomicU64::new(0),
            finished: Mutex::new(VecDeque::new()),
            stored: Mutex::new(Stored::default()),
        })
    }

    /// Keeps the conversation `tokens` under the answer's `id`.
    pub fn store(&self, id: String, tokens: Vec<u64>) {
        let mut s = lock(&self.stored);
        if s.ids.insert(id.clone(), Arc::new(tokens)).is_none() {
            s.order.push_back(id);
        }
        while s.order.len() > MAX_STORED {
            if let Some(old) = s.order.pop_front() {
                s.ids.remove(&old);
            }
        }
    }

    /// The conversation stored under `id`, if this node keeps it.
    pub fn stored(&self, id: &str) -> Option<Arc<Vec<u64>>> {
        lock(&self.stored).ids.get(id).cloned()
    }

    /// Model time as the wall clock sees it.
    fn wall_model_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0 * self.time_scale
    }

    /// Model ms to wall seconds.
    fn wall_secs(&self, model_ms: f64) -> f64 {
        model_ms / 1000.0 / self.time_scale
    }

    /// Whether the node imitates its engine (`health=engine`) rather than token-balancer's
    /// simple node.
    pub fn honest(&self) -> bool {
        self.health_mode == HealthMode::Engine
    }

    /// The engine imitated, honestly (see `honest`).
    pub fn flavour(&self) -> Flavour {
        self.flavour
    }

    /// Whether the node serves a request whatever model it names: SGLang, TGI, trtllm-serve and
    /// llama.cpp serve their one model under any name (only vLLM answers 404
    /// `model_not_found`). The simple node serves any name unless `models=` is given.
    fn serves_any_name(&self) -> bool {
        if self.honest() {
            !matches!(self.flavour, Flavour::Vllm | Flavour::VllmV0)
        } else {
            self.models.is_empty()
        }
    }

    /// The model a request names: `None` (no `model` field) is the first served one; an
    /// adapter is served by name; any other name is served when the node serves any name
    /// (see `serves_any_name`). llama.cpp answers with its own name, whatever was asked.
    pub fn resolve_model(&self, requested: Option<&str>) -> Result<Served, String> {
        let served = |name: &str, lora| Served {
            name: name.to_string(),
            lora,
        };
        match requested {
            None => Ok(served(self.first_model(), false)),
            Some(m) if self.loras.iter().any(|l| l == m) => Ok(served(m, true)),
            Some(m) if self.models.iter().any(|x| x == m) => Ok(served(m, false)),
            Some(_) if self.honest() && self.flavour == Flavour::Llamacpp => {
                Ok(served(&self.llamacpp_id(), false))
            }
            Some(m) if self.serves_any_name() => Ok(served(m, false)),
            Some(m) if self.models.is_empty() && m == DEFAULT_MODEL => Ok(served(m, false)),
            Some(m) => Err(format!("The model `{m}` does not exist.")),
        }
    }

    pub fn first_model(&self) -> &str {
        self.models.first().map_or(DEFAULT_MODEL, String::as_str)
    }

    /// llama.cpp's model id: the first of its aliases in sorted order (it keeps them in a
    /// set), else the `--model` path as given.
    fn llamacpp_id(&self) -> String {
        self.models
            .iter()
            .min()
            .cloned()
            .unwrap_or_else(|| format!("/models/{DEFAULT_MODEL}.Q4_1.gguf"))
    }

    /// The per-slot context a llama.cpp node enforces: a longer prompt is refused.
    pub fn n_ctx(&self) -> Option<u64> {
        (self.honest() && self.flavour == Flavour::Llamacpp).then_some(self.n_ctx)
    }

    /// The /v1/models list: the base models, then the adapters (with their base as parent,
    /// as vLLM lists them). llama.cpp lists its one model (see `llamacpp_id`) with its
    /// aliases and `meta.n_ctx`, the per-slot context.
    pub fn model_list(&self) -> Value {
        if self.honest() && self.flavour == Flavour::Llamacpp {
            let id = self.llamacpp_id();
            let mut aliases: Vec<&str> = self.models.iter().map(String::as_str).collect();
            aliases.sort_unstable();
            if aliases.is_empty() {
                aliases.push(&id);
            }
            return json!({
                "models": [{"name": id, "model": id, "modified_at": "", "size": "",
                            "digest": "", "type": "model", "description": "", "tags": [""],
                            "capabilities": ["completion"], "parameters": "",
                            "details": {"parent_model": "", "format": "gguf", "family": "",
                                        "families": [""], "parameter_size": "",
                                        "quantization_level": ""}}],
                "object": "list",
                "data": [{"id": id, "aliases": aliases, "tags": [], "object": "model",
                          "created": unix_secs(), "owned_by": "llamacpp",
                          "meta": {"vocab_type": 2, "n_vocab": 49152,
                                   "n_ctx_train": 8192, "n_embd": 576,
                                   "n_params": 134515008, "size": 97632512,
                                   "n_ctx": self.n_ctx}}]
            });
        }
        let base: Vec<&str> = if self.models.is_empty() {
            vec![DEFAULT_MODEL]
        } else {
            self.models.iter().map(String::as_str).collect()
        };
        let mut data: Vec<Value> = base
            .iter()
            .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "mock"}))
            .collect();
        data.extend(self.loras.iter().map(|l| {
            json!({"id": l, "object": "model", "created": 0, "owned_by": "mock",
                   "parent": self.first_model()})
        }));
        json!({"object": "list", "data": data})
    }

    /// Drives the engine: one iteration, wait until its (scaled) end, deliver its events.
    ///
    /// The model clock advances by iteration durations and each wait is until an absolute
    /// deadline, so the timer's millisecond granularity delays single iterations but does not
    /// accumulate: a busy node runs `time_scale` times faster than real time. After idling the
    /// clock jumps to the wall clock; if the process falls far behind (a stall), it catches up
    /// to within `MAX_LAG` so that the backlog is not delivered in one long burst.
    pub async fn drive(self: Arc<Self>) {
        const MAX_LAG: Duration = Duration::from_millis(20);
        let max_lag_ms = MAX_LAG.as_secs_f64() * 1000.0 * self.time_scale;
        let mut clock_ms = self.wall_model_ms();
        loop {
            // Only ever behind here after a busy iteration: after idling the clock was set to
            // the wall clock.
            let behind = self.wall_model_ms() - max_lag_ms;
            if behind > clock_ms {
                let lost = ((behind - clock_ms) * 1000.0) as u64;
                self.lost_model_us.fetch_add(lost, Ordering::Relaxed);
            }
            let now = clock_ms.max(behind);
            let step = lock(&self.engine).step(now);
            let start_ms = now;
            let Some(it) = step else {
                self.wake.notified().await;
                clock_ms = clock_ms.max(self.wall_model_ms());
                continue;
            };
            clock_ms = now + it.duration_ms;
            let deadline = Duration::try_from_secs_f64(clock_ms / 1000.0 / self.time_scale)
                .ok()
                .and_then(|d| self.start.checked_add(d));
            let Some(deadline) = deadline else {
                eprintln!(
                    "mock-gpu-node: {}: model clock overflow, stopping",
                    self.name
                );
                return;
            };
            // tokio's timer fires on millisecond ticks even for a deadline already past, so
            // when behind, go on at once (yielding): that is what makes lateness not add up.
            if deadline > Instant::now() {
                tokio::time::sleep_until(deadline.into()).await;
            } else {
                tokio::task::yield_now().await;
            }
            self.deliver(start_ms, &it);
        }
    }

    /// Hands an iteration's events to the responses, after noting them in the statistics
    /// (first, so that a response that ends on its Finished finds its request already
    /// counted as finished, not aborted).
    fn deliver(&self, start_ms: f64, it: &Iteration) {
        let events = &it.events;
        let now = self.wall_model_ms();
        self.observe(start_ms, now, it);
        let mut gone = vec![];
        {
            let mut finished = lock(&self.finished);
            prune(&mut finished, now);
            finished.extend(
                events
                    .iter()
                    .filter(|ev| matches!(ev, Event::Finished { .. }))
                    .map(|_| now),
            );
        }
        {
            let streams = lock(&self.streams);
            for a in it.admitted.iter().filter(|a| a.first) {
                if let Some(tx) = streams.get(&a.id) {
                    let _ = tx.send(Delivery::Admitted {
                        cached_tokens: a.cached_tokens,
                    });
                }
            }
            for ev in events {
                let (id, d) = match *ev {
                    Event::Token { id, index } => (id, Delivery::Token(index)),
                    Event::Finished { id } => (id, Delivery::Finished),
                    // The response simply stalls until the sequence is recomputed.
                    Event::Preempted { .. } => continue,
                };
                match streams.get(&id) {
                    Some(tx) if tx.send(d).is_ok() => {}
                    _ => gone.push(id),
                }
            }
        }
        // Nobody listens (normally the Ticket already did this): stop computing for them.
        if !gone.is_empty() {
            let mut e = lock(&self.engine);
            for id in gone {
                e.cancel(id);
            }
        }
    }

    /// Queue times, time to first token, inter-token times, and the whole request's figures
    /// when it finishes. `start_ms` is when the iteration began (when its admissions
    /// happened), `now_ms` when its events reach the responses.
    fn observe(&self, start_ms: f64, now_ms: f64, it: &Iteration) {
        let mut guard = lock(&self.stats);
        let stats = &mut *guard;
        for Admission { id, first, .. } in &it.admitted {
            if let (true, Some(t)) = (*first, stats.tracks.get(id)) {
                let queued = self.wall_secs((start_ms - t.arrival_ms).max(0.0));
                stats.recorder.observe(Observed::Queue, queued);
            }
        }
        for ev in &it.events {
            match *ev {
                Event::Token { id, .. } => {
                    let Some(t) = stats.tracks.get_mut(&id) else {
                        continue;
                    };
                    let (o, since) = match t.first_token_ms {
                        None => {
                            t.first_token_ms = Some(now_ms);
                            (Observed::Ttft, t.arrival_ms)
                        }
                        Some(_) => (Observed::InterToken, t.last_token_ms),
                    };
                    stats
                        .recorder
                        .observe(o, self.wall_secs((now_ms - since).max(0.0)));
                    t.last_token_ms = now_ms;
                    t.tokens += 1;
                }
                Event::Finished { id } => {
                    let Some(t) = stats.tracks.remove(&id) else {
                        continue;
                    };
                    let r = &mut stats.recorder;
                    r.observe(
                        Observed::E2e,
                        self.wall_secs((now_ms - t.arrival_ms).max(0.0)),
                    );
                    r.observe(Observed::PromptTokens, t.prompt_tokens as f64);
                    r.observe(Observed::GenerationTokens, t.tokens as f64);
                    if let (Some(first), true) = (t.first_token_ms, t.tokens > 1) {
                        let per_token = (now_ms - first).max(0.0) / (t.tokens - 1) as f64;
                        r.observe(Observed::TimePerOutputToken, self.wall_secs(per_token));
                    }
                    if t.ends_at_length {
                        stats.finished_length += 1;
                    } else {
                        stats.finished_stop += 1;
                    }
                }
                Event::Preempted { .. } => {}
            }
        }
    }

    /// Queues a request; its admission and tokens arrive on the receiver as the engine
    /// produces them. Also returns the prompt tokens the prefix cache holds for it right now.
    pub fn submit(
        self: &Arc<Self>,
        s: Submission,
    ) -> (Ticket, mpsc::UnboundedReceiver<Delivery>, u64) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_tokens = s.prompt_ids.len() as u64;
        lock(&self.streams).insert(id, tx);
        lock(&self.stats).tracks.insert(
            id,
            Track {
                model: s.model.clone(),
                prompt_tokens,
                ends_at_length: s.ends_at_length,
                arrival_ms: self.wall_model_ms(),
                first_token_ms: None,
                last_token_ms: 0.0,
                tokens: 0,
            },
        );
        let peek = {
            let mut e = lock(&self.engine);
            // The model or adapter seeds the hash chain: they never share KV.
            let hashes =
                prefix::block_hashes(&s.model.name, s.prompt_ids, e.config.prefix_block_tokens);
            let peek = e.peek_hit_tokens(&hashes, prompt_tokens);
            e.submit_request(Request {
                id,
                prompt_tokens,
                output_tokens: s.output_tokens,
                block_hashes: hashes,
            });
            peek
        };
        self.wake.notify_one();
        let ticket = Ticket {
            node: self.clone(),
            id,
        };
        (ticket, rx, peek)
    }

    /// Prefix-cache figures for /admin/stats (tokens, as vLLM counts them, and blocks).
    pub fn prefix_stats(&self) -> Value {
        let e = lock(&self.engine);
        json!({
            "prefix_cache_queries": e.prefix_queries_tokens_total,
            "prefix_cache_hits": e.prefix_hits_tokens_total,
            "prefix_cache_blocks": e.prefix_cached_blocks(),
            "prefix_cache_evictable_blocks": e.prefix_evictable_blocks(),
            "prefix_cache_capacity_blocks": e.prefix_capacity_blocks(),
            "prefix_block_tokens": e.config.prefix_block_tokens,
            "prompt_tokens_computed": e.prompt_tokens_total,
        })
    }

    /// The seed health report (rates per wall second), with the test overrides applied.
    pub fn health(&self) -> Value {
        let now = self.wall_model_ms();
        let mut e = lock(&self.engine);
        let kv_total = e.config.kv_capacity_tokens;
        let used = e.kv_used_tokens();
        let capacity = self
            .capacity
            .unwrap_or(e.capacity_tokens_per_sec() * self.time_scale);
        let mut v = json!({
            "name": self.name,
            "tokens_per_sec_load": e.load_tokens_per_sec(now) * self.time_scale,
            "tokens_per_sec_capacity": capacity,
            "vram_used_bytes": used.saturating_mul(KV_BYTES_PER_TOKEN),
            "vram_total_bytes": kv_total.saturating_mul(KV_BYTES_PER_TOKEN),
            "kv_cache_usage": e.kv_cache_usage(),
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
    pub fn orca(&self) -> String {
        let now = self.wall_model_ms();
        let rps = {
            let mut f = lock(&self.finished);
            prune(&mut f, now);
            f.len() as f64 * 1000.0 / LOAD_WINDOW_MS * self.time_scale
        };
        let mut e = lock(&self.engine);
        let kv = e.kv_cache_usage();
        let busy = e.load_tokens_per_sec(now) / e.capacity_tokens_per_sec().max(1.0);
        let util = kv.max(busy) + e.waiting() as f64 / e.config.max_running.max(1) as f64;
        format!(
            "TEXT application_utilization={util:.4}, cpu_utilization={util:.4}, \
             rps_fractional={rps:.3}, named_metrics.kv_cache_usage={kv:.4}, \
             named_metrics.num_requests_waiting={}",
            e.waiting()
        )
    }

    /// GET /metrics in the node's flavour (`metrics.rs`), from the engine's state now.
    pub fn metrics(&self) -> String {
        let now = self.wall_model_ms();
        let mut e = lock(&self.engine);
        let c = &e.config;
        let (kv_capacity_tokens, block_tokens) = (c.kv_capacity_tokens, c.prefix_block_tokens);
        let max_running = c.max_running as u64;
        let gen_throughput = e.generation_tokens_per_sec(now) * self.time_scale;
        let running_ids: Vec<u64> = e.running_ids().collect();
        let waiting_ids: Vec<u64> = e.waiting_ids().collect();
        let mut snap = Snapshot {
            model: self.first_model(),
            running: running_ids.len() as u64,
            waiting: waiting_ids.len() as u64,
            max_running,
            kv_used_tokens: e.kv_used_tokens(),
            kv_capacity_tokens,
            kv_usage: e.kv_cache_usage(),
            block_tokens,
            prefix_caching: e.prefix_capacity_blocks() > 0,
            prompt_tokens_total: e.prompt_tokens_total,
            prompt_tokens_whole_total: e.prompt_tokens_whole_total,
            generation_tokens_total: e.generation_tokens_total,
            prefix_queries_tokens_total: e.prefix_queries_tokens_total,
            prefix_hits_tokens_total: e.prefix_hits_tokens_total,
            prefix_queries_blocks_total: e.prefix_queries_blocks_total,
            prefix_hits_blocks_total: e.prefix_hits_blocks_total,
            preemptions_total: e.vram_overflow_events,
            requests_total: self.requests_total.load(Ordering::Relaxed),
            running_max_tokens: e.running_max_tokens(),
            gen_throughput,
            prefill_seconds_total: self.wall_secs(e.prefill_ms_total),
            decode_seconds_total: self.wall_secs(e.decode_ms_total),
            iterations_total: e.iterations_total,
            batch_slots_total: e.batch_slots_total,
            unix_time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            ..Snapshot::default()
        };
        drop(e);
        snap.apply(lock(&self.overrides).gauges());
        let stats = lock(&self.stats);
        snap.finished_stop_total = stats.finished_stop;
        snap.finished_length_total = stats.finished_length;
        snap.aborted_total = stats.aborted;
        if !self.loras.is_empty() {
            // Each adapter once, in batch (or queue) order.
            let adapters = |ids: &[u64]| {
                let mut out: Vec<String> = vec![];
                for t in ids.iter().filter_map(|id| stats.tracks.get(id)) {
                    if t.model.lora && !out.contains(&t.model.name) {
                        out.push(t.model.name.clone());
                    }
                }
                out
            };
            snap.loras = Some(Loras {
                max_lora: self.loras.len(),
                running: adapters(&running_ids),
                waiting: adapters(&waiting_ids),
            });
        }
        snap.histograms = Some(&stats.recorder);
        metrics::render(self.flavour, &snap)
    }
}

/// Drops the finish times that left the window.
fn prune(finished: &mut VecDeque<f64>, now_ms: f64) {
    while matches!(finished.front(), Some(t) if *t <= now_ms - LOAD_WINDOW_MS) {
        finished.pop_front();
    }
}
