//! When each node is polled: a tick's health polls spread over slices of the tick instead of
//! all at once.
//!
//! Each poll costs Envoy's main thread about 25 us to start (the callout: an async HTTP stream,
//! a host picked by the health cluster, headers encoded) and 8 us inside the VM when its answer
//! comes back, measured with a thousand nodes; about 110 us of Envoy CPU in all. Started
//! together, a thousand polls hold the thread for 30 ms and their answers arrive together:
//! wherever the main thread shares a core with a worker, every request in that window waits.
//! So the nodes are polled in slices, node `i` in slice `i mod slices`, slice `k` of a round
//! `k * tick_ms / slices` after the round began: each node is still polled once a tick, and
//! the work comes in pieces of about `NODES_PER_SLICE` polls. A fleet that fits in one slice
//! is polled exactly as before, all at once each tick. The poller publishes what it learned
//! once per round (after the last slice), so the fleet snapshot the workers decode changes
//! once a tick, not once a slice.
//!
//! Quiet nodes are polled less often (`due`). A poll is worth its cost when the answer can
//! change a decision. Two kinds of node are telling the balancer little it does not know:
//! - a quiet one, whose reports move nothing the choice reads (the same requests running and
//!   waiting, KV-cache use within a point, load within 5 %: `Report::quiet_since`);
//! - a slack one, whose reports move but show room to spare (nothing waiting, KV-cache use at
//!   most half the VRAM ceiling, at most half its capacity in use: `Report::slack`). Whatever
//!   it reports next, a request sent there starts at once and fits: no decision is close there.
//!
//! Each such report in a row doubles the node's poll period, from `tick_ms` up to
//! `quiet_poll_ms` (by default eight ticks, at most 2 s). Its report stays fresh as long as its
//! next poll is not late: the staleness limit counts from when the next report is due, not from
//! the last one (`grace_ms`, `NodeState::fresh_until`), so the quiet period is not bound by
//! `stale_after_ms` (a failed poll still takes the node out at once, as for any node). Any
//! other report, any failed poll, or any prompt of this Envoy's there whose
//! first token has not come back (the caller says, `NodeState::poll_due`) brings it back to
//! every tick: a burst sent to an idle node is followed as closely as before, since what an
//! engine does with prompts it has not started (queues them, admits them, how fast) is what the
//! books cannot know. Streams already decoding are followed by the books themselves (every
//! token that comes back), so they alone keep a node at every tick no longer. What a longer
//! period delays is news of work that others sent (another Envoy replica) to a node that had
//! room, by at most `quiet_poll_ms`, and the KV its decoding streams wrote since the report,
//! which a node with half its ceiling free has room for. An idle fleet costs an eighth of the
//! polls with the shipped settings, and so does the share of a busy fleet with room to spare; a
//! node near a decision is polled every tick as before. The idea is the adaptive scrape interval
//! of monitoring systems, keyed here to what the balancer reads and sends.

/// Polls started together at most, but for the cap on slices (a bigger fleet has bigger
/// slices rather than slices shorter than `MIN_SLICE_MS`).
pub const NODES_PER_SLICE: usize = 64;
/// Shortest time between two slices (Envoy's timers are in milliseconds; a 10 ms tick is the
/// shortest the configuration allows).
pub const MIN_SLICE_MS: u64 = 10;
/// Most slices a tick is cut into.
pub const MAX_SLICES: usize = 16;

/// How long after its last good report a node with `quiet_reports` quiet reports in a row is
/// polled again: `tick_ms`, doubled per quiet report, at most `quiet_poll_ms`.
pub fn period_ms(quiet_reports: u32, tick_ms: u64, quiet_poll_ms: u64) -> u64 {
    tick_ms
        .saturating_mul(1u64 << quiet_reports.min(20))
        .min(quiet_poll_ms.max(tick_ms))
}

