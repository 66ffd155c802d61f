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
//!
//! A stream whose client did not ask for usage (most clients do not) reports no count, and
//! vLLM and SGLang end such a stream without one. The engine's own counter of prompt tokens
//! still moves ([`EngineCounts`]): over the same seconds, what the engines counted against what
//! the filter estimated of the prompts that started there (their first token came back; the
//! shared books keep the running totals, `Books::started_text_prompt`) is the same ratio, for
//! the fleet. The poller service samples it every four ticks (once a second at the shipped
//! tick), from the engines whose counter counts each prompt whole once its prefill is done
//! (vLLM; engines that count only the part they computed, like llama.cpp, would read their
//! prefix cache's hits as a smaller tokenizer), and only while this router sends nearly all the work the engines report (its requests in
//! flight at least `MIN_OWN_SHARE` of those the engines report running or waiting, smoothed;
//! behind several routers the counter counts the others' prompts too, which would make every
//! prompt look larger than it is). It is used for every model until the answers have counted
//! `MIN_SAMPLES` prompts themselves.

use crate::fleet::books::Books;
use crate::ingest::engine::{Counter, Engine};

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

    /// A ratio learned elsewhere (the poller service's, see [`EngineCounts`]), as a scale that
    /// is in use.
    pub fn of_ratio(ratio: f64) -> PromptScale {
        if !(ratio.is_finite() && ratio > 0.0) {
            return PromptScale::default();
        }
        PromptScale {
            estimated: 1.0,
            reported: ratio,
            samples: MIN_SAMPLES,
        }
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
    /// The ratio the engines' counters gave (see [`EngineCounts`]), when known.
    engine: Option<PromptScale>,
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
    /// the fleet's once learned, else the engines' counters' when known (the fleet's, at 1,
    /// otherwise).
    pub fn of(&self, model: Option<&str>) -> &PromptScale {
        let learned = |s: &&PromptScale| s.samples() >= MIN_SAMPLES;
        model
            .and_then(|name| self.models.iter().find(|m| m.name == name))
            .map(|m| &m.scale)
            .filter(learned)
            .or_else(|| Some(&self.fleet).filter(learned))
            .or(self.engine.as_ref())
            .unwrap_or(&self.fleet)
    }

    /// The ratio the engines' counters gave, as the poller service publishes it (`None`: not
    /// known).
    pub fn set_engine(&mut self, ratio: Option<f64>) {
        self.engine = ratio.map(PromptScale::of_ratio);
    }

    /// The engines' counters' ratio in use, if known.
    pub fn engine_ratio(&self) -> Option<f64> {
        self.engine.map(|s| s.ratio())
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

/// Smallest share of the requests the engines report that must be this router's for the
/// engines' counters to be sampled.
pub const MIN_OWN_SHARE: f64 = 0.8;
/// Requests the engines must report (smoothed) before the share decides anything.
const MIN_REPORTED: f64 = 1.0;
/// Each pass keeps this much of the smoothed share before it: about five passes' memory.
const SHARE_KEEP: f64 = 0.8;

/// What one node says at a pass of [`EngineCounts::observe`] (the default: nothing).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NodeCount {
    /// Who holds the slot (`node::tenant_of`): a new tenant starts over.
    pub tenant: u64,
    /// The engine's prompt-token counter at its last scrape, and the engine.
    pub counter: Option<(Engine, Counter)>,
    /// Its shared books.
    pub books: Books,
    /// Requests its last report shows running or waiting, if it says.
    pub reported: Option<f64>,
}

/// The last pass's figures of one node.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mark {
    tenant: u64,
    counter: Counter,
    text: u64,
    other: u64,
}

/// The engines' prompt counters against the books' started prompts (see the module).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineCounts {
    last: Vec<Option<Mark>>,
    scale: PromptScale,
    /// This router's requests and all the requests the engines report, smoothed; none before
    /// the first pass.
    share: Option<(f64, f64)>,
}

