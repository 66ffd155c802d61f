//! Finding a node's telemetry when only its address is configured.
//!
//! A node whose `health_path` is not configured is polled first at `/health`, the path of the
//! simple JSON health format. Real inference engines answer there too, but not with their
//! load: vLLM, SGLang, TGI and trtllm-serve answer an empty 200, llama.cpp `{"status":"ok"}`.
//! Their load is in their Prometheus metrics, at `/metrics` (trtllm-serve: at
//! `/prometheus/metrics`; its `/metrics` is JSON iteration statistics). Polling `/health` for
//! ever would leave every such node without a report, and every request would go to Envoy's
//! own balancer; so when the health path answers something that is not telemetry, the metrics
//! paths are tried, in order, and the first one that answers telemetry is kept for the node.
//!
//! The rule, per node (`Probe`, fed one classified answer at a time, `Seen`):
//!
//! - On the health path, telemetry (the simple JSON format or an engine's metrics, even with a
//!   bad value this time) settles the node there: nothing to say. An answer that is not
//!   telemetry (a 200 that is empty, JSON that is not the health format, text without a known
//!   engine's metrics) or a 404 sends the next poll to the first metrics path at once. Any
//!   other failure (no answer, another status, an answer over the limit) is a failed poll as
//!   it always was: a node that is down is down, not "without telemetry".
//! - On a metrics path, telemetry settles the node there: the caller says so once (`Found`).
//!   A status (404, llama.cpp's 501 without `--metrics`), an answer over the limit or one
//!   that is not telemetry moves on to the next path; after the last, nothing was found
//!   (`NotFound`), which the caller reports loudly, with what each path answered. No answer,
//!   or 502/503/504 (Envoy's own answer for a refused connection or a timeout, an engine that
//!   is loading), means the node went away meanwhile: a failed poll, and the discovery starts
//!   again at the health path.
//! - A settled node keeps its path: its failures are failed polls, as for a configured path.
//! - A node without telemetry is polled at the health path (its answers are failed polls, so
//!   it stays out of the choice) and the metrics paths are tried again every `RETRY_MS`, so
//!   an engine restarted with its metrics on is found without touching the configuration.
//!
//! Asking for less (`filter_metrics`, on by default). vLLM, SGLang and trtllm-serve render
//! `/metrics` with the Python `prometheus_client`, which returns only the samples named by
//! `name[]` query parameters when any are given. Their pages run to tens of kilobytes (every
//! latency histogram, per-route HTTP metrics, the process's own), of which the balancer reads
//! about ten lines; every byte is copied through Envoy into the VM and scanned on every tick. So
//! once a path answers such an engine's metrics (found, or configured), the next polls add the
//! engine's names (`Engine::names_read`, percent-encoded) to that path. An answer to the
//! filtered path that shows the query was not honoured (not telemetry, a 4xx, over the limit)
//! turns filtering off for the node for good (`Step::Unfiltered`) and the whole page is asked at
//! once; a node that is down is down, filtered or not. A configured path that already has a
//! query is never changed.
//!
//! A configured `health_path` is used as it is: no discovery. A configured `format` still
//! decides how every answer is read (so `format: vllm` finds only vLLM's metrics). The probe
//! costs nothing per request: it runs on the poll path only, where the polling happens (each
//! VM with `poller: vm`, the poller service with `poller: singleton`).

use crate::config::DEFAULT_HEALTH_PATH;
use crate::ingest::engine::{Engine, FormatError, Health};
use crate::ingest::telemetry::ReportError;
use std::fmt;

/// The metrics paths tried, in order, after the health path answered no telemetry.
pub const METRICS_PATHS: [&str; 2] = ["/metrics", "/prometheus/metrics"];

/// How long a node without telemetry waits before its metrics paths are tried again.
pub const RETRY_MS: u64 = 30_000;

/// What one poll of a path brought, as discovery tells it apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// No answer, or 502, 503 or 504: the node (or Envoy, for it) says it is not there now.
    Down,
    /// Another status than 200.
    Status(u16),
    /// A 200 over the read limit.
    TooLarge,
    /// Telemetry: the simple JSON health format (`None`) or an engine's metrics, read or not.
    Telemetry(Option<Engine>),
    /// A 200 that is not telemetry, and what it is.
    NotTelemetry(Other),
}

