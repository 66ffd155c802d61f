//! From an engine's cumulative token counters to the `Report` the choice reads: tokens per
//! second between two polls, a learned capacity, and KV headroom in the seed format's terms.
//!
//! Pure, with time as an argument (never a clock), like linkerd's and tower's peak-EWMA load
//! estimators, so every rule below is tested natively and under WASI. One `Tracker` per node
//! lives in `NodeState` and keeps the previous counter sample.
//!
//! Rate. Load is `(Δprompt + Δgeneration) / Δt` between the last two scrapes, both counters
//! summed over their series (see `engine`). A rate exists only between two comparable scrapes:
//! - First scrape: no rate. The report goes out at once with load 0 and everything the scrape
//!   knows as gauges (running, waiting, KV use). Withholding it until the second poll would
//!   leave the node — or, after an Envoy start, the whole fleet — to Envoy's fallback balancer
//!   for a tick, blind to queues and KV; with the report, a freshly seen node whose queue is
//!   long still ranks behind idle peers (the choice charges `queue_depth` as backlog), a full
//!   cache still trips the VRAM guard, and this filter's own in-flight bookings count as usual.
//! - A counter that went down (the engine restarted): the interval has no rate, the new values
//!   become the baseline, and the load is 0 until the next poll, as for a first scrape. Not
//!   "treat the new value as the delta from zero": the counters are sums over series, and when
//!   one series restarts (one data-parallel engine of a vLLM) the sum drops while the others
//!   keep their whole history, which "from zero" would count as one interval's work — a spike
//!   that the capacity peak below would then remember.
//! - A series set that changed (a series appeared or vanished, the engine is another one,
//!   the clock went back, or a rate of 1e15 tokens/s or more): not comparable either; same
//!   treatment.
//! - Scrapes closer than `MIN_WINDOW_MS`: the baseline is kept and the last rate stands, since
//!   a window that short measures the engine's batching (counters move per iteration, TGI's per
//!   finished request) rather than its throughput.
//!
//! Capacity. Engines report none, so it is learned as a decaying peak of the measured rate (a
//! configured `capacity_tokens_per_sec` wins over it where a node's capacity is resolved,
//! `NodeState::capacity`),
//! `peak = max(rate, peak * 0.5^(Δt / PEAK_HALF_LIFE_S))`, with one refinement: the peak decays
//! only while the node has requests waiting (or does not say). A node with no queue is not
//! saturated, so its rate is a lower bound on what it can do and proves nothing against the
//! peak; a saturated node's rate is its capacity for the current traffic mix, which is what the
//! peak must follow (capacity in tokens/s depends on the prefill/decode mix). Without the gate
//! an idle GPU would decay to look slower than a busy one, and a steady 40% load would pull
//! every node's capacity down to its load. The half-life, 120 s, holds a peak across the
//! seconds-long bursts of a saturated engine and follows a change of mix within minutes.
//! Below `LEARNED_CAPACITY_FLOOR` (10 tokens/s) the peak is no capacity: the report carries
//! none and the choice's fleet rule applies (the largest capacity known in the fleet, else twice
//! the largest load), so a node that has not shown what it can do — new, or never loaded — is
//! assumed as fast as the best known one and gets traffic to learn from, instead of being
//! starved at a tiny learned figure, and an idle fleet never ranks on a zero capacity.
//!
//! Sustained rate. The same counters over windows of at least `SUSTAINED_WINDOW_MS` (5 s) of
//! work, with the same gated peak: what the node was seen to serve over seconds. An engine that
//! counts a prompt when its prefill is done (llama.cpp) moves its counter in lumps, and over
//! half a second a lump reads as many times the node's throughput: on two llama.cpp servers the
//! half-second peak was 1,500 to 3,000 tokens/s, the 5-s one 120 to 330. The capacity above
//! keeps the half-second peak, as the ranking is tuned with it (a change of the ranking's
//! capacity was not shown to route better); the first-token forecast, which admission holds
//! budgets against, drains at the sustained rate (`NodeState::forecast_rate`). The window is
//! 5 s of the node at work (requests running or waiting at either end of a poll interval), not
//! of the clock: idle moments would make the rate a measure of the traffic, not of the node.
//! Where it errs: a window spent decoding a few streams counts few tokens, so the figure is a
//! peak over windows, and until 5 s of work have passed the forecast drains at the capacity
//! the choice ranks with.
//!
//! KV. The report carries the engine's use fraction, or tokens in use over the cache size, and
//! the cache size from the engine's geometry (`Report::kv_cache_tokens`); when the engine
//! publishes no geometry, a configured `kv_cache_tokens` sizes it, as it does for the seed
//! format's `kv_cache_usage`.

