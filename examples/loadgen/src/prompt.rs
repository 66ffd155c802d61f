//! Prompt text of a given length, built so both tokenizers in play see a realistic length:
//! the mock node counts 1.3 tokens a word, the filter estimates ~4 characters a token, and the
//! words below average ~5 characters, so the filter's estimate is close to, but not exactly, the
//! node's count — as with a real engine's tokenizer.
//!
//! Text is a deterministic function of a seed: Mooncake blocks with the same hash id become the
//! same text (a shared prefix), and distinct Azure requests share nothing.

const WORDS: &[&str] = &[
    "the", "model", "server", "request", "token", "cluster", "latency", "memory", "answer",
    "question", "about", "people", "system", "network", "between", "through", "summary", "report",
    "figure", "result", "value", "should", "because", "another", "number", "market", "quarter",
    "growth", "design", "engine", "batch", "cache", "prompt", "output", "please", "explain",
    "simple", "careful", "history", "future", "river", "mountain", "city", "garden", "window",
    "letter", "story", "chapter", "reason", "method", "data", "table", "field", "record", "signal",
    "source", "target", "policy", "budget", "schedule", "and", "of", "to", "in",
];

fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// About `tokens` tokens (by the mock's count) of text derived from `seed`.
pub fn text(seed: u64, tokens: u64, out: &mut String) {
    let words = (tokens * 10).div_ceil(13);
    let mut s = seed ^ 0x5eed;
    for _ in 0..words {
        let w = WORDS[(next(&mut s) % WORDS.len() as u64) as usize];
        out.push_str(w);
        out.push(' ');
    }
}

/// How a prompt of `prompt_tokens` is laid out, in order: each full prefix block, shared by
/// every request that has it (`Some` of the seed it is drawn from, the block's hash id's), and
/// the request's own tokens (`None`: a partial last block, then whatever follows the blocks),
/// each with its length.
fn layout(prompt_tokens: u64, blocks: &[u64], block_tokens: u64) -> Vec<(Option<u64>, u64)> {
    let mut parts = Vec::new();
    let mut left = prompt_tokens;
    for b in blocks {
        if left == 0 {
            break;
        }
        let n = left.min(block_tokens);
        let shared = (n == block_tokens).then(|| b.wrapping_mul(0x1000_0000_01b3) ^ 0xb10c);
        parts.push((shared, n));
        left -= n;
    }
    if left > 0 {
        parts.push((None, left));
    }
    parts
}

/// A request's prompt: its prefix blocks (if any), each from the block's hash id, then the rest
/// from the request's own seed.
pub fn build(request_seed: u64, prompt_tokens: u64, blocks: &[u64], block_tokens: u64) -> String {
    let mut out = String::with_capacity(prompt_tokens as usize * 5);
    for (shared, n) in layout(prompt_tokens, blocks, block_tokens) {
        text(shared.unwrap_or(request_seed), n, &mut out);
    }
    out
}

/// A request's prompt as token ids, as a client with its own tokenizer sends it: exactly
/// `prompt_tokens` ids, laid out as [`build`] lays out text (each full prefix block from the
/// block's hash id, shared by every request that has the block; the rest from the request's
/// own seed).
pub fn ids(request_seed: u64, prompt_tokens: u64, blocks: &[u64], block_tokens: u64) -> Vec<u32> {
    let mut out = Vec::with_capacity(prompt_tokens as usize);
    let mut own = request_seed ^ 0x1d5;
    for (mut shared, n) in layout(prompt_tokens, blocks, block_tokens) {
        let state = match shared.as_mut() {
            Some(block) => block,
            None => &mut own,
        };
        // Ids of a 150k-token vocabulary, as today's tokenizers have.
        out.extend((0..n).map(|_| (next(state) % 150_000) as u32));
    }
    out
}

/// Image sizes a request's images are drawn from (photos, screenshots, scans).
const IMAGE_SIZES: [(u32, u32); 6] = [
    (640, 480),
    (1024, 768),
    (768, 1024),
    (1280, 720),
    (1920, 1080),
    (1000, 1400),
];

/// An image as a `data:` URL: a PNG signature and header of a size drawn from `IMAGE_SIZES`,
/// then 48 bytes of its own (a vision model's count reads the header; the rest only tells one
/// image from another), in base64.
pub fn image(seed: u64) -> String {
    let mut s = seed ^ 0x1a6e;
    let (w, h) = IMAGE_SIZES[(next(&mut s) % IMAGE_SIZES.len() as u64) as usize];
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    bytes.extend_from_slice(&w.to_be_bytes());
    bytes.extend_from_slice(&h.to_be_bytes());
    bytes.extend_from_slice(b"\x08\x02\0\0\0");
    for _ in 0..6 {
        bytes.extend_from_slice(&next(&mut s).to_le_bytes());
    }
    format!("data:image/png;base64,{}", base64(&bytes))
}

