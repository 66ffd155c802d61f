//! State shared by every VM of one Envoy process: the fleet snapshot the poller publishes and
//! the in-flight books all workers write.
//!
//! Envoy runs one Wasm VM per worker thread plus one on the main thread, and each VM has its
//! own memory. Left alone, every VM polls every node (five polls per tick with four workers)
//! and counts only its own dispatches, so a worker cannot see what the other workers sent a
//! node since its last report: the herding the in-flight books exist to stop comes back, one
//! worker at a time. proxy-wasm's shared data (a key-value store per `vm_id`, with a
//! compare-and-swap token per key) is the one memory all of them see. This module is what goes
//! into it, and the rules for changing it, as plain Rust behind the narrow `Store` trait.
//!
//! - **The fleet snapshot** (`Snapshot`, under `FLEET_KEY`): per node its last good report and
//!   when it was taken, its report epoch, whether it is ejected or out of the cluster, and what
//!   is known of its models. One writer (the poller service) replaces it whole; readers (the
//!   filter VMs) re-read it only when the small version record under `VERSION_KEY` changes,
//!   which they check once per request and per tick. The version record also carries the
//!   poller's heartbeat, written every tick, so a reader tells a dead poller from a quiet fleet.
//!   The encoding is a compact binary layout (about 120 bytes a node): decoding 1,000 nodes
//!   (120 KB) takes about 0.16 ms natively and 0.67 ms as wasm32-wasip1 under Node's V8,
//!   release builds (`decode_cost_of_a_thousand_nodes`, run with `--ignored`).
//! - **The books** (`Books`, one key per slot of the poller's fleet, `books_key`): in-flight
//!   requests and tokens, the unreflected part (dispatched since the report of `epoch`) and
//!   the KV growth still to come. Every VM read-modify-writes them with CAS (`Ledger::update`),
//!   retrying up to `MAX_CAS_RETRIES` times. No key per request or per address: a slot is a
//!   node's index in the snapshot, at most `balancer::MAX_NODES` of them, and a slot freed by a
//!   node that left the cluster is reused for the next new one once its books are empty.
//! - **The tenant rule**: books carry the address they count for (`node::tenant_of`), and
//!   the poller claims a reused slot's books for the new address (`ensure_books`) before it
//!   publishes the snapshot showing it. A change booked for the former address (a release
//!   that was kept for later, a worker whose snapshot is older) finds another tenant and is
//!   dropped (`Written::Gone`): it can never land on the new node's books.
//! - **The epoch rule**: a node's report epoch grows with every report the poller takes. When
//!   an update finds the snapshot's epoch newer than the books', the unreflected part resets
//!   (that report now reflects that work) before the change applies; a change's unreflected
//!   part applies only if the books are at the epoch it was booked at. So a release never
//!   takes away work a newer report already cleared.
//!
//! Changes are signed deltas (`Change`), so a change that could not be written (retries
//! exhausted, key missing, host error) is kept in the VM (`Ledger`'s pending changes), merged
//! into the next write to that node and retried on every tick: nothing is lost, and when every
//! dispatch is released the books are exactly zero again. What that costs: until the pending
//! change is written, the other workers do not see it (they decide on books that miss it, as
//! every VM did before shared books), and this VM sees it only in its own view (`view` adds
//! its pending changes).

pub mod sync;

use crate::fleet::node::Ticket;
use crate::ingest::telemetry::Report;
use std::collections::HashMap;

/// Root id of the poller service: the bootstrap extension loads the same `.wasm` with this
/// `root_id`, and the plugin tells its role by its `plugin_root_id` property.
pub const POLLER_ROOT_ID: &str = "token_balancer_poller";
/// Key of the fleet snapshot.
pub const FLEET_KEY: &str = "token_balancer.fleet";
/// Key of the snapshot's version record (`Version`).
pub const VERSION_KEY: &str = "token_balancer.fleet.version";
/// Compare-and-swap attempts after the first before a change is kept for later.
pub const MAX_CAS_RETRIES: u32 = 8;

/// The books of the node in slot `slot` of the poller's fleet (its index in the snapshot) live
/// under this key. Keys are per slot, not per address: Envoy's shared data cannot delete a key,
/// so keys named after addresses would grow with every pod ever replaced, while slots are
/// reused (`Balancer::set_members`) and bounded by `balancer::MAX_NODES`.
pub fn books_key(slot: usize) -> String {
    format!("token_balancer.books.{slot}")
}

/// A host call to the store failed (not a CAS mismatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFailed;

/// Why a write did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetError {
    /// The value changed since it was read (its CAS token no longer matches).
    CasMismatch,
    Failed,
}

