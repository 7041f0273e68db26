//! 8-bit activations on AVX-512 VNNI, as llama.cpp does (its q4_1·q8_1 and q8_0·q8_0 dot
//! products): the activation row is quantized once per product into blocks of 32 (int8 values
//! and an f32 scale), and `vpdpbusd` multiplies 64 u8 weights by 64 s8 activations per
//! instruction, summing groups of 4 into 16 i32 lanes. Only the per-block scales are applied in
//! f32. This changes results slightly (like llama.cpp's), so `super::exact_activations()` turns
//! it off. This module holds the formats' pair loads and the activations' quantization; the
//! products themselves (decode of one or several tokens, and prefill) are `vnni_gemm`'s.
//!
//! Two weight blocks go into one zmm (a *pair*). A format loads its pair as 64 unsigned bytes in
//! one of two byte orders, and the activations are laid out in the same order beforehand:
//!
//! - `Layout::Nibbles` (4-bit formats): `[b0 values 0..16, b1 0..16, b0 16..32, b1 16..32]`,
//!   the order in which the low and high nibbles of the two blocks unpack;
//! - `Layout::Natural` (Q8_0): `[b0 values 0..32, b1 values 0..32]`.
//!
//! Signed weights are made unsigned by an offset `k` (Q8_0: w + 128; Q4_0: the stored nibble,
//! w = q − 8), whose contribution −k·Σx is precomputed per lane (`QPair::corr`, for the Q8_0
//! head kernel `q8_packed`) and per 16-value chunk (`QPair::corr4`, for `vnni_gemm`).

#![cfg(target_arch = "x86_64")]

use super::formats::{self, Block};
use std::arch::x86_64::*;

/// Byte order of a pair of blocks in a zmm (see the module comment).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Nibbles,
    Natural,
}

/// One pair of quantized activation blocks, with everything the kernel needs per pair
/// precomputed in lane order, so the per-row work is loads, one `vpdpbusd` and two FMAs.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct QPair {
    /// int8 activations in the format's layout.
    pub(super) q: [i8; 64],
    /// Each lane's block scale d_x.
    pub(super) dx: [f32; 16],
    /// −k · (sum of the lane's 4 activations): the starting value of the integer accumulator.
    pub(super) corr: [i32; 16],
    /// `corr` summed per 128-bit chunk, every lane of a chunk holding its chunk's sum (the
    /// correction of `vnni_gemm`, which sums each chunk's lanes before converting to f32).
    pub(super) corr4: [i32; 16],
    /// s = d_x · Σq of each lane's block (`[s0 × 8, s1 × 8]` in the Natural layout): multiplied
    /// by the weights' min m of the block it adds the min term m·s of formats with a min.
    pub(super) sx: [f32; 16],
}

impl QPair {
    pub(super) const ZERO: QPair = QPair {
        q: [0; 64],
        dx: [0.0; 16],
        corr: [0; 16],
        corr4: [0; 16],
        sx: [0.0; 16],
    };
}

/// Whether this CPU has the instructions these kernels use.
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    })
}

/// A block format with a VNNI kernel. Its values are read in *pairs* of 64: two blocks of 32
/// (formats with N = 32), or a quarter of a 256-value super-block (K formats).
pub trait Vnni: Block {
    const LAYOUT: Layout;
    /// The offset k added to signed weights to make them unsigned.
    const OFFSET: i32;
    /// Whether w = d·q + m has a min term (else the kernel skips it).
    const MIN: bool;
    /// Whether each 16-value chunk has its own weight scale (Q6_K) rather than each 32-value
    /// block (the `[d0, m0, d1, m1]` of `load_pair` then holds every scale of the pair).
    const CHUNK_SCALES: bool = false;
    /// Whether `block_scales` is `[scale of 32-value sub-block j (8), min of sub-block j (8)]`
    /// (Q4_K), from which the 8-bit GEMM takes four rows' pair scales with two shuffles.
    const SUB_BLOCK_SCALES: bool = false;
    /// Pair `p` of the weight block at `b` (N = 256; for N = 32 `p` is 0 and the pair is the
    /// block at `b` and, if `two`, the next one): 64 u8 weights in `LAYOUT`, each i32 lane's
    /// weight scale (in the lane order of `vpdpbusd`'s sums), and `[_, m0, _, m1]`, the min
    /// term of each 32-value half (w = d·q + m; 0 for formats without a min).
    ///
    /// # Safety
    /// AVX-512F/BW and F16C are available; `b` points at one (two if `two`) whole blocks.
    unsafe fn load_pair(b: *const u8, p: usize, two: bool) -> (__m512i, __m512, __m128);