/// A 200 answer that is not telemetry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Other {
    /// An empty body (vLLM, SGLang, TGI, trtllm-serve's `/health`).
    Empty,
    /// A JSON object without `tokens_per_sec_load` (llama.cpp's `{"status":"ok"}`).
    JsonNotHealth,
    /// A JSON object where an engine's metrics were configured (`format`).
    JsonNotMetrics(Engine),
    /// Neither JSON nor Prometheus text (trtllm-serve's JSON array, a web page).
    Unreadable,
    /// Prometheus text without a known engine's metrics.
    UnknownMetrics,
}

impl fmt::Display for Other {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Other::Empty => f.write_str("an empty 200"),
            Other::JsonNotHealth => f.write_str("JSON that is not the health format"),
            Other::JsonNotMetrics(e) => write!(f, "JSON, not {e} metrics"),
            Other::Unreadable => f.write_str("neither the health format nor Prometheus text"),
            Other::UnknownMetrics => f.write_str("Prometheus text of no known engine"),
        }
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Seen::Down => f.write_str("no answer"),
            Seen::Status(s) => write!(f, "status {s}"),
            Seen::TooLarge => f.write_str("an answer over the read limit"),
            Seen::Telemetry(None) => f.write_str("the health format"),
            Seen::Telemetry(Some(e)) => write!(f, "{e} metrics"),
            Seen::NotTelemetry(o) => o.fmt(f),
        }
    }
}

impl Seen {
    /// A status other than 200 (none: no answer at all).
    pub fn of_status(status: Option<&str>) -> Seen {
        match status.and_then(|s| s.parse::<u16>().ok()) {
            None | Some(502..=504) => Seen::Down,
            Some(s) => Seen::Status(s),
        }
    }

    /// A 200 body as the node's format read it.
    pub fn of_read(read: &Result<Health, FormatError>) -> Seen {
        match read {
            Ok(Health::Seed(_)) | Err(FormatError::Seed(ReportError::BadLoad)) => {
                Seen::Telemetry(None)
            }
            Ok(Health::Engine(s)) => Seen::Telemetry(Some(s.engine)),
            Err(FormatError::NothingUsable { engine, .. }) => Seen::Telemetry(Some(*engine)),
            Err(FormatError::Empty) => Seen::NotTelemetry(Other::Empty),
            Err(FormatError::Seed(ReportError::MissingLoad)) => {
                Seen::NotTelemetry(Other::JsonNotHealth)
            }
            Err(FormatError::JsonNotMetrics(e)) => Seen::NotTelemetry(Other::JsonNotMetrics(*e)),
            Err(FormatError::Seed(ReportError::NotJson) | FormatError::NotMetrics { .. }) => {
                Seen::NotTelemetry(Other::Unreadable)
            }
            Err(FormatError::UnknownEngine { .. }) => Seen::NotTelemetry(Other::UnknownMetrics),
        }
    }
}

/// What the caller does with an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A health poll: a report, or a failed poll, as for any node.
    Poll,
    /// Not a poll: ask the next path (`Probe::path`) now.
    Next,
    /// Not a poll: the filtered path answered this, so the node does not honour `name[]`
    /// filters; ask its whole page (`Probe::path`) now, and from now on.
    Unfiltered(Seen),
    /// A metrics path answered telemetry: a health poll, and the node's telemetry is found
    /// there (`announce`: the first time for this node, or after it was lost).
    Found(Discovery),
    /// No path answered telemetry: the caller reports it (`announce`: the first time), and
    /// the node is polled at its health path until the next try.
    NotFound(Discovery),
}

impl Step {
    /// Whether the caller asks the node's path (`Probe::path`) again at once: not a poll, and
    /// not a finding (`Next`, `Unfiltered`).
    pub fn asks_again(&self) -> bool {
        matches!(self, Step::Next | Step::Unfiltered(_))
    }
}

/// What discovery found for a node, and whether to say so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    /// Each path asked and what it answered, in order.
    pub tried: Vec<(&'static str, Seen)>,
    /// The first time this outcome is reached for the node (once per node, not per retry).
    pub announce: bool,
}

impl Discovery {
    /// The path kept and the engine found there (the last one tried), for `Found`.
    pub fn found(&self) -> Option<(&'static str, Option<Engine>)> {
        match self.tried.last() {
            Some((path, Seen::Telemetry(engine))) => Some((path, *engine)),
            _ => None,
        }
    }

