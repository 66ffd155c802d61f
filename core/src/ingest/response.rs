//! Output observed in responses: how many tokens a stream actually generated.
//!
//! Clients cap `max_tokens` far above what models generate, so the cap is a poor estimate of a
//! request's decode work and of the KV it will grow into. The filter learns the real output
//! lengths from the responses passing through it, without buffering them: each response chunk
//! is scanned for content deltas of OpenAI-style SSE streams (`"content":"…"` in chat chunks,
//! `"text":"…"` in completion and Anthropic text-delta chunks; engines send about one token per
//! event), and for the exact count where the server reports usage (`"completion_tokens":N`,
//! or Anthropic's `"output_tokens":N`), which wins when present.

fn count(hay: &[u8], needle: &[u8], mut accept: impl FnMut(&[u8]) -> bool) -> u64 {
    let mut n = 0;
    let mut i = 0;
    while let Some(pos) = hay
        .get(i..)
        .and_then(|rest| rest.windows(needle.len()).position(|w| w == needle))
    {
        let after = i + pos + needle.len();
        if accept(hay.get(after..).unwrap_or_default()) {
            n += 1;
        }
        i = after;
    }
    n
}

/// Content-bearing events in a response chunk (non-empty `content` or `text` strings).
pub fn output_events(chunk: &[u8]) -> u64 {
    let non_empty = |rest: &[u8]| rest.first().is_some_and(|&b| b != b'"');
    count(chunk, b"\"content\":\"", non_empty) + count(chunk, b"\"text\":\"", non_empty)
}

/// The output token count a server reports in the chunk, if it does.
pub fn reported_output_tokens(chunk: &[u8]) -> Option<u64> {
    let mut found = None;
    for key in [&b"\"completion_tokens\":"[..], &b"\"output_tokens\":"[..]] {
        count(chunk, key, |rest| {
            let digits: Vec<u8> = rest
                .iter()
                .skip_while(|b| **b == b' ')
                .take_while(|b| b.is_ascii_digit())
                .copied()
                .collect();
            if let Some(v) = std::str::from_utf8(&digits)
                .ok()
                .and_then(|d| d.parse().ok())
            {
                found = Some(v);
            }
            false
        });
    }
    found
}

/// What one response has shown of its output so far, fed chunk by chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputMeter {
    events: u64,
    reported: Option<u64>,
}

impl OutputMeter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the next chunk of the response body.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.events = self.events.saturating_add(output_events(chunk));
        if let Some(n) = reported_output_tokens(chunk) {
            self.reported = Some(n);
        }
    }

    /// Output tokens delivered so far, for the books of requests in flight.
    pub fn progress(&self) -> u64 {
        self.events
    }

    /// The output length this response is a sample of, once it has ended: `status_ok` when it
    /// was a 200, `completed` when its body reached its end.
    pub fn finish(&self, status_ok: bool, completed: bool) -> Option<u64> {
        let output = self.reported.unwrap_or(self.events);
        (status_ok && completed && output > 0).then_some(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_in_chunks() {
        let cases: &[(&str, u64)] = &[
            ("", 0),
            (r#"data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}"#, 1),
            (
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
                2,
            ),
            (r#"data: {"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}"#, 0),
            (r#"data: {"choices":[{"text":" world","index":0}]}"#, 1),
            (r#"data: {"choices":[{"text":"","finish_reason":"length"}]}"#, 0),
            (r#"data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"Hello"}}"#, 1),
            ("data: [DONE]", 0),
        ];
        for (chunk, want) in cases {
            assert_eq!(output_events(chunk.as_bytes()), *want, "{chunk}");
        }
    }

    #[test]
    fn reported_usage() {
        let cases: &[(&str, Option<u64>)] = &[
            (
                r#"{"usage":{"prompt_tokens":7,"completion_tokens":12,"total_tokens":19}}"#,
                Some(12),
            ),
            (
                r#"data: {"choices":[],"usage":{"completion_tokens": 40}}"#,
                Some(40),
            ),
            (
                r#"{"type":"message_delta","usage":{"output_tokens":15}}"#,
                Some(15),
            ),
            (r#"{"choices":[{"delta":{"content":"x"}}]}"#, None),
            (r#"{"completion_tokens":"many"}"#, None),
        ];
        for (chunk, want) in cases {
            assert_eq!(reported_output_tokens(chunk.as_bytes()), *want, "{chunk}");
        }
    }
}
