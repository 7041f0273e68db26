//! TurboQuant value rows (`--kv-quant turbo`, mlx-bun's scheme, whose codec oracle is
//! vllm-metal's `turboquant.py`): a value row is sign-flipped, rotated by the normalized
//! Walsh–Hadamard transform (after which its entries are close to Gaussian), and every group of
//! 32 is scaled by its RMS and coded with a Lloyd–Max codebook for the unit normal (3 bits by
//! default). Keys are affine 8-bit groups of 32 without rotation (`KvQuant::turbo`).
//!
//! Row layout: the codes as one little-endian bit stream (value i at bit `bits·i`, as
//! vllm-metal packs them), then per group of 32 its RMS as little-endian f16. At head_dim 128
//! with 3 bits: 48 + 8 = 56 bytes (f16: 256).
//!
//! The sign pattern is ours (a fixed hash of the index): vllm-metal draws it from MLX's random
//! generator with key 42, which is not reproducible outside MLX; any fixed ±1 pattern serves.

use super::{rotate_rows, KvQuant};
use half::f16;

/// Values per RMS group.
pub const GROUP: usize = 32;

/// Value widths taken, and their Lloyd–Max codebooks for the unit normal (Max 1960; the 3-bit
/// one is vllm-metal's `CENTROIDS_3BIT` digit for digit), ascending.
const CODEBOOK_2: [f32; 4] = [-1.5104, -0.4528, 0.4528, 1.5104];
const CODEBOOK_3: [f32; 8] = [-2.15195, -1.34391, -0.75601, -0.24509, 0.24509, 0.75601, 1.34391, 2.15195];
const CODEBOOK_4: [f32; 16] = [
    -2.7326, -2.0690, -1.6181, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284, 0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326,
];

/// The codebook of `bits` (2, 3 or 4).
pub fn codebook(bits: u8) -> &'static [f32] {
    match bits {
        2 => &CODEBOOK_2,
        3 => &CODEBOOK_3,
        4 => &CODEBOOK_4,
        _ => panic!("TurboQuant values take 2, 3 or 4 bits, not {bits}"),
    }
}

/// The decision boundaries: midpoints of neighbouring centroids (vllm-metal's
/// `BOUNDARIES_3BIT` are these to 5 digits).
fn boundaries(bits: u8) -> Vec<f32> {
    codebook(bits).windows(2).map(|w| (w[0] + w[1]) * 0.5).collect()
}

/// +1 or −1 for channel `i`: a fixed hash of the index.
pub fn sign(i: usize) -> f32 {
    let mut z = (i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    if (z ^ (z >> 31)) & 1 == 0 {
        1.0
    } else {
        -1.0
    }
}

/// Bytes of one value row of head size `d`.
pub fn row_bytes(bits: u8, d: usize) -> usize {
    d * bits as usize / 8 + d / GROUP * 2
}

/// Writes the value row of `x` (head size `x.len()`, a multiple of 32) into `out`.
pub fn encode_row(bits: u8, x: &[f32], out: &mut [u8]) {
    let d = x.len();
    debug_assert_eq!(out.len(), row_bytes(bits, d));
    let mut y: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * sign(i)).collect();
    rotate_rows(&mut y, d);
    let bounds = boundaries(bits);
    let code_bytes = d * bits as usize / 8;
    out[..code_bytes].fill(0);
    for (g, ys) in y.chunks_exact(GROUP).enumerate() {
        // As vllm-metal: normalized by the f32 RMS (+1e-8), the RMS stored as f16.
        let rms = (ys.iter().map(|v| v * v).sum::<f32>() / GROUP as f32).sqrt();
        for (k, v) in ys.iter().enumerate() {
            let code = bounds.iter().filter(|b| v / (rms + 1e-8) > **b).count();
            put_bits(&mut out[..code_bytes], bits, g * GROUP + k, code as u32);
        }
        let at = code_bytes + 2 * g;
        out[at..at + 2].copy_from_slice(&f16::from_f32(rms).to_le_bytes());
    }
}

/// The values of `row` into `out` (head size `out.len()`): centroid × the group's RMS, rotated
/// back and sign-flipped back.
pub fn decode_row(bits: u8, row: &[u8], out: &mut [f32]) {
    decode_rotated(bits, row, out);
    unrotate(out, out.len());
}

/// The values of `row` still in the rotated domain: centroid × the group's RMS (one product per
/// value). Attention sums these weighted by the softmax and rotates the sum back once
/// ([`unrotate`]), instead of rotating every row back.
pub fn decode_rotated(bits: u8, row: &[u8], out: &mut [f32]) {
    let d = out.len();
    let book = codebook(bits);
    let code_bytes = d * bits as usize / 8;
    for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
        let rms = group_rms(row, code_bytes, g);
        for (k, x) in o.iter_mut().enumerate() {
            *x = book[get_bits(&row[..code_bytes], bits, g * GROUP + k) as usize] * rms;
        }
    }
}

