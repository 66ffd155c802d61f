//! The traffic the load generator replays, as a library so that the cluster simulator draws the
//! same workloads and arrival processes (`trace`).

pub mod trace;
