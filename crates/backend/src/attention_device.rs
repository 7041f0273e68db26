//! Attention on non-CPU devices, and the static-shape decode step that CUDA graphs capture.
//!
//! [`attend`] (host positions): one query per sequence goes to the fused CUDA decode kernel;
//! longer spans (prefill) to the flash prefill kernel, or else to a candle composition whose
//! causal/window mask is built on the device (no host mask of `T·S` floats per layer). [`append_and_attend`] (device position): writes one
//! token's key and value at the position held in a device tensor and attends over the whole
//! cache buffer, masking keys after that position, so every step has the same shapes and
//! pointers. Each has a generic candle composition, which is what runs on CPU (tests) and where
//! a kernel does not apply.

use crate::attention::{AttentionParams, Positions};
use crate::rope::Rope;
use candle_core::{DType, Device, Result, Tensor};

/// q `[T, Hq, D]`, k and v `[Hkv, S, D]` → `[T, Hq·D]`, on a non-CPU device.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, pos: Positions, p: &AttentionParams) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if q.dims3()?.0 == 1 {
        use crate::cuda::ops::{attend_decode, DecodeAttention};
        let q = q.contiguous()?;
        let a = DecodeAttention {
            q: &q,
            k,
            v,
            rope: None,
            pos: crate::cuda::Pos::Host(pos.query_start),
            key_start: pos.key_start,
            params: p,
            append: None,
        };
        if let Some(out) = attend_decode(&a)? {
            return Ok(out);
        }
    }
    #[cfg(feature = "cuda")]
    return crate::cuda::profile::region(q.device(), || format!("prefill attention t={}", q.dims()[0]), || {
        match crate::cuda::ops::flash_prefill(&q.contiguous()?, k, v, pos, p)? {
            Some(out) => Ok(out),
            None => attend_masked(q, k, v, pos, p),
        }
    });
    #[cfg(not(feature = "cuda"))]
    attend_masked(q, k, v, pos, p)
}

/// Explicit scores and softmax with the mask built on the device.
pub fn attend_masked(q: &Tensor, k: &Tensor, v: &Tensor, pos: Positions, p: &AttentionParams) -> Result<Tensor> {
    let (t, hq, d) = q.dims3()?;
    let (hkv, s, _) = k.dims3()?;
    let group = hq / hkv;
    let dev = q.device();
    let q = q.transpose(0, 1)?.contiguous()?.reshape((hkv, group * t, d))?;
    #[cfg(feature = "cuda")]
    {
        // Raw scores in the activation dtype, then scale, mask and softmax in one kernel.
        let raw = q.matmul(&k.contiguous()?.t()?)?;
        if let Some(probs) = crate::cuda::ops::masked_softmax(&raw, t, pos, p)? {
            let out = probs.to_dtype(v.dtype())?.matmul(&v.contiguous()?)?;
            return out.reshape((hq, t, d))?.transpose(0, 1)?.contiguous()?.reshape((t, hq * d));
        }
    }
    let scores = scores(&q, k, p)?.reshape((hkv, group, t, s))?;
    let qpos = Tensor::arange(pos.query_start as u32, (pos.query_start + t) as u32, dev)?.reshape((t, 1))?;
    let kpos = Tensor::arange(pos.key_start as u32, (pos.key_start + s) as u32, dev)?.reshape((1, s))?;
    let mask = additive_mask(&kpos.broadcast_as((t, s))?, &qpos.broadcast_as((t, s))?, p.window)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let out = probs.to_dtype(v.dtype())?.reshape((hkv, group * t, s))?.matmul(&v.contiguous()?)?;
    out.reshape((hq, t, d))?.transpose(0, 1)?.contiguous()?.reshape((t, hq * d))
}

