//! Quantized KV-cache rows (`--kv-bits 8|4`): affine group quantization along head_dim, as
//! mlx-bun's (mlx's `affine` mode) — per group of `group` values a scale and a bias (both f16),
//! codes `c = round((x − bias) / scale)` in `0..2^bits`, read back as `c·scale + bias`.
//!
//! Affine rather than symmetric (llama.cpp's q8_0/q4_0): keys carry per-channel offsets (RoPE'd
//! biases, outlier channels) that leave a group's values off-centre; the bias spends the whole
//! code range on the group's actual span, which matters at 4 bits. Groups run along head_dim
//! only, so every cached token is one self-contained row and trimming by tokens stays exact.
//!
//! Rows are first rotated by a normalized Walsh–Hadamard transform along head_dim (as llama.cpp
//! does for its quantized KV since 2026, `attn_rot_k`/`attn_rot_v`): keys of models with outlier
//! channels (Qwen2's k biases) spread their outliers over the whole row, so a group's range, and
//! its quantization step, shrink. Queries get the same rotation (q·k is unchanged by an
//! orthonormal rotation) and the attention output the inverse (the transform is its own
//! inverse), so attention reads rotated rows as they are.
//!
//! A row of one (head, token) is `codes` then `groups × (scale, bias)` as little-endian f16:
//! 8 bits: one byte per value; 4 bits: per 32-value block 16 bytes, byte i holding value i in
//! its low nibble and value i+16 in its high nibble (so 16 consecutive values unpack from 16
//! bytes with one shift or mask). Rows sit in U8 tensors `[kv_heads, tokens, row_bytes]`.

use half::f16;

pub mod turbo;

/// A quantized cache format: bits per value and values per group (along head_dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvQuant {
    pub bits: u8,
    pub group: usize,
    /// Rows (and queries) rotated by the Walsh–Hadamard transform (the default).
    pub rotate: bool,
    /// TurboQuant (`KvQuant::turbo`): values are coded apart, with a Lloyd–Max codebook of this
    /// many bits after a sign flip and rotation ([`turbo`]); keys as the fields above say. Such
    /// a format names a cache (`ferrolm_kv`'s `TurboCache`), never rows handed to attention.
    pub turbo_values: Option<u8>,
    /// mlx_lm's `quantized_kv_start`: the cache stays float until a step leaves it holding more
    /// than this many tokens, then all of it is quantized (`ferrolm_kv`'s `DeferredCache`);
    /// 0 quantizes from the first token. A cache setting; rows never carry it.
    pub start: usize,
}

/// Group sizes accepted (powers of two, multiples of the 32-value 4-bit block).
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

impl KvQuant {
    /// `bits` 8 or 4, `group` one of [`GROUP_SIZES`].
    pub fn new(bits: u8, group: usize) -> Result<Self, String> {
        if bits != 8 && bits != 4 {
            return Err(format!("KV bits must be 8 or 4, not {bits}"));
        }
        if !GROUP_SIZES.contains(&group) {
            return Err(format!("KV group size must be one of {GROUP_SIZES:?}, not {group}"));
        }
        Ok(Self { bits, group, rotate: true, turbo_values: None, start: 0 })
    }

    /// TurboQuant as mlx-bun (`--kv-quant turbo[:k<b>v<b>]`, default k8v3): keys affine
    /// `k_bits` (8 or 4) in groups of 32 without rotation, values `v_bits` (2, 3 or 4) of
    /// Lloyd–Max codes after a sign flip and rotation.
    pub fn turbo(k_bits: u8, v_bits: u8) -> Result<Self, String> {
        if !(2..=4).contains(&v_bits) {
            return Err(format!("TurboQuant value bits must be 2, 3 or 4, not {v_bits}"));
        }
        let keys = Self::new(k_bits, turbo::GROUP).map_err(|e| format!("TurboQuant keys: {e}"))?;
        Ok(Self { rotate: false, turbo_values: Some(v_bits), ..keys })
    }

    /// The key rows' format of a TurboQuant format (itself otherwise).
    pub fn keys(&self) -> Self {
        Self { turbo_values: None, ..*self }
    }

    /// Bytes of one (head, token) value row: a TurboQuant value row, else `row_bytes`.
    pub fn value_row_bytes(&self, d: usize) -> usize {
        match self.turbo_values {
            Some(bits) => turbo::row_bytes(bits, d),
            None => self.row_bytes(d),
        }
    }

