//! The glue against a fake host (`fake`): a request's way through the filter (`requests`),
//! the root context's configure, tick and callout answers (`roots`), how a node's telemetry
//! is found when only its address is configured (`discovery`), the per-node stats under
//! churn (`metrics`), and the per-request explanation (`explain`).

mod admission;
mod discovery;
mod explain;
mod metrics;
mod requests;
mod roots;
mod stored;

use crate::fake::FakeHost;
use crate::request::Request;
use crate::root::Root;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::Action;
use token_balancer_core::fleet::books::Books;

/// The root context's id; requests get ids from 2.
pub const ROOT: u32 = 1;
pub const A: &str = "10.0.0.1:8000";
pub const B: &str = "10.0.0.2:8000";
/// The default routing header.
pub const ROUTING: &str = "x-gateway-destination-endpoint";

/// A health answer with room to spare.
pub const IDLE: &str = r#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000}"#;
/// A health answer of a node whose cache is full.
pub const FULL: &str = r#"{"tokens_per_sec_load":100,"tokens_per_sec_capacity":1000,"vram_used_bytes":1000000000,"vram_total_bytes":1000000000}"#;

/// A configuration of nodes A and B with `extra` fields (each starting with a comma).
pub fn config(extra: &str) -> String {
    format!(
        r#"{{"nodes":[{{"address":"{A}"}},{{"address":"{B}"}}],"health_cluster":"gpu_health","models_poll_ms":0{extra}}}"#
    )
}

/// A root context configured with `json`, at a clock of 1,000 s.
pub fn configured(json: &str) -> (FakeHost, Root<FakeHost>) {
    let host = FakeHost::default();
    {
        let mut w = host.world();
        w.configuration = json.as_bytes().to_vec();
        w.now_ms = 1_000_000;
    }
    host.enter(ROOT);
    let mut root = Root::new(ROOT, host.clone());
    assert!(root.on_configure(0), "configuration refused: {json}");
    (host, root)
}

pub fn tick(host: &FakeHost, root: &mut Root<FakeHost>) {
    host.enter(ROOT);
    root.on_tick();
}

/// Delivers the answer `(status, body)` to callout `token`.
pub fn answer(
    host: &FakeHost,
    root: &mut Root<FakeHost>,
    token: u32,
    status: Option<&str>,
    body: &str,
) {
    host.world().answer = (status.map(str::to_string), body.as_bytes().to_vec());
    host.enter(ROOT);
    root.on_http_call_response(token, 0, body.len(), 0);
}

/// Answers every health callout sent so far with `body` (a 200).
pub fn answer_health(host: &FakeHost, root: &mut Root<FakeHost>, body: &str) {
    for call in host.take_calls() {
        assert_eq!(call.path, "/health", "{call:?}");
        answer(host, root, call.token, Some("200"), body);
    }
}

/// A root whose nodes have all reported `body`.
pub fn reported(json: &str, body: &str) -> (FakeHost, Root<FakeHost>) {
    let (host, mut root) = configured(json);
    tick(&host, &mut root);
    answer_health(&host, &mut root, body);
    (host, root)
}

/// A request context `id` whose stream has the request headers `headers`.
pub fn request(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    headers: &[(&str, &str)],
) -> Request<FakeHost> {
    host.stream(id).request = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    root.request(id)
}

/// A completions request `id` with `body`: (what its headers and its body callback said).
pub fn post(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    body: &str,
) -> (Request<FakeHost>, Action, Action) {
    let len = body.len().to_string();
    let mut req = request(
        host,
        root,
        id,
        &[(":path", "/v1/completions"), ("content-length", &len)],
    );
    host.stream(id).body = body.as_bytes().to_vec();
    host.enter(id);
    let headers = req.on_http_request_headers(0, false);
    let body_action = req.on_http_request_body(body.len(), true);
    (req, headers, body_action)
}

/// A request `id` to `path` with `body` and the extra request `headers`, its headers paused
/// for the body: the request and what its body callback said.
pub fn post_to(
    host: &FakeHost,
    root: &Root<FakeHost>,
    id: u32,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (Request<FakeHost>, Action) {
    let len = body.len().to_string();
    let mut all = vec![(":path", path), ("content-length", len.as_str())];
    all.extend_from_slice(headers);
    let mut req = request(host, root, id, &all);
    host.stream(id).body = body.as_bytes().to_vec();
    host.enter(id);
    assert_eq!(req.on_http_request_headers(0, false), Action::Pause);
    let action = req.on_http_request_body(body.len(), true);
    (req, action)
}

/// A small completions body.
pub const BODY: &str = r#"{"model":"m","prompt":"hello there","max_tokens":20}"#;

/// The response of stream `id` starts with `status`.
pub fn respond(host: &FakeHost, req: &mut Request<FakeHost>, id: u32, status: &str) {
    host.stream(id).response = vec![(":status".to_string(), status.to_string())];
    host.enter(id);
    assert_eq!(req.on_http_response_headers(0, false), Action::Continue);
}

/// Ends stream `id` (Envoy's `on_log`).
pub fn end(host: &FakeHost, req: &mut Request<FakeHost>, id: u32) {
    host.enter(id);
    req.on_log();
}

/// Node `node`'s books in the filter's own balancer.
pub fn books(root: &Root<FakeHost>, node: usize) -> Books {
    let state = root.state().borrow();
    *state.as_ref().unwrap().balancer.nodes()[node].books()
}

/// Requests the filter has booked on node `node` (its own balancer's books).
pub fn inflight(root: &Root<FakeHost>, node: usize) -> u64 {
    books(root, node).inflight_requests
}

/// A completions request `id` routed with room for a long answer, its response started with
/// a 200: the request, and the node it was routed to (0 for A, 1 for B).
pub fn answering(host: &FakeHost, root: &Root<FakeHost>, id: u32) -> (Request<FakeHost>, usize) {
    let body = r#"{"model":"m","prompt":"hello there","max_tokens":4000}"#;
    let (mut req, _, _) = post(host, root, id, body);
    let routed = host.request_header_of(id, ROUTING).unwrap();
    let node = usize::from(!routed.starts_with(A));
    respond(host, &mut req, id, "200");
    (req, node)
}

/// A chunk `bytes` of stream `id`'s response body, `end` when it is the last: what the body
/// callback said.
pub fn response_chunk(
    host: &FakeHost,
    req: &mut Request<FakeHost>,
    id: u32,
    bytes: &[u8],
    end: bool,
) -> Action {
    host.stream(id).response_body = bytes.to_vec();
    host.enter(id);
    req.on_http_response_body(bytes.len(), end)
}

/// An admin `/clusters?format=json` answer listing `addresses` in cluster gpu_nodes.
pub fn members(addresses: &[&str]) -> String {
    let hosts: Vec<String> = addresses
        .iter()
        .map(|a| {
            let (ip, port) = a.split_once(':').unwrap();
            format!(
                r#"{{"address":{{"socket_address":{{"address":"{ip}","port_value":{port}}}}}}}"#
            )
        })
        .collect();
    format!(
        r#"{{"cluster_statuses":[{{"name":"gpu_nodes","host_statuses":[{}]}}]}}"#,
        hosts.join(",")
    )
}

/// A configuration that follows cluster gpu_nodes through the admin cluster.
pub const FOLLOWING: &str = r#"{"health_cluster":"gpu_health","models_poll_ms":0,"tick_ms":100,
    "membership":{"cluster":"gpu_nodes","admin_cluster":"admin","poll_ms":100}}"#;