    /// What the health path answered.
    pub fn health_said(&self) -> Option<Seen> {
        self.tried.first().map(|(_, seen)| *seen)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Polling the health path, not settled yet.
    Start,
    /// Trying `METRICS_PATHS[i]`.
    Trying(usize),
    /// Telemetry is at the health path (`None`) or at `METRICS_PATHS[i]`.
    Settled(Option<usize>),
    /// Nothing found; tried again from `retry_at_ms`.
    NotFound { retry_at_ms: u64 },
}

/// What was last announced for a node, so each outcome is said once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    Found(usize),
    NotFound,
}

/// One node's discovery (see the module comment).
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// The configured `health_path`: polled as it is, never probed.
    fixed: Option<String>,
    state: State,
    /// What the paths of the discovery under way answered.
    tried: Vec<(&'static str, Seen)>,
    said: Option<Said>,
    /// Whether filtered polls may be tried (`filter_metrics`), and were not refused.
    may_filter: bool,
    /// The settled path with the engine's `name[]` query, polled instead of it.
    filtered: Option<String>,
}

impl Probe {
    /// A node's probe: `health_path` is the configured one, if any; `filter_metrics` whether
    /// an engine that filters by name is asked for the samples read alone.
    pub fn new(health_path: Option<&str>, filter_metrics: bool) -> Probe {
        Probe {
            fixed: health_path.map(str::to_string),
            state: State::Start,
            tried: Vec::new(),
            said: None,
            may_filter: filter_metrics,
            filtered: None,
        }
    }

    /// Whether polls ask for the samples read alone now.
    pub fn filtered(&self) -> bool {
        self.filtered.is_some()
    }

    /// Whether the node's telemetry is looked for (no `health_path` configured).
    pub fn discovers(&self) -> bool {
        self.fixed.is_none()
    }

    /// Whether the node is without telemetry (nothing found at its last try).
    pub fn not_found(&self) -> bool {
        matches!(self.state, State::NotFound { .. })
    }

    /// The path to poll now.
    pub fn path(&self) -> &str {
        if let Some(p) = &self.filtered {
            return p;
        }
        self.whole_path()
    }

    /// The path to poll now, without a filter.
    fn whole_path(&self) -> &str {
        if let Some(p) = &self.fixed {
            return p;
        }
        match self.state {
            State::Trying(i) | State::Settled(Some(i)) => {
                METRICS_PATHS.get(i).copied().unwrap_or(DEFAULT_HEALTH_PATH)
            }
            State::Start | State::Settled(None) | State::NotFound { .. } => DEFAULT_HEALTH_PATH,
        }
    }

    /// The answer to a poll of `path()`, at `now_ms`. A node without telemetry is looked for
    /// again by its first answer once `RETRY_MS` has passed.
    pub fn on_answer(&mut self, seen: Seen, now_ms: u64) -> Step {
        if self.filtered.is_some() {
            // Only a settled path is filtered, and a settled path stays: this is a poll,
            // unless the answer says the filter was not understood.
            return match seen {
                Seen::NotTelemetry(_) | Seen::TooLarge | Seen::Status(400..=499) => {
                    self.filtered = None;
                    self.may_filter = false;
                    Step::Unfiltered(seen)
                }
                Seen::Telemetry(_) | Seen::Down | Seen::Status(_) => Step::Poll,
            };
        }
        let step = self.on_whole_answer(seen, now_ms);
        if let (true, Seen::Telemetry(Some(engine))) = (self.may_filter, seen) {
            if engine.filters_by_name() && self.settled() {
                self.filtered = filtered_path(self.whole_path(), engine);
            }
        }
        step
    }

    /// Whether the path polled is the node's telemetry for good: configured, or found.
    fn settled(&self) -> bool {
        self.fixed.is_some() || matches!(self.state, State::Settled(_))
    }