    /// The scales of the whole block at `b` that `load_pair_scaled` reads its pairs' from,
    /// decoded once per row and block instead of once per pair (K formats pack 6- and 8-bit
    /// scales per super-block; unpacking them per pair cost more than the multiplications).
    /// Formats without block-wide scales return zeros and ignore them.
    ///
    /// # Safety
    /// As `load_pair`.
    #[inline(always)]
    unsafe fn block_scales(_b: *const u8) -> __m512 {
        _mm512_setzero_ps()
    }

    /// `load_pair`, given `block_scales(b)`: bit-identical results.
    ///
    /// # Safety
    /// As `load_pair`; `scales` is `block_scales(b)`.
    #[inline(always)]
    unsafe fn load_pair_scaled(b: *const u8, p: usize, two: bool, _scales: __m512) -> (__m512i, __m512, __m128) {
        Self::load_pair(b, p, two)
    }
}

#[inline(always)]
unsafe fn u16_at(b: *const u8) -> i32 {
    u16::from_le_bytes([*b, *b.add(1)]) as i32
}

#[inline(always)]
unsafe fn u32_at(b: *const u8) -> i32 {
    i32::from_le_bytes([*b, *b.add(1), *b.add(2), *b.add(3)])
}

/// Halves `[h0, h1, h2, h3]` (as two 32-bit words `lo`, `hi`) to f32.
#[inline(always)]
unsafe fn halves(lo: i32, hi: i32) -> __m128 {
    _mm_cvtph_ps(_mm_set_epi32(0, 0, hi, lo))
}

/// 16 packed nibble bytes of each of two blocks → the Nibbles layout.
#[inline(always)]
unsafe fn unpack_nibbles(q0: *const u8, q1: *const u8, two: bool) -> __m512i {
    let lo = _mm_loadu_si128(q0 as *const __m128i);
    let hi = if two { _mm_loadu_si128(q1 as *const __m128i) } else { _mm_setzero_si128() };
    split_nibbles(_mm256_set_m128i(hi, lo))
}

/// 32 bytes → `[their low nibbles, their high nibbles]`.
#[inline(always)]
pub(super) unsafe fn split_nibbles(q: __m256i) -> __m512i {
    let mask = _mm256_set1_epi8(0x0f);
    let low_nibbles = _mm256_and_si256(q, mask);
    let high_nibbles = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
    _mm512_inserti64x4(_mm512_castsi256_si512(low_nibbles), high_nibbles, 1)
}

/// Spreads `[d0, _, d1, _]` over the lanes of each block in `layout`.
#[inline(always)]
pub(super) unsafe fn per_lane(layout: Layout, dm: __m128) -> __m512 {
    _mm512_permutexvar_ps(scale_index(layout), _mm512_castps128_ps512(dm))
}

impl Vnni for formats::Q4_0 {
    const LAYOUT: Layout = Layout::Nibbles;
    const OFFSET: i32 = 8;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, two: bool) -> (__m512i, __m512, __m128) {
        let b1 = b.add(Self::BYTES);
        let d1 = if two { u16_at(b1) } else { 0 };
        let dm = halves(u16_at(b), d1);
        (unpack_nibbles(b.add(2), b1.add(2), two), per_lane(Self::LAYOUT, dm), dm)
    }
}

impl Vnni for formats::Q4_1 {
    const LAYOUT: Layout = Layout::Nibbles;
    const OFFSET: i32 = 0;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, two: bool) -> (__m512i, __m512, __m128) {
        let b1 = b.add(Self::BYTES);
        let dm1 = if two { u32_at(b1) } else { 0 };
        let dm = halves(u32_at(b), dm1);
        (unpack_nibbles(b.add(4), b1.add(4), two), per_lane(Self::LAYOUT, dm), dm)
    }
}

