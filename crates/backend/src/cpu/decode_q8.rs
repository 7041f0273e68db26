//! Decode attention's q·k over 8- or 4-bit key rows (`kv_quant`) with integer dot products on
//! AVX-512 VNNI, as llama.cpp does for its q8_0 / q4_0 KV: the query is rounded once per step to
//! int8 in blocks of 32 values (`d = max|q| / 127`, `q8 = round(q / d)`), laid out in the order
//! the rows' codes load into a zmm, and `vpdpbusd` multiplies 64 unsigned codes by 64 signed
//! query values per instruction. Per key row and query head:
//!
//! ```text
//! q·k ≈ Σ_groups scale_g · Σ_{32-blocks b ⊂ g} d_b · Σ_{i ∈ b} q8_i · code_i  +  Σ_g bias_g · Σ_{i ∈ g} q_i
//! ```
//!
//! the integer sums exact, the bias term with the float query's group sums (so the query's
//! rounding touches only the code term). Each key row is loaded once for all query heads of its
//! kv head (the float path reads it once per query head). Like the other 8-bit-activation
//! kernels this moves results slightly, so exact activations (`FERROLM_CPU_EXACT=1`) keep the
//! float path.

#![cfg(target_arch = "x86_64")]

use super::kv_rows::QKv;
use std::arch::x86_64::*;

/// Largest head size taken: 4 chunks of 64 values, at most 8 groups (their scales and biases,
/// 16 f16, widen into one zmm).
pub const MAX_D: usize = 256;
const MAX_CHUNKS: usize = MAX_D / 64;
/// Query heads per kv head taken (the prepared queries sit on the stack).
pub const MAX_HEADS: usize = 16;

/// Whether the int8 path runs: the CPU has VNNI and activations may be rounded.
pub fn wanted() -> bool {
    super::vnni::available() && !super::exact_activations()
}

/// Whether [`dots`] takes rows of head size `d` with `heads` query heads per kv head.
pub fn supports(d: usize, heads: usize) -> bool {
    d % 64 == 0 && d <= MAX_D && heads <= MAX_HEADS
}

/// The value (within its 64-value chunk) whose code sits at byte `p` of the chunk's zmm: 8 bits
/// load in order; 4 bits load two 32-value blocks' 16 bytes as `[low nibbles, high nibbles]`,
/// i.e. `[b0 0..16, b1 0..16, b0 16..32, b1 16..32]` (`kv_quant`'s nibble order).
pub fn value_at(bits: u8, p: usize) -> usize {
    match (bits, p / 16) {
        (8, _) => p,
        (_, 0) => p,
        (_, 1) => 32 + p % 16,
        (_, 2) => 16 + p % 16,
        _ => 48 + p % 16,
    }
}

/// One 32-value block of the query rounded to int8: its scale `d` and values `round(q / d)`.
pub fn round_block(q: &[f32]) -> (f32, [i8; 32]) {
    let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let mut out = [0i8; 32];
    if d > 0.0 {
        for (o, x) in out.iter_mut().zip(q) {
            *o = (x / d).round().clamp(-127.0, 127.0) as i8;
        }
    }
    (d, out)
}

/// One query head prepared for the rows: per chunk its int8 values in code order and each
/// lane's block scale `d`; `[0, S0, 0, S1, ..]` (S_g the float sum of group g), which times the
/// rows' `[s0, b0, s1, b1, ..]` gives the bias term.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct HeadQ8 {
    q8: [[i8; 64]; MAX_CHUNKS],
    lane_d: [[f32; 16]; MAX_CHUNKS],
    bias_sums: [f32; 16],
}

impl HeadQ8 {
    const ZERO: HeadQ8 = HeadQ8 { q8: [[0; 64]; MAX_CHUNKS], lane_d: [[0.0; 16]; MAX_CHUNKS], bias_sums: [0.0; 16] };

