//! A prompt's prefix chain: the request's prompt, rendered in message order, cut into blocks of
//! characters, each named by a hash that chains the hash of the block before it (so block i's
//! hash stands for the whole prompt up to the end of block i, as vLLM names its KV blocks).
//! Two prompts that share their first k blocks share the first k hashes, whatever follows.
//!
//! The filter has no tokenizer and sees no engine events, so the chain is over characters, not
//! tokens: an engine caches blocks of tokens, and a block of `block_chars` characters is a few
//! of them. What the chain is for is telling which node already holds a prompt's leading part
//! (`fleet::prefixes` remembers which chains went where); how many tokens that saves is the
//! matched share of the rendered characters times the prompt's estimated tokens (`Chain::cached`).
//!
//! Rendering: the model name seeds the chain (different models never share a cache); then the
//! prompt's turns as `request::Prompt::turns` reads them: the tools the request offers (a
//! template renders them first, in or before the system prompt), the Anthropic `system` (or
//! the Responses API's `instructions`), then each message's role and parts in order
//! (`request::Part`: text, tool results' content, tool uses' input; an assistant's tool calls
//! after its content; a Responses `input`'s items as the messages they stand for), with
//! separators that cannot occur in JSON-decoded text boundaries being confused (a role, a part
//! and a message each end with their own control byte); a completion's (or a native generate
//! endpoint's) prompt: its string or strings, or its token ids, four bytes an id (a block of
//! ids then covers as many tokens as a block of text is estimated to). An image counts as a
//! marker, its source's length and its source's last 64 bytes (hashing a megabyte of base64
//! per request would cost more than the routing; two images rarely end alike), so equal text
//! after different images does not match, as in an engine's cache; other parts that are not
//! text (audio) count as a marker only. A matched image is priced by its share of the
//! rendered characters (a few), not of its tokens: the cached share of a prompt that opens
//! with a large image is underestimated. Only full blocks are
//! hashed (a partial last block is never shared by an engine either), and at most
//! `MAX_BLOCKS` of them.
//!
//! Hints: OpenAI's `prompt_cache_key` (the client's own name for a group of requests that share
//! a prefix), else `user`, become `hint`, a key that independent routers can agree on before any
//! of them has seen the prompt (see `route::choice`). A configured session header is added by
//! the glue (`with_hint`).
//!
//! The hash is a word-at-a-time multiply-rotate mix (in the spirit of FxHash) with a SplitMix64
//! finaliser per block: the prompt is read 8 bytes at a time, which keeps a 16 KiB prompt to a
//! few microseconds inside the VM. It resists no crafted collision; a collision only makes a
//! node look like it holds a prefix it does not, which costs one slower prefill.

use crate::ingest::request::{Api, Part, Prompt};
use serde_json::Value;

/// Longest chain kept: 1,024 blocks of 256 characters cover a 256 KiB prompt (about 64k tokens).
pub const MAX_BLOCKS: usize = 1024;

const K: u64 = 0x9e37_79b9_7f4a_7c15;
const END_ROLE: u8 = 0x1e;
const END_PART: u8 = 0x1f;
const END_MESSAGE: u8 = 0x1d;
const OTHER_PART: &[u8] = b"\x1c";
const IMAGE_PART: &[u8] = b"\x1c\x1c";
/// Bytes of an image's source that stand for it in the chain (see `Chainer::image`).
const IMAGE_TAIL: usize = 64;

/// SplitMix64's finaliser: every input bit reaches every output bit.
pub fn finish(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn mix(h: u64, word: u64) -> u64 {
    (h.rotate_left(5) ^ word).wrapping_mul(K)
}

/// `h` continued over `bytes`, 8 at a time; the tail is packed with its length.
fn hash_bytes(mut h: u64, bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        h = mix(h, u64::from_le_bytes(a));
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut a = [0u8; 8];
        for (d, s) in a.iter_mut().zip(tail) {
            *d = *s;
        }
        h = mix(h, u64::from_le_bytes(a) ^ ((tail.len() as u64) << 59));
    }
    h
}

