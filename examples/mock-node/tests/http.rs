//! Starts the real binary and talks HTTP/1.1 to it over plain TcpStreams (no client library),
//! polling with deadlines rather than sleeping.

// A test crate: failing loudly is the point (the helpers outside #[test] fns need this too).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use mock_gpu_node::tokenize;
use serde_json::Value;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_mock-gpu-node");

/// A running mock-gpu-node process, killed when dropped (also when a test fails).
struct Mock {
    child: Child,
    ports: Vec<u16>,
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Free ports from the OS: bind port 0, read the port, let go (all held at once, so distinct).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// Starts the mock with one `--node PORT,<spec>` per spec and waits for every "listening"
/// line. Retries with other ports if one was taken between choosing and binding it.
fn start(specs: &[&str], extra: &[&str]) -> Mock {
    for _attempt in 0..3 {
        let ports = free_ports(specs.len());
        let mut cmd = Command::new(BIN);
        for (port, spec) in ports.iter().zip(specs) {
            let sep = if spec.is_empty() { "" } else { "," };
            cmd.arg("--node").arg(format!("{port}{sep}{spec}"));
        }
        cmd.args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mock = Mock { child, ports };
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut listening = 0;
        while listening < specs.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with("listening ") => listening += 1,
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("no listening line in 20 s"),
                Err(mpsc::RecvTimeoutError::Disconnected) => break, // exited
            }
        }
        if listening == specs.len() {
            return mock;
        }
        let mut mock = mock;
        let mut err = String::new();
        if let Some(mut e) = mock.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        assert!(err.contains("cannot listen"), "mock exited: {err}");
    }
    panic!("could not find free ports in 3 attempts")
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Arrival time of each chunk of a chunked body.
    chunk_times: Vec<Instant>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive HTTP/1.1 connection.
struct Conn {
    r: BufReader<TcpStream>,
}

impl Conn {
    fn open(port: u16) -> Conn {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Conn {
            r: BufReader::new(s),
        }
    }

    fn send(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) {
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {}\r\n",
            body.len()
        );
        if !body.is_empty() {
            req.push_str("content-type: application/json\r\n");
        }
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        self.r.get_mut().write_all(req.as_bytes()).unwrap();
    }

    fn line(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        if self.r.read_line(&mut l)? == 0 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        Ok(l.trim_end_matches(['\r', '\n']).to_string())
    }

    fn read_response(&mut self) -> std::io::Result<Response> {
        let status_line = self.line()?;
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let mut headers = vec![];
        loop {
            let l = self.line()?;
            if l.is_empty() {
                break;
            }
            let (k, v) = l.split_once(':').unwrap();
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
        let mut resp = Response {
            status,
            headers,
            body: vec![],
            chunk_times: vec![],
        };
        if resp.header("transfer-encoding") == Some("chunked") {
            loop {
                let size = usize::from_str_radix(self.line()?.trim(), 16).unwrap();
                if size == 0 {
                    self.line()?; // the blank line after the last chunk
                    break;
                }
                let mut chunk = vec![0; size];
                self.r.read_exact(&mut chunk)?;
                resp.chunk_times.push(Instant::now());
                resp.body.extend(chunk);
                self.line()?;
            }
        } else {
            let len: usize = resp
                .header("content-length")
                .map_or(0, |v| v.parse().unwrap());
            resp.body = vec![0; len];
            self.r.read_exact(&mut resp.body)?;
        }
        Ok(resp)
    }

    fn call(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
        self.send(method, path, headers, body);
        self.read_response().unwrap()
    }
}

/// The `data:` payloads of an SSE body.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not an SSE data event: {e:?}"))
                .to_string()
        })
        .collect()
}

const PROMPT: &str = "Hello, how are you today?";

/// A chat body; streamed, it asks for the usage (`stream_options.include_usage`).
fn chat_body(max_tokens: u64, stream: bool) -> String {
    let usage = if stream {
        r#","stream_options":{"include_usage":true}"#
    } else {
        ""
    };
    format!(
        r#"{{"model":"m1","stream":{stream},"max_tokens":{max_tokens}{usage},
            "messages":[{{"role":"user","content":"{PROMPT}"}}]}}"#
    )
}

