//! NVIDIA GPUs (feature `cuda`): device setup, ferrolm's own kernels (`kernels.cu`, compiled to
//! PTX by build.rs) and the captured decode step (`graph.rs`).
//!
//! The kernels are launched directly on candle's stream with raw device pointers; every wrapper
//! returns `Ok(None)` when its inputs are outside what the kernel handles (dtype, layout, sizes),
//! and the caller then runs the generic candle composition. Positions are either host values or
//! a device word ([`Pos`]), so a step captured once replays at every position.
//!
//! Debug levers, read once: `FERROLM_CUDA_KERNELS=0` turns every ferrolm kernel off (candle ops
//! only), `FERROLM_CUDA_GEMV=0` only the batch-1 matrix-vector kernel (cuBLAS instead),
//! `FERROLM_CUDA_GEMV=smem` picks its shared-memory variant, `FERROLM_CUDA_SOFTMAX=0` turns off
//! the fused masked softmax of prefill attention (candle's mask + softmax instead),
//! `FERROLM_CUDA_LAYER=1` turns on the one-kernel decode layer (`layer.rs`, experimental),
//! `FERROLM_CUDA_PTX=file.ptx` loads the kernels from that file instead of the built-in PTX (kernel
//! variants compiled with other `-D` switches, A/B'd against one binary: `scripts/gpu/ptx_variants.sh`).

use candle_core::cuda_backend::cudarc::driver::{sys, DevicePtr};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{CudaStorage, DType, Device, Result, Shape, Storage, Tensor};
use std::sync::OnceLock;

const BUILT_IN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ferrolm_kernels.ptx"));

/// The kernels' PTX: the built-in one, or the file `FERROLM_CUDA_PTX` names (read once; a
/// file that cannot be read fails every launch instead of falling back silently).
pub(crate) fn ptx() -> Result<&'static str> {
    static TEXT: OnceLock<std::result::Result<&'static str, String>> = OnceLock::new();
    let text = TEXT.get_or_init(|| match std::env::var("FERROLM_CUDA_PTX") {
        Ok(path) => std::fs::read_to_string(&path)
            .map(|text| &*Box::leak(text.into_boxed_str()))
            .map_err(|e| format!("FERROLM_CUDA_PTX={path}: {e}")),
        Err(_) => Ok(BUILT_IN_PTX),
    });
    text.clone().map_err(candle_core::Error::Msg)
}
pub(crate) const MODULE: &str = "ferrolm_kernels";

/// A CUDA device on its own stream, without per-tensor event tracking (one stream orders all
/// work; events on every allocation cost host time and cannot be captured), and with the
/// stream-ordered allocator keeping freed memory for reuse instead of returning it at each sync.
pub fn new_device(ordinal: usize) -> Result<Device> {
    let dev = CudaDevice::new_with_stream(ordinal)?;
    // SAFETY: ferrolm submits all work on this one stream (graph replays included).
    unsafe { dev.disable_event_tracking() };
    keep_freed_memory(&dev);
    Ok(Device::Cuda(dev))
}

fn keep_freed_memory(dev: &CudaDevice) {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    if ctx.bind_to_thread().is_err() {
        return;
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: plain driver calls on this context's device; failures leave the default in place.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS {
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            sys::cuMemPoolSetAttribute(pool, attr, &mut threshold as *mut u64 as *mut std::ffi::c_void);
        }
    }
}

/// Which of ferrolm's kernels are on (debug levers, read once per process).
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    pub kernels: bool,
    pub gemv: bool,
    /// `FERROLM_CUDA_GEMV=smem`: the matrix-vector kernel that stages x in shared memory.
    pub gemv_smem: bool,
    /// Prefill attention through the fused masked-softmax kernel (`FERROLM_CUDA_SOFTMAX=0`: off).
    pub masked_softmax: bool,
    /// Programmatic dependent launch (see `launch_raw`); `FERROLM_CUDA_PDL=0` turns it off.
    pub pdl: bool,
    /// `FERROLM_CUDA_LAYER=1`: a decode layer as one persistent kernel (`layer.rs`; measured
    /// slower than the five separate kernels so far, hence off by default).
    pub layer_kernel: bool,
    /// The greedy argmax inside the head's product (`FERROLM_CUDA_HEAD_ARGMAX=0`: the separate
    /// argmax kernels after it).
    pub head_argmax: bool,
    /// Prefill attention through the flash kernel (`FERROLM_CUDA_FLASH=0`: the masked-softmax
    /// composition).
    pub flash_prefill: bool,
}

