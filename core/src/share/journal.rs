//! Where the workers of one Envoy sent which prompts: a bounded journal of placements in
//! shared data, so that every worker's prefix index (`fleet::prefixes`) learns the others'
//! routing, with `poller: singleton`.
//!
//! Each worker's VM keeps its own prefix index: without this journal, a worker believes a node
//! holds a prompt's prefix only if that worker sent it there, and four workers place one
//! tenant's prompts as four routers would. Sharing the index itself (one key per block, or one
//! value for all) would cost a read-modify-write of large values on every request; a journal
//! costs one small compare-and-swap and one write per batch of placements, and each reader
//! takes in only what is new, in order, into its own index.
//!
//! - **Batches**: a worker publishes its placements at once when it has published none for
//!   `FOLLOW_MS`, and otherwise gathers them and publishes them together when that much time
//!   has passed (at its next decision or its next tick) or when the batch is full
//!   (`MAX_ENTRY_BLOCKS`). Below about a hundred requests a second per worker every placement
//!   goes out at once; above it the shared-data calls of publishing (a read and a
//!   compare-and-swap of the head, a write of the entry: each a crossing into Envoy) are paid
//!   once per batch instead of once per request, and the other workers learn a placement at
//!   most `FOLLOW_MS` later, which is as often as they look.
//! - **The head** (`HEAD_KEY`): the sequence number of the next entry. The poller service
//!   creates it at start (workers never create keys); a worker claims a number by
//!   compare-and-swap on the head, retried up to `MAX_CAS_RETRIES` times, then writes its
//!   entry under `entry_key(seq % SLOTS)`: for each placement of the batch, the node's slot in
//!   the poller's fleet and its tenant (as the books carry them, see `share`) and the chain's
//!   block hashes.
//! - **Readers** follow the head at most once per `FOLLOW_MS`, read the entries from the last
//!   one taken to the head, and take in those written by another VM whose slot still counts
//!   for the same address (a placement on a node that has left is dropped, as its books are).
//!   A VM knows its own entries by the numbers it claimed, and does not read them.
//!   An entry whose number was claimed but not written yet stops the reading until it is, or
//!   until `LAG` later entries are there (its writer may have gone). A reader more than
//!   `SLOTS` entries behind skips what was overwritten.
//! - **Bounded**: at most `SLOTS` entries of at most `MAX_ENTRY_BLOCKS` blocks (about 2 MB in
//!   all in the worst case), whatever the traffic. What is lost is counted, never retried: a
//!   placement that could not be published is still in its writer's index, and one a reader
//!   missed only makes that reader price one prefix as a router that never saw it would.

use super::codec;
use super::{SetError, Store, StoreFailed, MAX_CAS_RETRIES};
use crate::ingest::prompt::MAX_BLOCKS;
use std::collections::VecDeque;

/// Key of the journal's head (the next sequence number, 8 bytes little-endian). Builds that
/// wrote one placement an entry used other keys: during a reload the two do not read each
/// other's.
pub const HEAD_KEY: &str = "token_balancer.placements.head";
/// Entries kept; the oldest is overwritten by the newest.
pub const SLOTS: u64 = 64;
/// Blocks one entry holds at most, its placements' chains together: a batch that would pass
/// it goes out first. At least one chain's `MAX_BLOCKS`.
pub const MAX_ENTRY_BLOCKS: usize = 4 * MAX_BLOCKS;
/// Later entries after which an entry claimed but never written is skipped.
pub const LAG: u64 = 8;
/// How often a reader looks at the head, at most; and how long a writer gathers placements
/// into one batch while requests keep coming.
pub const FOLLOW_MS: u64 = 10;

/// The key of entry `seq`.
pub fn entry_key(seq: u64) -> String {
    format!("token_balancer.placements.{}", seq % SLOTS)
}

/// Creates the head if there is none (the poller service, at start).
pub fn ensure_head<S: Store>(store: &mut S) -> Result<(), StoreFailed> {
    match store.get(HEAD_KEY)? {
        Some(_) => Ok(()),
        None => store
            .set(HEAD_KEY, &0u64.to_le_bytes(), None)
            .map_err(|_| StoreFailed),
    }
}

/// One placement: the chain `blocks` was sent to the node in `slot` counting for `tenant`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub slot: u32,
    pub tenant: u64,
    pub blocks: Vec<u64>,
}

/// One entry: a batch of placements, under its sequence number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub seq: u64,
    pub placements: Vec<Placement>,
}

