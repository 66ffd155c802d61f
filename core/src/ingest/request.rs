//! Request weight: how many tokens a request will cost a GPU, estimated from its body.
//!
//! The cost of an LLM request is not its byte size but the tokens the engine must prefill (the
//! prompt) plus the tokens it must decode (the output). The filter cannot run the model's
//! tokenizer, so it estimates prompt tokens from characters by script, the rule of thumb that
//! BPE tokenizers (GPT/Llama families) follow closely enough for balancing: about 4 characters a
//! token in English-like ASCII text, about 3 in Spanish and other accented Latin-script text
//! (accents split words into more pieces), about 2 in other alphabets (Cyrillic, Greek, Arabic,
//! Hebrew, Indic), and about 1 per CJK character (Han, Kana, Hangul); a prompt sent as token
//! ids is counted exactly, one token an id. Output tokens come from the request's own cap
//! (`max_tokens`, `max_completion_tokens`, or an engine's native name for it, `OUTPUT_CAPS`),
//! or a configured default, times `n` and times the prompts of a batch: the decode budget the
//! engine reserves KV cache for.
//!
//! Shapes understood: OpenAI `/v1/chat/completions` (string or array-of-parts content),
//! `/v1/completions` (a prompt as text or token ids, or a batch of them), engines' native
//! generate endpoints (SGLang's and TGI's `/generate`, vLLM's tokens-in
//! `/inference/v1/generate`, llama.cpp's `/completion`), `/v1/embeddings` (no output), Anthropic
//! `/v1/messages` (`system` plus content blocks), and OpenAI's Responses API, `/v1/responses`
//! (`instructions`, and `input` as a string or a list of items: messages, tool calls and their
//! outputs, reasoning; `max_output_tokens`), which vLLM, SGLang and llama.cpp's server serve
//! beside chat completions and which OpenAI's agents speak. Where a body keeps its prompt is
//! told once ([`Prompt`]) for both the weight and the prefix chain (`prompt`). An agent's
//! prompt is more than its messages' text: the `tools` it offers (which a chat template
//! renders as JSON ahead of the messages), an assistant's tool calls, tool results and
//! Anthropic's tool blocks are counted too ([`json_tokens`], `part_tokens`), and so are the
//! images a vision-language model turns into prompt tokens (`ingest::image`). A request that
//! only counts, tokenizes or renders its prompt ([`Api::Count`]) weighs nothing. A body that is
//! not JSON, or whose shape gives no prompt, is `None`: the caller then leaves the request to
//! Envoy's fallback balancer. Fields of the wrong type are ignored one by one rather than
//! failing the whole estimate.
//!
//! The body's `model` comes out with the weight (`read`): it narrows the nodes the request may
//! go to (see `models`). It is moved out of the parsed value, not copied; a missing, empty or
//! non-string `model` is no model, as vLLM serves such a request with its default model.

use crate::ingest::image::ImagePricing;
use crate::ingest::prompt::{self, Chain};
use crate::ingest::stored;
use serde_json::Value;

/// What a request's weight is read with besides its body: the configuration's
/// `default_max_tokens` and `images`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pricing {
    /// Output tokens of a request that caps none.
    pub default_max_tokens: u64,
    /// How an image in a prompt is counted (`ingest::image`).
    pub images: ImagePricing,
}

impl Pricing {
    /// `default_max_tokens`, and images at their defaults.
    pub fn new(default_max_tokens: u64) -> Pricing {
        Pricing {
            default_max_tokens,
            images: ImagePricing::default(),
        }
    }
}

/// Estimated token cost of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Weight {
    /// Tokens to prefill.
    pub prompt_tokens: u64,
    /// Tokens to decode (all `n` choices together).
    pub output_tokens: u64,
}

impl Weight {
    /// Total tokens the engine will process for this request, and also the KV-cache tokens it
    /// will hold at its peak (prompt plus everything generated).
    pub fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.output_tokens)
    }
}

/// Tokens a chat template adds around each message (role markers, separators).
const PER_MESSAGE_OVERHEAD: u64 = 4;
/// Upper bound on `n`: a body asking for a million choices must not make a weight that
/// overflows arithmetic downstream; no engine serves more than this in one request anyway.
const MAX_N: u64 = 128;
/// Upper bound on any output cap taken from a body, for the same reason.
const MAX_OUTPUT_TOKENS: u64 = 1 << 24;

/// Estimates prompt tokens in `text` by script (see the module comment).
pub fn estimate_text_tokens(text: &str) -> u64 {
    // Most prompts are ASCII: checked a word at a time and counted by length, instead of
    // classifying one character at a time (the loop below is most of a request's cost inside
    // the VM, 4 us of 6 for a 4 KiB prompt under V8). The same figure the loop gives.
    if text.is_ascii() {
        return (text.len() as u64).div_ceil(4);
    }
    let (mut ascii, mut accented_latin, mut alphabetic, mut cjk, mut other) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut has_accent = false;
    for c in text.chars() {
        match c as u32 {
            0..=0x7f => ascii += 1,
            // Latin-1 letters and Latin Extended-A/B.
            0xc0..=0x24f => {
                accented_latin += 1;
                has_accent = true;
            }
            // Greek, Cyrillic, Armenian, Hebrew, Arabic, Indic scripts, Thai.
            0x370..=0x0e7f => alphabetic += 1,
            // Hangul Jamo, CJK punctuation, Kana, Han, Hangul syllables, full-width forms.
            0x1100..=0x11ff
            | 0x3000..=0x9fff
            | 0xac00..=0xd7af
            | 0xf900..=0xfaff
            | 0xff00..=0xffef => cjk += 1,
            _ => other += 1,
        }
    }
    // Accented text is tokenized more finely throughout, not only at the accented letters.
    let latin = ascii + accented_latin;
    let latin_tokens = if has_accent {
        latin.div_ceil(3)
    } else {
        latin.div_ceil(4)
    };
    latin_tokens + alphabetic.div_ceil(2) + cjk + other
}

/// Prompt tokens of a message's content: a string, or parts (see [`part_tokens`]).
fn text_of_content(content: &Value, images: &ImagePricing) -> u64 {
    match content {
        Value::String(s) => estimate_text_tokens(s),
        Value::Array(parts) => parts
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(part_tokens(p, images))),
        _ => 0,
    }
}

/// Whether every part of a message's content is priced (see `Prompt::prices_every_part`).
fn content_priced(content: &Value, images: &ImagePricing) -> bool {
    let Value::Array(parts) = content else {
        return true;
    };
    parts.iter().all(|p| match Part::of(p) {
        Part::Text(_) | Part::Json(_) => true,
        Part::Content(c) => content_priced(c, images),
        Part::Image(_) => images.enabled,
        Part::Other => false,
    })
}

