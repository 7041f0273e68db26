//! Scaled dot-product attention of new queries over a sequence's cached keys and values, with
//! causal and sliding-window masking and grouped-query heads. The fused CPU kernel never
//! materializes a mask or a score matrix; other devices use a composition of candle ops.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use crate::cpu::attn::{self, Call, Kv};
use crate::cpu::kv_rows::QKv;
use crate::cpu::turbo_rows::TurboKv;
use crate::kv_quant::{self, KvQuant};
use crate::paged::BlockTable;
use crate::cpu::math;
use crate::cpu::simd::{level, multiversion_plain, MulAdd};
use crate::cpu::threads::{parallel_ranges, SharedOut};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Multiplies q·k (usually 1/sqrt(head_dim)).
    pub scale: f32,
    /// A key is visible to a query only if it is fewer than `window` positions behind it.
    pub window: Option<usize>,
    /// Gemma-2-style tanh soft-capping of scores, when set.
    pub softcap: Option<f32>,
}

/// Where the queries and keys sit in the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Positions {
    /// Absolute position of the first query.
    pub query_start: usize,
    /// Absolute position of the first key (keys are in temporal order).
    pub key_start: usize,
}

/// q `[T, Hq, D]`, k and v `[Hkv, S, D]` → `[T, Hq·D]`: queries of decode rows (one token of a
/// sequence, or a few being verified), each on the kernel a lone decode uses.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, pos: Positions, p: &AttentionParams) -> candle_core::Result<Tensor> {
    attend_as(q, k, v, None, pos, p, false)
}

/// `attend` over keys and values stored as `quant` says: `None` float tensors, else quantized
/// rows (U8 `[Hkv, S, row_bytes]`, see `kv_quant`).
pub fn attend_quant(q: &Tensor, k: &Tensor, v: &Tensor, quant: Option<KvQuant>, pos: Positions, p: &AttentionParams) -> candle_core::Result<Tensor> {
    attend_as(q, k, v, quant, pos, p, false)
}

/// `attend` for the queries of a prompt chunk: on the CPU always the tiled prefill kernel,
/// whose result for a query does not depend on the other queries of its call, so a prompt's
/// attention is the same however it was cut into chunks (a chunk of one token included).
pub fn attend_prompt(q: &Tensor, k: &Tensor, v: &Tensor, pos: Positions, p: &AttentionParams) -> candle_core::Result<Tensor> {
    attend_as(q, k, v, None, pos, p, true)
}

/// `attend_prompt` over keys and values stored as `quant` says (see [`attend_quant`]).
pub fn attend_prompt_quant(q: &Tensor, k: &Tensor, v: &Tensor, quant: Option<KvQuant>, pos: Positions, p: &AttentionParams) -> candle_core::Result<Tensor> {
    attend_as(q, k, v, quant, pos, p, true)
}

/// `attend` (`prompt` false) or `attend_prompt` (true) over a paged cache: k and v are a
/// layer's pools `[blocks, Hkv, B, D]` (f16 or f32) and `table` lists the sequence's blocks.
/// The CPU kernels read the rows through the table; the arithmetic, and so every bit of the
/// result, is that of the same keys and values held contiguously. CPU only.
pub fn attend_paged(q: &Tensor, k: &Tensor, v: &Tensor, table: &BlockTable, pos: Positions, p: &AttentionParams, prompt: bool) -> candle_core::Result<Tensor> {
    attend_paged_quant(q, k, v, None, table, pos, p, prompt)
}

/// `attend_paged` over pools stored as `quant` says: `None` f16 or f32, else quantized rows
/// (U8 pools `[blocks, Hkv, B, row_bytes]`, see `kv_quant`), read through the table by the
/// same kernels as a contiguous quantized cache, with the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_paged_quant(q: &Tensor, k: &Tensor, v: &Tensor, quant: Option<KvQuant>, table: &BlockTable, pos: Positions, p: &AttentionParams, prompt: bool) -> candle_core::Result<Tensor> {
    let (t, hq, d) = q.dims3()?;
    let hkv = table.kv_heads(k.layout())?;
    if table.kv_heads(v.layout())? != hkv || hq % hkv != 0 {
        candle_core::bail!("paged attention: {hq} query heads over {hkv} kv heads")
    }
    if let Some(qf) = quant {
        return attend_quantized(q, k, v, qf, Some(table), pos, p, prompt);
    }
    let dt = k.dtype();
    if !matches!(q.device(), Device::Cpu) || q.dtype() != DType::F32 || v.dtype() != dt || !matches!(dt, DType::F16 | DType::F32) {
        candle_core::bail!("paged attention runs on the CPU over f16 or f32 pools, not {:?} {}", q.device(), dt.as_str())
    }
    let reads_f16 = prompt || (t == 1 && decode_kernel(d)) || t >= TILED_MIN_TOKENS;
    if dt == DType::F16 && !reads_f16 {
        // The per-row kernel takes f32 (2 or 3 rows without the AVX-512 decode kernel).
        return attend_paged(q, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, table, pos, p, prompt);
    }
    q.contiguous()?.apply_op3_no_bwd(k, v, &AttendCpu { pos, params: *p, prompt, quant: None, table: Some(table) })
}

