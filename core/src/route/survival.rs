//! How long a stream will still run, and how high that takes a node's KV cache.
//!
//! A running stream holds one cache slot per context token: its prompt and what it has
//! generated. Each engine iteration adds a token to every running stream, and a stream that
//! ends frees its whole context. So what a node's streams will still add to its cache depends
//! on how long each will still run, and that depends on its age: a stream that has already
//! generated more than most answers do is likely a long answer, not one about to end. Over the
//! next `t` tokens the expected cache of one stream is
//!
//! ```text
//!   S(g + t | g) * (c + t)        S(x | g) = P(output > x | output > g)
//! ```
//!
//! with `c` its context now and `g` its output so far, and a node's cache is the sum over its
//! streams, whose highest point ahead is what a new request must fit beside (`peak_rise`). A
//! cohort that started together (a burst) rises until its answers start to end; streams at every
//! stage of their answers free about as much as they add, and the sum stays flat. Reserving every
//! stream's whole expected output instead, as if none ended before the others grew, is right for
//! the first and several times too much for the second; reserving half of it, as the room-now
//! check did, is too little for the first and still too much for the second (in the simulator,
//! decode-heavy traffic at full load waited out its holds with the caches a third empty).
//!
//! A stream whose first token has not come is taken to run through the whole horizon: it may
//! be waiting at the engine, which admits it as the others end, so it grows while they free
//! (in the simulator, following it from now like the others let bursts overflow: on mixed
//! prompt- and decode-heavy bursts at full load, 6 -> 22 preemptions, and back to 6 this way).
//! That reserves more than its expected answer; counting it at the highest point its own path
//! had reached instead let the same bursts overflow 24 times.
//!
//! `S` is read from the output lengths seen to complete (`Lengths`), not from a fitted
//! distribution: answers cut at `max_tokens` pile up at the cap, and a log-normal fitted to
//! their mean and spread thins exactly that tail (in the simulator, decode-heavy bursts
//! overflowed more with it). The margin is z standard deviations of the sum, each stream
//! running or not at `t` (`S (1 - S) (c + t)^2`), as the VRAM check's margin is z deviations
//! of a sum of lengths. `S(g + t | g)` is the conditional survival (the residual life) of
//! survival analysis, read from the empirical survival function.

/// Bins per doubling of the output length.
const BINS_PER_OCTAVE: usize = 8;
/// Doublings covered: outputs from 1 to 2^16 tokens; longer ones count in the last bin.
const OCTAVES: usize = 16;
const BINS: usize = BINS_PER_OCTAVE * OCTAVES;
/// Outputs counted before the counts are halved, so that they follow a changing mix.
const WINDOW: u32 = 4096;
/// Outputs a class (or the fleet) needs before its survival is read.
pub const MIN_LENGTHS: u32 = 50;

/// The bin of an output length (tokens), and the share of the bin's width below it: a doubling
/// is split into `BINS_PER_OCTAVE` equal parts (from the bits of the length, no logarithm: this
/// runs for every stream at every point of the path). Lengths below one token count in the
/// first bin.
fn bin_of(x: f64) -> (usize, f64) {
    if x.is_nan() || x < 1.0 {
        return (0, 0.0);
    }
    let octave = (u64::BITS - 1 - (x as u64).leading_zeros()) as usize;
    if octave >= OCTAVES {
        return (BINS - 1, 1.0);
    }
    let base = (1u64 << octave) as f64;
    let part = (x - base) / base * BINS_PER_OCTAVE as f64;
    let sub = (part as usize).min(BINS_PER_OCTAVE - 1);
    let b = (octave * BINS_PER_OCTAVE + sub).min(BINS - 1);
    (b, (part - sub as f64).clamp(0.0, 1.0))
}

/// Completed output lengths, counted in bins an eighth of a doubling wide.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Lengths {
    /// Empty until the first length is counted.
    bins: Vec<u32>,
    total: u32,
}

