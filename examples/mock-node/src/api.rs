//! The HTTP API of one node: OpenAI-compatible completions (streaming or not), the seed
//! /health, /metrics in the node's engine flavour, /v1/models, and the test controls under
//! /admin.

use crate::node::{lock, Delivery, Node, Overrides, Submission};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use mock_gpu_node::metrics::{self, Flavour};
use mock_gpu_node::tokenize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

const DEFAULT_MAX_TOKENS: u64 = 256;
const MAX_BODY_BYTES: usize = 16 << 20;
/// Benchmark-only header carrying the true output length of a replayed request, so the mock
/// ends it where the real one ended; the filter never reads it.
const OUTPUT_TOKENS_HEADER: &str = "x-mock-output-tokens";

/// ORCA load report header, read by Envoy's client_side_weighted_round_robin.
const ORCA_HEADER: &str = "endpoint-load-metrics";

/// Benchmark-only header: prompt tokens the prefix cache saved. A whole response knows it
/// exactly; a stream's headers leave before the request is scheduled, so there it is what
/// the cache held when the request arrived (the final usage chunk has the exact figure, as
/// `usage.prompt_tokens_details.cached_tokens`).
const PREFIX_HIT_HEADER: &str = "x-mock-prefix-hit-tokens";

pub type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

pub async fn handle(
    node: Arc<Node>,
    req: Request<Incoming>,
) -> Result<Response<BoxBody>, Infallible> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let mut r = match (req.method().clone(), path.as_str()) {
        (Method::POST, "/v1/chat/completions") => completion(node.clone(), Kind::Chat, req).await,
        (Method::POST, "/v1/completions") => completion(node.clone(), Kind::Text, req).await,
        (Method::POST, "/v1/responses") => completion(node.clone(), Kind::Responses, req).await,
        (Method::POST, "/generate") => completion(node.clone(), Kind::Generate, req).await,
        (Method::POST, "/v1/messages") => completion(node.clone(), Kind::Messages, req).await,
        (Method::GET, "/health") => health(&node).await,
        (Method::GET, "/metrics") => metrics(&node, false, query.as_deref()),
        (Method::GET, "/prometheus/metrics")
            if node.honest() && node.flavour() == Flavour::Trtllm =>
        {
            metrics(&node, true, query.as_deref())
        }
        (Method::GET, "/v1/models") => json_response(StatusCode::OK, &node.model_list()),
        (Method::GET, p) if p.starts_with("/v1/responses/") => stored_response(&node, p),
        (Method::POST, "/admin/health") => admin_health(&node, req).await,
        (Method::GET, "/admin/stats") => json_response(StatusCode::OK, &admin_stats(&node)),
        // The seed report, whatever /health serves: for tools reading a node that imitates an
        // engine honestly (its /health then says nothing of load).
        (Method::GET, "/admin/report") => json_response(StatusCode::OK, &node.health()),
        (method, _) => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("no route for {method} {path}"),
        ),
    };
    // Checked when the command line was parsed.
    if let Ok(v) = HeaderValue::from_str(&node.name) {
        r.headers_mut().insert("x-mock-node", v);
    }
    Ok(r)
}

/// `GET /v1/responses/{id}`: a stored answer, found only on the node that stores it.
fn stored_response(node: &Node, path: &str) -> Response<BoxBody> {
    let id = path.trim_start_matches("/v1/responses/");
    match node.stored(id) {
        Some(tokens) => json_response(
            StatusCode::OK,
            &json!({"id": id, "object": "response", "status": "completed",
                    "usage": {"total_tokens": tokens.len()}}),
        ),
        None => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("Response with id '{id}' not found."),
        ),
    }
}

fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<BoxBody> {
    let mut r = Response::new(Full::new(body.into()).boxed_unsync());
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_response(status: StatusCode, v: &Value) -> Response<BoxBody> {
    full(status, "application/json", v.to_string())
}

/// OpenAI's error shape.
fn error(status: StatusCode, kind: &str, message: &str) -> Response<BoxBody> {
    error_with_code(status, kind, message, Value::Null)
}

fn error_with_code(
    status: StatusCode,
    kind: &str,
    message: &str,
    code: Value,
) -> Response<BoxBody> {
    json_response(
        status,
        &json!({"error": {"message": message, "type": kind, "param": null, "code": code}}),
    )
}

fn admin_stats(node: &Node) -> Value {
    let mut v = json!({"name": node.name,
        "requests_total": node.requests_total.load(Ordering::Relaxed),
        "health_requests_total": node.health_requests_total.load(Ordering::Relaxed),
        "metrics_requests_total": node.metrics_requests_total.load(Ordering::Relaxed),
        "metrics_bytes_total": node.metrics_bytes_total.load(Ordering::Relaxed),
        "lost_model_ms": node.lost_model_us.load(Ordering::Relaxed) as f64 / 1000.0});
    if let (Some(o), Value::Object(p)) = (v.as_object_mut(), node.prefix_stats()) {
        o.extend(p);
    }
    v
}

/// Reads a body of bounded size; the error is the response to send.
async fn read_body(req: Request<Incoming>) -> Result<Bytes, Response<BoxBody>> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &format!("body larger than {MAX_BODY_BYTES} bytes"),
        )),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("could not read the body: {e}"),
        )),
    }
}

/// Reads a JSON body; the error is the response to send.
async fn read_json(req: Request<Incoming>) -> Result<Value, Response<BoxBody>> {
    let body = read_body(req).await?;
    serde_json::from_slice(&body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("body is not valid JSON: {e}"),
        )
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// /v1/chat/completions
    Chat,
    /// /v1/completions
    Text,
    /// /v1/responses (OpenAI's Responses API), its events as vLLM and llama.cpp's server send
    /// them
    Responses,
    /// /generate, SGLang's native endpoint: `text` or `input_ids`, `sampling_params`; streamed
    /// as SGLang does with `--incremental-streaming-output` (each event the new text, with
    /// `meta_info` counting the tokens so far)
    Generate,
    /// /v1/messages, Anthropic's Messages API, as vLLM and llama.cpp's server serve it:
    /// `system`, content blocks, `max_tokens`; streamed as Anthropic's named events
    Messages,
}

