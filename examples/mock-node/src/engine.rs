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
//! Prefix caching (vLLM's automatic prefix caching; `prefix.rs` has the index): a request
//! comes with the chained hashes of its prompt's full blocks of `prefix_block_tokens` tokens.
//! At admission, the longest leading run of them that is cached is a hit: the sequence starts
//! with those tokens already computed (holding their KV), so its prefill is shorter. As in vLLM
//! at least one prompt token is always computed (the last block never hits when the whole
//! prompt is cached), because the iteration that finishes the prefill samples the first token.
//! Once its prefill completes, a sequence's full prompt blocks enter the cache (or refresh
//! there). Cached blocks held by running sequences count as used KV, once however many share
//! them; cached blocks nobody holds are *evictable*: they are free KV that still holds a
//! prefix, reclaimed least recently used first as soon as the running sequences need the
//! memory, and the index never holds more than `prefix_cache_blocks` (default: as many as the
//! KV cache holds, so the only limit is free memory; 0 disables caching). Counters follow vLLM
//! v1: queries and hits in tokens, counted at every admission.
//!
//! The model never reads a clock and has no I/O: `step(now_ms)` plans and applies one iteration
//! starting at `now_ms` and returns its duration and the events that happen at its end. The
//! HTTP server sleeps that long (scaled) before delivering the events; a simulator advances its
//! clock instead.

use crate::prefix::PrefixCache;
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
    /// Tokens in a prefix-cache block (and the KV block size reported in metrics).
    pub prefix_block_tokens: u64,
    /// Prefix-cache capacity in blocks; `None`: as many blocks as the KV cache holds; 0 turns
    /// prefix caching off.
    pub prefix_cache_blocks: Option<u64>,
}

/// vLLM's default KV block size.
pub const DEFAULT_BLOCK_TOKENS: u64 = 16;

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
            prefix_block_tokens: DEFAULT_BLOCK_TOKENS,
            prefix_cache_blocks: None,
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
            prefix_block_tokens: DEFAULT_BLOCK_TOKENS,
            prefix_cache_blocks: None,
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
            prefix_block_tokens: DEFAULT_BLOCK_TOKENS,
            prefix_cache_blocks: None,
        }
    }

    /// The prefix cache's capacity in blocks (see `prefix_cache_blocks`).
    pub fn prefix_capacity_blocks(&self) -> u64 {
        self.prefix_cache_blocks
            .unwrap_or(self.kv_capacity_tokens / self.prefix_block_tokens.max(1))
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

/// A request as the engine receives it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Request {
    pub id: u64,
    pub prompt_tokens: u64,
    /// Tokens to generate (0 counts as 1: a request produces at least one token).
    pub output_tokens: u64,
    /// Chained hashes of the prompt's full blocks (`prefix::block_hashes`); empty: the request
    /// neither hits nor fills the prefix cache.
    pub block_hashes: Vec<u64>,
}

#[derive(Debug, Clone)]
struct Seq {
    id: u64,
    prompt: u64,
    output: u64,
    generated: u64,
    /// Context tokens still to prefill: the prompt, or prompt + generated after a preemption.
    to_prefill: u64,
    hashes: Vec<u64>,
    /// Leading blocks of `hashes` it holds in the prefix cache (shared, counted there).
    cached: usize,
    /// Whether it was ever admitted (queue time and the response's hit count are the first's).
    admitted_once: bool,
}

impl Seq {
    fn context(&self) -> u64 {
        self.prompt + self.generated
    }

    /// KV the sequence uses: the context prefilled so far (cache hits included).
    fn held(&self) -> u64 {
        self.context().saturating_sub(self.to_prefill)
    }

