//! Which prompt prefixes each node is believed to hold in its prefix cache: an approximate
//! index of the chains (`ingest::prompt`) this router sent to each node, least recently used
//! first out, bounded per node by the node's cache size and in all by a configured budget.
//!
//! The index is the router's memory of its own routing, as in the inference gateway's
//! approximate prefix scorer and SGLang's cache-aware router: no engine events, no tokenizer. A
//! node is believed to hold a block once a chain containing it was sent there, and to lose it
//! when the node's share of the index is full and the block is the least recently sent. A
//! chain's blocks are touched last block first, so a prefix ages from its tail, as engines
//! evict (a head without its tail still saves work, a tail without its head never does): the
//! blocks a node holds of one chain stay a leading run, and the match is found by binary search
//! over the chain's depth.
//!
//! Two maps: (block, node) -> when it was last sent there, for a node's match; and block ->
//! how many nodes hold it and the few that sent it most recently, for finding the nodes with
//! the longest match without asking every node. Each node keeps a log of its touches in order;
//! eviction pops the log, skipping entries a later touch made stale, and the log is compacted
//! when stale entries pass half of it, so memory stays proportional to the blocks held.
//!
//! Where it is wrong: an engine that evicts earlier than the index believes (its cache shared
//! with other routers' traffic, or smaller than configured) makes a node look like it holds a
//! prefix it lost; a node whose cache other routers filled is not known to hold anything. The
//! cost model then over- or under-prices one prefill; the engines' reported hit rates are the
//! check.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Blocks held by one node, when nothing better is known: about 130k tokens of cache (an 80 GB
/// GPU serving a 7B model) in blocks of 64 tokens.
pub const DEFAULT_BLOCKS_PER_NODE: usize = 2048;
/// Most recent holders remembered per block (the candidates for a longest match).
const RECENT: usize = 4;
const NOBODY: u32 = u32::MAX;

/// Keys here are already hashes: mixing them once more is enough.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }
}

type Fast = BuildHasherDefault<KeyHasher>;

#[derive(Debug, Clone, Copy)]
struct Holders {
    count: u32,
    /// Most recent first; `NOBODY` where empty.
    recent: [u32; RECENT],
}

impl Holders {
    fn touch(&mut self, node: u32) {
        let at = self
            .recent
            .iter()
            .position(|&n| n == node)
            .unwrap_or(RECENT - 1);
        if let Some(head) = self.recent.get_mut(..=at) {
            head.rotate_right(1);
        }
        if let Some(first) = self.recent.first_mut() {
            *first = node;
        }
    }

    fn forget(&mut self, node: u32) {
        if let Some(at) = self.recent.iter().position(|&n| n == node) {
            if let Some(tail) = self.recent.get_mut(at..) {
                tail.rotate_left(1);
            }
            if let Some(last) = self.recent.last_mut() {
                *last = NOBODY;
            }
        }
    }
}

#[derive(Debug, Clone, Default)]
struct NodeLog {
    /// Blocks this node holds in the index.
    live: usize,
    /// Blocks it may hold.
    cap: usize,
    /// (block, stamp) in the order they were touched; stale where a later touch moved on.
    log: VecDeque<(u64, u64)>,
}

/// The index (see the module).
#[derive(Debug, Clone, Default)]
pub struct PrefixIndex {
    held: HashMap<(u64, u32), u64, Fast>,
    blocks: HashMap<u64, Holders, Fast>,
    nodes: Vec<NodeLog>,
    /// Blocks held by all nodes together, at most.
    budget: usize,
    per_node_default: usize,
    clock: u64,
}

impl PrefixIndex {
    /// An index holding at most `budget` blocks in all, and `per_node` per node unless a node's
    /// own size is set (`set_capacity`).
    pub fn new(budget: usize, per_node: usize) -> PrefixIndex {
        PrefixIndex {
            budget,
            per_node_default: per_node,
            ..PrefixIndex::default()
        }
    }

    /// Blocks held in all nodes together.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Bytes the index takes, about (its maps' and logs' reserved room).
    pub fn bytes(&self) -> usize {
        let held = self.held.capacity() * (std::mem::size_of::<((u64, u32), u64)>() + 1);
        let blocks = self.blocks.capacity() * (std::mem::size_of::<(u64, Holders)>() + 1);
        let logs: usize = self
            .nodes
            .iter()
            .map(|n| n.log.capacity() * std::mem::size_of::<(u64, u64)>())
            .sum();
        held + blocks + logs
    }

    /// Blocks node `node` is believed to hold.
    pub fn held_by(&self, node: usize) -> usize {
        self.nodes.get(node).map_or(0, |n| n.live)
    }

    fn share(&self, nodes: usize) -> usize {
        (self.budget / nodes.max(1)).max(1)
    }

    fn ensure(&mut self, node: usize) -> Option<&mut NodeLog> {
        if node >= self.nodes.len() {
            if node >= u32::MAX as usize {
                return None;
            }
            let cap = self.per_node_default;
            self.nodes.resize_with(node + 1, || NodeLog {
                cap,
                ..NodeLog::default()
            });
        }
        self.nodes.get_mut(node)
    }

