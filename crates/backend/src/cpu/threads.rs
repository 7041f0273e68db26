//! The CPU kernels' thread pool. A decode step runs a few hundred small parallel regions, so
//! the handoff must cost about a microsecond: workers spin on an epoch counter for a short
//! while after each region, then park on a condition variable (so an idle server uses no CPU).
//! Each thread gets one contiguous range of the work, so it streams its own weight rows.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker spins for the next region before parking.
const SPIN: Duration = Duration::from_micros(200);

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Incremented for every region; workers run the job when it changes.
    epoch: AtomicUsize,
    /// The current region's job (valid while `pending > 0`).
    job: UnsafeCell<Option<Job>>,
    /// Workers that have not finished the current region.
    pending: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `Pool::busy` before the epoch is
// published (Release) and read by workers after they observe the epoch (Acquire).
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    /// One region at a time; a concurrent caller runs its region inline instead of waiting.
    busy: Mutex<()>,
}

/// The process-wide pool, sized to the cores (`FERROLM_THREADS` overrides).
pub fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        super::alloc::tune();
        let n = std::env::var("FERROLM_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Pool::new(n.max(1))
    })
}

pub fn num_threads() -> usize {
    pool().threads
}

impl Pool {
    fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        for index in 1..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("ferrolm-cpu-{index}"))
                .spawn(move || worker(shared, index))
                .expect("spawn a CPU worker");
        }
        Self { shared, threads, busy: Mutex::new(()) }
    }

    /// Runs `f(i)` for every thread index i in 0..threads, the caller taking index 0.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let Ok(_guard) = self.busy.try_lock() else {
            (0..self.threads).for_each(f);
            return;
        };
        if self.threads == 1 {
            return f(0);
        }
        let s = &*self.shared;
        // SAFETY: we hold `busy`; workers read the job only after the epoch below changes, and
        // we wait for all of them to finish before `f` goes out of scope.
        unsafe { *s.job.get() = Some(std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f)) };
        s.pending.store(self.threads - 1, Ordering::Release);
        {
            let _lock = s.park.lock().unwrap();
            s.epoch.fetch_add(1, Ordering::AcqRel);
            s.wake.notify_all();
        }
        f(0);
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            backoff(&mut spins);
        }
    }
}

fn worker(s: Arc<Shared>, index: usize) {
    // Epoch 0 is the pool's creation: a region published before this thread first runs must
    // still be seen as new.
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen {
            backoff(&mut spins);
            if spins % 256 == 0 && start.elapsed() > SPIN {
                let lock = s.park.lock().unwrap();
                let _unused = s.wake.wait_while(lock, |_| s.epoch.load(Ordering::Acquire) == seen).unwrap();
            }
        }
        seen = s.epoch.load(Ordering::Acquire);
        // SAFETY: the job was stored before the epoch we observed was published.
        let job = unsafe { (*s.job.get()).expect("job set before the epoch") };
        unsafe { (*job)(index) };
        s.pending.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Busy-waits briefly, then yields the core: on a machine with more runnable threads than
/// cores, pure spinning would keep the thread we wait for off the CPU.
#[inline(always)]
fn backoff(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if *spins < 4096 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Pieces of a region per thread: each thread starts on its own piece and then takes the next
/// unclaimed one, so a thread that the OS preempts, or that drew costlier rows (attention items
/// over longer contexts), does not leave the other waiting at the region's end. Each piece is
/// still one contiguous range (one weight stream), and which thread runs a row never changes
/// its arithmetic.
const PIECES_PER_THREAD: usize = 4;

/// Runs `f` over `0..n` split into contiguous ranges whose lengths are multiples of `align`,
/// spread over the threads; runs inline when the work is too small to be worth a handoff.
pub fn parallel_ranges(n: usize, align: usize, worth_splitting: bool, f: impl Fn(Range<usize>) + Sync) {
    let threads = num_threads();
    if !worth_splitting || threads <= 1 || n <= align {
        f(0..n);
        return;
    }
    let units = n.div_ceil(align);
    let per = units.div_ceil(units.min(threads * PIECES_PER_THREAD)) * align;
    let pieces = n.div_ceil(per);
    let next = AtomicUsize::new(threads);
    pool().run(&|i| {
        let mut piece = i;
        while piece < pieces {
            f(piece * per..((piece + 1) * per).min(n));
            piece = next.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// A pointer to an output buffer whose disjoint parts several threads write.
#[derive(Clone, Copy)]
pub struct SharedOut(*mut f32, usize);

// SAFETY: users only write disjoint index sets from different threads (each thread owns a
// distinct range of output columns or rows).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr(), out.len())
    }

    /// The buffer's start, for kernels that write through a pointer (they must keep to the
    /// same rule as `write`).
    pub fn ptr(&self) -> *mut f32 {
        self.0
    }

    /// # Safety
    /// No other thread may access index `i` concurrently.
    #[inline(always)]
    pub unsafe fn write(&self, i: usize, v: f32) {
        debug_assert!(i < self.1);
        *self.0.add(i) = v;
    }

    pub fn len(&self) -> usize {
        self.1
    }

    pub fn is_empty(&self) -> bool {
        self.1 == 0
    }

    /// Elements `at..at + len` of this buffer.
    pub fn part(&self, at: usize, len: usize) -> Self {
        assert!(at + len <= self.1, "part {at}+{len} of {}", self.1);
        // SAFETY: inside the buffer (checked above).
        Self(unsafe { self.0.add(at) }, len)
    }
}

/// A vector of `n` floats that `fill` writes, all of them, through the `SharedOut` it is given
/// (typically from several threads). Not zeroed first: for a batched decode step's outputs
/// (the head's alone is 3 MB at 16 sequences) zeroing was a serial memset on the calling
/// thread, 2–4% of the step, while the workers waited.
///
/// # Safety
/// `fill` must write every element before it returns.
pub unsafe fn filled_vec(n: usize, fill: impl FnOnce(SharedOut)) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    fill(SharedOut(v.as_mut_ptr(), n));
    // SAFETY: the caller promised that `fill` wrote all n elements.
    unsafe { v.set_len(n) };
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_index_runs_exactly_once_across_many_regions() {
        let total = AtomicU64::new(0);
        for round in 0..2000u64 {
            parallel_ranges(1000, 8, true, |r| {
                total.fetch_add(r.map(|i| i as u64 + round).sum(), Ordering::Relaxed);
            });
        }
        let per_round = |round: u64| (0..1000u64).map(|i| i + round).sum::<u64>();
        assert_eq!(total.load(Ordering::Relaxed), (0..2000).map(per_round).sum::<u64>());
    }

    #[test]
    fn concurrent_callers_do_not_deadlock() {
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..500 {
                        let hits = AtomicU64::new(0);
                        parallel_ranges(64, 4, true, |r| {
                            hits.fetch_add(r.len() as u64, Ordering::Relaxed);
                        });
                        assert_eq!(hits.load(Ordering::Relaxed), 64);
                    }
                });
            }
        });
    }
}
