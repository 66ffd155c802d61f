//! The full comparison: every fresh node that may serve the request, ranked by its predicted
//! time to serve (see `choice` for the rule). It places the requests the drawn candidates
//! cannot (`candidates::sample`), every request with `choices: 0`, and it is what tells a
//! saturated fleet apart (`AllOverCeiling`, least overflow first).
//!
//! It ranks on the books at hand: each node's in-flight books as this balancer last saw them.
//! Where the books are shared between VMs, reading a node's current ones is a host call, and a
//! comparison of every node must not cost one per node of the fleet: a thousand per request at
//! a thousand nodes, and as many again for the held request tried on every event while the
//! fleet is saturated. So `compare` ranks every node on the books at hand, then brings the
//! books of the best few up to date one at a time, in rank order, re-weighing each and ranking
//! again, until the nodes it would commit to (the routing header's) all have current books or
//! it has read `reads` of them. A node whose current books show more work than this balancer
//! knew drops down the ranking as soon as it comes near the top, and what was read stays for
//! the next decisions, so the view converges on the nodes that matter at a bounded cost per
//! decision. What it cannot see within the bound is a node that freed room since this
//! balancer last read its books while ranked below the best few: it is found once its books
//! are read again, which the balancer does for one more node, each in turn, on every full
//! comparison (a report does not clear books that still count finished requests).
//!
//! Only the best of each kind are kept as the nodes are ranked (a selection, no list of the
//! whole fleet), and exact ties are broken by a random key drawn for every node, so equal idle
//! nodes share a burst instead of the first one in the list taking it all.

use crate::config::Rule;
use crate::fleet::node::NodeState;
use crate::rng::Rng;
use crate::route::choice::{evaluate, may_serve, Ask, AssumedCapacity, FleetWide, Params, Ranked};
use std::cmp::Ordering;

/// Keeps the `keep` smallest by `cmp`, in order: a selection (linear) then a sort of `keep`.
fn best<T>(v: &mut Vec<T>, keep: usize, cmp: impl Fn(&T, &T) -> Ordering) {
    let keep = keep.max(1);
    if v.len() > keep {
        v.select_nth_unstable_by(keep - 1, &cmp);
        v.truncate(keep);
    }
    v.sort_by(cmp);
}

/// The `k` smallest items pushed, in order, by a strict ordering: the worst kept is compared
/// first, so an item that does not make the cut costs one comparison.
struct TopK<T> {
    k: usize,
    items: Vec<T>,
    cmp: fn(&T, &T) -> Ordering,
}

impl<T> TopK<T> {
    fn new(k: usize, cmp: fn(&T, &T) -> Ordering) -> Self {
        let k = k.max(1);
        TopK {
            k,
            items: Vec::with_capacity(k.min(64)),
            cmp,
        }
    }

    fn push(&mut self, x: T) {
        if self.items.len() >= self.k {
            match self.items.last() {
                Some(worst) if (self.cmp)(&x, worst) == Ordering::Less => {
                    self.items.pop();
                }
                _ => return,
            }
        }
        let at = self
            .items
            .partition_point(|y| (self.cmp)(y, &x) != Ordering::Greater);
        self.items.insert(at, x);
    }

    /// Takes out the items `out` says.
    fn remove(&mut self, out: impl Fn(&T) -> bool) {
        self.items.retain(|x| !out(x));
    }
}

/// What the rule decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Nodes to try, best first.
    Route(Vec<Ranked>),
    /// Every fresh node would pass the VRAM ceiling: nodes ordered by the overflow, least first.
    AllOverCeiling(Vec<Ranked>),
    /// No node has a fresh report: no basis to choose, Envoy's fallback balancer routes.
    NoFreshNodes,
}

/// A node ranked, with the random key that breaks its exact ties.
type Entry = (Ranked, u64);

/// Sooner first.
fn by_time((a, ka): &Entry, (b, kb): &Entry) -> Ordering {
    a.seconds.total_cmp(&b.seconds).then(ka.cmp(kb))
}

