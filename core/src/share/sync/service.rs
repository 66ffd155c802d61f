//! The poller service's side of the sync: the snapshot and heartbeat published, and the
//! books' keys created and claimed for the addresses that take their slots.

use super::{BookKey, Counts};
use crate::fleet::node::tenant_of;
use crate::route::balancer::{Balancer, MemberChange};
use crate::share::journal;
use crate::share::wake::{self, Woken};
use crate::share::{
    ensure_books, totals, Books, Snapshot, Store, StoreFailed, Version, FLEET_KEY, VERSION_KEY,
};
use std::cell::RefCell;

/// The poller service's side of the sync (see `share::sync`).
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

    /// Creates the books of every configured node (kept where they already count for it) and
    /// the placements journal's head: they exist before any worker routes, since workers
    /// never create keys.
    pub fn claim_all<S: Store>(&self, store: &mut S) -> Counts {
        let mut counts = Counts::default();
        for book in self.keys.iter().flatten() {
            if ensure_books(store, &book.key, book.tenant).is_err() {
                counts.fail();
            }
        }
        if journal::ensure_head(store).is_err() {
            counts.fail();
        }
        if wake::create(store).is_err() {
            counts.fail();
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
            balancer.set_members(addresses, busy)
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
            let Some(tenant) = balancer.nodes().get(i).map(|n| n.tenant()) else {
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

    /// The slots the workers named on the wake list since the last call (`share::wake`), the
    /// list emptied; `None` when it could not be read (the caller then reads the books).
    pub fn take_woken<S: Store>(&self, store: &mut S) -> Option<Woken> {
        wake::take(store).ok()
    }

    /// Whether slot `slot`'s shared books have prompts whose first token has not come back
    /// (one read; books that cannot be read count as prefilling, the side that polls): such
    /// a node is polled every tick (see `fleet::polling`).
    pub fn prefilling<S: Store>(&self, store: &mut S, slot: usize) -> bool {
        self.key(slot).is_some_and(|k| match store.get(&k.key) {
            Ok(Some((bytes, _))) => Books::decode(&bytes).map_or(true, |b| b.prefilling()),
            Ok(None) => false,
            Err(StoreFailed) => true,
        })
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
