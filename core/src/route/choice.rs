//! The choice: which node will serve this request soonest without overflowing its VRAM.
//!
//! For every node with a fresh report the filter predicts the time to serve the request:
//!
//! ```text
//!   spare    S = max(C - L, 5% of C)                tokens/s the node has free
//!   backlog  B = queue_depth * mean_request_tokens  work waiting at the node (reported)
//!              + unreflected_tokens                 work this filter sent since that report
//!              + running * mean_output / 2          output still to come where it runs
//!   time     T = (B + w) / S                        w = prompt + output tokens of the request
//! ```
//!
//! with `L` the reported token load and `C` the capacity (configured, else reported, else the
//! largest capacity known in the fleet, else twice the largest load, so that nodes reporting
//! only a load are ranked by load). This is the sojourn time of a work-conserving queue that
//! drains at the node's spare rate: a fast GPU with room beats a slow idle one, a node whose
//! queue is long loses even when its throughput looks fine (throughput saturates, the queue
//! does not), and the unreflected term moves a node down the ranking with every request sent to
//! it before the next report, so a burst spreads instead of herding. The output still to come
//! of the sequences the node reports running counts as work ahead too: an engine spends each
//! iteration's token budget on its decoders before any prefill, so a node busy decoding starts
//! a new prompt late (in the simulator, leaving it out tripled the p99 TTFT behind 16 replicas). The 5% floor keeps a
//! saturated node finite, ranked among saturated peers by its backlog. T is an ordering key, not
//! a latency forecast: only the order matters, which is why the rule stays robust to telemetry
//! that is off by a constant factor (the same spirit as tower's `Load` that only needs `Ord`).
//!
//! The predictive safety valve (the seed article's term): a node is excluded when admitting the
//! request would push its predicted KV-cache use over the ceiling. Predicted use is the reported
//! use plus what is still to come: the prompts sent since the report, the output the requests in
//! flight may still generate (running sequences grow one KV slot a token; ignoring that growth
//! is how a node that looks 85% full overflows a minute later), and this request's own prompt
//! and output. Output is booked at the learned mean, and the uncertainty is reserved once per
//! node for everything in flight there: z standard deviations of one output times the square
//! root of the number in flight (the standard deviation of a sum of independent lengths), not
//! z deviations per request. The growth still to come is this router's books, or, when larger,
//! the node's reported running sequences times half a mean output: behind several Envoy
//! replicas each router's books hold only its own share of what runs there. Reserving each request at its own 90th percentile assumes they
//! all run long at once; with 60 sequences on a node that books several times the growth that
//! happens, keeps the cache a third empty and, with holding, makes requests wait for room that
//! is there. Before enough outputs are learned, each request books its cap instead.
//! When every fresh node would overflow, the decision says so (`AllOverCeiling`, least overflow
//! first): the caller either holds the request until a node has room (`admission`, when
//! `max_hold_ms` is set) or sends it to the one that overflows least.
//!
//! Which nodes are compared: by default two, drawn in proportion to their capacity (`sample`,
//! power-of-two choices; `pool` says why). Every Envoy worker and every Envoy replica ranks
//! the same reports between two polls, and its own in-flight correction only sees its own
//! dispatches: comparing every node makes them all pick the same node (herding). Two random
//! candidates, the better one kept, spread independent routers and still steer away from
//! loaded nodes; a request the drawn nodes cannot take without passing the VRAM ceiling is
//! placed by comparing every node (`decide`), which is also what tells a saturated fleet apart.
//! `choices: 0` compares every node on every request.
//!
//! Exact ties are broken at random with the injected generator, so equal idle nodes share a
//! burst instead of the first one in the list taking it all.
//!
//! A request that names a model is ranked among the nodes that serve it, or might (a node whose
//! set is not known, see `models`); the others are not candidates at all, as a stale node is
//! not. The capacity assumed for nodes that report none is still the fleet's: which nodes serve
//! a model says nothing about how fast an unreported one is.

use crate::config::Rule;
use crate::fleet::models::Serves;
use crate::fleet::node::NodeState;
use crate::ingest::request::Weight;
use crate::ingest::telemetry::Report;
use crate::rng::Rng;