impl Lengths {
    /// Counts a completed output of `tokens`.
    pub fn add(&mut self, tokens: u64) {
        if self.bins.is_empty() {
            self.bins = vec![0; BINS];
        }
        if self.total >= WINDOW {
            for c in &mut self.bins {
                *c /= 2;
            }
            self.total = self.bins.iter().sum();
        }
        let (b, _) = bin_of(tokens as f64);
        if let Some(c) = self.bins.get_mut(b) {
            *c = c.saturating_add(1);
            self.total = self.total.saturating_add(1);
        }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// The survival function these counts give, once there are `MIN_LENGTHS` of them.
    pub fn survival(&self) -> Option<Survival> {
        if self.total < MIN_LENGTHS {
            return None;
        }
        let total = f64::from(self.total);
        // above[b]: the share of outputs in bins after b.
        let mut above = vec![0.0; BINS];
        let mut acc = 0u32;
        for (b, c) in self.bins.iter().enumerate().rev() {
            if let Some(a) = above.get_mut(b) {
                *a = f64::from(acc) / total;
            }
            acc = acc.saturating_add(*c);
        }
        let share = self.bins.iter().map(|&c| f64::from(c) / total).collect();
        Some(Survival { above, share })
    }
}

/// P(output > x) from counted lengths.
#[derive(Debug, Clone, PartialEq)]
pub struct Survival {
    above: Vec<f64>,
    share: Vec<f64>,
}

impl Survival {
    /// The share of outputs longer than `x` tokens (the bin that holds `x` is taken as spread
    /// evenly over its width, on the doubling scale).
    pub fn above(&self, x: f64) -> f64 {
        if x < 1.0 {
            return 1.0;
        }
        let (b, within) = bin_of(x);
        let after = self.above.get(b).copied().unwrap_or(0.0);
        let here = self.share.get(b).copied().unwrap_or(0.0);
        (after + here * (1.0 - within)).clamp(0.0, 1.0)
    }

    /// P(output > g + t | output > g): a stream that has generated `g` tokens still runs `t`
    /// tokens from now. A stream older than every output counted is taken to run on.
    pub fn runs_on(&self, g: f64, t: f64) -> f64 {
        self.given(self.above(g), g + t)
    }

    /// P(output > x | output > g) where `alive` = P(output > g) (`runs_on`, with its
    /// denominator computed once by a caller that asks many times).
    fn given(&self, alive: f64, x: f64) -> f64 {
        if alive <= f64::EPSILON {
            return 1.0;
        }
        (self.above(x) / alive).clamp(0.0, 1.0)
    }
}

/// One stream as the path needs it: its context now (prompt and output so far), its output so
/// far, whether its first token has come, and how many streams like it it stands for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Running {
    pub context: f64,
    pub generated: f64,
    /// Its first token has come. One that has not may wait at the engine behind the others
    /// and start as they end: it is taken to run through the horizon.
    pub started: bool,
    /// How many independent streams of this context and age it counts for: 1 for a stream of
    /// this router's own; more where its streams are taken as a sample of streams it does not
    /// see (`choice::room_now`). The mean and the variance of the path grow with it.
    pub stands_for: f64,
}

impl Running {
    /// One stream.
    pub fn one(context: f64, generated: f64, started: bool) -> Running {
        Running {
            context,
            generated,
            started,
            stands_for: 1.0,
        }
    }
}

/// Tokens ahead at which the path is looked at.
const AHEAD: [f64; 12] = [
    0.0, 8.0, 16.0, 32.0, 64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0,
];

