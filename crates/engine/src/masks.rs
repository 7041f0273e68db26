//! The grammar masks of a step's constrained decode rows, computed before sampling (issue 33).
//! A row's first mask depends only on the tokens its constraint has already consumed, so it is
//! known once the step's rows are: the masks of different sequences are independent
//! (llguidance matchers share only their compiled grammar, behind its own lock), so they can be
//! computed side by side, and during the forward. The sampler then takes them exactly as if
//! computed in place: the same masks, so the same tokens, logprobs and random draws.

use crate::constraint::TokenConstraint;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// When the masks of a step's constrained rows are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskSchedule {
    /// One after another, after the forward (the first version; kept as the baseline).
    Serial,
    /// After the forward, spread over the CPU pool's threads.
    Parallel,
    /// During the forward, on a helper thread that spreads them over the CPU pool when the
    /// forward leaves it idle (a GPU forward); on a CPU forward it computes them one by one on
    /// a core the forward also wants.
    Overlap,
}

impl MaskSchedule {
    /// Overlap where the forward runs on a device (the engine thread only launches kernels and
    /// the cores are free: the helper spreads the masks over the pool); parallel after the
    /// forward on the CPU, where the forward's regions already take every core of the pool.
    /// Measured (bench/results/structured.md): 16 rows' masks over the pool take 1/5 of the
    /// serial median and 1/9 to 1/13 of its p99 on 16 quiet cores, half on 2 quiet cores; on
    /// the 2-core dev machine oversubscribed by other work (load 8-11) parallel was slower than
    /// serial (its regions wait for a descheduled thread), and overlap took the masks off the
    /// step's path with no gain in the step beyond the machine's spread. Overlap on a GPU is
    /// not measured yet.
    pub fn for_device(device: &candle_core::Device) -> Self {
        if device.is_cpu() {
            Self::Parallel
        } else {
            Self::Overlap
        }
    }
}

/// Where a step's mask time went.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaskTimes {
    /// Masks computed (constrained decode rows).
    pub rows: usize,
    /// Time the engine thread spent on them or waiting for them: what they add to the step.
    pub waited: Duration,
    /// Their computing time summed over rows (on whatever thread computed them).
    pub work: Duration,
}

/// The computed first mask of a row (None until computed), or why the constraint failed.
pub type Premask = Option<Result<Vec<u32>, String>>;

/// One constrained row's first mask to compute: its sequence's constraint and where the mask
/// goes.
pub struct MaskJob<'s> {
    constraint: &'s mut dyn TokenConstraint,
    out: &'s mut Premask,
}

impl<'s> MaskJob<'s> {
    pub fn new(constraint: &'s mut dyn TokenConstraint, out: &'s mut Premask) -> Self {
        Self { constraint, out }
    }

    /// Computes the mask into its slot; returns how long it took. A panic in the constraint
    /// becomes that row's error (a pool worker must not unwind).
    fn run(&mut self) -> Duration {
        let start = Instant::now();
        let mask = std::panic::catch_unwind(AssertUnwindSafe(|| self.constraint.mask()))
            .unwrap_or_else(|p| Err(format!("grammar mask: {}", crate::service::panic_message(p))));
        *self.out = Some(mask);
        start.elapsed()
    }
}

/// Runs `forward` and computes `jobs` as `schedule` says; returns the forward's result and the
/// masks' times. `cpu_forward`: the forward runs on the CPU pool (so a helper thread must not
/// take it).
pub fn with_forward<R>(
    schedule: MaskSchedule,
    cpu_forward: bool,
    jobs: &mut [MaskJob<'_>],
    forward: impl FnOnce() -> R,
) -> (R, MaskTimes) {
    let rows = jobs.len();
    if rows == 0 {
        return (forward(), MaskTimes::default());
    }
    let (result, waited, work) = match schedule {
        MaskSchedule::Serial | MaskSchedule::Parallel => {
            let result = forward();
            let start = Instant::now();
            let work = compute(jobs, schedule == MaskSchedule::Parallel);
            (result, start.elapsed(), work)
        }
        MaskSchedule::Overlap => std::thread::scope(|s| {
            let helper = s.spawn(|| compute(jobs, !cpu_forward));
            let result = forward();
            let start = Instant::now();
            let work = helper.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            (result, start.elapsed(), work)
        }),
    };
    (result, MaskTimes { rows, waited, work })
}

/// Computes every job's mask, over the CPU pool's threads when `parallel` (each thread takes
/// the next job left: a few masks cost 50 times the median); returns the summed time.
fn compute(jobs: &mut [MaskJob<'_>], parallel: bool) -> Duration {
    let pool = ferrolm_backend::cpu::threads::pool();
    if !parallel || jobs.len() < 2 || ferrolm_backend::cpu::threads::num_threads() < 2 {
        return jobs.iter_mut().map(MaskJob::run).sum();
    }
    let slots: Vec<Mutex<&mut MaskJob<'_>>> = jobs.iter_mut().map(Mutex::new).collect();
    let (next, nanos) = (AtomicUsize::new(0), AtomicU64::new(0));
    pool.run(&|_thread| {
        while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
            let took = slot.lock().unwrap_or_else(|e| e.into_inner()).run();
            nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        }
    });
    Duration::from_nanos(nanos.into_inner())
}
