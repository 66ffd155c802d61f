//! Prefix-aware pricing through the whole balancer: prompts that share a prefix go where it is
//! cached until that node's backlog costs more than the prefill saved, a hot prefix in every
//! prompt does not pull everything to one node, the node holding a prefix is compared even
//! when the draws miss it, and independent balancers agree where a new prefix goes.

use crate::ingest::prompt::{self, Chain};
use crate::ingest::request::{Api, Weight};
use crate::rng::SplitMix64;
use crate::route::balancer::{Balancer, Outcome, OwnBooks};
use crate::route::routers;
use crate::route::testing::*;

/// A chat prompt: `system` then `question`, its chain in 256-character blocks, and its weight
/// (prompt tokens at 4 characters a token, `output` tokens out).
fn prompt(system: &str, question: &str, output: u64) -> (Weight, Chain) {
    let body = serde_json::json!({"messages":[
        {"role":"system","content":system},{"role":"user","content":question}]});
    let obj = body.as_object().cloned().unwrap_or_default();
    let chain = prompt::chain(Api::Chat, &obj, None, 256);
    let chars = (system.len() + question.len()) as u64;
    (
        Weight {
            prompt_tokens: chars / 4,
            output_tokens: output,
        },
        chain,
    )
}

/// A system prompt of about `chars` characters, its own for each `tenant`.
fn system(tenant: u32, chars: usize) -> String {
    let words = format!("Tenant {tenant} rules: be brief, be kind, cite sources. ");
    words.repeat(chars / words.len() + 1)
}

/// The stream of `t` delivered `n` tokens and ended, as the glue reports it.
fn finish(b: &mut Balancer, t: &crate::fleet::node::Ticket, n: u64) {
    b.progress(t, 0, n);
    b.release(t, n);
}

fn go(
    b: &mut Balancer,
    (weight, chain): &(Weight, Chain),
    now: u64,
    rng: &mut SplitMix64,
) -> Outcome {
    b.route(*weight, None, chain, now, rng, false, &mut OwnBooks)
}

/// Requests of one tenant (a 16k-character system prompt, about 4k tokens, short questions)
/// follow the node that holds the prompt while it is idle, and spill to an idle node once
/// the home node reports a queue whose work costs more than the prefill saved there.
#[test]
fn a_shared_prefix_sticks_until_its_node_is_loaded() {
    let mut b = idle_fleet(4, r#","choices":0"#);
    let mut rng = SplitMix64::new(3);
    let sys = system(1, 16_000);
    let first = routed(&go(&mut b, &prompt(&sys, "question 0", 50), 10, &mut rng)).unwrap();
    let home = first.node;
    finish(&mut b, &first, 50);
    for i in 1..20 {
        let t = routed(&go(
            &mut b,
            &prompt(&sys, &format!("question {i}"), 50),
            10,
            &mut rng,
        ))
        .unwrap();
        assert_eq!(t.node, home, "turn {i}");
        assert!(t.cached > 3900, "priced as cached: {}", t.cached);
        finish(&mut b, &t, 50);
    }
    // The home node reports half its throughput in use: the 4k-token prefill saved still
    // outweighs it. Then it reports a queue of two requests of the mean size (about 4k
    // tokens each): more work ahead than the prefill saved, and the request goes to an idle
    // node.
    let report = |load: u32, q: u32| {
        format!(
            r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000,"queue_depth":{q}}}"#
        )
    };
    let mut place = |load: u32, q: u32, now: u64| {
        b.on_health(home, Some(report(load, q).as_bytes()), now)
            .unwrap();
        let t = routed(&go(&mut b, &prompt(&sys, "one more", 50), now, &mut rng)).unwrap();
        finish(&mut b, &t, 50);
        t.node
    };
    assert_eq!(place(0, 0, 20), home);
    assert_eq!(place(500, 0, 30), home);
    assert_ne!(place(0, 2, 40), home);
}

