//! Launch wrappers for the kernels of `kernels.cu`. Each returns `Ok(None)` (or `false`) when the
//! inputs are outside what the kernel handles; the caller then runs the generic composition.

use super::{alloc, cuda_device, policy, pos_args, ptr, suffix, Pos};
use crate::attention::AttentionParams;
use candle_core::{DType, Result, Tensor};

/// Keys per split of the decode attention: split boundaries are multiples of this whatever the
/// buffer length, so a step over a narrowed view and one over the whole buffer sum identically.
pub const ATTN_CHUNK: usize = 64; // = ATTN_CHUNK in kernels.cu
const ATTN_MAX_G: usize = 8;
/// 16-byte vectors per thread of `fl_rmsnorm_vec_bf16` (RMS_VECS in kernels.cu).
const RMS_VECS: usize = 4;

fn on(t: &Tensor) -> Option<(candle_core::cuda_backend::CudaDevice, &'static str)> {
    if !policy().kernels || !t.is_contiguous() {
        return None;
    }
    Some((cuda_device(t)?, suffix(t.dtype())?))
}

/// A one-element u32 tensor on a CUDA device (a token id or a decode position).
fn u32_word(t: &Tensor) -> bool {
    t.dtype() == DType::U32 && t.elem_count() == 1 && cuda_device(t).is_some()
}

fn f32_on_device(t: &Tensor) -> bool {
    t.dtype() == DType::F32 && t.is_contiguous() && cuda_device(t).is_some()
}

/// RMSNorm of `x [.., cols]` with f32 weights `w [cols]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Option<Tensor>> {
    Ok(norm(x, None, w, eps)?.map(|(_, n)| n))
}

/// `s = x + r` (rounded to x's dtype) and RMSNorm(s), in one pass: returns (s, norm).
pub fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
    Ok(norm(x, Some(r), w, eps)?.and_then(|(s, n)| s.map(|s| (s, n))))
}

fn norm(x: &Tensor, r: Option<&Tensor>, w: &Tensor, eps: f32) -> Result<Option<(Option<Tensor>, Tensor)>> {
    let Some((dev, sfx)) = on(x) else { return Ok(None) };
    let cols = *x.dims().last().unwrap_or(&0);
    if cols == 0 || !f32_on_device(w) || w.elem_count() != cols {
        return Ok(None);
    }
    if let Some(r) = r {
        if r.dtype() != x.dtype() || r.shape() != x.shape() || !r.is_contiguous() {
            return Ok(None);
        }
    }
    let rows = x.elem_count() / cols;
    let mut dims = x.dims().to_vec();
    let halves = if r.is_some() { 2 } else { 1 };
    dims.insert(0, halves);
    let out = alloc(&dev, dims, x.dtype())?;
    let base = ptr(&out)?;
    let half_bytes = (rows * cols * x.dtype().size_in_bytes()) as u64;
    let (rp, sp, op) = match r {
        Some(r) => (ptr(r)?, base, base + half_bytes),
        None => (0u64, 0u64, base),
    };
    let nv = cols / 8;
    let vectorized = x.dtype() == DType::BF16
        && cols % 8 == 0
        && nv <= RMS_VECS * 1024
        && [ptr(x)?, rp, sp, op, ptr(w)?].iter().all(|p| p % 16 == 0);
    if vectorized {
        let threads = (nv.div_ceil(32) * 32).min(1024) as u32;
        launch!(dev, "fl_rmsnorm_vec_bf16", (rows as u32, 1, 1), threads, ptr(x)?, rp, sp, op, ptr(w)?, cols as i32, eps);
    } else {
        launch!(dev, &format!("fl_rmsnorm_{sfx}"), (rows as u32, 1, 1), 256, ptr(x)?, rp, sp, op, ptr(w)?, cols as i32, eps);
    }
    let normed = out.narrow(0, halves - 1, 1)?.squeeze(0)?;
    let sum = match r {
        Some(_) => Some(out.narrow(0, 0, 1)?.squeeze(0)?),
        None => None,
    };
    Ok(Some((sum, normed)))
}

/// Rotary embedding of `x [tokens, heads, dim]`, token t at position pos + t; `cos`, `sin` are the
/// f32 tables `[max_positions, dim/2]` (the caller checks the range).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, pos: Pos<'_>, interleaved: bool) -> Result<Option<Tensor>> {
    let Some((dev, sfx)) = on(x) else { return Ok(None) };
    let Ok((tokens, heads, dim)) = x.dims3() else { return Ok(None) };
    if !f32_on_device(cos) || !f32_on_device(sin) || dim % 2 != 0 {
        return Ok(None);
    }
    let out = alloc(&dev, x.shape().clone(), x.dtype())?;
    let (pp, ph) = pos_args(pos)?;
    let total = tokens * heads * dim / 2;
    let grid = total.div_ceil(256).clamp(1, 4096) as u32;
    launch!(
        dev, &format!("fl_rope_{sfx}"), (grid, 1, 1), 256,
        ptr(x)?, ptr(&out)?, ptr(cos)?, ptr(sin)?, pp, ph, tokens as i32, heads as i32, dim as i32, interleaved as i32
    );
    Ok(Some(out))
}

/// The rotary tables and convention a kernel applies on the fly (None: no rotation).
#[derive(Clone, Copy)]
pub struct RopeTables<'a> {
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub interleaved: bool,
}

