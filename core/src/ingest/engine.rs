//! Inference engines: what a node's health answer is (the seed JSON, or an engine's
//! Prometheus `/metrics`) and which of the engine's metrics tell the balancer its load.
//!
//! Real clusters run vLLM, SGLang, TGI, trtllm-serve or llama.cpp, and none of them serves the
//! seed JSON; each exports Prometheus text with its own names. This module reads one scrape into
//! a `Scrape`: the gauges the choice needs (requests running and waiting, KV-cache use, the
//! cache's size when the engine publishes its geometry) and the cumulative prompt and
//! generation token counters. Counters are not a load: `rates` turns two scrapes into
//! tokens per second and a `telemetry::Report`.
//!
//! Names read, per engine (sources: vLLM "Production Metrics" docs and `vllm/v1/metrics`;
//! SGLang "Production Metrics" docs and `sglang/srt/metrics/collector.py`; TGI's "Metrics"
//! reference; TensorRT-LLM's `tensorrt_llm/metrics/collector.py` behind trtllm-serve's
//! `/prometheus/metrics`; llama.cpp's `tools/server/README.md`, `GET /metrics` with `--metrics`):
//!
//! | signal | vLLM | SGLang | TGI | trtllm-serve | llama.cpp |
//! |---|---|---|---|---|---|
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` | `tgi_batch_current_size` | `trtllm_num_requests_running` | `llamacpp:requests_processing` |
//! | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` | `tgi_queue_size` | `trtllm_num_requests_waiting` | `llamacpp:requests_deferred` |
//! | KV use 0..1 | `vllm:kv_cache_usage_perc`, v0 `vllm:gpu_cache_usage_perc` | `sglang:token_usage` | - | `trtllm_kv_cache_utilization` | `llamacpp:kv_cache_usage_ratio` |
//! | KV tokens in use | - | `sglang:num_used_tokens` | `tgi_batch_current_max_tokens` | `trtllm_kv_cache_used_blocks` x tokens/block | `llamacpp:kv_cache_tokens` |
//! | KV size, tokens | `vllm:cache_config_info{block_size x num_gpu_blocks}` | `sglang:max_total_num_tokens`, else `sglang:cache_config_info{page_size x num_pages}` | - | `trtllm_kv_cache_tokens_per_block` x `trtllm_kv_cache_max_blocks` | - |
//! | prompt tokens | `vllm:prompt_tokens_total` | `sglang:prompt_tokens_total` | `tgi_request_input_length_sum` | `trtllm_prompt_tokens_total` | `llamacpp:prompt_tokens_total` |
//! | output tokens | `vllm:generation_tokens_total` | `sglang:generation_tokens_total` | `tgi_request_generated_tokens_sum` | `trtllm_generation_tokens_total` | `llamacpp:tokens_predicted_total` |
//! | prefix-cache hits (the engine's word, beside the filter's prediction) | `vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total` (tokens) | `sglang:cache_hit_rate` (a recent fraction; the mean over its series) | - | - | - |
//!
//! Assumptions, stated because the engines document them loosely:
//! - vLLM v0 and v1 share the prefix; both KV names are read (vLLM renamed the gauge, and
//!   routers that knew one name broke). The "perc" gauges are fractions (1 = full), as their
//!   help text says. `vllm:num_requests_swapped` (v0) is ignored: swapped sequences hold no GPU
//!   KV and are neither running nor admission-queued work the balancer could steer.
//!   `vllm:cache_config_info` may say `num_gpu_blocks="None"` before profiling; then no size.
//! - SGLang's `token_usage` is used tokens over the KV pool (`max_total_num_tokens`). Only the
//!   first tensor-parallel rank of an attention group exports, so series differ by data-parallel
//!   rank, not by TP rank, and are distinct pools (summing them double counts nothing).
//! - TGI has no KV gauge; `tgi_batch_current_max_tokens` is the token budget the running batch
//!   holds (its prompts plus their max new tokens), TGI's own admission measure against
//!   `--max-batch-total-tokens`, which it does not export: configure `kv_cache_tokens` to that
//!   value to turn it into a fraction. Its token counts are histogram sums: input length is
//!   recorded at admission, generated tokens when a request ends, so TGI's rate is lumpier.
//! - trtllm-serve's counters exist in recent TensorRT-LLM only (1.1 exported five metrics);
//!   without them the load stays 0 and the choice ranks by queue, KV and in-flight work.
//!   `trtllm_kv_cache_utilization` is taken as a fraction; when absent or above 1, used over
//!   max blocks is used instead.
//! - llama.cpp publishes no cache size in `/metrics` (n_ctx is in `/props`); configure
//!   `kv_cache_tokens` so `llamacpp:kv_cache_tokens` becomes a fraction. Newer builds dropped
//!   the KV metrics altogether; the node is then ranked without the VRAM guard.
//!
//! Several series of one metric (per `model_name`, per data-parallel `engine` index in vLLM,
//! per DP rank in SGLang): request counts and token counters are summed, since every series is
//! work on this node. KV quantities (use fraction, tokens in use, cache size) take the maximum:
//! each series describes one engine's own cache pool, a request lands in one pool, and the
//! VRAM guard must not be fooled by an average that hides a full pool (nor by a sum of
//! fractions past 1). The maximum is the fullest pool against one pool's size: conservative.
//!
//! Values are checked per sample: a NaN, infinite, negative or absurd (>= 1e15) value, or a
//! fraction above 1, is dropped on its own and counted; the other series and fields stand.
//!
//! vLLM's scrape also says which models the node serves (see `models`): the `model_name` label
//! of the series read above, and the adapters of `vllm:lora_requests_info` (its
//! `running_lora_adapters` and `waiting_lora_adapters` labels, comma-separated, and
//! `max_lora`). vLLM never removes an old label set of that gauge and sets the current one's
//! value to the time, so only the series with the largest value is the present; older series
//! name adapters that may have been unloaded since. Other engines are not read for models.
//!
//! This file is longer than the others: the five engines are read by one accumulation, and
//! its tests, which are most of the file, check each engine's real `/metrics` fixture against
//! that same code, so the table above, the code and its per-engine cases stay side by side.

use crate::fleet::models::{MAX_MODELS_PER_NODE, MAX_MODEL_NAME_BYTES};
use crate::ingest::prometheus::{parse_prometheus_samples, Labels, Sample};
use crate::ingest::telemetry::{self, believable, Report, ReportError};
use std::fmt;

