//! Output observed in responses: how many tokens a stream actually generated.
//!
//! Clients cap `max_tokens` far above what models generate, so the cap is a poor estimate of a
//! request's decode work and of the KV it will grow into. The filter learns the real output
//! lengths from the responses passing through it, without buffering them: an [`OutputMeter`]
//! reads each response chunk as Envoy hands it over, at whatever boundaries Envoy chose, and
//! keeps between chunks only the state of its scan (how much of a key it has seen, the digits
//! of a count so far) — a few bytes, never the response's bytes. So a key or a count split
//! across two chunks reads exactly as if it had come in one.
//!
//! What it reads:
//! - content deltas of event streams: non-empty `"content":"…"` strings in OpenAI chat chunks,
//!   `"text":"…"` in completion and Anthropic text-delta chunks, and `"delta":"…"` in the
//!   Responses API's events (its answer, its reasoning and its tool calls' arguments alike:
//!   `response.output_text.delta` and the others; a chat chunk's `"delta"` is an object, read
//!   inside); engines send about one token per event. A Responses stream repeats the whole
//!   text in its closing events (`….done`, `response.completed`): a few events more at the
//!   very end, where the server's count comes too and wins for the sample;
//! - a reasoning model's thinking, streamed before its answer: `"reasoning_content":"…"`
//!   (vLLM, SGLang and llama.cpp with a reasoning parser), `"reasoning":"…"` (vLLM's newer
//!   name) and Anthropic's `"thinking":"…"` deltas. These are generated tokens like the
//!   answer's, decoded and held in the KV cache, and the server's count includes them; read
//!   as nothing, a model that thinks for a minute would look to the books like a prompt still
//!   waiting for its prefill all that minute. vLLM may send a delta's thinking under both
//!   `reasoning` and `reasoning_content`: thinking counts once a line (an event's `data:`
//!   line);
//! - a tool call's arguments as they are generated: `"arguments":"…"` pieces in OpenAI-style
//!   `tool_calls` deltas, Anthropic's `"partial_json":"…"`. An agent's turn is often a tool
//!   call and nothing else: read as nothing, it would show no output at all;
//! - the count the server reports (`"completion_tokens":N`, SGLang's native `meta_info` too;
//!   Anthropic's and the Responses API's `"output_tokens":N`; llama.cpp's native
//!   `"tokens_predicted":N`; TGI's `"generated_tokens":N`), the last one in the body, which
//!   wins over the events when present. Native `/generate` streams are read the same way:
//!   SGLang's events each carry a `"text"` (the whole text so far, or with
//!   `--incremental-streaming-output` the new piece: one event either way), TGI's a token's
//!   `"text"`, llama.cpp's `/completion` a `"content"`.
//!
//! A key is a quoted name and a colon, with the whitespace JSON allows around the colon (Python
//! servers write `"content": "…"`). Inside a string value quotes are escaped, so a key quoted
//! in generated text is not read as one.
//!
//! Streamed or not: a body whose first byte (after whitespace) is `{` or `[` is one JSON
//! answer; anything else is an event stream (`data:` lines, with `event:`, `id:` or `:`
//! comment lines). The body itself tells, so no response header has to be read for it. A JSON
//! answer holds its whole output in one `"content"` string, so its
//! events say nothing of its length: it is a sample only when it reports a count. Without
//! one it is no sample, rather than an estimate from the content's length in characters:
//! four characters a token is off by a factor of two and more for code, non-Latin scripts
//! and JSON output, and a biased sample skews the learned output lengths that every
//! request's KV reservation is drawn from, while a missing sample only leaves them to the
//! other responses. The common OpenAI-compatible servers report usage in every non-streamed
//! answer, so such answers are rare.
//!
//! Counted unread: following a stream costs, per chunk, a crossing into Envoy that copies it
//! into the VM and a scan of it; the filter's own code alone was 0.9 us a streamed token,
//! about 230 us for a 256-token answer against about 16 us for the rest of a request
//! (docs/BENCHMARKS.md, "Following streamed answers"). Engines send one event per token, each
//! its own chunk, and a stream's events differ only in their text. So once a stream has shown
//! [`LEARN`] chunks that were each exactly one content event from one event boundary to the
//! next, a chunk whose size is within the sizes those had (and under twice the smallest, so
//! two events never fit) is counted as one event without being read ([`OutputMeter::skim`]).
//! Every other chunk is read: the first ones, any of another size (two events that came
//! together, the closing events, the usage), the last (`end_of_stream`), and every
//! [`CHECK_EVERY`]-th of the right size, as a check; a checked chunk that was not one event
//! ends skimming for the stream. What this can miscount: a chunk of the right size that held
//! no content (a finish event alone in its chunk, counted as a token when not checked). The
//! server's count, when it sends one, still wins for the sample.
//!
//! The filter takes three numbers from the meter: [`OutputMeter::progress`], the running count
//! the books of requests in flight advance by, which never goes back; [`OutputMeter::finish`],
//! the output length a response that ended is a sample of — only a 200 read to its end, with a
//! positive count, is one; and [`OutputMeter::prompt_reported`], the prompt's length as the
//! server counted it, which the filter's estimate of prompts is calibrated by
//! (`route::prompt_scale`): `"prompt_tokens":N` in OpenAI's usage and SGLang's `meta_info`,
//! else llama.cpp's `timings` (`prompt_n` computed plus `cache_n` found cached), which its
//! server puts on the last event of every stream, with or without usage. OpenAI-compatible
//! servers send a stream's usage only when the client asks for it
//! (`stream_options.include_usage`), so without `timings` most streams carry no prompt count.

/// The keys the scan reads: the name between the quotes, and what its value is.
const KEYS: [(&[u8], Kind); 15] = [
    (b"content", Kind::Text),
    (b"text", Kind::Text),
    (b"delta", Kind::Text),
    (b"reasoning_content", Kind::Thought),
    (b"reasoning", Kind::Thought),
    (b"thinking", Kind::Thought),
    (b"arguments", Kind::Text),
    (b"partial_json", Kind::Text),
    (b"completion_tokens", Kind::Count(Number::Output)),
    (b"output_tokens", Kind::Count(Number::Output)),
    (b"tokens_predicted", Kind::Count(Number::Output)),
    (b"generated_tokens", Kind::Count(Number::Output)),
    (b"prompt_tokens", Kind::Count(Number::Prompt)),
    (b"prompt_n", Kind::Count(Number::Computed)),
    (b"cache_n", Kind::Count(Number::Cached)),
];

/// Chunks of one content event each a stream must show, read, before one is counted unread.
pub const LEARN: u8 = 4;

/// Of the chunks that could be counted unread, every this-many-th is read as a check.
pub const CHECK_EVERY: u8 = 16;

/// Every key of `KEYS`, as a set of bits (bit `i` for `KEYS[i]`).
const ALL_KEYS: u16 = (1 << KEYS.len()) - 1;

/// What a key's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A string: a content event when it is not empty.
    Text,
    /// A string of thinking: a content event when it is not empty and no other thinking of
    /// the same line was one (vLLM sends a delta's thinking under both of its names).
    Thought,
    /// A number, of what.
    Count(Number),
}

