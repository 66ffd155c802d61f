//! Injectable randomness for the choice (ties, and later power-of-two sampling).
//!
//! The core never draws entropy itself: the glue seeds a generator from the host clock, the
//! tests seed it with constants, so every decision is reproducible in a test. SplitMix64
//! (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014) is
//! tiny, has no bad seeds, and is plenty for load balancing.

/// Anything that yields uniformly distributed 64-bit values.
pub trait Rng {
    fn next_u64(&mut self) -> u64;
}

/// The SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }
}

impl Rng for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_seeds_differ() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        let mut c = SplitMix64::new(8);
        let xs: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..4).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..4).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
        assert!(xs.windows(2).all(|w| w[0] != w[1]));
    }
}
