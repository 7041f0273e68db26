//! Per-request randomness. Each sampler owns its generator; nothing is process-global except the
//! entropy counter that makes unseeded requests differ.
//!
//! The stream is keyed by (seed, step): step n's generator is `Xoshiro256++` seeded through
//! SplitMix64 from `seed ^ (n + 1) * GOLDEN`. A seeded run is therefore reproducible per step, not
//! just per request: resuming at step n (checkpoints, speculative rollback) draws the same numbers
//! without replaying the earlier steps, and other requests never touch this state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// 2^64 / golden ratio: the Weyl increment.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64 finalizer: a bijective 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A fresh seed for a request that gave none: wall-clock nanoseconds mixed with a Weyl sequence,
/// so two requests started in the same clock tick still differ.
pub fn fresh_seed() -> u64 {
    static WEYL: AtomicU64 = AtomicU64::new(0);
    let tick = WEYL.fetch_add(GOLDEN, Ordering::Relaxed).wrapping_add(GOLDEN);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    mix64(nanos ^ mix64(tick))
}

/// Xoshiro256++ (Blackman & Vigna): small, fast, and good enough for sampling.
#[derive(Clone, Debug)]
pub struct StepRng {
    s: [u64; 4],
}

impl StepRng {
    /// The generator for `step` of the request seeded with `seed`.
    pub fn for_step(seed: u64, step: u64) -> Self {
        let mut sm = seed ^ step.wrapping_add(1).wrapping_mul(GOLDEN);
        let mut s = [0u64; 4];
        for w in &mut s {
            sm = sm.wrapping_add(GOLDEN);
            *w = mix64(sm);
        }
        StepRng { s }
    }

    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = self.s;
        let out = s0.wrapping_add(s3).rotate_left(23).wrapping_add(s0);
        let t = s1 << 17;
        let mut s = [s0, s1, s2 ^ s0, s3 ^ s1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        self.s = s;
        out
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_steps_differ() {
        let a: Vec<u64> = (0..4).map(|_| StepRng::for_step(7, 3).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(StepRng::for_step(7, 3).next_u64(), StepRng::for_step(7, 4).next_u64());
        assert_ne!(StepRng::for_step(7, 3).next_u64(), StepRng::for_step(8, 3).next_u64());
    }

    #[test]
    fn uniform_mean_is_half() {
        let mut r = StepRng::for_step(1, 0);
        let n = 200_000;
        let mean: f64 = (0..n).map(|_| r.uniform()).sum::<f64>() / n as f64;
        // Standard error is 1/sqrt(12 n) ~ 6.5e-4; 5 sigma.
        assert!((mean - 0.5).abs() < 3.3e-3, "mean {mean}");
    }

    #[test]
    fn fresh_seeds_differ_back_to_back() {
        let seeds: Vec<u64> = (0..64).map(|_| fresh_seed()).collect();
        let mut sorted = seeds.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), seeds.len());
    }
}