    /// `on_answer` for an unfiltered path.
    fn on_whole_answer(&mut self, seen: Seen, now_ms: u64) -> Step {
        if self.fixed.is_some() {
            return Step::Poll;
        }
        let state = match self.state {
            State::NotFound { retry_at_ms } if now_ms >= retry_at_ms => State::Start,
            state => state,
        };
        match state {
            State::Settled(_) => Step::Poll,
            State::NotFound { .. } => {
                // Telemetry at the health path after all: kept there.
                if let Seen::Telemetry(_) = seen {
                    self.state = State::Settled(None);
                }
                Step::Poll
            }
            State::Start => match seen {
                Seen::Telemetry(_) => {
                    self.state = State::Settled(None);
                    self.tried.clear();
                    Step::Poll
                }
                Seen::NotTelemetry(_) | Seen::Status(404) => {
                    self.tried.clear();
                    self.tried.push((DEFAULT_HEALTH_PATH, seen));
                    self.state = State::Trying(0);
                    Step::Next
                }
                Seen::Down | Seen::Status(_) | Seen::TooLarge => {
                    self.state = state;
                    Step::Poll
                }
            },
            State::Trying(i) => {
                let path = METRICS_PATHS.get(i).copied().unwrap_or(DEFAULT_HEALTH_PATH);
                match seen {
                    Seen::Down => {
                        self.state = State::Start;
                        self.tried.clear();
                        Step::Poll
                    }
                    Seen::Telemetry(_) => {
                        self.tried.push((path, seen));
                        self.state = State::Settled(Some(i));
                        let announce = self.said != Some(Said::Found(i));
                        self.said = Some(Said::Found(i));
                        Step::Found(Discovery {
                            tried: std::mem::take(&mut self.tried),
                            announce,
                        })
                    }
                    Seen::Status(_) | Seen::TooLarge | Seen::NotTelemetry(_) => {
                        self.tried.push((path, seen));
                        if i + 1 < METRICS_PATHS.len() {
                            self.state = State::Trying(i + 1);
                            return Step::Next;
                        }
                        self.state = State::NotFound {
                            retry_at_ms: now_ms.saturating_add(RETRY_MS),
                        };
                        let announce = self.said != Some(Said::NotFound);
                        self.said = Some(Said::NotFound);
                        Step::NotFound(Discovery {
                            tried: std::mem::take(&mut self.tried),
                            announce,
                        })
                    }
                }
            }
        }
    }
}

