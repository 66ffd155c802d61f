//! Plugin configuration: the JSON that sits in the Envoy YAML under the Wasm filter's
//! `configuration` value.
//!
//! The configuration is typed and closed: unknown fields are rejected, because a misspelt
//! field silently falling back to a default is the classic way a load balancer ends up doing
//! something its operator did not ask for. Every error names the offending field and says why,
//! and the glue refuses to start the plugin (one log line) rather than run half-configured.
//!
//! The whole schema is in this one file, longer than the others: every field, its default and
//! its check read in one place, next to the tests that name each error's field.

use crate::explain::Cidr;
use crate::fleet::models::{MAX_MODELS_PER_NODE, MAX_MODEL_NAME_BYTES};
use crate::ingest::engine::HealthFormat;
use crate::ingest::image::{ImagePricing, MAX_IMAGE_TOKENS};
use crate::ingest::request::Pricing;
use serde_json::{Map, Value};
use std::fmt;

/// Which rule ranks the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Predicted time to serve with the VRAM guard (see `route::choice`).
    TokenThroughput,
    /// The seed article's naive rule, kept as a baseline for the benchmarks: the lowest
    /// reported `tokens_per_sec_load` wins; no capacity, queue, in-flight or VRAM awareness.
    LeastReportedLoad,
    /// Our re-implementation of the Kubernetes inference gateway's default scoring, kept as a
    /// baseline for the benchmarks: each node scores 2 x queue (the shortest reported queue 1,
    /// the longest 0) + 2 x (1 - KV-cache use) + 3 x the share of the prompt's prefix it is
    /// believed to hold (the same index as `token_throughput`'s, see `fleet::prefixes`), and
    /// the highest score wins; no capacity, in-flight or VRAM-ceiling awareness.
    GatewayProfile,
}

/// One GPU node, as a member of the Envoy cluster that serves inference traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeConfig {
    /// `ip:port` of the node exactly as it is a member of the Envoy cluster: this is the value
    /// written into the routing header, so it must match the cluster's endpoint address.
    pub address: String,
    /// Path of the node's health endpoint, polled on every tick, as configured. When it is
    /// not, the filter starts at `DEFAULT_HEALTH_PATH` and finds the node's telemetry itself
    /// (see `fleet::probe`).
    pub health_path: Option<String>,
    /// `ip:port` to poll for health when it differs from `address` (a metrics sidecar).
    pub health_address: Option<String>,
    /// Token throughput the node can sustain, in tokens per second. Overrides what the node
    /// reports as `tokens_per_sec_capacity`; needed when the node reports no capacity.
    pub capacity_tokens_per_sec: Option<f64>,
    /// KV-cache size of the node, in tokens. Lets the VRAM check work for nodes that report only
    /// `kv_cache_usage` (a fraction) and no byte counts, or whose engine publishes no cache
    /// geometry (TGI, llama.cpp).
    pub kv_cache_tokens: Option<u64>,
    /// What the health endpoint serves: `auto` (default) tells the seed JSON from an engine's
    /// Prometheus text by the answer; the others fix it.
    pub format: HealthFormat,
    /// The models (and LoRA adapters) the node serves. When set, this is the whole truth for
    /// the node: its `/v1/models` is not polled and its metrics add nothing (see `models`).
    pub models: Option<Vec<String>>,
    /// Whether a node found to serve an engine's metrics through `prometheus_client` is then
    /// asked for the samples read alone (`?name[]=...`, see `fleet::probe`). Default true.
    pub filter_metrics: bool,
}

/// The health path polled first when a node's `health_path` is not configured.
pub const DEFAULT_HEALTH_PATH: &str = "/health";

impl NodeConfig {
    /// The configured health path, else the default one polled first.
    pub fn health_path(&self) -> &str {
        self.health_path.as_deref().unwrap_or(DEFAULT_HEALTH_PATH)
    }

    /// The address the health callout goes to.
    pub fn health_target(&self) -> &str {
        self.health_address.as_deref().unwrap_or(&self.address)
    }
}

/// Ticks a quiet node's poll period reaches by default (`quiet_poll_ms`).
pub const QUIET_TICKS: u64 = 8;
/// Longest default `quiet_poll_ms`, whatever the tick: news of other routers' work on a quiet
/// node comes at most this late.
pub const QUIET_POLL_DEFAULT_MS: u64 = 2000;
/// Longest `quiet_poll_ms` accepted.
pub const MAX_QUIET_POLL_MS: u64 = 60_000;

/// The whole plugin configuration. Durations are integer milliseconds (`*_ms`). The defaults
/// are documented in docs/CONFIGURATION.md and asserted by the tests below.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The GPU nodes this filter balances over: at least one, unless `membership` is set; then
    /// these are the settings of the members at these addresses.
    pub nodes: Vec<NodeConfig>,
    /// When set, the nodes are the members of this Envoy cluster, followed at runtime.
    pub membership: Option<Membership>,
    /// Envoy cluster that carries health callouts. It must send each callout to the address in
    /// `health_target_header` (an ORIGINAL_DST cluster with `http_header_name`, see envoy/).
    pub health_cluster: String,
    /// Header of the health callout that names the node to reach (`ip:port`).
    pub health_target_header: String,
    /// How often every node's health endpoint is polled.
    pub tick_ms: u64,
    /// Timeout of one health callout.
    pub health_timeout_ms: u64,
    /// Age after which a node's last good report is no longer trusted (the node is then not a
    /// candidate). Must be longer than the tick.
    pub stale_after_ms: u64,
    /// Longest period between polls of a node whose reports move nothing (see
    /// `fleet::polling`); `tick_ms` polls every node every tick. Default: `QUIET_TICKS` ticks,
    /// at most `QUIET_POLL_DEFAULT_MS` (and at least a tick).
    pub quiet_poll_ms: u64,
    /// Request header that carries the chosen `ip:port` list to Envoy's override_host policy.
    pub routing_header: String,
    /// Most request-body bytes inspected; a larger body is passed on untouched and the request
    /// goes to Envoy's fallback balancer. Keep it below Envoy's buffer limit.
    pub max_body_bytes: usize,
    /// Highest predicted VRAM/KV-cache use (0..1] a node may reach by admitting a request.
    pub vram_ceiling: f64,
    /// Output tokens assumed when a request sets no max_tokens.
    pub default_max_tokens: u64,
    /// KV-cache bytes per token of context (512 KiB for a 7B model in fp16).
    pub kv_bytes_per_token: u64,
    /// How many nodes the routing header lists: the choice, then the next best for retries.
    pub max_hosts_in_header: usize,
    /// When set, responses carry this header with the chosen node and the estimate.
    pub debug_header: Option<String>,
    /// When set, a GET of exactly this path is answered by the filter with its beliefs (see
    /// `route::beliefs`) as JSON, never forwarded. Set it only on an operator's listener.
    pub beliefs_path: Option<String>,
    /// When set, one request can ask for an explanation of its decision (see `explain`).
    pub explain: Option<Explain>,
    /// The ranking rule: `token_throughput` (default), or the seed article's naive
    /// `least_reported_load`, kept only as a benchmark baseline.
    pub policy: Rule,
    /// How many candidates the choice compares per request: power-of-d choices over nodes
    /// drawn in proportion to their capacity, 0 for all nodes (argmin), or `auto` (the
    /// default): as many as the number of routers sharing the fleet allows (`route::routers`).
    pub choices: Choices,
    /// Longest a request waits in the filter while every node is predicted over the VRAM
    /// ceiling, before it is routed anyway. 0 (default) never holds: such a request goes at
    /// once to the node that overflows least.
    pub max_hold_ms: u64,
    /// Most requests held at once per Envoy worker; more are routed at once.
    pub max_held_requests: usize,
    /// Predicted KV use (at or above `vram_ceiling`) that even the least-full node must pass
    /// for a request to be held; below it, but over the ceiling, the request goes to that node.
    /// Default 1.0 (or `vram_ceiling` if that is higher): hold only what would outgrow the
    /// whole cache.
    pub hold_kv_ceiling: f64,
    /// Failed health polls in a row that take a node out of the choice (before its last report
    /// goes stale).
    pub unhealthy_after_failures: u32,
    /// Good health polls in a row that bring an ejected node back.
    pub healthy_after_successes: u32,
    /// How often each node's `GET /v1/models` is asked for the models it serves; 0 never.
    pub models_poll_ms: u64,
    /// What happens to a request whose model no node serves.
    pub unknown_model: UnknownModel,
    /// Who polls the nodes: every VM for itself, or one poller service per Envoy process.
    pub poller: Poller,
    /// Prefix-aware pricing: where each prompt's prefix is believed cached (see `prefix`).
    pub prefix: PrefixConfig,
    /// Who waits, who goes first, who is told to come back (see `route::admission`).
    pub admission: AdmissionConfig,
    /// How an image in a prompt is counted (see `ingest::image`).
    pub images: ImagePricing,
    /// Responses stored by the node that answered them, and the requests that come back to
    /// them (see `ingest::stored`).
    pub stored_responses: StoredResponses,
}

