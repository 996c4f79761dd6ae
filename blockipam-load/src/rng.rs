//! The seeded random source of a run's schedule: SplitMix64, written out here so that a seed gives
//! the same schedule whatever version of a random-number crate is in the lock file.

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit state advanced by a constant and mixed.
/// Not cryptographic; only repeatable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The generator of one stream derived from `seed` (for example one per simulated node), so
    /// that each stream is the same whatever the other streams do.
    pub fn derived(seed: u64, stream: u64) -> Self {
        let mut base = SplitMix64::new(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        SplitMix64::new(base.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..bound` (0 when `bound` is 0), by multiply-and-shift.
    pub fn below(&mut self, bound: usize) -> usize {
        ((u128::from(self.next_u64()) * bound as u128) >> 64) as usize
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// An exponentially distributed gap with `rate` events per unit (mean `1 / rate`).
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -(1.0 - self.unit()).ln() / rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_numbers_and_another_seed_others() {
        let first: Vec<u64> = {
            let mut rng = SplitMix64::new(42);
            (0..8).map(|_| rng.next_u64()).collect()
        };
        let again: Vec<u64> = {
            let mut rng = SplitMix64::new(42);
            (0..8).map(|_| rng.next_u64()).collect()
        };
        let other: Vec<u64> = {
            let mut rng = SplitMix64::new(43);
            (0..8).map(|_| rng.next_u64()).collect()
        };
        assert_eq!(first, again);
        assert_ne!(first, other);
        // The published first output of SplitMix64 seeded with 0.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn bounded_draws_stay_in_range_and_cover_it() {
        let mut rng = SplitMix64::derived(7, 3);
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let n = rng.below(5);
            assert!(n < 5);
            seen[n] = true;
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(rng.exponential(2.0) >= 0.0);
        }
        assert!(seen.iter().all(|s| *s), "{seen:?}");
        assert_eq!(rng.below(0), 0);
    }
}
