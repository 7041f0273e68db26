//! Quantized weights repacked at load for the 8-bit kernels (`vnni`, `vnni_gemm`), for the
//! formats whose file layout is dear to unpack per use: in Q5_0 the fifth bits are spread over a
//! 32-bit word per block and have to be rearranged into a byte mask with scalar shifts (~20
//! instructions per row and pair, more than the multiplications themselves, in decode and again
//! for every tile in prefill).
//!
//! A repacked pair holds exactly what `Vnni::load_pair` of the source format computes, stored
//! ready to load: Q5_0 keeps its nibbles and gets its fifth bits as the 64-bit mask, in the
//! file's 44 bytes per 64 values. The pairs are produced by the source format's own `load_pair`,
//! so products are bit-identical to the file layout's.
//!
//! Q4_K and Q6_K were repacked here too (their scales ready as f32) until that was measured to
//! cost more than it saved: 48 and 80 bytes per 64 values instead of 36 and 52.5, and decode is
//! bound by memory. They decode their scales once per super-block instead (`Vnni::block_scales`).

#![cfg(target_arch = "x86_64")]

use super::alloc::HugeBuf;
use super::formats::{self, Block};
use super::vnni::{per_lane, split_nibbles, Layout, Vnni};
use std::arch::x86_64::*;

/// Rows per released range of the source while packing (the peak holds about one copy).
const RELEASE_ROWS: usize = 256;

/// A repacked format: pairs of 64 values (`Block::N` = 64), each `Block::BYTES` long.
pub trait Repacked: Vnni {
    type Source: Vnni;

    /// Writes pair `p` of the source row at `row` into `out[..Self::BYTES]`.
    ///
    /// # Safety
    /// `vnni::available()`; `row` holds a whole source row with more than `p` pairs.
    unsafe fn pack_pair(row: *const u8, p: usize, out: &mut [u8]);
}

/// `rows` source rows of `cols` values (`cols` a multiple of 64) → the repacked rows (in huge
/// pages, see `HugeBuf`), calling `done(range)` on each finished byte range of `w` so that its
/// pages can be dropped.
///
/// # Safety
/// `vnni::available()`.
pub unsafe fn pack<R: Repacked>(w: &[u8], rows: usize, cols: usize, done: &dyn Fn(std::ops::Range<usize>)) -> std::io::Result<HugeBuf> {
    let src_row = cols / R::Source::N * R::Source::BYTES;
    assert!(cols % 64 == 0 && w.len() == rows * src_row);
    let pairs = cols / 64;
    let mut out = HugeBuf::zeroed(rows * pairs * R::BYTES)?;
    for (r, dst) in out.bytes_mut().chunks_exact_mut(pairs * R::BYTES).enumerate() {
        for (p, pair) in dst.chunks_exact_mut(R::BYTES).enumerate() {
            R::pack_pair(w.as_ptr().add(r * src_row), p, pair);
        }
        if (r + 1) % RELEASE_ROWS == 0 || r + 1 == rows {
            done((r - r % RELEASE_ROWS) * src_row..(r + 1) * src_row);
        }
    }
    Ok(out)
}

/// The source's pair p of a row: for 32-value formats blocks 2p and 2p + 1, for 256-value
/// ones quarter p % 4 of super-block p / 4.
#[inline(always)]
unsafe fn source_pair<S: Vnni>(row: *const u8, p: usize) -> (__m512i, __m512, __m128) {
    if S::N == 32 {
        S::load_pair(row.add(2 * p * S::BYTES), 0, true)
    } else {
        S::load_pair(row.add(p / 4 * S::BYTES), p % 4, true)
    }
}

#[inline(always)]
unsafe fn u16_at(b: *const u8) -> u16 {
    (b as *const u16).read_unaligned()
}

/// Q5_0 pairs: `[b0 qs (16), b1 qs (16), fifth-bit mask in the Nibbles byte order (u64),
/// d0, d1 (f16)]`.
pub struct Q5_0Pairs;

impl Block for Q5_0Pairs {
    const N: usize = 64;
    const BYTES: usize = 44;
    fn dequant(b: &[u8], out: &mut [f32]) {
        let mask = u64::from_le_bytes(b[32..40].try_into().unwrap());
        for blk in 0..2 {
            let d = formats::f16_to_f32(u16::from_le_bytes([b[40 + 2 * blk], b[41 + 2 * blk]]));
            for j in 0..16 {
                let q = b[16 * blk + j];
                // Byte orders: value j → layout byte 16·blk + j, value 16 + j → 32 + 16·blk + j.
                let (lo, hi) = (16 * blk + j, 32 + 16 * blk + j);
                let h = |at: usize| if mask >> at & 1 == 1 { 16 } else { 0 };
                out[32 * blk + j] = ((q & 15) as i32 + h(lo) - 16) as f32 * d;
                out[32 * blk + 16 + j] = ((q >> 4) as i32 + h(hi) - 16) as f32 * d;
            }
        }
    }
}