pub fn policy() -> Policy {
    static P: OnceLock<Policy> = OnceLock::new();
    *P.get_or_init(|| {
        let off = |k: &str| std::env::var(k).is_ok_and(|v| v == "0");
        let kernels = !off("FERROLM_CUDA_KERNELS");
        let smem = std::env::var("FERROLM_CUDA_GEMV").is_ok_and(|v| v == "smem");
        let softmax = !off("FERROLM_CUDA_SOFTMAX");
        let pdl = !off("FERROLM_CUDA_PDL");
        let gemv = kernels && !off("FERROLM_CUDA_GEMV");
        let layer_kernel = gemv && std::env::var("FERROLM_CUDA_LAYER").is_ok_and(|v| v == "1");
        let head_argmax = gemv && !off("FERROLM_CUDA_HEAD_ARGMAX");
        let flash_prefill = kernels && !off("FERROLM_CUDA_FLASH");
        Policy { kernels, gemv, gemv_smem: kernels && smem, masked_softmax: kernels && softmax, pdl, layer_kernel, head_argmax, flash_prefill }
    })
}

/// A position read by a kernel: known on the host, or the u32 in a one-element device tensor
/// (captured steps).
#[derive(Clone, Copy)]
pub enum Pos<'a> {
    Host(usize),
    Device(&'a Tensor),
}

/// The CUDA device of a tensor, if it is on one.
pub(crate) fn cuda_device(t: &Tensor) -> Option<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Some(d.clone()),
        _ => None,
    }
}

/// Device address of a tensor's first element (callers check the layout they index with).
pub(crate) fn ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else { candle_core::bail!("ferrolm cuda kernel: tensor not on a CUDA device") };
    Ok(slice_ptr(s)? + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

fn slice_ptr(s: &CudaStorage) -> Result<u64> {
    let stream = s.device.cuda_stream();
    Ok(match &s.slice {
        CudaStorageSlice::BF16(x) => x.device_ptr(&stream).0,
        CudaStorageSlice::F16(x) => x.device_ptr(&stream).0,
        CudaStorageSlice::F32(x) => x.device_ptr(&stream).0,
        CudaStorageSlice::U32(x) => x.device_ptr(&stream).0,
        CudaStorageSlice::U8(x) => x.device_ptr(&stream).0,
        CudaStorageSlice::I64(x) => x.device_ptr(&stream).0,
        _ => candle_core::bail!("ferrolm cuda kernel: unsupported storage dtype"),
    })
}

/// The device address a position argument passes (0 = use the host value) and the host value.
pub(crate) fn pos_args(pos: Pos<'_>) -> Result<(u64, u32)> {
    match pos {
        Pos::Host(p) => Ok((0, p as u32)),
        Pos::Device(t) => {
            if t.dtype() != DType::U32 || t.elem_count() != 1 {
                candle_core::bail!("device position must be a one-element u32 tensor")
            }
            Ok((ptr(t)?, 0))
        }
    }
}

/// A fresh contiguous tensor of `shape` on `dev` (contents unset until a kernel writes them).
pub(crate) fn alloc(dev: &CudaDevice, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
    let shape = shape.into();
    if let Some(t) = arena::take(&shape, dtype)? {
        return Ok(t);
    }
    let n = shape.elem_count();
    // SAFETY: every caller launches a kernel that writes all n elements before the tensor is read.
    let slice = unsafe {
        match dtype {
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
            DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
            DType::U32 => CudaStorageSlice::U32(dev.alloc::<u32>(n)?),
            d => candle_core::bail!("ferrolm cuda alloc: unsupported dtype {d:?}"),
        }
    };
    let storage = Storage::Cuda(CudaStorage { slice, device: dev.clone() });
    let t = Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false);
    arena::keep(&t);
    Ok(t)
}

