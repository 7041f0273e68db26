//! Products with 8-bit activations on AVX-512 VNNI, for prefill (`gemm`) and decode (`gemv` for
//! one token, `gemv_tokens` for several sequences' tokens in one step), all with one arithmetic:
//! tiles of 4 weight rows × up to 16 tokens in registers, each weight pair loaded and unpacked
//! once per tile, and per token each row's integer sum over a 16-value chunk gathered into one
//! lane (four chained `vpdpbusd` against the transposed rows, `tile`; or, for one token, a
//! `vpdpbusd` per row and three rounds of unpacks, `rows4_one_token`) before one conversion, one
//! scale product and one FMA serve four rows. Integer sums are exact in any order and the f32
//! steps are the same, so every output has the same bits whichever kernel computed it: a
//! sequence decoded in a batch equals its solo run, and a prompt token's product equals the one
//! decode would compute.
//!
//! Until 2026-12-07 decode used per-lane arithmetic (a conversion, product and FMA per 4 values
//! per row), which bound batched decode on Zen 4's FMA pipes: at 8–16 tokens this is 1.3–2.6×
//! faster, one token on par (`decode_rates`).

#![cfg(target_arch = "x86_64")]

use super::vnni::{Layout, QPair, Vnni};
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
    let shape = Shape::new(cols, V::BYTES, V::N, false);
    let (row_bytes, pairs) = (shape.row_bytes, shape.pairs);
    assert!(w.len() >= rows.end * row_bytes && xq.len() >= pairs_len(t, pairs));
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

/// Decode of one token: y(r) = W[r] · x for rows `rows`, `xq` the token's pairs in order
/// (`vnni::quantize`), with `gemm`'s arithmetic (the same bits as `gemm` of that token).
///
/// # Safety
/// `vnni::available()`; `w` holds whole rows of `cols / N` blocks; `xq` was quantized from
/// `cols` values for this `V`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn gemv<V: Vnni>(w: &[u8], cols: usize, xq: &[QPair], rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, f32)) {
    assert!(cols % V::N == 0 && (V::N == 32 || V::N % 64 == 0));
    let shape = Shape::new(cols, V::BYTES, V::N, true);
    assert!(w.len() >= rows.end * shape.row_bytes && xq.len() == shape.pairs);
    let mut r = rows.start;
    while r < rows.end {
        let nr = (rows.end - r).min(4);
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), rows4_one_token::<V>(w.as_ptr().add(r * shape.row_bytes), nr, xq.as_ptr(), &shape));
        for (i, v) in out.into_iter().take(nr).enumerate() {
            y(r + i, v);
        }
        r += nr;
    }
}

/// Decode of `m` tokens together (continuous batching): y(j, r) = W[r] · x_j, `xq` holding the
/// tokens' pairs token-major (`m · cols.div_ceil(64)`), each weight row read once per 16
/// tokens; every output has the bits of `gemv` of its token (and of `gemm`).
///
/// # Safety
/// As `gemv`, with `xq` quantized from `m` rows of `cols` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn gemv_tokens<V: Vnni>(w: &[u8], cols: usize, xq: &[QPair], m: usize, rows: std::ops::Range<usize>, y: &mut impl FnMut(usize, usize, f32)) {
    assert!(cols % V::N == 0 && (V::N == 32 || V::N % 64 == 0));
    let shape = Shape::new(cols, V::BYTES, V::N, true);
    assert!(w.len() >= rows.end * shape.row_bytes && xq.len() == m * shape.pairs);
    let mut out = [0f32; 4 * TOKENS];
    let mut r = rows.start;
    while r < rows.end {
        let nr = (rows.end - r).min(4);
        let mut j = 0;
        while j < m {
            let nt = (m - j).min(TOKENS);
            let (wr, xj) = (w.as_ptr().add(r * shape.row_bytes), xq.as_ptr().add(j * shape.pairs));
            tile_of::<V>(nt, wr, nr, xj, &shape, out.as_mut_ptr(), 4);
            for g in 0..nt {
                for i in 0..nr {
                    y(j + g, r + i, out[4 * g + i]);
                }
            }
            j += nt;
        }
        r += nr;
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
    /// Where pair p of token j of a tile is: `xq + p·pair_stride + j·token_stride` (prefill's
    /// grouped layout: TOKENS and 1; decode's token-major rows: 1 and `pairs`).
    pair_stride: usize,
    token_stride: usize,
    /// How far ahead to prefetch the weights (decode reads each weight once and waits on
    /// memory; 0 for prefill: computed once here, not per tile).
    ahead: usize,
}

