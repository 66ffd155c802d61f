//! A continuous-batching model of one GPU inference node, in model time.
//!
//! Engines like vLLM schedule one model iteration at a time rather than one request at a time
//! (iteration-level scheduling, Orca, OSDI'22): every iteration decodes one token for each
//! running sequence, and newly admitted sequences join the batch at the next iteration instead
//! of waiting for the batch to drain. With chunked prefill (Sarathi-Serve, OSDI'24) an iteration
//! has a token budget (`prefill_chunk_tokens`): the decode tokens come first and what remains of
//! the budget goes to prompt tokens, so a long prompt is spread over several iterations and
//! does not stall the decoders. An iteration's time therefore grows with the tokens in it:
//!
//! ```text
//!   iteration_ms = max(floor_ms, per_token_ms * tokens)              // the weights' matmuls
//!                + attention_ms_per_1k_ctx * cached_context / 1000   // reading the KV cache
//!                + overhead_ms                                       // scheduler, sampling
//! ```
//!
//! Figures (Llama-2-7B, fp16, one GPU; see ../shared/NOTES.md):
//! - floor and slope from published operator profiling: max(5.6 ms, 0.0204 ms x tokens) on H100,
//!   max(9.3 ms, 0.063 ms x tokens) on A100. The floor is the time to read the weights once
//!   (13.5 GB / 3.35 TB/s = 4 ms on H100, / 1.55 TB/s = 8.7 ms on A100); the slope is ~14 GFLOP
//!   a token at ~70% of the tensor peak.
//! - attention: decoding reads every cached KV token of the batch once per iteration, which is
//!   bound by memory bandwidth: 1000 tokens x 512 KiB = 0.52 GB, i.e. 0.16 ms on H100
//!   (3.35 TB/s), 0.34 ms on A100-40GB (1.55 TB/s), 1.75 ms on L4 (300 GB/s).
//! - KV cache: 2 x 32 layers x 4096 x 2 bytes = 512 KiB a token; 80 GB less ~14 GB of weights
//!   holds ~130k tokens, 40 GB ~50k.
//! - overhead: a couple of ms of CPU work per iteration (scheduling, sampling, detokenizing).
//!
//! The KV cache stands for VRAM: a running sequence holds one slot per context token it has
//! prefilled or generated. New sequences wait (FIFO) while the cache cannot hold their context
//! beside that of the running ones; the running ones' future output is not reserved, so they
//! can outgrow the cache. Then the most recently admitted one is preempted by recomputation
//! (vLLM's default): its KV is freed, it goes back to the front of the queue, and when admitted
//! again it prefills prompt + generated-so-far before producing its next token. Each such
//! preemption counts as one VRAM overflow event.
//!
//! The model never reads a clock and has no I/O: `step(now_ms)` plans and applies one iteration
//! starting at `now_ms` and returns its duration and the events that happen at its end. The
//! HTTP server sleeps that long (scaled) before delivering the events; a simulator advances its
//! clock instead.

use std::collections::VecDeque;

/// Speed and size of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Shortest iteration (reading the weights once), ms.
    pub floor_ms: f64,
    /// Compute per token in the iteration, ms.
    pub per_token_ms: f64,
    /// Fixed CPU cost per iteration, ms.
    pub overhead_ms: f64,
    /// Attention cost per 1000 cached context tokens in the batch, ms.
    pub attention_ms_per_1k_ctx: f64,
    /// KV cache size in tokens (VRAM left after the weights / 512 KiB).
    pub kv_capacity_tokens: u64,
    /// Most sequences in one batch.
    pub max_running: usize,
    /// Token budget of one iteration (decode tokens first, the rest for prefill).
    pub prefill_chunk_tokens: u64,
}

impl EngineConfig {
    /// H100-80GB, Llama-2-7B fp16: ~130k tokens of KV after the weights.
    pub fn h100() -> Self {
        EngineConfig {
            floor_ms: 5.6,
            per_token_ms: 0.0204,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 0.16,
            kv_capacity_tokens: 130_000,
            max_running: 256,
            prefill_chunk_tokens: 512,
        }
    }