impl Entry {
    pub fn encode(&self) -> Vec<u8> {
        let blocks: usize = self.placements.iter().map(|p| p.blocks.len()).sum();
        let mut out = Vec::with_capacity(12 + 16 * self.placements.len() + 8 * blocks);
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&sat32(self.placements.len() as u64).to_le_bytes());
        for p in &self.placements {
            out.extend_from_slice(&p.slot.to_le_bytes());
            out.extend_from_slice(&p.tenant.to_le_bytes());
            out.extend_from_slice(&sat32(p.blocks.len() as u64).to_le_bytes());
            for b in &p.blocks {
                out.extend_from_slice(&b.to_le_bytes());
            }
        }
        out
    }

    /// `None` for anything but a whole entry.
    pub fn decode(bytes: &[u8]) -> Option<Entry> {
        let mut r = codec::Reader::new(bytes);
        let seq = r.u64()?;
        let count = r.u32()? as usize;
        // Each placement takes at least 16 bytes: a count past what the bytes hold is not
        // an entry (and allocates nothing).
        if count > bytes.len() / 16 {
            return None;
        }
        let mut placements = Vec::with_capacity(count);
        for _ in 0..count {
            let slot = r.u32()?;
            let tenant = r.u64()?;
            let n = r.u32()? as usize;
            let raw = r.take(n.checked_mul(8)?)?;
            let blocks = raw
                .chunks_exact(8)
                .filter_map(|c| c.try_into().ok().map(u64::from_le_bytes))
                .collect();
            placements.push(Placement {
                slot,
                tenant,
                blocks,
            });
        }
        if r.take(1).is_some() {
            return None;
        }
        Some(Entry { seq, placements })
    }
}

/// What became of one step, one field per `prefix.shared_*` counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JournalCounts {
    /// Placements this VM published.
    pub published: u32,
    /// Placements this VM could not publish (no head yet, CAS exhausted, a host failure).
    pub dropped: u32,
    /// Other workers' placements read (one on a node that has since left is then dropped).
    pub taken: u32,
    /// Entries (batches of placements) this VM never read (overwritten before it came to
    /// them, never written, or unreadable).
    pub missed: u32,
    /// CAS mismatches on the head, retried.
    pub cas_retries: u32,
    /// Host calls that failed.
    pub failed: u32,
}

impl JournalCounts {
    /// Adds `c`'s counts to these.
    pub fn add(&mut self, c: JournalCounts) {
        self.published = self.published.saturating_add(c.published);
        self.dropped = self.dropped.saturating_add(c.dropped);
        self.taken = self.taken.saturating_add(c.taken);
        self.missed = self.missed.saturating_add(c.missed);
        self.cas_retries = self.cas_retries.saturating_add(c.cas_retries);
        self.failed = self.failed.saturating_add(c.failed);
    }
}

/// One VM's side of the journal (see the module).
#[derive(Debug, Clone, Default)]
pub struct Journal {
    /// The numbers of this VM's latest entries (at most `SLOTS`): already in its index.
    own: VecDeque<u64>,
    /// The next entry to read; `None` before the first look.
    next: Option<u64>,
    followed_ms: Option<u64>,
    /// Placements gathered and not published yet, and their blocks in all.
    batch: Vec<Placement>,
    batch_blocks: usize,
    /// When this VM last published a batch.
    published_ms: Option<u64>,
}

impl Journal {
    /// Takes in that `blocks` were sent to the node in `slot` counting for `tenant`: published
    /// at once when nothing was for `FOLLOW_MS`, else gathered into the batch (which goes out
    /// first if this chain would overfill it).
    pub fn place<S: Store>(
        &mut self,
        store: &mut S,
        now_ms: u64,
        slot: usize,
        tenant: u64,
        blocks: &[u64],
    ) -> JournalCounts {
        let mut c = JournalCounts::default();
        let Ok(slot) = u32::try_from(slot) else {
            c.dropped = 1;
            return c;
        };
        let blocks = blocks.get(..MAX_BLOCKS).unwrap_or(blocks);
        if blocks.is_empty() {
            // Nothing to learn from: a prompt without a whole block.
            return c;
        }
        if self.batch_blocks.saturating_add(blocks.len()) > MAX_ENTRY_BLOCKS {
            c.add(self.publish(store, now_ms));
        }
        self.batch.push(Placement {
            slot,
            tenant,
            blocks: blocks.to_vec(),
        });
        self.batch_blocks = self.batch_blocks.saturating_add(blocks.len());
        c.add(self.flush(store, now_ms));
        c
    }

