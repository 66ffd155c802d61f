//! A continuous-batching model of one GPU inference node, in model time.
//!
//! Engines like vLLM schedule at the granularity of one model iteration (Orca, OSDI'22): each
//! iteration decodes one token for every running sequence and, with chunked prefill
//! (Sarathi-Serve, OSDI'24), spends the rest of a fixed token budget on the prompts of newly
//! admitted sequences. So an iteration's time grows with the tokens in it:
//!
//! ```text
//!   iteration_ms = max(floor_ms, per_token_ms * tokens) + attention_ms_per_1k_ctx * context / 1000 + overhead_ms
//! ```
//!
//! with the published operator figures for Llama-2-7B on one GPU (floor 5.6 ms and 0.0204 ms
//! a token on H100, 9.3 ms and 0.063 ms on A100; see ../shared/NOTES.md) and an attention term
//! for the cached context the batch reads. The KV cache stands for VRAM: a sequence holds one
//! KV slot per token of context (prompt plus generated). New sequences wait while the cache
//! cannot hold their context; when running sequences outgrow it, the most recently admitted one
//! is preempted (its KV freed, recomputed later from the front of the queue) and the event is
//! counted as a VRAM overflow.
//!
//! The model never reads a clock: `step(now_ms)` plans and applies one iteration starting at
//! `now_ms` and returns its duration and the events that happen at its end. The HTTP server
//! sleeps that long (scaled) before delivering them; a simulator just advances its clock.

use std::collections::VecDeque;

/// Speed and size of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub floor_ms: f64,
    pub per_token_ms: f64,
    pub overhead_ms: f64,
    pub attention_ms_per_1k_ctx: f64,
    pub kv_capacity_tokens: u64,
    pub max_running: usize,
    pub prefill_chunk_tokens: u64,
}

impl EngineConfig {
    /// H100-80GB-like: ~130k tokens of KV after 7B weights.
    pub fn h100() -> Self {
        EngineConfig {
            floor_ms: 5.6,
            per_token_ms: 0.0204,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 0.01,
            kv_capacity_tokens: 130_000,
            max_running: 256,
            prefill_chunk_tokens: 512,
        }
    }

    /// A100-40GB-like: ~50k tokens of KV.
    pub fn a100() -> Self {
        EngineConfig {
            floor_ms: 9.3,
            per_token_ms: 0.063,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 0.025,
            kv_capacity_tokens: 50_000,
            max_running: 256,
            prefill_chunk_tokens: 512,
        }
    }

    /// L4-24GB-like: a slower, smaller inference card (~20k tokens of KV).
    pub fn l4() -> Self {
        EngineConfig {
            floor_ms: 15.0,
            per_token_ms: 0.15,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 0.06,
            kv_capacity_tokens: 20_000,
            max_running: 128,
            prefill_chunk_tokens: 512,
        }
    }

    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "h100" => Some(Self::h100()),
            "a100" => Some(Self::a100()),
            "l4" => Some(Self::l4()),
            _ => None,
        }
    }

    pub fn iteration_ms(&self, tokens: u64, context_tokens: u64) -> f64 {
        (self.per_token_ms * tokens as f64).max(self.floor_ms)
            + self.attention_ms_per_1k_ctx * context_tokens as f64 / 1000.0
            + self.overhead_ms
    }

    /// Tokens per second at a full token budget and no context: the most the node processes.
    pub fn capacity_tokens_per_sec(&self) -> f64 {
        let t = self.prefill_chunk_tokens;
        t as f64 / self.iteration_ms(t, 0) * 1000.0
    }
}

/// What happens to a request at the end of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The request produced output token number `index` (0-based).
    Token { id: u64, index: u64 },
    /// The request produced its last token.
    Finished { id: u64 },
    /// The request was preempted (KV overflow) and waits to be recomputed.
    Preempted { id: u64 },
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    prompt: u64,
    output: u64,
    generated: u64,
    /// Context tokens still to prefill (the prompt, or prompt + generated after preemption).
    to_prefill: u64,
}

impl Seq {
    fn context(&self) -> u64 {
        self.prompt + self.generated
    }
}

/// One planned-and-applied iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Iteration {
    pub duration_ms: f64,
    pub tokens: u64,
    pub events: Vec<Event>,
}

#[derive(Debug, Clone)]
pub struct Engine {
    pub config: EngineConfig,
    waiting: VecDeque<Seq>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<Seq>,
    kv_used: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub vram_overflow_events: u64,
    /// (end time of an iteration, tokens in it), for the load window.
    window: VecDeque<(f64, u64)>,
}

