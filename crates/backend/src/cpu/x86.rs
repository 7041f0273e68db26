//! AVX-512 kernels: each block format dequantizes 16 values at a time straight into a vector
//! register (`dq16`), and one generic loop multiplies them into the activations. Only the
//! per-format `dq16` differs; the loops are shared.

#![cfg(target_arch = "x86_64")]

use super::formats::{self, scale_min_k4, Block};
use std::arch::x86_64::*;

/// A block format the AVX-512 kernels can dequantize in registers.
pub trait Dq16: Block {
    /// Values `16c .. 16c+16` of the block at `b`.
    ///
    /// # Safety
    /// AVX-512F/BW and F16C are available; `b` points at a whole block; `c < N / 16`.
    unsafe fn dq16(b: *const u8, c: usize) -> __m512;
}

#[inline(always)]
unsafe fn half(b: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([*b, *b.add(1)]) as i32)))
}

#[inline(always)]
unsafe fn nibbles(qs: *const u8, high: bool) -> __m512 {
    let q = _mm_loadu_si128(qs as *const __m128i);
    let q = if high { _mm_srli_epi16(q, 4) } else { q };
    let q = _mm_and_si128(q, _mm_set1_epi8(0x0f));
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))
}

impl Dq16 for formats::F32 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        _mm512_loadu_ps(b.add(64 * c) as *const f32)
    }
}

impl Dq16 for formats::F16 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(b.add(32 * c) as *const __m256i))
    }
}

impl Dq16 for formats::BF16 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.add(32 * c) as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
    }
}

impl Dq16 for formats::Q4_0 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        let d = half(b);
        _mm512_fmadd_ps(nibbles(b.add(2), c == 1), _mm512_set1_ps(d), _mm512_set1_ps(-8.0 * d))
    }
}

impl Dq16 for formats::Q4_1 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        _mm512_fmadd_ps(nibbles(b.add(4), c == 1), _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b.add(2))))
    }
}

/// The fifth bits of Q5 values 16c..16c+16, as 0 or 16 in each lane.
#[inline(always)]
unsafe fn fifth_bits(qh: *const u8, c: usize) -> __m512i {
    let bits = u32::from_le_bytes([*qh, *qh.add(1), *qh.add(2), *qh.add(3)]);
    let mask = (bits >> (16 * c)) as u16;
    _mm512_maskz_mov_epi32(mask, _mm512_set1_epi32(16))
}

#[inline(always)]
unsafe fn q5_values(b: *const u8, qh: usize, qs: usize, c: usize) -> __m512 {
    let q = _mm_loadu_si128(b.add(qs) as *const __m128i);
    let q = if c == 1 { _mm_srli_epi16(q, 4) } else { q };
    let low = _mm512_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(0x0f)));
    _mm512_cvtepi32_ps(_mm512_or_si512(low, fifth_bits(b.add(qh), c)))
}

impl Dq16 for formats::Q5_0 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        let d = half(b);
        _mm512_fmadd_ps(q5_values(b, 2, 6, c), _mm512_set1_ps(d), _mm512_set1_ps(-16.0 * d))
    }
}

impl Dq16 for formats::Q5_1 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        _mm512_fmadd_ps(q5_values(b, 4, 8, c), _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b.add(2))))
    }
}

impl Dq16 for formats::Q8_0 {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        let q = _mm_loadu_si128(b.add(2 + 16 * c) as *const __m128i);
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(half(b)))
    }
}

impl Dq16 for formats::Q4K {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        // 4 groups of 64 values; each group has a low-nibble and a high-nibble sub-block of 32.
        let (group, sub, half_of_sub) = (c / 4, (c / 2) % 2, c % 2);
        let scales = std::slice::from_raw_parts(b.add(4), 12);
        let (sc, m) = scale_min_k4(2 * group + sub, scales);
        let q = nibbles(b.add(16 + group * 32 + half_of_sub * 16), sub == 1);
        let d = _mm512_set1_ps(half(b) * sc);
        _mm512_fmsub_ps(q, d, _mm512_set1_ps(half(b.add(2)) * m))
    }
}

