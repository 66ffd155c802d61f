//! The candidate pool: which nodes a request may be sent to, and how likely each is to be drawn
//! for the power-of-d choices (see `choice`).
//!
//! Comparing every node on every request is what herds: between two health reports every
//! Envoy worker and replica ranks the same stale figures the same way and sends its requests to
//! the same "best" node (Mitzenmacher, "How Useful Is Old Information?", IEEE TPDS 2000, shows
//! the global minimum on old data is worse than two random choices). Drawing a few candidates
//! at random and keeping the best of them spreads the requests of independent routers while
//! still steering away from loaded nodes (Mitzenmacher, "The Power of Two Choices in
//! Randomized Load Balancing", 2001; tower's `balance::p2c`). GPU fleets are not uniform, so a
//! node is drawn in proportion to its capacity: an H100 is drawn about three times as often as
//! an L4 and then compared on its predicted time to serve, as in weighted power-of-two-choices.
//!
//! Drawing needs the set of candidates and their cumulative weights, and computing that walks
//! the fleet: it is done when the set changes (a node's first report, an ejection or
//! readmission, a model list, the configuration), when a member's report goes stale, and at
//! least every `REBUILD_MS` so that the weights follow learned capacities, never per request.
//! Between two rebuilds a drawn node is still checked for freshness, so a stale one is never
//! chosen; a node that became a candidate since the last rebuild is only missed until the next
//! one.

use std::collections::HashMap;

use crate::config::Rule;
use crate::fleet::node::NodeState;
use crate::ingest::prompt::{finish, hash_str};
use crate::rng::Rng;
use crate::route::choice::{evaluate, may_serve, Ask, AssumedCapacity, FleetWide, Params, Ranked};

/// Longest the pool's weights go without a rebuild.
pub const REBUILD_MS: u64 = 1000;

/// Largest pool the prefix-keyed preference is computed over (`Pool::preferred`): it walks
/// every member, a logarithm each.
pub const PREFERENCE_POOL: usize = 256;

/// Eligible nodes and their cumulative drawing weights.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pool {
    members: Vec<usize>,
    cumulative: Vec<f64>,
    /// Each member's address, hashed: its name in the prefix-keyed preference.
    names: Vec<u64>,
    /// The capacity assumed for nodes that report none (see `choice`), as of the rebuild.
    assumed_capacity: f64,
    built_at: Option<u64>,
    /// The earliest moment a member's report goes stale: the set changes then.
    valid_until: u64,
    dirty: bool,
    /// `preferred` of the keys asked since the last rebuild, at most `HOMES_REMEMBERED`: a
    /// decision asks for its prompt's key every time, and the answer is a pass over the
    /// members that only a rebuild can change.
    homes: HashMap<u64, Option<usize>>,
}

/// Keys whose preferred member the pool remembers between rebuilds (about 24 bytes each).
pub const HOMES_REMEMBERED: usize = 1024;

impl Pool {
    /// The set may have changed: rebuild before the next draw.
    pub fn invalidate(&mut self) {
        self.dirty = true;
    }

    /// Rebuilds the pool if it may be out of date at `now_ms`; says whether it did.
    pub fn refresh(&mut self, nodes: &[NodeState], now_ms: u64, stale_after_ms: u64) -> bool {
        let due = match self.built_at {
            None => true,
            Some(at) => {
                self.dirty || now_ms >= self.valid_until || now_ms.saturating_sub(at) >= REBUILD_MS
            }
        };
        if due {
            self.rebuild(nodes, now_ms, stale_after_ms);
        }
        due
    }

    fn rebuild(&mut self, nodes: &[NodeState], now_ms: u64, stale_after_ms: u64) {
        self.members.clear();
        self.cumulative.clear();
        self.names.clear();
        let mut assumed = AssumedCapacity::default();
        let mut valid_until = u64::MAX;
        for n in nodes {
            let Some(r) = n.fresh_report(now_ms, stale_after_ms) else {
                continue;
            };
            assumed.add(n, r);
            if let Some(until) = n.fresh_until(stale_after_ms) {
                valid_until = valid_until.min(until.saturating_add(1));
            }
        }
        self.assumed_capacity = assumed.value();
        let mut total = 0.0;
        for (i, n) in nodes.iter().enumerate() {
            let Some(r) = n.fresh_report(now_ms, stale_after_ms) else {
                continue;
            };
            let c = n.capacity(r, self.assumed_capacity);
            // A node reporting no usable capacity is still drawn, as rarely as a node of a
            // thousandth of the fleet's largest.
            let weight = if c.is_finite() && c > 0.0 {
                c
            } else {
                self.assumed_capacity.max(1.0) * 1e-3
            };
            total += weight;
            self.members.push(i);
            self.cumulative.push(total);
            self.names.push(hash_str(0, n.address()));
        }
        self.built_at = Some(now_ms);
        self.valid_until = valid_until;
        self.dirty = false;
        self.homes.clear();
    }

