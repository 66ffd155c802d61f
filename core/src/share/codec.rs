//! The bytes of what the VMs share: the fleet snapshot, its version record and one node's
//! books, in a compact little-endian layout (see `share` for what each is for).
//!
//! Every read is checked: a truncated value, trailing bytes or a wrong magic is refused
//! whole (`Malformed`, `None`), never half read, and a count the bytes cannot hold sizes no
//! allocation. The books are 96 bytes, twelve `u64`s in the order of `Books`' fields; the
//! shorter books earlier builds wrote (64, 72 and 80 bytes, before `prefill_tokens`,
//! `ended_requests` and the started prompts' totals) are read with the missing figures at zero.

use crate::fleet::books::Books;
use crate::ingest::telemetry::Report;

/// The version record: which snapshot is current, and when the poller was last alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Version {
    pub version: u64,
    pub heartbeat_ms: u64,
}

impl Version {
    pub fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        let (a, b) = out.split_at_mut(8);
        a.copy_from_slice(&self.version.to_le_bytes());
        b.copy_from_slice(&self.heartbeat_ms.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Option<Version> {
        let mut r = Reader::new(bytes);
        let v = Version {
            version: r.u64()?,
            heartbeat_ms: r.u64()?,
        };
        r.done().then_some(v)
    }
}

/// One node as the poller sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NodeView {
    pub address: String,
    /// The last good report and when it was taken (ms).
    pub report: Option<(Report, u64)>,
    /// Grows with every report (see the epoch rule in the module comment).
    pub epoch: u64,
    pub ejected: bool,
    pub member: bool,
    /// The last good `/v1/models` list, and names seen in the metrics since.
    pub listed_models: Option<Vec<String>>,
    pub seen_models: Vec<String>,
    /// The node's engine serves any model name (see `fleet::models`).
    pub any_name: bool,
    /// The per-slot context its list gives, tokens.
    pub context_tokens: Option<u64>,
    /// How much longer than a tick the poller waits to poll the node again, for its quiet
    /// reports: its report stays fresh that much longer (`NodeState::fresh_until`).
    pub grace_ms: u64,
}

/// What the poller publishes: every node it follows, and what the fleet's engines' counters
/// say of the filter's prompt estimates (`route::prompt_scale::EngineCounts`), when known.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeView>,
    pub prompt_ratio: Option<f64>,
}

const MAGIC: &[u8; 4] = b"TBF3";
/// Snapshots of builds before the prompt ratio that follows the nodes: read without one.
const MAGIC_BEFORE_PROMPT_RATIO: &[u8; 4] = b"TBF2";
/// Snapshots of builds before a report's eighth figure (the sustained rate): read alike, since
/// they never set its bit. An older reader refuses the new magic rather than misread it.
const MAGIC_BEFORE_SUSTAINED: &[u8; 4] = b"TBF1";
const HAS_REPORT: u8 = 1;
const EJECTED: u8 = 2;
const MEMBER: u8 = 4;
const LISTED: u8 = 8;
const ANY_NAME: u8 = 16;
/// A context follows the node's model names (a bit an older reader does not set).
const CONTEXT: u8 = 32;
/// A poll grace follows (a bit an older writer does not set: read as none).
const GRACE: u8 = 64;

/// Little-endian cursor over a byte slice; every read is checked.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.bytes.len() < n {
            return None;
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1)?.first().copied()
    }

    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn f64(&mut self) -> Option<f64> {
        Some(f64::from_bits(self.u64()?))
    }

    pub(crate) fn str(&mut self) -> Option<String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }

    fn strs(&mut self) -> Option<Vec<String>> {
        let n = self.u16()? as usize;
        // Each name takes at least its 2-byte length: a count the bytes cannot hold is garbage
        // (and must not size an allocation).
        if n > self.bytes.len() / 2 {
            return None;
        }
        (0..n).map(|_| self.str()).collect()
    }

    fn done(&self) -> bool {
        self.bytes.is_empty()
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Addresses and model names are far below 64 KiB (models caps names at 512 bytes).
    let bytes = s.as_bytes();
    let n = bytes.len().min(u16::MAX as usize);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(bytes.get(..n).unwrap_or_default());
}

fn put_strs(out: &mut Vec<u8>, list: &[String]) {
    let n = list.len().min(u16::MAX as usize);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    for s in list.iter().take(n) {
        put_str(out, s);
    }
}

/// The report's optional figures, in the order of their bits in the mask.
fn optionals(r: &Report) -> [Option<f64>; 8] {
    [
        r.capacity_tokens_per_sec,
        r.vram_used_bytes,
        r.vram_total_bytes,
        r.kv_cache_usage,
        r.kv_cache_tokens,
        r.queue_depth,
        r.running_requests,
        r.sustained_tokens_per_sec,
    ]
}