    /// `q` prepared: the rounding of [`round_block`] and the order of [`value_at`], 16 values
    /// at a time in registers (the scalar form, `new_scalar`, cost ~1 µs per head and step:
    /// a third of the int8 path's time at 512 keys).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL available; `q.len()` a multiple of 64, at most `MAX_D`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn new(q: &[f32], bits: u8, group: usize) -> Self {
        let mut h = Self::ZERO;
        for c in 0..q.len() / 64 {
            for b in 0..2 {
                let at = c * 64 + 32 * b;
                let x = [_mm512_loadu_ps(q.as_ptr().add(at)), _mm512_loadu_ps(q.as_ptr().add(at + 16))];
                let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1])));
                let d = amax / 127.0;
                for (half, xs) in x.iter().enumerate() {
                    // Where these 16 values' codes sit among the chunk's 64 bytes.
                    let from = 32 * b + 16 * half;
                    let to = (0..4).map(|k| 16 * k).find(|&p| value_at(bits, p) == from).unwrap_or(from);
                    let packed = if d > 0.0 { _mm512_cvtepi32_epi8(round_away(_mm512_div_ps(*xs, _mm512_set1_ps(d)))) } else { _mm_setzero_si128() };
                    _mm_storeu_si128(h.q8[c].as_mut_ptr().add(to) as *mut __m128i, packed);
                    for l in to / 4..to / 4 + 4 {
                        h.lane_d[c][l] = d;
                    }
                }
            }
        }
        for (g, xs) in q.chunks_exact(group).enumerate() {
            h.bias_sums[2 * g + 1] = xs.iter().sum();
        }
        h
    }

    #[cfg(test)]
    fn new_scalar(q: &[f32], bits: u8, group: usize) -> Self {
        let mut h = Self::ZERO;
        let mut blocks = [(0f32, [0i8; 32]); MAX_D / 32];
        for (b, xs) in blocks.iter_mut().zip(q.chunks_exact(32)) {
            *b = round_block(xs);
        }
        for (c, (q8, lane_d)) in h.q8.iter_mut().zip(&mut h.lane_d).take(q.len() / 64).enumerate() {
            for (p, x) in q8.iter_mut().enumerate() {
                let v = c * 64 + value_at(bits, p);
                *x = blocks[v / 32].1[v % 32];
            }
            for (l, d) in lane_d.iter_mut().enumerate() {
                *d = blocks[(c * 64 + value_at(bits, 4 * l)) / 32].0;
            }
        }
        for (g, xs) in q.chunks_exact(group).enumerate() {
            h.bias_sums[2 * g + 1] = xs.iter().sum();
        }
        h
    }
}

/// `round(x)` as `f32::round` (halves away from zero), clamped to ±127, as i32 lanes: rounded
/// to nearest even, then the exact halves (x − trunc(x) = ±0.5) moved away from zero.
#[inline(always)]
unsafe fn round_away(x: __m512) -> __m512i {
    let trunc = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(x);
    let even = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let halves = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(_mm512_sub_ps(x, trunc)), _mm512_set1_ps(0.5));
    // ±1 with x's sign (integer ops: the float forms need AVX-512 DQ).
    let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
    let away = _mm512_add_ps(trunc, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0)), sign)));
    let r = _mm512_mask_blend_ps(halves, even, away);
    _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0)), _mm512_set1_ps(127.0)))
}

/// For each chunk, each lane's index of its group's scale in `[s0, b0, s1, b1, ..]`.
fn scale_index(bits: u8, group: usize) -> [[i32; 16]; MAX_CHUNKS] {
    let mut idx = [[0; 16]; MAX_CHUNKS];
    for (c, lanes) in idx.iter_mut().enumerate() {
        for (l, i) in lanes.iter_mut().enumerate() {
            *i = (2 * ((c * 64 + value_at(bits, 4 * l)) / group) % 16) as i32;
        }
    }
    idx
}

/// Affine key rows as [`dots`] reads them: 64 or 32 bytes at a time from a row. A row's bytes
/// need not lie in one piece (TurboQuant's key rows straddle its two stored halves).
pub trait KeyBytes: Sync {
    /// Where row (`head`, `token`) is.
    type Row: Copy;
    fn quant(&self) -> crate::kv_quant::KvQuant;
    fn d(&self) -> usize;
    fn key_row(&self, head: usize, token: usize) -> Self::Row;
    /// Bytes `at..at + 64` of `row`.
    ///
    /// # Safety
    /// AVX-512 F/BW available; the bytes lie in the row.
    unsafe fn load64(&self, row: Self::Row, at: usize) -> __m512i;
    /// Bytes `at..at + 32` of `row`, the bytes outside `mask` zero (and not read).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL available; the bytes in `mask` lie in the row.
    unsafe fn load32(&self, row: Self::Row, at: usize, mask: __mmask32) -> __m256i;
}

