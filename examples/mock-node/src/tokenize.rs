//! The mock node's own token count. It is deliberately not the filter's rule (the filter
//! estimates from characters, ~4 a token): like a real engine's tokenizer, it is something the
//! filter can only approximate, so the benchmark measures the filter with an honest estimate
//! error.
//!
//! Rule: ceil(1.3 x whitespace-separated words) + one per ASCII punctuation mark, and for chat
//! bodies 4 more per message (role markers and separators of a chat template).

use serde_json::Value;

/// Tokens a chat template adds per message.
pub const PER_MESSAGE: u64 = 4;

/// Tokens in a piece of text.
pub fn count(text: &str) -> u64 {
    let words = text.split_whitespace().count() as u64;
    let punct = text.chars().filter(char::is_ascii_punctuation).count() as u64;
    (words * 13).div_ceil(10) + punct
}

/// Prompt tokens of a `/v1/chat/completions` body: `messages` is an array whose `content` is a
/// string, an array of parts (`{"type":"text","text":..}` or strings; other parts such as
/// images count nothing), or absent/null (e.g. an assistant message with tool calls).
pub fn chat_prompt_tokens(body: &Value) -> Result<u64, String> {
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Err("`messages` must be an array".into());
    };
    Ok(messages
        .iter()
        .map(|m| PER_MESSAGE + m.get("content").map_or(0, content_tokens))
        .sum())
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

fn content_tokens(content: &Value) -> u64 {
    match content {
        Value::String(s) => count(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => count(s),
                _ => p.get("text").and_then(Value::as_str).map_or(0, count),
            })
            .sum(),
        _ => 0,
    }
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
                Ok((4 + 4) + (4 + 2 + 2) + 4),
            ),
            (json!({"prompt": "hi"}), Err(())),
            (json!({"messages": "hi"}), Err(())),
        ] {
            assert_eq!(chat_prompt_tokens(&body).map_err(|_| ()), want, "{body}");
        }
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
        }
    }
}
