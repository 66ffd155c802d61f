//! Which models a node serves: the set a request's `model` narrows the candidates to.
//!
//! A fleet often serves several models, and a vLLM node also serves LoRA adapters, which a
//! client asks for by putting the adapter's name in `model`. A request sent to a node that does
//! not serve its model fails there with 404 `model_not_found`, so the choice must only rank the
//! nodes that serve it. Three sources say what a node serves, in order of authority:
//!
//! 1. `nodes[].models` in the configuration: when set, it is the whole truth for that node and
//!    nothing learned overrides it (the operator knows about aliases and adapters loaded later;
//!    the filter does not poll such a node's list).
//! 2. The node's `GET /v1/models` list (OpenAI `{"data":[{"id":...}]}`), polled now and then:
//!    the complete set at the time it was taken, base models and registered adapters alike.
//!    The last good list stays until a new good one replaces it; a failed or unreadable poll
//!    changes nothing.
//! 3. vLLM's metrics, read on every health poll anyway: the `model_name` label of its series
//!    and the adapters of `vllm:lora_requests_info` (`running_lora_adapters`,
//!    `waiting_lora_adapters`). These only ever add: they name the first served name and the
//!    adapters in use, never the whole set, so they cannot tell that a node does *not* serve a
//!    name. What they add on top of a list is an adapter loaded at runtime (vLLM's
//!    `/v1/load_lora_adapter`) before the next list poll shows it; a new list clears them, since
//!    it is complete as of its own time.
//!
//! What a list means depends on the engine behind it, known from its metrics' names. vLLM
//! serves exactly the names it lists (others: 404 `model_not_found`). SGLang, TGI,
//! trtllm-serve and llama.cpp serve their one model whatever the request's `model` says
//! (SGLang's maintainers call the field OpenAI compatibility only; llama.cpp lists its
//! `--model` file's path unless given `--alias`, and answers any name under that id). For such
//! a node a name it does not list is `Serves::AnyName`: a candidate when no node of the fleet
//! names the model (clients asking llama.cpp for "gpt-4o", or for "llama" when it lists a file
//! path), not when some node does (a fleet serving several models must not send one model's
//! requests to another model's node). A configured set stays exact whatever the engine.
//!
//! The same list carries llama.cpp's per-slot context (`data[].meta.n_ctx`): a prompt longer
//! than that is refused with 400 before any work, so the choice leaves such a node out for it
//! (`context_tokens`). A llama.cpp node's list is asked for that even when its names are
//! configured.
//!
//! A node whose set is not known (no configuration, no good list yet) is a candidate for any
//! model: refusing it would turn a transient polling failure, or a node that serves no list,
//! into lost capacity or rejected requests, while routing to it costs at worst the 404 the
//! node answers itself, which is what Envoy's own balancer would have risked anyway. Metrics
//! alone do not change that (see 3). A model is unknown only when every node is known not to
//! serve it.
//!
//! Names are matched exactly (vLLM compares them so), by a linear scan: a node serves a few
//! to a few tens of names, where a scan beats hashing and allocates nothing.

use crate::ingest::engine::Engine;
use serde_json::Value;
use std::fmt;

/// Most names kept per node and per source: a list longer than this is cut (a node serving
/// hundreds of adapters still gets the first of them; the rest are treated as not served only
/// if the list was complete, so the cut is logged by the caller through the count).
pub const MAX_MODELS_PER_NODE: usize = 256;
/// Longest name kept; a longer id is skipped (no engine names a model with kilobytes).
pub const MAX_MODEL_NAME_BYTES: usize = 512;

/// Whether a node serves a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serves {
    Yes,
    No,
    /// The node's set is not known: a candidate anyway (see the module comment).
    Unknown,
    /// The node does not list it, but its engine serves any name: a candidate when no node
    /// names the model (see the module comment).
    AnyName,
}

/// Whether an engine serves its model under any name a request gives (see the module
/// comment): all but vLLM.
pub fn serves_any_name(engine: Engine) -> bool {
    engine != Engine::Vllm
}