/// A hash of a short string (a model name, a hint, a node's address).
pub fn hash_str(seed: u64, s: &str) -> u64 {
    finish(hash_bytes(seed ^ K, s.as_bytes()) ^ s.len() as u64)
}

/// A prompt's chain of block hashes and what is needed to price a match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chain {
    /// Hashes of the full blocks, first block first.
    pub blocks: Vec<u64>,
    /// Characters (bytes) rendered in all, full blocks and the rest.
    pub rendered: u64,
    /// Characters (bytes) a block covers.
    pub block_chars: u64,
    /// A key the client gave for requests that share a prefix (`prompt_cache_key`, `user`, a
    /// session header), hashed with the model.
    pub hint: Option<u64>,
}

impl Chain {
    /// No chain: the request is priced the same on every node.
    pub const NONE: Chain = Chain {
        blocks: Vec::new(),
        rendered: 0,
        block_chars: 0,
        hint: None,
    };

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty() && self.hint.is_none()
    }

    /// Prompt tokens found cached where the first `matched` blocks are: that share of the
    /// rendered characters, of `prompt_tokens`. At least one token is always computed (an
    /// engine computes the last one to sample the first output).
    pub fn cached(&self, matched: usize, prompt_tokens: u64) -> u64 {
        if matched == 0 || self.rendered == 0 {
            return 0;
        }
        let chars = (matched as u64).saturating_mul(self.block_chars);
        let share = (chars as f64 / self.rendered as f64).min(1.0);
        ((prompt_tokens as f64 * share) as u64).min(prompt_tokens.saturating_sub(1))
    }

    /// The key of the preference independent routers agree on (see `route::choice`): the
    /// client's hint, else the first block (the prompt's opening, where shared system prompts
    /// are); `None` for a prompt shorter than a block.
    pub fn key(&self) -> Option<u64> {
        self.hint.or_else(|| self.blocks.first().copied())
    }

    /// Adds a hint the request carries outside its body (a session header), when the body
    /// gave none.
    pub fn with_hint(mut self, model: Option<&str>, hint: Option<&str>) -> Chain {
        if self.hint.is_none() {
            self.hint = hint
                .filter(|h| !h.is_empty())
                .map(|h| hash_str(model_seed(model), h));
        }
        self
    }
}

fn model_seed(model: Option<&str>) -> u64 {
    hash_str(0x7072_6566_6978, model.unwrap_or(""))
}

/// Cuts rendered bytes into chained block hashes.
struct Chainer {
    block: usize,
    filled: usize,
    h: u64,
    parent: u64,
    rendered: u64,
    blocks: Vec<u64>,
}

impl Chainer {
    fn new(block_chars: usize, seed: u64) -> Chainer {
        Chainer {
            block: block_chars.max(1),
            filled: 0,
            h: seed,
            parent: seed,
            rendered: 0,
            blocks: Vec::new(),
        }
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        self.rendered = self.rendered.saturating_add(bytes.len() as u64);
        while !bytes.is_empty() && self.blocks.len() < MAX_BLOCKS {
            let n = (self.block - self.filled).min(bytes.len());
            let (head, rest) = bytes.split_at(n);
            self.h = hash_bytes(self.h, head);
            self.filled += n;
            if self.filled == self.block {
                let b = finish(self.h ^ self.parent.rotate_left(17));
                self.blocks.push(b);
                self.parent = b;
                self.h = b;
                self.filled = 0;
            }
            bytes = rest;
        }
    }

    fn content(&mut self, content: &Value) {
        match content {
            Value::String(s) => self.feed(s.as_bytes()),
            Value::Array(parts) => {
                for p in parts {
                    match Part::of(p) {
                        Part::Text(t) => self.feed(t.as_bytes()),
                        Part::Content(content) => self.content(content),
                        Part::Json(v) => self.json(v),
                        Part::Image(source) => self.image(source),
                        Part::Other => self.feed(OTHER_PART),
                    }
                    self.feed(&[END_PART]);
                }
            }
            _ => {}
        }
    }