/// Writes one token's `k`, `v` (`[1, kv_heads, dim]`, k rotated on the way when `rope` is given)
/// at position `pos` of the whole cache buffers `kc`, `vc` `[kv_heads, capacity, dim]`.
pub fn kv_append(kc: &Tensor, vc: &Tensor, k: &Tensor, v: &Tensor, rope: Option<RopeTables<'_>>, pos: Pos<'_>) -> Result<bool> {
    let Some((dev, sfx)) = on(k) else { return Ok(false) };
    let (Ok((hkv, cap, dim)), Ok((one, hk, dk))) = (kc.dims3(), k.dims3()) else { return Ok(false) };
    let same = |t: &Tensor| t.dtype() == k.dtype() && t.is_contiguous();
    if one != 1 || hk != hkv || dk != dim || v.shape() != k.shape() || !same(v) || !same(kc) || !same(vc) || vc.shape() != kc.shape() {
        return Ok(false);
    }
    if let Pos::Host(p) = pos {
        if p >= cap {
            candle_core::bail!("kv append at {p} beyond the reserved capacity {cap}")
        }
    }
    let (cp, sp, inter) = match rope {
        Some(r) if f32_on_device(r.cos) && f32_on_device(r.sin) => (ptr(r.cos)?, ptr(r.sin)?, r.interleaved),
        Some(_) => return Ok(false),
        None => (0, 0, false),
    };
    let (pp, ph) = pos_args(pos)?;
    let block = (dim / 2).div_ceil(32).max(1) as u32 * 32;
    launch!(
        dev, &format!("fl_kv_append_{sfx}"), (hkv as u32, 1, 1), block,
        ptr(k)?, ptr(v)?, ptr(kc)?, ptr(vc)?, cp, sp, pp, ph, dim as i32, cap as i32, inter as i32
    );
    Ok(true)
}

/// Single-query attention: `q [1, hq, dim]` (rotated first when `rope` is given) over `kc`, `vc`
/// `[kv_heads, S, dim]` (token stride dim, any head stride: a narrowed cache view or the whole
/// buffer). The query sits at `pos`; key j is at `key_start + j`. Returns `[1, hq·dim]`.
/// With `append`, the token's own key and value (`[1, kv_heads, dim]`, the key rotated on the
/// way when `rope` is given) are first written at key `pos - key_start`, as `kv_append` would.
pub struct DecodeAttention<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub rope: Option<RopeTables<'a>>,
    pub pos: Pos<'a>,
    pub key_start: usize,
    pub params: &'a AttentionParams,
    pub append: Option<(&'a Tensor, &'a Tensor)>,
}

pub fn attend_decode(a: &DecodeAttention<'_>) -> Result<Option<Tensor>> {
    let Some((dev, sfx)) = on(a.q) else { return Ok(None) };
    let (Ok((one, hq, d)), Ok((hkv, s, dk))) = (a.q.dims3(), a.k.dims3()) else { return Ok(None) };
    let (ks, vs) = (a.k.stride(), a.v.stride());
    let ok = one == 1
        && dk == d
        && matches!(d, 64 | 128 | 256)
        && hkv > 0
        && hq % hkv == 0
        && hq / hkv <= ATTN_MAX_G
        && a.k.dtype() == a.q.dtype()
        && a.v.dtype() == a.q.dtype()
        && a.v.dims() == a.k.dims()
        && ks[1] == d
        && ks[2] == 1
        && ks == vs
        && cuda_device(a.k).is_some();
    // 16-byte vector loads of K and V rows.
    let row_bytes = d * a.k.dtype().size_in_bytes();
    let aligned = |t: &Tensor| -> Result<bool> { Ok(ptr(t)? % 16 == 0 && (t.stride()[0] * t.dtype().size_in_bytes()) % 16 == 0) };
    if !ok || s == 0 || row_bytes % 16 != 0 || !aligned(a.k)? || !aligned(a.v)? {
        return Ok(None);
    }
    let new_row = |t: &Tensor| t.dtype() == a.q.dtype() && t.is_contiguous() && t.dims() == [1, hkv, d];
    let (kn, vn) = match a.append {
        Some((k, v)) if new_row(k) && new_row(v) && cuda_device(k).is_some() && cuda_device(v).is_some() => (ptr(k)?, ptr(v)?),
        Some(_) => return Ok(None),
        None => (0, 0),
    };
    let (cp, sp, inter) = match a.rope {
        Some(r) if f32_on_device(r.cos) && f32_on_device(r.sin) => (ptr(r.cos)?, ptr(r.sin)?, r.interleaved),
        Some(_) => return Ok(None),
        None => (0, 0, false),
    };
    let (pp, ph) = pos_args(a.pos)?;
    let nsplit = s.div_ceil(ATTN_CHUNK);
    let rows = hq * nsplit;
    let part_m = alloc(&dev, rows, DType::F32)?;
    let part_l = alloc(&dev, rows, DType::F32)?;
    let part_acc = alloc(&dev, rows * d, DType::F32)?;
    // Finished-block counters of the in-kernel merge: zero before the first step, and the last
    // block of each head leaves its counter at zero again.
    let counters = super::alloc_zeroed_u32(&dev, hkv)?;
    let out = alloc(&dev, (1, hq * d), a.q.dtype())?;
    let p = a.params;
    // The instance for at most 4 query heads per kv head: less shared memory (see kernels.cu).
    let g4 = if a.q.dtype() == DType::BF16 && hq / hkv <= 4 { "_g4" } else { "" };
    launch!(
        dev, &format!("fl_attn_{sfx}_d{d}{g4}"), (hkv as u32, nsplit as u32, 1), 128,
        ptr(a.q)?, ptr(a.k)?, ptr(a.v)?, cp, sp, pp, ph, (hq / hkv) as i32, ks[0] as i64,
        a.key_start as i32, s as i32, p.window.unwrap_or(0) as i32, p.scale,
        p.softcap.unwrap_or(0.0), inter as i32, ptr(&part_m)?, ptr(&part_l)?, ptr(&part_acc)?,
        kn, vn, ptr(&counters)?, ptr(&out)?
    );
    Ok(Some(out))
}