/// What a number the scan reads counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    /// The server's output count.
    Output,
    /// The server's count of the prompt (OpenAI's `usage.prompt_tokens`, SGLang's
    /// `meta_info`), what the filter's estimate of it is calibrated by (see `PromptScale`).
    Prompt,
    /// llama.cpp's `timings`: the prompt tokens computed (`prompt_n`) and those found in the
    /// cache (`cache_n`); together, the prompt's count when no usage gives it.
    Computed,
    Cached,
}

/// What kind of body the response is, from its first byte.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Body {
    /// Nothing but whitespace yet.
    #[default]
    Unknown,
    /// Server-sent events.
    Stream,
    /// One JSON answer.
    Reply,
}

/// Where the scan is, carried from one chunk to the next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Scan {
    /// Looking for a quote.
    #[default]
    Idle,
    /// In a quoted name, `len` bytes in, that may still be any key of the set `keys`.
    Name { len: u8, keys: u16 },
    /// After a key's closing quote, before its colon.
    Colon(Kind),
    /// After a key's colon, before its value.
    Value(Kind),
    /// After a text value's opening quote (of thinking, or not).
    Text { thought: bool },
    /// In a count's digits (`overflow` when they are past `u64`: no count), of `of`.
    Count {
        value: u64,
        overflow: bool,
        of: Number,
    },
}

/// Reads on in a quoted name, `len` bytes in, that may still be any key of the set `keys`:
/// the bytes of `rest` taken, and where the scan is after them.
fn read_name(mut len: u8, mut keys: u16, rest: &[u8]) -> (usize, Scan) {
    for (used, &b) in rest.iter().enumerate() {
        if b == b'"' {
            let key = KEYS
                .iter()
                .enumerate()
                .find(|(k, (name, _))| keys & (1 << k) != 0 && name.len() == usize::from(len));
            let scan = match key {
                Some((_, &(_, kind))) => Scan::Colon(kind),
                // Not a key; the quote may open one.
                None => Scan::Name {
                    len: 0,
                    keys: ALL_KEYS,
                },
            };
            return (used + 1, scan);
        }
        let at = usize::from(len);
        keys = KEYS
            .iter()
            .enumerate()
            .filter(|(k, (name, _))| keys & (1 << k) != 0 && name.get(at) == Some(&b))
            .fold(0, |set, (k, _)| set | (1 << k));
        if keys == 0 {
            return (used + 1, Scan::Idle);
        }
        // Below the longest key's length: `keys` is empty past it.
        len += 1;
    }
    (rest.len(), Scan::Name { len, keys })
}

/// What one response has shown of its output so far, fed chunk by chunk.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputMeter {
    body: Body,
    scan: Scan,
    /// Content events seen.
    events: u64,
    /// The last count the server reported whose digits have ended, when `has_reported` (an
    /// `Option` would take eight bytes more: the meter is carried by every response in flight).
    reported: u64,
    has_reported: bool,
    /// The highest such count.
    highest: u64,
    /// The last prompt count the server reported whose digits have ended (0: none; a prompt
    /// of no tokens is no sample either), at most `u32::MAX` (kept small: the meter is carried
    /// by every response in flight); and the last of llama.cpp's `timings` (`prompt_n`, of
    /// which 0 is none: the server computes at least one token of every prompt; `cache_n`).
    prompt: u32,
    computed: u32,
    cached: u32,
    /// Sizes of the chunks read that were each exactly one content event (smallest, largest),
    /// how many such were read, and chunks of such a size counted unread since the last read.
    single: Option<(u16, u16)>,
    learned: u8,
    unread: u8,
    /// A check found a chunk of the right size that was not one event: every chunk is read.
    no_skim: bool,
    /// A thinking text was counted on this line: another on it is the same token.
    thought_in_line: bool,
}

impl OutputMeter {
    /// A meter for a response not read yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the next chunk, `size` bytes, may be counted as one content event without
    /// being read ([`OutputMeter::skim`]; see the module comment): never the last chunk
    /// (`end_of_stream`), nor one that starts anywhere but between two events.
    pub fn may_skim(&self, size: usize, end_of_stream: bool) -> bool {
        let Some((low, high)) = self.single else {
            return false;
        };
        let Ok(size) = u16::try_from(size) else {
            return false;
        };
        !end_of_stream
            && !self.no_skim
            && self.body == Body::Stream
            && self.scan == Scan::Idle
            && self.learned >= LEARN
            && self.unread < CHECK_EVERY - 1
            && (low..=high).contains(&size)
            && size < low.saturating_mul(2)
    }

    /// Counts the next chunk, unread, as one content event (when `may_skim` allowed it).
    pub fn skim(&mut self) {
        self.events = self.events.saturating_add(1);
        self.unread = self.unread.saturating_add(1);
    }