/// Q5 blocks: the Nibbles layout of the low 4 bits, with the fifth bits (one u32 per block, bit
/// j for value j) added as 16 where set.
#[inline(always)]
unsafe fn q5_pair(b: *const u8, qh: usize, qs: usize, bytes: usize, two: bool) -> __m512i {
    let b1 = b.add(bytes);
    let low = unpack_nibbles(b.add(qs), b1.add(qs), two);
    let (h0, h1) = (u32_at(b.add(qh)) as u32 as u64, if two { u32_at(b1.add(qh)) as u32 as u64 } else { 0 });
    // Byte i of the layout is value i of b0 (i < 16), of b1 (16..32), 16 + i of b0 (32..48)...
    let mask = (h0 & 0xffff) | (h1 & 0xffff) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
    _mm512_mask_add_epi8(low, mask, low, _mm512_set1_epi8(16))
}

impl Vnni for formats::Q5_0 {
    const LAYOUT: Layout = Layout::Nibbles;
    const OFFSET: i32 = 16;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, two: bool) -> (__m512i, __m512, __m128) {
        let d1 = if two { u16_at(b.add(Self::BYTES)) } else { 0 };
        let dm = halves(u16_at(b), d1);
        (q5_pair(b, 2, 6, Self::BYTES, two), per_lane(Self::LAYOUT, dm), dm)
    }
}

impl Vnni for formats::Q5_1 {
    const LAYOUT: Layout = Layout::Nibbles;
    const OFFSET: i32 = 0;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, two: bool) -> (__m512i, __m512, __m128) {
        let dm1 = if two { u32_at(b.add(Self::BYTES)) } else { 0 };
        let dm = halves(u32_at(b), dm1);
        (q5_pair(b, 4, 8, Self::BYTES, two), per_lane(Self::LAYOUT, dm), dm)
    }
}

impl Vnni for formats::Q8_0 {
    const LAYOUT: Layout = Layout::Natural;
    const OFFSET: i32 = 128;
    const MIN: bool = false;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, _p: usize, two: bool) -> (__m512i, __m512, __m128) {
        let b1 = b.add(Self::BYTES);
        let lo = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let (hi, d1) = if two {
            (_mm256_loadu_si256(b1.add(2) as *const __m256i), u16_at(b1))
        } else {
            (_mm256_setzero_si256(), 0)
        };
        let q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        // w + 128 as u8; a missing second block then reads as 128s against zero activations.
        let q = _mm512_xor_si512(q, _mm512_set1_epi8(-128));
        let dm = halves(u16_at(b), d1);
        (q, per_lane(Self::LAYOUT, dm), dm)
    }
}

impl Vnni for formats::Q4K {
    const LAYOUT: Layout = Layout::Natural;
    const OFFSET: i32 = 0;
    const MIN: bool = true;
    const SUB_BLOCK_SCALES: bool = true;
    #[inline(always)]
    unsafe fn load_pair(b: *const u8, p: usize, two: bool) -> (__m512i, __m512, __m128) {
        Self::load_pair_scaled(b, p, two, Self::block_scales(b))
    }