/// One decode row of each of B sequences against each one's own cache buffers, in one launch
/// (`fl_attn_batch_*`): q `[B, Hq·D]`, k and v `[B, Hkv·D]` (unrotated; each row contiguous, rows
/// any stride apart: views of a stacked QKV product are read in place), and per sequence its
/// whole buffers `[Hkv, capacity, D]` and its position (capacity > position).
/// The new key (rotated) and value are written at each position; returns `[B, Hq·D]`, each row
/// bit-identical to that sequence's single-row [`attend_decode`] with rope and append.
pub struct DecodeBatch<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub buffers: &'a [(Tensor, Tensor)],
    pub positions: &'a [usize],
    pub rope: RopeTables<'a>,
    pub params: &'a AttentionParams,
}

pub fn attend_decode_batch(a: &DecodeBatch<'_>) -> Result<Option<Tensor>> {
    let Some(dev) = cuda_device(a.q).filter(|_| policy().kernels) else { return Ok(None) };
    let Some(sfx) = suffix(a.q.dtype()) else { return Ok(None) };
    let Some((hkv, _, d)) = a.buffers.first().and_then(|(k, _)| k.dims3().ok()) else { return Ok(None) };
    let (Ok((b, qw)), Ok((bk, kw))) = (a.q.dims2(), a.k.dims2()) else { return Ok(None) };
    let hq = qw / d.max(1);
    let dtype = a.q.dtype();
    // Rows of contiguous elements, 16-byte aligned, any distance apart.
    let rows_ok = |t: &Tensor| -> Result<bool> {
        let s = t.stride();
        Ok(s[1] == 1 && (s[0] * t.dtype().size_in_bytes()) % 16 == 0 && ptr(t)? % 16 == 0)
    };
    let inputs_ok = bk == b
        && kw == hkv * d
        && qw == hq * d
        && b == a.buffers.len()
        && b == a.positions.len()
        && matches!(d, 64 | 128 | 256)
        && hkv > 0
        && hq % hkv == 0
        && hq / hkv <= ATTN_MAX_G
        && a.k.dtype() == dtype
        && a.v.dtype() == dtype
        && a.v.dims() == a.k.dims()
        && cuda_device(a.k).is_some()
        && cuda_device(a.v).is_some()
        && f32_on_device(a.rope.cos)
        && f32_on_device(a.rope.sin);
    if !inputs_ok || !rows_ok(a.q)? || !rows_ok(a.k)? || !rows_ok(a.v)? {
        return Ok(None);
    }
    // Per sequence: K, V, head stride, position, first partial row (see kernels.cu).
    let mut fields: Vec<i64> = Vec::with_capacity(b * 5);
    let (mut rows, mut most) = (0usize, 0usize);
    for ((kc, vc), &pos) in a.buffers.iter().zip(a.positions) {
        let buffer_ok = |t: &Tensor| -> Result<bool> {
            let ok = t.dtype() == dtype && cuda_device(t).is_some() && t.is_contiguous() && t.dims3().is_ok_and(|(h, cap, dd)| h == hkv && dd == d && cap > pos);
            Ok(ok && ptr(t)? % 16 == 0)
        };
        if !buffer_ok(kc)? || !buffer_ok(vc)? {
            return Ok(None);
        }
        let nsplit = (pos + 1).div_ceil(ATTN_CHUNK);
        fields.extend([ptr(kc)? as i64, ptr(vc)? as i64, kc.stride()[0] as i64, pos as i64, rows as i64]);
        rows += hq * nsplit;
        most = most.max(nsplit);
    }
    let seqs = Tensor::from_vec(fields, b * BATCH_FIELDS, a.q.device())?;
    let shape = BatchShape { b, hq, hkv, d, splits: most, part_rows: rows };
    launch_batch(&dev, sfx, a.q, a.k, a.v, &seqs, shape, &a.rope, a.params).map(Some)
}

/// 64-bit words per sequence of a batched decode table (BATCH_FIELDS in kernels.cu).
pub const BATCH_FIELDS: usize = 5;

/// The grid and partial-row sizes of one `fl_attn_batch_*` launch.
#[derive(Clone, Copy)]
struct BatchShape {
    b: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// The grid's split dimension (items past a row's own splits return at once).
    splits: usize,
    part_rows: usize,
}

#[allow(clippy::too_many_arguments)]
fn launch_batch(
    dev: &candle_core::cuda_backend::CudaDevice,
    sfx: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &Tensor,
    s: BatchShape,
    rope: &RopeTables<'_>,
    p: &AttentionParams,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let part_m = alloc(dev, s.part_rows, DType::F32)?;
    let part_l = alloc(dev, s.part_rows, DType::F32)?;
    let part_acc = alloc(dev, s.part_rows * s.d, DType::F32)?;
    // Zero before the first launch; the last block of each head leaves its counter at zero.
    let counters = super::alloc_zeroed_u32(dev, s.b * s.hkv)?;
    let out = alloc(dev, (s.b, s.hq * s.d), dtype)?;
    let g4 = if dtype == DType::BF16 && s.hq / s.hkv <= 4 { "_g4" } else { "" };
    launch!(
        dev, &format!("fl_attn_batch_{sfx}_d{}{g4}", s.d), (s.hkv as u32, s.splits as u32, s.b as u32), 128,
        ptr(q)?, ptr(seqs)?, ptr(rope.cos)?, ptr(rope.sin)?, (s.hq / s.hkv) as i32, s.hkv as i32,
        p.window.unwrap_or(0) as i32, p.scale, p.softcap.unwrap_or(0.0), rope.interleaved as i32,
        ptr(&part_m)?, ptr(&part_l)?, ptr(&part_acc)?, ptr(k)?, ptr(v)?, ptr(&counters)?, ptr(&out)?,
        q.stride()[0] as i64, k.stride()[0] as i64, v.stride()[0] as i64
    );
    Ok(out)
}

