//! Decode of several sequences in one step (continuous batching): each weight row is read once
//! per group of up to `GROUP` tokens instead of once per token. Every (token, row) output is
//! computed with exactly the arithmetic of the one-token kernels (`vnni::gemv`, `x86::gemv`):
//! the same integer sums, scale products, FMA chain over the blocks in order and final
//! reduction, so a sequence decoded in a batch gets the bits it gets alone. (The prefill GEMM
//! sums differently, which is why a step keeps decode rows and prompt rows apart.)
//!
//! Activations of token j are at `j·pairs` (8-bit, `vnni::quantize_into`) or `j·cols` (f32).
//! Rows go in pairs and tokens in groups of four: 8 accumulators (and 8 min-term accumulators)
//! stay in registers while a pair of weight blocks is unpacked once per row.

#![cfg(target_arch = "x86_64")]

use super::vnni::{finish, loaded_pair_dot, prefetch, prefetch_distance, QPair, Vnni};
use super::x86::Dq16;
use std::arch::x86_64::*;

/// Tokens per pass over a row pair.
pub const GROUP: usize = 8;

/// Rows per pass.
const ROWS: usize = 1;

/// y(token, row) = W[row] · x_token for `m` tokens and rows `rows`, 8-bit activations `xq`
/// (`m` tokens of `cols.div_ceil(64)` pairs, token-major), bit-identical to `vnni::gemv` per
/// token.
///
/// # Safety
/// `vnni::available()`; `w` holds whole rows of `cols / N` blocks; `xq` was quantized from
/// `m` rows of `cols` values for this `V`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn gemv_tokens<V: Vnni>(w: &[u8], cols: usize, xq: &[QPair], m: usize, rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, usize, f32)) {
    assert!(cols % V::N == 0 && (V::N == 32 || V::N % 64 == 0));
    let row_bytes = cols / V::N * V::BYTES;
    let pairs = cols.div_ceil(64);
    let shape = Shape { row_bytes, pairs, odd: cols % 64 == 32 };
    assert!(w.len() >= rows.end * row_bytes && xq.len() == m * pairs);
    // Blocks of rows, each block's weights reused by every token group while they are in L1,
    // and a token group's activations by every row of the block.
    for block in (rows.start..rows.end).step_by(ROW_BLOCK) {
        let block_end = (block + ROW_BLOCK).min(rows.end);
        let mut j = 0;
        while j < m {
            let nt = (m - j).min(GROUP);
            let mut r = block;
            while r < block_end {
                let nr = (block_end - r).min(ROWS);
                let (wr, xj) = (w.as_ptr().add(r * row_bytes), xq.as_ptr().add(j * pairs));
                let out = int8_group::<V, ROWS>(nt, wr, xj, &shape);
                for (i, row) in out.iter().take(nr).enumerate() {
                    for (g, v) in row.iter().take(nt).enumerate() {
                        y(j + g, r + i, *v);
                    }
                }
                r += nr;
            }
            j += nt;
        }
    }
}

/// Rows whose weights stay cached while every token group passes over them.
const ROW_BLOCK: usize = 16;

struct Shape {
    row_bytes: usize,
    pairs: usize,
    /// An odd number of 32-blocks (N = 32 formats): the last pair has one block.
    odd: bool,
}

/// `int8_rows` for `nt` (1..=GROUP) tokens, each count its own instance; unused outputs are 0.
#[inline(always)]
unsafe fn int8_group<V: Vnni, const R: usize>(nt: usize, w: *const u8, xq: *const QPair, s: &Shape) -> [[f32; GROUP]; R] {
    fn widen<const R: usize, const G: usize>(v: [[f32; G]; R]) -> [[f32; GROUP]; R] {
        std::array::from_fn(|i| std::array::from_fn(|j| if j < G { v[i][j] } else { 0.0 }))
    }
    match nt {
        1 => widen(int8_rows::<V, R, 1>(w, xq, s)),
        2 => widen(int8_rows::<V, R, 2>(w, xq, s)),
        3 => widen(int8_rows::<V, R, 3>(w, xq, s)),
        4 => widen(int8_rows::<V, R, 4>(w, xq, s)),
        5 => widen(int8_rows::<V, R, 5>(w, xq, s)),
        6 => widen(int8_rows::<V, R, 6>(w, xq, s)),
        7 => widen(int8_rows::<V, R, 7>(w, xq, s)),
        _ => widen(int8_rows::<V, R, 8>(w, xq, s)),
    }
}