/// The RMS of group `g` of a value row whose codes take `code_bytes`.
#[inline(always)]
pub fn group_rms(row: &[u8], code_bytes: usize, g: usize) -> f32 {
    let at = code_bytes + 2 * g;
    f16::from_le_bytes([row[at], row[at + 1]]).to_f32()
}

/// Rows of `d` values (any number) from the rotated domain back: the Walsh–Hadamard transform
/// (its own inverse), then the sign flip. Linear, so it may run on a weighted sum of rows.
pub fn unrotate(x: &mut [f32], d: usize) {
    rotate_rows(x, d);
    for row in x.chunks_exact_mut(d) {
        row.iter_mut().enumerate().for_each(|(i, v)| *v *= sign(i));
    }
}

/// Bytes of one stored half: a TurboQuant cache keeps each (head, token)'s key row then value
/// row as one joined row, cut into two equal halves held as its `k` and `v` rows.
pub fn half_bytes(quant: KvQuant, d: usize) -> usize {
    (quant.row_bytes(d) + quant.value_row_bytes(d)) / 2
}

/// Keys `k` and values `v` (`[.., d]`, any float dtype) as the two stored halves of their
/// joined rows (U8 `[.., half_bytes]`): keys quantized as `quant.keys()`, values encoded.
pub fn encode(quant: KvQuant, k: &candle_core::Tensor, v: &candle_core::Tensor) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
    let mut shape = k.dims().to_vec();
    let last = shape.len() - 1;
    let d = shape[last];
    let keys = super::quantize(quant.keys(), k)?.flatten_all()?.to_vec1::<u8>()?;
    let values = v.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let (kb, vb, bits) = (quant.row_bytes(d), quant.value_row_bytes(d), quant.turbo_values.unwrap_or(3));
    let mut joined = vec![0u8; keys.len() / kb * (kb + vb)];
    for ((out, key), value) in joined.chunks_exact_mut(kb + vb).zip(keys.chunks_exact(kb)).zip(values.chunks_exact(d)) {
        out[..kb].copy_from_slice(key);
        encode_row(bits, value, &mut out[kb..]);
    }
    let half = (kb + vb) / 2;
    shape[last] = kb + vb;
    let joined = candle_core::Tensor::from_vec(joined, shape.as_slice(), k.device())?;
    Ok((joined.narrow(last, 0, half)?.contiguous()?, joined.narrow(last, half, half)?.contiguous()?))
}

/// The halves `k`, `v` (U8 `[.., half_bytes]`) of `quant` widened to f32 keys and values
/// `[.., d]` (keys dequantized, values decoded and rotated back): what attention read before it
/// read the rows themselves, and what paths without a TurboQuant kernel still read.
pub fn widen(quant: KvQuant, k: &candle_core::Tensor, v: &candle_core::Tensor, d: usize) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
    let mut shape = k.dims().to_vec();
    let last = shape.len() - 1;
    let half = shape[last];
    if half != half_bytes(quant, d) || v.dims() != k.dims() {
        candle_core::bail!("TurboQuant rows of {half} bytes are not {} halves of head size {d}", quant.name())
    }
    let joined = candle_core::Tensor::cat(&[k, v], last)?.flatten_all()?.to_vec1::<u8>()?;
    let (kb, bits, key_format) = (quant.row_bytes(d), quant.turbo_values.unwrap_or(3), quant.keys());
    let rows = joined.len() / (2 * half);
    let (mut keys, mut values) = (vec![0f32; rows * d], vec![0f32; rows * d]);
    for ((row, key), value) in joined.chunks_exact(2 * half).zip(keys.chunks_exact_mut(d)).zip(values.chunks_exact_mut(d)) {
        key_format.dequantize_row(&row[..kb], key);
        decode_row(bits, &row[kb..], value);
    }
    shape[last] = d;
    let dev = k.device();
    Ok((candle_core::Tensor::from_vec(keys, shape.as_slice(), dev)?, candle_core::Tensor::from_vec(values, shape.as_slice(), dev)?))
}

/// The `bits`-wide code of value `i` in a little-endian bit stream.
pub fn get_bits(codes: &[u8], bits: u8, i: usize) -> u32 {
    let (bit, width) = (i * bits as usize, bits as u32);
    let mut word = 0u32;
    for (k, b) in codes[bit / 8..].iter().take(3).enumerate() {
        word |= (*b as u32) << (8 * k);
    }
    (word >> (bit % 8)) & ((1 << width) - 1)
}