/// Least overflow first, then sooner.
fn by_overflow((a, ka): &Entry, (b, kb): &Entry) -> Ordering {
    a.kv_fraction
        .unwrap_or(0.0)
        .total_cmp(&b.kv_fraction.unwrap_or(0.0))
        .then(a.seconds.total_cmp(&b.seconds))
        .then(ka.cmp(kb))
}

/// The best nodes with room and the best without, as ranked so far.
struct Ranking {
    admitted: TopK<Entry>,
    over: TopK<Entry>,
    fleet: FleetWide,
}

/// What ranking the fleet gave: a ranking to refine, or, for the naive rule and a fleet with no
/// candidate, the decision itself.
enum Ranks {
    Ranking(Ranking),
    Done(Decision),
}

impl Ranking {
    /// Weighs node `i` (`n`, whose fresh report is `r`) and keeps it if it makes the cut.
    fn add(
        &mut self,
        i: usize,
        n: &NodeState,
        r: &crate::ingest::telemetry::Report,
        ask: &Ask,
        p: &Params,
        key: u64,
    ) {
        let (ranked, is_over) = evaluate(i, n, r, ask, &self.fleet, p);
        if is_over {
            self.over.push((ranked, key));
        } else {
            self.admitted.push((ranked, key));
        }
    }

    /// Takes node `i` out, and gives the key it was ranked with.
    fn take(&mut self, i: usize) -> Option<u64> {
        let key = self
            .admitted
            .items
            .iter()
            .chain(self.over.items.iter())
            .find(|(r, _)| r.node == i)
            .map(|(_, k)| *k);
        self.admitted.remove(|(r, _)| r.node == i);
        self.over.remove(|(r, _)| r.node == i);
        key
    }

    /// The nodes a decision would commit to: the best with room, or, when none has room, the
    /// least overflowing.
    fn front(&self) -> &[Entry] {
        if self.admitted.items.is_empty() {
            &self.over.items
        } else {
            &self.admitted.items
        }
    }

    fn into_decision(self, keep: usize) -> Decision {
        let keep = keep.max(1);
        let list = |t: TopK<Entry>| t.items.into_iter().take(keep).map(|(r, _)| r).collect();
        if self.admitted.items.is_empty() {
            Decision::AllOverCeiling(list(self.over))
        } else {
            Decision::Route(list(self.admitted))
        }
    }
}

/// The inference gateway's default scoring, as we re-implement it for the benchmarks (see
/// `config::Rule::GatewayProfile`): `2 q + 2 (1 - kv) + 3 prefix`, highest first, with `q` the
/// node's reported queue scaled so the shortest is 1 and the longest 0, `kv` its reported
/// KV-cache use and `prefix` the share of the prompt's chain it is believed to hold. The
/// `seconds` of each entry is the negated score (smaller is better, as elsewhere).
fn gateway_profile<'a>(
    fresh: impl Iterator<Item = (usize, &'a NodeState, &'a crate::ingest::telemetry::Report)>,
    ask: &Ask,
    p: &Params,
    rng: &mut dyn Rng,
) -> Vec<Ranked> {
    let nodes: Vec<(usize, f64, f64)> = fresh
        .map(|(i, _, r)| {
            let kv = r.kv_fraction().unwrap_or(0.0).clamp(0.0, 1.0);
            (i, r.queue_depth.unwrap_or(0.0), kv)
        })
        .collect();
    let (lo, hi) = nodes
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), (_, q, _)| {
            (lo.min(*q), hi.max(*q))
        });
    let blocks = ask.prefix.map_or(1, |x| x.chain.blocks.len().max(1)) as f64;
    let mut scored: Vec<Entry> = nodes
        .into_iter()
        .map(|(i, q, kv)| {
            let queue = if hi > lo { (hi - q) / (hi - lo) } else { 1.0 };
            let prefix = ask
                .prefix
                .map_or(0.0, |x| x.index.matched(i, &x.chain.blocks) as f64 / blocks);
            let score = 2.0 * queue + 2.0 * (1.0 - kv) + 3.0 * prefix;
            let cached = ask
                .prefix
                .map_or(0, |x| x.cached(i, ask.weight.prompt_tokens));
            let ranked = Ranked {
                node: i,
                seconds: -score,
                kv_fraction: Some(kv),
                cached,
                first_token_seconds: None,
                queued_seconds: None,
                tpot_seconds: None,
                prefill_room_seconds: None,
            };
            (ranked, rng.next_u64())
        })
        .collect();
    best(&mut scored, p.keep, by_time);
    scored.into_iter().map(|(r, _)| r).collect()
}

