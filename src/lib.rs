//! token-balancer: an Envoy proxy-wasm filter that routes LLM inference requests by token
//! throughput and KV-cache headroom instead of by connection count.
//!
//! Everything that decides is plain Rust with no proxy-wasm dependency (`config`, `weight`,
//! `telemetry`, `prometheus`, `engine`, `throughput`, `models`, `node`, `choice`, `balancer`,
//! `admission`, `rng`, `shared`, `polling`): it takes time and randomness as arguments and is tested natively and
//! compiled to wasm32-wasip1. The `filter` module is the thin glue that moves bytes between
//! Envoy and that core; it holds no decision logic.

pub mod admission;
pub mod balancer;
pub mod choice;
pub mod config;
pub mod engine;
pub mod membership;
pub mod models;
pub mod node;
pub mod output;
pub mod polling;
pub mod pool;
pub mod prometheus;
pub mod rng;
pub mod shared;
pub mod telemetry;
pub mod throughput;
pub mod usage;
pub mod weight;

// In test builds the entry point below is compiled out, so the glue is unused there.
#[cfg_attr(test, allow(dead_code))]
mod filter;

// The entry point Envoy calls when the VM starts. Not in test builds: a test binary has its
// own entry point (and on wasm32-wasip1 a command module must not also be a reactor).
#[cfg(not(test))]
proxy_wasm::main! {{
    filter::start();
}}
