//! Q8_0 weights repacked for decode with 8-bit activations (`vnni`). In the file's layout a
//! row and pair of blocks costs ~14 instructions (two 32-byte loads joined, the +128 offset, two
//! scalar scale loads widened and spread over the lanes) and these products are compute-bound on
//! two cores. Repacked, four rows' pair quants lie side by side as 64-byte lines with the offset
//! already added, and their eight scales together, so a row and pair is one aligned load, one
//! `vpdpbusd`, one permute of the group's scales, a multiply, a conversion and an FMA.
//!
//! Its arithmetic is per lane (each lane's integer sum times d_w·d_x, FMA'd pair after pair;
//! `tests::per_lane_row` spells it out), the same for one token and for several, so a
//! sequence's logits have the same bits batched or alone. Used for output heads (one token per step at
//! most: logits are computed for the last position only), where the original blocks stay in the
//! memory map for the embedding lookup.

#![cfg(target_arch = "x86_64")]

use super::alloc::HugeBuf;
use super::formats::{self, Block};
use super::vnni::{self, QPair};
use std::arch::x86_64::*;

/// Row groups (of four rows) per block of `gemv_tokens`.
const HEAD_BLOCK_GROUPS: usize = 16;

/// Rows per released range while packing.
const RELEASE_ROWS: usize = 1024;

/// Q8_0 rows in groups of four: 64-byte line `(group·pairs + p)·4 + i` of `lines` holds row
/// 4·group + i, pair p (its two blocks +128, as u8), in huge pages (`HugeBuf`);
/// `scales[(group·pairs + p)·8 + 2i + j]` its block 2p + j's f16 scale. Missing rows and blocks
/// are zero (quant 128, scale 0).
pub struct Q8Rows {
    lines: HugeBuf,
    scales: Vec<u16>,
    rows: usize,
    pairs: usize,
}

impl Q8Rows {
    /// Repacks `rows` Q8_0 rows of `cols` values (`w` in the file's block layout), calling
    /// `done(bytes)` for each finished range of `w` as it goes (so that a memory map can drop
    /// those pages before the next are read: the peak stays near one copy).
    pub fn pack(w: &[u8], rows: usize, cols: usize, done: &dyn Fn(std::ops::Range<usize>)) -> Self {
        type Q = formats::Q8_0;
        assert!(cols % Q::N == 0 && w.len() == rows * cols / Q::N * Q::BYTES);
        let blocks = cols / Q::N;
        let pairs = blocks.div_ceil(2);
        let groups = rows.div_ceil(4);
        let mut lines = HugeBuf::zeroed(groups * pairs * 4 * 64).expect("memory for the packed head");
        let bytes = lines.bytes_mut();
        bytes.fill(128);
        let mut scales = vec![0u16; groups * pairs * 8];
        for r in 0..rows {
            let (g, i) = (r / 4, r % 4);
            for b in 0..blocks {
                let blk = &w[(r * blocks + b) * Q::BYTES..(r * blocks + b + 1) * Q::BYTES];
                let (p, j) = (b / 2, b % 2);
                let at = ((g * pairs + p) * 4 + i) * 64 + 32 * j;
                let line = &mut bytes[at..at + 32];
                for (dst, q) in line.iter_mut().zip(&blk[2..]) {
                    *dst = q ^ 0x80;
                }
                scales[(g * pairs + p) * 8 + 2 * i + j] = u16::from_le_bytes([blk[0], blk[1]]);
            }
            let row_bytes = blocks * Q::BYTES;
            if (r + 1) % RELEASE_ROWS == 0 || r + 1 == rows {
                done((r - r % RELEASE_ROWS) * row_bytes..(r + 1) * row_bytes);
            }
        }
        Self { lines, scales, rows, pairs }
    }