/// What a node's health endpoint serves, from `nodes[].format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HealthFormat {
    /// Decided per answer: a JSON object is the seed format, Prometheus text is read by the
    /// prefix of its metric names.
    #[default]
    Auto,
    Seed,
    Vllm,
    Sglang,
    Tgi,
    Trtllm,
    LlamaCpp,
}

impl HealthFormat {
    pub const ALL: [HealthFormat; 7] = [
        HealthFormat::Auto,
        HealthFormat::Seed,
        HealthFormat::Vllm,
        HealthFormat::Sglang,
        HealthFormat::Tgi,
        HealthFormat::Trtllm,
        HealthFormat::LlamaCpp,
    ];

    /// The configuration spelling.
    pub fn name(self) -> &'static str {
        match self {
            HealthFormat::Auto => "auto",
            HealthFormat::Seed => "seed",
            HealthFormat::Vllm => "vllm",
            HealthFormat::Sglang => "sglang",
            HealthFormat::Tgi => "tgi",
            HealthFormat::Trtllm => "trtllm",
            HealthFormat::LlamaCpp => "llamacpp",
        }
    }

    pub fn from_name(s: &str) -> Option<HealthFormat> {
        HealthFormat::ALL.into_iter().find(|f| f.name() == s)
    }

    fn engine(self) -> Option<Engine> {
        match self {
            HealthFormat::Auto | HealthFormat::Seed => None,
            HealthFormat::Vllm => Some(Engine::Vllm),
            HealthFormat::Sglang => Some(Engine::Sglang),
            HealthFormat::Tgi => Some(Engine::Tgi),
            HealthFormat::Trtllm => Some(Engine::Trtllm),
            HealthFormat::LlamaCpp => Some(Engine::LlamaCpp),
        }
    }
}

/// An inference engine whose Prometheus metrics are understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    Tgi,
    Trtllm,
    LlamaCpp,
}

impl Engine {
    pub const ALL: [Engine; 5] = [
        Engine::Vllm,
        Engine::Sglang,
        Engine::Tgi,
        Engine::Trtllm,
        Engine::LlamaCpp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Tgi => "tgi",
            Engine::Trtllm => "trtllm",
            Engine::LlamaCpp => "llamacpp",
        }
    }

    /// The prefix every metric of the engine carries.
    pub fn prefix(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm:",
            Engine::Sglang => "sglang:",
            Engine::Tgi => "tgi_",
            Engine::Trtllm => "trtllm_",
            Engine::LlamaCpp => "llamacpp:",
        }
    }

    /// The engine a metric name belongs to, by its prefix.
    pub fn of_metric(name: &str) -> Option<Engine> {
        Engine::ALL
            .into_iter()
            .find(|e| name.starts_with(e.prefix()))
    }

    /// Which field of a scrape a metric feeds, for this engine.
    fn field(self, name: &str) -> Option<Field> {
        READ.iter()
            .find(|(e, n, _)| *e == self && *n == name)
            .map(|(_, _, f)| *f)
    }

    /// Whether the engine serves `/metrics` through the Python `prometheus_client`, whose
    /// exposition renders only the samples named by `name[]` query parameters when given any:
    /// vLLM, SGLang and trtllm-serve. TGI's exporter and llama.cpp's hand-written page ignore
    /// queries (and are small).
    pub fn filters_by_name(self) -> bool {
        matches!(self, Engine::Vllm | Engine::Sglang | Engine::Trtllm)
    }

    /// Whether the engine's prompt-token counter counts each prompt whole, its cached part
    /// included, once its prefill is done: vLLM's (v1 counts a request's prompt length at its
    /// first token). llama.cpp counts only the tokens it computed; SGLang's, TGI's and
    /// trtllm-serve's counting is not relied on. See `route::prompt_scale::EngineCounts`.
    pub fn counts_whole_prompts(self) -> bool {
        matches!(self, Engine::Vllm)
    }

    /// Every sample name this module reads from the engine's scrape: the table of `READ` and
    /// vLLM's LoRA gauge. A poll may ask for these alone (see `probe`).
    pub fn names_read(self) -> impl Iterator<Item = &'static str> {
        let lora = (self == Engine::Vllm).then_some(VLLM_LORA_INFO);
        READ.iter()
            .filter(move |(e, _, _)| *e == self)
            .map(|(_, n, _)| *n)
            .chain(lora)
    }
}

/// vLLM's gauge of LoRA adapters (see `models`).
const VLLM_LORA_INFO: &str = "vllm:lora_requests_info";

