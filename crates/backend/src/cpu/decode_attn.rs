//! Decode attention (one new token per sequence) on AVX-512, as flash-decoding: the work is cut
//! into (kv head, key range) items spread over the threads; each item runs all G query heads of
//! its group together over its keys, so every cached K and V row is read once per group instead
//! of once per query head, and the weighted sum of values keeps its accumulators in registers
//! (the per-row kernel kept them in memory, one store-to-load round trip per key, which made it
//! a fifth of a decode step). The items' partial results (max, sum, weighted values) are merged
//! at the end.
//!
//! A paged cache (`paged::BlockTable`) is read a block's run of rows at a time, and an item
//! takes several kv heads there, walking each block's heads together (see [`split`]); the
//! items' key ranges and every sum's order are the contiguous cache's, so the bits are too.
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
use std::ops::Range;

/// Query heads handled together in the value phase (4 heads × 4 vectors of 16 = 16 registers).
const HEADS_PER_PASS: usize = 4;
/// Columns of the value phase per pass: 4 vectors of 16.
const COLS: usize = 64;
/// An item takes at least this many keys (below, splitting costs more than it saves).
const MIN_KEYS_PER_ITEM: usize = 64;
/// Query heads of an item of several kv heads at most (their queries' `prepare_query` kept on
/// the stack).
const MAX_ITEM_QHEADS: usize = 16;

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
    /// Row (`head`, `token`) and how many rows from it on (at most `max`) lie one after another
    /// in its block, [`Rows::next_row`] apart: the kernel walks such a run without going back
    /// to a paged cache's block table (a contiguous cache is one run). By default a run is
    /// one row.
    #[inline(always)]
    fn run_at(&self, head: usize, token: usize, d: usize, max: usize) -> (Self::Row, usize) {
        (self.row_at(head, token, d), max.min(1))
    }
    /// The row after `row` in its run (not to be read past the run's end).
    #[inline(always)]
    fn next_row(&self, row: Self::Row) -> Self::Row {
        row
    }
    /// Whether a block holds every kv head's rows in one piece of memory (a paged cache's
    /// pool), so the kernel reads a block's heads together (see [`split`]).
    fn heads_interleaved(&self) -> bool {
        false
    }
    /// Asks for the cache lines of the first `lines` lines of the run of `run` rows at `row`
    /// (a hint; by default nothing).
    #[inline(always)]
    fn prefetch_run(&self, row: Self::Row, run: usize, lines: usize) {
        let _ = (row, run, lines);
    }
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
    fn run_at(&self, head: usize, token: usize, d: usize, max: usize) -> (*const E, usize) {
        let (rows, n) = self.run(head, token, d, max);
        (rows.as_ptr(), n)
    }
    #[inline(always)]
    fn next_row(&self, row: *const E) -> *const E {
        row.wrapping_add(self.token_stride)
    }
    fn heads_interleaved(&self) -> bool {
        self.is_paged()
    }
    #[inline(always)]
    fn prefetch_run(&self, row: *const E, run: usize, lines: usize) {
        prefetch_lines(row as *const i8, (run * self.token_stride * std::mem::size_of::<E>()).div_ceil(64).min(lines))
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
    #[inline(always)]
    fn run_at(&self, head: usize, token: usize, _d: usize, max: usize) -> (*const u8, usize) {
        let (rows, n) = self.rows.run(head, token, self.quant.row_bytes(self.d), max);
        (rows.as_ptr(), n)
    }
    #[inline(always)]
    fn next_row(&self, row: *const u8) -> *const u8 {
        row.wrapping_add(self.rows.token_stride)
    }
    fn heads_interleaved(&self) -> bool {
        self.rows.is_paged()
    }
    #[inline(always)]
    fn prefetch_run(&self, row: *const u8, run: usize, lines: usize) {
        prefetch_lines(row as *const i8, (run * self.rows.token_stride).div_ceil(64).min(lines))
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

/// Asks for `lines` cache lines from `p` on (a hint: never faults).
#[inline(always)]
fn prefetch_lines(p: *const i8, lines: usize) {
    for l in 0..lines {
        // SAFETY: a prefetch of any address is allowed (SSE, in every x86_64).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l)) };
    }
}

/// Cache lines of a head's next run asked for as [`walk`] enters its run before: enough to
/// start the hardware prefetcher on the next block wherever it lies (asking for the whole run
/// measured slower, docs/paged_kv.md).
const PF_LINES: usize = 4;

/// Calls `f(h, j, row, run)` for the runs of rows (keys `lo + j..lo + j + run`, first row
/// `row`) of kv heads `heads` over keys `lo..lo + n`: block by block, and in a block head by
/// head, so a paged cache's block (every head's rows, one piece of memory) is read as one
/// stream; a contiguous cache is one run per head, read head by head. Runs start at the same
/// keys in every head (blocks hold the same tokens for all heads). Before a run, the first
/// lines of the head's next run are asked for.
#[inline(always)]
fn walk<R: Rows>(rows: &R, heads: Range<usize>, (lo, n, d): (usize, usize, usize), mut f: impl FnMut(usize, usize, R::Row, usize)) {
    assert!(!heads.is_empty());
    let mut j = 0;
    while j < n {
        let mut run = 0;
        for h in heads.clone() {
            let (row, r) = rows.run_at(h, lo + j, d, n - j);
            if j + r < n {
                let (next, next_run) = rows.run_at(h, lo + j + r, d, n - j - r);
                rows.prefetch_run(next, next_run, PF_LINES);
            }
            f(h, j, row, r);
            run = r;
        }
        j += run;
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
    /// Per-thread scores of an item, `[kv heads][G][keys]`.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's item results, per call `[part][kv head][G][partial_len]`, reused
    /// across calls.
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
        items += sp.items(c.hkv);
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

/// How a call's keys are cut into parts (depends only on the call and the thread count: every
/// layout of the cache cuts alike, so gives the same bits) and its kv heads into items.
struct Split {
    parts: usize,
    per_part: usize,
    /// Kv heads per item.
    heads: usize,
}

impl Split {
    fn items(&self, hkv: usize) -> usize {
        self.parts * hkv.div_ceil(self.heads)
    }
}

/// A contiguous cache's items take one kv head each. A paged pool's block holds every kv
/// head's rows in one piece of memory, and walking one head's rows alone reads a run of it and
/// jumps, which streams from memory at half the bandwidth of reading the block whole
/// (docs/paged_kv.md): there an item takes as many kv heads as leave an item per thread, and
/// reads each block's heads together.
fn split<R: Rows>(c: &DecodeCall<R>) -> Split {
    let keys = c.hi.saturating_sub(c.lo);
    let wanted = (2 * num_threads()).div_ceil(c.hkv);
    let parts = wanted.min(keys / MIN_KEYS_PER_ITEM).max(1);
    let group = c.hq / c.hkv;
    let heads = match c.k.heads_interleaved() {
        true => c.hkv.div_ceil(num_threads().div_ceil(parts)).min(MAX_ITEM_QHEADS / group).max(1),
        false => 1,
    };
    Split { parts, per_part: keys.div_ceil(parts), heads }
}

/// Every (call, key range, kv heads) item into `partials`, over the threads.
fn run_items<R: Rows>(calls: &[&DecodeCall<R>], splits: &[Split], first_item: &[usize], first_partial: &[usize], partials: &mut [f32]) {
    let total: usize = calls.iter().zip(splits).map(|(c, s)| s.items(c.hkv)).sum();
    let work: usize = calls.iter().map(|c| c.hi.saturating_sub(c.lo) * c.hq * c.d).sum();
    let scratch = calls.iter().zip(splits).map(|(c, s)| s.heads * c.hq / c.hkv * s.per_part).max().unwrap_or(0);
    let shared = super::threads::SharedOut::new(partials);
    parallel_ranges(total, 1, work > 1 << 14, |items| {
        SCORES.with(|sc| {
            let mut sc = sc.borrow_mut();
            sc.resize(scratch, 0.0);
            for item in items {
                let i = first_item.partition_point(|&f| f <= item) - 1;
                let (c, sp) = (calls[i], &splits[i]);
                let local = item - first_item[i];
                let chunks = c.hkv.div_ceil(sp.heads);
                let (p, first_head) = (local / chunks, local % chunks * sp.heads);
                let heads = first_head..(first_head + sp.heads).min(c.hkv);
                let lo = c.lo + p * sp.per_part;
                let hi = (lo + sp.per_part).min(c.hi);
                let (group, stride) = (c.hq / c.hkv, partial_len(c.d));
                let (at, len) = ((p * c.hkv + first_head) * group * stride, heads.len() * group * stride);
                // SAFETY: each item writes only its own heads' values of its part of `partials`.
                let dst = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(first_partial[i] + at), len) };
                if lo >= hi {
                    for head in dst.chunks_exact_mut(stride) {
                        head[0] = f32::NEG_INFINITY;
                        head[1] = 0.0;
                    }
                    continue;
                }
                // SAFETY: `supports` checked AVX-512F; the rows indexed exist in k and v.
                unsafe { item_avx512(c, heads, lo, hi, &mut sc, dst) };
            }
        })
    });
}

/// Combines the parts of every query head into `out`.
fn merge<R>(c: &DecodeCall<R>, parts: usize, partials: &[f32], out: &mut [f32]) {
    let (d, group, stride) = (c.d, c.hq / c.hkv, partial_len(c.d));
    for qh in 0..c.hq {
        let (h, g) = (qh / group, qh % group);
        let at = |p: usize| ((p * c.hkv + h) * group + g) * stride;
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

/// kv heads `heads` over keys `[lo, hi)`: for each of their G query heads, writes max, sum and
/// the (unnormalized) weighted values to `dst[((h - heads.start) * G + g) * (2 + d)..]`.
///
/// # Safety
/// AVX-512F is available; keys `[lo, hi)` of `heads` exist in `c.k` and `c.v`.
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn item_avx512<R: Rows>(c: &DecodeCall<R>, heads: Range<usize>, lo: usize, hi: usize, scores: &mut [f32], dst: &mut [f32]) {
    let (d, group, n) = (c.d, c.hq / c.hkv, hi - lo);
    let stride = partial_len(d);
    let scores = &mut scores[..heads.len() * group * n];
    key_scores(c, heads.clone(), (lo, n), scores);
    // Each query head's scores: scaled, maximum, exponentials, sum.
    for (i, row) in scores.chunks_exact_mut(n).enumerate() {
        let mut max = f32::NEG_INFINITY;
        for s in row.iter_mut() {
            let mut x = *s * c.scale;
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
        dst[i * stride] = max;
        dst[i * stride + 1] = sum_lanes(row);
    }
    // Weighted values, HEADS_PER_PASS heads × COLS columns at a time.
    for g0 in (0..group).step_by(HEADS_PER_PASS) {
        for col in (0..d).step_by(COLS) {
            let heads = heads.clone();
            match (group - g0).min(HEADS_PER_PASS) {
                1 => values::<R, 1>(c, heads, (lo, n), g0, col, scores, dst),
                2 => values::<R, 2>(c, heads, (lo, n), g0, col, scores, dst),
                3 => values::<R, 3>(c, heads, (lo, n), g0, col, scores, dst),
                _ => values::<R, 4>(c, heads, (lo, n), g0, col, scores, dst),
            }
        }
    }
}

/// Raw q·k of the G query heads of each kv head of `heads` with keys `lo..lo + n` into
/// `scores[((h - heads.start) * G + g) * n + j]`: by the rows' own kernel for all G heads
/// ([`Rows::dots_all_heads`]) or one q·k at a time ([`Rows::dot`]) over each run.
///
/// # Safety
/// As [`item_avx512`].
#[inline(always)]
unsafe fn key_scores<R: Rows>(c: &DecodeCall<R>, heads: Range<usize>, (lo, n): (usize, usize), scores: &mut [f32]) {
    let (d, group, h0) = (c.d, c.hq / c.hkv, heads.start);
    let q_of = |h: usize| &c.q[h * group * d..(h + 1) * group * d];
    if c.k.dots_all_heads(q_of(h0), h0, lo, n, &mut scores[..group * n]) {
        for h in heads.start + 1..heads.end {
            c.k.dots_all_heads(q_of(h), h, lo, n, &mut scores[(h - h0) * group * n..(h - h0 + 1) * group * n]);
        }
        return;
    }
    let q = &c.q[h0 * group * d..heads.end * group * d];
    // The queries' `prepare_query`, made once where they fit the stack.
    let mut preps = [[0f32; MAX_GROUPS]; MAX_ITEM_QHEADS];
    let prepared = heads.len() * group <= MAX_ITEM_QHEADS;
    if prepared {
        for (prep, qh) in preps.iter_mut().zip(q.chunks_exact(d)) {
            *prep = c.k.prepare_query(qh);
        }
    }
    walk(&c.k, heads, (lo, n, d), |h, j0, first, run| {
        for g in 0..group {
            let i = (h - h0) * group + g;
            let fresh;
            let prep = match prepared {
                true => &preps[i],
                false => {
                    fresh = c.k.prepare_query(&q[i * d..(i + 1) * d]);
                    &fresh
                }
            };
            let mut row = first;
            for s in &mut scores[i * n + j0..i * n + j0 + run] {
                *s = c.k.dot(row, q[i * d..].as_ptr(), d, prep);
                row = c.k.next_row(row);
            }
        }
    });
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

/// Σ_j p[g][j] · v[j][col..col+64] for query heads g0..g0+G of each kv head of `heads`,
/// accumulated in 4·G registers over a run (kept in `dst` between a head's runs: the same
/// sums, in the same order, as over one run).
///
/// # Safety
/// As [`item_avx512`].
#[inline]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn values<R: Rows, const G: usize>(c: &DecodeCall<R>, heads: Range<usize>, (lo, n): (usize, usize), g0: usize, col: usize, p: &[f32], dst: &mut [f32]) {
    let (d, group, h0) = (c.d, c.hq / c.hkv, heads.start);
    let stride = partial_len(d);
    let out_at = |h: usize, g: usize| ((h - h0) * group + g0 + g) * stride + 2 + col;
    walk(&c.v, heads, (lo, n, d), |h, j0, first, run| {
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        if j0 > 0 {
            for (g, a) in acc.iter_mut().enumerate() {
                let o = dst.as_ptr().add(out_at(h, g));
                for (i, ai) in a.iter_mut().enumerate() {
                    *ai = _mm512_loadu_ps(o.add(16 * i));
                }
            }
        }
        let p = &p[((h - h0) * group + g0) * n..];
        let mut row = first;
        for j in j0..j0 + run {
            let v = c.v.load64(row, col);
            for (g, a) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.get_unchecked(g * n + j));
                for (ai, vi) in a.iter_mut().zip(v) {
                    *ai = _mm512_fmadd_ps(w, vi, *ai);
                }
            }
            row = c.v.next_row(row);
        }
        for (g, a) in acc.iter().enumerate() {
            let o = dst.as_mut_ptr().add(out_at(h, g));
            for (i, ai) in a.iter().enumerate() {
                _mm512_storeu_ps(o.add(16 * i), *ai);
            }
        }
    });
}
