//! GET /metrics in the Prometheus text format of one of six real inference engines, so that a
//! balancer that reads engines' own metrics can be tested against each of them: vLLM (v1 and
//! the older v0 names), SGLang, TGI, trtllm-serve and llama.cpp's server.
//!
//! Every flavour reports the same engine state (`Snapshot`) under that engine's metric names,
//! label sets, help texts and number style, including the quirks a parser meets in the wild:
//! - vLLM and SGLang run prometheus_client in multiprocess mode: labels come sorted (so `le`
//!   sits among them), a histogram's `_sum` comes before its buckets, values are Python floats
//!   (`3.0`, `8.128902e+06`). Counters end in `_total`.
//! - trtllm-serve uses prometheus_client in a single process: labels in declaration order,
//!   `le` last, buckets then `_count` then `_sum`.
//! - TGI uses the Rust `metrics` exporter: no labels, integer counters without `_total`
//!   (`tgi_request_count`), buckets then `_sum` then `_count`.
//! - llama.cpp prints its own flat list, no labels and no histograms (it has none; its
//!   averages are gauges).
//!
//! vLLM's page is as large as a real one (about 30 KB for one model, idle): besides the families a
//! balancer reads it carries every latency and size histogram vLLM v1 registers, its sleep
//! state, and the Python process's own metrics, which `prometheus_client` adds by default. The
//! histograms vLLM has and the mock does not observe on its own are filled from the nearest
//! one it does (prefill time from time to first token, inference time from end to end, ...):
//! right in shape and size, approximate in value.
//!
//! The engines that use `prometheus_client` (vLLM, SGLang, trtllm-serve) honour its `name[]`
//! query filter, as the real ones do (`filter_by_name`): only the samples named are rendered,
//! with the HELP and TYPE lines of their families. TGI and llama.cpp ignore queries.
//!
//! `mock:vram_overflow_events_total` (KV-overflow preemptions) is added to every flavour: real
//! engines are scraped alongside their own extras too, and the benchmark wants it.
//!
//! Latencies are wall-clock seconds (what an observer of the node measures); token counts are
//! tokens of the mock's own tokenizer.

use std::fmt::Write;

/// Which engine's /metrics to imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    Vllm,
    VllmV0,
    Sglang,
    Tgi,
    Trtllm,
    Llamacpp,
}

impl Flavour {
    pub const ALL: [Flavour; 6] = [
        Flavour::Vllm,
        Flavour::VllmV0,
        Flavour::Sglang,
        Flavour::Tgi,
        Flavour::Trtllm,
        Flavour::Llamacpp,
    ];

    pub fn parse(name: &str) -> Option<Flavour> {
        Flavour::ALL.into_iter().find(|f| f.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Flavour::Vllm => "vllm",
            Flavour::VllmV0 => "vllm-v0",
            Flavour::Sglang => "sglang",
            Flavour::Tgi => "tgi",
            Flavour::Trtllm => "trtllm",
            Flavour::Llamacpp => "llamacpp",
        }
    }
}

/// What the node observes per request, for the histograms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// Arrival to first token, s.
    Ttft,
    /// Arrival to last token, s.
    E2e,
    /// Arrival to (first) admission into the batch, s.
    Queue,
    /// Between two consecutive tokens of a request, s (one observation per interval).
    InterToken,
    /// A request's mean time per output token after the first, s (one per request).
    TimePerOutputToken,
    /// A finished request's prompt tokens.
    PromptTokens,
    /// A finished request's generated tokens.
    GenerationTokens,
}

const OBSERVED: [Observed; 7] = [
    Observed::Ttft,
    Observed::E2e,
    Observed::Queue,
    Observed::InterToken,
    Observed::TimePerOutputToken,
    Observed::PromptTokens,
    Observed::GenerationTokens,
];

/// A Prometheus histogram: per-bucket counts (the last bucket is +Inf), sum and count.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: Vec<f64>) -> Self {
        let counts = vec![0; bounds.len() + 1];
        Histogram {
            bounds,
            counts,
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().take_while(|b| v > **b).count();
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// (upper bound, cumulative count), +Inf last.
    fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut total = 0;
        self.bounds
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(&self.counts)
            .map(|(b, c)| {
                total += c;
                (b, total)
            })
            .collect()
    }
}

/// Buckets vLLM (and engines that copied it) use for time to first token, s.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// ... for whole-request times (end to end, queue), s.
const REQUEST_BUCKETS: [f64; 21] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// ... for the time between tokens, s.
const TOKEN_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// 1, 2, 5, 10, 20, 50, ... up to `max` (vLLM's token-count buckets).
fn buckets_1_2_5(max: u64) -> Vec<f64> {
    let mut out = vec![];
    let mut scale = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * scale;
            if v > max {
                break 'outer;
            }
            out.push(v as f64);
        }
        scale = match scale.checked_mul(10) {
            Some(s) => s,
            None => break,
        };
    }
    out
}

/// The node's histograms, with the buckets its flavour uses.
#[derive(Debug, Clone)]
pub struct Recorder {
    hists: Vec<(Observed, Histogram)>,
}

impl Recorder {
    /// `max_len`: the longest sequence the node takes (the top of the token-count buckets).
    pub fn new(flavour: Flavour, max_len: u64) -> Self {
        let hists = OBSERVED
            .into_iter()
            .map(|o| (o, Histogram::new(Self::bounds(flavour, o, max_len))))
            .collect();
        Recorder { hists }
    }

    fn bounds(flavour: Flavour, o: Observed, max_len: u64) -> Vec<f64> {
        if flavour == Flavour::Tgi {
            // TGI: durations on a x1.5 scale from 0.15 ms; lengths in 100 linear steps.
            return match o {
                Observed::PromptTokens | Observed::GenerationTokens => {
                    let max = max_len.max(100) as f64;
                    (1..=100)
                        .map(|i| (max / 100.0 * i as f64).round())
                        .collect()
                }
                _ => (1..=35).map(|k| 0.0001 * 1.5f64.powi(k)).collect(),
            };
        }
        match o {
            Observed::Ttft => TTFT_BUCKETS.to_vec(),
            Observed::E2e | Observed::Queue => REQUEST_BUCKETS.to_vec(),
            Observed::InterToken | Observed::TimePerOutputToken => TOKEN_BUCKETS.to_vec(),
            Observed::PromptTokens | Observed::GenerationTokens => buckets_1_2_5(max_len),
        }
    }

    pub fn observe(&mut self, o: Observed, v: f64) {
        if let Some((_, h)) = self.hists.iter_mut().find(|(k, _)| *k == o) {
            h.observe(v);
        }
    }

    pub fn get(&self, o: Observed) -> Option<&Histogram> {
        self.hists.iter().find(|(k, _)| *k == o).map(|(_, h)| h)
    }
}

/// LoRA adapters, as vLLM reports them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Loras {
    pub max_lora: usize,
    /// Adapters of running requests (each once, in order of first appearance).
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

