//! Decode attention (one new token per sequence) on AVX-512, as flash-decoding: the work is cut
//! into (kv head, key range) items spread over the threads; each item runs all G query heads of
//! its group together over its keys, so every cached K and V row is read once per group instead
//! of once per query head, and the weighted sum of values keeps its accumulators in registers
//! (the per-row kernel kept them in memory, one store-to-load round trip per key, which made it
//! a fifth of a decode step). The items' partial results (max, sum, weighted values) are merged
//! at the end.
//!
//! Per value the arithmetic is the per-row kernel's in a different order: q·k as 16-lane FMA
//! chains over d then summed, scaled (and soft-capped), `math::exp`, the weighted values as one
//! FMA chain over the item's keys, combined over items with the usual rescaling. Cached rows
//! are f32 or f16 (the CPU cache's default, converted exactly to f32 on load), or quantized
//! (`kv_quant`), dequantized 16 values at a time in registers.

#![cfg(target_arch = "x86_64")]

use super::attn::Kv;
use super::kv_rows::QKv;
use super::math;
use super::threads::{num_threads, parallel_ranges};
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Query heads handled together in the value phase (4 heads × 4 vectors of 16 = 16 registers).
const HEADS_PER_PASS: usize = 4;
/// Columns of the value phase per pass: 4 vectors of 16.
const COLS: usize = 64;
/// An item takes at least this many keys (below, splitting costs more than it saves).
const MIN_KEYS_PER_ITEM: usize = 64;

/// A cached element type: f32, or f16 widened exactly on load.
pub trait Elem: Copy + Sync {
    /// Elements `p..p+16` as f32.
    ///
    /// # Safety
    /// AVX-512F (and F16C) available; 16 elements readable at `p`.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    unsafe fn load16(p: *const half::f16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// Cached rows read 16 values at a time into registers: float rows (`Kv`) or quantized rows
/// (`QKv`, dequantized in registers: codes widened, times the group's scale, plus its bias).
pub trait Rows: Copy + Sync {
    /// Where one (head, token) row starts.
    type Row: Copy;
    fn row_at(&self, head: usize, token: usize, d: usize) -> Self::Row;
    /// Values `col..col+16` of `row` as f32 (`col` a multiple of 16).
    ///
    /// # Safety
    /// AVX-512F (and F16C) available; `row` from `row_at` of a row that exists, `col + 16 ≤ d`.
    unsafe fn load16(&self, row: Self::Row, col: usize) -> __m512;

    /// Values `col..col+64` of `row` (the value phase's columns of one pass).
    ///
    /// # Safety
    /// As [`Rows::load16`], `col + 64 ≤ d`.
    #[inline(always)]
    unsafe fn load64(&self, row: Self::Row, col: usize) -> [__m512; 4] {
        [self.load16(row, col), self.load16(row, col + 16), self.load16(row, col + 32), self.load16(row, col + 48)]
    }

    /// What [`Rows::dot`] needs of a query beyond its values (quantized rows: its sum per group).
    fn prepare_query(&self, q: &[f32]) -> [f32; MAX_GROUPS] {
        let _ = q;
        [0.0; MAX_GROUPS]
    }

    /// Raw q·k of the query heads `q` (`[G, d]`) with keys `lo..lo + n` of kv head `h` into
    /// `out[g * n + j]` by a kernel made for these rows reading each row once for all G heads;
    /// false where there is none (then [`Rows::dot`] runs per head and key).
    fn dots_all_heads(&self, q: &[f32], h: usize, lo: usize, n: usize, out: &mut [f32]) -> bool {
        let _ = (q, h, lo, n, out);
        false
    }

    /// q·row over `d` values: one 16-lane FMA chain of q with the widened values, then summed.
    ///
    /// # Safety
    /// As [`Rows::load16`]; `d` values readable at `q`.
    #[inline(always)]
    unsafe fn dot(&self, row: Self::Row, q: *const f32, d: usize, prep: &[f32; MAX_GROUPS]) -> f32 {
        let _ = prep;
        let mut acc = _mm512_setzero_ps();
        for i in (0..d).step_by(16) {
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i)), self.load16(row, i), acc);
        }
        _mm512_reduce_add_ps(acc)
    }
}

/// Groups per row at most for [`Rows::prepare_query`] (head_dim 2048 in groups of 32).
pub const MAX_GROUPS: usize = 64;

impl QKv<'_> {
    /// Codes `col..col+16` of `row` as 16 i32 lanes.
    #[inline(always)]
    unsafe fn codes16(&self, row: *const u8, col: usize) -> __m512i {
        if self.quant.bits == 8 {
            _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(col) as *const __m128i))
        } else {
            // 4 bits: the 32-value block's 16 bytes; low nibbles are its first 16 values.
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(col / 32 * 16) as *const __m128i));
            if col % 32 == 0 {
                _mm512_and_si512(bytes, _mm512_set1_epi32(0xf))
            } else {
                _mm512_srli_epi32::<4>(bytes)
            }
        }
    }
}