/// What one part of a message's content holds for the prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Part<'a> {
    /// Text: a string part, OpenAI's `text` parts, Anthropic's text blocks, the Responses
    /// API's `input_text` / `output_text` parts (their `text`), the `thinking` of an earlier
    /// turn.
    Text(&'a str),
    /// Anthropic's `tool_result` block: its `content`, read as a message's.
    Content(&'a Value),
    /// Anthropic's `tool_use` block: its `input`, rendered as JSON.
    Json(&'a Value),
    /// An image: OpenAI's `image_url` part (its `url`), the Responses API's `input_image`
    /// (its `image_url`), Anthropic's `image` block (its `source`'s `data` or `url`). The
    /// source is a `data:` URL, a link, or bare base64; `None` when the part gives none.
    Image(Option<&'a str>),
    /// Anything else (audio, video): what it costs is the engine's encoder's, not told by
    /// the body.
    Other,
}

impl<'a> Part<'a> {
    /// The one reading of a content part, for its tokens (`part_tokens`) and its prefix chain.
    pub fn of(part: &'a Value) -> Part<'a> {
        let Value::Object(o) = part else {
            return match part {
                Value::String(s) => Part::Text(s),
                _ => Part::Other,
            };
        };
        if let Some("image_url" | "input_image" | "image") = o.get("type").and_then(Value::as_str) {
            let url = match o.get("image_url") {
                Some(Value::Object(u)) => u.get("url"),
                url => url,
            };
            let source = url.or_else(|| {
                let s = o.get("source")?;
                s.get("data").or_else(|| s.get("url"))
            });
            return Part::Image(source.and_then(Value::as_str));
        }
        if let Some(Value::String(text)) = o.get("text") {
            Part::Text(text)
        } else if let Some(content) = o.get("content") {
            Part::Content(content)
        } else if let Some(input) = o.get("input") {
            Part::Json(input)
        } else if let Some(Value::String(thinking)) = o.get("thinking") {
            Part::Text(thinking)
        } else {
            Part::Other
        }
    }
}

/// Prompt tokens of one part of a message's content (see [`Part`]).
fn part_tokens(part: &Value, images: &ImagePricing) -> u64 {
    match Part::of(part) {
        Part::Text(text) => estimate_text_tokens(text),
        Part::Content(content) => text_of_content(content, images),
        Part::Json(v) => json_tokens(v),
        Part::Image(source) => images.tokens(source),
        Part::Other => 0,
    }
}

/// Prompt tokens of a JSON value a chat template renders as JSON (tool definitions, a tool
/// call's input): its strings and keys by the text rule, a token for every other scalar and
/// for each member's or element's punctuation. Engines dump tools into the prompt whole, so
/// an agent's tool list is often thousands of tokens that no message shows.
pub fn json_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => estimate_text_tokens(s),
        Value::Array(items) => items.iter().map(|i| 1 + json_tokens(i)).sum(),
        Value::Object(members) => members
            .iter()
            .map(|(k, v)| 1 + estimate_text_tokens(k) + json_tokens(v))
            .sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 1,
    }
}

fn positive_u64(v: Option<&Value>) -> Option<u64> {
    let v = v?;
    // JSON numbers like 256.0 or 1e3 are still meant as counts.
    let n = v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f.min(u64::MAX as f64) as u64)
    })?;
    (n > 0).then_some(n)
}

/// Which API the request is for, told from its path (the body alone cannot tell an embeddings
/// request's `input` from anything else).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Embeddings,
    Messages,
    /// OpenAI's Responses API.
    Responses,
    /// An engine's native generate endpoint: SGLang's and TGI's `/generate` (TGI's
    /// `/generate_stream` too) and vLLM's tokens-in `/inference/v1/generate`. The prompt is a
    /// completion's, under the engine's own name (`text`, `input_ids`, `token_ids`, `inputs`).
    Generate,
    /// Counting, tokenizing or rendering a prompt without running it: Anthropic's
    /// `/v1/messages/count_tokens`, OpenAI's `/v1/responses/input_tokens`, the engines'
    /// `/tokenize` and `/detokenize`, llama.cpp's `/apply-template`. Nothing is prefilled or
    /// decoded, however long the prompt the body carries.
    Count,
    /// Unknown path: the body's shape decides.
    Other,
}

/// Path endings of requests that only count, tokenize or render a prompt (`Api::Count`).
const COUNT_PATHS: [&str; 5] = [
    "/count_tokens",
    "/input_tokens",
    "/tokenize",
    "/detokenize",
    "/apply-template",
];

impl Api {
    pub fn from_path(path: &str) -> Api {
        let path = path.split('?').next().unwrap_or(path);
        if COUNT_PATHS.iter().any(|end| path.ends_with(end)) {
            Api::Count
        } else if path.ends_with("/generate") || path.ends_with("/generate_stream") {
            Api::Generate
        } else if path.ends_with("/chat/completions") {
            Api::Chat
        } else if path.ends_with("/completions") {
            Api::Completions
        } else if path.ends_with("/embeddings") {
            Api::Embeddings
        } else if path.ends_with("/messages") {
            Api::Messages
        } else if path.ends_with("/responses") {
            Api::Responses
        } else {
            Api::Other
        }
    }
}

/// Why a request's body will not be read, told from its headers before any of it comes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreadable {
    /// The headers end the request: there is no body.
    NoBody,
    /// A `content-encoding` other than `identity`: it cannot be read without inflating it.
    Encoded,
    /// A `content-length` over `max_body_bytes`: the body streams on untouched from the start.
    /// Waiting for the body to pass the limit is not enough inside Envoy: a body that arrives
    /// faster than the worker reads lands in one large read, buffered on top of what the pause
    /// holds, and past the listener's buffer limit Envoy answers 413 and resets the client.
    OverLimit,
}

/// Whether the body of a request whose headers end it (`end_of_stream`) and whose headers
/// `header` gives will be read: `None`, or why not. Headers are asked only as far as needed,
/// in this order (inside Envoy each lookup is a host call).
pub fn unreadable(
    end_of_stream: bool,
    header: impl Fn(&str) -> Option<String>,
    max_body_bytes: usize,
) -> Option<Unreadable> {
    if end_of_stream {
        return Some(Unreadable::NoBody);
    }
    if header("content-encoding").is_some_and(|e| !e.eq_ignore_ascii_case("identity")) {
        return Some(Unreadable::Encoded);
    }
    let over = |l: String| {
        l.trim()
            .parse::<u64>()
            .is_ok_and(|n| n > max_body_bytes as u64)
    };
    header("content-length")
        .is_some_and(over)
        .then_some(Unreadable::OverLimit)
}

