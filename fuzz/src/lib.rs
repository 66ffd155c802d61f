//! The fuzz targets of token-balancer, one function per target, each taking the raw fuzz input
//! and panicking (through `assert!`) when an invariant of the code under test breaks.
//!
//! These functions are used twice: by the libFuzzer binaries in `fuzz/fuzz_targets/` (run with
//! `cargo fuzz run <target>`, see fuzz/README.md), and by the core crate's corpus replay test
//! `core/tests/fuzz_corpus.rs`, which includes this file as a module (`#[path]`) and runs every
//! committed corpus file through the same function on stable Rust in `cargo test`. So this file
//! must only use `std`, `serde_json` and `token_balancer_core`, the dependencies both sides have.
//!
//! The invariants asserted are the ones the code documents (module comments and
//! docs/CONFIGURATION.md); where a bound is a private constant of `core/src/`, it is repeated
//! here with the place it comes from.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use serde_json::{json, Value};
use token_balancer_core::config::{is_ip_port, Config, NodeConfig, Poller, UnknownModel};
use token_balancer_core::ingest::engine::{self, Health, HealthFormat};
use token_balancer_core::ingest::image::MAX_IMAGE_TOKENS;
use token_balancer_core::ingest::prometheus::parse_prometheus_samples;
use token_balancer_core::ingest::prompt::MAX_BLOCKS;
use token_balancer_core::ingest::rates::Tracker;
use token_balancer_core::ingest::request::{estimate, read_with_chain, Api, Pricing, Weight};
use token_balancer_core::ingest::response::OutputMeter;
use token_balancer_core::ingest::stored::{self, IdScan};
use token_balancer_core::ingest::telemetry::{parse_health, Report, ABSURD};

/// A fuzz target: takes any bytes, panics when an invariant breaks.
pub type Target = fn(&[u8]);

/// The fuzz targets by name, as `cargo fuzz` knows them (and as their corpus folders are named).
pub const TARGETS: &[(&str, Target)] = &[
    ("request_body", request_body),
    ("health_json", health_json),
    ("config", config),
    ("response_usage", response_usage),
    ("prometheus_text", prometheus_text),
];

/// Request paths the first input byte chooses from: every API the estimator knows, with the
/// variants the filter sees in practice (prefixes, query strings), and unknown paths.
const PATHS: [&str; 16] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/messages",
    "/generate",
    "/v1/chat/completions?stream=true",
    "/openai/v1/embeddings",
    "/v1/responses",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/generate_stream",
    "/inference/v1/generate",
    "/completion",
    "/v1/responses/input_tokens",
    "/api/unknown",
    "/v1/completions?x=1",
];

/// `default_max_tokens` values the first input byte chooses from (the configuration accepts any
/// u64, including 0 and the maximum).
const DEFAULT_MAX_TOKENS: [u64; 4] = [256, 0, 1, u64::MAX];

/// `request::MAX_OUTPUT_TOKENS` (core/src/ingest/request.rs): the clamp on any output cap taken from a body.
const MAX_OUTPUT_TOKENS: u64 = 1 << 24;
/// `request::MAX_N` (core/src/ingest/request.rs): the clamp on `n`.
const MAX_N: u64 = 128;
/// `request::MAX_BATCH` (core/src/ingest/request.rs): the clamp on a batch's prompts.
const MAX_BATCH: u64 = 1 << 16;
/// `request::GENERATE_PROMPTS` (core/src/ingest/request.rs): where a native generate body keeps
/// its prompt, read on `Api::Generate` paths only.
const GENERATE_PROMPTS: [&str; 4] = ["text", "input_ids", "token_ids", "inputs"];
/// `request::OUTPUT_CAPS` (core/src/ingest/request.rs), as JSON pointers: where a body that is
/// not the Responses API's caps its output.
const OUTPUT_CAPS: [&str; 6] = [
    "/max_completion_tokens",
    "/max_tokens",
    "/n_predict",
    "/sampling_params/max_new_tokens",
    "/sampling_params/max_tokens",
    "/parameters/max_new_tokens",
];
/// `request::PER_MESSAGE_OVERHEAD` (core/src/ingest/request.rs): template tokens added per message.
const PER_MESSAGE_OVERHEAD: u64 = 4;
/// `request::RESPONSES_ONLY` (core/src/ingest/request.rs): the fields that make a body with
/// `input` on a path that names no API the Responses API's rather than embeddings'.
const RESPONSES_ONLY: [&str; 3] = ["instructions", "max_output_tokens", "previous_response_id"];