/// Why a snapshot could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

impl Snapshot {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.nodes.len() * 96);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(self.nodes.len() as u32).to_le_bytes());
        for n in &self.nodes {
            put_str(&mut out, &n.address);
            let mut flags = 0;
            for (on, bit) in [
                (n.report.is_some(), HAS_REPORT),
                (n.ejected, EJECTED),
                (n.member, MEMBER),
                (n.listed_models.is_some(), LISTED),
                (n.any_name, ANY_NAME),
                (n.context_tokens.is_some(), CONTEXT),
                (n.grace_ms > 0, GRACE),
            ] {
                if on {
                    flags |= bit;
                }
            }
            out.push(flags);
            out.extend_from_slice(&n.epoch.to_le_bytes());
            if let Some((r, at)) = &n.report {
                out.extend_from_slice(&at.to_le_bytes());
                out.extend_from_slice(&r.load_tokens_per_sec.to_bits().to_le_bytes());
                let opts = optionals(r);
                let mut mask = 0u8;
                for (i, o) in opts.iter().enumerate() {
                    if o.is_some() {
                        mask |= 1 << i;
                    }
                }
                out.push(mask);
                for v in opts.iter().flatten() {
                    out.extend_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            if let Some(list) = &n.listed_models {
                put_strs(&mut out, list);
            }
            put_strs(&mut out, &n.seen_models);
            if let Some(c) = n.context_tokens {
                out.extend_from_slice(&c.to_le_bytes());
            }
            if n.grace_ms > 0 {
                let grace = u32::try_from(n.grace_ms).unwrap_or(u32::MAX);
                out.extend_from_slice(&grace.to_le_bytes());
            }
        }
        match self.prompt_ratio {
            Some(r) => {
                out.push(1);
                out.extend_from_slice(&r.to_bits().to_le_bytes());
            }
            None => out.push(0),
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Snapshot, Malformed> {
        Self::read(bytes).ok_or(Malformed)
    }

    fn read(bytes: &[u8]) -> Option<Snapshot> {
        let mut r = Reader::new(bytes);
        let magic = r.take(4)?;
        if magic != MAGIC && magic != MAGIC_BEFORE_PROMPT_RATIO && magic != MAGIC_BEFORE_SUSTAINED {
            return None;
        }
        let with_ratio = magic == MAGIC;
        let count = r.u32()? as usize;
        // A node takes at least 11 bytes.
        if count > bytes.len() / 11 {
            return None;
        }
        let mut nodes = Vec::with_capacity(count);
        for _ in 0..count {
            let address = r.str()?;
            let flags = r.u8()?;
            let epoch = r.u64()?;
            let report = if flags & HAS_REPORT != 0 {
                let at = r.u64()?;
                let load = r.f64()?;
                let mask = r.u8()?;
                let mut o = [None; 8];
                for (i, figure) in o.iter_mut().enumerate() {
                    if mask & (1 << i) != 0 {
                        *figure = Some(r.f64()?);
                    }
                }
                let [capacity, used, total, usage, kv_tokens, queue, running, sustained] = o;
                Some((
                    Report {
                        load_tokens_per_sec: load,
                        capacity_tokens_per_sec: capacity,
                        sustained_tokens_per_sec: sustained,
                        vram_used_bytes: used,
                        vram_total_bytes: total,
                        kv_cache_usage: usage,
                        kv_cache_tokens: kv_tokens,
                        queue_depth: queue,
                        running_requests: running,
                    },
                    at,
                ))
            } else {
                None
            };
            let listed_models = if flags & LISTED != 0 {
                Some(r.strs()?)
            } else {
                None
            };
            let seen_models = r.strs()?;
            let context_tokens = if flags & CONTEXT != 0 {
                Some(r.u64()?)
            } else {
                None
            };
            let grace_ms = if flags & GRACE != 0 {
                u64::from(r.u32()?)
            } else {
                0
            };
            nodes.push(NodeView {
                address,
                report,
                epoch,
                ejected: flags & EJECTED != 0,
                member: flags & MEMBER != 0,
                listed_models,
                seen_models,
                any_name: flags & ANY_NAME != 0,
                context_tokens,
                grace_ms,
            });
        }
        let prompt_ratio = match with_ratio {
            true => match r.u8()? {
                0 => None,
                1 => Some(r.f64()?).filter(|v| v.is_finite() && *v > 0.0),
                _ => return None,
            },
            false => None,
        };
        r.done().then_some(Snapshot {
            nodes,
            prompt_ratio,
        })
    }
}

/// Bytes of encoded books.
pub const BOOKS_LEN: usize = 96;
/// Bytes of books as builds before the started prompts' totals wrote them: read with none.
const BOOKS_LEN_BEFORE_STARTED: usize = 80;
/// Bytes of books as builds before `ended_requests` wrote them: read with none ended.
const BOOKS_LEN_BEFORE_ENDED: usize = 72;
/// Bytes of books as builds before `prefill_tokens` wrote them: read with no prefill.
const BOOKS_LEN_BEFORE_PREFILL: usize = 64;

impl Books {
    pub fn encode(&self) -> [u8; BOOKS_LEN] {
        let mut out = [0u8; BOOKS_LEN];
        for (chunk, v) in out.chunks_exact_mut(8).zip(self.fields()) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn fields(&self) -> [u64; 12] {
        [
            self.epoch,
            self.tenant,
            self.inflight_requests,
            self.inflight_tokens,
            self.unreflected_tokens,
            self.unreflected_requests,
            self.unreflected_prompt_tokens,
            self.growth_tokens,
            self.prefill_tokens,
            self.ended_requests,
            self.started_text_prompt,
            self.started_other_prompt,
        ]
    }

    pub fn decode(bytes: &[u8]) -> Option<Books> {
        let mut r = Reader::new(bytes);
        let b = Books {
            epoch: r.u64()?,
            tenant: r.u64()?,
            inflight_requests: r.u64()?,
            inflight_tokens: r.u64()?,
            unreflected_tokens: r.u64()?,
            unreflected_requests: r.u64()?,
            unreflected_prompt_tokens: r.u64()?,
            growth_tokens: r.u64()?,
            prefill_tokens: if bytes.len() == BOOKS_LEN_BEFORE_PREFILL {
                0
            } else {
                r.u64()?
            },
            ended_requests: if bytes.len() <= BOOKS_LEN_BEFORE_ENDED {
                0
            } else {
                r.u64()?
            },
            started_text_prompt: if bytes.len() <= BOOKS_LEN_BEFORE_STARTED {
                0
            } else {
                r.u64()?
            },
            started_other_prompt: if bytes.len() <= BOOKS_LEN_BEFORE_STARTED {
                0
            } else {
                r.u64()?
            },
        };
        r.done().then_some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_round_trip() {
        let b = Books {
            epoch: 7,
            tenant: 99,
            inflight_requests: 1,
            inflight_tokens: 2,
            unreflected_tokens: 3,
            unreflected_requests: 4,
            unreflected_prompt_tokens: 5,
            growth_tokens: u64::MAX,
            prefill_tokens: 6,
            ended_requests: 8,
            started_text_prompt: 9,
            started_other_prompt: 10,
        };
        assert_eq!(Books::decode(&b.encode()), Some(b));
        assert_eq!(Books::decode(&b.encode()[..BOOKS_LEN - 1]), None);
        // Books earlier builds wrote, without the started prompts' totals (and the ended
        // count, and the prefill): read with none.
        let unstarted = Books {
            started_text_prompt: 0,
            started_other_prompt: 0,
            ..b
        };
        assert_eq!(
            Books::decode(&b.encode()[..BOOKS_LEN_BEFORE_STARTED]),
            Some(unstarted)
        );
        assert_eq!(
            Books::decode(&b.encode()[..BOOKS_LEN_BEFORE_ENDED]),
            Some(Books {
                ended_requests: 0,
                ..unstarted
            })
        );
        assert_eq!(
            Books::decode(&b.encode()[..BOOKS_LEN_BEFORE_PREFILL]),
            Some(Books {
                prefill_tokens: 0,
                ended_requests: 0,
                ..unstarted
            })
        );
        // The layout other VMs read: twelve little-endian u64s, in order.
        let bytes = b.encode();
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(words, [7, 99, 1, 2, 3, 4, 5, u64::MAX, 6, 8, 9, 10]);
        let v = Version {
            version: 3,
            heartbeat_ms: 99,
        };
        assert_eq!(Version::decode(&v.encode()), Some(v));
        let snap = Snapshot {
            nodes: vec![
                NodeView {
                    address: "10.0.0.1:80".into(),
                    report: Some((
                        Report {
                            load_tokens_per_sec: 12.5,
                            capacity_tokens_per_sec: Some(1000.0),
                            sustained_tokens_per_sec: Some(400.0),
                            kv_cache_usage: Some(0.25),
                            running_requests: Some(3.0),
                            ..Report::default()
                        },
                        1234,
                    )),
                    epoch: 1_700_000_000_042,
                    ejected: true,
                    member: true,
                    listed_models: Some(vec!["m1".into(), "lora-é".into()]),
                    seen_models: vec!["hot".into()],
                    any_name: true,
                    context_tokens: Some(512),
                    grace_ms: 750,
                },
                NodeView {
                    address: "[::1]:8000".into(),
                    ..NodeView::default()
                },
            ],
            prompt_ratio: Some(1.3),
        };
        let bytes = snap.encode();
        assert_eq!(Snapshot::decode(&bytes), Ok(snap.clone()));
        let snap = Snapshot {
            prompt_ratio: None,
            ..snap
        };
        let unknown = snap.encode();
        assert_eq!(Snapshot::decode(&unknown), Ok(snap.clone()));
        // A ratio that is no ratio is read as none.
        let mut bad = bytes.clone();
        let at = bad.len() - 8;
        bad[at..].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        assert_eq!(Snapshot::decode(&bad), Ok(snap.clone()));
        // Any truncation, trailing garbage or wrong magic is refused, never half read.
        for n in 0..bytes.len() {
            assert_eq!(Snapshot::decode(&bytes[..n]), Err(Malformed), "{n}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(Snapshot::decode(&long), Err(Malformed));
        assert_eq!(Snapshot::decode(b"TBF4\0\0\0\0"), Err(Malformed));
        // A count the bytes cannot hold allocates nothing.
        assert_eq!(Snapshot::decode(b"TBF2\xff\xff\xff\xff"), Err(Malformed));
        // A snapshot of a build before the sustained rate (which never set its bit) reads.
        let mut older = snap.clone();
        if let Some((r, _)) = older.nodes.first_mut().and_then(|n| n.report.as_mut()) {
            r.sustained_tokens_per_sec = None;
        }
        // Snapshots of builds before the prompt ratio end with the nodes.
        let before_ratio = &unknown[..unknown.len() - 1];
        let mut old_bytes = before_ratio.to_vec();
        old_bytes[..4].copy_from_slice(b"TBF2");
        assert_eq!(Snapshot::decode(&old_bytes), Ok(snap.clone()));
        let mut old_bytes = older.encode();
        old_bytes.pop();
        old_bytes[..4].copy_from_slice(b"TBF1");
        assert_eq!(Snapshot::decode(&old_bytes), Ok(older));
        // A grace past what four bytes hold is written as the most they hold.
        let mut far = Snapshot {
            nodes: vec![NodeView {
                address: "n".into(),
                grace_ms: u64::MAX,
                ..NodeView::default()
            }],
            prompt_ratio: None,
        };
        let read = Snapshot::decode(&far.encode());
        if let Some(n) = far.nodes.first_mut() {
            n.grace_ms = u64::from(u32::MAX);
        }
        assert_eq!(read, Ok(far));
    }

    fn fleet(n: usize) -> Snapshot {
        Snapshot {
            nodes: (0..n)
                .map(|i| NodeView {
                    address: format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
                    report: Some((
                        Report {
                            load_tokens_per_sec: i as f64,
                            capacity_tokens_per_sec: Some(40_000.0),
                            vram_used_bytes: Some(1e9),
                            vram_total_bytes: Some(8e10),
                            queue_depth: Some(2.0),
                            running_requests: Some(17.0),
                            ..Report::default()
                        },
                        1_700_000_000_000,
                    )),
                    epoch: 1_700_000_000_000 + i as u64,
                    ejected: false,
                    member: true,
                    listed_models: Some(vec!["meta-llama/Llama-3.1-8B-Instruct".into()]),
                    seen_models: vec![],
                    any_name: false,
                    context_tokens: None,
                    grace_ms: 0,
                })
                .collect(),
            prompt_ratio: None,
        }
    }

    /// Decode cost of a 1,000-node snapshot: `cargo test --release decode_cost -- --ignored
    /// --nocapture`.
    #[test]
    #[ignore]
    fn decode_cost_of_a_thousand_nodes() {
        let bytes = fleet(1000).encode();
        let rounds = 200;
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            let s = Snapshot::decode(std::hint::black_box(&bytes)).unwrap();
            std::hint::black_box(s);
        }
        let each = start.elapsed() / rounds;
        println!("1000 nodes: {} bytes, decode {:?}", bytes.len(), each);
    }

    #[test]
    fn a_thousand_nodes_round_trip() {
        let f = fleet(1000);
        let bytes = f.encode();
        assert!(bytes.len() < 1000 * 160, "{}", bytes.len());
        assert_eq!(Snapshot::decode(&bytes), Ok(f));
    }
}
