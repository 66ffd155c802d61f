//! The per-node stats under churn: nodes replaced under new addresses, as pods are.

use super::{A, B};
use crate::fake::FakeHost;
use crate::metrics::{Metrics, NodeStat, MAX_NODE_ADDRESSES, NODE_STATS, OTHER_NODE, STATS};

/// The address of the `n`th replacement pod.
fn pod(n: usize) -> String {
    format!("172.16.{}.{}:8000", n >> 8, n & 255)
}

fn picks(host: &FakeHost, address: &str) -> i64 {
    host.metric(&format!("token_balancer.node.{address}.picks"))
}

#[test]
fn ten_thousand_address_changes_define_a_bounded_number_of_stats() {
    let host = FakeHost::default();
    let mut m = Metrics::define(host.clone(), [A, B]);
    // Four slots, each replaced 2,500 times under a new address; every pod serves once.
    for n in 0..10_000 {
        let slot = n % 4;
        m.name_node(slot, &pod(n));
        m.bump_node(slot, NodeStat::Picks);
    }
    // The two configured addresses, then the first pods up to the bound, then "other".
    let per_node = NODE_STATS.len();
    let bound = STATS.len() + per_node * (MAX_NODE_ADDRESSES + 1);
    assert_eq!(host.metric_names().len(), bound);
    assert_eq!(host.world().defines, bound, "no name is defined twice");
    let named = MAX_NODE_ADDRESSES - 2;
    assert_eq!(picks(&host, &pod(0)), 1);
    assert_eq!(picks(&host, &pod(named - 1)), 1);
    assert_eq!(
        picks(&host, &pod(named)),
        0,
        "past the bound: never defined"
    );
    assert_eq!(picks(&host, OTHER_NODE), (10_000 - named) as i64);

    // A node back at an address it had counts on where it left off, with no new definition;
    // so does one at an address past the bound, under "other".
    let defined = host.world().defines;
    m.name_node(0, A);
    m.bump_node(0, NodeStat::Picks);
    m.name_node(1, &pod(3));
    m.bump_node(1, NodeStat::Picks);
    m.name_node(2, &pod(9_999));
    m.bump_node(2, NodeStat::Picks);
    assert_eq!(host.world().defines, defined);
    assert_eq!((picks(&host, A), picks(&host, &pod(3))), (1, 2));
    assert_eq!(picks(&host, OTHER_NODE), (10_000 - named + 1) as i64);
}

#[test]
fn a_fleet_within_the_bound_has_every_node_under_its_own_address() {
    let host = FakeHost::default();
    let mut m = Metrics::define(host.clone(), [A, B]);
    m.name_node(5, &pod(7));
    m.bump_node(5, NodeStat::HealthFailures);
    m.bump_node(1, NodeStat::Picks);
    m.bump_node(9, NodeStat::Picks); // no such slot: nothing counted
    assert_eq!(
        host.metric(&format!("token_balancer.node.{}.health_failures", pod(7))),
        1
    );
    assert_eq!(picks(&host, B), 1);
    assert!(host
        .metric_names()
        .iter()
        .all(|(_, n)| !n.contains(OTHER_NODE)));
}
