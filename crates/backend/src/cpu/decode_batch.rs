//! Decode of several sequences in one step (continuous batching) with f32 activations (F16 /
//! BF16 / F32 weights, and every format in exact mode): each weight row is read once per group
//! of up to `GROUP` tokens instead of once per token. Every (token, row) output is computed with
//! exactly the arithmetic of the one-token kernel (`x86::gemv`): the same products, FMA chain
//! over the blocks in order and final reduction, so a sequence decoded in a batch gets the bits
//! it gets alone. (8-bit activations batch in `vnni_gemm::gemv_tokens`.)
//!
//! Activations of token j are at `j·cols`.

#![cfg(target_arch = "x86_64")]

use super::vnni::{prefetch, prefetch_distance};
use super::x86::Dq16;
use std::arch::x86_64::*;

/// Tokens per pass over a row pair.
pub const GROUP: usize = 8;

/// Rows per pass.
const ROWS: usize = 1;

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
    use super::super::vnni;
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
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