/// Request body estimation. Input: one byte that chooses the request path (low 4 bits) and the
/// configured `default_max_tokens` (next 2 bits), then the body.
pub fn request_body(data: &[u8]) {
    let Some((&choice, body)) = data.split_first() else {
        return;
    };
    let path = PATHS[usize::from(choice & 15)];
    let default_max_tokens = DEFAULT_MAX_TOKENS[usize::from((choice >> 4) & 3)];
    let api = Api::from_path(path);
    let got = estimate(api, body, default_max_tokens);

    // Deterministic, and blind to insignificant JSON whitespace around the value.
    assert_eq!(got, estimate(api, body, default_max_tokens));
    let mut padded = b" \n\t".to_vec();
    padded.extend_from_slice(body);
    padded.extend_from_slice(b"\r\n ");
    assert_eq!(
        got,
        estimate(api, &padded, default_max_tokens),
        "whitespace"
    );

    // Total over arbitrary paths too (the filter passes any `:path` header).
    let _ = Api::from_path(&String::from_utf8_lossy(body));

    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let Some(w) = got else {
        return;
    };
    // Only a JSON object body yields an estimate.
    let obj = parsed
        .as_ref()
        .and_then(Value::as_object)
        .expect("an estimate from a body that is not a JSON object");
    if api == Api::Count {
        // Counting a prompt weighs nothing and has no chain, whatever the body holds.
        assert_eq!(w, Weight::default(), "a count with a weight");
        let e = read_with_chain(api, body, &Pricing::new(default_max_tokens), Some(16)).unwrap();
        assert!(e.chain.is_empty(), "a count with a chain");
        return;
    }
    assert!(
        obj.contains_key("messages")
            || obj.contains_key("prompt")
            || obj.contains_key("input")
            || (api == Api::Generate && GENERATE_PROMPTS.iter().any(|k| obj.contains_key(*k))),
        "an estimate from a body with no prompt"
    );
    check_weight(api, obj, w, default_max_tokens, body);
    check_chain(api, body, default_max_tokens, w);
}

/// The prefix chain read in the same parse (`ingest::prompt`): the same weight as without it,
/// at most `MAX_BLOCKS` blocks, no more full blocks than the rendered characters hold, a
/// priced match never the whole prompt, and the same chain for the same body.
fn check_chain(api: Api, body: &[u8], default_max_tokens: u64, w: Weight) {
    for block in [16usize, 256] {
        let e = read_with_chain(api, body, &Pricing::new(default_max_tokens), Some(block))
            .expect("a body with a weight has one with a chain too");
        assert_eq!(e.weight, w, "the chain changed the weight");
        let c = &e.chain;
        assert!(c.blocks.len() <= MAX_BLOCKS);
        assert!(
            (c.blocks.len() as u64).saturating_mul(block as u64) <= c.rendered,
            "{} blocks of {block} from {} characters",
            c.blocks.len(),
            c.rendered
        );
        for m in [0, c.blocks.len()] {
            assert!(c.cached(m, w.prompt_tokens) <= w.prompt_tokens.saturating_sub(1));
        }
        assert_eq!(
            Some(e.chain.clone()),
            read_with_chain(api, body, &Pricing::new(default_max_tokens), Some(block))
                .map(|e| e.chain)
        );
    }
}

/// Objects anywhere in `v` whose `type` names an image part (`request::Part::Image`).
fn image_parts(v: &Value) -> u64 {
    match v {
        Value::Array(items) => items.iter().map(image_parts).sum(),
        Value::Object(o) => {
            let own = matches!(
                o.get("type").and_then(Value::as_str),
                Some("image_url" | "input_image" | "image")
            );
            u64::from(own) + o.values().map(image_parts).sum::<u64>()
        }
        _ => 0,
    }
}