/// How much later than one tick after its last good report a node with `quiet_reports` quiet
/// reports in a row is next polled: its period less a tick. Its report stays fresh that much
/// longer (`NodeState::fresh_report`): the staleness limit counts from when a report was due,
/// so that a node polled less often because it is quiet does not fall out of the choice
/// between two polls.
pub fn grace_ms(quiet_reports: u32, tick_ms: u64, quiet_poll_ms: u64) -> u64 {
    period_ms(quiet_reports, tick_ms, quiet_poll_ms).saturating_sub(tick_ms)
}

/// Whether a node whose last good report came at `report_ms` (none: never) is polled when its
/// slice is due at `now_ms`. Slices come once a tick, so half a tick of slack keeps a period
/// of `k` ticks from becoming `k + 1`.
pub fn due(
    report_ms: Option<u64>,
    quiet_reports: u32,
    now_ms: u64,
    tick_ms: u64,
    quiet_poll_ms: u64,
) -> bool {
    let Some(at) = report_ms else { return true };
    quiet_reports == 0
        || now_ms.saturating_add(tick_ms / 2)
            >= at.saturating_add(period_ms(quiet_reports, tick_ms, quiet_poll_ms))
}

/// How many slices a tick's polls of `nodes` nodes are spread over.
pub fn slices(nodes: usize, tick_ms: u64) -> usize {
    let wanted = nodes.div_ceil(NODES_PER_SLICE).max(1);
    let fit = usize::try_from(tick_ms / MIN_SLICE_MS).unwrap_or(usize::MAX);
    wanted.min(MAX_SLICES).min(fit).max(1)
}

/// The timer period that polls one slice per tick.
pub fn slice_period_ms(tick_ms: u64, slices: usize) -> u64 {
    (tick_ms / slices.max(1) as u64).max(1)
}

/// Whether node `node` is polled in slice `slice` of `slices`.
pub fn in_slice(node: usize, slice: usize, slices: usize) -> bool {
    node % slices.max(1) == slice
}

/// The nodes of a fleet of `nodes` that slice `slice` of `slices` polls (those `in_slice`), in
/// order: a timer's work is its slices' nodes, not a walk over the whole fleet (a thousand
/// nodes in 16 slices are walked 66 times a second otherwise).
pub fn slice_nodes(slice: usize, slices: usize, nodes: usize) -> impl Iterator<Item = usize> {
    (slice..nodes).step_by(slices.max(1))
}

/// Which slices are due, by the clock rather than by counting timer ticks: Envoy's timer fires
/// late under load, and a late tick that polled one slice would stretch every node's poll
/// period by the delay. Slice `k` of a round is due `k` slice periods after the round began; a
/// late tick polls every slice that came due, and a schedule more than a tick behind (the VM
/// was not called at all) starts afresh instead of catching up in one burst.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    slices: usize,
    tick_ms: u64,
    /// When the current round began, and the slice of it to poll next (slice `k` is due
    /// `k * tick_ms / slices` after the round began: exact over a round, whatever the timer).
    round_start_ms: u64,
    next: usize,
    /// The last call's slices included the round's last.
    ended_round: bool,
}

impl Schedule {
    /// The slices due at `now_ms`, in order, for `nodes` nodes polled once per `tick_ms`.
    pub fn due(&mut self, nodes: usize, tick_ms: u64, now_ms: u64) -> Vec<usize> {
        let slices = slices(nodes, tick_ms);
        if slices != self.slices || tick_ms != self.tick_ms {
            // A new fleet size or tick: a new round, starting now.
            *self = Schedule {
                slices,
                tick_ms,
                round_start_ms: now_ms,
                next: 0,
                ended_round: false,
            };
        }
        let offset = |next: usize| tick_ms.saturating_mul(next as u64) / slices as u64;
        if self
            .round_start_ms
            .saturating_add(offset(self.next))
            .saturating_add(tick_ms)
            < now_ms
        {
            // More than a tick behind: the next slice is due now, the rest from there.
            self.round_start_ms = now_ms.saturating_sub(offset(self.next));
        }
        // A timer fires a little early as often as late against the clock read here: half a
        // slice of slack, or an early tick would find nothing due and the slice would wait a
        // whole timer period. Rounds still start exactly a tick apart.
        let slack = slice_period_ms(tick_ms, slices) / 2;
        let mut out = Vec::new();
        while out.len() < slices
            && self.round_start_ms.saturating_add(offset(self.next)) <= now_ms.saturating_add(slack)
        {
            out.push(self.next);
            self.next += 1;
            if self.next == slices {
                self.next = 0;
                self.round_start_ms = self.round_start_ms.saturating_add(tick_ms);
            }
        }
        self.ended_round = out.contains(&(slices - 1));
        out
    }

