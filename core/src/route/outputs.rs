//! Output-length learning: how many tokens a request will generate, learned from the streams
//! that completed, per class of prompt size.
//!
//! Clients send `max_tokens` as a cap, far above what models generate, so the cap is a poor
//! estimate of a request's cost. What the filter sees is every stream's real output length when
//! it ends. Output length is not independent of the prompt: in the Azure conversation trace,
//! prompts of 512 to 2,047 tokens generate about 330 tokens on average, four times what prompts
//! of 256 to 511 or of 2,048 and more generate (about 80 to 95). One fleet-wide mean books the
//! long answers as short ones, and they are the requests that make the end-to-end tail. So the
//! moments are kept per power-of-two class of the prompt's estimated size, falling back to the
//! fleet-wide ones while a class has too few samples: the cheapest form of the per-class
//! prediction that learned schedulers use, with two moments per class (compare the per-request
//! predictors of Fu et al., "Efficient LLM Scheduling by Learning to Rank", 2024, which need a
//! model of the prompt's content).
//!
//! Moments are plain while few samples exist, then exponentially weighted so they follow a
//! changing traffic mix (West's incremental mean and variance).

use crate::ingest::request::Weight;
use crate::route::choice::Growth;
use crate::route::survival::{Lengths, Survival, MIN_LENGTHS};

/// Samples a class (or the fleet) needs before its moments replace the fallback.
pub const MIN_SAMPLES: u64 = 20;
/// Weight of the newest sample once a class has `1 / ALPHA` samples.
const ALPHA: f64 = 0.05;
/// Prompt classes: [0, 2), [2, 4), ... [2^(CLASSES-1), inf) estimated tokens.
const CLASSES: usize = 20;
/// Standard deviations of the output of a node's in-flight requests, taken together, reserved
/// as KV growth beyond their means (and above their expected path, `choice::room_now`) (2: a 2% chance a node's total outgrows it if lengths were
/// normal and independent; they are skewed right, so this is a floor, not a bound).
pub const RESERVE_SIGMAS: f64 = 2.0;

/// Standard normal quantile of 0.75: the lower quartile is this many standard deviations below
/// the mean (of the logarithm, for a log-normal).
const LOWER_QUARTILE_Z: f64 = 0.6745;

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Moments {
    mean: f64,
    var: f64,
    samples: u64,
}

impl Moments {
    fn add(&mut self, x: f64) {
        self.samples = self.samples.saturating_add(1);
        let alpha = (1.0 / self.samples as f64).max(ALPHA);
        let diff = x - self.mean;
        self.mean += alpha * diff;
        self.var = (1.0 - alpha) * (self.var + alpha * diff * diff);
    }

    fn learned(&self) -> Option<OutputLength> {
        (self.samples >= MIN_SAMPLES).then(|| OutputLength {
            mean: self.mean,
            sd: self.var.max(0.0).sqrt(),
        })
    }
}

/// A learned output length: mean and standard deviation, tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputLength {
    pub mean: f64,
    pub sd: f64,
}

/// The output-length model of one filter instance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputModel {
    fleet: Moments,
    classes: [Moments; CLASSES],
    /// The lengths themselves, counted in bins, fleet-wide and per class (empty until the
    /// first is observed): how long a stream of a given age will still run (`survival`).
    fleet_lengths: Lengths,
    class_lengths: Vec<Lengths>,
}

fn class_of(prompt_tokens: u64) -> usize {
    let bits = (u64::BITS - prompt_tokens.leading_zeros()) as usize;
    bits.min(CLASSES - 1)
}

impl OutputModel {
    /// A stream whose prompt was estimated at `prompt_tokens` completed with `output_tokens`.
    pub fn observe(&mut self, prompt_tokens: u64, output_tokens: u64) {
        let x = output_tokens as f64;
        self.fleet.add(x);
        if let Some(c) = self.classes.get_mut(class_of(prompt_tokens)) {
            c.add(x);
        }
        self.fleet_lengths.add(output_tokens);
        if self.class_lengths.is_empty() {
            self.class_lengths = vec![Lengths::default(); CLASSES];
        }
        if let Some(c) = self.class_lengths.get_mut(class_of(prompt_tokens)) {
            c.add(output_tokens);
        }
    }

