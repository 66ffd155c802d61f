//! The mock node's own token count. It is deliberately not the filter's rule (the filter
//! estimates from characters, ~4 a token): like a real engine's tokenizer, it is something the
//! filter can only approximate, so the benchmark measures the filter with an honest estimate
//! error.
//!
//! Rule: ceil(1.3 x whitespace-separated words) + one per ASCII punctuation mark, and for chat
//! bodies 4 more per message (role markers and separators of a chat template). An image in a
//! chat counts as Qwen2.5-VL counts it (`image_ids`): not the filter's rule either.
//!
//! The same rule also yields token *ids* (`*_ids`), one per counted token, for prefix caching:
//! they are a function of the text up to that token only, so two prompts with the same leading
//! text have the same leading ids, hence the same leading cache blocks (`prefix.rs`).

use crate::prefix::{fnv1a, FNV_OFFSET};
use serde_json::Value;

/// Tokens a chat template adds per message.
pub const PER_MESSAGE: u64 = 4;

/// `ids` as another tokenizer would count them, `scale` times as many (`token_scale=`): each
/// id kept, dropped or followed by ids derived from it, so that the same prompt gives the same
/// ids (and its prefix is cached alike).
pub fn rescale(ids: Vec<u64>, scale: f64) -> Vec<u64> {
    if scale == 1.0 {
        return ids;
    }
    let upto = |i: usize| (i as f64 * scale).floor() as usize;
    let mut out = Vec::with_capacity(upto(ids.len()) + 1);
    for (i, id) in ids.into_iter().enumerate() {
        for k in 0..upto(i + 1) - upto(i) {
            out.push(if k == 0 {
                id
            } else {
                id.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    .wrapping_add(k as u64)
            });
        }
    }
    out
}

/// Tokens in a piece of text.
pub fn count(text: &str) -> u64 {
    let words = text.split_whitespace().count() as u64;
    let punct = text.chars().filter(char::is_ascii_punctuation).count() as u64;
    (words * 13).div_ceil(10) + punct
}

/// Prompt tokens of a `/v1/chat/completions` body: as many as its ids (`chat_prompt_ids`).
pub fn chat_prompt_tokens(body: &Value) -> Result<u64, String> {
    chat_prompt_ids(body).map(|ids| ids.len() as u64)
}

/// Prompt tokens of a `/v1/completions` body: `prompt` is a string, an array of strings, or
/// (as OpenAI allows) token ids: an array of integers or an array of such arrays.
pub fn completion_prompt_tokens(body: &Value) -> Result<u64, String> {
    match body.get("prompt") {
        Some(Value::String(s)) => Ok(count(s)),
        Some(Value::Array(items)) => Ok(items
            .iter()
            .map(|item| match item {
                Value::String(s) => count(s),
                Value::Number(_) => 1,
                Value::Array(ids) => ids.len() as u64,
                _ => 0,
            })
            .sum()),
        _ => Err("`prompt` must be a string or an array".into()),
    }
}

/// Tags that keep the id kinds apart (a word, a punctuation mark, a chat-template marker).
const PUNCT_TAG: u64 = 0x7075_6e63_0000_0000;
const TEMPLATE_TAG: u64 = 0x7465_6d70_0000_0000;

/// Appends the ids of `text`'s tokens, exactly `count(text)` of them. Word `i` (0-based) is
/// ceil(1.3 (i+1)) - ceil(1.3 i) tokens (1 or 2; the sum telescopes to `count`'s ceil(1.3 n)),
/// followed by one token per punctuation mark in it.
pub fn text_ids(text: &str, out: &mut Vec<u64>) {
    for (i, word) in text.split_whitespace().enumerate() {
        let i = i as u64;
        let pieces = (13 * (i + 1)).div_ceil(10) - (13 * i).div_ceil(10);
        let h = fnv1a(FNV_OFFSET, word.as_bytes());
        out.extend((0..pieces).map(|p| h.wrapping_add(p)));
        out.extend(
            word.chars()
                .filter(char::is_ascii_punctuation)
                .map(|c| PUNCT_TAG | u64::from(c)),
        );
    }
}

