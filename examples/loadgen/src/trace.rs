//! Trace readers: the real traffic the benchmark replays (see ../shared/data/README.md).
//!
//! - Azure LLM inference trace (Splitwise, ISCA'24), conversation CSV:
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as `YYYY-MM-DD HH:MM:SS.fffffff`.
//! - Mooncake trace (FAST'25), JSONL: `timestamp` (ms), `input_length`, `output_length`,
//!   `hash_ids` (512-token prefix blocks; equal leading ids are a shared prefix).
//! - ShareGPT conversation lengths (the filtered statistics Sarathi-Serve, OSDI'24, publishes;
//!   Llama-2 tokenizer, at most 8k tokens), CSV: `num_prefill_tokens,num_decode_tokens,...`.
//!   It has no times: the requests come in file order, Poisson at `GENERATED_RATE` (seeded).
//!   Prompts around 1,700 tokens and answers around 400: heavier on both sides than the Azure
//!   trace, and no policy here was tuned on it.
//!
//! And two generated workloads with shared prefixes (seeded, Poisson arrivals; the shared
//! parts are Mooncake-style blocks, so equal blocks become equal text):
//! - `tenants:N`: N tenants, each with a system prompt of its own of 2k to 6k tokens (whole
//!   blocks), users asking questions of 20 to 200 tokens, tenants drawn by a Zipf law of
//!   exponent 0.8 (a few busy, many quiet), outputs log-normal around 150 tokens;
//! - `hot`: one 2,048-token system prompt in every request, then a part of its own
//!   (log-normal around 500 tokens), outputs log-normal around 150 tokens.
//!
//! And a family for robustness, nothing shared, sizes unlike the traces the policies were
//! tuned on (`Shape`):
//! - `prefill`: code-assistant-like, long prompts and short answers (prompts log-normal around
//!   2,000 tokens, answers around 25);
//! - `decode`: short prompts, long answers (prompts around 200 tokens, answers around 600);
//! - `mixed`: each request one or the other, at even odds;
//! - `long`: long-context conversations, prompts log-normal around 8,000 tokens up to 48,000,
//!   answers around 200 (the traffic that tests a VRAM guard).
//!
//! And `two-tenants` (`two_tenants`): a tenant with steady short chat and a tenant with bursts
//! of long prompts that saturate the fleet, each request naming its tenant, for admission.
//!
//! Any of them, and any trace, can arrive in bursts (`bursty`): on/off traffic, tens of requests
//! within a second, then a quiet spell, at the same mean rate. Inter-arrival times then have a
//! coefficient of variation above 10 (Poisson's is 1), the shape of production traces where
//! one client's batch job or a retry storm lands at once.

/// One request of a trace, times relative to the trace's first request.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    pub at_ms: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Prefix blocks (Mooncake), so equal blocks become equal text.
    pub blocks: Vec<u64>,
    /// The tenant sending it, in workloads that have tenants who ask to be told apart
    /// (`two_tenants`); sent as the inference gateway's fairness-id header.
    pub tenant: Option<&'static str>,
}

/// Tokens per Mooncake hash block.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Seconds since midnight of `HH:MM:SS.fff...` plus whole days from the date, enough to order
/// and space one trace (the Azure trace spans one hour of one day).
fn azure_seconds(ts: &str) -> Option<f64> {
    let (date, time) = ts.trim().split_once(' ')?;
    let day: f64 = date.rsplit('-').next()?.parse().ok()?;
    let mut hms = time.split(':');
    let h: f64 = hms.next()?.parse().ok()?;
    let m: f64 = hms.next()?.parse().ok()?;
    let s: f64 = hms.next()?.parse().ok()?;
    Some(day * 86_400.0 + h * 3600.0 + m * 60.0 + s)
}

