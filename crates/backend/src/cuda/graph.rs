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

use crate::graph::MIRROR_SLOTS;

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
    buffers: Vec<Tensor>,
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
    Ok(Captured { graph, buffers })
}

/// Drops a graph that was never replayed and keeps its buffers for the next [`capture`] of the
/// same step, as a warm-up's are kept.
pub fn rearm(c: Captured) {
    WARM_BUFFERS.with(|b| *b.borrow_mut() = c.buffers);
}

/// Replays a captured graph on its stream.
pub fn replay(c: &Captured) -> Result<()> {
    c.graph.launch().w()
}

/// Copies one-element u32 device tensors into pinned host slots without waiting; `wait` blocks
/// only on the copy it asks for. Two slots: the copy of step n can be in flight while step n+1
/// is queued behind it.
///
/// It also holds a token mirror: MIRROR_SLOTS u64 of pinned host memory mapped into the device, where
/// a greedy head kernel launched inside [`TokenReader::mirrored`] stores each step's (position,
/// token) itself. Replays of such a step then need nothing between them on the stream (no copy,
/// no event: each one cost the graph boundary a few microseconds), and
/// [`TokenReader::wait_mirrored`] polls the slot.
pub struct TokenReader {
    dev: CudaDevice,
    host: *mut u32,
    events: Vec<CudaEvent>,
    mirror: *mut u64,
}

thread_local! {
    /// The device address of the token mirror greedy head kernels launched now write (0: none),
    /// and whether one took it.
    static TOKEN_MIRROR: std::cell::Cell<(u64, bool)> = const { std::cell::Cell::new((0, false)) };
}

/// The token mirror for a greedy head kernel being launched (0 outside
/// [`TokenReader::mirrored`]); marks it taken.
pub fn take_token_mirror() -> u64 {
    TOKEN_MIRROR.with(|m| {
        let (addr, _) = m.get();
        m.set((addr, addr != 0));
        addr
    })
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
        // SAFETY: MIRROR_SLOTS u64s of page-locked host memory mapped into the device's address space
        // (unified addressing: the same address on both sides), freed in Drop.
        let mirror = unsafe { result::malloc_host(MIRROR_SLOTS * 8, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.w()? as *mut u64;
        // SAFETY: as above; zero is a tag no step writes (positions start at 1 after a step).
        unsafe { std::ptr::write_bytes(mirror, 0, MIRROR_SLOTS) };
        Ok(Self { dev: dev.clone(), host, events, mirror })
    }

    /// Empties the mirror's slots once the device is idle (no earlier step can still write
    /// them), so that no tag of an earlier generation is read as this one's.
    pub fn clear_mirror(&mut self) -> Result<()> {
        self.dev.cuda_stream().synchronize().w()?;
        // SAFETY: nothing on the device writes the slots now (synchronized above).
        unsafe { std::ptr::write_bytes(self.mirror, 0, MIRROR_SLOTS) };
        Ok(())
    }

    /// Runs `f` with this reader's mirror set for the greedy head kernels it launches or
    /// captures; returns `f`'s result and whether one of them took the mirror.
    pub fn mirrored<R>(&mut self, f: impl FnOnce() -> R) -> (R, bool) {
        TOKEN_MIRROR.with(|m| m.set((self.mirror as u64, false)));
        let out = f();
        let (_, taken) = TOKEN_MIRROR.with(|m| m.replace((0, false)));
        (out, taken)
    }

    /// Waits until the mirror holds the token of the step that advanced the position to `pos`,
    /// and returns it, asking the stream for errors now and then so that a failed step ends
    /// the wait. Spins by default; with `FERROLM_TOKEN_POLL_US=n` it sleeps n µs between looks
    /// instead (the host reads one launch behind the device, so a late look costs the client a
    /// few µs of latency but the device nothing, while a spinning host holds a core).
    pub fn wait_mirrored(&mut self, pos: u32) -> Result<u32> {
        let slot = pos as usize % MIRROR_SLOTS;
        let sleep = poll_sleep();
        for look in 0u64.. {
            if let Some(token) = self.mirrored_token(slot, pos) {
                return Ok(token);
            }
            if sleep.is_some() || look % 4096 == 4095 {
                self.check_stream(slot, pos)?;
            }
            match sleep {
                Some(d) => std::thread::sleep(d),
                None => std::hint::spin_loop(),
            }
        }
        unreachable!()
    }

    /// The token in `slot` when its tag says it is step `pos`'s.
    fn mirrored_token(&self, slot: usize, pos: u32) -> Option<u32> {
        // SAFETY: a slot of our mapped allocation; the device writes it whole (8 bytes).
        let v = unsafe { std::ptr::read_volatile(self.mirror.add(slot)) };
        ((v >> 32) as u32 == pos).then_some(v as u32)
    }

    /// Fails when the stream failed, or went idle without step `pos` writing its slot (the step
    /// took no mirror).
    fn check_stream(&self, slot: usize, pos: u32) -> Result<()> {
        // SAFETY: a query of our live stream; it enqueues nothing.
        match unsafe { sys::cuStreamQuery(self.dev.cuda_stream().cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS if self.mirrored_token(slot, pos).is_none() => {
                candle_core::bail!("decode step {pos}: the token mirror was not written")
            }
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            e => e.result().w(),
        }
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

/// The pause between looks at the token mirror (`FERROLM_TOKEN_POLL_US`); `None`: spin.
fn poll_sleep() -> Option<std::time::Duration> {
    static SLEEP: std::sync::OnceLock<Option<std::time::Duration>> = std::sync::OnceLock::new();
    *SLEEP.get_or_init(|| {
        let us = std::env::var("FERROLM_TOKEN_POLL_US").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        (us > 0).then(|| std::time::Duration::from_micros(us))
    })
}

impl Drop for TokenReader {
    fn drop(&mut self) {
        // A replay may still be writing the mirror.
        let _ = self.dev.cuda_stream().synchronize();
        for e in &self.events {
            let _ = e.synchronize();
        }
        // SAFETY: allocated by malloc_host in new; no copy into it is pending.
        unsafe {
            let _ = result::free_host(self.host as *mut std::ffi::c_void);
            let _ = result::free_host(self.mirror as *mut std::ffi::c_void);
        }
    }
}