/// Ranks the fresh nodes that may serve the request, keeping the `k` best of each kind.
fn rank(
    nodes: &[NodeState],
    ask: &Ask,
    mean_request_tokens: f64,
    now_ms: u64,
    p: &Params,
    rng: &mut dyn Rng,
    k: usize,
) -> Ranks {
    // The fleet's fresh nodes set the assumed capacity; only the candidates among them are
    // ranked. Two passes, neither of which allocates: this runs on every request the draws
    // cannot place, and a list of a thousand nodes built per request costs more than a
    // second walk.
    let mut assumed = AssumedCapacity::default();
    let mut any = false;
    for (i, n) in nodes.iter().enumerate() {
        let Some(r) = n.fresh_report(now_ms, p.stale_after_ms) else {
            continue;
        };
        assumed.add(n, r);
        any |= may_serve(i, n, ask);
    }
    if !any {
        return Ranks::Done(Decision::NoFreshNodes);
    }
    let fresh = nodes.iter().enumerate().filter_map(|(i, n)| {
        let r = n.fresh_report(now_ms, p.stale_after_ms)?;
        may_serve(i, n, ask).then_some((i, n, r))
    });

    if p.rule == Rule::LeastReportedLoad {
        let mut ranked: Vec<Entry> = fresh
            .map(|(i, _, r)| {
                let ranked = Ranked {
                    node: i,
                    seconds: r.load_tokens_per_sec,
                    kv_fraction: None,
                    cached: 0,
                    first_token_seconds: None,
                    queued_seconds: None,
                    tpot_seconds: None,
                    prefill_room_seconds: None,
                };
                (ranked, rng.next_u64())
            })
            .collect();
        best(&mut ranked, p.keep, by_time);
        return Ranks::Done(Decision::Route(
            ranked.into_iter().map(|(r, _)| r).collect(),
        ));
    }

    if p.rule == Rule::GatewayProfile {
        return Ranks::Done(Decision::Route(gateway_profile(fresh, ask, p, rng)));
    }

    let mut ranking = Ranking {
        admitted: TopK::new(k, by_time),
        over: TopK::new(k, by_overflow),
        fleet: FleetWide {
            assumed_capacity: assumed.value(),
            mean_request_tokens,
        },
    };
    for (i, n, r) in fresh {
        // The random key breaks exact ties only; it is drawn for every node so that the
        // sequence drawn does not depend on which nodes tie.
        let key = rng.next_u64();
        ranking.add(i, n, r, ask, p, key);
    }
    Ranks::Ranking(ranking)
}

/// Ranks the fresh nodes that may serve the request, on the books at hand.
pub fn decide(
    nodes: &[NodeState],
    ask: &Ask,
    mean_request_tokens: f64,
    now_ms: u64,
    p: &Params,
    rng: &mut dyn Rng,
) -> Decision {
    match rank(nodes, ask, mean_request_tokens, now_ms, p, rng, p.keep) {
        Ranks::Ranking(ranking) => ranking.into_decision(p.keep),
        Ranks::Done(d) => d,
    }
}

