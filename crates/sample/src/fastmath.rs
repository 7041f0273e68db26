//! Whole-vocabulary passes on the host: chunk maxima and chunk sums of `exp`.
//!
//! The vocabulary is cut into chunks of [`CHUNK`] logits. One pass records each chunk's maximum;
//! filters then visit only the chunks that can hold a candidate, so nothing sorts the vocabulary.
//! `exp` is a Cephes-style polynomial written so that LLVM vectorizes it: the std `expf` is a scalar
//! libm call and would cost ~1 ms per step at 262,144 tokens. The kernels are compiled three
//! times (AVX-512, AVX2+FMA, baseline) and picked at run time; they use no fused multiply-add, so
//! every build gives bit-identical results.
//!
//! Comparisons are written so that NaN falls on the "skip / zero" side, hence the negated ones.
#![allow(clippy::neg_cmp_op_on_partial_ord)]

/// Logits per chunk.
pub const CHUNK: usize = 64;
/// Lanes of the per-chunk accumulators (fixed, so reductions have one order on every CPU).
const LANES: usize = 16;
/// Chunks whose best logit is this many nats (after temperature) below the shift contribute less
/// than e^-64 each: they are skipped and count as zero.
pub const SKIP_NATS: f32 = 64.0;

const LN_MIN: f32 = -87.336_54; // ln(f32::MIN_POSITIVE)
const LOG2E: f32 = std::f32::consts::LOG2_E;
const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `e^t`, accurate to ~2 ulp for t in [-87.3, 88]; 0 below (so -inf maps to exactly 0).
#[inline(always)]
pub fn exp_f32(t: f32) -> f32 {
    // max/min, not clamp: NaN must become a finite value here.
    #[allow(clippy::manual_clamp)]
    let c = t.max(LN_MIN).min(88.0);
    let k = c * LOG2E + MAGIC;
    let n = k - MAGIC;
    let r = c - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // The low mantissa bits of `k` hold n; turn them into the exponent of 2^n.
    let e = (k.to_bits() as i32 - 0x4B40_0000 + 127) as u32;
    let v = y * f32::from_bits(e << 23);
    if t < LN_MIN {
        0.0
    } else {
        v
    }
}

/// The weight of logit `x`: `e^((x - shift) * scale)`. Every pass uses this exact expression.
#[inline(always)]
pub fn weight(x: f32, shift: f32, scale: f32) -> f32 {
    exp_f32((x - shift) * scale)
}

#[inline(always)]
fn reduce(mut acc: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for j in 0..w {
            acc[j] = op(acc[j], acc[j + w]);
        }
        w /= 2;
    }
    acc[0]
}