impl Vnni for Q5_0Pairs {
    const LAYOUT: Layout = Layout::Nibbles;
    const OFFSET: i32 = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, _two: bool) -> (__m512i, __m512, __m128) {
        let q = split_nibbles(_mm256_loadu_si256(b as *const __m256i));
        let fifth = (b.add(32) as *const u64).read_unaligned();
        let q = _mm512_mask_add_epi8(q, fifth, q, _mm512_set1_epi8(16));
        let d = (b.add(40) as *const u32).read_unaligned();
        // [d0, 0, d1, 0]: the `[d, m]` pairs of `vnni`'s Nibbles scale order.
        let dm = _mm_cvtph_ps(_mm_cvtepu16_epi32(_mm_cvtsi32_si128(d as i32)));
        (q, per_lane(Self::LAYOUT, dm), dm)
    }
}

impl Repacked for Q5_0Pairs {
    type Source = formats::Q5_0;
    unsafe fn pack_pair(row: *const u8, p: usize, out: &mut [u8]) {
        let (q, _, _) = source_pair::<Self::Source>(row, p);
        let (b0, b1) = (row.add(2 * p * 22), row.add((2 * p + 1) * 22));
        std::ptr::copy_nonoverlapping(b0.add(6), out.as_mut_ptr(), 16);
        std::ptr::copy_nonoverlapping(b1.add(6), out.as_mut_ptr().add(16), 16);
        // The fifth bits are where the source's unpacked values reach 16.
        let fifth = _mm512_test_epi8_mask(q, _mm512_set1_epi8(16));
        out[32..40].copy_from_slice(&fifth.to_le_bytes());
        out[40..42].copy_from_slice(&u16_at(b0).to_le_bytes());
        out[42..44].copy_from_slice(&u16_at(b1).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::super::vnni::{self, available};
    use super::super::vnni_gemm;
    use super::*;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// Repacked rows dequantize to the source's values, and `vnni_gemm::gemv` and `vnni_gemm::gemm`
    /// on them equal the same kernels on the file's layout bit for bit.
    fn check<R: Repacked>(rows: usize, cols: usize) {
        if !available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        type S<R> = <R as Repacked>::Source;
        let mut rnd = vnni::tests::uniform(0x9e3779b97f4a7c15);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let w = vnni::tests::quantize_rows::<S<R>>(&wf, rows, cols);
        let released = std::cell::Cell::new(0);
        // SAFETY: VNNI was detected above.
        let packed = unsafe { pack::<R>(&w, rows, cols, &|r| released.set(released.get().max(r.end))) }.unwrap();
        let packed = packed.bytes();
        assert_eq!(released.get(), w.len(), "every source byte is released");
        let dequant = |bytes: &[u8], n: usize, size: usize, f: fn(&[u8], &mut [f32])| {
            let mut out = vec![0f32; rows * cols];
            for (b, o) in bytes.chunks_exact(size).zip(out.chunks_exact_mut(n)) {
                f(b, o);
            }
            out
        };
        let want = dequant(&w, S::<R>::N, S::<R>::BYTES, S::<R>::dequant);
        assert_eq!(bits(&dequant(packed, 64, R::BYTES, R::dequant)), bits(&want));

        let t = 21;
        let x: Vec<f32> = (0..t * cols).map(|_| rnd() * 2.0).collect();
        let xq = vnni_gemm::quantize_tokens::<R>(&x, t, cols);
        let (mut a, mut b) = (vec![0f32; t * rows], vec![0f32; t * rows]);
        let (mut one, mut ga, mut gb) = (Vec::new(), vec![0f32; rows], vec![0f32; rows]);
        // SAFETY: VNNI was detected; sizes match.
        unsafe {
            vnni_gemm::gemm::<S<R>>(&w, cols, &xq, t, 0..rows, a.as_mut_ptr(), rows);
            vnni_gemm::gemm::<R>(packed, cols, &xq, t, 0..rows, b.as_mut_ptr(), rows);
            vnni::quantize::<R>(&x[..cols], &mut one);
            vnni_gemm::gemv::<S<R>>(&w, cols, &one, 0..rows, &mut |r, v| ga[r] = v);
            vnni_gemm::gemv::<R>(packed, cols, &one, 0..rows, &mut |r, v| gb[r] = v);
        }
        assert_eq!(bits(&a), bits(&b), "gemm");
        assert_eq!(bits(&ga), bits(&gb), "gemv");
    }

    #[test]
    fn repacked_equals_source() {
        check::<Q5_0Pairs>(13, 640);
        check::<Q5_0Pairs>(4, 64);
    }
}
