//! Prefill attention as small GEMMs on the `micro` kernels: for a tile of MR query tokens of one
//! head, scores = Q·Kᵀ against 32-key panels of Kᵀ (packed once per call), a row softmax, then
//! P·V against packed V column panels. Each key and value is loaded once per tile instead of
//! once per query, and no horizontal reductions are needed. Decode (one query per head) runs on
//! `decode_attn`. Cached rows may be f16 (the CPU cache's default): packing widens them.
//!
//! Per output value the arithmetic is the per-row kernel's: q·k as one FMA chain over d, scaled
//! (and soft-capped) afterwards, `math::exp`, the weighted sum of values as one FMA chain over
//! keys in order, divided by the sum at the end.

use super::math;
use super::micro::{self, MicroKernel};
use super::simd::{multiversion_plain, Level, MulAdd};
use super::kv_rows::WidenRows;
use super::threads::{parallel_ranges, SharedOut};
use std::cell::RefCell;

/// A `[H, S, D]` view of cached keys or values (f32, or the CPU cache's f16) with a contiguous
/// last dimension and any head and token strides (the KV cache hands out a narrowed view of its
/// buffer). Every CPU attention kernel reads the cache through it.
///
/// Tokens sit in blocks of `1 << block_shift` tokens starting at the element offsets `blocks`
/// (a paged cache's block table, see `paged::BlockTable`); a contiguous view is one block
/// holding every token (`Kv::contiguous`), so both read through the same two instructions.
#[derive(Clone, Copy)]
pub struct Kv<'a, E = f32> {
    pub data: &'a [E],
    pub head_stride: usize,
    pub token_stride: usize,
    pub blocks: &'a [usize],
    pub block_shift: u32,
}

/// The block table of a contiguous view: one block at offset 0.
const ONE_BLOCK: &[usize] = &[0];

impl<'a, E> Kv<'a, E> {
    /// `[H, S, D]` rows at `data` with these strides, in one block.
    pub fn contiguous(data: &'a [E], head_stride: usize, token_stride: usize) -> Self {
        Self { data, head_stride, token_stride, blocks: ONE_BLOCK, block_shift: usize::BITS - 1 }
    }

    #[inline(always)]
    pub(crate) fn row(&self, head: usize, token: usize, d: usize) -> &[E] {
        let within = token & ((1usize << self.block_shift) - 1);
        let o = self.blocks[token >> self.block_shift] + head * self.head_stride + within * self.token_stride;
        &self.data[o..o + d]
    }

    /// Whether the rows sit in blocks of a paged cache's pool (not one contiguous block).
    pub(crate) fn is_paged(&self) -> bool {
        self.block_shift != usize::BITS - 1
    }

    /// The rows of `head` from `token` on that lie one after another (`token_stride` apart) in
    /// its block, at most `max` of them: their elements (the first row's start to the last
    /// row's end) and how many. The decode kernel walks a run without going back to the table
    /// (a contiguous view is one run).
    #[inline(always)]
    pub(crate) fn run(&self, head: usize, token: usize, d: usize, max: usize) -> (&[E], usize) {
        let within = token & ((1usize << self.block_shift) - 1);
        let n = ((1usize << self.block_shift) - within).min(max);
        let o = self.blocks[token >> self.block_shift] + head * self.head_stride + within * self.token_stride;
        (&self.data[o..o + (n.max(1) - 1) * self.token_stride + d], n)
    }
}

/// A cached element type, widened exactly to f32.
pub trait Widen: Copy + Sync {
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// One attention call: q `[t, hq, d]` over keys and values `[hkv, s, d]` (passed beside it),
/// output `[t, hq·d]`.
pub struct Call<'a> {
    pub q: &'a [f32],
    pub t: usize,
    pub hq: usize,
    pub hkv: usize,
    pub s: usize,
    pub d: usize,
    pub scale: f32,
    pub softcap: Option<f32>,
    /// The key range `[lo, hi)` visible to query token i.
    pub visible: &'a (dyn Fn(usize) -> (usize, usize) + Sync),
}

