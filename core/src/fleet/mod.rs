//! What the balancer knows of each node between two decisions: its last report and health,
//! its in-flight books, the models it serves, and when it is polled next.

pub mod callouts;
pub mod models;
pub mod node;
pub mod polling;