impl<E: Elem> Rows for Kv<'_, E> {
    type Row = *const E;
    #[inline(always)]
    fn row_at(&self, head: usize, token: usize, d: usize) -> *const E {
        self.row(head, token, d).as_ptr()
    }
    #[inline(always)]
    unsafe fn load16(&self, row: *const E, col: usize) -> __m512 {
        E::load16(row.add(col))
    }
}

impl Rows for QKv<'_> {
    type Row = *const u8;

    /// Int8 query · codes on VNNI (`decode_q8`), unless activations are kept exact.
    fn dots_all_heads(&self, q: &[f32], h: usize, lo: usize, n: usize, out: &mut [f32]) -> bool {
        let run = super::decode_q8::wanted() && super::decode_q8::supports(self.d, q.len() / self.d);
        if run {
            super::decode_q8::dots(self, q, h, lo, n, out);
        }
        run
    }

    /// The query's sum over each group (the bias term of q·k is bias × that sum).
    fn prepare_query(&self, q: &[f32]) -> [f32; MAX_GROUPS] {
        let mut sums = [0f32; MAX_GROUPS];
        for (s, g) in sums.iter_mut().zip(q.chunks_exact(self.quant.group)) {
            *s = g.iter().sum();
        }
        sums
    }

    /// q·k of an affine row without widening it: per group, q·codes as a 16-lane FMA chain,
    /// then × scale into the running vector; the biases' share, Σ bias·Σq, added at the end.
    #[inline(always)]
    unsafe fn dot(&self, row: *const u8, q: *const f32, d: usize, prep: &[f32; MAX_GROUPS]) -> f32 {
        let quant = self.quant;
        let params = row.add(quant.code_bytes(d));
        let (mut acc, mut bias) = (_mm512_setzero_ps(), 0f32);
        for (g, sum) in prep.iter().enumerate().take(d / quant.group) {
            let mut codes_dot = _mm512_setzero_ps();
            for i in (g * quant.group..(g + 1) * quant.group).step_by(16) {
                codes_dot = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(i)), _mm512_cvtepi32_ps(self.codes16(row, i)), codes_dot);
            }
            let sb = _mm_cvtph_ps(_mm_cvtsi32_si128((params.add(4 * g) as *const i32).read_unaligned()));
            acc = _mm512_fmadd_ps(codes_dot, _mm512_broadcastss_ps(sb), acc);
            bias += _mm_cvtss_f32(_mm_movehdup_ps(sb)) * sum;
        }
        _mm512_reduce_add_ps(acc) + bias
    }
    #[inline(always)]
    fn row_at(&self, head: usize, token: usize, _d: usize) -> *const u8 {
        self.row(head, token).as_ptr()
    }
    /// The 64 values with each group's scale and bias widened once (not per 16 values), read
    /// as one fused multiply-add `code·scale + bias` (a rounding fewer than `dequantize_row`'s
    /// product then sum; this runs once per key row for all query heads of its kv head).
    #[inline(always)]
    unsafe fn load64(&self, row: *const u8, col: usize) -> [__m512; 4] {
        let q = self.quant;
        let params = row.add(q.code_bytes(self.d));
        let mut out = [_mm512_setzero_ps(); 4];
        let mut group = usize::MAX;
        let (mut scale, mut bias) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for (k, o) in out.iter_mut().enumerate() {
            let c = col + 16 * k;
            if c / q.group != group {
                group = c / q.group;
                let sb = _mm_cvtph_ps(_mm_cvtsi32_si128((params.add(4 * group) as *const i32).read_unaligned()));
                (scale, bias) = (_mm512_broadcastss_ps(sb), _mm512_broadcastss_ps(_mm_movehdup_ps(sb)));
            }
            *o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(self.codes16(row, c)), scale, bias);
        }
        out
    }

    #[inline(always)]
    unsafe fn load16(&self, row: *const u8, col: usize) -> __m512 {
        let q = self.quant;
        let codes = self.codes16(row, col);
        // Scale and bias (two f16) of the group holding `col`, widened together.
        let at = q.code_bytes(self.d) + col / q.group * 4;
        let sb = _mm_cvtph_ps(_mm_cvtsi32_si128((row.add(at) as *const i32).read_unaligned()));
        let (scale, bias) = (_mm512_broadcastss_ps(sb), _mm512_broadcastss_ps(_mm_movehdup_ps(sb)));
        _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(codes), scale), bias)
    }
}