/// Keys per split of the decode attention for a row at `pos` (its grid items).
pub fn decode_splits(pos: usize) -> usize {
    (pos + 1).div_ceil(ATTN_CHUNK)
}

/// One row of a batched decode table (see [`attend_decode_table`]): a sequence's whole cache
/// buffers `[Hkv, capacity, D]` (capacity > `pos`), its position, and the first of its partial
/// rows (`first_part`; it takes Hq · splits rows from there). None when the buffers are not
/// what the kernel reads (not contiguous, 16-byte aligned, on a CUDA device, of one dtype).
pub fn decode_table_row(k: &Tensor, v: &Tensor, pos: usize, first_part: usize) -> Result<Option<[i64; BATCH_FIELDS]>> {
    let fits = |t: &Tensor| t.dtype() == k.dtype() && t.is_contiguous() && t.dims() == k.dims() && t.dims3().is_ok_and(|(_, cap, _)| cap > pos);
    if suffix(k.dtype()).is_none() || !fits(k) || !fits(v) || !k.device().is_cuda() || !v.device().is_cuda() {
        return Ok(None);
    }
    let (kp, vp) = (ptr(k)?, ptr(v)?);
    if kp % 16 != 0 || vp % 16 != 0 {
        return Ok(None);
    }
    Ok(Some([kp as i64, vp as i64, k.stride()[0] as i64, pos as i64, first_part as i64]))
}

/// [`attend_decode_batch`] with the sequences' table already on the device (`table`: i64
/// `[B · BATCH_FIELDS]`, rows of [`decode_table_row`], the first partial row of row i at
/// i · Hq · `splits`) and the grid's split dimension fixed at `splits` (at least every row's
/// [`decode_splits`]): the launch's arguments then do not depend on the sequences, so a captured
/// step stays valid while they come and go (the caller rewrites the table before each replay).
/// Each row equals its [`attend_decode_batch`] result bit for bit (the same items; the extra
/// ones return at once). The caller guarantees the table's buffers are `[hkv, capacity, d]` in
/// q's dtype.
pub struct DecodeTable<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub table: &'a Tensor,
    pub hkv: usize,
    pub d: usize,
    pub splits: usize,
    pub rope: RopeTables<'a>,
    pub params: &'a AttentionParams,
}

pub fn attend_decode_table(a: &DecodeTable<'_>) -> Result<Option<Tensor>> {
    let Some(dev) = cuda_device(a.q).filter(|_| policy().kernels) else { return Ok(None) };
    let Some(sfx) = suffix(a.q.dtype()) else { return Ok(None) };
    let (Ok((b, qw)), Ok((bk, kw)), Ok((bv, vw))) = (a.q.dims2(), a.k.dims2(), a.v.dims2()) else { return Ok(None) };
    let (hkv, d) = (a.hkv, a.d);
    let hq = qw / d.max(1);
    let rows_ok = |t: &Tensor| -> Result<bool> {
        let s = t.stride();
        Ok(t.dtype() == a.q.dtype() && cuda_device(t).is_some() && s[1] == 1 && (s[0] * t.dtype().size_in_bytes()) % 16 == 0 && ptr(t)? % 16 == 0)
    };
    let inputs_ok = bk == b
        && bv == b
        && b > 0
        && kw == hkv * d
        && vw == kw
        && qw == hq * d
        && matches!(d, 64 | 128 | 256)
        && hkv > 0
        && hq % hkv == 0
        && hq / hkv <= ATTN_MAX_G
        && a.splits > 0
        && a.table.dtype() == DType::I64
        && a.table.is_contiguous()
        && a.table.elem_count() == b * BATCH_FIELDS
        && cuda_device(a.table).is_some()
        && f32_on_device(a.rope.cos)
        && f32_on_device(a.rope.sin);
    if !inputs_ok || !rows_ok(a.q)? || !rows_ok(a.k)? || !rows_ok(a.v)? {
        return Ok(None);
    }
    let shape = BatchShape { b, hq, hkv, d, splits: a.splits, part_rows: b * hq * a.splits };
    launch_batch(&dev, sfx, a.q, a.k, a.v, a.table, shape, &a.rope, a.params).map(Some)
}

/// The argmax of each row of f32 logits `[rows, n]` (first index on ties, as the host sampler's
/// argmax): a `[rows]` u32 tensor on the device, in two launches for all rows.
pub fn argmax_rows(logits: &Tensor) -> Result<Option<Tensor>> {
    if !policy().kernels || !f32_on_device(logits) {
        return Ok(None);
    }
    let Ok((rows, n)) = logits.dims2() else { return Ok(None) };
    if rows == 0 || n == 0 {
        return Ok(None);
    }
    let dev = cuda_device(logits).unwrap();
    let parts = n.div_ceil(2048).clamp(1, 256);
    let per = n.div_ceil(parts);
    let best = alloc(&dev, rows * parts, DType::F32)?;
    let index = alloc(&dev, rows * parts, DType::U32)?;
    let out = alloc(&dev, rows, DType::U32)?;
    launch!(dev, "fl_argmax_rows_partial_f32", (parts as u32, rows as u32, 1), 256, ptr(logits)?, ptr(&best)?, ptr(&index)?, n as i32, per as i32);
    launch!(dev, "fl_argmax_rows_final", (rows as u32, 1, 1), 256, ptr(&best)?, ptr(&index)?, ptr(&out)?, parts as i32);
    Ok(Some(out))
}

