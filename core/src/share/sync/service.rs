//! The poller service's side of the sync: the snapshot and heartbeat published, and the
//! books' keys created and claimed for the addresses that take their slots.

use super::{BookKey, Counts};
use crate::fleet::node::tenant_of;
use crate::route::balancer::{Balancer, MemberChange};
use crate::route::prompt_scale::{EngineCounts, NodeCount};
use crate::share::journal;
use crate::share::wake;
use crate::share::{
    ensure_books, read_books as read, Books, Snapshot, Store, StoreFailed, Version, FLEET_KEY,
    VERSION_KEY,
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
    /// By slot, what is known of prompts the workers sent to a node polled late (`Named`).
    named: Vec<Named>,
    /// The wake list could not be read this tick: every slot's books are read instead.
    read_all: bool,
    /// The engines' prompt counters against the books (see `read_books`).
    engine_counts: EngineCounts,
}

/// What the poller service knows of prompts the workers sent to a node polled late: whether
/// its shared books are read when its slice comes (a node with a prompt waiting for its first
/// token is polled every tick, see `fleet::polling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Named {
    /// No worker named the node since an answer of its showed nothing waiting: not read.
    #[default]
    No,
    /// A worker named it on the wake list (`share::wake`), or its last answer would let it
    /// wait longer while its books showed a prompt waiting: read.
    Yes,
    /// Its last answer showed nothing waiting, but the workers still see the report before
    /// it until the next snapshot is out, and name a node once per report: read until then,
    /// and once more then.
    UntilPublished,
}

impl Service {
    /// A service started at `now_ms` whose configured nodes are at `addresses`, slot for slot.
    pub fn new<'a>(addresses: impl IntoIterator<Item = &'a str>, now_ms: u64) -> Service {
        let keys: Vec<Option<BookKey>> = addresses
            .into_iter()
            .enumerate()
            .map(|(i, a)| Some(BookKey::new(i, tenant_of(a))))
            .collect();
        Service {
            named: vec![Named::No; keys.len()],
            keys,
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
                self.named.resize(i + 1, Named::No);
            }
            let book = BookKey::new(i, tenant);
            if ensure_books(store, &book.key, tenant).is_err() {
                counts.fail();
            }
            if let Some(k) = self.keys.get_mut(i) {
                *k = Some(book);
            }
            // Nothing of this Envoy's is known to wait at a new node.
            if let Some(n) = self.named.get_mut(i) {
                *n = Named::No;
            }
        }
        counts
    }

    /// Publishes the fleet if it changed (and moves the version), and the heartbeat, always.
    pub fn publish<S: Store>(&mut self, store: &mut S, balancer: &Balancer, now_ms: u64) -> Counts {
        let mut counts = Counts::default();
        let bytes = Snapshot {
            nodes: balancer.fleet_view(self.epoch_base),
            // In thousandths: a ratio that moves a little with every pass would make the
            // snapshot new every second for the workers to decode again.
            prompt_ratio: self
                .engine_counts
                .ratio()
                .map(|r| (r * 1000.0).round() / 1000.0),
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
        // The workers now see every report taken so far: a name kept until then is dropped,
        // unless the node's books show a prompt sent since its answer (one read each).
        if counts.failed == 0 {
            for slot in 0..self.named.len() {
                if self.named.get(slot) == Some(&Named::UntilPublished) {
                    let waiting = self.prefilling(store, slot);
                    if let Some(n) = self.named.get_mut(slot) {
                        *n = if waiting { Named::Yes } else { Named::No };
                    }
                }
            }
        }
        counts
    }

    /// Reads every node's shared books: their sums (for the service's gauges), and a pass of
    /// the engines' prompt counters against the prompts the books saw start
    /// (`EngineCounts`), whose ratio the next snapshot carries.
    pub fn read_books<S: Store>(&mut self, store: &mut S, balancer: &Balancer) -> Books {
        let mut sum = Books::default();
        let nodes = balancer.nodes();
        let mut counts = Vec::with_capacity(self.keys.len());
        for (slot, key) in self.keys.iter().enumerate() {
            let books = key.as_ref().and_then(|k| read(store, &k.key));
            if let Some(b) = &books {
                sum = sum.plus(b);
            }
            let (Some(b), Some(k), Some(n)) = (books, key, nodes.get(slot)) else {
                counts.push(NodeCount::default());
                continue;
            };
            let reported = n.last_report().and_then(|r| r.requests_there());
            counts.push(NodeCount {
                tenant: k.tenant,
                counter: n.engine_prompt_counter(),
                books: b,
                reported,
            });
        }
        self.engine_counts.observe(&counts);
        sum
    }

    /// Where slot `slot`'s books are.
    pub fn key(&self, slot: usize) -> Option<&BookKey> {
        self.keys.get(slot)?.as_ref()
    }

    /// A timer tick: the slots the workers named on the wake list since the last one
    /// (`share::wake`) have their books read from now on, and the list is emptied. If it
    /// cannot be read, this tick reads every slot's books (`waiting`).
    pub fn take_woken<S: Store>(&mut self, store: &mut S) -> Counts {
        let mut counts = Counts::default();
        self.read_all = false;
        match wake::take(store) {
            Ok(woken) if woken.overflowed => self.named.fill(Named::Yes),
            Ok(woken) => {
                for slot in woken.slots {
                    if let Some(n) = self.named.get_mut(slot) {
                        *n = Named::Yes;
                    }
                }
            }
            Err(StoreFailed) => {
                self.read_all = true;
                counts.fail();
            }
        }
        counts
    }

    /// Whether a prompt of a worker's waits for its first token at the node in slot `slot`,
    /// as far as the service looks: the books of a named node (or of every node, this tick,
    /// when the wake list could not be read) are read; others count as nothing waiting.
    pub fn waiting<S: Store>(&self, store: &mut S, slot: usize) -> bool {
        let named = self.read_all || self.named.get(slot).is_some_and(|&n| n != Named::No);
        named && self.prefilling(store, slot)
    }

    /// The node in slot `slot` answered a poll. If the answer lets it wait longer than a
    /// tick (`late`), its books are read once: a prompt waiting keeps it named; otherwise a
    /// name is kept until the next snapshot is out (`Named::UntilPublished`). A node polled
    /// every tick anyway needs no read, and no name.
    pub fn answered<S: Store>(&mut self, store: &mut S, slot: usize, late: bool) {
        let waiting = late && self.prefilling(store, slot);
        if let Some(n) = self.named.get_mut(slot) {
            *n = match (waiting, *n) {
                (true, _) => Named::Yes,
                (false, Named::No) => Named::No,
                (false, _) => Named::UntilPublished,
            };
        }
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