fn attend_as(q: &Tensor, k: &Tensor, v: &Tensor, quant: Option<KvQuant>, pos: Positions, p: &AttentionParams, prompt: bool) -> candle_core::Result<Tensor> {
    if let Some(qf) = quant {
        return attend_quantized(q, k, v, qf, None, pos, p, prompt);
    }
    let (_, hq, _) = q.dims3()?;
    let (hkv, _, _) = k.dims3()?;
    if hq % hkv != 0 {
        candle_core::bail!("attention: {hq} query heads are not a multiple of {hkv} kv heads")
    }
    if matches!(q.device(), Device::Cpu) && q.dtype() == DType::F32 {
        let kv_is = |dt: DType| k.dtype() == dt && v.dtype() == dt;
        // An f16 cache (the CPU default) is read by the decode and the tiled kernel directly;
        // the per-row kernel (2 or 3 new tokens, e.g. a speculative check) takes f32.
        let t = q.dims()[0];
        let reads_f16 = prompt || (t == 1 && decode_kernel(q.dims()[2])) || t >= TILED_MIN_TOKENS;
        if kv_is(DType::F16) && !reads_f16 {
            return attend_as(q, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, None, pos, p, prompt);
        }
        if kv_is(DType::F32) || kv_is(DType::F16) {
            let q = q.contiguous()?;
            return q.apply_op3_no_bwd(k, v, &AttendCpu { pos, params: *p, prompt, quant: None, table: None });
        }
    }
    if !matches!(q.device(), Device::Cpu) {
        return crate::attention_device::attend(q, k, v, pos, p);
    }
    attend_generic(q, k, v, pos, p)
}

/// Attention over quantized rows: the decode and tiled kernels read them directly (decode
/// dequantizes in registers, the tiled kernel while packing its panels); the per-row kernel
/// (2 or 3 rows without AVX-512 decode) and other devices get the rows dequantized to f32.
/// `table`: k and v are paged pools `[blocks, Hkv, B, row_bytes]` read through it.
#[allow(clippy::too_many_arguments)]
fn attend_quantized(q: &Tensor, k: &Tensor, v: &Tensor, quant: KvQuant, table: Option<&BlockTable>, pos: Positions, p: &AttentionParams, prompt: bool) -> candle_core::Result<Tensor> {
    if quant.turbo_values.is_some() {
        if table.is_some() {
            candle_core::bail!("attention: TurboQuant rows are read gathered, not through a block table")
        }
        return attend_turbo(q, k, v, quant, pos, p, prompt);
    }
    let (t, hq, d) = q.dims3()?;
    let (hkv, row) = match table {
        Some(table) => (table.kv_heads(k.layout())?, k.dims()[3]),
        None => {
            let (hkv, _, row) = k.dims3()?;
            (hkv, row)
        }
    };
    if hq % hkv != 0 {
        candle_core::bail!("attention: {hq} query heads are not a multiple of {hkv} kv heads")
    }
    if k.dtype() != DType::U8 || v.dtype() != DType::U8 || row != quant.row_bytes(d) || v.dims() != k.dims() {
        candle_core::bail!("attention: {} keys are not {} rows of head size {d}", k.dtype().as_str(), quant.name())
    }
    let direct = prompt || (t == 1 && decode_kernel(d)) || t >= TILED_MIN_TOKENS;
    if matches!(q.device(), Device::Cpu) && q.dtype() == DType::F32 && direct {
        // Rotated rows: queries rotated alike, the output (rotated values) rotated back.
        let q = if quant.rotate { kv_quant::rotate(q)? } else { q.contiguous()? };
        let out = q.apply_op3_no_bwd(k, v, &AttendCpu { pos, params: *p, prompt, quant: Some(quant), table })?;
        return unrotate_heads(out, quant, d);
    }
    // The per-row kernel reads f32: the rows dequantized (for a paged cache, its own blocks
    // gathered first), the same values in the same order as a contiguous cache's.
    let (k, v, pos) = match table {
        Some(table) => (table.gather(k)?, table.gather(v)?, pos),
        None => (k.clone(), v.clone(), pos),
    };
    let (k, v) = (kv_quant::dequantize(quant, &k, d)?, kv_quant::dequantize(quant, &v, d)?);
    attend_as(q, &k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?, None, pos, p, prompt)
}

/// Attention over TurboQuant rows (k and v a TurboQuant cache's halves `[Hkv, S, half]`, see
/// `cpu::turbo_rows`): the decode and tiled kernels read them in place, values in the rotated
/// domain, and each head's output is rotated back once; the per-row kernel (2 or 3 rows
/// without AVX-512 decode) and other devices get the rows widened to f32 (`turbo::widen`).
fn attend_turbo(q: &Tensor, k: &Tensor, v: &Tensor, quant: KvQuant, pos: Positions, p: &AttentionParams, prompt: bool) -> candle_core::Result<Tensor> {
    let (t, hq, d) = q.dims3()?;
    let (hkv, _, row) = k.dims3()?;
    if hq % hkv != 0 {
        candle_core::bail!("attention: {hq} query heads are not a multiple of {hkv} kv heads")
    }
    if quant.check_head_dim(d).is_err() || k.dtype() != DType::U8 || v.dtype() != DType::U8 || row != kv_quant::turbo::half_bytes(quant, d) || v.dims() != k.dims() {
        candle_core::bail!("attention: {} keys are not {} rows of head size {d}", k.dtype().as_str(), quant.name())
    }
    let direct = prompt || (t == 1 && decode_kernel(d)) || t >= TILED_MIN_TOKENS;
    if matches!(q.device(), Device::Cpu) && q.dtype() == DType::F32 && direct {
        return q.contiguous()?.apply_op3_no_bwd(k, v, &AttendCpu { pos, params: *p, prompt, quant: Some(quant), table: None });
    }
    let (k, v) = kv_quant::turbo::widen(quant, k, v, d)?;
    attend_as(q, &k.to_dtype(q.dtype())?, &v.to_dtype(q.dtype())?, None, pos, p, prompt)
}

/// The attention output `[rows, heads·d]` of rotated values rotated back, per head.
fn unrotate_heads(out: Tensor, quant: KvQuant, d: usize) -> candle_core::Result<Tensor> {
    if !quant.rotate {
        return Ok(out);
    }
    let (rows, width) = out.dims2()?;
    kv_quant::rotate(&out.reshape((rows, width / d, d))?)?.reshape((rows, width))
}