    /// The format quantizing only once the cache holds more than `start` tokens.
    pub fn starting_at(self, start: usize) -> Self {
        Self { start, ..self }
    }

    /// The format without (false) or with the Hadamard rotation.
    pub fn with_rotation(self, rotate: bool) -> Self {
        Self { rotate, ..self }
    }

    /// Whether rows of head size `d` can be stored (whole groups).
    pub fn check_head_dim(&self, d: usize) -> Result<(), String> {
        if self.turbo_values.is_some() && d % 64 != 0 {
            return Err(format!("TurboQuant needs a head_dim that is a multiple of 64, not {d}"));
        }
        match d % self.group {
            0 => Ok(()),
            _ => Err(format!("head_dim {d} is not a multiple of the KV group size {}", self.group)),
        }
    }

    /// Names the format in cache signatures: `q8g64`, `turbo-k8v3`.
    /// `-norot` marks a format without the rotation, `@N` a `start` of N.
    pub fn name(&self) -> String {
        let start = if self.start > 0 { format!("@{}", self.start) } else { String::new() };
        if let Some(v) = self.turbo_values {
            return format!("turbo-k{}v{v}{start}", self.bits);
        }
        format!("q{}g{}{}{start}", self.bits, self.group, if self.rotate { "" } else { "-norot" })
    }

    pub fn code_bytes(&self, d: usize) -> usize {
        d * self.bits as usize / 8
    }

    /// Bytes of one (head, token) row of head size `d`.
    pub fn row_bytes(&self, d: usize) -> usize {
        self.code_bytes(d) + d / self.group * 4
    }