/// proxy-wasm shared data, as this module needs it.
/// A value read from the store, with the CAS token it was read at.
pub type Read = (Vec<u8>, u32);

pub trait Store {
    /// The value under `key` with its CAS token; `Ok(None)` when there is none.
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed>;
    /// Writes `value` under `key` if its CAS token is still `cas` (`None`: unconditionally).
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError>;
}

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
}

/// What the poller publishes: every node it follows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeView>,
}

const MAGIC: &[u8; 4] = b"TBF1";
const HAS_REPORT: u8 = 1;
const EJECTED: u8 = 2;
const MEMBER: u8 = 4;
const LISTED: u8 = 8;

/// Little-endian cursor over a byte slice; every read is checked.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
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

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn f64(&mut self) -> Option<f64> {
        Some(f64::from_bits(self.u64()?))
    }

    fn str(&mut self) -> Option<String> {
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
fn optionals(r: &Report) -> [Option<f64>; 7] {
    [
        r.capacity_tokens_per_sec,
        r.vram_used_bytes,
        r.vram_total_bytes,
        r.kv_cache_usage,
        r.kv_cache_tokens,
        r.queue_depth,
        r.running_requests,
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
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Snapshot, Malformed> {
        Self::read(bytes).ok_or(Malformed)
    }

    fn read(bytes: &[u8]) -> Option<Snapshot> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != MAGIC {
            return None;
        }
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
                let mut o = [None; 7];
                for (i, slot) in o.iter_mut().enumerate() {
                    if mask & (1 << i) != 0 {
                        *slot = Some(r.f64()?);
                    }
                }
                let [capacity, used, total, usage, kv_tokens, queue, running] = o;
                Some((
                    Report {
                        load_tokens_per_sec: load,
                        capacity_tokens_per_sec: capacity,
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
            nodes.push(NodeView {
                address,
                report,
                epoch,
                ejected: flags & EJECTED != 0,
                member: flags & MEMBER != 0,
                listed_models,
                seen_models,
            });
        }
        r.done().then_some(Snapshot { nodes })
    }
}

/// One node's in-flight books, as every worker of the Envoy sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Books {
    /// The report epoch the unreflected part belongs to.
    pub epoch: u64,
    /// The address these books count for (`node::tenant_of`): a change booked for another
    /// tenant of the slot is dropped, since its node has left and its work with it.
    pub tenant: u64,
    pub inflight_requests: u64,
    pub inflight_tokens: u64,
    pub unreflected_tokens: u64,
    pub unreflected_requests: u64,
    pub unreflected_prompt_tokens: u64,
    pub growth_tokens: u64,
}

/// Bytes of encoded books.
pub const BOOKS_LEN: usize = 64;

fn add(v: u64, d: i64) -> u64 {
    if d >= 0 {
        v.saturating_add(d as u64)
    } else {
        v.saturating_sub(d.unsigned_abs())
    }
}

impl Books {
    pub fn encode(&self) -> [u8; BOOKS_LEN] {
        let mut out = [0u8; BOOKS_LEN];
        for (chunk, v) in out.chunks_exact_mut(8).zip(self.fields()) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn fields(&self) -> [u64; 8] {
        [
            self.epoch,
            self.tenant,
            self.inflight_requests,
            self.inflight_tokens,
            self.unreflected_tokens,
            self.unreflected_requests,
            self.unreflected_prompt_tokens,
            self.growth_tokens,
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
        };
        r.done().then_some(b)
    }

    /// The epoch rule: a report newer than the books' epoch reflects their unreflected part.
    pub fn at_epoch(mut self, report_epoch: u64) -> Books {
        if report_epoch > self.epoch {
            self.epoch = report_epoch;
            self.unreflected_tokens = 0;
            self.unreflected_requests = 0;
            self.unreflected_prompt_tokens = 0;
        }
        self
    }

    /// The books after `c` (whose unreflected part counts only at the books' epoch).
    pub fn apply(mut self, c: &Change) -> Books {
        self.inflight_requests = add(self.inflight_requests, c.requests);
        self.inflight_tokens = add(self.inflight_tokens, c.tokens);
        self.growth_tokens = add(self.growth_tokens, c.growth);
        if let Some(u) = &c.unreflected {
            if u.epoch == self.epoch {
                self.unreflected_requests = add(self.unreflected_requests, u.requests);
                self.unreflected_tokens = add(self.unreflected_tokens, u.tokens);
                self.unreflected_prompt_tokens =
                    add(self.unreflected_prompt_tokens, u.prompt_tokens);
            }
        }
        self
    }

    /// Nothing in flight, nothing unreflected (the epoch and tenant aside).
    pub fn is_zero(&self) -> bool {
        self.fields().iter().skip(2).all(|&v| v == 0)
    }

    /// Empty books of `tenant`.
    pub fn of(tenant: u64) -> Books {
        Books {
            tenant,
            ..Books::default()
        }
    }
}

/// The unreflected part of a change and the epoch it was booked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreflected {
    pub epoch: u64,
    pub requests: i64,
    pub tokens: i64,
    pub prompt_tokens: i64,
}

/// A change to one node's books, as signed deltas: changes add up, so one that could not be
/// written merges with the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Change {
    pub requests: i64,
    pub tokens: i64,
    pub growth: i64,
    pub unreflected: Option<Unreflected>,
}

fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Change {
    /// The request of `ticket` was dispatched (as `NodeState::dispatch_reserving` books it).
    pub fn dispatch(t: &Ticket) -> Change {
        let tokens = signed(t.weight.total());
        Change {
            requests: 1,
            tokens,
            growth: signed(t.reserved_output),
            unreflected: Some(Unreflected {
                epoch: t.epoch,
                requests: 1,
                tokens,
                prompt_tokens: signed(t.weight.prompt_tokens),
            }),
        }
    }

    /// Its stream went from `before` to `after` output tokens (`NodeState::progress`).
    pub fn progress(t: &Ticket, before: u64, after: u64) -> Change {
        let r = t.reserved_output;
        let done = after.min(r).saturating_sub(before.min(r));
        Change {
            growth: -signed(done),
            ..Change::default()
        }
    }

    /// Its stream ended; `received` is the output count the last progress was written with
    /// (`NodeState::release`).
    pub fn release(t: &Ticket, received: u64) -> Change {
        let tokens = signed(t.weight.total());
        Change {
            requests: -1,
            tokens: -tokens,
            growth: -signed(t.reserved_output.saturating_sub(received)),
            unreflected: Some(Unreflected {
                epoch: t.epoch,
                requests: -1,
                tokens: -tokens,
                prompt_tokens: -signed(t.weight.prompt_tokens),
            }),
        }
    }

    /// Both changes, as one. Of two unreflected parts at different epochs only the newer is
    /// kept: the older could only apply to books still at its epoch, and the books have
    /// passed it by the time the newer one was booked (epochs never go back).
    pub fn merge(self, o: Change) -> Change {
        let unreflected = match (self.unreflected, o.unreflected) {
            (Some(a), Some(b)) if a.epoch == b.epoch => Some(Unreflected {
                epoch: a.epoch,
                requests: a.requests.saturating_add(b.requests),
                tokens: a.tokens.saturating_add(b.tokens),
                prompt_tokens: a.prompt_tokens.saturating_add(b.prompt_tokens),
            }),
            (Some(a), Some(b)) => Some(if a.epoch > b.epoch { a } else { b }),
            (a, b) => a.or(b),
        };
        Change {
            requests: self.requests.saturating_add(o.requests),
            tokens: self.tokens.saturating_add(o.tokens),
            growth: self.growth.saturating_add(o.growth),
            unreflected,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.requests == 0
            && self.tokens == 0
            && self.growth == 0
            && self.unreflected.map_or(true, |u| {
                u.requests == 0 && u.tokens == 0 && u.prompt_tokens == 0
            })
    }
}

/// What became of one update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Written after `retries` CAS mismatches; the books as they now stand.
    Yes { books: Books, retries: u32 },
    /// Every attempt met a CAS mismatch: the change is kept for later.
    Exhausted,
    /// The node has no books yet (the poller creates them): kept for later.
    Missing,
    /// The slot now counts for another address: the change's node has left, and the change
    /// is dropped with it.
    Gone,
    /// A host call failed, or the stored books are unreadable: kept for later.
    Failed,
}

/// One VM's side of the books: the changes it could not write yet, per key, with the tenant
/// they were booked for.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    pending: HashMap<String, (u64, Change)>,
}