    /// An image part: a marker, then what tells one image from another without hashing it
    /// whole (a megabyte of base64 per request would cost more than the routing): its
    /// source's length and last `IMAGE_TAIL` bytes (a link whole, when shorter).
    fn image(&mut self, source: Option<&str>) {
        self.feed(IMAGE_PART);
        if let Some(s) = source.map(str::as_bytes) {
            self.feed(&(s.len() as u64).to_le_bytes());
            self.feed(
                s.get(s.len().saturating_sub(IMAGE_TAIL)..)
                    .unwrap_or_default(),
            );
        }
    }

    /// A completion's prompt (see `request::text_tokens`): a string's bytes; a token id as
    /// its four low bytes (ids are under 2^32 in every tokenizer), so a block of ids is a
    /// quarter as many tokens as a block of text is characters, as the estimate has it; a
    /// list item by item, each string and each list ended by a separator (a batch's prompts
    /// are chained one after the other).
    fn text(&mut self, prompt: &Value) {
        match prompt {
            Value::String(s) => self.feed(s.as_bytes()),
            Value::Number(n) => {
                let id = n.as_u64().unwrap_or_default() as u32;
                self.feed(&id.to_le_bytes());
            }
            Value::Array(items) => {
                for item in items {
                    self.text(item);
                    if !item.is_number() {
                        self.feed(&[END_PART]);
                    }
                }
            }
            Value::Null | Value::Bool(_) | Value::Object(_) => {}
        }
    }

    /// One turn (see `request::Prompt::turns`): its role, then its content when it has one,
    /// then what the template renders as JSON (the tools, an assistant's tool calls), each
    /// ended by its separator.
    fn message(&mut self, role: &str, content: Option<&Value>, json: Option<&Value>) {
        self.feed(role.as_bytes());
        self.feed(&[END_ROLE]);
        if let Some(content) = content {
            self.content(content);
        }
        if let Some(json) = json {
            self.json(json);
        }
        self.feed(&[END_MESSAGE]);
    }

    /// A JSON value the template renders as JSON (tools, tool calls): its keys and scalars
    /// in order, each ended by a separator, so that equal values give equal bytes. Bounded by
    /// the parser's nesting limit (128).
    fn json(&mut self, v: &Value) {
        match v {
            Value::String(s) => self.feed(s.as_bytes()),
            Value::Number(n) => self.feed(n.to_string().as_bytes()),
            Value::Bool(b) => self.feed(if *b { b"true" } else { b"false" }),
            Value::Null => self.feed(b"null"),
            Value::Array(items) => {
                for i in items {
                    self.json(i);
                }
            }
            Value::Object(members) => {
                for (k, v) in members {
                    self.feed(k.as_bytes());
                    self.feed(&[END_ROLE]);
                    self.json(v);
                }
            }
        }
        self.feed(&[END_PART]);
    }
}

/// The chain of a request body's prompt, in blocks of `block_chars` characters (see the
/// module). `obj` is the body (of a request to `api`) with `model` already taken out. A body
/// with no prompt, or an embeddings one (no engine caches its KV), gives an empty chain.
pub fn chain(
    api: Api,
    obj: &serde_json::Map<String, Value>,
    model: Option<&str>,
    block_chars: usize,
) -> Chain {
    chain_of(Prompt::of(api, obj), obj, model, block_chars)
}

