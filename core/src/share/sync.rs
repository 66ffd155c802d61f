//! How the poller service and the filter VMs keep in step through shared data, with
//! `poller: singleton`.
//!
//! Two sides, one type each:
//! - `Service`, the poller on Envoy's main thread: after every round of polls it publishes the
//!   fleet snapshot (only when its bytes changed, so the version moves only then) and the
//!   version record with its heartbeat (always, so the readers can tell a quiet fleet from a
//!   dead poller). It also owns the books' keys: it creates every node's books before any
//!   worker routes, and when membership gives a departed node's slot to a new address it
//!   claims the slot's books for that address, once they are empty.
//! - `Reader`, a filter VM: it follows the version record (at most once per
//!   `VERSION_RECHECK_MS` while the fleet is usable), takes in a new snapshot when the version
//!   moved, maps each of its nodes to the books key of the snapshot's slot with the same
//!   address, and writes its dispatches, progress and releases into those books (`write`,
//!   with what could not be written kept and retried by `flush`).
//!
//! Both are generic over `Store`, so the protocol is tested here against an in-memory store.
//! Nothing here counts or logs: each step returns what happened (`Counts` for the `shared.*`
//! counters, `Synced` for whether the fleet is usable and what to say about it), and the glue
//! turns that into metrics and log lines.

use super::{
    books_key, ensure_books, totals, Books, Change, Ledger, Read, Snapshot, Store, StoreFailed,
    Version, Written, FLEET_KEY, MAX_CAS_RETRIES, VERSION_KEY,
};
use crate::fleet::node::{tenant_of, Ticket};
use crate::route::balancer::{Balancer, BookSource, MemberChange};
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

/// How long a reader trusts its last look at the version record while the fleet is usable. A
/// new snapshot comes once a tick (>= 10 ms), so looking on every request would nearly always
/// cost a host call to learn that nothing moved; a snapshot or a lost heartbeat is noticed at
/// most this much later.
pub const VERSION_RECHECK_MS: u64 = 10;

/// Where a node's shared books are: its slot in the poller's fleet, and who it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookKey {
    pub slot: usize,
    pub tenant: u64,
    /// `books_key(slot)`, made once.
    pub key: String,
}

impl BookKey {
    pub fn new(slot: usize, tenant: u64) -> BookKey {
        BookKey {
            slot,
            tenant,
            key: books_key(slot),
        }
    }
}

/// What became of the shared-data calls of one step, one field per `shared.*` counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Host calls that failed, and books or snapshots that could not be read.
    pub failed: u32,
    /// Compare-and-swap mismatches retried.
    pub cas_retries: u32,
    /// Writes that met a mismatch on every attempt (kept for later).
    pub cas_exhausted: u32,
    /// Writes to books the poller has not created yet (kept for later).
    pub books_missing: u32,
    /// Writes dropped because the slot now counts for another address.
    pub books_gone: u32,
    /// Snapshots published (service).
    pub published: u32,
    /// Snapshots taken in (reader).
    pub imported: u32,
}

impl Counts {
    /// The counts of one write.
    pub fn of(written: Written) -> Counts {
        let mut c = Counts::default();
        c.add(written);
        c
    }

    /// Counts one write.
    pub fn add(&mut self, written: Written) {
        match written {
            Written::Yes { retries, .. } => {
                self.cas_retries = self.cas_retries.saturating_add(retries);
            }
            Written::Exhausted => {
                self.cas_exhausted = self.cas_exhausted.saturating_add(1);
                self.cas_retries = self.cas_retries.saturating_add(MAX_CAS_RETRIES);
            }
            Written::Missing => self.books_missing = self.books_missing.saturating_add(1),
            Written::Gone => self.books_gone = self.books_gone.saturating_add(1),
            Written::Failed => self.failed = self.failed.saturating_add(1),
        }
    }

    fn fail(&mut self) {
        self.failed = self.failed.saturating_add(1);
    }
}

/// Why a reader has no usable fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// No version record or no snapshot in shared data (the service has not published).
    NoSnapshot,
    /// The version record's heartbeat is older than `stale_after_ms`.
    Stale,
    /// The snapshot's bytes do not decode.
    Unreadable,
}

impl fmt::Display for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lost::NoSnapshot => "no fleet snapshot from the poller service",
            Lost::Stale => "the poller service's heartbeat is stale (service gone?)",
            Lost::Unreadable => "the fleet snapshot is unreadable",
        })
    }
}

