//! One VM's read-modify-writes of the shared books: each change is written with
//! compare-and-swap, retried on contention, and kept for later when it cannot be written (see
//! `share` for the rules: the tenant rule, the epoch rule, pending changes).

use crate::fleet::books::{Books, Change};
use crate::share::{Read, SetError, Store, StoreFailed, MAX_CAS_RETRIES};
use std::collections::HashMap;

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
    /// whose node's latest report epoch this VM knows is `report_epoch`. `known` is a read of
    /// `key` (value and CAS token) this VM has just made, if it made one (`view`): a decision
    /// has read the chosen node's books already, and the dispatch then costs one host call,
    /// not two. If another worker wrote since, the CAS token no longer matches and the write
    /// starts over from a fresh read.
    pub fn update<S: Store>(
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
            .map(|(k, t)| self.update(store, k, *t, epoch_of(k), Change::default(), None))
            .collect()
    }

    /// The books of `key` as this VM should see them: the shared ones under the epoch rule,
    /// plus what this VM has not written yet; with the read they were made from (value and CAS
    /// token, `None` when the store had no books or they count for another tenant), for
    /// `update`. `None` when the store has none or cannot say. Books of another tenant (this
    /// VM's snapshot is older than the slot's reuse) count as empty: the node this VM means has
    /// left, and nothing of it was in flight when its slot was reused.
    pub fn view<S: Store>(
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

/// The books at `key`, if there are readable ones (the poller service's gauges add them up,
/// `sync::Service::read_books`).
pub fn read<S: Store>(store: &mut S, key: &str) -> Option<Books> {
    match store.get(key) {
        Ok(Some((bytes, _))) => Books::decode(&bytes),
        _ => None,
    }
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
    use crate::fleet::node::Ticket;
    use crate::ingest::request::Weight;
    use crate::share::books_key;
    use crate::share::testing::FakeStore;

    fn shared(store: &mut FakeStore, key: &str) -> Books {
        Books::decode(&store.data[key].0).unwrap()
    }

    fn ticket(epoch: u64, p: u64, o: u64) -> Ticket {
        Ticket {
            node: 0,
            tenant: T,
            generation: 0,
            epoch,
            weight: Weight {
                prompt_tokens: p,
                output_tokens: o,
            },
            reserved_output: o + 10,
            cached: 0,
            tpot_ms: None,
            stream: 0,
            text_prompt: 0,
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
                None,
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
        l.update(&mut s, K, T, 1, Change::dispatch(&a), None);
        l.update(&mut s, K, T, 1, Change::dispatch(&b), None);
        assert_eq!(shared(&mut s, K).unreflected_tokens, 165);
        // A report (epoch 2) covers both; a is released after it, b before any new one.
        l.update(&mut s, K, T, 2, Change::release(&a, 0), None);
        let now = shared(&mut s, K);
        assert_eq!((now.unreflected_tokens, now.inflight_tokens), (0, 15));
        // The report still shows a: ended since, so the workers read it as theirs.
        assert_eq!((now.ended_requests, now.in_report_requests()), (1, 2));
        let c = ticket(2, 1, 1);
        l.update(&mut s, K, T, 2, Change::dispatch(&c), None);
        l.update(&mut s, K, T, 2, Change::release(&b, 0), None);
        assert_eq!(shared(&mut s, K).unreflected_tokens, 2, "c's stays");
        l.update(&mut s, K, T, 2, Change::release(&c, 0), None);
        let now = shared(&mut s, K);
        assert!(now.is_zero());
        assert_eq!(now.ended_requests, 2, "a and b, not c");
        // The next report starts the count again.
        l.update(&mut s, K, T, 3, Change::default(), None);
        assert_eq!(shared(&mut s, K).ended_requests, 0);
    }

    /// A dispatch written from the read its decision made costs one host call; a read that
    /// another worker's write made stale costs the retry, and nothing is lost.
    #[test]
    fn a_write_from_a_known_read_skips_the_second_read() {
        let cases: &[(bool, usize, u32)] = &[(false, 1, 0), (true, 3, 1)];
        for &(stale, calls, retries) in cases {
            let mut s = store_with_books();
            let mut l = Ledger::default();
            let (books, read) = l.view(&mut s, K, T, 0).unwrap();
            assert!(books.is_zero());
            if stale {
                l.update(&mut s, K, T, 0, Change::dispatch(&ticket(0, 1, 1)), None);
            }
            s.calls = 0;
            let w = l.update(&mut s, K, T, 0, Change::dispatch(&ticket(0, 10, 10)), read);
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
            let w = l.update(&mut s, K, T, 0, Change::dispatch(&ticket(0, 10, 10)), None);
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
            let (view, _) = l.view(&mut s, K, T, 0).unwrap();
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
            l.update(&mut s, K, T, 0, Change::dispatch(&t), None),
            Written::Missing
        );
        assert_eq!(l.view(&mut s, K, T, 0).unwrap().0.inflight_requests, 1);
        s.fail = true;
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::progress(&t, 0, 4), None),
            Written::Failed
        );
        assert_eq!(l.view(&mut s, K, T, 0), None);
        s.fail = false;
        ensure_books(&mut s, K, T).unwrap();
        // The release merges with the kept dispatch and progress: they cancel out.
        let w = l.update(&mut s, K, T, 0, Change::release(&t, 4), None);
        assert!(
            matches!(w, Written::Yes { books, .. } if books.is_zero()),
            "{w:?}"
        );
        assert_eq!(l.pending(), 0);
        // Unreadable books are not overwritten.
        s.set(K, b"junk", None).unwrap();
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&t), None),
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
                let epoch = ledger.view(&mut s, K, T, report_epoch).unwrap().0.epoch;
                let t = ticket(epoch, rng.next_u64() % 1000, rng.next_u64() % 300);
                open.push((w, t, 0));
                ledger.update(&mut s, K, T, report_epoch, Change::dispatch(&t), None)
            } else {
                let i = (rng.next_u64() as usize) % open.len();
                let (owner, t, got) = open[i];
                let ledger = &mut workers[owner];
                if roll < 75 {
                    let after = got + rng.next_u64() % 50;
                    open[i].2 = after;
                    ledger.update(
                        &mut s,
                        K,
                        T,
                        report_epoch,
                        Change::progress(&t, got, after),
                        None,
                    )
                } else {
                    open.swap_remove(i);
                    ledger.update(&mut s, K, T, report_epoch, Change::release(&t, got), None)
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
            workers[w].update(&mut s, K, T, report_epoch, Change::release(&t, got), None);
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
            l.update(&mut s, K, T, 0, Change::dispatch(&a), None),
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
            l.update(&mut s, K, T, 0, Change::release(&a, 0), None),
            Written::Gone
        );
        assert_eq!(l.pending(), 0);
        assert_eq!(shared(&mut s, K), Books::of(NEW));
        // A VM whose snapshot still shows the old tenant sees empty books and no read to
        // reuse; the new tenant's own changes are written.
        let (books, read) = l.view(&mut s, K, T, 0).unwrap();
        assert_eq!((books, read), (Books::of(T), None));
        let b = Ticket {
            tenant: NEW,
            ..ticket(0, 3, 3)
        };
        assert!(matches!(
            l.update(&mut s, K, NEW, 0, Change::dispatch(&b), None),
            Written::Yes { .. }
        ));
        assert_eq!(shared(&mut s, K).inflight_requests, 1);
        // A change kept for one tenant is not merged into another's.
        s.fail = true;
        l.update(&mut s, K, NEW, 0, Change::release(&b, 0), None);
        s.fail = false;
        assert_eq!(
            l.update(&mut s, K, T, 0, Change::dispatch(&a), None),
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

    /// The books read back, added up over the nodes.
    fn totals(s: &mut FakeStore, keys: &[String]) -> Books {
        keys.iter()
            .filter_map(|k| read(s, k))
            .fold(Books::default(), |sum, b| sum.plus(&b))
    }

    #[test]
    fn books_read_back_add_up_over_every_node() {
        let mut s = FakeStore::default();
        let keys: Vec<String> = (0..3).map(books_key).collect();
        let mut l = Ledger::default();
        for k in &keys {
            ensure_books(&mut s, k, T).unwrap();
            l.update(&mut s, k, T, 0, Change::dispatch(&ticket(0, 10, 5)), None);
        }
        let t = totals(&mut s, &keys);
        assert_eq!((t.inflight_requests, t.inflight_tokens), (3, 45));
        // Host calls: one get and one set per uncontended update.
        let before = s.calls;
        l.update(
            &mut s,
            &keys[0],
            T,
            0,
            Change::progress(&ticket(0, 10, 5), 0, 1),
            None,
        );
        assert_eq!(s.calls - before, 2);
        // Figures any VM may have written add up saturating.
        let top = Books {
            inflight_requests: u64::MAX,
            growth_tokens: u64::MAX,
            ..Books::of(T)
        };
        for k in &keys {
            s.set(k, &top.encode(), None).unwrap();
        }
        let t = totals(&mut s, &keys);
        assert_eq!((t.inflight_requests, t.growth_tokens), (u64::MAX, u64::MAX));
    }
}