/// Maximum of a chunk; NaN is ignored.
#[inline(always)]
pub fn max_of(s: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut it = s.chunks_exact(LANES);
    for c in &mut it {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    for (j, &v) in it.remainder().iter().enumerate() {
        acc[j] = if v > acc[j] { v } else { acc[j] };
    }
    reduce(acc, |a, b| if b > a { b } else { a })
}

/// The weight of `x` if it is at least `floor` (NaN never is), else 0.
#[inline(always)]
pub fn weight_from(x: f32, shift: f32, scale: f32, floor: f32) -> f32 {
    let w = weight(x, shift, scale);
    if x >= floor {
        w
    } else {
        0.0
    }
}

/// Sum of the weights of a chunk's logits that are >= floor.
#[inline(always)]
pub fn sum_weights(s: &[f32], shift: f32, scale: f32, floor: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut it = s.chunks_exact(LANES);
    for c in &mut it {
        for j in 0..LANES {
            acc[j] += weight_from(c[j], shift, scale, floor);
        }
    }
    for (j, &v) in it.remainder().iter().enumerate() {
        acc[j] += weight_from(v, shift, scale, floor);
    }
    reduce(acc, |a, b| a + b)
}

/// Bit k set when logit k of a chunk (at most 64) is in [lo, hi]; branch-free, so scanning a
/// chunk costs no mispredictions.
#[inline(always)]
pub fn mask_between(s: &[f32], lo: f32, hi: f32) -> u64 {
    let mut m = 0u64;
    for (k, &x) in s.iter().enumerate().take(CHUNK) {
        m |= (((x >= lo) & (x <= hi)) as u64) << k;
    }
    m
}

/// Number of logits >= t in a chunk.
#[inline(always)]
pub fn count_at_least(s: &[f32], t: f32) -> usize {
    s.iter().map(|&x| (x >= t) as usize).sum()
}

/// Histogram of weights by distance below `max`, `per_nat` bins per nat, the last bin catching
/// everything further down (and NaN). Used to find the top-p cut without sorting.
pub struct Bins {
    pub max: f32,
    pub per_nat: f32,
    pub count: usize,
}

impl Bins {
    #[inline(always)]
    pub fn of(&self, x: f32) -> usize {
        let r = (self.max - x) * self.per_nat;
        let last = (self.count - 1) as f32;
        if r < last {
            r as usize
        } else {
            self.count - 1
        }
    }

    /// The largest logit a token in bin b can have (bins only get lower from there).
    pub fn top_of(&self, b: usize) -> f32 {
        self.max - b as f32 / self.per_nat
    }
}

#[inline(always)]
fn hist_chunk(s: &[f32], bins: &Bins, hist: &mut [f64]) {
    let mut w = [0f32; CHUNK];
    let mut b = [0u32; CHUNK];
    let n = s.len().min(CHUNK);
    for k in 0..n {
        w[k] = weight(s[k], bins.max, 1.0);
        b[k] = bins.of(s[k]) as u32;
    }
    // Four interleaved copies of the histogram break the store-to-load chains of repeated bins.
    for k in 0..n {
        hist[b[k] as usize * 4 + (k & 3)] += w[k] as f64;
    }
}

#[inline(always)]
fn maxima_generic(x: &[f32], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(x.chunks(CHUNK)) {
        *o = max_of(c);
    }
}

#[inline(always)]
fn sums_generic(x: &[f32], cmax: &[f32], shift: f32, scale: f32, floor: f32, out: &mut [f32]) {
    for ((o, c), &m) in out.iter_mut().zip(x.chunks(CHUNK)).zip(cmax) {
        *o = if skipped(m, shift, scale) || !(m >= floor) { 0.0 } else { sum_weights(c, shift, scale, floor) };
    }
}

/// Adds every chunk's weights into `hist`; `chunk(c)` gives chunk c's logits. Chunks entirely
/// in the last bin add `tail[c]` (their precomputed sum) instead of being visited.
#[inline(always)]
fn hist_generic<'a>(
    chunks: usize,
    chunk: &dyn Fn(usize) -> &'a [f32],
    cmax: &[f32],
    tail: &[f32],
    bins: &Bins,
    hist: &mut [f64],
) {
    for c in 0..chunks {
        if bins.of(cmax[c]) == bins.count - 1 {
            hist[(bins.count - 1) * 4] += tail[c] as f64;
        } else {
            hist_chunk(chunk(c), bins, hist);
        }
    }
}

/// Whether a chunk whose maximum is `m` is negligible (see [`SKIP_NATS`]).
#[inline(always)]
pub fn skipped(m: f32, shift: f32, scale: f32) -> bool {
    !((m - shift) * scale >= -SKIP_NATS)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f")]
    pub unsafe fn maxima_512(x: &[f32], out: &mut [f32]) {
        super::maxima_generic(x, out)
    }
    #[target_feature(enable = "avx2")]
    pub unsafe fn maxima_avx2(x: &[f32], out: &mut [f32]) {
        super::maxima_generic(x, out)
    }
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sums_512(x: &[f32], m: &[f32], sh: f32, sc: f32, fl: f32, out: &mut [f32]) {
        super::sums_generic(x, m, sh, sc, fl, out)
    }
    #[target_feature(enable = "avx2")]
    pub unsafe fn sums_avx2(x: &[f32], m: &[f32], sh: f32, sc: f32, fl: f32, out: &mut [f32]) {
        super::sums_generic(x, m, sh, sc, fl, out)
    }
    #[target_feature(enable = "avx512f")]
    pub unsafe fn hist_512<'a>(
        n: usize,
        chunk: &dyn Fn(usize) -> &'a [f32],
        cmax: &[f32],
        tail: &[f32],
        bins: &super::Bins,
        hist: &mut [f64],
    ) {
        super::hist_generic(n, chunk, cmax, tail, bins, hist)
    }
    #[target_feature(enable = "avx2")]
    pub unsafe fn hist_avx2<'a>(
        n: usize,
        chunk: &dyn Fn(usize) -> &'a [f32],
        cmax: &[f32],
        tail: &[f32],
        bins: &super::Bins,
        hist: &mut [f64],
    ) {
        super::hist_generic(n, chunk, cmax, tail, bins, hist)
    }
}

