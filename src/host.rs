//! What the filter asks of Envoy, as one narrow trait (`Host`), and its proxy-wasm
//! implementation (`Envoy`).
//!
//! Every context of the filter is generic over `Host`, so the whole glue runs against a fake
//! host in the unit tests (native builds have no proxy-wasm host functions to call), while the
//! shipped filter is monomorphised over `Envoy`, a zero-sized type: the calls compile to the
//! same host calls as if the contexts named them directly, with no dispatch in between.
//!
//! `Envoy` goes through `proxy_wasm::hostcalls`, which return errors instead of panicking
//! like the SDK's convenience trait methods do; each method says what an error becomes, and
//! every caller degrades to the fail-open path (the request continues untouched and Envoy's
//! own balancer routes it), since a panic would trap the VM and fail the traffic.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};
use token_balancer_core::share::{SetError, Store, StoreFailed};

/// The host calls the filter makes. Header and body calls act on the effective context: the
/// stream whose callback is running, or the one `set_effective_context` named.
pub trait Host: Store + Clone + 'static {
    /// Wall-clock time, ms since the epoch; 0 if the host cannot say.
    fn now_ms(&self) -> u64;

    /// A request header's value; `None` when absent or unreadable.
    fn request_header(&self, name: &str) -> Option<String>;
    /// Sets a request header (replacing any value).
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Status>;
    /// Removes a request header; a failure leaves it (nothing to do about it).
    fn remove_request_header(&self, name: &str);
    /// A response header's value; `None` when absent or unreadable.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Sets a response header; a failure leaves the response without it.
    fn set_response_header(&self, name: &str, value: &str);
    /// The downstream address of the effective stream (`ip:port`, Envoy's `source.address`);
    /// `None` when Envoy cannot say.
    fn source_address(&self) -> Option<String>;
    /// The address of the upstream host the effective stream's response came from (`ip:port`,
    /// Envoy's `upstream.address`): the routing header's first node, or a later one its retries
    /// went to; `None` when Envoy cannot say.
    fn upstream_address(&self) -> Option<String>;
    /// Sets `key` in the stream's filter state, where Envoy's access log reads it as
    /// `%FILTER_STATE(wasm.<key>:PLAIN)%`; a failure leaves it unset.
    fn set_filter_state(&self, key: &str, value: &str);

    /// The first `size` bytes of the request body buffered so far; `None` when there is none
    /// or it cannot be read.
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// The response body chunk of `size` bytes; `None` when there is none or it cannot be read.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Answers the request with a local reply.
    fn send_response(
        &self,
        status: u32,
        headers: Vec<(&str, &str)>,
        body: &[u8],
    ) -> Result<(), Status>;
    /// Makes the stream `context_id` the effective context (a held request, from a callback
    /// of another context).
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status>;
    /// Lets the effective context's paused request go on.
    fn resume_request(&self);

    /// Registers this VM's wake-up queue under `name` (unique to the VM): whatever is put in
    /// it brings the root context an `on_queue_ready` soon after. `None` when the host refuses.
    fn register_queue(&self, name: &str) -> Option<u32>;
    /// Puts a token in the queue `queue`, for the root context to wake on.
    fn wake(&self, queue: u32);
    /// Empties the queue `queue` (the root context woke).
    fn drain_queue(&self, queue: u32);

    /// Starts an HTTP callout through `cluster`; its answer comes to the root context with
    /// the returned token.
    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        timeout: Duration,
    ) -> Result<u32, Status>;
    /// The `:status` of the callout being answered; `None` for a reset (no response).
    fn call_status(&self) -> Option<String>;
    /// The body of the callout being answered: empty when it has none, `None` when it cannot
    /// be read.
    fn call_body(&self, size: usize) -> Option<Vec<u8>>;

    /// The plugin's configuration bytes (empty when there are none or they cannot be read).
    fn plugin_configuration(&self) -> Vec<u8>;
    /// The plugin's `root_id`.
    fn root_id(&self) -> Option<Vec<u8>>;
    /// The period of the root context's timer.
    fn set_tick_period(&self, period: Duration);
    /// Makes the VM log at the level Envoy's `wasm` logger has now (`-l debug` or
    /// `--component-log-level wasm:debug` shows the debug lines); the level stays as it is when
    /// Envoy cannot say. Envoy refuses the question while the VM starts, so the configuration
    /// asks it.
    fn follow_log_level(&self);

    /// Defines a metric; 0 (never a valid id) when the host refuses, which makes every later
    /// update of it a no-op.
    fn define_metric(&self, kind: MetricType, name: &str) -> u32;
    /// Adds `delta` to a counter or gauge.
    fn increment_metric(&self, id: u32, delta: i64);
    /// Sets a gauge.
    fn record_metric(&self, id: u32, value: u64);
}