pub fn parse_azure(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    let mut first = None;
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let parsed = (|| {
            let t = azure_seconds(f.first()?)?;
            let p: u64 = f.get(1)?.trim().parse().ok()?;
            let o: u64 = f.get(2)?.trim().parse().ok()?;
            Some((t, p, o))
        })();
        let (t, p, o) =
            parsed.ok_or_else(|| format!("azure trace line {}: cannot parse {line:?}", i + 1))?;
        let t0 = *first.get_or_insert(t);
        out.push(TraceRequest {
            at_ms: (t - t0) * 1000.0,
            prompt_tokens: p,
            output_tokens: o.max(1),
            blocks: vec![],
            tenant: None,
        });
    }
    Ok(out)
}

pub fn parse_mooncake(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("mooncake trace line {}: {e}", i + 1))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        let (Some(t), Some(p), Some(o)) =
            (num("timestamp"), num("input_length"), num("output_length"))
        else {
            return Err(format!(
                "mooncake trace line {}: missing timestamp/input_length/output_length",
                i + 1
            ));
        };
        let blocks = v
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        out.push(TraceRequest {
            at_ms: t,
            prompt_tokens: p as u64,
            output_tokens: (o as u64).max(1),
            blocks,
            tenant: None,
        });
    }
    Ok(out)
}

/// ShareGPT's lengths in file order, at Poisson times of `GENERATED_RATE` drawn from `seed`.
pub fn parse_sharegpt(text: &str, seed: u64) -> Result<Vec<TraceRequest>, String> {
    let mut g = Gen(seed ^ 0x5a4e_6e70);
    let mut at = 0.0;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let mut f = line.split(',').map(str::trim);
        let (Some(Ok(p)), Some(Ok(o))) = (f.next().map(str::parse), f.next().map(str::parse))
        else {
            return Err(format!(
                "sharegpt lengths line {}: cannot parse {line:?}",
                i + 1
            ));
        };
        at += g.gap_ms(GENERATED_RATE);
        out.push(TraceRequest {
            at_ms: at,
            prompt_tokens: p,
            output_tokens: u64::max(o, 1),
            blocks: vec![],
            tenant: None,
        });
    }
    Ok(out)
}

/// Requests per second (model time) of the generated workloads at rate 1.
pub const GENERATED_RATE: f64 = 2.0;
/// Requests generated: an hour at `GENERATED_RATE`.
const GENERATED: usize = 7200;

struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn lognormal(&mut self, median: f64, sigma: f64, lo: f64, hi: f64) -> u64 {
        let u1 = self.uniform().max(1e-12);
        let u2 = self.uniform();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        (median * (sigma * z).exp()).clamp(lo, hi) as u64
    }
    /// Exponential gap of a Poisson process of `rate` per second, ms.
    fn gap_ms(&mut self, rate: f64) -> f64 {
        -(1.0 - self.uniform()).ln() / rate * 1000.0
    }
}

/// Size shapes of the robustness family (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Prefill,
    Decode,
    Mixed,
    Long,
}

impl Shape {
    pub fn parse(name: &str) -> Option<Shape> {
        match name {
            "prefill" => Some(Shape::Prefill),
            "decode" => Some(Shape::Decode),
            "mixed" => Some(Shape::Mixed),
            "long" => Some(Shape::Long),
            _ => None,
        }
    }

    /// One request's (prompt, output) tokens.
    fn draw(self, g: &mut Gen) -> (u64, u64) {
        let prefill = match self {
            Shape::Prefill => true,
            Shape::Decode => false,
            Shape::Mixed => g.uniform() < 0.5,
            Shape::Long => {
                return (
                    g.lognormal(8000.0, 0.8, 1000.0, 48_000.0),
                    g.lognormal(200.0, 0.7, 10.0, 1000.0),
                )
            }
        };
        if prefill {
            (
                g.lognormal(2000.0, 0.5, 200.0, 8000.0),
                g.lognormal(25.0, 0.6, 1.0, 200.0),
            )
        } else {
            (
                g.lognormal(200.0, 0.8, 10.0, 2000.0),
                g.lognormal(600.0, 0.5, 50.0, 2000.0),
            )
        }
    }
}