/// What is known about one node's served models.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServedModels {
    /// `nodes[].models`: authoritative when set.
    configured: Option<Vec<String>>,
    /// The last good `/v1/models` list.
    listed: Option<Vec<String>>,
    /// Names seen in the node's metrics since that list (or ever, while there is none).
    seen: Vec<String>,
    /// The node's engine serves any name (see `serves_any_name`).
    any_name: bool,
    /// The per-slot context the last good list gives, tokens (llama.cpp's `meta.n_ctx`).
    context_tokens: Option<u64>,
    /// The node's engine lists its context (llama.cpp): its list is asked even when its
    /// names are configured.
    lists_context: bool,
}

impl ServedModels {
    /// A node whose set is configured: exactly `names`, whatever is learned later.
    pub fn configured(names: Vec<String>) -> Self {
        ServedModels {
            configured: Some(names),
            ..ServedModels::default()
        }
    }

    pub fn is_configured(&self) -> bool {
        self.configured.is_some()
    }

    /// The last good `/v1/models` list, if any.
    pub fn listed(&self) -> Option<&[String]> {
        self.listed.as_deref()
    }

    /// Names learned from metrics and not (yet) in a list.
    pub fn seen(&self) -> &[String] {
        &self.seen
    }

    pub fn serves(&self, model: &str) -> Serves {
        let has = |names: &[String]| names.iter().any(|n| n == model);
        if let Some(names) = &self.configured {
            return if has(names) { Serves::Yes } else { Serves::No };
        }
        if has(&self.seen) {
            return Serves::Yes;
        }
        match &self.listed {
            Some(names) if has(names) => Serves::Yes,
            Some(_) if self.any_name => Serves::AnyName,
            Some(_) => Serves::No,
            None => Serves::Unknown,
        }
    }

    /// Every name the node is known to serve by name: configured, listed, seen.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let (first, second): (&[String], &[String]) = match &self.configured {
            Some(c) => (c, &[]),
            None => (self.listed.as_deref().unwrap_or_default(), &self.seen),
        };
        first.iter().chain(second).map(String::as_str)
    }

    /// Whether the node's engine serves any name (see `serves_any_name`).
    pub fn any_name(&self) -> bool {
        self.any_name
    }

    /// The node's engine is now known (its metrics' names): whether it serves any name, and
    /// whether its list gives its context. Returns whether the first changed.
    pub fn set_engine(&mut self, engine: Engine) -> bool {
        self.lists_context = engine == Engine::LlamaCpp;
        self.set_any_name(serves_any_name(engine))
    }

    /// Whether the node's `/v1/models` is worth asking: its names are not configured, or its
    /// engine's list gives the context (llama.cpp), which a configured set does not.
    pub fn wants_list(&self) -> bool {
        self.configured.is_none() || self.lists_context
    }

    /// Sets whether the node's engine serves any name; returns whether that changed.
    pub fn set_any_name(&mut self, any_name: bool) -> bool {
        let changed = self.any_name != any_name;
        self.any_name = any_name;
        changed
    }

    /// The per-slot context of the node, tokens, when its list gives one.
    pub fn context_tokens(&self) -> Option<u64> {
        self.context_tokens
    }

    /// Sets the per-slot context (from a list; a snapshot).
    pub fn set_context_tokens(&mut self, tokens: Option<u64>) {
        self.context_tokens = tokens;
    }

    /// A good `/v1/models` list replaces the last one. It is complete as of now, so what the
    /// metrics added before it is dropped. Ignored for a configured node (whose list is asked
    /// for its context only).
    pub fn set_list(&mut self, names: Vec<String>) {
        if self.configured.is_none() {
            self.listed = Some(names);
            self.seen.clear();
        }
    }

    /// Names from one metrics scrape: each not yet known is added (see the module comment).
    /// Returns whether any was.
    pub fn observe_metrics(&mut self, names: &[String]) -> bool {
        if self.configured.is_some() {
            return false;
        }
        let before = self.seen.len();
        for name in names {
            let listed = self.listed.as_ref().is_some_and(|l| l.contains(name));
            if !listed && !self.seen.contains(name) && self.seen.len() < MAX_MODELS_PER_NODE {
                self.seen.push(name.clone());
            }
        }
        self.seen.len() != before
    }
}

