//! Trace readers: the real traffic the benchmark replays (see ../shared/data/README.md).
//!
//! - Azure LLM inference trace (Splitwise, ISCA'24), conversation CSV:
//!   `TIMESTAMP,ContextTokens,GeneratedTokens`, timestamps as `YYYY-MM-DD HH:MM:SS.fffffff`.
//! - Mooncake trace (FAST'25), JSONL: `timestamp` (ms), `input_length`, `output_length`,
//!   `hash_ids` (512-token prefix blocks; equal leading ids are a shared prefix).

/// One request of a trace, times relative to the trace's first request.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    pub at_ms: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Prefix blocks (Mooncake), so equal blocks become equal text.
    pub blocks: Vec<u64>,
}

/// Tokens per Mooncake hash block.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Seconds since midnight of `HH:MM:SS.fff...` plus whole days from the date, enough to order
/// and space one trace (the Azure trace spans one hour of one day).
fn azure_seconds(ts: &str) -> Option<f64> {
    let (date, time) = ts.trim().split_once(' ')?;
    let day: f64 = date.rsplit('-').next()?.parse().ok()?;
    let mut hms = time.split(':');
    let h: f64 = hms.next()?.parse().ok()?;
    let m: f64 = hms.next()?.parse().ok()?;
    let s: f64 = hms.next()?.parse().ok()?;
    Some(day * 86_400.0 + h * 3600.0 + m * 60.0 + s)
}

pub fn parse_azure(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    let mut first = None;
    for (i, line) in text.lines().enumerate().skip(1) {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let parsed = (|| {
            let t = azure_seconds(f.first()?)?;
            let p: u64 = f.get(1)?.trim().parse().ok()?;
            let o: u64 = f.get(2)?.trim().parse().ok()?;
            Some((t, p, o))
        })();
        let (t, p, o) =
            parsed.ok_or_else(|| format!("azure trace line {}: cannot parse {line:?}", i + 1))?;
        let t0 = *first.get_or_insert(t);
        out.push(TraceRequest {
            at_ms: (t - t0) * 1000.0,
            prompt_tokens: p,
            output_tokens: o.max(1),
            blocks: vec![],
        });
    }
    Ok(out)
}

pub fn parse_mooncake(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| format!("mooncake trace line {}: {e}", i + 1))?;
        let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        let (Some(t), Some(p), Some(o)) =
            (num("timestamp"), num("input_length"), num("output_length"))
        else {
            return Err(format!(
                "mooncake trace line {}: missing timestamp/input_length/output_length",
                i + 1
            ));
        };
        let blocks = v
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        out.push(TraceRequest {
            at_ms: t,
            prompt_tokens: p as u64,
            output_tokens: (o as u64).max(1),
            blocks,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_rows() {
        let t = parse_azure(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:48.0,396,0\n",
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].at_ms, 0.0);
        assert!((t[1].at_ms - 1500.0).abs() < 1e-6);
        assert_eq!((t[1].prompt_tokens, t[1].output_tokens), (396, 1));
        assert!(parse_azure("h\nnot,a,row\n").is_err());
    }

    #[test]
    fn mooncake_rows() {
        let t = parse_mooncake(
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 6, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 250, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 2]}\n",
        )
        .unwrap();
        assert_eq!(t[1].at_ms, 250.0);
        assert_eq!(t[1].blocks, vec![0, 2]);
        assert!(parse_mooncake("{\"timestamp\": 0}").is_err());
    }
}