/// `GENERATED` requests of `shape`, Poisson arrivals at `GENERATED_RATE`.
pub fn shaped(shape: Shape, seed: u64) -> Vec<TraceRequest> {
    let mut g = Gen(seed ^ 0x5a4e_0000 ^ shape as u64);
    let mut at = 0.0;
    (0..GENERATED)
        .map(|_| {
            at += g.gap_ms(GENERATED_RATE);
            let (prompt_tokens, output_tokens) = shape.draw(&mut g);
            TraceRequest {
                at_ms: at,
                prompt_tokens,
                output_tokens: output_tokens.max(1),
                blocks: vec![],
                tenant: None,
            }
        })
        .collect()
}

/// The `two-tenants` workload's tenants: `chat` sends a steady stream of short requests,
/// `docs` sends bursts of long prompts that saturate the fleet.
pub const TWO_TENANTS: [&str; 2] = ["chat", "docs"];
/// Long prompts in one of `docs`' bursts, and the mean time from one burst to the next.
const DOCS_BURST: u64 = 30;
const DOCS_EVERY_MS: f64 = 30_000.0;

/// The `two-tenants` workload, an hour of it: tenant `chat` sends requests at 2 per second
/// (Poisson; prompts log-normal around 300 tokens, answers around 120), tenant `docs` sends
/// bursts of 30 long prompts within a second (prompts around 6,000 tokens up to 16,000,
/// answers around 60), one burst every 15 to 45 s. A burst is more prompt than the benchmark's
/// four nodes hold in KV cache: the fleet saturates and the gateway has to decide whose
/// request waits.
pub fn two_tenants(seed: u64) -> Vec<TraceRequest> {
    let mut g = Gen(seed ^ 0x2_7e4a_4e75);
    let span_ms = GENERATED as f64 / GENERATED_RATE * 1000.0;
    let [chat, docs] = TWO_TENANTS;
    let mut out = Vec::new();
    let mut at = 0.0;
    loop {
        at += g.gap_ms(GENERATED_RATE);
        if at >= span_ms {
            break;
        }
        out.push(TraceRequest {
            at_ms: at,
            prompt_tokens: g.lognormal(300.0, 0.6, 30.0, 2_000.0),
            output_tokens: g.lognormal(120.0, 0.6, 10.0, 600.0),
            blocks: vec![],
            tenant: Some(chat),
        });
    }
    let mut start = 5_000.0;
    while start < span_ms {
        for _ in 0..DOCS_BURST {
            out.push(TraceRequest {
                at_ms: start + g.uniform() * BURST_MS,
                prompt_tokens: g.lognormal(6_000.0, 0.5, 2_000.0, 16_000.0),
                output_tokens: g.lognormal(60.0, 0.6, 5.0, 400.0),
                blocks: vec![],
                tenant: Some(docs),
            });
        }
        start += DOCS_EVERY_MS * (0.5 + g.uniform());
    }
    out.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    out
}

/// Requests in one burst: 20 to 60.
pub const BURST_REQUESTS: (u64, u64) = (20, 60);
/// A burst's requests arrive within this many ms.
pub const BURST_MS: f64 = 1000.0;

/// On/off arrivals at a mean `rate_per_s` (see the module): a burst of 20 to 60 requests spread
/// evenly over `BURST_MS`, then a quiet spell until the next burst. The time from one burst's
/// start to the next is log-normal (sigma 1.2) with mean `size / rate`, so the mean rate holds and
/// quiet spells vary from seconds to minutes. `uniform` draws in [0, 1): the caller's seeded
/// generator, so the simulator and the load generator draw the same process.
#[derive(Debug, Clone, Default)]
pub struct Bursts {
    start_ms: f64,
    size: u64,
    sent: u64,
}