/// Why a `/v1/models` answer gave no list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListError {
    NotJson,
    /// A JSON value without a `data` array.
    NoData,
    /// A `data` array with no usable id. An engine serves at least one model; an empty list is
    /// more likely a broken answer, and learning it would make every request an unknown model.
    Empty,
}

impl fmt::Display for ListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ListError::NotJson => "not JSON",
            ListError::NoData => "no `data` array (not an OpenAI model list)",
            ListError::Empty => "no model id in `data`",
        })
    }
}

/// A node's `/v1/models`, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelList {
    pub names: Vec<String>,
    /// The smallest `meta.n_ctx` of its entries (llama.cpp: the context of one slot).
    pub context_tokens: Option<u64>,
}

/// Largest context believed, tokens; a larger `n_ctx` is a broken answer and is not used.
const MAX_CONTEXT_TOKENS: u64 = 1 << 30;

/// Reads an OpenAI model list, as `parse_model_list`, with llama.cpp's per-slot context
/// (`data[].meta.n_ctx`, a positive integer; the smallest when several entries have one).
pub fn read_model_list(body: &[u8]) -> Result<ModelList, ListError> {
    let v: Value = serde_json::from_slice(body).map_err(|_| ListError::NotJson)?;
    let context_tokens = v
        .get("data")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| e.get("meta")?.get("n_ctx")?.as_u64())
        .filter(|n| (1..=MAX_CONTEXT_TOKENS).contains(n))
        .min();
    Ok(ModelList {
        names: names_of(v)?,
        context_tokens,
    })
}

/// Reads an OpenAI model list, `{"object":"list","data":[{"id":"m","object":"model"},...]}`.
/// Total: any bytes give a list or an error. Entries without a string `id`, empty or overlong
/// ids, and repeats are skipped one by one; at most `MAX_MODELS_PER_NODE` names are kept.
pub fn parse_model_list(body: &[u8]) -> Result<Vec<String>, ListError> {
    let v: Value = serde_json::from_slice(body).map_err(|_| ListError::NotJson)?;
    names_of(v)
}

fn names_of(v: Value) -> Result<Vec<String>, ListError> {
    let Value::Object(mut obj) = v else {
        return Err(ListError::NoData);
    };
    let Some(Value::Array(data)) = obj.remove("data") else {
        return Err(ListError::NoData);
    };
    let mut names: Vec<String> = Vec::with_capacity(data.len().min(MAX_MODELS_PER_NODE));
    for entry in data {
        if names.len() >= MAX_MODELS_PER_NODE {
            break;
        }
        let Value::Object(mut entry) = entry else {
            continue;
        };
        // Moved out of the parsed value: no copy of the name.
        let Some(Value::String(id)) = entry.remove("id") else {
            continue;
        };
        if !id.is_empty() && id.len() <= MAX_MODEL_NAME_BYTES && !names.contains(&id) {
            names.push(id);
        }
    }
    if names.is_empty() {
        return Err(ListError::Empty);
    }
    Ok(names)
}

/// When to ask a node for its model list next. Every `period_ms` once a list is known; until
/// then, and after a failure, sooner: from one tick, doubling up to the period, so a node that
/// was not up yet at start is learned within seconds, and one that never answers costs a
/// callout per period, not per tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListPoll {
    next_ms: u64,
    retry_ms: u64,
    min_retry_ms: u64,
    period_ms: u64,
}

impl ListPoll {
    /// Due at once; `min_retry_ms` is the first retry delay (the tick), `period_ms` the period.
    pub fn new(min_retry_ms: u64, period_ms: u64) -> Self {
        let min_retry_ms = min_retry_ms.clamp(1, period_ms.max(1));
        ListPoll {
            next_ms: 0,
            retry_ms: min_retry_ms,
            min_retry_ms,
            period_ms,
        }
    }

