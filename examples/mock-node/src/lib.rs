//! The mock GPU node as a library: the engine model (pure, shared with the simulator of later
//! work), its prefix cache, the node's own tokenizer rule, and the engines' metric formats.
//! The HTTP server is `main.rs`.

pub mod engine;
pub mod metrics;
pub mod prefix;
pub mod tokenize;