/// A change in whether a reader's fleet is usable, worth one log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetEvent {
    /// The fleet became usable.
    InUse,
    /// The fleet is not usable: said once until it is back.
    Lost(Lost),
}

/// What one `Reader::sync` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Synced {
    /// There is a usable fleet: present, and the poller alive.
    pub usable: bool,
    /// A node got a new report (held requests may now find room).
    pub new_reports: bool,
    pub counts: Counts,
    /// Slots the reader's nodes took from the snapshot (new, back, or a new address).
    pub joined: Vec<usize>,
    /// Nodes of the reader the snapshot lacks, counted when the fleet was not usable before
    /// (the poller runs another configuration).
    pub lacking: usize,
    /// What to log, when anything.
    pub event: Option<FleetEvent>,
}

/// A filter VM's side of the sync (see the module comment).
#[derive(Debug, Clone, Default)]
pub struct Reader {
    /// When the version record was last read.
    version_checked_ms: Option<u64>,
    /// Books key of each node, index for index with the balancer's nodes (`None`: a node the
    /// poller's snapshot does not have).
    keys: Vec<Option<BookKey>>,
    ledger: Ledger,
    /// The last version taken in.
    version: Option<u64>,
    /// The snapshot is there and the poller alive.
    fleet_ok: bool,
    /// The loss of the fleet has been reported (once until it is back).
    warned: bool,
}

impl Reader {
    /// Takes in a new fleet snapshot if the version moved, and says whether there is a usable
    /// one (present, and the poller's heartbeat no older than `stale_after_ms`). One store
    /// call when nothing changed, none within `VERSION_RECHECK_MS` of the last look while the
    /// fleet is usable.
    pub fn sync<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &mut Balancer,
        now_ms: u64,
        stale_after_ms: u64,
    ) -> Synced {
        let mut out = Synced::default();
        if self.fleet_ok
            && self
                .version_checked_ms
                .is_some_and(|at| now_ms.saturating_sub(at) < VERSION_RECHECK_MS)
        {
            out.usable = true;
            return out;
        }
        self.version_checked_ms = Some(now_ms);
        let version = match store.get(VERSION_KEY) {
            Ok(Some((bytes, _))) => Version::decode(&bytes),
            Ok(None) => None,
            Err(StoreFailed) => {
                out.counts.fail();
                None
            }
        };
        let alive = version.filter(|v| now_ms.saturating_sub(v.heartbeat_ms) <= stale_after_ms);
        let mut usable = false;
        let mut why = Lost::NoSnapshot;
        if let Some(v) = alive {
            if self.version == Some(v.version) {
                usable = self.fleet_ok;
            } else {
                match store.get(FLEET_KEY) {
                    Ok(Some((bytes, _))) => match Snapshot::decode(&bytes) {
                        Ok(snapshot) => {
                            out.counts.imported = out.counts.imported.saturating_add(1);
                            out.joined = balancer.mirror_fleet(&snapshot).joined;
                            let imported = balancer.import_fleet(&snapshot);
                            self.map_books(balancer, &snapshot);
                            if !self.fleet_ok {
                                out.lacking = imported.missing;
                            }
                            out.new_reports = imported.new_reports > 0;
                            self.version = Some(v.version);
                            usable = true;
                        }
                        Err(_) => {
                            out.counts.fail();
                            why = Lost::Unreadable;
                        }
                    },
                    Ok(None) => {}
                    Err(StoreFailed) => out.counts.fail(),
                }
            }
        } else if version.is_some() {
            why = Lost::Stale;
        }
        if usable && !self.fleet_ok {
            out.event = Some(FleetEvent::InUse);
            self.warned = false;
        } else if !usable && !self.warned {
            out.event = Some(FleetEvent::Lost(why));
            self.warned = true;
        }
        self.fleet_ok = usable;
        out.usable = usable;
        out
    }

    /// The books key of each node, from the slots of `snapshot`, matched by address. A key is
    /// made again only when its node's slot or address changed.
    fn map_books(&mut self, balancer: &Balancer, snapshot: &Snapshot) {
        let slots: HashMap<&str, usize> = snapshot
            .nodes
            .iter()
            .enumerate()
            .map(|(i, v)| (v.address.as_str(), i))
            .collect();
        let nodes = balancer.nodes();
        self.keys.resize_with(nodes.len(), || None);
        for (n, book) in nodes.iter().zip(self.keys.iter_mut()) {
            let Some(&slot) = slots.get(n.address.as_str()) else {
                *book = None;
                continue;
            };
            if !book
                .as_ref()
                .is_some_and(|b| b.slot == slot && b.tenant == n.tenant)
            {
                *book = Some(BookKey::new(slot, n.tenant));
            }
        }
    }

    /// Where node `node`'s shared books are, if the snapshot has the node.
    pub fn key(&self, node: usize) -> Option<&BookKey> {
        self.keys.get(node)?.as_ref()
    }

    /// Writes `change` to the shared books of `ticket`'s node (a dispatch, progress, a
    /// release), from `known`, a read of them just made, if any (`Ledger::update_known`). The
    /// change counts for the ticket's tenant: if the node's slot has gone to another address
    /// since, it is dropped (`books_gone`). Nothing is written for a node without books key.
    pub fn write<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &Balancer,
        ticket: &Ticket,
        change: Change,
        known: Option<Read>,
    ) -> Counts {
        let Some(Some(book)) = self.keys.get(ticket.node) else {
            return Counts::default();
        };
        let epoch = balancer.nodes().get(ticket.node).map_or(0, |n| n.epoch());
        Counts::of(
            self.ledger
                .update_known(store, &book.key, ticket.tenant, epoch, change, known),
        )
    }

    /// Writes the changes kept for later (see `Ledger`).
    pub fn flush<S: Store>(&mut self, store: &mut S, balancer: &Balancer) -> Counts {
        let mut counts = Counts::default();
        if self.ledger.pending() == 0 {
            return counts;
        }
        let keys = &self.keys;
        let nodes = balancer.nodes();
        let epoch_of = |k: &str| {
            keys.iter()
                .position(|x| x.as_ref().is_some_and(|b| b.key == k))
                .and_then(|i| nodes.get(i))
                .map_or(0, |n| n.epoch())
        };
        for w in self.ledger.flush(store, epoch_of) {
            counts.add(w);
        }
        counts
    }

    /// Changes kept for later (nodes).
    pub fn pending(&self) -> usize {
        self.ledger.pending()
    }

    /// The shared books, as a decision reads them: each weighed node's from the store, one
    /// store call per node weighed.
    pub fn books<'a, S: Store>(&'a self, store: &'a mut S) -> SharedBooks<'a, S> {
        SharedBooks {
            reader: self,
            store,
            failed: 0,
            reads: Reads::default(),
        }
    }
}