/// Runs `c` over keys `k` and values `v` into `out` (`t·hq·d` values).
pub fn attend<R: WidenRows>(level: Level, c: &Call, k: R, v: R, out: &mut [f32]) {
    assert_eq!(out.len(), c.t * c.hq * c.d);
    let packed = |nr| pack(c, k, v, nr);
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => run::<micro::Avx512>(level, c, packed(micro::Avx512::NR), out),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => run::<micro::Avx2>(level, c, packed(micro::Avx2::NR), out),
        _ => run::<micro::Portable>(level, c, packed(micro::Portable::NR), out),
    }
}

/// Kᵀ and V regrouped for the micro-kernel: `kt[head][panel][d][NR]` (keys zero-padded to
/// whole panels) and `vp[head][chunk][s_pad][NR]` (d zero-padded to whole NR-column chunks).
struct Packed {
    kt: Vec<f32>,
    vp: Vec<f32>,
    panels: usize,
    chunks: usize,
}

/// Packs for a micro-kernel of `nr` columns, widening f16 (or dequantizing quantized) rows on
/// the way.
fn pack<R: WidenRows>(c: &Call, k: R, v: R, nr: usize) -> Packed {
    let (d, s) = (c.d, c.s);
    let panels = s.div_ceil(nr);
    let chunks = d.div_ceil(nr);
    let s_pad = panels * nr;
    let mut kt = vec![0f32; c.hkv * panels * d * nr];
    let mut vp = vec![0f32; c.hkv * chunks * s_pad * nr];
    let (mut krow, mut vrow) = (vec![0f32; d], vec![0f32; d]);
    for h in 0..c.hkv {
        for j in 0..s {
            let (p, jj) = (j / nr, j % nr);
            let base = (h * panels + p) * d * nr + jj;
            k.widen_row(h, j, &mut krow);
            for (dd, x) in krow.iter().enumerate() {
                kt[base + dd * nr] = *x;
            }
            v.widen_row(h, j, &mut vrow);
            for ch in 0..chunks {
                let cols = (d - ch * nr).min(nr);
                let at = ((h * chunks + ch) * s_pad + j) * nr;
                vp[at..at + cols].copy_from_slice(&vrow[ch * nr..ch * nr + cols]);
            }
        }
    }
    Packed { kt, vp, panels, chunks }
}

struct Job<'a> {
    level: Level,
    c: &'a Call<'a>,
    packed: Packed,
    tiles: usize,
    out: SharedOut,
}

thread_local! {
    /// Per-thread scratch: the packed query tile, the tile's scores `[MR][s_pad]`, and the
    /// probabilities packed `[s_pad][MR]`.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

fn run<K: MicroKernel>(level: Level, c: &Call, packed: Packed, out: &mut [f32]) {
    let tiles = c.t.div_ceil(K::MR);
    let job = Job { level, c, packed, tiles, out: SharedOut::new(out) };
    let items = tiles * c.hq;
    let s_pad = job.packed.panels * K::NR;
    parallel_ranges(items, 1, true, |items| {
        SCRATCH.with(|s| {
            let (xq, scores, pt) = &mut *s.borrow_mut();
            xq.resize(c.d * K::MR, 0.0);
            scores.resize(K::MR * s_pad, 0.0);
            pt.resize(s_pad * K::MR, 0.0);
            tiles_of(level, &job, items, xq, scores, pt)
        })
    });
}

multiversion_plain!(fn tiles_of(job: &Job, items: std::ops::Range<usize>, xq: &mut [f32], scores: &mut [f32], pt: &mut [f32]) => tiles_impl);

#[inline(always)]
fn tiles_impl<F: MulAdd>(job: &Job, items: std::ops::Range<usize>, xq: &mut [f32], scores: &mut [f32], pt: &mut [f32]) {
    match job.level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => tiles_with::<F, micro::Avx512>(job, items, xq, scores, pt),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => tiles_with::<F, micro::Avx2>(job, items, xq, scores, pt),
        _ => tiles_with::<F, micro::Portable>(job, items, xq, scores, pt),
    }
}