/// Whether requests naming a stored response (OpenAI's Responses API) go to the node that
/// stored it, and how many stored responses are remembered (see `share::stored`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredResponses {
    pub enabled: bool,
    pub slots: u32,
    /// How many nodes are asked where a response this Envoy has not seen is stored, when a
    /// request names one (0: none; see `ingest::stored`).
    pub ask_nodes: u32,
}

impl Default for StoredResponses {
    fn default() -> Self {
        StoredResponses {
            enabled: true,
            slots: crate::share::stored::DEFAULT_SLOTS,
            ask_nodes: crate::share::stored::DEFAULT_ASK_NODES,
        }
    }
}

/// What a request claims at admission (see `ingest::claim` and `route::admission`): its
/// priority, its tenant and its time-to-first-token budget, read from headers whose names
/// follow the Kubernetes inference gateway's where it has them.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Header naming the request's objective; its priority is looked up in `objectives`.
    pub objective_header: String,
    /// Objective name to priority (higher goes first; below 0 may be shed under saturation).
    /// A name not listed, or no header, is priority 0.
    pub objectives: Vec<(String, i32)>,
    /// Header carrying an integer priority directly; read only when set. It wins over the
    /// objective.
    pub priority_header: Option<String>,
    /// Header naming the tenant whose requests are queued fairly against other tenants'.
    pub fairness_header: String,
    /// Without the header, the body's `user` field names the tenant.
    pub fairness_from_user: bool,
    /// Header with the request's time-to-first-token budget, in milliseconds.
    pub ttft_header: String,
    /// Header with the longest time per output token the request accepts, in milliseconds.
    pub tpot_header: String,
    /// Status of a request the filter answers itself because it cannot be served in time or
    /// is shed: 429 (default) or 503.
    pub reject_status: u32,
    /// Most request-body bytes held at once per Envoy worker; a request that would pass it is
    /// not held.
    pub max_held_bytes: u64,
    /// With holding on: a node whose queued prompts would take longer than this to prefill
    /// (milliseconds, forecast at its capacity) takes no request that may wait; when every
    /// node is past it the request waits in the hold queue, where priority and fairness order
    /// it, instead of in an engine's first-come queue. 0 (default) holds only for VRAM.
    pub max_queued_ms: u64,
    /// With `max_queued_ms` and more than one tenant active: one node is kept with at most
    /// this much of prompts queued (milliseconds at its capacity), for short requests. A
    /// request whose own prompt takes longer than this to prefill (where it would prefill
    /// fastest) does not take the last such node: it goes to another within `max_queued_ms`,
    /// or waits; a shorter one goes where its first token comes soonest. 0 (default) keeps no
    /// node.
    pub short_lane_ms: u64,
    /// What becomes of a request that no node has room for and that may wait no longer: held
    /// for `max_hold_ms`, or finding the hold queue full (or holding off).
    pub when_full: WhenFull,
}

/// What becomes of a request that no node has room for once it may wait no longer
/// (`admission.when_full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenFull {
    /// It goes to the node that would overflow least (the default): every request is served,
    /// and an engine may preempt to make room.
    #[default]
    Route,
    /// The filter answers it itself with `reject_status` and a `Retry-After`: no request is
    /// sent where it would overflow a node's cache.
    Reject,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            objective_header: "x-gateway-inference-objective".into(),
            objectives: Vec::new(),
            priority_header: None,
            fairness_header: "x-gateway-inference-fairness-id".into(),
            fairness_from_user: true,
            ttft_header: "x-slo-ttft-ms".into(),
            tpot_header: "x-slo-tpot-ms".into(),
            reject_status: 429,
            max_held_bytes: 64 << 20,
            max_queued_ms: 0,
            short_lane_ms: 0,
            when_full: WhenFull::Route,
        }
    }
}

const ADMISSION_FIELDS: &[&str] = &[
    "objective_header",
    "objectives",
    "priority_header",
    "fairness_header",
    "fairness_from_user",
    "ttft_header",
    "tpot_header",
    "reject_status",
    "max_held_bytes",
    "max_queued_ms",
    "short_lane_ms",
    "when_full",
];

/// The most objectives `admission.objectives` lists.
pub const MAX_OBJECTIVES: usize = 256;

fn parse_admission(value: &Value) -> Result<AdmissionConfig, ConfigError> {
    let f = Fields::new(value, "admission.", ADMISSION_FIELDS)?;
    let d = AdmissionConfig::default();
    let objectives = match f.get("objectives") {
        None => Vec::new(),
        Some(Value::Object(map)) if map.len() <= MAX_OBJECTIVES => map
            .iter()
            .map(|(name, v)| {
                let field = format!("admission.objectives.{name}");
                if name.is_empty() || name.len() > 253 {
                    return Err(err(field, "must be a name of 1 to 253 bytes"));
                }
                let p = v
                    .as_i64()
                    .and_then(|p| i32::try_from(p).ok())
                    .filter(|p| p.abs() <= 1_000_000)
                    .ok_or_else(|| err(&field, "must be an integer priority in -1000000..=1000000"))?;
                Ok((name.clone(), p))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(err(
                f.name("objectives"),
                format!("must be an object of at most {MAX_OBJECTIVES} objective names to integer priorities"),
            ))
        }
    };
    let priority_header = match f.get("priority_header") {
        None => None,
        Some(_) => Some(header_name(&f, "priority_header", "")?),
    };
    let fairness_from_user = f
        .boolean("fairness_from_user")?
        .unwrap_or(d.fairness_from_user);
    let reject_status = match f.uint("reject_status")? {
        None => d.reject_status,
        Some(s @ (429 | 503)) => s as u32,
        Some(_) => return Err(err(f.name("reject_status"), "must be 429 or 503")),
    };
    let max_held_bytes = f.uint("max_held_bytes")?.unwrap_or(d.max_held_bytes);
    let max_queued_ms = f.uint("max_queued_ms")?.unwrap_or(d.max_queued_ms);
    if max_queued_ms > 600_000 {
        return Err(err(
            f.name("max_queued_ms"),
            "must be at most 600000 (10 minutes)",
        ));
    }
    let short_lane_ms = f.uint("short_lane_ms")?.unwrap_or(d.short_lane_ms);
    if short_lane_ms > 0 && short_lane_ms >= max_queued_ms {
        return Err(err(
            f.name("short_lane_ms"),
            "must be below `admission.max_queued_ms` (the lane is a node queued less than the rest may be), or 0",
        ));
    }
    let when_full = match f.string("when_full")?.as_deref() {
        None | Some("route") => WhenFull::Route,
        Some("reject") => WhenFull::Reject,
        Some(other) => {
            return Err(err(
                f.name("when_full"),
                format!("{other:?} is not a choice (route, reject)"),
            ))
        }
    };
    let a = AdmissionConfig {
        objective_header: header_name(&f, "objective_header", &d.objective_header)?,
        objectives,
        priority_header,
        fairness_header: header_name(&f, "fairness_header", &d.fairness_header)?,
        fairness_from_user,
        ttft_header: header_name(&f, "ttft_header", &d.ttft_header)?,
        tpot_header: header_name(&f, "tpot_header", &d.tpot_header)?,
        reject_status,
        max_held_bytes,
        max_queued_ms,
        short_lane_ms,
        when_full,
    };
    // Each header is read for one meaning only.
    let mut seen: Vec<(&str, &str)> = vec![
        ("objective_header", a.objective_header.as_str()),
        ("fairness_header", a.fairness_header.as_str()),
        ("ttft_header", a.ttft_header.as_str()),
        ("tpot_header", a.tpot_header.as_str()),
    ];
    seen.extend(a.priority_header.as_deref().map(|h| ("priority_header", h)));
    for (i, (name, h)) in seen.iter().enumerate() {
        if let Some((other, _)) = seen.iter().take(i).find(|(_, o)| o == h) {
            return Err(err(
                format!("admission.{name}"),
                format!("is the same header as `admission.{other}`"),
            ));
        }
    }
    Ok(a)
}

/// Prefix-aware pricing (`fleet::prefixes`, `ingest::prompt`): each request is priced on each
/// node at the prompt tokens that node's prefix cache does not hold.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixConfig {
    /// Prefix pricing on (the default) or off (every node is charged the whole prompt).
    pub enabled: bool,
    /// Characters of rendered prompt per block of the prefix chain.
    pub block_chars: usize,
    /// Blocks the index remembers in all (every node together), per VM.
    pub max_blocks: usize,
    /// Blocks believed held per node when its cache size is not known.
    pub blocks_per_node: usize,
    /// Request header whose value names a session (requests likely to share a prefix); an
    /// affinity hint, as the body's `prompt_cache_key` and `user` are.
    pub session_header: Option<String>,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            block_chars: 256,
            max_blocks: 65_536,
            blocks_per_node: crate::fleet::prefixes::DEFAULT_BLOCKS_PER_NODE,
            session_header: None,
        }
    }
}

const IMAGES_FIELDS: &[&str] = &["enabled", "tokens", "pixels_per_token"];

