//! Requests pinned to one node through the whole balancer: a turn continuing a stored
//! conversation goes to the node that stores it whatever the others offer, is priced with the
//! stored turns (cached there), waits for room there and nowhere else, and still goes there
//! when that node's report is stale.

use crate::ingest::request::Weight;
use crate::rng::SplitMix64;
use crate::route::balancer::{Balancer, Outcome, OwnBooks, Terms};
use crate::route::testing::*;

fn pinned(
    b: &mut Balancer,
    weight: Weight,
    address: &str,
    context: u64,
    now: u64,
    may_hold: bool,
) -> Outcome {
    let pin = b.pin_to(&stored(address, context));
    assert!(pin.is_some(), "{address} is in the fleet");
    let terms = Terms {
        may_hold,
        pin,
        ..Terms::default()
    };
    let mut rng = SplitMix64::new(7);
    b.route_on(
        weight,
        None,
        &Chain::NONE,
        now,
        &mut rng,
        terms,
        &mut OwnBooks,
    )
}

#[test]
fn a_pinned_request_goes_to_its_node_priced_with_the_stored_turns() {
    // Node 1 is busy, the others idle: unpinned, nothing goes to node 1.
    let mut b = sampled_fleet(4, r#","choices":0"#, |i| if i == 1 { 900 } else { 0 });
    let mut rng = SplitMix64::new(1);
    for _ in 0..8 {
        let o = b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
        assert_ne!(routed_to(&o), Some(1));
    }
    let o = pinned(&mut b, W, "127.0.0.1:8002", 3_000, 10, true);
    let t = routed(&o).unwrap();
    assert_eq!(t.node, 1);
    // Its prompt is the stored conversation and its own input; only its own is prefilled.
    assert_eq!(t.weight.prompt_tokens, 3_100);
    if let Outcome::Routed {
        header_value,
        compared,
        ..
    } = &o
    {
        assert_eq!(&**header_value, "127.0.0.1:8002");
        assert_eq!(compared.len(), 1);
        assert_eq!(compared[0].cached, 3_000);
    }
    assert_eq!(b.pin_to(&stored("127.0.0.1:9999", 10)), None);
}

#[test]
fn a_pinned_request_waits_for_room_on_its_node_not_elsewhere() {
    let mut b = Balancer::new(&cfg(2, r#","choices":0,"kv_bytes_per_token":1"#));
    b.on_health(0, Some(FULL), 0).unwrap();
    b.on_health(1, Some(ROOM), 0).unwrap();
    let mut rng = SplitMix64::new(2);
    // Unpinned, it goes where there is room.
    let o = b.route(W, None, &Chain::NONE, 10, &mut rng, true, &mut OwnBooks);
    assert_eq!(routed_to(&o), Some(1));
    // Pinned to the full node, it may wait there: no other node could serve it.
    assert_eq!(
        pinned(&mut b, W, "127.0.0.1:8001", 500, 10, true),
        Outcome::Saturated
    );
    // Unable to wait, it goes there over the ceiling.
    match pinned(&mut b, W, "127.0.0.1:8001", 500, 10, false) {
        Outcome::Routed {
            ticket,
            over_ceiling,
            ..
        } => {
            assert_eq!(ticket.node, 0);
            assert!(over_ceiling);
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn a_pinned_request_goes_to_its_node_without_a_fresh_report() {
    let mut b = idle_fleet(3, r#","tick_ms":250,"stale_after_ms":1000"#);
    // Only node 2 reports again; nodes 0 and 1 are stale by 5 s.
    b.on_health(2, Some(IDLE), 4_500).unwrap();
    let o = pinned(&mut b, W, "127.0.0.1:8001", 0, 5_000, true);
    assert_eq!(routed_to(&o), Some(0));
    // A request of no weight (a stored response's poll) goes there too, and books nothing.
    let poll = pinned(&mut b, Weight::default(), "127.0.0.1:8002", 0, 5_000, true);
    let t = routed(&poll).unwrap();
    assert_eq!((t.node, t.weight.total()), (1, 0));
    // Unpinned, only the fresh node is chosen.
    let mut rng = SplitMix64::new(3);
    let o = b.route(W, None, &Chain::NONE, 5_000, &mut rng, false, &mut OwnBooks);
    assert_eq!(routed_to(&o), Some(2));
}

#[test]
fn the_stored_turns_a_report_still_shows_in_use_are_not_counted_twice() {
    // A node with 1,000 tokens of cache, its report taken at 100 while the turn before ran:
    // 700 tokens in use, that turn's 600-token prompt among them.
    let mut b = Balancer::new(&cfg(1, r#","choices":0,"kv_bytes_per_token":1"#));
    let report = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"vram_used_bytes":700,"vram_total_bytes":1000}"#;
    b.on_health(0, Some(report), 100).unwrap();
    let turn = crate::share::stored::Stored {
        address: "127.0.0.1:8001".into(),
        context_tokens: 650,
        prompt_tokens: 600,
        seen_ms: 50,
        ended_ms: 150,
    };
    let pin = b.pin_to(&turn);
    assert_eq!(pin.map(|p| p.shown), Some(600));
    let next = Weight {
        prompt_tokens: 20,
        output_tokens: 20,
    };
    let terms = Terms {
        may_hold: true,
        pin,
        ..Terms::default()
    };
    let mut rng = SplitMix64::new(9);
    // 700 in use + 670 of prompt + 20 out, less the 600 the report shows: 790, under 0.9.
    match b.route_on(
        next,
        None,
        &Chain::NONE,
        160,
        &mut rng,
        terms,
        &mut OwnBooks,
    ) {
        Outcome::Routed { over_ceiling, .. } => assert!(!over_ceiling),
        o => panic!("{o:?}"),
    }
    // The same turn with a report taken before the one before it started: it may wait.
    let earlier = crate::share::stored::Stored {
        seen_ms: 120,
        ..turn
    };
    let pin = b.pin_to(&earlier);
    assert_eq!(pin.map(|p| p.shown), Some(0));
    let terms = Terms { pin, ..terms };
    assert_eq!(
        b.route_on(
            next,
            None,
            &Chain::NONE,
            160,
            &mut rng,
            terms,
            &mut OwnBooks
        ),
        Outcome::Saturated
    );
}

/// Where a stored response this balancer has not seen is: the nodes with a fresh report are
/// asked, at most as many as configured, from a different one each time.
#[test]
fn the_nodes_asked_for_an_unseen_response_are_the_fresh_ones() {
    let mut b = Balancer::new(&cfg(4, ""));
    for i in [0, 1, 3] {
        let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000}"#;
        b.on_health(i, Some(body), 0).unwrap();
    }
    let mut rng = SplitMix64::new(5);
    let mut asked = b.nodes_to_ask(10, 32, &mut rng);
    asked.sort_unstable();
    assert_eq!(
        asked,
        ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8004"],
        "node 2 (127.0.0.1:8003) never reported"
    );
    // At most two, and not always the same two.
    let mut firsts = std::collections::BTreeSet::new();
    for _ in 0..32 {
        let two = b.nodes_to_ask(10, 2, &mut rng);
        assert_eq!(two.len(), 2);
        firsts.insert(two[0].clone());
    }
    assert!(firsts.len() > 1, "{firsts:?}");
    assert!(b.nodes_to_ask(10, 0, &mut rng).is_empty());
    // Stale reports: nobody to ask.
    assert!(b.nodes_to_ask(1_000_000, 32, &mut rng).is_empty());
}