fn check_weight(
    api: Api,
    obj: &serde_json::Map<String, Value>,
    w: Weight,
    default_max_tokens: u64,
    body: &[u8],
) {
    // The documented clamps: output at most MAX_OUTPUT_TOKENS times MAX_N times MAX_BATCH,
    // never an overflow.
    assert!(
        w.output_tokens <= MAX_OUTPUT_TOKENS * MAX_N * MAX_BATCH,
        "output {} over the clamp",
        w.output_tokens
    );
    assert_eq!(w.total(), w.prompt_tokens + w.output_tokens);
    // A prompt token needs at least one character of the body, and a message at least one
    // byte, worth PER_MESSAGE_OVERHEAD tokens; an image part (its `type` names an image) is
    // at most MAX_IMAGE_TOKENS: the prompt estimate is bounded by the size.
    let json = Value::Object(obj.clone());
    let images = image_parts(&json);
    let body_len = body.len() as u64;
    assert!(
        w.prompt_tokens <= PER_MESSAGE_OVERHEAD * body_len + MAX_IMAGE_TOKENS * images,
        "prompt {} from {body_len} bytes and {images} images",
        w.prompt_tokens
    );
    // The prompt is in `input` when there are no `messages` (a list), no `prompt` and (on a
    // native generate path) none of its names; then it is the Responses API's on its path, or
    // elsewhere (but embeddings') with one of its own fields, and embeddings' otherwise.
    let native = (api == Api::Generate)
        .then(|| GENERATE_PROMPTS.iter().find_map(|k| obj.get(*k)))
        .flatten();
    let in_input = !obj.get("messages").is_some_and(Value::is_array)
        && !obj.contains_key("prompt")
        && native.is_none()
        && obj.contains_key("input");
    let responses_fields = RESPONSES_ONLY.iter().any(|k| obj.contains_key(*k));
    let responses = in_input && (api == Api::Responses || (api == Api::Other && responses_fields));
    let is_embedding = api == Api::Embeddings || (in_input && !responses);
    if is_embedding {
        assert_eq!(w.output_tokens, 0, "an embedding decodes nothing");
        return;
    }
    // Without any cap in the body the configured default applies, clamped, times n (<= 128;
    // the Responses API has no `n`) and times a batch's prompts.
    let caps: &[&str] = if responses {
        &["/max_output_tokens"]
    } else {
        &OUTPUT_CAPS
    };
    let has_cap = caps.iter().any(|k| {
        json.pointer(k)
            .and_then(Value::as_f64)
            .is_some_and(|f| f >= 1.0)
    });
    if !has_cap {
        let cap = default_max_tokens.min(MAX_OUTPUT_TOKENS);
        assert!(
            w.output_tokens % cap.max(1) == 0
                && w.output_tokens <= cap.saturating_mul(MAX_N * MAX_BATCH),
            "output {} without a cap, default {default_max_tokens}",
            w.output_tokens
        );
        // One sequence of one prompt: no `n` of any name, and a prompt that is no list.
        let several = ["/n", "/sampling_params/n", "/parameters/best_of"]
            .iter()
            .any(|k| json.pointer(k).is_some());
        let list = obj.get("prompt").or(native).is_some_and(Value::is_array);
        if responses || (!several && !list) {
            assert_eq!(w.output_tokens, cap, "default cap, n = 1");
        }
    }
}

/// A value a health report may hold: finite, non-negative, below the "absurd" limit
/// (`telemetry::ABSURD`, 1e15).
fn sane(x: f64) -> bool {
    (0.0..ABSURD).contains(&x)
}

/// Health answer parsing (the seed JSON format).
pub fn health_json(data: &[u8]) {
    let got = parse_health(data);
    let mut padded = b"\n ".to_vec();
    padded.extend_from_slice(data);
    padded.extend_from_slice(b" \t");
    assert_eq!(got, parse_health(&padded), "whitespace");
    let Ok(r) = got else {
        return;
    };
    let Report {
        load_tokens_per_sec,
        capacity_tokens_per_sec,
        vram_used_bytes,
        vram_total_bytes,
        kv_cache_usage,
        queue_depth,
        running_requests,
        kv_cache_tokens,
        sustained_tokens_per_sec,
    } = r;
    assert!(sane(load_tokens_per_sec), "load {load_tokens_per_sec}");
    for (name, v) in [
        ("capacity", capacity_tokens_per_sec),
        ("vram_used", vram_used_bytes),
        ("vram_total", vram_total_bytes),
        ("kv_cache_usage", kv_cache_usage),
        ("queue_depth", queue_depth),
        ("running_requests", running_requests),
        ("kv_cache_tokens", kv_cache_tokens),
        ("sustained", sustained_tokens_per_sec),
    ] {
        if let Some(x) = v {
            assert!(sane(x), "{name} {x}");
        }
    }
    assert!(capacity_tokens_per_sec.map_or(true, |c| c > 0.0));
    assert!(kv_cache_usage.map_or(true, |u| u <= 1.0));
    // VRAM bytes come as a pair, with a positive total.
    assert_eq!(vram_used_bytes.is_some(), vram_total_bytes.is_some());
    assert!(vram_total_bytes.map_or(true, |t| t > 0.0));
    // A report is only ever made from a JSON object.
    let v: Value = serde_json::from_slice(data).expect("a report from a body that is not JSON");
    assert!(v.is_object());
}