    /// The part of `held` that is its own, not in shared cache blocks.
    fn private(&self, block: u64) -> u64 {
        self.held().saturating_sub(self.cached as u64 * block)
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
    /// Requests admitted at the start of the iteration, in admission order, with the prompt
    /// tokens their prefix-cache hit saved.
    pub admitted: Vec<Admission>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub id: u64,
    pub cached_tokens: u64,
    /// False when it comes back after a preemption.
    pub first: bool,
}

/// Width of the window the reported load is measured over, model ms.
pub const LOAD_WINDOW_MS: f64 = 1000.0;

#[derive(Debug, Clone)]
pub struct Engine {
    pub config: EngineConfig,
    waiting: VecDeque<Seq>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<Seq>,
    prefix: PrefixCache,
    /// Prompt tokens computed (recomputation after preemption included, cache hits not), as
    /// llama.cpp counts them.
    pub prompt_tokens_total: u64,
    /// Prompts counted whole, cache hits included, once each when its prefill is done (its
    /// first token), as vLLM v1 counts them.
    pub prompt_tokens_whole_total: u64,
    pub generation_tokens_total: u64,
    pub vram_overflow_events: u64,
    /// Prefix-cache lookups: context tokens looked up, and the tokens found, at admissions.
    pub prefix_queries_tokens_total: u64,
    pub prefix_hits_tokens_total: u64,
    /// The same in blocks: full blocks that could have hit, and the ones that did.
    pub prefix_queries_blocks_total: u64,
    pub prefix_hits_blocks_total: u64,
    /// Iterations run, and the sum of their batch sizes (llama.cpp reports both).
    pub iterations_total: u64,
    pub batch_slots_total: u64,
    /// Model time spent on prompt and on generated tokens (an iteration's duration split in
    /// proportion to its tokens), ms.
    pub prefill_ms_total: f64,
    pub decode_ms_total: f64,
    /// (end time of an iteration, tokens in it, generated tokens in it), oldest first, for
    /// the load window.
    window: VecDeque<(f64, u64, u64)>,
}

impl Engine {
    pub fn new(config: EngineConfig) -> Self {
        let prefix = PrefixCache::new(config.prefix_capacity_blocks());
        Engine {
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix,
            prompt_tokens_total: 0,
            prompt_tokens_whole_total: 0,
            generation_tokens_total: 0,
            vram_overflow_events: 0,
            prefix_queries_tokens_total: 0,
            prefix_hits_tokens_total: 0,
            prefix_queries_blocks_total: 0,
            prefix_hits_blocks_total: 0,
            iterations_total: 0,
            batch_slots_total: 0,
            prefill_ms_total: 0.0,
            decode_ms_total: 0.0,
            window: VecDeque::new(),
        }
    }

    /// Queues a request that takes no part in prefix caching.
    pub fn submit(&mut self, id: u64, prompt_tokens: u64, output_tokens: u64) {
        self.submit_request(Request {
            id,
            prompt_tokens,
            output_tokens,
            block_hashes: vec![],
        });
    }

    /// Queues a request.
    pub fn submit_request(&mut self, r: Request) {
        self.waiting.push_back(Seq {
            id: r.id,
            prompt: r.prompt_tokens,
            output: r.output_tokens.max(1),
            generated: 0,
            to_prefill: r.prompt_tokens,
            hashes: r.block_hashes,
            cached: 0,
            admitted_once: false,
        });
    }

    /// Drops a request wherever it is (the client went away), freeing its KV.
    pub fn cancel(&mut self, id: u64) {
        self.waiting.retain(|s| s.id != id);
        if let Some(pos) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(pos);
            self.prefix
                .release(s.hashes.get(..s.cached).unwrap_or_default());
        }
    }

    /// Leading blocks of `seq` the cache would give it now: whole blocks, and at least one
    /// context token left to compute.
    fn hit_blocks(&self, hashes: &[u64], context: u64) -> usize {
        if !self.prefix.enabled() {
            return 0;
        }
        let block = self.config.prefix_block_tokens.max(1);
        let most = usize::try_from(context.saturating_sub(1) / block).unwrap_or(usize::MAX);
        self.prefix
            .lookup(hashes.get(..most.min(hashes.len())).unwrap_or_default())
    }

    /// Prompt tokens a request with these block hashes would find cached if it were admitted
    /// now (what a streaming response can report before it is).
    pub fn peek_hit_tokens(&self, hashes: &[u64], prompt_tokens: u64) -> u64 {
        self.hit_blocks(hashes, prompt_tokens) as u64 * self.config.prefix_block_tokens
    }