/// Knobs of the rule, from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Params {
    pub rule: Rule,
    pub stale_after_ms: u64,
    pub vram_ceiling: f64,
    pub kv_bytes_per_token: u64,
    /// How many nodes of the ranking the caller uses (the routing header's length): only
    /// those are put in order, the rest are dropped unsorted, so a decision over a thousand
    /// nodes is a linear selection, not a sort.
    pub keep: usize,
    /// Candidates compared per request (power-of-d choices); 0 compares every node.
    pub choices: usize,
}

/// Keeps the `keep` smallest by `cmp`, in order: a selection (linear) then a sort of `keep`.
fn best<T>(v: &mut Vec<T>, keep: usize, cmp: impl Fn(&T, &T) -> std::cmp::Ordering) {
    let keep = keep.max(1);
    if v.len() > keep {
        v.select_nth_unstable_by(keep - 1, &cmp);
        v.truncate(keep);
    }
    v.sort_by(cmp);
}

/// The `k` smallest items pushed, in order, by a strict ordering: the worst kept is compared
/// first, so an item that does not make the cut costs one comparison.
struct TopK<T, F: Fn(&T, &T) -> std::cmp::Ordering> {
    k: usize,
    items: Vec<T>,
    cmp: F,
}

impl<T, F: Fn(&T, &T) -> std::cmp::Ordering> TopK<T, F> {
    fn new(k: usize, cmp: F) -> Self {
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
                Some(worst) if (self.cmp)(&x, worst) == std::cmp::Ordering::Less => {
                    self.items.pop();
                }
                _ => return,
            }
        }
        let at = self
            .items
            .partition_point(|y| (self.cmp)(y, &x) != std::cmp::Ordering::Greater);
        self.items.insert(at, x);
    }
}

/// Share of capacity assumed free on a saturated node.
const MIN_SPARE_SHARE: f64 = 0.05;

/// One node in the ranking.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    pub node: usize,
    /// Predicted time to serve, seconds (an ordering key).
    pub seconds: f64,
    /// Predicted KV-cache use after admission, when the node reports enough to tell.
    pub kv_fraction: Option<f64>,
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

/// Predicted KV-cache fraction on the node after admitting `extra_tokens` more context.
fn kv_fraction(node: &NodeState, r: &Report, extra_tokens: u64, p: &Params) -> Option<f64> {
    let extra = extra_tokens as f64;
    if let (Some(used), Some(total)) = (r.vram_used_bytes, r.vram_total_bytes) {
        return Some((used + extra * p.kv_bytes_per_token as f64) / total);
    }
    let usage = r.kv_cache_usage?;
    // The size the engine publishes (its cache geometry) is exact; the configured one is the
    // operator's fallback for engines that publish none.
    match r
        .kv_cache_tokens
        .or(node.kv_cache_tokens().map(|k| k as f64))
    {
        Some(k) if k > 0.0 => Some(usage + extra / k),
        // Without the cache size the request cannot be sized: only a full cache is known.
        _ => Some(usage),
    }
}

/// The KV growth to reserve: this request's expected output, and the margin for the
/// uncertainty of the output of everything in flight on a node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Growth {
    /// Output tokens this request is expected to add to the cache.
    pub own: u64,
    /// Margin per square root of the number of requests in flight on the node (z times the
    /// standard deviation of one output length); 0 when nothing is learned yet.
    pub margin_per_sqrt: f64,
    /// Output still to come of one sequence the node reports running (half a mean output):
    /// the growth of the requests other routers sent, which this one has no books for.
    pub per_running: f64,
}

/// The request being placed: its cost, the KV growth to reserve for it, and its model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask<'a> {
    pub weight: Weight,
    pub growth: Growth,
    /// The body's `model`; `None` puts no restriction on the nodes.
    pub model: Option<&'a str>,
}

/// Whether node `n` may serve a request for `model`: there is no restriction, or the node
/// serves the model or might (its set is not known).
pub fn may_serve(n: &NodeState, model: Option<&str>) -> bool {
    match model {
        None => true,
        Some(m) => n.models().serves(m) != Serves::No,
    }
}

/// The capacity assumed for a node that reports none and has none configured: the largest
/// capacity known among the fresh nodes, else twice their largest load, so that nodes
/// reporting only a load are ranked by load. Every fresh node is `add`ed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AssumedCapacity {
    known: Option<f64>,
    max_load: f64,
}

impl AssumedCapacity {
    /// Takes fresh node `n`, whose report is `r`, into account.
    pub fn add(&mut self, n: &NodeState, r: &Report) {
        if let Some(c) = n.known_capacity(r) {
            self.known = Some(self.known.map_or(c, |m| m.max(c)));
        }
        self.max_load = self.max_load.max(r.load_tokens_per_sec);
    }