use crate::ingest::engine::{Counter, Engine, Scrape};
use crate::ingest::telemetry::{Report, ABSURD};

/// Scrapes closer than this keep the baseline: the window would measure batching, not rate.
pub const MIN_WINDOW_MS: u64 = 500;
/// Half-life of the learned capacity peak while the node is saturated, seconds.
pub const PEAK_HALF_LIFE_S: f64 = 120.0;
/// A learned peak below this (tokens/s) is not believed as a capacity.
pub const LEARNED_CAPACITY_FLOOR: f64 = 10.0;
/// Milliseconds of work the sustained rate is measured over (see the module).
pub const SUSTAINED_WINDOW_MS: u64 = 5_000;

/// What one scrape did to the rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// The first scrape with counters: a baseline, no rate yet.
    First,
    /// A rate over the interval since the baseline, tokens/s.
    Measured(f64),
    /// Too soon after the baseline: the last rate stands.
    TooSoon,
    /// A counter went down: new baseline, no rate for this interval.
    Reset,
    /// Another engine, another series set, time went back, or an absurd rate: new baseline.
    Incomparable,
    /// The scrape has no token counters at all: no rate.
    NoCounters,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Baseline {
    at_ms: u64,
    engine: Engine,
    prompt: Option<Counter>,
    generation: Option<Counter>,
}

/// The per-node memory between scrapes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tracker {
    baseline: Option<Baseline>,
    rate: Option<f64>,
    peak: Option<f64>,
    last_poll_ms: Option<u64>,
    last_step: Option<Step>,
    /// The sustained rate's peak, decaying as `peak` does.
    sustained: Option<f64>,
    /// The sustained rate's window: the tokens counted when it started, the milliseconds
    /// since in which the node had work, and whether it had work at the last scrape.
    window: Option<(f64, u64, bool)>,
    /// The last scrape's prompt-token counter, and the engine that served it.
    prompt: Option<(Engine, Counter)>,
}

impl Tracker {
    /// Tokens per second over the last measured interval.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The learned capacity, when the peak is high enough to be one.
    pub fn learned_capacity(&self) -> Option<f64> {
        self.peak.filter(|p| *p >= LEARNED_CAPACITY_FLOOR)
    }

    /// The learned sustained rate, when its peak is high enough to be one.
    pub fn sustained(&self) -> Option<f64> {
        self.sustained.filter(|p| *p >= LEARNED_CAPACITY_FLOOR)
    }

    /// The engine's count of prompt tokens at the last scrape, and the engine, if it gave one.
    pub fn prompt_counter(&self) -> Option<(Engine, Counter)> {
        self.prompt
    }

    /// What the last scrape did to the rate.
    pub fn last_step(&self) -> Option<Step> {
        self.last_step
    }

    /// Takes one scrape taken at `now_ms` and returns the node's report.
    pub fn observe(
        &mut self,
        scrape: &Scrape,
        now_ms: u64,
        configured_kv_tokens: Option<u64>,
    ) -> Report {
        let step = self.advance(scrape, now_ms);
        self.learn(scrape, step, now_ms);
        self.prompt = scrape.prompt_tokens.map(|c| (scrape.engine, c));
        self.last_step = Some(step);
        let kv_size = scrape
            .kv_total_tokens
            .or(configured_kv_tokens.map(|k| k as f64))
            .filter(|k| *k > 0.0);
        let kv_usage = scrape.kv_usage.or_else(|| {
            let used = scrape.kv_used_tokens?;
            Some((used / kv_size?).min(1.0))
        });
        Report {
            load_tokens_per_sec: self.rate.unwrap_or(0.0),
            capacity_tokens_per_sec: self.learned_capacity(),
            sustained_tokens_per_sec: self.sustained(),
            vram_used_bytes: None,
            vram_total_bytes: None,
            kv_cache_usage: kv_usage,
            kv_cache_tokens: scrape.kv_total_tokens,
            queue_depth: scrape.waiting,
            running_requests: scrape.running,
        }
    }

