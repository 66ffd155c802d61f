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
//! Configured with `probe:KIND:N`, it also makes `N` host calls of one kind per request, once
//! the body is in: what one crossing into Envoy costs, told apart by `examples/host_call_cost.py`
//! from the same filter making none (see `Probe` for the kinds).
//!
//! `examples/overhead.py` runs it beside token-balancer and beside Envoy without any filter, so
//! that the cost of hosting a Wasm filter that reads bodies (VM entries per stream, the body
//! copied into the VM, buffering) is told apart from the cost of token-balancer's own work.
//! Built only for those benchmarks: `cargo build --release --target wasm32-wasip1 -p wasm-floor`.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MapType, MetricType};
use std::cell::Cell;
use std::rc::Rc;

/// The routing header token-balancer writes (envoy/envoy.yaml): written here too, so the
/// header map changes as it does.
const ROUTING_HEADER: &str = "x-gateway-destination-endpoint";
/// The shared-data key the probe reads and writes: a value the size of a node's books.
const PROBE_KEY: &str = "wasm_floor.probe";
const PROBE_VALUE: [u8; 96] = [7; 96];

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}}

/// The host calls the probe makes, each of the kind token-balancer makes on a request's path.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Probe {
    /// Reads a shared-data value (the books of a node).
    SharedGet,
    /// Writes a shared-data value.
    SharedSet,
    /// Adds one to a counter.
    Metric,
    /// Looks up a request header the request does not have.
    HeaderAbsent,
    /// Looks up a request header it has (`content-length`).
    HeaderPresent,
    /// Reads a property (`source.address`; token-balancer reads `upstream.address`).
    Property,
    /// Reads the clock.
    Clock,
}

impl Probe {
    fn parse(kind: &str) -> Option<Probe> {
        Some(match kind {
            "shared_get" => Probe::SharedGet,
            "shared_set" => Probe::SharedSet,
            "metric" => Probe::Metric,
            "header_absent" => Probe::HeaderAbsent,
            "header_present" => Probe::HeaderPresent,
            "property" => Probe::Property,
            "clock" => Probe::Clock,
            _ => return None,
        })
    }

    /// Makes the call once; returns what it read, counted, so that nothing is optimised away.
    fn call(self, metric: u32) -> usize {
        match self {
            Probe::SharedGet => match hostcalls::get_shared_data(PROBE_KEY) {
                Ok((Some(v), _)) => v.len(),
                _ => 0,
            },
            Probe::SharedSet => {
                usize::from(hostcalls::set_shared_data(PROBE_KEY, Some(&PROBE_VALUE), None).is_ok())
            }
            Probe::Metric => usize::from(hostcalls::increment_metric(metric, 1).is_ok()),
            Probe::HeaderAbsent => {
                match hostcalls::get_map_value(MapType::HttpRequestHeaders, "x-wasm-floor-absent") {
                    Ok(Some(v)) => v.len(),
                    _ => 0,
                }
            }
            Probe::HeaderPresent => {
                match hostcalls::get_map_value(MapType::HttpRequestHeaders, "content-length") {
                    Ok(Some(v)) => v.len(),
                    _ => 0,
                }
            }
            Probe::Property => match hostcalls::get_property(vec!["source", "address"]) {
                Ok(Some(v)) => v.len(),
                _ => 0,
            },
            Probe::Clock => hostcalls::get_current_time().map_or(0, |t| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| usize::from(d.subsec_nanos() & 1 == 1))
            }),
        }
    }
}

#[derive(Default)]
struct Root {
    destinations: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
    /// Host calls to make per request: the kind, how many, and the probe's counter.
    probe: Option<(Probe, usize, u32)>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = self
            .get_plugin_configuration()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        if let Some(spec) = text.trim().strip_prefix("probe:") {
            let mut parts = spec.split(':');
            let kind = parts.next().and_then(Probe::parse);
            let n = parts.next().and_then(|n| n.parse::<usize>().ok());
            let (Some(kind), Some(n)) = (kind, n) else {
                proxy_wasm::hostcalls::log(
                    LogLevel::Error,
                    &format!("wasm-floor: bad probe {spec:?}: want probe:KIND:N"),
                )
                .ok();
                return false;
            };
            let metric =
                hostcalls::define_metric(MetricType::Counter, "wasm_floor.probe").unwrap_or(0);
            let _ = hostcalls::set_shared_data(PROBE_KEY, Some(&PROBE_VALUE), None);
            self.probe = Some((kind, n, metric));
            return true;
        }
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
            probe: self.probe,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Request {
    destinations: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
    probe: Option<(Probe, usize, u32)>,
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
            let mut seen = body.len();
            if let Some((kind, n, metric)) = self.probe {
                for _ in 0..n {
                    seen = seen.wrapping_add(kind.call(metric));
                }
            }
            std::hint::black_box(seen);
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