    /// y[r] = W[r] · x for rows `rows` (starting at a multiple of 4), `xq` = `vnni::quantize`
    /// of x for Q8_0.
    ///
    /// # Safety
    /// `vnni::available()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn gemv(&self, xq: &[QPair], rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, f32)) {
        assert!(rows.start % 4 == 0 && rows.end <= self.rows && xq.len() == self.pairs);
        // Lane l of row i's scales: block 2p (lanes 0–7) or 2p + 1 (lanes 8–15) of row i, the
        // Natural layout of `vnni`.
        let index: [__m512i; 4] = std::array::from_fn(|i| {
            let (a, b) = (2 * i as i32, 2 * i as i32 + 1);
            _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a)
        });
        for g in rows.start / 4..rows.end.div_ceil(4) {
            let mut acc = [_mm512_setzero_ps(); 4];
            for (p, xp) in xq.iter().enumerate() {
                let at = (g * self.pairs + p) * 4;
                let lines = self.lines.bytes().as_ptr();
                vnni::prefetch(lines.wrapping_add((at + 16) * 64));
                let xv = _mm512_load_si512(xp.q.as_ptr() as *const _);
                let corr = _mm512_load_si512(xp.corr.as_ptr() as *const _);
                let dx = _mm512_load_ps(xp.dx.as_ptr());
                let s = _mm_loadu_si128(self.scales.as_ptr().add(2 * at) as *const __m128i);
                let s = _mm512_castps256_ps512(_mm256_cvtph_ps(s));
                for (i, a) in acc.iter_mut().enumerate() {
                    let wq = _mm512_load_si512(lines.add((at + i) * 64) as *const _);
                    let isum = _mm512_dpbusd_epi32(corr, wq, xv);
                    let scale = _mm512_mul_ps(_mm512_permutexvar_ps(index[i], s), dx);
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                let r = 4 * g + i;
                if r < rows.end {
                    y(r, vnni::finish(*a, _mm_setzero_ps()));
                }
            }
        }
    }

    /// `gemv` for `m` tokens (`xq`: `m` tokens of `pairs` pairs, token-major), each line loaded
    /// once per group of four tokens: y(token, row), bit-identical to `gemv` per token (the
    /// decode of a batch of sequences).
    ///
    /// # Safety
    /// `vnni::available()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn gemv_tokens(&self, xq: &[QPair], m: usize, rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, usize, f32)) {
        assert!(rows.start % 4 == 0 && rows.end <= self.rows && xq.len() == m * self.pairs);
        // As in `gemv`: lane l of row i's scales.
        let mut index = [_mm512_setzero_si512(); 4];
        for (i, ix) in index.iter_mut().enumerate() {
            let (a, b) = (2 * i as i32, 2 * i as i32 + 1);
            *ix = _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
        }
        // A block of row groups at a time (its lines, 37 KB at 576 columns, stay in L2), and
        // within it four tokens at a time over every group: the four tokens' pairs stay in L1.
        // Looping all tokens per group instead read 16 tokens' pairs (46 KB, more than L1) per
        // group: the head at 16 tokens ran at 50 against 60 GMAC/s at 4.
        self.tokens_blocked(xq, m, rows, HEAD_BLOCK_GROUPS, &index, y)
    }

    #[inline(always)]
    unsafe fn tokens_blocked(&self, xq: &[QPair], m: usize, rows: std::ops::Range<usize>, block_groups: usize, index: &[__m512i; 4], y: &mut impl FnMut(usize, usize, f32)) {
        let groups = rows.start / 4..rows.end.div_ceil(4);
        let mut block = groups.start;
        while block < groups.end {
            let block_end = (block + block_groups).min(groups.end);
            let mut j = 0;
            while j < m {
                let nt = (m - j).min(4);
                let x = &xq[j * self.pairs..(j + nt) * self.pairs];
                for g in block..block_end {
                    let out = match nt {
                        1 => widen(self.group_tokens::<1>(g, x, index)),
                        2 => widen(self.group_tokens::<2>(g, x, index)),
                        3 => widen(self.group_tokens::<3>(g, x, index)),
                        _ => widen(self.group_tokens::<4>(g, x, index)),
                    };
                    for (i, row) in out.iter().enumerate() {
                        let r = 4 * g + i;
                        if r < rows.end {
                            row.iter().take(nt).enumerate().for_each(|(t, v)| y(j + t, r, *v));
                        }
                    }
                }
                j += nt;
            }
            block = block_end;
        }
    }

    /// Row group `g` × `T` tokens: `gemv`'s loop with each line multiplied into every token's
    /// accumulator.
    #[inline(always)]
    unsafe fn group_tokens<const T: usize>(&self, g: usize, xq: &[QPair], index: &[__m512i; 4]) -> [[f32; T]; 4] {
        let mut acc = [[_mm512_setzero_ps(); T]; 4];
        let lines = self.lines.bytes().as_ptr();
        for p in 0..self.pairs {
            let at = (g * self.pairs + p) * 4;
            vnni::prefetch(lines.wrapping_add((at + 16) * 64));
            let s = _mm_loadu_si128(self.scales.as_ptr().add(2 * at) as *const __m128i);
            let s = _mm512_castps256_ps512(_mm256_cvtph_ps(s));
            for (i, row) in acc.iter_mut().enumerate() {
                let wq = _mm512_load_si512(lines.add((at + i) * 64) as *const _);
                let ws = _mm512_permutexvar_ps(index[i], s);
                for (t, a) in row.iter_mut().enumerate() {
                    let xp = &xq[t * self.pairs + p];
                    let xv = _mm512_load_si512(xp.q.as_ptr() as *const _);
                    let corr = _mm512_load_si512(xp.corr.as_ptr() as *const _);
                    let isum = _mm512_dpbusd_epi32(corr, wq, xv);
                    let scale = _mm512_mul_ps(ws, _mm512_load_ps(xp.dx.as_ptr()));
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *a);
                }
            }
        }
        let mut out = [[0f32; T]; 4];
        for i in 0..4 {
            for t in 0..T {
                out[i][t] = vnni::finish(acc[i][t], _mm_setzero_ps());
            }
        }
        out
    }
}