    fn advance(&mut self, s: &Scrape, now_ms: u64) -> Step {
        if s.prompt_tokens.is_none() && s.generation_tokens.is_none() {
            self.baseline = None;
            self.rate = None;
            return Step::NoCounters;
        }
        let current = Baseline {
            at_ms: now_ms,
            engine: s.engine,
            prompt: s.prompt_tokens,
            generation: s.generation_tokens,
        };
        let Some(prev) = self.baseline else {
            self.baseline = Some(current);
            self.rate = None;
            return Step::First;
        };
        let series = |c: Option<Counter>| c.map(|c| c.series);
        let comparable = prev.engine == current.engine
            && series(prev.prompt) == series(current.prompt)
            && series(prev.generation) == series(current.generation)
            && now_ms >= prev.at_ms;
        if !comparable {
            self.baseline = Some(current);
            self.rate = None;
            return Step::Incomparable;
        }
        let delta = |a: Option<Counter>, b: Option<Counter>| match (a, b) {
            (Some(a), Some(b)) => b.total - a.total,
            _ => 0.0,
        };
        let d_prompt = delta(prev.prompt, current.prompt);
        let d_generation = delta(prev.generation, current.generation);
        if d_prompt < 0.0 || d_generation < 0.0 {
            self.baseline = Some(current);
            self.rate = None;
            return Step::Reset;
        }
        let dt_ms = now_ms.saturating_sub(prev.at_ms);
        if dt_ms < MIN_WINDOW_MS {
            return Step::TooSoon;
        }
        let rate = (d_prompt + d_generation) * 1000.0 / dt_ms as f64;
        self.baseline = Some(current);
        if !(rate.is_finite() && rate < ABSURD) {
            self.rate = None;
            return Step::Incomparable;
        }
        self.rate = Some(rate);
        Step::Measured(rate)
    }