    /// Publishes the batch if `FOLLOW_MS` has passed since the last one went out (the next
    /// decision's, or the tick's, call).
    pub fn flush<S: Store>(&mut self, store: &mut S, now_ms: u64) -> JournalCounts {
        let due = self
            .published_ms
            .map_or(true, |at| now_ms.saturating_sub(at) >= FOLLOW_MS);
        if due && !self.batch.is_empty() {
            self.publish(store, now_ms)
        } else {
            JournalCounts::default()
        }
    }

    /// Placements gathered and not published yet.
    pub fn gathered(&self) -> usize {
        self.batch.len()
    }

    /// Publishes the batch as one entry, now.
    fn publish<S: Store>(&mut self, store: &mut S, now_ms: u64) -> JournalCounts {
        let mut c = JournalCounts::default();
        let placements = std::mem::take(&mut self.batch);
        self.batch_blocks = 0;
        if placements.is_empty() {
            return c;
        }
        self.published_ms = Some(now_ms);
        let n = sat32(placements.len() as u64);
        for _ in 0..=MAX_CAS_RETRIES {
            let (seq, cas) = match store.get(HEAD_KEY) {
                Ok(Some((bytes, cas))) => match head(&bytes) {
                    Some(seq) => (seq, cas),
                    None => break,
                },
                Ok(None) => break,
                Err(StoreFailed) => {
                    c.failed = 1;
                    break;
                }
            };
            match store.set(HEAD_KEY, &seq.saturating_add(1).to_le_bytes(), Some(cas)) {
                Ok(()) => {}
                Err(SetError::CasMismatch) => {
                    c.cas_retries = c.cas_retries.saturating_add(1);
                    continue;
                }
                Err(SetError::Failed) => {
                    c.failed = 1;
                    break;
                }
            }
            let entry = Entry { seq, placements };
            if store.set(&entry_key(seq), &entry.encode(), None).is_err() {
                c.failed = 1;
                break;
            }
            if self.own.len() >= SLOTS as usize {
                self.own.pop_front();
            }
            self.own.push_back(seq);
            c.published = n;
            return c;
        }
        c.dropped = n;
        c
    }

    /// Takes in the entries other VMs wrote since the last look, at most once per
    /// `FOLLOW_MS`: `take(slot, tenant, blocks)` for each placement, in the order they were
    /// written.
    pub fn follow<S: Store>(
        &mut self,
        store: &mut S,
        now_ms: u64,
        mut take: impl FnMut(usize, u64, &[u64]),
    ) -> JournalCounts {
        let mut c = JournalCounts::default();
        if self
            .followed_ms
            .is_some_and(|at| now_ms.saturating_sub(at) < FOLLOW_MS)
        {
            return c;
        }
        self.followed_ms = Some(now_ms);
        let end = match store.get(HEAD_KEY) {
            Ok(Some((bytes, _))) => match head(&bytes) {
                Some(h) => h,
                None => return c,
            },
            Ok(None) => return c,
            Err(StoreFailed) => {
                c.failed = 1;
                return c;
            }
        };
        // A new reader takes in what the journal still has; one that fell behind skips what
        // was overwritten; a head that went back (a new process's store) starts over.
        let oldest = end.saturating_sub(SLOTS);
        let mut next = match self.next {
            Some(n) if n <= end => n,
            _ => oldest,
        };
        if next < oldest {
            c.missed = sat32(oldest - next);
            next = oldest;
        }
        while next < end {
            // This VM's own entries are in its index already: not read at all (with one
            // worker, that is every entry).
            if self.own.contains(&next) {
                next += 1;
                continue;
            }
            let read = match store.get(&entry_key(next)) {
                Ok(r) => r,
                Err(StoreFailed) => {
                    c.failed = c.failed.saturating_add(1);
                    break;
                }
            };
            match read.as_ref().map(|(bytes, _)| Entry::decode(bytes)) {
                Some(Some(e)) if e.seq == next => {
                    for p in &e.placements {
                        take(p.slot as usize, p.tenant, &p.blocks);
                        c.taken = c.taken.saturating_add(1);
                    }
                }
                // Overwritten by a later lap, or unreadable.
                Some(Some(e)) if e.seq > next => c.missed = c.missed.saturating_add(1),
                Some(None) => c.missed = c.missed.saturating_add(1),
                // Claimed, not written yet: wait for it, unless LAG entries came after it
                // (its writer seems gone).
                _ if end - next - 1 < LAG => break,
                _ => c.missed = c.missed.saturating_add(1),
            }
            next += 1;
        }
        self.next = Some(next);
        c
    }
}