/// One sequence's decode rows in a batch: q `[T, Hq, D]` (one token, or the pending token and
/// drafts being verified, at positions `query_start..query_start + T`) over its keys and values
/// `[Hkv, S, D]` (all T rows' keys appended).
pub struct DecodeQuery<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    /// How k and v are stored (see [`attend_quant`]).
    pub quant: Option<KvQuant>,
    pub pos: Positions,
}

impl DecodeQuery<'_> {
    /// Row `r`'s attention alone (the fallback when no batched kernel takes the batch); `table`:
    /// k and v are paged pools read through it.
    fn attend_row(&self, table: Option<&BlockTable>, r: usize, p: &AttentionParams) -> candle_core::Result<Tensor> {
        let pos = Positions { query_start: self.pos.query_start + r, key_start: self.pos.key_start };
        let keys = (pos.query_start + 1).saturating_sub(pos.key_start);
        let q = self.q.narrow(0, r, 1)?;
        match table {
            Some(table) => attend_paged_quant(&q, self.k, self.v, self.quant, &table.truncated(keys), pos, p, false),
            None => {
                let keys = keys.min(self.k.dims()[1]);
                let (k, v) = (self.k.narrow(1, 0, keys)?, self.v.narrow(1, 0, keys)?);
                attend_quant(&q, &k, &v, self.quant, pos, p)
            }
        }
    }
}