fn lower_header_name(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Plugin configuration parsing and validation.
pub fn config(data: &[u8]) {
    let got = Config::parse(data);
    // Whitespace around the JSON changes nothing but positions in a JSON error message.
    let mut padded = b" \n".to_vec();
    padded.extend_from_slice(data);
    padded.push(b'\n');
    match (&got, Config::parse(&padded)) {
        (Ok(a), Ok(b)) => assert_eq!(*a, b, "whitespace"),
        (Err(a), Err(b)) => assert_eq!(a.field, b.field, "whitespace"),
        (a, b) => panic!("whitespace changed the outcome: {a:?} vs {b:?}"),
    }
    let c = match got {
        Ok(c) => c,
        Err(e) => {
            // Every error names a field and a reason, and says both. The one empty field name
            // is an unknown top-level key that is itself empty (`{"": 1}`): the error then
            // names exactly what the configuration said.
            assert!(!e.reason.is_empty(), "{e:?}");
            assert!(
                !e.field.is_empty() || e.reason.starts_with("is not a known field"),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(
                text.contains(&e.field) && text.contains(&e.reason),
                "{text}"
            );
            return;
        }
    };
    // The invariants docs/CONFIGURATION.md documents.
    assert!(
        !c.nodes.is_empty() || c.membership.is_some(),
        "no node and no membership"
    );
    for (i, n) in c.nodes.iter().enumerate() {
        assert!(is_ip_port(&n.address), "{:?}", n.address);
        assert!(
            c.nodes[..i].iter().all(|m| m.address != n.address),
            "{:?} listed twice",
            n.address
        );
        assert!(n.health_path().starts_with('/'), "{:?}", n.health_path);
        assert!(is_ip_port(n.health_target()), "{:?}", n.health_target());
        assert!(n
            .capacity_tokens_per_sec
            .map_or(true, |x| x.is_finite() && x > 0.0));
        assert_ne!(n.kv_cache_tokens, Some(0));
    }
    assert!(!c.health_cluster.is_empty());
    assert!(c.tick_ms >= 10, "tick_ms {}", c.tick_ms);
    assert!(c.health_timeout_ms > 0);
    assert!(c.stale_after_ms > c.tick_ms, "stale_after_ms <= tick_ms");
    assert!(c.max_body_bytes > 0);
    assert!(
        c.vram_ceiling > 0.0 && c.vram_ceiling <= 1.0,
        "vram_ceiling {}",
        c.vram_ceiling
    );
    assert!(c.kv_bytes_per_token > 0);
    assert!(c.max_hosts_in_header > 0);
    assert!(lower_header_name(&c.routing_header));
    assert!(lower_header_name(&c.health_target_header));
    assert!(c.debug_header.as_deref().map_or(true, lower_header_name));
    assert!(c
        .beliefs_path
        .as_deref()
        .map_or(true, |p| p.starts_with('/')));
    if let Some(e) = &c.explain {
        assert!(lower_header_name(&e.header));
        assert_ne!(e.header, c.routing_header);
        assert_ne!(Some(&e.header), c.debug_header.as_ref());
        assert!(
            !e.sources.is_empty() || e.access_log,
            "an explain that explains nothing"
        );
        assert!(e.sources.len() <= token_balancer_core::config::MAX_EXPLAIN_SOURCES);
    }

    // Written back out with every field explicit, the configuration parses to itself.
    let again = Config::parse(to_json(&c).to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{c:?} written out does not parse again: {e}"));
    assert_eq!(strip_floats(&again), strip_floats(&c));
    assert!(close(again.vram_ceiling, c.vram_ceiling));
    assert!(close(again.hold_kv_ceiling, c.hold_kv_ceiling));
    for (a, b) in again.nodes.iter().zip(&c.nodes) {
        match (a.capacity_tokens_per_sec, b.capacity_tokens_per_sec) {
            (Some(x), Some(y)) => assert!(close(x, y), "{x} vs {y}"),
            (x, y) => assert_eq!(x, y),
        }
    }
}

/// Equal up to the last bits: serde_json (without its `float_roundtrip` feature, which the
/// filter does not use) may parse a float it printed one unit in the last place away.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= a.abs().max(b.abs()) * 1e-14
}

fn strip_floats(c: &Config) -> Config {
    let mut c = c.clone();
    c.vram_ceiling = 0.0;
    c.hold_kv_ceiling = 0.0;
    if let Some(m) = &mut c.membership {
        let d = &mut m.node_defaults;
        d.capacity_tokens_per_sec = d.capacity_tokens_per_sec.map(|_| 0.0);
    }
    for n in &mut c.nodes {
        n.capacity_tokens_per_sec = n.capacity_tokens_per_sec.map(|_| 0.0);
    }
    c
}

fn node_json(n: &NodeConfig) -> Value {
    json!({
        "address": n.address,
        "health_path": n.health_path,
        "health_address": n.health_address,
        "capacity_tokens_per_sec": n.capacity_tokens_per_sec,
        "kv_cache_tokens": n.kv_cache_tokens,
        "format": n.format.name(),
        "models": n.models,
    })
}

/// The configuration with every field written out, so that a field left out here is a field
/// whose value the round trip would silently reset to its default.
fn to_json(c: &Config) -> Value {
    let nodes: Vec<Value> = c.nodes.iter().map(node_json).collect();
    let policy = match c.policy {
        token_balancer_core::config::Rule::TokenThroughput => "token_throughput",
        token_balancer_core::config::Rule::LeastReportedLoad => "least_reported_load",
        token_balancer_core::config::Rule::GatewayProfile => "gateway_profile",
    };
    let unknown_model = match c.unknown_model {
        UnknownModel::Fallback => "fallback",
        UnknownModel::Reject => "reject",
    };
    let choices = match c.choices {
        token_balancer_core::config::Choices::Auto => json!("auto"),
        token_balancer_core::config::Choices::Fixed(d) => json!(d),
    };
    let poller = match c.poller {
        Poller::Vm => "vm",
        Poller::Singleton => "singleton",
    };
    let mut out = json!({
        "nodes": nodes,
        "health_cluster": c.health_cluster,
        "health_target_header": c.health_target_header,
        "tick_ms": c.tick_ms,
        "health_timeout_ms": c.health_timeout_ms,
        "stale_after_ms": c.stale_after_ms,
        "routing_header": c.routing_header,
        "max_body_bytes": c.max_body_bytes,
        "vram_ceiling": c.vram_ceiling,
        "default_max_tokens": c.default_max_tokens,
        "kv_bytes_per_token": c.kv_bytes_per_token,
        "max_hosts_in_header": c.max_hosts_in_header,
        "policy": policy,
        "choices": choices,
        "max_hold_ms": c.max_hold_ms,
        "max_held_requests": c.max_held_requests,
        "hold_kv_ceiling": c.hold_kv_ceiling,
        "unhealthy_after_failures": c.unhealthy_after_failures,
        "healthy_after_successes": c.healthy_after_successes,
        "models_poll_ms": c.models_poll_ms,
        "unknown_model": unknown_model,
        "poller": poller,
        "prefix": {
            "enabled": c.prefix.enabled,
            "block_chars": c.prefix.block_chars,
            "max_blocks": c.prefix.max_blocks,
            "blocks_per_node": c.prefix.blocks_per_node,
            "session_header": c.prefix.session_header,
        },
    });
    // Optional fields are absent rather than null: the parser takes null as a wrong type.
    if let Some(h) = &c.debug_header {
        out["debug_header"] = json!(h);
    }
    if let Some(p) = &c.beliefs_path {
        out["beliefs_path"] = json!(p);
    }
    if let Some(e) = &c.explain {
        let sources: Vec<String> = e.sources.iter().map(ToString::to_string).collect();
        out["explain"] = json!({
            "header": e.header,
            "sources": sources,
            "access_log": e.access_log,
        });
    }
    if let Some(m) = &c.membership {
        let mut d = node_json(&m.node_defaults);
        if let Some(obj) = d.as_object_mut() {
            obj.remove("address");
            obj.remove("health_address");
        }
        out["membership"] = json!({
            "cluster": m.cluster,
            "admin_cluster": m.admin_cluster,
            "poll_ms": m.poll_ms,
            "node_defaults": d,
        });
    }
    strip_nulls(&mut out);
    out
}

fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.retain(|_, x| !x.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(list) => list.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// A meter fed `chunks` in order; the running count must never go back between them.
fn meter(chunks: &[&[u8]]) -> OutputMeter {
    let mut m = OutputMeter::new();
    let mut last = 0;
    for c in chunks {
        m.feed(c);
        assert!(m.progress() >= last, "progress went back");
        last = m.progress();
    }
    m
}

/// What a meter tells the filter: the running count and the sample.
fn told(m: &OutputMeter) -> (u64, Option<u64>, Option<u64>) {
    (
        m.progress(),
        m.finish(true, true),
        m.prompt_reported(true, true),
    )
}

/// The response body metered as Envoy may hand it over: the input is the whole body, cut into
/// chunks at boundaries derived from it.
pub fn response_usage(data: &[u8]) {
    let metered = meter(&[data]);
    let whole = told(&metered);

    // Chunk boundaries change nothing: at one point, byte by byte, in chunks whose sizes the
    // bytes themselves give (1 to 32), with empty chunks between.
    let sum = data.iter().fold(0usize, |acc, &b| {
        acc.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    let (a, b) = data.split_at(sum % (data.len() + 1));
    assert_eq!(told(&meter(&[a, b])), whole, "split at {}", a.len());
    let bytes: Vec<&[u8]> = data.chunks(1).collect();
    assert_eq!(told(&meter(&bytes)), whole, "byte by byte");
    let mut chunks: Vec<&[u8]> = Vec::new();
    let mut rest = data;
    let mut sizes = data.iter().cycle();
    while !rest.is_empty() {
        let size = 1 + usize::from(sizes.next().copied().unwrap_or(0) % 32);
        let (c, r) = rest.split_at(size.min(rest.len()));
        chunks.extend([c, &[][..]]);
        rest = r;
    }
    assert_eq!(told(&meter(&chunks)), whole, "in chunks");

    // The stored response's id reads the same whatever the chunks, is an id, and is in the
    // answer's first bytes.
    let id_of = |chunks: &[&[u8]]| {
        let mut scan = IdScan::new();
        for c in chunks {
            scan.feed(c);
        }
        scan.end();
        assert!(!scan.wants());
        scan.id().map(str::to_string)
    };
    let id = id_of(&[data]);
    assert_eq!(id_of(&[a, b]), id, "id split at {}", a.len());
    assert_eq!(id_of(&bytes), id, "id byte by byte");
    assert_eq!(id_of(&chunks), id, "id in chunks");
    if let Some(id) = &id {
        assert!(stored::valid_id(id.as_bytes()), "{id:?}");
        let head = data.get(..stored::ID_WITHIN).unwrap_or(data);
        assert!(head.windows(id.len()).any(|w| w == id.as_bytes()));
    }

    // Followed as the filter does, chunks of a learned size counted unread: the count still
    // never goes back, and the last chunk is always read.
    let mut followed = OutputMeter::new();
    let mut last = 0;
    for (i, c) in chunks.iter().enumerate() {
        let end = i + 1 == chunks.len();
        if followed.may_skim(c.len(), end) {
            assert!(!end, "the last chunk skimmed");
            followed.skim();
        } else {
            followed.feed(c);
        }
        assert!(
            followed.progress() >= last,
            "progress went back when followed"
        );
        last = followed.progress();
    }

    // The sample rule: only from a 200 read to its end, and never of 0 tokens.
    assert_eq!(metered.finish(false, true), None);
    assert_eq!(metered.finish(true, false), None);
    let sample = metered.finish(true, true);
    assert_ne!(sample, Some(0));

    // Each content event needs its own `"text":"` and a byte of content, 9 bytes at least.
    let has = |k: &[u8]| data.windows(k.len()).any(|w| w == k);
    let count_key = has(b"\"completion_tokens\"") || has(b"\"output_tokens\"");
    let first = data
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n' | 0xEF | 0xBB | 0xBF));
    let reply = matches!(first, Some(b'{' | b'['));
    if !count_key {
        let len = data.len() as u64;
        assert!(
            metered.progress() <= len / 9,
            "{} events in {len} bytes",
            metered.progress()
        );
        // A JSON answer's output is known only from a count.
        if reply {
            assert_eq!(sample, None, "a sample from a reply without a count");
            assert_eq!(metered.progress(), 0);
        }
    }

    // A comma ends whatever key or value the body ended in; after it, one content event more
    // adds one to a stream's running count (or nothing, when a count is higher) and nothing to
    // a JSON answer's.
    let with = |tail: &[u8]| {
        let mut more = data.to_vec();
        more.extend_from_slice(tail);
        meter(&[&more])
    };
    let ended = with(b",").progress();
    let more = with(b",\"content\":\"x\"").progress();
    if reply {
        assert_eq!(more, ended, "an event counted in a reply");
    } else {
        assert!(
            (ended..=ended.saturating_add(1)).contains(&more),
            "{ended} then {more}"
        );
    }

    // A count reported after everything else is the sample.
    let n = data
        .iter()
        .take(8)
        .fold(0u64, |acc, &b| acc << 8 | u64::from(b));
    let last = with(format!(",\"output_tokens\": {n}}}").as_bytes());
    assert_eq!(last.finish(true, true), (n > 0).then_some(n));
    assert!(last.progress() >= n);

    // llama.cpp's timings at the end count the prompt, unless a usage count of it came first;
    // they move neither the output count nor its sample.
    let (computed, cached) = (n & 0xffff, n >> 48);
    let timed =
        with(format!(",\"timings\":{{\"cache_n\":{cached},\"prompt_n\":{computed}}}").as_bytes());
    // The usage's count alone: timings that computed nothing count no prompt.
    let usage = with(b",\"prompt_n\":0,").prompt_reported(true, true);
    let from_timings = (computed > 0).then_some(computed + cached);
    assert_eq!(
        timed.prompt_reported(true, true),
        usage.or(from_timings),
        "{usage:?} then timings {cached} + {computed}"
    );
    assert_eq!(
        (timed.progress(), timed.finish(true, true)),
        (ended, with(b",").finish(true, true))
    );
}

/// The report invariants any health answer must meet once turned into a `Report`: every number
/// finite, non-negative and below the absurd limit; usage a fraction.
fn sane_report(r: &Report) {
    assert!(sane(r.load_tokens_per_sec), "{r:?}");
    for x in [
        r.capacity_tokens_per_sec,
        r.vram_used_bytes,
        r.vram_total_bytes,
        r.kv_cache_usage,
        r.queue_depth,
        r.running_requests,
        r.kv_cache_tokens,
    ]
    .into_iter()
    .flatten()
    {
        assert!(sane(x), "{r:?}");
    }
    assert!(r.kv_cache_usage.map_or(true, |u| u <= 1.0), "{r:?}");
}

/// Prometheus text (src/prometheus.rs) and what each engine's mapping (src/engine.rs) and the
/// counter-rate tracker (src/throughput.rs) make of it.
pub fn prometheus_text(data: &[u8]) {
    let mut samples = parse_prometheus_samples(data);
    let mut n = 0usize;
    for s in samples.by_ref() {
        n += 1;
        assert!(!s.name.is_empty(), "a sample without a name");
        assert!(
            s.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "metric name {:?}",
            s.name
        );
        for (k, v) in s.labels.iter() {
            assert!(!k.is_empty());
            let _ = v.unescaped();
            let _ = v.as_f64();
        }
    }
    assert!(n + samples.skipped() <= data.split(|b| *b == b'\n').count());
    // CRLF line ends read the same samples.
    if !data.contains(&b'\r') {
        let crlf: Vec<u8> = data
            .split(|b| *b == b'\n')
            .collect::<Vec<_>>()
            .join(&b"\r\n"[..]);
        assert_eq!(parse_prometheus_samples(&crlf).count(), n, "CRLF");
    }
    for format in [
        HealthFormat::Auto,
        HealthFormat::Vllm,
        HealthFormat::Sglang,
        HealthFormat::Tgi,
        HealthFormat::Trtllm,
        HealthFormat::LlamaCpp,
    ] {
        match engine::read(format, data) {
            Ok(Health::Engine(scrape)) => {
                let mut tracker = Tracker::default();
                for (t, kv) in [(0, None), (1_000, Some(1000)), (2_000, None)] {
                    sane_report(&tracker.observe(&scrape, t, kv));
                }
            }
            Ok(Health::Seed(report)) => sane_report(&report),
            Err(_) => {}
        }
    }
}
