//! What the simulated clients send: each request's prompt and output length, and which parts of
//! its prompt it shares with other requests (system prompts, earlier turns, documents), so that
//! the engines' prefix caches and the filter's prefix index both have something to find.
//!
//! A prompt is a sequence of shared segments (an id and a length in tokens) followed by a part
//! of its own. Token ids are a function of the segment and the position in it, so two prompts
//! that share their leading segments share their leading tokens, hence the engine's leading KV
//! blocks (`mock_gpu_node::prefix::block_hashes`). The filter never sees tokens: it hashes
//! blocks of about `block_chars` characters (`ingest::prompt`), which here are groups of
//! `block_chars / 4` tokens, the filter's own estimate of characters per token, not aligned with
//! the engine's blocks.
//!
//! Workloads (all seeded):
//! - `azure`: the Azure conversation trace's sizes, nothing shared (the control);
//! - `tenants`: many tenants, each with a long system prompt of its own (2k to 6k tokens),
//!   users asking short questions, tenants drawn by a Zipf law (a few busy, many quiet);
//! - `hot`: one 2k-token system prompt in every request, the rest unique (Azure sizes);
//! - `mooncake`: the Mooncake trace, whose `hash_ids` name its 512-token blocks;
//! - `prefill`, `decode`, `mixed`, `long`: the load generator's robustness family (long prompts and
//!   short answers, the reverse, both, or long-context conversations), nothing shared, the same
//!   sizes the real-Envoy benchmark sends (`loadgen::trace::shaped`).

use mock_gpu_node::prefix::block_hashes;
use token_balancer_core::ingest::prompt::{finish, Chain};
use token_balancer_core::rng::{Rng, SplitMix64};

/// One request's shape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Job {
    pub prompt: u64,
    pub output: u64,
    /// Shared segments, in order: (id, tokens). The prompt past them is the request's own.
    pub shared: Vec<(u64, u64)>,
}

impl Job {
    /// Whether any part of the prompt is shared.
    pub fn shares(&self) -> bool {
        !self.shared.is_empty()
    }

    /// The prompt's token ids; `own` seeds the part that is the request's own.
    pub fn tokens(&self, own: u64) -> Vec<u64> {
        let mut out = Vec::with_capacity(usize::try_from(self.prompt).unwrap_or(0));
        for &(id, len) in &self.shared {
            for j in 0..len {
                if out.len() as u64 >= self.prompt {
                    return out;
                }
                out.push(finish(id.wrapping_mul(0x9e37_79b9) ^ j));
            }
        }
        let mut j = 0u64;
        while (out.len() as u64) < self.prompt {
            out.push(finish(
                (own ^ 0xdead_beef_0000_0000).wrapping_add(j.wrapping_mul(0x1000_0001)),
            ));
            j += 1;
        }
        out
    }

    /// The engine's block hashes of the prompt (blocks of `block` tokens).
    pub fn engine_blocks(tokens: &[u64], block: u64) -> Vec<u64> {
        block_hashes("m", tokens, block)
    }

    /// The chain the filter would hash from this prompt's text: blocks of `block_chars`
    /// characters, `block_chars / 4` tokens each.
    pub fn filter_chain(tokens: &[u64], block_chars: u64) -> Chain {
        let per_block = usize::try_from(block_chars / 4).unwrap_or(64).max(1);
        let mut parent = 0x7072_6566_6978u64;
        let blocks = tokens
            .chunks_exact(per_block)
            .take(token_balancer_core::ingest::prompt::MAX_BLOCKS)
            .map(|c| {
                let mut h = parent;
                for t in c {
                    h = (h.rotate_left(5) ^ t).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                }
                parent = finish(h ^ parent.rotate_left(17));
                parent
            })
            .collect();
        Chain {
            blocks,
            rendered: tokens.len() as u64 * 4,
            block_chars,
            hint: None,
        }
    }
}

/// The Azure trace's (or synthetic) sizes, nothing shared.
pub fn from_sizes(sizes: &[(u64, u64)]) -> Vec<Job> {
    sizes
        .iter()
        .map(|&(prompt, output)| Job {
            prompt,
            output,
            shared: vec![],
        })
        .collect()
}

