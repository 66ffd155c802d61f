//! Prefix caching, as vLLM does it: a prompt is cut into fixed-size blocks of tokens, each block
//! is named by a hash that chains the hash of the block before it (so block i's hash stands
//! for every token up to the end of block i), and the engine keeps the KV of blocks it computed
//! under those names. A new request whose leading block hashes are present skips computing
//! them.
//!
//! `PrefixCache` is the index of those blocks with vLLM's bookkeeping: a block referenced by a
//! running sequence is in use (it is counted once however many sequences share it, and cannot
//! be evicted); a block no sequence references is *evictable*: it still holds its KV and can be
//! hit, but it is free memory that the engine reclaims, least recently released first. Blocks
//! are released last block first, so a prefix loses its tail before its head (a head without
//! its tail still saves work, a tail without its head never does).
//!
//! Hashes are FNV-1a 64 (self-written: the mock needs determinism and speed, not resistance to
//! crafted collisions); equal hashes are taken to mean equal blocks.

use std::collections::{BTreeMap, HashMap};

/// FNV-1a 64-bit offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`, continuing from state `h` (start from `FNV_OFFSET`).
pub fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The chained hashes of the full `block`-token blocks of `tokens` (a partial last block has
/// none: it cannot be shared). `seed` starts the chain: requests for different models or
/// adapters never share blocks, as in vLLM where the adapter is part of the block's key.
pub fn block_hashes(seed: &str, tokens: &[u64], block: u64) -> Vec<u64> {
    let block = usize::try_from(block).unwrap_or(usize::MAX).max(1);
    let mut parent = fnv1a(FNV_OFFSET, seed.as_bytes());
    tokens
        .chunks_exact(block)
        .map(|chunk| {
            let mut h = fnv1a(FNV_OFFSET, &parent.to_le_bytes());
            for t in chunk {
                h = fnv1a(h, &t.to_le_bytes());
            }
            parent = h;
            h
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Entry {
    /// Running sequences that hold this block.
    refs: u32,
    /// When it was last released (its key in `free` while `refs` is 0).
    tick: u64,
}

/// The index of cached blocks: at most `capacity` of them, referenced or evictable.
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    capacity: usize,
    entries: HashMap<u64, Entry>,
    /// Evictable blocks by release time, oldest first: the eviction order (a BTreeMap, so the
    /// order is deterministic whatever the HashMap does).
    free: BTreeMap<u64, u64>,
    clock: u64,
    referenced: usize,
    pub evicted_total: u64,
}

impl PrefixCache {
    /// A cache of `capacity_blocks` blocks; 0 disables it (nothing is ever found or kept).
    pub fn new(capacity_blocks: u64) -> Self {
        PrefixCache {
            capacity: usize::try_from(capacity_blocks).unwrap_or(usize::MAX),
            ..PrefixCache::default()
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Blocks cached, referenced or not.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Blocks some running sequence holds (used KV).
    pub fn referenced_blocks(&self) -> usize {
        self.referenced
    }
    /// Blocks cached but held by nobody (free KV that still holds a prefix).
    pub fn evictable_blocks(&self) -> usize {
        self.free.len()
    }

    /// How many leading blocks of `hashes` are cached.
    pub fn lookup(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.entries.contains_key(h))
            .count()
    }

    /// How many of `hashes` some running sequence already holds.
    pub fn referenced_among(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .filter(|h| self.entries.get(h).is_some_and(|e| e.refs > 0))
            .count()
    }

    /// Takes a reference on each cached block of `hashes` (normally a run `lookup` found).
    pub fn acquire(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(e) = self.entries.get_mut(h) {
                if e.refs == 0 {
                    self.free.remove(&e.tick);
                    self.referenced += 1;
                }
                e.refs += 1;
            }
        }
    }

    /// A sequence that holds `hashes[..held]` computed all of `hashes`: it takes references on
    /// the rest too, inserting the blocks not cached yet (evicting to make room). Returns how
    /// many leading blocks it now holds: it stops at the first block there is no room for
    /// (every cached block in use), and the blocks after that stay its private KV.
    pub fn extend(&mut self, hashes: &[u64], held: usize) -> usize {
        let mut n = held;
        for h in hashes.iter().skip(held) {
            if let Some(e) = self.entries.get_mut(h) {
                if e.refs == 0 {
                    self.free.remove(&e.tick);
                    self.referenced += 1;
                }
                e.refs += 1;
            } else {
                if self.entries.len() >= self.capacity && !self.evict_one() {
                    break;
                }
                self.entries.insert(*h, Entry { refs: 1, tick: 0 });
                self.referenced += 1;
            }
            n += 1;
        }
        n
    }

    /// Drops one reference on each of `hashes`, last block first (see the module doc).
    pub fn release(&mut self, hashes: &[u64]) {
        for h in hashes.iter().rev() {
            if let Some(e) = self.entries.get_mut(h) {
                if e.refs == 0 {
                    continue;
                }
                e.refs -= 1;
                if e.refs == 0 {
                    self.clock += 1;
                    e.tick = self.clock;
                    self.free.insert(self.clock, *h);
                    self.referenced -= 1;
                }
            }
        }
    }

    /// Evicts least recently released blocks until at most `max` are evictable: the engine
    /// reclaims the free memory they sit in.
    pub fn evict_to(&mut self, max: usize) {
        while self.free.len() > max && self.evict_one() {}
    }

    fn evict_one(&mut self) -> bool {
        match self.free.pop_first() {
            Some((_, h)) => {
                self.entries.remove(&h);
                self.evicted_total += 1;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_known_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn hashes_chain_over_full_blocks() {
        let a: Vec<u64> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // inside the second block of 16
        let (ha, hb) = (block_hashes("m", &a, 16), block_hashes("m", &b, 16));
        assert_eq!(ha.len(), 2, "40 tokens are two full blocks of 16");
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // Chained: the same tokens after a different first block hash differently.
        let mut c = a.clone();
        c[0] = 7;
        assert_ne!(block_hashes("m", &c, 16)[1], ha[1]);
        // The seed (model, adapter) separates otherwise equal prompts.
        assert_ne!(block_hashes("lora-x", &a, 16)[0], ha[0]);
        assert!(block_hashes("m", &a[..15], 16).is_empty());
    }

    #[test]
    fn lru_evicts_least_recently_released_tail_first() {
        let mut c = PrefixCache::new(4);
        // Sequence one computes blocks 1, 2; sequence two computes 3, 4.
        assert_eq!(c.extend(&[1, 2], 0), 2);
        assert_eq!(c.extend(&[3, 4], 0), 2);
        assert_eq!(
            (c.len(), c.referenced_blocks(), c.evictable_blocks()),
            (4, 4, 0)
        );
        // Full of blocks in use: nothing can be inserted.
        assert_eq!(c.extend(&[5], 0), 0);
        c.release(&[1, 2]);
        c.release(&[3, 4]);
        assert_eq!(c.evictable_blocks(), 4);
        // Reuse of [1, 2] makes them the most recent; the order is now 4, 3, 2, 1 (tails
        // before heads, and [3, 4] released before [1, 2] was).
        c.acquire(&[1, 2]);
        c.release(&[1, 2]);
        for (insert, gone) in [(10, 4), (11, 3), (12, 2), (13, 1)] {
            assert_eq!(c.extend(&[insert], 0), 1);
            c.release(&[insert]);
            assert_eq!(c.lookup(&[gone]), 0, "{gone} should have gone for {insert}");
        }
        assert_eq!(c.evicted_total, 4);
        assert_eq!(c.lookup(&[11, 99, 12]), 1, "only a leading run counts");
    }

    #[test]
    fn shared_blocks_are_counted_once_and_evictable_only_when_unreferenced() {
        let mut c = PrefixCache::new(8);
        c.extend(&[1, 2, 3], 0);
        c.acquire(&[1, 2]); // a second sequence hits two blocks
        assert_eq!(
            (c.referenced_blocks(), c.referenced_among(&[1, 2, 3, 4])),
            (3, 3)
        );
        c.release(&[1, 2, 3]);
        assert_eq!((c.referenced_blocks(), c.evictable_blocks()), (2, 1));
        c.evict_to(0);
        assert_eq!(
            c.lookup(&[1, 2, 3]),
            2,
            "3 was evictable, 1 and 2 are in use"
        );
        // The second sequence extends its run [1, 2] with a block of its own.
        assert_eq!(c.extend(&[1, 2, 9], 2), 3);
        assert_eq!(c.referenced_blocks(), 3);
    }

    #[test]
    fn disabled_cache_keeps_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(!c.enabled());
        assert_eq!(c.extend(&[1, 2], 0), 0);
        assert_eq!((c.len(), c.lookup(&[1])), (0, 0));
    }
}