/// `R` rows at `w` × `G` tokens at `xq`: `vnni::rows_dot`'s loop with each loaded weight pair
/// multiplied into every token's accumulators.
#[inline(always)]
unsafe fn int8_rows<V: Vnni, const R: usize, const G: usize>(w: *const u8, xq: *const QPair, s: &Shape) -> [[f32; G]; R] {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let mut macc = [[_mm_setzero_ps(); G]; R];
    let ahead = prefetch_distance(R * s.row_bytes);
    if V::N == 32 {
        let full = s.pairs - s.odd as usize;
        for p in 0..s.pairs {
            let two = p < full;
            let mut wp = [(_mm512_setzero_si512(), _mm512_setzero_ps(), _mm_setzero_ps()); R];
            for (i, wi) in wp.iter_mut().enumerate() {
                let at = w.add(i * s.row_bytes + 2 * p * V::BYTES);
                if two {
                    prefetch(at.wrapping_add(ahead));
                }
                *wi = V::load_pair(at, 0, two);
            }
            tokens_dot::<V, R, G>(&wp, xq.add(p), s.pairs, &mut acc, &mut macc);
        }
    } else {
        let per_block = V::N / 64;
        let mut scales = [_mm512_setzero_ps(); R];
        for p in 0..s.pairs {
            let (blk, q) = (p / per_block, p % per_block);
            let mut wp = [(_mm512_setzero_si512(), _mm512_setzero_ps(), _mm_setzero_ps()); R];
            for (i, wi) in wp.iter_mut().enumerate() {
                let at = w.add(i * s.row_bytes + blk * V::BYTES);
                prefetch(at.wrapping_add(ahead + q * V::BYTES / per_block));
                if q == 0 {
                    scales[i] = V::block_scales(at);
                }
                *wi = V::load_pair_scaled(at, q, true, scales[i]);
            }
            tokens_dot::<V, R, G>(&wp, xq.add(p), s.pairs, &mut acc, &mut macc);
        }
    }
    // Loops, not closures: a closure would not inherit the target features, and the reduction
    // inside `finish` would become a call.
    let mut out = [[0f32; G]; R];
    for i in 0..R {
        for j in 0..G {
            out[i][j] = finish(acc[i][j], macc[i][j]);
        }
    }
    out
}

/// One pair of `R` rows' weights (unpacked) into every token's accumulators: each token's
/// activations (pair `p` at `xq`, token stride `pairs`) loaded once for the R rows. A function,
/// not a closure: closures do not inherit the target features, and the intrinsics would be calls.
#[inline(always)]
unsafe fn tokens_dot<V: Vnni, const R: usize, const G: usize>(
    w: &[(__m512i, __m512, __m128); R],
    xq: *const QPair,
    pairs: usize,
    acc: &mut [[__m512; G]; R],
    macc: &mut [[__m128; G]; R],
) {
    for j in 0..G {
        let xp = &*xq.add(j * pairs);
        for i in 0..R {
            let (wq, dw, m) = w[i];
            loaded_pair_dot::<V>(wq, dw, m, xp, &mut acc[i][j], &mut macc[i][j]);
        }
    }
}

/// y(token, row) = W[row] · x_token for `m` f32 activation rows `x` (`m·cols` values), the
/// weights dequantized in registers (`Dq16`): bit-identical to `x86::gemv` per token.
///
/// # Safety
/// AVX-512F/BW/VL and F16C are available; `w` holds whole rows of `cols / N` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn gemv_tokens_f32<B: Dq16>(w: &[u8], cols: usize, x: &[f32], m: usize, rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, usize, f32)) {
    let row_bytes = cols / B::N * B::BYTES;
    assert!(w.len() >= rows.end * row_bytes && x.len() >= m * cols);
    let mut r = rows.start;
    while r < rows.end {
        let nr = (rows.end - r).min(ROWS);
        let mut j = 0;
        while j < m {
            let nt = (m - j).min(GROUP);
            let (wr, xj) = (w.as_ptr().add(r * row_bytes), x.as_ptr().add(j * cols));
            let out = f32_group::<B, ROWS>(nt, wr, row_bytes, xj, cols);
            for (i, row) in out.iter().take(nr).enumerate() {
                for (g, v) in row.iter().take(nt).enumerate() {
                    y(j + g, r + i, *v);
                }
            }
            j += nt;
        }
        r += nr;
    }
}