/// The highest the streams' expected cache reaches over the tokens ahead, with `z` standard
/// deviations of it, in tokens: `streams` with the survival each follows (`None` for a stream
/// whose class has none yet: the caller then has no path, see `choice::room_now`).
pub fn peak<'a, I>(streams: I, z: f64) -> Option<f64>
where
    I: Iterator<Item = (Running, Option<&'a Survival>)> + Clone,
{
    // Each stream's chance to be running now, the denominator of its `runs_on`, once.
    let now: Vec<f64> = streams
        .clone()
        .map(|(s, survival)| survival.map(|v| v.above(s.generated)))
        .collect::<Option<_>>()?;
    let mut best: f64 = 0.0;
    for t in AHEAD {
        let (mut mean, mut var) = (0.0, 0.0);
        for ((s, survival), &alive) in streams.clone().zip(&now) {
            let p = match survival {
                Some(_) if !s.started => 1.0,
                Some(v) => v.given(alive, s.generated + t),
                None => return None,
            };
            let c = s.context + t;
            mean += s.stands_for * p * c;
            var += s.stands_for * p * (1.0 - p) * c * c;
        }
        best = best.max(mean + z * var.sqrt());
    }
    best.is_finite().then_some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(lengths: &[(u64, usize)]) -> Lengths {
        let mut l = Lengths::default();
        for &(tokens, times) in lengths {
            for _ in 0..times {
                l.add(tokens);
            }
        }
        l
    }

    #[test]
    fn survival_is_read_from_the_counted_lengths() {
        // Half the answers 100 tokens, half 1,000.
        let s = counted(&[(100, 50), (1000, 50)]).survival().unwrap();
        let table = [
            (0.0, 1.0),
            (50.0, 1.0),
            (200.0, 0.5),
            (900.0, 0.5),
            (2000.0, 0.0),
        ];
        for (x, want) in table {
            assert!(
                (s.above(x) - want).abs() < 1e-9,
                "above({x}) = {}",
                s.above(x)
            );
        }
        // Within a bin, in between.
        let mid = s.above(100.0);
        assert!(mid > 0.5 && mid < 1.0, "{mid}");
    }

    #[test]
    fn too_few_lengths_give_no_survival() {
        assert!(counted(&[(100, 49)]).survival().is_none());
        assert!(counted(&[(100, 50)]).survival().is_some());
    }

    #[test]
    fn a_stream_past_the_short_answers_is_expected_to_run_on() {
        let s = counted(&[(100, 80), (1000, 20)]).survival().unwrap();
        // New: four in five end by 100 tokens.
        assert!(s.runs_on(0.0, 300.0) < 0.25);
        // At 300 tokens, only long answers are left: it runs on.
        assert!((s.runs_on(300.0, 300.0) - 1.0).abs() < 1e-9);
        // Older than anything seen: taken to run on.
        assert_eq!(s.runs_on(5000.0, 100.0), 1.0);
    }

    #[test]
    fn the_counts_follow_a_changing_mix() {
        let mut l = counted(&[(100, 4096)]);
        for _ in 0..4096 {
            l.add(1000);
        }
        assert!(l.total() <= WINDOW + 1);
        // A window of the new mix: the old one is halved twice, a quarter of the counts.
        let s = l.survival().unwrap();
        assert!((s.above(200.0) - 0.75).abs() < 0.01, "{}", s.above(200.0));
    }

    #[test]
    fn a_cohort_rises_and_streams_at_every_stage_stay_flat() {
        // Every answer 400 tokens.
        let s = counted(&[(400, 100)]).survival().unwrap();
        let cohort: Vec<(Running, Option<&Survival>)> = (0..10)
            .map(|_| (Running::one(100.0, 0.0, true), Some(&s)))
            .collect();
        let now: f64 = 10.0 * 100.0;
        let p = peak(cohort.iter().copied(), 0.0).unwrap();
        // They grow together to about 400 tokens each before any ends.
        assert!(p > now + 10.0 * 300.0, "{p}");
        // Ten streams, one every 40 tokens of the way: the ends free what the others add.
        let staged: Vec<(Running, Option<&Survival>)> = (0..10)
            .map(|i| {
                let g = 40.0 * i as f64;
                (Running::one(100.0 + g, g, true), Some(&s))
            })
            .collect();
        let now: f64 = staged.iter().map(|(r, _)| r.context).sum();
        let p = peak(staged.iter().copied(), 0.0).unwrap();
        assert!(p < now + 0.2 * now, "{p} against {now}");
        // With no survival for one stream there is no path.
        let mut unknown = staged.clone();
        unknown.push((Running::one(1.0, 0.0, true), None));
        assert!(peak(unknown.iter().copied(), 2.0).is_none());
    }

    /// A stream without its first token may be waiting at the engine behind the others, and
    /// start as they end: it is taken to run through the whole horizon.
    #[test]
    fn a_stream_not_started_runs_through_the_horizon() {
        let s = counted(&[(100, 100)]).survival().unwrap();
        let one = |started| [(Running::one(100.0, 0.0, started), Some(&s))];
        let started = peak(one(true).iter().copied(), 0.0).unwrap();
        let waiting = peak(one(false).iter().copied(), 0.0).unwrap();
        assert!(started < 250.0, "{started}");
        assert_eq!(waiting, 100.0 + 1024.0);
    }

    /// A stream that stands for `k` like it counts as `k` independent streams of its context
    /// and age: `k` times the expected path, `sqrt(k)` times the deviation.
    #[test]
    fn a_stream_standing_for_others_counts_as_that_many() {
        let s = counted(&[(100, 50), (1000, 50)]).survival().unwrap();
        for k in [1_usize, 3, 10] {
            let standing = [(
                Running {
                    stands_for: k as f64,
                    ..Running::one(100.0, 40.0, true)
                },
                Some(&s),
            )];
            let many = vec![(Running::one(100.0, 40.0, true), Some(&s)); k];
            for z in [0.0, 2.0] {
                let (a, b) = (
                    peak(standing.iter().copied(), z).unwrap(),
                    peak(many.iter().copied(), z).unwrap(),
                );
                assert!((a - b).abs() < 1e-6 * b, "k {k}, z {z}: {a} against {b}");
            }
        }
    }

    #[test]
    fn the_margin_grows_with_the_spread() {
        let s = counted(&[(100, 50), (1000, 50)]).survival().unwrap();
        let one = [(Running::one(100.0, 0.0, true), Some(&s))];
        let bare = peak(one.iter().copied(), 0.0).unwrap();
        let wide = peak(one.iter().copied(), 2.0).unwrap();
        assert!(wide > bare, "{wide} {bare}");
    }
}