    /// `[d·sc_0..8, −dmin·m_0..8]` of the eight 32-value sub-blocks.
    #[inline(always)]
    unsafe fn block_scales(b: *const u8) -> __m512 {
        let (sc, m) = k4_scales_mins(b.add(4));
        let ints = _mm512_cvtepu8_epi32(_mm_set_epi64x(m as i64, sc as i64));
        let dd = halves(u32_at(b), 0); // [d, dmin, 0, 0]
        let dd = _mm_xor_ps(dd, _mm_set_ps(0.0, 0.0, -0.0, 0.0)); // [d, −dmin]
        let factors = _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(dd));
        _mm512_mul_ps(_mm512_cvtepi32_ps(ints), factors)
    }

    /// Pair p is the 32 bytes of group p: low nibbles are sub-block 2p, high ones 2p + 1, each
    /// with a 6-bit scale and min: w = d·sc·q − dmin·m.
    #[inline(always)]
    unsafe fn load_pair_scaled(b: *const u8, p: usize, _two: bool, scales: __m512) -> (__m512i, __m512, __m128) {
        let q = split_nibbles(_mm256_loadu_si256(b.add(16 + 32 * p) as *const __m256i));
        let p2 = 2 * p as i32;
        let dw = _mm512_permutexvar_ps(_mm512_set_epi32(p2 + 1, p2 + 1, p2 + 1, p2 + 1, p2 + 1, p2 + 1, p2 + 1, p2 + 1, p2, p2, p2, p2, p2, p2, p2, p2), scales);
        // [d·sc0, −dmin·m0, d·sc1, −dmin·m1] of the pair's two sub-blocks.
        let dm = _mm512_permutexvar_ps(_mm512_castsi128_si512(_mm_set_epi32(p2 + 9, p2 + 1, p2 + 8, p2)), scales);
        (q, dw, _mm512_castps512_ps128(dm))
    }
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K super-block (its 12 packed bytes at
/// `s`), each as one byte of a u64. Sub-blocks 0..4 keep theirs in the low 6 bits of bytes 0..4
/// (scales) and 4..8 (mins); sub-blocks 4..8 have their low 4 bits in the nibbles of bytes
/// 8..12 and their high 2 bits in the top bits of bytes 0..8 (see `formats::scale_min_k4`).
#[inline(always)]
unsafe fn k4_scales_mins(s: *const u8) -> (u64, u64) {
    let (a, b, c) = (u32_at(s) as u32, u32_at(s.add(4)) as u32, u32_at(s.add(8)) as u32);
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let sc_lo = a & LOW6;
    let sc_hi = (c & LOW4) | ((a >> 6) & LOW2) << 4;
    let m_lo = b & LOW6;
    let m_hi = ((c >> 4) & LOW4) | ((b >> 6) & LOW2) << 4;
    (sc_lo as u64 | (sc_hi as u64) << 32, m_lo as u64 | (m_hi as u64) << 32)
}

impl Vnni for formats::Q6K {
    const LAYOUT: Layout = Layout::Natural;
    const OFFSET: i32 = 32;
    const MIN: bool = false;
    const CHUNK_SCALES: bool = true;
    /// Pair p is quadrants 2(p%2) and 2(p%2)+1 of half p/2: 4 low bits from a nibble of ql
    /// (low nibbles for the first quadrant pair, high for the second), 2 high bits from qh;
    /// an i8 scale per 16 values, so four per pair: w = d·sc·(q − 32).
    #[inline(always)]
    unsafe fn load_pair_scaled(b: *const u8, p: usize, _two: bool, scales: __m512) -> (__m512i, __m512, __m128) {
        let (h, second) = (p / 2, p % 2 == 1);
        let ql = _mm512_loadu_si512(b.add(64 * h) as *const _);
        let ql = if second { _mm512_srli_epi16(ql, 4) } else { ql };
        let ql = _mm512_and_si512(ql, _mm512_set1_epi8(0x0f));
        // The same 32 qh bytes serve both quadrants, shifted by 2·quadrant.
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * h) as *const __m256i));
        let shift = if second { _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4) } else { _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0) };
        let shift = _mm512_or_si512(shift, _mm512_slli_epi64(shift, 16));
        let shift = _mm512_or_si512(shift, _mm512_slli_epi64(shift, 32));
        let qh = _mm512_and_si512(_mm512_srlv_epi16(qh, shift), _mm512_set1_epi8(3));
        let q = _mm512_or_si512(ql, _mm512_slli_epi16(qh, 4));
        // Scales 4p..4p + 4, one per 16 values.
        let k = 4 * p as i32;
        let idx = _mm512_set_epi32(k + 3, k + 3, k + 3, k + 3, k + 2, k + 2, k + 2, k + 2, k + 1, k + 1, k + 1, k + 1, k, k, k, k);
        (q, _mm512_permutexvar_ps(idx, scales), _mm_setzero_ps())
    }

    #[inline(always)]
    unsafe fn load_pair(b: *const u8, p: usize, two: bool) -> (__m512i, __m512, __m128) {
        Self::load_pair_scaled(b, p, two, Self::block_scales(b))
    }

    /// `d·sc_k` of the sixteen 16-value chunks.
    #[inline(always)]
    unsafe fn block_scales(b: *const u8) -> __m512 {
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192) as *const __m128i));
        _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(_mm_cvtss_f32(halves(u16_at(b.add(208)), 0))))
    }
}

