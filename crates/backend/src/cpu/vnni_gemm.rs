//! Prefill with 8-bit activations on AVX-512 VNNI: `vnni::gemv` for several tokens at once.
//! Every activation row is quantized once per product (`vnni::quantize_strided`), then tiles of
//! 4 weight rows × up to 16 tokens are computed in registers: each weight pair is loaded,
//! unpacked and transposed once per tile (`transpose4`) and multiplied by every token's
//! activations with four chained `vpdpbusd`, which leave each row's integer sum in its own
//! lanes before the f32 scaling (`tile`).
//!
//! Per output the integer sums are `gemv`'s; only the order of the f32 additions differs
//! (chunks of 16 values are summed in integers first), so prefill and decode agree to f32
//! rounding for the same token.

#![cfg(target_arch = "x86_64")]

use super::vnni::{scale_index, Layout, QPair, Vnni};
use std::arch::x86_64::*;

/// Tokens per block: a block's quantized activations (320 bytes per 64 values) stay in L2
/// while every weight row of the thread passes over them.
const TOKEN_BLOCK: usize = 32;
const _: () = assert!(TOKEN_BLOCK % TOKENS == 0);

/// Tokens per group of the activation layout and per register tile (with 4 weight rows): 16
/// accumulators, so that each pair's weight unpacking serves 16 tokens.
pub const TOKENS: usize = 16;

/// Where pair p of token `tok` sits in the activations `gemm` reads: tokens in groups of
/// `TOKENS`, each group's pairs interleaved (`[group][pair][token in group]`), so that a tile
/// reads its tokens' pairs from consecutive memory.
#[inline(always)]
pub fn pair_index(tok: usize, p: usize, pairs: usize) -> usize {
    ((tok / TOKENS) * pairs + p) * TOKENS + tok % TOKENS
}

/// Pairs to allocate for `t` tokens of `pairs` pairs (whole groups).
pub fn pairs_len(t: usize, pairs: usize) -> usize {
    t.div_ceil(TOKENS) * TOKENS * pairs
}

/// Output `y[tok·ld + r]` for rows `rows` of `w` and all `t` tokens of `xq` (`t` tokens of
/// `cols.div_ceil(64)` pairs, quantized for `V` and laid out by `pair_index`).
///
/// # Safety
/// `vnni::available()`; `w` holds whole rows of `cols / N` blocks; `y` is valid for writes at
/// every `tok·ld + r` (tok < t, r in rows) and no other thread writes those.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn gemm<V: Vnni>(w: &[u8], cols: usize, xq: &[QPair], t: usize, rows: std::ops::Range<usize>, y: *mut f32, ld: usize) {
    assert!(cols % V::N == 0 && (V::N == 32 || V::N % 64 == 0));
    let row_bytes = cols / V::N * V::BYTES;
    let pairs = cols.div_ceil(64);
    assert!(w.len() >= rows.end * row_bytes && xq.len() >= pairs_len(t, pairs));
    let shape = Shape { row_bytes, pairs, odd: cols % 64 == 32 };
    let mut t0 = 0;
    while t0 < t {
        let t1 = (t0 + TOKEN_BLOCK).min(t);
        let mut r = rows.start;
        while r < rows.end {
            let nr = (rows.end - r).min(4);
            let mut j = t0;
            while j < t1 {
                let nt = (t1 - j).min(TOKENS);
                let wr = w.as_ptr().add(r * row_bytes);
                let xj = xq.as_ptr().add(pair_index(j, 0, pairs));
                let out = y.add(j * ld + r);
                tile_of::<V>(nt, wr, nr, xj, &shape, out, ld);
                j += nt;
            }
            r += nr;
        }
        t0 = t1;
    }
}