    /// Reads the next chunk of the response body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let at_boundary = self.body != Body::Reply && self.scan == Scan::Idle;
        let counts = |m: &Self| {
            let reported = m.has_reported.then_some(m.reported);
            (m.highest, reported, m.prompt, m.computed, m.cached)
        };
        let (events, before) = (self.events, counts(self));
        self.scan_chunk(chunk);
        // One content event from one boundary to the next, and no count: the size of a chunk
        // that may later be counted unread.
        let size = u16::try_from(chunk.len()).ok();
        let single = at_boundary
            && size.is_some()
            && self.body == Body::Stream
            && self.scan == Scan::Idle
            && self.events == events.saturating_add(1)
            && counts(self) == before;
        let size = size.unwrap_or(u16::MAX);
        let within = self
            .single
            .is_some_and(|(low, high)| (low..=high).contains(&size));
        if single {
            self.single = Some(match self.single {
                Some((low, high)) => (low.min(size), high.max(size)),
                None => (size, size),
            });
            self.learned = self.learned.saturating_add(1);
        } else if within && self.learned >= LEARN {
            self.no_skim = true;
        }
        self.unread = 0;
    }

    fn scan_chunk(&mut self, chunk: &[u8]) {
        if self.body == Body::Unknown {
            let leading = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n' | 0xEF | 0xBB | 0xBF);
            // Whitespace (and a byte order mark) holds no key: nothing else to read.
            let Some(&first) = chunk.iter().find(|b| !leading(b)) else {
                return;
            };
            self.body = if matches!(first, b'{' | b'[') {
                Body::Reply
            } else {
                Body::Stream
            };
        }
        let mut i = 0;
        while let Some(rest) = chunk.get(i..).filter(|r| !r.is_empty()) {
            match self.scan {
                Scan::Idle => {
                    // Keys start with a quote: the bytes up to the next one are skipped unread,
                    // but for the end of a line (an event's line, in a stream).
                    let Some(at) = rest.iter().position(|&b| b == b'"' || b == b'\n') else {
                        return;
                    };
                    i += at + 1;
                    if rest.get(at) == Some(&b'\n') {
                        self.thought_in_line = false;
                        continue;
                    }
                    self.scan = Scan::Name {
                        len: 0,
                        keys: ALL_KEYS,
                    };
                }
                Scan::Name { len, keys } => {
                    let (used, scan) = read_name(len, keys, rest);
                    i += used;
                    self.scan = scan;
                }
                _ => {
                    // A byte the scan does not take ends what it was in; it is read again
                    // from `Idle`.
                    if rest.first().is_some_and(|&b| self.step(b)) {
                        i += 1;
                    } else {
                        self.scan = Scan::Idle;
                    }
                }
            }
        }
    }

    /// Takes one byte after a key's name; `false` when the byte is not part of what the scan
    /// is in.
    fn step(&mut self, b: u8) -> bool {
        let json_space = matches!(b, b' ' | b'\t' | b'\r' | b'\n');
        self.scan = match self.scan {
            Scan::Colon(kind) if b == b':' => Scan::Value(kind),
            Scan::Colon(_) | Scan::Value(_) if json_space => return true,
            Scan::Value(kind @ (Kind::Text | Kind::Thought)) if b == b'"' => Scan::Text {
                thought: kind == Kind::Thought,
            },
            Scan::Value(Kind::Count(of)) if b.is_ascii_digit() => Scan::Count {
                value: u64::from(b - b'0'),
                overflow: false,
                of,
            },
            Scan::Text { thought } if b != b'"' => {
                if !(thought && self.thought_in_line) {
                    self.events = self.events.saturating_add(1);
                }
                self.thought_in_line |= thought;
                Scan::Idle
            }
            Scan::Count {
                value,
                overflow,
                of,
            } if b.is_ascii_digit() => {
                let next = value
                    .checked_mul(10)
                    .and_then(|v| v.checked_add(u64::from(b - b'0')));
                Scan::Count {
                    value: next.unwrap_or(value),
                    overflow: overflow || next.is_none(),
                    of,
                }
            }
            Scan::Count {
                value,
                overflow,
                of,
            } => {
                let small = u32::try_from(value).unwrap_or(u32::MAX);
                match (overflow, of) {
                    (true, _) => {}
                    (false, Number::Prompt) => self.prompt = small,
                    (false, Number::Computed) => self.computed = small,
                    (false, Number::Cached) => self.cached = small,
                    (false, Number::Output) => {
                        self.reported = value;
                        self.has_reported = true;
                        self.highest = self.highest.max(value);
                    }
                }
                return false;
            }
            Scan::Idle
            | Scan::Name { .. }
            | Scan::Colon(_)
            | Scan::Value(_)
            | Scan::Text { .. } => return false,
        };
        true
    }

    /// A count of `of` whose digits end the body so far, not yet taken.
    fn pending(&self, of: Number) -> Option<u64> {
        match self.scan {
            Scan::Count {
                value,
                overflow: false,
                of: o,
            } if o == of => Some(value),
            _ => None,
        }
    }

    /// The count the server reported last, counting one whose digits end the body so far.
    fn reported(&self) -> Option<u64> {
        self.pending(Number::Output)
            .or(self.has_reported.then_some(self.reported))
    }

    /// The prompt's length as the server counted it, once the response has ended as `finish`
    /// takes a sample (a 200 read to its end): its usage's count, else llama.cpp's timings
    /// (computed plus cached); `None` when it sent neither.
    pub fn prompt_reported(&self, status_ok: bool, completed: bool) -> Option<u64> {
        if !(status_ok && completed) {
            return None;
        }
        let usage = self
            .pending(Number::Prompt)
            .unwrap_or(u64::from(self.prompt));
        let timed = (self.computed > 0)
            .then(|| u64::from(self.computed).saturating_add(u64::from(self.cached)));
        Some(usage).filter(|&n| n > 0).or(timed)
    }

    /// Output tokens delivered so far, for the books of requests in flight: the content events
    /// of a stream, or the server's count when it is higher (a server may report usage as it
    /// goes). Never goes back: events only add up, and a count is taken once its digits have
    /// ended, as the highest so far. A JSON answer's events are no count: it has progressed by
    /// its reported count only.
    pub fn progress(&self) -> u64 {
        match self.body {
            Body::Stream => self.events.max(self.highest),
            Body::Reply | Body::Unknown => self.highest,
        }
    }

    /// The output length this response is a sample of, once it has ended: `status_ok` when it
    /// was a 200, `completed` when its body reached its end. The server's count when it gave
    /// one, else the content events of a stream; `None` for a failed or cut-off response, a
    /// JSON answer without a count (see the module comment), or no output at all.
    pub fn finish(&self, status_ok: bool, completed: bool) -> Option<u64> {
        if !(status_ok && completed) {
            return None;
        }
        let output = match self.body {
            Body::Stream => self.reported().unwrap_or(self.events),
            Body::Reply => self.reported()?,
            Body::Unknown => return None,
        };
        (output > 0).then_some(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One response, as bytes, with what reading it must give.
    struct Case {
        name: &'static str,
        body: String,
        /// The running count once the whole body is read.
        progress: u64,
        /// The output-length sample of the body read to its end with a 200.
        sample: Option<u64>,
    }

    fn sse(events: &[String]) -> String {
        events.iter().map(|e| format!("data: {e}\n\n")).collect()
    }

    /// Named events (Anthropic's, the Responses API's): an `event:` line, then the data.
    fn named_sse<N: std::fmt::Display, D: std::fmt::Display>(events: &[(N, D)]) -> String {
        events
            .iter()
            .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
            .collect()
    }

    fn chat_chunk(delta: &str, finish: &str) -> String {
        format!(
            r#"{{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1718000000,"model":"llama-3-8b","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]}}"#
        )
    }

    fn chat_stream(usage: bool) -> String {
        let mut events = vec![chat_chunk(r#"{"role":"assistant","content":""}"#, "null")];
        for word in ["Hello", ",", " world", "!", " \\\"quoted\\\""] {
            events.push(chat_chunk(&format!(r#"{{"content":"{word}"}}"#), "null"));
        }
        events.push(chat_chunk("{}", r#""stop""#));
        if usage {
            events.push(
                r#"{"id":"chatcmpl-7","object":"chat.completion.chunk","created":1718000000,"model":"llama-3-8b","choices":[],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7,"completion_tokens_details":{"reasoning_tokens":0}}}"#
                    .to_string(),
            );
        }
        events.push("[DONE]".to_string());
        sse(&events)
    }

    /// A reasoning model's chat stream: four thinking deltas under `key` (and one empty), then
    /// two answer deltas, the finish, and the usage (9 tokens, 4 of them reasoning) when
    /// `usage`. The request's own settings echo nothing the meter reads.
    fn reasoning_stream(key: &str, usage: bool) -> String {
        let mut events = vec![chat_chunk(
            r#"{"role":"assistant","content":null,"reasoning_content":null}"#,
            "null",
        )];
        for word in ["Let", " me", " think", ".", ""] {
            events.push(chat_chunk(&format!(r#"{{"{key}":"{word}"}}"#), "null"));
        }
        for word in ["Four", "."] {
            events.push(chat_chunk(
                &format!(r#"{{"content":"{word}","{key}":null}}"#),
                "null",
            ));
        }
        events.push(chat_chunk("{}", r#""stop""#));
        if usage {
            events.push(
                r#"{"id":"chatcmpl-7","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":9,"completion_tokens_details":{"reasoning_tokens":4}},"reasoning":{"effort":"low"}}"#
                    .to_string(),
            );
        }
        events.push("[DONE]".to_string());
        sse(&events)
    }

    /// vLLM keeping the old name beside the new: each thinking delta carries its text under
    /// both (three thinking tokens, one empty delta), then two answer tokens.
    fn thinking_under_both_names() -> String {
        let mut events: Vec<String> = ["Hm", "", " ok", "."]
            .iter()
            .map(|t| {
                chat_chunk(
                    &format!(r#"{{"reasoning":"{t}","reasoning_content":"{t}"}}"#),
                    "null",
                )
            })
            .collect();
        for word in ["Yes", "!"] {
            events.push(chat_chunk(
                &format!(r#"{{"content":"{word}","reasoning":null,"reasoning_content":null}}"#),
                "null",
            ));
        }
        events.push("[DONE]".to_string());
        sse(&events)
    }

    /// An agent's turn that is a tool call and nothing else (vLLM's and OpenAI's shape): the
    /// name with empty arguments, then four pieces of arguments, the finish, no usage.
    fn tool_call_stream() -> String {
        let call = |f: &str| {
            chat_chunk(
                &format!(r#"{{"tool_calls":[{{"index":0,"function":{f}}}]}}"#),
                "null",
            )
        };
        let mut events = vec![
            chat_chunk(r#"{"role":"assistant","content":null}"#, "null"),
            call(r#"{"name":"get_weather","arguments":""}"#),
        ];
        for piece in [r#"{\"loc"#, r#"ation\":"#, r#" \"Par"#, r#"is\"}"#] {
            events.push(call(&format!(r#"{{"arguments":"{piece}"}}"#)));
        }
        events.push(chat_chunk("{}", r#""tool_calls""#));
        events.push("[DONE]".to_string());
        sse(&events)
    }

    /// Anthropic's tool use: the block's start, three pieces of its input, the final count.
    fn anthropic_tool_use_stream() -> String {
        let mut events = vec![(
            "content_block_start".to_string(),
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"toolu_01","name":"get_weather","input":{}}}"#
                .to_string(),
        )];
        for piece in [r#"{\"loc"#, r#"ation\": \"Pa"#, r#"ris\"}"#] {
            events.push((
                "content_block_delta".to_string(),
                format!(
                    r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"input_json_delta","partial_json":"{piece}"}}}}"#
                ),
            ));
        }
        events.push((
            "message_delta".to_string(),
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":3}}"#
                .to_string(),
        ));
        named_sse(&events)
    }

    /// Anthropic's extended thinking: a thinking block (two deltas and a signature), then a
    /// text block of one delta, and the final output count.
    fn anthropic_thinking_stream() -> String {
        let events: &[(&str, &str)] = &[
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Two plus two"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":" is four."}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM"}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"4"}}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":3}}"#,
            ),
        ];
        named_sse(events)
    }

    fn completions_stream() -> String {
        let chunk = |text: &str, finish: &str| {
            format!(
                r#"{{"id":"cmpl-3","object":"text_completion","created":1718000000,"choices":[{{"text":"{text}","index":0,"logprobs":null,"finish_reason":{finish}}}],"model":"llama-3-8b"}}"#
            )
        };
        let mut events: Vec<String> = [" Once", " upon", " a", " time"]
            .iter()
            .map(|t| chunk(t, "null"))
            .collect();
        events.push(chunk("", r#""length""#));
        events.push("[DONE]".to_string());
        sse(&events)
    }

    fn anthropic_stream() -> String {
        let events: &[(&str, &str)] = &[
            (
                "message_start",
                r#"{"type":"message_start","message":{"id":"msg_01","type":"message","role":"assistant","content":[],"model":"claude-3-5-sonnet","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,"output_tokens":1}}}"#,
            ),
            (
                "content_block_start",
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            ),
            ("ping", r#"{"type": "ping"}"#),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}"#,
            ),
            (
                "content_block_delta",
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" How"}}"#,
            ),
            (
                "content_block_stop",
                r#"{"type":"content_block_stop","index":0}"#,
            ),
            (
                "message_delta",
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}"#,
            ),
            ("message_stop", r#"{"type":"message_stop"}"#),
        ];
        named_sse(events)
    }

    /// OpenAI's Responses API, streamed as vLLM and llama.cpp's server stream it: thinking,
    /// answer and a tool call's arguments each as `"delta"` strings, then closing events that
    /// repeat each whole text once more, and the count in `response.completed`.
    fn responses_stream() -> String {
        let events: &[(&str, &str)] = &[
            (
                "response.created",
                r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","instructions":"Be brief.","max_output_tokens":64,"output":[],"text":{"format":{"type":"text"}},"usage":null}}"#,
            ),
            (
                "response.output_item.added",
                r#"{"type":"response.output_item.added","output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[],"content":[]}}"#,
            ),
            (
                "response.reasoning_text.delta",
                r#"{"type":"response.reasoning_text.delta","item_id":"rs_1","output_index":0,"content_index":0,"delta":"Let me"}"#,
            ),
            (
                "response.reasoning_text.delta",
                r#"{"type":"response.reasoning_text.delta","item_id":"rs_1","output_index":0,"content_index":0,"delta":" think"}"#,
            ),
            (
                "response.content_part.added",
                r#"{"type":"response.content_part.added","item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","annotations":[],"text":""}}"#,
            ),
            (
                "response.output_text.delta",
                r#"{"type":"response.output_text.delta","item_id":"msg_1","output_index":1,"content_index":0,"delta":"Hello","logprobs":[],"sequence_number":5}"#,
            ),
            (
                "response.output_text.delta",
                r#"{"type": "response.output_text.delta", "item_id": "msg_1", "delta": " \"world\""}"#,
            ),
            (
                "response.function_call_arguments.delta",
                r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":2,"delta":"{\"city\":"}"#,
            ),
            (
                "response.function_call_arguments.delta",
                r#"{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":2,"delta":"\"Paris\"}"}"#,
            ),
            (
                "response.output_text.done",
                r#"{"type":"response.output_text.done","item_id":"msg_1","text":"Hello \"world\""}"#,
            ),
            (
                "response.output_item.done",
                r#"{"type":"response.output_item.done","item":{"id":"fc_1","type":"function_call","arguments":"{\"city\":\"Paris\"}","name":"weather"}}"#,
            ),
            (
                "response.completed",
                r#"{"type":"response.completed","response":{"id":"resp_1","object":"response","status":"completed","max_output_tokens":64,"output":[{"type":"message","content":[{"type":"output_text","text":"Hello \"world\""}]}],"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":0},"output_tokens":6,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":26}}}"#,
            ),
        ];
        named_sse(events)
    }

    /// A Responses API answer, not streamed.
    const RESPONSES_REPLY: &str = r#"{"id":"resp_2","object":"response","status":"completed","max_output_tokens":null,"output":[{"id":"msg_2","type":"message","role":"assistant","content":[{"type":"output_text","text":"Hi there.","annotations":[]}]}],"usage":{"input_tokens":12,"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":16}}"#;

    /// SGLang's native `/generate` stream, as it streams by default: each event the whole text
    /// so far, `meta_info` counting the tokens.
    fn sglang_stream() -> String {
        let mut text = String::new();
        let mut events: Vec<String> = (1..=4)
            .map(|i| {
                text.push_str(&format!(" w{i}"));
                let finish = if i == 4 { r#"{"type":"length","length":4}"# } else { "null" };
                format!(
                    r#"{{"text":"{text}","output_ids":[{i}],"meta_info":{{"id":"a1","finish_reason":{finish},"prompt_tokens":7,"completion_tokens":{i},"cached_tokens":0}},"index":0}}"#
                )
            })
            .collect();
        events.push("[DONE]".to_string());
        sse(&events)
    }

    /// TGI's `/generate_stream`: a token a event, the last with the whole text and `details`.
    fn tgi_stream() -> String {
        let token = |i: u32, last: bool| {
            let end = if last {
                r#""generated_text":" a b c","details":{"finish_reason":"length","generated_tokens":3,"seed":null}"#
            } else {
                r#""generated_text":null,"details":null"#
            };
            format!(
                r#"{{"index":{i},"token":{{"id":{i},"text":" x","logprob":-0.5,"special":false}},{end}}}"#
            )
        };
        sse(&[token(1, false), token(2, false), token(3, true)])
    }

    const SGLANG_REPLY: &str = r#"{"text":" a b","output_ids":[5,6],"meta_info":{"id":"a2","finish_reason":{"type":"length","length":2},"prompt_tokens":7,"completion_tokens":2,"cached_tokens":0}}"#;

    const LLAMACPP_NATIVE_REPLY: &str = r#"{"index":0,"content":" upon a time there","tokens":[],"id_slot":0,"stop":true,"model":"m","tokens_predicted":5,"tokens_evaluated":4,"generation_settings":{"n_predict":5},"prompt":"Once","has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":8}"#;

    const CHAT_REPLY: &str = r#"{"id":"chatcmpl-9","object":"chat.completion","created":1718000000,"model":"llama-3-8b","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, how can I help you today?","tool_calls":[]},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"total_tokens":20,"completion_tokens":11,"completion_tokens_details":null}}"#;

    /// A reply as Python's `json.dumps` writes it by default: a space after each colon.
    const SPACED_REPLY: &str = "{\"id\": \"chatcmpl-9\", \"object\": \"chat.completion\", \"choices\": [{\"index\": 0, \"message\": {\"role\": \"assistant\", \"content\": \"Sure.\"}, \"finish_reason\": \"stop\"}], \"usage\": {\"prompt_tokens\": 9, \"completion_tokens\": 3, \"total_tokens\": 12}}\n";

    const ANTHROPIC_REPLY: &str = r#"{"id":"msg_01","type":"message","role":"assistant","content":[{"type":"text","text":"Hi! How can I help?"}],"model":"claude-3-5-sonnet","stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":8}}"#;

    fn cases() -> Vec<Case> {
        vec![
            Case {
                name: "chat stream",
                body: chat_stream(false),
                progress: 5,
                sample: Some(5),
            },
            Case {
                name: "chat stream with usage",
                body: chat_stream(true),
                progress: 7,
                sample: Some(7),
            },
            Case {
                name: "completions stream",
                body: completions_stream(),
                progress: 4,
                sample: Some(4),
            },
            Case {
                name: "anthropic stream",
                body: anthropic_stream(),
                progress: 15,
                sample: Some(15),
            },
            Case {
                name: "reasoning chat stream (reasoning_content, then content)",
                body: reasoning_stream("reasoning_content", false),
                progress: 6,
                sample: Some(6),
            },
            Case {
                name: "reasoning chat stream (reasoning), usage with reasoning_tokens",
                body: reasoning_stream("reasoning", true),
                progress: 9,
                sample: Some(9),
            },
            Case {
                name: "reasoning chat stream, each delta's thinking under both names (vLLM)",
                body: thinking_under_both_names(),
                progress: 5,
                sample: Some(5),
            },
            Case {
                name: "chat stream of a tool call",
                body: tool_call_stream(),
                progress: 4,
                sample: Some(4),
            },
            Case {
                name: "anthropic stream of a tool use",
                body: anthropic_tool_use_stream(),
                progress: 3,
                sample: Some(3),
            },
            Case {
                name: "anthropic stream with thinking",
                body: anthropic_thinking_stream(),
                progress: 3,
                sample: Some(3),
            },
            Case {
                // Six deltas, then the texts once more in the closing events (three: the
                // answer twice, the arguments once): the running count ends 3 over the
                // server's, whose count is the sample.
                name: "responses stream (thinking, answer, a tool call's arguments)",
                body: responses_stream(),
                progress: 9,
                sample: Some(6),
            },
            Case {
                name: "responses reply",
                body: RESPONSES_REPLY.to_string(),
                progress: 4,
                sample: Some(4),
            },
            Case {
                name: "chat reply",
                body: CHAT_REPLY.to_string(),
                progress: 11,
                sample: Some(11),
            },
            Case {
                name: "spaced chat reply",
                body: SPACED_REPLY.to_string(),
                progress: 3,
                sample: Some(3),
            },
            Case {
                name: "anthropic reply",
                body: ANTHROPIC_REPLY.to_string(),
                progress: 8,
                sample: Some(8),
            },
            Case {
                name: "SGLang's native stream (the whole text so far in each event)",
                body: sglang_stream(),
                progress: 4,
                sample: Some(4),
            },
            Case {
                name: "SGLang's native reply",
                body: SGLANG_REPLY.to_string(),
                progress: 2,
                sample: Some(2),
            },
            Case {
                name: "TGI's stream, with details",
                body: tgi_stream(),
                progress: 3,
                sample: Some(3),
            },
            Case {
                name: "llama.cpp's native reply",
                body: LLAMACPP_NATIVE_REPLY.to_string(),
                progress: 5,
                sample: Some(5),
            },
            Case {
                name: "chat reply without usage",
                body: CHAT_REPLY
                    .split(r#","usage""#)
                    .next()
                    .unwrap_or_default()
                    .to_string()
                    + "}",
                progress: 0,
                sample: None,
            },
        ]
    }

    fn read(chunks: &[&[u8]]) -> OutputMeter {
        let mut m = OutputMeter::new();
        for c in chunks {
            m.feed(c);
        }
        m
    }

    fn seen(m: &OutputMeter) -> (u64, Option<u64>) {
        (m.progress(), m.finish(true, true))
    }

    #[test]
    fn whole_responses() {
        for c in cases() {
            let m = read(&[c.body.as_bytes()]);
            assert_eq!(seen(&m), (c.progress, c.sample), "{}", c.name);
        }
    }

    #[test]
    fn every_split_reads_like_the_whole() {
        for c in cases() {
            let body = c.body.as_bytes();
            let whole = seen(&read(&[body]));
            for at in 0..=body.len() {
                let (a, b) = body.split_at(at);
                assert_eq!(seen(&read(&[a, b])), whole, "{} split at {at}", c.name);
            }
            // Byte by byte, the running count never goes back.
            let mut m = OutputMeter::new();
            let mut last = 0;
            for byte in body.chunks(1) {
                m.feed(byte);
                assert!(m.progress() >= last, "{}: progress went back", c.name);
                last = m.progress();
            }
            assert_eq!(seen(&m), whole, "{} byte by byte", c.name);
            // Chunks of every size up to 40, and empty chunks in between.
            for size in 2..=40 {
                let mut m = OutputMeter::new();
                for chunk in body.chunks(size) {
                    m.feed(chunk);
                    m.feed(&[]);
                }
                assert_eq!(seen(&m), whole, "{} in chunks of {size}", c.name);
            }
        }
    }

    #[test]
    fn fields_split_across_two_chunks() {
        // (first chunk, second chunk, progress, sample)
        let cases: &[(&str, &str, u64, Option<u64>)] = &[
            (
                r#"data: {"choices":[{"delta":{"cont"#,
                r#"ent":"Hi"}}]}"#,
                1,
                Some(1),
            ),
            (
                r#"data: {"choices":[{"delta":{"content":""#,
                r#"Hi"}}]}"#,
                1,
                Some(1),
            ),
            (
                r#"data: {"choices":[{"delta":{"content":"#,
                r#""Hi"}}]}"#,
                1,
                Some(1),
            ),
            (r#"data: {"choices":[{"text"#, r#"":"x"}]}"#, 1, Some(1)),
            (r#"data: {"choices":[{"text":""#, r#""}]}"#, 0, None),
            (
                r#"{"usage":{"completion_tokens":1"#,
                r#"23}}"#,
                123,
                Some(123),
            ),
            (
                r#"{"usage":{"completion_tok"#,
                r#"ens":123}}"#,
                123,
                Some(123),
            ),
            (r#"{"usage":{"output_tokens""#, r#": 7}}"#, 7, Some(7)),
            (r#"{"usage":{"output_tokens":"#, r#"7}}"#, 7, Some(7)),
        ];
        for (a, b, progress, sample) in cases {
            let m = read(&[a.as_bytes(), b.as_bytes()]);
            assert_eq!(seen(&m), (*progress, *sample), "{a} | {b}");
        }
    }

    #[test]
    fn the_carry_is_a_few_bytes() {
        // No buffer between chunks: the meter is its counters and the scan's state.
        assert!(std::mem::size_of::<OutputMeter>() <= 64);
    }

    #[test]
    fn a_reply_without_usage_is_no_sample() {
        // A single JSON answer holds one `"content"` whatever its length: not a token count.
        let reply = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"A long answer of many tokens."},"finish_reason":"stop"}]}"#;
        let m = read(&[reply.as_bytes()]);
        assert_eq!(m.finish(true, true), None);
        assert_eq!(m.progress(), 0);
        // Leading whitespace (or a byte order mark) does not make it a stream.
        let m = read(&[b"\xef\xbb\xbf \r\n", reply.as_bytes()]);
        assert_eq!(m.finish(true, true), None);
        // A stream of events with the same content is a sample of one token.
        let stream = r#"data: {"choices":[{"delta":{"content":"A long answer of many tokens."}}]}"#;
        let m = read(&[stream.as_bytes(), b"\n\ndata: [DONE]\n\n"]);
        assert_eq!(m.finish(true, true), Some(1));
    }

    #[test]
    fn the_sample_rule() {
        let stream = sse(&[
            r#"{"choices":[{"delta":{"content":"a"}}]}"#.to_string(),
            r#"{"choices":[{"delta":{"content":"b"}}]}"#.to_string(),
        ]);
        let with_usage = format!(
            "{stream}data: {}\n\n",
            r#"{"choices":[],"usage":{"completion_tokens": 40}}"#
        );
        let empty =
            sse(&[r#"{"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}"#.to_string()]);
        // (body, status_ok, completed, sample)
        let cases: &[(&str, bool, bool, Option<u64>)] = &[
            (&stream, true, true, Some(2)),
            (&stream, false, true, None),
            (&stream, true, false, None),
            (&with_usage, true, true, Some(40)),
            (&with_usage, false, false, None),
            (&empty, true, true, None),
            ("", true, true, None),
            (r#"{"usage":{"completion_tokens":0}}"#, true, true, None),
            (
                r#"{"usage":{"completion_tokens":"many"}}"#,
                true,
                true,
                None,
            ),
        ];
        for (body, ok, completed, want) in cases {
            let m = read(&[body.as_bytes()]);
            assert_eq!(m.finish(*ok, *completed), *want, "{body} {ok} {completed}");
        }
    }

    /// The server's count of the prompt, which the estimate is calibrated by: OpenAI's usage
    /// (streamed or not, written with or without spaces) and SGLang's `meta_info`; other
    /// formats' counts are not read, and a prompt count never moves the output count.
    #[test]
    fn the_servers_prompt_count_is_read() {
        let chat = chat_stream(true);
        let plain = chat_stream(false);
        let sglang = sglang_stream();
        // (name, body, status_ok, completed, prompt count, output sample)
        type PromptCase<'a> = (&'a str, &'a str, bool, bool, Option<u64>, Option<u64>);
        let cases: &[PromptCase] = &[
            ("chat reply", CHAT_REPLY, true, true, Some(9), Some(11)),
            ("spaced reply", SPACED_REPLY, true, true, Some(9), Some(3)),
            (
                "chat stream with usage",
                &chat,
                true,
                true,
                Some(12),
                Some(7),
            ),
            (
                "chat stream without usage",
                &plain,
                true,
                true,
                None,
                Some(5),
            ),
            ("sglang stream", &sglang, true, true, Some(7), Some(4)),
            ("sglang reply", SGLANG_REPLY, true, true, Some(7), Some(2)),
            (
                "responses reply (input_tokens)",
                RESPONSES_REPLY,
                true,
                true,
                None,
                Some(4),
            ),
            (
                "anthropic reply (input_tokens)",
                ANTHROPIC_REPLY,
                true,
                true,
                None,
                Some(8),
            ),
            ("failed", CHAT_REPLY, false, true, None, None),
            ("cut off", CHAT_REPLY, true, false, None, None),
            (
                "no tokens",
                r#"{"usage":{"prompt_tokens":0,"completion_tokens":2}}"#,
                true,
                true,
                None,
                Some(2),
            ),
            (
                "count last",
                r#"{"usage":{"completion_tokens":2,"prompt_tokens":41"#,
                true,
                true,
                Some(41),
                Some(2),
            ),
            (
                "not a number",
                r#"{"usage":{"prompt_tokens":"x","completion_tokens":2}}"#,
                true,
                true,
                None,
                Some(2),
            ),
            (
                "llama.cpp's timings, no usage",
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"finish_reason\":\"length\",\"delta\":{}}],\"timings\":{\"cache_n\":30,\"prompt_n\":7,\"prompt_ms\":1.5,\"predicted_n\":1}}\n\ndata: [DONE]\n\n",
                true,
                true,
                Some(37),
                Some(1),
            ),
            (
                "usage before timings",
                r#"{"usage":{"completion_tokens":2,"prompt_tokens":41},"timings":{"cache_n":1,"prompt_n":2}}"#,
                true,
                true,
                Some(41),
                Some(2),
            ),
            (
                "nothing computed is no count",
                r#"{"usage":{"completion_tokens":2},"timings":{"cache_n":9,"prompt_n":0}}"#,
                true,
                true,
                None,
                Some(2),
            ),
            (
                "timings of a failed answer",
                r#"{"usage":{"completion_tokens":2},"timings":{"cache_n":0,"prompt_n":5}}"#,
                false,
                true,
                None,
                None,
            ),
        ];
        for (name, body, ok, completed, prompt, sample) in cases {
            let m = read(&[body.as_bytes()]);
            assert_eq!(m.prompt_reported(*ok, *completed), *prompt, "{name}");
            assert_eq!(m.finish(*ok, *completed), *sample, "{name}");
            // Split anywhere, the same.
            for at in 0..body.len() {
                let (a, b) = body.as_bytes().split_at(at);
                let m = read(&[a, b]);
                assert_eq!(
                    m.prompt_reported(*ok, *completed),
                    *prompt,
                    "{name} split at {at}"
                );
            }
        }
    }

    #[test]
    fn events_and_counts() {
        // (body, progress, sample)
        let cases: &[(&str, u64, Option<u64>)] = &[
            ("", 0, None),
            ("data: [DONE]\n\n", 0, None),
            (r#"data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}"#, 1, Some(1)),
            (r#"data: {"choices":[{"delta":{"content": "Hi"}}]}"#, 1, Some(1)),
            (r#"data: {"choices":[{"delta":{"content":null,"tool_calls":[]}}]}"#, 0, None),
            (r#"data: {"choices":[{"text":" world","index":0}]}"#, 1, Some(1)),
            (r#"data: {"choices":[{"text":"","finish_reason":"length"}]}"#, 0, None),
            (": keep-alive\n\ndata: {\"choices\":[{\"text\":\"x\"}]}\n\n", 1, Some(1)),
            // The last count reported is the sample; the running count keeps the highest.
            (
                "data: {\"usage\":{\"output_tokens\":30}}\n\ndata: {\"usage\":{\"output_tokens\":3}}\n\n",
                30,
                Some(3),
            ),
            // Overflowing digits are no count.
            (r#"{"usage":{"completion_tokens":99999999999999999999999}}"#, 0, None),
            (r#"{"usage":{"completion_tokens":18446744073709551615}}"#, u64::MAX, Some(u64::MAX)),
            // Keys inside a string, with their quotes escaped, are not keys.
            (r#"data: {"delta":{"content":"say \"text\":\"x\" and \"output_tokens\":9"}}"#, 1, Some(1)),
        ];
        for (body, progress, sample) in cases {
            let m = read(&[body.as_bytes()]);
            assert_eq!(seen(&m), (*progress, *sample), "{body}");
        }
    }

    /// Follows `chunks` as the filter does: a chunk that may be counted unread is, the others
    /// are read. The meter, and which chunks were read.
    fn follow(chunks: &[String]) -> (OutputMeter, Vec<bool>) {
        let mut m = OutputMeter::new();
        let mut read = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            if m.may_skim(c.len(), last) {
                m.skim();
                read.push(false);
            } else {
                m.feed(c.as_bytes());
                read.push(true);
            }
        }
        (m, read)
    }

    /// A chat stream of `n` tokens of varied text, one event a chunk, then the finish event
    /// and `[DONE]` together, with the usage before them when `usage`.
    fn token_chunks(n: usize, usage: bool) -> Vec<String> {
        let words = [
            " the", " a", " quick", ",", " foxes", " jumped", ".", " over",
        ];
        let mut chunks = vec![sse(&[chat_chunk(
            r#"{"role":"assistant","content":""}"#,
            "null",
        )])];
        for i in 0..n {
            let word = words.get(i % words.len()).copied().unwrap_or("x");
            chunks.push(sse(&[chat_chunk(
                &format!(r#"{{"content":"{word}"}}"#),
                "null",
            )]));
        }
        if usage {
            chunks.push(sse(&[format!(
                r#"{{"id":"chatcmpl-7","choices":[],"usage":{{"prompt_tokens":9,"completion_tokens":{n}}}}}"#
            )]));
        }
        chunks.push(sse(&[chat_chunk("{}", r#""stop""#), "[DONE]".to_string()]));
        chunks
    }

    #[test]
    fn a_stream_is_counted_as_if_read_while_most_chunks_stay_unread() {
        for (n, usage) in [(200, false), (200, true), (37, false), (3, false)] {
            let chunks = token_chunks(n, usage);
            let all: Vec<&[u8]> = chunks.iter().map(|c| c.as_bytes()).collect();
            let whole = read(&all);
            let (m, read) = follow(&chunks);
            assert_eq!(seen(&m), seen(&whole), "{n} tokens, usage {usage}");
            assert_eq!(seen(&m).0, n as u64);
            let reads = read.iter().filter(|r| **r).count();
            if n >= 200 {
                // The role chunk, the sizes learned, a check every CHECK_EVERY, the end.
                assert!(reads <= 40, "{reads} of {} chunks read", chunks.len());
            }
            // What comes before the sizes are known, and the last chunk, are always read.
            let learning = 1 + usize::from(LEARN);
            assert!(read.iter().take(learning).all(|r| *r), "{read:?}");
            assert_eq!(read.last(), Some(&true));
        }
    }

    #[test]
    fn two_events_in_one_chunk_are_read() {
        let mut chunks = token_chunks(20, false);
        // Events that came together (the upstream was quicker than Envoy's reads).
        let joined: String = chunks.drain(10..14).collect();
        chunks.insert(10, joined);
        let (m, read) = follow(&chunks);
        assert_eq!(read.get(10), Some(&true));
        assert_eq!(seen(&m).0, 20);
    }

    #[test]
    fn a_check_that_finds_no_event_ends_skimming() {
        let mut chunks = token_chunks(60, false);
        // Keep-alive comments padded to a token event's size: the same size, no content.
        let size = chunks.get(3).map_or(0, String::len);
        let comment = format!(": {}\n\n", "k".repeat(size.saturating_sub(4)));
        assert_eq!(comment.len(), size);
        for c in chunks.iter_mut().skip(8).step_by(2).take(30) {
            *c = comment.clone();
        }
        let (m, read) = follow(&chunks);
        // Some comments were counted as tokens before a check read one; then every chunk is.
        let first_check = read
            .iter()
            .enumerate()
            .skip(1 + usize::from(LEARN))
            .find(|(i, r)| **r && chunks.get(*i) == Some(&comment))
            .map(|(i, _)| i);
        let Some(at) = first_check else {
            panic!("no comment was read: {read:?}");
        };
        assert!(read.iter().skip(at).all(|r| *r), "{read:?}");
        assert!(m.no_skim);
        // Miscounted by at most the comments counted before the check.
        let counted = seen(&m).0;
        assert!(
            (30..30 + u64::from(CHECK_EVERY)).contains(&counted),
            "{counted}"
        );
    }

    #[test]
    fn a_chunk_after_a_split_event_is_read() {
        let mut chunks = token_chunks(30, false);
        // An event cut in two: the chunk after the cut starts inside it.
        let cut = chunks.get(12).cloned().unwrap_or_default();
        let (head, tail) = cut.split_at(cut.find("content").unwrap_or(0) + 3);
        let (head, tail) = (head.to_string(), tail.to_string());
        chunks.splice(12..13, [head, tail]);
        let (m, read) = follow(&chunks);
        assert_eq!(read.get(13), Some(&true), "{read:?}");
        assert_eq!(seen(&m).0, 30);
    }

    #[test]
    fn a_reply_is_never_skimmed() {
        let reply = r#"{"choices":[{"message":{"content":"hi"}}],"usage":{"completion_tokens":1}}"#;
        let mut m = OutputMeter::new();
        for _ in 0..8 {
            assert!(!m.may_skim(reply.len(), false));
            m.feed(reply.as_bytes());
        }
    }

    /// A real llama-server's streamed answers (b11434, `scripts/llamacpp-facts.py`), cut into
    /// the chunks it sends (one event each), followed as the filter follows them: the same
    /// count and sample as reading every byte, most chunks unread.
    #[test]
    fn real_streams_are_counted_as_if_read() {
        // (body, the server's output count, its prompt count: the usage's when asked for,
        // else its timings', the same)
        let streams = [
            (
                include_str!("../../tests/data/streams/llamacpp_chat.sse"),
                None,
                37,
            ),
            (
                include_str!("../../tests/data/streams/llamacpp_chat_usage.sse"),
                Some(40),
                37,
            ),
            (
                include_str!("../../tests/data/streams/llamacpp_completion.sse"),
                None,
                4,
            ),
        ];
        for (body, usage, prompt) in streams {
            let chunks: Vec<String> = body.split_inclusive("\n\n").map(str::to_string).collect();
            assert!(chunks.len() >= 40, "{}", chunks.len());
            let whole = read(&[body.as_bytes()]);
            let (m, read) = follow(&chunks);
            assert_eq!(seen(&m), seen(&whole));
            // 40 tokens, each an event (or the server's count).
            assert_eq!(seen(&m).1, Some(usage.unwrap_or(40)));
            // The prompt's count, from the usage or the timings of the last choice's event,
            // which is never counted unread.
            assert_eq!(m.prompt_reported(true, true), Some(prompt));
            assert_eq!(whole.prompt_reported(true, true), Some(prompt));
            let reads = read.iter().filter(|r| **r).count();
            assert!(reads * 2 < chunks.len(), "{reads} of {} read", chunks.len());
        }
    }

    /// A real llama-server's (b11434) streamed answer to OpenAI's Responses API, one event a
    /// chunk: its 20 `response.output_text.delta` events are counted as they come, mostly
    /// unread, the closing events that repeat the text (four) put the running count a little
    /// over at the very end, and the server's count in `response.completed` is the sample.
    #[test]
    fn a_real_responses_stream_is_followed() {
        let body = include_str!("../../tests/data/streams/llamacpp_responses.sse");
        let chunks: Vec<String> = body.split_inclusive("\n\n").map(str::to_string).collect();
        let deltas = chunks
            .iter()
            .filter(|c| c.starts_with("event: response.output_text.delta\n"))
            .count();
        assert_eq!(deltas, 20);
        let whole = read(&[body.as_bytes()]);
        let (m, reads) = follow(&chunks);
        assert_eq!(seen(&m), seen(&whole));
        assert_eq!(seen(&m), (deltas as u64 + 4, Some(21)));
        // Its usage says `input_tokens`, which is not read; its timings count the prompt: 23
        // computed and 3 cached, the 26 of `input_tokens`.
        assert_eq!(m.prompt_reported(true, true), Some(26));
        // Before the closing events, the count is the deltas so far.
        let (before_close, _) = follow(&chunks[..chunks.len() - 4]);
        assert_eq!(before_close.progress(), deltas as u64);
        // Of a short answer's 20 deltas, the first few teach the size and some are of
        // another: at least half are counted unread.
        let unread = reads.iter().filter(|r| !**r).count();
        assert!(unread * 2 >= deltas, "{unread} of {} unread", chunks.len());
    }

    /// Real llama-server b11434 streams of Anthropic's Messages API (20 `text_delta` events,
    /// the server's `output_tokens` 21, EOS included, in `message_delta`) and of the native
    /// `/completion` (40 events each with its `content` and the running `tokens_predicted`, then
    /// a closing event with the settings and timings), recorded by `llamacpp-facts.py`: followed
    /// chunk by chunk as if read whole, at the server's count.
    #[test]
    fn real_messages_and_native_streams_are_followed() {
        // (body, a token's event, the server's output count, its prompt count: Anthropic's
        // `input_tokens` are not read and this stream has no timings; the native one's timings)
        for (body, events, count, prompt) in [
            (
                include_str!("../../tests/data/streams/llamacpp_messages.sse"),
                "event: content_block_delta\n",
                21,
                None,
            ),
            (
                include_str!("../../tests/data/streams/llamacpp_native.sse"),
                "data: {\"index\":0,\"content\":\"",
                40,
                Some(4),
            ),
        ] {
            let chunks: Vec<String> = body.split_inclusive("\n\n").map(str::to_string).collect();
            let tokens = chunks.iter().filter(|c| c.starts_with(events)).count() as u64;
            assert!(tokens >= 20, "{tokens}");
            let whole = read(&[body.as_bytes()]);
            let (m, _) = follow(&chunks);
            assert_eq!(seen(&m), seen(&whole));
            assert_eq!(m.finish(true, true), Some(count));
            assert_eq!(m.prompt_reported(true, true), prompt);
            // Before the last events the running count is the tokens so far.
            let (early, _) = follow(&chunks[..10]);
            assert!((8..=10).contains(&early.progress()), "{}", early.progress());
        }
    }

    #[test]
    fn reasoning_values_that_are_not_text_count_nothing() {
        let events = [
            r#"{"choices":[{"delta":{"reasoning":null,"content":"a"}}]}"#,
            r#"{"reasoning":{"effort":"low","summary":null},"choices":[{"delta":{"content":"b"}}]}"#,
            r#"{"choices":[],"usage":{"completion_tokens_details":{"reasoning_tokens":7}}}"#,
            r#"{"choices":[{"delta":{"reasoning_content":""}}]}"#,
        ]
        .map(String::from);
        let m = read(&[sse(&events).as_bytes()]);
        // Two answer tokens; no count (`reasoning_tokens` is a part of one, not the count).
        assert_eq!(seen(&m), (2, Some(2)));
    }
}