impl Bursts {
    /// The next arrival time, ms from the start.
    pub fn next_ms(&mut self, rate_per_s: f64, uniform: &mut dyn FnMut() -> f64) -> f64 {
        if self.sent >= self.size {
            let (lo, hi) = BURST_REQUESTS;
            let size = lo + ((uniform() * (hi - lo + 1) as f64) as u64).min(hi - lo);
            if self.size > 0 {
                let mean_ms = self.size as f64 / rate_per_s.max(1e-9) * 1000.0;
                // A log-normal of mean `mean_ms`: median mean * e^(-sigma^2 / 2).
                let (u1, u2) = (uniform().max(1e-12), uniform());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                let gap = mean_ms * (1.2 * z - 0.72).exp();
                self.start_ms += gap.max(BURST_MS);
            }
            self.size = size;
            self.sent = 0;
        }
        let at = self.start_ms + BURST_MS * self.sent as f64 / self.size as f64;
        self.sent += 1;
        at
    }
}

/// The same requests, re-timed into bursts at the trace's own mean rate.
pub fn bursty(mut requests: Vec<TraceRequest>, seed: u64) -> Vec<TraceRequest> {
    let span_s = requests.last().map_or(0.0, |r| r.at_ms) / 1000.0;
    let rate = if span_s > 0.0 {
        requests.len() as f64 / span_s
    } else {
        GENERATED_RATE
    };
    let mut g = Gen(seed ^ 0xb0_0575);
    let mut clock = Bursts::default();
    for r in &mut requests {
        r.at_ms = clock.next_ms(rate, &mut || g.uniform());
    }
    requests
}

/// Block ids of generated shared prompts start here, apart from any trace's.
const GENERATED_BLOCKS: u64 = 1 << 40;

/// The `tenants:N` workload (see the module).
pub fn tenants(n: usize, seed: u64) -> Vec<TraceRequest> {
    let mut g = Gen(seed ^ 0x7e4a_4e75);
    let n = n.max(1);
    let systems: Vec<u64> = (0..n).map(|_| g.between(4, 12)).collect();
    let weights: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(0.8)).collect();
    let total: f64 = weights.iter().sum();
    let mut at = 0.0;
    (0..GENERATED)
        .map(|_| {
            at += g.gap_ms(GENERATED_RATE);
            let mut u = g.uniform() * total;
            let mut tenant = n - 1;
            for (k, w) in weights.iter().enumerate() {
                if u < *w {
                    tenant = k;
                    break;
                }
                u -= w;
            }
            let blocks = systems.get(tenant).copied().unwrap_or(4);
            let base = GENERATED_BLOCKS + (tenant as u64) * 64;
            TraceRequest {
                at_ms: at,
                prompt_tokens: blocks * MOONCAKE_BLOCK_TOKENS + g.between(20, 200),
                output_tokens: g.lognormal(150.0, 0.8, 10.0, 1000.0),
                blocks: (base..base + blocks).collect(),
                tenant: None,
            }
        })
        .collect()
}

/// The `hot` workload (see the module).
pub fn hot(seed: u64) -> Vec<TraceRequest> {
    let mut g = Gen(seed ^ 0x4075);
    let mut at = 0.0;
    (0..GENERATED)
        .map(|_| {
            at += g.gap_ms(GENERATED_RATE);
            TraceRequest {
                at_ms: at,
                prompt_tokens: 4 * MOONCAKE_BLOCK_TOKENS + g.lognormal(500.0, 0.8, 20.0, 4000.0),
                output_tokens: g.lognormal(150.0, 0.8, 10.0, 1000.0),
                blocks: (0..4).map(|b| GENERATED_BLOCKS - 1 - b).collect(),
                tenant: None,
            }
        })
        .collect()
}

