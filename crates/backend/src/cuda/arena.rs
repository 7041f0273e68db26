//! Buffers of a captured step, made before the capture. Allocating inside a capture records a
//! memory node per allocation into the graph (and a free node per release), each a node the
//! replay walks through. Instead, the warm-up run records the sequence of buffers ferrolm's
//! kernels allocate ([`Recording`]), and the capture that follows gets the same buffers back in
//! the same order ([`Replaying`]): the graph holds only kernels, writing to buffers that live as
//! long as the graph. The step is deterministic, so the n-th request of the capture asks for the
//! shape of the n-th request of the warm-up; a mismatch fails the capture (eager fallback).

use candle_core::{DType, Result, Shape, Tensor};
use std::cell::RefCell;

enum Mode {
    Off,
    Recording(Vec<Tensor>),
    Replaying { buffers: Vec<Tensor>, next: usize },
}

thread_local! {
    static MODE: RefCell<Mode> = const { RefCell::new(Mode::Off) };
}

fn enabled() -> bool {
    !std::env::var("FERROLM_CUDA_ARENA").is_ok_and(|v| v == "0")
}

/// Starts recording the buffers allocated on this thread (the warm-up run).
pub fn record() {
    if enabled() {
        MODE.with(|m| *m.borrow_mut() = Mode::Recording(Vec::new()));
    }
}

/// Stops recording; the buffers stay kept for a [`replay`] that follows.
pub fn stop_recording() -> Vec<Tensor> {
    MODE.with(|m| match std::mem::replace(&mut *m.borrow_mut(), Mode::Off) {
        Mode::Recording(b) => b,
        _ => Vec::new(),
    })
}

/// Hands `buffers` out again, in order, to the allocations of this thread (the capture).
pub fn replay(buffers: Vec<Tensor>) {
    if !buffers.is_empty() {
        MODE.with(|m| *m.borrow_mut() = Mode::Replaying { buffers, next: 0 });
    }
}

/// Ends a replay; returns the buffers (the graph keeps them) and whether every one was used.
pub fn stop_replay() -> (Vec<Tensor>, bool) {
    MODE.with(|m| match std::mem::replace(&mut *m.borrow_mut(), Mode::Off) {
        Mode::Replaying { buffers, next } => {
            let all = next == buffers.len();
            (buffers, all)
        }
        _ => (Vec::new(), true),
    })
}

/// Starts handing out the replayed buffers from the first again: the next step of a capture that
/// records several steps reuses the buffers of the one before (the steps run one after another
/// on the stream, as replays of a one-step graph would). Fails when the step before did not
/// use them all (its sequence diverged from the warm-up's).
pub fn restart_replay() -> Result<()> {
    MODE.with(|m| match &mut *m.borrow_mut() {
        Mode::Replaying { buffers, next } if *next != buffers.len() => {
            candle_core::bail!("step arena: a step used {} of {} recorded buffers", next, buffers.len())
        }
        Mode::Replaying { next, .. } => {
            *next = 0;
            Ok(())
        }
        _ => Ok(()),
    })
}

/// The buffer for this allocation while replaying (an error when the sequence diverges).
pub(crate) fn take(shape: &Shape, dtype: DType) -> Result<Option<Tensor>> {
    MODE.with(|m| match &mut *m.borrow_mut() {
        Mode::Replaying { buffers, next } => {
            let Some(t) = buffers.get(*next) else { candle_core::bail!("step arena: more allocations than recorded") };
            if t.shape() != shape || t.dtype() != dtype {
                candle_core::bail!(
                    "step arena: allocation {} is {shape:?} {dtype:?}, recorded {:?} {:?}",
                    *next,
                    t.shape(),
                    t.dtype()
                )
            }
            *next += 1;
            Ok(Some(t.clone()))
        }
        _ => Ok(None),
    })
}

/// Keeps a fresh allocation while recording.
pub(crate) fn keep(t: &Tensor) {
    MODE.with(|m| {
        if let Mode::Recording(b) = &mut *m.borrow_mut() {
            b.push(t.clone());
        }
    })
}