impl Dq16 for formats::Q6K {
    #[inline(always)]
    unsafe fn dq16(b: *const u8, c: usize) -> __m512 {
        // Two halves of 128 values; each half has four quadrants of 32 built from ql/qh bits.
        let (h, e) = (c / 8, (c % 8) * 16);
        let (quadrant, l0) = (e / 32, e % 32);
        let ql = _mm_loadu_si128(b.add(h * 64 + (quadrant & 1) * 32 + l0) as *const __m128i);
        let ql = if quadrant >= 2 { _mm_srli_epi16(ql, 4) } else { ql };
        let ql = _mm_and_si128(ql, _mm_set1_epi8(0x0f));
        let qh = _mm_loadu_si128(b.add(128 + h * 32 + l0) as *const __m128i);
        let qh = _mm_and_si128(_mm_srl_epi16(qh, _mm_cvtsi32_si128(2 * quadrant as i32)), _mm_set1_epi8(3));
        let q = _mm_or_si128(ql, _mm_slli_epi16(qh, 4));
        let v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(32));
        let scale = *(b.add(192 + h * 8 + l0 / 16 + 2 * quadrant) as *const i8) as f32;
        _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(half(b.add(208)) * scale))
    }
}

/// y[r] = W[r] · x for rows `rows`, four rows at a time sharing the activation loads, with
/// software prefetch of the next row group (`vnni::prefetch_distance`): decode reads each
/// weight once, and for F16/BF16 weights (or exact mode) this loop is what waits on memory.
///
/// # Safety
/// AVX-512F/BW/VL and F16C are available; `w` holds whole rows of `cols / N` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn gemv<B: Dq16>(
    w: &[u8],
    cols: usize,
    x: &[f32],
    rows: std::ops::Range<usize>,
    y: &mut impl FnMut(usize, f32),
) {
    let row_bytes = cols / B::N * B::BYTES;
    assert!(w.len() >= rows.end * row_bytes && x.len() >= cols);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let ahead = super::vnni::prefetch_distance(4 * row_bytes);
    let mut r = rows.start;
    while r + 4 <= rows.end {
        let mut acc = [_mm512_setzero_ps(); 4];
        for blk in 0..cols / B::N {
            let off = blk * B::BYTES;
            for i in 0..4 {
                let at = wp.add((r + i) * row_bytes + off).wrapping_add(ahead);
                for line in (0..B::BYTES).step_by(64) {
                    super::vnni::prefetch(at.wrapping_add(line));
                }
            }
            for c in 0..B::N / 16 {
                let xv = _mm512_loadu_ps(xp.add(blk * B::N + 16 * c));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(B::dq16(wp.add((r + i) * row_bytes + off), c), xv, *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            y(r + i, _mm512_reduce_add_ps(*a));
        }
        r += 4;
    }
    for r in r..rows.end {
        let mut acc = _mm512_setzero_ps();
        for blk in 0..cols / B::N {
            for c in 0..B::N / 16 {
                let xv = _mm512_loadu_ps(xp.add(blk * B::N + 16 * c));
                acc = _mm512_fmadd_ps(B::dq16(wp.add(r * row_bytes + blk * B::BYTES), c), xv, acc);
            }
        }
        y(r, _mm512_reduce_add_ps(acc));
    }
}

/// `out[c·ld + r] = rows[r·cols + c]` for 16 rows and columns `c < cols` (a multiple of 16):
/// 16 × 16 blocks transposed in registers (64 shuffles per block). A scalar loop over strided
/// stores is what the compiler turns into scatter instructions, which are slow on AMD Zen 4.
///
/// # Safety
/// AVX-512F is available; `rows` holds 16·cols values; `out` is valid for writes of 16 values at
/// every `c·ld` (c < cols).
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose16(rows: &[f32], cols: usize, out: *mut f32, ld: usize) {
    assert!(cols % 16 == 0 && rows.len() >= 16 * cols);
    for c0 in (0..cols).step_by(16) {
        let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(rows.as_ptr().add(i * cols + c0)));
        // t: pairs of rows interleaved; u[4g + c] lane L = column 4L + c, rows 4g..4g+4.
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
            if i % 2 == 0 { _mm512_unpacklo_ps(a, b) } else { _mm512_unpackhi_ps(a, b) }
        });
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (lo01, hi01, lo23, hi23) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_shuffle_ps::<0x44>(lo01, lo23);
            u[4 * g + 1] = _mm512_shuffle_ps::<0xee>(lo01, lo23);
            u[4 * g + 2] = _mm512_shuffle_ps::<0x44>(hi01, hi23);
            u[4 * g + 3] = _mm512_shuffle_ps::<0xee>(hi01, hi23);
        }
        for c in 0..4 {
            // Lanes (0, 2) and (1, 3) of rows 0–7, then of rows 8–15.
            let x = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
            let y = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
            let x2 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
            let y2 = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
            let col = |l: usize| out.add((c0 + 4 * l + c) * ld);
            _mm512_storeu_ps(col(0), _mm512_shuffle_f32x4::<0x88>(x, x2));
            _mm512_storeu_ps(col(1), _mm512_shuffle_f32x4::<0x88>(y, y2));
            _mm512_storeu_ps(col(2), _mm512_shuffle_f32x4::<0xdd>(x, x2));
            _mm512_storeu_ps(col(3), _mm512_shuffle_f32x4::<0xdd>(y, y2));
        }
    }
}