#[inline(always)]
unsafe fn f32_group<B: Dq16, const R: usize>(nt: usize, w: *const u8, row_bytes: usize, x: *const f32, cols: usize) -> [[f32; GROUP]; R] {
    fn widen<const R: usize, const G: usize>(v: [[f32; G]; R]) -> [[f32; GROUP]; R] {
        std::array::from_fn(|i| std::array::from_fn(|j| if j < G { v[i][j] } else { 0.0 }))
    }
    match nt {
        1 => widen(f32_rows::<B, R, 1>(w, row_bytes, x, cols)),
        2 => widen(f32_rows::<B, R, 2>(w, row_bytes, x, cols)),
        3 => widen(f32_rows::<B, R, 3>(w, row_bytes, x, cols)),
        4 => widen(f32_rows::<B, R, 4>(w, row_bytes, x, cols)),
        5 => widen(f32_rows::<B, R, 5>(w, row_bytes, x, cols)),
        6 => widen(f32_rows::<B, R, 6>(w, row_bytes, x, cols)),
        7 => widen(f32_rows::<B, R, 7>(w, row_bytes, x, cols)),
        _ => widen(f32_rows::<B, R, 8>(w, row_bytes, x, cols)),
    }
}

/// `x86::gemv`'s loop for `R` rows with each dequantized 16 weights multiplied into every
/// token's accumulator.
#[inline(always)]
unsafe fn f32_rows<B: Dq16, const R: usize, const G: usize>(w: *const u8, row_bytes: usize, x: *const f32, cols: usize) -> [[f32; G]; R] {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let ahead = prefetch_distance(R * row_bytes);
    for blk in 0..cols / B::N {
        let off = blk * B::BYTES;
        for i in 0..R {
            let at = w.add(i * row_bytes + off).wrapping_add(ahead);
            for line in (0..B::BYTES).step_by(64) {
                prefetch(at.wrapping_add(line));
            }
        }
        for c in 0..B::N / 16 {
            for i in 0..R {
                let wv = B::dq16(w.add(i * row_bytes + off), c);
                for j in 0..G {
                    let xv = _mm512_loadu_ps(x.add(j * cols + blk * B::N + 16 * c));
                    acc[i][j] = _mm512_fmadd_ps(wv, xv, acc[i][j]);
                }
            }
        }
    }
    let mut out = [[0f32; G]; R];
    for i in 0..R {
        for j in 0..G {
            out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::formats::{self, Block};
    use super::super::vnni::{self, available, quantize};
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every token's row equals the one-token kernel's bit for bit, for token counts around
    /// the group size and row counts around the row pair.
    fn check<V: Vnni>(cols: usize) {
        if !available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        let mut rnd = vnni::tests::uniform(0x51ed2701);
        for (rows, m) in [(7, 1), (7, 5), (8, 4), (3, 9)] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..m * cols).map(|i| rnd() * if i % 5 == 0 { 4.0 } else { 1.0 }).collect();
            let w = vnni::tests::quantize_rows::<V>(&wf, rows, cols);
            let pairs = cols.div_ceil(64);
            let mut xq = vec![QPair::ZERO; m * pairs];
            let mut got = vec![0f32; m * rows];
            // SAFETY: VNNI was detected above; sizes match.
            unsafe {
                for j in 0..m {
                    vnni::quantize_into::<V>(&x[j * cols..(j + 1) * cols], &mut xq[j * pairs..(j + 1) * pairs]);
                }
                gemv_tokens::<V>(&w, cols, &xq, m, 0..rows, &mut |j, r, v| got[j * rows + r] = v);
            }
            for j in 0..m {
                let (mut one, mut want) = (Vec::new(), vec![0f32; rows]);
                // SAFETY: as above.
                unsafe {
                    quantize::<V>(&x[j * cols..(j + 1) * cols], &mut one);
                    vnni::gemv::<V>(&w, cols, &one, 0..rows, &mut |r, v| want[r] = v);
                }
                assert_eq!(bits(&got[j * rows..(j + 1) * rows]), bits(&want), "rows {rows}, token {j} of {m}");
            }
        }
    }

    #[test]
    fn int8_tokens_equal_gemv_bit_for_bit() {
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

    fn check_f32<B: Dq16>(w: &[u8], rows: usize, cols: usize) {
        let mut rnd = vnni::tests::uniform(0x7f4a7c15);
        for m in [1, 3, 4, 6] {
            let x: Vec<f32> = (0..m * cols).map(|_| rnd()).collect();
            let mut got = vec![0f32; m * rows];
            // SAFETY: AVX-512 was checked by the caller; sizes match.
            unsafe { gemv_tokens_f32::<B>(w, cols, &x, m, 0..rows, &mut |j, r, v| got[j * rows + r] = v) };
            for j in 0..m {
                let mut want = vec![0f32; rows];
                // SAFETY: as above.
                unsafe { super::super::x86::gemv::<B>(w, cols, &x[j * cols..(j + 1) * cols], 0..rows, &mut |r, v| want[r] = v) };
                assert_eq!(bits(&got[j * rows..(j + 1) * rows]), bits(&want), "{rows} rows, token {j} of {m}");
            }
        }
    }

    #[test]
    fn f32_tokens_equal_gemv_bit_for_bit() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("SKIP: no AVX-512");
            return;
        }
        let (rows, cols) = (9, 256);
        let mut rnd = vnni::tests::uniform(3);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let f16: Vec<u8> = wf.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        check_f32::<formats::F16>(&f16, rows, cols);
        let q = vnni::tests::quantize_rows::<formats::Q4K>(&wf, rows, cols);
        check_f32::<formats::Q4K>(&q, rows, cols);
        assert_eq!(formats::F16::N, 16 * (formats::F16::N / 16));
    }
}