    /// The capacity assumed, tokens per second.
    pub fn value(&self) -> f64 {
        self.known.unwrap_or(2.0 * self.max_load + 1.0)
    }
}

/// What the fleet as a whole contributes to one node's evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fleet {
    /// Capacity assumed for a node that reports none and has none configured.
    pub assumed_capacity: f64,
    /// Running mean of request size, tokens: turns a reported queue depth into work.
    pub mean_request_tokens: f64,
}

/// One node's predicted time to serve the request and KV use after admitting it, and whether
/// that use passes the ceiling. `r` is the node's fresh report.
pub fn evaluate(
    node: usize,
    n: &NodeState,
    r: &Report,
    ask: &Ask,
    fleet: &Fleet,
    p: &Params,
) -> (Ranked, bool) {
    let (weight, growth) = (ask.weight, ask.growth);
    let c = n.capacity(r, fleet.assumed_capacity);
    let books = n.books();
    let spare = (c - r.load_tokens_per_sec).max(MIN_SPARE_SHARE * c);
    // Output the running sequences still have to generate, estimated from the node's reported
    // running count (half a mean output each): the same figure behind any number of Envoy
    // replicas, where each router's books hold only its own share. It is work ahead of the
    // request: decode tokens take an iteration's budget before any prefill, so a node busy
    // decoding many sequences starts a new prompt late. (This router's books are not used
    // here: one long stream of its own is one token an iteration, not work ahead.) For the
    // KV the cache must still hold, the larger of books and estimate stands.
    let reported_growth = r.running_requests.unwrap_or(0.0) * growth.per_running;
    let still_to_come = (books.growth_tokens as f64).max(reported_growth);
    let backlog = r.queue_depth.unwrap_or(0.0) * fleet.mean_request_tokens
        + books.unreflected_tokens as f64
        + reported_growth;
    let seconds = (backlog + weight.total() as f64) / spare;
    // KV still to come: prompts sent since the report, the output reserved for everything
    // in flight, and this request's own prompt and reserved output.
    let margin = growth.margin_per_sqrt * (books.inflight_requests.saturating_add(1) as f64).sqrt();
    let still_to_come = still_to_come as u64;
    let kv_extra = books
        .unreflected_prompt_tokens
        .saturating_add(still_to_come)
        .saturating_add(weight.prompt_tokens)
        .saturating_add(growth.own)
        .saturating_add(margin.ceil() as u64);
    let kv = kv_fraction(n, r, kv_extra, p);
    let ranked = Ranked {
        node,
        seconds,
        kv_fraction: kv,
    };
    (ranked, matches!(kv, Some(f) if f > p.vram_ceiling))
}