/// silu(gate) · up, elementwise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    if let Some(out) = silu_mul_rows(gate, up)? {
        return Ok(Some(out));
    }
    let (gate, up) = (&gate.contiguous()?, &up.contiguous()?);
    let Some((dev, sfx)) = on(gate) else { return Ok(None) };
    if up.shape() != gate.shape() || up.dtype() != gate.dtype() {
        return Ok(None);
    }
    let n = gate.elem_count();
    let out = alloc(&dev, gate.shape().clone(), gate.dtype())?;
    let grid = n.div_ceil(256).clamp(1, 8192) as u32;
    launch!(dev, &format!("fl_silu_mul_{sfx}"), (grid, 1, 1), 256, ptr(gate)?, ptr(up)?, ptr(&out)?, n);
    Ok(Some(out))
}

/// [`silu_mul`] of bf16 `[rows, cols]` inputs whose rows have their own stride (the two halves of
/// a stacked gate|up product, read in place: a prefill's would otherwise be copied twice), in
/// 16-byte vectors. None when the layout does not allow it.
fn silu_mul_rows(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    let Some(dev) = cuda_device(gate).filter(|_| policy().kernels) else { return Ok(None) };
    let Ok((rows, cols)) = gate.dims2() else { return Ok(None) };
    let (gs, us) = (gate.stride(), up.stride());
    let bf16 = gate.dtype() == DType::BF16 && up.dtype() == DType::BF16 && cuda_device(up).is_some();
    let vectors = cols % 8 == 0 && gs[1] == 1 && us[1] == 1 && gs[0] % 8 == 0 && us[0] % 8 == 0;
    if !bf16 || up.dims() != gate.dims() || !vectors || rows == 0 || ptr(gate)? % 16 != 0 || ptr(up)? % 16 != 0 {
        return Ok(None);
    }
    let out = alloc(&dev, (rows, cols), DType::BF16)?;
    let grid = (rows * cols / 8).div_ceil(256).clamp(1, 16384) as u32;
    launch!(dev, "fl_silu_mul_rows_bf16", (grid, 1, 1), 256, ptr(gate)?, gs[0] as i64, ptr(up)?, us[0] as i64, ptr(&out)?, rows as i32, cols as i32);
    Ok(Some(out))
}

/// y = x Wᵀ for one bf16 row `x [1, K]` and bf16 `w [N, K]`: `[1, N]` bf16.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    if !policy().gemv || x.dtype() != DType::BF16 || w.dtype() != DType::BF16 || !w.is_contiguous() {
        return Ok(None);
    }
    let Some((dev, _)) = on(x) else { return Ok(None) };
    let (Ok((n, k)), Some(&kx)) = (w.dims2(), x.dims().last()) else { return Ok(None) };
    if kx != k || x.elem_count() != k || k % 8 != 0 || cuda_device(w).is_none() {
        return Ok(None);
    }
    let (xp, wp) = (ptr(x)?, ptr(w)?);
    if xp % 16 != 0 || wp % 16 != 0 {
        return Ok(None);
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().unwrap() = n;
    let out = alloc(&dev, dims, DType::BF16)?;
    let grid = n.div_ceil(8) as u32;
    // x in shared memory: K bf16 values, within the default 48 KiB per block.
    if policy().gemv_smem && k * 2 <= 48 * 1024 {
        super::with_smem((k * 2) as u32);
        launch!(dev, "fl_gemv_smem_bf16", (grid, 1, 1), 256, xp, wp, ptr(&out)?, n as i32, k as i32);
    } else {
        launch!(dev, "fl_gemv_bf16", (grid, 1, 1), 256, xp, wp, ptr(&out)?, n as i32, k as i32);
    }
    Ok(Some(out))
}

/// How the input row of [`gemv_fused`] is prepared.
#[derive(Clone, Copy)]
pub enum GemvInput<'a> {
    Plain(&'a Tensor),
    /// RMSNorm(x) with f32 weights and eps.
    Normed(&'a Tensor, &'a Tensor, f32),
    /// silu(gate) · up.
    SiluMul(&'a Tensor, &'a Tensor),
}

/// y = W·x' (+ residual) for one bf16 row, x' prepared from the input as `input` says, in one
/// kernel (`fl_gemv_tma2_bf16` or `fl_gemv_fused_bf16`). `w [N, K]` bf16; returns `[1, N]`.
pub fn gemv_fused(input: GemvInput<'_>, w: &Tensor, residual: Option<&Tensor>) -> Result<Option<Tensor>> {
    gemv_row(input, w, residual, RowOut::Bf16, None)
}

/// silu(gate·x') · (up·x') for one bf16 row, `w [2·I, K]` holding the gate rows then the up rows,
/// in one kernel (the bulk-copy product's SwiGLU epilogue): `[1, I]`, bit-identical to the
/// `[1, 2·I]` product through `gemv_fused` followed by silu·up. None where that kernel is not
/// the one in use.
pub fn gemv_swiglu(input: GemvInput<'_>, w: &Tensor) -> Result<Option<Tensor>> {
    if gemv_variant() != GemvVariant::Tma || w.dims2().map_or(true, |(n, _)| n % 2 != 0) {
        return Ok(None);
    }
    gemv_row(input, w, None, RowOut::SwiGlu, None)
}

/// An output head's logits for one bf16 row: W·x' as f32 `[1, N]` holding the bf16-rounded
/// values (what the bf16 product followed by a conversion gives), in one kernel. None where the
/// bulk-copy product is not the one in use.
pub fn gemv_logits(input: GemvInput<'_>, w: &Tensor) -> Result<Option<Tensor>> {
    if gemv_variant() != GemvVariant::Tma {
        return Ok(None);
    }
    gemv_row(input, w, None, RowOut::F32, None)
}