    /// Node `node` holds about `blocks` blocks of cache (from its reported or configured
    /// size); it keeps at most that many, within its share of the budget.
    pub fn set_capacity(&mut self, node: usize, blocks: usize) {
        if let Some(n) = self.ensure(node) {
            n.cap = blocks.max(1);
        }
        self.evict(node);
    }

    /// The node in slot `node` is another one now (or gone): it holds nothing.
    pub fn forget(&mut self, node: usize) {
        let Some(n) = self.nodes.get_mut(node) else {
            return;
        };
        let log = std::mem::take(&mut n.log);
        n.live = 0;
        let id = node as u32;
        for (b, _) in log {
            if self.held.remove(&(b, id)).is_some() {
                self.drop_holder(b, id);
            }
        }
    }

    fn drop_holder(&mut self, block: u64, node: u32) {
        if let Some(h) = self.blocks.get_mut(&block) {
            h.count = h.count.saturating_sub(1);
            h.forget(node);
            if h.count == 0 {
                self.blocks.remove(&block);
            }
        }
    }

    /// A request with `chain` was sent to node `node`: it now holds every block of it.
    pub fn record(&mut self, node: usize, chain: &[u64]) {
        if chain.is_empty() || self.ensure(node).is_none() {
            return;
        }
        let id = node as u32;
        // Last block first: the head is the most recently used, and ages last.
        for &b in chain.iter().rev() {
            self.clock += 1;
            let stamp = self.clock;
            let fresh = self.held.insert((b, id), stamp).is_none();
            let h = self.blocks.entry(b).or_insert(Holders {
                count: 0,
                recent: [NOBODY; RECENT],
            });
            if fresh {
                h.count = h.count.saturating_add(1);
            }
            h.touch(id);
            if let Some(n) = self.nodes.get_mut(node) {
                if fresh {
                    n.live += 1;
                }
                n.log.push_back((b, stamp));
            }
        }
        self.evict(node);
    }

    /// Drops node `node`'s least recently sent blocks past its bound, and compacts its log.
    fn evict(&mut self, node: usize) {
        let share = self.share(self.nodes.len());
        let id = node as u32;
        loop {
            let Some(n) = self.nodes.get_mut(node) else {
                return;
            };
            if n.live <= n.cap.min(share) {
                break;
            }
            let Some((b, stamp)) = n.log.pop_front() else {
                break;
            };
            if self.held.get(&(b, id)) == Some(&stamp) {
                self.held.remove(&(b, id));
                n.live = n.live.saturating_sub(1);
                self.drop_holder(b, id);
            }
        }
        let held = &self.held;
        if let Some(n) = self.nodes.get_mut(node) {
            if n.log.len() > 2 * n.live + 64 {
                n.log.retain(|(b, s)| held.get(&(*b, id)) == Some(s));
            }
        }
    }

    /// How many nodes are believed to hold the first block of `chain` (none: a new prefix).
    pub fn holders_of_start(&self, chain: &[u64]) -> usize {
        chain
            .first()
            .and_then(|b| self.blocks.get(b))
            .map_or(0, |h| h.count as usize)
    }