/// Prompt token ids of a `/v1/chat/completions` body, as a chat template renders it: the
/// request's `tools` first (dumped as JSON, as templates do, after `PER_MESSAGE` template
/// ids), then per message `PER_MESSAGE` template ids derived from its role, its content's ids
/// and an assistant's `tool_calls` (as JSON). `messages` is an array whose `content` is a
/// string, an array of parts (`{"type":"text","text":..}` or strings, Anthropic-style
/// `tool_result` blocks by their `content` and `tool_use` blocks by their `input` as JSON,
/// images as a vision model counts them (`image_ids`); other parts such as audio count
/// nothing), or absent/null (e.g. an assistant message with tool calls).
pub fn chat_prompt_ids(body: &Value) -> Result<Vec<u64>, String> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Err("`messages` must be an array".into());
    };
    let mut out = Vec::new();
    let template = |role: &str, out: &mut Vec<u64>| {
        let r = fnv1a(FNV_OFFSET, role.as_bytes()) & 0xffff_ffff;
        out.extend((0..PER_MESSAGE).map(|j| TEMPLATE_TAG | (r << 4) | j));
    };
    if let Some(tools) = body.get("tools").filter(|t| !t.is_null()) {
        template("tools", &mut out);
        text_ids(&tools.to_string(), &mut out);
    }
    for m in messages {
        template(
            m.get("role").and_then(Value::as_str).unwrap_or_default(),
            &mut out,
        );
        if let Some(content) = m.get("content") {
            content_ids(content, &mut out);
        }
        if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
            text_ids(&calls.to_string(), &mut out);
        }
    }
    Ok(out)
}

/// The ids of a message's content (see `chat_prompt_ids`).
fn content_ids(content: &Value, out: &mut Vec<u64>) {
    match content {
        Value::String(s) => text_ids(s, out),
        Value::Array(parts) => {
            for p in parts {
                if let Value::String(s) = p {
                    text_ids(s, out);
                } else if is_image(p) {
                    image_ids(p, out);
                } else if let Some(t) = p.get("text").and_then(Value::as_str) {
                    text_ids(t, out);
                } else if let Some(c) = p.get("content") {
                    content_ids(c, out);
                } else if let Some(input) = p.get("input") {
                    text_ids(&input.to_string(), out);
                }
            }
        }
        _ => {}
    }
}

/// An image part: OpenAI's `image_url`, the Responses API's `input_image`, Anthropic's
/// `image`.
fn is_image(part: &Value) -> bool {
    matches!(
        part.get("type").and_then(Value::as_str),
        Some("image_url" | "input_image" | "image")
    )
}

/// Most pixels Qwen2.5-VL's processor keeps of an image (and fewest it scales one up to).
const MAX_PIXELS: f64 = 12_845_056.0;
const MIN_PIXELS: f64 = 3_136.0;
/// Tokens of an image whose size the body does not give (a link): a 1008 x 1008 one.
const LINKED_IMAGE_TOKENS: u64 = 1_296;