/// [`gemv_logits`], and the greedy end of a decode step in the same kernel: `dst[0]` ← the
/// logits' argmax (first index on ties, as [`argmax_into`]) and `advance[0] += 1` when given
/// (one-element u32 device tensors). Its last block to finish reduces the blocks' maxima, so
/// the step needs no argmax kernels. None where the bulk-copy product is not the one in use.
pub fn gemv_logits_argmax(input: GemvInput<'_>, w: &Tensor, dst: &Tensor, advance: Option<&Tensor>) -> Result<Option<Tensor>> {
    if !policy().head_argmax || gemv_variant() != GemvVariant::Tma || !u32_word(dst) || !advance.is_none_or(|t| u32_word(t)) {
        return Ok(None);
    }
    gemv_row(input, w, None, RowOut::F32, Some((dst, advance)))
}

/// What a product row writes (GEMV_OUT_* in gemv_tma.cuh).
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowOut {
    Bf16 = 0,
    SwiGlu = 1,
    F32 = 2,
}

/// The token and position a head's product also writes (see [`gemv_logits_argmax`]).
type Greedy<'a> = Option<(&'a Tensor, Option<&'a Tensor>)>;

fn gemv_row(input: GemvInput<'_>, w: &Tensor, residual: Option<&Tensor>, mode: RowOut, greedy: Greedy<'_>) -> Result<Option<Tensor>> {
    let (x, x2, nw, eps, pro) = match input {
        GemvInput::Plain(x) => (x, None, None, 0.0, 0),
        GemvInput::Normed(x, nw, eps) => (x, None, Some(nw), eps, 1),
        GemvInput::SiluMul(g, u) => (g, Some(u), None, 0.0, 2),
    };
    if !policy().gemv || x.dtype() != DType::BF16 || w.dtype() != DType::BF16 || !w.is_contiguous() {
        return Ok(None);
    }
    let Some((dev, _)) = on(x) else { return Ok(None) };
    let Ok((n, k)) = w.dims2() else { return Ok(None) };
    let row = |t: &Tensor| t.dtype() == DType::BF16 && t.is_contiguous() && t.elem_count() == k && cuda_device(t).is_some();
    let tma = gemv_variant() == GemvVariant::Tma;
    let ok = row(x)
        && x2.is_none_or(row)
        && nw.is_none_or(|t| f32_on_device(t) && t.elem_count() == k)
        && residual.is_none_or(|r| r.dtype() == DType::BF16 && r.is_contiguous() && r.elem_count() == n)
        && k % 8 == 0
        && k * 2 <= if tma { TMA_MAX_SMEM - tma_shape().stage_buffers() } else { 48 * 1024 };
    if !ok {
        return Ok(None);
    }
    let opt = |t: Option<&Tensor>| t.map_or(Ok(0u64), ptr);
    let (xp, x2p, nwp, wp, rp) = (ptr(x)?, opt(x2)?, opt(nw)?, ptr(w)?, opt(residual)?);
    if [xp, x2p, nwp, wp].iter().any(|p| p % 16 != 0) {
        return Ok(None);
    }
    let out = match mode {
        RowOut::Bf16 => alloc(&dev, (1, n), DType::BF16)?,
        RowOut::SwiGlu => alloc(&dev, (1, n / 2), DType::BF16)?,
        RowOut::F32 => alloc(&dev, (1, n), DType::F32)?,
    };
    let (n32, k32, op) = (n as i32, k as i32, ptr(&out)?);
    match gemv_variant() {
        GemvVariant::Tma => {
            // Every block gets both stage buffers, even one with a single stage of work: giving
            // such blocks (QKV, O) only what they use, so that more of the neighbouring kernels'
            // blocks fit beside them early, was measured slower (1B: 48.1 vs 47.2 us per layer).
            let smem = tma_shape().stage_buffers() + k * 2;
            let grid = tma_grid(&dev, n, smem)?;
            // The argmax's scratch: a finished-block counter (left at zero), each block's best.
            // With the position advanced, also the host's token mirror when a reader set one.
            let (am, dst, adv, mirror) = match greedy {
                Some((dst, adv)) => {
                    let mirror = if adv.is_some() { super::graph::take_token_mirror() } else { 0 };
                    (Some(super::alloc_zeroed_u32(&dev, 1 + 2 * grid as usize)?), ptr(dst)?, opt(adv)?, mirror)
                }
                None => (None, 0, 0, 0),
            };
            super::with_smem(smem as u32);
            launch!(
                dev, tma_shape().kernel, (grid, 1, 1), 256, xp, x2p, nwp, eps, pro as i32, wp, rp, op, n32, k32, mode as i32,
                opt(am.as_ref())?, dst, adv, mirror
            );
        }
        _ if greedy.is_some() => return Ok(None),
        v => {
            let name = if v == GemvVariant::Ldg { "fl_gemv_fused_ldg_bf16" } else { "fl_gemv_fused_bf16" };
            super::with_smem((k * 2) as u32);
            launch!(dev, name, (n.div_ceil(8) as u32, 1, 1), 256, xp, x2p, nwp, eps, pro as i32, wp, rp, op, n32, k32);
        }
    }
    Ok(Some(out))
}

/// Which fused matrix-vector kernel runs (`FERROLM_CUDA_GEMV_VARIANT`, see kernels.cu and
/// gemv_tma.cuh): by default the one that streams the weights into shared memory with bulk
/// copies over a few blocks per SM; `streaming` reads them into registers with the streaming
/// hint, one short block per 8 rows (the default until 2026-12-04); `ldg` the same through the
/// read-only path. All three give bit-identical results.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GemvVariant {
    Streaming,
    Ldg,
    Tma,
}
fn gemv_variant() -> GemvVariant {
    static V: std::sync::OnceLock<GemvVariant> = std::sync::OnceLock::new();
    *V.get_or_init(|| match std::env::var("FERROLM_CUDA_GEMV_VARIANT").as_deref() {
        Ok("ldg") => GemvVariant::Ldg,
        Ok("streaming") => GemvVariant::Streaming,
        _ => GemvVariant::Tma,
    })
}

