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
//! exactly and neither scaled nor counted here.
//!
//! A tokenizer is the model's, so the ratio is kept per model the requests name
//! ([`PromptScales`]): a fleet serving Llama and Qwen learns each one's. A model's own ratio
//! is used once its answers alone have counted `MIN_SAMPLES` prompts; until then, and for
//! requests that name no model, the fleet's, learned from every answer, stands in. At most
//! `MAX_MODELS` are kept apart, the least recently counted giving way to a new one: names
//! that keep changing (an engine that serves any name, a client that invents them) cost a
//! bounded memory, and a model pushed out is scaled by the fleet's ratio again until it has
//! counted enough anew.

/// Answers that must have counted a prompt before the ratio is used.
pub const MIN_SAMPLES: u32 = 20;
/// The sums fade by `1 / WINDOW` a sample: the ratio follows about the last this many prompts.
const WINDOW: f64 = 1000.0;
/// The ratio's bounds.
pub const MIN_RATIO: f64 = 0.25;
pub const MAX_RATIO: f64 = 4.0;

/// Models whose ratio is kept apart, at most.
pub const MAX_MODELS: usize = 16;
/// A model name longer than this (bytes) is counted in the fleet's ratio only.
pub const MAX_MODEL_NAME: usize = 256;

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

/// One model's ratio, and when it last counted a prompt (`PromptScales::counted`).
#[derive(Debug, Clone, PartialEq)]
struct ModelScale {
    name: String,
    scale: PromptScale,
    counted: u64,
}

/// The fleet's ratio, and each model's (see the module).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptScales {
    fleet: PromptScale,
    models: Vec<ModelScale>,
    /// Prompts counted, for which model counted one last.
    counted: u64,
}

impl PromptScales {
    /// An answer of `model` (the request's, when it named one) counted `reported` tokens for a
    /// prompt the filter estimated at `estimated`. Either at 0 is no sample.
    pub fn observe(&mut self, model: Option<&str>, estimated: u64, reported: u64) {
        if estimated == 0 || reported == 0 {
            return;
        }
        self.fleet.observe(estimated, reported);
        let Some(name) = model.filter(|m| !m.is_empty() && m.len() <= MAX_MODEL_NAME) else {
            return;
        };
        self.counted = self.counted.saturating_add(1);
        let counted = self.counted;
        if let Some(m) = self.models.iter_mut().find(|m| m.name == name) {
            m.scale.observe(estimated, reported);
            m.counted = counted;
            return;
        }
        let mut scale = PromptScale::default();
        scale.observe(estimated, reported);
        let fresh = ModelScale {
            name: name.to_string(),
            scale,
            counted,
        };
        if self.models.len() < MAX_MODELS {
            self.models.push(fresh);
        } else if let Some(oldest) = self.models.iter_mut().min_by_key(|m| m.counted) {
            *oldest = fresh;
        }
    }

    /// The ratio a prompt of `model` is scaled by: the model's own once it is learned, else
    /// the fleet's.
    pub fn of(&self, model: Option<&str>) -> &PromptScale {
        model
            .and_then(|name| self.models.iter().find(|m| m.name == name))
            .map(|m| &m.scale)
            .filter(|s| s.samples() >= MIN_SAMPLES)
            .unwrap_or(&self.fleet)
    }

    /// The fleet's ratio, learned from every answer.
    pub fn fleet(&self) -> &PromptScale {
        &self.fleet
    }

    /// Each model kept apart, with its own ratio (learned or not yet), the most recently
    /// counted first.
    pub fn models(&self) -> Vec<(&str, &PromptScale)> {
        let mut models: Vec<&ModelScale> = self.models.iter().collect();
        models.sort_by_key(|m| std::cmp::Reverse(m.counted));
        models
            .into_iter()
            .map(|m| (m.name.as_str(), &m.scale))
            .collect()
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

    /// Two models whose tokenizers count 0.7 and 1.3 engine tokens per estimated token, their
    /// answers interleaved: each is scaled by its own ratio once learned, the others (a model
    /// not seen, no model) by the fleet's, which is their mix.
    #[test]
    fn each_model_is_scaled_by_its_own_ratio() {
        let mut s = PromptScales::default();
        // (answers counted of each model, scaled prompt of 1000 for llama / qwen / another /
        // none)
        let cases: &[(u32, [u64; 4])] = &[
            (0, [1000; 4]),
            // Each model below MIN_SAMPLES, the fleet past it: the fleet's for all.
            (10, [1000; 4]),
            (15, [1000; 4]),
            // Each model learned.
            (20, [700, 1300, 1000, 1000]),
            (200, [700, 1300, 1000, 1000]),
        ];
        let mut done = 0;
        for &(answers, want) in cases {
            while done < answers {
                s.observe(Some("llama"), 1000, 700);
                s.observe(Some("qwen"), 1000, 1300);
                done += 1;
            }
            let got =
                [Some("llama"), Some("qwen"), Some("mistral"), None].map(|m| s.of(m).apply(1000));
            // The fleet's mix is 1.0 but for the fading, which weighs the last answers (qwen's)
            // a little more.
            for (g, w) in got.iter().zip(want) {
                assert!(
                    g.abs_diff(w) <= 2,
                    "after {answers} answers of each: {got:?}"
                );
            }
            assert_eq!(s.of(Some("mistral")), s.fleet());
        }
        assert_eq!(s.fleet().samples(), 400);
        let names: Vec<&str> = s.models().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["qwen", "llama"], "most recently counted first");
    }

    #[test]
    fn answers_without_a_model_teach_the_fleet_only() {
        let mut s = PromptScales::default();
        for _ in 0..MIN_SAMPLES {
            s.observe(None, 1000, 800);
            s.observe(Some(""), 1000, 800);
            s.observe(Some(&"m".repeat(MAX_MODEL_NAME + 1)), 1000, 800);
            // Zeros are no sample, and keep no model apart.
            s.observe(Some("zero"), 0, 800);
        }
        assert_eq!(s.fleet().samples(), 3 * MIN_SAMPLES);
        assert!(s.models().is_empty());
        assert_eq!(s.of(Some("any")).apply(1000), 800);
    }

    /// A seventeenth model takes the place of the one counted least recently; the fleet's
    /// ratio keeps every answer.
    #[test]
    fn at_most_max_models_are_kept_apart() {
        let mut s = PromptScales::default();
        let name = |i: usize| format!("model-{i}");
        for i in 0..MAX_MODELS {
            for _ in 0..MIN_SAMPLES {
                s.observe(Some(&name(i)), 1000, 500);
            }
        }
        // Model 0 counts again: model 1 is now the least recent.
        s.observe(Some(&name(0)), 1000, 500);
        for _ in 0..MIN_SAMPLES {
            s.observe(Some("newcomer"), 1000, 1500);
        }
        let kept: Vec<&str> = s.models().iter().map(|(n, _)| *n).collect();
        assert_eq!(kept.len(), MAX_MODELS);
        assert!(kept.contains(&"newcomer") && kept.contains(&name(0).as_str()));
        assert!(!kept.contains(&name(1).as_str()), "{kept:?}");
        assert_eq!(s.of(Some("newcomer")).apply(1000), 1500);
        assert_eq!(s.of(Some(&name(2))).apply(1000), 500);
        // The one that gave way is scaled by the fleet's ratio again.
        let fleet = s.fleet().apply(1000);
        assert_eq!(s.of(Some(&name(1))).apply(1000), fleet);
        assert!(fleet > 500 && fleet < 1500, "{fleet}");
    }
}