fn head(bytes: &[u8]) -> Option<u64> {
    bytes.try_into().ok().map(u64::from_le_bytes)
}

fn sat32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::testing::FakeStore;

    fn store() -> FakeStore {
        let mut s = FakeStore::default();
        ensure_head(&mut s).unwrap();
        s
    }

    /// Publishes one placement as its own entry: `FOLLOW_MS` after `j`'s last batch.
    fn put(
        j: &mut Journal,
        s: &mut FakeStore,
        slot: usize,
        tenant: u64,
        b: &[u64],
    ) -> JournalCounts {
        let now = j.published_ms.map_or(0, |at| at + FOLLOW_MS);
        j.place(s, now, slot, tenant, b)
    }

    /// Everything `follow` took, as (slot, tenant, blocks).
    fn follow(
        j: &mut Journal,
        s: &mut FakeStore,
        now: u64,
    ) -> (Vec<(usize, u64, Vec<u64>)>, JournalCounts) {
        let mut got = Vec::new();
        let c = j.follow(s, now, |slot, tenant, b| {
            got.push((slot, tenant, b.to_vec()))
        });
        (got, c)
    }

    fn placement(slot: u32, tenant: u64, blocks: &[u64]) -> Placement {
        Placement {
            slot,
            tenant,
            blocks: blocks.to_vec(),
        }
    }

    #[test]
    fn entries_round_trip_and_anything_else_is_refused() {
        let e = Entry {
            seq: 7,
            placements: vec![placement(3, 11, &[1, 2, u64::MAX]), placement(0, 9, &[])],
        };
        let bytes = e.encode();
        assert_eq!(Entry::decode(&bytes), Some(e));
        for cut in 0..bytes.len() {
            assert_eq!(Entry::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Entry::decode(&longer), None);
        let mut huge = bytes.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Entry::decode(&huge), None, "a chain longer than the bytes");
        let mut many = bytes;
        many[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Entry::decode(&many), None, "more placements than the bytes");
    }

    #[test]
    fn a_reader_takes_the_others_placements_in_order_and_not_its_own() {
        let mut s = store();
        let (mut a, mut b) = (Journal::default(), Journal::default());
        assert_eq!(put(&mut b, &mut s, 0, 10, &[1, 2]).published, 1);
        assert_eq!(put(&mut a, &mut s, 1, 11, &[3]).published, 1);
        assert_eq!(put(&mut b, &mut s, 2, 12, &[4, 5, 6]).published, 1);
        let (got, c) = follow(&mut a, &mut s, 0);
        assert_eq!(got, vec![(0, 10, vec![1, 2]), (2, 12, vec![4, 5, 6])]);
        assert_eq!((c.taken, c.missed), (2, 0));
        // Nothing new: nothing again, and within FOLLOW_MS not even a look.
        let calls = s.calls;
        assert!(follow(&mut a, &mut s, 5).0.is_empty());
        assert_eq!(s.calls, calls);
        put(&mut b, &mut s, 1, 11, &[7]);
        assert!(follow(&mut a, &mut s, 9).0.is_empty());
        assert_eq!(follow(&mut a, &mut s, 10).0, vec![(1, 11, vec![7])]);
    }

    #[test]
    fn a_vm_tells_its_own_entries_by_the_numbers_it_claimed() {
        let mut s = store();
        let (mut a, mut b) = (Journal::default(), Journal::default());
        put(&mut a, &mut s, 0, 1, &[1]);
        put(&mut b, &mut s, 1, 2, &[2]);
        put(&mut a, &mut s, 2, 3, &[3]);
        // Its own are not even read: the head and b's entry, two host calls.
        let calls = s.calls;
        assert_eq!(follow(&mut a, &mut s, 0).0, vec![(1, 2, vec![2])]);
        assert_eq!(s.calls - calls, 2);
        assert_eq!(
            follow(&mut b, &mut s, 0).0,
            vec![(0, 1, vec![1]), (2, 3, vec![3])]
        );
        // A lone writer follows the journal with one read of the head.
        put(&mut a, &mut s, 0, 1, &[4]);
        let calls = s.calls;
        assert!(follow(&mut a, &mut s, 10).0.is_empty());
        assert_eq!(s.calls - calls, 1);
    }

    /// Placements within `FOLLOW_MS` of the last batch are gathered and go out together, in
    /// order, at the next placement or flush after it: three host calls a batch, whatever
    /// its size. A quiet writer's placement goes out at once.
    #[test]
    fn placements_close_together_are_published_as_one_batch() {
        let mut s = store();
        let (mut w, mut r) = (Journal::default(), Journal::default());
        let calls = s.calls;
        assert_eq!(w.place(&mut s, 100, 0, 1, &[1]).published, 1, "at once");
        assert_eq!(
            s.calls - calls,
            3,
            "read and swap the head, write the entry"
        );
        let calls = s.calls;
        for (t, b) in [(101, 2), (105, 3), (109, 4)] {
            assert_eq!(w.place(&mut s, t, 0, 1, &[b]), JournalCounts::default());
        }
        assert_eq!((s.calls - calls, w.gathered()), (0, 3), "gathered");
        assert_eq!(w.flush(&mut s, 109), JournalCounts::default(), "not due");
        // The next placement after FOLLOW_MS takes the batch out with it.
        let calls = s.calls;
        assert_eq!(w.place(&mut s, 110, 1, 2, &[5]).published, 4);
        assert_eq!((s.calls - calls, w.gathered()), (3, 0));
        let (got, c) = follow(&mut r, &mut s, 110);
        let blocks: Vec<u64> = got.iter().map(|g| g.2[0]).collect();
        assert_eq!((blocks, c.taken), (vec![1, 2, 3, 4, 5], 5));
        // One left gathered goes out at the flush (the tick) once due.
        w.place(&mut s, 115, 0, 1, &[6]);
        assert_eq!(w.flush(&mut s, 119).published, 0);
        assert_eq!(w.flush(&mut s, 120).published, 1);
        assert_eq!(follow(&mut r, &mut s, 120).0, vec![(0, 1, vec![6])]);
        assert_eq!(
            w.flush(&mut s, 200),
            JournalCounts::default(),
            "nothing left"
        );
    }

    /// A batch never holds more than `MAX_ENTRY_BLOCKS` blocks: one that a chain would
    /// overfill goes out first, due or not.
    #[test]
    fn a_full_batch_goes_out_before_it_overflows() {
        let mut s = store();
        let mut w = Journal::default();
        let chain: Vec<u64> = (0..MAX_BLOCKS as u64).collect();
        w.place(&mut s, 0, 0, 1, &[1]);
        let mut published = 0;
        for t in 1..=5 {
            published += w.place(&mut s, t, 0, 1, &chain).published;
        }
        // The fifth chain would have passed the limit: the batch of four went out.
        assert_eq!((published, w.gathered()), (4, 1));
        let longest = s
            .data
            .iter()
            .filter(|(k, _)| k.as_str() != HEAD_KEY)
            .map(|(_, (v, _))| v.len())
            .max()
            .unwrap();
        assert!(longest <= 12 + 16 * 4 + 8 * MAX_ENTRY_BLOCKS, "{longest}");
        // A chain past MAX_BLOCKS is cut there, as the prompt's chain is.
        let longer: Vec<u64> = (0..2 * MAX_BLOCKS as u64).collect();
        w.place(&mut s, 100, 0, 1, &longer);
        let (got, _) = follow(&mut Journal::default(), &mut s, 100);
        assert_eq!(got.last().unwrap().2.len(), MAX_BLOCKS);
        // A prompt without a whole block has nothing to place.
        assert_eq!(w.place(&mut s, 200, 0, 1, &[]), JournalCounts::default());
        assert_eq!(w.gathered(), 0);
    }

    #[test]
    fn the_head_is_claimed_by_compare_and_swap_so_racing_writers_never_share_a_number() {
        let mut s = store();
        // Another worker claims a number between our read of the head and our write.
        let mut slipped = 0;
        s.interfere = Some(Box::new(move |data, next_cas| {
            if slipped < 2 {
                slipped += 1;
                let (bytes, _) = &data[HEAD_KEY];
                let h = u64::from_le_bytes(bytes[..].try_into().unwrap());
                *next_cas += 1;
                data.insert(HEAD_KEY.into(), ((h + 1).to_le_bytes().to_vec(), *next_cas));
            }
        }));
        let c = put(&mut Journal::default(), &mut s, 4, 40, &[8]);
        assert_eq!((c.published, c.cas_retries), (1, 2));
        s.interfere = None;
        // Ours is number 2, after the two the other worker claimed.
        let e = Entry::decode(&s.data[&entry_key(2)].0).unwrap();
        assert_eq!((e.seq, e.placements), (2, vec![placement(4, 40, &[8])]));
        assert_eq!(head(&s.data[HEAD_KEY].0), Some(3));
    }

    #[test]
    fn a_writer_that_always_loses_the_race_drops_its_placements_and_says_so() {
        let mut s = store();
        s.interfere = Some(Box::new(|data, next_cas| {
            *next_cas += 1;
            let v = data[HEAD_KEY].0.clone();
            data.insert(HEAD_KEY.into(), (v, *next_cas));
        }));
        let mut w = Journal::default();
        w.place(&mut s, 0, 0, 1, &[1]);
        w.place(&mut s, 1, 0, 1, &[2]);
        let c = w.place(&mut s, 10, 0, 1, &[3]);
        assert_eq!(
            (c.published, c.dropped, c.cas_retries),
            (0, 2, MAX_CAS_RETRIES + 1)
        );
        assert_eq!(w.gathered(), 0, "dropped, not retried");
    }

    #[test]
    fn without_a_head_or_with_a_failing_host_nothing_is_written_and_it_is_counted() {
        let mut s = FakeStore::default();
        let c = put(&mut Journal::default(), &mut s, 0, 1, &[1]);
        assert_eq!((c.published, c.dropped), (0, 1));
        assert!(s.data.is_empty(), "workers never create the head");
        let (got, c) = follow(&mut Journal::default(), &mut s, 0);
        assert!(got.is_empty());
        assert_eq!(c, JournalCounts::default());
        let mut s = store();
        s.fail = true;
        let c = put(&mut Journal::default(), &mut s, 0, 1, &[1]);
        assert_eq!((c.dropped, c.failed), (1, 1));
        let (_, c) = follow(&mut Journal::default(), &mut s, 0);
        assert_eq!(c.failed, 1);
    }

    #[test]
    fn an_entry_claimed_but_not_written_is_waited_for_then_skipped_after_lag_entries() {
        let mut s = store();
        let mut w = Journal::default();
        let mut r = Journal::default();
        put(&mut w, &mut s, 0, 1, &[1]);
        // A writer claimed number 1 and has not written its entry yet.
        s.data
            .insert(HEAD_KEY.into(), (2u64.to_le_bytes().to_vec(), 99));
        put(&mut w, &mut s, 0, 1, &[3]);
        let (got, _) = follow(&mut r, &mut s, 0);
        assert_eq!(
            got,
            vec![(0, 1, vec![1])],
            "stops at the entry not written yet"
        );
        // Written now: taken in order.
        let late = Entry {
            seq: 1,
            placements: vec![placement(0, 1, &[2])],
        };
        s.data.insert(entry_key(1), (late.encode(), 100));
        let (got, _) = follow(&mut r, &mut s, 10);
        assert_eq!(got, vec![(0, 1, vec![2]), (0, 1, vec![3])]);
        // Another claimed and never written: skipped once LAG entries follow it.
        let h = head(&s.data[HEAD_KEY].0).unwrap();
        s.data
            .insert(HEAD_KEY.into(), ((h + 1).to_le_bytes().to_vec(), 101));
        for i in 0..LAG - 1 {
            put(&mut w, &mut s, 0, 1, &[10 + i]);
        }
        let (got, c) = follow(&mut r, &mut s, 20);
        assert!(got.is_empty(), "still within LAG: waits");
        put(&mut w, &mut s, 0, 1, &[99]);
        let (got, c2) = follow(&mut r, &mut s, 30);
        assert_eq!(got.len() as u64, LAG);
        assert_eq!((c.missed, c2.missed), (0, 1));
    }

    #[test]
    fn the_journal_is_bounded_and_a_reader_behind_by_a_lap_skips_what_was_overwritten() {
        let mut s = store();
        let mut w = Journal::default();
        let mut r = Journal::default();
        let _ = follow(&mut r, &mut s, 0);
        for i in 0..(SLOTS + 10) {
            put(&mut w, &mut s, 0, 1, &[i]);
        }
        let entries = s.data.keys().filter(|k| k.as_str() != HEAD_KEY).count();
        assert_eq!(entries as u64, SLOTS);
        let (got, c) = follow(&mut r, &mut s, 10);
        assert_eq!(got.len() as u64, SLOTS);
        assert_eq!(got.first().unwrap().2, vec![10]);
        assert_eq!(c.missed, 10);
        // A reader that starts now takes in what the journal still has.
        let (got, _) = follow(&mut Journal::default(), &mut s, 10);
        assert_eq!(got.len() as u64, SLOTS);
    }
}