/// f32 scores q·kᵀ·scale (soft-capped when asked): q `[Hkv, R, D]`, k `[Hkv, S, D]` → `[Hkv, R, S]`.
fn scores(q: &Tensor, k: &Tensor, p: &AttentionParams) -> Result<Tensor> {
    let mut x = (q.matmul(&k.contiguous()?.t()?)?.to_dtype(DType::F32)? * p.scale as f64)?;
    if let Some(cap) = p.softcap {
        x = ((x / cap as f64)?.tanh()? * cap as f64)?;
    }
    Ok(x)
}

/// 0 where key position `kpos` is visible from query position `qpos` (kpos <= qpos, and within
/// the window), -inf elsewhere; u32 inputs of one shape, f32 out.
fn additive_mask(kpos: &Tensor, qpos: &Tensor, window: Option<usize>) -> Result<Tensor> {
    let mut visible = kpos.le(qpos)?;
    if let Some(w) = window {
        visible = (visible * kpos.affine(1.0, w as f64)?.gt(qpos)?)?;
    }
    let zeros = Tensor::zeros(kpos.shape(), DType::F32, kpos.device())?;
    let hidden = Tensor::full(f32::NEG_INFINITY, kpos.shape(), kpos.device())?;
    visible.where_cond(&zeros, &hidden)
}

/// One token of one sequence against whole cache buffers: rotates `q` and `k` (`[1, H, D]`) to the
/// position in `pos` (one u32 on the device), writes k and v at that position of `cache_k`,
/// `cache_v` (`[Hkv, capacity, D]`, capacity > pos) and attends over keys 0..=pos (and the
/// window). Returns `[1, Hq·D]`. The host never learns the position: the step can be replayed.
pub struct StaticStep<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub rope: &'a Rope,
    pub cache_k: &'a Tensor,
    pub cache_v: &'a Tensor,
    pub pos: &'a Tensor,
    pub params: &'a AttentionParams,
}

pub fn append_and_attend(s: &StaticStep<'_>) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(out) = append_and_attend_cuda(s)? {
        return Ok(out);
    }
    let q = s.rope.apply_at(s.q, s.pos)?;
    let k = s.rope.apply_at(s.k, s.pos)?;
    write_at(s.cache_k, &k, s.pos)?;
    write_at(s.cache_v, s.v, s.pos)?;
    attend_at(&q, s.cache_k, s.cache_v, s.pos, s.params)
}

#[cfg(feature = "cuda")]
fn append_and_attend_cuda(s: &StaticStep<'_>) -> Result<Option<Tensor>> {
    use crate::cuda::ops::{attend_decode, kv_append, DecodeAttention, RopeTables};
    use crate::cuda::Pos;
    if !matches!(s.q.device(), Device::Cuda(_)) {
        return Ok(None);
    }
    let (cos, sin, interleaved) = s.rope.tables()?;
    let tables = RopeTables { cos, sin, interleaved };
    let (q, k, v) = (s.q.contiguous()?, s.k.contiguous()?, s.v.contiguous()?);
    let a = DecodeAttention {
        q: &q,
        k: s.cache_k,
        v: s.cache_v,
        rope: Some(tables),
        pos: Pos::Device(s.pos),
        key_start: 0,
        params: s.params,
        append: Some((&k, &v)),
    };
    if let Some(out) = attend_decode(&a)? {
        return Ok(Some(out));
    }
    // The attention kernel does not apply (head size, grouping): append with its own kernel and
    // attend by composition.
    if !kv_append(s.cache_k, s.cache_v, &k, &v, Some(tables), Pos::Device(s.pos))? {
        return Ok(None);
    }
    attend_at(&s.rope.apply_at(&q, s.pos)?, s.cache_k, s.cache_v, s.pos, s.params).map(Some)
}