/// What the filter reads from a request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    pub weight: Weight,
    /// The model (or LoRA adapter) the body names.
    pub model: Option<String>,
    /// The prompt's prefix chain (see `prompt`), when one was asked for.
    pub chain: Chain,
    /// The body's `user` (OpenAI's end-user id), a tenant for fair queuing (see `claim`).
    pub user: Option<String>,
    /// The stored response a Responses request continues (`previous_response_id`, see
    /// `ingest::stored`).
    pub continues: Option<String>,
    /// A Responses request whose answer the engine is asked to keep (`store`, true unless the
    /// body says false).
    pub stores: bool,
    /// The prompt is (or has) token ids, counted exactly: not an estimate to calibrate (see
    /// `route::prompt_scale`).
    pub ids: bool,
    /// The prompt has parts the estimate counts nothing for while the engine counts them:
    /// images while images are not priced, audio, video (see [`Prompt::prices_every_part`]).
    /// The engine's count of such a prompt is no sample of how it counts text.
    pub uncounted: bool,
}

/// Estimates a request's weight from its JSON body, or `None` when the body gives no basis
/// (images at their default pricing).
pub fn estimate(api: Api, body: &[u8], default_max_tokens: u64) -> Option<Weight> {
    read(api, body, default_max_tokens).map(|e| e.weight)
}

/// Reads a request's weight and model from its JSON body, or `None` when the body gives no
/// basis for a weight (whatever its model); images at their default pricing.
pub fn read(api: Api, body: &[u8], default_max_tokens: u64) -> Option<Estimate> {
    read_with_chain(api, body, &Pricing::new(default_max_tokens), None)
}

/// `read` with `pricing`, and with `block_chars` the prompt's prefix chain in blocks of that
/// many characters (see `prompt`), from the same parse.
pub fn read_with_chain(
    api: Api,
    body: &[u8],
    pricing: &Pricing,
    block_chars: Option<usize>,
) -> Option<Estimate> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let Value::Object(mut obj) = v else {
        return None;
    };
    let model = match obj.remove("model") {
        Some(Value::String(m)) if !m.is_empty() => Some(m),
        _ => None,
    };
    let mut responses = false;
    let mut ids = false;
    let mut uncounted = false;
    let (weight, chain) = if api == Api::Count {
        // Costs the GPU nothing, whatever it carries; its model still says where it may go.
        (Weight::default(), Chain::NONE)
    } else {
        // Where the prompt is, read once for both the weight and the chain.
        let found = Prompt::of(api, &obj)?;
        responses = matches!(found, Prompt::Responses { .. });
        ids = matches!(found, Prompt::Text(v) | Prompt::Embed(v) if has_ids(v));
        uncounted = !found.prices_every_part(&pricing.images);
        let weight = weight_of(api, found, &obj, pricing);
        let chain = match block_chars {
            Some(b) => prompt::chain_of(Some(found), &obj, model.as_deref(), b),
            None => Chain::NONE,
        };
        (weight, chain)
    };
    let user = match obj.remove("user") {
        Some(Value::String(u)) if !u.is_empty() => Some(u),
        _ => None,
    };
    let continues = match obj.get("previous_response_id") {
        Some(Value::String(id)) if responses && stored::valid_id(id.as_bytes()) => Some(id.clone()),
        _ => None,
    };
    let stores = responses && !matches!(obj.get("store"), Some(Value::Bool(false)));
    Some(Estimate {
        weight,
        model,
        chain,
        user,
        continues,
        stores,
        ids,
        uncounted,
    })
}

/// Where a request body keeps its prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prompt<'a> {
    /// Chat: the messages (each a `role` and a `content`), after Anthropic's top-level
    /// `system` when there is one.
    Messages {
        tools: Option<&'a Value>,
        system: Option<&'a Value>,
        messages: &'a [Value],
    },
    /// The Responses API: its `instructions` (the system message) and its `input`, a string
    /// (one user message) or a list of items (see [`Prompt::items`]).
    Responses {
        tools: Option<&'a Value>,
        instructions: Option<&'a Value>,
        input: &'a Value,
    },
    /// Completions and native generate endpoints: one prompt or a batch of them (see
    /// [`text_tokens`], [`batch_size`]), as text or token ids.
    Text(&'a Value),
    /// Embeddings: the texts (or token ids) to embed. No output, and nothing an engine's
    /// prefix cache keeps.
    Embed(&'a Value),
}

/// Prompt tokens of a completion's prompt or an embedding's input, as text or token ids: a
/// string by the text rule, a token id as exactly one token, a list as the sum of its items.
/// Engines take all of these: vLLM and SGLang a string, a list of strings, a list of ids or
/// a list of id lists; llama.cpp also ids and strings mixed in one prompt. Reinforcement
/// learning rollouts and agents that keep their own tokenizer send ids, often long ones.
pub fn text_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => estimate_text_tokens(s),
        Value::Number(_) => 1,
        Value::Array(items) => items
            .iter()
            .fold(0u64, |sum, item| sum.saturating_add(text_tokens(item))),
        Value::Null | Value::Bool(_) | Value::Object(_) => 0,
    }
}

/// Whether a completion's prompt or an embedding's input holds token ids (numbers), which
/// `text_tokens` counts exactly rather than estimates.
fn has_ids(v: &Value) -> bool {
    match v {
        Value::Number(_) => true,
        Value::Array(items) => items.iter().any(has_ids),
        Value::String(_) | Value::Null | Value::Bool(_) | Value::Object(_) => false,
    }
}

/// Largest batch a body's prompt list is taken to be (a bound for arithmetic, as `MAX_N`).
const MAX_BATCH: u64 = 1 << 16;

/// How many prompts a completion's prompt is, each decoded on its own: a list of strings or
/// of id lists is a batch of that many; a string, a list of token ids, and llama.cpp's mix
/// of ids and strings are one prompt.
pub fn batch_size(v: &Value) -> u64 {
    match v {
        Value::Array(items) if !items.is_empty() && !items.iter().any(Value::is_number) => {
            (items.len() as u64).min(MAX_BATCH)
        }
        _ => 1,
    }
}