/// Standard base64, padded.
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let w = c
            .iter()
            .enumerate()
            .fold(0u32, |w, (k, b)| w | u32::from(*b) << (16 - 8 * k));
        for k in 0..4 {
            out.push(if k <= c.len() {
                char::from(A[((w >> (18 - 6 * k)) & 63) as usize])
            } else {
                '='
            });
        }
    }
    out
}

/// The shape a request's tools come in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolShape {
    /// OpenAI's chat: `{"type":"function","function":{name, description, parameters}}`.
    Chat,
    /// The Responses API's flat `{"type":"function", name, description, parameters}`.
    Responses,
    /// Anthropic's `{name, description, input_schema}`.
    Anthropic,
}

/// An agent's tool list: `n` function tools in `shape`, each a name, a description of about 40
/// words and a JSON schema of three string parameters, the same for every request (an agent
/// offers the same tools every turn).
pub fn tools(n: usize, shape: ToolShape) -> serde_json::Value {
    (0..n as u64)
        .map(|i| {
            let mut description = String::new();
            text(0x7001 ^ i.wrapping_mul(0x9e37), 52, &mut description);
            let mut properties = serde_json::Map::new();
            for p in 0..3u64 {
                let mut about = String::new();
                text(0x7002 ^ (i * 8 + p), 8, &mut about);
                properties.insert(
                    format!("arg{p}"),
                    serde_json::json!({"type": "string", "description": about.trim_end()}),
                );
            }
            let (name, description) = (format!("tool_{i}"), description.trim_end().to_string());
            let schema = serde_json::json!({"type": "object", "properties": properties,
                                            "required": ["arg0"]});
            match shape {
                ToolShape::Chat => serde_json::json!({"type": "function", "function": {
                    "name": name, "description": description, "parameters": schema}}),
                ToolShape::Responses => serde_json::json!({"type": "function", "name": name,
                    "description": description, "parameters": schema}),
                ToolShape::Anthropic => serde_json::json!({"name": name,
                    "description": description, "input_schema": schema}),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_pngs_of_the_listed_sizes_each_its_own() {
        assert_eq!(base64(b"Man"), "TWFu");
        assert_eq!(base64(b"Ma"), "TWE=");
        assert_eq!(base64(b"M"), "TQ==");
        let a = image(1);
        assert!(a.starts_with("data:image/png;base64,iVBORw0KGgo"), "{a}");
        assert_ne!(a, image(2));
        assert_eq!(a, image(1));
    }

    #[test]
    fn ids_are_as_many_as_asked_and_share_the_shared_blocks() {
        let a = ids(1, 1024 + 100, &[7, 8, 9], 512);
        let b = ids(2, 1024 + 50, &[7, 8, 10], 512);
        let c = ids(3, 1024, &[1, 2], 512);
        assert_eq!((a.len(), b.len(), c.len()), (1124, 1074, 1024));
        assert_eq!(a[..1024], b[..1024], "two shared blocks");
        assert_ne!(
            a[1024..1074],
            b[1024..],
            "a partial block is the request's own"
        );
        assert_ne!(a[..512], c[..512]);
        assert_eq!(ids(4, 10, &[], 512).len(), 10);
    }

    #[test]
    fn lengths_and_sharing() {
        let a = build(1, 1024 + 100, &[7, 8, 9], 512);
        let b = build(2, 1024 + 50, &[7, 8, 10], 512);
        let c = build(3, 1024, &[1, 2], 512);
        let shared = block_len(7) + block_len(8);
        assert_eq!(
            a[..shared],
            b[..shared],
            "equal hash ids give equal prefixes"
        );
        assert_ne!(a[..shared + 40], b[..shared + 40], "then they differ");
        assert_ne!(a[..block_len(7)], c[..block_len(7)]);
        // ~1.3 tokens a word: word count matches the token target.
        let words = build(4, 1300, &[], 512).split_whitespace().count();
        assert_eq!(words, 1000);
    }

    fn block_len(hash: u64) -> usize {
        let mut s = String::new();
        text(hash.wrapping_mul(0x1000_0000_01b3) ^ 0xb10c, 512, &mut s);
        s.len()
    }
}