/// Ranks the fresh nodes that may serve the request.
pub fn decide(
    nodes: &[NodeState],
    ask: &Ask,
    mean_request_tokens: f64,
    now_ms: u64,
    p: &Params,
    rng: &mut dyn Rng,
) -> Decision {
    // The fleet's fresh nodes set the assumed capacity; only the candidates among them are
    // ranked. Two passes, neither of which allocates: this runs on every request the draws
    // cannot place, and a list of a thousand nodes built per request costs more than a
    // second walk.
    let mut assumed = AssumedCapacity::default();
    let mut any = false;
    for n in nodes {
        let Some(r) = n.fresh_report(now_ms, p.stale_after_ms) else {
            continue;
        };
        assumed.add(n, r);
        any |= may_serve(n, ask.model);
    }
    if !any {
        return Decision::NoFreshNodes;
    }
    let assumed_capacity = assumed.value();
    let fresh = nodes.iter().enumerate().filter_map(|(i, n)| {
        let r = n.fresh_report(now_ms, p.stale_after_ms)?;
        may_serve(n, ask.model).then_some((i, n, r))
    });

    if p.rule == Rule::LeastReportedLoad {
        let mut ranked: Vec<(Ranked, u64)> = fresh
            .map(|(i, _, r)| {
                let ranked = Ranked {
                    node: i,
                    seconds: r.load_tokens_per_sec,
                    kv_fraction: None,
                };
                (ranked, rng.next_u64())
            })
            .collect();
        best(&mut ranked, p.keep, |(a, ka), (b, kb)| {
            a.seconds.total_cmp(&b.seconds).then(ka.cmp(kb))
        });
        return Decision::Route(ranked.into_iter().map(|(r, _)| r).collect());
    }

    let fleet = Fleet {
        assumed_capacity,
        mean_request_tokens,
    };
    // Only the `keep` best of each kind are kept, as they come: no list of the whole fleet.
    let mut admitted = TopK::new(
        p.keep,
        |(a, ka): &(Ranked, u64), (b, kb): &(Ranked, u64)| {
            a.seconds.total_cmp(&b.seconds).then(ka.cmp(kb))
        },
    );
    let mut over = TopK::new(
        p.keep,
        |(a, ka): &(Ranked, u64), (b, kb): &(Ranked, u64)| {
            a.kv_fraction
                .unwrap_or(0.0)
                .total_cmp(&b.kv_fraction.unwrap_or(0.0))
                .then(a.seconds.total_cmp(&b.seconds))
                .then(ka.cmp(kb))
        },
    );
    for (i, n, r) in fresh {
        let (ranked, is_over) = evaluate(i, n, r, ask, &fleet, p);
        // The random key breaks exact ties only; it is drawn for every node so that the
        // sequence drawn does not depend on which nodes tie.
        let key = rng.next_u64();
        if is_over {
            over.push((ranked, key));
        } else {
            admitted.push((ranked, key));
        }
    }
    if admitted.items.is_empty() {
        return Decision::AllOverCeiling(over.items.into_iter().map(|(r, _)| r).collect());
    }
    Decision::Route(admitted.items.into_iter().map(|(r, _)| r).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::models::ServedModels;
    use crate::rng::SplitMix64;

    const P: Params = Params {
        rule: Rule::TokenThroughput,
        stale_after_ms: 3000,
        vram_ceiling: 0.9,
        kv_bytes_per_token: 1,
        keep: usize::MAX,
        choices: 0,
    };

    fn w(p: u64, o: u64) -> Weight {
        Weight {
            prompt_tokens: p,
            output_tokens: o,
        }
    }

    fn node(report: Option<Report>) -> NodeState {
        configured(report, None, None)
    }

    /// A node with a configured capacity and KV-cache size, reported at 1000.
    fn configured(report: Option<Report>, capacity: Option<f64>, kv: Option<u64>) -> NodeState {
        let mut n = NodeState::new("127.0.0.1:1", capacity, kv);
        if let Some(r) = report {
            n.accept_report(r, 1000);
        }
        n
    }

    fn rep(load: f64, cap: Option<f64>) -> Report {
        Report {
            load_tokens_per_sec: load,
            capacity_tokens_per_sec: cap,
            ..Report::default()
        }
    }

    fn order(d: &Decision) -> Vec<usize> {
        match d {
            Decision::Route(r) | Decision::AllOverCeiling(r) => r.iter().map(|x| x.node).collect(),
            Decision::NoFreshNodes => vec![],
        }
    }

    const NO_MARGIN: Growth = Growth {
        own: 1,
        margin_per_sqrt: 0.0,
        per_running: 0.0,
    };

    /// A request of `weight` for `model`, reserving its whole output, no margin.
    fn ask(weight: Weight, model: Option<&str>) -> Ask<'_> {
        Ask {
            weight,
            growth: Growth {
                own: weight.output_tokens,
                margin_per_sqrt: 0.0,
                per_running: 0.0,
            },
            model,
        }
    }

    fn run(nodes: &[NodeState], weight: Weight, now: u64) -> Decision {
        run_for(nodes, weight, None, now)
    }

    fn run_for(nodes: &[NodeState], weight: Weight, model: Option<&str>, now: u64) -> Decision {
        decide(
            nodes,
            &ask(weight, model),
            100.0,
            now,
            &P,
            &mut SplitMix64::new(1),
        )
    }

    #[test]
    fn table_of_choices() {
        let vram = |used: f64, total: f64| Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(1000.0),
            vram_used_bytes: Some(used),
            vram_total_bytes: Some(total),
            ..Report::default()
        };
        type Case = (&'static str, Vec<NodeState>, Weight, Vec<usize>);
        let cases: Vec<Case> = vec![
            (
                "lowest load wins at equal capacity",
                vec![
                    node(Some(rep(900.0, Some(1000.0)))),
                    node(Some(rep(100.0, Some(1000.0)))),
                    node(Some(rep(500.0, Some(1000.0)))),
                ],
                w(100, 100),
                vec![1, 2, 0],
            ),
            (
                "a fast busy GPU beats a slow idle one",
                vec![
                    node(Some(rep(0.0, Some(1000.0)))),
                    node(Some(rep(5000.0, Some(10000.0)))),
                ],
                w(100, 100),
                vec![1, 0],
            ),
            (
                "load only, no capacity anywhere: ranked by load",
                vec![
                    node(Some(rep(30.0, None))),
                    node(Some(rep(10.0, None))),
                    node(Some(rep(20.0, None))),
                ],
                w(1, 1),
                vec![1, 2, 0],
            ),
            (
                "stale and unreported nodes are not candidates",
                vec![node(None), node(Some(rep(999.0, Some(1000.0))))],
                w(1, 1),
                vec![1],
            ),
            (
                "queue depth counts as backlog",
                vec![
                    node(Some(Report {
                        queue_depth: Some(50.0),
                        ..rep(100.0, Some(1000.0))
                    })),
                    node(Some(rep(300.0, Some(1000.0)))),
                ],
                w(10, 10),
                vec![1, 0],
            ),
            (
                "VRAM ceiling excludes a node that would overflow",
                vec![
                    node(Some(vram(850.0, 1000.0))),
                    node(Some(Report {
                        load_tokens_per_sec: 900.0,
                        ..vram(0.0, 1000.0)
                    })),
                ],
                w(60, 0),
                vec![1],
            ),
            (
                "a small request still fits under the ceiling",
                vec![
                    node(Some(vram(850.0, 1000.0))),
                    node(Some(Report {
                        load_tokens_per_sec: 900.0,
                        ..vram(0.0, 1000.0)
                    })),
                ],
                w(20, 20),
                vec![0, 1],
            ),
        ];
        for (name, nodes, weight, want) in cases {
            assert_eq!(order(&run(&nodes, weight, 2000)), want, "{name}");
        }
    }

    #[test]
    fn staleness_limit() {
        let nodes = vec![node(Some(rep(1.0, None)))];
        assert_eq!(order(&run(&nodes, w(1, 1), 4000)), vec![0]);
        assert_eq!(run(&nodes, w(1, 1), 4001), Decision::NoFreshNodes);
        assert_eq!(run(&[], w(1, 1), 0), Decision::NoFreshNodes);
    }

    #[test]
    fn capacity_override_wins_over_report() {
        let slow = configured(Some(rep(500.0, Some(100_000.0))), Some(600.0), None);
        let other = node(Some(rep(500.0, Some(2000.0))));
        assert_eq!(order(&run(&[slow, other], w(10, 10), 2000)), vec![1, 0]);
    }

    #[test]
    fn unreflected_dispatches_push_a_node_down() {
        let mut nodes = vec![
            node(Some(rep(100.0, Some(1000.0)))),
            node(Some(rep(150.0, Some(1000.0)))),
        ];
        assert_eq!(order(&run(&nodes, w(50, 50), 2000))[0], 0);
        // A burst between two reports spreads across both nodes instead of herding on node 0.
        let mut picks = [0usize; 2];
        for _ in 0..20 {
            let first = order(&run(&nodes, w(50, 50), 2000))[0];
            picks[first] += 1;
            nodes[first].dispatch(first, w(50, 50), 50);
        }
        assert!(picks[0] >= 5 && picks[1] >= 5, "burst split {picks:?}");
    }

    #[test]
    fn unreflected_work_counts_against_the_vram_ceiling() {
        let report = Report {
            vram_used_bytes: Some(0.0),
            vram_total_bytes: Some(1000.0),
            ..rep(0.0, Some(1000.0))
        };
        let mut n = node(Some(report));
        assert!(matches!(
            run(&[n.clone()], w(400, 0), 2000),
            Decision::Route(_)
        ));
        n.dispatch(0, w(600, 0), 0);
        assert!(matches!(
            run(&[n], w(400, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
    }

    #[test]
    fn growth_of_running_requests_counts_against_the_vram_ceiling() {
        let report = |used: f64| Report {
            vram_used_bytes: Some(used),
            vram_total_bytes: Some(1000.0),
            ..rep(0.0, Some(1000.0))
        };
        let mut n = node(Some(report(0.0)));
        let t = n.dispatch(0, w(100, 500), 500);
        // The next report shows the prompt's KV; the 500 output tokens are still to come.
        n.accept_report(report(100.0), 1500);
        assert!(matches!(
            run(&[n.clone()], w(400, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // Once the stream has generated its output and ended, the room is back.
        n.progress(&t, 0, 500);
        n.release(&t, 500);
        n.accept_report(report(0.0), 1800);
        assert!(matches!(run(&[n], w(400, 0), 2000), Decision::Route(_)));
    }

    /// The uncertainty of in-flight output is pooled per node: sixteen requests booked at
    /// their mean of 100 leave room for one more with a margin of 2 sd x sqrt(17), where
    /// booking each at mean + 2 sd (17 x 300 tokens: 1.01 of the cache) would call it full.
    #[test]
    fn growth_margin_is_pooled_over_the_requests_in_flight() {
        let mut n = configured(
            Some(Report {
                kv_cache_usage: Some(0.5),
                ..rep(0.0, Some(1000.0))
            }),
            None,
            Some(10_000),
        );
        for _ in 0..16 {
            n.dispatch(0, w(0, 100), 100);
        }
        let decide_with = |margin_per_sqrt: f64| {
            decide(
                std::slice::from_ref(&n),
                &Ask {
                    weight: w(100, 100),
                    growth: Growth {
                        own: 100,
                        margin_per_sqrt,
                        per_running: 0.0,
                    },
                    model: None,
                },
                100.0,
                2000,
                &P,
                &mut SplitMix64::new(1),
            )
        };
        // sd 100: 0.5 + (1600 + 100 + 100 + 200 * sqrt(17)) / 10000 = 0.76
        let Decision::Route(r) = decide_with(200.0) else {
            panic!("the node has room")
        };
        let kv = r[0].kv_fraction.unwrap();
        assert!((kv - 0.7625).abs() < 1e-3, "{kv}");
        // sd 300: 0.5 + (1800 + 600 * sqrt(17)) / 10000 = 0.93, over the ceiling.
        assert!(matches!(decide_with(600.0), Decision::AllOverCeiling(_)));
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
    fn kv_fraction_forms() {
        let frac = |usage: f64, k: Option<u64>| {
            configured(
                Some(Report {
                    kv_cache_usage: Some(usage),
                    ..rep(0.0, Some(1000.0))
                }),
                None,
                k,
            )
        };
        // Fraction plus a configured size: the request is sized.
        assert!(matches!(
            run(&[frac(0.5, Some(1000))], w(300, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[frac(0.5, Some(1000))], w(500, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // A size the node reports itself is used, ahead of the configured one.
        let reported = |usage: f64, k: Option<u64>| {
            let mut n = frac(usage, k);
            n.accept_report(
                Report {
                    kv_cache_tokens: Some(1000.0),
                    ..*n.fresh_report(1000, 3000).unwrap()
                },
                1000,
            );
            n
        };
        assert!(matches!(
            run(&[reported(0.5, None)], w(300, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[reported(0.5, Some(1_000_000))], w(500, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
        // Fraction alone: only an already-full cache excludes.
        assert!(matches!(
            run(&[frac(0.5, None)], w(1_000_000, 0), 2000),
            Decision::Route(_)
        ));
        assert!(matches!(
            run(&[frac(0.95, None)], w(1, 0), 2000),
            Decision::AllOverCeiling(_)
        ));
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

    /// Sequences another router sent grow too: a node reporting 40 running sequences and 60%
    /// KV use has no room for a request once their output still to come (half a mean output
    /// of 200 each) is counted, although this router's own books for it are empty.
    #[test]
    fn reported_running_sequences_count_as_growth() {
        let r = Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(1000.0),
            vram_used_bytes: Some(6000.0),
            vram_total_bytes: Some(10_000.0),
            running_requests: Some(40.0),
            ..Report::default()
        };
        let nodes = [node(Some(r))];
        let place = |per_running: f64| {
            let ask = Ask {
                weight: w(100, 100),
                growth: Growth {
                    own: 100,
                    margin_per_sqrt: 0.0,
                    per_running,
                },
                model: None,
            };
            decide(&nodes, &ask, 100.0, 2000, &P, &mut SplitMix64::new(1))
        };
        // Without: 6000 + 200 of 10000 is under the 0.9 ceiling.
        assert!(matches!(place(0.0), Decision::Route(_)));
        // With: 6000 + 40 * 100 + 200 is over it.
        assert!(matches!(place(100.0), Decision::AllOverCeiling(_)));
    }
}