/// The samples read, per engine, and the field of a scrape each feeds (the module's table).
const READ: &[(Engine, &str, Field)] = &[
    (Engine::Vllm, "vllm:num_requests_running", Field::Running),
    (Engine::Vllm, "vllm:num_requests_waiting", Field::Waiting),
    (Engine::Vllm, "vllm:kv_cache_usage_perc", Field::KvUsage),
    (Engine::Vllm, "vllm:gpu_cache_usage_perc", Field::KvUsage),
    (Engine::Vllm, "vllm:prompt_tokens_total", Field::Prompt),
    (
        Engine::Vllm,
        "vllm:generation_tokens_total",
        Field::Generation,
    ),
    (
        Engine::Vllm,
        "vllm:cache_config_info",
        Field::CacheInfo("block_size", "num_gpu_blocks"),
    ),
    (
        Engine::Vllm,
        "vllm:prefix_cache_hits_total",
        Field::PrefixHits,
    ),
    (
        Engine::Vllm,
        "vllm:prefix_cache_queries_total",
        Field::PrefixQueries,
    ),
    (Engine::Sglang, "sglang:num_running_reqs", Field::Running),
    (Engine::Sglang, "sglang:num_queue_reqs", Field::Waiting),
    (Engine::Sglang, "sglang:token_usage", Field::KvUsage),
    (
        Engine::Sglang,
        "sglang:num_used_tokens",
        Field::KvUsedTokens,
    ),
    (
        Engine::Sglang,
        "sglang:max_total_num_tokens",
        Field::KvTotalTokens,
    ),
    (Engine::Sglang, "sglang:prompt_tokens_total", Field::Prompt),
    (
        Engine::Sglang,
        "sglang:generation_tokens_total",
        Field::Generation,
    ),
    (
        Engine::Sglang,
        "sglang:cache_config_info",
        Field::CacheInfo("page_size", "num_pages"),
    ),
    (
        Engine::Sglang,
        "sglang:cache_hit_rate",
        Field::PrefixHitRate,
    ),
    (Engine::Tgi, "tgi_batch_current_size", Field::Running),
    (Engine::Tgi, "tgi_queue_size", Field::Waiting),
    (
        Engine::Tgi,
        "tgi_batch_current_max_tokens",
        Field::KvUsedTokens,
    ),
    (Engine::Tgi, "tgi_request_input_length_sum", Field::Prompt),
    (
        Engine::Tgi,
        "tgi_request_generated_tokens_sum",
        Field::Generation,
    ),
    (
        Engine::Trtllm,
        "trtllm_num_requests_running",
        Field::Running,
    ),
    (
        Engine::Trtllm,
        "trtllm_num_requests_waiting",
        Field::Waiting,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_utilization",
        Field::KvUsage,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_used_blocks",
        Field::KvUsedBlocks,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_max_blocks",
        Field::KvTotalBlocks,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_tokens_per_block",
        Field::KvTokensPerBlock,
    ),
    (Engine::Trtllm, "trtllm_prompt_tokens_total", Field::Prompt),
    (
        Engine::Trtllm,
        "trtllm_generation_tokens_total",
        Field::Generation,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:requests_processing",
        Field::Running,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:requests_deferred",
        Field::Waiting,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:kv_cache_usage_ratio",
        Field::KvUsage,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:kv_cache_tokens",
        Field::KvUsedTokens,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:prompt_tokens_total",
        Field::Prompt,
    ),
    (
        Engine::LlamaCpp,
        "llamacpp:tokens_predicted_total",
        Field::Generation,
    ),
];

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Running,
    Waiting,
    KvUsage,
    KvUsedTokens,
    KvUsedBlocks,
    KvTotalTokens,
    KvTotalBlocks,
    KvTokensPerBlock,
    Prompt,
    Generation,
    /// Prompt tokens the prefix cache held, and the prompt tokens looked up (vLLM v1).
    PrefixHits,
    PrefixQueries,
    /// The prefix cache's recent hit rate, 0..1 (SGLang).
    PrefixHitRate,
    /// An info metric whose labels give (tokens per block, blocks).
    CacheInfo(&'static str, &'static str),
}

/// A cumulative counter summed over its series. The series count is part of its identity: a
/// sum over a different set of series is not comparable with the last one (see `rates`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counter {
    pub total: f64,
    pub series: u32,
}

/// What one scrape of an engine says, before any rate is computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Scrape {
    pub engine: Engine,
    /// Requests being served (sum over series).
    pub running: Option<f64>,
    /// Requests waiting for admission (sum over series).
    pub waiting: Option<f64>,
    /// KV-cache use 0..1 (the fullest pool).
    pub kv_usage: Option<f64>,
    /// KV-cache tokens in use, for engines that count tokens rather than a fraction.
    pub kv_used_tokens: Option<f64>,
    /// KV-cache size in tokens, from the engine's published cache geometry.
    pub kv_total_tokens: Option<f64>,
    /// Cumulative prompt (prefill) tokens.
    pub prompt_tokens: Option<Counter>,
    /// Cumulative generated (decode) tokens.
    pub generation_tokens: Option<Counter>,
    /// Cumulative prompt tokens found in the prefix cache, and looked up there (vLLM v1's
    /// `prefix_cache_hits_total` and `prefix_cache_queries_total`): the engine's own word on
    /// the hit rate, beside the filter's prediction (see `fleet::prefixes`).
    pub prefix_hits: Option<Counter>,
    pub prefix_queries: Option<Counter>,
    /// The prefix cache's recent hit rate, 0..1, when the engine publishes a rate rather than
    /// counters (SGLang's `cache_hit_rate`; the mean over its data-parallel series).
    pub prefix_hit_rate: Option<f64>,
    /// Sample lines read, lines skipped as invalid, and values dropped as not believable.
    pub samples: usize,
    pub skipped_lines: usize,
    pub rejected_values: usize,
    /// Models the scrape names (vLLM only): the `model_name` labels and the LoRA adapters
    /// running or waiting, each once, at most `models::MAX_MODELS_PER_NODE`.
    pub models: Vec<String>,
    /// vLLM's `max_lora` (adapters one batch may hold), when LoRA is enabled. Read but not yet
    /// used by the choice: it bounds adapters per batch, not the adapters served.
    pub max_lora: Option<u32>,
}

/// A health answer, read.
#[derive(Debug, Clone, PartialEq)]
pub enum Health {
    /// The seed JSON: a report as the node wrote it.
    Seed(Report),
    /// An engine's metrics: counters still to be turned into a rate.
    Engine(Scrape),
}

/// Why a health answer could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// The seed format's own error.
    Seed(ReportError),
    /// An empty body (an engine's `/health` answers 200 with nothing: poll its metrics path).
    Empty,
    /// An engine format was configured, but the answer is a JSON object.
    JsonNotMetrics(Engine),
    /// Not a JSON object, and not one valid Prometheus sample line in it.
    NotMetrics { skipped_lines: usize },
    /// Prometheus text, but no metric of a known engine (format `auto`).
    UnknownEngine { samples: usize },
    /// The engine's metrics are there, but none the balancer reads has a usable value.
    NothingUsable { engine: Engine, samples: usize },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::Seed(e) => write!(f, "seed format: {e}"),
            FormatError::Empty => f.write_str(
                "answer is empty (engines serve Prometheus text at their metrics path, e.g. /metrics, not /health)",
            ),
            FormatError::JsonNotMetrics(e) => write!(
                f,
                "format {e}: answer is a JSON object, not Prometheus text (seed format? health_path?)"
            ),
            FormatError::NotMetrics { skipped_lines } => write!(
                f,
                "answer is neither a JSON object nor Prometheus text ({skipped_lines} invalid lines, no sample)"
            ),
            FormatError::UnknownEngine { samples } => write!(
                f,
                "Prometheus text with {samples} samples but no metric of a known engine (prefixes vllm:, sglang:, tgi_, trtllm_, llamacpp:)"
            ),
            FormatError::NothingUsable { engine, samples } => write!(
                f,
                "format {engine}: none of {samples} samples is a {engine} metric the balancer reads \
                 (running, waiting, KV use, token counters) with a usable value"
            ),
        }
    }
}

