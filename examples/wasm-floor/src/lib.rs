//! The floor: a proxy-wasm HTTP filter that does only what any body-based router must do in
//! Envoy, and nothing else. It pauses the request headers, takes the whole body into the VM once
//! it has arrived, and writes one request header (the routing header) before letting the
//! request go; every other callback is the SDK's default.
//!
//! Configured with nothing, it removes the routing header, so Envoy's fallback balancer
//! (least_request) picks the node. Configured with a comma-separated list of `ip:port`
//! destinations, it names them in turn in the routing header, so `override_host` sends each
//! request where the filter said, as a router does.
//!
//! `examples/overhead.py` runs it beside token-balancer and beside Envoy without any filter, so
//! that the cost of hosting a Wasm filter that reads bodies (VM entries per stream, the body
//! copied into the VM, buffering) is told apart from the cost of token-balancer's own work.
//! Built only for that benchmark: `cargo build --release --target wasm32-wasip1 -p wasm-floor`.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::cell::Cell;
use std::rc::Rc;

/// The routing header token-balancer writes (envoy/envoy.yaml): written here too, so the
/// header map changes as it does.
const ROUTING_HEADER: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}}

#[derive(Default)]
struct Root {
    destinations: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = self
            .get_plugin_configuration()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        self.destinations = Rc::new(
            text.split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(str::to_string)
                .collect(),
        );
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Request {
            destinations: Rc::clone(&self.destinations),
            next: Rc::clone(&self.next),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    destinations: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
}

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
            let i = self.next.get();
            self.next.set(i.wrapping_add(1));
            let to = self
                .destinations
                .get(i % self.destinations.len().max(1))
                .map(String::as_str);
            self.set_http_request_header(ROUTING_HEADER, to);
        }
        Action::Continue
    }
}