#[cfg(test)]
mod speed {
    use super::super::formats;
    use super::super::vnni::{self, available};
    use super::*;

    /// Single-thread rates of the batched decode product against the one-token kernel run once
    /// per token (`cargo test --release -p ferrolm-backend -- --ignored tokens_rate --nocapture`).
    fn rate<V: Vnni>(name: &str, rows: usize, cols: usize) {
        let mut rnd = vnni::tests::uniform(11);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let w = vnni::tests::quantize_rows::<V>(&wf, rows, cols);
        let pairs = cols.div_ceil(64);
        for m in [1, 4, 8, 16] {
            let x: Vec<f32> = (0..m * cols).map(|_| rnd()).collect();
            let mut xq = vec![QPair::ZERO; m * pairs];
            let mut sink = 0f32;
            let (mut batched, mut solo) = (f64::MAX, f64::MAX);
            // SAFETY: callers checked VNNI; sizes match.
            unsafe {
                for j in 0..m {
                    vnni::quantize_into::<V>(&x[j * cols..(j + 1) * cols], &mut xq[j * pairs..(j + 1) * pairs]);
                }
                for _ in 0..30 {
                    let t = std::time::Instant::now();
                    gemv_tokens::<V>(&w, cols, &xq, m, 0..rows, &mut |_, _, v| sink += v);
                    batched = batched.min(t.elapsed().as_secs_f64());
                    let t = std::time::Instant::now();
                    for j in 0..m {
                        vnni::gemv::<V>(&w, cols, &xq[j * pairs..(j + 1) * pairs], 0..rows, &mut |_, v| sink += v);
                    }
                    solo = solo.min(t.elapsed().as_secs_f64());
                }
            }
            // The prefill GEMM (`vnni_gemm`, other summation order) on the same tokens.
            let xg = super::super::vnni_gemm::quantize_tokens::<V>(&x, m, cols);
            let mut y = vec![0f32; m * rows];
            let mut gemm = f64::MAX;
            for _ in 0..30 {
                let t = std::time::Instant::now();
                // SAFETY: as above.
                unsafe { super::super::vnni_gemm::gemm::<V>(&w, cols, &xg, m, 0..rows, y.as_mut_ptr(), rows) };
                gemm = gemm.min(t.elapsed().as_secs_f64());
            }
            let gmac = (rows * cols * m) as f64 / 1e9;
            eprintln!(
                "{name} {rows}x{cols} m={m}: batched {:.1} GMAC/s, one by one {:.1}, prefill gemm {:.1} ({sink:.0} {})",
                gmac / batched,
                gmac / solo,
                gmac / gemm,
                y[0]
            );
        }
    }

    #[test]
    #[ignore]
    fn tokens_rate() {
        if !available() {
            return;
        }
        rate::<formats::Q4_1>("Q4_1", 3072, 576);
        rate::<formats::Q8_0>("Q8_0", 3072, 576);
        rate::<formats::Q4K>("Q4_K", 1792, 1024);
        rate::<formats::Q5_0>("Q5_0", 4864, 896);
        // The default 1.5B model's Q6_K output head (151,936 x 1,536) and a Q4_K product of its width.
        rate::<formats::Q6K>("Q6_K", 151936, 1536);
        rate::<formats::Q4K>("Q4_K", 8960, 1536);
    }
}