fn uniform(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn between(rng: &mut SplitMix64, lo: u64, hi: u64) -> u64 {
    lo + rng.next_u64() % (hi - lo + 1).max(1)
}

/// Output lengths log-normal around a median of 150 tokens, 10 to 1,000.
fn output(rng: &mut SplitMix64) -> u64 {
    let u1 = uniform(rng).max(1e-12);
    let u2 = uniform(rng);
    let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    (150.0 * (0.8 * z).exp()).clamp(10.0, 1000.0) as u64
}

/// The load generator's `shape` workload (see the module).
pub fn shaped(shape: loadgen::trace::Shape, seed: u64) -> Vec<Job> {
    from_trace(&loadgen::trace::shaped(shape, seed))
}

/// A trace's requests as jobs, by their sizes alone (their times are the simulator's to draw).
pub fn from_trace(trace: &[loadgen::trace::TraceRequest]) -> Vec<Job> {
    trace
        .iter()
        .map(|r| Job {
            prompt: r.prompt_tokens,
            output: r.output_tokens,
            shared: vec![],
        })
        .collect()
}

/// `count` requests from `tenants` tenants (Zipf 0.8 popularity), each tenant's system prompt
/// 2k to 6k tokens, each question 20 to 200 tokens of its own.
pub fn tenants(tenants: usize, count: usize, seed: u64) -> Vec<Job> {
    let mut rng = SplitMix64::new(seed);
    let t = tenants.max(1);
    let lengths: Vec<u64> = (0..t).map(|_| between(&mut rng, 2000, 6000)).collect();
    let weights: Vec<f64> = (1..=t).map(|k| 1.0 / (k as f64).powf(0.8)).collect();
    let total: f64 = weights.iter().sum();
    (0..count)
        .map(|_| {
            let mut u = uniform(&mut rng) * total;
            let mut tenant = t - 1;
            for (k, w) in weights.iter().enumerate() {
                if u < *w {
                    tenant = k;
                    break;
                }
                u -= w;
            }
            let system = lengths.get(tenant).copied().unwrap_or(2000);
            let question = between(&mut rng, 20, 200);
            Job {
                prompt: system + question,
                output: output(&mut rng),
                shared: vec![(1_000_000 + tenant as u64, system)],
            }
        })
        .collect()
}

/// `count` requests that all open with the same 2k-token system prompt, then a part of their
/// own drawn from `sizes`.
pub fn hot(sizes: &[(u64, u64)], count: usize, seed: u64) -> Vec<Job> {
    let mut rng = SplitMix64::new(seed);
    (0..count)
        .map(|_| {
            let pick = (rng.next_u64() % sizes.len().max(1) as u64) as usize;
            let (p, o) = sizes.get(pick).copied().unwrap_or((500, 200));
            Job {
                prompt: 2000 + p.min(4000),
                output: o.max(1),
                shared: vec![(7, 2000)],
            }
        })
        .collect()
}

/// The Mooncake trace (JSON lines with `input_length`, `output_length`, `hash_ids` of 512-token
/// blocks): each full block named by a hash id is a shared segment.
pub fn mooncake(text: &str) -> Vec<Job> {
    text.lines()
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let prompt = v.get("input_length")?.as_u64()?;
            let output = v.get("output_length")?.as_u64()?.max(1);
            let ids = v.get("hash_ids")?.as_array()?;
            let full = usize::try_from(prompt / 512).unwrap_or(0);
            let shared = ids
                .iter()
                .take(full)
                .filter_map(serde_json::Value::as_u64)
                .map(|id| (id, 512))
                .collect();
            Some(Job {
                prompt,
                output,
                shared,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_segments_share_leading_blocks_in_both_views() {
        let a = Job {
            prompt: 600,
            output: 1,
            shared: vec![(1, 512)],
        };
        let b = Job {
            prompt: 700,
            ..a.clone()
        };
        let (ta, tb) = (a.tokens(10), b.tokens(11));
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..600], tb[512..600]);
        let (ea, eb) = (Job::engine_blocks(&ta, 16), Job::engine_blocks(&tb, 16));
        assert_eq!(ea[..32], eb[..32]);
        assert_ne!(ea[32], eb[32]);
        let (fa, fb) = (Job::filter_chain(&ta, 256), Job::filter_chain(&tb, 256));
        assert_eq!(fa.blocks[..8], fb.blocks[..8]);
        assert_ne!(fa.blocks[8], fb.blocks[8]);
        assert_eq!(fa.rendered, 2400);
    }

    #[test]
    fn workloads_have_their_shapes() {
        let t = tenants(40, 2000, 1);
        assert!(t.iter().all(|j| j.shares() && j.prompt >= 2020));
        let distinct: std::collections::BTreeSet<_> = t.iter().map(|j| j.shared[0].0).collect();
        assert!(distinct.len() > 30, "{}", distinct.len());
        let h = hot(&[(100, 10), (3000, 50)], 100, 2);
        assert!(h.iter().all(|j| j.shared == vec![(7, 2000)]));
        let m = mooncake(
            "{\"timestamp\":0,\"input_length\":1100,\"output_length\":5,\"hash_ids\":[4,5,6]}\nnot json\n",
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].shared, vec![(4, 512), (5, 512)]);
    }
}