/// As vLLM, SGLang, llama.cpp and OpenAI's API: a chat or text stream ends with its usage
/// only when the client asks for it, or when the node sends it unasked (`force_usage=1`,
/// vLLM's `--enable-force-include-usage`); a whole answer always has it.
#[test]
fn a_stream_carries_its_usage_only_when_asked_or_forced() {
    let mock = start(
        &[
            "name=plain,instant=1",
            "name=forced,instant=1,force_usage=1",
        ],
        &[],
    );
    let usage_events = |port: u16, path: &str, body: &str| -> Vec<Value> {
        let r = Conn::open(port).call("POST", path, &[], body);
        assert_eq!(r.status, 200, "{}", r.text());
        let events = sse_events(&r.text());
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        events
            .iter()
            .filter(|e| e.as_str() != "[DONE]")
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .filter(|v| v.get("usage").is_some())
            .collect()
    };
    let chat = |options: &str| {
        format!(
            r#"{{"model":"m","stream":true,"max_tokens":4{options},"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    let text = r#"{"prompt":"Once","max_tokens":4,"stream":true}"#;
    let asked = r#","stream_options":{"include_usage":true}"#;
    let declined = r#","stream_options":{"include_usage":false}"#;
    let (plain, forced) = (mock.ports[0], mock.ports[1]);
    for (port, path, body, usage) in [
        (plain, "/v1/chat/completions", chat(""), false),
        (plain, "/v1/chat/completions", chat(declined), false),
        (plain, "/v1/chat/completions", chat(asked), true),
        (plain, "/v1/completions", text.to_string(), false),
        (forced, "/v1/chat/completions", chat(""), true),
        (forced, "/v1/completions", text.to_string(), true),
    ] {
        let found = usage_events(port, path, &body);
        assert_eq!(found.len(), usize::from(usage), "{path} {body}: {found:?}");
        if let Some(u) = found.first() {
            assert_eq!(u["choices"], Value::Array(vec![]), "{u}");
            assert_eq!(u["usage"]["completion_tokens"], 1, "{u}");
            assert!(u["usage"]["prompt_tokens"].as_u64() > Some(0), "{u}");
        }
    }
    // A whole answer has its usage whatever was asked.
    let r = Conn::open(plain).call(
        "POST",
        "/v1/chat/completions",
        &[],
        &chat("").replace(r#""stream":true"#, r#""stream":false"#),
    );
    assert!(r.json()["usage"]["prompt_tokens"].as_u64() > Some(0));
}

#[test]
fn completions_on_one_keep_alive_connection() {
    let mock = start(&["name=alpha"], &["--time-scale", "10"]);
    let mut c = Conn::open(mock.ports[0]);
    let prompt_tokens = tokenize::count(PROMPT) + tokenize::PER_MESSAGE;

    // Chat, ended by max_tokens.
    let r = c.call("POST", "/v1/chat/completions", &[], &chat_body(5, false));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-node"), Some("alpha"));
    assert!(r
        .header("endpoint-load-metrics")
        .is_some_and(|v| v.starts_with("TEXT ")));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "m1");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "tok0 tok1 tok2 tok3 tok4 "
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + 5);

    // The benchmark header ends it earlier: a natural stop.
    let r = c.call(
        "POST",
        "/v1/chat/completions",
        &[("x-mock-output-tokens", "2")],
        &chat_body(5, false),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 tok1 ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    // Text completion, default model, array prompt.
    let r = c.call(
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt":["Once upon a time"],"max_tokens":3}"#,
    );
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "mock-model");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 ");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        tokenize::count("Once upon a time")
    );

    // Bad input: OpenAI-style errors, still tagged, and the connection survives.
    for (path, body, status) in [
        ("/v1/chat/completions", "{not json", 400),
        ("/v1/chat/completions", r#"{"messages":"hi"}"#, 400),
        ("/v1/completions", r#"{"max_tokens":3}"#, 400),
        ("/v1/embeddings", "{}", 404),
    ] {
        let r = c.call("POST", path, &[], body);
        assert_eq!(r.status, status, "{path} {body}");
        assert_eq!(r.header("x-mock-node"), Some("alpha"));
        assert_eq!(
            r.json()["error"]["type"],
            "invalid_request_error",
            "{path} {body}"
        );
    }
    let r = c.call("GET", "/v1/models", &[], "");
    assert_eq!(r.json()["data"][0]["id"], "mock-model");

    let stats = c.call("GET", "/admin/stats", &[], "").json();
    assert_eq!(stats["name"], "alpha");
    assert_eq!(stats["requests_total"], 6, "{stats}");
}

#[test]
fn instant_nodes_answer_at_once_without_the_engine() {
    // Real time on an L4: 500 tokens would take seconds through the engine.
    let mock = start(&["name=fast,gpu=l4,instant=1"], &[]);
    let mut c = Conn::open(mock.ports[0]);
    let t0 = Instant::now();
    let r = c.call("POST", "/v1/chat/completions", &[], &chat_body(500, false));
    assert!(
        t0.elapsed() < Duration::from_millis(500),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-mock-node"), Some("fast"));
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "tok0 ");
    assert_eq!(
        v["usage"]["prompt_tokens"],
        tokenize::count(PROMPT) + tokenize::PER_MESSAGE
    );
    assert_eq!(v["usage"]["completion_tokens"], 1);

    // A stream is the same one token as SSE events, ending in [DONE].
    let r = c.call("POST", "/v1/chat/completions", &[], &chat_body(500, true));
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 1 + 3, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));

    // The model check and bad bodies behave as on an engine node; the engine saw nothing.
    let r = c.call("POST", "/v1/chat/completions", &[], "{not json");
    assert_eq!(r.status, 400);
    let h = c.call("GET", "/health", &[], "").json();
    assert_eq!(h["running_requests"], 0, "{h}");
    assert_eq!(h["queue_depth"], 0, "{h}");
}

