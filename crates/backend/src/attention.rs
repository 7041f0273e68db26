//! Scaled dot-product attention of new queries over a sequence's cached keys and values, with
//! causal and sliding-window masking and grouped-query heads. The fused CPU kernel never
//! materializes a mask or a score matrix; other devices use a composition of candle ops.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

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

/// q `[T, Hq, D]`, k and v `[Hkv, S, D]` → `[T, Hq·D]`.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: Positions,
    p: &AttentionParams,
) -> candle_core::Result<Tensor> {
    let (_, hq, _) = q.dims3()?;
    let (hkv, _, _) = k.dims3()?;
    if hq % hkv != 0 {
        candle_core::bail!("attention: {hq} query heads are not a multiple of {hkv} kv heads")
    }
    let all_f32 = [q, k, v].iter().all(|t| t.dtype() == DType::F32);
    if matches!(q.device(), Device::Cpu) && all_f32 {
        let q = q.contiguous()?;
        return q.apply_op3_no_bwd(k, v, &AttendCpu { pos, params: *p });
    }
    attend_generic(q, k, v, pos, p)
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
    let q = q
        .transpose(0, 1)?
        .contiguous()?
        .reshape((hkv, group * t, d))?;
    let mut scores = (q.matmul(&k.contiguous()?.t()?)?.to_dtype(DType::F32)? * p.scale as f64)?;
    if let Some(cap) = p.softcap {
        scores = ((scores / cap as f64)?.tanh()? * cap as f64)?;
    }
    let mask = build_mask(t, s, group, pos, p.window);
    let mask = Tensor::from_vec(mask, (group * t, s), q.device())?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let out = probs.to_dtype(dtype)?.matmul(&v.contiguous()?)?; // [hkv, group*t, d]
    out.reshape((hq, t, d))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, hq * d))
}

/// Range of key indices visible to the query at absolute position `qpos`.
fn visible_keys(qpos: usize, s: usize, pos: Positions, window: Option<usize>) -> (usize, usize) {
    let hi = (qpos + 1).saturating_sub(pos.key_start).min(s);
    let lo = match window {
        Some(w) => (qpos + 1)
            .saturating_sub(w)
            .saturating_sub(pos.key_start)
            .min(hi),
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

struct AttendCpu {
    pos: Positions,
    params: AttentionParams,
}

/// A `[H, S, D]` tensor view with a contiguous last dimension and arbitrary head/token strides
/// (the KV cache hands out a narrowed view of its buffer).
struct KvView<'a> {
    data: &'a [f32],
    head_stride: usize,
    token_stride: usize,
}

impl<'a> KvView<'a> {
    fn new(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<Self> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("attention: expected f32 kv")
        };
        let stride = layout.stride();
        if stride[2] != 1 {
            candle_core::bail!("attention: kv head_dim must be contiguous")
        }
        Ok(Self {
            data: &data[layout.start_offset()..],
            head_stride: stride[0],
            token_stride: stride[1],
        })
    }

    fn row(&self, head: usize, token: usize, d: usize) -> &[f32] {
        let o = head * self.head_stride + token * self.token_stride;
        &self.data[o..o + d]
    }
}

impl CustomOp3 for AttendCpu {
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
        let CpuStorage::F32(q) = qs else {
            candle_core::bail!("attention: expected f32 q")
        };
        let (t, hq, d) = ql.shape().dims3()?;
        let (hkv, s, _) = kl.shape().dims3()?;
        let q = &q[ql.start_offset()..ql.start_offset() + t * hq * d];
        let (k, v) = (KvView::new(ks, kl)?, KvView::new(vs, vl)?);
        let group = hq / hkv;
        let mut out = vec![0f32; t * hq * d];
        let work = |(row, o): (usize, &mut [f32])| {
            let (i, h) = (row / hq, row % hq);
            let (lo, hi) = visible_keys(self.pos.query_start + i, s, self.pos, self.params.window);
            let qrow = &q[row * d..(row + 1) * d];
            attend_one(qrow, &k, &v, h / group, lo..hi, &self.params, o);
        };
        if t * hq * s * d > 1 << 16 {
            out.par_chunks_mut(d).enumerate().for_each(work);
        } else {
            out.chunks_mut(d).enumerate().for_each(work);
        }
        Ok((CpuStorage::F32(out), Shape::from((t, hq * d))))
    }
}

/// One query row against keys `range` of one kv head, with an online softmax.
fn attend_one(
    q: &[f32],
    k: &KvView,
    v: &KvView,
    head: usize,
    range: std::ops::Range<usize>,
    p: &AttentionParams,
    out: &mut [f32],
) {
    let d = q.len();
    let mut max = f32::NEG_INFINITY;
    let mut denom = 0f32;
    out.fill(0.0);
    for j in range {
        let mut score = dot(q, k.row(head, j, d)) * p.scale;
        if let Some(cap) = p.softcap {
            score = (score / cap).tanh() * cap;
        }
        if score > max {
            let correction = (max - score).exp();
            denom *= correction;
            out.iter_mut().for_each(|o| *o *= correction);
            max = score;
        }
        let w = (score - max).exp();
        denom += w;
        axpy(w, v.row(head, j, d), out);
    }
    if denom > 0.0 {
        let inv = 1.0 / denom;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorize without reassociation limits.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[inline]
fn axpy(w: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += w * xi;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(t: usize, hq: usize, hkv: usize, s: usize, pos: Positions, window: Option<usize>) {
        let dev = Device::Cpu;
        let d = 16;
        let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap();
        // A view into a larger buffer, as the KV cache provides.
        let kbuf = Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap();
        let vbuf = Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap();
        let (k, v) = (kbuf.narrow(1, 0, s).unwrap(), vbuf.narrow(1, 0, s).unwrap());
        let p = AttentionParams {
            scale: 0.25,
            window,
            softcap: None,
        };
        let fused = attend(&q, &k, &v, pos, &p).unwrap();
        let generic = attend_generic(&q, &k, &v, pos, &p).unwrap();
        let diff = (fused - generic).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
    }

    #[test]
    fn fused_equals_generic_for_prefill_decode_gqa_and_window() {
        check(
            7,
            6,
            2,
            7,
            Positions {
                query_start: 0,
                key_start: 0,
            },
            None,
        );
        check(
            1,
            9,
            3,
            20,
            Positions {
                query_start: 19,
                key_start: 0,
            },
            None,
        );
        check(
            4,
            4,
            1,
            30,
            Positions {
                query_start: 26,
                key_start: 0,
            },
            Some(8),
        );
        check(
            3,
            4,
            4,
            10,
            Positions {
                query_start: 40,
                key_start: 33,
            },
            Some(6),
        );
    }
}