/// `tile` for `nt` tokens (1..=TOKENS), each count its own instance.
#[inline(always)]
unsafe fn tile_of<V: Vnni>(nt: usize, w: *const u8, nr: usize, xq: *const QPair, s: &Shape, y: *mut f32, ld: usize) {
    macro_rules! by_count {
        ($($m:literal)*) => {
            match nt {
                $($m => tile::<V, $m>(w, nr, xq, s, y, ld),)*
                _ => unreachable!("tile of {nt} tokens"),
            }
        };
    }
    by_count!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

struct Shape {
    row_bytes: usize,
    pairs: usize,
    /// An odd number of 32-blocks (N = 32 formats): the last pair has one block.
    odd: bool,
}

/// 4 rows at `w` (row stride `row_bytes`; only the first `nr` are written, the others repeat
/// the last valid row) × M ≤ TOKENS tokens of the token group at `xq`, written to
/// `y[j·ld + i]`.
///
/// The four rows' quants are transposed once per pair (`transpose4`) so that, per token, lane i
/// of each 128-bit chunk accumulates row i's integer sum over that chunk (the chunk's 16 values
/// share one activation and one weight scale) before anything is converted to f32: one
/// conversion, one scale product and one FMA serve four rows.
#[inline(always)]
unsafe fn tile<V: Vnni, const M: usize>(w: *const u8, nr: usize, xq: *const QPair, s: &Shape, y: *mut f32, ld: usize) {
    let mut acc = [_mm512_setzero_ps(); M];
    // Lane l of the activations' `[0, s0, 0, s1]` → lane l of the min terms' s.
    let s_index = _mm512_add_epi32(scale_index(V::LAYOUT), _mm512_set1_epi32(1));
    let per_block = (V::N / 64).max(1);
    let mut scales = [_mm512_setzero_ps(); 4];
    for p in 0..s.pairs {
        let mut wq = [_mm512_setzero_si512(); 4];
        let mut dw = [_mm512_setzero_ps(); 4];
        let mut dm = [_mm_setzero_ps(); 4];
        for i in 0..4 {
            let row = w.add(i.min(nr - 1) * s.row_bytes);
            let (q, d, m) = if V::N == 32 {
                V::load_pair(row.add(2 * p * V::BYTES), 0, !(s.odd && p + 1 == s.pairs))
            } else {
                let (blk, at) = (row.add(p / per_block * V::BYTES), p % per_block);
                if at == 0 {
                    scales[i] = V::block_scales(blk);
                }
                V::load_pair_scaled(blk, at, true, scales[i])
            };
            wq[i] = q;
            dw[i] = d;
            dm[i] = m;
        }
        let mins = if V::MIN { min_terms::<V>(dm) } else { _mm512_setzero_ps() };
        // Lane i of chunk k: row i's weight scale of chunk k.
        let dw4 = _mm512_castpd_ps(_mm512_unpacklo_pd(
            _mm512_castps_pd(_mm512_unpacklo_ps(dw[0], dw[1])),
            _mm512_castps_pd(_mm512_unpacklo_ps(dw[2], dw[3])),
        ));
        let wt = transpose4(wq);
        for j in 0..M {
            let x = &*xq.add(p * TOKENS + j);
            let xv = _mm512_load_si512(x.q.as_ptr() as *const _);
            // Lane i of chunk c: Σ over the chunk's four groups g of row i's group g · x's.
            let mut u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wt[0], _mm512_shuffle_epi32::<0x00>(xv));
            u = _mm512_dpbusd_epi32(u, wt[1], _mm512_shuffle_epi32::<0x55>(xv));
            u = _mm512_dpbusd_epi32(u, wt[2], _mm512_shuffle_epi32::<0xaa>(xv));
            u = _mm512_dpbusd_epi32(u, wt[3], _mm512_shuffle_epi32::<0xff>(xv));
            if V::OFFSET != 0 {
                u = _mm512_add_epi32(u, _mm512_load_si512(x.corr4.as_ptr() as *const _));
            }
            let scale = _mm512_mul_ps(dw4, _mm512_load_ps(x.dx.as_ptr()));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scale, acc[j]);
            if V::MIN {
                let sx = _mm512_permutexvar_ps(s_index, _mm512_castps128_ps512(_mm_load_ps(x.s.as_ptr())));
                acc[j] = _mm512_fmadd_ps(mins, sx, acc[j]);
            }
        }
    }
    for j in 0..M {
        let a = acc[j];
        let lo = _mm_add_ps(_mm512_extractf32x4_ps::<0>(a), _mm512_extractf32x4_ps::<1>(a));
        let hi = _mm_add_ps(_mm512_extractf32x4_ps::<2>(a), _mm512_extractf32x4_ps::<3>(a));
        // A masked store: a loop over `nr` values became a call to memcpy per token.
        _mm_mask_storeu_ps(y.add(j * ld), (1u8 << nr.min(4)) - 1, _mm_add_ps(lo, hi));
    }
}

