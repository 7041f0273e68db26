//! Splitting work across the CPU's threads. Each thread gets one contiguous range, so a thread
//! streams its own rows of a weight matrix and caches stay warm.

use rayon::prelude::*;
use std::ops::Range;

/// Threads the CPU kernels use (rayon's pool; `RAYON_NUM_THREADS` overrides).
pub fn num_threads() -> usize {
    rayon::current_num_threads()
}

/// Runs `f` over `0..n` split into at most `num_threads()` contiguous ranges whose lengths are
/// multiples of `align`; runs inline when the work is too small to be worth a handoff.
pub fn parallel_ranges(
    n: usize,
    align: usize,
    worth_splitting: bool,
    f: impl Fn(Range<usize>) + Sync,
) {
    let threads = num_threads();
    if !worth_splitting || threads <= 1 || n <= align {
        f(0..n);
        return;
    }
    let units = n.div_ceil(align);
    let per = units.div_ceil(threads) * align;
    let parts = n.div_ceil(per);
    (0..parts)
        .into_par_iter()
        .for_each(|i| f(i * per..((i + 1) * per).min(n)));
}

/// A pointer to an output buffer whose disjoint parts several threads write.
#[derive(Clone, Copy)]
pub struct SharedOut(*mut f32, usize);

// SAFETY: users only write disjoint index sets from different threads (checked by design of
// the callers: each thread owns a distinct range of output columns or rows).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr(), out.len())
    }

    /// # Safety
    /// No other thread may access index `i` concurrently.
    #[inline(always)]
    pub unsafe fn write(&self, i: usize, v: f32) {
        debug_assert!(i < self.1);
        *self.0.add(i) = v;
    }
}