/// The reads of the shared books one decision made, by node: the chosen node's dispatch is
/// written from its read, without reading it again.
#[derive(Debug, Clone, Default)]
pub struct Reads(Vec<(usize, Read)>);

impl Reads {
    /// The read of node `node`'s books, if the decision made one.
    pub fn take(self, node: usize) -> Option<Read> {
        self.0
            .into_iter()
            .find(|(n, _)| *n == node)
            .map(|(_, read)| read)
    }
}

/// A reader's shared books as the `BookSource` of one decision (`Balancer::route_with_books`).
pub struct SharedBooks<'a, S> {
    reader: &'a Reader,
    store: &'a mut S,
    failed: u32,
    reads: Reads,
}

impl<S> SharedBooks<'_, S> {
    /// The reads made, and the failed ones counted.
    pub fn finish(self) -> (Reads, Counts) {
        let counts = Counts {
            failed: self.failed,
            ..Counts::default()
        };
        (self.reads, counts)
    }
}

impl<S: Store> BookSource for SharedBooks<'_, S> {
    fn books(&mut self, node: usize, report_epoch: u64) -> Option<Books> {
        let book = self.reader.key(node)?;
        match self
            .reader
            .ledger
            .view_read(self.store, &book.key, book.tenant, report_epoch)
        {
            Some((books, read)) => {
                if let Some(read) = read {
                    self.reads.0.push((node, read));
                }
                Some(books)
            }
            None => {
                self.failed = self.failed.saturating_add(1);
                None
            }
        }
    }
}

/// The poller service's side of the sync (see the module comment).
#[derive(Debug, Clone, Default)]
pub struct Service {
    /// Books key of each slot of the service's fleet.
    keys: Vec<Option<BookKey>>,
    /// The last version published.
    version: Option<u64>,
    /// Added to every node's report epoch, and the first version: the service's start time
    /// (see `Balancer::fleet_view`).
    epoch_base: u64,
    /// The bytes last published, so the version moves only when something changed.
    published: Vec<u8>,
}