    /// A100-40GB, Llama-2-7B fp16: ~50k tokens of KV.
    pub fn a100() -> Self {
        EngineConfig {
            floor_ms: 9.3,
            per_token_ms: 0.063,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 0.34,
            kv_capacity_tokens: 50_000,
            max_running: 256,
            prefill_chunk_tokens: 512,
        }
    }

    /// L4-24GB-class: a slow, small inference card. The floor fits a 4-bit 7B model (~4 GB of
    /// weights at 300 GB/s is ~13 ms; fp16 weights would take ~45 ms), leaving room for ~20k
    /// tokens of fp16 KV; attention follows its 300 GB/s.
    pub fn l4() -> Self {
        EngineConfig {
            floor_ms: 15.0,
            per_token_ms: 0.15,
            overhead_ms: 2.0,
            attention_ms_per_1k_ctx: 1.75,
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

    /// Duration of an iteration of `tokens` tokens over `cached_context` KV tokens.
    pub fn iteration_ms(&self, tokens: u64, cached_context: u64) -> f64 {
        (self.per_token_ms * tokens as f64).max(self.floor_ms)
            + self.attention_ms_per_1k_ctx * cached_context as f64 / 1000.0
            + self.overhead_ms
    }

    /// Tokens per second of model time at a full token budget and an empty cache: the most the
    /// node processes. (A full cache slows it down through the attention term.)
    pub fn capacity_tokens_per_sec(&self) -> f64 {
        let t = self.prefill_chunk_tokens;
        let ms = self.iteration_ms(t, 0);
        if ms > 0.0 {
            t as f64 / ms * 1000.0
        } else {
            0.0
        }
    }
}

/// What happens to a request at the end of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The request produced output token number `index` (0-based; index 0 is the first token,
    /// sampled by the iteration that finishes the prompt's prefill).
    Token { id: u64, index: u64 },
    /// The request produced its last token (follows that token's `Token` event).
    Finished { id: u64 },
    /// The request was preempted (KV overflow); it waits at the front of the queue and
    /// continues from where it was once its context is recomputed.
    Preempted { id: u64 },
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    prompt: u64,
    output: u64,
    generated: u64,
    /// Context tokens still to prefill: the prompt, or prompt + generated after a preemption.
    to_prefill: u64,
}

impl Seq {
    fn context(&self) -> u64 {
        self.prompt + self.generated
    }

    /// KV slots the sequence holds: the context prefilled so far.
    fn held(&self) -> u64 {
        self.context().saturating_sub(self.to_prefill)
    }
}

/// One planned-and-applied iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct Iteration {
    pub duration_ms: f64,
    /// Prompt and generated tokens processed.
    pub tokens: u64,
    /// In order: tokens (in batch order), finishes, then preemptions.
    pub events: Vec<Event>,
}