/// The engine state every flavour reports. Counters are cumulative and only grow.
#[derive(Debug, Clone, Default)]
pub struct Snapshot<'a> {
    /// The model label (the node's first served model).
    pub model: &'a str,
    pub running: u64,
    pub waiting: u64,
    pub max_running: u64,
    pub kv_used_tokens: u64,
    pub kv_capacity_tokens: u64,
    /// kv_used / kv_capacity.
    pub kv_usage: f64,
    /// KV block size in tokens (also the prefix-cache block).
    pub block_tokens: u64,
    pub prefix_caching: bool,
    /// Prompt tokens computed (llama.cpp's, SGLang's and trtllm-serve's counter here).
    pub prompt_tokens_total: u64,
    /// Prompts counted whole once each at their first token (vLLM's counter).
    pub prompt_tokens_whole_total: u64,
    pub generation_tokens_total: u64,
    pub prefix_queries_tokens_total: u64,
    pub prefix_hits_tokens_total: u64,
    pub prefix_queries_blocks_total: u64,
    pub prefix_hits_blocks_total: u64,
    pub preemptions_total: u64,
    /// Requests received, and how the finished ones ended.
    pub requests_total: u64,
    pub finished_stop_total: u64,
    pub finished_length_total: u64,
    pub aborted_total: u64,
    /// Every running sequence's prompt + whole output.
    pub running_max_tokens: u64,
    /// Generated tokens per wall second, recent.
    pub gen_throughput: f64,
    /// Wall seconds spent on prompt and on generated tokens.
    pub prefill_seconds_total: f64,
    pub decode_seconds_total: f64,
    pub iterations_total: u64,
    pub batch_slots_total: u64,
    /// Some when the node serves adapters.
    pub loras: Option<Loras>,
    /// Seconds since the Unix epoch (vLLM's lora_requests_info value).
    pub unix_time: f64,
    pub histograms: Option<&'a Recorder>,
}

/// Test overrides of the gauges a balancer routes on, set through POST /admin/health with the
/// seed format's names (`queue_depth`, `running_requests`, `kv_cache_usage`) so one override
/// drives /health and every /metrics flavour alike. Counters are never overridden: they must
/// only grow.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GaugeOverrides {
    pub waiting: Option<u64>,
    pub running: Option<u64>,
    /// KV-cache use 0..1; it also sets the tokens in use (and TGI's batch tokens) to match.
    pub kv_usage: Option<f64>,
}

impl Snapshot<'_> {
    /// Replaces the overridden gauges.
    pub fn apply(&mut self, o: GaugeOverrides) {
        if let Some(w) = o.waiting {
            self.waiting = w;
        }
        if let Some(r) = o.running {
            self.running = r;
        }
        if let Some(u) = o.kv_usage {
            let u = if u.is_finite() {
                u.clamp(0.0, 1.0)
            } else {
                0.0
            };
            self.kv_usage = u;
            self.kv_used_tokens = (u * self.kv_capacity_tokens as f64).round() as u64;
            self.running_max_tokens = self.kv_used_tokens;
        }
    }

    fn ratio(num: u64, den: u64) -> f64 {
        if den == 0 {
            0.0
        } else {
            num as f64 / den as f64
        }
    }
    fn block(&self) -> u64 {
        self.block_tokens.max(1)
    }
    fn total_blocks(&self) -> u64 {
        self.kv_capacity_tokens / self.block()
    }
    fn used_blocks(&self) -> u64 {
        self.kv_used_tokens.div_ceil(self.block())
    }
}

/// How numbers look.
#[derive(Clone, Copy, PartialEq)]
enum Num {
    /// prometheus_client: Python float repr, exponent past 6 integer digits.
    Python,
    /// Integers as integers, other values in shortest decimal form.
    Plain,
}

/// Where `le` goes and in which order a histogram's series come.
#[derive(Clone, Copy, PartialEq)]
enum Hist {
    /// Multiprocess prometheus_client: labels sorted, `_sum`, buckets, `_count`.
    SortedSumFirst,
    /// Single-process prometheus_client: `le` last; buckets, `_count`, `_sum`.
    LeLastCountThenSum,
    /// The Rust metrics exporter: buckets, `_sum`, `_count`.
    SumThenCount,
}

struct Out {
    text: String,
    num: Num,
    hist: Hist,
}

type Labels<'a> = Vec<(&'a str, String)>;

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn python_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    let repr = if v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    };
    // prometheus_client writes what Go would: 8128902.0 -> 8.128902e+06.
    match repr.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!(
                "{}.{}{}",
                repr.get(..1).unwrap_or_default(),
                repr.get(1..dot).unwrap_or_default(),
                repr.get(dot + 1..).unwrap_or_default()
            );
            let mantissa = digits.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => repr,
    }
}

fn plain(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    format!("{v}")
}

impl Out {
    fn new(num: Num, hist: Hist) -> Out {
        Out {
            text: String::new(),
            num,
            hist,
        }
    }

    fn value(&self, v: f64) -> String {
        match self.num {
            Num::Python => python_float(v),
            Num::Plain => plain(v),
        }
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = write!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
    }

    fn line(&mut self, name: &str, labels: &[(&str, String)], value: &str) {
        self.text.push_str(name);
        if !labels.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{}\"", escape(v));
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// A gauge or counter family with one series.
    fn one(&mut self, name: &str, kind: &str, help: &str, labels: &Labels, v: f64) {
        self.header(name, kind, help);
        let v = self.value(v);
        self.line(name, labels, &v);
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &Labels, v: f64) {
        self.one(name, "gauge", help, labels, v);
    }

    fn counter(&mut self, name: &str, help: &str, labels: &Labels, v: u64) {
        self.one(name, "counter", help, labels, v as f64);
    }

    fn histogram(&mut self, name: &str, help: &str, labels: &Labels, h: Option<&Histogram>) {
        let Some(h) = h else { return };
        self.header(name, "histogram", help);
        let mut sorted = labels.clone();
        if self.hist == Hist::SortedSumFirst {
            sorted.sort_by(|a, b| a.0.cmp(b.0));
        }
        let bucket_labels = |le: f64, out: &Out| {
            let le = match out.num {
                Num::Python => python_float(le),
                Num::Plain => plain(le),
            };
            let mut l = sorted.clone();
            l.push(("le", le));
            if out.hist == Hist::SortedSumFirst {
                l.sort_by(|a, b| a.0.cmp(b.0));
            }
            l
        };
        let sum = self.value(h.sum);
        let count = self.value(h.count as f64);
        let (sum_name, count_name, bucket_name) = (
            format!("{name}_sum"),
            format!("{name}_count"),
            format!("{name}_bucket"),
        );
        if self.hist == Hist::SortedSumFirst {
            self.line(&sum_name, &sorted, &sum);
        }
        for (le, n) in h.cumulative() {
            let l = bucket_labels(le, self);
            let n = self.value(n as f64);
            self.line(&bucket_name, &l, &n);
        }
        match self.hist {
            Hist::SortedSumFirst => self.line(&count_name, &sorted, &count),
            Hist::LeLastCountThenSum => {
                self.line(&count_name, &sorted, &count);
                self.line(&sum_name, &sorted, &sum);
            }
            Hist::SumThenCount => {
                self.line(&sum_name, &sorted, &sum);
                self.line(&count_name, &sorted, &count);
            }
        }
    }