/// One decode step's attention: q `[hq, d]`, keys `[lo, hi)` of k and v `[hkv, s, d]`.
pub struct DecodeCall<'a, R> {
    pub q: &'a [f32],
    pub k: R,
    pub v: R,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub lo: usize,
    pub hi: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
}

/// Whether [`attend`] runs a call with head size `d`: AVX-512 present, d a multiple of 64.
pub fn supports(d: usize) -> bool {
    super::simd::level() == super::simd::Level::Avx512 && d % COLS == 0
}

/// An item's result for one query head: running max, sum of weights, weighted values (`d`).
fn partial_len(d: usize) -> usize {
    2 + d
}

thread_local! {
    /// Per-thread scores of an item, `[G][keys]`.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's item results, `[item][G][partial_len]`, reused across calls.
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Writes the attention output `[hq·d]` of `c` into `out`. Callers check [`supports`] first.
pub fn attend<R: Rows>(c: &DecodeCall<R>, out: &mut [f32]) {
    attend_many(&[c], &mut [out])
}

/// The attention of several sequences' decode tokens (a batch), `outs[i]` for `calls[i]`, with
/// the items of all of them in one parallel pass. Each call is cut into the same items as
/// alone and merged alike, so its output is the bits [`attend`] gives it.
pub fn attend_many<R: Rows>(calls: &[&DecodeCall<R>], outs: &mut [&mut [f32]]) {
    assert_eq!(calls.len(), outs.len());
    let splits: Vec<Split> = calls.iter().map(|c| split(c)).collect();
    // Per call: its first item and the offset of its partial results.
    let (mut first_item, mut first_partial) = (Vec::with_capacity(calls.len()), Vec::with_capacity(calls.len()));
    let (mut items, mut len) = (0, 0);
    for (c, sp) in calls.iter().zip(&splits) {
        assert!(supports(c.d) && c.hq % c.hkv == 0);
        first_item.push(items);
        first_partial.push(len);
        items += c.hkv * sp.parts;
        len += sp.parts * c.hq * partial_len(c.d);
    }
    PARTIALS.with(|partials| {
        let mut partials = partials.borrow_mut();
        partials.resize(len, 0.0);
        run_items(calls, &splits, &first_item, &first_partial, &mut partials);
        for (i, (c, out)) in calls.iter().zip(outs.iter_mut()).enumerate() {
            assert_eq!(out.len(), c.hq * c.d);
            merge(c, splits[i].parts, &partials[first_partial[i]..], out);
        }
    })
}

/// How a call's keys are cut into items (depends only on the call and the thread count).
struct Split {
    parts: usize,
    per_part: usize,
}

fn split<R>(c: &DecodeCall<R>) -> Split {
    let keys = c.hi.saturating_sub(c.lo);
    let wanted = (2 * num_threads()).div_ceil(c.hkv);
    let parts = wanted.min(keys / MIN_KEYS_PER_ITEM).max(1);
    Split { parts, per_part: keys.div_ceil(parts) }
}

/// Every (call, kv head, key range) item into `partials`, over the threads.
fn run_items<R: Rows>(calls: &[&DecodeCall<R>], splits: &[Split], first_item: &[usize], first_partial: &[usize], partials: &mut [f32]) {
    let total: usize = calls.iter().zip(splits).map(|(c, s)| c.hkv * s.parts).sum();
    let work: usize = calls.iter().map(|c| c.hi.saturating_sub(c.lo) * c.hq * c.d).sum();
    let scratch = calls.iter().zip(splits).map(|(c, s)| c.hq / c.hkv * s.per_part).max().unwrap_or(0);
    let shared = super::threads::SharedOut::new(partials);
    parallel_ranges(total, 1, work > 1 << 14, |items| {
        SCORES.with(|sc| {
            let mut sc = sc.borrow_mut();
            sc.resize(scratch, 0.0);
            for item in items {
                let i = first_item.partition_point(|&f| f <= item) - 1;
                let (c, sp) = (calls[i], &splits[i]);
                let local = item - first_item[i];
                let (h, p) = (local / sp.parts, local % sp.parts);
                let lo = c.lo + p * sp.per_part;
                let hi = (lo + sp.per_part).min(c.hi);
                let (group, stride) = (c.hq / c.hkv, partial_len(c.d));
                // SAFETY: each item writes only its own `group * stride` values of `partials`.
                let dst = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(first_partial[i] + local * group * stride), group * stride) };
                if lo >= hi {
                    for g in 0..group {
                        dst[g * stride] = f32::NEG_INFINITY;
                        dst[g * stride + 1] = 0.0;
                    }
                    continue;
                }
                // SAFETY: `supports` checked AVX-512F; the rows indexed exist in k and v.
                unsafe { item_avx512(c, h, lo, hi, &mut sc, dst) };
            }
        })
    });
}