impl Service {
    /// A service started at `now_ms` whose configured nodes are at `addresses`, slot for slot.
    pub fn new<'a>(addresses: impl IntoIterator<Item = &'a str>, now_ms: u64) -> Service {
        Service {
            keys: addresses
                .into_iter()
                .enumerate()
                .map(|(i, a)| Some(BookKey::new(i, tenant_of(a))))
                .collect(),
            epoch_base: now_ms,
            ..Service::default()
        }
    }

    /// Creates the books of every configured node (kept where they already count for it):
    /// they exist before any worker routes, since workers never create books.
    pub fn claim_all<S: Store>(&self, store: &mut S) -> Counts {
        let mut counts = Counts::default();
        for book in self.keys.iter().flatten() {
            if ensure_books(store, &book.key, book.tenant).is_err() {
                counts.fail();
            }
        }
        counts
    }

    /// The cluster's members are now `addresses` (`Balancer::set_members`). The service routes
    /// nothing itself: whether a departed node's requests have ended is in the shared books,
    /// so a slot (and its books key) is not reused before they have, and a slot taken by a new
    /// address has its books claimed for it.
    pub fn follow_members<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &mut Balancer,
        addresses: &[String],
    ) -> (MemberChange, Counts) {
        let change = {
            let keys = &self.keys;
            let store = RefCell::new(&mut *store);
            let busy = |i: usize| {
                keys.get(i).and_then(Option::as_ref).is_some_and(|b| {
                    // A store already in use cannot say: busy, a slot is never reused on a
                    // guess.
                    store
                        .try_borrow_mut()
                        .map_or(true, |mut s| books_busy(&mut **s, &b.key))
                })
            };
            balancer.set_members_with(addresses, busy)
        };
        let counts = self.claim(store, balancer, &change.joined);
        (change, counts)
    }

    /// The books of the slots `joined` count for the addresses now holding them (kept when
    /// they already do: a node back in its slot finds its requests still there). Done before
    /// the snapshot that shows the new nodes, so no worker routes to a node whose books are
    /// missing or still count for the slot's former address.
    fn claim<S: Store>(&mut self, store: &mut S, balancer: &Balancer, joined: &[usize]) -> Counts {
        let mut counts = Counts::default();
        for &i in joined {
            let Some(tenant) = balancer.nodes().get(i).map(|n| n.tenant) else {
                continue;
            };
            if self.keys.len() <= i {
                self.keys.resize_with(i + 1, || None);
            }
            let book = BookKey::new(i, tenant);
            if ensure_books(store, &book.key, tenant).is_err() {
                counts.fail();
            }
            if let Some(k) = self.keys.get_mut(i) {
                *k = Some(book);
            }
        }
        counts
    }

    /// Publishes the fleet if it changed (and moves the version), and the heartbeat, always.
    pub fn publish<S: Store>(&mut self, store: &mut S, balancer: &Balancer, now_ms: u64) -> Counts {
        let mut counts = Counts::default();
        let bytes = Snapshot {
            nodes: balancer.fleet_view(self.epoch_base),
        }
        .encode();
        let mut version = self.version.unwrap_or(self.epoch_base);
        if bytes != self.published {
            match store.set(FLEET_KEY, &bytes, None) {
                Ok(()) => {
                    version = version.saturating_add(1);
                    self.version = Some(version);
                    self.published = bytes;
                    counts.published = counts.published.saturating_add(1);
                }
                Err(_) => counts.fail(),
            }
        }
        let record = Version {
            version,
            heartbeat_ms: now_ms,
        };
        if store.set(VERSION_KEY, &record.encode(), None).is_err() {
            counts.fail();
        }
        counts
    }

    /// The sums of every node's shared books (for the service's gauges).
    pub fn totals<S: Store>(&self, store: &mut S) -> Books {
        totals(store, self.keys.iter().flatten().map(|b| b.key.as_str()))
    }

    /// Where slot `slot`'s books are.
    pub fn key(&self, slot: usize) -> Option<&BookKey> {
        self.keys.get(slot)?.as_ref()
    }
}

/// Whether the shared books under `key` have requests in flight (or cannot be read, which
/// counts as busy: a slot is never reused on a guess).
fn books_busy<S: Store>(store: &mut S, key: &str) -> bool {
    match store.get(key) {
        Ok(Some((bytes, _))) => Books::decode(&bytes).map_or(true, |b| b.inflight_requests > 0),
        Ok(None) => false,
        Err(StoreFailed) => true,
    }
}

#[cfg(test)]
#[path = "sync_tests.rs"]
mod tests;