/// A `[[f32; T]; 4]` padded with zeros to four tokens.
fn widen<const T: usize>(v: [[f32; T]; 4]) -> [[f32; 4]; 4] {
    std::array::from_fn(|i| std::array::from_fn(|j| if j < T { v[i][j] } else { 0.0 }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row r of Q8_0 rows `w` times `xq` with the per-lane arithmetic this module promises: per
    /// pair, lane sums by `vpdpbusd` from the offset correction, times d_w·d_x, FMA'd in order.
    ///
    /// # Safety
    /// `vnni::available()`; `w` holds `r + 1` whole rows of `cols` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn per_lane_row(w: &[u8], cols: usize, xq: &[QPair], r: usize) -> f32 {
        type F = formats::Q8_0;
        let row = w.as_ptr().add(r * cols / 32 * F::BYTES);
        let mut acc = _mm512_setzero_ps();
        for (p, xp) in xq.iter().enumerate() {
            let two = 2 * p + 1 < cols / 32;
            let (wq, dw, _) = <F as vnni::Vnni>::load_pair(row.add(2 * p * F::BYTES), 0, two);
            let isum = _mm512_dpbusd_epi32(_mm512_load_si512(xp.corr.as_ptr() as *const _), wq, _mm512_load_si512(xp.q.as_ptr() as *const _));
            let scale = _mm512_mul_ps(dw, _mm512_load_ps(xp.dx.as_ptr()));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc);
        }
        vnni::finish(acc, _mm_setzero_ps())
    }

    /// The repacked product equals the per-lane arithmetic on the file's layout bit for bit,
    /// for row counts that are and are not multiples of 4, odd block counts and row ranges.
    #[test]
    fn repacked_equals_file_layout_exactly() {
        if !vnni::available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        let mut rnd = vnni::tests::uniform(0x2545f4914f6cdd1d);
        for (rows, cols) in [(13, 96), (64, 640), (7, 32)] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..cols).map(|_| rnd() * 3.0).collect();
            let w = vnni::tests::quantize_rows::<formats::Q8_0>(&wf, rows, cols);
            let packed = Q8Rows::pack(&w, rows, cols, &|_| {});
            let mut xq = Vec::new();
            let (mut want, mut got) = (vec![0f32; rows], vec![0f32; rows]);
            // SAFETY: VNNI was detected above.
            unsafe {
                vnni::quantize::<formats::Q8_0>(&x, &mut xq);
                for (r, v) in want.iter_mut().enumerate() {
                    *v = per_lane_row(&w, cols, &xq, r);
                }
                packed.gemv(&xq, 0..rows, &mut |r, v| got[r] = v);
                packed.gemv(&xq, 4..rows, &mut |r, v| assert_eq!(v.to_bits(), want[r].to_bits()));
            }
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    /// Several tokens at once give each token's `gemv` bits.
    #[test]
    fn tokens_equal_gemv_exactly() {
        if !vnni::available() {
            eprintln!("SKIP: no AVX-512 VNNI");
            return;
        }
        let mut rnd = vnni::tests::uniform(0x85ebca6b);
        for (rows, cols, m) in [(13, 96, 6), (8, 640, 4), (7, 32, 1)] {
            let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
            let w = vnni::tests::quantize_rows::<formats::Q8_0>(&wf, rows, cols);
            let packed = Q8Rows::pack(&w, rows, cols, &|_| {});
            let pairs = cols.div_ceil(64);
            let x: Vec<f32> = (0..m * cols).map(|_| rnd() * 2.0).collect();
            let mut xq = vec![QPair::ZERO; m * pairs];
            let mut got = vec![0f32; m * rows];
            // SAFETY: VNNI was detected above.
            unsafe {
                for j in 0..m {
                    vnni::quantize_into::<formats::Q8_0>(&x[j * cols..(j + 1) * cols], &mut xq[j * pairs..(j + 1) * pairs]);
                }
                packed.gemv_tokens(&xq, m, 0..rows, &mut |j, r, v| got[j * rows + r] = v);
                for j in 0..m {
                    let one = &xq[j * pairs..(j + 1) * pairs];
                    packed.gemv(one, 0..rows, &mut |r, v| assert_eq!(v.to_bits(), got[j * rows + r].to_bits(), "token {j} row {r}"));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn blocked_for_test(packed: &Q8Rows, xq: &[QPair], m: usize, rows: usize, bg: usize, sink: &mut f32) {
        let index: [__m512i; 4] = std::array::from_fn(|i| {
            let (a, b) = (2 * i as i32, 2 * i as i32 + 1);
            _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a)
        });
        packed.tokens_blocked(xq, m, 0..rows, bg, &index, &mut |_, _, v| *sink += v);
    }

    /// The packed head at SmolLM2's size (49,152 × 576), single thread, best of 20, one token
    /// and several (`cargo test --release -p ferrolm-backend --lib head_rates -- --ignored
    /// --nocapture`).
    #[test]
    #[ignore]
    fn head_rates() {
        if !vnni::available() {
            return;
        }
        let (rows, cols) = (49152, 576);
        let mut rnd = vnni::tests::uniform(3);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let packed = Q8Rows::pack(&vnni::tests::quantize_rows::<formats::Q8_0>(&wf, rows, cols), rows, cols, &|_| {});
        let pairs = cols.div_ceil(64);
        let mut sink = 0f32;
        for m in [1, 4, 8, 16] {
            let x: Vec<f32> = (0..m * cols).map(|_| rnd()).collect();
            let mut xq = vec![QPair::ZERO; m * pairs];
            let mut best = f64::MAX;
            // SAFETY: VNNI was detected above; sizes match.
            unsafe {
                for j in 0..m {
                    vnni::quantize_into::<formats::Q8_0>(&x[j * cols..(j + 1) * cols], &mut xq[j * pairs..(j + 1) * pairs]);
                }
                for _ in 0..20 {
                    let t = std::time::Instant::now();
                    packed.gemv_tokens(&xq, m, 0..rows, &mut |_, _, v| sink += v);
                    best = best.min(t.elapsed().as_secs_f64());
                }
                let mut line = format!("head m={m}: {:.1} GMAC/s; blocks of", (rows * cols * m) as f64 / best / 1e9);
                for bg in [1, 2, 4, 8, 16] {
                    let mut b = f64::MAX;
                    for _ in 0..20 {
                        let t = std::time::Instant::now();
                        blocked_for_test(&packed, &xq, m, rows, bg, &mut sink);
                        b = b.min(t.elapsed().as_secs_f64());
                    }
                    line += &format!(" {bg}: {:.1}", (rows * cols * m) as f64 / b / 1e9);
                }
                eprintln!("{line} ({sink:.0})");
            }
        }
    }
}