    fn overflow(&mut self, labels: &Labels, s: &Snapshot) {
        self.counter(
            "mock:vram_overflow_events_total",
            "Sequences preempted because the KV cache overflowed (mock-gpu-node).",
            labels,
            s.preemptions_total,
        );
    }
}

/// The /metrics body of `flavour` for `s`.
pub fn render(flavour: Flavour, s: &Snapshot) -> String {
    match flavour {
        Flavour::Vllm => vllm(s, true),
        Flavour::VllmV0 => vllm(s, false),
        Flavour::Sglang => sglang(s),
        Flavour::Tgi => tgi(s),
        Flavour::Trtllm => trtllm(s),
        Flavour::Llamacpp => llamacpp(s),
    }
}

fn hist<'a>(s: &Snapshot<'a>, o: Observed) -> Option<&'a Histogram> {
    s.histograms.and_then(|r| r.get(o))
}

fn python_bool(b: bool) -> String {
    if b { "True" } else { "False" }.into()
}

/// The metrics `prometheus_client`'s default registry adds to every Python server: garbage
/// collector, interpreter and process. Values are plausible constants and the node's age.
fn python_process(o: &mut Out, s: &Snapshot) {
    for (name, help, per_gen) in [
        (
            "python_gc_objects_collected_total",
            "Objects collected during gc",
            [41287.0, 7764.0, 1093.0],
        ),
        (
            "python_gc_objects_uncollectable_total",
            "Uncollectable objects found during GC",
            [0.0; 3],
        ),
        (
            "python_gc_collections_total",
            "Number of times this generation was collected",
            [1632.0, 148.0, 9.0],
        ),
    ] {
        o.header(name, "counter", help);
        for (g, v) in per_gen.iter().enumerate() {
            let v = o.value(*v);
            o.line(name, &[("generation", g.to_string())], &v);
        }
    }
    let info: Labels = vec![
        ("implementation", "CPython".into()),
        ("major", "3".into()),
        ("minor", "12".into()),
        ("patchlevel", "9".into()),
        ("version", "3.12.9".into()),
    ];
    o.gauge("python_info", "Python platform information", &info, 1.0);
    let none: Labels = vec![];
    for (name, kind, help, v) in [
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            39872561152.0,
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            2186342400.0,
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            s.unix_time.floor() - 3600.0,
        ),
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            9321.67,
        ),
        (
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            93.0,
        ),
        (
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            1048576.0,
        ),
    ] {
        o.one(name, kind, help, &none, v);
    }
}

/// A histogram of `bounds` with `n` observations of `v` each (for a family whose values the
/// mock does not observe, such as vLLM's `n` request parameter).
fn constant_histogram(bounds: Vec<f64>, v: f64, n: u64) -> Histogram {
    let mut h = Histogram::new(bounds);
    let i = h.bounds.iter().take_while(|b| v > **b).count();
    if let Some(c) = h.counts.get_mut(i) {
        *c = n;
    }
    h.sum = v * n as f64;
    h.count = n;
    h
}

/// Only the samples whose names are in `names`, with the HELP and TYPE lines of their
/// families: what `prometheus_client` serves for `?name[]=a&name[]=b` (it filters on sample
/// names, so a histogram is asked for by `x_bucket`, `x_sum`, `x_count`, a counter by
/// `x_total`). Nothing named is an empty page.
pub fn filter_by_name(text: &str, names: &[String]) -> String {
    let mut out = String::new();
    let mut headers: Vec<&str> = Vec::new();
    let mut family_shown = false;
    for line in text.lines() {
        if line.starts_with('#') {
            if family_shown || headers.len() >= 2 {
                headers.clear();
                family_shown = false;
            }
            headers.push(line);
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if names.iter().any(|n| n == name) {
            if !family_shown {
                for h in headers.drain(..) {
                    out.push_str(h);
                    out.push('\n');
                }
                family_shown = true;
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn vllm(s: &Snapshot, v1: bool) -> String {
    let mut o = Out::new(Num::Python, Hist::SortedSumFirst);
    python_process(&mut o, s);
    let mut l: Labels = vec![("model_name", s.model.to_string())];
    if v1 {
        l.insert(0, ("engine", "0".into()));
    }
    let with = |extra: (&'static str, &str)| {
        let mut x = l.clone();
        x.push((extra.0, extra.1.to_string()));
        x.sort_by(|a, b| a.0.cmp(b.0));
        x
    };
    if v1 {
        o.gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            &l,
            s.running as f64,
        );
        o.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &l,
            s.waiting as f64,
        );
        o.header(
            "vllm:engine_sleep_state",
            "gauge",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        );
        for (state, v) in [
            ("awake", 1.0),
            ("weights_offloaded", 0.0),
            ("discard_all", 0.0),
        ] {
            let v = o.value(v);
            o.line("vllm:engine_sleep_state", &with(("sleep_state", state)), &v);
        }
        o.gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            &l,
            s.kv_usage,
        );
        o.counter(
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            &l,
            s.prefix_queries_tokens_total,
        );
        o.counter(
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            &l,
            s.prefix_hits_tokens_total,
        );
    } else {
        o.gauge(
            "vllm:num_requests_running",
            "Number of requests currently running on GPU.",
            &l,
            s.running as f64,
        );
        o.gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            &l,
            s.waiting as f64,
        );
        o.gauge(
            "vllm:num_requests_swapped",
            "Number of requests swapped to CPU.",
            &l,
            0.0,
        );
        o.gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            &l,
            s.kv_usage,
        );
        o.gauge(
            "vllm:cpu_cache_usage_perc",
            "CPU KV-cache usage. 1 means 100 percent usage.",
            &l,
            0.0,
        );
        o.gauge(
            "vllm:gpu_prefix_cache_hit_rate",
            "GPU prefix cache block hit rate.",
            &l,
            Snapshot::ratio(s.prefix_hits_blocks_total, s.prefix_queries_blocks_total),
        );
    }
    o.counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        &l,
        s.preemptions_total,
    );
    o.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        &l,
        s.prompt_tokens_whole_total,
    );
    o.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        &l,
        s.generation_tokens_total,
    );
    o.header(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, n) in [
        ("abort", s.aborted_total),
        ("length", s.finished_length_total),
        ("stop", s.finished_stop_total),
    ] {
        let v = o.value(n as f64);
        o.line(
            "vllm:request_success_total",
            &with(("finished_reason", reason)),
            &v,
        );
    }
    o.histogram(
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        &l,
        hist(s, Observed::PromptTokens),
    );
    o.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        &l,
        hist(s, Observed::GenerationTokens),
    );
    if v1 {
        // Families the mock does not observe, filled from the nearest it does.
        o.histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &l,
            hist(s, Observed::PromptTokens),
        );
        o.histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &l,
            hist(s, Observed::GenerationTokens),
        );
        let finished = s.finished_stop_total + s.finished_length_total;
        let n = constant_histogram(vec![1.0, 2.0, 5.0, 10.0, 20.0], 1.0, finished);
        o.histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            &l,
            Some(&n),
        );
        o.histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &l,
            hist(s, Observed::GenerationTokens),
        );
    }
    o.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
        hist(s, Observed::Ttft),
    );
    if v1 {
        o.histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &l,
            hist(s, Observed::InterToken),
        );
    } else {
        o.histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            &l,
            hist(s, Observed::InterToken),
        );
    }
    o.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &l,
        hist(s, Observed::E2e),
    );
    o.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &l,
        hist(s, Observed::Queue),
    );
    if v1 {
        for (name, help, from) in [
            (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
                Observed::E2e,
            ),
            (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                Observed::Ttft,
            ),
            (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                Observed::E2e,
            ),
        ] {
            o.histogram(name, help, &l, hist(s, from));
        }
    }
    // An Info-style gauge: the value is 1, the facts are labels.
    let mut cache: Labels = vec![
        ("block_size", s.block().to_string()),
        ("cache_dtype", "auto".into()),
        ("enable_prefix_caching", python_bool(s.prefix_caching)),
        ("gpu_memory_utilization", "0.9".into()),
        ("num_cpu_blocks", "0".into()),
        ("num_gpu_blocks", s.total_blocks().to_string()),
    ];
    if v1 {
        cache.push(("engine", "0".into()));
        cache.sort_by(|a, b| a.0.cmp(b.0));
    }
    o.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &cache,
        1.0,
    );
    if let Some(lora) = &s.loras {
        // vLLM's value is the time of the report; the adapters are comma-separated labels.
        o.gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            &vec![
                ("max_lora", lora.max_lora.to_string()),
                ("running_lora_adapters", lora.running.join(",")),
                ("waiting_lora_adapters", lora.waiting.join(",")),
            ],
            s.unix_time,
        );
    }
    o.overflow(&l, s);
    o.text
}

