//! CUDA graphs for fixed-shape steps, and pinned read-back of token ids.
//!
//! A step is captured from candle's stream while candle's host-to-device cache is on (so layout
//! uploads come from buffers made during the warm-up run); allocations inside the capture become
//! graph memory nodes and must be freed inside it too (only pre-existing buffers persist). A
//! capture that fails for any reason ends the capture and leaves nothing behind: the caller runs
//! the step eagerly instead.

use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaEvent, CudaGraph};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{Result, Tensor};

/// Runs `f` once with candle's host-to-device cache on (a warm-up before [`capture`]: every
/// small upload the step makes is cached, so the capture can reuse it).
pub fn warm_up(dev: &CudaDevice, f: &mut dyn FnMut() -> Result<()>) -> Result<()> {
    let _cache = dev.enable_cuda_graph_htod_cache();
    super::arena::record();
    let ran = f();
    WARM_BUFFERS.with(|b| *b.borrow_mut() = super::arena::stop_recording());
    ran
}

thread_local! {
    /// The buffers the last warm-up allocated, for the capture that follows (see arena.rs).
    static WARM_BUFFERS: std::cell::RefCell<Vec<Tensor>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A captured step and the buffers its kernels write.
pub struct Captured {
    pub graph: CudaGraph,
    _buffers: Vec<Tensor>,
}

/// Records `f` on the device's stream into a graph (nothing executes). Errors leave the stream
/// out of capture mode.
pub fn capture(dev: &CudaDevice, f: &mut dyn FnMut() -> Result<()>) -> Result<Captured> {
    let stream = dev.cuda_stream();
    stream.synchronize().w()?;
    let _cache = dev.enable_cuda_graph_htod_cache();
    super::arena::replay(WARM_BUFFERS.with(|b| std::mem::take(&mut *b.borrow_mut())));
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .w()?;
    let ran = f();
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    let (buffers, all_used) = super::arena::stop_replay();
    ran?;
    let graph = ended.w()?.ok_or_else(|| candle_core::Error::Msg("the captured step recorded no work".into()))?;
    if !all_used {
        candle_core::bail!("step arena: the capture allocated fewer buffers than its warm-up");
    }
    graph.upload().w()?;
    if super::profile::enabled() {
        eprintln!("{}", super::profile::graph_nodes(graph.cu_graph()));
    }
    Ok(Captured { graph, _buffers: buffers })
}

/// Replays a captured graph on its stream.
pub fn replay(c: &Captured) -> Result<()> {
    c.graph.launch().w()
}

/// Copies one-element u32 device tensors into pinned host slots without waiting; `wait` blocks
/// only on the copy it asks for. Two slots: the copy of step n can be in flight while step n+1
/// is queued behind it.
pub struct TokenReader {
    dev: CudaDevice,
    host: *mut u32,
    events: Vec<CudaEvent>,
}

// SAFETY: the pinned slots are only touched through &mut self.
unsafe impl Send for TokenReader {}

pub const SLOTS: usize = 2;

impl TokenReader {
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().w()?;
        // SAFETY: SLOTS u32s of page-locked host memory, freed in Drop.
        let host = unsafe { result::malloc_host(SLOTS * 4, 0) }.w()? as *mut u32;
        let events = (0..SLOTS)
            .map(|_| ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .w()?;
        Ok(Self { dev: dev.clone(), host, events })
    }

    /// Queues the copy of `t` (one u32 on this device) into `slot`.
    pub fn queue(&mut self, t: &Tensor, slot: usize) -> Result<()> {
        let src = super::ptr(t)?;
        let stream = self.dev.cuda_stream();
        // SAFETY: 4 bytes from a live device tensor into our pinned slot, ordered on the stream.
        unsafe {
            result::memcpy_dtoh_async(std::slice::from_raw_parts_mut(self.host.add(slot), 1), src, stream.cu_stream())
        }
        .w()?;
        self.events[slot].record(&stream).w()
    }

    /// Waits for the copy queued into `slot` and returns the value.
    pub fn wait(&mut self, slot: usize) -> Result<u32> {
        self.events[slot].synchronize().w()?;
        // SAFETY: the copy into this slot has completed.
        Ok(unsafe { std::ptr::read_volatile(self.host.add(slot)) })
    }
}

impl Drop for TokenReader {
    fn drop(&mut self) {
        for e in &self.events {
            let _ = e.synchronize();
        }
        // SAFETY: allocated by malloc_host in new; no copy into it is pending.
        unsafe {
            let _ = result::free_host(self.host as *mut std::ffi::c_void);
        }
    }
}