/// Work items `items` (each a (query tile, head) pair, taken alternately from both ends of the
/// list so that causal work balances across threads).
#[inline(always)]
fn tiles_with<F: MulAdd, K: MicroKernel>(job: &Job, items: std::ops::Range<usize>, xq: &mut [f32], scores: &mut [f32], pt: &mut [f32]) {
    let c = job.c;
    let (mr, nr, d) = (K::MR, K::NR, c.d);
    let (panels, chunks) = (job.packed.panels, job.packed.chunks);
    let s_pad = panels * nr;
    let group = c.hq / c.hkv;
    let n = job.tiles * c.hq;
    let mut acc = [0f32; 256];
    for v in items {
        let item = if v % 2 == 0 { v / 2 } else { n - 1 - v / 2 };
        let (tile, h) = (item / c.hq, item % c.hq);
        let g = h / group;
        let i0 = tile * mr;
        let rows = (c.t - i0).min(mr);
        // The query tile, [d][MR], zero-padded.
        xq.fill(0.0);
        for r in 0..rows {
            let q = &c.q[((i0 + r) * c.hq + h) * d..((i0 + r) * c.hq + h + 1) * d];
            for (dd, x) in q.iter().enumerate() {
                xq[dd * mr + r] = *x;
            }
        }
        let ranges: [(usize, usize); 16] = std::array::from_fn(|r| if r < rows { (c.visible)(i0 + r) } else { (0, 0) });
        let lo = ranges[..rows].iter().map(|r| r.0).min().unwrap_or(0);
        let hi = ranges[..rows].iter().map(|r| r.1).max().unwrap_or(0);
        if lo >= hi {
            for r in 0..rows {
                for col in 0..d {
                    // SAFETY: each (token, head) row belongs to one work item.
                    unsafe { job.out.write((i0 + r) * c.hq * d + h * d + col, 0.0) };
                }
            }
            continue;
        }
        let (p0, p1) = (lo / nr, hi.div_ceil(nr));
        // Scores for every visible panel.
        for p in p0..p1 {
            let kt = &job.packed.kt[(g * panels + p) * d * nr..(g * panels + p + 1) * d * nr];
            // SAFETY: the level's features were detected; sizes match.
            unsafe { K::run(d, xq, kt, &mut acc) };
            for r in 0..rows {
                scores[r * s_pad + p * nr..r * s_pad + (p + 1) * nr].copy_from_slice(&acc[r * nr..(r + 1) * nr]);
            }
        }
        // Softmax per row over its own range; the rest of the union range weighs 0.
        let mut inv = [0f32; 16];
        for r in 0..rows {
            let (rlo, rhi) = ranges[r];
            let row = &mut scores[r * s_pad..(r + 1) * s_pad];
            row[p0 * nr..rlo.max(p0 * nr)].fill(0.0);
            row[rhi.max(rlo)..p1 * nr].fill(0.0);
            if rlo >= rhi {
                continue;
            }
            let vis = &mut row[rlo..rhi];
            for x in vis.iter_mut() {
                *x *= c.scale;
            }
            if let Some(cap) = c.softcap {
                for x in vis.iter_mut() {
                    *x = (*x / cap).tanh() * cap;
                }
            }
            let max = lanes(vis, f32::NEG_INFINITY, f32::max);
            for x in vis.iter_mut() {
                *x = math::exp(*x - max);
            }
            let sum = lanes(vis, 0.0, |a, b| a + b);
            inv[r] = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        }
        // Probabilities packed [key][MR] over the union panels.
        let base = p0 * nr;
        let len = (p1 - p0) * nr;
        for j in 0..len {
            for r in 0..mr {
                pt[j * mr + r] = if r < rows { scores[r * s_pad + base + j] } else { 0.0 };
            }
        }
        for ch in 0..chunks {
            let vp0 = ((g * chunks + ch) * s_pad + base) * nr;
            let vp = &job.packed.vp[vp0..vp0 + len * nr];
            // SAFETY: as above.
            unsafe { K::run(len, &pt[..len * mr], vp, &mut acc) };
            let cols = (d - ch * nr).min(nr);
            for r in 0..rows {
                let o = (i0 + r) * c.hq * d + h * d + ch * nr;
                for col in 0..cols {
                    // SAFETY: each (token, head) row belongs to one work item.
                    unsafe { job.out.write(o + col, acc[r * nr + col] * inv[r]) };
                }
            }
        }
    }
    let _ = std::marker::PhantomData::<F>;
}

/// Folds `v` with `f` in 16 independent lanes, then the lanes (so the loop vectorizes).
#[inline(always)]
fn lanes(v: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 16];
    let chunks = v.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..16 {
            acc[l] = f(acc[l], c[l]);
        }
    }
    for (l, x) in rest.iter().enumerate() {
        acc[l] = f(acc[l], *x);
    }
    acc.into_iter().fold(init, f)
}