    /// Leading blocks of `chain` node `node` is believed to hold.
    pub fn matched(&self, node: usize, chain: &[u64]) -> usize {
        let id = node as u32;
        let holds = |i: usize| {
            chain
                .get(i)
                .is_some_and(|b| self.held.contains_key(&(*b, id)))
        };
        // The blocks held of one chain are a leading run (see the module): the first block not
        // held is found by bisection.
        if !holds(0) {
            return 0;
        }
        let (mut lo, mut hi) = (1usize, chain.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if holds(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The nodes believed to hold the longest leading run of `chain` (up to four, most recent
    /// first), and its length; no nodes when none holds its first block.
    pub fn longest(&self, chain: &[u64]) -> (usize, impl Iterator<Item = usize> + '_) {
        let held = |i: usize| chain.get(i).and_then(|b| self.blocks.get(b));
        let (mut lo, mut hi) = if held(0).is_some() {
            (1usize, chain.len())
        } else {
            (0, 0)
        };
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if held(mid).is_some() {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let recent = lo
            .checked_sub(1)
            .and_then(held)
            .map_or([NOBODY; RECENT], |h| h.recent);
        (
            lo,
            recent
                .into_iter()
                .filter(|&n| n != NOBODY)
                .map(|n| n as usize),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(from: u64, len: u64) -> Vec<u64> {
        (from..from + len).collect()
    }

    #[test]
    fn a_recorded_chain_is_matched_by_its_leading_run() {
        let mut ix = PrefixIndex::new(1000, 100);
        ix.record(0, &[1, 2, 3, 4]);
        let cases: &[(&str, usize, &[u64], usize)] = &[
            ("the same chain", 0, &[1, 2, 3, 4], 4),
            ("a longer one", 0, &[1, 2, 3, 4, 5, 6], 4),
            ("a shorter one", 0, &[1, 2], 2),
            ("parting after two", 0, &[1, 2, 9, 9], 2),
            ("another head", 0, &[7, 2, 3], 0),
            ("another node", 1, &[1, 2, 3, 4], 0),
            ("empty", 0, &[], 0),
        ];
        for (name, node, c, want) in cases {
            assert_eq!(ix.matched(*node, c), *want, "{name}");
        }
        assert_eq!(ix.len(), 4);
        assert_eq!(ix.held_by(0), 4);
    }

    #[test]
    fn longest_match_names_the_most_recent_holders() {
        let mut ix = PrefixIndex::new(1000, 100);
        ix.record(0, &[1, 2]);
        ix.record(1, &[1, 2, 3]);
        ix.record(2, &[1, 2, 3]);
        ix.record(3, &[1]);
        let (depth, nodes) = ix.longest(&[1, 2, 3, 4]);
        assert_eq!((depth, nodes.collect::<Vec<_>>()), (3, vec![2, 1]));
        let (depth, nodes) = ix.longest(&[1, 5]);
        assert_eq!((depth, nodes.collect::<Vec<_>>()), (1, vec![3, 2, 1, 0]));
        let (depth, nodes) = ix.longest(&[8]);
        assert_eq!((depth, nodes.count()), (0, 0));
    }

    #[test]
    fn least_recently_sent_blocks_leave_first_and_the_head_last() {
        let mut ix = PrefixIndex::new(1000, 6);
        ix.record(0, &chain(100, 4)); // blocks 100..104
        ix.record(0, &chain(200, 4)); // over the bound of 6 by 2
        assert_eq!(ix.held_by(0), 6);
        // The older chain lost its tail, not its head.
        assert_eq!(ix.matched(0, &chain(100, 4)), 2);
        assert_eq!(ix.matched(0, &chain(200, 4)), 4);
        // Sending the first chain again makes it the newest: the second now ages.
        ix.record(0, &chain(100, 4));
        assert_eq!(ix.matched(0, &chain(100, 4)), 4);
        assert_eq!(ix.matched(0, &chain(200, 4)), 2);
        assert_eq!(ix.len(), 6);
    }

    #[test]
    fn the_budget_is_shared_by_the_nodes() {
        let mut ix = PrefixIndex::new(8, 100);
        ix.record(3, &[1]); // four nodes known: two blocks each
        ix.record(0, &chain(10, 5));
        ix.record(1, &chain(20, 5));
        assert_eq!((ix.held_by(0), ix.held_by(1)), (2, 2));
        ix.set_capacity(1, 1);
        assert_eq!(ix.held_by(1), 1);
        assert!(ix.len() <= 8);
    }

    #[test]
    fn a_forgotten_node_holds_nothing_and_others_keep_theirs() {
        let mut ix = PrefixIndex::new(1000, 100);
        ix.record(0, &[1, 2, 3]);
        ix.record(1, &[1, 2]);
        ix.forget(0);
        assert_eq!(ix.matched(0, &[1, 2, 3]), 0);
        assert_eq!(ix.matched(1, &[1, 2, 3]), 2);
        let (depth, nodes) = ix.longest(&[1, 2, 3]);
        assert_eq!((depth, nodes.collect::<Vec<_>>()), (2, vec![1]));
        ix.forget(7); // never seen: nothing happens
        assert_eq!(ix.len(), 2);
    }

    /// Memory follows the blocks held, not the touches: a hot prefix sent a million times
    /// keeps a log of about its own length.
    #[test]
    fn repeated_touches_do_not_grow_the_log() {
        let mut ix = PrefixIndex::new(10_000, 1000);
        for i in 0..100_000u64 {
            ix.record(0, &[1, 2, 3, 4, 5, 6, 7, 8]);
            ix.record(0, &[1, 2, 3, 4, 1000 + (i % 64)]);
        }
        assert_eq!(ix.held_by(0), 8 + 64);
        let log = ix.nodes.first().map_or(0, |n| n.log.len());
        assert!(log <= 2 * (8 + 64) + 64 + 13, "{log}");
        assert!(ix.bytes() < 64 * 1024, "{}", ix.bytes());
    }

    #[test]
    fn eviction_under_churn_keeps_the_maps_consistent() {
        let mut ix = PrefixIndex::new(64, 16);
        let mut rng = crate::rng::SplitMix64::new(7);
        use crate::rng::Rng;
        for _ in 0..5000 {
            let node = (rng.next_u64() % 5) as usize;
            let head = rng.next_u64() % 20;
            let len = 1 + rng.next_u64() % 10;
            let c: Vec<u64> = (0..len).map(|i| head * 1000 + i).collect();
            match rng.next_u64() % 10 {
                0 => ix.forget(node),
                _ => ix.record(node, &c),
            }
            let total: usize = (0..5).map(|n| ix.held_by(n)).sum();
            assert_eq!(total, ix.len());
            assert!(ix.len() <= 64 + 15, "{}", ix.len());
        }
        for (b, h) in &ix.blocks {
            let holders = (0..5u32)
                .filter(|n| ix.held.contains_key(&(*b, *n)))
                .count();
            assert_eq!(h.count as usize, holders);
            assert!(h
                .recent
                .iter()
                .all(|&n| n == NOBODY || ix.held.contains_key(&(*b, n))));
        }
    }
}