fn sglang(s: &Snapshot) -> String {
    let mut o = Out::new(Num::Python, Hist::SortedSumFirst);
    let l: Labels = vec![
        ("engine_type", "unified".into()),
        ("model_name", s.model.to_string()),
        ("pp_rank", "0".into()),
        ("tp_rank", "0".into()),
    ];
    o.gauge(
        "sglang:num_running_reqs",
        "The number of running requests.",
        &l,
        s.running as f64,
    );
    o.gauge(
        "sglang:num_used_tokens",
        "The number of used tokens.",
        &l,
        s.kv_used_tokens as f64,
    );
    o.gauge("sglang:token_usage", "The token usage.", &l, s.kv_usage);
    o.gauge(
        "sglang:gen_throughput",
        "The generation throughput (token/s).",
        &l,
        s.gen_throughput,
    );
    o.gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        &l,
        s.waiting as f64,
    );
    o.gauge(
        "sglang:cache_hit_rate",
        "The prefix cache hit rate.",
        &l,
        Snapshot::ratio(s.prefix_hits_tokens_total, s.prefix_queries_tokens_total),
    );
    o.gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        &l,
        s.kv_capacity_tokens as f64,
    );
    o.counter(
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        &l,
        s.prompt_tokens_total,
    );
    o.counter(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        &l,
        s.generation_tokens_total,
    );
    o.counter(
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens.",
        &l,
        s.prefix_hits_tokens_total,
    );
    o.counter(
        "sglang:num_requests_total",
        "Number of requests processed.",
        &l,
        s.finished_stop_total + s.finished_length_total + s.aborted_total,
    );
    o.counter(
        "sglang:num_aborted_requests_total",
        "Number of requests aborted.",
        &l,
        s.aborted_total,
    );
    o.histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
        hist(s, Observed::Ttft),
    );
    o.histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &l,
        hist(s, Observed::InterToken),
    );
    o.histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        &l,
        hist(s, Observed::E2e),
    );
    o.histogram(
        "sglang:queue_time_seconds",
        "Histogram of queueing time in seconds.",
        &l,
        hist(s, Observed::Queue),
    );
    o.overflow(&l, s);
    o.text
}

fn tgi(s: &Snapshot) -> String {
    let mut o = Out::new(Num::Plain, Hist::SumThenCount);
    let l: Labels = vec![];
    o.counter(
        "tgi_request_count",
        "Number of requests received",
        &l,
        s.requests_total,
    );
    o.counter(
        "tgi_request_success",
        "Number of successful requests",
        &l,
        s.finished_stop_total + s.finished_length_total,
    );
    o.gauge("tgi_queue_size", "Current queue size", &l, s.waiting as f64);
    o.gauge(
        "tgi_batch_current_size",
        "Current batch size",
        &l,
        s.running as f64,
    );
    o.gauge(
        "tgi_batch_current_max_tokens",
        "Maximum tokens for the current batch",
        &l,
        s.running_max_tokens as f64,
    );
    o.histogram(
        "tgi_request_input_length",
        "Input token length per request",
        &l,
        hist(s, Observed::PromptTokens),
    );
    o.histogram(
        "tgi_request_generated_tokens",
        "Generated tokens per request",
        &l,
        hist(s, Observed::GenerationTokens),
    );
    o.histogram(
        "tgi_request_duration",
        "Request duration",
        &l,
        hist(s, Observed::E2e),
    );
    o.histogram(
        "tgi_request_queue_duration",
        "Time spent in the queue per request",
        &l,
        hist(s, Observed::Queue),
    );
    o.histogram(
        "tgi_request_mean_time_per_token_duration",
        "Mean time per token per request",
        &l,
        hist(s, Observed::TimePerOutputToken),
    );
    o.overflow(&l, s);
    o.text
}

