//! GGML block formats: how many elements a block holds, its size in bytes, and how to
//! dequantize it to f32. Layouts follow ggml-quants.c; each `dequant` is written to vectorize.

use candle_core::quantized::GgmlDType;

/// A weight format the CPU kernels read directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl Format {
    /// None: a format without a CPU kernel here (the caller falls back to candle).
    pub fn from_ggml(d: GgmlDType) -> Option<Self> {
        Some(match d {
            GgmlDType::F32 => Format::F32,
            GgmlDType::F16 => Format::F16,
            GgmlDType::BF16 => Format::BF16,
            GgmlDType::Q4_0 => Format::Q4_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q5_0 => Format::Q5_0,
            GgmlDType::Q5_1 => Format::Q5_1,
            GgmlDType::Q8_0 => Format::Q8_0,
            GgmlDType::Q4K => Format::Q4K,
            GgmlDType::Q6K => Format::Q6K,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block(self) -> usize {
        match self {
            Format::Q4K | Format::Q6K => 256,
            _ => 32,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            Format::F32 => 128,
            Format::F16 | Format::BF16 => 64,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }
}

/// One block format, as a type so kernels are monomorphized per format.
pub trait Block {
    const N: usize;
    const BYTES: usize;
    /// Dequantizes `b[..BYTES]` into `out[..N]`.
    fn dequant(b: &[u8], out: &mut [f32]);
}

/// Branch-free IEEE half → single conversion (vectorizes; no F16C intrinsic needed).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let exp = em & 0x7c00;
    // Normal numbers: rebias the exponent. Subnormals: scale the mantissa exactly.
    let normal = f32::from_bits((em << 13) + ((127 - 15) << 23));
    let subnormal = (em as f32) * f32::from_bits((127 - 24) << 23);
    let inf_nan = f32::from_bits((em << 13) | (0xff << 23));
    let v = if exp == 0x7c00 {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(v.to_bits() | sign)
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

pub struct F32;
pub struct F16;
pub struct BF16;
pub struct Q4_0;
pub struct Q4_1;
pub struct Q5_0;
pub struct Q5_1;
pub struct Q8_0;
pub struct Q4K;
pub struct Q6K;

impl Block for F32 {
    const N: usize = 32;
    const BYTES: usize = 128;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        for (o, c) in out[..32].iter_mut().zip(b[..128].chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

impl Block for F16 {
    const N: usize = 32;
    const BYTES: usize = 64;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        for (o, c) in out[..32].iter_mut().zip(b[..64].chunks_exact(2)) {
            *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
        }
    }
}

impl Block for BF16 {
    const N: usize = 32;
    const BYTES: usize = 64;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        for (o, c) in out[..32].iter_mut().zip(b[..64].chunks_exact(2)) {
            *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
        }
    }
}

impl Block for Q4_0 {
    const N: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let d = half(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            out[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
            out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl Block for Q4_1 {
    const N: usize = 32;
    const BYTES: usize = 20;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let (d, m) = (half(b, 0), half(b, 2));
        let qs = &b[4..20];
        for j in 0..16 {
            out[j] = (qs[j] & 0x0f) as f32 * d + m;
            out[j + 16] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}

impl Block for Q5_0 {
    const N: usize = 32;
    const BYTES: usize = 22;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let d = half(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            out[j] = (((qs[j] & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
            out[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
        }
    }
}

impl Block for Q5_1 {
    const N: usize = 32;
    const BYTES: usize = 24;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let (d, m) = (half(b, 0), half(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            out[j] = ((qs[j] & 0x0f) as u32 | h0) as f32 * d + m;
            out[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
        }
    }
}

impl Block for Q8_0 {
    const N: usize = 32;
    const BYTES: usize = 34;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let d = half(b, 0);
        for j in 0..32 {
            out[j] = (b[2 + j] as i8) as f32 * d;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K super-block (ggml's get_scale_min_k4).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        let sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (sc as f32, m as f32)
    }
}

impl Block for Q4K {
    const N: usize = 256;
    const BYTES: usize = 144;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let (d, dmin) = (half(b, 0), half(b, 2));
        let scales = &b[4..16];
        let qs = &b[16..144];
        for part in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * part, scales);
            let (sc2, m2) = scale_min_k4(2 * part + 1, scales);
            let (d1, min1, d2, min2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
            let q = &qs[part * 32..part * 32 + 32];
            let o = &mut out[part * 64..part * 64 + 64];
            for l in 0..32 {
                o[l] = d1 * (q[l] & 0x0f) as f32 - min1;
                o[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
            }
        }
    }
}

impl Block for Q6K {
    const N: usize = 256;
    const BYTES: usize = 210;
    #[inline(always)]
    fn dequant(b: &[u8], out: &mut [f32]) {
        let d = half(b, 208);
        for half_block in 0..2 {
            let ql = &b[half_block * 64..half_block * 64 + 64];
            let qh = &b[128 + half_block * 32..128 + half_block * 32 + 32];
            let sc = &b[192 + half_block * 8..192 + half_block * 8 + 8];
            let o = &mut out[half_block * 128..half_block * 128 + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                o[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                o[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                o[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                o[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}

/// Dequantizes whole rows `[rows, cols]` of `bytes` in `format` (reference and embedding path).
pub fn dequant_rows(format: Format, bytes: &[u8], cols: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
    fn run<B: Block>(bytes: &[u8], cols: usize, rows: std::ops::Range<usize>, out: &mut [f32]) {
        let row_bytes = cols / B::N * B::BYTES;
        for (i, r) in rows.enumerate() {
            let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
            for (blk, o) in row.chunks_exact(B::BYTES).zip(out[i * cols..(i + 1) * cols].chunks_exact_mut(B::N)) {
                B::dequant(blk, o);
            }
        }
    }
    match format {
        Format::F32 => run::<F32>(bytes, cols, rows, out),
        Format::F16 => run::<F16>(bytes, cols, rows, out),
        Format::BF16 => run::<BF16>(bytes, cols, rows, out),
        Format::Q4_0 => run::<Q4_0>(bytes, cols, rows, out),
        Format::Q4_1 => run::<Q4_1>(bytes, cols, rows, out),
        Format::Q5_0 => run::<Q5_0>(bytes, cols, rows, out),
        Format::Q5_1 => run::<Q5_1>(bytes, cols, rows, out),
        Format::Q8_0 => run::<Q8_0>(bytes, cols, rows, out),
        Format::Q4K => run::<Q4K>(bytes, cols, rows, out),
        Format::Q6K => run::<Q6K>(bytes, cols, rows, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{bits:#x}");
        }
    }

    /// Every format dequantizes exactly as candle's reference does.
    #[test]
    fn dequant_equals_candle() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (rows, cols) = (3, 512);
        let x = (Tensor::randn(0f32, 1.0, (rows, cols), &dev)? * 3.0)?;
        for dt in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize(&x, dt)?;
            let want: Vec<f32> = q.dequantize(&dev)?.flatten_all()?.to_vec1()?;
            let data = q.data()?;
            let mut got = vec![0f32; rows * cols];
            dequant_rows(Format::from_ggml(dt).unwrap(), &data, cols, 0..rows, &mut got);
            assert_eq!(got, want, "{dt:?}");
        }
        Ok(())
    }
}
