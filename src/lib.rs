//! token-balancer: an Envoy proxy-wasm filter that routes LLM inference requests by token
//! throughput and KV-cache headroom instead of by connection count.
//!
//! This crate is the glue, the `.wasm` Envoy loads: it moves bytes between Envoy and
//! `token-balancer-core`, where everything that decides lives (no proxy-wasm there; tested
//! natively and as wasm32-wasip1). The files follow what flows through them:
//! - `host`: every host call, behind the narrow `Host` trait; `Envoy` implements it with
//!   proxy-wasm's host calls, and the tests with a fake host (`fake`).
//! - `metrics`: the table of the filter's Envoy stats.
//! - `root`: the root context (configure, tick, callout answers), with `polls` (the callouts
//!   sent) and `answers` (what their answers become).
//! - `roles`: what a VM is (`Vm`, the poller `Service`, a `Reader` of the service's fleet),
//!   with each role's own state and its part in a decision.
//! - `state`: what the root and its requests share, and how a decision reaches a request.
//! - `request`: one request's way through the filter (the HTTP context), with `asking` (the
//!   nodes asked where a stored response this Envoy has not seen is).
//!
//! Every path that cannot decide continues the request untouched, so Envoy's own fallback
//! balancer routes it (fail-open).

mod answers;
mod asking;
mod host;
mod metrics;
mod polls;
mod request;
mod roles;
mod root;
mod state;

#[cfg(test)]
mod fake;

/// Installs the root context of this VM (the request contexts come from it). Logging starts at
/// info level; the configuration then takes Envoy's own level (`Host::follow_log_level`).
#[cfg_attr(test, allow(dead_code))]
fn start() {
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| Box::new(root::Root::new(context_id, host::Envoy)));
}

// The entry point Envoy calls when the VM starts. Not in test builds: a test binary has its
// own entry point (and on wasm32-wasip1 a command module must not also be a reactor).
#[cfg(not(test))]
proxy_wasm::main! {{
    start();
}}

#[cfg(test)]
mod tests;
