//! A small parser for the Prometheus text exposition format, the `/metrics` answer of every
//! inference engine the balancer reads (vLLM, SGLang, TGI, trtllm-serve, llama.cpp).
//!
//! Written from the format's specification ("Exposition formats", text-based format 0.0.4,
//! prometheus.io/docs/instrumenting/exposition_formats/), not from another implementation:
//!
//! ```text
//!   # HELP <metric name> <docstring>
//!   # TYPE <metric name> counter|gauge|histogram|summary|untyped
//!   <metric name>[{<label name>="<label value>",...}] <value> [<timestamp ms>]
//! ```
//!
//! Lines end in `\n` (a `\r` before it is dropped: some exporters and proxies send CRLF).
//! Blank lines and plain `#` comments are ignored. A metric name matches
//! `[a-zA-Z_:][a-zA-Z0-9_:]*`, a label name `[a-zA-Z_][a-zA-Z0-9_]*`; label values are
//! double-quoted with the escapes `\\`, `\"` and `\n`. The value is a float as Go's ParseFloat
//! reads it, including `NaN`, `+Inf` and `-Inf`; the optional timestamp is an int64 of
//! milliseconds. Histograms and summaries need no special case: their series are ordinary
//! sample lines (`x_bucket{le="0.5"}`, `x_sum`, `x_count`, `x{quantile="0.9"}`), and callers
//! pick the one they want by name and label. OpenMetrics additions that a scraper may meet
//! are tolerated: the extra `# TYPE` kinds, `# EOF`, and an exemplar after ` # ` at the end of
//! a sample line (ignored). Go's hexadecimal floats and the quoted UTF-8 metric names of
//! Prometheus 3 are not read; such lines are skipped like junk.
//!
//! Why our own parser instead of a crate: it runs inside Envoy, on every tick, for every node,
//! in every worker VM, and it must never panic (a panic traps the Wasm VM and fails traffic).
//! So it is total — any byte string yields some (possibly empty) sequence of samples — and it
//! does not allocate: samples borrow `&str` slices of the answer, label pairs are scanned
//! lazily from the raw label text, and a label value is only unescaped (into a `Cow`) when it
//! actually holds an escape. A line that is not valid (bad syntax, bad escape, unparsable value
//! or timestamp, invalid UTF-8) is skipped and counted, never fatal: one broken line from an
//! exporter must not throw away the rest of the scrape. Whether the whole answer is usable is
//! the caller's decision (see `engine`).

use std::borrow::Cow;

/// One sample line: a metric name, its labels, its value and the optional timestamp.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Labels<'a>,
    pub value: f64,
    /// Milliseconds since the epoch, when the exporter wrote one.
    pub timestamp_ms: Option<i64>,
}

/// The label pairs of a sample, kept as the validated raw text between the braces and scanned
/// again on demand: most samples are never asked for their labels, so nothing is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Labels<'a> {
    raw: &'a str,
}

impl<'a> Labels<'a> {
    /// The pairs in the order written.
    pub fn iter(&self) -> LabelIter<'a> {
        LabelIter { rest: self.raw }
    }

    /// The value of the first label called `name`. (The format forbids repeating a label;
    /// checking would cost a scan per pair, so a repeat is not rejected, the first one wins.)
    pub fn get(&self, name: &str) -> Option<LabelValue<'a>> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    /// The raw text between the braces, escapes and all.
    pub fn raw(&self) -> &'a str {
        self.raw
    }
}

/// A label value as written, between its quotes, escapes not yet resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelValue<'a> {
    raw: &'a str,
}