/// With prefix pricing off, the same tenant's requests spread from the first (the control
/// for the test above: it is the pricing that keeps them together).
#[test]
fn without_prefix_pricing_the_same_requests_spread() {
    let mut b = idle_fleet(4, r#","choices":0,"prefix":{"enabled":false}"#);
    let mut rng = SplitMix64::new(3);
    let sys = system(1, 16_000);
    let mut picks = [0usize; 4];
    for i in 0..40 {
        let (w, _) = prompt(&sys, &format!("question {i}"), 50);
        let o = b.route(w, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
        picks[routed_to(&o).unwrap()] += 1;
    }
    assert!(picks.iter().all(|&p| p == 10), "{picks:?}");
}

/// One 8k-character system prompt in every request and a unique 4k-character rest: once every
/// node holds the system prompt no node is cheaper for it, and the load spreads evenly.
#[test]
fn a_hot_prefix_in_every_prompt_spreads() {
    let mut b = idle_fleet(8, "");
    let mut rng = SplitMix64::new(5);
    let sys = system(0, 8_000);
    let mut tokens = [0u64; 8];
    let mut inflight = std::collections::VecDeque::new();
    for i in 0..800u64 {
        let q = format!("{i} ").repeat(4000 / format!("{i} ").len());
        let o = go(&mut b, &prompt(&sys, &q, 200), 10 + i, &mut rng);
        let Outcome::Routed { ticket, .. } = o else {
            panic!("routed")
        };
        if i >= 100 {
            tokens[ticket.node] += ticket.work();
        }
        // Each request ends once 16 more have been routed: a steady 16 in flight.
        inflight.push_back(ticket);
        if inflight.len() > 16 {
            let done = inflight.pop_front().unwrap();
            finish(&mut b, &done, 200);
        }
    }
    let mean = tokens.iter().sum::<u64>() as f64 / 8.0;
    let max = *tokens.iter().max().unwrap() as f64;
    assert!(max / mean <= 1.2, "max/mean {:.2}: {tokens:?}", max / mean);
}

/// In a fleet of 20 drawn two at a time, the node that holds a prompt's prefix is compared on
/// every request, not one time in ten.
#[test]
fn the_node_holding_the_prefix_joins_the_drawn_candidates() {
    let mut b = idle_fleet(20, "");
    let mut rng = SplitMix64::new(9);
    let sys = system(2, 16_000);
    let first = routed(&go(&mut b, &prompt(&sys, "q", 20), 10, &mut rng)).unwrap();
    let home = first.node;
    finish(&mut b, &first, 20);
    for i in 0..30 {
        let o = go(&mut b, &prompt(&sys, &format!("q{i}"), 20), 10, &mut rng);
        let Outcome::Routed { ticket, .. } = o else {
            panic!("routed")
        };
        assert_eq!(ticket.node, home, "request {i}");
        finish(&mut b, &ticket, 20);
    }
}

/// Two balancers that never talk (two Envoy replicas) send a new tenant's first request to the
/// same node when the fleet is idle: the prefix-keyed preference. Over 40 tenants they agree
/// on every one, and the tenants spread over the fleet.
#[test]
fn independent_balancers_agree_where_a_new_prefix_goes() {
    let mut a = idle_fleet(8, "");
    let mut b = idle_fleet(8, "");
    let (mut ra, mut rb) = (SplitMix64::new(1), SplitMix64::new(2));
    let mut homes = [0usize; 8];
    for t in 0..40 {
        let sys = system(100 + t, 4_000);
        let na = routed_to(&go(
            &mut a,
            &prompt(&sys, "first question", 20),
            10,
            &mut ra,
        ));
        let nb = routed_to(&go(
            &mut b,
            &prompt(&sys, "another question", 20),
            10,
            &mut rb,
        ));
        assert_eq!(na, nb, "tenant {t}");
        homes[na.unwrap()] += 1;
        a = idle_again(a);
        b = idle_again(b);
    }
    assert!(homes.iter().filter(|&&h| h > 0).count() >= 6, "{homes:?}");
}

/// A replica that spilled a tenant's first request, because the node the prefix key prefers
/// was loaded then, goes back to that node once it is free: the other replicas put the prefix
/// there, so it is presumed to hold what this replica's own node holds. Without the
/// presumption the node this replica sent it to, with a queue shorter than the prefill saved,
/// keeps the tenant, and the replicas' caches stay split.
#[test]
fn a_replica_that_spilled_a_prefix_returns_to_the_preferred_node() {
    let sys = system(7, 16_000);
    let ask = |q: &str| prompt(&sys, q, 50);
    // Where every replica puts the tenant when the fleet is idle.
    let mut rng = SplitMix64::new(5);
    let preferred = routed_to(&go(
        &mut idle_fleet(4, r#","choices":0"#),
        &ask("q"),
        10,
        &mut rng,
    ))
    .unwrap();
    let report = |load: u32, q: u32| {
        format!(
            r#"{{"tokens_per_sec_load":{load},"tokens_per_sec_capacity":1000,"queue_depth":{q}}}"#
        )
    };
    let mut b = idle_fleet(4, r#","choices":0"#);
    b.on_health(preferred, Some(report(1000, 4).as_bytes()), 10)
        .unwrap();
    let spilled = routed(&go(&mut b, &ask("first"), 10, &mut rng)).unwrap();
    assert_ne!(spilled.node, preferred, "the preferred node is loaded");
    finish(&mut b, &spilled, 50);
    // The preferred node is idle again; the spill target reports a short queue, costing less
    // than the 4k-token prefill it holds.
    b.on_health(preferred, Some(report(0, 0).as_bytes()), 20)
        .unwrap();
    b.on_health(spilled.node, Some(report(300, 0).as_bytes()), 20)
        .unwrap();
    let t = routed(&go(&mut b, &ask("second"), 20, &mut rng)).unwrap();
    assert_eq!(t.node, preferred);
    assert!(t.cached > 3900, "priced as cached there: {}", t.cached);
}

/// The balancer with every node's books emptied by a new report (its index kept).
fn idle_again(mut b: Balancer) -> Balancer {
    for i in 0..b.nodes().len() {
        let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000}"#;
        b.on_health(i, Some(body), 10).unwrap();
        let books = b.books(i).unwrap();
        b.set_books(
            i,
            &crate::share::Books {
                epoch: books.epoch,
                tenant: books.tenant,
                ..crate::share::Books::default()
            },
        );
    }
    b
}

/// A client's `prompt_cache_key` keeps short prompts (no full block to match) of one
/// conversation on one node in an idle fleet, and different keys spread.
#[test]
fn a_prompt_cache_key_is_an_affinity_hint() {
    let mut b = idle_fleet(6, "");
    let mut rng = SplitMix64::new(4);
    let mut nodes_of_key = vec![std::collections::BTreeSet::new(); 12];
    for round in 0..5 {
        for (key, set) in nodes_of_key.iter_mut().enumerate() {
            let body = format!(r#"{{"prompt":"hi {round}","prompt_cache_key":"conv-{key}"}}"#);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let chain = prompt::chain(Api::Chat, v.as_object().unwrap(), None, 256);
            assert!(chain.blocks.is_empty());
            let o = b.route(W, None, &chain, 10 + round, &mut rng, false, &mut OwnBooks);
            let t = routed(&o).unwrap();
            set.insert(t.node);
            finish(&mut b, &t, 100);
        }
    }
    assert!(
        nodes_of_key.iter().all(|s| s.len() == 1),
        "{nodes_of_key:?}"
    );
    let distinct: std::collections::BTreeSet<_> = nodes_of_key
        .iter()
        .flat_map(|s| s.iter().copied())
        .collect();
    assert!(distinct.len() >= 4, "{distinct:?}");
}

/// A node that reports its VRAM in bytes (the seed format has no cache geometry) is believed
/// to hold no more prompt blocks than its cache has room for, at `kv_bytes_per_token`: a small
/// node forgets old prefixes as its engine does, instead of being priced for a default size
/// several times its own.
#[test]
fn a_node_reporting_vram_bytes_sizes_its_share_of_the_index() {
    // 1 byte a token, 6,400 tokens of cache: 100 blocks of 64 tokens (256 characters).
    let mut b = idle_fleet(1, r#","choices":0,"kv_bytes_per_token":1"#);
    let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"vram_used_bytes":0,"vram_total_bytes":6400}"#;
    b.on_health(0, Some(body), 5).unwrap();
    let mut rng = SplitMix64::new(2);
    for tenant in 0..10 {
        // About 32 blocks each: 320 blocks sent in all.
        let sys = system(200 + tenant, 8_000);
        let t = routed(&go(&mut b, &prompt(&sys, "q", 10), 10, &mut rng)).unwrap();
        finish(&mut b, &t, 10);
    }
    let held = b.prefixes().unwrap().held_by(0);
    assert!((90..=100).contains(&held), "{held} blocks believed held");
}

/// A slot given to another address holds no prefix: the new node is not priced as holding
/// what the old one held.
#[test]
fn a_node_replaced_in_its_slot_holds_nothing() {
    let mut b = following("");
    b.set_members(&members(&["10.0.0.1:8000", "10.0.0.2:8000"]), |_| false);
    for i in 0..2 {
        b.on_health(i, Some(IDLE), 0).unwrap();
    }
    let mut rng = SplitMix64::new(1);
    let sys = system(3, 8_000);
    let t = routed(&go(&mut b, &prompt(&sys, "q", 10), 10, &mut rng)).unwrap();
    assert!(b.prefixes().unwrap().held_by(t.node) > 0);
    finish(&mut b, &t, 10);
    let kept = if t.node == 0 {
        "10.0.0.2:8000"
    } else {
        "10.0.0.1:8000"
    };
    b.set_members(&members(&[kept]), |_| false);
    b.set_members(&members(&[kept, "10.0.0.9:8000"]), |_| false);
    assert_eq!(b.nodes()[t.node].address(), "10.0.0.9:8000");
    assert_eq!(b.prefixes().unwrap().held_by(t.node), 0);
}

/// The benchmarks' re-implementation of the inference gateway's scoring: a node holding the
/// whole prefix wins with a queue (3 for the prefix against 2 for the shortest queue) until its
/// KV-cache use takes enough off its score.
#[test]
fn the_gateway_profile_scores_queue_kv_and_prefix() {
    let mut b = idle_fleet(3, r#","policy":"gateway_profile""#);
    let mut rng = SplitMix64::new(8);
    let sys = system(4, 8_000);
    let t = routed(&go(&mut b, &prompt(&sys, "q", 10), 10, &mut rng)).unwrap();
    finish(&mut b, &t, 10);
    let home = t.node;
    let report = |q: u32, kv: f64| {
        format!(
            r#"{{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"queue_depth":{q},"kv_cache_usage":{kv}}}"#
        )
    };
    for i in 0..3 {
        let (q, kv) = if i == home { (5, 0.0) } else { (0, 0.0) };
        b.on_health(i, Some(report(q, kv).as_bytes()), 20).unwrap();
    }
    let t = routed(&go(&mut b, &prompt(&sys, "again", 10), 20, &mut rng)).unwrap();
    assert_eq!(t.node, home, "2 x 0 + 2 x 1 + 3 x 1 against 2 x 1 + 2 x 1");
    finish(&mut b, &t, 10);
    b.on_health(home, Some(report(5, 0.8).as_bytes()), 30)
        .unwrap();
    let t = routed(&go(&mut b, &prompt(&sys, "once more", 10), 30, &mut rng)).unwrap();
    assert_ne!(t.node, home, "2 x 0 + 2 x 0.2 + 3 x 1 against 4");
}

/// The candidates a routed request was weighed among (see `routers`).
fn choices_of(o: &Outcome) -> Option<usize> {
    match o {
        Outcome::Routed { choices, .. } => Some(usize::from(*choices)),
        _ => None,
    }
}

/// `choices: auto` behind one router: two candidates until the engines report this router's
/// requests, then 16 for prompts that are all new, and two again while the traffic reuses
/// prefixes (where a new prefix goes decides where its tenant's later requests go).
#[test]
fn auto_choices_follow_the_routers_and_the_reuse_of_prefixes() {
    let n = 20;
    let mut b = idle_fleet(n, "");
    let mut rng = SplitMix64::new(5);
    let unique = |i: u32| prompt(&system(1_000 + i, 2_000), "question", 50);
    // Unreported, and prompts taken as reused: two.
    let first = go(&mut b, &unique(0), 10, &mut rng);
    assert_eq!(choices_of(&first), Some(2));
    // Two hundred new prompts in flight, then reports that show each node running what this
    // router sent it: its share is all of it.
    let mut per_node = vec![0u32; n];
    for i in 1..200 {
        if let Some(t) = routed(&go(&mut b, &unique(i), 20, &mut rng)) {
            if let Some(c) = per_node.get_mut(t.node) {
                *c += 1;
            }
        }
    }
    for (i, c) in per_node.iter().enumerate() {
        let body = format!(
            r#"{{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000,"running_requests":{c},"queue_depth":0}}"#
        );
        b.on_health(i, Some(body.as_bytes()), 2_000).unwrap();
    }
    let new = go(&mut b, &unique(500), 2_000, &mut rng);
    assert_eq!(choices_of(&new), Some(routers::FEW_CHOICES));
    // A tenant's system prompt, sent over and over: once most prompts find their opening
    // cached, two candidates (its holders join them) for every prompt, new ones included.
    let sys = system(7, 4_000);
    for i in 0..200 {
        go(&mut b, &prompt(&sys, &format!("q{i}"), 10), 2_100, &mut rng);
    }
    let held = go(&mut b, &prompt(&sys, "again", 10), 2_200, &mut rng);
    assert_eq!(choices_of(&held), Some(2));
    let new = go(&mut b, &unique(900), 2_200, &mut rng);
    assert_eq!(choices_of(&new), Some(2));
}

/// Envoy's retries may serve a request on a later node of the routing header than the chosen
/// one: the booking moves there (taken off the chosen node), the prompt is recorded where it
/// was served, and it is priced there as cached as far as the index believes. The chosen node,
/// another balancer's ticket or an unknown address change nothing.
#[test]
fn a_request_served_elsewhere_is_booked_where_it_ran() {
    let mut b = idle_fleet(3, r#","choices":0"#);
    let mut rng = SplitMix64::new(5);
    let sys = system(2, 16_000);
    let first = prompt(&sys, "question 0", 50);
    let t = routed(&go(&mut b, &first, 10, &mut rng)).unwrap();
    let chosen = t.node;
    let other = (chosen + 1) % 3;
    let address = |i: usize| format!("127.0.0.1:{}", 8001 + i);
    let inflight = |b: &Balancer, i: usize| b.books(i).unwrap().inflight_requests;

    assert_eq!(
        b.moved(&t, &address(chosen), &first.1),
        None,
        "served where chosen"
    );
    assert_eq!(b.moved(&t, "10.0.0.9:8000", &first.1), None, "not a node");
    let mut stranger = idle_fleet(3, r#","choices":0"#);
    assert_eq!(
        stranger.moved(&t, &address(other), &first.1),
        None,
        "another balancer's"
    );
    assert_eq!((inflight(&b, chosen), inflight(&b, other)), (1, 0));

    let m = b.moved(&t, &address(other), &first.1).unwrap();
    assert_eq!(m.node, other);
    assert_eq!(m.weight, t.weight);
    assert_eq!(
        m.cached, 0,
        "the node it ran on was not believed to hold the prompt"
    );
    assert_eq!((inflight(&b, chosen), inflight(&b, other)), (0, 1));
    let blocks = first.1.blocks.len();
    assert!(blocks > 0);
    assert_eq!(
        b.prefixes().unwrap().matched(other, &first.1.blocks),
        blocks
    );
    finish(&mut b, &m, 50);
    assert_eq!((inflight(&b, chosen), inflight(&b, other)), (0, 0));

    // A later turn moved to a node that holds the prompt is priced as cached there.
    let later = prompt(&sys, "question 1", 50);
    let t = routed(&go(&mut b, &later, 20, &mut rng)).unwrap();
    let holder = if t.node == chosen { other } else { chosen };
    let m = b.moved(&t, &address(holder), &later.1).unwrap();
    assert!(
        m.cached > 3900,
        "priced as cached where it ran: {}",
        m.cached
    );
    finish(&mut b, &m, 50);
    assert!((0..3).all(|i| inflight(&b, i) == 0));
}

/// Envoy prints an IPv6 address in its shortest form; a node configured in another spelling
/// is still the node the response came from.
#[test]
fn a_node_is_recognised_in_any_spelling_of_its_address() {
    let cfg = crate::config::Config::parse(
        br#"{"nodes":[{"address":"[fd00:0:0::2]:8000"},{"address":"10.0.0.3:8000"}],"health_cluster":"h","choices":0}"#,
    )
    .unwrap();
    let mut b = Balancer::new(&cfg);
    for i in 0..2 {
        let body = br#"{"tokens_per_sec_load":0,"tokens_per_sec_capacity":1000}"#;
        b.on_health(i, Some(body), 0).unwrap();
    }
    let mut rng = SplitMix64::new(1);
    let p = prompt(&system(3, 2_000), "hello", 10);
    let t = routed(&go(&mut b, &p, 10, &mut rng)).unwrap();
    let (mine, other) = if t.node == 0 {
        ("[fd00::2]:8000", "10.0.0.3:8000")
    } else {
        ("10.0.0.3:8000", "[fd00::2]:8000")
    };
    assert_eq!(b.moved(&t, mine, &p.1), None, "served where chosen");
    let m = b.moved(&t, other, &p.1).unwrap();
    assert_eq!(m.node, 1 - t.node);
}