/// Four rows' 64 quants → `t[j]`: lane i of 128-bit chunk c holds row i's four quants of
/// group (dword) j of chunk c. A `vpdpbusd` of `t[j]` against the activations' dword j of
/// each chunk (`_mm512_shuffle_epi32`) then adds row i's four products of that group into lane
/// i, so four chained `vpdpbusd` leave lane i of chunk c = row i's integer sum over chunk c
/// with no reduction across lanes.
#[inline(always)]
unsafe fn transpose4(w: [__m512i; 4]) -> [__m512i; 4] {
    let ab_lo = _mm512_unpacklo_epi32(w[0], w[1]); // a0 b0 a1 b1
    let ab_hi = _mm512_unpackhi_epi32(w[0], w[1]); // a2 b2 a3 b3
    let cd_lo = _mm512_unpacklo_epi32(w[2], w[3]);
    let cd_hi = _mm512_unpackhi_epi32(w[2], w[3]);
    [
        _mm512_unpacklo_epi64(ab_lo, cd_lo),
        _mm512_unpackhi_epi64(ab_lo, cd_lo),
        _mm512_unpacklo_epi64(ab_hi, cd_hi),
        _mm512_unpackhi_epi64(ab_hi, cd_hi),
    ]
}

/// The four rows' min terms `[_, m0, _, m1]` (w = d·q + m per 32-value block) laid out like
/// the accumulators: lane i of the first chunk of block b holds row i's m_b, every other lane
/// 0. Multiplied by each lane's s = d_x·Σq_x of its block, they add m·s to the same
/// accumulator, so formats with a min need no second one.
#[inline(always)]
unsafe fn min_terms<V: Vnni>(dm: [__m128; 4]) -> __m512 {
    let (lo01, lo23) = (_mm_unpacklo_ps(dm[0], dm[1]), _mm_unpacklo_ps(dm[2], dm[3]));
    let (hi01, hi23) = (_mm_unpackhi_ps(dm[0], dm[1]), _mm_unpackhi_ps(dm[2], dm[3]));
    let m0 = _mm_movehl_ps(lo23, lo01); // rows 0–3's m0
    let m1 = _mm_movehl_ps(hi23, hi01);
    let v = _mm512_castps128_ps512(m0);
    match V::LAYOUT {
        // Block 1 starts at chunk 2 (Natural) or 1 (Nibbles).
        Layout::Natural => _mm512_insertf32x4::<2>(_mm512_insertf32x4::<1>(v, _mm_setzero_ps()), m1),
        Layout::Nibbles => _mm512_insertf32x4::<2>(_mm512_insertf32x4::<1>(v, m1), _mm_setzero_ps()),
    }
}

/// The `t` token rows of `x` quantized for `V` in `gemm`'s layout (tests and measurements).
#[cfg(test)]
pub(super) fn quantize_tokens<V: Vnni>(x: &[f32], t: usize, cols: usize) -> Vec<QPair> {
    let pairs = cols.div_ceil(64);
    let mut xq = vec![QPair::ZERO; pairs_len(t, pairs)];
    for (tok, xr) in x.chunks_exact(cols).take(t).enumerate() {
        // SAFETY: callers check `vnni::available()`; the token's pairs lie inside `xq`.
        unsafe { super::vnni::quantize_strided::<V>(xr, xq.as_mut_ptr().add(pair_index(tok, 0, pairs)), TOKENS) };
    }
    xq
}

#[cfg(test)]
mod tests {
    use super::super::formats;
    use super::super::vnni::{available, gemv, quantize};
    use super::*;