/// `chain`, for a body whose prompt `Prompt::of` has already found (`None`: none).
pub fn chain_of(
    prompt: Option<Prompt<'_>>,
    obj: &serde_json::Map<String, Value>,
    model: Option<&str>,
    block_chars: usize,
) -> Chain {
    let seed = model_seed(model);
    let mut c = Chainer::new(block_chars, seed);
    match prompt {
        // A conversation's turns keep their blocks from one request to the next, whichever
        // of the two APIs sends them.
        Some(p @ (Prompt::Messages { .. } | Prompt::Responses { .. })) => {
            p.turns(|t| c.message(t.role, t.content, t.json));
        }
        Some(Prompt::Text(prompt)) => c.text(prompt),
        Some(Prompt::Embed(_)) | None => {}
    }
    let hint = ["prompt_cache_key", "user"]
        .iter()
        .find_map(|k| match obj.get(*k) {
            Some(Value::String(s)) if !s.is_empty() => Some(hash_str(seed, s)),
            _ => None,
        });
    Chain {
        blocks: c.blocks,
        rendered: c.rendered,
        block_chars: c.block as u64,
        hint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(body: &str, block: usize) -> Chain {
        of_api(Api::Chat, body, block)
    }

    /// Leading blocks two chains share.
    fn shared(a: &Chain, b: &Chain) -> usize {
        a.blocks
            .iter()
            .zip(&b.blocks)
            .take_while(|(x, y)| x == y)
            .count()
    }

    fn of_api(api: Api, body: &str, block: usize) -> Chain {
        let v: Value = serde_json::from_str(body).unwrap();
        let mut obj = v.as_object().unwrap().clone();
        let model = obj.remove("model");
        chain(api, &obj, model.as_ref().and_then(Value::as_str), block)
    }

    /// An agent's requests: the tool list the template renders first is chained (two requests
    /// with the same tools share its blocks, and other tools part them at once), and so are
    /// tool calls and tool results, which were a marker only.
    #[test]
    fn tools_tool_calls_and_results_are_chained() {
        let tools = serde_json::json!([{"type":"function","function":{"name":"read_file",
            "description":"Read a file of the repository. ".repeat(8),
            "parameters":{"type":"object","properties":{"path":{"type":"string"}}}}}]);
        let ask = |tools: &Value, q: &str| {
            serde_json::json!({"model":"m","tools":tools,"messages":[{"role":"user","content":q}]})
                .to_string()
        };
        let a = of(&ask(&tools, "What does main.rs do?"), 32);
        let b = of(&ask(&tools, "Where is the config read?"), 32);
        let common = shared(&a, &b);
        assert!(common >= 240 / 32, "{common} blocks shared");
        let other = serde_json::json!([{"type":"function","function":{"name":"write_file"}}]);
        let c = of(&ask(&other, "What does main.rs do?"), 32);
        assert_ne!(a.blocks.first(), c.blocks.first());
        // A tool's result is text the engine caches: two results part the chains.
        let turn = |result: &str| {
            serde_json::json!({"model":"m","messages":[
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
                    "function":{"name":"read_file","arguments":"{\"path\":\"main.rs\"}"}}]},
                {"role":"tool","tool_call_id":"c1","content":result}]})
            .to_string()
        };
        let x = of(&turn(&"fn main() {} ".repeat(20)), 32);
        let y = of(&turn(&"mod config; ".repeat(20)), 32);
        assert!(x.blocks.len() >= 8 && x.blocks != y.blocks);
        let anthropic = |result: &str| {
            serde_json::json!({"model":"m","messages":[{"role":"user","content":[
                {"type":"tool_result","tool_use_id":"t","content":result}]}]})
            .to_string()
        };
        let x = of(&anthropic(&"fn main() {} ".repeat(20)), 32);
        let y = of(&anthropic(&"mod config; ".repeat(20)), 32);
        assert!(x.blocks.len() >= 7 && x.blocks != y.blocks);
    }

    /// A Responses API body renders as the chat it stands for (engines put both through the
    /// same template): instructions as the system message, a string input as the user's, items
    /// as their messages. So a conversation's turns share their blocks, whichever API sent them.
    #[test]
    fn a_responses_body_chains_as_the_chat_it_stands_for() {
        let sys = "You are a careful assistant. ".repeat(20);
        let q = "What is the capital of France? ".repeat(10);
        let chat = of(&chat(&sys, &q), 32);
        let responses = serde_json::json!({"model":"m","instructions":sys,"input":q}).to_string();
        assert_eq!(of_api(Api::Responses, &responses, 32), chat);
        let items = serde_json::json!({"model":"m","instructions":sys,"input":[
            {"type":"message","role":"user","content":[{"type":"input_text","text":q}]}]})
        .to_string();
        // (A list of parts ends each part with its separator: the same blocks, a byte more.)
        assert_eq!(of_api(Api::Responses, &items, 32).blocks, chat.blocks);
        // A later turn (the answer's tool call, its output) extends the same chain.
        let later = serde_json::json!({"model":"m","instructions":sys,"input":[
            {"role":"user","content":q},
            {"type":"function_call","call_id":"c","name":"f","arguments":"{\"x\":1}"},
            {"type":"function_call_output","call_id":"c","output":"42 ".repeat(40)}]})
        .to_string();
        let later = of_api(Api::Responses, &later, 32);
        assert!(later.blocks.len() > chat.blocks.len());
        assert_eq!(
            later.blocks.get(..chat.blocks.len()),
            Some(&chat.blocks[..])
        );
        // Embeddings' input is cached by no engine: no chain.
        let embed = serde_json::json!({"model":"m","input":q}).to_string();
        assert!(of_api(Api::Embeddings, &embed, 32).blocks.is_empty());
        assert!(!of_api(Api::Responses, &embed, 32).blocks.is_empty());
    }

    fn chat(system: &str, user: &str) -> String {
        serde_json::json!({"model":"m","messages":[
            {"role":"system","content":system},{"role":"user","content":user}]})
        .to_string()
    }

    #[test]
    fn shared_leading_text_shares_leading_blocks() {
        let sys = "You are a careful assistant. ".repeat(40); // 1,160 characters
        let a = of(&chat(&sys, "What is the capital of France?"), 64);
        let b = of(
            &chat(&sys, "Summarise the plot of Hamlet in two lines."),
            64,
        );
        let common = shared(&a, &b);
        // The system prompt's full blocks (role and separator included) are shared ...
        assert!(common >= 1160 / 64, "{common}");
        // ... and the chains part where the questions do.
        assert!(common < a.blocks.len().max(b.blocks.len()));
    }

    #[test]
    fn the_chain_depends_on_everything_before_a_block() {
        let cases = [
            (
                "another model",
                r#"{"model":"x","prompt":"PPPPPPPPPPPPPPPPPPPP"}"#,
            ),
            (
                "one character earlier",
                r#"{"model":"m","prompt":"QPPPPPPPPPPPPPPPPPPP"}"#,
            ),
            (
                "a role instead of raw text",
                r#"{"model":"m","messages":[{"role":"user","content":"PPPPPPPPPPPPPPPPPPPP"}]}"#,
            ),
        ];
        let base = of(r#"{"model":"m","prompt":"PPPPPPPPPPPPPPPPPPPP"}"#, 8);
        assert_eq!(base.blocks.len(), 2);
        for (name, body) in cases {
            let c = of(body, 8);
            assert_ne!(c.blocks.first(), base.blocks.first(), "{name}");
        }
        // Equal text gives equal blocks, even when it arrives in other pieces.
        let parts = of(r#"{"model":"m","prompt":["PPPPPPPPPPPPPPPPPPPP"]}"#, 8);
        assert_eq!(parts.blocks, base.blocks);
    }

    #[test]
    fn block_boundaries_inside_a_piece_do_not_depend_on_what_follows() {
        for len in [7usize, 8, 9, 15, 16, 17, 31, 33] {
            let short = "abcdefghij".repeat(4);
            let long = format!("{short}{}", "z".repeat(len));
            let a = of(&format!(r#"{{"prompt":"{short}"}}"#), 8);
            let b = of(&format!(r#"{{"prompt":"{long}"}}"#), 8);
            assert_eq!(a.blocks[..], b.blocks[..a.blocks.len()], "+{len}");
        }
    }

    #[test]
    fn pricing_a_match() {
        let c = Chain {
            blocks: vec![1, 2, 3, 4],
            rendered: 1000,
            block_chars: 200,
            hint: None,
        };
        assert_eq!(c.cached(0, 250), 0);
        assert_eq!(c.cached(2, 250), 100); // 400 of 1000 characters
        assert_eq!(c.cached(4, 250), 200);
        // Never the whole prompt: the last token is always computed.
        let whole = Chain {
            rendered: 800,
            ..c.clone()
        };
        assert_eq!(whole.cached(4, 250), 249);
        assert_eq!(Chain::NONE.cached(3, 100), 0);
    }

    #[test]
    fn hints_and_keys() {
        let hinted = of(
            r#"{"model":"m","prompt":"hi","prompt_cache_key":"tenant-7","user":"u"}"#,
            8,
        );
        let user = of(r#"{"model":"m","prompt":"hi","user":"tenant-7"}"#, 8);
        let other_model = of(r#"{"model":"n","prompt":"hi","user":"tenant-7"}"#, 8);
        assert!(hinted.blocks.is_empty());
        assert_eq!(hinted.key(), user.key(), "the same string, whichever field");
        assert_ne!(user.key(), other_model.key());
        let plain = of(r#"{"model":"m","prompt":"hi"}"#, 8);
        assert_eq!(plain.key(), None);
        assert_eq!(
            plain.clone().with_hint(Some("m"), Some("tenant-7")).key(),
            user.key()
        );
        assert_eq!(plain.clone().with_hint(Some("m"), Some("")).key(), None);
        // A body's hint wins over a header's.
        assert_eq!(
            hinted.clone().with_hint(Some("m"), Some("other")).key(),
            hinted.key()
        );
        // Without a hint the key is the first block.
        let long = of(r#"{"model":"m","prompt":"0123456789abcdef"}"#, 8);
        assert_eq!(long.key(), long.blocks.first().copied());
    }

    /// Token-id prompts (completions, native generate endpoints) are chained as their ids:
    /// the same leading ids share leading blocks, a block of 32 bytes is 8 ids, and the
    /// matched share prices the cached tokens exactly.
    #[test]
    fn token_id_prompts_are_chained() {
        let ids =
            |n: u32, tail: u32| -> Vec<u32> { (0..n).map(|i| 1000 + i).chain([tail]).collect() };
        let chain = |api: Api, key: &str, ids: Vec<u32>| {
            of_api(api, &serde_json::json!({ key: ids }).to_string(), 32)
        };
        let a = chain(Api::Completions, "prompt", ids(40, 1));
        let b = chain(Api::Generate, "input_ids", ids(40, 2));
        assert_eq!(a.blocks.len(), 5); // 41 ids = 164 bytes: 5 full blocks of 8 ids
        assert_eq!(a.rendered, 164);
        assert_eq!(shared(&a, &b), 5);
        // 5 blocks of 41 ids matched: 40 tokens cached of 41.
        assert_eq!(a.cached(5, 41), 40);
        let other = chain(Api::Completions, "prompt", ids(3, 1));
        let c = chain(
            Api::Completions,
            "prompt",
            [7].into_iter().chain(ids(40, 1)).collect(),
        );
        assert!(other.blocks.is_empty());
        assert_eq!(shared(&a, &c), 0, "a different first id parts the chains");
        // A batch is chained prompt after prompt, text and ids alike.
        let batch = of_api(Api::Generate, r#"{"text":["abcdefgh","ijklmnop"]}"#, 8);
        let first = of_api(Api::Generate, r#"{"text":"abcdefgh"}"#, 8);
        assert_eq!(shared(&batch, &first), 1);
    }

    #[test]
    fn chains_are_bounded_and_odd_bodies_give_none() {
        let huge = "a".repeat(MAX_BLOCKS * 8 + 100);
        let c = of(&format!(r#"{{"prompt":"{huge}"}}"#), 8);
        assert_eq!(c.blocks.len(), MAX_BLOCKS);
        for body in [
            r#"{"prompt":7}"#,
            r#"{"input":"embed me, please, all of me"}"#,
            r#"{"messages":"nope"}"#,
        ] {
            assert!(of(body, 8).blocks.is_empty(), "{body}");
        }
        let images = of(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:..."}},{"type":"text","text":"describe this picture in detail"}]}]}"#,
            8,
        );
        assert!(images.blocks.len() >= 3);
    }
}