fn parse_images(value: &Value) -> Result<ImagePricing, ConfigError> {
    let f = Fields::new(value, "images.", IMAGES_FIELDS)?;
    let d = ImagePricing::default();
    let tokens = f.uint("tokens")?.unwrap_or(d.tokens);
    if tokens > MAX_IMAGE_TOKENS {
        return Err(err(
            f.name("tokens"),
            format!("must be at most {MAX_IMAGE_TOKENS}"),
        ));
    }
    Ok(ImagePricing {
        enabled: f.boolean("enabled")?.unwrap_or(d.enabled),
        tokens,
        pixels_per_token: f.uint("pixels_per_token")?.unwrap_or(d.pixels_per_token),
    })
}

const STORED_FIELDS: &[&str] = &["enabled", "slots", "ask_nodes"];

fn parse_stored(value: &Value) -> Result<StoredResponses, ConfigError> {
    let f = Fields::new(value, "stored_responses.", STORED_FIELDS)?;
    let d = StoredResponses::default();
    let max = crate::share::stored::MAX_SLOTS;
    let slots = f.uint("slots")?.unwrap_or(u64::from(d.slots));
    let slots = u32::try_from(slots)
        .ok()
        .filter(|s| (1..=max).contains(s))
        .ok_or_else(|| err(f.name("slots"), format!("must be 1 to {max}")))?;
    let most = crate::share::stored::MAX_ASK_NODES;
    let ask_nodes = f.uint("ask_nodes")?.unwrap_or(u64::from(d.ask_nodes));
    let ask_nodes = u32::try_from(ask_nodes)
        .ok()
        .filter(|n| *n <= most)
        .ok_or_else(|| err(f.name("ask_nodes"), format!("must be 0 to {most}")))?;
    Ok(StoredResponses {
        enabled: f.boolean("enabled")?.unwrap_or(d.enabled),
        slots,
        ask_nodes,
    })
}

const PREFIX_FIELDS: &[&str] = &[
    "enabled",
    "block_chars",
    "max_blocks",
    "blocks_per_node",
    "session_header",
];

fn parse_prefix(value: &Value) -> Result<PrefixConfig, ConfigError> {
    let f = Fields::new(value, "prefix.", PREFIX_FIELDS)?;
    let d = PrefixConfig::default();
    let enabled = f.boolean("enabled")?.unwrap_or(d.enabled);
    let bounded = |key: &str, default: usize, lo: u64, hi: u64| -> Result<usize, ConfigError> {
        match f.uint(key)? {
            None => Ok(default),
            Some(n) if (lo..=hi).contains(&n) => Ok(usize::try_from(n).unwrap_or(default)),
            Some(_) => Err(err(f.name(key), format!("must be between {lo} and {hi}"))),
        }
    };
    let block_chars = bounded("block_chars", d.block_chars, 16, 65_536)?;
    let max_blocks = bounded("max_blocks", d.max_blocks, 0, 4_194_304)?;
    let blocks_per_node = bounded("blocks_per_node", d.blocks_per_node, 1, 4_194_304)?;
    let session_header = match f.get("session_header") {
        None => None,
        Some(_) => Some(header_name(&f, "session_header", "")?),
    };
    Ok(PrefixConfig {
        enabled,
        block_chars,
        max_blocks,
        blocks_per_node,
        session_header,
    })
}

/// Who polls the nodes (see `share`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poller {
    /// Every VM (each Envoy worker and the main thread) polls every node and keeps its own
    /// books. Needs nothing more than the HTTP filter.
    Vm,
    /// One poller per Envoy process: a bootstrap `envoy.bootstrap.wasm` service with
    /// `singleton: true`, loaded from the same `.wasm` with the same `vm_id`, this same
    /// configuration and root_id `token_balancer_poller`, polls and publishes the fleet in
    /// shared data; the filter VMs read it and share their in-flight books there.
    Singleton,
}

/// How many candidates the choice compares per request (`choices`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choices {
    /// Follows how many routers share the fleet, learned from the engines' reports (see
    /// `route::routers`).
    Auto,
    /// This many drawn candidates; 0 compares every node.
    Fixed(usize),
}

/// What happens to a request naming a model that every node is known not to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownModel {
    /// Envoy's own balancer routes it, as without the filter (the node answers for itself).
    Fallback,
    /// The filter answers 404 `model_not_found` itself, as vLLM would.
    Reject,
}

const CONFIG_FIELDS: &[&str] = &[
    "nodes",
    "health_cluster",
    "health_target_header",
    "tick_ms",
    "health_timeout_ms",
    "stale_after_ms",
    "quiet_poll_ms",
    "routing_header",
    "max_body_bytes",
    "vram_ceiling",
    "default_max_tokens",
    "kv_bytes_per_token",
    "max_hosts_in_header",
    "debug_header",
    "beliefs_path",
    "explain",
    "policy",
    "choices",
    "max_hold_ms",
    "max_held_requests",
    "hold_kv_ceiling",
    "unhealthy_after_failures",
    "healthy_after_successes",
    "models_poll_ms",
    "unknown_model",
    "membership",
    "poller",
    "prefix",
    "images",
    "stored_responses",
    "admission",
];
const NODE_FIELDS: &[&str] = &[
    "address",
    "health_path",
    "health_address",
    "capacity_tokens_per_sec",
    "kv_cache_tokens",
    "format",
    "models",
    "filter_metrics",
];

const MEMBERSHIP_FIELDS: &[&str] = &["cluster", "admin_cluster", "poll_ms", "node_defaults"];

const NODE_DEFAULT_FIELDS: &[&str] = &[
    "health_path",
    "capacity_tokens_per_sec",
    "kv_cache_tokens",
    "format",
    "models",
    "filter_metrics",
];

/// Where the set of nodes comes from when it follows an Envoy cluster (`membership`): the
/// cluster's members as Envoy's admin endpoint lists them (see `membership`).
#[derive(Debug, Clone, PartialEq)]
pub struct Membership {
    /// The inference cluster whose members are the nodes (the one the routing header steers).
    pub cluster: String,
    /// A cluster whose endpoint is Envoy's own admin listener: the member list is read from
    /// its `/clusters?format=json`.
    pub admin_cluster: String,
    /// How often the member list is read.
    pub poll_ms: u64,
    /// Settings of a member that `nodes` does not list (its `address` is the member's).
    pub node_defaults: NodeConfig,
}

fn parse_membership(value: &Value, tick_ms: u64) -> Result<Membership, ConfigError> {
    let f = Fields::new(value, "membership.", MEMBERSHIP_FIELDS)?;
    let cluster = f.required_string("cluster")?;
    let admin_cluster = f.required_string("admin_cluster")?;
    for (key, v) in [("cluster", &cluster), ("admin_cluster", &admin_cluster)] {
        if v.is_empty() {
            return Err(err(f.name(key), "must name an Envoy cluster"));
        }
    }
    let poll_ms = f.uint("poll_ms")?.unwrap_or(2000);
    if poll_ms < tick_ms {
        return Err(err(
            f.name("poll_ms"),
            format!("must be at least tick_ms ({tick_ms}): the list is read on the tick"),
        ));
    }
    let empty = Value::Object(Map::new());
    let defaults = f.get("node_defaults").unwrap_or(&empty);
    let d = Fields::new(defaults, "membership.node_defaults.", NODE_DEFAULT_FIELDS)?;
    Ok(Membership {
        cluster,
        admin_cluster,
        poll_ms,
        node_defaults: node_settings(&d, String::new())?,
    })
}

/// The per-request explanation (`explain` in the configuration; see `crate::explain`).
#[derive(Debug, Clone, PartialEq)]
pub struct Explain {
    /// Request header asking for the explanation; the response carries it under this name.
    pub header: String,
    /// Downstream networks a request may ask from; from anywhere else the header is dropped.
    pub sources: Vec<Cidr>,
    /// Every request's explanation goes into Envoy's filter state, for the access log.
    pub access_log: bool,
}

/// The most networks `explain.sources` lists.
pub const MAX_EXPLAIN_SOURCES: usize = 64;
const EXPLAIN_FIELDS: &[&str] = &["header", "sources", "access_log"];

fn parse_explain(value: &Value, taken: &[(&str, &str)]) -> Result<Explain, ConfigError> {
    let f = Fields::new(value, "explain.", EXPLAIN_FIELDS)?;
    let header = header_name(&f, "header", "x-token-balancer-explain")?;
    if let Some((other, _)) = taken.iter().find(|(_, h)| *h == header) {
        return Err(err(f.name("header"), format!("is already `{other}`")));
    }
    let sources = match f.get("sources") {
        None => Vec::new(),
        Some(Value::Array(list)) if list.len() <= MAX_EXPLAIN_SOURCES => list
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let name = format!("explain.sources[{i}]");
                let s = v.as_str().ok_or_else(|| err(&name, "must be a string"))?;
                Cidr::parse(s).map_err(|why| err(name, why))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(err(
                f.name("sources"),
                format!("must be an array of at most {MAX_EXPLAIN_SOURCES} IP networks"),
            ))
        }
    };
    let access_log = f.boolean("access_log")?.unwrap_or(false);
    if sources.is_empty() && !access_log {
        return Err(err(
            "explain",
            "explains nothing: list the `sources` a request may ask from, or set `access_log`",
        ));
    }
    Ok(Explain {
        header,
        sources,
        access_log,
    })
}