impl<'a> LabelValue<'a> {
    pub fn raw(&self) -> &'a str {
        self.raw
    }

    /// The value's characters with the escapes resolved, without allocating.
    pub fn chars(&self) -> impl Iterator<Item = char> + 'a {
        let mut it = self.raw.chars();
        std::iter::from_fn(move || {
            let c = it.next()?;
            if c != '\\' {
                return Some(c);
            }
            // The line was validated, so only the three escapes occur; anything else (which
            // cannot happen) is kept as written rather than trusted.
            Some(match it.next() {
                Some('n') => '\n',
                Some(other) => other,
                None => '\\',
            })
        })
    }

    /// The unescaped value; borrowed unless it holds an escape.
    pub fn unescaped(&self) -> Cow<'a, str> {
        if self.raw.contains('\\') {
            Cow::Owned(self.chars().collect())
        } else {
            Cow::Borrowed(self.raw)
        }
    }

    /// Whether the unescaped value equals `s`.
    pub fn matches(&self, s: &str) -> bool {
        self.chars().eq(s.chars())
    }

    /// The value read as a number (engines publish configuration this way, e.g. vLLM's
    /// `cache_config_info{block_size="16"}`). Numbers hold no escapes, so the raw text is read.
    pub fn as_f64(&self) -> Option<f64> {
        self.raw.parse().ok()
    }
}

/// Iterator over the label pairs of a validated label block.
#[derive(Debug, Clone)]
pub struct LabelIter<'a> {
    rest: &'a str,
}

impl<'a> Iterator for LabelIter<'a> {
    type Item = (&'a str, LabelValue<'a>);

    fn next(&mut self) -> Option<Self::Item> {
        // Cleared first: whatever goes wrong below (it cannot, the block was validated), the
        // iterator ends instead of yielding nonsense or looping.
        let s = std::mem::take(&mut self.rest);
        let s = s.trim_start_matches([',', ' ', '\t']);
        let (name, after) = take_while(s, is_label_char);
        if name.is_empty() {
            return None;
        }
        let after = trim_blanks(after)
            .strip_prefix('=')
            .map(trim_blanks)?
            .strip_prefix('"')?;
        let end = closing_quote(after)?;
        let value = after.get(..end)?;
        self.rest = after.get(end + 1..)?;
        Some((name, LabelValue { raw: value }))
    }
}

/// The samples of an exposition, in order; invalid lines are skipped and counted.
#[derive(Debug, Clone)]
pub struct Samples<'a> {
    rest: &'a [u8],
    skipped: usize,
}

impl<'a> Samples<'a> {
    /// Lines skipped so far as invalid (bad syntax, invalid UTF-8, malformed HELP or TYPE).
    pub fn skipped(&self) -> usize {
        self.skipped
    }
}

/// Parses a Prometheus text exposition. Total: any bytes give an iterator, invalid lines are
/// skipped (see `Samples::skipped`). This is the entry point for fuzzing.
pub fn parse_prometheus_samples(bytes: &[u8]) -> Samples<'_> {
    // A UTF-8 byte order mark would otherwise spoil the first line.
    let rest = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    Samples { rest, skipped: 0 }
}

impl<'a> Iterator for Samples<'a> {
    type Item = Sample<'a>;

    fn next(&mut self) -> Option<Sample<'a>> {
        while !self.rest.is_empty() {
            let (line, rest) = match self.rest.iter().position(|&b| b == b'\n') {
                Some(i) => (
                    self.rest.get(..i).unwrap_or_default(),
                    self.rest.get(i + 1..).unwrap_or_default(),
                ),
                None => (self.rest, &[][..]),
            };
            self.rest = rest;
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            // Validated per line, so one bad byte costs one line, not the scrape.
            let Ok(line) = std::str::from_utf8(line) else {
                self.skipped += 1;
                continue;
            };
            let line = line.trim_matches([' ', '\t']);
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                if !valid_comment(comment) {
                    self.skipped += 1;
                }
                continue;
            }
            match parse_sample(line) {
                Some(sample) => return Some(sample),
                None => self.skipped += 1,
            }
        }
        None
    }
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b':'
}

fn is_name_char(b: u8) -> bool {
    is_name_start(b) || b.is_ascii_digit()
}