    /// How long the answers to prompts of `prompt_tokens` run (`survival::Survival`): from
    /// their class's counted lengths once it has enough, else the fleet's, else nothing.
    pub fn survival(&self, prompt_tokens: u64) -> Option<Survival> {
        self.class_lengths
            .get(class_of(prompt_tokens))
            .filter(|c| c.total() >= MIN_LENGTHS)
            .unwrap_or(&self.fleet_lengths)
            .survival()
    }

    /// The prompt class of `prompt_tokens` (a key for callers that keep one survival per
    /// class, see `choice::room_now`).
    pub fn class(prompt_tokens: u64) -> usize {
        class_of(prompt_tokens)
    }

    /// The expected output of a request with this prompt: its class's moments once learned,
    /// else the fleet's, else nothing (the caller keeps the cap).
    pub fn estimate(&self, prompt_tokens: u64) -> Option<OutputLength> {
        self.classes
            .get(class_of(prompt_tokens))
            .and_then(Moments::learned)
            .or_else(|| self.fleet.learned())
    }

    /// The fleet-wide moments, once learned: the spread of a node's mix of requests.
    pub fn fleet(&self) -> Option<OutputLength> {
        self.fleet.learned()
    }

    /// Streams seen to completion.
    pub fn samples(&self) -> u64 {
        self.fleet.samples
    }

    /// What a request is expected to cost: its prompt, and as output the smaller of its cap
    /// and the mean output learned for its prompt's size class (clients set caps far above
    /// what models generate: the Azure trace's outputs average a fifth of a typical 1024 cap).
    /// Until enough streams have completed, the cap stands: the safe side for the VRAM guard.
    pub fn expected(&self, weight: Weight) -> Weight {
        match self.estimate(weight.prompt_tokens) {
            Some(e) => Weight {
                prompt_tokens: weight.prompt_tokens,
                output_tokens: weight.output_tokens.min(e.mean.ceil() as u64),
            },
            None => weight,
        }
    }

    /// A short answer for a request of `weight`: the output a quarter of its prompt class's
    /// answers stay under, with output lengths taken as log-normal (right-skewed: most answers
    /// short, a few long) with the class's mean and spread; never above what `expected` gives.
    /// Until outputs are learned, `expected`'s figure (the cap). A stream's budget binds
    /// hardest when its answer is short (a prefill's stall spread over few tokens), so this is
    /// the horizon a budgeted stream's room is reckoned over (`choice::prefill_room`).
    pub fn short_answer(&self, weight: Weight) -> u64 {
        let expected = self.expected(weight).output_tokens;
        let Some(e) = self.estimate(weight.prompt_tokens) else {
            return expected;
        };
        if !(e.mean > 0.0 && e.sd.is_finite()) {
            return expected;
        }
        let cv2 = (e.sd / e.mean).powi(2);
        let sigma2 = cv2.ln_1p();
        let mu = e.mean.ln() - sigma2 / 2.0;
        let quartile = (mu - LOWER_QUARTILE_Z * sigma2.sqrt()).exp();
        if quartile.is_finite() {
            (quartile.round() as u64).clamp(1, expected.max(1))
        } else {
            expected
        }
    }