/// A configuration the plugin refuses to run with: the field and the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid token-balancer configuration: `{}` {}",
            self.field, self.reason
        )
    }
}

fn err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Typed access to one JSON object's fields, so that every type error names its field. (serde's
/// derive reports type errors by line and column only, which is no help inside Envoy YAML.)
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    fn new(value: &'a Value, prefix: &str, known: &[&str]) -> Result<Self, ConfigError> {
        let name = if prefix.is_empty() {
            "configuration"
        } else {
            prefix.trim_end_matches('.')
        };
        let obj = value
            .as_object()
            .ok_or_else(|| err(name, "must be a JSON object"))?;
        if let Some(unknown) = obj.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(err(
                format!("{prefix}{unknown}"),
                format!("is not a known field (known: {})", known.join(", ")),
            ));
        }
        Ok(Fields {
            obj,
            prefix: prefix.to_string(),
        })
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The field's value, treating JSON `null` as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(err(self.name(key), "must be a string")),
        }
    }

    fn required_string(&self, key: &str) -> Result<String, ConfigError> {
        self.string(key)?
            .ok_or_else(|| err(self.name(key), "is required"))
    }

    fn uint(&self, key: &str) -> Result<Option<u64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| err(self.name(key), "must be a non-negative integer")),
        }
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| err(self.name(key), "must be true or false")),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| err(self.name(key), "must be a number")),
        }
    }
}

/// Is `s` an `ip:port` (IPv4 or bracketed IPv6) with a non-zero port? Envoy's override_host
/// only accepts addresses, never host names, so catching a name here saves a silent fallback.
pub fn is_ip_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let port_ok = matches!(port.parse::<u16>(), Ok(p) if p != 0);
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        host.parse::<std::net::Ipv4Addr>().is_ok()
    };
    port_ok && host_ok
}

fn header_name(f: &Fields, key: &str, default: &str) -> Result<String, ConfigError> {
    let value = f.string(key)?.unwrap_or_else(|| default.to_string());
    let ok = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    if ok {
        Ok(value)
    } else {
        Err(err(f.name(key), "must be a lower-case HTTP header name"))
    }
}

fn parse_node(value: &Value, i: usize, seen: &[NodeConfig]) -> Result<NodeConfig, ConfigError> {
    let f = Fields::new(value, &format!("nodes[{i}]."), NODE_FIELDS)?;
    let address = f.required_string("address")?;
    if !is_ip_port(&address) {
        return Err(err(
            f.name("address"),
            format!(
                "{address:?} is not ip:port (Envoy's override_host takes addresses, not names)"
            ),
        ));
    }
    if seen.iter().any(|n| n.address == address) {
        return Err(err(
            f.name("address"),
            format!("{address:?} is listed twice"),
        ));
    }
    node_settings(&f, address)
}

/// A node's settings other than its address: a listed node's, or the defaults of the nodes
/// learned from the cluster (`membership.node_defaults`, which has no `health_address`).
fn node_settings(f: &Fields, address: String) -> Result<NodeConfig, ConfigError> {
    let health_path = f.string("health_path")?;
    if health_path.as_ref().is_some_and(|p| !p.starts_with('/')) {
        return Err(err(f.name("health_path"), "must start with '/'"));
    }
    let health_address = f.string("health_address")?;
    if let Some(h) = &health_address {
        if !is_ip_port(h) {
            return Err(err(
                f.name("health_address"),
                format!("{h:?} is not ip:port"),
            ));
        }
    }
    let capacity_tokens_per_sec = f.number("capacity_tokens_per_sec")?;
    if matches!(capacity_tokens_per_sec, Some(c) if !(c.is_finite() && c > 0.0)) {
        return Err(err(
            f.name("capacity_tokens_per_sec"),
            "must be a positive number",
        ));
    }
    let kv_cache_tokens = f.uint("kv_cache_tokens")?;
    if kv_cache_tokens == Some(0) {
        return Err(err(f.name("kv_cache_tokens"), "must be positive"));
    }
    let format = match f.string("format")? {
        None => HealthFormat::Auto,
        Some(name) => HealthFormat::from_name(&name).ok_or_else(|| {
            let names: Vec<&str> = HealthFormat::ALL.iter().map(|h| h.name()).collect();
            err(
                f.name("format"),
                format!("{name:?} is not a health format ({})", names.join(", ")),
            )
        })?,
    };
    let models = match f.get("models") {
        None => None,
        Some(v) => Some(model_names(v, &f.name("models"))?),
    };
    let filter_metrics = f.boolean("filter_metrics")?.unwrap_or(true);
    Ok(NodeConfig {
        address,
        health_path,
        health_address,
        capacity_tokens_per_sec,
        kv_cache_tokens,
        format,
        models,
        filter_metrics,
    })
}

/// `nodes[i].models`: a non-empty array of distinct, non-empty model names.
fn model_names(value: &Value, field: &str) -> Result<Vec<String>, ConfigError> {
    let Value::Array(list) = value else {
        return Err(err(field, "must be an array of model names"));
    };
    if list.is_empty() {
        return Err(err(
            field,
            "must name at least one model (leave it out to learn the node's models)",
        ));
    }
    if list.len() > MAX_MODELS_PER_NODE {
        return Err(err(
            field,
            format!("lists more than {MAX_MODELS_PER_NODE} models"),
        ));
    }
    let mut names: Vec<String> = Vec::with_capacity(list.len());
    for (j, v) in list.iter().enumerate() {
        let name = match v {
            Value::String(s) if !s.is_empty() && s.len() <= MAX_MODEL_NAME_BYTES => s.clone(),
            _ => {
                return Err(err(
                    format!("{field}[{j}]"),
                    format!("must be a model name (a non-empty string of at most {MAX_MODEL_NAME_BYTES} bytes)"),
                ))
            }
        };
        if names.contains(&name) {
            return Err(err(
                format!("{field}[{j}]"),
                format!("{name:?} is listed twice"),
            ));
        }
        names.push(name);
    }
    Ok(names)
}

impl Config {
    /// What a request's weight is read with (`ingest::request::read_with_chain`).
    pub fn pricing(&self) -> Pricing {
        Pricing {
            default_max_tokens: self.default_max_tokens,
            images: self.images,
        }
    }