/// Where an engine's native generate body keeps its prompt (`Api::Generate`): SGLang's `text`
/// or `input_ids`, vLLM's `token_ids`, TGI's `inputs`. Read on those paths only: elsewhere
/// such a field may be anything (SGLang's `/encode` embeds a `text`).
const GENERATE_PROMPTS: [&str; 4] = ["text", "input_ids", "token_ids", "inputs"];

/// Fields only a Responses API body has, which tell it from an embeddings one on a path that
/// names neither.
const RESPONSES_ONLY: [&str; 3] = ["instructions", "max_output_tokens", "previous_response_id"];

impl<'a> Prompt<'a> {
    /// Where `obj`, the body of a request to `api`, keeps its prompt; `None` when nowhere, or
    /// not as a string or a list. A chat's or a Responses request's `tools` are part of its
    /// prompt: the engine renders them into the template.
    pub fn of(api: Api, obj: &'a serde_json::Map<String, Value>) -> Option<Prompt<'a>> {
        let text = |v: &'a Value| matches!(v, Value::String(_) | Value::Array(_)).then_some(v);
        if let Some(Value::Array(messages)) = obj.get("messages") {
            return Some(Prompt::Messages {
                tools: obj.get("tools"),
                system: obj.get("system"),
                messages,
            });
        }
        if let Some(prompt) = obj.get("prompt") {
            return text(prompt).map(Prompt::Text);
        }
        if api == Api::Generate {
            if let Some(prompt) = GENERATE_PROMPTS.iter().find_map(|k| obj.get(*k)) {
                return text(prompt).map(Prompt::Text);
            }
        }
        let input = text(obj.get("input")?)?;
        let responses = api == Api::Responses
            || (api == Api::Other && RESPONSES_ONLY.iter().any(|k| obj.contains_key(*k)));
        Some(if responses {
            Prompt::Responses {
                tools: obj.get("tools"),
                instructions: obj.get("instructions"),
                input,
            }
        } else {
            Prompt::Embed(input)
        })
    }

    /// A Responses API `input` as messages, each `(role, content)`: a string is one user
    /// message; a list's items are messages (`role` and `content`: a string or parts), tool
    /// calls (their `arguments`, the assistant's), tool outputs (`output`) and reasoning (its
    /// `content` parts, or else its `summary`), as engines render them into the chat template
    /// (llama.cpp's server turns them into chat messages one for one).
    pub fn items(input: &'a Value) -> impl Iterator<Item = (&'a str, Option<&'a Value>)> {
        let (one, list) = match input {
            Value::String(_) => (Some(("user", Some(input))), &[][..]),
            Value::Array(items) => (None, &items[..]),
            _ => (None, &[][..]),
        };
        one.into_iter().chain(list.iter().map(|item| {
            let kind = item.get("type").and_then(Value::as_str);
            let role = item.get("role").and_then(Value::as_str);
            match kind {
                Some("function_call") => ("assistant", item.get("arguments")),
                Some("function_call_output") => ("tool", item.get("output")),
                Some("reasoning") => (
                    "assistant",
                    item.get("content")
                        .filter(|c| c.as_array().is_some_and(|a| !a.is_empty()))
                        .or_else(|| item.get("summary")),
                ),
                _ => (role.unwrap_or("user"), item.get("content")),
            }
        }))
    }

    /// The prompt as a chat template renders it, turn by turn, in order (`visit` is called
    /// once a turn): the tools the request offers, the system message (Anthropic's `system`,
    /// the Responses API's `instructions`), then the messages (the Responses API's `input`
    /// items), each with its content and an assistant's tool calls. Completions' and
    /// embeddings' text has no turns. The one reading of a prompt's parts, for its tokens
    /// (`tokens`) and its prefix chain (`prompt::chain`).
    pub fn turns(&self, mut visit: impl FnMut(Turn<'a>)) {
        let (tools, system) = match *self {
            Prompt::Messages { tools, system, .. } => (tools, system.map(|s| (s, false))),
            Prompt::Responses {
                tools,
                instructions,
                ..
            } => (tools, instructions.map(|i| (i, true))),
            Prompt::Text(_) | Prompt::Embed(_) => return,
        };
        if let Some(tools) = tools {
            visit(Turn {
                role: "tools",
                content: None,
                json: Some(tools),
                framed: false,
            });
        }
        if let Some((system, framed)) = system {
            visit(Turn {
                role: "system",
                content: Some(system),
                json: None,
                framed,
            });
        }
        match *self {
            Prompt::Messages { messages, .. } => {
                for m in messages {
                    visit(Turn {
                        role: m.get("role").and_then(Value::as_str).unwrap_or_default(),
                        content: m.get("content"),
                        json: m.get("tool_calls"),
                        framed: true,
                    });
                }
            }
            Prompt::Responses { input, .. } => {
                for (role, content) in Prompt::items(input) {
                    visit(Turn {
                        role,
                        content,
                        json: None,
                        framed: true,
                    });
                }
            }
            Prompt::Text(_) | Prompt::Embed(_) => {}
        }
    }

    /// Whether every part of every turn is priced by its content: none is an image while
    /// `images` counts nothing, nor audio or video (`Part::Other`), which the engine turns into
    /// tokens the body does not tell.
    fn prices_every_part(&self, images: &ImagePricing) -> bool {
        let mut all = true;
        self.turns(|t| all &= t.content.map_or(true, |c| content_priced(c, images)));
        all
    }

    /// Estimated prompt tokens (see the module comment): every turn's content (images as
    /// `images` prices them) and JSON, and the template's overhead for each message.
    fn tokens(&self, images: &ImagePricing) -> u64 {
        match *self {
            Prompt::Text(text) | Prompt::Embed(text) => text_tokens(text),
            Prompt::Messages { .. } | Prompt::Responses { .. } => {
                let mut tokens = 0u64;
                self.turns(|t| {
                    let content = t.content.map_or(0, |c| text_of_content(c, images));
                    tokens = tokens
                        .saturating_add(if t.framed { PER_MESSAGE_OVERHEAD } else { 0 })
                        .saturating_add(content)
                        .saturating_add(t.json.map(json_tokens).unwrap_or(0));
                });
                tokens
            }
        }
    }
}

/// One turn of a prompt as a template renders it (see [`Prompt::turns`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn<'a> {
    pub role: &'a str,
    /// Its text: a string, or parts.
    pub content: Option<&'a Value>,
    /// What the template renders as JSON after the content: the tools, or an assistant's tool
    /// calls.
    pub json: Option<&'a Value>,
    /// A message the template frames with its role markers (`PER_MESSAGE_OVERHEAD`); not the
    /// tools, nor Anthropic's top-level `system`.
    pub framed: bool,
}

/// Where a body caps its output, first found first: OpenAI's names, llama.cpp's
/// `n_predict`, SGLang's `sampling_params.max_new_tokens`, vLLM's tokens-in
/// `sampling_params.max_tokens`, TGI's `parameters.max_new_tokens`.
const OUTPUT_CAPS: [&[&str]; 6] = [
    &["max_completion_tokens"],
    &["max_tokens"],
    &["n_predict"],
    &["sampling_params", "max_new_tokens"],
    &["sampling_params", "max_tokens"],
    &["parameters", "max_new_tokens"],
];

/// Where a body asks for several sequences at once, each decoded and held in the KV cache:
/// `n` (OpenAI), `sampling_params.n` (SGLang, vLLM's tokens-in), TGI's `parameters.best_of`.
const CHOICES: [&[&str]; 3] = [
    &["n"],
    &["sampling_params", "n"],
    &["parameters", "best_of"],
];

/// The value at `path` in `obj`, object within object.
fn field<'a>(obj: &'a serde_json::Map<String, Value>, path: &[&str]) -> Option<&'a Value> {
    let (first, rest) = path.split_first()?;
    rest.iter()
        .try_fold(obj.get(*first)?, |v, key| v.as_object()?.get(*key))
}