    /// `preferred`, remembered until the pool is rebuilt: the same answer, without the pass
    /// over the members for a key already asked.
    pub fn home(&mut self, key: u64) -> Option<usize> {
        if let Some(&home) = self.homes.get(&key) {
            return home;
        }
        let home = self.preferred(key);
        if self.homes.len() >= HOMES_REMEMBERED {
            self.homes.clear();
        }
        self.homes.insert(key, home);
        home
    }

    /// How many nodes are candidates.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The capacity the choice assumes for nodes that report none.
    pub fn assumed_capacity(&self) -> f64 {
        self.assumed_capacity
    }

    /// The member that routers agree on for prefix key `key` without talking to each other:
    /// weighted rendezvous hashing (Thaler and Ravishankar's highest random weight, with
    /// weights as in Schindelhauer and Schomaker): each member scores `w / -ln(u)` with `u`
    /// a uniform hash of the key and the member's address, and the highest score wins, so a
    /// member is preferred for a share of the keys proportional to its capacity, and a member
    /// joining or leaving moves only the keys it wins or held. `None` over more than
    /// `PREFERENCE_POOL` members.
    pub fn preferred(&self, key: u64) -> Option<usize> {
        if self.members.len() > PREFERENCE_POOL {
            return None;
        }
        let mut best: Option<(f64, usize)> = None;
        let mut below = 0.0;
        for ((&i, &cumulative), &name) in self.members.iter().zip(&self.cumulative).zip(&self.names)
        {
            let w = cumulative - below;
            below = cumulative;
            let u = ((finish(key ^ name) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let score = -w / u.ln();
            if best.map(|(s, _)| score > s).unwrap_or(true) {
                best = Some((score, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// One member, drawn in proportion to its capacity.
    pub fn draw(&self, rng: &mut dyn Rng) -> Option<usize> {
        let total = *self.cumulative.last()?;
        // 53 random bits make a uniform double in [0, 1).
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        let at = self.cumulative.partition_point(|&c| c <= u);
        self.members
            .get(at)
            .or_else(|| self.members.last())
            .copied()
    }
}

/// Power-of-d choices (see this module): draws candidates in proportion to their capacity and
/// keeps the best of the first `p.choices` with room under the VRAM ceiling; the other nodes
/// drawn with room follow, best first, as the retry hosts of the routing header. `None` when
/// sampling has nothing to add or cannot decide: the pool is no larger than the number of
/// choices (then every node is compared anyway), or the draws found no node with room, which
/// only a comparison of every node can tell apart from a saturated fleet (holding depends on
/// that). Draws are bounded, so a request whose model few nodes serve costs a few draws and
/// then the full comparison. `load_books` brings a drawn node's in-flight books up to date
/// just before it is weighed, for the nodes compared (the retry hosts are weighed on the
/// books at hand), at most `2 * choices` times: the nodes compared and as many drawn without
/// room, so that a saturated fleet costs a bounded number of reads before the full
/// comparison.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    nodes: &mut [NodeState],
    pool: &Pool,
    ask: &Ask,
    mean_request_tokens: f64,
    now_ms: u64,
    p: &Params,
    rng: &mut dyn Rng,
    load_books: &mut dyn FnMut(usize, &mut NodeState) -> bool,
) -> Option<Vec<Ranked>> {
    let d = p.choices;
    if d == 0 || pool.len() <= d || p.rule != Rule::TokenThroughput {
        return None;
    }
    let want = d.max(p.keep.min(pool.len()));
    let fleet = FleetWide {
        assumed_capacity: pool.assumed_capacity(),
        mean_request_tokens,
    };
    let mut drawn: Vec<usize> = Vec::with_capacity(want + 4);
    let mut reads = 0;
    let mut admitted: Vec<Ranked> = Vec::with_capacity(want);
    // The nodes the prompt's prefix points to come first (see `choice::Prefix::joiners`):
    // the preferred node as one of the `d`, the holders of the prefix besides them.
    let mut d = d;
    let joiners = ask.prefix.into_iter().flat_map(|x| x.joiners());
    let mut draws = 0;
    let mut next = joiners
        .map(|(i, adds)| (i, Some(adds)))
        .chain(std::iter::from_fn(|| {
            draws += 1;
            (draws <= 4 * want + 8)
                .then(|| pool.draw(rng))
                .flatten()
                .map(|i| (i, None))
        }));
    while admitted.len() < want.max(d) {
        let Some((i, joiner)) = next.next() else {
            break;
        };
        if drawn.contains(&i) {
            continue;
        }
        drawn.push(i);
        let Some(n) = nodes.get_mut(i) else { continue };
        if !may_serve(i, n, ask) || n.fresh_report(now_ms, p.stale_after_ms).is_none() {
            continue;
        }
        // Only the compared nodes' books are read: with books in shared data that is a host
        // call each, and a decision must not cost one per node of the fleet. The nodes drawn
        // past the `d` compared only fill the retry list, where this VM's own books will do.
        if joiner.is_some() || (admitted.len() < d && reads < 2 * d) {
            reads += 1;
            load_books(i, n);
        }
        let n = &*n;
        let Some(r) = n.fresh_report(now_ms, p.stale_after_ms) else {
            continue;
        };
        let (ranked, over) = evaluate(i, n, r, ask, &fleet, p);
        if !over {
            if joiner == Some(true) {
                d += 1;
            }
            admitted.push(ranked);
        }
    }
    let compared = d.min(admitted.len());
    let winner = admitted
        .iter()
        .take(compared)
        .enumerate()
        .min_by(|(_, a), (_, b)| a.seconds.total_cmp(&b.seconds))
        .map(|(at, _)| at)?;
    admitted.swap(0, winner);
    if let Some(rest) = admitted.get_mut(1..) {
        rest.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    }
    admitted.truncate(p.keep.max(1));
    Some(admitted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::config::Rule;
    use crate::ingest::telemetry::Report;
    use crate::rng::SplitMix64;
    use crate::route::balancer::{Balancer, Outcome, OwnBooks};
    use crate::route::testing::*;

    const P: Params = Params {
        rule: Rule::TokenThroughput,
        stale_after_ms: 1000,
        vram_ceiling: 0.9,
        kv_bytes_per_token: 1,
        keep: 3,
        choices: 2,
    };

    fn node(capacity: Option<f64>, reported_at: Option<u64>) -> NodeState {
        let mut n = NodeState::new("127.0.0.1:1", None, None);
        if let Some(at) = reported_at {
            n.accept_report(
                Report {
                    load_tokens_per_sec: 10.0,
                    capacity_tokens_per_sec: capacity,
                    ..Report::default()
                },
                at,
            );
        }
        n
    }

    /// Weighted rendezvous: over many keys each member is preferred in proportion to its
    /// capacity, and a member leaving moves only the keys it was preferred for.
    #[test]
    fn the_preferred_member_follows_capacity_and_moves_little() {
        let named = |a: &str, c: f64| {
            let mut n = NodeState::new(a, None, None);
            n.accept_report(
                Report {
                    load_tokens_per_sec: 0.0,
                    capacity_tokens_per_sec: Some(c),
                    ..Report::default()
                },
                0,
            );
            n
        };
        let fleet = |n: usize| -> Vec<NodeState> {
            (0..n)
                .map(|i| {
                    named(
                        &format!("10.0.0.{i}:8000"),
                        if i == 0 { 3000.0 } else { 1000.0 },
                    )
                })
                .collect()
        };
        let mut pool = Pool::default();
        pool.refresh(&fleet(4), 0, P.stale_after_ms);
        let keys: Vec<u64> = (0..6000u64).map(finish).collect();
        let before: Vec<usize> = keys.iter().map(|&k| pool.preferred(k).unwrap()).collect();
        let share = |node: usize| before.iter().filter(|&&n| n == node).count() as f64 / 6000.0;
        // Capacities 3:1:1:1: half the keys to node 0, a sixth to each other.
        assert!((share(0) - 0.5).abs() < 0.03, "{}", share(0));
        assert!((share(1) - 1.0 / 6.0).abs() < 0.03, "{}", share(1));
        // Node 3 leaves: only its keys move.
        let mut smaller = fleet(4);
        smaller[3].note_failure();
        smaller[3].note_failure();
        pool.refresh(&smaller, 0, P.stale_after_ms);
        pool.invalidate();
        pool.refresh(&smaller, 0, P.stale_after_ms);
        for (&k, &was) in keys.iter().zip(&before) {
            let now = pool.preferred(k).unwrap();
            if was != 3 {
                assert_eq!(now, was);
            } else {
                assert_ne!(now, 3);
            }
        }
        // The remembered answer is the same, and a rebuild forgets it: node 3 back, its keys
        // go back to it.
        for &k in keys.iter().take(200) {
            assert_eq!(pool.home(k), pool.preferred(k));
            assert_eq!(pool.home(k), pool.preferred(k), "asked again");
        }
        pool.invalidate();
        pool.refresh(&fleet(4), 0, P.stale_after_ms);
        for (&k, &was) in keys.iter().zip(&before).take(200) {
            assert_eq!(pool.home(k), Some(was));
        }
        // Remembering is bounded.
        for &k in &keys {
            pool.home(k);
        }
        assert!(pool.homes.len() <= HOMES_REMEMBERED);
    }

    #[test]
    fn members_are_the_fresh_nodes_not_ejected() {
        let mut ejected = node(Some(100.0), Some(0));
        ejected.note_failure();
        ejected.note_failure();
        assert!(ejected.ejected());
        let nodes = vec![
            node(Some(100.0), Some(0)),
            node(Some(100.0), None),
            ejected,
            node(Some(100.0), Some(500)),
        ];
        let mut pool = Pool::default();
        pool.refresh(&nodes, 600, P.stale_after_ms);
        assert_eq!(pool.members, vec![0, 3]);
        // Node 0's report goes stale after 1000 ms: the pool rebuilds without it.
        pool.refresh(&nodes, 1001, P.stale_after_ms);
        assert_eq!(pool.members, vec![3]);
        pool.refresh(&nodes, 1501, P.stale_after_ms);
        assert!(pool.is_empty());
        let mut rng = SplitMix64::new(1);
        assert_eq!(pool.draw(&mut rng), None);
    }

    #[test]
    fn draws_follow_capacity() {
        let cases: &[(&[Option<f64>], &[f64])] = &[
            (&[Some(100.0), Some(100.0)], &[0.5, 0.5]),
            (&[Some(300.0), Some(100.0)], &[0.75, 0.25]),
            (&[Some(100.0), Some(100.0), Some(200.0)], &[0.25, 0.25, 0.5]),
            // A node reporting no capacity is assumed to have the largest known one.
            (&[None, Some(100.0)], &[0.5, 0.5]),
        ];
        for (caps, shares) in cases {
            let nodes: Vec<_> = caps.iter().map(|c| node(*c, Some(0))).collect();
            let mut pool = Pool::default();
            pool.refresh(&nodes, 1, P.stale_after_ms);
            let mut rng = SplitMix64::new(7);
            let mut counts = vec![0u32; nodes.len()];
            let draws = 40_000;
            for _ in 0..draws {
                counts[pool.draw(&mut rng).unwrap()] += 1;
            }
            for (i, share) in shares.iter().enumerate() {
                let got = counts[i] as f64 / draws as f64;
                assert!(
                    (got - share).abs() < 0.02,
                    "{caps:?}: node {i} drawn {got}, want {share}"
                );
            }
        }
    }

    #[test]
    fn rebuilds_only_when_due() {
        let p = Params {
            stale_after_ms: 10 * REBUILD_MS,
            ..P
        };
        let mut nodes = vec![node(Some(100.0), Some(0))];
        let mut pool = Pool::default();
        pool.refresh(&nodes, 10, p.stale_after_ms);
        assert_eq!(pool.members, vec![0]);
        // A new candidate is not seen until the pool is invalidated or its rebuild is due.
        nodes.push(node(Some(100.0), Some(20)));
        pool.refresh(&nodes, 30, p.stale_after_ms);
        assert_eq!(pool.members, vec![0]);
        pool.invalidate();
        pool.refresh(&nodes, 30, p.stale_after_ms);
        assert_eq!(pool.members, vec![0, 1]);
        nodes.push(node(Some(100.0), Some(40)));
        pool.refresh(&nodes, 40, p.stale_after_ms);
        assert_eq!(pool.members, vec![0, 1]);
        pool.refresh(&nodes, 30 + REBUILD_MS, p.stale_after_ms);
        assert_eq!(pool.members, vec![0, 1, 2]);
    }

    /// Sixteen routers (replicas) hold the same reports: one node idle, 99 half loaded. Each
    /// sends one request before the next report. Comparing every node sends all sixteen to the
    /// idle one (herding); two choices spread them.
    #[test]
    fn two_choices_do_not_herd_on_the_same_stale_reports() {
        let idle = |i: usize| if i == 42 { 0 } else { 500 };
        let cases: &[(&str, usize, usize)] = &[
            // (config, fewest and most requests the idle node gets out of 16)
            (r#","choices":0"#, 16, 16),
            (r#","choices":2"#, 0, 3),
        ];
        for (extra, low, high) in cases {
            let mut at_idle = 0;
            for replica in 0..16u64 {
                let mut b = sampled_fleet(100, extra, idle);
                let o = b.route(
                    W,
                    None,
                    &Chain::NONE,
                    10,
                    &mut SplitMix64::new(replica),
                    false,
                    &mut OwnBooks,
                );
                at_idle += usize::from(routed_to(&o) == Some(42));
            }
            assert!(
                (*low..=*high).contains(&at_idle),
                "{extra}: {at_idle} of 16 at the idle node"
            );
        }
    }

    /// The drawn nodes are compared: with two choices a request never goes to the more
    /// loaded of its two candidates, so the most loaded nodes get the least.
    #[test]
    fn two_choices_prefer_the_less_loaded() {
        let mut b = sampled_fleet(10, r#","choices":2"#, |i| 100 * i as u32);
        let mut rng = SplitMix64::new(3);
        let mut counts = [0u32; 10];
        for _ in 0..2000 {
            let o = b.route(W, None, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
            if let Outcome::Routed { ticket, .. } = o {
                counts[ticket.node] += 1;
                b.release(&ticket, 0);
            }
        }
        // Two distinct nodes drawn uniformly, the less loaded kept: node i wins the pairs with a
        // more loaded node, with probability (n-1-i) / (n(n-1)/2); the most loaded never wins.
        for (i, c) in counts.iter().enumerate() {
            let want = 2000.0 * (9 - i) as f64 / 45.0;
            assert!(
                (*c as f64 - want).abs() < 0.25 * want + 10.0,
                "node {i}: {c}, want about {want}: {counts:?}"
            );
        }
    }

    /// Drawing never bends the rules of the full comparison: no stale or ejected node, no node
    /// that would pass the ceiling, no node that does not serve the model, and a saturated
    /// fleet is still told apart (held) rather than routed by luck of the draw.
    #[test]
    fn two_choices_keep_the_rules() {
        let config = cfg(
            20,
            r#","choices":2,"kv_bytes_per_token":1,"max_hold_ms":1000"#,
        );
        let mut b = Balancer::new(&config);
        let full = br#"{"tokens_per_sec_load":0,"vram_used_bytes":990,"vram_total_bytes":1000}"#;
        let room = br#"{"tokens_per_sec_load":900,"tokens_per_sec_capacity":1000,"vram_used_bytes":0,"vram_total_bytes":100000}"#;
        for i in 0..20 {
            b.on_health(i, Some(&full[..]), 0).unwrap();
        }
        let mut rng = SplitMix64::new(5);
        assert_eq!(
            b.route(W, None, &Chain::NONE, 10, &mut rng, true, &mut OwnBooks),
            Outcome::Saturated
        );
        // Only node 7 has room, and node 3 has room but stops answering (ejected).
        b.on_health(7, Some(&room[..]), 20).unwrap();
        b.on_health(3, Some(&room[..]), 20).unwrap();
        b.on_health(3, None, 30).unwrap_err();
        b.on_health(3, None, 40).unwrap_err();
        for _ in 0..50 {
            let o = b.route(W, None, &Chain::NONE, 50, &mut rng, true, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(7), "{o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // Later every report but node 7's (taken at 20) is stale: only node 7 is drawn.
        let late = 20 + config.stale_after_ms;
        for _ in 0..20 {
            let o = b.route(W, None, &Chain::NONE, late, &mut rng, false, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(7), "{o:?}");
        }
    }

    #[test]
    fn two_choices_respect_the_model() {
        let nodes: Vec<String> = (0..30)
            .map(|i| {
                let model = if i % 10 == 4 { "rare" } else { "common" };
                format!(
                    r#"{{"address":"127.0.0.1:{}","models":["{model}"]}}"#,
                    9000 + i
                )
            })
            .collect();
        let cfg = Config::parse(
            format!(r#"{{"nodes":[{}],"health_cluster":"h"}}"#, nodes.join(",")).as_bytes(),
        )
        .unwrap();
        let mut b = Balancer::new(&cfg);
        for i in 0..30 {
            b.on_health(i, Some(br#"{"tokens_per_sec_load":1}"#), 0)
                .unwrap();
        }
        let mut rng = SplitMix64::new(9);
        for _ in 0..200 {
            let o = b.route(
                W,
                Some("rare"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks,
            );
            let node = routed_to(&o).unwrap();
            assert_eq!(node % 10, 4, "{o:?}");
            let o = b.route(
                W,
                Some("common"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks,
            );
            assert_ne!(routed_to(&o).unwrap() % 10, 4, "{o:?}");
        }
        assert_eq!(
            b.route(
                W,
                Some("none"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            ),
            Outcome::UnknownModel
        );
    }
}