    /// Every (token, row) equals `gemv` of that token up to f32 summation order (the integer
    /// sums are the same), over tile edges in both directions (rows and tokens not multiples of
    /// the tile, more tokens than a token block).
    fn check<V: Vnni>(cols: usize) {
        if !available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        let (rows, t) = (11, 70);
        let mut rnd = super::super::vnni::tests::uniform(0x2545f4914f6cdd1d);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..t * cols).map(|i| rnd() * if i % 7 == 0 { 5.0 } else { 1.0 }).collect();
        let w = super::super::vnni::tests::quantize_rows::<V>(&wf, rows, cols);
        let mut wd = vec![0f32; rows * cols];
        for (blk, o) in w.chunks_exact(V::BYTES).zip(wd.chunks_exact_mut(V::N)) {
            V::dequant(blk, o);
        }
        let xq = quantize_tokens::<V>(&x, t, cols);
        let mut got = vec![0f32; t * rows];
        // SAFETY: VNNI was detected above; sizes match.
        unsafe {
            gemm::<V>(&w, cols, &xq, t, 0..rows, got.as_mut_ptr(), rows);
        }
        for tok in 0..t {
            let mut one = Vec::new();
            let mut want = vec![0f32; rows];
            // SAFETY: as above.
            unsafe {
                quantize::<V>(&x[tok * cols..(tok + 1) * cols], &mut one);
                gemv::<V>(&w, cols, &one, 0..rows, &mut |r, v| want[r] = v);
            }
            for r in 0..rows {
                let (g, w_) = (got[tok * rows + r], want[r]);
                let abs: f32 = wd[r * cols..(r + 1) * cols].iter().zip(&x[tok * cols..]).map(|(a, b)| (a * b).abs()).sum();
                assert!((g - w_).abs() <= 1e-5 * abs, "token {tok} row {r}: {g} vs {w_} (Σ|w·x| {abs})");
            }
        }
    }

    #[test]
    fn gemm_equals_gemv() {
        check::<formats::Q4_0>(576);
        check::<formats::Q4_1>(576);
        check::<formats::Q4_1>(96);
        check::<formats::Q5_0>(96);
        check::<formats::Q5_1>(576);
        check::<formats::Q8_0>(576);
        check::<formats::Q8_0>(96);
        check::<formats::Q4K>(512);
        check::<formats::Q6K>(768);
    }
}

#[cfg(test)]
mod speed {
    use super::super::formats;
    use super::super::vnni::available;
    use super::*;

    fn rate<V: Vnni>(name: &str, rows: usize, cols: usize) {
        rate_with::<V, V>(name, rows, cols, |w| w);
    }

    fn rate_packed<R: super::super::vnni_packed::Repacked>(name: &str, rows: usize, cols: usize) {
        rate_with::<R::Source, R>(name, rows, cols, |w| unsafe { super::super::vnni_packed::pack::<R>(&w, rows, cols, &|_| {}) }.unwrap().bytes().to_vec());
    }

    fn rate_with<S: Vnni, V: Vnni>(name: &str, rows: usize, cols: usize, prep: impl Fn(Vec<u8>) -> Vec<u8>) {
        let t = 512;
        let mut rnd = super::super::vnni::tests::uniform(7);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..t * cols).map(|_| rnd()).collect();
        let w = prep(super::super::vnni::tests::quantize_rows::<S>(&wf, rows, cols));
        let xq = quantize_tokens::<V>(&x, t, cols);
        let mut y = vec![0f32; t * rows];
        // SAFETY: callers checked VNNI; sizes match.
        unsafe {
            let mut best = f64::MAX;
            for _ in 0..20 {
                let s = std::time::Instant::now();
                gemm::<V>(&w, cols, &xq, t, 0..rows, y.as_mut_ptr(), rows);
                best = best.min(s.elapsed().as_secs_f64());
            }
            eprintln!("{name} {rows}x{cols} t={t}: {:.1} GMAC/s", (rows * cols * t) as f64 / best / 1e9);
        }
    }

    #[test]
    #[ignore]
    fn gemm_rate() {
        if !available() {
            return;
        }
        rate::<formats::Q5_0>("Q5_0", 2048, 640);
        rate::<formats::Q6K>("Q6_K", 640, 2048);
        rate::<formats::Q4K>("Q4_K", 640, 1024);
        rate::<formats::Q8_0>("Q8_0", 1536, 576);
        rate::<formats::Q4_1>("Q4_1", 1536, 576);
        use super::super::vnni_packed::*;
        rate_packed::<Q5_0Pairs>("Q5_0 packed", 2048, 640);
    }
}