impl Shape {
    fn new(cols: usize, bytes_per_block: usize, n: usize, token_major: bool) -> Self {
        let pairs = cols.div_ceil(64);
        let (pair_stride, token_stride) = if token_major { (1, pairs) } else { (TOKENS, 1) };
        let row_bytes = cols / n * bytes_per_block;
        let ahead = if token_major { super::vnni::prefetch_distance(4 * row_bytes) } else { 0 };
        Self { row_bytes, pairs, odd: cols % 64 == 32, pair_stride, token_stride, ahead }
    }
}

/// 4 rows at `w` (row stride `row_bytes`; only the first `nr` are written, the others repeat
/// the last valid row) × M ≤ TOKENS tokens at `xq` (laid out by `s`'s strides), written to
/// `y[j·ld + i]`.
///
/// The four rows' quants are transposed once per pair (`transpose4`) so that, per token, lane i
/// of each 128-bit chunk accumulates row i's integer sum over that chunk (the chunk's 16 values
/// share one activation and one weight scale) before anything is converted to f32: one
/// conversion, one scale product and one FMA serve four rows.
#[inline(always)]
unsafe fn tile<V: Vnni, const M: usize>(w: *const u8, nr: usize, xq: *const QPair, s: &Shape, y: *mut f32, ld: usize) {
    let mut acc = [_mm512_setzero_ps(); M];
    let mut rows = Rows4::<V>::new(w, nr, s);
    for p in 0..s.pairs {
        let four = rows.pair(p);
        let wt = transpose4(four.wq);
        for j in 0..M {
            let x = &*xq.add(p * s.pair_stride + j * s.token_stride);
            let xv = _mm512_load_si512(x.q.as_ptr() as *const _);
            // Lane i of chunk c: Σ over the chunk's four groups g of row i's group g · x's.
            let mut u = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wt[0], _mm512_shuffle_epi32::<0x00>(xv));
            u = _mm512_dpbusd_epi32(u, wt[1], _mm512_shuffle_epi32::<0x55>(xv));
            u = _mm512_dpbusd_epi32(u, wt[2], _mm512_shuffle_epi32::<0xaa>(xv));
            u = _mm512_dpbusd_epi32(u, wt[3], _mm512_shuffle_epi32::<0xff>(xv));
            acc[j] = four.accumulate::<V>(u, x, acc[j]);
        }
    }
    for j in 0..M {
        // A masked store: a loop over `nr` values became a call to memcpy per token.
        _mm_mask_storeu_ps(y.add(j * ld), (1u8 << nr.min(4)) - 1, reduce_chunks(acc[j]));
    }
}

/// One token: `tile::<V, 1>`'s arithmetic without the transpose. Each row's `vpdpbusd`
/// against the activations leaves its four groups of each chunk in four lanes; three rounds of
/// unpacks and adds gather them into lane i of each chunk, the same integers as the transposed
/// sums (integer addition is exact in any order), so every output has `tile`'s bits.
#[inline(always)]
unsafe fn rows4_one_token<V: Vnni>(w: *const u8, nr: usize, xq: *const QPair, s: &Shape) -> __m128 {
    let mut acc = _mm512_setzero_ps();
    let mut rows = Rows4::<V>::new(w, nr, s);
    for p in 0..s.pairs {
        let four = rows.pair(p);
        let x = &*xq.add(p);
        let xv = _mm512_load_si512(x.q.as_ptr() as *const _);
        // Not `array::from_fn`: a closure does not inherit the target features.
        let mut u = [_mm512_setzero_si512(); 4];
        for i in 0..4 {
            u[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), four.wq[i], xv);
        }
        acc = four.accumulate::<V>(sum_groups(u), x, acc);
    }
    reduce_chunks(acc)
}