#[test]
fn streaming_sends_one_event_per_token_as_produced() {
    // Real time: 10 tokens take at least 10 iterations of >= 7.6 ms on an H100.
    let mock = start(&["name=beta,gpu=h100"], &[]);
    let mut c = Conn::open(mock.ports[0]);
    let r = c.call("POST", "/v1/chat/completions", &[], &chat_body(10, true));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-mock-node"), Some("beta"));
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 10 + 3, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..12]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "tok0 ");
    assert_eq!(chunks[9]["choices"][0]["delta"]["content"], "tok9 ");
    assert!(chunks[9]["choices"][0]["delta"].get("role").is_none());
    assert_eq!(chunks[10]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[11]["choices"], Value::Array(vec![]));
    assert_eq!(chunks[11]["usage"]["completion_tokens"], 10);
    // The tokens were not buffered to the end: they came in separate chunks, spread over
    // at least the nine iterations between the first token and the last.
    assert!(r.chunk_times.len() >= 13, "{} chunks", r.chunk_times.len());
    let spread = r.chunk_times[9].duration_since(r.chunk_times[0]);
    assert!(spread >= Duration::from_millis(50), "{spread:?}");

    // Text completions stream the same way, on the same connection.
    let r = c.call(
        "POST",
        "/v1/completions",
        &[("x-mock-output-tokens", "3")],
        r#"{"prompt":"Once upon a time","max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#,
    );
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 3 + 3, "{events:?}");
    let last: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], "tok0 ");
}

#[test]
fn health_metrics_and_test_controls() {
    // Time scale 2: the 1 s load window is half a wall second.
    let mock = start(&["name=gamma,gpu=a100"], &["--time-scale", "2"]);
    let port = mock.ports[0];
    let mut c = Conn::open(port);

    let h = c.call("GET", "/health", &[], "");
    assert_eq!(h.status, 200);
    assert_eq!(h.header("x-mock-node"), Some("gamma"));
    let v = h.json();
    for field in [
        "tokens_per_sec_load",
        "tokens_per_sec_capacity",
        "vram_used_bytes",
        "vram_total_bytes",
        "kv_cache_usage",
        "queue_depth",
        "running_requests",
        "vram_overflow_events",
        "name",
    ] {
        assert!(v.get(field).is_some(), "{field} missing from {v}");
    }
    assert_eq!(v["name"], "gamma");
    assert_eq!(v["vram_total_bytes"], 50_000u64 * 524_288);
    // Capacity is per wall second: twice the model's at --time-scale 2.
    let a100 = 512.0 / (512.0 * 0.063 + 2.0) * 1000.0;
    let cap = v["tokens_per_sec_capacity"].as_f64().unwrap();
    assert!((cap - a100 * 2.0).abs() < 1e-6, "{cap}");

    // Work shows up as load.
    c.call("POST", "/v1/chat/completions", &[], &chat_body(20, false));
    let load = c.call("GET", "/health", &[], "").json()["tokens_per_sec_load"]
        .as_f64()
        .unwrap();
    assert!(load > 0.0, "{load}");

    // Overrides replace fields; the rest stays real.
    let r = c.call(
        "POST",
        "/admin/health",
        &[],
        r#"{"tokens_per_sec_load":1e9,"vram_used_bytes":123}"#,
    );
    assert_eq!((r.status, r.json()["ok"].clone()), (200, Value::Bool(true)));
    let v = c.call("GET", "/health", &[], "").json();
    assert_eq!(v["tokens_per_sec_load"], 1e9);
    assert_eq!(v["vram_used_bytes"], 123);
    assert_eq!(v["name"], "gamma");

    c.call("POST", "/admin/health", &[], r#"{"fail":true}"#);
    let r = c.call("GET", "/health", &[], "");
    assert_eq!(r.status, 503);
    assert_eq!(r.header("x-mock-node"), Some("gamma"));

    // A hanging /health holds the connection without answering.
    c.call("POST", "/admin/health", &[], r#"{"hang":true}"#);
    let mut hung = Conn::open(port);
    hung.r
        .get_ref()
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    hung.send("GET", "/health", &[], "");
    let err = hung
        .read_response()
        .err()
        .expect("a hanging /health answered");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err}"
    );

    c.call("POST", "/admin/health", &[], r#"{"reset":true}"#);
    let v = c.call("GET", "/health", &[], "").json();
    assert_eq!(v["vram_used_bytes"], 0);
    assert!(v["tokens_per_sec_load"].as_f64().unwrap() < 1e9);
    // `{}` clears too.
    c.call("POST", "/admin/health", &[], r#"{"queue_depth":99}"#);
    c.call("POST", "/admin/health", &[], "{}");
    assert_eq!(c.call("GET", "/health", &[], "").json()["queue_depth"], 0);

    let stats = c.call("GET", "/admin/stats", &[], "").json();
    assert_eq!(stats["health_requests_total"], 7, "{stats}");

    // vLLM v1 by default, labelled as vLLM labels them.
    let m = c.call("GET", "/metrics", &[], "").text();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "mock:vram_overflow_events_total",
    ] {
        assert!(m.contains(&format!("# TYPE {name} ")), "{name}: {m}");
        assert!(
            m.contains(&format!(
                "{name}{{engine=\"0\",model_name=\"mock-model\"}} "
            )),
            "{name}: {m}"
        );
    }
    assert!(
        m.contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"mock-model\"} 20.0\n")
    );
    assert!(m.contains("vllm:cache_config_info{block_size=\"16\","));
    assert!(m.contains(
        "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"mock-model\"} 1.0\n"
    ));
}