/// `decide`, then the books of the nodes it would commit to brought up to date (see this
/// module): `refresh(i, n)` brings node `i`'s books up to date and says whether they changed;
/// it is called at most `reads` times, for the best nodes in rank order, each re-weighed on
/// its new books. With nothing to refresh (books that are this balancer's alone) the decision
/// is `decide`'s.
#[allow(clippy::too_many_arguments)]
pub fn compare(
    nodes: &mut [NodeState],
    ask: &Ask,
    mean_request_tokens: f64,
    now_ms: u64,
    p: &Params,
    rng: &mut dyn Rng,
    reads: usize,
    refresh: &mut dyn FnMut(usize, &mut NodeState) -> bool,
) -> Decision {
    // The `reads` nodes past the header a refresh may push down leave enough behind them.
    let k = p.keep.max(1).saturating_add(reads);
    let mut ranking = match rank(nodes, ask, mean_request_tokens, now_ms, p, rng, k) {
        Ranks::Ranking(ranking) => ranking,
        Ranks::Done(d) => return d,
    };
    let mut read: Vec<usize> = Vec::with_capacity(reads.min(64));
    while read.len() < reads {
        let next = ranking
            .front()
            .iter()
            .take(p.keep.max(1))
            .map(|(r, _)| r.node)
            .find(|i| !read.contains(i));
        let Some(i) = next else { break };
        read.push(i);
        let Some(n) = nodes.get_mut(i) else { continue };
        if !refresh(i, n) {
            continue;
        }
        let n = &*n;
        if let (Some(key), Some(r)) = (ranking.take(i), n.fresh_report(now_ms, p.stale_after_ms)) {
            ranking.add(i, n, r, ask, p, key);
        }
    }
    ranking.into_decision(p.keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::models::ServedModels;
    use crate::ingest::prompt::Chain;
    use crate::ingest::telemetry::Report;
    use crate::rng::SplitMix64;
    use crate::route::balancer::{Balancer, Outcome};
    use crate::route::choice::Growth;
    use crate::route::testing::{
        ask, cfg, node, order, rep, routed, routed_to, run, run_for, w, Counting, FULL, P, ROOM, W,
    };

    const NO_MARGIN: Growth = Growth {
        own: 1,
        margin_per_sqrt: 0.0,
        per_running: 0.0,
    };

    #[test]
    fn staleness_limit() {
        let nodes = vec![node(Some(rep(1.0, None)))];
        assert_eq!(order(&run(&nodes, w(1, 1), 4000)), vec![0]);
        assert_eq!(run(&nodes, w(1, 1), 4001), Decision::NoFreshNodes);
        assert_eq!(run(&[], w(1, 1), 0), Decision::NoFreshNodes);
    }

    #[test]
    fn all_over_ceiling_orders_by_least_overflow() {
        let full = |used: f64| {
            node(Some(Report {
                vram_used_bytes: Some(used),
                vram_total_bytes: Some(1000.0),
                ..rep(0.0, Some(1000.0))
            }))
        };
        let d = run(&[full(990.0), full(950.0), full(999.0)], w(10, 0), 2000);
        assert!(matches!(d, Decision::AllOverCeiling(_)));
        assert_eq!(order(&d), vec![1, 0, 2]);
    }

    #[test]
    fn the_naive_rule_follows_reported_load_only() {
        let naive = Params {
            rule: Rule::LeastReportedLoad,
            ..P
        };
        let full = Report {
            vram_used_bytes: Some(999.0),
            vram_total_bytes: Some(1000.0),
            ..rep(10.0, Some(100.0))
        };
        let mut nodes = vec![node(Some(full)), node(Some(rep(20.0, Some(100_000.0))))];
        // Blind to VRAM, capacity and its own dispatches: node 0 takes every request.
        for _ in 0..5 {
            let d = decide(
                &nodes,
                &ask(w(500, 500), None),
                100.0,
                2000,
                &naive,
                &mut SplitMix64::new(1),
            );
            assert_eq!(order(&d), vec![0, 1]);
            nodes[0].dispatch(0, w(500, 500), 500);
        }
    }

    #[test]
    fn exact_ties_are_broken_at_random_but_reproducibly() {
        let nodes: Vec<NodeState> = (0..4).map(|_| node(Some(rep(0.0, Some(1000.0))))).collect();
        let mut rng = SplitMix64::new(42);
        let tiny = Ask {
            weight: w(1, 1),
            growth: NO_MARGIN,
            model: None,
            named: false,
            prefix: None,
            pin: None,
        };
        let mut seen = [0usize; 4];
        for _ in 0..200 {
            let d = decide(&nodes, &tiny, 1.0, 2000, &P, &mut rng);
            seen[order(&d)[0]] += 1;
        }
        assert!(seen.iter().all(|&s| s > 20), "ties spread: {seen:?}");
        let a = decide(&nodes, &tiny, 1.0, 2000, &P, &mut SplitMix64::new(9));
        let b = decide(&nodes, &tiny, 1.0, 2000, &P, &mut SplitMix64::new(9));
        assert_eq!(a, b);
    }

    /// Nodes serving m1 (configured), m2 (listed), an adapter (seen in metrics on top of a
    /// list), and one whose set is unknown: (model asked, the nodes ranked).
    #[test]
    fn a_model_narrows_the_candidates() {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut nodes: Vec<NodeState> =
            (0..4).map(|_| node(Some(rep(0.0, Some(1000.0))))).collect();
        *nodes[0].models_mut() = ServedModels::configured(names(&["m1"]));
        nodes[1].models_mut().set_list(names(&["m2"]));
        nodes[2].models_mut().set_list(names(&["m2"]));
        nodes[2].models_mut().observe_metrics(&names(&["sql-lora"]));
        // Node 3: nothing known. The load orders the candidates: 0, 1, 2, 3 from least loaded.
        for (i, n) in nodes.iter_mut().enumerate() {
            n.accept_report(rep(100.0 * i as f64, Some(1000.0)), 1000);
        }
        let cases: &[(Option<&str>, &[usize])] = &[
            (None, &[0, 1, 2, 3]),
            (Some("m1"), &[0, 3]),
            (Some("m2"), &[1, 2, 3]),
            (Some("sql-lora"), &[2, 3]),
            (Some("other"), &[3]),
        ];
        for (model, want) in cases {
            assert_eq!(
                order(&run_for(&nodes, w(10, 10), *model, 2000)),
                *want,
                "{model:?}"
            );
        }
        // The unknown node known at last: a model nobody serves has no candidate.
        nodes[3].models_mut().set_list(names(&["m3"]));
        assert_eq!(
            run_for(&nodes, w(10, 10), Some("other"), 2000),
            Decision::NoFreshNodes
        );
        // A stale node serving the model is no candidate either.
        assert_eq!(
            run_for(&nodes, w(10, 10), Some("m1"), 5000),
            Decision::NoFreshNodes
        );
        // The naive rule narrows the same way.
        let naive = Params {
            rule: Rule::LeastReportedLoad,
            ..P
        };
        let d = decide(
            &nodes,
            &ask(w(1, 1), Some("m2")),
            1.0,
            2000,
            &naive,
            &mut SplitMix64::new(1),
        );
        assert_eq!(order(&d), vec![1, 2]);
    }

    /// Narrowing does not change what a node's missing capacity is assumed to be: the fleet's
    /// largest, even when the fast node serves another model.
    #[test]
    fn assumed_capacity_is_the_fleets_whatever_the_model() {
        let mut fast = node(Some(rep(0.0, Some(10_000.0))));
        *fast.models_mut() = ServedModels::configured(vec!["big".into()]);
        let mut unreported = node(Some(rep(500.0, None)));
        *unreported.models_mut() = ServedModels::configured(vec!["small".into()]);
        let mut slow = node(Some(rep(400.0, Some(1000.0))));
        *slow.models_mut() = ServedModels::configured(vec!["small".into()]);
        // Unreported at the fleet's 10,000: 9,500 spare against the slow node's 600.
        assert_eq!(
            order(&run_for(
                &[fast, unreported, slow],
                w(10, 10),
                Some("small"),
                2000
            )),
            vec![1, 2]
        );
    }

    /// A thousand nodes over the VRAM ceiling: every decision (and every held request tried
    /// again, see `admission`) reads a bounded number of books, not one per node, and still
    /// finds the node that has room, or tells it is full after all.
    #[test]
    fn a_saturated_fleet_costs_a_bounded_number_of_book_reads() {
        let bound = 2 * 2 + crate::route::balancer::COMPARISON_READS;
        let mut b = Balancer::new(&cfg(1000, r#","kv_bytes_per_token":1"#));
        for i in 0..1000 {
            b.on_health(i, Some(FULL), 0).unwrap();
        }
        let mut rng = SplitMix64::new(3);
        for _ in 0..20 {
            let mut books = Counting::new(|_| false);
            assert_eq!(
                b.route(W, None, &Chain::NONE, 10, &mut rng, true, &mut books),
                Outcome::Saturated
            );
            assert!(books.reads <= bound, "{} reads", books.reads);
        }
        // One node reports room: it is found.
        b.on_health(777, Some(ROOM), 20).unwrap();
        let mut books = Counting::new(|_| false);
        let t = routed(&b.route(W, None, &Chain::NONE, 30, &mut rng, true, &mut books)).unwrap();
        assert_eq!(t.node, 777);
        assert!(books.reads <= bound, "{} reads", books.reads);
        b.release(&t, 0);
        // Another worker has filled it since (its shared books say so), and node 778 reports
        // room too: the books read before committing send the request to 778.
        b.on_health(778, Some(ROOM), 40).unwrap();
        let mut books = Counting::new(|i| i == 777);
        assert_eq!(
            routed_to(&b.route(W, None, &Chain::NONE, 50, &mut rng, true, &mut books)),
            Some(778)
        );
        assert!(books.reads <= bound, "{} reads", books.reads);
    }

    /// Without books to refresh (a balancer that is the only one dispatching, as in the
    /// simulator), `compare` decides as `decide` does, on the same random draws: random
    /// fleets of loaded, full and stale nodes, with every kind of header length.
    #[test]
    fn compare_without_refreshes_is_decide() {
        let mut gen = SplitMix64::new(77);
        for case in 0..300 {
            let n = 1 + (gen.next_u64() % 40) as usize;
            let mut nodes: Vec<NodeState> = (0..n)
                .map(|_| {
                    let used = (gen.next_u64() % 1000) as f64;
                    let r = Report {
                        vram_used_bytes: Some(used),
                        vram_total_bytes: Some(1000.0),
                        queue_depth: Some((gen.next_u64() % 5) as f64),
                        ..rep((gen.next_u64() % 1000) as f64, Some(1000.0))
                    };
                    let mut s = node(Some(r));
                    if gen.next_u64() % 4 == 0 {
                        s.dispatch(0, w(10, 10), 10);
                    }
                    s
                })
                .collect();
            let p = Params {
                keep: 1 + (gen.next_u64() % 4) as usize,
                ..P
            };
            let a = ask(w(1 + gen.next_u64() % 300, 10), None);
            let now = 1000 + gen.next_u64() % 4000;
            let seed = gen.next_u64();
            let want = decide(&nodes, &a, 50.0, now, &p, &mut SplitMix64::new(seed));
            let mut calls = 0;
            let got = compare(
                &mut nodes,
                &a,
                50.0,
                now,
                &p,
                &mut SplitMix64::new(seed),
                8,
                &mut |_, _| {
                    calls += 1;
                    false
                },
            );
            assert_eq!(got, want, "case {case}");
            assert!(calls <= 8);
        }
    }
}
