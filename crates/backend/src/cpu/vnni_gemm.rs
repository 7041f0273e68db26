//! Prefill with 8-bit activations on AVX-512 VNNI: `vnni::gemv` for several tokens at once.
//! Every activation row is quantized once per product (`vnni::quantize_into`), then tiles of
//! 4 weight rows × 4 tokens are computed in registers: each weight pair is loaded and unpacked
//! once per tile and multiplied by four tokens' activations with `vpdpbusd`, and the four
//! rows' integer sums are combined before the f32 scaling (`tile`).
//!
//! Per output the integer sums are `gemv`'s; only the order of the f32 additions differs
//! (chunks of 16 values are summed in integers first), so prefill and decode agree to f32
//! rounding for the same token.

#![cfg(target_arch = "x86_64")]

use super::vnni::{QPair, Vnni};
use std::arch::x86_64::*;

/// Tokens per block: a block's quantized activations (320 bytes per 64 values) stay in L2
/// while every weight row of the thread passes over them.
const TOKEN_BLOCK: usize = 32;
const _: () = assert!(TOKEN_BLOCK % TOKENS == 0 && TOKENS <= 8);

/// Tokens per register tile (with 4 weight rows).
pub const TOKENS: usize = 8;

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
                match nt {
                    8 => tile::<V, 8>(wr, nr, xj, &shape, out, ld),
                    7 => tile::<V, 7>(wr, nr, xj, &shape, out, ld),
                    6 => tile::<V, 6>(wr, nr, xj, &shape, out, ld),
                    5 => tile::<V, 5>(wr, nr, xj, &shape, out, ld),
                    4 => tile::<V, 4>(wr, nr, xj, &shape, out, ld),
                    3 => tile::<V, 3>(wr, nr, xj, &shape, out, ld),
                    2 => tile::<V, 2>(wr, nr, xj, &shape, out, ld),
                    _ => tile::<V, 1>(wr, nr, xj, &shape, out, ld),
                }
                j += nt;
            }
            r += nr;
        }
        t0 = t1;
    }
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
/// Per token, the four rows' integer sums are reduced across lanes before anything is
/// converted to f32 (`reduce4`): lane i of each 128-bit chunk then holds row i's sum over that
/// chunk (the chunk's 16 values share one activation and one weight scale), so one conversion,
/// one scale product and one FMA serve four rows.
#[inline(always)]
unsafe fn tile<V: Vnni, const M: usize>(w: *const u8, nr: usize, xq: *const QPair, s: &Shape, y: *mut f32, ld: usize) {
    let mut acc = [_mm512_setzero_ps(); M];
    // Min terms: 128-bit chunk i of macc[j] is gemv's `macc` of row i and token j.
    let mut macc = [_mm512_setzero_ps(); M];
    let per_block = (V::N / 64).max(1);
    for p in 0..s.pairs {
        let mut wq = [_mm512_setzero_si512(); 4];
        let mut dw = [_mm512_setzero_ps(); 4];
        let mut mm = _mm512_setzero_ps();
        for i in 0..4 {
            let row = w.add(i.min(nr - 1) * s.row_bytes);
            let (q, d, m) = if V::N == 32 {
                V::load_pair(row.add(2 * p * V::BYTES), 0, !(s.odd && p + 1 == s.pairs))
            } else {
                V::load_pair(row.add(p / per_block * V::BYTES), p % per_block, true)
            };
            wq[i] = q;
            dw[i] = d;
            if V::MIN {
                mm = insert_chunk(mm, m, i);
            }
        }
        // Lane i of chunk k: row i's weight scale of chunk k.
        let dw4 = _mm512_castpd_ps(_mm512_unpacklo_pd(
            _mm512_castps_pd(_mm512_unpacklo_ps(dw[0], dw[1])),
            _mm512_castps_pd(_mm512_unpacklo_ps(dw[2], dw[3])),
        ));
        for j in 0..M {
            let x = &*xq.add(p * TOKENS + j);
            let xv = _mm512_load_si512(x.q.as_ptr() as *const _);
            let z = _mm512_setzero_si512();
            let mut u = reduce4(
                _mm512_dpbusd_epi32(z, wq[0], xv),
                _mm512_dpbusd_epi32(z, wq[1], xv),
                _mm512_dpbusd_epi32(z, wq[2], xv),
                _mm512_dpbusd_epi32(z, wq[3], xv),
            );
            if V::OFFSET != 0 {
                u = _mm512_add_epi32(u, _mm512_load_si512(x.corr4.as_ptr() as *const _));
            }
            let scale = _mm512_mul_ps(dw4, _mm512_load_ps(x.dx.as_ptr()));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scale, acc[j]);
            if V::MIN {
                let sx = _mm512_broadcast_f32x4(_mm_load_ps(x.s.as_ptr()));
                macc[j] = _mm512_fmadd_ps(mm, sx, macc[j]);
            }
        }
    }
    for j in 0..M {
        let a = acc[j];
        let lo = _mm_add_ps(_mm512_extractf32x4_ps::<0>(a), _mm512_extractf32x4_ps::<1>(a));
        let hi = _mm_add_ps(_mm512_extractf32x4_ps::<2>(a), _mm512_extractf32x4_ps::<3>(a));
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(lo, hi));
        for (i, o) in out.iter().enumerate().take(nr) {
            let mut v = *o;
            if V::MIN {
                let m = extract_chunk(macc[j], i);
                let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
                v += _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps::<1>(m, m)));
            }
            *y.add(j * ld + i) = v;
        }
    }
}

/// Four vectors of 16 i32 → lane i of each 128-bit chunk = the sum of vector i's four lanes
/// in that chunk.
#[inline(always)]
unsafe fn reduce4(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> __m512i {
    // [a0+a2, b0+b2, a1+a3, b1+b3] per chunk, likewise for c, d.
    let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
}

#[inline(always)]
unsafe fn insert_chunk(v: __m512, part: __m128, at: usize) -> __m512 {
    match at {
        0 => _mm512_insertf32x4::<0>(v, part),
        1 => _mm512_insertf32x4::<1>(v, part),
        2 => _mm512_insertf32x4::<2>(v, part),
        _ => _mm512_insertf32x4::<3>(v, part),
    }
}

#[inline(always)]
unsafe fn extract_chunk(v: __m512, at: usize) -> __m128 {
    match at {
        0 => _mm512_extractf32x4_ps::<0>(v),
        1 => _mm512_extractf32x4_ps::<1>(v),
        2 => _mm512_extractf32x4_ps::<2>(v),
        _ => _mm512_extractf32x4_ps::<3>(v),
    }
}

#[cfg(test)]
mod tests {
    use super::super::formats;
    use super::super::vnni::{available, gemv, quantize, quantize_strided, QPair};
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
        let pairs = cols.div_ceil(64);
        let mut xq = vec![QPair::ZERO; pairs_len(t, pairs)];
        let mut got = vec![0f32; t * rows];
        // SAFETY: VNNI was detected above; sizes match.
        unsafe {
            for (tok, xr) in x.chunks_exact(cols).enumerate() {
                quantize_strided::<V>(xr, xq.as_mut_ptr().add(pair_index(tok, 0, pairs)), TOKENS);
            }
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
