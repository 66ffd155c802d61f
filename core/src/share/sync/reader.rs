//! The filter VM's side of the sync: the fleet snapshot followed through the version record,
//! the books keys mapped by address, the reader's writes to the shared books, and its side of
//! the placements journal.

use super::{BookKey, Counts, VERSION_RECHECK_MS};
use crate::fleet::node::Ticket;
use crate::route::balancer::{Balancer, BookSource};
use crate::share::journal::{Journal, JournalCounts};
use crate::share::wake::{self, Pushed};
use crate::share::{
    Books, Change, Ledger, Read, Snapshot, Store, StoreFailed, Version, FLEET_KEY, VERSION_KEY,
};
use std::collections::HashMap;
use std::fmt;

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

/// A filter VM's side of the sync (see `share::sync`).
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
    /// Where every worker's prompts went (see `share::journal`).
    pub(crate) journal: Journal,
    /// By node, the report epoch at which this VM last named it on the wake list
    /// (`share::wake`): a node is named once per report of it, not once per request.
    woke: Vec<Option<u64>>,
}

impl Reader {
    /// Publishes the placements `balancer` made since the last call (`share::journal`), for
    /// the other workers' prefix indexes: at once, or gathered into a batch that goes out
    /// once due (this call publishes one that is). A placement on a node without books key
    /// (not in the poller's fleet) is not published.
    pub fn publish_placements<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &mut Balancer,
        now_ms: u64,
    ) -> JournalCounts {
        let mut counts = JournalCounts::default();
        for (node, blocks) in balancer.take_placements() {
            if let Some(Some(book)) = self.keys.get(node) {
                let c = self
                    .journal
                    .place(store, now_ms, book.slot, book.tenant, &blocks);
                counts.add(c);
            }
        }
        counts.add(self.journal.flush(store, now_ms));
        counts
    }

    /// Takes the other workers' placements into `balancer`'s prefix index, at most once per
    /// `journal::FOLLOW_MS`; one whose slot now counts for another address is dropped.
    pub fn follow_placements<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &mut Balancer,
        now_ms: u64,
    ) -> JournalCounts {
        if balancer.chain_block_chars().is_none() {
            return JournalCounts::default();
        }
        let keys = &self.keys;
        self.journal.follow(store, now_ms, |slot, tenant, blocks| {
            let node = keys.iter().position(|k| {
                k.as_ref()
                    .is_some_and(|b| b.slot == slot && b.tenant == tenant)
            });
            if let Some(node) = node {
                balancer.believe_placed(node, blocks);
            }
        })
    }

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
            let Some(&slot) = slots.get(n.address()) else {
                *book = None;
                continue;
            };
            if !book
                .as_ref()
                .is_some_and(|b| b.slot == slot && b.tenant == n.tenant())
            {
                *book = Some(BookKey::new(slot, n.tenant()));
            }
        }
    }

    /// Where node `node`'s shared books are, if the snapshot has the node.
    pub fn key(&self, node: usize) -> Option<&BookKey> {
        self.keys.get(node)?.as_ref()
    }

    /// Writes `change` to the shared books of `ticket`'s node (a dispatch, progress, a
    /// release), from `known`, a read of them just made, if any (`Ledger::update`). The
    /// change counts for the ticket's tenant: if the node's slot has gone to another address
    /// since, it is dropped (`books_gone`). A ticket from before a reconfiguration still has
    /// its booking in the shared books, which outlive this VM's balancer: its node is found by
    /// address (`Balancer::holder`). Nothing is written for a node without books key.
    pub fn write<S: Store>(
        &mut self,
        store: &mut S,
        balancer: &Balancer,
        ticket: &Ticket,
        change: Change,
        known: Option<Read>,
    ) -> Counts {
        let Some(node) = balancer.holder(ticket) else {
            return Counts::default();
        };
        let Some(Some(book)) = self.keys.get(node) else {
            return Counts::default();
        };
        let epoch = balancer.nodes().get(node).map_or(0, |n| n.epoch());
        Counts::of(
            self.ledger
                .update(store, &book.key, ticket.tenant, epoch, change, known),
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

    /// A prompt was just sent to `node`, which the poller service may be polling at a longer
    /// period (the caller checks, `NodeState::polled_late`) and whose latest report is of
    /// epoch `epoch`: the node is named on the wake list (`share::wake`), once per report.
    pub fn wake<S: Store>(&mut self, store: &mut S, node: usize, epoch: u64) -> Counts {
        let mut counts = Counts::default();
        let Some(Some(book)) = self.keys.get(node) else {
            return counts;
        };
        if self.woke.get(node).copied().flatten() == Some(epoch) {
            return counts;
        }
        match wake::push(store, book.slot) {
            Pushed::Yes { retries } => {
                counts.cas_retries = retries;
                if self.woke.len() <= node {
                    self.woke.resize(node + 1, None);
                }
                if let Some(w) = self.woke.get_mut(node) {
                    *w = Some(epoch);
                }
            }
            Pushed::Lost => counts.wakes_lost = 1,
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
            booked: Vec::new(),
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

/// A reader's shared books as the `BookSource` of one decision (`Balancer::route`).
pub struct SharedBooks<'a, S> {
    reader: &'a Reader,
    store: &'a mut S,
    failed: u32,
    reads: Reads,
    /// The dispatches booked with this source and not written yet (see
    /// `BookSource::booked`), added to every later read of their node.
    booked: Vec<(usize, Change)>,
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
            .view(self.store, &book.key, book.tenant, report_epoch)
        {
            Some((books, read)) => {
                if let Some(read) = read {
                    self.reads.0.push((node, read));
                }
                let booked = self.booked.iter().filter(|(n, _)| *n == node);
                Some(booked.fold(books, |b, (_, c)| b.apply(c)))
            }
            None => {
                self.failed = self.failed.saturating_add(1);
                None
            }
        }
    }

    fn booked(&mut self, node: usize, change: &Change) {
        self.booked.push((node, *change));
    }
}