    pub fn due(&self, now_ms: u64) -> bool {
        now_ms >= self.next_ms
    }

    /// A poll went out at `now_ms`: not due again until its answer (or a timeout) comes back.
    pub fn sent(&mut self, now_ms: u64) {
        self.next_ms = now_ms.saturating_add(self.period_ms);
    }

    /// The answer came back at `now_ms`, a good list or not.
    pub fn answered(&mut self, good: bool, now_ms: u64) {
        if good {
            self.retry_ms = self.min_retry_ms;
            self.next_ms = now_ms.saturating_add(self.period_ms);
        } else {
            self.next_ms = now_ms.saturating_add(self.retry_ms);
            self.retry_ms = self.retry_ms.saturating_mul(2).min(self.period_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::engine::Engine;
    use crate::rng::{Rng, SplitMix64};
    use crate::route::balancer::{Balancer, Outcome, OwnBooks};
    use crate::route::testing::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// (state, model asked, answer): every source and how they combine.
    #[test]
    fn serves_table() {
        let listed = |l: &[&str]| {
            let mut s = ServedModels::default();
            s.set_list(names(l));
            s
        };
        let seen = |mut s: ServedModels, l: &[&str]| {
            s.observe_metrics(&names(l));
            s
        };
        let any = |mut s: ServedModels| {
            assert!(s.set_engine(Engine::LlamaCpp));
            s
        };
        let configured = ServedModels::configured(names(&["m1", "m1-alias"]));
        let cases: Vec<(&str, ServedModels, &str, Serves)> = vec![
            (
                "nothing known",
                ServedModels::default(),
                "m1",
                Serves::Unknown,
            ),
            (
                "configured, listed",
                configured.clone(),
                "m1-alias",
                Serves::Yes,
            ),
            (
                "configured, not listed",
                configured.clone(),
                "m2",
                Serves::No,
            ),
            (
                "configured wins over anything learned",
                {
                    let mut c = seen(configured.clone(), &["m2"]);
                    c.set_list(names(&["m2"]));
                    c
                },
                "m2",
                Serves::No,
            ),
            ("in the list", listed(&["m1", "sql"]), "sql", Serves::Yes),
            ("not in the list", listed(&["m1", "sql"]), "m2", Serves::No),
            ("exact match only", listed(&["m1"]), "M1", Serves::No),
            ("exact match only, prefix", listed(&["m1"]), "m", Serves::No),
            (
                "metrics alone say yes for what they name",
                seen(ServedModels::default(), &["m1", "sql"]),
                "sql",
                Serves::Yes,
            ),
            (
                "metrics alone never say no",
                seen(ServedModels::default(), &["m1"]),
                "m2",
                Serves::Unknown,
            ),
            (
                "an adapter loaded after the list shows in the metrics",
                seen(listed(&["m1"]), &["m1", "new-adapter"]),
                "new-adapter",
                Serves::Yes,
            ),
            (
                "an engine serving any name: what it lists",
                any(listed(&["/models/x.gguf"])),
                "/models/x.gguf",
                Serves::Yes,
            ),
            (
                "an engine serving any name: anything else, unless named elsewhere",
                any(listed(&["/models/x.gguf"])),
                "gpt-4o",
                Serves::AnyName,
            ),
            (
                "an engine serving any name, no list yet",
                any(ServedModels::default()),
                "gpt-4o",
                Serves::Unknown,
            ),
            (
                "an engine serving any name, configured: exact",
                any(configured.clone()),
                "gpt-4o",
                Serves::No,
            ),
            (
                "a new list drops what the metrics added",
                {
                    let mut s = seen(listed(&["m1"]), &["old-adapter"]);
                    s.set_list(names(&["m1"]));
                    s
                },
                "old-adapter",
                Serves::No,
            ),
        ];
        for (name, state, model, want) in cases {
            assert_eq!(state.serves(model), want, "{name}");
        }
    }

    #[test]
    fn metrics_add_each_name_once_and_are_bounded() {
        let mut s = ServedModels::default();
        s.set_list(names(&["m1"]));
        s.observe_metrics(&names(&["m1", "a", "a", "b"]));
        s.observe_metrics(&names(&["b", "c"]));
        assert_eq!(s.seen(), ["a", "b", "c"]);
        let many: Vec<String> = (0..1000).map(|i| format!("x{i}")).collect();
        s.observe_metrics(&many);
        assert_eq!(s.seen().len(), MAX_MODELS_PER_NODE);
        let mut c = ServedModels::configured(names(&["m"]));
        c.observe_metrics(&names(&["z"]));
        c.set_list(names(&["z"]));
        assert!(c.seen().is_empty() && c.listed().is_none());
    }

    #[test]
    fn model_lists() {
        let long = "x".repeat(MAX_MODEL_NAME_BYTES + 1);
        let with_long = format!(r#"{{"data":[{{"id":"{long}"}},{{"id":"ok"}}]}}"#);
        type Case<'a> = (&'a str, &'a [u8], Result<Vec<String>, ListError>);
        let cases: Vec<Case> = vec![
            (
                "vLLM with an adapter",
                br#"{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model","created":1,"owned_by":"vllm","root":"/models/llama","parent":null,"max_model_len":8192},{"id":"sql-lora","object":"model","parent":"meta-llama/Llama-3.1-8B-Instruct"}]}"#,
                Ok(names(&["meta-llama/Llama-3.1-8B-Instruct", "sql-lora"])),
            ),
            ("escapes resolved", br#"{"data":[{"id":"a\"b\u00e9"}]}"#, Ok(names(&["a\"bé"]))),
            (
                "bad entries skipped one by one",
                br#"{"data":[7,null,{"id":5},{"name":"x"},{"id":""},{"id":"m"},{"id":"m"},"m2",{"id":["m3"]}]}"#,
                Ok(names(&["m"])),
            ),
            ("overlong id skipped", with_long.as_bytes(), Ok(names(&["ok"]))),
            ("empty list", br#"{"object":"list","data":[]}"#, Err(ListError::Empty)),
            ("no usable id", br#"{"data":[{"id":1}]}"#, Err(ListError::Empty)),
            ("seed health JSON", br#"{"tokens_per_sec_load":5}"#, Err(ListError::NoData)),
            ("data not an array", br#"{"data":{"id":"m"}}"#, Err(ListError::NoData)),
            ("a bare array", br#"[{"id":"m"}]"#, Err(ListError::NoData)),
            ("empty body", b"", Err(ListError::NotJson)),
            ("HTML", b"<html>404</html>", Err(ListError::NotJson)),
            ("truncated", br#"{"data":[{"id":"m"#, Err(ListError::NotJson)),
            ("not UTF-8", b"{\"data\":[{\"id\":\"\xff\"}]}", Err(ListError::NotJson)),
        ];
        for (name, body, want) in cases {
            assert_eq!(parse_model_list(body), want, "{name}");
        }
        let deep = format!(r#"{{"data":{}{}}}"#, "[".repeat(10_000), "]".repeat(10_000));
        assert_eq!(parse_model_list(deep.as_bytes()), Err(ListError::NotJson));
        let many: Vec<String> = (0..1000).map(|i| format!(r#"{{"id":"m{i}"}}"#)).collect();
        let body = format!(r#"{{"data":[{}]}}"#, many.join(","));
        assert_eq!(
            parse_model_list(body.as_bytes()).map(|l| l.len()),
            Ok(MAX_MODELS_PER_NODE)
        );
        for e in [ListError::NotJson, ListError::NoData, ListError::Empty] {
            assert!(!e.to_string().is_empty());
        }
    }

    /// llama.cpp's list carries the per-slot context; other lists have none.
    #[test]
    fn the_context_of_a_list() {
        let real = include_bytes!("../../tests/data/models/llamacpp_real.json");
        let noalias = include_bytes!("../../tests/data/models/llamacpp_real_noalias.json");
        let cases: Vec<(&str, &[u8], Option<u64>)> = vec![
            ("llama.cpp, --alias", real, Some(512)),
            ("llama.cpp, no alias", noalias, Some(512)),
            ("vLLM", br#"{"data":[{"id":"m","max_model_len":8192}]}"#, None),
            (
                "the smallest of several",
                br#"{"data":[{"id":"a","meta":{"n_ctx":4096}},{"id":"b","meta":{"n_ctx":1024}}]}"#,
                Some(1024),
            ),
            (
                "bad values are not used",
                br#"{"data":[{"id":"a","meta":{"n_ctx":0}},{"id":"b","meta":{"n_ctx":-5}},{"id":"c","meta":{"n_ctx":"512"}},{"id":"d","meta":{"n_ctx":1e20}}]}"#,
                None,
            ),
        ];
        for (name, body, want) in cases {
            assert_eq!(
                read_model_list(body).map(|l| l.context_tokens),
                Ok(want),
                "{name}"
            );
        }
        assert_eq!(
            read_model_list(noalias).map(|l| l.names),
            Ok(names(&[
                "/root/.cache/token-balancer/models/SmolLM2-135M-Instruct.Q4_1.gguf"
            ]))
        );
        assert_eq!(read_model_list(b"{"), Err(ListError::NotJson));
    }

    /// A llama.cpp node with configured names still has its list asked, for its context only.
    #[test]
    fn a_configured_llamacpp_node_is_asked_its_context() {
        let llamacpp = include_str!("../../tests/data/metrics/llamacpp_real.prom");
        let list = include_bytes!("../../tests/data/models/llamacpp_real_noalias.json");
        let mut b = Balancer::new(&engine_cfg(&[
            r#","models":["smollm2"]"#,
            r#","models":["m"]"#,
        ]));
        assert!(!b.learns_models(0), "the engine is not known yet");
        b.on_health(0, Some(llamacpp.as_bytes()), 0).unwrap();
        b.on_health(1, Some(VLLM_V1.as_bytes()), 0).unwrap();
        assert!(b.learns_models(0) && !b.learns_models(1));
        assert_eq!(b.on_models(0, list), Ok(1));
        let m = b.nodes()[0].models();
        assert_eq!(m.context_tokens(), Some(512));
        assert_eq!(m.listed(), None, "the configured names stand");
        assert_eq!(m.serves("smollm2"), Serves::Yes);
        assert_eq!(m.serves("gpt-4o"), Serves::No);
    }

    /// A prompt longer than a node's per-slot context is not sent there; one that fits no
    /// node falls back to Envoy (the engine would refuse it anywhere).
    #[test]
    fn a_prompt_goes_only_where_it_fits_the_context() {
        let mut b = Balancer::new(&engine_cfg(&[
            r#","capacity_tokens_per_sec":100000"#,
            r#","capacity_tokens_per_sec":1000"#,
            "",
        ]));
        for i in 0..3 {
            b.on_health(i, Some(br#"{"tokens_per_sec_load":0}"#), 0)
                .unwrap();
        }
        // The fast node has 512 tokens a slot, the slow one 4096; the third lists no context.
        b.on_models(0, br#"{"data":[{"id":"m","meta":{"n_ctx":512}}]}"#)
            .unwrap();
        b.on_models(1, br#"{"data":[{"id":"m","meta":{"n_ctx":4096}}]}"#)
            .unwrap();
        b.on_models(2, br#"{"data":[{"id":"m"}]}"#).unwrap();
        let mut rng = SplitMix64::new(5);
        let ask = |b: &mut Balancer, rng: &mut SplitMix64, prompt: u64| {
            let w = crate::ingest::request::Weight {
                prompt_tokens: prompt,
                output_tokens: 8,
            };
            let o = b.route(w, Some("m"), &Chain::NONE, 10, rng, false, &mut OwnBooks);
            if let Outcome::Routed { ticket, .. } = &o {
                b.release(ticket, 0);
            }
            o
        };
        for _ in 0..20 {
            let short = routed_to(&ask(&mut b, &mut rng, 100));
            assert!(short.is_some());
            let long = routed_to(&ask(&mut b, &mut rng, 1200));
            assert!(matches!(long, Some(1 | 2)), "{long:?}");
        }
        // Exactly the context fits.
        b.on_models(2, br#"{"data":[{"id":"m","meta":{"n_ctx":512}}]}"#)
            .unwrap();
        for _ in 0..10 {
            assert_eq!(routed_to(&ask(&mut b, &mut rng, 4096)), Some(1));
        }
        assert_eq!(ask(&mut b, &mut rng, 4097), Outcome::NoFreshNodes);
    }

    #[test]
    fn random_model_lists_never_panic() {
        let mut rng = SplitMix64::new(0x5eed);
        let seed = br#"{"object":"list","data":[{"id":"a","object":"model"},{"id":"b"}]}"#;
        let alphabet = b"{}[]\":,\\ abdit0123456789nul\xff";
        for round in 0..2000u64 {
            let mut b = seed.to_vec();
            for _ in 0..1 + rng.next_u64() % 8 {
                let at = (rng.next_u64() as usize) % (b.len() + 1);
                let c = alphabet[(rng.next_u64() as usize) % alphabet.len()];
                match rng.next_u64() % 4 {
                    0 => b.truncate(at),
                    1 => b.insert(at, c),
                    _ if at < b.len() => b[at] = c,
                    _ => {}
                }
            }
            if let Ok(list) = parse_model_list(&b) {
                assert!(!list.is_empty(), "round {round}");
                assert!(list.iter().all(|n| !n.is_empty()));
            }
        }
    }

    /// (event, time) -> whether a poll is due right after.
    #[test]
    fn list_poll_schedule() {
        let mut p = ListPoll::new(100, 1000);
        assert!(p.due(0));
        p.sent(0);
        assert!(!p.due(999), "nothing while the poll is out");
        // Failures retry sooner, doubling: 100, 200, 400, 800, then the period.
        let mut t = 50;
        for want in [100, 200, 400, 800, 1000, 1000] {
            p.answered(false, t);
            assert!(
                !p.due(t + want - 1) && p.due(t + want),
                "retry after {want}"
            );
            t += want;
            p.sent(t);
        }
        // A good list: the period, and the next failure starts again from one tick.
        p.answered(true, t);
        assert!(!p.due(t + 999) && p.due(t + 1000));
        p.answered(false, t + 1000);
        assert!(p.due(t + 1100));
        // A period shorter than the tick: never retries faster than the period.
        let mut q = ListPoll::new(500, 200);
        q.answered(false, 0);
        assert!(q.due(200));
    }

    /// Node 0 configured for m1, node 1 learns m2 and an adapter from its list, node 2 has no
    /// list; then node 2 learns one, and a bad answer changes nothing.
    #[test]
    fn models_narrow_the_route_and_unknown_models_are_told_apart() {
        let mut b = Balancer::new(&engine_cfg(&[r#","models":["m1"]"#, "", ""]));
        let mut rng = SplitMix64::new(11);
        // Loads 100, 200, 300: with no restriction node 0 would win.
        let load = |b: &mut Balancer, now: u64| {
            for i in 0..3 {
                let body = format!(
                    r#"{{"tokens_per_sec_load":{},"tokens_per_sec_capacity":1000}}"#,
                    100 * (i + 1)
                );
                b.on_health(i, Some(body.as_bytes()), now).unwrap();
            }
        };
        load(&mut b, 0);
        assert!(!b.learns_models(0) && b.learns_models(1) && !b.learns_models(7));
        assert_eq!(b.on_models(0, br#"{"data":[{"id":"m9"}]}"#), Ok(1));
        assert_eq!(
            b.nodes()[0].models().serves("m9"),
            Serves::No,
            "configured wins"
        );
        assert_eq!(
            b.on_models(
                1,
                br#"{"data":[{"id":"m2"},{"id":"sql-lora","parent":"m2"}]}"#
            ),
            Ok(2)
        );
        // (model, the node it goes to) while node 2's set is unknown: node 2, the most loaded,
        // only takes what no known node serves.
        let cases: &[(Option<&str>, usize)] = &[
            (None, 0),
            (Some("m1"), 0),
            (Some("m2"), 1),
            (Some("sql-lora"), 1),
            (Some("m3"), 2),
        ];
        for (model, want) in cases {
            let o = b.route(W, *model, &Chain::NONE, 10, &mut rng, false, &mut OwnBooks);
            assert_eq!(routed_to(&o), Some(*want), "{model:?}: {o:?}");
            if let Outcome::Routed { ticket, .. } = o {
                b.release(&ticket, 0);
            }
        }
        // Node 2's list says m3: a model nobody serves is now unknown, with or without holding.
        assert_eq!(b.on_models(2, br#"{"data":[{"id":"m3"}]}"#), Ok(1));
        assert!(b.model_unknown("m4") && !b.model_unknown("m3"));
        assert_eq!(
            b.route(
                W,
                Some("m4"),
                &Chain::NONE,
                10,
                &mut rng,
                true,
                &mut OwnBooks
            ),
            Outcome::UnknownModel
        );
        assert_eq!(
            routed_to(&b.route(
                W,
                Some("m3"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            )),
            Some(2)
        );
        // Bad answers keep the last good list.
        for bad in [
            &b"<html>"[..],
            br#"{"data":[]}"#,
            br#"{"tokens_per_sec_load":1}"#,
        ] {
            assert!(b.on_models(2, bad).is_err());
        }
        assert_eq!(
            b.nodes()[2].models().listed(),
            Some(&["m3".to_string()][..])
        );
        // A known model whose nodes are all stale is no unknown model: Envoy routes it.
        assert_eq!(
            b.route(
                W,
                Some("m3"),
                &Chain::NONE,
                10_000,
                &mut rng,
                false,
                &mut OwnBooks
            ),
            Outcome::NoFreshNodes
        );
        // Nor is one whose only node has never reported, while another node is fresh.
        let mut e = Balancer::new(&engine_cfg(&[r#","models":["m1"]"#, r#","models":["m2"]"#]));
        e.on_health(1, Some(br#"{"tokens_per_sec_load":1}"#), 0)
            .unwrap();
        assert_eq!(
            e.route(
                W,
                Some("m1"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            ),
            Outcome::NoFreshNodes
        );
        assert_eq!(
            routed_to(&e.route(
                W,
                Some("m2"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            )),
            Some(1)
        );
        assert_eq!(
            e.route(
                W,
                Some("m3"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            ),
            Outcome::UnknownModel
        );
    }

    /// vLLM's metrics add what a list taken earlier does not show yet: an adapter loaded at
    /// runtime, running now.
    #[test]
    fn an_adapter_seen_in_the_metrics_is_routed_to_its_node() {
        let mut b = Balancer::new(&engine_cfg(&[r#","format":"vllm""#, r#","format":"vllm""#]));
        let mut rng = SplitMix64::new(12);
        for i in 0..2 {
            b.on_models(
                i,
                br#"{"data":[{"id":"meta-llama/Llama-3.1-8B-Instruct"}]}"#,
            )
            .unwrap();
        }
        let with_lora = format!(
            "{VLLM_V1}vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"hot-lora\",waiting_lora_adapters=\"\"}} 1.7e9\n"
        );
        b.on_health(0, Some(VLLM_V1.as_bytes()), 0).unwrap();
        b.on_health(1, Some(with_lora.as_bytes()), 0).unwrap();
        assert_eq!(b.nodes()[1].models().seen(), ["hot-lora"]);
        for _ in 0..5 {
            let o = b.route(
                W,
                Some("hot-lora"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks,
            );
            assert_eq!(routed_to(&o), Some(1), "{o:?}");
        }
        // The next list is complete as of its time: without the adapter, it is unknown.
        b.on_models(
            1,
            br#"{"data":[{"id":"meta-llama/Llama-3.1-8B-Instruct"}]}"#,
        )
        .unwrap();
        assert_eq!(
            b.route(
                W,
                Some("hot-lora"),
                &Chain::NONE,
                10,
                &mut rng,
                false,
                &mut OwnBooks
            ),
            Outcome::UnknownModel
        );
    }
}