/// `u[i]` holds row i's four group sums of each 128-bit chunk → lane i of each chunk holds row
/// i's sum over the chunk.
#[inline(always)]
unsafe fn sum_groups(u: [__m512i; 4]) -> __m512i {
    // Per chunk: [r0 g0+g2, r1 g0+g2, r0 g1+g3, r1 g1+g3], and rows 2, 3 alike.
    let a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[0], u[1]), _mm512_unpackhi_epi32(u[0], u[1]));
    let a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[2], u[3]), _mm512_unpackhi_epi32(u[2], u[3]));
    _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23))
}

/// Lane i of the sum of the four chunks: row i's output.
#[inline(always)]
unsafe fn reduce_chunks(a: __m512) -> __m128 {
    let lo = _mm_add_ps(_mm512_extractf32x4_ps::<0>(a), _mm512_extractf32x4_ps::<1>(a));
    let hi = _mm_add_ps(_mm512_extractf32x4_ps::<2>(a), _mm512_extractf32x4_ps::<3>(a));
    _mm_add_ps(lo, hi)
}

/// Four weight rows read pair by pair (the last valid row repeated past `nr`).
struct Rows4<'a, V> {
    /// The four rows (the last valid one repeated).
    rows: [*const u8; 4],
    s: &'a Shape,
    /// Each row's `V::block_scales` of its current block (K formats).
    scales: [__m512; 4],
    _format: std::marker::PhantomData<V>,
}

/// One pair of four rows, ready for every token: the quants, each row's weight scale of each
/// chunk in lane i of the chunk (`dw4`) and the min terms (`min_terms`).
struct Pair4 {
    wq: [__m512i; 4],
    dw4: __m512,
    mins: __m512,
}

impl<'a, V: Vnni> Rows4<'a, V> {
    #[inline(always)]
    unsafe fn new(w: *const u8, nr: usize, s: &'a Shape) -> Self {
        let mut rows = [w; 4];
        for (i, r) in rows.iter_mut().enumerate() {
            *r = w.add(i.min(nr - 1) * s.row_bytes);
        }
        Self { rows, s, scales: [_mm512_setzero_ps(); 4], _format: std::marker::PhantomData }
    }

    #[inline(always)]
    unsafe fn pair(&mut self, p: usize) -> Pair4 {
        let s = self.s;
        let per_block = (V::N / 64).max(1);
        // Where pair p starts in a row, and which pair of its block it is (K formats).
        let (at, of_block) = if V::N == 32 { (2 * p * V::BYTES, 0) } else { (p / per_block * V::BYTES, p % per_block) };
        if V::N != 32 && of_block == 0 {
            for i in 0..4 {
                self.scales[i] = V::block_scales(self.rows[i].add(at));
            }
            if V::SUB_BLOCK_SCALES || V::CHUNK_SCALES {
                self.scales = transpose_rows(self.scales);
            }
        }
        if s.ahead != 0 {
            for row in self.rows {
                super::vnni::prefetch(row.add(at).wrapping_add(s.ahead + of_block * V::BYTES / per_block));
            }
        }
        let two = !(V::N == 32 && s.odd && p + 1 == s.pairs);
        let mut wq = [_mm512_setzero_si512(); 4];
        let mut dm = [_mm_setzero_ps(); 4];
        for i in 0..4 {
            // The per-lane scales `load_pair` also returns are not needed: the four rows' scales
            // come from `dm` or the block scales below (the compiler drops their permutes).
            (wq[i], _, dm[i]) = V::load_pair_scaled(self.rows[i].add(at), of_block, two, self.scales[i]);
        }
        if V::SUB_BLOCK_SCALES {
            let (dw4, mins) = sub_block_pair(&self.scales, of_block);
            return Pair4 { wq, dw4, mins };
        }
        if V::CHUNK_SCALES {
            return Pair4 { wq, dw4: chunk_scales_pair(&self.scales, of_block), mins: _mm512_setzero_ps() };
        }
        // The same lanes from the rows' `[d0, m0, d1, m1]` (`dw` is those spread per block).
        let [d0, m0, d1, m1] = transpose_quads(dm);
        let mins = if V::MIN { min_terms::<V>(m0, m1) } else { _mm512_setzero_ps() };
        Pair4 { wq, dw4: by_block::<V>(d0, d1), mins }
    }
}

