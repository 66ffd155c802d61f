//! How many tokens the engines count for what the filter estimates of a prompt.
//!
//! The filter has no tokenizer: it estimates a prompt's tokens from its characters (about 4 a
//! token for English-like text, see `ingest::request`). A model's tokenizer counts otherwise:
//! Llama 3's larger vocabulary takes fewer tokens for the same English, code and JSON take
//! more, and each model's chat template adds its own. An estimate 30% high makes every prompt
//! look 30% larger in the KV-cache check, so requests wait for room the cache has; 30% low,
//! and caches overflow. The engines say the truth after the fact: OpenAI-compatible servers
//! (vLLM, SGLang, llama.cpp's OpenAI endpoints, TGI's) count the prompt in each answer's
//! `usage.prompt_tokens` (a stream's, when the client asks for it), and llama.cpp's server in
//! the `timings` that end its every stream (`ingest::response`). So the filter keeps the
//! ratio of those counts to its own estimates of the same prompts, and scales every estimate
//! by it: a calibration of its tokenizer-free rule against the model being served, as the
//! output lengths are learned from the answers rather than taken from `max_tokens`.
//!
//! The ratio is of sums, not an average of ratios: a long prompt, where a fixed overhead
//! matters least and the KV check most, weighs more than a short one. The sums fade, so the
//! ratio follows a change of model or of traffic (`WINDOW` prompts); it is used once
//! `MIN_SAMPLES` answers have counted a prompt, and kept within `MIN_RATIO` to `MAX_RATIO`,
//! so a server that counts something else (a prompt truncated, or only its uncached part)
//! cannot scale prompts to nothing or without bound. Prompts sent as token ids are counted
//! exactly and neither scaled nor counted here. One ratio for the fleet: a fleet serving
//! models with different tokenizers gets their mix.

/// Answers that must have counted a prompt before the ratio is used.
pub const MIN_SAMPLES: u32 = 20;
/// The sums fade by `1 / WINDOW` a sample: the ratio follows about the last this many prompts.
const WINDOW: f64 = 1000.0;
/// The ratio's bounds.
pub const MIN_RATIO: f64 = 0.25;
pub const MAX_RATIO: f64 = 4.0;

/// Prompt tokens counted by the engines against the filter's estimates of them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PromptScale {
    estimated: f64,
    reported: f64,
    samples: u32,
}

impl PromptScale {
    /// An answer counted `reported` tokens for a prompt the filter estimated at `estimated`.
    /// Either at 0 is no sample.
    pub fn observe(&mut self, estimated: u64, reported: u64) {
        if estimated == 0 || reported == 0 {
            return;
        }
        let keep = 1.0 - 1.0 / WINDOW;
        self.estimated = self.estimated * keep + estimated as f64;
        self.reported = self.reported * keep + reported as f64;
        self.samples = self.samples.saturating_add(1);
    }

    /// Engine tokens per estimated token: 1 until `MIN_SAMPLES` prompts were counted.
    pub fn ratio(&self) -> f64 {
        if self.samples < MIN_SAMPLES || self.estimated <= 0.0 {
            return 1.0;
        }
        let r = self.reported / self.estimated;
        if r.is_finite() {
            r.clamp(MIN_RATIO, MAX_RATIO)
        } else {
            1.0
        }
    }

    /// The filter's estimate of a prompt, `estimated` tokens, in the engines' tokens.
    pub fn apply(&self, estimated: u64) -> u64 {
        let scaled = (estimated as f64 * self.ratio()).round();
        if scaled >= u64::MAX as f64 {
            u64::MAX
        } else {
            scaled as u64
        }
    }

    /// `ratio` in thousandths, rounded.
    pub fn permille(&self) -> u64 {
        (self.ratio() * 1000.0).round() as u64
    }

    /// Prompts counted so far.
    pub fn samples(&self) -> u32 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_is_learned_from_the_counts() {
        // Short prompts counted at twice the estimate, long ones as estimated, in turn.
        let mixed: Vec<(u64, u64)> = [(10, 20), (990, 990)].repeat(10);
        // (samples of (estimated, reported), ratio)
        let cases: &[(&[(u64, u64)], f64)] = &[
            (&[], 1.0),
            // Fewer than MIN_SAMPLES: not used yet.
            (&[(1000, 760); 19], 1.0),
            (&[(1000, 760); 20], 0.76),
            (&[(1000, 1300); 50], 1.3),
            // Sums, not an average of ratios: the long prompt weighs its size.
            (&mixed, 1.01),
            // Zeros are no samples.
            (&[(0, 500); 30], 1.0),
            (&[(500, 0); 30], 1.0),
            // Bounded.
            (&[(1000, 10); 30], MIN_RATIO),
            (&[(10, 1000); 30], MAX_RATIO),
        ];
        for (samples, want) in cases {
            let mut s = PromptScale::default();
            for &(e, r) in *samples {
                s.observe(e, r);
            }
            assert!(
                (s.ratio() - want).abs() < 1e-3,
                "{samples:?}: ratio {} want {want}",
                s.ratio()
            );
        }
    }

    #[test]
    fn the_ratio_follows_a_change() {
        let mut s = PromptScale::default();
        for _ in 0..2000 {
            s.observe(1000, 1300);
        }
        assert!((s.ratio() - 1.3).abs() < 1e-9);
        // Another model's tokenizer: after a window's worth, mostly the new ratio.
        for _ in 0..3000 {
            s.observe(1000, 800);
        }
        assert!((s.ratio() - 0.8).abs() < 0.05, "{}", s.ratio());
    }

    #[test]
    fn estimates_are_scaled() {
        let mut s = PromptScale::default();
        assert_eq!(s.apply(1234), 1234, "unlearned: as estimated");
        for _ in 0..MIN_SAMPLES {
            s.observe(1000, 750);
        }
        assert_eq!((s.apply(1000), s.apply(0), s.apply(3)), (750, 0, 2));
        for _ in 0..100 {
            s.observe(1, 4000);
        }
        assert_eq!(s.apply(u64::MAX), u64::MAX, "saturates");
    }
}