/// The generated text: token `i` is the word `tok<i>` and a space.
fn token_text(i: u64) -> String {
    format!("tok{i} ")
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What every response or chunk of one completion shares.
struct Completion {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    finish_reason: &'static str,
    prompt_tokens: u64,
    completion_tokens: u64,
    /// Prompt tokens found in the prefix cache (known once the request is scheduled).
    cached_tokens: u64,
    /// A chat stream's first tokens sent as thinking (`reasoning_content`), as a reasoning
    /// model streams them before its answer.
    reasoning_tokens: u64,
    /// A chat stream's answer is a tool call, its tokens the call's arguments.
    tool_call: bool,
    /// A chat or text stream ends with its usage: the client asked for it
    /// (`stream_options.include_usage`), or the node sends it unasked (`force_usage=1`), as
    /// vLLM, SGLang, llama.cpp and OpenAI's API do; otherwise no chunk carries it.
    usage_in_stream: bool,
}

impl Completion {
    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens,
               "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }

    fn object(&self, v: Value) -> Value {
        let mut o = json!({"id": self.id, "created": self.created, "model": self.model});
        if let (Some(o), Value::Object(v)) = (o.as_object_mut(), v) {
            o.extend(v);
        }
        o
    }

    /// The Responses API's usage.
    fn responses_usage(&self) -> Value {
        json!({"input_tokens": self.prompt_tokens,
               "input_tokens_details": {"cached_tokens": self.cached_tokens},
               "output_tokens": self.completion_tokens,
               "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
               "total_tokens": self.prompt_tokens + self.completion_tokens})
    }

    /// A Responses API response object with `output` (its items) and `status`.
    fn response(&self, status: &str, output: Value, usage: Value) -> Value {
        json!({"id": self.id, "object": "response", "created_at": self.created,
               "model": self.model, "status": status, "output": output, "usage": usage})
    }

    /// A Responses API message item holding `text`.
    fn message_item(&self, text: &str) -> Value {
        json!({"id": format!("msg-{}", self.id), "type": "message", "role": "assistant",
               "status": "completed",
               "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    /// SGLang's `meta_info` after `tokens` output tokens (`finished`: with its finish reason).
    fn meta_info(&self, tokens: u64, finished: bool) -> Value {
        let finish = if finished {
            json!({"type": self.finish_reason, "length": tokens})
        } else {
            Value::Null
        };
        json!({"id": self.id, "finish_reason": finish, "prompt_tokens": self.prompt_tokens,
               "completion_tokens": tokens, "cached_tokens": self.cached_tokens})
    }

    fn whole(&self, text: String) -> Value {
        let (object, choice) = match self.kind {
            Kind::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": self.finish_reason, "logprobs": null}),
            ),
            Kind::Text => (
                "text_completion",
                json!({"index": 0, "text": text, "finish_reason": self.finish_reason,
                       "logprobs": null}),
            ),
            Kind::Responses => {
                return self.response(
                    "completed",
                    json!([self.message_item(&text)]),
                    self.responses_usage(),
                )
            }
            Kind::Generate => {
                return json!({"text": text,
                              "meta_info": self.meta_info(self.completion_tokens, true)})
            }
            Kind::Messages => {
                let answer = if self.tool_call {
                    json!({"type": "tool_use", "id": format!("toolu-{}", self.id),
                           "name": "lookup", "input": {"q": text}})
                } else {
                    json!({"type": "text", "text": text})
                };
                return json!({"id": self.id, "type": "message", "role": "assistant",
                              "model": self.model, "content": [answer],
                              "stop_reason": self.stop_reason(), "stop_sequence": null,
                              "usage": self.messages_usage(self.completion_tokens)});
            }
        };
        self.object(json!({"object": object, "choices": [choice], "usage": self.usage()}))
    }

    /// A stream chunk's `object` (the Responses API's events have none).
    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Text | Kind::Responses | Kind::Generate | Kind::Messages => "text_completion",
        }
    }

    /// Anthropic's stop reason.
    fn stop_reason(&self) -> &'static str {
        match (self.tool_call, self.finish_reason) {
            (true, _) => "tool_use",
            (false, "length") => "max_tokens",
            (false, _) => "end_turn",
        }
    }

    /// Anthropic's usage after `output` tokens.
    fn messages_usage(&self, output: u64) -> Value {
        json!({"input_tokens": self.prompt_tokens - self.cached_tokens.min(self.prompt_tokens),
               "cache_read_input_tokens": self.cached_tokens, "output_tokens": output})
    }

    /// The content block token `i` belongs to: its index, and its `content_block_start`
    /// block and its delta's type and key (thinking first, then the answer: text or a tool
    /// use).
    fn messages_block(&self, i: u64) -> (u64, Value, &'static str, &'static str) {
        let thinking = i < self.reasoning_tokens;
        let index = u64::from(!thinking && self.reasoning_tokens > 0);
        if thinking {
            (
                index,
                json!({"type": "thinking", "thinking": ""}),
                "thinking_delta",
                "thinking",
            )
        } else if self.tool_call {
            let block = json!({"type": "tool_use", "id": format!("toolu-{}", self.id),
                               "name": "lookup", "input": {}});
            (index, block, "input_json_delta", "partial_json")
        } else {
            (
                index,
                json!({"type": "text", "text": ""}),
                "text_delta",
                "text",
            )
        }
    }

    /// Anthropic's events carrying token `i`: `message_start` first, a block's
    /// `content_block_start` (and the block before it stopped) where a block begins, then the
    /// token's `content_block_delta`.
    fn messages_event(&self, i: u64) -> Bytes {
        let mut out = String::new();
        if i == 0 {
            let start = json!({"type": "message_start", "message": {"id": self.id, "type": "message",
                "role": "assistant", "model": self.model, "content": [], "stop_reason": null,
                "usage": self.messages_usage(0)}});
            out.push_str(&event("message_start", &start));
        }
        let (index, block, delta_type, key) = self.messages_block(i);
        if i == 0 || (i == self.reasoning_tokens && index > 0) {
            if index > 0 {
                let stop = json!({"type": "content_block_stop", "index": index - 1});
                out.push_str(&event("content_block_stop", &stop));
            }
            let start = json!({"type": "content_block_start", "index": index,
                               "content_block": block});
            out.push_str(&event("content_block_start", &start));
        }
        let delta = json!({"type": "content_block_delta", "index": index,
                           "delta": {"type": delta_type, key: token_text(i)}});
        out.push_str(&event("content_block_delta", &delta));
        Bytes::from(out)
    }

    /// Anthropic's closing events: the last block stopped, `message_delta` with the stop
    /// reason and the output count, `message_stop`.
    fn messages_closing(&self) -> Vec<Bytes> {
        let (index, ..) = self.messages_block(self.completion_tokens.saturating_sub(1));
        let stop = json!({"type": "content_block_stop", "index": index});
        let delta = json!({"type": "message_delta",
                           "delta": {"stop_reason": self.stop_reason(), "stop_sequence": null},
                           "usage": {"output_tokens": self.completion_tokens}});
        vec![
            Bytes::from(event("content_block_stop", &stop)),
            Bytes::from(event("message_delta", &delta)),
            Bytes::from(event("message_stop", &json!({"type": "message_stop"}))),
        ]
    }

    /// The Responses API event carrying token `i`: of thinking, of a tool call's arguments or
    /// of the answer, each a `"delta"`; the first comes after `response.created`.
    fn responses_event(&self, i: u64) -> Bytes {
        let delta = token_text(i);
        let (kind, item) = if i < self.reasoning_tokens {
            ("response.reasoning_text.delta", format!("rs-{}", self.id))
        } else if self.tool_call {
            (
                "response.function_call_arguments.delta",
                format!("fc-{}", self.id),
            )
        } else {
            ("response.output_text.delta", format!("msg-{}", self.id))
        };
        let mut out = String::new();
        if i == 0 {
            let created = json!({"type": "response.created", "sequence_number": 0,
                                 "response": self.response("in_progress", json!([]), Value::Null)});
            out.push_str(&event("response.created", &created));
        }
        let data = json!({"type": kind, "item_id": item, "output_index": 0,
                          "content_index": 0, "delta": delta, "sequence_number": i + 1});
        out.push_str(&event(kind, &data));
        Bytes::from(out)
    }

    /// The Responses API's closing events: the whole answer once more, then
    /// `response.completed` with the usage.
    fn responses_closing(&self) -> Vec<Bytes> {
        let text: String = (self.reasoning_tokens..self.completion_tokens)
            .map(token_text)
            .collect();
        let item = if self.tool_call {
            json!({"id": format!("fc-{}", self.id), "type": "function_call", "status": "completed",
                   "call_id": format!("call-{}", self.id), "name": "lookup", "arguments": text})
        } else {
            self.message_item(&text)
        };
        let done = json!({"type": "response.output_item.done", "output_index": 0, "item": item});
        let completed = json!({"type": "response.completed",
                               "response": self.response("completed", json!([item]),
                                                         self.responses_usage())});
        vec![
            Bytes::from(event("response.output_item.done", &done)),
            Bytes::from(event("response.completed", &completed)),
        ]
    }

    /// The SSE event carrying token `i`.
    fn token_event(&self, i: u64) -> Bytes {
        let text = token_text(i);
        match self.kind {
            Kind::Responses => return self.responses_event(i),
            Kind::Messages => return self.messages_event(i),
            Kind::Generate => {
                let last = i + 1 >= self.completion_tokens;
                return sse(
                    &json!({"text": text, "meta_info": self.meta_info(i + 1, last),
                                   "index": 0}),
                );
            }
            Kind::Chat | Kind::Text => {}
        }
        let choice = match self.kind {
            Kind::Chat if i < self.reasoning_tokens && i == 0 => {
                json!({"index": 0, "finish_reason": null,
                       "delta": {"role": "assistant", "reasoning_content": text}})
            }
            Kind::Chat if i < self.reasoning_tokens => json!({"index": 0, "finish_reason": null,
                                                             "delta": {"reasoning_content": text}}),
            Kind::Chat if self.tool_call => {
                let call = if i == self.reasoning_tokens {
                    json!({"index": 0, "id": format!("call-{}", self.id), "type": "function",
                           "function": {"name": "lookup", "arguments": text}})
                } else {
                    json!({"index": 0, "function": {"arguments": text}})
                };
                let mut delta = json!({"tool_calls": [call]});
                if i == 0 {
                    delta = json!({"role": "assistant", "tool_calls": [call]});
                }
                json!({"index": 0, "finish_reason": null, "delta": delta})
            }
            Kind::Chat if i == 0 => json!({"index": 0, "finish_reason": null,
                                           "delta": {"role": "assistant", "content": text}}),
            Kind::Chat => json!({"index": 0, "finish_reason": null, "delta": {"content": text}}),
            Kind::Text | Kind::Responses | Kind::Generate | Kind::Messages => {
                json!({"index": 0, "text": text, "finish_reason": null, "logprobs": null})
            }
        };
        sse(&self.object(json!({"object": self.chunk_object(), "choices": [choice]})))
    }

    /// The events after the last token: the finish reason, the usage, `[DONE]` (the
    /// Responses API: its own, `responses_closing`).
    fn closing_events(&self) -> Vec<Bytes> {
        let last = match self.kind {
            Kind::Chat => json!({"index": 0, "delta": {}, "finish_reason": self.finish_reason}),
            Kind::Text => json!({"index": 0, "text": "", "finish_reason": self.finish_reason,
                                 "logprobs": null}),
            Kind::Responses => return self.responses_closing(),
            Kind::Messages => return self.messages_closing(),
            // The last token's event carried the finish reason.
            Kind::Generate => return vec![Bytes::from_static(b"data: [DONE]\n\n")],
        };
        let mut events = vec![sse(
            &self.object(json!({"object": self.chunk_object(), "choices": [last]}))
        )];
        if self.usage_in_stream {
            events.push(sse(&self.object(
                json!({"object": self.chunk_object(), "choices": [], "usage": self.usage()}),
            )));
        }
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        events
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A named server-sent event, as the Responses API sends them.
fn event(name: &str, data: &Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

async fn completion(node: Arc<Node>, kind: Kind, req: Request<Incoming>) -> Response<BoxBody> {
    node.requests_total.fetch_add(1, Ordering::Relaxed);
    let true_output: Option<u64> = req
        .headers()
        .get(OUTPUT_TOKENS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let body = match read_json(req).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    // As vLLM does, the model is checked before anything else in the body.
    let served = match node.resolve_model(body.get("model").and_then(Value::as_str)) {
        Ok(m) => m,
        Err(msg) => {
            return error_with_code(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                &msg,
                json!("model_not_found"),
            )
        }
    };
    let prompt_ids = match kind {
        Kind::Chat => {
            tokenize::chat_prompt_ids(&body).map(|ids| tokenize::rescale(ids, node.token_scale))
        }
        Kind::Text => tokenize::completion_prompt_ids(&body),
        Kind::Responses => {
            tokenize::responses_as_chat(&body).and_then(|c| tokenize::chat_prompt_ids(&c))
        }
        Kind::Generate => tokenize::generate_prompt_ids(&body),
        Kind::Messages => {
            tokenize::messages_as_chat(&body).and_then(|c| tokenize::chat_prompt_ids(&c))
        }
    };
    let mut prompt_ids = match prompt_ids {
        Ok(ids) => ids,
        Err(msg) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", &msg),
    };
    // A turn continuing a stored answer is served only by the node that stores it, as vLLM
    // serves it (its store is each server's memory), with the stored conversation ahead of
    // its own input. Instant answers neither store nor look up.
    let previous = body.get("previous_response_id").and_then(Value::as_str);
    if let (Kind::Responses, Some(previous), false) = (kind, previous, node.instant) {
        match node.stored(previous) {
            Some(history) => {
                let mut ids = history.to_vec();
                ids.append(&mut prompt_ids);
                prompt_ids = ids;
            }
            None => {
                return error(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    &format!("Response with id '{previous}' not found."),
                )
            }
        }
    }
    let stores =
        kind == Kind::Responses && body.get("store").and_then(Value::as_bool) != Some(false);
    let prompt_tokens = prompt_ids.len() as u64;
    // llama.cpp refuses a prompt longer than a slot's context before any work.
    if let Some(n_ctx) = node.n_ctx().filter(|n| prompt_tokens > *n) {
        return json_response(
            StatusCode::BAD_REQUEST,
            &json!({"error": {"code": 400, "type": "exceed_context_size_error",
                "message": format!("request ({prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it"),
                "n_prompt_tokens": prompt_tokens, "n_ctx": n_ctx}}),
        );
    }
    if node.instant {
        return instant(&node, kind, served.name, prompt_tokens, &body);
    }
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .or_else(|| body.get("max_output_tokens"))
        .or_else(|| body.pointer("/sampling_params/max_new_tokens"))
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_MAX_TOKENS);
    let output = true_output.map_or(max_tokens, |t| t.clamp(1, max_tokens));
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let ends_at_length = output >= max_tokens;
    let (ticket, mut rx, cached_at_arrival) = node.submit(Submission {
        prompt_ids: &prompt_ids,
        output_tokens: output,
        model: &served,
        ends_at_length,
    });
    let id = format!(
        "{}-{}-{}",
        match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
            Kind::Responses => "resp",
            Kind::Generate => "gen",
            Kind::Messages => "msg",
        },
        node.name,
        ticket.id()
    );
    if stores {
        // The conversation so far: its prompt, then its output (ids of this answer's own).
        let seed = ticket.id().wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1 << 63;
        prompt_ids.extend((0..output).map(|i| seed.wrapping_add(i)));
        node.store(id.clone(), prompt_ids);
    } else {
        drop(prompt_ids);
    }
    let mut c = Completion {
        kind,
        id,
        created: unix_now(),
        model: served.name,
        finish_reason: if ends_at_length { "length" } else { "stop" },
        prompt_tokens,
        completion_tokens: output,
        cached_tokens: cached_at_arrival,
        reasoning_tokens: (output as f64 * node.reasoning).round() as u64,
        tool_call: node.tool_calls,
        usage_in_stream: usage_in_stream(&node, &body),
    };

    if !stream {
        // If the client goes away, hyper drops this future and the ticket with it.
        let mut text = String::new();
        loop {
            match rx.recv().await {
                Some(Delivery::Admitted { cached_tokens }) => c.cached_tokens = cached_tokens,
                Some(Delivery::Token(i)) => text.push_str(&token_text(i)),
                Some(Delivery::Finished) | None => break,
            }
        }
        drop(ticket);
        let mut r = json_response(StatusCode::OK, &c.whole(text));
        let h = r.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&node.orca()) {
            h.insert(ORCA_HEADER, v);
        }
        h.insert(PREFIX_HIT_HEADER, HeaderValue::from(c.cached_tokens));
        return r;
    }

    let (tx, body_rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let _ticket = ticket; // held until the stream ends or the client leaves
        loop {
            let delivery = tokio::select! {
                d = rx.recv() => d,
                // The client went away (even while the request still waits for a batch slot).
                _ = tx.closed() => return,
            };
            match delivery {
                Some(Delivery::Admitted { cached_tokens }) => c.cached_tokens = cached_tokens,
                Some(Delivery::Token(i)) => {
                    if tx.send(c.token_event(i)).await.is_err() {
                        return;
                    }
                }
                Some(Delivery::Finished) => break,
                None => return,
            }
        }
        for event in c.closing_events() {
            if tx.send(event).await.is_err() {
                return;
            }
        }
    });
    let mut r = Response::new(ChannelBody(body_rx).boxed_unsync());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&node.orca()) {
        h.insert(ORCA_HEADER, v);
    }
    h.insert(PREFIX_HIT_HEADER, HeaderValue::from(cached_at_arrival));
    r
}

