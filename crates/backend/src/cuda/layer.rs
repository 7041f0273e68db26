//! The decode-layer kernel (`decode_layer.cuh`): one Llama-style decoder layer for one token in a
//! single persistent kernel, one block per SM, its five phases separated by grid barriers and
//! each phase's first weight loads issued before the barrier that precedes it. Bit-identical to
//! the five separate kernels (norm+QKV, attention with append, O+residual, norm+gate|up,
//! silu·up+down+residual).
//!
//! Off by default (`FERROLM_CUDA_LAYER=1` turns it on): on the H200 it is still slower than the
//! separate kernels (1B shape: 60.5 against 57.2 µs per layer, `scripts/gpu/layer_bench.cu`; end
//! to end 884 against 959 tok/s). Its products stream weights at ~3.1-3.3 TB/s through the
//! registers of 16 warps per SM; the next step is streaming them through shared memory with bulk
//! asynchronous copies (TMA), which hold no registers for the loads in flight (decode_layer.cuh).

use super::ops::RopeTables;
use super::{alloc, alloc_zeroed_u32, cuda_device, ptr};
use crate::attention::AttentionParams;
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{DType, Result, Tensor};

const THREADS: u32 = 512; // LAYER_THREADS
const GROUPS: usize = 4; // LAYER_GROUPS: attention groups of ATTN_THREADS per block
const ATTN_CHUNK: usize = super::ops::ATTN_CHUNK;

/// The kernel's `DecodeLayer` parameter, field for field (C layout).
#[repr(C)]
struct Params {
    x: u64,
    x_mid: u64,
    x_out: u64,
    n1: u64,
    n2: u64,
    eps: f32,
    hidden: i32,
    wqkv: u64,
    qkv: u64,
    nqkv: i32,
    kc: u64,
    vc: u64,
    head_stride: i64,
    s_max: i32,
    nsplit: i32,
    cos_t: u64,
    sin_t: u64,
    interleaved: i32,
    pos: u64,
    hq: i32,
    hkv: i32,
    scale: f32,
    window: i32,
    softcap: f32,
    part_m: u64,
    part_l: u64,
    part_acc: u64,
    counters: u64,
    attn: u64,
    wo: u64,
    wgu: u64,
    inter: i32,
    act: u64,
    wdown: u64,
    bar: u64,
    clocks: u64,
}