fn trtllm(s: &Snapshot) -> String {
    let mut o = Out::new(Num::Python, Hist::LeLastCountThenSum);
    let l: Labels = vec![
        ("model_name", s.model.to_string()),
        ("engine_type", "trtllm".into()),
    ];
    let max_blocks = s.total_blocks();
    let used_blocks = s.used_blocks().min(max_blocks);
    o.gauge(
        "trtllm_num_requests_running",
        "Number of active requests",
        &l,
        s.running as f64,
    );
    o.gauge(
        "trtllm_num_requests_waiting",
        "Number of queued requests",
        &l,
        s.waiting as f64,
    );
    o.gauge(
        "trtllm_kv_cache_utilization",
        "KV cache utilization",
        &l,
        s.kv_usage,
    );
    o.gauge(
        "trtllm_kv_cache_hit_rate",
        "KV cache hit rate",
        &l,
        Snapshot::ratio(s.prefix_hits_blocks_total, s.prefix_queries_blocks_total),
    );
    o.gauge(
        "trtllm_kv_cache_max_blocks",
        "Maximum number of KV cache blocks",
        &l,
        max_blocks as f64,
    );
    o.gauge(
        "trtllm_kv_cache_free_blocks",
        "Number of free KV cache blocks",
        &l,
        (max_blocks - used_blocks) as f64,
    );
    o.gauge(
        "trtllm_kv_cache_used_blocks",
        "Number of used KV cache blocks",
        &l,
        used_blocks as f64,
    );
    o.gauge(
        "trtllm_kv_cache_tokens_per_block",
        "Number of tokens per KV cache block",
        &l,
        s.block() as f64,
    );
    o.counter(
        "trtllm_kv_cache_reused_blocks_total",
        "Cumulative number of KV cache blocks reused (cache hits)",
        &l,
        s.prefix_hits_blocks_total,
    );
    o.counter(
        "trtllm_kv_cache_missed_blocks_total",
        "Cumulative number of KV cache blocks missed (cache misses)",
        &l,
        s.prefix_queries_blocks_total
            .saturating_sub(s.prefix_hits_blocks_total),
    );
    o.counter(
        "trtllm_prompt_tokens_total",
        "Cumulative number of prompt (input) tokens processed.",
        &l,
        s.prompt_tokens_total,
    );
    o.counter(
        "trtllm_generation_tokens_total",
        "Cumulative number of generation (output) tokens produced.",
        &l,
        s.generation_tokens_total,
    );
    o.header(
        "trtllm_request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, n) in [
        ("stop", s.finished_stop_total),
        ("length", s.finished_length_total),
    ] {
        let mut x = l.clone();
        x.push(("finished_reason", reason.into()));
        let v = o.value(n as f64);
        o.line("trtllm_request_success_total", &x, &v);
    }
    o.histogram(
        "trtllm_time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
        hist(s, Observed::Ttft),
    );
    o.histogram(
        "trtllm_e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        &l,
        hist(s, Observed::E2e),
    );
    o.histogram(
        "trtllm_time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        &l,
        hist(s, Observed::TimePerOutputToken),
    );
    o.histogram(
        "trtllm_request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &l,
        hist(s, Observed::Queue),
    );
    o.overflow(&l, s);
    o.text
}