/// Which block (0 or 1 of the pair) each i32 lane of the accumulator belongs to, as an index
/// into `[d0, m0, d1, m1]`.
#[inline(always)]
pub(super) unsafe fn scale_index(layout: Layout) -> __m512i {
    match layout {
        Layout::Nibbles => _mm512_set_epi32(2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0),
        Layout::Natural => _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
    }
}

/// Quantizes 32 activations to int8 exactly as llama.cpp's x86 quantize_row_q8_0/q8_1 do
/// (q = round-to-even(x·127/amax), scale stored as f16), so that on the same weights both
/// engines multiply the same integers and their 8-bit rounding errors coincide instead of adding
/// up. Returns the two halves of 16 values, d (f16-rounded) and s = d·Σq (f16-rounded, from the
/// unrounded d, as llama.cpp's q8_1).
#[inline(always)]
unsafe fn quantize_block(x: *const f32) -> (__m128i, __m128i, f32, f32) {
    let (v0, v1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    let d = amax / 127.0;
    let id = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    // The default MXCSR rounding: to nearest, ties to even.
    let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
    let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
    let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    (_mm512_cvtsepi32_epi8(q0), _mm512_cvtsepi32_epi8(q1), round_f16(d), round_f16(d * sum as f32))
}

/// `v` rounded to the nearest f16 (to even), back in f32.
#[inline(always)]
unsafe fn round_f16(v: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_set_ss(v))))
}

/// Quantizes `x` (a multiple of 32 values) into `out` for a format `V`, one `QPair` per two
/// blocks (an odd last block gets a zero partner).
///
/// # Safety
/// `available()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn quantize<V: Vnni>(x: &[f32], out: &mut Vec<QPair>) {
    assert!(x.len() % 32 == 0);
    out.clear();
    out.resize(x.len().div_ceil(64), QPair::ZERO);
    quantize_into::<V>(x, out)
}

/// `quantize` into a slice of `x.len().div_ceil(64)` pairs.
///
/// # Safety
/// `available()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn quantize_into<V: Vnni>(x: &[f32], out: &mut [QPair]) {
    assert!(out.len() == x.len().div_ceil(64));
    quantize_strided::<V>(x, out.as_mut_ptr(), 1)
}

/// `quantize_into` writing pair p at `out + p·stride`.
///
/// # Safety
/// `available()`; `out + p·stride` is valid for writes for every pair p of `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn quantize_strided<V: Vnni>(x: &[f32], out: *mut QPair, stride: usize) {
    assert!(x.len() % 32 == 0);
    let blocks = x.len() / 32;
    for p in 0..blocks.div_ceil(2) {
        let pair = &mut *out.add(p * stride);
        let mut bytes = _mm512_setzero_si512();
        let (mut d, mut s) = ([0f32; 2], [0f32; 2]);
        for j in 0..2.min(blocks - 2 * p) {
            let (lo, hi, dj, sj) = quantize_block(x.as_ptr().add((2 * p + j) * 32));
            let (at_lo, at_hi) = match V::LAYOUT {
                Layout::Nibbles => (j, 2 + j),
                Layout::Natural => (2 * j, 2 * j + 1),
            };
            bytes = insert_128(bytes, lo, at_lo);
            bytes = insert_128(bytes, hi, at_hi);
            d[j] = dj;
            s[j] = sj;
        }
        _mm512_storeu_si512(pair.q.as_mut_ptr() as *mut _, bytes);
        let dx = _mm512_permutexvar_ps(scale_index(V::LAYOUT), _mm512_castps128_ps512(_mm_set_ps(0.0, d[1], 0.0, d[0])));
        _mm512_storeu_ps(pair.dx.as_mut_ptr(), dx);
        // Σ of each lane's 4 activations, by the same instruction with weights of 1.
        let lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), bytes);
        let corr = _mm512_mullo_epi32(lane_sums, _mm512_set1_epi32(-V::OFFSET));
        _mm512_storeu_si512(pair.corr.as_mut_ptr() as *mut _, corr);
        let c2 = _mm512_add_epi32(_mm512_unpacklo_epi32(corr, corr), _mm512_unpackhi_epi32(corr, corr));
        let c4 = _mm512_add_epi32(_mm512_unpacklo_epi64(c2, c2), _mm512_unpackhi_epi64(c2, c2));
        _mm512_storeu_si512(pair.corr4.as_mut_ptr() as *mut _, c4);
        let sx = _mm512_permutexvar_ps(scale_index(V::LAYOUT), _mm512_castps128_ps512(_mm_set_ps(0.0, s[1], 0.0, s[0])));
        _mm512_storeu_ps(pair.sx.as_mut_ptr(), sx);
    }
}

