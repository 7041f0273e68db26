//! Fixed-shape steps recorded once and replayed (CUDA graphs), and token ids read back without
//! stalling the queue. Device-agnostic: on devices without graphs, [`capture`] reports that and
//! the caller runs its step eagerly; [`TokenReader`] reads at once.

use candle_core::{Device, Result, Tensor};

/// A captured step.
pub struct StepGraph {
    #[cfg(feature = "cuda")]
    graph: crate::cuda::graph::Captured,
}

// SAFETY: the graph's handles are plain driver objects, usable from any thread: cudarc binds
// the owning context to the calling thread before each launch, upload and destroy. A model keeps
// its batched step graphs behind a mutex (one thread at a time).
unsafe impl Send for StepGraph {}

/// Whether steps on `device` can be captured.
pub fn supported(device: &Device) -> bool {
    cfg!(feature = "cuda") && matches!(device, Device::Cuda(_))
}

/// Runs `f` as the warm-up before a capture (on CUDA: with candle's host-to-device cache on, so
/// every small upload the step makes is kept for the capture to reuse).
pub fn warm_up(device: &Device, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => crate::cuda::graph::warm_up(d, f),
        _ => f(),
    }
}

/// Records `f` without running it. Fails on devices without graphs, or when `f` does anything a
/// capture cannot hold (a host copy, a synchronization, an upload the warm-up did not make); the
/// device is then as before and the caller runs the step eagerly.
pub fn capture(device: &Device, f: &mut dyn FnMut() -> Result<()>) -> Result<StepGraph> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => Ok(StepGraph { graph: crate::cuda::graph::capture(d, f)? }),
        _ => {
            let _ = f;
            candle_core::bail!("no step graphs on {device:?}")
        }
    }
}

impl StepGraph {
    /// Drops this graph (never replayed) and keeps the buffers its step writes for the next
    /// [`capture`] of the same step, which then needs no new warm-up.
    pub fn rearm(self) {
        #[cfg(feature = "cuda")]
        crate::cuda::graph::rearm(self.graph);
    }

    /// Queues one replay of the captured step.
    pub fn replay(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        return crate::cuda::graph::replay(&self.graph);
        #[cfg(not(feature = "cuda"))]
        candle_core::bail!("no step graphs in this build")
    }
}

/// Read-back slots of a [`TokenReader`]: step n's token can be read while step n+1 runs.
pub const SLOTS: usize = 2;

/// Slots of the token mirror (the head kernel's MIRROR_SLOTS): a graph of up to
/// `MIRROR_SLOTS / 2` steps can run while the host reads the tokens of the graph before it.
pub const MIRROR_SLOTS: usize = 8;

/// Inside the capture of a graph that records several steps, between two of them: the next
/// step reuses the buffers the step before took from the warm-up's (on CUDA, the step arena),
/// and its first kernel starts after the step before has finished (kernels read the position
/// the previous step's head advanced before their programmatic wait). Fails when the step
/// before took fewer than the warm-up made (the capture then fails, and the caller runs its
/// steps eagerly).
pub fn next_captured_step(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            crate::cuda::after_all();
            crate::cuda::arena::restart_replay()
        }
        _ => Ok(()),
    }
}

/// Reads one-element u32 tensors (sampled token ids) back to the host: `queue` starts the copy
/// behind the work already queued, `wait` returns it. Two slots, so that step n's token can be
/// read while step n+1 runs.
pub struct TokenReader {
    #[cfg(feature = "cuda")]
    cuda: Option<crate::cuda::graph::TokenReader>,
    ready: [u32; SLOTS],
}

impl TokenReader {
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            #[cfg(feature = "cuda")]
            cuda: match device {
                Device::Cuda(d) => Some(crate::cuda::graph::TokenReader::new(d)?),
                _ => None,
            },
            ready: [0; SLOTS],
        })
        .inspect(|_: &Self| {
            let _ = device;
        })
    }

    pub fn queue(&mut self, t: &Tensor, slot: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.queue(t, slot);
        }
        self.ready[slot] = t.flatten_all()?.to_vec1::<u32>()?[0];
        Ok(())
    }

    pub fn wait(&mut self, slot: usize) -> Result<u32> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.wait(slot);
        }
        Ok(self.ready[slot])
    }

    /// Runs `f` (a step, or its capture) with this reader's token mirror set: a greedy step
    /// whose head kernel can (CUDA) then stores its token into host memory itself, readable by
    /// [`TokenReader::wait_mirrored`] with nothing queued between steps. Returns `f`'s result
    /// and whether the step took the mirror (never on other devices).
    pub fn mirrored<R>(&mut self, f: impl FnOnce() -> R) -> (R, bool) {
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.mirrored(f);
        }
        (f(), false)
    }

    /// Before a generation's mirrored steps: waits for the device and empties the mirror, so
    /// that no token of an earlier generation is read as one of this one's.
    pub fn clear_mirror(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.clear_mirror();
        }
        Ok(())
    }

    /// The token of the mirrored step that advanced the decode position to `pos`, once written.
    pub fn wait_mirrored(&mut self, pos: u32) -> Result<u32> {
        #[cfg(feature = "cuda")]
        if let Some(c) = &mut self.cuda {
            return c.wait_mirrored(pos);
        }
        candle_core::bail!("no token mirror on this device (step {pos})")
    }
}

/// The kernel timings recorded since the last call (`FERROLM_CUDA_PROFILE=1`, CUDA devices,
/// eager work only), per step of `steps`; `None` when profiling is off or the device has none.
/// Waits for the device.
pub fn profile_report(device: &Device, steps: usize) -> Result<Option<String>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) if crate::cuda::profile::enabled() => crate::cuda::profile::report(d, steps).map(Some),
        _ => {
            let _ = steps;
            Ok(None)
        }
    }
}
