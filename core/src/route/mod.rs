//! The decision: what a request costs on each node, which nodes are compared, what outputs
//! are expected, and whether the request goes now or waits for room.

pub mod admission;
pub mod balancer;
pub mod beliefs;
pub mod candidates;
pub mod choice;
pub mod outputs;
#[cfg(test)]
mod pin_tests;
#[cfg(test)]
mod prefix_tests;
pub mod prompt_scale;
pub mod ranking;
pub mod routers;
pub mod survival;
#[cfg(test)]
pub(crate) mod testing;
