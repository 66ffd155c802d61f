//! How many routers share the fleet, as one of them can tell, and how many candidates the
//! choice compares because of it (`choices: "auto"`, the default).
//!
//! Comparing every node on every request is the best choice for a router that sees all the
//! traffic: its books hold every dispatch since the last reports, so the best node it finds
//! is the best node. Routers that each see a share of the traffic rank the same reports the
//! same way and herd on the same "best" node between two ticks, which a few random candidates
//! prevent (Mitzenmacher, "How Useful Is Old Information?", 2000; see `candidates`). The
//! simulator puts the crossing near four routers (docs/BENCHMARKS.md, "How many
//! candidates"): with one or two, comparing every node gives a p99 TTFT 0.57x to 1.0x of
//! two choices'; with four they tie; with eight it is 1.1x to 1.4x worse, with sixteen up to
//! 2.7x.
//!
//! A router cannot see its peers, but the engines see all of them: each reports the requests
//! it is running and queueing whoever sent them, while this router's books hold its own.
//! Summed over the fleet and smoothed over `MEMORY_MS`, its own share of the reported
//! requests is about 1/k behind k routers that split the traffic. (One Envoy with the poller
//! service is one router, its workers sharing the books; with a poller in every VM, each
//! worker is one.) A share of at least `FEW_ENTER` compares `FEW_CHOICES` candidates
//! (every node of a fleet that small, and about as good as every node in a larger one at
//! a bounded cost per request); below `FEW_LEAVE`, two. In between, and until the fleet has
//! carried `MIN_REPORTED` requests, the choice stays where it was: two at first, safe for
//! any number of routers.
//!
//! Prefixes change the rule. Where the traffic reuses them (many tenants' system prompts,
//! conversations), where a new prefix is placed decides where its later requests go, since
//! they are priced cheaper where it is cached: comparing every node puts every new prefix
//! on the node that is fastest at that moment, and the tenants pile up there (in the
//! simulator, on 40 tenants over 8 nodes, p99 TTFT 1.2x to 6.6x of two choices' over five
//! seeds). Two candidates, one of them the node preferred for the prefix (rendezvous hashing,
//! see `candidates`), spread new prefixes in proportion to capacity. So while more than
//! `REUSE_SHARE` of the recent prompts (about the last `REUSE_MEMORY`) found their opening
//! cached somewhere, prompts are weighed between the holders and two drawn nodes
//! (`reuses_prefixes`); traffic with no reuse (every prompt new) keeps the rule above. Until
//! the router has seen enough prompts to tell, prefixes are taken as reused.
//!
//! Where it errs: requests that reach the engines without any router (clients calling a node
//! directly) count as other routers' and keep two choices; with the poller service, a
//! worker's copies of the shared books are as fresh as its last read of each, and a node not
//! read for a while counts what it held then. And comparing 16 costs more than two: behind the
//! poller service each compared node's books are a read of shared data, about 16 us of CPU
//! a request more at 1,000 nodes (1 us at 10).

use crate::fleet::node::NodeState;

/// Candidates compared when few routers share the fleet.
pub const FEW_CHOICES: usize = 16;
/// Candidates compared when many do, and before the share is known.
pub const MANY_CHOICES: usize = 2;
/// Share of the reported requests at or above which this router is one of few.
pub const FEW_ENTER: f64 = 0.4;
/// Share below which it is one of many again.
pub const FEW_LEAVE: f64 = 0.3;
/// Time constant of the smoothing, milliseconds.
pub const MEMORY_MS: f64 = 10_000.0;
/// Smoothed requests the engines must report before the share decides anything.
pub const MIN_REPORTED: f64 = 2.0;

/// Share of recent prompts with a cached opening above which the traffic reuses prefixes.
pub const REUSE_SHARE: f64 = 0.2;
/// Prompts the share of reuse is smoothed over, about.
pub const REUSE_MEMORY: f64 = 64.0;

/// This router's share of the requests the engines report, smoothed, and the number of
/// candidates it leads to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routers {
    own: f64,
    reported: f64,
    at_ms: Option<u64>,
    few: bool,
    /// Share of recent prompts whose opening some node was believed to hold.
    reuse: f64,
}