impl EngineCounts {
    /// One pass over every node (`nodes[i]` is slot `i`): each node whose engine counts whole
    /// prompts and whose counter and books moved comparably since the last pass adds to the
    /// sample, which is taken while this router's share of the reported requests is at least
    /// `MIN_OWN_SHARE`.
    pub fn observe(&mut self, nodes: &[NodeCount]) {
        self.last.resize(nodes.len(), None);
        let (mut own, mut reported) = (0.0, 0.0);
        let (mut counted, mut text, mut other) = (0.0, 0u64, 0u64);
        for (n, last) in nodes.iter().zip(self.last.iter_mut()) {
            if let Some(r) = n.reported.filter(|r| r.is_finite() && *r >= 0.0) {
                reported += r;
                // This router's requests in flight now against the engine's at its last poll:
                // the books' count since the report (`in_report_requests`) loses the requests
                // that end between a poll and the pass, which short requests often do; in a
                // steady state the two moments see as many.
                own += n.books.inflight_requests as f64;
            }
            let Some((_, counter)) = n.counter.filter(|(e, _)| e.counts_whole_prompts()) else {
                *last = None;
                continue;
            };
            let mark = Mark {
                tenant: n.tenant,
                counter,
                text: n.books.started_text_prompt,
                other: n.books.started_other_prompt,
            };
            if let Some(before) = last.replace(mark) {
                let comparable = before.tenant == mark.tenant
                    && before.counter.series == mark.counter.series
                    && mark.counter.total >= before.counter.total
                    && mark.text >= before.text
                    && mark.other >= before.other;
                if comparable {
                    counted += mark.counter.total - before.counter.total;
                    text = text.saturating_add(mark.text - before.text);
                    other = other.saturating_add(mark.other - before.other);
                }
            }
        }
        let (own, reported) = match self.share {
            None => (own, reported),
            Some((o, r)) => (
                SHARE_KEEP * o + (1.0 - SHARE_KEEP) * own,
                SHARE_KEEP * r + (1.0 - SHARE_KEEP) * reported,
            ),
        };
        self.share = Some((own, reported));
        let alone = reported >= MIN_REPORTED && own / reported >= MIN_OWN_SHARE;
        if !alone || !counted.is_finite() {
            return;
        }
        // What the engines counted of the prompts the filter estimated from text: their whole
        // count less what it knew exactly.
        let of_text = (counted - other as f64).max(0.0);
        if of_text >= u64::MAX as f64 {
            return;
        }
        self.scale.observe(text, of_text.round() as u64);
    }