/// The value of the first sample line `series` (name and labels exactly) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn completion_body(prompt: &str, max_tokens: u64) -> String {
    serde_json::json!({"prompt": prompt, "max_tokens": max_tokens}).to_string()
}

#[test]
fn prefix_cache_hits_show_in_headers_usage_stats_and_metrics() {
    let mock = start(
        &[
            "name=cached,prefix_block=16",
            "name=uncached,prefix_cache_blocks=0",
        ],
        &["--time-scale", "20"],
    );
    // 200 words, then either more of the same text or different words.
    let head: String = (0..200).map(|i| format!("word{i} ")).collect();
    let same = format!("{head}and the same ending");
    let other = format!("{head}but a different tail of text");
    let tokens = tokenize::count(&same);
    let shared = tokenize::count(&head);
    let mut c = Conn::open(mock.ports[0]);

    let hit = |r: &Response| -> u64 {
        r.header("x-mock-prefix-hit-tokens")
            .unwrap()
            .parse()
            .unwrap()
    };
    let r = c.call("POST", "/v1/completions", &[], &completion_body(&same, 2));
    assert_eq!((r.status, hit(&r)), (200, 0), "cold cache");
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    // The same prompt again: every whole block but the last is cached (one token must be
    // computed), and usage says so too.
    let r = c.call("POST", "/v1/completions", &[], &completion_body(&same, 2));
    let full = (tokens - 1) / 16 * 16;
    assert_eq!(hit(&r), full);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        full
    );
    // A shared head: the blocks inside it.
    let r = c.call("POST", "/v1/completions", &[], &completion_body(&other, 2));
    assert_eq!(hit(&r), shared / 16 * 16);
    // A different model (or adapter) has its own cache.
    let body = serde_json::json!({"model": "other", "prompt": same, "max_tokens": 2});
    let r = c.call("POST", "/v1/completions", &[], &body.to_string());
    assert_eq!(hit(&r), 0);
    // A stream reports, in its headers, what the cache held when it arrived, and the
    // exact figure in its final usage.
    let body = serde_json::json!({"prompt": same, "max_tokens": 2, "stream": true,
                                  "stream_options": {"include_usage": true}});
    let r = c.call("POST", "/v1/completions", &[], &body.to_string());
    assert_eq!(hit(&r), full);
    let events = sse_events(&r.text());
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"],
        full
    );

    let stats = c.call("GET", "/admin/stats", &[], "").json();
    let hits = 2 * full + shared / 16 * 16;
    assert_eq!(stats["prefix_cache_hits"], hits, "{stats}");
    assert_eq!(
        stats["prefix_cache_queries"],
        4 * tokens + tokenize::count(&other),
        "{stats}"
    );
    assert_eq!(stats["prefix_block_tokens"], 16);
    assert!(
        stats["prefix_cache_blocks"].as_u64().unwrap() > 0,
        "{stats}"
    );
    let m = c.call("GET", "/metrics", &[], "").text();
    let labels = "{engine=\"0\",model_name=\"mock-model\"}";
    assert_eq!(
        sample(&m, &format!("vllm:prefix_cache_hits_total{labels}")),
        Some(hits as f64)
    );
    // vLLM counts every prompt whole, its cached part included.
    let counted = sample(&m, &format!("vllm:prompt_tokens_total{labels}")).unwrap();
    assert_eq!(counted as u64, 4 * tokens + tokenize::count(&other));
    // llama.cpp's counter is of the tokens computed: only the uncached ones.
    assert_eq!(
        stats["prompt_tokens_computed"],
        4 * tokens + tokenize::count(&other) - hits,
        "{stats}"
    );

    // prefix_cache_blocks=0: no caching at all.
    let mut u = Conn::open(mock.ports[1]);
    for _ in 0..2 {
        let r = u.call("POST", "/v1/completions", &[], &completion_body(&same, 2));
        assert_eq!(hit(&r), 0);
    }
    let stats = u.call("GET", "/admin/stats", &[], "").json();
    assert_eq!(
        (
            stats["prefix_cache_hits"].clone(),
            stats["prefix_cache_queries"].clone()
        ),
        (0.into(), 0.into())
    );
    assert!(u
        .call("GET", "/metrics", &[], "")
        .text()
        .contains("enable_prefix_caching=\"False\""));
}

