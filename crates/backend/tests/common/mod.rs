//! What the quantized-KV attention tests share: TurboQuant caches of random rows and a float64
//! reference of attention over them.

#![allow(dead_code)]

use candle_core::{Device, Tensor};
use ferrolm_backend::attention::{attend_decode_batch, attend_quant, AttentionParams, DecodeQuery, Positions};
use ferrolm_backend::kv_quant::{turbo, KvQuant};

/// TurboQuant halves `k`, `v` (U8 `[hkv, s, half]`, cut from a longer cache as the cache hands
/// out a narrowed view) of random keys (off-centre, as keys are) and values.
pub fn turbo_kv(quant: KvQuant, hkv: usize, s: usize, d: usize) -> (Tensor, Tensor) {
    let dev = Device::Cpu;
    let keys = (Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap() + 0.7).unwrap();
    let values = Tensor::randn(0f32, 1.0, (hkv, s + 5, d), &dev).unwrap();
    let (k, v) = turbo::encode(quant, &keys, &values).unwrap();
    (k.narrow(1, 0, s).unwrap(), v.narrow(1, 0, s).unwrap())
}

/// The query's values as the int8 kernel multiplies them: per 32-value block d = max|q| / 127
/// (f32), q8 = round(q / d), read back as d·q8.
pub fn rounded_query(q: &[f32]) -> Vec<f64> {
    q.chunks_exact(32)
        .flat_map(|b| {
            let d = b.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            b.iter().map(move |x| if d > 0.0 { (x / d).round() as f64 * d as f64 } else { 0.0 })
        })
        .collect()
}

/// The normalized Walsh–Hadamard transform over blocks of `d`'s largest power-of-two divisor
/// (its own inverse).
pub fn fwht(x: &mut [f64]) {
    let n = 1 << x.len().trailing_zeros();
    for block in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (block[j], block[j + h]);
                    (block[j], block[j + h]) = (a + b, a - b);
                }
            }
            h *= 2;
        }
        block.iter_mut().for_each(|v| *v /= (n as f64).sqrt());
    }
}

/// A TurboQuant cache's rows of one kv head read in f64: per token its key (affine codes,
/// scales, biases) and its value decoded as the scheme says (centroid × the stored RMS, rotated
/// back, sign-flipped back).
pub struct TurboRef {
    pub quant: KvQuant,
    pub d: usize,
    /// `[hkv][s]` joined rows.
    rows: Vec<Vec<Vec<u8>>>,
}

impl TurboRef {
    pub fn new(quant: KvQuant, k: &Tensor, v: &Tensor, d: usize) -> Self {
        let (hkv, s, half) = k.dims3().unwrap();
        let bytes = |t: &Tensor| t.contiguous().unwrap().flatten_all().unwrap().to_vec1::<u8>().unwrap();
        let (kb, vb) = (bytes(k), bytes(v));
        let rows = (0..hkv)
            .map(|h| {
                (0..s)
                    .map(|t| {
                        let at = (h * s + t) * half;
                        [&kb[at..at + half], &vb[at..at + half]].concat()
                    })
                    .collect()
            })
            .collect();
        Self { quant, d, rows }
    }

    /// Σ_g scale_g·Σ q̃_i·code_i + bias_g·Σ q_i: q̃ the rounded query (`rounded`) or q itself.
    fn score(&self, q: &[f32], qt: &[f64], row: &[u8]) -> f64 {
        let (keys, d) = (self.quant.keys(), self.d);
        let mut dot = 0f64;
        for g in 0..d / keys.group {
            let (sc, bias) = keys.scale_bias(row, d, g);
            let idx = g * keys.group..(g + 1) * keys.group;
            let codes: f64 = idx.clone().map(|i| qt[i] * keys.code(row, i) as f64).sum();
            let qsum: f64 = idx.map(|i| q[i] as f64).sum();
            dot += sc as f64 * codes + bias as f64 * qsum;
        }
        dot
    }

    fn value(&self, row: &[u8]) -> Vec<f64> {
        let (d, bits) = (self.d, self.quant.turbo_values.unwrap());
        let value_row = &row[self.quant.row_bytes(d)..];
        let code_bytes = d * bits as usize / 8;
        let book = turbo::codebook(bits);
        let mut x: Vec<f64> = (0..d)
            .map(|i| {
                let at = code_bytes + i / turbo::GROUP * 2;
                let rms = half::f16::from_le_bytes([value_row[at], value_row[at + 1]]).to_f64();
                book[turbo::get_bits(&value_row[..code_bytes], bits, i) as usize] as f64 * rms
            })
            .collect();
        fwht(&mut x);
        x.iter_mut().enumerate().for_each(|(i, v)| *v *= turbo::sign(i) as f64);
        x
    }

    /// One query head `q` (`d` values) of kv head `h` over keys `keys`, scaled by `scale`.
    pub fn attend(&self, q: &[f32], h: usize, keys: std::ops::Range<usize>, scale: f64, rounded: bool) -> Vec<f64> {
        let qt: Vec<f64> = if rounded { rounded_query(q) } else { q.iter().map(|x| *x as f64).collect() };
        let rows = &self.rows[h][keys];
        let scores: Vec<f64> = rows.iter().map(|r| self.score(q, &qt, r) * scale).collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut out = vec![0f64; self.d];
        for (r, wt) in rows.iter().zip(&w) {
            for (o, x) in out.iter_mut().zip(self.value(r)) {
                *o += wt / total * x;
            }
        }
        out
    }

    /// Rows `[t, hq]` of queries `q` at positions `query_start + i` (causal, keys from 0,
    /// `window` as `AttentionParams`), flattened as the kernels' output `[t, hq·d]`.
    pub fn attend_rows(
        &self,
        q: &[f32],
        hq: usize,
        query_start: usize,
        window: Option<usize>,
        scale: f64,
        rounded: bool,
    ) -> Vec<f64> {
        let (d, hkv) = (self.d, self.rows.len());
        let s = self.rows[0].len();
        let mut out = Vec::new();
        for (i, row) in q.chunks_exact(hq * d).enumerate() {
            let pos = query_start + i;
            let hi = (pos + 1).min(s);
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w)).min(hi);
            for (qh, qv) in row.chunks_exact(d).enumerate() {
                out.extend(self.attend(qv, qh / (hq / hkv), lo..hi, scale, rounded));
            }
        }
        out
    }
}

/// The largest absolute difference between `ours` and `want`.
pub fn max_diff(ours: &Tensor, want: &[f64]) -> f64 {
    let ours = ours.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(ours.len(), want.len());
    ours.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max)
}

/// Decode rows of several sequences in one pass (`data`: each sequence's query, quantized k and
/// v, and cache length) equal each sequence alone, bit for bit.
pub fn assert_batch_equals_alone(data: &[(Tensor, Tensor, Tensor, usize)], quant: KvQuant) {
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    let queries: Vec<DecodeQuery> =
        data.iter().map(|(q, k, v, s)| DecodeQuery { q, k, v, quant: Some(quant), pos: Positions { query_start: s - 1, key_start: 0 } }).collect();
    let batch = attend_decode_batch(&queries, &p).unwrap();
    for (i, d) in queries.iter().enumerate() {
        let alone = attend_quant(d.q, d.k, d.v, d.quant, d.pos, &p).unwrap();
        assert_eq!(bits(&batch.narrow(0, i, 1).unwrap()), bits(&alone), "{} sequence {i}", quant.name());
    }
}
