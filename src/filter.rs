//! The proxy-wasm glue: moves bytes between Envoy and the pure core, and nothing else.
//!
//! Root context (one per VM, i.e. per Envoy worker): reads the plugin configuration, polls every
//! node's health endpoint on the tick timer with HTTP callouts, and owns the `Balancer`.
//! HTTP context (one per request): strips any client-supplied routing header, pauses the
//! headers, reads the body up to the limit, asks the balancer, writes the routing header and
//! lets the request go; when the stream ends it releases the request's in-flight booking.
//!
//! Every path that cannot decide continues the request untouched, so Envoy's own fallback
//! balancer routes it (fail-open). Host calls go through `proxy_wasm::hostcalls`, which return
//! errors instead of panicking like the SDK's convenience trait methods do; an error from Envoy
//! degrades to the fail-open path, since a panic would trap the VM and fail the traffic.

use crate::balancer::{Balancer, HealthError, Outcome};
use crate::config::Config;
use crate::node::Ticket;
use crate::rng::SplitMix64;
use crate::usage;
use crate::weight::{self, Api, Weight};
use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

/// Largest health answer read; a larger one is a broken node, not telemetry. Engines' Prometheus
/// text is far larger than the seed JSON: one vLLM engine's `/metrics` is about 35 KB with its
/// histograms, and a data-parallel vLLM repeats every series per engine (8 engines, ~300 KB).
/// Parsing costs about 4 ms per MiB under V8 (the parser reads ~250 MB/s as Wasm).
const MAX_HEALTH_BODY: usize = 1024 * 1024;
/// Delay before the first poll, so a freshly started Envoy has data within a fraction of a
/// second instead of a whole tick.
const FIRST_POLL: Duration = Duration::from_millis(50);

