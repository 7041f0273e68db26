//! TurboQuant rows (`--kv-quant turbo`, `kv_quant::turbo`) as the CPU attention kernels read
//! them in place, with no f32 copy of the cache per step (mlx-bun decodes the whole cache on
//! every fetch; so did ferrolm before).
//!
//! A TurboQuant cache stores each (head, token)'s key row then value row as one joined row cut
//! into two equal halves, its `k` and `v` rows (`turbo::half_bytes`). A key row (affine, 8 or 4
//! bits, not rotated) is longer than a half, so it starts in the first half and ends in the
//! second: the int8 decode kernel (`decode_q8`) loads its bytes with two masked loads where a
//! load crosses the cut; the float paths copy it to the stack first. A value row lies wholly in
//! the second half.
//!
//! Values are read in the rotated domain — centroid × the group's RMS, `turbo::decode_rotated`
//! — and summed so, weighted by the softmax; the caller rotates each head's output back once
//! (`turbo::unrotate`: the transform is linear, so rotating the weighted sum equals summing the
//! rotated rows), instead of rotating every cached row back on every step.

use super::attn::Kv;
use super::kv_rows::WidenRows;
use crate::kv_quant::{turbo, KvQuant};

/// Key rows assembled on the stack: head size 1024 at 8 bits (1,024 codes + 32 × 4 bytes).
const MAX_KEY_BYTES: usize = 1152;

/// TurboQuant rows of head size `d`: the first and second halves `[H, S, half]` (strides as
/// `Kv`), read as key rows or (`values`) as value rows in the rotated domain.
#[derive(Clone, Copy)]
pub struct TurboKv<'a> {
    pub first: Kv<'a, u8>,
    pub second: Kv<'a, u8>,
    pub quant: KvQuant,
    pub d: usize,
    /// This view reads the value rows (else the key rows).
    pub values: bool,
    half: usize,
    key_bytes: usize,
    /// The value codebook, zero beyond its entries (a lookup table of 16 lanes).
    book: [f32; 16],
    /// Bit offset of each of 16 consecutive values' codes within its lane's word (`codes16`).
    shifts: [i32; 16],
}

impl<'a> TurboKv<'a> {
    /// `quant` a TurboQuant format (`KvQuant::turbo`) with `d` taken by it; panics otherwise.
    pub fn new(first: Kv<'a, u8>, second: Kv<'a, u8>, quant: KvQuant, d: usize, values: bool) -> Self {
        let bits = quant.turbo_values.expect("a TurboQuant format");
        assert!(d.is_multiple_of(64) && quant.row_bytes(d) <= MAX_KEY_BYTES, "TurboQuant rows of head size {d}");
        let mut book = [0f32; 16];
        book[..1 << bits].copy_from_slice(turbo::codebook(bits));
        let shifts = std::array::from_fn(|i| (i % 8 * bits as usize) as i32);
        Self {
            first,
            second,
            quant,
            d,
            values,
            half: turbo::half_bytes(quant, d),
            key_bytes: quant.row_bytes(d),
            book,
            shifts,
        }
    }

    /// The same rows read as values (`true`) or keys.
    pub fn reading_values(self, values: bool) -> Self {
        Self { values, ..self }
    }

    fn value_bits(&self) -> u8 {
        self.quant.turbo_values.unwrap_or(3)
    }

    /// Key row (`head`, `token`) into `out[..key_bytes]`.
    #[inline(always)]
    pub(crate) fn key_row_into(&self, head: usize, token: usize, out: &mut [u8]) {
        let (kb, half) = (self.key_bytes, self.half);
        out[..half].copy_from_slice(self.first.row(head, token, half));
        out[half..kb].copy_from_slice(&self.second.row(head, token, half)[..kb - half]);
    }

    /// Value row (`head`, `token`): the end of its second half.
    #[inline(always)]
    pub(crate) fn value_row(&self, head: usize, token: usize) -> &[u8] {
        &self.second.row(head, token, self.half)[self.key_bytes - self.half..]
    }
}

