//! token-balancer: an Envoy proxy-wasm filter that routes LLM inference requests by token
//! throughput and KV-cache headroom instead of by connection count.
//!
//! This crate is the glue, the `.wasm` Envoy loads: host calls, metrics, and the root and
//! request contexts. Everything that decides lives in `token-balancer-core`, which has no
//! proxy-wasm dependency and is tested natively and as wasm32-wasip1.

// In test builds the entry point below is compiled out, so the glue is unused there.
#[cfg_attr(test, allow(dead_code))]
mod filter;

// The entry point Envoy calls when the VM starts. Not in test builds: a test binary has its
// own entry point (and on wasm32-wasip1 a command module must not also be a reactor).
#[cfg(not(test))]
proxy_wasm::main! {{
    filter::start();
}}