fn is_label_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn is_label_char(b: u8) -> bool {
    is_label_start(b) || b.is_ascii_digit()
}

/// Splits `s` after the longest prefix of bytes accepted by `f`. `f` accepts ASCII only, so the
/// split falls on a character boundary.
fn take_while(s: &str, f: impl Fn(u8) -> bool) -> (&str, &str) {
    let n = s.bytes().position(|b| !f(b)).unwrap_or(s.len());
    (s.get(..n).unwrap_or(""), s.get(n..).unwrap_or(""))
}

fn trim_blanks(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// The next blank-separated token and the rest.
fn token(s: &str) -> (&str, &str) {
    take_while(s, |b| !is_blank(b))
}

fn metric_name(s: &str) -> Option<(&str, &str)> {
    if !s.bytes().next().is_some_and(is_name_start) {
        return None;
    }
    Some(take_while(s, is_name_char))
}

/// Byte index of the closing quote of a label value whose opening quote is already consumed.
fn closing_quote(s: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, b) in s.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' => escaped = true,
            b'"' => return Some(i),
            _ => {}
        }
    }
    None
}

/// Validates a label block whose `{` is consumed: returns the text inside the braces and the
/// text after the `}`. A trailing comma before `}` is allowed, as the format allows it.
fn scan_labels(s: &str) -> Option<(&str, &str)> {
    let bytes = s.as_bytes();
    let skip = |mut i: usize| {
        while bytes.get(i).copied().is_some_and(is_blank) {
            i += 1;
        }
        i
    };
    let mut i = skip(0);
    while *bytes.get(i)? != b'}' {
        if !is_label_start(*bytes.get(i)?) {
            return None;
        }
        while bytes.get(i).copied().is_some_and(is_label_char) {
            i += 1;
        }
        i = skip(i);
        if *bytes.get(i)? != b'=' {
            return None;
        }
        i = skip(i + 1);
        if *bytes.get(i)? != b'"' {
            return None;
        }
        i += 1;
        loop {
            match *bytes.get(i)? {
                b'"' => break,
                b'\\' => match *bytes.get(i + 1)? {
                    b'\\' | b'"' | b'n' => i += 2,
                    _ => return None,
                },
                _ => i += 1,
            }
        }
        i = skip(i + 1);
        match *bytes.get(i)? {
            b',' => i = skip(i + 1),
            b'}' => {}
            _ => return None,
        }
    }
    Some((s.get(..i)?, s.get(i + 1..)?))
}

fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let (name, rest) = metric_name(line)?;
    let rest = trim_blanks(rest);
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let (raw, after) = scan_labels(inner)?;
            (Labels { raw }, after)
        }
        None => (Labels::default(), rest),
    };
    let (value, rest) = token(trim_blanks(rest));
    let value: f64 = value.parse().ok()?;
    let rest = trim_blanks(rest);
    // An OpenMetrics exemplar (` # {trace_id="..."} 1`) may follow; it is not ours to read.
    let (timestamp, rest) = if rest.starts_with('#') {
        ("", rest)
    } else {
        token(rest)
    };
    let timestamp_ms = match timestamp {
        "" => None,
        t => Some(t.parse::<i64>().ok()?),
    };
    let rest = trim_blanks(rest);
    if !(rest.is_empty() || rest.starts_with('#')) {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
        timestamp_ms,
    })
}