#[test]
fn served_models_and_lora_adapters() {
    let mock = start(&["name=multi,models=llama|qwen,loras=sql|chat"], &[]);
    let port = mock.ports[0];
    let mut c = Conn::open(port);
    let v = c.call("GET", "/v1/models", &[], "").json();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["llama", "qwen", "sql", "chat"]);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "mock");
    assert_eq!(v["data"][2]["parent"], "llama");

    // Unknown model: OpenAI's 404, before anything else in the body is looked at.
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let r = c.call(
            "POST",
            path,
            &[],
            r#"{"model":"gpt-4","prompt":"hi","messages":[]}"#,
        );
        assert_eq!(r.status, 404, "{path}");
        let e = r.json();
        assert_eq!(e["error"]["type"], "invalid_request_error");
        assert_eq!(e["error"]["code"], "model_not_found");
        assert!(e["error"]["message"].as_str().unwrap().contains("gpt-4"));
    }
    // No model: the first one. A served model or adapter: echoed.
    let r = c.call("POST", "/v1/completions", &[], &completion_body("hi", 1));
    assert_eq!(r.json()["model"], "llama");
    let body = serde_json::json!({"model": "qwen", "prompt": "hi", "max_tokens": 1});
    assert_eq!(
        c.call("POST", "/v1/completions", &[], &body.to_string())
            .json()["model"],
        "qwen"
    );

    // vLLM lists the adapters of running requests: hold a long stream open on "sql".
    let mut stream = Conn::open(port);
    let body = r#"{"model":"sql","prompt":"hi","max_tokens":2000,"stream":true}"#;
    stream.send("POST", "/v1/completions", &[], body);
    let series = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("vllm:lora_requests_info{"))
            .map(String::from)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let running = loop {
        let m = c.call("GET", "/metrics", &[], "").text();
        let line = series(&m).expect("lora_requests_info");
        if line.contains("running_lora_adapters=\"sql\"") || Instant::now() > deadline {
            break line;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(running.starts_with("vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} "), "{running}");
    // The client leaves: the request is aborted and the adapter is no longer running.
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = c.call("GET", "/metrics", &[], "").text();
        let aborted = sample(&m, "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"llama\"}");
        if aborted == Some(1.0) && series(&m).unwrap().contains("running_lora_adapters=\"\"") {
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn metric_flavours_report_the_engine_state_in_their_names() {
    // (flavour, its running-requests series, its prompt-token counter, its KV-use gauge)
    let table = [
        ("vllm", "vllm:num_requests_running{engine=\"0\",model_name=\"m\"}",
         "vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"}",
         "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"}"),
        ("vllm-v0", "vllm:num_requests_running{model_name=\"m\"}",
         "vllm:prompt_tokens_total{model_name=\"m\"}",
         "vllm:gpu_cache_usage_perc{model_name=\"m\"}"),
        ("sglang",
         "sglang:num_running_reqs{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"}",
         "sglang:prompt_tokens_total{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"}",
         "sglang:token_usage{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"}"),
        ("tgi", "tgi_batch_current_size", "tgi_request_input_length_sum", "tgi_batch_current_max_tokens"),
        ("trtllm", "trtllm_num_requests_running{model_name=\"m\",engine_type=\"trtllm\"}",
         "trtllm_prompt_tokens_total{model_name=\"m\",engine_type=\"trtllm\"}",
         "trtllm_kv_cache_utilization{model_name=\"m\",engine_type=\"trtllm\"}"),
        ("llamacpp", "llamacpp:requests_processing", "llamacpp:prompt_tokens_total",
         "llamacpp:kv_cache_usage_ratio"),
    ];
    let specs: Vec<String> = table
        .iter()
        .map(|(f, ..)| format!("name={f},metrics={f},models=m"))
        .collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let mock = start(&specs, &["--time-scale", "20"]);
    let prompt = "Once upon a time there was a mock GPU node.";
    for ((flavour, running, prompt_counter, kv), port) in table.iter().zip(&mock.ports) {
        let mut c = Conn::open(*port);
        // trtllm-serve's Prometheus text is at /prometheus/metrics (its /metrics is JSON).
        let path = if *flavour == "trtllm" {
            "/prometheus/metrics"
        } else {
            "/metrics"
        };
        let scrape = |c: &mut Conn| {
            let r = c.call("GET", path, &[], "");
            assert_eq!(r.status, 200, "{flavour}");
            assert!(r
                .header("content-type")
                .unwrap()
                .starts_with("text/plain; version=0.0.4"));
            r.text()
        };
        let before = scrape(&mut c);
        assert_eq!(sample(&before, running), Some(0.0), "{flavour}: {before}");
        assert_eq!(
            sample(&before, prompt_counter),
            Some(0.0),
            "{flavour}: {before}"
        );
        assert_eq!(sample(&before, kv), Some(0.0), "{flavour}: {before}");
        for line in before.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                line.rsplit_once(' ')
                    .is_some_and(|(_, v)| v == "+Inf" || v.parse::<f64>().is_ok()),
                "{flavour}: {line:?}"
            );
        }
        // A request in flight shows as running (and, but for TGI's max-tokens, as KV use).
        let mut held = Conn::open(*port);
        held.send(
            "POST",
            "/v1/completions",
            &[],
            r#"{"prompt":"hi","max_tokens":3000,"stream":true}"#,
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while sample(&scrape(&mut c), running) != Some(1.0) {
            assert!(Instant::now() < deadline, "{flavour}: never running");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(sample(&scrape(&mut c), kv).unwrap() > 0.0, "{flavour}");
        drop(held);
        let r = c.call("POST", "/v1/completions", &[], &completion_body(prompt, 4));
        assert_eq!(r.status, 200);
        // Counters only grow; the finished request's prompt is in them.
        let after = scrape(&mut c);
        let (b, a) = (
            sample(&before, prompt_counter).unwrap(),
            sample(&after, prompt_counter).unwrap(),
        );
        assert!(
            a >= b + tokenize::count(prompt) as f64,
            "{flavour}: {b} -> {a}"
        );
        for line in before
            .lines()
            .filter(|l| l.starts_with("# TYPE ") && l.ends_with(" counter"))
        {
            let name = line.split(' ').nth(2).unwrap();
            for sample_line in before
                .lines()
                .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            {
                let (series, v) = sample_line.rsplit_once(' ').unwrap();
                let v: f64 = v.parse().unwrap();
                let now =
                    sample(&after, series).unwrap_or_else(|| panic!("{flavour}: {series} gone"));
                assert!(now >= v, "{flavour}: {series} went from {v} to {now}");
            }
        }
        // /health answers as the engine does: an empty 200, llama.cpp's {"status":"ok"}.
        let h = c.call("GET", "/health", &[], "");
        assert_eq!(h.status, 200, "{flavour}");
        if *flavour == "llamacpp" {
            assert_eq!(h.json(), serde_json::json!({"status": "ok"}));
        } else {
            assert_eq!(h.text(), "", "{flavour}");
        }
    }
}

