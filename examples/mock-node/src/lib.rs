//! The mock GPU node as a library: the engine model (pure, shared with the simulator of later
//! work) and the node's own tokenizer rule. The HTTP server is `main.rs`.

pub mod engine;
pub mod tokenize;