    /// Parses and validates the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Err(err(
                "configuration",
                "is empty; `nodes` and `health_cluster` are required",
            ));
        }
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("configuration", format!("is not valid JSON: {e}")))?;
        let f = Fields::new(&value, "", CONFIG_FIELDS)?;

        let follows_cluster = f.get("membership").is_some();
        let none = Vec::new();
        let list = match f.get("nodes") {
            None if follows_cluster => &none,
            None => return Err(err("nodes", "is required (or `membership`)")),
            Some(Value::Array(list)) if list.is_empty() && !follows_cluster => {
                return Err(err(
                    "nodes",
                    "must list at least one node (or set `membership`)",
                ))
            }
            Some(Value::Array(list)) => list,
            Some(_) => return Err(err("nodes", "must be an array of nodes")),
        };
        let mut nodes = Vec::with_capacity(list.len());
        for (i, v) in list.iter().enumerate() {
            let node = parse_node(v, i, &nodes)?;
            nodes.push(node);
        }

        let health_cluster = f.required_string("health_cluster")?;
        if health_cluster.is_empty() {
            return Err(err("health_cluster", "must name an Envoy cluster"));
        }
        let tick_ms = f.uint("tick_ms")?.unwrap_or(1000);
        if tick_ms < 10 {
            return Err(err("tick_ms", "must be at least 10"));
        }
        let health_timeout_ms = f.uint("health_timeout_ms")?.unwrap_or(500);
        if health_timeout_ms == 0 {
            return Err(err("health_timeout_ms", "must be positive"));
        }
        let stale_after_ms = f.uint("stale_after_ms")?.unwrap_or(3000);
        if stale_after_ms <= tick_ms {
            return Err(err(
                "stale_after_ms",
                format!("must be longer than tick_ms ({tick_ms}), or every report goes stale before the next"),
            ));
        }
        // A quiet node's report stays fresh until its next poll is late (`fleet::polling`),
        // so the period is not bound by the staleness limit.
        let quiet_poll_ms = f.uint("quiet_poll_ms")?.unwrap_or(
            tick_ms
                .saturating_mul(QUIET_TICKS)
                .min(QUIET_POLL_DEFAULT_MS)
                .max(tick_ms),
        );
        if quiet_poll_ms < tick_ms || quiet_poll_ms > MAX_QUIET_POLL_MS {
            return Err(err(
                "quiet_poll_ms",
                format!(
                    "must be from tick_ms ({tick_ms}: every node every tick) to {MAX_QUIET_POLL_MS}"
                ),
            ));
        }
        let max_body_bytes = f.uint("max_body_bytes")?.unwrap_or(1 << 20);
        if max_body_bytes == 0 {
            return Err(err("max_body_bytes", "must be positive"));
        }
        let vram_ceiling = f.number("vram_ceiling")?.unwrap_or(0.9);
        if !(vram_ceiling > 0.0 && vram_ceiling <= 1.0) {
            return Err(err("vram_ceiling", "must be in (0, 1]"));
        }
        let default_max_tokens = f.uint("default_max_tokens")?.unwrap_or(256);
        let kv_bytes_per_token = f.uint("kv_bytes_per_token")?.unwrap_or(512 * 1024);
        if kv_bytes_per_token == 0 {
            return Err(err("kv_bytes_per_token", "must be positive"));
        }
        let max_hosts_in_header = f.uint("max_hosts_in_header")?.unwrap_or(3);
        if max_hosts_in_header == 0 {
            return Err(err("max_hosts_in_header", "must be at least 1"));
        }
        let debug_header = match f.get("debug_header") {
            None => None,
            Some(_) => Some(header_name(&f, "debug_header", "")?),
        };
        let beliefs_path = f.string("beliefs_path")?;
        if let Some(p) = &beliefs_path {
            let ok = p.starts_with('/')
                && p.len() <= 1024
                && p.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#');
            if !ok {
                return Err(err(
                    "beliefs_path",
                    "must be a path starting with / (printable ASCII, no query, at most 1024 bytes)",
                ));
            }
        }
        let routing_header = header_name(&f, "routing_header", "x-gateway-destination-endpoint")?;
        let explain = match f.get("explain") {
            None => None,
            Some(v) => {
                let mut taken = vec![("routing_header", routing_header.as_str())];
                taken.extend(debug_header.as_deref().map(|h| ("debug_header", h)));
                Some(parse_explain(v, &taken)?)
            }
        };
        let policy = match f.string("policy")?.as_deref() {
            None | Some("token_throughput") => Rule::TokenThroughput,
            Some("least_reported_load") => Rule::LeastReportedLoad,
            Some("gateway_profile") => Rule::GatewayProfile,
            Some(other) => {
                return Err(err(
                    "policy",
                    format!("{other:?} is not a policy (token_throughput, least_reported_load, gateway_profile)"),
                ))
            }
        };
        let choices = match f.get("choices") {
            None => Choices::Auto,
            Some(Value::String(s)) if s == "auto" => Choices::Auto,
            Some(v) => match v.as_u64() {
                Some(n) if n <= 64 => Choices::Fixed(usize::try_from(n).unwrap_or(0)),
                Some(_) => {
                    return Err(err(
                        "choices",
                        "must be at most 64 (0 compares every node); more samples than that \
                         cost more than a full comparison saves",
                    ))
                }
                None => {
                    return Err(err(
                        "choices",
                        "must be \"auto\" or an integer from 0 (every node) to 64",
                    ))
                }
            },
        };
        let max_hold_ms = f.uint("max_hold_ms")?.unwrap_or(0);
        if max_hold_ms > 600_000 {
            return Err(err(
                "max_hold_ms",
                "must be at most 600000 (10 minutes); a request held longer is a lost request",
            ));
        }
        let max_held_requests = f.uint("max_held_requests")?.unwrap_or(1024);
        let hold_kv_ceiling = f
            .number("hold_kv_ceiling")?
            .unwrap_or(vram_ceiling.max(1.0));
        if !(hold_kv_ceiling >= vram_ceiling && hold_kv_ceiling <= 2.0) {
            return Err(err(
                "hold_kv_ceiling",
                format!("must be between vram_ceiling ({vram_ceiling}) and 2"),
            ));
        }
        let threshold = |name: &str| -> Result<u32, ConfigError> {
            match f.uint(name)?.unwrap_or(2) {
                n @ 1..=100 => Ok(n as u32),
                _ => Err(err(name, "must be between 1 and 100 polls")),
            }
        };
        let unhealthy_after_failures = threshold("unhealthy_after_failures")?;
        let healthy_after_successes = threshold("healthy_after_successes")?;
        let models_poll_ms = f.uint("models_poll_ms")?.unwrap_or(30_000);
        if models_poll_ms != 0 && models_poll_ms < tick_ms {
            return Err(err(
                "models_poll_ms",
                format!("must be 0 (never) or at least tick_ms ({tick_ms}): lists are asked on the tick"),
            ));
        }
        let membership = match f.get("membership") {
            None => None,
            Some(v) => Some(parse_membership(v, tick_ms)?),
        };
        let unknown_model = match f.string("unknown_model")?.as_deref() {
            None | Some("fallback") => UnknownModel::Fallback,
            Some("reject") => UnknownModel::Reject,
            Some(other) => {
                return Err(err(
                    "unknown_model",
                    format!("{other:?} is not a choice (fallback, reject)"),
                ))
            }
        };
        let poller = match f.string("poller")?.as_deref() {
            None | Some("vm") => Poller::Vm,
            Some("singleton") => Poller::Singleton,
            Some(other) => {
                return Err(err(
                    "poller",
                    format!("{other:?} is not a choice (vm, singleton)"),
                ))
            }
        };
        let prefix = match f.get("prefix") {
            None => PrefixConfig::default(),
            Some(v) => parse_prefix(v)?,
        };
        let admission = match f.get("admission") {
            None => AdmissionConfig::default(),
            Some(v) => parse_admission(v)?,
        };
        let images = match f.get("images") {
            None => ImagePricing::default(),
            Some(v) => parse_images(v)?,
        };
        let stored_responses = match f.get("stored_responses") {
            None => StoredResponses::default(),
            Some(v) => parse_stored(v)?,
        };
        // The filter removes these from every request before reading any hint.
        if let Some(h) = &prefix.session_header {
            let taken = [
                ("routing_header", Some(routing_header.as_str())),
                ("debug_header", debug_header.as_deref()),
                (
                    "explain.header",
                    explain.as_ref().map(|e| e.header.as_str()),
                ),
            ];
            if let Some((other, _)) = taken.iter().find(|(_, t)| *t == Some(h.as_str())) {
                return Err(err(
                    "prefix.session_header",
                    format!("is already `{other}`"),
                ));
            }
        }
        Ok(Config {
            poller,
            prefix,
            images,
            stored_responses,
            admission,
            membership,
            models_poll_ms,
            unknown_model,
            policy,
            choices,
            max_hold_ms,
            hold_kv_ceiling,
            unhealthy_after_failures,
            healthy_after_successes,
            max_held_requests: usize::try_from(max_held_requests).unwrap_or(usize::MAX),
            nodes,
            health_cluster,
            health_target_header: header_name(
                &f,
                "health_target_header",
                "x-token-balancer-health-target",
            )?,
            tick_ms,
            health_timeout_ms,
            stale_after_ms,
            quiet_poll_ms,
            routing_header,
            max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
            vram_ceiling,
            default_max_tokens,
            kv_bytes_per_token,
            max_hosts_in_header: usize::try_from(max_hosts_in_header).unwrap_or(usize::MAX),
            explain,
            debug_header,
            beliefs_path,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"{"nodes":[{"address":"127.0.0.1:8001"}],"health_cluster":"health"}"#;

    #[test]
    fn membership_needs_no_nodes_and_has_defaults() {
        let c = Config::parse(
            br#"{"health_cluster":"h","membership":{"cluster":"gpu_nodes","admin_cluster":"admin"}}"#,
        )
        .unwrap();
        assert!(c.nodes.is_empty());
        let m = c.membership.unwrap();
        assert_eq!(
            (m.cluster.as_str(), m.admin_cluster.as_str()),
            ("gpu_nodes", "admin")
        );
        assert_eq!(m.poll_ms, 2000);
        assert_eq!(m.node_defaults.health_path, None);
        assert_eq!(m.node_defaults.health_path(), "/health");
        assert_eq!(m.node_defaults.format, HealthFormat::Auto);
        let c = Config::parse(
            br#"{"health_cluster":"h","nodes":[],"tick_ms":100,"membership":{"cluster":"c",
                "admin_cluster":"a","poll_ms":500,"node_defaults":{"health_path":"/metrics",
                "format":"vllm","kv_cache_tokens":5000,"models":["m"],"filter_metrics":false}}}"#,
        )
        .unwrap();
        let d = c.membership.unwrap().node_defaults;
        assert_eq!(d.health_path(), "/metrics");
        assert!(!d.filter_metrics);
        assert_eq!(d.format, HealthFormat::Vllm);
        assert_eq!(d.kv_cache_tokens, Some(5000));
        assert_eq!(d.models.as_deref(), Some(&["m".to_string()][..]));
        assert!(Config::parse(MIN.as_bytes()).unwrap().membership.is_none());
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = Config::parse(MIN.as_bytes()).unwrap();
        assert_eq!(c.tick_ms, 1000);
        assert_eq!(c.health_timeout_ms, 500);
        assert_eq!(c.stale_after_ms, 3000);
        assert_eq!(c.quiet_poll_ms, 2000);
        // Eight ticks, at most 2 s, whatever the staleness limit.
        let quiet = |tick: u64, stale: u64| {
            Config::parse(
                format!(r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h","tick_ms":{tick},"stale_after_ms":{stale}}}"#)
                    .as_bytes(),
            )
            .unwrap()
            .quiet_poll_ms
        };
        assert_eq!(quiet(100, 60000), 800);
        assert_eq!(quiet(250, 2000), 2000);
        assert_eq!(quiet(250, 300), 2000);
        assert_eq!(quiet(5000, 6000), 5000);
        // Longer than the staleness limit is accepted: a quiet node's report stays fresh
        // until its next poll is late.
        let longer = Config::parse(
            br#"{"nodes":[{"address":"127.0.0.1:1"}],"health_cluster":"h","tick_ms":100,"stale_after_ms":1000,"quiet_poll_ms":5000}"#,
        )
        .unwrap();
        assert_eq!(longer.quiet_poll_ms, 5000);
        assert_eq!(c.routing_header, "x-gateway-destination-endpoint");
        assert_eq!(c.max_body_bytes, 1 << 20);
        assert_eq!(c.vram_ceiling, 0.9);
        assert_eq!(c.default_max_tokens, 256);
        assert_eq!(c.kv_bytes_per_token, 512 * 1024);
        assert_eq!(c.max_hosts_in_header, 3);
        assert_eq!(c.debug_header, None);
        assert_eq!(c.beliefs_path, None);
        assert_eq!(c.policy, Rule::TokenThroughput);
        assert_eq!(c.choices, Choices::Auto);
        assert_eq!(c.max_hold_ms, 0);
        assert_eq!(c.max_held_requests, 1024);
        assert_eq!(c.hold_kv_ceiling, 1.0);
        assert_eq!(c.unhealthy_after_failures, 2);
        assert_eq!(c.healthy_after_successes, 2);
        assert_eq!(c.nodes[0].health_path, None);
        assert_eq!(c.nodes[0].health_path(), "/health");
        assert!(c.nodes[0].filter_metrics);
        assert_eq!(c.nodes[0].health_target(), "127.0.0.1:8001");
        assert_eq!(c.nodes[0].format, HealthFormat::Auto);
        assert_eq!(c.nodes[0].models, None);
        assert_eq!(c.models_poll_ms, 30_000);
        assert_eq!(c.unknown_model, UnknownModel::Fallback);
        assert_eq!(c.poller, Poller::Vm);
        assert_eq!(c.explain, None);
        let c = Config::parse(
            br#"{"nodes":[{"address":"127.0.0.1:8001"}],"health_cluster":"h","poller":"singleton"}"#,
        );
        assert_eq!(c.map(|c| c.poller), Ok(Poller::Singleton));
    }

    #[test]
    fn full_config_parses() {
        let c = Config::parse(
            br#"{"nodes":[{"address":"10.0.0.1:8000","health_path":"/h","health_address":"10.0.0.1:9000",
                 "capacity_tokens_per_sec":5000,"kv_cache_tokens":100000,"format":"vllm",
                 "models":["m1","sql-lora"]},
                {"address":"[::1]:8000"}],
               "health_cluster":"h","health_target_header":"x-t","tick_ms":200,"health_timeout_ms":100,
               "stale_after_ms":1000,"routing_header":"x-r","max_body_bytes":4096,"vram_ceiling":0.8,
               "default_max_tokens":64,"kv_bytes_per_token":1024,"max_hosts_in_header":2,
               "debug_header":"x-token-balancer-debug","policy":"least_reported_load",
               "max_hold_ms":5000,"max_held_requests":10,"models_poll_ms":0,
               "unknown_model":"reject","choices":0,"beliefs_path":"/token-balancer/beliefs"}"#,
        )
        .unwrap();
        assert_eq!(c.nodes[0].health_target(), "10.0.0.1:9000");
        assert_eq!(c.nodes[0].capacity_tokens_per_sec, Some(5000.0));
        assert_eq!(c.nodes[1].address, "[::1]:8000");
        assert_eq!(c.nodes[0].format, HealthFormat::Vllm);
        assert_eq!(c.nodes[1].format, HealthFormat::Auto);
        assert_eq!(c.debug_header.as_deref(), Some("x-token-balancer-debug"));
        assert_eq!(c.beliefs_path.as_deref(), Some("/token-balancer/beliefs"));
        assert_eq!(c.policy, Rule::LeastReportedLoad);
        assert_eq!(c.choices, Choices::Fixed(0));
        let auto = Config::parse(
            br#"{"nodes":[{"address":"10.0.0.1:8000"}],"health_cluster":"h","choices":"auto"}"#,
        )
        .unwrap();
        assert_eq!(auto.choices, Choices::Auto);
        assert_eq!(c.max_hold_ms, 5000);
        assert_eq!(c.max_held_requests, 10);
        assert_eq!(
            c.nodes[0].models.as_deref(),
            Some(&["m1".to_string(), "sql-lora".to_string()][..])
        );
        assert_eq!(c.nodes[1].models, None);
        assert_eq!(c.models_poll_ms, 0);
        assert_eq!(c.unknown_model, UnknownModel::Reject);
    }

    /// Every rejected configuration names the field it is about.
    #[test]
    fn each_error_names_its_field() {
        let node = r#"{"address":"127.0.0.1:8001"}"#;
        let with = |extra: &str| format!(r#"{{"nodes":[{node}],"health_cluster":"h",{extra}}}"#);
        let cases: Vec<(String, &str)> = vec![
            ("".into(), "configuration"),
            ("not json".into(), "configuration"),
            (r#"{"health_cluster":"h"}"#.into(), "nodes"),
            (r#"{"nodes":[{"address":"127.0.0.1:1"}]}"#.into(), "health_cluster"),
            (r#"{"nodes":[],"health_cluster":"h"}"#.into(), "nodes"),
            (with(r#""tick":5"#), "tick"),
            (with(r#""nodes":3"#), "nodes"),
            (r#"[1]"#.into(), "configuration"),
            (r#"{"nodes":[7],"health_cluster":"h"}"#.into(), "nodes[0]"),
            (r#"{"nodes":[{}],"health_cluster":"h"}"#.into(), "nodes[0].address"),
            (with(r#""vram_ceiling":"high""#), "vram_ceiling"),
            (with(r#""max_body_bytes":-1"#), "max_body_bytes"),
            (with(r#""tick_ms":"fast""#), "tick_ms"),
            (r#"{"nodes":[{"address":"gpu-1:8000"}],"health_cluster":"h"}"#.into(), "nodes[0].address"),
            (r#"{"nodes":[{"address":"127.0.0.1:0"}],"health_cluster":"h"}"#.into(), "nodes[0].address"),
            (r#"{"nodes":[{"address":"127.0.0.1"}],"health_cluster":"h"}"#.into(), "nodes[0].address"),
            (format!(r#"{{"nodes":[{node},{node}],"health_cluster":"h"}}"#), "nodes[1].address"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","port":2}],"health_cluster":"h"}"#.into(), "nodes[0].port"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","health_path":"health"}],"health_cluster":"h"}"#.into(), "nodes[0].health_path"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","filter_metrics":"no"}],"health_cluster":"h"}"#.into(), "nodes[0].filter_metrics"),
            (r#"{"membership":{"cluster":"c","admin_cluster":"a","node_defaults":{"filter_metrics":1}},"health_cluster":"h"}"#.into(), "membership.node_defaults.filter_metrics"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","health_address":"x"}],"health_cluster":"h"}"#.into(), "nodes[0].health_address"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","capacity_tokens_per_sec":0}],"health_cluster":"h"}"#.into(), "nodes[0].capacity_tokens_per_sec"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","kv_cache_tokens":0}],"health_cluster":"h"}"#.into(), "nodes[0].kv_cache_tokens"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","format":"prometheus"}],"health_cluster":"h"}"#.into(), "nodes[0].format"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","format":"VLLM"}],"health_cluster":"h"}"#.into(), "nodes[0].format"),
            (format!(r#"{{"nodes":[{node},{{"address":"127.0.0.1:2","format":7}}],"health_cluster":"h"}}"#), "nodes[1].format"),
            (r#"{"nodes":[{"address":"127.0.0.1:1"}],"health_cluster":""}"#.into(), "health_cluster"),
            (with(r#""routing_header":"X Bad""#), "routing_header"),
            (with(r#""health_target_header":"""#), "health_target_header"),
            (with(r#""debug_header":"Nope:""#), "debug_header"),
            (with(r#""beliefs_path":"beliefs""#), "beliefs_path"),
            (with(r#""beliefs_path":"""#), "beliefs_path"),
            (with(r#""beliefs_path":"/a b""#), "beliefs_path"),
            (with(r#""beliefs_path":"/b?x=1""#), "beliefs_path"),
            (with(r#""beliefs_path":7"#), "beliefs_path"),
            (with(r#""tick_ms":1"#), "tick_ms"),
            (with(r#""health_timeout_ms":0"#), "health_timeout_ms"),
            (with(r#""stale_after_ms":1000"#), "stale_after_ms"),
            (with(r#""quiet_poll_ms":500"#), "quiet_poll_ms"),
            (with(r#""quiet_poll_ms":60001"#), "quiet_poll_ms"),
            (with(r#""quiet_poll_ms":-1"#), "quiet_poll_ms"),
            (with(r#""max_body_bytes":0"#), "max_body_bytes"),
            (with(r#""vram_ceiling":0"#), "vram_ceiling"),
            (with(r#""vram_ceiling":1.5"#), "vram_ceiling"),
            (with(r#""kv_bytes_per_token":0"#), "kv_bytes_per_token"),
            (with(r#""max_hosts_in_header":0"#), "max_hosts_in_header"),
            (with(r#""policy":"random""#), "policy"),
            (with(r#""policy":1"#), "policy"),
            (with(r#""choices":65"#), "choices"),
            (with(r#""choices":-1"#), "choices"),
            (with(r#""choices":"two""#), "choices"),
            (with(r#""choices":2.5"#), "choices"),
            (with(r#""membership":{}"#), "membership.cluster"),
            (with(r#""membership":{"cluster":"c"}"#), "membership.admin_cluster"),
            (with(r#""membership":{"cluster":"","admin_cluster":"a"}"#), "membership.cluster"),
            (with(r#""membership":{"cluster":"c","admin_cluster":"a","poll_ms":10}"#), "membership.poll_ms"),
            (with(r#""membership":{"cluster":"c","admin_cluster":"a","every":1}"#), "membership.every"),
            (with(r#""membership":{"cluster":"c","admin_cluster":"a","node_defaults":{"health_address":"127.0.0.1:1"}}"#),
             "membership.node_defaults.health_address"),
            (with(r#""membership":{"cluster":"c","admin_cluster":"a","node_defaults":{"format":"x"}}"#),
             "membership.node_defaults.format"),
            (with(r#""membership":[]"#), "membership"),
            (r#"{"health_cluster":"h"}"#.into(), "nodes"),
            (with(r#""max_hold_ms":600001"#), "max_hold_ms"),
            (with(r#""max_hold_ms":-5"#), "max_hold_ms"),
            (with(r#""max_held_requests":"many""#), "max_held_requests"),
            (with(r#""unhealthy_after_failures":0"#), "unhealthy_after_failures"),
            (with(r#""hold_kv_ceiling":0.5"#), "hold_kv_ceiling"),
            (with(r#""hold_kv_ceiling":3"#), "hold_kv_ceiling"),
            (with(r#""healthy_after_successes":101"#), "healthy_after_successes"),
            (with(r#""models_poll_ms":500"#), "models_poll_ms"),
            (with(r#""models_poll_ms":-1"#), "models_poll_ms"),
            (with(r#""unknown_model":"drop""#), "unknown_model"),
            (with(r#""unknown_model":true"#), "unknown_model"),
            (with(r#""poller":"main""#), "poller"),
            (with(r#""poller":1"#), "poller"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","models":"m1"}],"health_cluster":"h"}"#.into(), "nodes[0].models"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","models":[]}],"health_cluster":"h"}"#.into(), "nodes[0].models"),
            (format!(r#"{{"nodes":[{node},{{"address":"127.0.0.1:2","models":["a",""]}}],"health_cluster":"h"}}"#), "nodes[1].models[1]"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","models":["a",7]}],"health_cluster":"h"}"#.into(), "nodes[0].models[1]"),
            (r#"{"nodes":[{"address":"127.0.0.1:1","models":["a","b","a"]}],"health_cluster":"h"}"#.into(), "nodes[0].models[2]"),
        ];
        for (json, field) in cases {
            let e = Config::parse(json.as_bytes()).expect_err(&json);
            assert_eq!(e.field, field, "config {json}: {e}");
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn stored_responses_parse_with_their_defaults_and_name_each_error() {
        let c = Config::parse(MIN.as_bytes()).unwrap();
        assert_eq!(c.stored_responses, StoredResponses::default());
        assert!(c.stored_responses.enabled);
        assert_eq!(c.stored_responses.slots, 16_384);
        assert_eq!(c.stored_responses.ask_nodes, 32);
        let with = |p: &str| {
            format!(r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h",{p}}}"#)
        };
        let c = Config::parse(
            with(r#""stored_responses":{"enabled":false,"slots":64,"ask_nodes":0}"#).as_bytes(),
        )
        .unwrap();
        let want = StoredResponses {
            enabled: false,
            slots: 64,
            ask_nodes: 0,
        };
        assert_eq!(c.stored_responses, want);
        for (json, field, why) in [
            (
                r#""stored_responses":{"slots":0}"#,
                "stored_responses.slots",
                "1 to 1048576",
            ),
            (
                r#""stored_responses":{"slots":1048577}"#,
                "stored_responses.slots",
                "1 to 1048576",
            ),
            (
                r#""stored_responses":{"slots":-3}"#,
                "stored_responses.slots",
                "",
            ),
            (
                r#""stored_responses":{"enabled":"yes"}"#,
                "stored_responses.enabled",
                "",
            ),
            (
                r#""stored_responses":{"ask_nodes":257}"#,
                "stored_responses.ask_nodes",
                "0 to 256",
            ),
            (
                r#""stored_responses":{"pin":true}"#,
                "stored_responses.pin",
                "",
            ),
            (
                r#""stored_responses":true"#,
                "stored_responses",
                "JSON object",
            ),
        ] {
            let e = Config::parse(with(json).as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(why), "{json}: {e}");
        }
    }

    #[test]
    fn images_parse_with_their_defaults_and_name_each_error() {
        let c = Config::parse(MIN.as_bytes()).unwrap();
        assert_eq!(c.images, ImagePricing::default());
        assert_eq!(c.pricing(), Pricing::new(256));
        let with = |p: &str| {
            format!(r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h",{p}}}"#)
        };
        let c = Config::parse(
            with(r#""images":{"enabled":true,"tokens":256,"pixels_per_token":0}"#).as_bytes(),
        )
        .unwrap();
        let want = ImagePricing {
            enabled: true,
            tokens: 256,
            pixels_per_token: 0,
        };
        assert_eq!(c.images, want);
        assert_eq!(c.pricing().images, want);
        for (json, field, why) in [
            (r#""images":{"tokens":-1}"#, "images.tokens", ""),
            (r#""images":{"enabled":1}"#, "images.enabled", ""),
            (
                r#""images":{"tokens":16385}"#,
                "images.tokens",
                "at most 16384",
            ),
            (r#""images":{"pixels":784}"#, "images.pixels", ""),
            (
                r#""images":{"pixels_per_token":"784"}"#,
                "images.pixels_per_token",
                "",
            ),
            (r#""images":784"#, "images", "JSON object"),
        ] {
            let e = Config::parse(with(json).as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(why), "{json}: {e}");
        }
    }

    #[test]
    fn prefix_parses_with_its_defaults_and_names_each_error() {
        let c = Config::parse(MIN.as_bytes()).unwrap();
        assert_eq!(c.prefix, PrefixConfig::default());
        assert!(c.prefix.enabled);
        let with = |p: &str| {
            format!(r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h",{p}}}"#)
        };
        let c = Config::parse(
            with(r#""prefix":{"enabled":false,"block_chars":64,"max_blocks":0,"blocks_per_node":9,"session_header":"x-session-id"}"#)
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(
            c.prefix,
            PrefixConfig {
                enabled: false,
                block_chars: 64,
                max_blocks: 0,
                blocks_per_node: 9,
                session_header: Some("x-session-id".into()),
            }
        );
        let cases = [
            (
                r#""prefix":{"enabled":"yes"}"#,
                "prefix.enabled",
                "true or false",
            ),
            (
                r#""prefix":{"block_chars":8}"#,
                "prefix.block_chars",
                "between 16",
            ),
            (
                r#""prefix":{"max_blocks":-1}"#,
                "prefix.max_blocks",
                "non-negative",
            ),
            (
                r#""prefix":{"blocks_per_node":0}"#,
                "prefix.blocks_per_node",
                "between 1",
            ),
            (
                r#""prefix":{"session_header":"X-Session"}"#,
                "prefix.session_header",
                "lower-case",
            ),
            (
                r#""prefix":{"hint":"x"}"#,
                "prefix.hint",
                "not a known field",
            ),
            (r#""prefix":true"#, "prefix", "JSON object"),
            (
                r#""prefix":{"session_header":"x-gateway-destination-endpoint"}"#,
                "prefix.session_header",
                "routing_header",
            ),
            (
                r#""debug_header":"x-tb","prefix":{"session_header":"x-tb"}"#,
                "prefix.session_header",
                "debug_header",
            ),
            (
                r#""explain":{"sources":["127.0.0.1"]},"prefix":{"session_header":"x-token-balancer-explain"}"#,
                "prefix.session_header",
                "explain.header",
            ),
        ];
        for (body, field, reason) in cases {
            let e = Config::parse(with(body).as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{body}");
            assert!(e.reason.contains(reason), "{body}: {}", e.reason);
        }
    }

    #[test]
    fn explain_parses_with_its_defaults() {
        let with = |e: &str| {
            format!(
                r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h","explain":{e}}}"#
            )
        };
        let c =
            Config::parse(with(r#"{"sources":["127.0.0.1/32","10.0.0.0/8","::1"]}"#).as_bytes())
                .unwrap();
        let e = c.explain.unwrap();
        assert_eq!(e.header, "x-token-balancer-explain");
        let shown: Vec<String> = e.sources.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["127.0.0.1/32", "10.0.0.0/8", "::1/128"]);
        assert!(!e.access_log);
        let c = Config::parse(with(r#"{"header":"x-why","access_log":true}"#).as_bytes()).unwrap();
        let e = c.explain.unwrap();
        assert_eq!(
            (e.header.as_str(), e.sources.len(), e.access_log),
            ("x-why", 0, true)
        );
    }

    #[test]
    fn admission_parses_with_its_defaults() {
        let c = Config::parse(MIN.as_bytes()).unwrap();
        assert_eq!(c.admission, AdmissionConfig::default());
        let a = &c.admission;
        assert_eq!(a.objective_header, "x-gateway-inference-objective");
        assert_eq!(a.fairness_header, "x-gateway-inference-fairness-id");
        assert_eq!(a.ttft_header, "x-slo-ttft-ms");
        assert_eq!(a.tpot_header, "x-slo-tpot-ms");
        assert!(a.objectives.is_empty() && a.priority_header.is_none());
        assert!(a.fairness_from_user);
        assert_eq!((a.reject_status, a.max_held_bytes), (429, 64 << 20));
        assert_eq!(a.when_full, WhenFull::Route);
        let c = Config::parse(
            br#"{"nodes":[{"address":"127.0.0.1:1"}],"health_cluster":"h","admission":{
                 "objectives":{"premium":100,"batch":-10},"priority_header":"x-priority",
                 "fairness_header":"x-tenant","fairness_from_user":false,"ttft_header":"x-ttft",
                 "reject_status":503,"max_held_bytes":1000,"when_full":"reject"}}"#,
        )
        .unwrap();
        let a = c.admission;
        let mut objectives = a.objectives.clone();
        objectives.sort();
        assert_eq!(
            objectives,
            vec![("batch".to_string(), -10), ("premium".to_string(), 100)]
        );
        assert_eq!(a.priority_header.as_deref(), Some("x-priority"));
        assert_eq!(
            (a.fairness_header.as_str(), a.fairness_from_user),
            ("x-tenant", false)
        );
        assert_eq!(a.ttft_header, "x-ttft");
        assert_eq!((a.reject_status, a.max_held_bytes), (503, 1000));
        assert_eq!(a.when_full, WhenFull::Reject);
    }

    /// Every rejected `admission` names its field, down to the objective at fault.
    #[test]
    fn each_admission_error_names_its_field() {
        let with = |a: &str| {
            format!(
                r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h","admission":{a}}}"#
            )
        };
        let cases = [
            (with("[]"), "admission", "JSON object"),
            (
                with(r#"{"fairness":"x"}"#),
                "admission.fairness",
                "not a known field",
            ),
            (
                with(r#"{"objectives":{"gold":"high"}}"#),
                "admission.objectives.gold",
                "integer priority",
            ),
            (
                with(r#"{"objectives":{"gold":2000000}}"#),
                "admission.objectives.gold",
                "integer priority",
            ),
            (
                with(r#"{"objectives":{"gold":1.5}}"#),
                "admission.objectives.gold",
                "integer priority",
            ),
            (
                with(r#"{"objectives":["gold"]}"#),
                "admission.objectives",
                "an object",
            ),
            (
                with(r#"{"short_lane_ms":100}"#),
                "admission.short_lane_ms",
                "must be below `admission.max_queued_ms`",
            ),
            (
                with(r#"{"max_queued_ms":500,"short_lane_ms":500}"#),
                "admission.short_lane_ms",
                "must be below `admission.max_queued_ms`",
            ),
            (
                with(r#"{"short_lane_ms":-1}"#),
                "admission.short_lane_ms",
                "non-negative integer",
            ),
            (
                with(r#"{"priority_header":"X-P"}"#),
                "admission.priority_header",
                "header name",
            ),
            (
                with(r#"{"ttft_header":""}"#),
                "admission.ttft_header",
                "header name",
            ),
            (
                with(r#"{"fairness_from_user":"yes"}"#),
                "admission.fairness_from_user",
                "true or false",
            ),
            (
                with(r#"{"when_full":"drop"}"#),
                "admission.when_full",
                "not a choice (route, reject)",
            ),
            (
                with(r#"{"when_full":true}"#),
                "admission.when_full",
                "string",
            ),
            (
                with(r#"{"reject_status":500}"#),
                "admission.reject_status",
                "429 or 503",
            ),
            (
                with(r#"{"max_held_bytes":-1}"#),
                "admission.max_held_bytes",
                "non-negative",
            ),
            (
                with(r#"{"ttft_header":"x-gateway-inference-fairness-id"}"#),
                "admission.ttft_header",
                "admission.fairness_header",
            ),
            (
                with(r#"{"priority_header":"x-slo-ttft-ms"}"#),
                "admission.priority_header",
                "admission.ttft_header",
            ),
            (
                with(r#"{"tpot_header":"x-slo-ttft-ms"}"#),
                "admission.tpot_header",
                "admission.ttft_header",
            ),
        ];
        for (json, field, why) in cases {
            let e = Config::parse(json.as_bytes()).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.reason.contains(why), "{json}: {e}");
        }
    }

    /// Every rejected `explain` names its field, down to the network at fault.
    #[test]
    fn each_explain_error_names_its_field() {
        let with = |e: &str| {
            format!(
                r#"{{"nodes":[{{"address":"127.0.0.1:1"}}],"health_cluster":"h","debug_header":"x-debug",{e}}}"#
            )
        };
        let many: Vec<String> = (0..65).map(|i| format!(r#""10.0.0.{i}""#)).collect();
        let cases: Vec<(String, &str, &str)> = vec![
            (
                with(r#""explain":{"sources":["10.0.0.0/33"]}"#),
                "explain.sources[0]",
                "0 to 32",
            ),
            (
                with(r#""explain":{"sources":["127.0.0.1/32","10.1.2.3/8"]}"#),
                "explain.sources[1]",
                "10.0.0.0/8",
            ),
            (
                with(r#""explain":{"sources":["localhost"]}"#),
                "explain.sources[0]",
                "not an IP network",
            ),
            (
                with(r#""explain":{"sources":["fd00::/200"]}"#),
                "explain.sources[0]",
                "0 to 128",
            ),
            (
                with(r#""explain":{"sources":[7]}"#),
                "explain.sources[0]",
                "string",
            ),
            (
                with(r#""explain":{"sources":"127.0.0.1/32"}"#),
                "explain.sources",
                "array",
            ),
            (
                with(&format!(r#""explain":{{"sources":[{}]}}"#, many.join(","))),
                "explain.sources",
                "at most 64",
            ),
            (
                with(r#""explain":{"header":"X-Explain","sources":["::1"]}"#),
                "explain.header",
                "header name",
            ),
            (
                with(r#""explain":{"header":"x explain","sources":["::1"]}"#),
                "explain.header",
                "header name",
            ),
            (
                with(r#""explain":{"header":"","sources":["::1"]}"#),
                "explain.header",
                "header name",
            ),
            (
                with(r#""explain":{"header":"x-debug","sources":["::1"]}"#),
                "explain.header",
                "debug_header",
            ),
            (
                with(r#""explain":{"header":"x-gateway-destination-endpoint","sources":["::1"]}"#),
                "explain.header",
                "routing_header",
            ),
            (
                with(r#""explain":{"sources":["::1"],"from":["::1"]}"#),
                "explain.from",
                "not a known field",
            ),
            (
                with(r#""explain":{"sources":["::1"],"access_log":"yes"}"#),
                "explain.access_log",
                "true or false",
            ),
            (with(r#""explain":{}"#), "explain", "explains nothing"),
            (
                with(r#""explain":{"sources":[]}"#),
                "explain",
                "explains nothing",
            ),
            (with(r#""explain":true"#), "explain", "JSON object"),
        ];
        for (json, field, says) in cases {
            let e = Config::parse(json.as_bytes()).expect_err(&json);
            assert_eq!(e.field, field, "config {json}: {e}");
            assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
            assert!(e.reason.contains(says), "config {json}: {e}");
        }
    }

    #[test]
    fn ip_port_forms() {
        for (s, ok) in [
            ("127.0.0.1:80", true),
            ("[::1]:80", true),
            ("::1:80", false),
            ("host:80", false),
            ("1.2.3.4:65536", false),
            ("1.2.3.4:", false),
            (":80", false),
        ] {
            assert_eq!(is_ip_port(s), ok, "{s}");
        }
    }
}