    /// How many slices a round has.
    pub fn slices(&self) -> usize {
        self.slices.max(1)
    }

    /// The timer period that polls one slice per tick.
    pub fn period_ms(&self) -> u64 {
        slice_period_ms(self.tick_ms, self.slices)
    }

    /// The slices the last call gave ended a round: every node has been polled since the
    /// round began (always true with one slice, once polled). A late tick that polls the last
    /// slice and the next round's first still ends a round.
    pub fn round_polled(&self) -> bool {
        self.ended_round
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_grow_with_the_fleet_within_the_tick() {
        // (nodes, tick_ms, slices, period)
        let cases: &[(usize, u64, usize, u64)] = &[
            (0, 1000, 1, 1000),
            (1, 1000, 1, 1000),
            (64, 250, 1, 250),
            (65, 250, 2, 125),
            (1000, 250, 16, 15),
            (1000, 1000, 16, 62),
            (4096, 1000, 16, 62),
            // A short tick: no slice shorter than 10 ms.
            (1000, 50, 5, 10),
            (1000, 10, 1, 10),
            (200, 25, 2, 12),
        ];
        for &(nodes, tick, want, period) in cases {
            let got = slices(nodes, tick);
            assert_eq!(got, want, "{nodes} nodes, tick {tick}");
            assert_eq!(
                slice_period_ms(tick, got),
                period,
                "{nodes} nodes, tick {tick}"
            );
        }
    }

    #[test]
    fn the_schedule_follows_the_clock_not_the_ticks() {
        let mut s = Schedule::default();
        // 200 nodes, tick 100 ms: 4 slices of 25 ms.
        assert_eq!(s.due(200, 100, 1000), vec![0]);
        assert_eq!((s.slices(), s.period_ms()), (4, 25));
        assert!(!s.round_polled());
        assert!(s.due(200, 100, 1010).is_empty(), "not due yet");
        // A tick a millisecond early for the next slice still polls it.
        assert_eq!(s.due(200, 100, 1024), vec![1]);
        // A tick 40 ms late polls both slices that came due; the round is then polled.
        assert_eq!(s.due(200, 100, 1075), vec![2, 3]);
        assert!(s.round_polled());
        assert!(s.due(200, 100, 1085).is_empty());
        assert!(!s.round_polled());
        // Later still: the round's last slice and the next round's first, in one call.
        assert_eq!(s.due(200, 100, 1110), vec![0]);
        assert_eq!(s.due(200, 100, 1175), vec![1, 2, 3]);
        assert!(s.round_polled());
        assert_eq!(s.due(200, 100, 1230), vec![0, 1]);
        assert!(!s.round_polled());
        assert_eq!(s.due(200, 100, 1300), vec![2, 3, 0]);
        assert!(s.round_polled(), "a round ended within the call");
        // Each node once a tick, whether the timer runs 1 ms slow or 1 ms fast against the
        // slices: over 10 s, 100 rounds of 4 slices (give or take the slice at the window's
        // edge).
        for step in [24, 26] {
            let mut s = Schedule::default();
            let (mut polled, mut t) = (0, 0);
            while t < 10_000 {
                polled += s.due(200, 100, t).len();
                t += step;
            }
            assert!((399..=401).contains(&polled), "step {step}: {polled}");
        }
        let mut s = Schedule::default();
        assert_eq!(s.due(200, 100, 0), vec![0]);
        // Far behind (the VM was not called for seconds): no burst of a hundred rounds.
        assert_eq!(s.due(200, 100, 60_000), vec![1]);
        // A thousand nodes, tick 250 ms: 16 slices on a 15 ms timer, yet exactly 4 rounds a
        // second (a timer period rounded down must not poll faster than the tick).
        let mut s = Schedule::default();
        let (mut polled, mut rounds, mut t) = (0, 0, 0);
        while t < 10_000 {
            polled += s.due(1000, 250, t).len();
            rounds += usize::from(s.round_polled());
            t += s.period_ms();
        }
        assert_eq!((polled, rounds), (40 * 16, 40));
        // The fleet grows past one slice: a new round from slice 0.
        let mut s = Schedule::default();
        assert_eq!(s.due(10, 100, 0), vec![0]);
        assert!(s.round_polled(), "one slice: every poll ends a round");
        assert_eq!(s.due(10, 100, 100), vec![0]);
        assert_eq!(s.due(100, 100, 150), vec![0]);
        assert_eq!(s.slices(), 2);
    }

    /// (quiet reports in a row, tick, quiet_poll_ms, period)
    #[test]
    fn quiet_nodes_are_polled_less_often_up_to_quiet_poll_ms() {
        let cases: &[(u32, u64, u64, u64)] = &[
            (0, 250, 1000, 250),
            (1, 250, 1000, 500),
            (2, 250, 1000, 1000),
            (9, 250, 1000, 1000),
            (u32::MAX, 250, 1000, 1000),
            // Off: quiet_poll_ms is the tick.
            (5, 250, 250, 250),
            (1, 100, 250, 200),
            (2, 100, 250, 250),
        ];
        for &(quiet, tick, max, want) in cases {
            assert_eq!(period_ms(quiet, tick, max), want, "{quiet} {tick} {max}");
            // The grace is what the period adds to the tick.
            assert_eq!(
                grace_ms(quiet, tick, max),
                want - tick,
                "{quiet} {tick} {max}"
            );
        }
        // Polled in the slice due a period after the report, with half a tick of slack; a
        // node never heard from, or whose last report moved, every tick.
        assert!(due(None, 3, 0, 250, 1000));
        assert!(due(Some(1000), 0, 1001, 250, 1000));
        assert!(!due(Some(1000), 1, 1250, 250, 1000));
        assert!(due(Some(1000), 1, 1375, 250, 1000));
        assert!(!due(Some(1000), 2, 1500, 250, 1000));
        assert!(!due(Some(1000), 2, 1874, 250, 1000));
        assert!(due(Some(1000), 2, 1875, 250, 1000));
        // Over 10 s of slices a tick apart, a report 10 ms after each poll: a quiet node is
        // polled once a second, not once every 5 ticks.
        let (mut t, mut polls, mut last) = (0u64, 0, None);
        while t < 10_000 {
            if due(last, 2, t, 250, 1000) {
                polls += 1;
                last = Some(t + 10);
            }
            t += 250;
        }
        assert_eq!(polls, 10);
    }

    #[test]
    fn every_node_is_in_exactly_one_slice() {
        for slices in 1..=MAX_SLICES {
            for node in 0..100 {
                let n = (0..slices).filter(|&s| in_slice(node, s, slices)).count();
                assert_eq!(n, 1, "node {node}, {slices} slices");
            }
        }
        assert!(in_slice(5, 0, 0), "no slices is one slice");
    }

    #[test]
    fn a_slices_nodes_are_those_in_it() {
        for slices in 0..=MAX_SLICES {
            for nodes in [0, 1, 5, 64, 1000] {
                for slice in 0..slices.max(1) {
                    let walked: Vec<usize> = slice_nodes(slice, slices, nodes).collect();
                    let wanted: Vec<usize> =
                        (0..nodes).filter(|&i| in_slice(i, slice, slices)).collect();
                    assert_eq!(walked, wanted, "slice {slice} of {slices}, {nodes} nodes");
                }
            }
        }
    }
}