/// Is this comment (the text after `#`) acceptable? Plain comments always are; `HELP` needs a
/// metric name, `TYPE` a metric name and a known kind.
fn valid_comment(comment: &str) -> bool {
    let (keyword, rest) = token(trim_blanks(comment));
    match keyword {
        "HELP" => metric_name(trim_blanks(rest)).is_some_and(|(_, after)| {
            after.is_empty() || after.bytes().next().is_some_and(is_blank)
        }),
        "TYPE" => {
            let Some((_, after)) = metric_name(trim_blanks(rest)) else {
                return false;
            };
            let (kind, tail) = token(trim_blanks(after));
            let known = matches!(
                kind,
                "counter"
                    | "gauge"
                    | "histogram"
                    | "summary"
                    | "untyped"
                    // OpenMetrics kinds, met when an exporter answers in that dialect.
                    | "unknown"
                    | "info"
                    | "stateset"
                    | "gaugehistogram"
            );
            known && trim_blanks(tail).is_empty()
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{Rng, SplitMix64};

    fn all(text: &str) -> (Vec<Sample<'_>>, usize) {
        let mut it = parse_prometheus_samples(text.as_bytes());
        let v: Vec<Sample> = it.by_ref().collect();
        (v, it.skipped())
    }

    fn one(line: &str) -> Option<Sample<'_>> {
        let (v, skipped) = all(line);
        assert!(v.len() + skipped <= 1, "{line:?}");
        v.into_iter().next()
    }

    fn pairs(s: &Sample) -> Vec<(String, String)> {
        s.labels
            .iter()
            .map(|(n, v)| (n.to_string(), v.unescaped().into_owned()))
            .collect()
    }

    #[test]
    fn sample_lines_as_the_spec_writes_them() {
        type Case = (
            &'static str,
            &'static str,
            Vec<(&'static str, &'static str)>,
            f64,
            Option<i64>,
        );
        let cases: Vec<Case> = vec![
            (
                "metric_without_timestamp_and_labels 12.47",
                "metric_without_timestamp_and_labels",
                vec![],
                12.47,
                None,
            ),
            (
                r#"http_requests_total{method="post",code="200"} 1027 1395066363000"#,
                "http_requests_total",
                vec![("method", "post"), ("code", "200")],
                1027.0,
                Some(1395066363000),
            ),
            (
                r#"msdos_file_access_time_seconds{path="C:\\DIR\\FILE.TXT",error="Cannot find file:\n\"FILE.TXT\""} 1.458255915e9"#,
                "msdos_file_access_time_seconds",
                vec![
                    ("path", r"C:\DIR\FILE.TXT"),
                    ("error", "Cannot find file:\n\"FILE.TXT\""),
                ],
                1.458255915e9,
                None,
            ),
            (
                "something_weird{problem=\"division by zero\"} +Inf -3982045",
                "something_weird",
                vec![("problem", "division by zero")],
                f64::INFINITY,
                Some(-3982045),
            ),
            (
                r#"rpc_duration_seconds{quantile="0.99"} 76656"#,
                "rpc_duration_seconds",
                vec![("quantile", "0.99")],
                76656.0,
                None,
            ),
            (
                r#"http_request_duration_seconds_bucket{le="+Inf"} 144320"#,
                "http_request_duration_seconds_bucket",
                vec![("le", "+Inf")],
                144320.0,
                None,
            ),
            ("x -Inf", "x", vec![], f64::NEG_INFINITY, None),
            (
                "vllm:num_requests_running{} 3",
                "vllm:num_requests_running",
                vec![],
                3.0,
                None,
            ),
            // Blanks and tabs anywhere tokens may be separated, a trailing comma in the labels.
            (
                "  \tx { a = \"1\" , b=\"2\", }\t 5  ",
                "x",
                vec![("a", "1"), ("b", "2")],
                5.0,
                None,
            ),
            // No blank is needed between the closing brace and the value.
            (r#"x{a="1"}5"#, "x", vec![("a", "1")], 5.0, None),
            // An OpenMetrics exemplar is ignored.
            (
                r#"x_bucket{le="1"} 3 # {trace_id="abc"} 0.5 123"#,
                "x_bucket",
                vec![("le", "1")],
                3.0,
                None,
            ),
            (
                r#"x 3 1700000000000 # {trace_id="abc"} 0.5"#,
                "x",
                vec![],
                3.0,
                Some(1700000000000),
            ),
            // A label value may hold anything but a bare quote or a bad escape.
            (
                r#"x{a="{}=,# \"q\" é 日本"} 1"#,
                "x",
                vec![("a", "{}=,# \"q\" é 日本")],
                1.0,
                None,
            ),
            ("_:x:1e3 1e3", "_:x:1e3", vec![], 1000.0, None),
        ];
        for (line, name, labels, value, ts) in cases {
            let s = one(line).unwrap_or_else(|| panic!("not parsed: {line:?}"));
            assert_eq!(s.name, name, "{line}");
            let want: Vec<(String, String)> = labels
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect();
            assert_eq!(pairs(&s), want, "{line}");
            assert_eq!(s.value, value, "{line}");
            assert_eq!(s.timestamp_ms, ts, "{line}");
        }
        assert!(one("x NaN").unwrap().value.is_nan());
    }

    #[test]
    fn invalid_lines_are_skipped_and_counted() {
        for line in [
            "x",
            "x ",
            "1x 2",
            "x{a=\"1\" 2",
            "x{a=1} 2",
            "x{a=\"1\"",
            "x{a=\"1\"}",
            "x{a=\"1\"b=\"2\"} 3",
            "x{1a=\"1\"} 3",
            "x{a:b=\"1\"} 3",
            r#"x{a="\t"} 3"#,
            r#"x{a="\"} 3"#,
            "x{,} 1",
            "x 1 2 3",
            "x one",
            "x 1 1.5",
            "x 0x10",
            "x 1 99999999999999999999",
            r#"{"x"} 1"#,
            "<html><body>502</body></html>",
            "# TYPE x",
            "# TYPE x countr",
            "# TYPE x gauge extra",
            "# TYPE 1x gauge",
            "# HELP",
            "# HELP 9x doc",
        ] {
            let (v, skipped) = all(line);
            assert!(v.is_empty(), "{line:?} parsed as {v:?}");
            assert_eq!(skipped, 1, "{line:?}");
        }
        // Plain comments, well-formed HELP/TYPE lines and blank lines are not junk.
        let (v, skipped) = all(
            "# just a comment\n#\n# HELP x Some help, with \\n escapes\n# HELP y\n# TYPE x counter\n\
             # TYPE z histogram\n# TYPE s summary\n# TYPE u untyped\n# TYPE i info\n# EOF\n\n \t \n",
        );
        assert_eq!((v.len(), skipped), (0, 0));
    }

    #[test]
    fn line_endings_blank_lines_utf8_and_truncation() {
        let text =
            b"a 1\r\n\r\nb{l=\"v\"} 2\r\n\xff\xfe 3\nc{l=\"\xe9\"} 4\n\xEF\xBB\xBFd 5\ne{l=\"trunc";
        let mut it = parse_prometheus_samples(text);
        let got: Vec<(&str, f64)> = it.by_ref().map(|s| (s.name, s.value)).collect();
        assert_eq!(got, vec![("a", 1.0), ("b", 2.0)]);
        // The non-UTF-8 lines, the BOM in mid-text and the truncated last line.
        assert_eq!(it.skipped(), 4);
        // A BOM at the very start is dropped; a missing final newline is fine.
        let got: Vec<&str> = parse_prometheus_samples(b"\xEF\xBB\xBFa 1\nb 2")
            .map(|s| s.name)
            .collect();
        assert_eq!(got, vec!["a", "b"]);
        assert_eq!(parse_prometheus_samples(b"").count(), 0);
        assert_eq!(parse_prometheus_samples(b"\n\n\r\n").count(), 0);
    }

    #[test]
    fn label_values_unescape_only_when_needed() {
        let s = one(r#"x{plain="abc",esc="a\\b\"c\nd"} 1"#).unwrap();
        let plain = s.labels.get("plain").unwrap();
        assert!(matches!(plain.unescaped(), Cow::Borrowed("abc")));
        let esc = s.labels.get("esc").unwrap();
        assert_eq!(esc.raw(), r#"a\\b\"c\nd"#);
        assert_eq!(esc.unescaped(), "a\\b\"c\nd");
        assert!(esc.matches("a\\b\"c\nd"));
        assert!(!esc.matches("a\\b\"c\n"));
        assert!(s.labels.get("missing").is_none());
        assert!(one("x 1").unwrap().labels.is_empty());
        let n = one(r#"x{block_size="16",none="None"} 1"#).unwrap();
        assert_eq!(
            n.labels.get("block_size").and_then(|v| v.as_f64()),
            Some(16.0)
        );
        assert_eq!(n.labels.get("none").and_then(|v| v.as_f64()), None);
        // A label value that looks like more labels is one value.
        let trick = one(r#"x{a="1\",b=\"2",c="3"} 4"#).unwrap();
        assert_eq!(
            pairs(&trick),
            vec![("a".into(), "1\",b=\"2".into()), ("c".into(), "3".into())]
        );
        assert_eq!(trick.value, 4.0);
    }

    #[test]
    fn histograms_and_summaries_are_plain_series() {
        let text = "# HELP d Request duration.\n# TYPE d histogram\n\
            d_bucket{le=\"0.1\"} 1\nd_bucket{le=\"1\"} 5\nd_bucket{le=\"+Inf\"} 7\nd_sum 9.5\nd_count 7\n\
            # TYPE q summary\nq{quantile=\"0.5\"} 0.2\nq{quantile=\"0.99\"} NaN\nq_sum 12\nq_count 40\n";
        let (v, skipped) = all(text);
        assert_eq!(skipped, 0);
        let names: Vec<&str> = v.iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "d_bucket", "d_bucket", "d_bucket", "d_sum", "d_count", "q", "q", "q_sum",
                "q_count"
            ]
        );
        let inf = v
            .iter()
            .find(|s| s.labels.get("le").is_some_and(|l| l.matches("+Inf")));
        assert_eq!(inf.map(|s| s.value), Some(7.0));
        assert!(v[6].value.is_nan());
    }

    /// Random bytes, and real-looking text with random damage, never panic the parser, and
    /// whatever it yields is well-formed (names non-empty, label iteration terminates).
    #[test]
    fn random_input_never_panics() {
        let mut rng = SplitMix64::new(0x5eed);
        let base = "# HELP vllm:x doc\n# TYPE vllm:x counter\nvllm:x_total{model_name=\"m\\\"1\",engine=\"0\"} 12 1700\n\
                    h_bucket{le=\"+Inf\"} NaN\nh_sum 3\r\nq{quantile=\"0.5\"} -Inf\n";
        let alphabet = b"{}\"\\=,# \t\n\r:_aZ09.+-eE\xff\xc3";
        for round in 0..4000 {
            let len = (rng.next_u64() % 200) as usize;
            let bytes: Vec<u8> = if round % 2 == 0 {
                (0..len).map(|_| rng.next_u64() as u8).collect()
            } else {
                let mut b = base.as_bytes().to_vec();
                for _ in 0..1 + rng.next_u64() % 6 {
                    let at = (rng.next_u64() as usize) % (b.len() + 1);
                    let c = alphabet[(rng.next_u64() as usize) % alphabet.len()];
                    match rng.next_u64() % 3 {
                        0 => b.insert(at, c),
                        1 if at < b.len() => b[at] = c,
                        _ => b.truncate(at),
                    }
                }
                b
            };
            let mut it = parse_prometheus_samples(&bytes);
            for s in it.by_ref() {
                assert!(!s.name.is_empty());
                for (n, v) in s.labels.iter().take(1000) {
                    assert!(!n.is_empty());
                    let _ = v.unescaped();
                }
                assert!(s.labels.iter().count() < 1000);
            }
            assert!(it.skipped() <= bytes.len() + 1);
        }
    }
}