impl Ledger {
    /// Applies `change` (with whatever this VM still owes `key`) to the shared books of `key`,
    /// whose node's latest report epoch this VM knows is `report_epoch`.
    pub fn update<S: Store>(
        &mut self,
        store: &mut S,
        key: &str,
        tenant: u64,
        report_epoch: u64,
        change: Change,
    ) -> Written {
        self.update_known(store, key, tenant, report_epoch, change, None)
    }

    /// `update`, starting from `known`, a read of `key` (value and CAS token) this VM has just
    /// made, instead of reading it again: a decision has read the chosen node's books already,
    /// and the dispatch then costs one host call, not two. If another worker wrote since, the
    /// CAS token no longer matches and the write starts over from a fresh read.
    pub fn update_known<S: Store>(
        &mut self,
        store: &mut S,
        key: &str,
        tenant: u64,
        report_epoch: u64,
        change: Change,
        known: Option<Read>,
    ) -> Written {
        // What is still owed to a former tenant of the slot left with it.
        let change = match self.pending.remove(key) {
            Some((t, p)) if t == tenant => p.merge(change),
            _ => change,
        };
        let written = write(store, key, tenant, report_epoch, &change, known);
        if !matches!(written, Written::Yes { .. } | Written::Gone) && !change.is_empty() {
            self.pending.insert(key.to_string(), (tenant, change));
        }
        written
    }

