//! The floor: a proxy-wasm HTTP filter that does only what any body-based router must do in
//! Envoy, and nothing else. It pauses the request headers, takes the whole body into the VM once
//! it has arrived, and writes one request header (the routing header, removed here) before
//! letting the request go; every other callback is the SDK's default.
//!
//! `examples/overhead.py` runs it beside token-balancer and beside Envoy without any filter, so
//! that the cost of hosting a Wasm filter that reads bodies (VM entries per stream, the body
//! copied into the VM, buffering) is told apart from the cost of token-balancer's own work.
//! Built only for that benchmark: `cargo build --release --target wasm32-wasip1 -p wasm-floor`.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

/// The routing header token-balancer writes (envoy/envoy.yaml): written here too, so the
/// header map changes as it does.
const ROUTING_HEADER: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root));
}}

struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request;

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        // The body is copied into the VM, as a router that reads it must.
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        if !body.is_empty() {
            self.set_http_request_header(ROUTING_HEADER, None);
        }
        Action::Continue
    }
}