/// Prompt tokens of each request (in order) in leading blocks some earlier request sent
/// already: what a prefix cache that forgot nothing and sat on every node would hold, the
/// bound on what routing can make the engines find.
pub fn seen_before(requests: &[&TraceRequest]) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    requests
        .iter()
        .map(|r| {
            let full = (r.prompt_tokens / MOONCAKE_BLOCK_TOKENS) as usize;
            let blocks = r.blocks.get(..full.min(r.blocks.len())).unwrap_or_default();
            // A block id stands for its whole prefix: a chain of ids, as in Mooncake.
            let mut key = 0u64;
            let mut hit = 0;
            let mut leading = true;
            for b in blocks {
                key = key.rotate_left(13) ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                if leading && seen.contains(&key) {
                    hit += 1;
                } else {
                    leading = false;
                }
                seen.insert(key);
            }
            (hit * MOONCAKE_BLOCK_TOKENS).min(r.prompt_tokens.saturating_sub(1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_rows() {
        let t = parse_azure(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:48.0,396,0\n",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].at_ms, 0.0);
        assert!((t[1].at_ms - 1500.0).abs() < 1e-6);
        assert_eq!((t[1].prompt_tokens, t[1].output_tokens), (396, 1));
        assert!(parse_azure("h\nnot,a,row\n").is_err());
    }

    #[test]
    fn generated_workloads_and_the_bound() {
        let t = tenants(10, 1);
        assert_eq!(t.len(), GENERATED);
        let rate = t.len() as f64 / (t.last().unwrap().at_ms / 1000.0);
        assert!((rate - GENERATED_RATE).abs() < 0.1, "{rate}");
        let firsts: std::collections::BTreeSet<u64> = t.iter().map(|r| r.blocks[0]).collect();
        assert_eq!(firsts.len(), 10);
        assert!(t
            .iter()
            .all(|r| r.prompt_tokens >= r.blocks.len() as u64 * 512 + 20));
        let h = hot(1);
        assert!(h.iter().all(|r| r.blocks == h[0].blocks));
        let refs: Vec<&TraceRequest> = h.iter().take(3).collect();
        assert_eq!(seen_before(&refs), vec![0, 2048, 2048]);
        // Only leading blocks count, and a partial last block never does.
        let a = TraceRequest {
            at_ms: 0.0,
            prompt_tokens: 1100,
            output_tokens: 1,
            blocks: vec![1, 2, 3],
            tenant: None,
        };
        let b = TraceRequest {
            prompt_tokens: 1600,
            blocks: vec![9, 2, 3],
            tenant: None,
            ..a.clone()
        };
        let c = TraceRequest {
            prompt_tokens: 1600,
            blocks: vec![1, 2, 3],
            tenant: None,
            ..a.clone()
        };
        assert_eq!(seen_before(&[&a, &b, &c]), vec![0, 0, 1024]);
    }

    #[test]
    fn the_robustness_family_has_its_shapes_and_bursts() {
        let median = |mut v: Vec<u64>| {
            v.sort_unstable();
            v[v.len() / 2]
        };
        let p = shaped(Shape::Prefill, 1);
        assert_eq!(p.len(), GENERATED);
        let (pp, po) = (
            median(p.iter().map(|r| r.prompt_tokens).collect()),
            median(p.iter().map(|r| r.output_tokens).collect()),
        );
        assert!(
            (1800..2200).contains(&pp) && (20..30).contains(&po),
            "{pp} {po}"
        );
        let d = shaped(Shape::Decode, 1);
        let (dp, dout) = (
            median(d.iter().map(|r| r.prompt_tokens).collect()),
            median(d.iter().map(|r| r.output_tokens).collect()),
        );
        assert!(
            (150..250).contains(&dp) && (500..700).contains(&dout),
            "{dp} {dout}"
        );
        let m = shaped(Shape::Mixed, 1);
        let long = m
            .iter()
            .filter(|r| r.prompt_tokens > r.output_tokens)
            .count();
        assert!((3000..4200).contains(&long), "{long}");
        assert_eq!(Shape::parse("decode"), Some(Shape::Decode));
        let l = shaped(Shape::Long, 1);
        let lp = median(l.iter().map(|r| r.prompt_tokens).collect());
        assert!((7000..9000).contains(&lp), "{lp}");
        assert_eq!(l.iter().map(|r| r.prompt_tokens).max(), Some(48_000));
        assert_eq!(Shape::parse("burst"), None);

        // Bursts keep the mean rate and the order, and their gaps vary above a CV of 10.
        let b = bursty(shaped(Shape::Prefill, 3), 3);
        assert!(b.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        let span_s = b.last().unwrap().at_ms / 1000.0;
        let rate = b.len() as f64 / span_s;
        assert!((rate / GENERATED_RATE - 1.0).abs() < 0.25, "{rate}");
        let gaps: Vec<f64> = b.windows(2).map(|w| w[1].at_ms - w[0].at_ms).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        let cv = var.sqrt() / mean;
        assert!(cv > 10.0, "{cv}");
        // Tens of requests within a second.
        let in_first = b.iter().filter(|r| r.at_ms < BURST_MS).count() as u64;
        assert!(
            (BURST_REQUESTS.0..=BURST_REQUESTS.1).contains(&in_first),
            "{in_first}"
        );
    }

    #[test]
    fn sharegpt_rows() {
        let text = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n\
                    74,918,992,0.08\n290,0,290,inf\n";
        let t = parse_sharegpt(text, 1).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].prompt_tokens, t[0].output_tokens), (74, 918));
        assert_eq!((t[1].prompt_tokens, t[1].output_tokens), (290, 1));
        assert!(0.0 < t[0].at_ms && t[0].at_ms < t[1].at_ms);
        assert_eq!(t, parse_sharegpt(text, 1).unwrap(), "seeded");
        assert_ne!(t[1].at_ms, parse_sharegpt(text, 2).unwrap()[1].at_ms);
        assert!(parse_sharegpt("h\nx,y\n", 1).is_err());
    }

    #[test]
    fn mooncake_rows() {
        let t = parse_mooncake(
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 6, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 250, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 2]}\n",
        )
        .unwrap();
        assert_eq!(t[1].at_ms, 250.0);
        assert_eq!(t[1].blocks, vec![0, 2]);
        assert!(parse_mooncake("{\"timestamp\": 0}").is_err());
    }

    #[test]
    fn two_tenants_steady_chat_and_bursts_of_long_prompts() {
        let t = two_tenants(3);
        assert!(t.windows(2).all(|w| w[0].at_ms <= w[1].at_ms), "in order");
        let of = |name: &str| {
            t.iter()
                .filter(|r| r.tenant == Some(name))
                .collect::<Vec<_>>()
        };
        let (chat, docs) = (of("chat"), of("docs"));
        assert_eq!(
            chat.len() + docs.len(),
            t.len(),
            "every request has a tenant"
        );
        // About 2 per second for an hour.
        assert!((6_500..8_000).contains(&chat.len()), "{}", chat.len());
        assert!(docs.len() % DOCS_BURST as usize == 0 && docs.len() >= 80 * 30);
        let mean = |rs: &[&TraceRequest]| {
            rs.iter().map(|r| r.prompt_tokens as f64).sum::<f64>() / rs.len() as f64
        };
        assert!(
            mean(&docs) > 10.0 * mean(&chat),
            "{} vs {}",
            mean(&docs),
            mean(&chat)
        );
        // Each burst's 30 prompts within a second.
        let first: Vec<f64> = docs.iter().take(30).map(|r| r.at_ms).collect();
        let span = first.iter().cloned().fold(f64::MIN, f64::max)
            - first.iter().cloned().fold(f64::MAX, f64::min);
        assert!(span <= BURST_MS, "{span}");
        assert_eq!(two_tenants(3), t, "seeded");
    }
}