/// Whether a chat or text stream ends with its usage: the client asked for it, or the node
/// sends it unasked (`force_usage=1`).
fn usage_in_stream(node: &Node, body: &Value) -> bool {
    node.force_usage
        || body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false)
}

/// A completion answered at once with one token, without the engine: the upstream of the
/// proxy-overhead benchmark, where the node's own time must be as close to nothing as a real
/// HTTP server gets. Same shapes as an engine answer (whole, or the SSE events of a stream).
/// A stream sends the node's `instant_tokens` events, `instant_gap_us` apart (the cost of
/// following a streamed answer).
fn instant(
    node: &Node,
    kind: Kind,
    model: String,
    prompt_tokens: u64,
    body: &Value,
) -> Response<BoxBody> {
    let id = node.next_id.fetch_add(1, Ordering::Relaxed);
    let c = Completion {
        kind,
        id: format!("instant-{}-{id}", node.name),
        created: unix_now(),
        model,
        finish_reason: "length",
        prompt_tokens,
        completion_tokens: 1,
        cached_tokens: 0,
        reasoning_tokens: 0,
        tool_call: false,
        usage_in_stream: usage_in_stream(node, body),
    };
    if !body.get("stream").and_then(Value::as_bool).unwrap_or(false) {
        return json_response(StatusCode::OK, &c.whole(token_text(0)));
    }
    let (tokens, gap_us) = (node.instant_tokens, node.instant_gap_us);
    let mut r = if tokens <= 1 && gap_us == 0 {
        let mut events = c.token_event(0).to_vec();
        for e in c.closing_events() {
            events.extend_from_slice(&e);
        }
        full(StatusCode::OK, "text/event-stream", events)
    } else {
        // Each token event its own chunk, `gap_us` apart, as an engine streams them.
        let c = Completion {
            completion_tokens: tokens,
            ..c
        };
        let (tx, body_rx) = mpsc::channel::<Bytes>(16);
        tokio::spawn(async move {
            let gap = std::time::Duration::from_micros(gap_us);
            for i in 0..tokens {
                if i > 0 && !gap.is_zero() {
                    tokio::time::sleep(gap).await;
                }
                if tx.send(c.token_event(i)).await.is_err() {
                    return;
                }
            }
            for event in c.closing_events() {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        });
        let mut r = Response::new(ChannelBody(body_rx).boxed_unsync());
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        r
    };
    r.headers_mut()
        .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// A response body fed from a channel, so SSE events leave as the engine produces them.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// `GET /metrics` (`prometheus`: `GET /prometheus/metrics`), as the imitated engine serves
/// it: trtllm-serve's `/metrics` is JSON iteration statistics and its Prometheus text is at
/// `/prometheus/metrics`; every other engine's is at `/metrics`. With `metrics_off=1` there is
/// none: llama.cpp started without `--metrics` answers 501, the others have no such route.
/// The engines that serve it through `prometheus_client` honour its `name[]` filter (`query`).
fn metrics(node: &Node, prometheus: bool, query: Option<&str>) -> Response<BoxBody> {
    let trtllm = node.honest() && node.flavour() == Flavour::Trtllm;
    if node.metrics_off {
        if node.honest() && node.flavour() == Flavour::Llamacpp && !prometheus {
            return json_response(
                StatusCode::NOT_IMPLEMENTED,
                &json!({"error": {"code": 501, "type": "not_supported_error",
                    "message": "This server does not support metrics endpoint. Start it with `--metrics`"}}),
            );
        }
        if prometheus || !trtllm {
            return full(
                StatusCode::NOT_FOUND,
                "application/json",
                r#"{"detail":"Not Found"}"#,
            );
        }
    }
    if trtllm && !prometheus {
        return json_response(
            StatusCode::OK,
            &json!([{"iter": 0, "numActiveRequests": 0, "numQueuedRequests": 0,
                     "gpuMemUsage": 0, "cpuMemUsage": 0, "pinnedMemUsage": 0}]),
        );
    }
    let mut text = node.metrics();
    let filters = matches!(
        node.flavour(),
        Flavour::Vllm | Flavour::VllmV0 | Flavour::Sglang | Flavour::Trtllm
    );
    let names = query.map(names_asked).unwrap_or_default();
    if filters && !names.is_empty() {
        text = metrics::filter_by_name(&text, &names);
    }
    node.metrics_requests_total.fetch_add(1, Ordering::Relaxed);
    node.metrics_bytes_total
        .fetch_add(text.len() as u64, Ordering::Relaxed);
    full(
        StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        text,
    )
}

/// The values of a query's `name[]` parameters, percent-decoded (as `parse_qs` reads them).
fn names_asked(query: &str) -> Vec<String> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| percent_decode(k) == "name[]")
        .map(|(_, v)| percent_decode(v))
        .collect()
}