impl Default for Routers {
    /// Two candidates, and prefixes taken as reused, until the traffic says otherwise: the
    /// first placements of a tenant's prefix are the ones its later requests follow.
    fn default() -> Self {
        Routers {
            own: 0.0,
            reported: 0.0,
            at_ms: None,
            few: false,
            reuse: 1.0,
        }
    }
}

impl Routers {
    /// Takes in the fleet as it is at `now_ms`: the fresh reports' running and queued
    /// requests, and this router's requests in flight that those reports already show.
    /// Nodes that report neither count are left out of both sums; when none reports them,
    /// nothing changes.
    pub fn observe(&mut self, nodes: &[NodeState], now_ms: u64, stale_after_ms: u64) {
        let (mut own, mut reported, mut counted) = (0.0, 0.0, false);
        for n in nodes {
            let Some(r) = n.fresh_report(now_ms, stale_after_ms) else {
                continue;
            };
            let Some(there) = r.requests_there() else {
                continue;
            };
            if !there.is_finite() || there < 0.0 {
                continue;
            }
            reported += there;
            counted = true;
            // Dispatches since the report are in no engine's count yet; requests ended since
            // still are.
            own += n.books().in_report_requests() as f64;
        }
        // Nothing reported counts (every report stale, or no engine tells): nothing learned.
        if !counted {
            return;
        }
        match self.at_ms {
            None => {
                self.own = own;
                self.reported = reported;
            }
            Some(at) => {
                let dt = now_ms.saturating_sub(at) as f64;
                let keep = (-dt / MEMORY_MS).exp();
                self.own = keep * self.own + (1.0 - keep) * own;
                self.reported = keep * self.reported + (1.0 - keep) * reported;
            }
        }
        self.at_ms = Some(now_ms);
        if let Some(share) = self.share() {
            if share >= FEW_ENTER {
                self.few = true;
            } else if share < FEW_LEAVE {
                self.few = false;
            }
        }
    }

    /// This router's share of the requests the engines report, 0 to 1; `None` until they
    /// have reported `MIN_REPORTED` of them.
    pub fn share(&self) -> Option<f64> {
        (self.reported >= MIN_REPORTED).then(|| (self.own / self.reported).clamp(0.0, 1.0))
    }

    /// A prompt was weighed whose opening some node held (`held`) or none did.
    pub fn reuse_seen(&mut self, held: bool) {
        let x = if held { 1.0 } else { 0.0 };
        self.reuse += (x - self.reuse) / REUSE_MEMORY;
    }

    /// Whether the traffic reuses prefixes: then prompts are weighed between their holders
    /// (or the node preferred for a new one) and two drawn nodes (see the module).
    pub fn reuses_prefixes(&self) -> bool {
        self.reuse > REUSE_SHARE
    }

    /// Candidates to compare for a request; `chained`: its prompt has a prefix chain to
    /// price (prefix pricing on, a prompt of a block or more). While the traffic reuses
    /// prefixes such a prompt gets two (see the module).
    pub fn choices(&self, chained: bool) -> usize {
        if self.few && !(chained && self.reuses_prefixes()) {
            FEW_CHOICES
        } else {
            MANY_CHOICES
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ingest::request::Weight;
    use crate::ingest::telemetry::Report;

    /// Four nodes, each reporting `reported` requests, with `own` of this router's in flight
    /// on each and reflected in the report.
    fn fleet(reported: f64, own: u64, now_ms: u64) -> Vec<NodeState> {
        let cfg = Config::parse(
            br#"{"health_cluster":"h","nodes":[{"address":"10.0.0.1:80"},{"address":"10.0.0.2:80"},
                {"address":"10.0.0.3:80"},{"address":"10.0.0.4:80"}]}"#,
        )
        .unwrap();
        cfg.nodes
            .iter()
            .map(|c| {
                let mut n = NodeState::new(&c.address, None, None);
                for _ in 0..own {
                    n.dispatch(
                        0,
                        Weight {
                            prompt_tokens: 10,
                            output_tokens: 10,
                        },
                        10,
                    );
                }
                n.accept_report(
                    Report {
                        running_requests: Some(reported),
                        queue_depth: Some(0.0),
                        ..Report::default()
                    },
                    now_ms,
                );
                n
            })
            .collect()
    }

