//! Telemetry: what a GPU node's health endpoint says about its load, parsed into a `Report`.
//!
//! The seed format is one JSON object. Only `tokens_per_sec_load` is required; the optional
//! fields make the choice sharper: `tokens_per_sec_capacity`, `vram_used_bytes` with
//! `vram_total_bytes` (or `kv_cache_usage` in 0..1), `queue_depth` and `running_requests`.
//! Parsing is total and strict about values: an answer that is not such an object, or whose
//! required field is missing, negative or not finite, is an error, so that a broken node never
//! replaces good data with garbage. An optional field with a bad value is dropped on its own.

use serde_json::{Map, Value};
use std::fmt;

/// One node's self-reported state at the time of a health answer.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Report {
    /// Tokens per second the node is processing now (prefill and decode).
    pub load_tokens_per_sec: f64,
    /// Tokens per second the node can sustain, when it says.
    pub capacity_tokens_per_sec: Option<f64>,
    /// Tokens per second the node was seen to serve over seconds of work, learned
    /// from an engine's counters (`rates`); what the first-token forecast drains queued
    /// prompts at. None in the seed format, whose capacity is the node's own word.
    pub sustained_tokens_per_sec: Option<f64>,
    /// KV-cache/VRAM in use, bytes, with the total.
    pub vram_used_bytes: Option<f64>,
    pub vram_total_bytes: Option<f64>,
    /// KV-cache use as a fraction 0..1, when the node reports a fraction instead of bytes.
    pub kv_cache_usage: Option<f64>,
    /// KV-cache size in tokens, when the node publishes its cache geometry (engines' metrics;
    /// the seed format has no such field). Sizes a request against `kv_cache_usage`, ahead of
    /// a configured `kv_cache_tokens`.
    pub kv_cache_tokens: Option<f64>,
    /// Requests waiting for admission.
    pub queue_depth: Option<f64>,
    /// Requests being served.
    pub running_requests: Option<f64>,
}

impl Report {
    /// Requests the report shows running or waiting, when it gives either count.
    pub fn requests_there(&self) -> Option<f64> {
        if self.running_requests.is_none() && self.queue_depth.is_none() {
            return None;
        }
        Some(self.running_requests.unwrap_or(0.0) + self.queue_depth.unwrap_or(0.0))
    }

    /// Whether this report moved nothing the choice reads since `before`: the same requests
    /// running and waiting, KV-cache use within a point, token load and capacity within 5 % (or
    /// 20 tokens a second).
    /// A node whose reports do not move is polled less often (see `fleet::polling`).
    pub fn quiet_since(&self, before: &Report) -> bool {
        // Within 5 %, or 20 tokens a second: noise on a node that is all but idle.
        let near = |a: f64, b: f64| (a - b).abs() <= (0.05 * a.abs().max(b.abs())).max(20.0);
        let same = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => near(a, b),
            (None, None) => true,
            _ => false,
        };
        let kv_same = match (self.kv_fraction(), before.kv_fraction()) {
            (Some(a), Some(b)) => (a - b).abs() <= 0.01,
            (None, None) => true,
            _ => false,
        };
        self.running_requests == before.running_requests
            && self.queue_depth == before.queue_depth
            && kv_same
            && near(self.load_tokens_per_sec, before.load_tokens_per_sec)
            && same(self.capacity_tokens_per_sec, before.capacity_tokens_per_sec)
    }

    /// KV-cache use as a fraction 0..1: the reported fraction, else used over total bytes.
    pub fn kv_fraction(&self) -> Option<f64> {
        self.kv_cache_usage
            .or(match (self.vram_used_bytes, self.vram_total_bytes) {
                (Some(u), Some(t)) if t > 0.0 => Some(u / t),
                _ => None,
            })
    }

    /// Whether the node had room to spare at this report, so that news of it cannot be close
    /// to turning a decision: nothing waiting, KV-cache use at most `kv_limit`, and (when it
    /// says its capacity) at most half of that in use. A node that does not report its queue
    /// or its KV use is never judged slack.
    /// A slack node is polled as a quiet one is (see `fleet::polling`).
    pub fn slack(&self, kv_limit: f64) -> bool {
        let idle_queue = self.queue_depth.is_some_and(|q| q < 0.5);
        let room = self.kv_fraction().is_some_and(|kv| kv <= kv_limit);
        let spare = self
            .capacity_tokens_per_sec
            .map_or(true, |c| self.load_tokens_per_sec <= 0.5 * c);
        idle_queue && room && spare
    }
}

/// Why a health answer was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportError {
    /// Not JSON, or not a JSON object.
    NotJson,
    /// `tokens_per_sec_load` absent.
    MissingLoad,
    /// `tokens_per_sec_load` present but not a finite non-negative number.
    BadLoad,
}

