//! One served node: its engine, the task that drives the engine in (scaled) real time, the
//! channels that carry each request's tokens to its HTTP response, and what /health and
//! /metrics report.

use crate::cli::NodeSpec;
use mock_gpu_node::engine::{Engine, Event, LOAD_WINDOW_MS};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// Llama-2-7B fp16: 2 (K, V) x 32 layers x 4096 x 2 bytes.
pub const KV_BYTES_PER_TOKEN: u64 = 512 * 1024;

/// What a request's response receives from the engine driver.
pub enum Delivery {
    Token(u64),
    Finished,
}

/// Test controls set through POST /admin/health.
#[derive(Default)]
pub struct Overrides {
    /// Fields that replace what /health would report.
    pub fields: Map<String, Value>,
    pub fail: bool,
    pub hang: bool,
}

pub struct Node {
    pub name: String,
    engine: Mutex<Engine>,
    wake: Notify,
    streams: Mutex<HashMap<u64, mpsc::UnboundedSender<Delivery>>>,
    pub overrides: Mutex<Overrides>,
    capacity: Option<f64>,
    time_scale: f64,
    start: Instant,
    next_id: AtomicU64,
    pub requests_total: AtomicU64,
    pub health_requests_total: AtomicU64,
    /// Model times at which requests finished, over the last window (for the ORCA report).
    finished: Mutex<VecDeque<f64>>,
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
    }
}

impl Node {
    pub fn new(spec: &NodeSpec, time_scale: f64) -> Arc<Node> {
        Arc::new(Node {
            name: spec.name.clone(),
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
            finished: Mutex::new(VecDeque::new()),
        })
    }

    /// Model time as the wall clock sees it.
    fn wall_model_ms(&self) -> f64 {
        self.start.elapsed().as_secs_f64() * 1000.0 * self.time_scale
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
        let mut clock_ms = 0.0_f64;
        loop {
            let now = clock_ms.max(self.wall_model_ms() - max_lag_ms);
            let step = lock(&self.engine).step(now);
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
            self.deliver(&it.events);
        }
    }

    fn deliver(&self, events: &[Event]) {
        let now = self.wall_model_ms();
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

    /// Queues a request; its tokens arrive on the receiver as the engine produces them.
    pub fn submit(
        self: &Arc<Self>,
        prompt_tokens: u64,
        output_tokens: u64,
    ) -> (Ticket, mpsc::UnboundedReceiver<Delivery>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.streams).insert(id, tx);
        lock(&self.engine).submit(id, prompt_tokens, output_tokens);
        self.wake.notify_one();
        let ticket = Ticket {
            node: self.clone(),
            id,
        };
        (ticket, rx)
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

    /// Prometheus text exposition with vLLM's metric names.
    pub fn metrics(&self) -> String {
        let e = lock(&self.engine);
        let labels = format!(
            "{{model_name=\"mock-model\",node=\"{}\"}}",
            escape_label(&self.name)
        );
        let rows: [(&str, &str, &str, String); 6] = [
            (
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                e.running().to_string(),
            ),
            (
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                e.waiting().to_string(),
            ),
            (
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                e.kv_cache_usage().to_string(),
            ),
            (
                "vllm:prompt_tokens_total",
                "counter",
                "Number of prefill tokens processed.",
                e.prompt_tokens_total.to_string(),
            ),
            (
                "vllm:generation_tokens_total",
                "counter",
                "Number of generation tokens processed.",
                e.generation_tokens_total.to_string(),
            ),
            (
                "mock:vram_overflow_events_total",
                "counter",
                "Sequences preempted because the KV cache overflowed.",
                e.vram_overflow_events.to_string(),
            ),
        ];
        drop(e);
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
            ));
        }
        out
    }
}

/// Drops the finish times that left the window.
fn prune(finished: &mut VecDeque<f64>, now_ms: f64) {
    while matches!(finished.front(), Some(t) if *t <= now_ms - LOAD_WINDOW_MS) {
        finished.pop_front();
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
