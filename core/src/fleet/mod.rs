//! What the balancer knows of each node between two decisions: its last report and health,
//! its in-flight books, the models it serves, which nodes are followed, and when each is
//! polled next.

pub mod books;
pub mod callouts;
pub mod membership;
pub mod models;
pub mod names;
pub mod node;
pub mod polling;
pub mod prefixes;
pub mod probe;