pub fn start() {
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Envoy counters (they appear under `wasmcustom.` in Envoy's stats).
#[derive(Default)]
struct Metrics {
    routed: u32,
    routed_over_vram_ceiling: u32,
    fallback_no_fresh_nodes: u32,
    fallback_no_body: u32,
    fallback_body_unusable: u32,
    fallback_body_over_limit: u32,
    fallback_encoded_body: u32,
    fallback_internal: u32,
    client_routing_header_removed: u32,
    health_ok: u32,
    health_failed: u32,
    health_unparsable: u32,
    node_picks: Vec<u32>,
    node_health_failures: Vec<u32>,
}

fn counter(name: &str) -> u32 {
    // 0 is never a valid metric id; incrementing it fails harmlessly.
    hostcalls::define_metric(MetricType::Counter, name).unwrap_or(0)
}

fn bump(id: u32) {
    if id != 0 {
        let _ = hostcalls::increment_metric(id, 1);
    }
}

impl Metrics {
    fn define(cfg: &Config) -> Metrics {
        let p = "token_balancer";
        let node = |addr: &str, what: &str| {
            let safe: String = addr
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            counter(&format!("{p}.node.{safe}.{what}"))
        };
        Metrics {
            routed: counter(&format!("{p}.routed")),
            routed_over_vram_ceiling: counter(&format!("{p}.routed_over_vram_ceiling")),
            fallback_no_fresh_nodes: counter(&format!("{p}.fallback.no_fresh_nodes")),
            fallback_no_body: counter(&format!("{p}.fallback.no_body")),
            fallback_body_unusable: counter(&format!("{p}.fallback.body_unusable")),
            fallback_body_over_limit: counter(&format!("{p}.fallback.body_over_limit")),
            fallback_encoded_body: counter(&format!("{p}.fallback.encoded_body")),
            fallback_internal: counter(&format!("{p}.fallback.internal")),
            client_routing_header_removed: counter(&format!("{p}.client_routing_header_removed")),
            health_ok: counter(&format!("{p}.health.ok")),
            health_failed: counter(&format!("{p}.health.failed")),
            health_unparsable: counter(&format!("{p}.health.unparsable")),
            node_picks: cfg
                .nodes
                .iter()
                .map(|n| node(&n.address, "picks"))
                .collect(),
            node_health_failures: cfg
                .nodes
                .iter()
                .map(|n| node(&n.address, "health_failures"))
                .collect(),
        }
    }
}

/// What the root context and its requests share (one VM is single-threaded).
struct State {
    /// Shared with the requests by reference count: no per-request copies of its strings.
    config: Rc<Config>,
    balancer: Balancer,
    rng: SplitMix64,
    metrics: Metrics,
}

type Shared = Rc<RefCell<Option<State>>>;

#[derive(Default)]
struct Root {
    state: Shared,
    /// Outstanding health callouts: token -> node index.
    pending: HashMap<u32, usize>,
    first_tick_done: bool,
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(node) = self.pending.remove(&token) else {
            return;
        };
        // A timed-out or reset callout has no :status.
        let ok = matches!(
            hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status"),
            Ok(Some(s)) if s == "200"
        );
        let body = if ok && body_size <= MAX_HEALTH_BODY {
            hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .map(|b| b.unwrap_or_default())
        } else {
            None
        };
        let Ok(mut guard) = self.state.try_borrow_mut() else {
            return;
        };
        let Some(s) = guard.as_mut() else { return };
        let result = s.balancer.on_health(node, body.as_deref(), now_ms());
        let address = s
            .config
            .nodes
            .get(node)
            .map(|n| n.address.as_str())
            .unwrap_or("?");
        if ok && body_size > MAX_HEALTH_BODY {
            debug!("health answer from {address} not read: {body_size} bytes, over the {MAX_HEALTH_BODY} limit");
        }
        match result {
            Ok(_) => bump(s.metrics.health_ok),
            Err(e) => {
                bump(
                    s.metrics
                        .node_health_failures
                        .get(node)
                        .copied()
                        .unwrap_or(0),
                );
                match e {
                    HealthError::Unparsable(why) => {
                        bump(s.metrics.health_unparsable);
                        debug!("health answer from {address} not used: {why}");
                    }
                    HealthError::CallFailed | HealthError::UnknownNode => {
                        bump(s.metrics.health_failed);
                        debug!("health call to {address} failed");
                    }
                }
            }
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                // One line, naming the field: Envoy then refuses the plugin.
                error!("{e}");
                return false;
            }
        };
        // Each worker's VM gets its own sequence: time and this context's address differ.
        let seed = now_ms() ^ ((self as *const Root as u64) << 20);
        let state = State {
            balancer: Balancer::new(&config),
            rng: SplitMix64::new(seed),
            metrics: Metrics::define(&config),
            config: Rc::new(config),
        };
        info!(
            "token-balancer configured: {} nodes, health via cluster {:?} every {} ms",
            state.config.nodes.len(),
            state.config.health_cluster,
            state.config.tick_ms
        );
        if let Ok(mut guard) = self.state.try_borrow_mut() {
            *guard = Some(state);
        }
        self.pending.clear();
        self.first_tick_done = false;
        let _ = hostcalls::set_tick_period(FIRST_POLL);
        true
    }

    fn on_tick(&mut self) {
        let Ok(guard) = self.state.try_borrow() else {
            return;
        };
        let Some(s) = guard.as_ref() else { return };
        if !self.first_tick_done {
            self.first_tick_done = true;
            let _ = hostcalls::set_tick_period(Duration::from_millis(s.config.tick_ms));
        }
        let timeout = Duration::from_millis(s.config.health_timeout_ms);
        for (i, node) in s.config.nodes.iter().enumerate() {
            // A node whose last poll is still outstanding is not polled again: slow nodes must
            // not pile up callouts.
            if self.pending.values().any(|&n| n == i) {
                continue;
            }
            let target = node.health_target();
            let headers = vec![
                (":method", "GET"),
                (":path", node.health_path.as_str()),
                (":authority", target),
                (":scheme", "http"),
                (s.config.health_target_header.as_str(), target),
                ("user-agent", "token-balancer"),
            ];
            match hostcalls::dispatch_http_call(
                &s.config.health_cluster,
                headers,
                None,
                vec![],
                timeout,
            ) {
                Ok(token) => {
                    self.pending.insert(token, i);
                }
                Err(e) => {
                    bump(s.metrics.health_failed);
                    warn!(
                        "health call to {target} via cluster {:?} could not start: {e:?}",
                        s.config.health_cluster
                    );
                }
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            state: self.state.clone(),
            api: Api::Other,
            ticket: None,
            debug: None,
            decided: false,
            received: 0,
            reported_output: None,
            status_ok: false,
            completed: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    state: Shared,
    api: Api,
    ticket: Option<Ticket>,
    /// Value of the debug response header, when that header is configured.
    debug: Option<String>,
    /// The routing decision is made (or given up); later body chunks pass straight through.
    decided: bool,
    /// Output observed in the response so far: content events, and the count the server
    /// reported, if it did.
    received: u64,
    reported_output: Option<u64>,
    /// The response was a 200 and its body reached its end: a complete sample of output length.
    status_ok: bool,
    completed: bool,
}

impl Request {
    /// The configuration; `None` when the plugin has none.
    fn config(&self) -> Option<Rc<Config>> {
        let guard = self.state.try_borrow().ok()?;
        guard.as_ref().map(|s| s.config.clone())
    }

    /// Runs `f` on the shared state; `None` when the plugin has no configuration.
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        let mut guard = self.state.try_borrow_mut().ok()?;
        guard.as_mut().map(f)
    }

    fn fallback(&mut self, why: &str, metric: impl Fn(&Metrics) -> u32) -> Action {
        self.decided = true;
        let debug_on = self
            .with(|s| {
                bump(metric(&s.metrics));
                s.config.debug_header.is_some()
            })
            .unwrap_or(false);
        if debug_on {
            self.debug = Some(format!("fallback={why}"));
        }
        Action::Continue
    }

    fn route(&mut self, weight: Weight) -> Action {
        self.decided = true;
        let routed = self.with(|s| {
            let outcome = s.balancer.route(weight, now_ms(), &mut s.rng);
            if let Outcome::Routed {
                ticket,
                over_ceiling,
                ..
            } = &outcome
            {
                bump(s.metrics.routed);
                bump(s.metrics.node_picks.get(ticket.node).copied().unwrap_or(0));
                if *over_ceiling {
                    bump(s.metrics.routed_over_vram_ceiling);
                }
            }
            (outcome, s.config.clone())
        });
        match routed {
            Some((
                Outcome::Routed {
                    ticket,
                    header_value,
                    predicted_seconds,
                    inflight_before,
                    ..
                },
                config,
            )) => {
                if hostcalls::set_map_value(
                    MapType::HttpRequestHeaders,
                    &config.routing_header,
                    Some(&header_value),
                )
                .is_err()
                {
                    // Without the header Envoy balances on its own; undo the booking.
                    self.with(|s| {
                        s.balancer.release(&ticket, 0);
                        bump(s.metrics.fallback_internal);
                    });
                    return Action::Continue;
                }
                self.ticket = Some(ticket);
                if config.debug_header.is_some() {
                    self.debug = Some(format!(
                        "node={header_value}; prompt_tokens={}; output_tokens={}; output_cap={}; predicted_ms={:.1}; inflight={inflight_before}",
                        ticket.weight.prompt_tokens,
                        ticket.weight.output_tokens,
                        weight.output_tokens,
                        predicted_seconds * 1000.0
                    ));
                }
                Action::Continue
            }
            Some((Outcome::NoFreshNodes, ..)) => {
                self.fallback("no_fresh_nodes", |m| m.fallback_no_fresh_nodes)
            }
            None => Action::Continue,
        }
    }

    fn release(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let output = self.reported_output.unwrap_or(self.received);
            let sample = self.status_ok && self.completed && output > 0;
            // The books are released by the count they were advanced by, so they balance
            // exactly; the server's own count, when it gave one, is the better sample.
            let progressed = self.received;
            self.with(|s| {
                if sample {
                    s.balancer.observe_output(output);
                }
                s.balancer.release(&ticket, progressed);
            });
        }
    }
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let Some(config) = self.config() else {
            return Action::Continue;
        };
        let routing_header = config.routing_header.as_str();
        // Clients never pick their node: whatever they sent is dropped before anything else.
        if let Ok(Some(_)) = hostcalls::get_map_value(MapType::HttpRequestHeaders, routing_header) {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, routing_header);
            self.with(|s| bump(s.metrics.client_routing_header_removed));
        }
        if let Some(h) = &config.debug_header {
            let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, h);
        }
        if end_of_stream {
            return self.fallback("no_body", |m| m.fallback_no_body);
        }
        // A compressed body cannot be read without inflating it; leave it to the fallback.
        if let Ok(Some(enc)) =
            hostcalls::get_map_value(MapType::HttpRequestHeaders, "content-encoding")
        {
            if !enc.eq_ignore_ascii_case("identity") {
                return self.fallback("encoded_body", |m| m.fallback_encoded_body);
            }
        }
        let path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path")
            .ok()
            .flatten()
            .unwrap_or_default();
        self.api = Api::from_path(&path);
        // Needs `allow_on_headers_stop_iteration: true` in the Wasm filter config, or Envoy
        // stops all iteration and the body never comes (see README).
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let Some((limit, default_max_tokens)) =
            self.with(|s| (s.config.max_body_bytes, s.config.default_max_tokens))
        else {
            return Action::Continue;
        };
        if body_size > limit {
            // Not buffered past the limit: the body streams on untouched.
            return self.fallback("body_over_limit", |m| m.fallback_body_over_limit);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        match weight::estimate(self.api, &body, default_max_tokens) {
            Some(w) => self.route(w),
            None => self.fallback("body_unusable", |m| m.fallback_body_unusable),
        }
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.status_ok = matches!(
            hostcalls::get_map_value(MapType::HttpResponseHeaders, ":status"),
            Ok(Some(s)) if s == "200"
        );
        if let Some(value) = &self.debug {
            if let Some(name) = self.config().and_then(|c| c.debug_header.clone()) {
                let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, &name, Some(value));
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // Only requests this filter routed feed the books; the chunk is read, never held.
        if let Some(ticket) = self.ticket {
            if self.status_ok && body_size > 0 {
                if let Ok(Some(chunk)) =
                    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                {
                    let before = self.received;
                    self.received = before.saturating_add(usage::output_events(&chunk));
                    if let Some(n) = usage::reported_output_tokens(&chunk) {
                        self.reported_output = Some(n);
                    }
                    if self.received > before {
                        self.with(|s| s.balancer.progress(&ticket, before, self.received));
                    }
                }
            }
            self.completed |= end_of_stream;
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}

impl Drop for Request {
    /// Belt and braces: a context destroyed without `on_log` still releases its booking.
    fn drop(&mut self) {
        self.release();
    }
}