/// Appends the ids of an image part, as a Qwen2.5-VL-like engine counts it: the image resized
/// to multiples of 28 pixels within its pixel bounds, a token per 28 x 28 square, plus the
/// vision start and end markers. The size is read from a PNG header in a `data:` URL (or bare
/// base64); any other image is counted at `LINKED_IMAGE_TOKENS`. The ids are the image's own
/// (its source's length and last bytes), so the same image gives the same ids.
fn image_ids(part: &Value, out: &mut Vec<u64>) {
    let url = match part.get("image_url") {
        Some(Value::Object(u)) => u.get("url"),
        url => url,
    };
    let source = url
        .or_else(|| part.pointer("/source/data"))
        .or_else(|| part.pointer("/source/url"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    let tokens = png_size(source).map_or(LINKED_IMAGE_TOKENS, |(w, h)| {
        let (w, h) = (f64::from(w), f64::from(h));
        let side = |x: f64| ((x / 28.0).round() * 28.0).max(28.0);
        let (mut bw, mut bh) = (side(w), side(h));
        if bw * bh > MAX_PIXELS {
            let beta = (w * h / MAX_PIXELS).sqrt();
            bw = ((w / beta / 28.0).floor() * 28.0).max(28.0);
            bh = ((h / beta / 28.0).floor() * 28.0).max(28.0);
        } else if bw * bh < MIN_PIXELS {
            let beta = (MIN_PIXELS / (w * h)).sqrt();
            bw = (w * beta / 28.0).ceil() * 28.0;
            bh = (h * beta / 28.0).ceil() * 28.0;
        }
        (bw * bh / 784.0) as u64
    });
    let bytes = source.as_bytes();
    let tail = bytes
        .get(bytes.len().saturating_sub(64)..)
        .unwrap_or_default();
    let h = fnv1a(fnv1a(FNV_OFFSET, &(bytes.len() as u64).to_le_bytes()), tail);
    out.push(TEMPLATE_TAG | 0x7673); // vision start
    out.extend((0..tokens).map(|k| h.wrapping_add(k)));
    out.push(TEMPLATE_TAG | 0x7665); // vision end
}

/// Width and height of a PNG given as a `data:` URL or bare base64.
fn png_size(source: &str) -> Option<(u32, u32)> {
    let b64 = match source.strip_prefix("data:") {
        Some(rest) => rest.split_once(";base64,")?.1,
        None => source,
    };
    let sextet = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    // The first 24 bytes: the signature and the IHDR's width and height.
    let mut bytes = Vec::with_capacity(24);
    for group in b64.as_bytes().get(..32)?.chunks(4) {
        let word = group
            .iter()
            .try_fold(0u32, |w, c| Some(w << 6 | u32::from(sextet(*c)?)))?;
        bytes.extend_from_slice(&word.to_be_bytes()[1..]);
    }
    let be32 = |i: usize| Some(u32::from_be_bytes(bytes.get(i..i + 4)?.try_into().ok()?));
    (bytes.get(..8)? == b"\x89PNG\r\n\x1a\n").then_some(())?;
    Some((be32(16)?, be32(20)?))
}

/// A `/v1/messages` body (Anthropic's Messages API) as the chat body it stands for: its
/// `system` (a string or text blocks) the system message, then its messages (content blocks
/// read as a chat's parts), and its `tools`.
pub fn messages_as_chat(body: &Value) -> Result<Value, String> {
    let Some(Value::Array(given)) = body.get("messages") else {
        return Err("messages: Field required".into());
    };
    let mut messages = Vec::with_capacity(given.len() + 1);
    if let Some(system) = body.get("system").filter(|s| !s.is_null()) {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    messages.extend(given.iter().cloned());
    let mut chat = serde_json::json!({"messages": messages});
    if let (Some(tools), Some(o)) = (body.get("tools"), chat.as_object_mut()) {
        o.insert("tools".into(), tools.clone());
    }
    Ok(chat)
}

/// A `/v1/responses` body (OpenAI's Responses API) as the chat body it stands for, as
/// llama.cpp's server converts it before its chat template: `instructions` is the system
/// message, a string `input` the user's, and `input`'s items are messages (`role`, `content`),
/// tool calls (an assistant message of their `arguments`), tool outputs (a `tool` message of
/// their `output`) and reasoning (an assistant message of its `content`).
pub fn responses_as_chat(body: &Value) -> Result<Value, String> {
    let mut messages = Vec::new();
    if let Some(i) = body.get("instructions").filter(|i| !i.is_null()) {
        messages.push(serde_json::json!({"role": "system", "content": i}));
    }
    match body.get("input") {
        Some(Value::String(s)) => messages.push(serde_json::json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for item in items {
                let kind = item.get("type").and_then(Value::as_str);
                let (role, content) = match kind {
                    Some("function_call") => ("assistant", item.get("arguments")),
                    Some("function_call_output") => ("tool", item.get("output")),
                    Some("reasoning") => ("assistant", item.get("content")),
                    _ => (
                        item.get("role").and_then(Value::as_str).unwrap_or("user"),
                        item.get("content"),
                    ),
                };
                messages.push(serde_json::json!({"role": role, "content": content}));
            }
        }
        _ => return Err("'input' must be a string or array of objects".into()),
    }
    let mut chat = serde_json::json!({"messages": messages});
    if let (Some(tools), Some(o)) = (body.get("tools"), chat.as_object_mut()) {
        o.insert("tools".into(), tools.clone());
    }
    Ok(chat)
}

/// Prompt token ids of a `/v1/completions` body; token-id prompts are their own ids. As many as
/// `completion_prompt_tokens` counts.
pub fn completion_prompt_ids(body: &Value) -> Result<Vec<u64>, String> {
    prompt_ids(body.get("prompt")).ok_or_else(|| "`prompt` must be a string or an array".into())
}

/// Prompt token ids of a native `/generate` body, as SGLang's: `text` (a string or strings) or
/// `input_ids` (ids, or lists of ids), read as a completion's prompt.
pub fn generate_prompt_ids(body: &Value) -> Result<Vec<u64>, String> {
    prompt_ids(body.get("text").or_else(|| body.get("input_ids")))
        .ok_or_else(|| "Either text or input_ids should be provided.".into())
}

/// The ids of a prompt given as text or token ids (see `completion_prompt_ids`); `None` when it
/// is neither.
fn prompt_ids(prompt: Option<&Value>) -> Option<Vec<u64>> {
    let mut out = Vec::new();
    // A JSON integer that is not a u64 (negative, say) still stands for one token.
    let id = |n: &serde_json::Number| n.as_u64().unwrap_or_else(|| n.as_i64().unwrap_or(0) as u64);
    match prompt {
        Some(Value::String(s)) => text_ids(s, &mut out),
        Some(Value::Array(items)) => {
            for item in items {
                match item {
                    Value::String(s) => text_ids(s, &mut out),
                    Value::Number(n) => out.push(id(n)),
                    Value::Array(ids) => out.extend(ids.iter().map(|v| match v {
                        Value::Number(n) => id(n),
                        _ => 0,
                    })),
                    _ => {}
                }
            }
        }
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text() {
        for (text, want) in [
            ("", 0),
            ("hello", 2),                // ceil(1.3)
            ("hello world", 3),          // ceil(2.6)
            ("Hello, world!", 5),        // 3 + 2 marks
            ("a b c d e f g h i j", 13), // exactly 13
            ("  spaced\n\tout  ", 3),
            ("héllo wörld", 3), // non-ASCII letters are not punctuation
            ("...", 5),         // one word, three marks
        ] {
            assert_eq!(count(text), want, "{text:?}");
        }
    }

    #[test]
    fn chat_bodies() {
        for (body, want) in [
            (json!({"messages": []}), Ok(0)),
            (
                json!({"messages": [{"role": "user", "content": "hello world"}]}),
                Ok(4 + 3),
            ),
            (
                json!({"messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "hello"},
                                                 {"type": "image_url", "image_url": {"url": "x"}},
                                                 "world"]},
                    {"role": "assistant", "content": null}]}),
                // an image whose size is not given: LINKED_IMAGE_TOKENS and its markers
                Ok((4 + 4) + (4 + 2 + (LINKED_IMAGE_TOKENS + 2) + 2) + 4),
            ),
            (json!({"prompt": "hi"}), Err(())),
            (json!({"messages": "hi"}), Err(())),
        ] {
            assert_eq!(chat_prompt_tokens(&body).map_err(|_| ()), want, "{body}");
        }
    }

    /// An agent's prompt: the tools (as JSON), an assistant's tool calls (as JSON), tool
    /// results and Anthropic's tool blocks count, as a chat template renders them.
    #[test]
    fn tools_and_tool_turns_count() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        // [{"function":{"name":"f"},"type":"function"}]: one word (2 tokens) and 20
        // punctuation marks.
        assert_eq!(count(&tools.to_string()), 2 + 20);
        let body = json!({"tools": tools, "messages": [
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "c", "function": {"arguments": "x"}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "user", "content": [
                {"type": "tool_result", "content": [{"type": "text", "text": "warm"}]},
                {"type": "tool_use", "input": {"q": "y"}}]}]});
        let calls = json!([{"id": "c", "function": {"arguments": "x"}}]).to_string();
        let input = json!({"q": "y"}).to_string();
        let want = (4 + 22) + (4 + 3) + (4 + count(&calls)) + (4 + 2) + (4 + 2 + count(&input));
        assert_eq!(chat_prompt_tokens(&body), Ok(want));
        // The Responses API's tools too.
        let r = responses_as_chat(&json!({"tools": tools, "input": "hello world"})).unwrap();
        assert_eq!(chat_prompt_tokens(&r), Ok((4 + 22) + (4 + 3)));
    }

    #[test]
    fn responses_bodies_count_as_their_chat() {
        let body = json!({"instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello world"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "sunny"}]});
        let chat = responses_as_chat(&body).unwrap();
        assert_eq!(
            chat_prompt_tokens(&chat),
            Ok((4 + 4) + (4 + 3) + (4 + 2 + 2) + (4 + 2))
        );
        let one = responses_as_chat(&json!({"input": "hello world"})).unwrap();
        assert_eq!(chat_prompt_tokens(&one), Ok(4 + 3));
        assert!(responses_as_chat(&json!({"input": 7})).is_err());
        assert!(responses_as_chat(&json!({"messages": []})).is_err());
    }

    #[test]
    fn completion_bodies() {
        for (body, want) in [
            (json!({"prompt": "Once upon a time"}), Ok(6)),
            (json!({"prompt": ["Once upon", "a time"]}), Ok(3 + 3)),
            (json!({"prompt": [1, 2, 3]}), Ok(3)),
            (json!({"prompt": [[1, 2], [3]]}), Ok(3)),
            (json!({"prompt": 7}), Err(())),
            (json!({}), Err(())),
        ] {
            assert_eq!(
                completion_prompt_tokens(&body).map_err(|_| ()),
                want,
                "{body}"
            );
            let ids = completion_prompt_ids(&body).map(|v| v.len() as u64);
            assert_eq!(ids.map_err(|_| ()), want, "{body}");
        }
    }

    /// SGLang's `/generate`: `text` or `input_ids`, the ids as given.
    #[test]
    fn generate_bodies() {
        let ids = |body: Value| generate_prompt_ids(&body);
        assert_eq!(
            ids(json!({"text": "Once upon a time"})).map(|v| v.len()),
            Ok(6)
        );
        assert_eq!(ids(json!({"input_ids": [5, 6, 7]})), Ok(vec![5, 6, 7]));
        assert_eq!(ids(json!({"input_ids": [[5], [6]]})), Ok(vec![5, 6]));
        assert!(ids(json!({"prompt": "no"})).is_err());
    }

    /// Images count as a Qwen2.5-VL-like engine counts them: 1024 x 768 resizes to 1036 x 756
    /// (37 x 27 = 999 tokens), plus the two markers; a link counts 1,296 and the markers.
    #[test]
    fn images_count_as_a_vision_model_counts_them() {
        let png = "iVBORw0KGgoAAAANSUhEUgAABAAAAAMACAIAAAA=";
        assert_eq!(png_size(png), Some((1024, 768)));
        assert_eq!(
            png_size(&format!("data:image/png;base64,{png}")),
            Some((1024, 768))
        );
        assert_eq!(png_size("https://x/y.png"), None);
        let chat = |part: Value| json!({"messages": [{"role": "user", "content": [part]}]});
        let url = format!("data:image/png;base64,{png}");
        for (part, tokens) in [
            (
                json!({"type": "image_url", "image_url": {"url": url}}),
                999 + 2,
            ),
            (json!({"type": "input_image", "image_url": url}), 999 + 2),
            (
                json!({"type": "image", "source": {"type": "base64", "data": png}}),
                999 + 2,
            ),
            (
                json!({"type": "image_url", "image_url": {"url": "https://x/y.png"}}),
                1296 + 2,
            ),
        ] {
            let ids = chat_prompt_ids(&chat(part.clone())).unwrap();
            assert_eq!(ids.len() as u64, PER_MESSAGE + tokens, "{part}");
        }
        // The same image gives the same ids, another image others.
        let a = chat_prompt_ids(&chat(
            json!({"type": "image_url", "image_url": {"url": url}}),
        ));
        let b = chat_prompt_ids(&chat(
            json!({"type": "image_url", "image_url": {"url": url}}),
        ));
        assert_eq!(a, b);
        let other = chat_prompt_ids(&chat(
            json!({"type": "image_url", "image_url": {"url": "https://x"}}),
        ));
        assert_ne!(a.unwrap().get(5), other.unwrap().get(5));
    }

    #[test]
    fn ids_are_as_many_as_the_count() {
        let long = "the model server request token, cluster! latency ".repeat(37);
        for text in [
            "",
            "hello",
            "Hello, world!",
            "a b c d e f g h i j k l m n o p q r s t u",
            "...",
            "  spaced\n\tout  ",
            long.as_str(),
        ] {
            let mut ids = vec![];
            text_ids(text, &mut ids);
            assert_eq!(ids.len() as u64, count(text), "{text:?}");
        }
        let body = json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, "world", {"type": "image_url"}]},
            {"role": "assistant", "content": null}]});
        let ids = chat_prompt_ids(&body).unwrap();
        assert_eq!(Ok(ids.len() as u64), chat_prompt_tokens(&body));
        assert!(chat_prompt_ids(&json!({"messages": "hi"})).is_err());
    }

    #[test]
    fn equal_leading_text_gives_equal_leading_ids() {
        let ids = |t: &str| {
            let mut v = vec![];
            text_ids(t, &mut v);
            v
        };
        let a = ids("one two three four five six seven eight nine ten eleven");
        let b = ids("one two three four five six seven eight nine ten twelve, and more");
        let shared = ids("one two three four five six seven eight nine ten").len();
        assert_eq!(a[..shared], b[..shared]);
        assert_ne!(a[shared], b[shared]);
        // The role is part of a chat prompt's ids.
        let user = chat_prompt_ids(&json!({"messages": [{"role": "user", "content": "x"}]}));
        let sys = chat_prompt_ids(&json!({"messages": [{"role": "system", "content": "x"}]}));
        assert_ne!(user.unwrap()[0], sys.unwrap()[0]);
        // Token-id prompts are their own ids.
        let ids = completion_prompt_ids(&json!({"prompt": [[5, 6], [7]]})).unwrap();
        assert_eq!(ids, vec![5, 6, 7]);
    }

    #[test]
    fn another_tokenizer_counts_a_share_of_the_ids_alike_each_time() {
        let ids: Vec<u64> = (100..200).collect();
        for (scale, want) in [(1.0, 100), (0.5, 50), (2.0, 200), (1.5, 150), (0.25, 25)] {
            let out = rescale(ids.clone(), scale);
            assert_eq!(out.len(), want, "{scale}");
            assert_eq!(
                out,
                rescale(ids.clone(), scale),
                "the same prompt, the same ids"
            );
            // A prompt's prefix gives the prefix of its ids.
            let head = rescale(ids[..40].to_vec(), scale);
            assert_eq!(out.get(..head.len()), Some(&head[..]), "{scale}");
        }
    }
}
