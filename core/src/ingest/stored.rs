//! Responses an engine stores, and the requests that come back to them: what OpenAI's
//! Responses API says in its bodies and paths about a stored response's id.
//!
//! A Responses request with `store` (OpenAI's default) is kept by the server that answered it,
//! under the id of its answer (`resp_…`). A later request names it: a turn that continues the
//! conversation (`previous_response_id`, the engine adds the stored turns to its prompt), a
//! background response's poll (`GET /v1/responses/{id}`), its cancellation
//! (`POST /v1/responses/{id}/cancel`), its deletion and its input items. vLLM keeps that store
//! in each server's memory, so any of these fails with 404 on another node: behind a balancer
//! that does not know where a response is stored, most of them fail. The filter reads the id
//! from the answer's first bytes as it passes ([`IdScan`]), notes the node and the
//! conversation's length under it (`share::stored`), and sends what comes back to it there,
//! priced with the stored turns (`Balancer::route_on`, `Pin`).
//!
//! A response another Envoy replica saw stored, or one stored before this Envoy started, is in
//! no table here. A request naming such an id has the nodes asked where it is
//! (`GET /v1/responses/{id}`, which an engine answers with the stored response or 404,
//! `Balancer::nodes_to_ask`); the node that answers with it is noted as if this Envoy had seen
//! it stored, with the conversation's length from the answer's usage ([`context_of`]), and
//! the request goes there. Behind a load balancer that spreads a client's requests over
//! several Envoy replicas, a replica looks for each answer it has not seen once.
//!
//! Every reader here is total: any bytes give a value or nothing.

/// Longest id taken (OpenAI's and vLLM's are about 40 bytes); a longer one is not kept.
pub const MAX_ID_BYTES: usize = 128;
/// Bytes of an answer's beginning searched for its id: the id is the first field of a whole
/// answer and of a stream's first event (`response.created`), far within this.
pub const ID_WITHIN: usize = 4096;

/// Words after `/responses/` that name an endpoint rather than a stored response.
const NOT_IDS: [&str; 2] = ["input_tokens", "compact"];

/// The stored response a path names: `/v1/responses/{id}`, `/v1/responses/{id}/cancel`,
/// `/v1/responses/{id}/input_items` (any prefix before `/responses/`, any query after).
pub fn path_id(path: &str) -> Option<&str> {
    let path = path.split('?').next().unwrap_or(path);
    let (_, rest) = path.rsplit_once("/responses/")?;
    let id = match rest.split_once('/') {
        Some((id, "cancel" | "input_items")) => id,
        Some(_) => return None,
        None => rest,
    };
    valid_id(id.as_bytes()).then_some(id)
}

/// The path that asks a node for the stored response `id` (see the module).
pub fn ask_path(id: &str) -> String {
    format!("/v1/responses/{id}")
}

/// The conversation's tokens up to and with a stored response, from the response object a
/// node answers `GET /v1/responses/{id}` with: its `usage`'s total tokens, else its input and
/// output tokens (the input counts the stored turns before it); 0 when it gives none.
pub fn context_of(answer: &[u8]) -> u64 {
    let Ok(serde_json::Value::Object(o)) = serde_json::from_slice(answer) else {
        return 0;
    };
    let Some(serde_json::Value::Object(usage)) = o.get("usage") else {
        return 0;
    };
    let count = |k: &str| usage.get(k).and_then(serde_json::Value::as_u64);
    count("total_tokens").unwrap_or_else(|| {
        let part = |k: &str| count(k).unwrap_or(0);
        part("input_tokens").saturating_add(part("output_tokens"))
    })
}

/// An id as ids are: 1 to `MAX_ID_BYTES` bytes of letters, digits, `_`, `-`, `.` or `:`.
pub fn valid_id(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
        && !NOT_IDS.iter().any(|w| w.as_bytes() == id)
}