/// Four rows' 16 lanes → `t[k]`: lane i of chunk c holds row i's lane 4c + k.
#[inline(always)]
unsafe fn transpose_rows(r: [__m512; 4]) -> [__m512; 4] {
    let (lo01, hi01) = (_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
    let (lo23, hi23) = (_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
    let pd = _mm512_castps_pd;
    [
        _mm512_castpd_ps(_mm512_unpacklo_pd(pd(lo01), pd(lo23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(pd(lo01), pd(lo23))),
        _mm512_castpd_ps(_mm512_unpacklo_pd(pd(hi01), pd(hi23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(pd(hi01), pd(hi23))),
    ]
}

/// Pair q of a Q4_K-like block (sub-blocks 2q and 2q + 1) from the four rows' transposed
/// `block_scales` (`transpose_rows`: scale of sub-block j = lane 4c + k with c = j / 4, k = j % 4;
/// its min 8 lanes on): `dw4` = `[s_2q, s_2q, s_2q+1, s_2q+1]` and the min terms
/// `[m_2q, 0, m_2q+1, 0]` by chunk, each lane i row i's — the values `min_terms` and `by_block`
/// build from the rows' `load_pair`.
#[inline(always)]
unsafe fn sub_block_pair(t: &[__m512; 4], q: usize) -> (__m512, __m512) {
    let k = 2 * (q % 2);
    let (a, b) = (t[k], t[k + 1]);
    if q < 2 {
        (_mm512_shuffle_f32x4::<0x00>(a, b), _mm512_maskz_shuffle_f32x4::<0x22>(0x0f0f, a, b))
    } else {
        (_mm512_shuffle_f32x4::<0x55>(a, b), _mm512_maskz_shuffle_f32x4::<0x33>(0x0f0f, a, b))
    }
}

/// Pair q of a Q6_K-like block (a scale per 16-value chunk, 16 per block) from the four rows'
/// transposed `block_scales`: chunk c of the pair is the block's chunk 4q + c, i.e. lane 4q + c,
/// found in chunk q of `t[c]`.
#[inline(always)]
unsafe fn chunk_scales_pair(t: &[__m512; 4], q: usize) -> __m512 {
    macro_rules! pick {
        ($imm:literal) => {{
            let (x, y) = (_mm512_shuffle_f32x4::<$imm>(t[0], t[1]), _mm512_shuffle_f32x4::<$imm>(t[2], t[3]));
            // [t0 q, t1 q, t2 q, t3 q] by chunk.
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y)
        }};
    }
    match q {
        0 => pick!(0x00),
        1 => pick!(0x55),
        2 => pick!(0xaa),
        _ => pick!(0xff),
    }
}

/// Four rows' `[d0, m0, d1, m1]` → `[d0 of rows 0..4, m0 of rows…, d1…, m1…]`.
#[inline(always)]
unsafe fn transpose_quads(q: [__m128; 4]) -> [__m128; 4] {
    let (lo01, lo23) = (_mm_unpacklo_ps(q[0], q[1]), _mm_unpacklo_ps(q[2], q[3]));
    let (hi01, hi23) = (_mm_unpackhi_ps(q[0], q[1]), _mm_unpackhi_ps(q[2], q[3]));
    [_mm_movelh_ps(lo01, lo23), _mm_movehl_ps(lo23, lo01), _mm_movelh_ps(hi01, hi23), _mm_movehl_ps(hi23, hi01)]
}

/// Chunk c gets `b0` where it belongs to the pair's first block, `b1` where to its second.
#[inline(always)]
unsafe fn by_block<V: Vnni>(b0: __m128, b1: __m128) -> __m512 {
    let v = _mm512_insertf32x4::<1>(_mm512_castps128_ps512(b0), b1);
    match V::LAYOUT {
        // Chunks 0, 1 | 2, 3.
        Layout::Natural => _mm512_shuffle_f32x4::<0b01_01_00_00>(v, v),
        // Chunks 0, 2 | 1, 3.
        Layout::Nibbles => _mm512_shuffle_f32x4::<0b01_00_01_00>(v, v),
    }
}

impl Pair4 {
    /// `acc` + this pair's products for one token, from `u` (lane i of chunk c: row i's integer
    /// sum over chunk c, before the format's offset correction).
    #[inline(always)]
    unsafe fn accumulate<V: Vnni>(&self, mut u: __m512i, x: &QPair, acc: __m512) -> __m512 {
        if V::OFFSET != 0 {
            u = _mm512_add_epi32(u, _mm512_load_si512(x.corr4.as_ptr() as *const _));
        }
        let scale = _mm512_mul_ps(self.dw4, _mm512_load_ps(x.dx.as_ptr()));
        let mut acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scale, acc);
        if V::MIN {
            acc = _mm512_fmadd_ps(self.mins, _mm512_load_ps(x.sx.as_ptr()), acc);
        }
        acc
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

/// The four rows' min terms m0, m1 of the pair's two blocks (w = d·q + m per 32-value block)
/// laid out like the accumulators: lane i of the first chunk of block b holds row i's m_b,
/// every other lane 0. Multiplied by each lane's s = d_x·Σq_x of its block, they add m·s to the
/// same accumulator, so formats with a min need no second one.
#[inline(always)]
unsafe fn min_terms<V: Vnni>(m0: __m128, m1: __m128) -> __m512 {
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
    use super::super::vnni::available;
    use super::*;

    /// Every (token, row) is within 8-bit rounding of the exact product (`vnni`'s tests bound
    /// it tightly for one token) and has the bits decode's kernels give it, over tile edges in
    /// both directions (rows and tokens not multiples of the tile, more tokens than a token
    /// block).
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
            for r in 0..rows {
                let (row, xt) = (&wd[r * cols..(r + 1) * cols], &x[tok * cols..(tok + 1) * cols]);
                let exact: f64 = row.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
                let abs: f64 = row.iter().zip(xt).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                let g = got[tok * rows + r] as f64;
                assert!((g - exact).abs() <= 0.01 * abs, "token {tok} row {r}: {g} vs {exact} (Σ|w·x| {abs})");
            }
        }
        decode_equals_gemm::<V>(&w, &x, cols, rows, t, &got);
    }

    /// Decode's kernels (one token, and tokens together in token-major rows) give every output
    /// the bits `gemm` gives it, for every row and token count (rows over tile edges).
    fn decode_equals_gemm<V: Vnni>(w: &[u8], x: &[f32], cols: usize, rows: usize, t: usize, by_gemm: &[f32]) {
        let pairs = cols.div_ceil(64);
        let mut xq = vec![QPair::ZERO; t * pairs];
        for (tok, q) in xq.chunks_exact_mut(pairs).enumerate() {
            // SAFETY: callers checked VNNI; sizes match.
            unsafe { super::super::vnni::quantize_into::<V>(&x[tok * cols..(tok + 1) * cols], q) };
        }
        let bits = |v: f32| v.to_bits();
        for tok in 0..t {
            let mut one = vec![0f32; rows];
            // SAFETY: as above.
            unsafe { super::gemv::<V>(w, cols, &xq[tok * pairs..(tok + 1) * pairs], 0..rows, &mut |r, v| one[r] = v) };
            for r in 0..rows {
                assert_eq!(bits(one[r]), bits(by_gemm[tok * rows + r]), "gemv: token {tok} row {r}");
            }
        }
        for m in [1, 2, 5, 16, 17, t] {
            let mut many = vec![0f32; m * rows];
            // SAFETY: as above.
            unsafe { super::gemv_tokens::<V>(w, cols, &xq[..m * pairs], m, 1..rows, &mut |j, r, v| many[j * rows + r] = v) };
            for j in 0..m {
                for r in 1..rows {
                    assert_eq!(bits(many[j * rows + r]), bits(by_gemm[j * rows + r]), "gemv_tokens of {m}: token {j} row {r}");
                }
            }
        }
    }

    #[test]
    fn gemm_near_exact_and_decode_equal_bit_for_bit() {
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
        let best = best_of(20, &mut || unsafe { gemm::<V>(&w, cols, &xq, t, 0..rows, y.as_mut_ptr(), rows) });
        eprintln!("{name} {rows}x{cols} t={t}: {:.1} GMAC/s", (rows * cols * t) as f64 / best / 1e9);
    }

    /// The fastest of `runs` timings of `f`, in seconds.
    fn best_of(runs: usize, f: &mut dyn FnMut()) -> f64 {
        (0..runs)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    }

    /// Decode's products, single thread, best of 30: one token at a time (`gemv`), m tokens
    /// together (`gemv_tokens`) and the prefill GEMM on the same tokens
    /// (`cargo test --release -p ferrolm-backend --lib decode_rates -- --ignored --nocapture`).
    fn decode_rate<V: Vnni>(name: &str, rows: usize, cols: usize) {
        let mut rnd = super::super::vnni::tests::uniform(7);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        let w = super::super::vnni::tests::quantize_rows::<V>(&wf, rows, cols);
        let pairs = cols.div_ceil(64);
        let mut sink = 0f32;
        let best = |f: &mut dyn FnMut()| best_of(30, f);
        for m in [1, 2, 4, 8, 16] {
            let x: Vec<f32> = (0..m * cols).map(|_| rnd()).collect();
            let mut xq = vec![QPair::ZERO; m * pairs];
            // SAFETY (all below): callers checked VNNI; sizes match.
            for (tok, q) in xq.chunks_exact_mut(pairs).enumerate() {
                unsafe { super::super::vnni::quantize_into::<V>(&x[tok * cols..(tok + 1) * cols], q) };
            }
            let one_by_one = best(&mut || {
                for q in xq.chunks_exact(pairs) {
                    unsafe { super::gemv::<V>(&w, cols, q, 0..rows, &mut |_, v| sink += v) }
                }
            });
            let together = best(&mut || unsafe { super::gemv_tokens::<V>(&w, cols, &xq, m, 0..rows, &mut |_, _, v| sink += v) });
            let xg = quantize_tokens::<V>(&x, m, cols);
            let mut y = vec![0f32; m * rows];
            let gemm_s = best(&mut || unsafe { super::gemm::<V>(&w, cols, &xg, m, 0..rows, y.as_mut_ptr(), rows) });
            let gmac = (rows * cols * m) as f64 / 1e9;
            eprintln!(
                "{name} {rows}x{cols} m={m}: one by one {:.1} GMAC/s, together {:.1}, prefill gemm {:.1} ({sink:.0})",
                gmac / one_by_one,
                gmac / together,
                gmac / gemm_s
            );
        }
    }

    #[test]
    #[ignore]
    fn decode_rates() {
        if !available() {
            return;
        }
        decode_rate::<formats::Q4_1>("Q4_1", 3072, 576);
        decode_rate::<formats::Q8_0>("Q8_0", 3072, 576);
        decode_rate::<formats::Q5_0>("Q5_0", 4864, 896);
        // The default 1.5B model's widths: its Q4_K and Q6_K products and its Q6_K output head.
        decode_rate::<formats::Q4K>("Q4_K", 8960, 1536);
        decode_rate::<formats::Q6K>("Q6_K", 8960, 1536);
        decode_rate::<formats::Q6K>("Q6_K", 151936, 1536);
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