fn put_bits(codes: &mut [u8], bits: u8, i: usize, code: u32) {
    let bit = i * bits as usize;
    let shifted = code << (bit % 8);
    for (k, b) in codes[bit / 8..].iter_mut().take(3).enumerate() {
        *b |= (shifted >> (8 * k)) as u8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheme in f64: sign flip, normalized Walsh–Hadamard transform, RMS per 32, nearest
    /// centroid by the midpoint boundaries, read back with the f16 RMS, rotated back.
    fn reference(bits: u8, x: &[f32]) -> (Vec<u32>, Vec<f64>) {
        let d = x.len();
        let fwht = |v: &mut [f64]| {
            let mut h = 1;
            while h < d {
                for i in (0..d).step_by(2 * h) {
                    for j in i..i + h {
                        let (a, b) = (v[j], v[j + h]);
                        (v[j], v[j + h]) = (a + b, a - b);
                    }
                }
                h *= 2;
            }
            v.iter_mut().for_each(|e| *e /= (d as f64).sqrt());
        };
        let book: Vec<f64> = codebook(bits).iter().map(|c| *c as f64).collect();
        let mut y: Vec<f64> = x.iter().enumerate().map(|(i, v)| *v as f64 * sign(i) as f64).collect();
        fwht(&mut y);
        let (mut codes, mut back) = (Vec::new(), Vec::new());
        for ys in y.chunks_exact(GROUP) {
            let rms = (ys.iter().map(|v| v * v).sum::<f64>() / GROUP as f64).sqrt();
            let stored = f16::from_f64(rms).to_f64();
            for v in ys {
                let code = book.windows(2).filter(|w| v / rms > (w[0] + w[1]) / 2.0).count();
                codes.push(code as u32);
                back.push(book[code] * stored);
            }
        }
        fwht(&mut back);
        back.iter_mut().enumerate().for_each(|(i, v)| *v *= sign(i) as f64);
        (codes, back)
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        let mut uniform = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        // Gaussian (Box–Muller) with an outlier channel and an offset, as values have.
        (0..n).map(|i| ((-2.0 * uniform().ln()).sqrt() * (6.283185307 * uniform()).cos() + if i % 64 == 3 { 6.0 } else { 0.3 }) as f32).collect()
    }

    /// Encode → decode equals the f64 reference: the same codes (but for values within f32
    /// rounding of a boundary), values within f32 rounding.
    #[test]
    fn round_trip_matches_the_f64_reference() {
        for bits in [2, 3, 4] {
            for d in [64, 128, 256] {
                let rows = 40;
                let x = data(d * rows, bits as u64 * 7 + d as u64);
                let (mut row, mut back) = (vec![0u8; row_bytes(bits, d)], vec![0f32; d]);
                let mut ties = 0;
                for xs in x.chunks_exact(d) {
                    encode_row(bits, xs, &mut row);
                    decode_row(bits, &row, &mut back);
                    let (codes, want) = reference(bits, xs);
                    let code_bytes = d * bits as usize / 8;
                    let differ = (0..d).filter(|&i| get_bits(&row[..code_bytes], bits, i) != codes[i]).count();
                    ties += differ;
                    if differ == 0 {
                        for (got, w) in back.iter().zip(&want) {
                            assert!((*got as f64 - w).abs() < 1e-5 * w.abs().max(1.0), "{bits} bits d{d}: {got} vs {w}");
                        }
                    }
                }
                assert!(ties * 2000 <= x.len(), "{bits} bits d{d}: {ties} codes differ from the reference");
            }
        }
    }

    /// On Gaussian rows the error is the codebook's: relative MSE near the Lloyd–Max
    /// distortion of the unit normal (2 bits 0.1175, 3 bits 0.03455, 4 bits 0.009497); a little
    /// below it (measured 0.103, 0.0312, 0.0086), as each group is scaled by its own RMS.
    #[test]
    fn distortion_is_the_lloyd_max_distortion() {
        for (bits, want) in [(2, 0.1175), (3, 0.03455), (4, 0.009497)] {
            let d = 128;
            let x: Vec<f32> = data(d * 400, 99 + bits as u64);
            let (mut row, mut back) = (vec![0u8; row_bytes(bits, d)], vec![0f32; d]);
            let (mut err, mut energy) = (0f64, 0f64);
            for xs in x.chunks_exact(d) {
                encode_row(bits, xs, &mut row);
                decode_row(bits, &row, &mut back);
                err += xs.iter().zip(&back).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
                energy += xs.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
            }
            let mse = err / energy;
            assert!(mse > 0.8 * want && mse < 1.05 * want, "{bits} bits: relative MSE {mse}, Lloyd–Max {want}");
        }
    }

    #[test]
    fn bit_streams_round_trip_and_row_sizes() {
        for bits in [2u8, 3, 4] {
            let d = 64;
            let mut codes = vec![0u8; d * bits as usize / 8];
            for i in 0..d {
                put_bits(&mut codes, bits, i, (i as u32 * 5 + 1) % (1 << bits));
            }
            assert!((0..d).all(|i| get_bits(&codes, bits, i) == (i as u32 * 5 + 1) % (1 << bits)));
        }
        // vllm-metal's 3-bit packing: 8 values in 3 bytes, v0 in bits 0-2 of byte 0.
        let mut three = [0u8; 3];
        for (i, v) in [1u32, 2, 3, 4, 5, 6, 7, 0].iter().enumerate() {
            put_bits(&mut three, 3, i, *v);
        }
        assert_eq!(three, [0b11_010_001, 0b0_101_100_0, 0b000_111_11]);
        assert_eq!(row_bytes(3, 128), 56);
        assert_eq!(row_bytes(2, 64), 20);
    }
}