/// Finds a response's id in its first bytes, fed chunk by chunk as Envoy hands them over:
/// the first `"id"` key with a string value that is an id ([`valid_id`]). Keeps at most
/// [`ID_WITHIN`] bytes, and nothing once it has found the id or given up.
#[derive(Debug, Default)]
pub struct IdScan {
    head: Vec<u8>,
    done: bool,
    found: Option<String>,
}

impl IdScan {
    pub fn new() -> Self {
        IdScan::default()
    }

    /// Whether more chunks can still tell the id.
    pub fn wants(&self) -> bool {
        !self.done
    }

    /// The id, once found.
    pub fn id(&self) -> Option<&str> {
        self.found.as_deref()
    }

    /// Takes the next chunk of the answer; true when this chunk completed the id.
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        if self.done {
            return false;
        }
        let room = ID_WITHIN.saturating_sub(self.head.len());
        let take = chunk.get(..room.min(chunk.len())).unwrap_or_default();
        self.head.extend_from_slice(take);
        let full = self.head.len() >= ID_WITHIN;
        match find_id(&self.head) {
            Found::Id(id) => {
                self.found = Some(id);
                self.finish();
                true
            }
            Found::Partial if !full => false,
            Found::Partial | Found::None => {
                if full {
                    self.finish();
                }
                false
            }
        }
    }

    /// The answer ended: nothing more comes.
    pub fn end(&mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        self.done = true;
        self.head = Vec::new();
    }
}

enum Found {
    Id(String),
    /// An `"id"` key whose value may still be coming.
    Partial,
    None,
}