impl fmt::Display for ReportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReportError::NotJson => "answer is not a JSON object",
            ReportError::MissingLoad => "answer has no tokens_per_sec_load",
            ReportError::BadLoad => "tokens_per_sec_load is not a finite non-negative number",
        })
    }
}

/// Values at or beyond this are not believed (1e15 tokens/s, 1 PB of VRAM), whatever the
/// format: an astronomically large number is a broken exporter, and would otherwise dominate
/// every comparison.
pub const ABSURD: f64 = 1e15;

/// Whether a figure a node reports is believable: finite, not negative, below `ABSURD`.
pub fn believable(v: f64) -> bool {
    (0.0..ABSURD).contains(&v)
}

fn sane(v: Option<&Value>) -> Option<f64> {
    v.and_then(Value::as_f64).filter(|x| believable(*x))
}

fn optional(obj: &Map<String, Value>, key: &str) -> Option<f64> {
    sane(obj.get(key))
}

/// Parses a seed-format health answer.
pub fn parse_health(body: &[u8]) -> Result<Report, ReportError> {
    let v: Value = serde_json::from_slice(body).map_err(|_| ReportError::NotJson)?;
    let obj = v.as_object().ok_or(ReportError::NotJson)?;
    let load = obj
        .get("tokens_per_sec_load")
        .ok_or(ReportError::MissingLoad)?;
    let load_tokens_per_sec = sane(Some(load)).ok_or(ReportError::BadLoad)?;
    let capacity = optional(obj, "tokens_per_sec_capacity").filter(|c| *c > 0.0);
    let mut vram_used = optional(obj, "vram_used_bytes");
    let mut vram_total = optional(obj, "vram_total_bytes").filter(|t| *t > 0.0);
    // Bytes only make sense as a pair.
    if vram_used.is_none() || vram_total.is_none() {
        vram_used = None;
        vram_total = None;
    }
    Ok(Report {
        load_tokens_per_sec,
        capacity_tokens_per_sec: capacity,
        sustained_tokens_per_sec: None,
        vram_used_bytes: vram_used,
        vram_total_bytes: vram_total,
        kv_cache_usage: optional(obj, "kv_cache_usage").filter(|u| *u <= 1.0),
        kv_cache_tokens: None,
        queue_depth: optional(obj, "queue_depth"),
        running_requests: optional(obj, "running_requests"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (case, before, after, quiet): what a report must keep for the node to be quiet.
    #[test]
    fn quiet_reports_table() {
        let idle = Report {
            load_tokens_per_sec: 0.0,
            capacity_tokens_per_sec: Some(40_000.0),
            kv_cache_usage: Some(0.10),
            queue_depth: Some(0.0),
            running_requests: Some(0.0),
            ..Report::default()
        };
        let with = |f: fn(&mut Report)| {
            let mut r = idle;
            f(&mut r);
            r
        };
        let cases: Vec<(&str, Report, Report, bool)> = vec![
            ("the same report", idle, idle, true),
            (
                "KV within a point",
                idle,
                with(|r| r.kv_cache_usage = Some(0.105)),
                true,
            ),
            (
                "load within 5 %",
                with(|r| r.load_tokens_per_sec = 1000.0),
                with(|r| r.load_tokens_per_sec = 1040.0),
                true,
            ),
            (
                "a few tokens a second on an idle node",
                idle,
                with(|r| r.load_tokens_per_sec = 15.0),
                true,
            ),
            (
                "one more request running",
                idle,
                with(|r| r.running_requests = Some(1.0)),
                false,
            ),
            (
                "one request waiting",
                idle,
                with(|r| r.queue_depth = Some(1.0)),
                false,
            ),
            (
                "KV two points up",
                idle,
                with(|r| r.kv_cache_usage = Some(0.12)),
                false,
            ),
            (
                "load up 10 %",
                with(|r| r.load_tokens_per_sec = 1000.0),
                with(|r| r.load_tokens_per_sec = 1100.0),
                false,
            ),
            (
                "capacity learned",
                with(|r| r.capacity_tokens_per_sec = None),
                idle,
                false,
            ),
            (
                "KV in bytes",
                with(|r| {
                    r.kv_cache_usage = None;
                    r.vram_used_bytes = Some(10.0);
                    r.vram_total_bytes = Some(100.0);
                }),
                with(|r| {
                    r.kv_cache_usage = None;
                    r.vram_used_bytes = Some(30.0);
                    r.vram_total_bytes = Some(100.0);
                }),
                false,
            ),
            (
                "a count the node stopped sending",
                idle,
                with(|r| r.running_requests = None),
                false,
            ),
        ];
        for (name, before, after, want) in cases {
            assert_eq!(after.quiet_since(&before), want, "{name}");
        }
    }

    /// (case, report, slack under a KV limit of 0.45): what a report must show for the node
    /// to have room to spare.
    #[test]
    fn slack_reports_table() {
        let busy = Report {
            load_tokens_per_sec: 12_000.0,
            capacity_tokens_per_sec: Some(40_000.0),
            kv_cache_usage: Some(0.30),
            queue_depth: Some(0.0),
            running_requests: Some(24.0),
            ..Report::default()
        };
        let with = |f: fn(&mut Report)| {
            let mut r = busy;
            f(&mut r);
            r
        };
        let cases: Vec<(&str, Report, bool)> = vec![
            ("running, nothing waiting, room in the cache", busy, true),
            (
                "KV use at the limit",
                with(|r| r.kv_cache_usage = Some(0.45)),
                true,
            ),
            (
                "KV use past the limit",
                with(|r| r.kv_cache_usage = Some(0.46)),
                false,
            ),
            (
                "one request waiting",
                with(|r| r.queue_depth = Some(1.0)),
                false,
            ),
            (
                "past half its capacity",
                with(|r| r.load_tokens_per_sec = 20_001.0),
                false,
            ),
            (
                "no capacity said: the load is not judged",
                with(|r| r.capacity_tokens_per_sec = None),
                true,
            ),
            ("queue not said", with(|r| r.queue_depth = None), false),
            ("KV use not said", with(|r| r.kv_cache_usage = None), false),
            (
                "KV in bytes",
                with(|r| {
                    r.kv_cache_usage = None;
                    r.vram_used_bytes = Some(40.0);
                    r.vram_total_bytes = Some(100.0);
                }),
                true,
            ),
            (
                "KV in bytes, past the limit",
                with(|r| {
                    r.kv_cache_usage = None;
                    r.vram_used_bytes = Some(50.0);
                    r.vram_total_bytes = Some(100.0);
                }),
                false,
            ),
        ];
        for (name, r, want) in cases {
            assert_eq!(r.slack(0.45), want, "{name}");
        }
    }

    #[test]
    fn seed_format_as_written() {
        let r = parse_health(br#"{"tokens_per_sec_load": 1234.5}"#).unwrap();
        assert_eq!(
            r,
            Report {
                load_tokens_per_sec: 1234.5,
                ..Report::default()
            }
        );
    }

    #[test]
    fn all_optional_fields() {
        let r = parse_health(
            br#"{"tokens_per_sec_load":10,"tokens_per_sec_capacity":100,"vram_used_bytes":5,
                 "vram_total_bytes":50,"kv_cache_usage":0.1,"queue_depth":3,"running_requests":7,
                 "name":"extra fields are fine"}"#,
        )
        .unwrap();
        assert_eq!(r.capacity_tokens_per_sec, Some(100.0));
        assert_eq!(r.vram_used_bytes, Some(5.0));
        assert_eq!(r.vram_total_bytes, Some(50.0));
        assert_eq!(r.kv_cache_usage, Some(0.1));
        assert_eq!(r.queue_depth, Some(3.0));
        assert_eq!(r.running_requests, Some(7.0));
    }

    #[test]
    fn malformed_answers_are_errors() {
        let cases: &[(&[u8], ReportError)] = &[
            (b"", ReportError::NotJson),
            (
                b"<html><body>502 Bad Gateway</body></html>",
                ReportError::NotJson,
            ),
            (br#"{"tokens_per_sec_load": 12"#, ReportError::NotJson),
            (b"[1]", ReportError::NotJson),
            (b"42", ReportError::NotJson),
            (br#"{"load": 1}"#, ReportError::MissingLoad),
            (br#"{"tokens_per_sec_load": "fast"}"#, ReportError::BadLoad),
            (br#"{"tokens_per_sec_load": -1}"#, ReportError::BadLoad),
            (br#"{"tokens_per_sec_load": null}"#, ReportError::BadLoad),
            (br#"{"tokens_per_sec_load": 1e300}"#, ReportError::BadLoad),
            (&[0xff, 0x00, 0xfe], ReportError::NotJson),
        ];
        for (body, want) in cases {
            assert_eq!(
                parse_health(body),
                Err(want.clone()),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn bad_optional_fields_are_dropped_alone() {
        let r = parse_health(
            br#"{"tokens_per_sec_load":1,"tokens_per_sec_capacity":0,"vram_used_bytes":-3,
                 "vram_total_bytes":10,"kv_cache_usage":1.5,"queue_depth":"deep","running_requests":1e99}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            Report {
                load_tokens_per_sec: 1.0,
                ..Report::default()
            }
        );
    }
}