    /// KV growth to reserve for a request of `weight` (with its cap): its expected output, and
    /// the pooled margin of `RESERVE_SIGMAS` fleet-wide standard deviations per square root of
    /// the requests in flight (see `choice`); the cap and no margin until outputs are learned.
    pub fn growth(&self, weight: Weight) -> Growth {
        let fleet = self.fleet();
        Growth {
            own: self.expected(weight).output_tokens,
            margin_per_sqrt: fleet.map_or(0.0, |e| RESERVE_SIGMAS * e.sd),
            per_running: fleet.map_or(0.0, |e| e.mean / 2.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_powers_of_two() {
        for (prompt, class) in [
            (0, 0),
            (1, 1),
            (2, 2),
            (3, 2),
            (511, 9),
            (512, 10),
            (1023, 10),
            (1024, 11),
            (u64::MAX, CLASSES - 1),
        ] {
            assert_eq!(class_of(prompt), class, "{prompt}");
        }
    }

    #[test]
    fn nothing_is_estimated_before_enough_samples() {
        let mut m = OutputModel::default();
        for _ in 0..MIN_SAMPLES - 1 {
            m.observe(100, 50);
        }
        assert_eq!(m.estimate(100), None);
        m.observe(100, 50);
        assert_eq!(m.estimate(100).map(|e| e.mean), Some(50.0));
    }

    /// Long answers to mid-sized prompts and short ones to small prompts: each class gets its
    /// own mean, and a class never seen falls back to the fleet's.
    #[test]
    fn each_class_learns_its_own_length_and_unseen_ones_fall_back() {
        let mut m = OutputModel::default();
        for i in 0..100 {
            m.observe(1000, if i % 2 == 0 { 300 } else { 400 });
            m.observe(300, 90);
        }
        let mid = m.estimate(900).unwrap();
        assert!((mid.mean - 350.0).abs() < 10.0, "{mid:?}");
        assert!((mid.sd - 50.0).abs() < 5.0, "{mid:?}");
        let small = m.estimate(400).unwrap();
        assert!(
            (small.mean - 90.0).abs() < 1e-6 && small.sd < 1e-6,
            "{small:?}"
        );
        let unseen = m.estimate(50_000).unwrap();
        assert!(unseen.mean > 150.0 && unseen.mean < 300.0, "{unseen:?}");
        assert_eq!(m.samples(), 200);
    }

    /// The short answer is the lower quartile of a log-normal with the class's mean and
    /// spread: below the mean by more the wider the spread, the expected output (the cap, then
    /// the mean) when nothing is learned or nothing varies, and never above the cap.
    #[test]
    fn a_short_answer_is_the_lower_quartile_of_the_learned_lengths() {
        let mut m = OutputModel::default();
        let capped = Weight {
            prompt_tokens: 3000,
            output_tokens: 1024,
        };
        assert_eq!(m.short_answer(capped), 1024, "nothing learned: the cap");
        for _ in 0..100 {
            m.observe(3000, 100);
        }
        assert_eq!(m.short_answer(capped), 100, "no spread: the mean");
        let mut m = OutputModel::default();
        for i in 0..MIN_SAMPLES {
            m.observe(3000, if i % 2 == 0 { 50 } else { 250 });
        }
        // Mean 150, sd 100: sigma^2 = ln(1 + 4/9) = 0.368, mu = ln 150 - 0.184 = 4.827;
        // exp(4.827 - 0.6745 * 0.606) = 83.
        let e = m.estimate(3000).unwrap();
        assert!(
            (e.mean - 150.0).abs() < 1e-6 && (e.sd - 100.0).abs() < 1e-6,
            "{e:?}"
        );
        assert_eq!(m.short_answer(capped), 83);
        let small_cap = Weight {
            prompt_tokens: 3000,
            output_tokens: 40,
        };
        assert_eq!(m.short_answer(small_cap), 40);
    }

    #[test]
    fn the_mean_follows_a_changing_mix() {
        let mut m = OutputModel::default();
        for _ in 0..200 {
            m.observe(10, 100);
        }
        for _ in 0..200 {
            m.observe(10, 500);
        }
        assert!(m.estimate(10).unwrap().mean > 490.0);
    }

    #[test]
    fn learned_output_length_replaces_the_cap_once_enough_streams_completed() {
        let mut m = OutputModel::default();
        let capped = Weight {
            prompt_tokens: 10,
            output_tokens: 1024,
        };
        for i in 0..MIN_SAMPLES {
            assert_eq!(
                m.expected(capped),
                capped,
                "after {i} samples the cap stands"
            );
            m.observe(10, if i % 2 == 0 { 100 } else { 300 });
        }
        assert_eq!(m.expected(capped).output_tokens, 200);
        // Outputs of 100 and 300: each request books the mean, 200, and the node's pooled
        // margin is 2 sd = 200 per square root of its requests in flight.
        let g = m.growth(capped);
        assert_eq!(g.own, 200);
        assert!((g.margin_per_sqrt - 200.0).abs() < 1e-6, "{g:?}");
        assert!((g.per_running - 100.0).abs() < 1e-6, "{g:?}");
        let below = Weight {
            prompt_tokens: 10,
            output_tokens: 150,
        };
        assert_eq!(m.growth(below).own, 150);
        // Never above the request's own cap.
        let small = Weight {
            prompt_tokens: 10,
            output_tokens: 50,
        };
        assert_eq!(m.expected(small), small);
    }
}