/// Dequantizes one row (`cols` values) into `out`.
///
/// # Safety
/// As for `gemv`; `row` holds `cols / N` blocks and `out` `cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn dequant_row<B: Dq16>(row: &[u8], out: &mut [f32]) {
    assert!(row.len() * B::N >= out.len() * B::BYTES);
    for blk in 0..out.len() / B::N {
        for c in 0..B::N / 16 {
            let v = B::dq16(row.as_ptr().add(blk * B::BYTES), c);
            _mm512_storeu_ps(out.as_mut_ptr().add(blk * B::N + 16 * c), v);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn transpose16_equals_scalar() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let (cols, ld) = (48, 40);
        let rows: Vec<f32> = (0..16 * cols).map(|i| i as f32).collect();
        let mut out = vec![-1f32; cols * ld];
        // SAFETY: AVX-512F was detected; every c·ld + 16 ≤ cols·ld.
        unsafe { super::transpose16(&rows, cols, out.as_mut_ptr(), ld) };
        for c in 0..cols {
            for r in 0..16 {
                assert_eq!(out[c * ld + r], rows[r * cols + c], "column {c} row {r}");
            }
            assert!(out[c * ld + 16..(c + 1) * ld].iter().all(|&v| v == -1.0));
        }
    }
}

#[cfg(test)]
mod speed {
    use super::super::alloc::HugeBuf;
    use super::super::formats;

    /// Read rate of the F16 matrix-vector product on one thread over 128 MB of weights, in huge
    /// pages and in ordinary ones (`cargo test --release -p ferrolm-backend -- --ignored
    /// gemv_f16_rate --nocapture`; compare `bench/membw.c`).
    #[test]
    #[ignore]
    fn gemv_f16_rate() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let (rows, cols) = (65536, 1024);
        let bytes = rows * cols * 2;
        let plain: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 & 0x3b).collect();
        let huge = HugeBuf::copy_of(&plain, &|_| {}).unwrap();
        let x = vec![0.5f32; cols];
        for (name, w) in [("4k pages", &plain[..]), ("huge pages", huge.bytes())] {
            let mut best = f64::MAX;
            let mut sink = 0f32;
            for _ in 0..8 {
                let t = std::time::Instant::now();
                // SAFETY: AVX-512 was detected; `w` holds `rows` rows of `cols` f16 values.
                unsafe { super::gemv::<formats::F16>(w, cols, &x, 0..rows, &mut |_, v| sink += v) };
                best = best.min(t.elapsed().as_secs_f64());
            }
            eprintln!("F16 gemv, {name}: {:.1} GB/s ({sink})", bytes as f64 / best / 1e9);
        }
    }
}