#[inline(always)]
unsafe fn insert_128(v: __m512i, part: __m128i, at: usize) -> __m512i {
    match at {
        0 => _mm512_inserti32x4::<0>(v, part),
        1 => _mm512_inserti32x4::<1>(v, part),
        2 => _mm512_inserti32x4::<2>(v, part),
        _ => _mm512_inserti32x4::<3>(v, part),
    }
}

/// The sum of an accumulator's lanes and of a min-term accumulator's.
#[inline(always)]
pub(super) unsafe fn finish(acc: __m512, macc: __m128) -> f32 {
    let m = _mm_add_ps(macc, _mm_movehl_ps(macc, macc));
    _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps::<1>(m, m)))
}

/// How far ahead of the rows being read to prefetch: the rows of the next group (`group`
/// bytes on), at least `FERROLM_PREFETCH` bytes (default 1024; 0 turns it off). A decode step reads
/// each weight once, so the kernel waits on memory; the hardware prefetcher alone does not keep
/// up with four interleaved row streams.
#[inline(always)]
pub(super) fn prefetch_distance(group: usize) -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min = *MIN.get_or_init(|| std::env::var("FERROLM_PREFETCH").ok().and_then(|v| v.parse().ok()).unwrap_or(1024));
    // 0: the line being read anyway (a no-op prefetch, never an unmapped address).
    group * min.div_ceil(group)
}

