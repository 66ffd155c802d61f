//! token-balancer-core: the decision core of token-balancer, an Envoy filter that routes LLM
//! inference requests by token throughput and KV-cache headroom instead of by connection count.
//!
//! Plain Rust with no proxy-wasm dependency: time comes in as `now_ms` and randomness as a
//! `rng::Rng`, so every rule is tested natively and compiled to wasm32-wasip1. The Envoy glue
//! (the root crate, `token-balancer`) only moves bytes between Envoy and this crate.
//!
//! The folders follow what flows through them:
//! - `ingest`: bytes from outside, read into typed values: request bodies (`request`),
//!   response streams (`response`), health answers in the seed JSON (`telemetry`) or an
//!   engine's Prometheus text (`prometheus`, `engine`), counters turned into rates (`rates`),
//!   and Envoy's admin list of cluster members (`members`).
//! - `fleet`: what is known of each node: its reports and health (`node`), its in-flight
//!   books and the one set of rules that changes them (`books`), the models it serves
//!   (`models`), which nodes are followed in which slot (`membership`), and when each is
//!   polled (`polling`).
//! - `route`: the decision: the cost of a request on a node (`choice`), the candidates drawn
//!   (`candidates`), output lengths learned (`outputs`), the balancer that ties them together
//!   (`balancer`), and holding under saturation (`admission`).
//! - `share`: what the VMs of one Envoy share through proxy-wasm's shared data (the fleet
//!   snapshot and the books), behind a narrow `Store` trait: the bytes (`codec`), the books'
//!   read-modify-writes (`ledger`), and a balancer's nodes to the snapshot and back (`fleet`).
//! - `config`: the plugin configuration, typed and closed; `rng`: injectable randomness;
//!   `explain`: a decision in words (the debug header, a request's explanation) and the
//!   networks an explanation may be asked from.

pub mod config;
pub mod explain;
pub mod fleet;
pub mod ingest;
pub mod rng;
pub mod route;
pub mod share;