/// `path` asking for `engine`'s samples read alone (`name[]=` for each, percent-encoded as a
/// query must be), or `None` when the path already carries a query.
fn filtered_path(path: &str, engine: Engine) -> Option<String> {
    if path.contains('?') {
        return None;
    }
    let mut out = String::with_capacity(path.len() + 48 * 12);
    out.push_str(path);
    for (i, name) in engine.names_read().enumerate() {
        out.push(if i == 0 { '?' } else { '&' });
        out.push_str("name%5B%5D=");
        for c in name.chars() {
            match c {
                ':' => out.push_str("%3A"),
                c => out.push(c),
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::engine::{read, HealthFormat};

    const EMPTY: Seen = Seen::NotTelemetry(Other::Empty);
    const STATUS_OK: Seen = Seen::NotTelemetry(Other::JsonNotHealth);
    const JSON_ARRAY: Seen = Seen::NotTelemetry(Other::Unreadable);
    const SEED: Seen = Seen::Telemetry(None);
    const LLAMACPP: Seen = Seen::Telemetry(Some(Engine::LlamaCpp));
    const TRTLLM: Seen = Seen::Telemetry(Some(Engine::Trtllm));

    /// What `step` a test expects, without the details of a discovery.
    #[derive(Debug, PartialEq)]
    enum S {
        Poll,
        Next,
        Found(bool),
        NotFound(bool),
        Unfiltered,
    }

    fn short(step: &Step) -> S {
        match step {
            Step::Poll => S::Poll,
            Step::Next => S::Next,
            Step::Unfiltered(_) => S::Unfiltered,
            Step::Found(d) => S::Found(d.announce),
            Step::NotFound(d) => S::NotFound(d.announce),
        }
    }

    /// One poll: the path polled, its answer, the step expected.
    type Polled = (&'static str, Seen, S);

    /// (case, [(path polled, answer, step)]): each engine's answers, in order, from a node
    /// configured by its address only.
    #[test]
    fn discovery_table() {
        use S::*;
        let cases: Vec<(&str, Vec<Polled>)> = vec![
            (
                "the simple JSON format at /health: settled there, nothing said",
                vec![("/health", SEED, Poll), ("/health", SEED, Poll)],
            ),
            (
                "a node settled at /health stays there: a bad answer later is a failed poll",
                vec![
                    ("/health", SEED, Poll),
                    ("/health", EMPTY, Poll),
                    ("/health", Seen::Status(404), Poll),
                    ("/health", SEED, Poll),
                ],
            ),
            (
                "vLLM, SGLang, TGI: an empty /health, the metrics at /metrics",
                vec![
                    ("/health", EMPTY, Next),
                    ("/metrics", Seen::Telemetry(Some(Engine::Vllm)), Found(true)),
                    ("/metrics", Seen::Telemetry(Some(Engine::Vllm)), Poll),
                    ("/metrics", Seen::Down, Poll),
                    ("/metrics", Seen::Status(501), Poll),
                ],
            ),
            (
                "llama.cpp with --metrics",
                vec![
                    ("/health", STATUS_OK, Next),
                    ("/metrics", LLAMACPP, Found(true)),
                    ("/metrics", LLAMACPP, Poll),
                ],
            ),
            (
                "trtllm-serve: /metrics is JSON statistics, Prometheus text further",
                vec![
                    ("/health", EMPTY, Next),
                    ("/metrics", JSON_ARRAY, Next),
                    ("/prometheus/metrics", TRTLLM, Found(true)),
                    ("/prometheus/metrics", TRTLLM, Poll),
                ],
            ),
            (
                "llama.cpp without --metrics: not found, said once, tried again later",
                vec![
                    ("/health", STATUS_OK, Next),
                    ("/metrics", Seen::Status(501), Next),
                    ("/prometheus/metrics", Seen::Status(404), NotFound(true)),
                    // Until the retry: polled at /health, failed polls as always.
                    ("/health", STATUS_OK, Poll),
                    ("/health", Seen::Down, Poll),
                ],
            ),
            (
                "a node down from the start is down, never without telemetry",
                vec![
                    ("/health", Seen::Down, Poll),
                    ("/health", Seen::Status(500), Poll),
                    ("/health", Seen::TooLarge, Poll),
                    ("/health", Seen::Down, Poll),
                ],
            ),
            (
                "a node that goes away during discovery starts again at /health",
                vec![
                    ("/health", EMPTY, Next),
                    ("/metrics", Seen::Down, Poll),
                    ("/health", Seen::Down, Poll),
                    ("/health", EMPTY, Next),
                    (
                        "/metrics",
                        Seen::Telemetry(Some(Engine::Sglang)),
                        Found(true),
                    ),
                ],
            ),
            (
                "a 404 at /health is looked past",
                vec![
                    ("/health", Seen::Status(404), Next),
                    ("/metrics", Seen::Telemetry(Some(Engine::Tgi)), Found(true)),
                ],
            ),
            (
                "an oversized /metrics is no telemetry to keep",
                vec![
                    ("/health", EMPTY, Next),
                    ("/metrics", Seen::TooLarge, Next),
                    ("/prometheus/metrics", EMPTY, NotFound(true)),
                ],
            ),
        ];
        for (name, steps) in cases {
            let mut p = Probe::new(None, false);
            for (k, (path, seen, want)) in steps.into_iter().enumerate() {
                assert_eq!(p.path(), path, "{name}, step {k}");
                assert_eq!(short(&p.on_answer(seen, 0)), want, "{name}, step {k}");
            }
        }
    }

    #[test]
    fn a_configured_path_is_polled_as_it_is() {
        let mut p = Probe::new(Some("/health"), false);
        assert!(!p.discovers());
        for seen in [EMPTY, STATUS_OK, Seen::Status(404), Seen::Down, SEED] {
            assert_eq!(p.path(), "/health");
            assert_eq!(p.on_answer(seen, 0), Step::Poll);
        }
        let p = Probe::new(Some("/stats"), false);
        assert_eq!(p.path(), "/stats");
        assert!(Probe::new(None, false).discovers());
    }

    /// Not found, then found on a retry (the engine restarted with its metrics), then lost
    /// and found again: each change is said once, the retries that change nothing are not.
    #[test]
    fn each_outcome_is_said_once_and_retries_follow_the_engine() {
        let mut p = Probe::new(None, false);
        let not_found = |p: &mut Probe, at: u64| {
            assert_eq!(p.path(), "/health");
            assert_eq!(p.on_answer(STATUS_OK, at), Step::Next);
            assert_eq!(p.path(), "/metrics");
            assert_eq!(p.on_answer(Seen::Status(501), at), Step::Next);
            assert_eq!(p.path(), "/prometheus/metrics");
            p.on_answer(Seen::Status(404), at)
        };
        let first = not_found(&mut p, 1_000);
        assert_eq!(
            first,
            Step::NotFound(Discovery {
                tried: vec![
                    ("/health", STATUS_OK),
                    ("/metrics", Seen::Status(501)),
                    ("/prometheus/metrics", Seen::Status(404)),
                ],
                announce: true,
            })
        );
        assert!(p.not_found());
        // Not tried again before RETRY_MS.
        assert_eq!(p.path(), "/health");
        assert_eq!(p.on_answer(STATUS_OK, 1_000 + RETRY_MS - 1), Step::Poll);
        // Tried again: still nothing, said no more.
        let again = not_found(&mut p, 1_000 + RETRY_MS);
        assert!(matches!(
            again,
            Step::NotFound(Discovery {
                announce: false,
                ..
            })
        ));
        // The engine is back with its metrics.
        let at = 1_000 + 2 * RETRY_MS;
        assert_eq!(p.path(), "/health");
        assert_eq!(p.on_answer(STATUS_OK, at), Step::Next);
        let found = p.on_answer(LLAMACPP, at);
        let Step::Found(d) = &found else {
            panic!("{found:?}")
        };
        assert!(d.announce && !p.not_found());
        assert_eq!(d.found(), Some(("/metrics", Some(Engine::LlamaCpp))));
        assert_eq!(d.health_said(), Some(STATUS_OK));
        assert_eq!(p.path(), "/metrics");
    }

    /// (case, configured path, [(whether the path polled is filtered, answer, step)]): with
    /// `filter_metrics` on, which nodes are asked for the samples read alone, and when that
    /// stops.
    #[test]
    fn filtered_polls_table() {
        use S::*;
        let vllm = Seen::Telemetry(Some(Engine::Vllm));
        let sglang = Seen::Telemetry(Some(Engine::Sglang));
        type Case = (&'static str, Option<&'static str>, Vec<(bool, Seen, S)>);
        let cases: Vec<Case> = vec![
            (
                "vLLM found at /metrics: filtered from the next poll; a node down, or failing \
                 with a 5xx, stays filtered",
                None,
                vec![
                    (false, EMPTY, Next),
                    (false, vllm, Found(true)),
                    (true, vllm, Poll),
                    (true, Seen::Down, Poll),
                    (true, Seen::Status(500), Poll),
                    (true, vllm, Poll),
                ],
            ),
            (
                "an empty answer to the filter: the whole page at once, and from then on",
                None,
                vec![
                    (false, EMPTY, Next),
                    (false, vllm, Found(true)),
                    (true, EMPTY, Unfiltered),
                    (false, vllm, Poll),
                    (false, vllm, Poll),
                ],
            ),
            (
                "a 400 to the filter (a proxy that rejects the query)",
                Some("/metrics"),
                vec![
                    (false, vllm, Poll),
                    (true, Seen::Status(400), Unfiltered),
                    (false, vllm, Poll),
                ],
            ),
            (
                "over the limit even filtered",
                Some("/metrics"),
                vec![
                    (false, sglang, Poll),
                    (true, Seen::TooLarge, Unfiltered),
                    (false, sglang, Poll),
                ],
            ),
            (
                "trtllm-serve at its second path",
                None,
                vec![
                    (false, EMPTY, Next),
                    (false, JSON_ARRAY, Next),
                    (false, TRTLLM, Found(true)),
                    (true, TRTLLM, Poll),
                ],
            ),
            (
                "llama.cpp and TGI ignore queries: never filtered",
                None,
                vec![
                    (false, STATUS_OK, Next),
                    (false, LLAMACPP, Found(true)),
                    (false, LLAMACPP, Poll),
                ],
            ),
            (
                "the JSON health format is not filtered",
                None,
                vec![(false, SEED, Poll), (false, SEED, Poll)],
            ),
            (
                "a configured path with a query of its own is left as it is",
                Some("/metrics?x=1"),
                vec![(false, vllm, Poll), (false, vllm, Poll)],
            ),
            (
                "a discovery under way is not filtered",
                None,
                vec![
                    (false, EMPTY, Next),
                    (false, Seen::Down, Poll),
                    (false, vllm, Poll),
                ],
            ),
        ];
        for (name, fixed, steps) in cases {
            let mut p = Probe::new(fixed, true);
            for (k, (filtered, seen, want)) in steps.into_iter().enumerate() {
                assert_eq!(p.filtered(), filtered, "{name}, step {k}: {}", p.path());
                assert_eq!(
                    p.path().contains("name%5B%5D="),
                    filtered,
                    "{name}, step {k}"
                );
                assert_eq!(short(&p.on_answer(seen, 0)), want, "{name}, step {k}");
            }
        }
        // Off in the configuration: never filtered.
        let mut p = Probe::new(Some("/metrics"), false);
        for _ in 0..3 {
            assert_eq!(p.on_answer(vllm, 0), Step::Poll);
            assert_eq!(p.path(), "/metrics");
        }
    }

    /// The filtered path names every sample the engine's reader uses, once each, and
    /// nothing else, in the form `prometheus_client` decodes.
    #[test]
    fn a_filtered_path_names_exactly_what_is_read() {
        for engine in Engine::ALL {
            let path = filtered_path("/metrics", engine).unwrap();
            let (base, query) = path.split_once('?').unwrap();
            assert_eq!(base, "/metrics");
            let asked: Vec<String> = query
                .split('&')
                .map(|kv| {
                    let v = kv.strip_prefix("name%5B%5D=").unwrap();
                    assert!(
                        v.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'%'),
                        "{v}"
                    );
                    v.replace("%3A", ":")
                })
                .collect();
            let read: Vec<&str> = engine.names_read().collect();
            assert_eq!(asked, read, "{engine}");
            assert!(read.iter().all(|n| n.starts_with(engine.prefix())));
        }
        assert!(Engine::Vllm
            .names_read()
            .any(|n| n == "vllm:lora_requests_info"));
        assert_eq!(filtered_path("/m?a=b", Engine::Vllm), None);
    }

    /// Each engine's real answers classified: what makes a path telemetry or not.
    #[test]
    fn answers_are_classified_by_what_they_are() {
        let vllm = include_str!("../../tests/data/metrics/vllm_v1.prom");
        let llamacpp = include_str!("../../tests/data/metrics/llamacpp_real.prom");
        let cases: Vec<(HealthFormat, &str, Seen)> = vec![
            (HealthFormat::Auto, "", EMPTY),
            (HealthFormat::Auto, "  \n", EMPTY),
            (HealthFormat::Auto, r#"{"status":"ok"}"#, STATUS_OK),
            (HealthFormat::Auto, r#"{"tokens_per_sec_load":5}"#, SEED),
            // The health format with a bad value: the path is right, the value is not.
            (HealthFormat::Auto, r#"{"tokens_per_sec_load":-5}"#, SEED),
            (HealthFormat::Auto, r#"[{"iter":1}]"#, JSON_ARRAY),
            (HealthFormat::Auto, "<html>hi</html>", JSON_ARRAY),
            (HealthFormat::Auto, r#"{"tokens_per_sec_load":"#, JSON_ARRAY),
            (
                HealthFormat::Auto,
                "go_goroutines 12\n",
                Seen::NotTelemetry(Other::UnknownMetrics),
            ),
            (
                HealthFormat::Auto,
                vllm,
                Seen::Telemetry(Some(Engine::Vllm)),
            ),
            (HealthFormat::Auto, llamacpp, LLAMACPP),
            (HealthFormat::LlamaCpp, llamacpp, LLAMACPP),
            (
                HealthFormat::Vllm,
                r#"{"status":"ok"}"#,
                Seen::NotTelemetry(Other::JsonNotMetrics(Engine::Vllm)),
            ),
            (
                HealthFormat::Vllm,
                "vllm:num_requests_running NaN\n",
                Seen::Telemetry(Some(Engine::Vllm)),
            ),
        ];
        for (format, body, want) in cases {
            assert_eq!(
                Seen::of_read(&read(format, body.as_bytes())),
                want,
                "{format:?} {body:.40}"
            );
        }
        assert_eq!(Seen::of_status(None), Seen::Down);
        for s in ["502", "503", "504"] {
            assert_eq!(Seen::of_status(Some(s)), Seen::Down, "{s}");
        }
        assert_eq!(Seen::of_status(Some("501")), Seen::Status(501));
        assert_eq!(Seen::of_status(Some("404")), Seen::Status(404));
        assert_eq!(Seen::of_status(Some("junk")), Seen::Down);
    }

    #[test]
    fn answers_read_in_words() {
        let cases: Vec<(Seen, &str)> = vec![
            (EMPTY, "an empty 200"),
            (STATUS_OK, "JSON that is not the health format"),
            (Seen::Status(501), "status 501"),
            (LLAMACPP, "llamacpp metrics"),
            (SEED, "the health format"),
            (Seen::Down, "no answer"),
        ];
        for (seen, want) in cases {
            assert_eq!(seen.to_string(), want);
        }
    }
}