/// A u32 buffer of `n` zeros on `dev`. Inside a step replayed from the arena it is the buffer
/// the warm-up zeroed, not zeroed again: callers must leave it at zero when done.
pub(crate) fn alloc_zeroed_u32(dev: &CudaDevice, n: usize) -> Result<Tensor> {
    if let Some(t) = arena::take(&Shape::from(n), DType::U32)? {
        return Ok(t);
    }
    let t = Tensor::zeros(n, DType::U32, &Device::Cuda(dev.clone()))?;
    arena::keep(&t);
    Ok(t)
}

/// Kernel-name suffix of a dtype ferrolm's kernels take.
pub(crate) fn suffix(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::BF16 => Some("bf16"),
        DType::F32 => Some("f32"),
        _ => None,
    }
}

/// One kernel launch on the device's stream: `launch!(dev, "name", (gx, gy, gz), block, args…)`.
/// Each argument is bound to a local that lives until the launch.
macro_rules! launch {
    ($dev:expr, $name:expr, $grid:expr, $block:expr, $($arg:expr),* $(,)?) => {{
        let func = $dev.get_or_load_custom_func($name, $crate::cuda::MODULE, $crate::cuda::ptx()?)?;
        let grid: (u32, u32, u32) = $grid;
        let smem = $crate::cuda::launch_smem();
        let mut params: Vec<*mut std::ffi::c_void> = Vec::new();
        $(
            // Shadowed, not dropped: every argument lives until the end of this block.
            let arg = $arg;
            params.push(&arg as *const _ as *mut std::ffi::c_void);
        )*
        let span = $crate::cuda::profile::begin(&$dev);
        // SAFETY: the wrappers in ops.rs pass the argument list each kernel declares in
        // kernels.cu, with pointers to live device buffers of the sizes the kernel indexes.
        unsafe { $crate::cuda::launch_raw(&$dev, func.cu_function(), grid, $block, smem, &mut params) }?;
        $crate::cuda::profile::end(&$dev, span, $name, grid);
    }};
}

/// Launches `f` on the device's stream with `params` (pointers to each argument). With
/// `FERROLM_CUDA_PDL=1` the launch allows programmatic dependent launch: the kernel may be
/// scheduled while the previous one drains, and waits (`griddepcontrol.wait`, in the prologue
/// every kernel in kernels.cu starts with) before touching memory, hiding the launch gap between the
/// short kernels of a decode step.
///
/// # Safety
/// `params` must match the kernel's parameter list, pointing at live values.
pub(crate) unsafe fn launch_raw(
    dev: &CudaDevice,
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    params: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    use candle_core::cuda_backend::WrapErr;
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
    let mut n = 0;
    // A cooperative kernel never waits for its predecessor (griddepcontrol): no early launch.
    let cooperative = COOPERATIVE.with(|c| c.replace(false));
    let after_all = AFTER_ALL.with(|c| c.replace(false));
    if policy().pdl && !cooperative && !after_all {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cooperative {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        attrs[n].value.cooperative = 1;
        n += 1;
    }
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()).result().w()
}

thread_local! {
    /// Dynamic shared memory for the next `launch!` on this thread (set by `with_smem`).
    static SMEM: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Whether the next `launch!` on this thread is cooperative (set by `cooperatively`).
    static COOPERATIVE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether the next `launch!` on this thread waits for all earlier work (set by `after_all`).
    static AFTER_ALL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the next `launch!` on this thread start only once every kernel before it has finished
/// (no programmatic early launch). A step's kernels read the decode position before their wait
/// (it steers the attention's early K/V loads), which holds only while no earlier kernel of the
/// same launch sequence can still advance it: a captured graph of several steps starts each step
/// after this, as a graph boundary or the eager path's token copy does.
pub(crate) fn after_all() {
    AFTER_ALL.with(|c| c.set(true));
}

/// Makes the next `launch!` on this thread cooperative: all its blocks are resident at once (or
/// the launch fails), which grid-wide barriers inside the kernel rely on.
pub(crate) fn cooperatively() {
    COOPERATIVE.with(|c| c.set(true));
}

pub(crate) fn launch_smem() -> u32 {
    SMEM.with(|c| c.replace(0))
}

/// Makes the next `launch!` on this thread reserve `bytes` of dynamic shared memory.
pub(crate) fn with_smem(bytes: u32) {
    SMEM.with(|c| c.set(bytes));
}

pub mod arena;
pub mod graph;
pub mod layer;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ops;
pub mod profile;
pub mod selftest;
