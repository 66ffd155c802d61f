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

use super::{books_key, Written, MAX_CAS_RETRIES};

mod reader;
mod service;

pub use reader::{FleetEvent, Lost, Reader, Reads, SharedBooks, Synced};
pub use service::Service;

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
    /// Nodes a worker could not name on the wake list (`wake::push`; reader).
    pub wakes_lost: u32,
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

    pub(crate) fn fail(&mut self) {
        self.failed = self.failed.saturating_add(1);
    }
}

#[cfg(test)]
mod tests;