/// One decode token of each of B sequences (q `[B, Hq·D]`, k and v `[B, Hkv·D]`, unrotated; rows
/// may be strided views, e.g. of a stacked QKV product),
/// each over its own whole cache buffers (`buffers[i]`, `[Hkv, capacity, D]`) at its host position
/// `positions[i]`: rotates, appends and attends in one CUDA launch for the batch. Returns
/// `[B, Hq·D]`, or None where the kernel does not apply (not on CUDA, head size, grouping, dtype):
/// the caller then takes the per-sequence path. Nothing is written when it returns None.
pub fn append_and_attend_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    buffers: &[(Tensor, Tensor)],
    positions: &[usize],
    rope: &Rope,
    params: &AttentionParams,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if matches!(q.device(), Device::Cuda(_)) {
        use crate::cuda::ops::{attend_decode_batch, DecodeBatch, RopeTables};
        let (cos, sin, interleaved) = rope.tables()?;
        let batch = DecodeBatch { q, k, v, buffers, positions, rope: RopeTables { cos, sin, interleaved }, params };
        return attend_decode_batch(&batch);
    }
    let _ = (q, k, v, buffers, positions, rope, params);
    Ok(None)
}

/// 64-bit words per row of a batched decode table ([`decode_table_row`]).
pub const DECODE_TABLE_FIELDS: usize = 5;

/// Keys per split of the device decode attention: a row at position `pos` needs
/// `(pos + 1).div_ceil(DECODE_SPLIT_KEYS)` of [`append_and_attend_table`]'s splits.
pub const DECODE_SPLIT_KEYS: usize = 64;
#[cfg(feature = "cuda")]
const _: () = assert!(DECODE_SPLIT_KEYS == crate::cuda::ops::ATTN_CHUNK && DECODE_TABLE_FIELDS == crate::cuda::ops::BATCH_FIELDS);

/// One row of a batched decode table on devices with the batched kernel (CUDA): a sequence's
/// whole cache buffers `[Hkv, capacity, D]` (capacity > `pos`), its position, and the first of
/// its partial rows (row i of a table of [`append_and_attend_table`] with `splits`:
/// i · Hq · splits). None elsewhere, or when the buffers are not what the kernel reads.
pub fn decode_table_row(k: &Tensor, v: &Tensor, pos: usize, first_part: usize) -> Result<Option<[i64; DECODE_TABLE_FIELDS]>> {
    #[cfg(feature = "cuda")]
    if matches!(k.device(), Device::Cuda(_)) {
        return crate::cuda::ops::decode_table_row(k, v, pos, first_part);
    }
    let _ = (k, v, pos, first_part);
    Ok(None)
}

/// A batch of decode rows through a table already on the device (i64 `[B · DECODE_TABLE_FIELDS]`
/// of [`decode_table_row`]s): each row's q, k, v (`[B, H·D]`, unrotated) are rotated, its key and
/// value appended at its position in its buffers, and its keys attended; one launch whose
/// arguments depend only on B and `splits` (at least every row's split count), so that a captured
/// step stays valid while the table's rows change. Each row equals [`append_and_attend_batch`]'s
/// bit for bit. None where the device has no such kernel.
pub struct TableStep<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub table: &'a Tensor,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub splits: usize,
    pub rope: &'a Rope,
    pub params: &'a AttentionParams,
}

pub fn append_and_attend_table(s: &TableStep<'_>) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if matches!(s.q.device(), Device::Cuda(_)) {
        use crate::cuda::ops::{attend_decode_table, DecodeTable, RopeTables};
        let (cos, sin, interleaved) = s.rope.tables()?;
        let rope = RopeTables { cos, sin, interleaved };
        let t = DecodeTable { q: s.q, k: s.k, v: s.v, table: s.table, hkv: s.kv_heads, d: s.head_dim, splits: s.splits, rope, params: s.params };
        return attend_decode_table(&t);
    }
    let _ = s;
    Ok(None)
}

/// buf `[Hkv, capacity, D]` ← x `[1, Hkv, D]` at token index `pos` (one u32 on the device).
pub fn write_at(buf: &Tensor, x: &Tensor, pos: &Tensor) -> Result<()> {
    let (_, h, d) = x.dims3()?;
    let src = x.transpose(0, 1)?.contiguous()?.to_dtype(buf.dtype())?;
    let idx = pos.flatten_all()?.reshape((1, 1, 1))?.broadcast_as((h, 1, d))?.contiguous()?;
    buf.scatter_set(&idx, &src, 1)
}