/// Each engine flavour, once named, answers /health, its model list and model names as that
/// engine does; `health=json` keeps the seed report; `metrics_off=1` is an engine started
/// without its metrics.
#[test]
fn engine_flavours_answer_health_and_models_as_their_engines() {
    let mock = start(
        &[
            "name=v,metrics=vllm",
            "name=s,metrics=sglang",
            "name=t,metrics=trtllm",
            "name=l,metrics=llamacpp,n_ctx=64",
            "name=la,metrics=llamacpp,models=zeta|alpha",
            "name=j,metrics=llamacpp,health=json",
            "name=off,metrics=llamacpp,metrics_off=1",
            "name=soff,metrics=sglang,metrics_off=1",
        ],
        &[],
    );
    let conn = |i: usize| Conn::open(mock.ports[i]);
    // The seed report stays available, with its engine's metrics.
    let j = conn(5).call("GET", "/health", &[], "").json();
    assert_eq!(j["name"], "j");
    // trtllm-serve: JSON iteration stats at /metrics, Prometheus text elsewhere.
    let t = conn(2).call("GET", "/metrics", &[], "");
    assert!(t.json().is_array(), "{}", t.text());
    let t = conn(2).call("GET", "/prometheus/metrics", &[], "");
    assert!(t.text().contains("trtllm_num_requests_running"));
    // Without metrics: llama.cpp's 501, another engine's missing route.
    let off = conn(6).call("GET", "/metrics", &[], "");
    assert_eq!(off.status, 501);
    assert!(off.text().contains("--metrics"));
    assert_eq!(conn(7).call("GET", "/metrics", &[], "").status, 404);
    // Only trtllm-serve has /prometheus/metrics.
    assert_eq!(
        conn(3).call("GET", "/prometheus/metrics", &[], "").status,
        404
    );
    // llama.cpp lists its model file (or its first alias in sorted order) with n_ctx.
    let l = conn(3).call("GET", "/v1/models", &[], "").json();
    assert_eq!(l["data"][0]["id"], "/models/mock-model.Q4_1.gguf");
    assert_eq!(l["data"][0]["meta"]["n_ctx"], 64);
    assert_eq!(l["data"][0]["owned_by"], "llamacpp");
    let la = conn(4).call("GET", "/v1/models", &[], "").json();
    assert_eq!(la["data"][0]["id"], "alpha");
    assert_eq!(
        la["data"][0]["aliases"],
        serde_json::json!(["alpha", "zeta"])
    );
    // Any name is served, but by vLLM; llama.cpp answers with its own name.
    let ask = |i: usize, model: &str| {
        let body = format!(
            r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
        );
        conn(i).call("POST", "/v1/chat/completions", &[], &body)
    };
    assert_eq!(ask(0, "gpt-4o").status, 404);
    assert_eq!(ask(0, "mock-model").status, 200);
    assert_eq!(ask(1, "gpt-4o").status, 200);
    assert_eq!(ask(2, "gpt-4o").status, 200);
    let r = ask(3, "gpt-4o");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["model"], "/models/mock-model.Q4_1.gguf");
    // A prompt over llama.cpp's per-slot context is refused before any work.
    let long = "word ".repeat(100);
    let body = format!(r#"{{"messages":[{{"role":"user","content":"{long}"}}],"max_tokens":2}}"#);
    let r = conn(3).call("POST", "/v1/chat/completions", &[], &body);
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "exceed_context_size_error");
}