/// The first `"id": "…"` in `bytes` whose value is an id.
fn find_id(bytes: &[u8]) -> Found {
    const KEY: &[u8] = b"\"id\"";
    let mut from = 0;
    while let Some(at) = bytes
        .get(from..)
        .and_then(|rest| rest.windows(KEY.len()).position(|w| w == KEY))
    {
        let after = from + at + KEY.len();
        from = after;
        let rest = bytes.get(after..).unwrap_or_default();
        let mut i = 0;
        let skip_ws = |i: &mut usize| {
            while rest.get(*i).is_some_and(|b| b.is_ascii_whitespace()) {
                *i += 1;
            }
        };
        skip_ws(&mut i);
        match rest.get(i) {
            None => return Found::Partial,
            Some(b':') => i += 1,
            Some(_) => continue,
        }
        skip_ws(&mut i);
        match rest.get(i) {
            None => return Found::Partial,
            Some(b'"') => i += 1,
            Some(_) => continue,
        }
        let value = rest.get(i..).unwrap_or_default();
        match value.iter().position(|&b| b == b'"') {
            Some(end) => {
                let id = value.get(..end).unwrap_or_default();
                if valid_id(id) {
                    if let Ok(s) = std::str::from_utf8(id) {
                        return Found::Id(s.to_string());
                    }
                }
            }
            None if value.len() <= MAX_ID_BYTES => return Found::Partial,
            None => {}
        }
    }
    // A key cut at the end (`"i`, `"id`) may complete with the next chunk.
    let tail = bytes.len().saturating_sub(KEY.len() - 1);
    let cut = (tail..bytes.len()).any(|s| {
        let t = bytes.get(s..).unwrap_or_default();
        KEY.starts_with(t)
    });
    if cut {
        Found::Partial
    } else {
        Found::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conversations_length_is_read_from_a_stored_responses_usage() {
        let cases: &[(&str, u64)] = &[
            (
                r#"{"id":"resp_1","object":"response","usage":{"input_tokens":300,"output_tokens":40,"total_tokens":340}}"#,
                340,
            ),
            (r#"{"id":"resp_1","usage":{"output_tokens":40}}"#, 40),
            (r#"{"id":"resp_1","usage":{"total_tokens":77}}"#, 77),
            (r#"{"id":"resp_1","usage":null}"#, 0),
            (r#"{"id":"resp_1"}"#, 0),
            (r#"{"usage":{"input_tokens":-3,"output_tokens":"x"}}"#, 0),
            (r#"{"detail":"Not Found"}"#, 0),
            ("not json", 0),
            ("", 0),
        ];
        for (answer, want) in cases {
            assert_eq!(context_of(answer.as_bytes()), *want, "{answer}");
        }
        assert_eq!(ask_path("resp_9"), "/v1/responses/resp_9");
        assert_eq!(path_id(&ask_path("resp_9")), Some("resp_9"));
    }

    #[test]
    fn paths_that_name_a_stored_response() {
        let cases: &[(&str, Option<&str>)] = &[
            ("/v1/responses/resp_abc", Some("resp_abc")),
            (
                "/v1/responses/resp_abc?stream=true&starting_after=3",
                Some("resp_abc"),
            ),
            ("/v1/responses/resp_abc/cancel", Some("resp_abc")),
            ("/v1/responses/resp_abc/input_items", Some("resp_abc")),
            ("/openai/v1/responses/resp-1.2:3", Some("resp-1.2:3")),
            ("/v1/responses", None),
            ("/v1/responses/", None),
            ("/v1/responses/input_tokens", None),
            ("/v1/responses/compact", None),
            ("/v1/responses/resp_abc/other", None),
            ("/v1/responses/resp abc", None),
            ("/v1/chat/completions", None),
        ];
        for (path, want) in cases {
            assert_eq!(path_id(path), *want, "{path}");
        }
        let long = format!("/v1/responses/{}", "a".repeat(MAX_ID_BYTES + 1));
        assert_eq!(path_id(&long), None);
    }

    fn scan(chunks: &[&[u8]]) -> Option<String> {
        let mut s = IdScan::new();
        for c in chunks {
            s.feed(c);
        }
        s.id().map(str::to_string)
    }

    #[test]
    fn the_id_of_whole_answers_and_streams() {
        // Included, not read: the core's tests also run as wasm32-wasip1, with no files.
        let stream = include_bytes!("../../tests/data/streams/llamacpp_responses.sse");
        let cases: &[(&[u8], Option<&str>)] = &[
            (stream, Some("resp_wgoOJM9dMYAEtmbSpblFCCwTNK8zCnzb")),
            (
                br#"{"id": "resp_1","object":"response","output":[{"id":"msg_2"}]}"#,
                Some("resp_1"),
            ),
            (br#"{"object":"response","id" :  "resp_3"}"#, Some("resp_3")),
            // A value that is no id is passed over for the next.
            (
                br#"{"id":7,"x":{"id":"bad id"},"id":"resp_4"}"#,
                Some("resp_4"),
            ),
            (br#"{"object":"response"}"#, None),
            (b"", None),
        ];
        for (body, want) in cases {
            assert_eq!(scan(&[body]).as_deref(), *want);
            // Every split of the first bytes reads the same.
            let head = &body[..body.len().min(120)];
            for cut in 0..head.len() {
                let (a, b) = body.split_at(cut);
                assert_eq!(scan(&[a, b]).as_deref(), *want, "cut at {cut}");
            }
        }
    }

    #[test]
    fn the_scan_keeps_little_and_gives_up() {
        let mut s = IdScan::new();
        s.feed(&vec![b' '; ID_WITHIN - 3]);
        assert!(s.wants());
        s.feed(b"\"id\":\"resp_late\"");
        // Past `ID_WITHIN` bytes: no id, and nothing kept.
        assert!(!s.wants());
        assert_eq!(s.id(), None);
        assert!(s.head.capacity() == 0);
        let mut s = IdScan::new();
        assert!(!s.feed(br#"{"id":"resp_1"#));
        assert!(s.feed(br#"23"}"#));
        assert_eq!(s.id(), Some("resp_123"));
        assert!(!s.wants());
        assert!(!s.feed(br#"{"id":"resp_9"}"#));
        assert_eq!(s.id(), Some("resp_123"));
        let mut s = IdScan::new();
        s.feed(b"{\"id\":\"resp_");
        s.end();
        assert_eq!(s.id(), None);
        assert!(!s.wants());
    }
}