/// The real host: proxy-wasm's host calls into Envoy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Envoy;

impl Store for Envoy {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), cas)) => Ok(Some((bytes, cas.unwrap_or(0)))),
            Ok((None, _)) => Ok(None),
            Err(_) => Err(StoreFailed),
        }
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(SetError::CasMismatch),
            Err(_) => Err(SetError::Failed),
        }
    }
}

impl Host for Envoy {
    fn now_ms(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    fn request_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), Status> {
        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value))
    }

    fn remove_request_header(&self, name: &str) {
        let _ = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
    }

    fn set_response_header(&self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpResponseHeaders, name, Some(value));
    }

    fn source_address(&self) -> Option<String> {
        string_property(vec!["source", "address"])
    }

    fn upstream_address(&self) -> Option<String> {
        string_property(vec!["upstream", "address"])
    }

    fn set_filter_state(&self, key: &str, value: &str) {
        let _ = hostcalls::set_property(vec![key], Some(value.as_bytes()));
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }

    fn send_response(
        &self,
        status: u32,
        headers: Vec<(&str, &str)>,
        body: &[u8],
    ) -> Result<(), Status> {
        hostcalls::send_http_response(status, headers, Some(body))
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        hostcalls::set_effective_context(context_id)
    }

    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }

    fn register_queue(&self, name: &str) -> Option<u32> {
        hostcalls::register_shared_queue(name).ok()
    }

    fn wake(&self, queue: u32) {
        // A failure leaves the answers to the next tick.
        let _ = hostcalls::enqueue_shared_queue(queue, Some(&[1]));
    }

    fn drain_queue(&self, queue: u32) {
        // Bounded: the queue holds a token per wake-up, and a wake-up is sent at most once
        // per callback.
        for _ in 0..1024 {
            if !matches!(hostcalls::dequeue_shared_queue(queue), Ok(Some(_))) {
                break;
            }
        }
    }

    fn dispatch(
        &self,
        cluster: &str,
        headers: Vec<(&str, &str)>,
        timeout: Duration,
    ) -> Result<u32, Status> {
        hostcalls::dispatch_http_call(cluster, headers, None, vec![], timeout)
    }

    fn call_status(&self) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
            .ok()
            .flatten()
    }

    fn call_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size)
            .ok()
            .map(Option::unwrap_or_default)
    }

    fn plugin_configuration(&self) -> Vec<u8> {
        hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    fn root_id(&self) -> Option<Vec<u8>> {
        hostcalls::get_property(vec!["plugin_root_id"])
            .ok()
            .flatten()
    }

    fn set_tick_period(&self, period: Duration) {
        let _ = hostcalls::set_tick_period(period);
    }

    fn follow_log_level(&self) {
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
    }

    fn define_metric(&self, kind: MetricType, name: &str) -> u32 {
        hostcalls::define_metric(kind, name).unwrap_or(0)
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        let _ = hostcalls::increment_metric(id, delta);
    }

    fn record_metric(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

/// An Envoy attribute of the effective stream that is a string (`source.address`,
/// `upstream.address`); `None` when absent, unreadable or not UTF-8.
fn string_property(path: Vec<&str>) -> Option<String> {
    hostcalls::get_property(path)
        .ok()
        .flatten()
        .and_then(|bytes| String::from_utf8(bytes).ok())
}