/// `attend` for the decode rows of several sequences, `[rows, Hq·D]`. Every row is computed as
/// a lone decode of that token would be (its keys up to its own position, the one-token
/// kernel's arithmetic), so verifying drafts gives the bits of decoding them one by one. On the
/// CPU one parallel pass over all rows' (kv head, key range) items (`decode_attn::attend_many`).
pub fn attend_decode_batch(queries: &[DecodeQuery<'_>], p: &AttentionParams) -> candle_core::Result<Tensor> {
    if let [one] = queries {
        if one.q.dims()[0] == 1 {
            return attend_quant(one.q, one.k, one.v, one.quant, one.pos, p);
        }
    }
    decode_batch(queries, &vec![None; queries.len()], p)
}

/// `attend_decode_batch` over paged caches: query i's k and v are pools `[blocks, Hkv, B, D]`
/// read through `tables[i]` (see [`attend_paged`]); the same bits as over contiguous caches.
pub fn attend_decode_batch_paged(queries: &[DecodeQuery<'_>], tables: &[&BlockTable], p: &AttentionParams) -> candle_core::Result<Tensor> {
    if queries.len() != tables.len() {
        candle_core::bail!("paged attention: {} queries, {} block tables", queries.len(), tables.len())
    }
    let tables: Vec<Option<&BlockTable>> = tables.iter().map(|t| Some(*t)).collect();
    decode_batch(queries, &tables, p)
}

fn decode_batch(queries: &[DecodeQuery<'_>], tables: &[Option<&BlockTable>], p: &AttentionParams) -> candle_core::Result<Tensor> {
    if let ([one], [table]) = (queries, tables) {
        if one.q.dims()[0] == 1 {
            return one.attend_row(*table, 0, p);
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(out) = decode_batch_cpu(queries, tables, p)? {
        return Ok(out);
    }
    let mut outs = Vec::new();
    for (d, table) in queries.iter().zip(tables) {
        for r in 0..d.q.dims()[0] {
            outs.push(d.attend_row(*table, r, p)?);
        }
    }
    Tensor::cat(&outs, 0)
}

/// The CPU batch when every query is one f32 token over an f16 (or every one over an f32) cache
/// with a head size `decode_attn` takes; None otherwise.
#[cfg(target_arch = "x86_64")]
fn decode_batch_cpu(queries: &[DecodeQuery<'_>], tables: &[Option<&BlockTable>], p: &AttentionParams) -> candle_core::Result<Option<Tensor>> {
    let Some(first) = queries.first() else { return Ok(None) };
    let (kv_dtype, quant) = (first.k.dtype(), first.quant);
    let fits = |d: &DecodeQuery| {
        matches!(d.q.device(), Device::Cpu) && d.q.dtype() == DType::F32 && d.k.dtype() == kv_dtype && d.v.dtype() == kv_dtype && d.quant == quant
    };
    if !queries.iter().all(fits) || !decode_kernel(first.q.dims()[2]) {
        return Ok(None);
    }
    match (kv_dtype, quant) {
        (DType::F16, None) => decode_batch_typed::<FloatRows<half::f16>>(queries, tables, p).map(Some),
        (DType::F32, None) => decode_batch_typed::<FloatRows<f32>>(queries, tables, p).map(Some),
        (DType::U8, Some(qf)) if qf.rotate => {
            // Each query rotated on its own, and each output row rotated back on its own: a
            // row's bits do not depend on the rest of the batch.
            let rotated = queries.iter().map(|d| kv_quant::rotate(d.q)).collect::<candle_core::Result<Vec<_>>>()?;
            let queries: Vec<DecodeQuery> = queries.iter().zip(&rotated).map(|(d, q)| DecodeQuery { q, ..*d }).collect();
            let out = decode_batch_typed::<QuantRows>(&queries, tables, p)?;
            unrotate_heads(out, qf, first.q.dims()[2]).map(Some)
        }
        (DType::U8, Some(qf)) if qf.turbo_values.is_some() => {
            let out = decode_batch_typed::<TurboRows>(queries, tables, p)?;
            let (rows, width) = out.dims2()?;
            let mut data = out.flatten_all()?.to_vec1::<f32>()?;
            kv_quant::turbo::unrotate(&mut data, first.q.dims()[2]);
            Tensor::from_vec(data, (rows, width), &Device::Cpu).map(Some)
        }
        (DType::U8, Some(_)) => decode_batch_typed::<QuantRows>(queries, tables, p).map(Some),
        _ => Ok(None),
    }
}

/// How a query's cache storage is viewed as rows for the decode kernel.
#[cfg(target_arch = "x86_64")]
trait RowsOf {
    type R<'a>: crate::cpu::decode_attn::Rows;
    /// `table` and `offsets` (its `BlockTable::offsets`) when the query's cache is paged.
    fn view<'a>(s: &'a CpuStorage, l: &Layout, quant: Option<KvQuant>, d: usize, paged: Option<(&BlockTable, &'a [usize])>) -> candle_core::Result<Self::R<'a>>;
    /// The key rows and the value rows of a query's cache (k in `ks`, v in `vs`).
    #[allow(clippy::too_many_arguments)]
    fn pair<'a>(
        (ks, kl): (&'a CpuStorage, &Layout),
        (vs, vl): (&'a CpuStorage, &Layout),
        quant: Option<KvQuant>,
        d: usize,
        kp: Option<(&BlockTable, &'a [usize])>,
        vp: Option<(&BlockTable, &'a [usize])>,
    ) -> candle_core::Result<(Self::R<'a>, Self::R<'a>)> {
        Ok((Self::view(ks, kl, quant, d, kp)?, Self::view(vs, vl, quant, d, vp)?))
    }
}

/// TurboQuant caches: each row's key and value live across both stored halves.
#[cfg(target_arch = "x86_64")]
struct TurboRows;

#[cfg(target_arch = "x86_64")]
impl RowsOf for TurboRows {
    type R<'a> = TurboKv<'a>;
    fn view<'a>(_: &'a CpuStorage, _: &Layout, _: Option<KvQuant>, _: usize, _: Option<(&BlockTable, &'a [usize])>) -> candle_core::Result<TurboKv<'a>> {
        candle_core::bail!("attention: TurboQuant rows are read in pairs of halves")
    }
    fn pair<'a>(
        (ks, kl): (&'a CpuStorage, &Layout),
        (vs, vl): (&'a CpuStorage, &Layout),
        quant: Option<KvQuant>,
        d: usize,
        kp: Option<(&BlockTable, &'a [usize])>,
        vp: Option<(&BlockTable, &'a [usize])>,
    ) -> candle_core::Result<(TurboKv<'a>, TurboKv<'a>)> {
        let quant = quant.ok_or_else(|| candle_core::Error::Msg("attention: TurboQuant rows without a format".into()))?;
        if kp.is_some() || vp.is_some() {
            candle_core::bail!("attention: TurboQuant rows are read gathered, not through a block table")
        }
        let (first, second) = (kv_view(ks.as_slice::<u8>()?, kl)?, kv_view(vs.as_slice::<u8>()?, vl)?);
        let keys = TurboKv::new(first, second, quant, d, false);
        Ok((keys, keys.reading_values(true)))
    }
}

#[cfg(target_arch = "x86_64")]
struct FloatRows<E>(std::marker::PhantomData<E>);

#[cfg(target_arch = "x86_64")]
impl<E: crate::cpu::decode_attn::Elem + candle_core::WithDType> RowsOf for FloatRows<E> {
    type R<'a> = Kv<'a, E>;
    fn view<'a>(s: &'a CpuStorage, l: &Layout, _: Option<KvQuant>, _: usize, paged: Option<(&BlockTable, &'a [usize])>) -> candle_core::Result<Kv<'a, E>> {
        match paged {
            Some((table, offsets)) => Ok(table.view(s.as_slice::<E>()?, l, offsets)),
            None => kv_view(s.as_slice::<E>()?, l),
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct QuantRows;

#[cfg(target_arch = "x86_64")]
impl RowsOf for QuantRows {
    type R<'a> = QKv<'a>;
    fn view<'a>(s: &'a CpuStorage, l: &Layout, quant: Option<KvQuant>, d: usize, paged: Option<(&BlockTable, &'a [usize])>) -> candle_core::Result<QKv<'a>> {
        let quant = quant.ok_or_else(|| candle_core::Error::Msg("attention: quantized rows without a format".into()))?;
        let rows = match paged {
            Some((table, offsets)) => table.view(s.as_slice::<u8>()?, l, offsets),
            None => kv_view(s.as_slice::<u8>()?, l)?,
        };
        qkv_of(rows, l, quant, d)
    }
}

#[cfg(target_arch = "x86_64")]
fn decode_batch_typed<V: RowsOf>(queries: &[DecodeQuery<'_>], tables: &[Option<&BlockTable>], p: &AttentionParams) -> candle_core::Result<Tensor> {
    use crate::cpu::decode_attn::{attend_many, DecodeCall};
    use candle_core::Storage;
    let qs = queries.iter().map(|d| d.q.contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
    let guards: Vec<_> = queries.iter().zip(&qs).map(|(d, q)| (q.storage_and_layout(), d.k.storage_and_layout(), d.v.storage_and_layout())).collect();
    let offsets: Vec<(Vec<usize>, Vec<usize>)> = tables.iter().zip(&guards).map(|(t, (_, (_, kl), (_, vl)))| t.map(|t| (t.offsets(kl), t.offsets(vl))).unwrap_or_default()).collect();
    let mut calls = Vec::with_capacity(queries.len());
    for (((d, ((qs, ql), (ks, kl), (vs, vl))), (k_off, v_off)), table) in queries.iter().zip(&guards).zip(&offsets).zip(tables) {
        let (Storage::Cpu(qc), Storage::Cpu(kc), Storage::Cpu(vc)) = (&**qs, &**ks, &**vs) else { candle_core::bail!("attention: expected CPU tensors") };
        let (t, hq, dim) = d.q.dims3()?;
        let hkv = match table {
            Some(table) => table.kv_heads(kl)?.min(table.kv_heads(vl)?),
            None => d.k.dims()[0],
        };
        let q_all = &qc.as_slice::<f32>()?[ql.start_offset()..ql.start_offset() + t * hq * dim];
        let (kp, vp) = (table.map(|t| (t, &k_off[..])), table.map(|t| (t, &v_off[..])));
        let (k, v) = V::pair((kc, kl), (vc, vl), d.quant, dim, kp, vp)?;
        for (r, q) in q_all.chunks_exact(hq * dim).enumerate() {
            // Row r sees the keys a lone decode at its position would hold.
            let qpos = d.pos.query_start + r;
            let held = (qpos + 1).saturating_sub(d.pos.key_start);
            let (lo, hi) = visible_keys(qpos, held, d.pos, p.window);
            calls.push(DecodeCall { q, k, v, hq, hkv, d: dim, lo, hi, scale: p.scale, softcap: p.softcap });
        }
    }
    let width = calls[0].hq * calls[0].d;
    let mut out = vec![0f32; calls.len() * width];
    let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(width).collect();
    let refs: Vec<&DecodeCall<V::R<'_>>> = calls.iter().collect();
    attend_many(&refs, &mut outs);
    let rows = calls.len();
    Tensor::from_vec(out, (rows, width), &Device::Cpu)
}

/// The reference composition: explicit scores, mask and softmax.
pub fn attend_generic(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: Positions,
    p: &AttentionParams,
) -> candle_core::Result<Tensor> {
    let (t, hq, d) = q.dims3()?;
    let (hkv, s, _) = k.dims3()?;
    let group = hq / hkv;
    let dtype = q.dtype();
    let q = q.transpose(0, 1)?.contiguous()?.reshape((hkv, group * t, d))?;
    let mut scores = (q.matmul(&k.contiguous()?.t()?)?.to_dtype(DType::F32)? * p.scale as f64)?;
    if let Some(cap) = p.softcap {
        scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
    }
    let mask = build_mask(t, s, group, pos, p.window);
    let mask = Tensor::from_vec(mask, (group * t, s), q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let out = probs.to_dtype(dtype)?.matmul(&v.contiguous()?)?; // [hkv, group*t, d]
    out.reshape((hq, t, d))?.transpose(0, 1)?.contiguous()?.reshape((t, hq * d))
}

/// Range of key indices visible to the query at absolute position `qpos`.
fn visible_keys(qpos: usize, s: usize, pos: Positions, window: Option<usize>) -> (usize, usize) {
    let hi = (qpos + 1).saturating_sub(pos.key_start).min(s);
    let lo = match window {
        Some(w) => (qpos + 1).saturating_sub(w).saturating_sub(pos.key_start).min(hi),
        None => 0,
    };
    (lo, hi)
}

fn build_mask(t: usize, s: usize, group: usize, pos: Positions, window: Option<usize>) -> Vec<f32> {
    let mut mask = vec![f32::NEG_INFINITY; group * t * s];
    for g in 0..group {
        for i in 0..t {
            let (lo, hi) = visible_keys(pos.query_start + i, s, pos, window);
            let row = (g * t + i) * s;
            mask[row + lo..row + hi].fill(0.0);
        }
    }
    mask
}

struct AttendCpu<'t> {
    pos: Positions,
    params: AttentionParams,
    /// Prompt rows: always the tiled kernel (see `attend_prompt`).
    prompt: bool,
    /// Quantized rows (U8 storage), see `kv_quant`.
    quant: Option<KvQuant>,
    /// Paged keys and values: k and v are pools `[blocks, Hkv, B, D]` read through this table.
    table: Option<&'t BlockTable>,
}

impl CustomOp3 for AttendCpu<'_> {
    fn name(&self) -> &'static str {
        "attend"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(q) = qs else { candle_core::bail!("attention: expected f32 q") };
        let (t, hq, d) = ql.shape().dims3()?;
        let (hkv, s) = match self.table {
            Some(table) => (table.kv_heads(kl)?, table.tokens),
            None => {
                let (hkv, s, _) = kl.shape().dims3()?;
                (hkv, s)
            }
        };
        let offsets = self.table.map(|table| table.offsets(kl)).unwrap_or_default();
        let q = &q[ql.start_offset()..ql.start_offset() + t * hq * d];
        let mut out = vec![0f32; t * hq * d];
        if let Some(quant) = self.quant {
            let (CpuStorage::U8(kd), CpuStorage::U8(vd)) = (ks, vs) else { candle_core::bail!("attention: expected quantized (u8) kv") };
            if quant.turbo_values.is_some() {
                let keys = TurboKv::new(self.view(kd, kl, &offsets)?, self.view(vd, vl, &offsets)?, quant, d, false);
                self.quantized(q, (t, hq, hkv, s, d), keys, keys.reading_values(true), &mut out)?;
                kv_quant::turbo::unrotate(&mut out, d);
                return Ok((CpuStorage::F32(out), Shape::from((t, hq * d))));
            }
            let (k, v) = (qkv_of(self.view(kd, kl, &offsets)?, kl, quant, d)?, qkv_of(self.view(vd, vl, &offsets)?, vl, quant, d)?);
            self.quantized(q, (t, hq, hkv, s, d), k, v, &mut out)?;
            return Ok((CpuStorage::F32(out), Shape::from((t, hq * d))));
        }
        if !self.prompt && t == 1 && decode_kernel(d) {
            let (lo, hi) = visible_keys(self.pos.query_start, s, self.pos, self.params.window);
            #[cfg(target_arch = "x86_64")]
            {
                use crate::cpu::decode_attn::{attend, DecodeCall};
                let (scale, softcap) = (self.params.scale, self.params.softcap);
                match (ks, vs) {
                    (CpuStorage::F32(kd), CpuStorage::F32(vd)) => {
                        let (k, v) = (self.view(kd, kl, &offsets)?, self.view(vd, vl, &offsets)?);
                        attend(&DecodeCall { q, k, v, hq, hkv, d, lo, hi, scale, softcap }, &mut out)
                    }
                    (CpuStorage::F16(kd), CpuStorage::F16(vd)) => {
                        let (k, v) = (self.view(kd, kl, &offsets)?, self.view(vd, vl, &offsets)?);
                        attend(&DecodeCall { q, k, v, hq, hkv, d, lo, hi, scale, softcap }, &mut out)
                    }
                    _ => candle_core::bail!("attention: k and v differ in dtype"),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lo, hi);
            return Ok((CpuStorage::F32(out), Shape::from((t, hq * d))));
        }
        if self.prompt || t >= TILED_MIN_TOKENS {
            let (pos, window) = (self.pos, self.params.window);
            let visible = move |i: usize| visible_keys(pos.query_start + i, s, pos, window);
            let call = Call {
                q,
                t,
                hq,
                hkv,
                s,
                d,
                scale: self.params.scale,
                softcap: self.params.softcap,
                visible: &visible,
            };
            match (ks, vs) {
                (CpuStorage::F32(kd), CpuStorage::F32(vd)) => attn::attend(level(), &call, self.view(kd, kl, &offsets)?, self.view(vd, vl, &offsets)?, &mut out),
                (CpuStorage::F16(kd), CpuStorage::F16(vd)) => attn::attend(level(), &call, self.view(kd, kl, &offsets)?, self.view(vd, vl, &offsets)?, &mut out),
                _ => candle_core::bail!("attention: k and v differ in dtype"),
            }
            return Ok((CpuStorage::F32(out), Shape::from((t, hq * d))));
        }
        let (CpuStorage::F32(kd), CpuStorage::F32(vd)) = (ks, vs) else { candle_core::bail!("attention: expected f32 kv") };
        let job = Job { q, k: self.view(kd, kl, &offsets)?, v: self.view(vd, vl, &offsets)?, hq, group: hq / hkv, s, d, op: self };
        let shared = SharedOut::new(&mut out);
        let worth = t * hq * s * d > 1 << 14;
        parallel_ranges(t * hq, 1, worth, |rows| {
            SCORES.with(|sc| {
                let mut sc = sc.borrow_mut();
                sc.resize(s, 0.0);
                attend_rows(level(), &job, rows, &mut sc, shared)
            })
        });
        Ok((CpuStorage::F32(out), Shape::from((t, hq * d))))
    }
}

impl AttendCpu<'_> {
    /// The rows of a cache's storage: through the block table when paged.
    fn view<'a, E>(&self, data: &'a [E], layout: &Layout, offsets: &'a [usize]) -> candle_core::Result<Kv<'a, E>> {
        match self.table {
            Some(table) => Ok(table.view(data, layout, offsets)),
            None => kv_view(data, layout),
        }
    }

    /// Quantized rows: one token on the decode kernel, else the tiled kernel (`attend_quantized`
    /// sends nothing else here).
    fn quantized<R: QuantizedRows>(&self, q: &[f32], (t, hq, hkv, s, d): (usize, usize, usize, usize, usize), k: R, v: R, out: &mut [f32]) -> candle_core::Result<()> {
        let (pos, window, scale, softcap) = (self.pos, self.params.window, self.params.scale, self.params.softcap);
        if !self.prompt && t == 1 && decode_kernel(d) {
            let (lo, hi) = visible_keys(pos.query_start, s, pos, window);
            #[cfg(target_arch = "x86_64")]
            crate::cpu::decode_attn::attend(&crate::cpu::decode_attn::DecodeCall { q, k, v, hq, hkv, d, lo, hi, scale, softcap }, out);
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lo, hi);
            return Ok(());
        }
        let visible = move |i: usize| visible_keys(pos.query_start + i, s, pos, window);
        let call = Call { q, t, hq, hkv, s, d, scale, softcap, visible: &visible };
        attn::attend(level(), &call, k, v, out);
        Ok(())
    }
}

/// Quantized rows both the decode kernel and the tiled kernel read (affine or TurboQuant).
#[cfg(target_arch = "x86_64")]
trait QuantizedRows: crate::cpu::kv_rows::WidenRows + crate::cpu::decode_attn::Rows {}
#[cfg(target_arch = "x86_64")]
impl<R: crate::cpu::kv_rows::WidenRows + crate::cpu::decode_attn::Rows> QuantizedRows for R {}
#[cfg(not(target_arch = "x86_64"))]
trait QuantizedRows: crate::cpu::kv_rows::WidenRows {}
#[cfg(not(target_arch = "x86_64"))]
impl<R: crate::cpu::kv_rows::WidenRows> QuantizedRows for R {}

/// Whether single-token attention with head size `d` runs on `cpu::decode_attn`.
fn decode_kernel(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::cpu::decode_attn::supports(d);
    #[cfg(not(target_arch = "x86_64"))]
    return {
        let _ = d;
        false
    };
}

/// A `[H, S, D]` view of cache storage with a contiguous last dimension.
fn kv_view<'a, E>(data: &'a [E], layout: &Layout) -> candle_core::Result<Kv<'a, E>> {
    let stride = layout.stride();
    if stride[2] != 1 {
        candle_core::bail!("attention: kv head_dim must be contiguous")
    }
    Ok(Kv::contiguous(&data[layout.start_offset()..], stride[0], stride[1]))
}

/// Rows of bytes (`[H, S, row_bytes]`, or a pool `[blocks, H, B, row_bytes]` through a table)
/// as quantized rows of head size `d`.
fn qkv_of<'a>(rows: Kv<'a, u8>, layout: &Layout, quant: KvQuant, d: usize) -> candle_core::Result<QKv<'a>> {
    let width = *layout.dims().last().unwrap_or(&0);
    if width != quant.row_bytes(d) {
        candle_core::bail!("attention: rows of {width} bytes are not {} rows of head size {d}", quant.name())
    }
    Ok(QKv { rows, quant, d })
}

/// From this many new tokens on, the tiled kernel (`cpu::attn`) runs; below, one query row at
/// a time.
const TILED_MIN_TOKENS: usize = 4;

thread_local! {
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Everything one attention call's rows need.
struct Job<'a> {
    q: &'a [f32],
    k: Kv<'a>,
    v: Kv<'a>,
    hq: usize,
    group: usize,
    s: usize,
    d: usize,
    op: &'a AttendCpu<'a>,
}

multiversion_plain!(fn attend_rows(job: &Job, rows: std::ops::Range<usize>, scores: &mut [f32], out: SharedOut) => attend_rows_impl);

/// Query rows `rows` (each a (token, head) pair): scores, softmax, weighted sum of values.
#[inline(always)]
fn attend_rows_impl<F: MulAdd>(job: &Job, rows: std::ops::Range<usize>, scores: &mut [f32], out: SharedOut) {
    let (d, p) = (job.d, &job.op.params);
    let mut acc = vec![0f32; d];
    let n = job.q.len() / d;
    for v in rows {
        let row = interleave_ends(v, n);
        let (i, h) = (row / job.hq, row % job.hq);
        let head = h / job.group;
        let (lo, hi) = visible_keys(job.op.pos.query_start + i, job.s, job.op.pos, p.window);
        let q = &job.q[row * d..(row + 1) * d];
        let mut max = f32::NEG_INFINITY;
        for j in lo..hi {
            let mut x = dot::<F>(q, job.k.row(head, j, d)) * p.scale;
            if let Some(cap) = p.softcap {
                x = (x / cap).tanh() * cap;
            }
            scores[j] = x;
            max = max.max(x);
        }
        let mut sum = 0f32;
        for x in &mut scores[lo..hi] {
            *x = math::exp(*x - max);
            sum += *x;
        }
        acc.fill(0.0);
        for j in lo..hi {
            let w = scores[j];
            for (a, v) in acc.iter_mut().zip(job.v.row(head, j, d)) {
                *a = F::mul_add(w, *v, *a);
            }
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for (c, a) in acc.iter().enumerate() {
            // SAFETY: each thread owns distinct rows of the output.
            unsafe { out.write(row * d + c, a * inv) };
        }
    }
}

/// Maps the v-th work item to a row, alternating from both ends (0, n-1, 1, n-2, …): under a
/// causal mask later rows see more keys, so any contiguous range of items then carries about
/// its share of the work and the threads finish together.
#[inline(always)]
fn interleave_ends(v: usize, n: usize) -> usize {
    if v % 2 == 0 {
        v / 2
    } else {
        n - 1 - v / 2
    }
}

#[inline(always)]
fn dot<F: MulAdd>(a: &[f32], b: &[f32]) -> f32 {
    // Sixteen independent accumulators: one vector register, no reassociation needed.
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..16 {
            acc[l] = F::mul_add(x[l], y[l], acc[l]);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        sum += x * y;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(t: usize, hq: usize, hkv: usize, s: usize, pos: Positions, window: Option<usize>) {
        check_d(16, t, hq, hkv, s, pos, window, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn check_d(d: usize, t: usize, hq: usize, hkv: usize, s: usize, pos: Positions, window: Option<usize>, softcap: Option<f32>) {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap();
        // A view into a larger buffer, as the KV cache provides.
        let kbuf = Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap();
        let vbuf = Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap();
        let (k, v) = (kbuf.narrow(1, 0, s).unwrap(), vbuf.narrow(1, 0, s).unwrap());
        let p = AttentionParams { scale: 0.25, window, softcap };
        let fused = attend(&q, &k, &v, pos, &p).unwrap();
        let generic = attend_generic(&q, &k, &v, pos, &p).unwrap();
        let diff = (fused - generic).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
        // An f16 cache (the CPU default): every kernel reads it as its exact f32 values.
        let (k16, v16) = (k.to_dtype(DType::F16).unwrap(), v.to_dtype(DType::F16).unwrap());
        let fused = attend(&q, &k16, &v16, pos, &p).unwrap();
        let widened = |x: &Tensor| x.to_dtype(DType::F32).unwrap();
        let generic = attend_generic(&q, &widened(&k16), &widened(&v16), pos, &p).unwrap();
        let diff = (fused - generic).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5, "f16 cache");
    }

    #[test]
    fn fused_equals_generic_for_prefill_decode_gqa_and_window() {
        check(7, 6, 2, 7, Positions { query_start: 0, key_start: 0 }, None);
        check(1, 9, 3, 20, Positions { query_start: 19, key_start: 0 }, None);
        check(4, 4, 1, 30, Positions { query_start: 26, key_start: 0 }, Some(8));
        check(3, 4, 4, 10, Positions { query_start: 40, key_start: 33 }, Some(6));
    }

    /// The decode kernel (`cpu::decode_attn`, one token, d a multiple of 64): groups of 1, 3 and
    /// 4 query heads per kv head, key ranges split over items, a window, soft-capping.
    #[test]
    fn decode_kernel_equals_generic() {
        check_d(64, 1, 9, 3, 300, Positions { query_start: 299, key_start: 0 }, None, None);
        check_d(128, 1, 8, 8, 40, Positions { query_start: 39, key_start: 0 }, None, None);
        check_d(256, 1, 4, 1, 700, Positions { query_start: 699, key_start: 0 }, Some(512), Some(30.0));
        check_d(64, 1, 14, 2, 1000, Positions { query_start: 1100, key_start: 101 }, Some(90), None);
    }

    /// Several sequences' decode tokens in one pass equal each one's `attend` bit for bit
    /// (different lengths, so different key splits; a window).
    #[test]
    fn decode_batch_equals_each_alone() {
        let dev = Device::Cpu;
        for window in [None, Some(100)] {
            let p = AttentionParams { scale: 0.125, window, softcap: None };
            let lens = [1, 70, 300, 1000, 129];
            let data: Vec<(Tensor, Tensor, Tensor)> = lens
                .iter()
                .map(|&s| {
                    let q = Tensor::randn(0f32, 1.0, (1, 8, 64), &dev).unwrap();
                    let kv = |_| Tensor::randn(0f32, 1.0, (2, s + 3, 64), &dev).unwrap().to_dtype(DType::F16).unwrap().narrow(1, 0, s).unwrap();
                    (q, kv(0), kv(1))
                })
                .collect();
            let queries: Vec<DecodeQuery> = data
                .iter()
                .zip(lens)
                .map(|((q, k, v), s)| DecodeQuery { q, k, v, quant: None, pos: Positions { query_start: s - 1, key_start: 0 } })
                .collect();
            let batch = attend_decode_batch(&queries, &p).unwrap();
            for (i, d) in queries.iter().enumerate() {
                let alone = attend(d.q, d.k, d.v, d.pos, &p).unwrap();
                let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&batch.narrow(0, i, 1).unwrap()), bits(&alone), "sequence {i}, window {window:?}");
            }
        }
    }

    /// Several rows of one sequence (a pending token and drafts) equal decoding them one at a
    /// time, each over the keys up to its own position, bit for bit.
    #[test]
    fn decode_rows_equal_one_at_a_time() {
        let dev = Device::Cpu;
        let (t, s) = (5, 300);
        let q = Tensor::randn(0f32, 1.0, (t, 8, 64), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, s, 64), &dev).unwrap().to_dtype(DType::F16).unwrap();
        let v = Tensor::randn(0f32, 1.0, (2, s, 64), &dev).unwrap().to_dtype(DType::F16).unwrap();
        let p = AttentionParams { scale: 0.125, window: None, softcap: None };
        let start = s - t;
        let pos = Positions { query_start: start, key_start: 0 };
        let q2 = Tensor::randn(0f32, 1.0, (1, 8, 64), &dev).unwrap();
        let batch = attend_decode_batch(&[DecodeQuery { q: &q, k: &k, v: &v, quant: None, pos }, DecodeQuery { q: &q2, k: &k, v: &v, quant: None, pos: Positions { query_start: s - 1, key_start: 0 } }], &p).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for r in 0..t {
            let keys = start + r + 1;
            let alone = attend(&q.narrow(0, r, 1).unwrap(), &k.narrow(1, 0, keys).unwrap(), &v.narrow(1, 0, keys).unwrap(), Positions { query_start: start + r, key_start: 0 }, &p).unwrap();
            assert_eq!(bits(&batch.narrow(0, r, 1).unwrap()), bits(&alone), "row {r}");
        }
        assert_eq!(batch.dims()[0], t + 1);
    }

    /// A prompt's attention is the same bits however it is cut into chunks: each chunk sees
    /// the keys up to its end, as the cache hands them out; a window and f16 keys included.
    #[test]
    fn prompt_attention_ignores_chunking() {
        let dev = Device::Cpu;
        let (t, hq, hkv, d) = (23, 6, 2, 64);
        let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (hkv, t, d), &dev).unwrap().to_dtype(DType::F16).unwrap();
        let v = Tensor::randn(0f32, 1.0, (hkv, t, d), &dev).unwrap().to_dtype(DType::F16).unwrap();
        for window in [None, Some(7)] {
            let p = AttentionParams { scale: 0.125, window, softcap: None };
            let run = |start: usize, len: usize| {
                let keys = |x: &Tensor| x.narrow(1, 0, start + len).unwrap();
                let pos = Positions { query_start: start, key_start: 0 };
                attend_prompt(&q.narrow(0, start, len).unwrap(), &keys(&k), &keys(&v), pos, &p).unwrap()
            };
            let whole: Vec<u32> = run(0, t).flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
            for cuts in [vec![1, 2, 20], vec![3, 4, 16], vec![9, 1, 13], vec![22, 1]] {
                let mut start = 0;
                let mut parts = Vec::new();
                for len in cuts {
                    parts.push(run(start, len));
                    start += len;
                }
                let chunked: Vec<u32> = Tensor::cat(&parts, 0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
                assert_eq!(whole, chunked, "window {window:?}");
            }
        }
    }

    /// The tiled prefill kernel (t ≥ TILED_MIN_TOKENS): head sizes that are and are not multiples
    /// of the panel width, query tiles cut by the causal mask and the window, a chunk after
    /// earlier cached keys, soft-capping.
    #[test]
    fn tiled_prefill_equals_generic() {
        check_d(64, 37, 9, 3, 37, Positions { query_start: 0, key_start: 0 }, None, None);
        check_d(64, 13, 9, 3, 50, Positions { query_start: 37, key_start: 0 }, None, None);
        check_d(256, 21, 4, 1, 21, Positions { query_start: 0, key_start: 0 }, Some(5), None);
        check_d(80, 40, 4, 2, 70, Positions { query_start: 60, key_start: 30 }, Some(17), Some(3.0));
        check_d(16, 4, 2, 2, 4, Positions { query_start: 0, key_start: 0 }, None, None);
    }
}