    fn levels(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// Group `g`'s scale and bias in `row` (head size `d`).
    #[inline(always)]
    pub fn scale_bias(&self, row: &[u8], d: usize, g: usize) -> (f32, f32) {
        let at = self.code_bytes(d) + 4 * g;
        let half = |i: usize| f16::from_le_bytes([row[i], row[i + 1]]).to_f32();
        (half(at), half(at + 2))
    }

    /// The code of value `i` in `row`.
    #[inline(always)]
    pub fn code(&self, row: &[u8], i: usize) -> u8 {
        match self.bits {
            8 => row[i],
            _ => {
                let byte = row[i / 32 * 16 + i % 16];
                if i % 32 < 16 {
                    byte & 0xf
                } else {
                    byte >> 4
                }
            }
        }
    }

    /// Writes the row of `x` (head size `x.len()`) into `out` (`row_bytes` long).
    pub fn quantize_row(&self, x: &[f32], out: &mut [u8]) {
        let d = x.len();
        debug_assert_eq!(out.len(), self.row_bytes(d));
        let code_bytes = self.code_bytes(d);
        out[..code_bytes].fill(0);
        for (g, xs) in x.chunks_exact(self.group).enumerate() {
            let (min, max) = xs.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            // Codes are chosen against the stored (f16) scale and bias, so their rounding is
            // absorbed by the codes except at the ends of the range.
            let scale = f16::from_f32((max - min) / self.levels());
            let bias = f16::from_f32(min);
            let (s, b) = (scale.to_f32(), bias.to_f32());
            for (k, &v) in xs.iter().enumerate() {
                let c = if s > 0.0 { ((v - b) / s).round().clamp(0.0, self.levels()) as u8 } else { 0 };
                self.put_code(out, g * self.group + k, c);
            }
            let at = code_bytes + 4 * g;
            out[at..at + 2].copy_from_slice(&scale.to_le_bytes());
            out[at + 2..at + 4].copy_from_slice(&bias.to_le_bytes());
        }
    }

    fn put_code(&self, row: &mut [u8], i: usize, c: u8) {
        match self.bits {
            8 => row[i] = c,
            _ => {
                let byte = &mut row[i / 32 * 16 + i % 16];
                *byte |= if i % 32 < 16 { c } else { c << 4 };
            }
        }
    }

    /// The values of `row` into `out` (head size `out.len()`): `code·scale + bias`, a product
    /// then a sum (no fused multiply-add), as every kernel reads them.
    pub fn dequantize_row(&self, row: &[u8], out: &mut [f32]) {
        let d = out.len();
        for (g, o) in out.chunks_exact_mut(self.group).enumerate() {
            let (s, b) = self.scale_bias(row, d, g);
            for (k, x) in o.iter_mut().enumerate() {
                *x = self.code(row, g * self.group + k) as f32 * s + b;
            }
        }
    }

    /// Quantizes `x` (rows of head size `d`, any number) into rows of `row_bytes(d)`.
    pub fn quantize_rows(&self, x: &[f32], d: usize) -> Vec<u8> {
        let rb = self.row_bytes(d);
        let mut out = vec![0u8; x.len() / d * rb];
        for (xs, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(rb)) {
            self.quantize_row(xs, o);
        }
        out
    }

    /// Dequantizes rows of `row_bytes(d)` into values.
    pub fn dequantize_rows(&self, rows: &[u8], d: usize) -> Vec<f32> {
        let rb = self.row_bytes(d);
        let mut out = vec![0f32; rows.len() / rb * d];
        for (r, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(d)) {
            self.dequantize_row(r, o);
        }
        out
    }
}

/// The Walsh–Hadamard block for head size `d`: its largest power-of-two divisor.
pub fn hadamard_block(d: usize) -> usize {
    1 << d.trailing_zeros()
}

/// Rotates every row of `d` values in `x` by the normalized Walsh–Hadamard transform (over
/// blocks of [`hadamard_block`]); applying it twice gives the rows back (up to f32 rounding).
/// The same arithmetic for every row, whatever else is in `x`.
pub fn rotate_rows(x: &mut [f32], d: usize) {
    let n = hadamard_block(d);
    let norm = 1.0 / (n as f32).sqrt();
    for block in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            // Written over slice halves so that the stages with h ≥ 8 vectorize; each
            // butterfly is the same two operations in any case.
            for pair in block.chunks_exact_mut(2 * h) {
                let (lo, hi) = pair.split_at_mut(h);
                for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        block.iter_mut().for_each(|v| *v *= norm);
    }
}

/// `x` `[.., d]` (f32, any layout) with every row rotated ([`rotate_rows`]).
pub fn rotate(x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    let d = *x.dims().last().unwrap_or(&1);
    let mut data = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    rotate_rows(&mut data, d);
    candle_core::Tensor::from_vec(data, x.dims(), x.device())
}

/// Quantizes `x` `[.., d]` (any float dtype) into a U8 tensor `[.., row_bytes]`, rotated
/// first when the format says so.
pub fn quantize(q: KvQuant, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    let dims = x.dims().to_vec();
    let d = *dims.last().unwrap_or(&0);
    let mut data = x.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if q.rotate {
        rotate_rows(&mut data, d);
    }
    let rows = q.quantize_rows(&data, d);
    let mut shape = dims;
    *shape.last_mut().unwrap() = q.row_bytes(d);
    candle_core::Tensor::from_vec(rows, shape, x.device())
}

/// Dequantizes a U8 tensor `[.., row_bytes]` of head size `d` into f32 `[.., d]`, rotated back
/// when the format rotates.
pub fn dequantize(q: KvQuant, rows: &candle_core::Tensor, d: usize) -> candle_core::Result<candle_core::Tensor> {
    let mut shape = rows.dims().to_vec();
    let data = rows.flatten_all()?.to_vec1::<u8>()?;
    *shape.last_mut().unwrap() = d;
    let mut values = q.dequantize_rows(&data, d);
    if q.rotate {
        rotate_rows(&mut values, d);
    }
    candle_core::Tensor::from_vec(values, shape, rows.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scheme in f64: scale and bias as stored (f16), codes by exact rounding.
    fn reference(q: KvQuant, x: &[f32]) -> (Vec<u8>, Vec<f64>) {
        let (mut codes, mut values) = (Vec::new(), Vec::new());
        let levels = ((1u32 << q.bits) - 1) as f64;
        for xs in x.chunks_exact(q.group) {
            let min = xs.iter().fold(f64::INFINITY, |m, &v| m.min(v as f64));
            let max = xs.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let s = f16::from_f64((max - min) / levels).to_f64();
            let b = f16::from_f64(min).to_f64();
            for &v in xs {
                let c = if s > 0.0 { ((v as f64 - b) / s).round().clamp(0.0, levels) } else { 0.0 };
                codes.push(c as u8);
                values.push(c * s + b);
            }
        }
        (codes, values)
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        // Off-centre groups with an outlier channel now and then, as keys have.
        let mut state = seed;
        (0..n)
            .map(|i| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = (state >> 11) as f64 / (1u64 << 53) as f64;
                let outlier = if i % 37 == 5 { 9.0 } else { 0.0 };
                (u * 4.0 - 1.0 + outlier + (i / 64 % 3) as f64) as f32
            })
            .collect()
    }

    /// Quantize → dequantize equals the f64 reference of the scheme: the same codes (but for
    /// near-ties decided differently by f32 division, off by one), values within f32 rounding,
    /// and every value within half a step of the input (a step more at the clamped ends).
    #[test]
    fn round_trip_matches_the_f64_reference() {
        for (bits, group) in [(8, 32), (8, 64), (4, 32), (4, 64), (8, 128), (4, 128)] {
            let q = KvQuant::new(bits, group).unwrap();
            let d = 128;
            let x = data(d * 50, bits as u64 * 1000 + group as u64);
            let rows = q.quantize_rows(&x, d);
            assert_eq!(rows.len(), 50 * q.row_bytes(d));
            let back = q.dequantize_rows(&rows, d);
            let mut ties = 0;
            for (r, xs) in x.chunks_exact(d).enumerate() {
                let (codes, values) = reference(q, xs);
                let row = &rows[r * q.row_bytes(d)..(r + 1) * q.row_bytes(d)];
                for i in 0..d {
                    let (ours, want) = (q.code(row, i), codes[i]);
                    let (s, _) = q.scale_bias(row, d, i / group);
                    if ours != want {
                        ties += 1;
                        assert_eq!(ours.abs_diff(want), 1, "{bits}-bit g{group}: value {i}");
                        continue;
                    }
                    let got = back[r * d + i] as f64;
                    assert!((got - values[i]).abs() <= 1e-6 * values[i].abs().max(1.0), "{bits}-bit g{group}: {got} vs {}", values[i]);
                    assert!((got - xs[i] as f64).abs() <= s as f64 * 0.5 + 0.01 * s as f64 + 2e-3 * (xs[i] as f64).abs(), "{bits}-bit g{group}: {got} vs input {}", xs[i]);
                }
            }
            assert!(ties * 1000 <= x.len(), "{bits}-bit g{group}: {ties} codes differ");
        }
    }

    /// Row sizes: 8-bit g64 at d 128 is 53.1 % of f16, 4-bit g64 28.1 %.
    #[test]
    fn row_bytes_per_format() {
        let q8 = KvQuant::new(8, 64).unwrap();
        let q4 = KvQuant::new(4, 64).unwrap();
        assert_eq!(q8.row_bytes(128), 136);
        assert_eq!(q4.row_bytes(128), 72);
        assert_eq!(KvQuant::new(4, 32).unwrap().row_bytes(64), 40);
        assert!(KvQuant::new(3, 32).is_err() && KvQuant::new(8, 48).is_err());
        assert!(q8.check_head_dim(96).is_err() && q8.check_head_dim(192).is_ok());
    }

    /// The rotation is orthonormal (dot products kept) and its own inverse, for head sizes of
    /// one power-of-two block and of several (96 = 3 × 32).
    #[test]
    fn rotation_keeps_dot_products_and_undoes_itself() {
        for d in [64, 128, 96] {
            let (a, b) = (data(d, 1), data(d, 2));
            let (mut ra, mut rb) = (a.clone(), b.clone());
            rotate_rows(&mut ra, d);
            rotate_rows(&mut rb, d);
            let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| *p as f64 * *q as f64).sum::<f64>();
            assert!((dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-4 * dot(&a, &a).sqrt() * dot(&b, &b).sqrt());
            rotate_rows(&mut ra, d);
            assert!(a.iter().zip(&ra).all(|(x, y)| (x - y).abs() < 1e-5 * x.abs().max(1.0)), "d {d}");
        }
        // An outlier channel is spread over the block.
        let mut x = vec![0f32; 64];
        x[5] = 8.0;
        rotate_rows(&mut x, 64);
        assert!(x.iter().all(|v| v.abs() == 1.0));
    }

    /// A constant group (zero range) reads back exactly as its f16 value.
    #[test]
    fn constant_groups_read_back() {
        let q = KvQuant::new(4, 32).unwrap();
        let x = vec![0.5f32; 64];
        let back = q.dequantize_rows(&q.quantize_rows(&x, 64), 64);
        assert!(back.iter().all(|&v| v == 0.5));
    }
}