/// Sum, maximum and count of the accepted series of one field.
#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    sum: f64,
    max: f64,
    n: u32,
}

impl Acc {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.max = if self.n == 0 { v } else { self.max.max(v) };
        self.n = self.n.saturating_add(1);
    }

    fn sum(&self) -> Option<f64> {
        (self.n > 0).then_some(self.sum)
    }

    fn max(&self) -> Option<f64> {
        (self.n > 0).then_some(self.max)
    }

    fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / f64::from(self.n))
    }

    fn counter(&self) -> Option<Counter> {
        // A sum of believable values can still pass the bound.
        (self.n > 0 && believable(self.sum)).then_some(Counter {
            total: self.sum,
            series: self.n,
        })
    }
}

#[derive(Debug, Default)]
struct Accs {
    running: Acc,
    waiting: Acc,
    kv_usage: Acc,
    kv_used_tokens: Acc,
    kv_used_blocks: Acc,
    kv_total_tokens: Acc,
    kv_total_blocks: Acc,
    kv_tokens_per_block: Acc,
    cache_info_tokens: Acc,
    prompt: Acc,
    generation: Acc,
    prefix_hits: Acc,
    prefix_queries: Acc,
    prefix_hit_rate: Acc,
    rejected: usize,
}

impl Accs {
    fn take(&mut self, field: Field, s: &Sample) {
        let value = match field {
            // The value of an info metric is 1; the geometry is in its labels.
            Field::CacheInfo(block, count) => {
                let get = |l: &str| s.labels.get(l).and_then(|v| v.as_f64());
                match (get(block), get(count)) {
                    (Some(b), Some(n)) => b * n,
                    // "None" before the engine profiled its memory: no size, not an error.
                    _ => return,
                }
            }
            _ => s.value,
        };
        let fraction = matches!(field, Field::KvUsage | Field::PrefixHitRate);
        let ok = believable(value) && !(fraction && value > 1.0);
        if !ok {
            self.rejected += 1;
            return;
        }
        let acc = match field {
            Field::Running => &mut self.running,
            Field::Waiting => &mut self.waiting,
            Field::KvUsage => &mut self.kv_usage,
            Field::KvUsedTokens => &mut self.kv_used_tokens,
            Field::KvUsedBlocks => &mut self.kv_used_blocks,
            Field::KvTotalTokens => &mut self.kv_total_tokens,
            Field::KvTotalBlocks => &mut self.kv_total_blocks,
            Field::KvTokensPerBlock => &mut self.kv_tokens_per_block,
            Field::CacheInfo(..) => &mut self.cache_info_tokens,
            Field::Prompt => &mut self.prompt,
            Field::Generation => &mut self.generation,
            Field::PrefixHits => &mut self.prefix_hits,
            Field::PrefixQueries => &mut self.prefix_queries,
            Field::PrefixHitRate => &mut self.prefix_hit_rate,
        };
        acc.add(value);
    }
}

/// Adds a model name once; empty and overlong names, and names past the bound, are dropped.
fn add_model(models: &mut Vec<String>, name: &str) {
    if !name.is_empty()
        && name.len() <= MAX_MODEL_NAME_BYTES
        && models.len() < MAX_MODELS_PER_NODE
        && !models.iter().any(|m| m == name)
    {
        models.push(name.to_string());
    }
}

fn product(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? * b?).filter(|p| believable(*p))
}

/// Reads one Prometheus scrape. `engine` is the configured engine, or `None` to detect it from
/// the first sample whose name carries a known prefix.
pub fn scrape(engine: Option<Engine>, body: &[u8]) -> Result<Scrape, FormatError> {
    let mut samples = parse_prometheus_samples(body);
    let mut engine = engine;
    let mut accs = Accs::default();
    let mut count = 0usize;
    let mut models = Vec::new();
    // The present series of vLLM's LoRA gauge: its value (a time) and labels.
    let mut lora: Option<(f64, Labels)> = None;
    for s in samples.by_ref() {
        count += 1;
        let e = match engine {
            Some(e) => e,
            None => match Engine::of_metric(s.name) {
                Some(e) => *engine.insert(e),
                None => continue,
            },
        };
        if let Some(field) = e.field(s.name) {
            accs.take(field, &s);
            if e == Engine::Vllm {
                if let Some(name) = s.labels.get("model_name") {
                    add_model(&mut models, &name.unescaped());
                }
            }
        } else if e == Engine::Vllm
            && s.name == VLLM_LORA_INFO
            && s.value.is_finite()
            && !matches!(lora, Some((t, _)) if s.value <= t)
        {
            lora = Some((s.value, s.labels));
        }
    }
    let mut max_lora = None;
    if let Some((_, labels)) = lora {
        for key in ["running_lora_adapters", "waiting_lora_adapters"] {
            if let Some(list) = labels.get(key) {
                for adapter in list.unescaped().split(',') {
                    add_model(&mut models, adapter.trim());
                }
            }
        }
        max_lora = labels
            .get("max_lora")
            .and_then(|v| v.raw().parse::<u32>().ok());
    }
    let skipped_lines = samples.skipped();
    if count == 0 {
        return Err(FormatError::NotMetrics { skipped_lines });
    }
    let Some(engine) = engine else {
        return Err(FormatError::UnknownEngine { samples: count });
    };
    let tokens_per_block = accs.kv_tokens_per_block.max();
    let kv_total_tokens = accs
        .kv_total_tokens
        .max()
        .or(accs.cache_info_tokens.max())
        .or(product(tokens_per_block, accs.kv_total_blocks.max()))
        .filter(|t| *t >= 1.0);
    let kv_used_tokens = accs
        .kv_used_tokens
        .max()
        .or(product(tokens_per_block, accs.kv_used_blocks.max()));
    let blocks_usage = match (accs.kv_used_blocks.max(), accs.kv_total_blocks.max()) {
        (Some(used), Some(total)) if total > 0.0 => Some((used / total).min(1.0)),
        _ => None,
    };
    let scrape = Scrape {
        engine,
        running: accs.running.sum(),
        waiting: accs.waiting.sum(),
        kv_usage: accs.kv_usage.max().or(blocks_usage),
        kv_used_tokens,
        kv_total_tokens,
        prompt_tokens: accs.prompt.counter(),
        generation_tokens: accs.generation.counter(),
        prefix_hits: accs.prefix_hits.counter(),
        prefix_queries: accs.prefix_queries.counter(),
        prefix_hit_rate: accs.prefix_hit_rate.mean(),
        samples: count,
        skipped_lines,
        rejected_values: accs.rejected,
        models,
        max_lora,
    };
    let usable = scrape.running.is_some()
        || scrape.waiting.is_some()
        || scrape.kv_usage.is_some()
        || scrape.kv_used_tokens.is_some()
        || scrape.prompt_tokens.is_some()
        || scrape.generation_tokens.is_some();
    if !usable {
        return Err(FormatError::NothingUsable {
            engine,
            samples: count,
        });
    }
    Ok(scrape)
}