/// One decoder layer's inputs: `x [1, hidden]` bf16, the two RMSNorms (f32 weights, eps), the
/// dense bf16 weights `wqkv [(hq + 2·hkv)·d, hidden]` (q, k, v rows), `wo [hidden, hq·d]`,
/// `wgu [2·inter, hidden]` (gate rows, then up rows), `wdown [hidden, inter]`, and the whole
/// cache buffers `[hkv, capacity, d]` written at the device position `pos`.
pub struct DecodeLayerArgs<'a> {
    pub x: &'a Tensor,
    pub attn_norm: (&'a Tensor, f32),
    pub ffn_norm: (&'a Tensor, f32),
    pub wqkv: &'a Tensor,
    pub wo: &'a Tensor,
    pub wgu: &'a Tensor,
    pub wdown: &'a Tensor,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub cache_k: &'a Tensor,
    pub cache_v: &'a Tensor,
    pub rope: RopeTables<'a>,
    pub pos: &'a Tensor,
    pub params: &'a AttentionParams,
}

/// `x + mlp(x')` with `x' = x + attn(x)`: the layer's output `[1, hidden]`, or None when the
/// kernel does not apply (the caller runs the separate kernels). Whether it is on at all
/// (`policy().layer_kernel`) is the caller's check.
pub fn decode_layer(a: &DecodeLayerArgs<'_>) -> Result<Option<Tensor>> {
    let Some(dev) = cuda_device(a.x) else { return Ok(None) };
    let Some(shape) = check(a)? else { return Ok(None) };
    let Some(sms) = resident_blocks(&dev)? else { return Ok(None) };
    let Shape { hidden, inter, nqkv, d, cap, nsplit } = shape;
    let (hq, hkv) = (a.heads, a.kv_heads);
    let bf = |n: usize| alloc(&dev, (1, n), DType::BF16);
    let (qkv, attn, x_mid, x_out, act) = (bf(nqkv)?, bf(hq * d)?, bf(hidden)?, bf(hidden)?, bf(inter)?);
    let part_m = alloc(&dev, hq * nsplit, DType::F32)?;
    let part_l = alloc(&dev, hq * nsplit, DType::F32)?;
    let part_acc = alloc(&dev, hq * nsplit * d, DType::F32)?;
    // Left at zero by the kernel: the merge counters and the barrier's arrival count.
    let counters = alloc_zeroed_u32(&dev, hkv)?;
    let bar = alloc_zeroed_u32(&dev, 2)?;
    let p = Params {
        x: ptr(a.x)?,
        x_mid: ptr(&x_mid)?,
        x_out: ptr(&x_out)?,
        n1: ptr(a.attn_norm.0)?,
        n2: ptr(a.ffn_norm.0)?,
        eps: a.attn_norm.1,
        hidden: hidden as i32,
        wqkv: ptr(a.wqkv)?,
        qkv: ptr(&qkv)?,
        nqkv: nqkv as i32,
        kc: ptr(a.cache_k)?,
        vc: ptr(a.cache_v)?,
        head_stride: (cap * d) as i64,
        s_max: cap as i32,
        nsplit: nsplit as i32,
        cos_t: ptr(a.rope.cos)?,
        sin_t: ptr(a.rope.sin)?,
        interleaved: a.rope.interleaved as i32,
        pos: ptr(a.pos)?,
        hq: hq as i32,
        hkv: hkv as i32,
        scale: a.params.scale,
        window: a.params.window.unwrap_or(0) as i32,
        softcap: a.params.softcap.unwrap_or(0.0),
        part_m: ptr(&part_m)?,
        part_l: ptr(&part_l)?,
        part_acc: ptr(&part_acc)?,
        counters: ptr(&counters)?,
        attn: ptr(&attn)?,
        wo: ptr(a.wo)?,
        wgu: ptr(a.wgu)?,
        inter: inter as i32,
        act: ptr(&act)?,
        wdown: ptr(a.wdown)?,
        bar: ptr(&bar)?,
        clocks: 0,
    };
    let mg = max_group(hq, hkv);
    let name = kernel_name(d, mg);
    let func = dev.get_or_load_custom_func(name, super::MODULE, super::ptx()?)?;
    let smem = smem_bytes(&shape, hq, mg);
    func.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .map_err(|e| candle_core::Error::Msg(format!("{name}: {e:?}")))?;
    super::with_smem(smem);
    super::cooperatively();
    launch!(dev, name, (sms, 1, 1), THREADS, p);
    Ok(Some(x_out))
}

struct Shape {
    hidden: usize,
    inter: usize,
    nqkv: usize,
    d: usize,
    cap: usize,
    nsplit: usize,
}

/// The sizes, when every input is what the kernel takes: bf16, contiguous, 16-byte aligned.
fn check(a: &DecodeLayerArgs<'_>) -> Result<Option<Shape>> {
    let (hq, hkv, d) = (a.heads, a.kv_heads, a.head_dim);
    let hidden = a.x.elem_count();
    let Ok((hkv_c, cap, dc)) = a.cache_k.dims3() else { return Ok(None) };
    let (Ok(gu), Ok(wd)) = (a.wgu.dims2(), a.wdown.dims2()) else { return Ok(None) };
    let inter = gu.0 / 2;
    let nqkv = (hq + 2 * hkv) * d;
    let bf16 = |t: &Tensor| t.dtype() == DType::BF16 && t.is_contiguous() && cuda_device(t).is_some();
    let f32v = |t: &Tensor, n: usize| t.dtype() == DType::F32 && t.is_contiguous() && t.elem_count() == n;
    let ok = [a.x, a.wqkv, a.wo, a.wgu, a.wdown, a.cache_k, a.cache_v].iter().all(|t| bf16(t))
        && matches!(d, 64 | 128)
        && hkv > 0
        && hq % hkv == 0
        && hq / hkv <= 8
        && hkv_c == hkv
        && dc == d
        && a.cache_v.dims() == a.cache_k.dims()
        && a.wqkv.dims() == [nqkv, hidden]
        && a.wo.dims() == [hidden, hq * d]
        && gu == (2 * inter, hidden)
        && wd == (hidden, inter)
        && [hidden, inter, hq * d].iter().all(|k| k % 8 == 0)
        && f32v(a.attn_norm.0, hidden)
        && f32v(a.ffn_norm.0, hidden)
        && a.attn_norm.1 == a.ffn_norm.1
        && f32v(a.rope.cos, a.rope.cos.elem_count())
        && a.rope.sin.dims() == a.rope.cos.dims()
        && f32v(a.rope.sin, a.rope.cos.elem_count())
        && a.rope.cos.dims().last() == Some(&(d / 2))
        && a.rope.cos.dims()[0] >= cap
        && a.pos.dtype() == DType::U32
        && a.pos.elem_count() == 1;
    if !ok {
        return Ok(None);
    }
    let tensors = [a.x, a.wqkv, a.wo, a.wgu, a.wdown, a.cache_k, a.cache_v, a.attn_norm.0, a.ffn_norm.0];
    for t in tensors {
        if ptr(t)? % 16 != 0 {
            return Ok(None);
        }
    }
    Ok(Some(Shape { hidden, inter, nqkv, d, cap, nsplit: cap.div_ceil(ATTN_CHUNK) }))
}

/// The instance for head size d and up to `mg` (4 or 8) query heads per kv head.
fn kernel_name(d: usize, mg: usize) -> &'static str {
    match (d, mg) {
        (64, 4) => "fl_decode_layer_d64_g4",
        (64, _) => "fl_decode_layer_d64_g8",
        (_, 4) => "fl_decode_layer_d128_g4",
        _ => "fl_decode_layer_d128_g8",
    }
}

/// The attention groups' query heads per kv head rounded up to an instance (fewer registers
/// and less shared memory at 4).
fn max_group(heads: usize, kv_heads: usize) -> usize {
    if heads / kv_heads <= 4 {
        4
    } else {
        8
    }
}

/// Dynamic shared memory: the staged input row of the widest product, or the attention groups'
/// `AttnShared<D>` (whichever is larger; the phases reuse it). The kernel traps if it gets less.
fn smem_bytes(s: &Shape, hq: usize, mg: usize) -> u32 {
    // sizeof(AttnShared<D, MG>) in kernels.cu: knew+vnew (D f32 each), qs, ps, sm+sl, pacc (f32),
    // a bool, aligned to 16 bytes.
    let attn_shared = (8 * s.d + 4 * (mg * s.d + mg * 64 + 2 * mg + (1024 / s.d) * mg * s.d) + 4).next_multiple_of(16);
    let row = 2 * s.hidden.max(s.inter).max(hq * s.d);
    (GROUPS * attn_shared).max(row) as u32
}

/// The grid: one block per SM, when one fits (the kernel needs all of them resident at once).
fn resident_blocks(dev: &candle_core::cuda_backend::CudaDevice) -> Result<Option<u32>> {
    use candle_core::cuda_backend::WrapErr;
    let ctx = dev.cuda_stream().context().clone();
    let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?;
    let coop = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH).w()?;
    Ok((sms > 0 && coop == 1).then_some(sms as u32))
}