/// The bulk-copy product's kernel and its stages in flight, each 8 rows' chunks of `batch`
/// 16-byte vectors (gemv_tma.cuh's NS and B): 2 stages of 256 (32 KB each) unless
/// `FERROLM_CUDA_TMA_STAGES=3` or `FERROLM_CUDA_TMA_BATCH=128` (16 KB stages, so that the next
/// kernel's blocks fit beside a running product's) pick another instance (same results).
struct TmaShape {
    kernel: &'static str,
    stages: usize,
    batch: usize,
}

impl TmaShape {
    /// Shared memory of the stage buffers.
    fn stage_buffers(&self) -> usize {
        self.stages * 8 * self.batch * 16
    }
}

fn tma_shape() -> &'static TmaShape {
    static S: std::sync::OnceLock<TmaShape> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<usize>().ok());
        let stages = env("FERROLM_CUDA_TMA_STAGES").filter(|&s| s == 3).unwrap_or(2);
        let batch = env("FERROLM_CUDA_TMA_BATCH").filter(|&b| b == 128).unwrap_or(256);
        let kernel = match (stages, batch) {
            (3, 256) => "fl_gemv_tma3_bf16",
            (2, 128) => "fl_gemv_tma2_b128_bf16",
            (3, 128) => "fl_gemv_tma3_b128_bf16",
            _ => "fl_gemv_tma2_bf16",
        };
        TmaShape { kernel, stages, batch }
    })
}

/// The dynamic shared memory the bulk-copy product may ask for (Hopper's 227 KiB per block, less
/// the kernel's static shared memory, rounded down).
const TMA_MAX_SMEM: usize = 224 * 1024;
/// Shared memory of one SM on Hopper, and what the driver reserves per block.
const SM_SMEM: usize = 228 * 1024;
const SMEM_PER_BLOCK_RESERVED: usize = 1024;

/// Grid of the bulk-copy product: as many blocks per SM as fit, at most 3 (the best measured on
/// the 1B shape) or `FERROLM_CUDA_GEMV_BLOCKS_PER_SM`, never more than one block per 8 rows.
/// Sets the kernel's shared-memory limit once per device. (The QKV and O products at 1 block per
/// SM, to leave room for the neighbouring kernels' blocks, measured slower: 1B 897 against 923.)
fn tma_grid(dev: &candle_core::cuda_backend::CudaDevice, n: usize, smem: usize) -> Result<u32> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::WrapErr;
    static READY: std::sync::Mutex<Vec<(usize, i32)>> = std::sync::Mutex::new(Vec::new());
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut ready = READY.lock().unwrap_or_else(|e| e.into_inner());
    let sms = match ready.iter().find(|(o, _)| *o == ordinal) {
        Some(&(_, sms)) => sms,
        None => {
            let kernel = tma_shape().kernel;
            let func = dev.get_or_load_custom_func(kernel, super::MODULE, super::ptx()?)?;
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            func.set_attribute(attr, TMA_MAX_SMEM as i32).map_err(|e| candle_core::Error::Msg(format!("{kernel}: {e:?}")))?;
            let ctx = dev.cuda_stream().context().clone();
            let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).w()?;
            ready.push((ordinal, sms));
            sms
        }
    };
    static MOST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let most = *MOST.get_or_init(|| {
        std::env::var("FERROLM_CUDA_GEMV_BLOCKS_PER_SM").ok().and_then(|v| v.parse().ok()).filter(|&b| b > 0).unwrap_or(3)
    });
    let per_sm = (SM_SMEM / (smem + SMEM_PER_BLOCK_RESERVED)).clamp(1, most);
    Ok((per_sm * sms.max(1) as usize).min(n.div_ceil(8)) as u32)
}

/// dst[0] = argmax of the f32 `logits` (first index on ties). Returns false when not applicable.
pub fn argmax_into(logits: &Tensor, dst: &Tensor) -> Result<bool> {
    argmax_advance(logits, dst, None)
}

/// [`argmax_into`], and `advance[0] += 1` in the same final pass when given (a one-element u32
/// device tensor: the position of a captured decode step).
pub fn argmax_advance(logits: &Tensor, dst: &Tensor, advance: Option<&Tensor>) -> Result<bool> {
    if !policy().kernels || !f32_on_device(logits) || !u32_word(dst) || !advance.is_none_or(|t| u32_word(t)) {
        return Ok(false);
    }
    let dev = cuda_device(logits).unwrap();
    let n = logits.elem_count();
    let parts = n.div_ceil(2048).clamp(1, 256);
    let per = n.div_ceil(parts);
    let best = alloc(&dev, parts, DType::F32)?;
    let index = alloc(&dev, parts, DType::U32)?;
    let adv = advance.map_or(Ok(0u64), ptr)?;
    launch!(dev, "fl_argmax_partial_f32", (parts as u32, 1, 1), 256, ptr(logits)?, ptr(&best)?, ptr(&index)?, n as i32, per as i32);
    launch!(dev, "fl_argmax_final", (1, 1, 1), 256, ptr(&best)?, ptr(&index)?, ptr(dst)?, parts as i32, adv);
    Ok(true)
}