impl WidenRows for TurboKv<'_> {
    /// Keys dequantized; values decoded in the rotated domain (the caller rotates the output).
    #[inline(always)]
    fn widen_row(&self, head: usize, token: usize, out: &mut [f32]) {
        if self.values {
            turbo::decode_rotated(self.value_bits(), self.value_row(head, token), out);
        } else {
            let mut row = [0u8; MAX_KEY_BYTES];
            self.key_row_into(head, token, &mut row);
            self.quant.keys().dequantize_row(&row[..self.key_bytes], out);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::TurboKv;
    use crate::cpu::attn::Kv;
    use crate::cpu::decode_attn::{Rows, MAX_GROUPS};
    use crate::cpu::decode_q8::{self, KeyBytes};
    use crate::cpu::kv_rows::QKv;
    use crate::kv_quant::KvQuant;
    use std::arch::x86_64::*;

    impl TurboKv<'_> {
        /// 16 values' codes from `col` (a multiple of 16) of the value row at `row`, as i32
        /// lanes: lanes 0–7 broadcast the 32-bit word holding values col..col+8, lanes 8–15 the
        /// one holding col+8..col+16 (`bits` bytes on), each lane shifting out its own code
        /// (broadcast loads, one shift, one mask; no cross-lane work but the lookup after).
        #[inline(always)]
        unsafe fn codes16(&self, row: *const u8, col: usize) -> __m512i {
            let bits = self.value_bits() as usize;
            let at = row.add(col * bits / 8);
            // In the row: the second word ends 4 − bits bytes past the codes, within the RMS
            // values that follow (d/16 ≥ 4 bytes).
            let words = _mm512_set1_epi32((at as *const i32).read_unaligned());
            let words = _mm512_mask_set1_epi32(words, 0xff00, (at.add(bits) as *const i32).read_unaligned());
            let shifted = _mm512_srlv_epi32(words, _mm512_loadu_si512(self.shifts.as_ptr() as *const __m512i));
            _mm512_and_si512(shifted, _mm512_set1_epi32((1 << bits) - 1))
        }

        /// The codebook times the RMS of the group holding `col` (the value row at `row`).
        #[inline(always)]
        unsafe fn scaled_book(&self, row: *const u8, col: usize) -> __m512 {
            let at = self.d * self.value_bits() as usize / 8 + col / crate::kv_quant::turbo::GROUP * 2;
            let rms = _mm_cvtph_ps(_mm_cvtsi32_si128((row.add(at) as *const u16).read_unaligned() as i32));
            _mm512_mul_ps(_mm512_loadu_ps(self.book.as_ptr()), _mm512_broadcastss_ps(rms))
        }

        /// Float q·k of the query heads `q` (`[G, d]`) with keys `lo..lo + n` of kv head `h`
        /// (exact activations): each key row copied whole to the stack, then read by the affine
        /// rows' float dot product (`QKv`), so the arithmetic is that of the same key rows
        /// held contiguously.
        #[target_feature(enable = "avx512f,fma,f16c")]
        unsafe fn float_dots(&self, q: &[f32], h: usize, lo: usize, n: usize, out: &mut [f32]) {
            let (d, keys) = (self.d, self.quant.keys());
            let mut row = [0u8; super::MAX_KEY_BYTES];
            let prepared: Vec<[f32; MAX_GROUPS]> = {
                let probe = QKv { rows: Kv::contiguous(&row[..self.key_bytes], 0, 0), quant: keys, d };
                q.chunks_exact(d).map(|qh| probe.prepare_query(qh)).collect()
            };
            for j in 0..n {
                self.key_row_into(h, lo + j, &mut row);
                let one = QKv { rows: Kv::contiguous(&row[..self.key_bytes], 0, 0), quant: keys, d };
                let ptr = one.row(0, 0).as_ptr();
                for (g, (qh, prep)) in q.chunks_exact(d).zip(&prepared).enumerate() {
                    out[g * n + j] = one.dot(ptr, qh.as_ptr(), d, prep);
                }
            }
        }
    }

    impl Rows for TurboKv<'_> {
        type Row = *const u8;

        /// A value row's start (values); a first half's (keys: read only by `dots_all_heads`).
        #[inline(always)]
        fn row_at(&self, head: usize, token: usize, _d: usize) -> *const u8 {
            match self.values {
                true => self.value_row(head, token).as_ptr(),
                false => self.first.row(head, token, self.half).as_ptr(),
            }
        }

        /// Values `col..col + 16` in the rotated domain: centroid × RMS, the products of
        /// `turbo::decode_rotated`.
        #[inline(always)]
        unsafe fn load16(&self, row: *const u8, col: usize) -> __m512 {
            debug_assert!(self.values, "key rows are read by dots_all_heads");
            _mm512_permutexvar_ps(self.codes16(row, col), self.scaled_book(row, col))
        }

        /// As `load16` four times, each group's scaled codebook made once.
        #[inline(always)]
        unsafe fn load64(&self, row: *const u8, col: usize) -> [__m512; 4] {
            let (first, second) = (self.scaled_book(row, col), self.scaled_book(row, col + 32));
            [
                _mm512_permutexvar_ps(self.codes16(row, col), first),
                _mm512_permutexvar_ps(self.codes16(row, col + 16), first),
                _mm512_permutexvar_ps(self.codes16(row, col + 32), second),
                _mm512_permutexvar_ps(self.codes16(row, col + 48), second),
            ]
        }

        /// Every key is scored here: the int8 query on VNNI (`decode_q8`, reading the split
        /// rows in place), else the float path.
        fn dots_all_heads(&self, q: &[f32], h: usize, lo: usize, n: usize, out: &mut [f32]) -> bool {
            if decode_q8::wanted() && decode_q8::supports(self.d, q.len() / self.d) {
                decode_q8::dots(self, q, h, lo, n, out);
            } else {
                // SAFETY: decode attention runs only where AVX-512F is (`decode_attn::supports`).
                unsafe { self.float_dots(q, h, lo, n, out) };
            }
            true
        }
    }

    impl KeyBytes for TurboKv<'_> {
        /// The row's first half and second half.
        type Row = (*const u8, *const u8);

        fn quant(&self) -> KvQuant {
            self.quant.keys()
        }

        fn d(&self) -> usize {
            self.d
        }

        #[inline(always)]
        fn key_row(&self, head: usize, token: usize) -> (*const u8, *const u8) {
            (self.first.row(head, token, self.half).as_ptr(), self.second.row(head, token, self.half).as_ptr())
        }

        /// Bytes across the cut come from both halves (masked loads read only their bytes).
        #[inline(always)]
        unsafe fn load64(&self, (a, b): (*const u8, *const u8), at: usize) -> __m512i {
            let half = self.half;
            if at + 64 <= half {
                _mm512_loadu_si512(a.add(at) as *const __m512i)
            } else if at >= half {
                _mm512_loadu_si512(b.add(at - half) as *const __m512i)
            } else {
                let in_first: __mmask64 = (1u64 << (half - at)) - 1;
                let lo = _mm512_maskz_loadu_epi8(in_first, a.add(at) as *const i8);
                _mm512_mask_loadu_epi8(lo, !in_first, b.wrapping_sub(half - at) as *const i8)
            }
        }

        #[inline(always)]
        unsafe fn load32(&self, (a, b): (*const u8, *const u8), at: usize, mask: __mmask32) -> __m256i {
            let half = self.half;
            if at >= half {
                return _mm256_maskz_loadu_epi8(mask, b.add(at - half) as *const i8);
            }
            let in_first: __mmask32 = if at + 32 <= half { u32::MAX } else { ((1u64 << (half - at)) - 1) as u32 };
            let lo = _mm256_maskz_loadu_epi8(mask & in_first, a.add(at) as *const i8);
            if mask & !in_first == 0 {
                return lo;
            }
            _mm256_mask_loadu_epi8(lo, mask & !in_first, b.wrapping_sub(half - at) as *const i8)
        }
    }
}