/// Width of the window the reported load is measured over, model ms.
pub const LOAD_WINDOW_MS: f64 = 1000.0;

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
    /// (end time of an iteration, tokens in it), oldest first, for the load window.
    window: VecDeque<(f64, u64)>,
}

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

    /// Queues a request. A request produces at least one token, so `output` 0 counts as 1.
    pub fn submit(&mut self, id: u64, prompt_tokens: u64, output_tokens: u64) {
        self.waiting.push_back(Seq {
            id,
            prompt: prompt_tokens,
            output: output_tokens.max(1),
            generated: 0,
            to_prefill: prompt_tokens,
        });
    }

    /// Drops a request wherever it is (the client went away), freeing its KV.
    pub fn cancel(&mut self, id: u64) {
        self.waiting.retain(|s| s.id != id);
        if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(pos);
            self.kv_used = self.kv_used.saturating_sub(s.held());
        }
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
    /// KV cache use, 0..1 (above 1 only for a lone sequence larger than the cache).
    pub fn kv_cache_usage(&self) -> f64 {
        match self.config.kv_capacity_tokens {
            0 => 0.0,
            cap => self.kv_used as f64 / cap as f64,
        }
    }
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
    pub fn capacity_tokens_per_sec(&self) -> f64 {
        self.config.capacity_tokens_per_sec()
    }

    /// Tokens (prompt and generated) of the iterations that ended in the last window before
    /// `now_ms`, per second of model time.
    pub fn load_tokens_per_sec(&mut self, now_ms: f64) -> f64 {
        self.prune_window(now_ms);
        let tokens: u64 = self
            .window
            .iter()
            .filter(|(end, _)| *end <= now_ms)
            .map(|(_, n)| n)
            .sum();
        tokens as f64 * 1000.0 / LOAD_WINDOW_MS
    }

    fn prune_window(&mut self, now_ms: f64) {
        while matches!(self.window.front(), Some((end, _)) if *end <= now_ms - LOAD_WINDOW_MS) {
            self.window.pop_front();
        }
    }

    /// FIFO admission while the batch has a free slot and the head's context fits in the cache
    /// beside the running sequences' whole context (prefilled or not). A lone sequence is
    /// always admitted, or one larger than the cache would block the queue forever.
    fn admit(&mut self) {
        let mut committed: u64 = self.running.iter().map(Seq::context).sum();
        while self.running.len() < self.config.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            let fits = committed + next.context() <= self.config.kv_capacity_tokens;
            if !fits && !self.running.is_empty() {
                break;
            }
            committed += next.context();
            if let Some(s) = self.waiting.pop_front() {
                self.running.push(s);
            }
        }
    }

    /// Plans and applies one iteration starting at `now_ms`; `None` when nothing can run.
    pub fn step(&mut self, now_ms: f64) -> Option<Iteration> {
        self.prune_window(now_ms);
        self.admit();
        if self.running.is_empty() {
            return None;
        }
        // Decode tokens first; the rest of the budget prefills, in admission order. At least
        // an eighth of the budget always goes to prefill so a batch of decoders larger than
        // the budget cannot starve the prompts.
        let decoding = self.running.iter().filter(|s| s.to_prefill == 0).count() as u64;
        let chunk = self.config.prefill_chunk_tokens;
        let mut budget = chunk.saturating_sub(decoding).max(chunk / 8).max(1);
        let cached_context = self.kv_used;
        let mut events = Vec::new();
        let (mut prefilled, mut generated) = (0, 0);
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
        }
        self.kv_used += prefilled + generated;
        self.prompt_tokens_total += prefilled;
        self.generation_tokens_total += generated;
        let tokens = prefilled + generated;
        let duration_ms = self.config.iteration_ms(tokens, cached_context);

        // Finished sequences free their KV.
        let mut freed = 0;
        self.running.retain(|s| {
            let done = s.to_prefill == 0 && s.generated >= s.output;
            if done {
                freed += s.held();
                events.push(Event::Finished { id: s.id });
            }
            !done
        });
        self.kv_used = self.kv_used.saturating_sub(freed);

        // Outgrown the cache: preempt the newest sequences until it fits again.
        while self.kv_used > self.config.kv_capacity_tokens && self.running.len() > 1 {
            let Some(mut victim) = self.running.pop() else {
                break;
            };
            self.kv_used = self.kv_used.saturating_sub(victim.held());
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

    /// Round numbers, no attention term unless a test sets it.
    fn small(kv: u64, max_running: usize) -> EngineConfig {
        EngineConfig {
            floor_ms: 5.0,
            per_token_ms: 0.1,
            overhead_ms: 1.0,
            attention_ms_per_1k_ctx: 0.0,
            kv_capacity_tokens: kv,
            max_running,
            prefill_chunk_tokens: 100,
        }
    }

    /// Steps until idle (or `limit` iterations), collecting every event in order.
    fn run(e: &mut Engine, limit: usize) -> Vec<Event> {
        let (mut t, mut all) = (0.0, vec![]);
        for _ in 0..limit {
            let Some(i) = e.step(t) else { break };
            t += i.duration_ms;
            all.extend(i.events);
        }
        all
    }

    fn tokens_of(events: &[Event], id: u64) -> Vec<u64> {
        events
            .iter()
            .filter_map(|ev| match *ev {
                Event::Token { id: i, index } if i == id => Some(index),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn iteration_time_formula() {
        let h = EngineConfig::h100();
        let mut att = small(1000, 8);
        att.attention_ms_per_1k_ctx = 0.5;
        for (c, tokens, ctx, want) in [
            (&h, 1, 0, 5.6 + 2.0),               // below the floor
            (&h, 274, 0, 5.6 + 2.0),             // 274 x 0.0204 = 5.59, still the floor
            (&h, 512, 0, 512.0 * 0.0204 + 2.0),  // compute-bound
            (&h, 10, 100_000, 5.6 + 16.0 + 2.0), // attention over 100k cached tokens
            (&att, 100, 2000, 10.0 + 1.0 + 1.0), // 100 x 0.1, 2k ctx x 0.5
            (&att, 0, 0, 5.0 + 1.0),             // empty iteration: floor + overhead
        ] {
            let got = c.iteration_ms(tokens, ctx);
            assert!((got - want).abs() < 1e-9, "{tokens} {ctx}: {got} != {want}");
        }
    }

    #[test]
    fn capacity_orders_the_presets() {
        let caps: Vec<f64> = ["h100", "a100", "l4"]
            .iter()
            .filter_map(|n| EngineConfig::preset(n))
            .map(|c| c.capacity_tokens_per_sec())
            .collect();
        assert_eq!(caps.len(), 3);
        assert!(caps[0] > caps[1] && caps[1] > caps[2], "{caps:?}");
        // H100: 512 tokens in 512 x 0.0204 + 2 ms.
        assert!((caps[0] - 512.0 / (512.0 * 0.0204 + 2.0) * 1000.0).abs() < 1e-6);
        assert!(EngineConfig::preset("tpu").is_none());
    }

    #[test]
    fn chunked_prefill_then_one_token_per_iteration() {
        let mut e = Engine::new(small(10_000, 8));
        e.submit(1, 250, 3);
        // 250 prompt tokens at 100 a chunk: two iterations of pure prefill, then the third
        // finishes the prompt and samples token 0, then one token per iteration.
        let want: [(u64, Vec<Event>); 5] = [
            (100, vec![]),
            (100, vec![]),
            (51, vec![Event::Token { id: 1, index: 0 }]),
            (1, vec![Event::Token { id: 1, index: 1 }]),
            (
                1,
                vec![Event::Token { id: 1, index: 2 }, Event::Finished { id: 1 }],
            ),
        ];
        for (n, (tokens, events)) in want.into_iter().enumerate() {
            let i = e.step(n as f64 * 10.0).unwrap();
            assert_eq!((i.tokens, i.events), (tokens, events), "iteration {n}");
        }
        assert!(e.is_idle());
        assert_eq!(e.kv_used_tokens(), 0);
        assert_eq!((e.prompt_tokens_total, e.generation_tokens_total), (250, 3));
        assert!(e.step(50.0).is_none());
    }

    #[test]
    fn decodes_first_then_prefills_with_the_rest_of_the_budget() {
        let mut e = Engine::new(small(10_000, 8));
        for id in 0..3 {
            e.submit(id, 10, 5);
        }
        // All three prompts fit one chunk: 30 prefill + 3 first tokens.
        let i = e.step(0.0).unwrap();
        assert_eq!(i.tokens, 33);
        e.submit(9, 500, 1);
        // Three decode tokens, then 97 of the long prompt.
        let i = e.step(10.0).unwrap();
        assert_eq!(i.tokens, 100);
        assert_eq!(tokens_of(&i.events, 9), Vec::<u64>::new());
        assert_eq!(e.kv_used_tokens(), 33 + 3 + 97);
    }

    #[test]
    fn decoding_order_is_admission_order() {
        let mut e = Engine::new(small(10_000, 8));
        for id in [7, 3, 5] {
            e.submit(id, 4, 2);
        }
        let events = run(&mut e, 10);
        let ids: Vec<u64> = events
            .iter()
            .filter_map(|ev| match ev {
                Event::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(ids, vec![7, 3, 5, 7, 3, 5]);
        for id in [7, 3, 5] {
            assert_eq!(tokens_of(&events, id), vec![0, 1]);
        }
        assert_eq!(events.len(), 9, "six tokens and three finishes");
    }

    #[test]
    fn admission_is_limited_by_kv_and_batch_size() {
        // (kv capacity, max running, prompts) -> (running, waiting) after the first step
        for (kv, max_running, prompts, want) in [
            (100, 8, vec![80, 50], (1, 1)),        // 80 + 50 > 100
            (100, 8, vec![49, 49], (2, 0)),        // full with the first tokens: fits
            (100, 8, vec![150, 10], (1, 1)),       // a lone oversized one still runs
            (10_000, 2, vec![10, 10, 10], (2, 1)), // batch slots
            (100, 8, vec![20, 90, 10], (1, 2)),    // FIFO: 10 does not jump past 90
        ] {
            let mut e = Engine::new(small(kv, max_running));
            for (id, p) in prompts.iter().enumerate() {
                e.submit(id as u64, *p, 50);
            }
            e.step(0.0).unwrap();
            assert_eq!(
                (e.running(), e.waiting()),
                want,
                "{kv} {max_running} {prompts:?}"
            );
        }
    }

    #[test]
    fn a_waiting_request_is_admitted_when_kv_frees() {
        let mut e = Engine::new(small(100, 8));
        e.submit(1, 80, 5);
        e.submit(2, 50, 5);
        let events = run(&mut e, 100);
        let finish_1 = events
            .iter()
            .position(|ev| *ev == Event::Finished { id: 1 });
        let first_2 = events
            .iter()
            .position(|ev| *ev == Event::Token { id: 2, index: 0 });
        assert!(finish_1.unwrap() < first_2.unwrap(), "{events:?}");
        assert!(e.is_idle());
    }

    #[test]
    fn outgrowing_the_cache_preempts_the_newest_and_counts_it() {
        let mut e = Engine::new(small(100, 8));
        e.submit(1, 45, 20);
        e.submit(2, 45, 20);
        let (mut t, mut events) = (0.0, vec![]);
        while let Some(i) = e.step(t) {
            t += i.duration_ms;
            events.extend(i.events);
            assert!(e.kv_used_tokens() <= 100);
        }
        let preempted: Vec<u64> = events
            .iter()
            .filter_map(|ev| match ev {
                Event::Preempted { id } => Some(*id),
                _ => None,
            })
            .collect();
        // Both admitted (90 <= 100); at 45+5 + 45+5 = 100 the next token overflows.
        assert_eq!(preempted, vec![2], "the newest is preempted, once");
        assert_eq!(e.vram_overflow_events, 1);
        // Its progress is kept: after recomputation it continues, no token repeats.
        assert_eq!(tokens_of(&events, 2), (0..20).collect::<Vec<_>>());
        assert_eq!(tokens_of(&events, 1), (0..20).collect::<Vec<_>>());
        // The recompute prefilled prompt + generated again.
        assert!(e.prompt_tokens_total > 90);
        assert_eq!(e.generation_tokens_total, 40);
        assert!(e.is_idle());
        assert_eq!(e.kv_used_tokens(), 0);
    }

    #[test]
    fn load_window() {
        let mut e = Engine::new(small(10_000, 8));
        e.submit(1, 100, 1);
        let i = e.step(0.0).unwrap();
        assert_eq!(i.tokens, 101, "the whole prompt and the first token");
        let end = i.duration_ms; // 101 x 0.1 + 1 = 11.1 ms
        for (now, want) in [
            (end - 1.0, 0.0), // not done yet
            (end, 101.0),
            (500.0, 101.0),
            (end + LOAD_WINDOW_MS - 1.0, 101.0),
            (end + LOAD_WINDOW_MS, 0.0), // slid out
        ] {
            assert_eq!(e.load_tokens_per_sec(now), want, "at {now}");
        }
    }

    #[test]
    fn cancel_frees_kv_wherever_the_request_is() {
        let mut e = Engine::new(small(10_000, 1));
        e.submit(1, 50, 10);
        e.submit(2, 50, 10);
        e.step(0.0).unwrap();
        assert_eq!((e.running(), e.waiting(), e.kv_used_tokens()), (1, 1, 51));
        e.cancel(2);
        e.cancel(1);
        e.cancel(42);
        assert_eq!(e.kv_used_tokens(), 0);
        assert!(e.is_idle());
    }
}