/// POST /admin/health's queue, running and KV overrides reach /metrics too, in the engine's
/// own names, and a reset gives the engine's values back.
#[test]
fn metrics_follow_the_gauge_overrides() {
    let table = [
        ("sglang", "sglang:num_queue_reqs{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"}",
         "sglang:token_usage{engine_type=\"unified\",model_name=\"m\",pp_rank=\"0\",tp_rank=\"0\"}", 0.95),
        ("tgi", "tgi_queue_size", "tgi_batch_current_max_tokens", 0.95 * 20_000.0),
        ("vllm", "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"}",
         "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"}", 0.95),
    ];
    let specs: Vec<String> = table
        .iter()
        .map(|(f, ..)| format!("name={f},metrics={f},models=m,kv_tokens=20000,health=json"))
        .collect();
    let specs: Vec<&str> = specs.iter().map(String::as_str).collect();
    let mock = start(&specs, &[]);
    for ((flavour, waiting, kv, want_kv), port) in table.iter().zip(&mock.ports) {
        let mut c = Conn::open(*port);
        let metrics = |c: &mut Conn| c.call("GET", "/metrics", &[], "").text();
        let before = metrics(&mut c);
        assert_eq!(sample(&before, waiting), Some(0.0), "{flavour}: {before}");
        let r = c.call(
            "POST",
            "/admin/health",
            &[],
            r#"{"queue_depth":42,"kv_cache_usage":0.95}"#,
        );
        assert_eq!(r.status, 200);
        let after = metrics(&mut c);
        assert_eq!(sample(&after, waiting), Some(42.0), "{flavour}: {after}");
        assert_eq!(sample(&after, kv), Some(*want_kv), "{flavour}: {after}");
        // The same override in the seed /health.
        let h = c.call("GET", "/health", &[], "").json();
        assert_eq!(
            (h["queue_depth"].as_f64(), h["kv_cache_usage"].as_f64()),
            (Some(42.0), Some(0.95))
        );
        c.call("POST", "/admin/health", &[], r#"{"reset":true}"#);
        let reset = metrics(&mut c);
        assert_eq!(sample(&reset, waiting), Some(0.0), "{flavour}: {reset}");
        assert_eq!(sample(&reset, kv), Some(0.0), "{flavour}: {reset}");
    }
}

#[test]
fn one_process_serves_several_nodes() {
    let mock = start(&["name=fast,gpu=h100", "name=slow,gpu=l4"], &[]);
    let caps: Vec<f64> = mock
        .ports
        .iter()
        .zip(["fast", "slow"])
        .map(|(port, name)| {
            let r = Conn::open(*port).call("GET", "/health", &[], "");
            assert_eq!(r.header("x-mock-node"), Some(name));
            r.json()["tokens_per_sec_capacity"].as_f64().unwrap()
        })
        .collect();
    assert!(caps[0] > caps[1], "{caps:?}");
}