impl KeyBytes for QKv<'_> {
    type Row = *const u8;
    fn quant(&self) -> crate::kv_quant::KvQuant {
        self.quant
    }
    fn d(&self) -> usize {
        self.d
    }
    #[inline(always)]
    fn key_row(&self, head: usize, token: usize) -> *const u8 {
        self.row(head, token).as_ptr()
    }
    #[inline(always)]
    unsafe fn load64(&self, row: *const u8, at: usize) -> __m512i {
        _mm512_loadu_si512(row.add(at) as *const __m512i)
    }
    #[inline(always)]
    unsafe fn load32(&self, row: *const u8, at: usize, mask: __mmask32) -> __m256i {
        if mask == u32::MAX {
            _mm256_loadu_si256(row.add(at) as *const __m256i)
        } else {
            _mm256_maskz_loadu_epi8(mask, row.add(at) as *const i8)
        }
    }
}

/// Raw q·k (unscaled) of the query heads `q` (`[G, d]`, rotated like the rows) with keys
/// `lo..lo + n` of kv head `h` into `out[g * n + j]`. Callers check [`wanted`] and
/// [`supports`].
pub fn dots<K: KeyBytes>(k: &K, q: &[f32], h: usize, lo: usize, n: usize, out: &mut [f32]) {
    let (d, quant) = (k.d(), k.quant());
    let heads = q.len() / d;
    assert!(wanted() && supports(d, heads) && out.len() >= heads * n);
    let mut prepared = [HeadQ8::ZERO; MAX_HEADS];
    for (p, qh) in prepared.iter_mut().zip(q.chunks_exact(d)) {
        // SAFETY: `wanted` checked AVX-512 F/BW/VL; `supports` the length.
        *p = unsafe { HeadQ8::new(qh, quant.bits, quant.group) };
    }
    let index = scale_index(quant.bits, quant.group);
    // SAFETY: `wanted` checked AVX-512 VNNI (with F, BW, VL, F16C, FMA).
    unsafe {
        match (d / 64, quant.bits) {
            (1, 8) => dots_vnni::<K, 1, false>(k, &prepared[..heads], &index, h, lo, n, out),
            (2, 8) => dots_vnni::<K, 2, false>(k, &prepared[..heads], &index, h, lo, n, out),
            (3, 8) => dots_vnni::<K, 3, false>(k, &prepared[..heads], &index, h, lo, n, out),
            (4, 8) => dots_vnni::<K, 4, false>(k, &prepared[..heads], &index, h, lo, n, out),
            (1, _) => dots_vnni::<K, 1, true>(k, &prepared[..heads], &index, h, lo, n, out),
            (2, _) => dots_vnni::<K, 2, true>(k, &prepared[..heads], &index, h, lo, n, out),
            (3, _) => dots_vnni::<K, 3, true>(k, &prepared[..heads], &index, h, lo, n, out),
            _ => dots_vnni::<K, 4, true>(k, &prepared[..heads], &index, h, lo, n, out),
        }
    }
}

/// Chunk `c`'s 64 codes of `row` in code order (see [`value_at`]).
#[inline(always)]
unsafe fn load_codes<K: KeyBytes, const NIBBLES: bool>(k: &K, row: K::Row, c: usize) -> __m512i {
    if NIBBLES {
        super::vnni::split_nibbles(k.load32(row, 32 * c, u32::MAX))
    } else {
        k.load64(row, 64 * c)
    }
}

/// Rows per tile: their sums are reduced together (one 16 × 16 transpose-add instead of a
/// horizontal sum per row and head).
const TILE: usize = 16;