/// Prefetches the line at `p` into L2, not L1: a T0 prefetch holds one of the core's few L1
/// miss buffers until its line arrives, and with the loads of four row streams already waiting
/// on memory that capped a thread at ~9 GB/s (measured: F16 decode 35 → 57–72 tok/s on one
/// thread with T2; the L1 fill from L2 then overlaps the arithmetic).
#[inline(always)]
pub(super) unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T2>(p as *const i8);
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The int8 dot product against f64 on the same dequantized weights. Each activation is
    /// rounded to within d/2 = amax_b/254 of its value, and the f16 scale d₁₆ differs from d by
    /// at most 2⁻¹¹·d, i.e. at most 127·2⁻¹¹·d = amax_b/2048 per value: so a row's product moves
    /// by at most Σ_b amax_b·(1/254 + 1/2048)·Σ_{i∈b}|w_i|. The f16-rounded s (formats with a
    /// min) and f32 sums add at most ~2⁻¹¹ relative to Σ|w·x| (slack 1e-3·Σ|w·x|). On random data
    /// the error must also stay well below 1% of Σ|w·x|.
    fn check<V: Vnni>(cols: usize) {
        if !available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        let rows = 11;
        let mut rnd = uniform(0x9e3779b97f4a7c15);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let x: Vec<f32> = (0..cols).map(|i| rnd() * if i % 7 == 0 { 5.0 } else { 1.0 }).collect();
        let w = quantize_rows::<V>(&wf, rows, cols);
        let mut wd = vec![0f32; rows * cols];
        for (blk, o) in w.chunks_exact(V::BYTES).zip(wd.chunks_exact_mut(V::N)) {
            V::dequant(blk, o);
        }
        let mut xq = Vec::new();
        // SAFETY: VNNI was detected above.
        unsafe { quantize::<V>(&x, &mut xq) };
        let mut got = vec![0f32; rows];
        // SAFETY: as above; `w` holds `rows` whole rows.
        unsafe { super::super::vnni_gemm::gemv::<V>(&w, cols, &xq, 0..rows, &mut |r, v| got[r] = v) };
        for r in 0..rows {
            let row = &wd[r * cols..(r + 1) * cols];
            let exact: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            let abs: f64 = row.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            let bound: f64 = (0..cols / 32)
                .map(|b| {
                    let amax = x[b * 32..b * 32 + 32].iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                    amax * (1.0 / 254.0 + 1.0 / 2048.0) * row[b * 32..b * 32 + 32].iter().map(|v| v.abs() as f64).sum::<f64>()
                })
                .sum();
            let err = (got[r] as f64 - exact).abs();
            assert!(err <= bound + 1e-3 * abs, "row {r}: error {err} > bound {bound}");
            assert!(err <= 0.01 * abs, "row {r}: error {err} vs Σ|w·x| {abs}");
        }
    }

    /// Quantizes f32 rows with candle's reference quantizer.
    /// Deterministic values in [-1, 1) (xorshift64), for the kernels' tests.
    pub(in crate::cpu) fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    pub(in crate::cpu) fn quantize_rows<V: Vnni>(wf: &[f32], rows: usize, cols: usize) -> Vec<u8> {
        use candle_core::quantized::{GgmlDType, QTensor};
        let dt = match V::BYTES {
            18 => GgmlDType::Q4_0,
            20 => GgmlDType::Q4_1,
            22 => GgmlDType::Q5_0,
            24 => GgmlDType::Q5_1,
            144 => GgmlDType::Q4K,
            210 => GgmlDType::Q6K,
            _ => GgmlDType::Q8_0,
        };
        let t = candle_core::Tensor::from_slice(wf, (rows, cols), &candle_core::Device::Cpu).unwrap();
        QTensor::quantize(&t, dt).unwrap().data().unwrap().to_vec()
    }

    #[test]
    fn q4_1_within_int8_rounding_bound() {
        check::<formats::Q4_1>(576);
        check::<formats::Q4_1>(1536);
        check::<formats::Q4_1>(96); // odd number of blocks
    }

    #[test]
    fn q4_0_within_int8_rounding_bound() {
        check::<formats::Q4_0>(576);
        check::<formats::Q4_0>(96);
    }

    #[test]
    fn q5_within_int8_rounding_bound() {
        check::<formats::Q5_0>(576);
        check::<formats::Q5_0>(96);
        check::<formats::Q5_1>(576);
        check::<formats::Q5_1>(96);
    }

    #[test]
    fn q4_k_within_int8_rounding_bound() {
        check::<formats::Q4K>(512);
        check::<formats::Q4K>(1536);
    }

    /// The whole-block scale decode gives every sub-block's scale and min as the reference's
    /// per-sub-block extraction does, on scale bytes with all bit patterns.
    #[test]
    fn q4_k_block_scales_match_per_sub_block() {
        let mut rnd = uniform(0x2545f4914f6cdd1d);
        for _ in 0..1000 {
            let bytes: Vec<u8> = (0..12).map(|_| ((rnd() + 1.0) * 128.0) as u8).collect();
            // SAFETY: 12 readable bytes.
            let (sc, m) = unsafe { k4_scales_mins(bytes.as_ptr()) };
            for j in 0..8 {
                let want = formats::scale_min_k4(j, &bytes);
                assert_eq!(((sc >> (8 * j)) as u8 as f32, (m >> (8 * j)) as u8 as f32), want, "sub-block {j} of {bytes:?}");
            }
        }
    }

    #[test]
    fn q6_k_within_int8_rounding_bound() {
        check::<formats::Q6K>(512);
        check::<formats::Q6K>(1536);
    }

    #[test]
    fn q8_0_within_int8_rounding_bound() {
        check::<formats::Q8_0>(576);
        check::<formats::Q8_0>(96);
    }
}