fn percent_decode(s: &str) -> String {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = [bytes.next(), bytes.next()];
                let digit = |d: Option<u8>| d.and_then(|d| (d as char).to_digit(16));
                match (digit(hex[0]), digit(hex[1])) {
                    (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
                    _ => out.extend([b'%'].into_iter().chain(hex.into_iter().flatten())),
                }
            }
            b => out.push(b),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn health(node: &Node) -> Response<BoxBody> {
    node.health_requests_total.fetch_add(1, Ordering::Relaxed);
    let (fail, hang) = {
        let o = lock(&node.overrides);
        (o.fail, o.hang)
    };
    if hang {
        // Hold the connection without ever answering, like a wedged node.
        std::future::pending::<()>().await;
    }
    if fail {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "health endpoint set to fail by /admin/health",
        );
    }
    if !node.honest() {
        return json_response(StatusCode::OK, &node.health());
    }
    // Engines' health says the process is up, nothing about load.
    if node.flavour() == Flavour::Llamacpp {
        return json_response(StatusCode::OK, &json!({"status": "ok"}));
    }
    full(StatusCode::OK, "text/plain; charset=utf-8", "")
}

/// Merges a JSON object into the /health overrides: `fail` and `hang` are switches, any other
/// field replaces the reported one; `{}` or `{"reset": true}` clears everything.
async fn admin_health(node: &Node, req: Request<Incoming>) -> Response<BoxBody> {
    // An empty body counts as `{}`.
    let v = match read_body(req).await {
        Ok(b) if b.iter().all(u8::is_ascii_whitespace) => json!({}),
        Ok(b) => match serde_json::from_slice::<Value>(&b) {
            Ok(v) => v,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    &format!("body is not valid JSON: {e}"),
                )
            }
        },
        Err(r) => return r,
    };
    let Some(obj) = v.as_object() else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "body must be a JSON object",
        );
    };
    let mut o = lock(&node.overrides);
    if obj.is_empty() || obj.get("reset").and_then(Value::as_bool) == Some(true) {
        *o = Overrides::default();
    } else {
        for (k, val) in obj {
            match k.as_str() {
                "fail" => o.fail = val.as_bool().unwrap_or(false),
                "hang" => o.hang = val.as_bool().unwrap_or(false),
                "reset" => {}
                _ => {
                    o.fields.insert(k.clone(), val.clone());
                }
            }
        }
    }
    json_response(StatusCode::OK, &json!({"ok": true}))
}