    /// Tries again every change kept for later; `epoch_of` gives each key's report epoch.
    /// Returns what became of each attempt.
    pub fn flush<S: Store>(
        &mut self,
        store: &mut S,
        epoch_of: impl Fn(&str) -> u64,
    ) -> Vec<Written> {
        let keys: Vec<(String, u64)> = self
            .pending
            .iter()
            .map(|(k, (t, _))| (k.clone(), *t))
            .collect();
        keys.iter()
            .map(|(k, t)| self.update(store, k, *t, epoch_of(k), Change::default()))
            .collect()
    }

    /// The books of `key` as this VM should see them: the shared ones under the epoch rule,
    /// plus what this VM has not written yet. `None` when the store has none or cannot say.
    pub fn view<S: Store>(
        &self,
        store: &mut S,
        key: &str,
        tenant: u64,
        report_epoch: u64,
    ) -> Option<Books> {
        self.view_read(store, key, tenant, report_epoch)
            .map(|(books, _)| books)
    }

    /// `view`, with the read it was made from (value and CAS token, `None` when the store had
    /// no books or they count for another tenant), for `update_known`. Books of another
    /// tenant (this VM's snapshot is older than the slot's reuse) count as empty: the node
    /// this VM means has left, and nothing of it was in flight when its slot was reused.
    pub fn view_read<S: Store>(
        &self,
        store: &mut S,
        key: &str,
        tenant: u64,
        report_epoch: u64,
    ) -> Option<(Books, Option<Read>)> {
        let mut read = match store.get(key) {
            Ok(r) => r,
            Err(StoreFailed) => return None,
        };
        let shared = match &read {
            Some((bytes, _)) => Books::decode(bytes)?,
            None => Books::of(tenant),
        };
        let shared = if shared.tenant == tenant {
            shared.at_epoch(report_epoch)
        } else {
            read = None;
            Books::of(tenant).at_epoch(report_epoch)
        };
        let books = match self.pending.get(key) {
            Some((t, p)) if *t == tenant => shared.apply(p),
            _ => shared,
        };
        Some((books, read))
    }

    /// Changes not written yet (nodes).
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

/// Makes the books of `key` count for `tenant`: kept if they already do, else (absent, of
/// another address, unreadable) replaced by empty books of `tenant`. Returns whether it wrote.
/// The poller does this for every node before any worker routes to it, and again when a slot
/// is reused for a new address; workers never create books (two creating at once could each
/// overwrite the other's first change).
pub fn ensure_books<S: Store>(store: &mut S, key: &str, tenant: u64) -> Result<bool, StoreFailed> {
    for _ in 0..=MAX_CAS_RETRIES {
        let cas = match store.get(key)? {
            Some((bytes, cas)) => {
                if Books::decode(&bytes).is_some_and(|b| b.tenant == tenant) {
                    return Ok(false);
                }
                Some(cas)
            }
            None => None,
        };
        match store.set(key, &Books::of(tenant).encode(), cas) {
            Ok(()) => return Ok(true),
            // A worker's last write for the former tenant came in between: read again.
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return Err(StoreFailed),
        }
    }
    Err(StoreFailed)
}

/// Sums of every node's books (for the gauges the poller publishes).
pub fn totals<'k, S: Store>(store: &mut S, keys: impl IntoIterator<Item = &'k str>) -> Books {
    let mut sum = Books::default();
    for k in keys {
        if let Ok(Some((bytes, _))) = store.get(k) {
            if let Some(b) = Books::decode(&bytes) {
                sum.inflight_requests += b.inflight_requests;
                sum.inflight_tokens += b.inflight_tokens;
                sum.unreflected_tokens += b.unreflected_tokens;
                sum.unreflected_requests += b.unreflected_requests;
                sum.unreflected_prompt_tokens += b.unreflected_prompt_tokens;
                sum.growth_tokens += b.growth_tokens;
            }
        }
    }
    sum
}