/// Number of chunks covering `n` logits.
pub fn chunk_count(n: usize) -> usize {
    n.div_ceil(CHUNK)
}

/// `out[c]` = maximum of chunk c of `x`.
pub fn chunk_maxima(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.resize(chunk_count(x.len()), f32::NEG_INFINITY);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: each call is guarded by detection of the feature it was compiled for.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { x86::maxima_512(x, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return unsafe { x86::maxima_avx2(x, out) };
        }
    }
    maxima_generic(x, out)
}

/// `out[c]` = Σ weight(x, shift, scale) over the logits >= floor of chunk c, or 0 where the
/// chunk is skipped.
pub fn chunk_sums(x: &[f32], cmax: &[f32], shift: f32, scale: f32, floor: f32, out: &mut Vec<f32>) {
    out.clear();
    out.resize(cmax.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in `chunk_maxima`.
        if std::arch::is_x86_feature_detected!("avx512f") {
            return unsafe { x86::sums_512(x, cmax, shift, scale, floor, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return unsafe { x86::sums_avx2(x, cmax, shift, scale, floor, out) };
        }
    }
    sums_generic(x, cmax, shift, scale, floor, out)
}

/// Histogram of e^(x - max) over all chunks (see [`Bins`]); `tail[c]` is chunk c's weight sum.
pub fn histogram<'a>(
    chunks: usize,
    chunk: &dyn Fn(usize) -> &'a [f32],
    cmax: &[f32],
    tail: &[f32],
    bins: &Bins,
) -> Vec<f64> {
    let mut hist = vec![0f64; bins.count * 4];
    let fold = |h: Vec<f64>| h.chunks_exact(4).map(|q| (q[0] + q[1]) + (q[2] + q[3])).collect();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as in `chunk_maxima`.
        if std::arch::is_x86_feature_detected!("avx512f") {
            unsafe { x86::hist_512(chunks, chunk, cmax, tail, bins, &mut hist) };
            return fold(hist);
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            unsafe { x86::hist_avx2(chunks, chunk, cmax, tail, bins, &mut hist) };
            return fold(hist);
        }
    }
    hist_generic(chunks, chunk, cmax, tail, bins, &mut hist);
    fold(hist)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_within_few_ulp() {
        let mut worst = 0f64;
        let mut t = -87.0f32;
        while t <= 10.0 {
            let want = (t as f64).exp();
            let got = exp_f32(t) as f64;
            worst = worst.max(((got - want) / want).abs());
            t += 0.00731;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_finite());
    }

    #[test]
    fn passes_match_scalar_reference() {
        let x: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 * 0.01 - 5.0).collect();
        let mut m = Vec::new();
        chunk_maxima(&x, &mut m);
        assert_eq!(m.len(), 16);
        for (c, chunk) in x.chunks(CHUNK).enumerate() {
            assert_eq!(m[c], chunk.iter().cloned().fold(f32::NEG_INFINITY, f32::max));
        }
        let mut s = Vec::new();
        chunk_sums(&x, &m, 5.0, 0.5, f32::NEG_INFINITY, &mut s);
        let mut fallback = vec![0.0; m.len()];
        sums_generic(&x, &m, 5.0, 0.5, f32::NEG_INFINITY, &mut fallback);
        assert_eq!(s, fallback, "vector and baseline builds must agree bit for bit");
        let total: f64 = s.iter().map(|&v| v as f64).sum();
        let want: f64 = x.iter().map(|&v| ((v as f64 - 5.0) * 0.5).exp()).sum();
        assert!((total - want).abs() / want < 1e-6);
    }
}