/// q `[1, Hq, D]` (rotated) over keys 0..=pos of whole buffers `[Hkv, capacity, D]` → `[1, Hq·D]`.
pub fn attend_at(q: &Tensor, k: &Tensor, v: &Tensor, pos: &Tensor, p: &AttentionParams) -> Result<Tensor> {
    // A cache in another dtype than q (f16 on CPU) is widened for the composition.
    let (k, v) = (&k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?);
    let (_, hq, d) = q.dims3()?;
    let (hkv, cap, _) = k.dims3()?;
    let q = q.contiguous()?.reshape((hkv, hq / hkv, d))?;
    let scores = scores(&q, k, p)?;
    let kpos = Tensor::arange(0u32, cap as u32, q.device())?;
    let qpos = pos.flatten_all()?.broadcast_as(cap)?;
    let mask = additive_mask(&kpos, &qpos, p.window)?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    probs.to_dtype(v.dtype())?.matmul(&v.contiguous()?)?.reshape((1, hq * d))
}

/// Whether `device` runs the fused kernels of this module (false: generic compositions).
pub fn has_kernels(device: &Device) -> bool {
    matches!(device, Device::Cuda(_)) && cfg!(feature = "cuda")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::RopeStyle;

    /// The static step on CPU (generic compositions) equals rope + append + reference attention.
    #[test]
    fn static_step_equals_reference_attention() -> Result<()> {
        let dev = Device::Cpu;
        let (hq, hkv, d, cap) = (6, 2, 16, 40);
        let rope = Rope::new(RopeStyle::HalfSplit, d, 10000.0, 128, None, &dev)?;
        for window in [None, Some(5)] {
            let p = AttentionParams { scale: 0.25, window, softcap: None };
            let ck = Tensor::zeros((hkv, cap, d), DType::F32, &dev)?;
            let cv = Tensor::zeros((hkv, cap, d), DType::F32, &dev)?;
            let prev_k = Tensor::randn(0f32, 1.0, (hkv, 9, d), &dev)?;
            let prev_v = Tensor::randn(0f32, 1.0, (hkv, 9, d), &dev)?;
            ck.slice_set(&prev_k, 1, 0)?;
            cv.slice_set(&prev_v, 1, 0)?;
            let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev)?;
            let k = Tensor::randn(0f32, 1.0, (1, hkv, d), &dev)?;
            let v = Tensor::randn(0f32, 1.0, (1, hkv, d), &dev)?;
            let pos = Tensor::new(&[9u32], &dev)?;
            let step = StaticStep { q: &q, k: &k, v: &v, rope: &rope, cache_k: &ck, cache_v: &cv, pos: &pos, params: &p };
            let got = append_and_attend(&step)?;
            let keys = Tensor::cat(&[prev_k.clone(), rope.apply(&k, 9)?.transpose(0, 1)?], 1)?;
            let vals = Tensor::cat(&[prev_v.clone(), v.transpose(0, 1)?], 1)?;
            let positions = Positions { query_start: 9, key_start: 0 };
            let want = crate::attention::attend_generic(&rope.apply(&q, 9)?, &keys, &vals, positions, &p)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{window:?}: {diff}");
            let written = ck.narrow(1, 9, 1)?.sub(&rope.apply(&k, 9)?.transpose(0, 1)?)?;
            assert_eq!(written.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        }
        Ok(())
    }

    #[test]
    fn device_mask_composition_equals_reference() -> Result<()> {
        let dev = Device::Cpu;
        let p = AttentionParams { scale: 0.3, window: Some(4), softcap: Some(20.0) };
        let q = Tensor::randn(0f32, 1.0, (3, 4, 8), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 10, 8), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (2, 10, 8), &dev)?;
        let pos = Positions { query_start: 12, key_start: 5 };
        let want = crate::attention::attend_generic(&q, &k, &v, pos, &p)?;
        let got = attend_masked(&q, &k, &v, pos, &p)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }
}