    /// Engine tokens per estimated token, once `MIN_SAMPLES` passes have counted a sample.
    pub fn ratio(&self) -> Option<f64> {
        (self.scale.samples() >= MIN_SAMPLES).then(|| self.scale.ratio())
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

    /// A node at a pass: its engine's counter at `total` (series `series`), the started
    /// prompts' totals in its books, and the requests its report shows.
    fn node(
        engine: Engine,
        total: f64,
        series: u32,
        text: u64,
        other: u64,
        reported: f64,
    ) -> NodeCount {
        NodeCount {
            tenant: 1,
            counter: Some((engine, Counter { total, series })),
            books: Books {
                started_text_prompt: text,
                started_other_prompt: other,
                // This router's requests the report shows: all of them.
                inflight_requests: reported as u64,
                ..Books::default()
            },
            reported: Some(reported),
        }
    }

    /// `passes` passes of one vLLM node whose engine counts `per_pass` tokens each pass for
    /// `text` estimated and `other` exact prompt tokens started, with `ours` of the `reported`
    /// requests this router's.
    fn run(
        passes: u64,
        per_pass: f64,
        text: u64,
        other: u64,
        ours: u64,
        reported: f64,
    ) -> EngineCounts {
        let mut e = EngineCounts::default();
        for i in 0..passes {
            let mut n = node(
                Engine::Vllm,
                per_pass * i as f64,
                0,
                text * i,
                other * i,
                reported,
            );
            n.books.inflight_requests = ours;
            e.observe(&[n]);
        }
        e
    }

    #[test]
    fn the_engines_counters_give_the_ratio_while_this_router_sends_the_work() {
        let n = u64::from(MIN_SAMPLES) + 1;
        // (passes, engine tokens a pass, text estimate a pass, exact a pass, ours, reported,
        // ratio)
        type Case = (u64, f64, u64, u64, u64, f64, Option<f64>);
        let cases: &[Case] = &[
            (n, 1300.0, 1000, 0, 4, 4.0, Some(1.3)),
            // Not enough passes yet.
            (n - 1, 1300.0, 1000, 0, 4, 4.0, None),
            // Prompts of token ids are exact: the engine's count of them is taken off.
            (n, 1800.0, 1000, 500, 4, 4.0, Some(1.3)),
            // Other routers send half the work: their prompts are in the counter, so no
            // sample.
            (n, 2600.0, 1000, 0, 2, 4.0, None),
            // Just at the share needed.
            (n, 1300.0, 1000, 0, 4, 5.0, Some(1.3)),
            // Nothing reported running: the share is not known, no sample.
            (n, 1300.0, 1000, 0, 0, 0.0, None),
            // No prompt started here: nothing learned.
            (n, 1300.0, 0, 0, 4, 4.0, None),
        ];
        for &(passes, per_pass, text, other, ours, reported, want) in cases {
            let e = run(passes, per_pass, text, other, ours, reported);
            match (e.ratio(), want) {
                (Some(got), Some(want)) => assert!((got - want).abs() < 1e-9, "{got}"),
                (got, want) => assert_eq!(
                    got, want,
                    "{passes} {per_pass} {text} {other} {ours} {reported}"
                ),
            }
        }
    }

    #[test]
    fn a_counter_that_restarts_or_another_engine_gives_no_sample() {
        let n = u64::from(MIN_SAMPLES) + 1;
        // (the node at pass i, samples expected)
        type Pass = fn(u64) -> NodeCount;
        let cases: &[(Pass, bool)] = &[
            // An engine that counts only what it computed is not sampled.
            (
                |i| node(Engine::LlamaCpp, 1300.0 * i as f64, 0, 1000 * i, 0, 4.0),
                false,
            ),
            // No counter.
            (
                |i| NodeCount {
                    counter: None,
                    ..node(Engine::Vllm, 0.0, 0, 1000 * i, 0, 4.0)
                },
                false,
            ),
            // The counter goes down every pass (restarts): never comparable.
            (
                |i| node(Engine::Vllm, 1e9 - 1300.0 * i as f64, 0, 1000 * i, 0, 4.0),
                false,
            ),
            // The series change every pass.
            (
                |i| node(Engine::Vllm, 1300.0 * i as f64, i as u32, 1000 * i, 0, 4.0),
                false,
            ),
            // The slot changes hands every pass.
            (
                |i| NodeCount {
                    tenant: i,
                    ..node(Engine::Vllm, 1300.0 * i as f64, 0, 1000 * i, 0, 4.0)
                },
                false,
            ),
        ];
        for (pass, learns) in cases {
            let mut e = EngineCounts::default();
            for i in 0..n {
                e.observe(&[pass(i)]);
            }
            assert_eq!(e.ratio().is_some(), *learns, "{:?}", pass(1));
        }
        // A restart (the counter starts over) costs one pass, and the ratio is still what the
        // engine counts.
        let mut e = EngineCounts::default();
        for i in 0..n + 1 {
            let total = if i < 5 { 1300 * i } else { 1300 * (i - 5) };
            e.observe(&[node(Engine::Vllm, total as f64, 0, 1000 * i, 0, 4.0)]);
        }
        assert!((e.ratio().unwrap() - 1.3).abs() < 1e-9);
        // Two nodes add up, a node without a counter in between changes nothing.
        let mut e = EngineCounts::default();
        for i in 0..n {
            let a = node(Engine::Vllm, 1000.0 * i as f64, 0, 1000 * i, 0, 2.0);
            let b = node(Engine::Vllm, 2000.0 * i as f64, 0, 1000 * i, 0, 2.0);
            e.observe(&[a, NodeCount::default(), b]);
        }
        assert!((e.ratio().unwrap() - 1.5).abs() < 1e-9);
    }

    #[test]
    fn the_engines_ratio_stands_in_until_the_answers_have_counted_enough() {
        let mut s = PromptScales::default();
        assert_eq!(s.of(None).apply(1000), 1000);
        s.set_engine(Some(1.3));
        assert_eq!(s.engine_ratio(), Some(1.3));
        assert_eq!(s.of(None).apply(1000), 1300);
        assert_eq!(s.of(Some("m")).apply(1000), 1300);
        // Answers that counted prompts win once there are enough of them.
        for _ in 0..MIN_SAMPLES {
            s.observe(Some("m"), 1000, 900);
        }
        assert_eq!(s.of(Some("m")).apply(1000), 900);
        assert_eq!(s.of(None).apply(1000), 900);
        // A ratio that is no ratio, or none, is not used.
        let mut s = PromptScales::default();
        s.set_engine(Some(f64::NAN));
        assert_eq!(s.of(None).apply(1000), 1000);
        s.set_engine(None);
        assert_eq!(s.engine_ratio(), None);
    }
}