/// # Safety
/// AVX-512 F/BW/VL/VNNI, F16C and FMA available; keys `lo..lo + n` of head `h` exist in `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn dots_vnni<K: KeyBytes, const C: usize, const NIBBLES: bool>(k: &K, heads: &[HeadQ8], index: &[[i32; 16]; MAX_CHUNKS], h: usize, lo: usize, n: usize, out: &mut [f32]) {
    let (d, quant) = (k.d(), k.quant());
    let params_at = quant.code_bytes(d);
    // The row's `groups` (scale, bias) pairs: 4 bytes each; the mask keeps the load in the row.
    let params_mask: __mmask32 = ((1u64 << (4 * (d / quant.group))) - 1) as __mmask32;
    let index: [__m512i; C] = std::array::from_fn(|c| _mm512_loadu_si512(index[c].as_ptr() as *const __m512i));
    // A tile's rows as every head reads them: codes, each lane's group scale, [s0, b0, ..].
    let mut codes = [[_mm512_setzero_si512(); C]; TILE];
    let mut scales = [[_mm512_setzero_ps(); C]; TILE];
    let mut params = [_mm512_setzero_ps(); TILE];
    for j0 in (0..n).step_by(TILE) {
        let m = (n - j0).min(TILE);
        for r in 0..m {
            let row = k.key_row(h, lo + j0 + r);
            params[r] = _mm512_cvtph_ps(k.load32(row, params_at, params_mask));
            for c in 0..C {
                codes[r][c] = load_codes::<K, NIBBLES>(k, row, c);
                scales[r][c] = _mm512_permutexvar_ps(index[c], params[r]);
            }
        }
        for (g, hq) in heads.iter().enumerate() {
            let bias_sums = _mm512_load_ps(hq.bias_sums.as_ptr());
            let q8: [__m512i; C] = std::array::from_fn(|c| _mm512_load_si512(hq.q8[c].as_ptr() as *const __m512i));
            let lane_d: [__m512; C] = std::array::from_fn(|c| _mm512_load_ps(hq.lane_d[c].as_ptr()));
            let mut acc = [_mm512_setzero_ps(); TILE];
            for r in 0..m {
                let mut a = _mm512_mul_ps(params[r], bias_sums);
                for c in 0..C {
                    let ints = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[r][c], q8[c]);
                    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(scales[r][c], lane_d[c]), a);
                }
                acc[r] = a;
            }
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(g * n + j0), ((1u32 << m) - 1) as __mmask16, sum_each(&acc));
        }
    }
}

/// Lane i of the result: the sum of the 16 lanes of `x[i]` (a transpose-add in four levels).
#[inline(always)]
unsafe fn sum_each(x: &[__m512; 16]) -> __m512 {
    // Pairs: per 128-bit chunk [a0+a2, b0+b2, a1+a3, b1+b3].
    let pair = |a: __m512, b: __m512| _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    let p: [__m512; 8] = std::array::from_fn(|i| pair(x[2 * i], x[2 * i + 1]));
    // Quads: per chunk [Σa, Σb, Σc, Σd] over the chunk.
    let quad = |a: __m512, b: __m512| _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b));
    let q: [__m512; 4] = std::array::from_fn(|i| quad(p[2 * i], p[2 * i + 1]));
    // Chunks: [a's chunks 0+1, a's 2+3, b's 0+1, b's 2+3].
    let chunks = |a: __m512, b: __m512| _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b));
    let (c0, c1) = (chunks(q[0], q[1]), chunks(q[2], q[3]));
    chunks(c0, c1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized query preparation gives the scalar one's bits: int8 values (ties at
    /// exact halves included), lane scales, group sums; 8 and 4 bits, groups 32–128.
    #[test]
    fn prepared_queries_equal_the_scalar_form() {
        if !super::super::vnni::available() {
            return;
        }
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        };
        for d in [64, 128, 192, 256] {
            for round in 0..20 {
                let mut q: Vec<f32> = (0..d).map(|_| next()).collect();
                if round % 2 == 0 {
                    // Each block's max 127, so d = 1 and halves are exact ties.
                    for (i, x) in q.iter_mut().enumerate() {
                        *x = if i % 32 == 0 { 127.0 } else { ((i * 7 % 255) as f32 - 127.0) / 2.0 };
                    }
                }
                if round == 3 {
                    q[..32].fill(0.0);
                }
                for (bits, group) in [(8, 32), (8, 128), (4, 32), (4, 64)] {
                    let (fast, slow) = (unsafe { HeadQ8::new(&q, bits, group) }, HeadQ8::new_scalar(&q, bits, group));
                    assert_eq!(fast.q8, slow.q8, "d{d} {bits} bits");
                    assert_eq!(fast.lane_d.map(|l| l.map(f32::to_bits)), slow.lane_d.map(|l| l.map(f32::to_bits)));
                    assert_eq!(fast.bias_sums.map(f32::to_bits), slow.bias_sums.map(f32::to_bits));
                }
            }
        }
    }
}