/// Reads a health answer in the node's configured format.
pub fn read(format: HealthFormat, body: &[u8]) -> Result<Health, FormatError> {
    if format == HealthFormat::Seed {
        return telemetry::parse_health(body)
            .map(Health::Seed)
            .map_err(FormatError::Seed);
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    let Some(first) = first else {
        return Err(FormatError::Empty);
    };
    // No metric name starts with `{`, so the first byte tells the two formats apart.
    let json = *first == b'{';
    match format.engine() {
        None if json => telemetry::parse_health(body)
            .map(Health::Seed)
            .map_err(FormatError::Seed),
        Some(e) if json => Err(FormatError::JsonNotMetrics(e)),
        engine => scrape(engine, body).map(Health::Engine),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::rates::Tracker;
    use crate::rng::{Rng, SplitMix64};

    const VLLM_V1: &str = include_str!("../../tests/data/metrics/vllm_v1.prom");
    const VLLM_V1_DP2: &str = include_str!("../../tests/data/metrics/vllm_v1_dp2.prom");
    const VLLM_V0: &str = include_str!("../../tests/data/metrics/vllm_v0.prom");
    const SGLANG: &str = include_str!("../../tests/data/metrics/sglang.prom");
    const TGI: &str = include_str!("../../tests/data/metrics/tgi.prom");
    const TRTLLM: &str = include_str!("../../tests/data/metrics/trtllm.prom");
    const TRTLLM_1_1: &str = include_str!("../../tests/data/metrics/trtllm_1_1.prom");
    const LLAMACPP: &str = include_str!("../../tests/data/metrics/llamacpp.prom");

    /// The fields a test compares: running, waiting, KV use, KV tokens in use, KV size,
    /// prompt counter, generation counter.
    type Fields = (
        Option<f64>,
        Option<f64>,
        Option<f64>,
        Option<f64>,
        Option<f64>,
        Option<(f64, u32)>,
        Option<(f64, u32)>,
    );

    fn fields(s: &Scrape) -> Fields {
        let c = |c: Option<Counter>| c.map(|c| (c.total, c.series));
        (
            s.running,
            s.waiting,
            s.kv_usage,
            s.kv_used_tokens,
            s.kv_total_tokens,
            c(s.prompt_tokens),
            c(s.generation_tokens),
        )
    }

    fn engine_scrape(format: HealthFormat, body: &str) -> Result<Scrape, FormatError> {
        match read(format, body.as_bytes())? {
            Health::Engine(s) => Ok(s),
            Health::Seed(r) => panic!("read as seed: {r:?}"),
        }
    }

    /// SGLang publishes its prefix cache's hit rate as a recent fraction per data-parallel
    /// rank: the scrape carries their mean; a value past 1 is dropped and counted.
    #[test]
    fn sglangs_hit_rate_is_the_mean_of_its_series() {
        let s = scrape(None, SGLANG.as_bytes()).unwrap();
        let rate = s.prefix_hit_rate.unwrap();
        assert!((rate - 0.007507552643049313).abs() < 1e-12, "{rate}");
        let two = "sglang:num_running_reqs{dp_rank=\"0\"} 1\n\
                   sglang:cache_hit_rate{dp_rank=\"0\"} 0.5\nsglang:cache_hit_rate{dp_rank=\"1\"} 0.75\n";
        let s = scrape(None, two.as_bytes()).unwrap();
        assert_eq!(s.prefix_hit_rate, Some(0.625));
        let bad = "sglang:num_running_reqs 1\nsglang:cache_hit_rate 1.5\n";
        let s = scrape(None, bad.as_bytes()).unwrap();
        assert_eq!((s.prefix_hit_rate, s.rejected_values), (None, 1));
        let vllm = scrape(None, VLLM_V1.as_bytes()).unwrap();
        assert_eq!(vllm.prefix_hit_rate, None, "vLLM publishes counters");
    }

    /// Each engine's full metric set, as the engine exposes it, read by auto-detection and by
    /// the explicit format alike.
    #[test]
    fn full_metric_sets_of_each_engine() {
        let cases: Vec<(&str, &str, HealthFormat, Engine, Fields)> = vec![
            (
                "vLLM v1",
                VLLM_V1,
                HealthFormat::Vllm,
                Engine::Vllm,
                (
                    Some(14.0),
                    Some(3.0),
                    Some(0.4375),
                    None,
                    Some(16.0 * 8192.0),
                    Some((1234567.0, 1)),
                    Some((456789.0, 1)),
                ),
            ),
            (
                // Two data-parallel engines: counts and counters summed, KV the fuller pool,
                // the size one pool's.
                "vLLM v1, two engines",
                VLLM_V1_DP2,
                HealthFormat::Vllm,
                Engine::Vllm,
                (
                    Some(10.0),
                    Some(3.0),
                    Some(0.8),
                    None,
                    Some(16.0 * 4096.0),
                    Some((4000.0, 2)),
                    Some((1200.0, 2)),
                ),
            ),
            (
                // gpu_cache_usage_perc, and num_requests_swapped (2) is not counted anywhere.
                "vLLM v0",
                VLLM_V0,
                HealthFormat::Vllm,
                Engine::Vllm,
                (
                    Some(5.0),
                    Some(7.0),
                    Some(0.91),
                    None,
                    Some(16.0 * 2048.0),
                    Some((98765.0, 1)),
                    Some((43210.0, 1)),
                ),
            ),
            (
                "SGLang",
                SGLANG,
                HealthFormat::Sglang,
                Engine::Sglang,
                (
                    Some(23.0),
                    Some(4.0),
                    Some(0.28),
                    Some(38220.0),
                    Some(136500.0),
                    Some((8128902.0, 1)),
                    Some((7557572.0, 1)),
                ),
            ),
            (
                "TGI",
                TGI,
                HealthFormat::Tgi,
                Engine::Tgi,
                (
                    Some(18.0),
                    Some(6.0),
                    None,
                    Some(45000.0),
                    None,
                    Some((2500000.0, 1)),
                    Some((800000.0, 1)),
                ),
            ),
            (
                "trtllm-serve",
                TRTLLM,
                HealthFormat::Trtllm,
                Engine::Trtllm,
                (
                    Some(9.0),
                    Some(2.0),
                    Some(0.62),
                    Some(2540.0 * 32.0),
                    Some(4096.0 * 32.0),
                    Some((5e6, 1)),
                    Some((2e6, 1)),
                ),
            ),
            (
                "llama.cpp",
                LLAMACPP,
                HealthFormat::LlamaCpp,
                Engine::LlamaCpp,
                (
                    Some(2.0),
                    Some(1.0),
                    Some(0.125),
                    Some(2048.0),
                    None,
                    Some((33065.0, 1)),
                    Some((7801.0, 1)),
                ),
            ),
        ];
        for (name, body, format, engine, want) in cases {
            for f in [HealthFormat::Auto, format] {
                let s = engine_scrape(f, body).unwrap_or_else(|e| panic!("{name} as {f:?}: {e}"));
                assert_eq!(s.engine, engine, "{name} as {f:?}");
                assert_eq!(fields(&s), want, "{name} as {f:?}");
                assert_eq!((s.skipped_lines, s.rejected_values), (0, 0), "{name}");
                // llama.cpp exports 13 metrics in all; the others dozens with their histograms.
                assert!(
                    s.samples >= 13,
                    "{name}: the full metric set, not a few lines"
                );
            }
            // The same text read as any other engine has nothing the balancer uses.
            for other in Engine::ALL.into_iter().filter(|e| *e != engine) {
                let f = HealthFormat::ALL
                    .into_iter()
                    .find(|f| f.engine() == Some(other))
                    .unwrap();
                assert!(
                    matches!(engine_scrape(f, body), Err(FormatError::NothingUsable { engine: e, .. }) if e == other),
                    "{name} as {other}"
                );
            }
            // CRLF line endings and extra blank lines change nothing.
            let crlf = body.replace('\n', "\r\n\r\n");
            let s = engine_scrape(HealthFormat::Auto, &crlf).unwrap();
            assert_eq!((fields(&s), s.skipped_lines), (want, 0), "{name} with CRLF");
        }
    }

    /// (scrape, the models it names, max_lora): vLLM's model_name labels and the present
    /// series of its LoRA gauge; no other engine is read for models.
    #[test]
    fn models_named_in_vllm_metrics() {
        let llama = "meta-llama/Llama-3.1-8B-Instruct";
        let lora = |t: f64, running: &str, waiting: &str| {
            format!(
                "vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}} {t}\n"
            )
        };
        let cases: Vec<(&str, String, Vec<&str>, Option<u32>)> = vec![
            ("vLLM v1", VLLM_V1.into(), vec![llama], None),
            ("two engines of one model: once", VLLM_V1_DP2.into(), vec![llama], None),
            (
                "vLLM v0, LoRA off",
                VLLM_V0.into(),
                vec!["mistralai/Mistral-7B-Instruct-v0.3"],
                Some(0),
            ),
            (
                "adapters running and waiting, trimmed",
                format!("{VLLM_V1}{}", lora(1.7e9, "sql, chat", "summ")),
                vec![llama, "sql", "chat", "summ"],
                Some(4),
            ),
            (
                // vLLM keeps every label set it ever set; the latest time is the present.
                "only the newest LoRA series counts",
                format!(
                    "{}{}{}vllm:num_requests_running{{model_name=\"base\"}} 1\n",
                    lora(100.0, "old", ""),
                    lora(300.0, "new", ""),
                    lora(200.0, "older", "")
                ),
                vec!["base", "new"],
                Some(4),
            ),
            (
                "two models on one node, escapes resolved",
                "vllm:num_requests_running{model_name=\"a\\\"b\"} 1\nvllm:num_requests_waiting{model_name=\"c\"} 0\n"
                    .into(),
                vec!["a\"b", "c"],
                None,
            ),
            (
                "no labels, empty adapters, a NaN time",
                format!(
                    "vllm:num_requests_running 1\nvllm:lora_requests_info{{max_lora=\"x\",running_lora_adapters=\",,\"}} 5\n{}",
                    "vllm:lora_requests_info{running_lora_adapters=\"nan\"} NaN\n"
                ),
                vec![],
                None,
            ),
            (
                "model_name of a metric not read is not looked at",
                "vllm:num_requests_running 1\nvllm:other{model_name=\"z\"} 1\n".into(),
                vec![],
                None,
            ),
            ("SGLang names a model but is not read for it", SGLANG.into(), vec![], None),
        ];
        for (name, body, want, max_lora) in cases {
            let s =
                engine_scrape(HealthFormat::Auto, &body).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(s.models, want, "{name}");
            assert_eq!(s.max_lora, max_lora, "{name}");
        }
    }

    #[test]
    fn trtllm_before_its_load_metrics_has_nothing_usable() {
        let e = engine_scrape(HealthFormat::Auto, TRTLLM_1_1).unwrap_err();
        assert!(
            matches!(e, FormatError::NothingUsable { engine: Engine::Trtllm, samples } if samples > 50),
            "{e:?}"
        );
        assert!(e.to_string().contains("format trtllm"), "{e}");
    }

    /// Body -> the fields read (with the count of lines skipped and values rejected), or the
    /// error. Each case names the trick it plays.
    #[test]
    fn malformed_and_tricky_answers() {
        type Want = Result<(Fields, usize, usize), FormatError>;
        let running = |r: f64| -> Fields { (Some(r), None, None, None, None, None, None) };
        let truncated = {
            let cut = VLLM_V1.find("vllm:kv_cache_usage_perc{").unwrap() + 30;
            VLLM_V1.get(..cut).unwrap().to_string()
        };
        let garbage = VLLM_V1.replacen(
            "# HELP vllm:kv_cache_usage_perc",
            "<<garbage>>\n\u{0}\u{1}\n{{{\n\"\n# HELP vllm:kv_cache_usage_perc",
            1,
        );
        let sglang_no_gauge: String = SGLANG
            .lines()
            .filter(|l| !l.starts_with("sglang:max_total_num_tokens"))
            .map(|l| format!("{l}\n"))
            .collect();
        let trtllm_no_util: String = TRTLLM
            .lines()
            .filter(|l| !l.starts_with("trtllm_kv_cache_utilization"))
            .map(|l| format!("{l}\n"))
            .collect();
        let trtllm_percent = TRTLLM.replace(
            "trtllm_kv_cache_utilization{engine_type=\"trtllm\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 0.62",
            "trtllm_kv_cache_utilization{engine_type=\"trtllm\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 62.0",
        );
        let vllm_full = fields(&engine_scrape(HealthFormat::Vllm, VLLM_V1).unwrap());
        let trtllm_blocks = (
            Some(9.0),
            Some(2.0),
            Some(2540.0 / 4096.0),
            Some(2540.0 * 32.0),
            Some(4096.0 * 32.0),
            Some((5e6, 1)),
            Some((2e6, 1)),
        );
        let sglang_full = fields(&engine_scrape(HealthFormat::Sglang, SGLANG).unwrap());
        let cases: Vec<(&str, HealthFormat, String, Want)> = vec![
            ("empty body", HealthFormat::Auto, "".into(), Err(FormatError::Empty)),
            ("whitespace only", HealthFormat::Vllm, " \r\n\t\n".into(), Err(FormatError::Empty)),
            (
                "HTML error page",
                HealthFormat::Auto,
                "<html><body>502 Bad Gateway</body></html>".into(),
                Err(FormatError::NotMetrics { skipped_lines: 1 }),
            ),
            (
                "a seed answer where vLLM metrics are expected",
                HealthFormat::Vllm,
                r#"{"tokens_per_sec_load": 5}"#.into(),
                Err(FormatError::JsonNotMetrics(Engine::Vllm)),
            ),
            (
                "Prometheus text of no known engine",
                HealthFormat::Auto,
                "# TYPE up gauge\nup 1\nprocess_open_fds 9\n".into(),
                Err(FormatError::UnknownEngine { samples: 2 }),
            ),
            (
                "geometry alone is no load signal",
                HealthFormat::Auto,
                "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1\n".into(),
                Err(FormatError::NothingUsable { engine: Engine::Vllm, samples: 1 }),
            ),
            (
                "truncated in the middle of a label block",
                HealthFormat::Auto,
                truncated,
                Ok(((Some(14.0), Some(3.0), None, None, None, None, None), 1, 0)),
            ),
            ("garbage lines between good ones", HealthFormat::Auto, garbage, Ok((vllm_full, 4, 0))),
            (
                "NaN and infinities in the fields used",
                HealthFormat::Vllm,
                "vllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_waiting{engine=\"0\"} 2\n\
                 vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:prompt_tokens_total{engine=\"0\"} +Inf\n\
                 vllm:generation_tokens_total{engine=\"0\"} 10\nvllm:num_requests_waiting{engine=\"1\"} -Inf\n"
                    .into(),
                Ok(((None, Some(2.0), None, None, None, None, Some((10.0, 1))), 0, 4)),
            ),
            (
                "a NaN series drops alone; the other series stands",
                HealthFormat::Vllm,
                "vllm:num_requests_running{engine=\"0\"} NaN\nvllm:num_requests_running{engine=\"1\"} 4\n".into(),
                Ok((running(4.0), 0, 1)),
            ),
            (
                "negative counters and gauges",
                HealthFormat::Vllm,
                "vllm:prompt_tokens_total -5\nvllm:generation_tokens_total 7\nvllm:num_requests_waiting -1\n".into(),
                Ok(((None, None, None, None, None, None, Some((7.0, 1))), 0, 2)),
            ),
            (
                "a fraction above 1 is dropped; both vLLM KV names are read",
                HealthFormat::Vllm,
                "vllm:kv_cache_usage_perc 1.5\nvllm:gpu_cache_usage_perc 0.5\n".into(),
                Ok(((None, None, Some(0.5), None, None, None, None), 0, 1)),
            ),
            (
                "label escape tricks",
                HealthFormat::Vllm,
                "vllm:num_requests_running{model_name=\"x\\\"} 99 fake\",engine=\"0\"} 3\n\
                 vllm:num_requests_waiting{model_name=\"a\\nb\\\\\"} 5\n\
                 vllm:other{x=\"vllm:num_requests_running{} 100\"} 1\n\
                 vllm:num_requests_running{model_name=\"\\x\"} 50\n\
                 vllm:num_requests_running{model_name=\"unterminated} 60\n"
                    .into(),
                Ok(((Some(3.0), Some(5.0), None, None, None, None, None), 2, 0)),
            ),
            (
                "huge numbers",
                HealthFormat::Vllm,
                "vllm:num_requests_running 1e300\nvllm:num_requests_waiting 1e999\n\
                 vllm:prompt_tokens_total 1e15\nvllm:generation_tokens_total 9.99e14\n\
                 vllm:kv_cache_usage_perc 1e-320\n"
                    .into(),
                Ok(((None, None, Some(1e-320), None, None, None, Some((9.99e14, 1))), 0, 3)),
            ),
            (
                "series each believable whose sum is not",
                HealthFormat::Vllm,
                "vllm:prompt_tokens_total{engine=\"0\"} 6e14\nvllm:prompt_tokens_total{engine=\"1\"} 6e14\nvllm:num_requests_running 1\n".into(),
                Ok((running(1.0), 0, 0)),
            ),
            (
                "cache geometry not yet known, or not a number",
                HealthFormat::Vllm,
                "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n\
                 vllm:cache_config_info{block_size=\"abc\",num_gpu_blocks=\"10\"} 1\nvllm:num_requests_running 1\n"
                    .into(),
                Ok((running(1.0), 0, 0)),
            ),
            ("SGLang geometry from cache_config_info labels", HealthFormat::Auto, sglang_no_gauge, Ok((sglang_full, 0, 0))),
            ("trtllm KV use from blocks when utilization is absent", HealthFormat::Auto, trtllm_no_util, Ok((trtllm_blocks, 0, 0))),
            ("trtllm utilization written as a percentage", HealthFormat::Auto, trtllm_percent, Ok((trtllm_blocks, 0, 1))),
            (
                "TGI rendering its histograms as summaries",
                HealthFormat::Tgi,
                "# TYPE tgi_request_input_length summary\ntgi_request_input_length{quantile=\"0.5\"} 120\n\
                 tgi_request_input_length{quantile=\"0.99\"} 3000\ntgi_request_input_length_sum 51200\n\
                 tgi_request_input_length_count 300\ntgi_queue_size 0\n"
                    .into(),
                Ok(((None, Some(0.0), None, None, None, Some((51200.0, 1)), None), 0, 0)),
            ),
            (
                "OpenMetrics exemplars, timestamps and # EOF",
                HealthFormat::Auto,
                "# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine=\"0\"} 100 # {trace_id=\"a\"} 1\n\
                 vllm:num_requests_running 3 1700000000000\n# EOF\n"
                    .into(),
                Ok(((Some(3.0), None, None, None, None, Some((100.0, 1)), None), 0, 0)),
            ),
            (
                "auto-detection skips other exporters' metrics",
                HealthFormat::Auto,
                "dynamo_frontend_requests_total 5\nsglang:num_queue_reqs 2\nvllm:num_requests_running 9\n".into(),
                Ok(((None, Some(2.0), None, None, None, None, None), 0, 0)),
            ),
        ];
        for (name, format, body, want) in cases {
            let got = engine_scrape(format, &body)
                .map(|s| (fields(&s), s.skipped_lines, s.rejected_values));
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn seed_answers_and_errors_in_auto_and_seed_formats() {
        for f in [HealthFormat::Auto, HealthFormat::Seed] {
            match read(f, b" \n{\"tokens_per_sec_load\": 12, \"queue_depth\": 3}") {
                Ok(Health::Seed(r)) => {
                    assert_eq!((r.load_tokens_per_sec, r.queue_depth), (12.0, Some(3.0)))
                }
                other => panic!("{f:?}: {other:?}"),
            }
            assert_eq!(
                read(f, br#"{"load": 1}"#),
                Err(FormatError::Seed(ReportError::MissingLoad))
            );
        }
        // The seed format keeps its own errors, even for metrics text.
        assert_eq!(
            read(HealthFormat::Seed, VLLM_V1.as_bytes()),
            Err(FormatError::Seed(ReportError::NotJson))
        );
        assert_eq!(
            read(HealthFormat::Seed, b""),
            Err(FormatError::Seed(ReportError::NotJson))
        );
    }

    #[test]
    fn errors_name_the_format_problem() {
        let cases = [
            (FormatError::Empty, "/metrics"),
            (FormatError::JsonNotMetrics(Engine::Sglang), "format sglang"),
            (
                FormatError::NotMetrics { skipped_lines: 3 },
                "neither a JSON object nor Prometheus text",
            ),
            (
                FormatError::UnknownEngine { samples: 4 },
                "vllm:, sglang:, tgi_, trtllm_, llamacpp:",
            ),
            (
                FormatError::Seed(ReportError::BadLoad),
                "seed format: tokens_per_sec_load",
            ),
        ];
        for (e, needle) in cases {
            assert!(e.to_string().contains(needle), "{e}");
        }
        for f in HealthFormat::ALL {
            assert_eq!(HealthFormat::from_name(f.name()), Some(f));
        }
        assert_eq!(HealthFormat::from_name("prometheus"), None);
    }

    /// Random bytes, and the fixtures with random damage, through every format and a tracker:
    /// nothing panics, and every report that comes out is believable.
    #[test]
    fn random_answers_never_panic_and_reports_stay_sane() {
        let mut rng = SplitMix64::new(0xfeed_5eed);
        let fixtures = [VLLM_V1, VLLM_V0, SGLANG, TGI, TRTLLM, LLAMACPP];
        let alphabet = b"{}\"\\=,# \t\n\r:_-+.eE0123456789NaInf\xff";
        let mut trackers: Vec<Tracker> = HealthFormat::ALL
            .iter()
            .map(|_| Tracker::default())
            .collect();
        for round in 0..600u64 {
            let body: Vec<u8> = if round % 3 == 0 {
                let len = (rng.next_u64() % 400) as usize;
                (0..len).map(|_| rng.next_u64() as u8).collect()
            } else {
                let mut b = fixtures[(rng.next_u64() as usize) % fixtures.len()]
                    .as_bytes()
                    .to_vec();
                for _ in 0..1 + rng.next_u64() % 20 {
                    let at = (rng.next_u64() as usize) % (b.len() + 1);
                    let c = alphabet[(rng.next_u64() as usize) % alphabet.len()];
                    match rng.next_u64() % 8 {
                        0 => b.truncate(at),
                        1..=3 => b.insert(at, c),
                        _ if at < b.len() => b[at] = c,
                        _ => {}
                    }
                }
                b
            };
            for (f, tracker) in HealthFormat::ALL.into_iter().zip(trackers.iter_mut()) {
                let report = match read(f, &body) {
                    Ok(Health::Seed(r)) => r,
                    Ok(Health::Engine(s)) => tracker.observe(&s, round * 1000, Some(1000)),
                    Err(e) => {
                        assert!(!e.to_string().is_empty());
                        continue;
                    }
                };
                let ok = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v >= 0.0);
                assert!(
                    report.load_tokens_per_sec.is_finite() && report.load_tokens_per_sec >= 0.0
                );
                assert!(ok(report.capacity_tokens_per_sec) && ok(report.queue_depth));
                assert!(ok(report.running_requests) && ok(report.kv_cache_tokens));
                assert!(
                    report
                        .kv_cache_usage
                        .is_none_or(|u| (0.0..=1.0).contains(&u)),
                    "{report:?}"
                );
            }
        }
    }

    /// vLLM v1's prefix-cache counters are read, summed over data-parallel engines; engines
    /// that publish none give none.
    #[test]
    fn prefix_cache_counters() {
        let counters = |text: &str| {
            let s = scrape(None, text.as_bytes()).unwrap();
            (
                s.prefix_hits.map(|c| c.total),
                s.prefix_queries.map(|c| c.total),
            )
        };
        assert_eq!(counters(VLLM_V1), (Some(411_522.0), Some(1_235_591.0)));
        let (hits, queries) = counters(VLLM_V1_DP2);
        assert!(queries.unwrap() > 5048.0, "{queries:?}");
        assert!(hits.unwrap() <= queries.unwrap());
        assert_eq!(counters(SGLANG), (None, None));
        assert_eq!(counters(VLLM_V0).1, None);
    }
}