/// The weight of a request to `api` whose body `obj` keeps its prompt as `prompt`.
fn weight_of(
    api: Api,
    prompt: Prompt<'_>,
    obj: &serde_json::Map<String, Value>,
    pricing: &Pricing,
) -> Weight {
    let default_max_tokens = pricing.default_max_tokens;
    let output_tokens = match prompt {
        // Whatever its shape, a body sent to an embeddings endpoint decodes nothing.
        _ if api == Api::Embeddings => 0,
        Prompt::Embed(_) => 0,
        Prompt::Responses { .. } => positive_u64(obj.get("max_output_tokens"))
            .unwrap_or(default_max_tokens)
            .min(MAX_OUTPUT_TOKENS),
        Prompt::Messages { .. } | Prompt::Text(_) => {
            let cap = OUTPUT_CAPS
                .iter()
                .find_map(|path| positive_u64(field(obj, path)))
                .unwrap_or(default_max_tokens)
                .min(MAX_OUTPUT_TOKENS);
            let n = CHOICES
                .iter()
                .find_map(|path| positive_u64(field(obj, path)))
                .unwrap_or(1)
                .min(MAX_N);
            let batch = match prompt {
                Prompt::Text(text) => batch_size(text),
                _ => 1,
            };
            cap.saturating_mul(n).saturating_mul(batch)
        }
    };
    Weight {
        prompt_tokens: prompt.tokens(&pricing.images),
        output_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (end of stream, content-encoding, content-length, limit 100) -> why not read.
    #[test]
    fn unreadable_bodies_table() {
        type Case = (
            bool,
            Option<&'static str>,
            Option<&'static str>,
            Option<Unreadable>,
        );
        let cases: &[Case] = &[
            (false, None, None, None),
            (false, Some("identity"), Some("100"), None),
            (false, Some("IDENTITY"), Some(" 99 "), None),
            (false, None, Some("not a number"), None),
            (true, Some("gzip"), Some("1000"), Some(Unreadable::NoBody)),
            (false, Some("gzip"), Some("1000"), Some(Unreadable::Encoded)),
            (false, Some("br"), None, Some(Unreadable::Encoded)),
            (false, None, Some("101"), Some(Unreadable::OverLimit)),
        ];
        for &(eos, enc, len, want) in cases {
            let header = |name: &str| match name {
                "content-encoding" => enc.map(str::to_string),
                "content-length" => len.map(str::to_string),
                _ => None,
            };
            assert_eq!(unreadable(eos, header, 100), want, "{eos} {enc:?} {len:?}");
        }
    }

    #[test]
    fn text_tokens_by_script() {
        let cases: &[(&str, u64)] = &[
            ("", 0),
            ("abcd", 1),
            ("abcde", 2),
            ("The quick brown fox jumps over the lazy dog", 11), // 43 chars / 4
            ("El niño comió piñata", 7),                         // 20 chars / 3
            ("你好世界", 4),
            ("こんにちは", 5),
            ("안녕하세요", 5),
            ("Привет мир", 6), // 9 Cyrillic / 2 -> 5, 1 space / 4 -> 1
            ("hi 你好", 3),    // 3 latin -> 1, 2 CJK
        ];
        for (text, want) in cases {
            assert_eq!(estimate_text_tokens(text), *want, "{text:?}");
        }
    }

    #[test]
    fn ascii_text_counts_as_the_classifying_loop_would() {
        // The fast path must agree with the per-character rule: pure ASCII of every length
        // mod 4, and the same text with one non-ASCII character (which takes the loop).
        for len in 0..12 {
            let text: String = "abc d".chars().cycle().take(len).collect();
            assert_eq!(
                estimate_text_tokens(&text),
                (len as u64).div_ceil(4),
                "{text:?}"
            );
            let mixed = format!("{text}\u{2014}");
            assert_eq!(
                estimate_text_tokens(&mixed),
                (len as u64).div_ceil(4) + 1,
                "{mixed:?}"
            );
        }
    }

    #[test]
    fn long_english_prompt_is_about_a_quarter_of_its_characters() {
        let text = "word ".repeat(2000);
        assert_eq!(estimate_text_tokens(&text), 2500);
    }

    fn w(p: u64, o: u64) -> Option<Weight> {
        Some(Weight {
            prompt_tokens: p,
            output_tokens: o,
        })
    }

    #[test]
    fn body_shapes() {
        let cases: &[(Api, &str, Option<Weight>)] = &[
            // chat, string content; 4 overhead + 16 chars / 4
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"abcdabcdabcdabcd"}],"max_tokens":10}"#,
                w(8, 10),
            ),
            // chat, array-of-parts content, images not counted by default,
            // max_completion_tokens wins
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":[{"type":"text","text":"abcdabcd"},{"type":"image_url","image_url":{"url":"x"}}]}],"max_completion_tokens":7,"max_tokens":99}"#,
                w(6, 7),
            ),
            // two messages, default max tokens, n = 3
            (
                Api::Chat,
                r#"{"messages":[{"role":"system","content":"abcd"},{"role":"user","content":"abcd"}],"n":3}"#,
                w(10, 768),
            ),
            // completions, string prompt
            (
                Api::Completions,
                r#"{"prompt":"abcdabcd","max_tokens":5}"#,
                w(2, 5),
            ),
            // completions, array prompt: a batch, every prompt counted and decoded
            (
                Api::Completions,
                r#"{"prompt":["abcd","abcdabcd"],"max_tokens":5}"#,
                w(3, 10),
            ),
            // embeddings: no output
            (
                Api::Embeddings,
                r#"{"input":"abcdabcd","model":"e5"}"#,
                w(2, 0),
            ),
            (Api::Embeddings, r#"{"input":["abcd","abcd"]}"#, w(2, 0)),
            // vLLM embeds chat messages too: still no output
            (
                Api::Embeddings,
                r#"{"messages":[{"role":"user","content":"abcd"}],"max_tokens":9}"#,
                w(5, 0),
            ),
            // Anthropic messages: system string + content blocks
            (
                Api::Messages,
                r#"{"system":"abcdabcd","messages":[{"role":"user","content":[{"type":"text","text":"abcd"}]}],"max_tokens":50}"#,
                w(7, 50),
            ),
            (
                Api::Messages,
                r#"{"system":[{"type":"text","text":"abcd"}],"messages":[{"role":"user","content":"abcd"}],"max_tokens":50}"#,
                w(6, 50),
            ),
            // Responses API: a string input is one user message; instructions another
            (
                Api::Responses,
                r#"{"input":"abcdabcd","max_output_tokens":30}"#,
                w(6, 30),
            ),
            (
                Api::Responses,
                r#"{"instructions":"abcd","input":"abcd","max_tokens":99}"#,
                w(10, 256),
            ),
            // input items: a message with parts (an image: not counted by default), a tool
            // call, its output, reasoning
            (
                Api::Responses,
                r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"abcdabcd"},{"type":"input_image","image_url":"x"}]},{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},{"type":"function_call_output","call_id":"c1","output":"abcd"},{"type":"reasoning","summary":[{"type":"summary_text","text":"abcd"}]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"abcd"}]}],"max_output_tokens":5}"#,
                w(4 + 2 + 4 + 2 + 4 + 1 + 4 + 1 + 4 + 1, 5),
            ),
            // items of the wrong shape count their overhead only
            (
                Api::Responses,
                r#"{"input":[7,{"role":"user"},{"type":"function_call","arguments":{"a":1}}]}"#,
                w(12, 256),
            ),
            // unknown path: the shape decides
            (Api::Other, r#"{"input":"abcd"}"#, w(1, 0)),
            (
                Api::Other,
                r#"{"input":"abcd","max_output_tokens":7}"#,
                w(5, 7),
            ),
            (
                Api::Other,
                r#"{"input":"abcd","instructions":"abcd"}"#,
                w(10, 256),
            ),
            (Api::Other, r#"{"prompt":"abcd","max_tokens":2}"#, w(1, 2)),
            // float counts accepted
            (Api::Chat, r#"{"messages":[],"max_tokens":12.0}"#, w(0, 12)),
        ];
        for (api, body, want) in cases {
            assert_eq!(estimate(*api, body.as_bytes(), 256), *want, "{body}");
        }
    }

    /// An agent's requests: the tools the template renders, an assistant's tool calls, tool
    /// results, Anthropic's tool use and tool result blocks, and earlier thinking all count.
    #[test]
    fn tools_and_tool_turns_are_prompt() {
        // {"name":"f","parameters":{"type":"object"}}: 3 members (1 each), keys name (1),
        // parameters (3), type (1), values f (1) and object (2).
        let tools = r#"[{"name":"f","parameters":{"type":"object"}}]"#;
        let tool_tokens = 1 + (1 + 1 + 1) + (1 + 3 + (1 + 1 + 2));
        assert_eq!(
            json_tokens(&serde_json::from_str(tools).unwrap()),
            tool_tokens
        );
        let cases: &[(Api, String, Option<Weight>)] = &[
            (
                Api::Chat,
                format!(r#"{{"tools":{tools},"messages":[{{"role":"user","content":"abcd"}}]}}"#),
                w(tool_tokens + 5, 256),
            ),
            // an assistant's tool call (content null), then the tool's result
            (
                Api::Chat,
                r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","function":{"arguments":"abcdabcd"}}]},{"role":"tool","tool_call_id":"c","content":"abcdabcdabcd"}]}"#
                    .to_string(),
                // tool_calls [{id: c, function: {arguments: abcdabcd}}]: 1 + (1 + 1 + 1) +
                // (1 + 2 + (1 + 3 + 2)) = 13
                w(4 + 13 + 4 + 3, 256),
            ),
            // Anthropic: tool_use input as JSON, tool_result content as a message's, thinking
            (
                Api::Messages,
                r#"{"messages":[{"role":"assistant","content":[{"type":"thinking","thinking":"abcdabcd"},{"type":"tool_use","id":"t","name":"f","input":{"q":"abcd"}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"abcdabcd"}]},{"type":"tool_result","tool_use_id":"u","content":"abcd"}]}],"max_tokens":9}"#
                    .to_string(),
                w(4 + 2 + 3 + 4 + 2 + 1, 9),
            ),
            // the Responses API's tools
            (
                Api::Responses,
                format!(r#"{{"tools":{tools},"input":"abcd"}}"#),
                w(tool_tokens + 5, 256),
            ),
        ];
        for (api, body, want) in cases {
            assert_eq!(estimate(*api, body.as_bytes(), 256), *want, "{body}");
        }
    }

    /// Prompts as token ids (one token each, exactly) and engines' native generate bodies,
    /// with their own names for the prompt, the output cap and the number of sequences.
    #[test]
    fn token_ids_and_native_generate_bodies() {
        let cases: &[(Api, &str, Option<Weight>)] = &[
            // vLLM and SGLang completions: ids, a batch of id lists, a batch of strings
            (
                Api::Completions,
                r#"{"prompt":[1,2,3,4,5],"max_tokens":7}"#,
                w(5, 7),
            ),
            (
                Api::Completions,
                r#"{"prompt":[[1,2,3],[4,5]],"max_tokens":7,"n":2}"#,
                w(5, 28),
            ),
            // llama.cpp: ids and strings mixed are one prompt; `n_predict` caps it
            (
                Api::Other,
                r#"{"prompt":[9,"abcdabcd",9],"n_predict":3}"#,
                w(4, 3),
            ),
            (
                Api::Completions,
                r#"{"prompt":"abcd","n_predict":-1}"#,
                w(1, 256),
            ),
            // embeddings of ids
            (Api::Embeddings, r#"{"input":[[1,2],[3,4,5]]}"#, w(5, 0)),
            // SGLang's /generate: text or input_ids, sampling_params
            (
                Api::Generate,
                r#"{"text":"abcdabcd","sampling_params":{"max_new_tokens":9}}"#,
                w(2, 9),
            ),
            (
                Api::Generate,
                r#"{"text":["abcd","abcd"],"sampling_params":{"max_new_tokens":9,"n":2}}"#,
                w(2, 36),
            ),
            (
                Api::Generate,
                r#"{"input_ids":[1,2,3],"sampling_params":{"temperature":0}}"#,
                w(3, 256),
            ),
            // vLLM's tokens-in generate
            (
                Api::Generate,
                r#"{"token_ids":[1,2,3,4],"sampling_params":{"max_tokens":11}}"#,
                w(4, 11),
            ),
            // TGI: inputs, parameters (best_of sequences are all decoded)
            (
                Api::Generate,
                r#"{"inputs":"abcdabcdabcd","parameters":{"max_new_tokens":20,"best_of":2}}"#,
                w(3, 40),
            ),
            // A native field elsewhere is no prompt (SGLang's /encode embeds a `text`)
            (Api::Other, r#"{"text":"abcd"}"#, None),
            (Api::Generate, r#"{"input_embeds":[[0.1,0.2]]}"#, None),
            (Api::Generate, r#"{"text":7}"#, None),
        ];
        for (api, body, want) in cases {
            assert_eq!(estimate(*api, body.as_bytes(), 256), *want, "{body}");
        }
    }

    /// A prompt with parts the estimate does not price (images while images count nothing,
    /// audio) is marked, so that the engine's count of it calibrates nothing; with images
    /// priced, an image is an estimate like text.
    #[test]
    fn prompts_with_parts_not_priced_are_marked() {
        let on = Pricing {
            default_max_tokens: 256,
            images: ImagePricing::on(),
        };
        let off = Pricing::new(256);
        let image = r#"{"type":"image_url","image_url":{"url":"https://x/y.png"}}"#;
        let audio = r#"{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}"#;
        let text = r#"{"type":"text","text":"abcd"}"#;
        let chat = |parts: &[&str]| {
            format!(
                r#"{{"messages":[{{"role":"user","content":[{}]}}]}}"#,
                parts.join(",")
            )
        };
        let in_tool_result = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"tool_result","content":[{image}]}}]}}],"max_tokens":5}}"#
        );
        // (api, body, marked with images off, marked with images priced)
        let cases: Vec<(Api, String, bool, bool)> = vec![
            (Api::Chat, chat(&[text]), false, false),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"abcd"}]}"#.into(),
                false,
                false,
            ),
            (Api::Chat, chat(&[text, image]), true, false),
            (Api::Chat, chat(&[audio, text]), true, true),
            (Api::Messages, in_tool_result, true, false),
            (
                Api::Completions,
                r#"{"prompt":"abcd"}"#.into(),
                false,
                false,
            ),
        ];
        for (api, body, marked_off, marked_on) in cases {
            let read = |p: &Pricing| read_with_chain(api, body.as_bytes(), p, None).unwrap();
            assert_eq!(read(&off).uncounted, marked_off, "{body}");
            assert_eq!(read(&on).uncounted, marked_on, "{body}");
        }
    }

    /// With `images.enabled`, images are prompt: by their size where the body carries the
    /// image (a PNG header in a `data:` URL or Anthropic's base64), else at the configured
    /// default, in every API's shape; `pixels_per_token: 0` counts every one at the default.
    #[test]
    fn images_are_prompt() {
        let on = Pricing {
            default_max_tokens: 256,
            images: ImagePricing::on(),
        };
        let estimate =
            |api: Api, body: &[u8], _| read_with_chain(api, body, &on, None).map(|e| e.weight);
        // A PNG header of 1024 x 768 (1,004 tokens at 784 pixels a token), in base64.
        let png = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAA=";
        let cases: &[(Api, String, u64)] = &[
            (
                Api::Chat,
                format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"data:image/png;base64,{png}"}}}},{{"type":"text","text":"abcd"}}]}}]}}"#),
                4 + 1004 + 1,
            ),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://x/y.png"}]}]}"#.to_string(),
                4 + 1024,
            ),
            (
                Api::Responses,
                format!(r#"{{"input":[{{"role":"user","content":[{{"type":"input_image","image_url":"data:image/png;base64,{png}"}}]}}]}}"#),
                4 + 1004,
            ),
            (
                Api::Messages,
                format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{png}"}}}},{{"type":"image","source":{{"type":"url","url":"https://x/y.png"}}}}]}}],"max_tokens":5}}"#),
                4 + 1004 + 1024,
            ),
            // an image in a tool's result
            (
                Api::Messages,
                format!(r#"{{"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":[{{"type":"image","source":{{"type":"base64","data":"{png}"}}}}]}}]}}],"max_tokens":5}}"#),
                4 + 1004,
            ),
        ];
        for (api, body, want) in cases {
            let got = estimate(*api, body.as_bytes(), 256).map(|w| w.prompt_tokens);
            assert_eq!(got, Some(*want), "{body}");
        }
        let fixed = Pricing {
            default_max_tokens: 256,
            images: ImagePricing {
                tokens: 256,
                pixels_per_token: 0,
                enabled: true,
            },
        };
        let e = read_with_chain(Api::Chat, cases[0].1.as_bytes(), &fixed, None).unwrap();
        assert_eq!(e.weight.prompt_tokens, 4 + 256 + 1);
        // Off (the default): images count nothing.
        let off = read(Api::Chat, cases[0].1.as_bytes(), 256).unwrap();
        assert_eq!(off.weight.prompt_tokens, 4 + 1);
    }

    /// Counting, tokenizing or rendering a prompt costs nothing, however long the prompt; the
    /// model still comes with it.
    #[test]
    fn counting_a_prompt_costs_nothing() {
        let long = "abcd".repeat(1000);
        for body in [
            format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":"{long}"}}],"max_tokens":9}}"#
            ),
            format!(r#"{{"model":"m","input":"{long}"}}"#),
            r#"{"model":"m","tokens":[1,2,3]}"#.to_string(),
        ] {
            let e =
                read_with_chain(Api::Count, body.as_bytes(), &Pricing::new(256), Some(64)).unwrap();
            assert_eq!(e.weight, Weight::default(), "{body}");
            assert_eq!(e.model.as_deref(), Some("m"));
            assert!(e.chain.is_empty());
        }
        assert_eq!(read(Api::Count, b"not json", 256), None);
    }

    #[test]
    fn malformed_bodies() {
        let cases: &[(&str, Option<Weight>)] = &[
            ("", None),
            ("not json", None),
            (r#"{"messages":"#, None),      // truncated
            ("[1,2,3]", None),              // not an object
            (r#"{"model":"x"}"#, None),     // no prompt at all
            (r#"{"prompt":42}"#, None),     // prompt of the wrong type
            (r#"{"input":{"a":1}}"#, None), // input of the wrong type
            // wrong-typed fields degrade one by one
            (
                r#"{"messages":[{"content":5},{"nocontent":true},7],"max_tokens":"many","n":"x"}"#,
                w(12, 256),
            ),
            (r#"{"messages":[],"max_tokens":-5,"n":0}"#, w(0, 256)),
            (r#"{"messages":[],"max_tokens":null}"#, w(0, 256)),
            // absurd values are clamped, never overflow
            (
                r#"{"messages":[],"max_tokens":1e300,"n":1e300}"#,
                w(0, MAX_OUTPUT_TOKENS * MAX_N),
            ),
            (
                r#"{"messages":[],"max_tokens":18446744073709551615,"n":18446744073709551615}"#,
                w(0, MAX_OUTPUT_TOKENS * MAX_N),
            ),
        ];
        for (body, want) in cases {
            assert_eq!(estimate(Api::Chat, body.as_bytes(), 256), *want, "{body}");
        }
        // Not UTF-8 at all.
        assert_eq!(estimate(Api::Chat, &[0xff, 0xfe, 0x00, 0x7b], 256), None);
    }

    #[test]
    fn the_model_comes_with_the_weight() {
        let cases: &[(&str, Option<&str>)] = &[
            (r#"{"model":"m1","messages":[]}"#, Some("m1")),
            (r#"{"messages":[],"model":"sql-lora"}"#, Some("sql-lora")),
            (
                r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"a"}"#,
                Some("meta-llama/Llama-3.1-8B-Instruct"),
            ),
            (r#"{"model":"a\"b\u00e9","messages":[]}"#, Some("a\"bé")),
            (r#"{"messages":[]}"#, None),
            (r#"{"model":"","messages":[]}"#, None),
            (r#"{"model":null,"messages":[]}"#, None),
            (r#"{"model":7,"messages":[]}"#, None),
            (r#"{"model":["m1"],"messages":[]}"#, None),
        ];
        for (body, want) in cases {
            let e = read(Api::Chat, body.as_bytes(), 256).unwrap();
            assert_eq!(e.model.as_deref(), *want, "{body}");
            assert_eq!(Some(e.weight), estimate(Api::Chat, body.as_bytes(), 256));
        }
        // A model does not make a body without a prompt usable.
        assert_eq!(read(Api::Chat, br#"{"model":"m1"}"#, 256), None);
    }

    #[test]
    fn a_responses_request_names_what_it_continues_and_whether_it_stores() {
        let cases: &[(Api, &str, Option<&str>, bool)] = &[
            (Api::Responses, r#"{"input":"hi"}"#, None, true),
            (Api::Responses, r#"{"input":"hi","store":true}"#, None, true),
            (
                Api::Responses,
                r#"{"input":"hi","store":false}"#,
                None,
                false,
            ),
            (
                Api::Responses,
                r#"{"input":"hi","previous_response_id":"resp_1"}"#,
                Some("resp_1"),
                true,
            ),
            // On an unknown path the body's shape tells a Responses request.
            (
                Api::Other,
                r#"{"input":"hi","previous_response_id":"resp_1","store":false}"#,
                Some("resp_1"),
                false,
            ),
            (
                Api::Responses,
                r#"{"input":"hi","previous_response_id":"a b"}"#,
                None,
                true,
            ),
            (
                Api::Responses,
                r#"{"input":"hi","previous_response_id":7}"#,
                None,
                true,
            ),
            (
                Api::Responses,
                r#"{"input":"hi","previous_response_id":null}"#,
                None,
                true,
            ),
            // Only a Responses request stores, or continues a stored one.
            (
                Api::Chat,
                r#"{"messages":[],"previous_response_id":"resp_1"}"#,
                None,
                false,
            ),
            (
                Api::Completions,
                r#"{"prompt":"hi","store":true}"#,
                None,
                false,
            ),
        ];
        for (api, body, continues, stores) in cases {
            let e = read(*api, body.as_bytes(), 256).unwrap();
            assert_eq!(e.continues.as_deref(), *continues, "{body}");
            assert_eq!(e.stores, *stores, "{body}");
        }
    }

    /// A prompt of token ids (alone, in a batch, beside text) is counted exactly, so it is
    /// marked as such; text and chat are estimates (see `route::prompt_scale`).
    #[test]
    fn prompts_of_token_ids_are_marked_exact() {
        let cases: &[(Api, &str, bool)] = &[
            (Api::Completions, r#"{"prompt":"hello there"}"#, false),
            (Api::Completions, r#"{"prompt":["a","b"]}"#, false),
            (Api::Completions, r#"{"prompt":[1,2,3]}"#, true),
            (Api::Completions, r#"{"prompt":[[1,2],[3]]}"#, true),
            (Api::Completions, r#"{"prompt":["a",[1,2]]}"#, true),
            (
                Api::Chat,
                r#"{"messages":[{"role":"user","content":"hi"}]}"#,
                false,
            ),
            (Api::Embeddings, r#"{"input":[5,6]}"#, true),
            (Api::Embeddings, r#"{"input":"five six"}"#, false),
        ];
        for (api, body, ids) in cases {
            let e = read(*api, body.as_bytes(), 256).unwrap();
            assert_eq!(e.ids, *ids, "{body}");
        }
    }

    #[test]
    fn api_from_path() {
        for (path, api) in [
            ("/v1/chat/completions", Api::Chat),
            ("/v1/chat/completions?x=1", Api::Chat),
            ("/v1/completions", Api::Completions),
            ("/openai/v1/embeddings", Api::Embeddings),
            ("/v1/messages", Api::Messages),
            ("/v1/responses", Api::Responses),
            ("/responses", Api::Responses),
            ("/v1/responses/input_tokens", Api::Count),
            ("/v1/messages/count_tokens", Api::Count),
            ("/tokenize", Api::Count),
            ("/detokenize", Api::Count),
            ("/apply-template", Api::Count),
            ("/generate", Api::Generate),
            ("/generate_stream", Api::Generate),
            ("/inference/v1/generate?x=1", Api::Generate),
            ("/completion", Api::Other),
            ("/encode", Api::Other),
        ] {
            assert_eq!(Api::from_path(path), api, "{path}");
        }
    }
}