    #[test]
    fn the_share_decides_the_choices_with_hysteresis() {
        // (own in flight per node, reported per node, choices after a minute of it)
        let table: &[(u64, f64, usize)] = &[
            (5, 5.0, FEW_CHOICES),   // one router
            (5, 10.0, FEW_CHOICES),  // two
            (2, 8.0, MANY_CHOICES),  // four: in the band, stays at two
            (2, 16.0, MANY_CHOICES), // eight
            (0, 1.0, MANY_CHOICES),  // nothing of this router's
            (0, 0.0, MANY_CHOICES),  // an idle fleet: not known, two
        ];
        for &(own, reported, want) in table {
            let mut r = Routers::default();
            for s in 0..60u64 {
                r.observe(&fleet(reported, own, s * 1000), s * 1000, 5000);
            }
            assert_eq!(
                r.choices(false),
                want,
                "own {own}, reported {reported}: {r:?}"
            );
        }
    }

    #[test]
    fn reuse_is_the_share_of_recent_prompts_found_cached() {
        let mut r = Routers::default();
        // Taken as reused until seen otherwise.
        assert!(r.reuses_prefixes());
        // One prompt in ten cached somewhere: below the share.
        for i in 0..1000 {
            r.reuse_seen(i % 10 == 0);
        }
        assert!(!r.reuses_prefixes(), "{r:?}");
        // Tenants' system prompts: most are.
        for i in 0..200 {
            r.reuse_seen(i % 10 != 0);
        }
        assert!(r.reuses_prefixes(), "{r:?}");
        // Every prompt new again: within a few hundred prompts, no longer.
        for _ in 0..300 {
            r.reuse_seen(false);
        }
        assert!(!r.reuses_prefixes(), "{r:?}");
    }

    #[test]
    fn the_band_keeps_the_last_decision() {
        let mut r = Routers::default();
        let mut t = 0;
        let mut run = |r: &mut Routers, own: u64, reported: f64| {
            for _ in 0..60 {
                t += 1000;
                r.observe(&fleet(reported, own, t), t, 5000);
            }
        };
        run(&mut r, 4, 4.0);
        assert_eq!(r.choices(false), FEW_CHOICES);
        // A share of 0.35, between leaving and entering: still few.
        run(&mut r, 7, 20.0);
        assert_eq!(r.choices(false), FEW_CHOICES, "{r:?}");
        run(&mut r, 1, 10.0);
        assert_eq!(r.choices(false), MANY_CHOICES, "{r:?}");
        run(&mut r, 7, 20.0);
        assert_eq!(r.choices(false), MANY_CHOICES, "{r:?}");
    }

    #[test]
    fn dispatches_no_report_shows_yet_are_not_counted() {
        // Ten requests each, sent after the reports that show five of another router's.
        let mut nodes = fleet(5.0, 0, 0);
        for n in &mut nodes {
            for _ in 0..10 {
                n.dispatch(
                    0,
                    Weight {
                        prompt_tokens: 10,
                        output_tokens: 10,
                    },
                    10,
                );
            }
        }
        let mut r = Routers::default();
        r.observe(&nodes, 0, 5000);
        assert_eq!(r.share(), Some(0.0));
    }

    #[test]
    fn stale_and_silent_nodes_are_left_out() {
        let mut nodes = fleet(5.0, 5, 0);
        // A node that reports no counts at all.
        if let Some(n) = nodes.get_mut(0) {
            n.accept_report(Report::default(), 0);
        }
        let mut r = Routers::default();
        r.observe(&nodes, 0, 5000);
        assert_eq!(r.share(), Some(5.0 / 5.0));
        // Every report stale: nothing new taken in, the smoothed figures stay.
        r.observe(&nodes, 60_000, 5000);
        assert_eq!(r.share(), Some(1.0));
        assert_eq!(r.choices(false), FEW_CHOICES);
    }
}