/// Width of the window the reported load is measured over.
pub const LOAD_WINDOW_MS: f64 = 1000.0;

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        Engine {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv_used: 0,
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            vram_overflow_events: 0,
            window: VecDeque::new(),
        }
    }

    /// Queues a request. `output` is at least 1 (a request produces at least one token).
    pub fn submit(&mut self, id: u64, prompt: u64, output: u64) {
        self.waiting.push_back(Seq {
            id,
            prompt,
            output: output.max(1),
            generated: 0,
            to_prefill: prompt,
        });
    }

    /// Drops a request wherever it is (the client went away), freeing its KV.
    pub fn cancel(&mut self, id: u64) {
        self.waiting.retain(|s| s.id != id);
        if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(pos);
            self.kv_used = self.kv_used.saturating_sub(self.held(&s));
        }
    }

    /// KV slots a running sequence holds: the context prefilled so far.
    fn held(&self, s: &Seq) -> u64 {
        s.context() - s.to_prefill
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn kv_used_tokens(&self) -> u64 {
        self.kv_used
    }
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Tokens processed per second of model time over the last window.
    pub fn load_tokens_per_sec(&mut self, now_ms: f64) -> f64 {
        while matches!(self.window.front(), Some((t, _)) if *t < now_ms - LOAD_WINDOW_MS) {
            self.window.pop_front();
        }
        let tokens: u64 = self.window.iter().map(|(_, n)| n).sum();
        tokens as f64 / (LOAD_WINDOW_MS / 1000.0)
    }

    fn admit(&mut self) {
        while self.running.len() < self.config.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            // Admit when the sequence's context fits beside the context of those running now
            // (their future output is not reserved: that is how running sequences can outgrow
            // the cache). A lone sequence is always admitted, or it would wait forever.
            let committed: u64 = self.running.iter().map(Seq::context).sum();
            if committed + next.context() > self.config.kv_capacity_tokens
                && !self.running.is_empty()
            {
                break;
            }
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
            }
        }
    }

    /// Plans and applies one iteration starting at `now_ms`; `None` when nothing can run.
    pub fn step(&mut self, now_ms: f64) -> Option<Iteration> {
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        let decoding = self.running.iter().filter(|s| s.to_prefill == 0).count() as u64;
        let chunk = self.config.prefill_chunk_tokens;
        let mut budget = chunk.saturating_sub(decoding).max(chunk / 8);
        let context: u64 = self.running.iter().map(|s| s.context()).sum();
        let mut events = Vec::new();
        let mut prefilled = 0;
        let mut generated = 0;
        for s in &mut self.running {
            if s.to_prefill > 0 {
                if budget == 0 {
                    continue;
                }
                let take = s.to_prefill.min(budget);
                budget -= take;
                s.to_prefill -= take;
                prefilled += take;
                if s.to_prefill > 0 {
                    continue;
                }
                // The iteration that finishes a prefill also samples the next token.
            }
            s.generated += 1;
            generated += 1;
            events.push(Event::Token {
                id: s.id,
                index: s.generated - 1,
            });
            if s.generated >= s.output {
                events.push(Event::Finished { id: s.id });
            }
        }
        self.kv_used += prefilled + generated;
        self.prompt_tokens_total += prefilled;
        self.generation_tokens_total += generated;
        let tokens = prefilled + generated;
        let duration_ms = self.config.iteration_ms(tokens, context);

        // Finished sequences free their KV.
        let mut freed = 0;
        self.running.retain(|s| {
            let done = s.generated >= s.output && s.to_prefill == 0;
            if done {
                freed += s.context();
            }
            !done
        });
        self.kv_used -= freed.min(self.kv_used);

        // Outgrown the cache: preempt the newest sequences until it fits again.
        while self.kv_used > self.config.kv_capacity_tokens && self.running.len() > 1 {
            let Some(mut victim) = self.running.pop() else {
                break;
            };
            self.kv_used -= self.held(&victim).min(self.kv_used);
            victim.to_prefill = victim.context();
            self.vram_overflow_events += 1;
            events.push(Event::Preempted { id: victim.id });
            self.waiting.push_front(victim);
        }

        self.window.push_back((now_ms + duration_ms, tokens));
        Some(Iteration {
            duration_ms,
            tokens,
            events,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(kv: u64) -> EngineConfig {
        EngineConfig {
            floor_ms: 5.0,
            per_token_ms: 0.1,
            overhead_ms: 1.0,
            attention_ms_per_1k_ctx: 0.0,
            kv_capacity_tokens: kv,
            max_running: 8,
            prefill_chunk_tokens: 100,
        }
    }

    #[test]
    fn iteration_time_formula() {
        let c = EngineConfig::h100();
        for (tokens, ctx, want) in [
            (1, 0, 5.6 + 2.0),
            (512, 0, 512.0 * 0.0204 + 2.0),
            (10, 100_000, 5.6 + 1.0 + 2.0),
        ] {
            assert!(
                (c.iteration_ms(tokens, ctx) - want).abs() < 1e-9,
                "{tokens} {ctx}"
            );
        }
        assert!(
            EngineConfig::h100().capacity_tokens_per_sec()
                > EngineConfig::a100().capacity_tokens_per_sec()
        );
        assert!(
            EngineConfig::a100().capacity_tokens_per_sec()
                > EngineConfig::l4().capacity_tokens_per_sec()
        );
    }

    #[test]
    fn chunked_prefill_then_one_token_per_iteration() {
        let mut e = Engine::new(small(10_000));
        e.submit(1, 250, 3);
        // 250 prompt tokens at 100 a chunk: two iterations of pure prefill, then the third
        // finishes the prompt and samples token 0.
        let i1 = e.step(0.0).unwrap();
        assert_eq!((i1.tokens, i1.events.len()), (100, 0));
        let i2 = e.step(10.0).unwrap();
        assert_eq!(i2.tokens, 100);
        let i3 = e.step(20.0).unwrap();
        assert_eq!(i3.events, vec![Event::Token { id: 1, index: 0 }]);
        assert_eq!(i3.tokens, 51);
        let i4 = e.step(30.0).unwrap();
        assert_eq!(i4.events, vec![Event::Token { id: 1, index: 1 }]);
        let i5 = e.step(40.0).unwrap();
        assert_eq!(
            i5.events,
            vec![Event::Token { id: 1, index: 2 }, Event::Finished { id: 1 }]
        );
        assert!(e.is_idle());
        assert_eq!(e.kv_used_tokens(), 0);
        assert_eq!((e.prompt_tokens_total, e.generation_tokens_total), (250, 3));
        assert!(e.step(50.0).is_none());
    }

    #[test]
    fn decodes_batch_together() {
        let mut e = Engine::new(small(10_000));
        for id in 0..4 {
            e.submit(id, 10, 2);
        }
        let i = e.step(0.0).unwrap();
        assert_eq!(i.tokens, 40 + 4);
        assert_eq!(
            i.events
                .iter()
                .filter(|ev| matches!(ev, Event::Token { .. }))
                .count(),
            4
        );
        assert_eq!(e.running(), 4);
    }

    #[test]
    fn admission_waits_for_kv() {
        let mut e = Engine::new(small(100));
        e.submit(1, 80, 5);
        e.submit(2, 50, 5);
        e.step(0.0).unwrap();
        assert_eq!(
            (e.running(), e.waiting()),
            (1, 1),
            "80 + 50 > 100: the second waits"
        );
        let mut first_done_at = None;
        let mut t = 1.0;
        while e.waiting() == 1 && t < 50.0 {
            if let Some(i) = e.step(t) {
                if i.events.contains(&Event::Finished { id: 1 }) {
                    first_done_at = Some(t);
                }
            }
            t += 1.0;
        }
        assert_eq!(e.waiting(), 0);
        assert!(
            first_done_at.is_some_and(|d| d < t),
            "admitted only after the first finished"
        );
    }

    #[test]
    fn outgrowing_the_cache_preempts_the_newest_and_counts_it() {
        let mut e = Engine::new(small(100));
        e.submit(1, 45, 20);
        e.submit(2, 45, 20);
        let (mut preempted, mut finished) = (vec![], 0);
        for t in 0..400 {
            if let Some(i) = e.step(t as f64) {
                for ev in &i.events {
                    match ev {
                        Event::Preempted { id } => preempted.push(*id),
                        Event::Finished { .. } => finished += 1,
                        Event::Token { .. } => {}
                    }
                }
            }
            assert!(e.kv_used_tokens() <= 100);
        }
        assert_eq!(preempted.first(), Some(&2), "the newest is preempted");
        assert_eq!(e.vram_overflow_events, preempted.len() as u64);
        assert!(e.vram_overflow_events >= 1);
        assert_eq!(finished, 2, "both still finish in the end");
        assert!(e.is_idle());
    }

    #[test]
    fn load_window() {
        let mut e = Engine::new(small(10_000));
        e.submit(1, 100, 1);
        let i = e.step(0.0).unwrap();
        assert_eq!(i.tokens, 101, "the whole prompt and the first token");
        assert_eq!(e.load_tokens_per_sec(10.0), 101.0);
        assert_eq!(e.load_tokens_per_sec(2000.0), 0.0);
    }

    #[test]
    fn cancel_frees_kv() {
        let mut e = Engine::new(small(10_000));
        e.submit(1, 50, 10);
        e.submit(2, 50, 10);
        e.step(0.0).unwrap();
        e.cancel(1);
        e.cancel(2);
        assert_eq!(e.kv_used_tokens(), 0);
        assert!(e.is_idle());
    }
}