#[test]
fn bad_command_lines_are_explained() {
    for (args, needle) in [
        (vec![], "at least one --node"),
        (vec!["--node", "1,gpu=tpu"], "unknown gpu"),
        (vec!["--node", "1", "--time-scale", "-3"], "positive number"),
        (vec!["--node", "1,metrics=openmetrics"], "unknown metrics"),
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for key in [
        "--time-scale",
        "prefix_block=",
        "prefix_cache_blocks=",
        "metrics=",
        "models=",
        "loras=",
    ] {
        assert!(help.contains(key), "{key} missing from --help");
    }
}

/// The named events of a Responses API stream, `(event, data)`.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named SSE event: {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

/// The named events of a 200 event stream answered to `body` posted to `path`.
fn named_stream(c: &mut Conn, path: &str, body: &str) -> Vec<(String, Value)> {
    let r = c.call("POST", path, &[], body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    named_events(&r.text())
}

fn event_names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// OpenAI's Responses API: the prompt from `instructions` and `input` as the chat they stand
/// for, the cap from `max_output_tokens`; streamed as `response.created`, one `"delta"` event
/// per token (thinking first with `reasoning`), the whole answer once more and
/// `response.completed` with the usage; whole, a `response` object.
#[test]
fn the_responses_api_is_served_as_engines_serve_it() {
    let mock = start(&["name=gamma,reasoning=0.5"], &["--time-scale", "10"]);
    let mut c = Conn::open(mock.ports[0]);
    let body = r#"{"model":"m1","stream":true,"max_output_tokens":4,"instructions":"Be brief.",
        "input":[{"role":"user","content":[{"type":"input_text","text":"Hello, how are you today?"}]}]}"#;
    let events = named_stream(&mut c, "/v1/responses", body);
    assert_eq!(
        event_names(&events),
        [
            "response.created",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_item.done",
            "response.completed"
        ]
    );
    assert_eq!(events[1].1["delta"], "tok0 ");
    assert_eq!(events[4].1["delta"], "tok3 ");
    assert_eq!(
        events[5].1["item"]["content"][0]["text"], "tok2 tok3 ",
        "the answer, without the thinking"
    );
    let usage = &events[6].1["response"]["usage"];
    assert_eq!(usage["output_tokens"], 4);
    // Instructions (4 + 4) and the message (4 + 9), as the chat body would count.
    assert_eq!(usage["input_tokens"], 21);

    let r = c.call(
        "POST",
        "/v1/responses",
        &[("x-mock-output-tokens", "2")],
        r#"{"input":"Hello, how are you today?","max_output_tokens":8}"#,
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["output"][0]["content"][0]["text"], "tok0 tok1 ");
    assert_eq!(v["usage"]["output_tokens"], 2);
    assert_eq!(v["usage"]["input_tokens"], 13);
    let r = c.call("POST", "/v1/responses", &[], r#"{"input":7}"#);
    assert_eq!(r.status, 400);
}

/// Stored answers, as vLLM keeps them with `VLLM_ENABLE_RESPONSES_API_STORE`: each node keeps
/// its own; a turn naming one (`previous_response_id`) is served with the stored conversation
/// ahead of its input on that node and refused (404) on another, and so is its `GET`.
#[test]
fn stored_answers_are_kept_by_the_node_that_answered_them() {
    let mock = start(&["name=one", "name=two"], &["--time-scale", "10"]);
    let (mut one, mut two) = (Conn::open(mock.ports[0]), Conn::open(mock.ports[1]));
    let first = r#"{"input":"Hello, how are you today?","max_output_tokens":8}"#;
    let r = one.call(
        "POST",
        "/v1/responses",
        &[("x-mock-output-tokens", "5")],
        first,
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["usage"]["input_tokens"], 13);
    let next = format!(r#"{{"input":"And then?","previous_response_id":"{id}","store":false}}"#);
    let r = one.call(
        "POST",
        "/v1/responses",
        &[("x-mock-output-tokens", "2")],
        &next,
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    // The stored 13 + 5, then its own message (4 + 4).
    assert_eq!(v["usage"]["input_tokens"], 26);
    let not_kept = v["id"].as_str().unwrap().to_string();
    let r = two.call("POST", "/v1/responses", &[], &next);
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]["message"].as_str().unwrap().contains(&id));
    let path = format!("/v1/responses/{id}");
    assert_eq!(one.call("GET", &path, &[], "").json()["id"], id.as_str());
    assert_eq!(two.call("GET", &path, &[], "").status, 404);
    // `store: false` kept nothing.
    let path = format!("/v1/responses/{not_kept}");
    assert_eq!(one.call("GET", &path, &[], "").status, 404);
}

/// SGLang's native `/generate`: the prompt as `text` or `input_ids`, the cap from
/// `sampling_params.max_new_tokens`; streamed as one event per token with `meta_info` counting
/// the tokens so far (the last with its finish reason), then `[DONE]`; whole, one object.
#[test]
fn the_native_generate_endpoint_is_served_as_sglang_serves_it() {
    let mock = start(&["name=delta"], &["--time-scale", "10"]);
    let mut c = Conn::open(mock.ports[0]);
    let body =
        r#"{"text":"Once upon a time","sampling_params":{"max_new_tokens":3},"stream":true}"#;
    let r = c.call("POST", "/generate", &[], body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 3 + 1, "{events:?}");
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..3]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["text"], "tok0 ");
    assert_eq!(chunks[0]["meta_info"]["completion_tokens"], 1);
    assert_eq!(chunks[0]["meta_info"]["finish_reason"], Value::Null);
    assert_eq!(chunks[0]["meta_info"]["prompt_tokens"], 6);
    assert_eq!(chunks[2]["meta_info"]["completion_tokens"], 3);
    assert_eq!(chunks[2]["meta_info"]["finish_reason"]["type"], "length");

    let r = c.call(
        "POST",
        "/generate",
        &[("x-mock-output-tokens", "2")],
        r#"{"input_ids":[1,2,3,4,5],"sampling_params":{"max_new_tokens":8}}"#,
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["text"], "tok0 tok1 ");
    assert_eq!(v["meta_info"]["prompt_tokens"], 5);
    assert_eq!(v["meta_info"]["completion_tokens"], 2);
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "stop");
    let r = c.call("POST", "/generate", &[], r#"{"prompt":"no"}"#);
    assert_eq!(r.status, 400);
}

/// Anthropic's Messages API: the prompt from `system` and the content blocks as the chat they
/// stand for, the cap from `max_tokens`; streamed as `message_start`, a thinking block then a
/// text block (`content_block_start`, one `content_block_delta` a token, `content_block_stop`),
/// `message_delta` with the output count and `message_stop`; whole, a `message` object.
#[test]
fn the_messages_api_is_served_as_engines_serve_it() {
    let mock = start(&["name=eps,reasoning=0.5"], &["--time-scale", "10"]);
    let mut c = Conn::open(mock.ports[0]);
    let body = r#"{"model":"m1","stream":true,"max_tokens":4,"system":"Be brief.",
        "messages":[{"role":"user","content":[{"type":"text","text":"Hello, how are you today?"}]}]}"#;
    let events = named_stream(&mut c, "/v1/messages", body);
    assert_eq!(
        event_names(&events),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    // System (4 + 4) and the message (4 + 9), as the chat body would count.
    assert_eq!(events[0].1["message"]["usage"]["input_tokens"], 21);
    assert_eq!(events[2].1["delta"]["thinking"], "tok0 ");
    assert_eq!(events[5].1["content_block"]["type"], "text");
    assert_eq!(events[7].1["delta"]["text"], "tok3 ");
    assert_eq!(events[9].1["usage"]["output_tokens"], 4);
    assert_eq!(events[9].1["delta"]["stop_reason"], "max_tokens");

    let r = c.call(
        "POST",
        "/v1/messages",
        &[("x-mock-output-tokens", "2")],
        r#"{"max_tokens":8,"messages":[{"role":"user","content":"Hello, how are you today?"}]}"#,
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["text"], "tok0 tok1 ");
    assert_eq!(v["usage"]["output_tokens"], 2);
    assert_eq!(v["stop_reason"], "end_turn");
    let r = c.call("POST", "/v1/messages", &[], r#"{"max_tokens":8}"#);
    assert_eq!(r.status, 400);
}