fn llamacpp(s: &Snapshot) -> String {
    let mut o = Out::new(Num::Plain, Hist::SumThenCount);
    let l: Labels = vec![];
    let per_sec = |tokens: u64, secs: f64| {
        if secs > 0.0 {
            tokens as f64 / secs
        } else {
            0.0
        }
    };
    o.counter(
        "llamacpp:prompt_tokens_total",
        "Number of prompt tokens processed.",
        &l,
        s.prompt_tokens_total,
    );
    o.one(
        "llamacpp:prompt_seconds_total",
        "counter",
        "Prompt process time",
        &l,
        s.prefill_seconds_total,
    );
    o.counter(
        "llamacpp:tokens_predicted_total",
        "Number of generation tokens processed.",
        &l,
        s.generation_tokens_total,
    );
    o.one(
        "llamacpp:tokens_predicted_seconds_total",
        "counter",
        "Predict process time",
        &l,
        s.decode_seconds_total,
    );
    o.counter(
        "llamacpp:n_decode_total",
        "Total number of llama_decode() calls",
        &l,
        s.iterations_total,
    );
    o.one(
        "llamacpp:n_busy_slots_per_decode",
        "counter",
        "Average number of busy slots per llama_decode() call",
        &l,
        Snapshot::ratio(s.batch_slots_total, s.iterations_total),
    );
    o.gauge(
        "llamacpp:prompt_tokens_seconds",
        "Average prompt throughput in tokens/s.",
        &l,
        per_sec(s.prompt_tokens_total, s.prefill_seconds_total),
    );
    o.gauge(
        "llamacpp:predicted_tokens_seconds",
        "Average generation throughput in tokens/s.",
        &l,
        per_sec(s.generation_tokens_total, s.decode_seconds_total),
    );
    o.gauge(
        "llamacpp:kv_cache_usage_ratio",
        "KV-cache usage. 1 means 100 percent usage.",
        &l,
        s.kv_usage,
    );
    o.gauge(
        "llamacpp:kv_cache_tokens",
        "KV-cache tokens.",
        &l,
        s.kv_used_tokens as f64,
    );
    o.gauge(
        "llamacpp:requests_processing",
        "Number of requests processing.",
        &l,
        s.running as f64,
    );
    o.gauge(
        "llamacpp:requests_deferred",
        "Number of requests deferred.",
        &l,
        s.waiting as f64,
    );
    o.overflow(&l, s);
    o.text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// One parsed sample: name, labels in order, value.
    #[derive(Debug, Clone)]
    struct Sample {
        name: String,
        labels: Vec<(String, String)>,
        value: f64,
    }

    fn parse_value(v: &str) -> Result<f64, String> {
        match v {
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => v.parse().map_err(|_| format!("bad value {v:?}")),
        }
    }

    fn valid_name(n: &str) -> bool {
        let mut cs = n.chars();
        cs.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    /// `name{k="v",...} value`, with the text format's escapes in label values.
    fn parse_sample(line: &str) -> Result<Sample, String> {
        let end = line.find(['{', ' ']).ok_or("no value")?;
        let name = &line[..end];
        if !valid_name(name) {
            return Err(format!("bad name {name:?}"));
        }
        let mut rest = &line[end..];
        let mut labels = vec![];
        if let Some(r) = rest.strip_prefix('{') {
            let mut chars = r.char_indices().peekable();
            loop {
                let (i, c) = chars.next().ok_or("unterminated labels")?;
                if c == '}' {
                    rest = &r[i + 1..];
                    break;
                }
                if c == ',' {
                    continue;
                }
                let eq = r[i..].find("=\"").ok_or("label without =\"")? + i;
                let key = &r[i..eq];
                if !valid_name(key) || key.contains(':') {
                    return Err(format!("bad label name {key:?}"));
                }
                while chars.peek().is_some_and(|(j, _)| *j <= eq + 1) {
                    chars.next();
                }
                let mut value = String::new();
                loop {
                    match chars.next().ok_or("unterminated label value")?.1 {
                        '"' => break,
                        '\\' => match chars.next().ok_or("dangling escape")?.1 {
                            'n' => value.push('\n'),
                            c @ ('\\' | '"') => value.push(c),
                            c => return Err(format!("bad escape \\{c}")),
                        },
                        '\n' => return Err("newline in a label value".into()),
                        c => value.push(c),
                    }
                }
                labels.push((key.to_string(), value));
            }
        }
        let value = rest.strip_prefix(' ').ok_or("no space before the value")?;
        if value.contains(' ') {
            return Err("a timestamp or junk after the value".into());
        }
        Ok(Sample {
            name: name.to_string(),
            labels,
            value: parse_value(value)?,
        })
    }

    /// Checks `text` line by line as Prometheus text exposition (0.0.4) and returns its
    /// samples. Every sample belongs to a family whose HELP and TYPE came before it; a
    /// histogram's buckets are cumulative and its +Inf bucket is its count.
    fn parse(text: &str) -> Result<Vec<Sample>, String> {
        let mut types: HashMap<String, String> = HashMap::new();
        let mut helped: Vec<String> = vec![];
        let mut samples = vec![];
        assert!(text.ends_with('\n'), "the last line ends with a newline");
        for (n, line) in text.lines().enumerate() {
            let err = |e: String| format!("line {}: {e}: {line:?}", n + 1);
            if let Some(c) = line.strip_prefix("# ") {
                let mut parts = c.splitn(3, ' ');
                let (kw, name, rest) = (parts.next(), parts.next(), parts.next());
                let name = name
                    .filter(|n| valid_name(n))
                    .ok_or_else(|| err("bad name".into()))?;
                match kw {
                    Some("HELP") => helped.push(name.to_string()),
                    Some("TYPE") => {
                        let kind = rest.unwrap_or_default();
                        if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind)
                        {
                            return Err(err(format!("bad type {kind:?}")));
                        }
                        if !helped.iter().any(|h| h == name) {
                            return Err(err("TYPE without HELP".into()));
                        }
                        if types.insert(name.to_string(), kind.to_string()).is_some() {
                            return Err(err("family declared twice".into()));
                        }
                    }
                    _ => return Err(err("unknown comment".into())),
                }
                continue;
            }
            if line.is_empty() {
                return Err(err("empty line".into()));
            }
            let s = parse_sample(line).map_err(err)?;
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    s.name
                        .strip_suffix(suffix)
                        .filter(|f| types.get(*f).is_some_and(|t| t == "histogram"))
                })
                .unwrap_or(&s.name);
            let kind = types
                .get(family)
                .ok_or_else(|| err("no TYPE before".into()))?;
            if kind == "histogram" && family == s.name {
                return Err(err("a histogram sample without a suffix".into()));
            }
            if kind == "counter" && (s.value.is_nan() || s.value < 0.0) {
                return Err(err("negative counter".into()));
            }
            samples.push(s);
        }
        // Histograms: cumulative buckets, +Inf = count, per label set.
        for (family, kind) in &types {
            if kind != "histogram" {
                continue;
            }
            let bucket = format!("{family}_bucket");
            let buckets: Vec<&Sample> = samples.iter().filter(|s| s.name == bucket).collect();
            if buckets.is_empty() {
                return Err(format!("{family}: no buckets"));
            }
            let mut last = 0.0;
            for b in &buckets {
                if b.value < last {
                    return Err(format!("{family}: buckets not cumulative"));
                }
                last = b.value;
            }
            let inf = buckets.iter().find(|b| label(b, "le") == Some("+Inf"));
            let count = samples.iter().find(|s| s.name == format!("{family}_count"));
            match (inf, count) {
                (Some(i), Some(c)) if i.value == c.value => {}
                _ => return Err(format!("{family}: +Inf bucket is not the count")),
            }
            if !samples.iter().any(|s| s.name == format!("{family}_sum")) {
                return Err(format!("{family}: no _sum"));
            }
        }
        Ok(samples)
    }

    fn label<'a>(s: &'a Sample, k: &str) -> Option<&'a str> {
        s.labels
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }

    fn recorder(f: Flavour) -> Recorder {
        let mut r = Recorder::new(f, 4096);
        for (o, v) in [
            (Observed::Ttft, 0.05),
            (Observed::Ttft, 0.3),
            (Observed::Ttft, 9000.0), // past the last bucket
            (Observed::E2e, 2.0),
            (Observed::Queue, 0.01),
            (Observed::InterToken, 0.02),
            (Observed::TimePerOutputToken, 0.02),
            (Observed::PromptTokens, 1200.0),
            (Observed::GenerationTokens, 200.0),
        ] {
            r.observe(o, v);
        }
        r
    }

    fn snapshot(r: &Recorder) -> Snapshot<'_> {
        Snapshot {
            model: "meta/llama \"7b\"",
            running: 3,
            waiting: 2,
            max_running: 256,
            kv_used_tokens: 32_500,
            kv_capacity_tokens: 130_000,
            kv_usage: 0.25,
            block_tokens: 16,
            prefix_caching: true,
            prompt_tokens_total: 8_128_902,
            prompt_tokens_whole_total: 8_128_902,
            generation_tokens_total: 4567,
            prefix_queries_tokens_total: 10_000,
            prefix_hits_tokens_total: 6400,
            prefix_queries_blocks_total: 600,
            prefix_hits_blocks_total: 400,
            preemptions_total: 1,
            requests_total: 20,
            finished_stop_total: 10,
            finished_length_total: 5,
            aborted_total: 1,
            running_max_tokens: 9000,
            gen_throughput: 812.5,
            prefill_seconds_total: 2.0,
            decode_seconds_total: 4.0,
            iterations_total: 100,
            batch_slots_total: 250,
            loras: Some(Loras {
                max_lora: 2,
                running: vec!["sql".into(), "chat".into()],
                waiting: vec![],
            }),
            unix_time: 1_700_000_000.5,
            histograms: Some(r),
        }
    }

    /// The value of the series `name` whose labels include `with`.
    fn value(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> Option<f64> {
        samples
            .iter()
            .find(|s| s.name == name && with.iter().all(|(k, v)| label(s, k) == Some(*v)))
            .map(|s| s.value)
    }

    #[test]
    fn every_flavour_is_valid_text_with_its_key_series() {
        let m = "meta/llama \"7b\"";
        // (flavour, [(series, labels it must carry, value)])
        type Want<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);
        let table: Vec<(Flavour, Vec<Want>)> = vec![
            (
                Flavour::Vllm,
                vec![
                    (
                        "vllm:num_requests_running",
                        vec![("model_name", m), ("engine", "0")],
                        3.0,
                    ),
                    ("vllm:num_requests_waiting", vec![], 2.0),
                    ("vllm:kv_cache_usage_perc", vec![], 0.25),
                    ("vllm:prompt_tokens_total", vec![], 8_128_902.0),
                    ("vllm:generation_tokens_total", vec![], 4567.0),
                    ("vllm:prefix_cache_queries_total", vec![], 10_000.0),
                    ("vllm:prefix_cache_hits_total", vec![], 6400.0),
                    ("vllm:num_preemptions_total", vec![], 1.0),
                    (
                        "vllm:request_success_total",
                        vec![("finished_reason", "length")],
                        5.0,
                    ),
                    (
                        "vllm:cache_config_info",
                        vec![("block_size", "16"), ("num_gpu_blocks", "8125")],
                        1.0,
                    ),
                    (
                        "vllm:lora_requests_info",
                        vec![
                            ("running_lora_adapters", "sql,chat"),
                            ("waiting_lora_adapters", ""),
                            ("max_lora", "2"),
                        ],
                        1_700_000_000.5,
                    ),
                    ("vllm:time_to_first_token_seconds_count", vec![], 3.0),
                    (
                        "vllm:time_to_first_token_seconds_bucket",
                        vec![("le", "0.1")],
                        1.0,
                    ),
                    (
                        "vllm:time_to_first_token_seconds_bucket",
                        vec![("le", "2560.0")],
                        2.0,
                    ),
                    (
                        "vllm:time_to_first_token_seconds_bucket",
                        vec![("le", "+Inf")],
                        3.0,
                    ),
                    (
                        "vllm:request_prompt_tokens_bucket",
                        vec![("le", "2000.0")],
                        1.0,
                    ),
                    ("vllm:inter_token_latency_seconds_sum", vec![], 0.02),
                    ("mock:vram_overflow_events_total", vec![], 1.0),
                ],
            ),
            (
                Flavour::VllmV0,
                vec![
                    ("vllm:gpu_cache_usage_perc", vec![("model_name", m)], 0.25),
                    ("vllm:num_requests_running", vec![], 3.0),
                    ("vllm:num_requests_waiting", vec![], 2.0),
                    ("vllm:num_requests_swapped", vec![], 0.0),
                    ("vllm:gpu_prefix_cache_hit_rate", vec![], 400.0 / 600.0),
                    ("vllm:prompt_tokens_total", vec![], 8_128_902.0),
                    ("vllm:generation_tokens_total", vec![], 4567.0),
                    (
                        "vllm:cache_config_info",
                        vec![("enable_prefix_caching", "True")],
                        1.0,
                    ),
                    ("vllm:time_per_output_token_seconds_count", vec![], 1.0),
                    ("vllm:e2e_request_latency_seconds_sum", vec![], 2.0),
                ],
            ),
            (
                Flavour::Sglang,
                vec![
                    (
                        "sglang:num_running_reqs",
                        vec![("model_name", m), ("tp_rank", "0")],
                        3.0,
                    ),
                    ("sglang:num_queue_reqs", vec![], 2.0),
                    ("sglang:token_usage", vec![], 0.25),
                    ("sglang:num_used_tokens", vec![], 32_500.0),
                    ("sglang:max_total_num_tokens", vec![], 130_000.0),
                    ("sglang:prompt_tokens_total", vec![], 8_128_902.0),
                    ("sglang:generation_tokens_total", vec![], 4567.0),
                    ("sglang:gen_throughput", vec![], 812.5),
                    ("sglang:cache_hit_rate", vec![], 0.64),
                    ("sglang:cached_tokens_total", vec![], 6400.0),
                    ("sglang:time_to_first_token_seconds_count", vec![], 3.0),
                ],
            ),
            (
                Flavour::Tgi,
                vec![
                    ("tgi_batch_current_size", vec![], 3.0),
                    ("tgi_queue_size", vec![], 2.0),
                    ("tgi_batch_current_max_tokens", vec![], 9000.0),
                    ("tgi_request_count", vec![], 20.0),
                    ("tgi_request_success", vec![], 15.0),
                    ("tgi_request_input_length_count", vec![], 1.0),
                    ("tgi_request_input_length_sum", vec![], 1200.0),
                    ("tgi_request_input_length_bucket", vec![("le", "1229")], 1.0),
                    ("tgi_request_input_length_bucket", vec![("le", "1024")], 0.0),
                    ("tgi_request_generated_tokens_count", vec![], 1.0),
                    ("tgi_request_duration_count", vec![], 1.0),
                ],
            ),
            (
                Flavour::Trtllm,
                vec![
                    (
                        "trtllm_num_requests_running",
                        vec![("model_name", m), ("engine_type", "trtllm")],
                        3.0,
                    ),
                    ("trtllm_num_requests_waiting", vec![], 2.0),
                    ("trtllm_kv_cache_utilization", vec![], 0.25),
                    ("trtllm_kv_cache_tokens_per_block", vec![], 16.0),
                    ("trtllm_kv_cache_max_blocks", vec![], 8125.0),
                    ("trtllm_kv_cache_used_blocks", vec![], 2032.0),
                    ("trtllm_kv_cache_free_blocks", vec![], 8125.0 - 2032.0),
                    ("trtllm_kv_cache_reused_blocks_total", vec![], 400.0),
                    ("trtllm_kv_cache_missed_blocks_total", vec![], 200.0),
                    ("trtllm_prompt_tokens_total", vec![], 8_128_902.0),
                    (
                        "trtllm_request_success_total",
                        vec![("finished_reason", "stop")],
                        10.0,
                    ),
                    ("trtllm_time_to_first_token_seconds_count", vec![], 3.0),
                ],
            ),
            (
                Flavour::Llamacpp,
                vec![
                    ("llamacpp:prompt_tokens_total", vec![], 8_128_902.0),
                    ("llamacpp:tokens_predicted_total", vec![], 4567.0),
                    ("llamacpp:prompt_tokens_seconds", vec![], 8_128_902.0 / 2.0),
                    ("llamacpp:predicted_tokens_seconds", vec![], 4567.0 / 4.0),
                    ("llamacpp:kv_cache_usage_ratio", vec![], 0.25),
                    ("llamacpp:kv_cache_tokens", vec![], 32_500.0),
                    ("llamacpp:requests_processing", vec![], 3.0),
                    ("llamacpp:requests_deferred", vec![], 2.0),
                    ("llamacpp:n_busy_slots_per_decode", vec![], 2.5),
                ],
            ),
        ];
        for (flavour, want) in table {
            let r = recorder(flavour);
            let text = render(flavour, &snapshot(&r));
            let samples = parse(&text).unwrap_or_else(|e| panic!("{flavour:?}: {e}\n{text}"));
            for (name, labels, v) in want {
                let got = value(&samples, name, &labels)
                    .unwrap_or_else(|| panic!("{flavour:?}: no {name} {labels:?}\n{text}"));
                assert!((got - v).abs() < 1e-9, "{flavour:?} {name}: {got} != {v}");
            }
            // Every flavour but llama.cpp (which has none) has histograms.
            assert_eq!(
                text.contains(" histogram\n"),
                flavour != Flavour::Llamacpp,
                "{flavour:?}"
            );
        }
    }

    /// vLLM's page is as large as the real one's, and `name[]` keeps exactly the samples
    /// named, with their families' HELP and TYPE lines, and nothing of the others.
    #[test]
    fn vllm_page_size_and_the_name_filter() {
        let r = recorder(Flavour::Vllm);
        let page = render(Flavour::Vllm, &snapshot(&r));
        assert!(page.len() > 25_000, "{}", page.len());
        let families = page.lines().filter(|l| l.starts_with("# TYPE")).count();
        assert!(families >= 30, "{families}");
        let names: Vec<String> = [
            "vllm:num_requests_running",
            "vllm:prompt_tokens_total",
            "vllm:e2e_request_latency_seconds_count",
            "absent",
        ]
        .map(String::from)
        .to_vec();
        let small = filter_by_name(&page, &names);
        let kept: Vec<&str> = small
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap())
            .collect();
        assert_eq!(
            kept,
            [
                "vllm:num_requests_running",
                "vllm:prompt_tokens_total",
                "vllm:e2e_request_latency_seconds_count"
            ]
        );
        for family in [
            "vllm:num_requests_running gauge",
            "vllm:prompt_tokens_total counter",
            "vllm:e2e_request_latency_seconds histogram",
        ] {
            assert!(
                small.contains(&format!("# TYPE {family}\n")),
                "{family}\n{small}"
            );
        }
        assert_eq!(
            small.lines().filter(|l| l.starts_with('#')).count(),
            6,
            "{small}"
        );
        assert!(small.len() < 1_000, "{small}");
        assert_eq!(filter_by_name(&page, &["absent".to_string()]), "");
    }

    #[test]
    fn each_flavour_speaks_only_its_own_names() {
        let r = recorder(Flavour::Vllm);
        let prefixes = [
            (Flavour::Vllm, "vllm:"),
            (Flavour::VllmV0, "vllm:"),
            (Flavour::Sglang, "sglang:"),
            (Flavour::Tgi, "tgi_"),
            (Flavour::Trtllm, "trtllm_"),
            (Flavour::Llamacpp, "llamacpp:"),
        ];
        for (f, prefix) in prefixes {
            let samples = parse(&render(f, &snapshot(&r))).unwrap();
            // vLLM's Python server adds the process's own metrics.
            let python = |n: &str| {
                matches!(f, Flavour::Vllm | Flavour::VllmV0)
                    && (n.starts_with("python_") || n.starts_with("process_"))
            };
            for s in &samples {
                assert!(
                    s.name.starts_with(prefix) || s.name.starts_with("mock:") || python(&s.name),
                    "{f:?}: {}",
                    s.name
                );
            }
        }
        // The v1 rename, both ways.
        let v1 = render(Flavour::Vllm, &snapshot(&r));
        let v0 = render(Flavour::VllmV0, &snapshot(&r));
        assert!(v1.contains("vllm:kv_cache_usage_perc{") && !v1.contains("gpu_cache_usage_perc"));
        assert!(v0.contains("vllm:gpu_cache_usage_perc{") && !v0.contains("kv_cache_usage_perc"));
    }

    #[test]
    fn number_and_label_styles() {
        for (v, want) in [
            (3.0, "3.0"),
            (0.25, "0.25"),
            (8_128_902.0, "8.128902e+06"),
            (1_000_000.0, "1e+06"),
            (123_456.0, "123456.0"),
            (1_700_000_000.5, "1.7000000005e+09"),
            (f64::INFINITY, "+Inf"),
        ] {
            assert_eq!(python_float(v), want);
        }
        let r = recorder(Flavour::Vllm);
        let text = render(Flavour::Vllm, &snapshot(&r));
        // Multiprocess prometheus_client: sorted labels, le among them, the sum first.
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.001\",\
             model_name=\"meta/llama \\\"7b\\\"\"} 0.0\n"
        ));
        let sum = text.find("vllm:time_to_first_token_seconds_sum").unwrap();
        assert!(
            sum < text
                .find("vllm:time_to_first_token_seconds_bucket")
                .unwrap()
        );
        let tgi = render(Flavour::Tgi, &snapshot(&r));
        assert!(tgi.contains("\ntgi_request_count 20\n"), "{tgi}");
        let trt = render(Flavour::Trtllm, &snapshot(&r));
        assert!(trt.contains(
            "trtllm_time_to_first_token_seconds_bucket{model_name=\"meta/llama \\\"7b\\\"\",\
             engine_type=\"trtllm\",le=\"+Inf\"} 3.0\n"
        ));
        // No adapters served: no lora series.
        let mut s = snapshot(&r);
        s.loras = None;
        assert!(!render(Flavour::Vllm, &s).contains("lora"));
    }

    /// The overrides tests drive a balancer with reach each flavour's own queue and KV series.
    #[test]
    fn gauge_overrides_show_in_every_flavour() {
        let r = recorder(Flavour::Vllm);
        // (flavour, its waiting series, its running series, its KV series, the KV value)
        let table = [
            (
                Flavour::Vllm,
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:kv_cache_usage_perc",
                0.95,
            ),
            (
                Flavour::VllmV0,
                "vllm:num_requests_waiting",
                "vllm:num_requests_running",
                "vllm:gpu_cache_usage_perc",
                0.95,
            ),
            (
                Flavour::Sglang,
                "sglang:num_queue_reqs",
                "sglang:num_running_reqs",
                "sglang:token_usage",
                0.95,
            ),
            (
                Flavour::Tgi,
                "tgi_queue_size",
                "tgi_batch_current_size",
                "tgi_batch_current_max_tokens",
                123_500.0,
            ),
            (
                Flavour::Trtllm,
                "trtllm_num_requests_waiting",
                "trtllm_num_requests_running",
                "trtllm_kv_cache_utilization",
                0.95,
            ),
            (
                Flavour::Llamacpp,
                "llamacpp:requests_deferred",
                "llamacpp:requests_processing",
                "llamacpp:kv_cache_usage_ratio",
                0.95,
            ),
        ];
        for (f, waiting, running, kv, want_kv) in table {
            let mut s = snapshot(&r);
            s.apply(GaugeOverrides::default());
            let plain = parse(&render(f, &s)).unwrap();
            assert_eq!(value(&plain, waiting, &[]), Some(2.0), "{f:?}");
            s.apply(GaugeOverrides {
                waiting: Some(77),
                running: Some(5),
                kv_usage: Some(0.95),
            });
            let samples = parse(&render(f, &s)).unwrap();
            assert_eq!(value(&samples, waiting, &[]), Some(77.0), "{f:?}");
            assert_eq!(value(&samples, running, &[]), Some(5.0), "{f:?}");
            assert_eq!(value(&samples, kv, &[]), Some(want_kv), "{f:?}");
            // Counters stay what the engine counted.
            assert_eq!(
                plain
                    .iter()
                    .filter(|x| x.name.ends_with("_total"))
                    .map(|x| x.value)
                    .sum::<f64>(),
                samples
                    .iter()
                    .filter(|x| x.name.ends_with("_total"))
                    .map(|x| x.value)
                    .sum::<f64>(),
                "{f:?}"
            );
        }
        // Out-of-range KV is clamped, not rendered as an impossible fraction.
        let mut s = snapshot(&r);
        s.apply(GaugeOverrides {
            kv_usage: Some(7.0),
            ..GaugeOverrides::default()
        });
        assert_eq!((s.kv_usage, s.kv_used_tokens), (1.0, 130_000));
    }

    #[test]
    fn histogram_buckets() {
        let mut h = Histogram::new(vec![1.0, 2.0]);
        for v in [0.5, 1.0, 1.5, 3.0] {
            h.observe(v);
        }
        assert_eq!(
            h.cumulative(),
            vec![(1.0, 2), (2.0, 3), (f64::INFINITY, 4)],
            "le is inclusive"
        );
        assert_eq!((h.sum, h.count), (6.0, 4));
        assert_eq!(
            buckets_1_2_5(600),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]
        );
        assert!(Flavour::ALL
            .iter()
            .all(|f| Flavour::parse(f.name()) == Some(*f)));
        assert_eq!(Flavour::parse("vllm-v2"), None);
    }
}