    fn learn(&mut self, s: &Scrape, step: Step, now_ms: u64) {
        let dt_s = self
            .last_poll_ms
            .map_or(0.0, |t| now_ms.saturating_sub(t) as f64 / 1000.0);
        self.last_poll_ms = Some(now_ms);
        let saturated = s.waiting.map_or(true, |w| w > 0.0);
        if saturated {
            let decay = 0.5f64.powf(dt_s / PEAK_HALF_LIFE_S);
            for p in [&mut self.peak, &mut self.sustained].into_iter().flatten() {
                *p *= decay;
            }
        }
        if let Step::Measured(r) = step {
            self.peak = Some(self.peak.map_or(r, |p| p.max(r)));
        }
        let total = match (s.prompt_tokens, s.generation_tokens) {
            (None, None) => None,
            (p, g) => Some(p.map_or(0.0, |c| c.total) + g.map_or(0.0, |c| c.total)),
        };
        // Work at this scrape: requests running or waiting (a node that does not say counts
        // as busy, as for the peak's decay). An interval counts as busy when either end is.
        let busy = match (s.running, s.waiting) {
            (None, None) => true,
            (r, w) => r.unwrap_or(0.0) + w.unwrap_or(0.0) > 0.0,
        };
        let dt_ms = (dt_s * 1000.0) as u64;
        match (step, self.window, total) {
            (
                Step::Measured(_) | Step::TooSoon,
                Some((before, busy_ms, was_busy)),
                Some(now_total),
            ) => {
                let busy_ms = busy_ms + if busy || was_busy { dt_ms } else { 0 };
                if busy_ms >= SUSTAINED_WINDOW_MS {
                    let r = (now_total - before) * 1000.0 / busy_ms as f64;
                    if r.is_finite() && (0.0..ABSURD).contains(&r) {
                        self.sustained = Some(self.sustained.map_or(r, |p| p.max(r)));
                    }
                    self.window = Some((now_total, 0, busy));
                } else {
                    self.window = Some((before, busy_ms, busy));
                }
            }
            // A new baseline (or none) starts the window again.
            _ => self.window = total.map(|t| (t, 0, busy)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scrape(prompt: Option<f64>, generation: Option<f64>, waiting: Option<f64>) -> Scrape {
        let c = |v: Option<f64>| v.map(|total| Counter { total, series: 1 });
        Scrape {
            engine: Engine::Vllm,
            running: Some(1.0),
            waiting,
            kv_usage: None,
            kv_used_tokens: None,
            kv_total_tokens: None,
            prompt_tokens: c(prompt),
            generation_tokens: c(generation),
            prefix_hits: None,
            prefix_queries: None,
            prefix_hit_rate: None,
            samples: 10,
            skipped_lines: 0,
            rejected_values: 0,
            models: vec![],
            max_lora: None,
        }
    }

    fn counters(p: f64, g: f64) -> Scrape {
        scrape(Some(p), Some(g), Some(0.0))
    }

    /// (scrape, time ms) -> expected step and reported load, in sequence.
    #[test]
    fn rate_across_polls_table() {
        type Poll = (Scrape, u64, Step, f64);
        let two_series = Scrape {
            prompt_tokens: Some(Counter {
                total: 3000.0,
                series: 2,
            }),
            ..counters(0.0, 0.0)
        };
        let cases: Vec<(&str, Vec<Poll>)> = vec![
            (
                "first poll has no rate, the second does",
                vec![
                    (counters(1000.0, 500.0), 0, Step::First, 0.0),
                    (
                        counters(1600.0, 900.0),
                        1000,
                        Step::Measured(1000.0),
                        1000.0,
                    ),
                    (counters(1600.0, 900.0), 3000, Step::Measured(0.0), 0.0),
                ],
            ),
            (
                "a counter reset (engine restart) skips one interval",
                vec![
                    (counters(1000.0, 1000.0), 0, Step::First, 0.0),
                    (
                        counters(2000.0, 1500.0),
                        1000,
                        Step::Measured(1500.0),
                        1500.0,
                    ),
                    (counters(10.0, 5.0), 2000, Step::Reset, 0.0),
                    (counters(410.0, 105.0), 2500, Step::Measured(1000.0), 1000.0),
                ],
            ),
            (
                "only one counter going down is a reset too",
                vec![
                    (counters(1000.0, 1000.0), 0, Step::First, 0.0),
                    (counters(5000.0, 999.0), 1000, Step::Reset, 0.0),
                ],
            ),
            (
                "polls closer than the window keep the baseline and the last rate",
                vec![
                    (counters(0.0, 0.0), 0, Step::First, 0.0),
                    (counters(100.0, 100.0), 1000, Step::Measured(200.0), 200.0),
                    (counters(150.0, 100.0), 1100, Step::TooSoon, 200.0),
                    (counters(500.0, 300.0), 2000, Step::Measured(600.0), 600.0),
                ],
            ),
            (
                "a series appearing makes the sums incomparable",
                vec![
                    (counters(1000.0, 0.0), 0, Step::First, 0.0),
                    (two_series, 1000, Step::Incomparable, 0.0),
                    (
                        Scrape {
                            prompt_tokens: Some(Counter {
                                total: 4000.0,
                                series: 2,
                            }),
                            ..counters(0.0, 0.0)
                        },
                        2000,
                        Step::Measured(1000.0),
                        1000.0,
                    ),
                ],
            ),
            (
                "a counter appearing (TGI's first finished request) re-baselines",
                vec![
                    (scrape(Some(100.0), None, Some(0.0)), 0, Step::First, 0.0),
                    (counters(200.0, 50.0), 1000, Step::Incomparable, 0.0),
                    (counters(300.0, 150.0), 2000, Step::Measured(200.0), 200.0),
                ],
            ),
            (
                "prompt counter only still gives a rate",
                vec![
                    (scrape(Some(100.0), None, None), 0, Step::First, 0.0),
                    (
                        scrape(Some(300.0), None, None),
                        2000,
                        Step::Measured(100.0),
                        100.0,
                    ),
                ],
            ),
            (
                "no counters: no rate, load 0",
                vec![
                    (scrape(None, None, Some(3.0)), 0, Step::NoCounters, 0.0),
                    (scrape(None, None, Some(3.0)), 1000, Step::NoCounters, 0.0),
                ],
            ),
            (
                "time going back re-baselines",
                vec![
                    (counters(0.0, 0.0), 5000, Step::First, 0.0),
                    (counters(10.0, 0.0), 4000, Step::Incomparable, 0.0),
                    (counters(20.0, 0.0), 5000, Step::Measured(10.0), 10.0),
                ],
            ),
            (
                "an absurd jump is not a rate",
                vec![
                    (counters(0.0, 0.0), 0, Step::First, 0.0),
                    (counters(9e14, 9e14), 1000, Step::Incomparable, 0.0),
                ],
            ),
            (
                "another engine behind the address re-baselines",
                vec![
                    (counters(0.0, 0.0), 0, Step::First, 0.0),
                    (
                        Scrape {
                            engine: Engine::Sglang,
                            ..counters(10.0, 10.0)
                        },
                        1000,
                        Step::Incomparable,
                        0.0,
                    ),
                ],
            ),
        ];
        for (name, polls) in cases {
            let mut t = Tracker::default();
            for (i, (s, at, step, load)) in polls.into_iter().enumerate() {
                let r = t.observe(&s, at, None);
                assert_eq!(t.last_step(), Some(step), "{name}: poll {i}");
                assert_eq!(r.load_tokens_per_sec, load, "{name}: poll {i}");
            }
        }
    }

    #[test]
    fn first_poll_report_carries_the_gauges() {
        let mut t = Tracker::default();
        let s = Scrape {
            running: Some(12.0),
            waiting: Some(40.0),
            kv_usage: Some(0.7),
            kv_total_tokens: Some(100_000.0),
            ..counters(1e6, 2e6)
        };
        let r = t.observe(&s, 0, None);
        assert_eq!(
            r,
            Report {
                load_tokens_per_sec: 0.0,
                capacity_tokens_per_sec: None,
                sustained_tokens_per_sec: None,
                vram_used_bytes: None,
                vram_total_bytes: None,
                kv_cache_usage: Some(0.7),
                kv_cache_tokens: Some(100_000.0),
                queue_depth: Some(40.0),
                running_requests: Some(12.0),
            }
        );
    }

    #[test]
    fn capacity_is_a_peak_that_decays_only_under_saturation() {
        let mut t = Tracker::default();
        let queued = |p: f64| scrape(Some(p), Some(0.0), Some(5.0));
        let idle = |p: f64| scrape(Some(p), Some(0.0), Some(0.0));
        t.observe(&queued(0.0), 0, None);
        // 4000 tokens/s while saturated: the peak.
        let r = t.observe(&queued(4000.0), 1000, None);
        assert_eq!(r.capacity_tokens_per_sec, Some(4000.0));
        // Lower rates do not lower it at once.
        let r = t.observe(&queued(5000.0), 2000, None);
        assert_eq!(r.load_tokens_per_sec, 1000.0);
        let c = r.capacity_tokens_per_sec.unwrap();
        assert!((c - 4000.0 * 0.5f64.powf(1.0 / 120.0)).abs() < 1e-6, "{c}");
        // Saturated for one half-life at 1000 tokens/s: about half the peak is left.
        let mut p = 5000.0;
        let mut at = 2000;
        for _ in 0..119 {
            p += 1000.0;
            at += 1000;
            t.observe(&queued(p), at, None);
        }
        let c = t.learned_capacity().unwrap();
        assert!((c - 2000.0).abs() < 1e-6, "after a half-life: {c}");
        // Idle (no queue) for an hour: the peak holds.
        for _ in 0..3600 {
            at += 1000;
            t.observe(&idle(p), at, None);
        }
        assert!((t.learned_capacity().unwrap() - c).abs() < 1e-9);
        // A higher rate raises it at once.
        at += 1000;
        let r = t.observe(&idle(p + 9000.0), at, None);
        assert_eq!(r.capacity_tokens_per_sec, Some(9000.0));
    }

    /// An engine that counts a prompt when it is done (llama.cpp) moves its counter in lumps:
    /// 2,000 tokens in one half-second poll every 5 s is 4,000 tokens/s over that poll and 400
    /// over the seconds it took. The capacity peak takes the first; the sustained rate, over
    /// windows of `SUSTAINED_WINDOW_MS` or more, the second, and a reset starts its window again.
    #[test]
    fn a_lumpy_counter_sustains_what_it_serves_over_seconds() {
        let mut t = Tracker::default();
        let mut total = 0.0;
        let mut r = t.observe(&counters(0.0, 0.0), 0, None);
        for at in (500..=30_000).step_by(500) {
            if at % 5_000 == 0 {
                total += 2000.0;
            }
            r = t.observe(&counters(total, 0.0), at, None);
        }
        assert_eq!(r.capacity_tokens_per_sec, Some(4000.0));
        assert_eq!(r.sustained_tokens_per_sec, Some(400.0));
        // Not before a whole window has passed.
        let mut fresh = Tracker::default();
        fresh.observe(&counters(0.0, 0.0), 0, None);
        let r = fresh.observe(&counters(2000.0, 0.0), 4_500, None);
        assert_eq!(
            (
                r.capacity_tokens_per_sec.is_some(),
                r.sustained_tokens_per_sec
            ),
            (true, None)
        );
        let r = fresh.observe(&counters(2000.0, 0.0), 5_000, None);
        assert_eq!(r.sustained_tokens_per_sec, Some(400.0));
        // A restarted engine (its counter went down) is no rate: the window starts again.
        fresh.observe(&counters(10.0, 0.0), 5_500, None);
        let r = fresh.observe(&counters(100_010.0, 0.0), 9_000, None);
        assert_eq!(
            r.sustained_tokens_per_sec,
            Some(400.0),
            "a window of 3.5 s measures nothing"
        );
    }

    /// Idle time is not in the window: a node that served 1,000 tokens in 2 s of work, then
    /// sat idle for 10 s, then served 1,500 in 3 s sustains 500 tokens/s, not 2,500 over 15 s.
    #[test]
    fn the_window_is_time_at_work() {
        let mut t = Tracker::default();
        let at = |p: f64, running: f64| Scrape {
            running: Some(running),
            ..counters(p, 0.0)
        };
        t.observe(&at(0.0, 1.0), 0, None);
        t.observe(&at(1000.0, 0.0), 2_000, None);
        let r = t.observe(&at(1000.0, 0.0), 12_000, None);
        assert_eq!(r.sustained_tokens_per_sec, None, "2 s of work so far");
        t.observe(&at(1000.0, 1.0), 12_500, None);
        let r = t.observe(&at(2500.0, 1.0), 15_000, None);
        assert_eq!(r.sustained_tokens_per_sec, Some(500.0));
    }

    #[test]
    fn learned_capacity_has_a_floor() {
        let mut t = Tracker::default();
        t.observe(&counters(0.0, 0.0), 0, None);
        // 5 tokens/s is below the floor: no capacity, the choice's fleet rule applies.
        let r = t.observe(&counters(3.0, 2.0), 1000, None);
        assert_eq!(r.load_tokens_per_sec, 5.0);
        assert_eq!(r.capacity_tokens_per_sec, None);
        t.observe(&counters(3.0, 2.0), 2000, None);
        let r = t.observe(&counters(5003.0, 2.0), 3000, None);
        assert_eq!(r.capacity_tokens_per_sec, Some(5000.0));
        assert_eq!(t.learned_capacity(), Some(5000.0));
        // Saturated long enough, a peak decays below the floor and stops being a capacity.
        let mut at = 3000;
        while t.learned_capacity().is_some() {
            at += 60_000;
            t.observe(&scrape(Some(5003.0), Some(2.0), Some(1.0)), at, None);
            assert!(at < 3_000_000, "never decayed");
        }
        assert_eq!(
            t.observe(&counters(5003.0, 2.0), at + 1000, None)
                .capacity_tokens_per_sec,
            None
        );
    }

    #[test]
    fn kv_from_fraction_tokens_geometry_or_configuration() {
        let mut t = Tracker::default();
        let base = counters(0.0, 0.0);
        type Case = (
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<u64>,
            Option<f64>,
            Option<f64>,
        );
        // (usage, used tokens, geometry, configured) -> (report usage, report kv tokens)
        let cases: Vec<Case> = vec![
            (
                Some(0.4),
                None,
                Some(1000.0),
                Some(50),
                Some(0.4),
                Some(1000.0),
            ),
            (
                None,
                Some(250.0),
                Some(1000.0),
                Some(50),
                Some(0.25),
                Some(1000.0),
            ),
            (None, Some(250.0), None, Some(500), Some(0.5), None),
            (None, Some(900.0), None, Some(500), Some(1.0), None),
            (None, Some(250.0), None, None, None, None),
            (None, None, Some(1000.0), Some(500), None, Some(1000.0)),
        ];
        for (i, (usage, used, geometry, configured, want_usage, want_tokens)) in
            cases.into_iter().enumerate()
        {
            let s = Scrape {
                kv_usage: usage,
                kv_used_tokens: used,
                kv_total_tokens: geometry,
                ..base.clone()
            };
            let r = t.observe(&s, i as u64 * 1000, configured);
            assert_eq!(r.kv_cache_usage, want_usage, "case {i}");
            assert_eq!(r.kv_cache_tokens, want_tokens, "case {i}");
        }
    }
}