/// Combines the parts of every query head into `out`.
fn merge<R>(c: &DecodeCall<R>, parts: usize, partials: &[f32], out: &mut [f32]) {
    let (d, group, stride) = (c.d, c.hq / c.hkv, partial_len(c.d));
    for qh in 0..c.hq {
        let (h, g) = (qh / group, qh % group);
        let at = |p: usize| ((h * parts + p) * group + g) * stride;
        let m = (0..parts).map(|p| partials[at(p)]).fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[qh * d..(qh + 1) * d];
        o.fill(0.0);
        let mut sum = 0f32;
        for p in 0..parts {
            let pm = partials[at(p)];
            if pm == f32::NEG_INFINITY {
                continue;
            }
            let w = if parts == 1 { 1.0 } else { math::exp(pm - m) };
            sum += partials[at(p) + 1] * w;
            for (x, a) in o.iter_mut().zip(&partials[at(p) + 2..at(p) + 2 + d]) {
                *x += a * w;
            }
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// kv head `h` over keys `[lo, hi)`: for each of its G query heads, writes max, sum and the
/// (unnormalized) weighted values to `dst[g * (2 + d)..]`.
///
/// # Safety
/// AVX-512F is available; keys `[lo, hi)` of head `h` exist in `c.k` and `c.v`.
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn item_avx512<R: Rows>(c: &DecodeCall<R>, h: usize, lo: usize, hi: usize, scores: &mut [f32], dst: &mut [f32]) {
    let (d, group, n) = (c.d, c.hq / c.hkv, hi - lo);
    let stride = partial_len(d);
    let q = &c.q[h * group * d..(h + 1) * group * d];
    // Scores, each head's maximum.
    let dotted = c.k.dots_all_heads(q, h, lo, n, &mut scores[..group * n]);
    for g in 0..group {
        let qg = q[g * d..].as_ptr();
        let row = &mut scores[g * n..(g + 1) * n];
        let mut max = f32::NEG_INFINITY;
        let prep = if dotted { [0.0; MAX_GROUPS] } else { c.k.prepare_query(&q[g * d..(g + 1) * d]) };
        for (j, s) in row.iter_mut().enumerate() {
            let dot = if dotted { *s } else { c.k.dot(c.k.row_at(h, lo + j, d), qg, d, &prep) };
            let mut x = dot * c.scale;
            if let Some(cap) = c.softcap {
                x = (x / cap).tanh() * cap;
            }
            *s = x;
            max = max.max(x);
        }
        // Two loops: the exponentials vectorize only without the running sum beside them.
        for s in row.iter_mut() {
            *s = math::exp(*s - max);
        }
        dst[g * stride] = max;
        dst[g * stride + 1] = sum_lanes(row);
    }
    // Weighted values, HEADS_PER_PASS heads × COLS columns at a time.
    for g0 in (0..group).step_by(HEADS_PER_PASS) {
        for col in (0..d).step_by(COLS) {
            match (group - g0).min(HEADS_PER_PASS) {
                1 => values::<R, 1>(c, h, lo, n, g0, col, scores, dst),
                2 => values::<R, 2>(c, h, lo, n, g0, col, scores, dst),
                3 => values::<R, 3>(c, h, lo, n, g0, col, scores, dst),
                _ => values::<R, 4>(c, h, lo, n, g0, col, scores, dst),
            }
        }
    }
}

/// The sum of `x` in 16 lanes (vectorized; the order differs from a sequential sum).
#[inline(always)]
fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let rest: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// Σ_j p[g][j] · v[j][col..col+64] for heads g0..g0+G, accumulated in 4·G registers.
///
/// # Safety
/// As [`item_avx512`].
#[inline]
#[target_feature(enable = "avx512f,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn values<R: Rows, const G: usize>(c: &DecodeCall<R>, h: usize, lo: usize, n: usize, g0: usize, col: usize, p: &[f32], dst: &mut [f32]) {
    let d = c.d;
    let mut acc = [[_mm512_setzero_ps(); 4]; G];
    for j in 0..n {
        let vr = c.v.row_at(h, lo + j, d);
        let v = c.v.load64(vr, col);
        for (g, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*p.get_unchecked((g0 + g) * n + j));
            for (ai, vi) in a.iter_mut().zip(v) {
                *ai = _mm512_fmadd_ps(w, vi, *ai);
            }
        }
    }
    let stride = partial_len(d);
    for (g, a) in acc.iter().enumerate() {
        let o = dst[(g0 + g) * stride + 2 + col..].as_mut_ptr();
        for (i, ai) in a.iter().enumerate() {
            _mm512_storeu_ps(o.add(16 * i), *ai);
        }
    }
}