/// Rows `ids` (u32 `[n]` on the device) of a bf16 `table [rows, hidden]` as a new `[n, hidden]`
/// tensor, each times `scale` (rounded to bf16 first, as candle's bf16 affine rounds it) when
/// given: the token-embedding lookup of a step, from the step arena (no allocation node in a
/// captured graph). Returns `None` when not applicable.
pub fn embed_rows(table: &Tensor, ids: &Tensor, scale: Option<f64>) -> Result<Option<Tensor>> {
    let Some(dev) = cuda_device(table) else { return Ok(None) };
    let Ok((rows, hidden)) = table.dims2() else { return Ok(None) };
    let n = ids.elem_count();
    let ids_ok = ids.dtype() == DType::U32 && ids.rank() == 1 && ids.is_contiguous() && cuda_device(ids).is_some();
    if table.dtype() != DType::BF16 || !table.is_contiguous() || hidden % 8 != 0 || ptr(table)? % 16 != 0 || !ids_ok || n == 0 {
        return Ok(None);
    }
    let out = alloc(&dev, (n, hidden), DType::BF16)?;
    let scale = scale.map_or(0.0, |s| half::bf16::from_f64(s).to_f32());
    launch!(dev, "fl_embed_rows_bf16", (n as u32, 1, 1), 256, ptr(table)?, ptr(ids)?, ptr(&out)?, rows as i32, hidden as i32, scale);
    Ok(Some(out))
}

/// p[0] += 1 for a one-element u32 device tensor. Returns false when not applicable.
pub fn increment(p: &Tensor) -> Result<bool> {
    let Some(dev) = cuda_device(p) else { return Ok(false) };
    if p.dtype() != DType::U32 || p.elem_count() != 1 {
        return Ok(false);
    }
    launch!(dev, "fl_increment_u32", (1, 1, 1), 32, ptr(p)?);
    Ok(true)
}

/// Prefill attention in one kernel (flash attention on tensor cores, `flash_prefill.cuh`): q
/// `[T, Hq, D]` bf16 over k, v `[Hkv, S, D]` bf16 (token stride D, any head stride: the cache
/// buffers' view, no copy) → `[T, Hq·D]`, causal from `pos`, windowed and soft-capped as `p`
/// says. Never materializes the T×S scores. None when not applicable (or `FERROLM_CUDA_FLASH=0`).
pub fn flash_prefill(q: &Tensor, k: &Tensor, v: &Tensor, pos: crate::attention::Positions, p: &crate::attention::AttentionParams) -> Result<Option<Tensor>> {
    if !policy().flash_prefill {
        return Ok(None);
    }
    let Some((dev, _)) = on(q) else { return Ok(None) };
    let (Ok((t, hq, d)), Ok((hkv, s, dk))) = (q.dims3(), k.dims3()) else { return Ok(None) };
    let bf16 = |x: &Tensor| x.dtype() == DType::BF16 && cuda_device(x).is_some();
    let (ks, vs) = (k.stride(), v.stride());
    let ok = bf16(q) && bf16(k) && bf16(v) && q.is_contiguous() && matches!(d, 64 | 128 | 256) && dk == d
        && hkv > 0 && hq % hkv == 0 && v.dims() == k.dims() && ks[1] == d && ks[2] == 1 && ks == vs && t > 0 && s > 0;
    if !ok || [ptr(q)?, ptr(k)?, ptr(v)?].iter().any(|a| a % 16 != 0) || (ks[0] * 2) % 16 != 0 {
        return Ok(None);
    }
    let out = alloc(&dev, (t, hq * d), DType::BF16)?;
    let name = format!("fl_flash_prefill_bf16_d{d}");
    let smem = flash_smem(d);
    let func = dev.get_or_load_custom_func(&name, super::MODULE, super::ptx()?)?;
    let attr = candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    func.set_attribute(attr, smem as i32).map_err(|e| candle_core::Error::Msg(format!("{name}: {e:?}")))?;
    super::with_smem(smem as u32);
    launch!(
        dev, &name, (t.div_ceil(FLASH_ROWS) as u32, hq as u32, 1), 128,
        ptr(q)?, ptr(k)?, ptr(v)?, ptr(&out)?, t as i32, hq as i32, (hq / hkv) as i32, ks[0] as i64, s as i32,
        pos.query_start as u32, pos.key_start as u32, p.window.unwrap_or(0) as i32, p.scale, p.softcap.unwrap_or(0.0)
    );
    Ok(Some(out))
}

/// Queries per block of the flash prefill kernel (FP_ROWS), and its shared memory for head
/// size d (`FlashShared<D>` in flash_prefill.cuh: padded q, k, v tiles; each warp's scores,
/// probabilities, outputs, maxima and sums).
const FLASH_ROWS: usize = 64;
fn flash_smem(d: usize) -> usize {
    let (warps, keys) = (4, 64);
    2 * 3 * 64 * (d + 8) + 4 * warps * 16 * (keys + 4) + 2 * warps * 16 * (keys + 8) + 4 * warps * 16 * (d + 4) + 4 * 2 * warps * 16
}

/// Causal/windowed softmax of raw prefill scores `[.., T, S]` (rows ordered with the query
/// index fastest-varying last: row r is query `r % T`) into probabilities of the same dtype,
/// scaled and soft-capped as `p` says, in one pass (no mask tensor, no f32 copies).
pub fn masked_softmax(scores: &Tensor, t: usize, pos: crate::attention::Positions, p: &crate::attention::AttentionParams) -> Result<Option<Tensor>> {
    if !policy().masked_softmax {
        return Ok(None);
    }
    let Some((dev, sfx)) = on(scores) else { return Ok(None) };
    let s = *scores.dims().last().unwrap_or(&0);
    if s == 0 || t == 0 || scores.elem_count() % (s * t) != 0 {
        return Ok(None);
    }
    let rows = scores.elem_count() / s;
    let out = alloc(&dev, scores.shape().clone(), scores.dtype())?;
    let window = p.window.map_or(0, |w| w as i32);
    let cap = p.softcap.unwrap_or(0.0);
    launch!(
        dev,
        &format!("fl_masked_softmax_{sfx}"),
        (rows as u32, 1, 1),
        256,
        ptr(scores)?,
        ptr(&out)?,
        s as i32,
        t as i32,
        pos.query_start as u32,
        pos.key_start as u32,
        window,
        p.scale,
        cap
    );
    Ok(Some(out))
}