fn write<S: Store>(
    store: &mut S,
    key: &str,
    tenant: u64,
    report_epoch: u64,
    change: &Change,
    mut known: Option<Read>,
) -> Written {
    for retries in 0..=MAX_CAS_RETRIES {
        let read = match known.take() {
            Some(k) => Ok(Some(k)),
            None => store.get(key),
        };
        let (books, cas) = match read {
            Ok(Some((bytes, cas))) => match Books::decode(&bytes) {
                Some(b) if b.tenant != tenant => return Written::Gone,
                Some(b) => (b, cas),
                None => return Written::Failed,
            },
            Ok(None) => return Written::Missing,
            Err(StoreFailed) => return Written::Failed,
        };
        let next = books.at_epoch(report_epoch).apply(change);
        match store.set(key, &next.encode(), Some(cas)) {
            Ok(()) => {
                return Written::Yes {
                    books: next,
                    retries,
                }
            }
            Err(SetError::CasMismatch) => continue,
            Err(SetError::Failed) => return Written::Failed,
        }
    }
    Written::Exhausted
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::request::Weight;

    /// Envoy's shared data, as the host implements it: a CAS token per key that changes on
    /// every write. `interfere` runs before a write and may change the store behind the
    /// writer's back (another worker); `fail` makes host calls fail.
    type Data = HashMap<String, (Vec<u8>, u32)>;
    /// Another worker's writes, slipped in before one of ours.
    type Interference = Box<dyn FnMut(&mut Data, &mut u32)>;

    #[derive(Default)]
    struct FakeStore {
        data: Data,
        next_cas: u32,
        interfere: Option<Interference>,
        fail: bool,
        calls: usize,
    }

    impl Store for FakeStore {
        fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreFailed> {
            self.calls += 1;
            if self.fail {
                return Err(StoreFailed);
            }
            Ok(self.data.get(key).cloned())
        }

        fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), SetError> {
            self.calls += 1;
            if self.fail {
                return Err(SetError::Failed);
            }
            if let Some(f) = self.interfere.as_mut() {
                f(&mut self.data, &mut self.next_cas);
            }
            if let (Some(cas), Some((_, now))) = (cas, self.data.get(key)) {
                if cas != *now {
                    return Err(SetError::CasMismatch);
                }
            }
            self.next_cas += 1;
            self.data
                .insert(key.to_string(), (value.to_vec(), self.next_cas));
            Ok(())
        }
    }

    fn shared(store: &mut FakeStore, key: &str) -> Books {
        Books::decode(&store.data[key].0).unwrap()
    }

    fn ticket(epoch: u64, p: u64, o: u64) -> Ticket {
        Ticket {
            node: 0,
            tenant: T,
            epoch,
            weight: Weight {
                prompt_tokens: p,
                output_tokens: o,
            },
            reserved_output: o + 10,
        }
    }

    const K: &str = "token_balancer.books.0";
    /// The tenant of slot 0 in these tests.
    const T: u64 = 7;

    fn store_with_books() -> FakeStore {
        let mut s = FakeStore::default();
        assert_eq!(ensure_books(&mut s, K, T), Ok(true));
        assert_eq!(ensure_books(&mut s, K, T), Ok(false), "never overwritten");
        s
    }

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
        };
        assert_eq!(Books::decode(&b.encode()), Some(b));
        assert_eq!(Books::decode(&b.encode()[..BOOKS_LEN - 1]), None);
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
                },
                NodeView {
                    address: "[::1]:8000".into(),
                    ..NodeView::default()
                },
            ],
        };
        let bytes = snap.encode();
        assert_eq!(Snapshot::decode(&bytes), Ok(snap.clone()));
        // Any truncation, trailing garbage or wrong magic is refused, never half read.
        for n in 0..bytes.len() {
            assert_eq!(Snapshot::decode(&bytes[..n]), Err(Malformed), "{n}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(Snapshot::decode(&long), Err(Malformed));
        assert_eq!(Snapshot::decode(b"TBF2\0\0\0\0"), Err(Malformed));
        // A count the bytes cannot hold allocates nothing.
        assert_eq!(Snapshot::decode(b"TBF1\xff\xff\xff\xff"), Err(Malformed));
    }

    /// (epoch of the books, report epoch the writer knows, change booked at epoch, expected
    /// unreflected requests after the write) for one dispatch on books holding 2 unreflected.
    #[test]
    fn epoch_rule_table() {
        let cases: &[(&str, u64, u64, u64, u64)] = &[
            ("same epoch: adds", 5, 5, 5, 3),
            (
                "a newer report resets, then the dispatch counts at it",
                5,
                6,
                6,
                1,
            ),
            (
                "a newer report resets; a dispatch booked before it is in it",
                5,
                6,
                5,
                0,
            ),
            (
                "the writer knows an older report: the books' epoch stands",
                6,
                5,
                6,
                3,
            ),
            (
                "a dispatch from an older epoch is already reflected",
                6,
                5,
                5,
                2,
            ),
        ];
        for (what, books_epoch, report_epoch, booked_at, want) in cases {
            let mut s = store_with_books();
            let start = Books {
                epoch: *books_epoch,
                tenant: T,
                inflight_requests: 2,
                unreflected_requests: 2,
                unreflected_tokens: 20,
                ..Books::default()
            };
            s.set(K, &start.encode(), None).unwrap();
            let mut l = Ledger::default();
            let w = l.update(
                &mut s,
                K,
                T,
                *report_epoch,
                Change::dispatch(&ticket(*booked_at, 5, 5)),
            );
            assert!(
                matches!(w, Written::Yes { retries: 0, .. }),
                "{what}: {w:?}"
            );
            let b = shared(&mut s, K);
            assert_eq!(b.unreflected_requests, *want, "{what}");
            assert_eq!(b.inflight_requests, 3, "{what}: in flight never resets");
            assert_eq!(b.epoch, (*books_epoch).max(*report_epoch), "{what}");
        }
    }

    #[test]
    fn a_release_takes_back_only_what_no_report_has_cleared() {
        let mut s = store_with_books();
        let mut l = Ledger::default();
        let a = ticket(1, 100, 50);
        let b = ticket(1, 10, 5);
        l.update(&mut s, K, T, 1, Change::dispatch(&a));
        l.update(&mut s, K, T, 1, Change::dispatch(&b));
        assert_eq!(shared(&mut s, K).unreflected_tokens, 165);
        // A report (epoch 2) covers both; a is released after it, b before any new one.
        l.update(&mut s, K, T, 2, Change::release(&a, 0));
        let now = shared(&mut s, K);
        assert_eq!((now.unreflected_tokens, now.inflight_tokens), (0, 15));
        let c = ticket(2, 1, 1);
        l.update(&mut s, K, T, 2, Change::dispatch(&c));
        l.update(&mut s, K, T, 2, Change::release(&b, 0));
        assert_eq!(shared(&mut s, K).unreflected_tokens, 2, "c's stays");
        l.update(&mut s, K, T, 2, Change::release(&c, 0));
        assert!(shared(&mut s, K).is_zero());
    }

    /// A dispatch written from the read its decision made costs one host call; a read that
    /// another worker's write made stale costs the retry, and nothing is lost.
    #[test]
    fn a_write_from_a_known_read_skips_the_second_read() {
        let cases: &[(bool, usize, u32)] = &[(false, 1, 0), (true, 3, 1)];
        for &(stale, calls, retries) in cases {
            let mut s = store_with_books();
            let mut l = Ledger::default();
            let (books, read) = l.view_read(&mut s, K, T, 0).unwrap();
            assert!(books.is_zero());
            if stale {
                l.update(&mut s, K, T, 0, Change::dispatch(&ticket(0, 1, 1)));
            }
            s.calls = 0;
            let w = l.update_known(&mut s, K, T, 0, Change::dispatch(&ticket(0, 10, 10)), read);
            assert!(
                matches!(w, Written::Yes { retries: r, .. } if r == retries),
                "{stale}: {w:?}"
            );
            assert_eq!(s.calls, calls, "{stale}");
            let b = shared(&mut s, K);
            assert_eq!(b.inflight_requests, 1 + u64::from(stale), "{stale}");
        }
    }

    /// Two workers interleave read-modify-writes on one node: every write whose CAS token is
    /// stale is retried, and nothing is lost.
    #[test]
    fn contention_is_retried_and_nothing_is_lost() {
        // (writes the other worker slips in before each of ours, CAS mismatches expected on our
        // first write, whether it is written or kept for later)
        let cases: &[(u32, u32, bool)] = &[(0, 0, true), (1, 1, true), (8, 8, true), (9, 0, false)];
        for &(slips, want_retries, written) in cases {
            let mut s = store_with_books();
            let left = std::rc::Rc::new(std::cell::Cell::new(slips));
            let other = std::rc::Rc::clone(&left);
            // The other worker dispatches one request (1 + 1 tokens) per slip.
            s.interfere = Some(Box::new(move |data, cas| {
                if other.get() > 0 {
                    other.set(other.get() - 1);
                    let (bytes, _) = &data[K];
                    let b = Books::decode(bytes)
                        .unwrap()
                        .apply(&Change::dispatch(&ticket(0, 1, 1)));
                    *cas += 1;
                    data.insert(K.to_string(), (b.encode().to_vec(), *cas));
                }
            }));
            let mut l = Ledger::default();
            let w = l.update(&mut s, K, T, 0, Change::dispatch(&ticket(0, 10, 10)));
            match w {
                Written::Yes { retries, .. } => {
                    assert!(written, "{slips}");
                    assert_eq!(retries, want_retries, "{slips}");
                }
                Written::Exhausted => assert!(!written, "{slips}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(l.pending(), usize::from(!written));
            // Our view counts the kept change; a flush writes it once the contention is over.
            let view = l.view(&mut s, K, T, 0).unwrap();
            assert_eq!(view.inflight_requests, u64::from(slips) + 1, "{slips}");
            s.interfere = None;
            let flushed = l.flush(&mut s, |_| 0);
            assert_eq!(flushed.len(), usize::from(!written));
            assert_eq!(l.pending(), 0);
            let b = shared(&mut s, K);
            assert_eq!(b.inflight_requests, u64::from(slips) + 1, "{slips}");
            assert_eq!(b.inflight_tokens, u64::from(slips) * 2 + 20, "{slips}");
        }
    }

    #[test]
    fn missing_books_or_a_failing_host_keep_the_change() {
        let mut s = FakeStore::default();
        let mut l = Ledger::default();
        let t = ticket(0, 10, 10);
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&t)),
            Written::Missing
        );
        assert_eq!(l.view(&mut s, K, T, 0).unwrap().inflight_requests, 1);
        s.fail = true;
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::progress(&t, 0, 4)),
            Written::Failed
        );
        assert_eq!(l.view(&mut s, K, T, 0), None);
        s.fail = false;
        ensure_books(&mut s, K, T).unwrap();
        // The release merges with the kept dispatch and progress: they cancel out.
        let w = l.update(&mut s, K, T, 0, Change::release(&t, 4));
        assert!(
            matches!(w, Written::Yes { books, .. } if books.is_zero()),
            "{w:?}"
        );
        assert_eq!(l.pending(), 0);
        // Unreadable books are not overwritten.
        s.set(K, b"junk", None).unwrap();
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&t)),
            Written::Failed
        );
        assert_eq!(s.data[K].0, b"junk");
    }

    /// Conservation: two workers dispatch, progress and release many requests in an
    /// interleaved order while reports come and contention forces retries and kept changes;
    /// once everything is released and flushed, the books are exactly zero.
    #[test]
    fn books_return_to_zero_after_every_dispatch_is_released() {
        use crate::rng::{Rng, SplitMix64};
        let mut rng = SplitMix64::new(42);
        let mut s = store_with_books();
        let contention = std::rc::Rc::new(std::cell::Cell::new(0u32));
        let c2 = std::rc::Rc::clone(&contention);
        // Contention: bumps the CAS token (a write of the same value) while `c2` is set.
        s.interfere = Some(Box::new(move |data, cas| {
            if c2.get() > 0 {
                c2.set(c2.get() - 1);
                *cas += 1;
                if let Some(v) = data.get_mut(K) {
                    v.1 = *cas;
                }
            }
        }));
        let mut workers = [Ledger::default(), Ledger::default()];
        let mut open: Vec<(usize, Ticket, u64)> = Vec::new();
        let mut report_epoch = 0u64;
        let mut exhausted = 0;
        for step in 0..4000 {
            let w = (rng.next_u64() % 2) as usize;
            let roll = rng.next_u64() % 100;
            if roll < 3 {
                report_epoch += 1;
                continue;
            }
            if roll < 6 {
                contention.set(12);
            }
            let ledger = &mut workers[w];
            let result = if roll < 45 || open.is_empty() {
                let epoch = ledger.view(&mut s, K, T, report_epoch).unwrap().epoch;
                let t = ticket(epoch, rng.next_u64() % 1000, rng.next_u64() % 300);
                open.push((w, t, 0));
                ledger.update(&mut s, K, T, report_epoch, Change::dispatch(&t))
            } else {
                let i = (rng.next_u64() as usize) % open.len();
                let (owner, t, got) = open[i];
                let ledger = &mut workers[owner];
                if roll < 75 {
                    let after = got + rng.next_u64() % 50;
                    open[i].2 = after;
                    ledger.update(&mut s, K, T, report_epoch, Change::progress(&t, got, after))
                } else {
                    open.swap_remove(i);
                    ledger.update(&mut s, K, T, report_epoch, Change::release(&t, got))
                }
            };
            if result == Written::Exhausted {
                exhausted += 1;
            }
            if step % 500 == 0 {
                for l in &mut workers {
                    l.flush(&mut s, |_| report_epoch);
                }
            }
        }
        assert!(exhausted > 0, "the test must exercise kept changes");
        for (w, t, got) in std::mem::take(&mut open) {
            workers[w].update(&mut s, K, T, report_epoch, Change::release(&t, got));
        }
        contention.set(0);
        for l in &mut workers {
            l.flush(&mut s, |_| report_epoch);
            assert_eq!(l.pending(), 0);
        }
        let b = shared(&mut s, K);
        assert!(b.is_zero(), "{b:?}");
    }

    /// A slot reused for another address (membership churn): the poller claims its books for
    /// the new tenant, and whatever the old tenant's workers still write, read or owe is
    /// dropped instead of landing on the new node's books.
    #[test]
    fn a_slot_given_to_another_address_drops_the_former_tenants_changes() {
        const NEW: u64 = 8;
        let mut s = store_with_books();
        let mut l = Ledger::default();
        let a = ticket(0, 10, 10);
        s.fail = true;
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&a)),
            Written::Failed
        );
        s.fail = false;
        assert_eq!(l.pending(), 1, "kept for later");
        // The poller gives slot 0 to another address: fresh books of the new tenant.
        assert_eq!(ensure_books(&mut s, K, NEW), Ok(true));
        assert_eq!(ensure_books(&mut s, K, NEW), Ok(false), "kept once claimed");
        assert_eq!(shared(&mut s, K), Books::of(NEW));
        // The old tenant's release (and its kept dispatch) are dropped, not written.
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::release(&a, 0)),
            Written::Gone
        );
        assert_eq!(l.pending(), 0);
        assert_eq!(shared(&mut s, K), Books::of(NEW));
        // A VM whose snapshot still shows the old tenant sees empty books and no read to
        // reuse; the new tenant's own changes are written.
        let (books, read) = l.view_read(&mut s, K, T, 0).unwrap();
        assert_eq!((books, read), (Books::of(T), None));
        let b = Ticket {
            tenant: NEW,
            ..ticket(0, 3, 3)
        };
        assert!(matches!(
            l.update(&mut s, K, NEW, 0, Change::dispatch(&b)),
            Written::Yes { .. }
        ));
        assert_eq!(shared(&mut s, K).inflight_requests, 1);
        // A change kept for one tenant is not merged into another's.
        s.fail = true;
        l.update(&mut s, K, NEW, 0, Change::release(&b, 0));
        s.fail = false;
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&a)),
            Written::Gone
        );
        assert_eq!(
            l.pending(),
            0,
            "the new tenant's kept release left with the switch"
        );
    }

    /// The poller claims a slot while a worker writes the former tenant's last change: the
    /// claim reads again and wins; it never overwrites a write it did not see.
    #[test]
    fn a_claim_retries_a_concurrent_write() {
        let mut s = store_with_books();
        let hits = std::rc::Rc::new(std::cell::Cell::new(1));
        let h = hits.clone();
        s.interfere = Some(Box::new(move |data, cas| {
            if h.get() > 0 {
                h.set(0);
                *cas += 1;
                if let Some(v) = data.get_mut(K) {
                    v.1 = *cas;
                }
            }
        }));
        assert_eq!(ensure_books(&mut s, K, 8), Ok(true));
        assert_eq!(shared(&mut s, K), Books::of(8));
        assert_eq!(hits.get(), 0);
    }

    #[test]
    fn totals_add_up_every_node() {
        let mut s = FakeStore::default();
        let keys: Vec<String> = (0..3).map(books_key).collect();
        let mut l = Ledger::default();
        for k in &keys {
            ensure_books(&mut s, k, T).unwrap();
            l.update(&mut s, k, T, 0, Change::dispatch(&ticket(0, 10, 5)));
        }
        let t = totals(&mut s, keys.iter().map(String::as_str));
        assert_eq!((t.inflight_requests, t.inflight_tokens), (3, 45));
        // Host calls: one get and one set per uncontended update.
        let before = s.calls;
        l.update(
            &mut s,
            &keys[0],
            T,
            0,
            Change::progress(&ticket(0, 10, 5), 0, 1),
        );
        assert_eq!(s.calls - before, 2);
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
                })
                .collect(),
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