    /// Ids of the running requests, in admission order, and of the waiting ones, in queue
    /// order.
    pub fn running_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.running.iter().map(|s| s.id)
    }
    pub fn waiting_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.waiting.iter().map(|s| s.id)
    }

    /// The most tokens the running batch can come to: every sequence's prompt plus its whole
    /// output (TGI's `tgi_batch_current_max_tokens`).
    pub fn running_max_tokens(&self) -> u64 {
        self.running.iter().map(|s| s.prompt + s.output).sum()
    }

    /// Blocks in the prefix cache (held or evictable), and the cache's capacity.
    pub fn prefix_cached_blocks(&self) -> usize {
        self.prefix.len()
    }
    pub fn prefix_capacity_blocks(&self) -> usize {
        self.prefix.capacity()
    }
    pub fn prefix_evictable_blocks(&self) -> usize {
        self.prefix.evictable_blocks()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
    /// KV in use: each sequence's own tokens plus the cache blocks held, once each. Evictable
    /// cache blocks are free memory and do not count (as in vLLM's usage figure).
    pub fn kv_used_tokens(&self) -> u64 {
        let block = self.config.prefix_block_tokens;
        self.running.iter().map(|s| s.private(block)).sum::<u64>()
            + self.prefix.referenced_blocks() as u64 * block
    }
    /// KV cache use, 0..1 (above 1 only for a lone sequence larger than the cache).
    pub fn kv_cache_usage(&self) -> f64 {
        match self.config.kv_capacity_tokens {
            0 => 0.0,
            cap => self.kv_used_tokens() as f64 / cap as f64,
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
            .filter(|(end, _, _)| *end <= now_ms)
            .map(|(_, n, _)| n)
            .sum();
        tokens as f64 * 1000.0 / LOAD_WINDOW_MS
    }

    /// Generated tokens per second of model time over the same window.
    pub fn generation_tokens_per_sec(&mut self, now_ms: f64) -> f64 {
        self.prune_window(now_ms);
        let tokens: u64 = self
            .window
            .iter()
            .filter(|(end, _, _)| *end <= now_ms)
            .map(|(_, _, g)| g)
            .sum();
        tokens as f64 * 1000.0 / LOAD_WINDOW_MS
    }

    fn prune_window(&mut self, now_ms: f64) {
        while matches!(self.window.front(), Some((end, _, _)) if *end <= now_ms - LOAD_WINDOW_MS) {
            self.window.pop_front();
        }
    }

    /// FIFO admission while the batch has a free slot and the head's context fits in the cache
    /// beside the running sequences' whole context (prefilled or not). Cache blocks the head
    /// would share with running sequences need no new memory. A lone sequence is always
    /// admitted, or one larger than the cache would block the queue forever.
    fn admit(&mut self) -> Vec<Admission> {
        let block = self.config.prefix_block_tokens;
        let mut admitted = vec![];
        let mut committed =
            self.kv_used_tokens() + self.running.iter().map(|s| s.to_prefill).sum::<u64>();
        while self.running.len() < self.config.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            let hit = self.hit_blocks(&next.hashes, next.context());
            let hit_hashes = next.hashes.get(..hit).unwrap_or_default();
            let shared = self.prefix.referenced_among(hit_hashes) as u64 * block;
            let need = next.context().saturating_sub(shared);
            let fits = committed + need <= self.config.kv_capacity_tokens;
            if !fits && !self.running.is_empty() {
                break;
            }
            committed += need;
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let hit_hashes = s.hashes.get(..hit).unwrap_or_default();
            self.prefix.acquire(hit_hashes);
            s.cached = hit;
            let cached_tokens = hit as u64 * block;
            s.to_prefill = s.context().saturating_sub(cached_tokens);
            if self.prefix.enabled() {
                let most = s.context().saturating_sub(1) / block.max(1);
                self.prefix_queries_tokens_total += s.context();
                self.prefix_hits_tokens_total += cached_tokens;
                self.prefix_queries_blocks_total += most.min(s.hashes.len() as u64);
                self.prefix_hits_blocks_total += hit as u64;
            }
            admitted.push(Admission {
                id: s.id,
                cached_tokens,
                first: !s.admitted_once,
            });
            s.admitted_once = true;
            self.running.push(s);
        }
        admitted
    }

    /// Plans and applies one iteration starting at `now_ms`; `None` when nothing can run.
    pub fn step(&mut self, now_ms: f64) -> Option<Iteration> {
        self.prune_window(now_ms);
        let admitted = self.admit();
        if self.running.is_empty() {
            return None;
        }
        // Decode tokens first; the rest of the budget prefills, in admission order. At least
        // an eighth of the budget always goes to prefill so a batch of decoders larger than
        // the budget cannot starve the prompts.
        let decoding = self.running.iter().filter(|s| s.to_prefill == 0).count() as u64;
        let chunk = self.config.prefill_chunk_tokens;
        let mut budget = chunk.saturating_sub(decoding).max(chunk / 8).max(1);
        // Attention reads every sequence's whole KV, shared cache blocks once per sequence.
        let cached_context: u64 = self.running.iter().map(Seq::held).sum();
        let batch = self.running.len() as u64;
        let mut events = Vec::new();
        let (mut prefilled, mut generated, mut whole) = (0, 0, 0);
        let prefix = &mut self.prefix;
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
                // Its prompt's blocks are computed: they enter (or refresh in) the cache.
                if prefix.enabled() {
                    s.cached = prefix.extend(&s.hashes, s.cached);
                }
                // Its first token comes with this iteration (not a recomputation's).
                if s.generated == 0 {
                    whole += s.prompt;
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
        self.prompt_tokens_total += prefilled;
        self.prompt_tokens_whole_total += whole;
        self.generation_tokens_total += generated;
        let tokens = prefilled + generated;
        let duration_ms = self.config.iteration_ms(tokens, cached_context);
        self.iterations_total += 1;
        self.batch_slots_total += batch;
        if tokens > 0 {
            let prefill_share = prefilled as f64 / tokens as f64;
            self.prefill_ms_total += duration_ms * prefill_share;
            self.decode_ms_total += duration_ms * (1.0 - prefill_share);
        }

        // Finished sequences free their KV (their cache blocks become evictable).
        let prefix = &mut self.prefix;
        self.running.retain(|s| {
            let done = s.to_prefill == 0 && s.generated >= s.output;
            if done {
                prefix.release(s.hashes.get(..s.cached).unwrap_or_default());
                events.push(Event::Finished { id: s.id });
            }
            !done
        });

        // Outgrown the cache: preempt the newest sequences until it fits again.
        while self.kv_used_tokens() > self.config.kv_capacity_tokens && self.running.len() > 1 {
            let Some(mut victim) = self.running.pop() else {
                break;
            };
            self.prefix
                .release(victim.hashes.get(..victim.cached).unwrap_or_default());
            victim.cached = 0;
            victim.to_prefill = victim.context();
            self.vram_overflow_events += 1;
            events.push(Event::Preempted { id: victim.id });
            self.waiting.push_front(victim);
        }

        // Evictable blocks live in free memory: reclaim what the running sequences now use.
        let free = self
            .config
            .kv_capacity_tokens
            .saturating_sub(self.kv_used_tokens());
        let block = self.config.prefix_block_tokens.max(1);
        self.prefix
            .evict_to(usize::try_from(free / block).unwrap_or(usize::MAX));

        self.window
            .push_back((now_ms + duration_ms, tokens, generated));
        Some(Iteration {
            duration_ms,
            tokens,
            events,
            admitted,
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
            prefix_block_tokens: 10,
            prefix_cache_blocks: None,
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
        assert_eq!(e.prompt_tokens_whole_total, 250);
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
        // The recompute prefilled prompt + generated again; each prompt counts whole once.
        assert!(e.prompt_tokens_total > 90);
        assert_eq!(e.prompt_tokens_whole_total, 90);
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

    /// A prompt of whole 10-token blocks (block `b` is tokens b*100 .. b*100+9) plus `tail`
    /// tokens of its own, as the engine receives it.
    fn prompt(id: u64, blocks: &[u64], tail: u64, output: u64) -> Request {
        let mut tokens: Vec<u64> = blocks
            .iter()
            .flat_map(|b| (0..10).map(move |j| b * 100 + j))
            .collect();
        tokens.extend((0..tail).map(|j| 1_000_000 + id * 1000 + j));
        Request {
            id,
            prompt_tokens: tokens.len() as u64,
            output_tokens: output,
            block_hashes: crate::prefix::block_hashes("m", &tokens, 10),
        }
    }

    /// Runs `r` alone until idle; its admission's cached tokens.
    fn run_one(e: &mut Engine, r: Request) -> u64 {
        let id = r.id;
        e.submit_request(r);
        let (mut t, mut hit) = (0.0, None);
        while let Some(i) = e.step(t) {
            t += i.duration_ms;
            for a in i.admitted {
                if a.id == id && a.first {
                    hit = Some(a.cached_tokens);
                }
            }
        }
        hit.unwrap()
    }

    #[test]
    fn prefix_cache_hits_misses_and_evictions() {
        let a: Vec<u64> = (1..=10).collect();
        let b: Vec<u64> = (11..=20).collect();
        let c: Vec<u64> = (21..=30).collect();
        let shared: Vec<u64> = vec![1, 2, 3, 4, 5, 40, 41];
        let d: Vec<u64> = (50..69).collect(); // 19 blocks
                                              // (case, kv tokens, cache blocks, requests run one after the other as (blocks, own
                                              // tail tokens, output)) -> cached tokens at each one's admission
        type Req<'a> = (&'a [u64], u64, u64);
        type Case<'a> = (&'a str, u64, Option<u64>, Vec<Req<'a>>, Vec<u64>);
        let cases: Vec<Case> = vec![
            // The last block of a fully cached prompt is recomputed (one token must be).
            (
                "repeat",
                10_000,
                None,
                vec![(&a, 0, 1), (&a, 0, 1)],
                vec![0, 90],
            ),
            (
                "repeat, own tail",
                10_000,
                None,
                vec![(&a, 5, 1), (&a, 7, 1)],
                vec![0, 100],
            ),
            (
                "shared prefix",
                10_000,
                None,
                vec![(&a, 0, 1), (&shared, 3, 1)],
                vec![0, 50],
            ),
            (
                "nothing shared",
                10_000,
                None,
                vec![(&a, 0, 1), (&b, 0, 1)],
                vec![0, 0],
            ),
            (
                "disabled",
                10_000,
                Some(0),
                vec![(&a, 0, 1), (&a, 0, 1)],
                vec![0, 0],
            ),
            // Ten blocks of room: B evicts A.
            (
                "evicted by capacity",
                10_000,
                Some(10),
                vec![(&a, 0, 1), (&b, 0, 1), (&a, 0, 1)],
                vec![0, 0, 0],
            ),
            // Twenty blocks: reusing A makes B the least recently used, so C evicts B.
            (
                "lru order",
                10_000,
                Some(20),
                vec![
                    (&a, 0, 1),
                    (&b, 0, 1),
                    (&a, 0, 1),
                    (&c, 0, 1),
                    (&a, 0, 1),
                    (&b, 0, 1),
                ],
                vec![0, 0, 90, 0, 90, 0],
            ),
            // D's 19 blocks evict A's tail first: A's head block still hits.
            (
                "tail evicted first",
                200,
                None,
                vec![(&a, 0, 1), (&d, 0, 1), (&a, 0, 1)],
                vec![0, 0, 10],
            ),
            // While D runs it needs all but 9 tokens of the KV: evictable blocks give way.
            (
                "evicted by memory",
                200,
                None,
                vec![(&a, 0, 1), (&d, 0, 5), (&a, 0, 1)],
                vec![0, 0, 0],
            ),
        ];
        for (case, kv, blocks, requests, want) in cases {
            let mut config = small(kv, 8);
            config.prefix_cache_blocks = blocks;
            let mut e = Engine::new(config);
            let got: Vec<u64> = requests
                .iter()
                .enumerate()
                .map(|(id, (bl, tail, out))| run_one(&mut e, prompt(id as u64, bl, *tail, *out)))
                .collect();
            assert_eq!(got, want, "{case}");
            assert_eq!(
                e.kv_used_tokens(),
                0,
                "{case}: cached blocks are not used KV"
            );
            assert!(
                e.prefix_cached_blocks() <= e.prefix_capacity_blocks(),
                "{case}"
            );
            // Counters in tokens: queries are every admitted context, hits the cached part.
            let queried: u64 = requests
                .iter()
                .map(|(bl, t, _)| bl.len() as u64 * 10 + t)
                .sum();
            let enabled = blocks != Some(0);
            assert_eq!(
                e.prefix_queries_tokens_total,
                if enabled { queried } else { 0 },
                "{case}"
            );
            assert_eq!(
                e.prefix_hits_tokens_total,
                want.iter().sum::<u64>(),
                "{case}"
            );
            assert_eq!(
                e.prefix_hits_blocks_total * 10,
                e.prefix_hits_tokens_total,
                "{case}"
            );
        }
    }

    #[test]
    fn a_prefix_hit_saves_prefill_iterations_and_compute() {
        let blocks: Vec<u64> = (1..=30).collect(); // 300 tokens, three chunks of 100
                                                   // (iterations to the first token, prompt tokens computed)
        let mut per_run = vec![];
        let mut e = Engine::new(small(10_000, 8));
        for id in 0..2 {
            let before = e.prompt_tokens_total;
            e.submit_request(prompt(id, &blocks, 0, 1));
            let (mut t, mut n, mut ms) = (0.0, 0, 0.0);
            while let Some(i) = e.step(t) {
                t += i.duration_ms;
                ms += i.duration_ms;
                n += 1;
            }
            per_run.push((n, e.prompt_tokens_total - before, ms));
        }
        let [(cold_n, cold_tokens, cold_ms), (warm_n, warm_tokens, warm_ms)] = per_run[..] else {
            panic!("{per_run:?}")
        };
        assert_eq!((cold_n, cold_tokens), (3, 300));
        assert_eq!(
            (warm_n, warm_tokens),
            (1, 10),
            "290 cached, the last block recomputed"
        );
        assert!(warm_ms < cold_ms / 2.0, "{warm_ms} vs {cold_ms}");
    }

    #[test]
    fn concurrent_hits_share_their_blocks() {
        let blocks: Vec<u64> = (1..=10).collect();
        let mut e = Engine::new(small(10_000, 8));
        run_one(&mut e, prompt(0, &blocks, 0, 1));
        e.submit_request(prompt(1, &blocks, 0, 50));
        e.submit_request(prompt(2, &blocks, 0, 50));
        let i = e.step(0.0).unwrap();
        let hits: Vec<u64> = i.admitted.iter().map(|a| a.cached_tokens).collect();
        assert_eq!(hits, vec![90, 90]);
        assert_eq!(
            i.tokens,
            10 + 10 + 2,
            "each recomputes its last block and samples a token"
        );
        // Ten shared blocks once, plus one generated token each (not 2 x 101).
        assert_eq!(e.kv_used_tokens(), 100 + 2);
        // What a request arriving now would find.
        assert_eq!(
            e.peek_hit_tokens(&prompt(3, &blocks, 4, 1).block_hashes, 104),
            100
        );
        e.cancel(1);
        e.cancel(2);
        assert_eq!(e.kv_used_tokens(), 0);
        assert_eq!(e.prefix_evictable_blocks(), 10);
    }

    #[test]
    fn a_preempted_sequence_finds_its_prompt_cached() {
        let mut e = Engine::new(small(100, 8));
        e.submit_request(prompt(1, &[1, 2, 3, 4], 5, 20));
        e.submit_request(prompt(2, &[5, 6, 7, 8], 5, 20));
        let (mut t, mut again) = (0.0, vec![]);
        while let Some(i) = e.step(t) {
            t += i.duration_ms;
            again.extend(i.admitted.iter().filter(|a| !a.first).copied());
        }
        // As in the preemption test above, the newest is preempted once. Its four prompt
        // blocks stayed cached, but evictable: while the other grows to 65 tokens only 35 are
        // free, so its tail block gave way. Back in, it finds 30 tokens cached.
        assert_eq!(e.vram_overflow_events, 1);
        assert_eq!(
            again,
            vec![Admission {
                id: 2,
                cached_tokens: 30,
                first: false
            }]
        );
        assert!(e.is_idle());
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
