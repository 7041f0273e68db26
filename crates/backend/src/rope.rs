//! Rotary position embeddings. Two conventions exist and checkpoints differ:
//! - `Interleaved` rotates pairs (x[2i], x[2i+1]) — GGML's "normal" RoPE, used for GGUF llama
//!   models, whose Q/K rows llama.cpp's converter permuted to match it;
//! - `HalfSplit` rotates pairs (x[i], x[i + d/2]) — GPT-NeoX style, used by Hugging Face llama
//!   checkpoints, Qwen2 and Gemma.
//! Both rotate pair i of a token at position p by the angle p · base^(-2i/d).

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Interleaved,
    HalfSplit,
}

/// Rows of the cos/sin tables computed together on the CPU.
const CPU_CHUNK: usize = 1024;

/// cos/sin tables for positions 0..max_positions. On a GPU both are whole tensors on the device
/// from the start (the kernels and the captured step index them by position). On the CPU, rows
/// are computed in chunks of `CPU_CHUNK` positions on first use: a model's full context (Gemma 3:
/// 32,768 positions × 2 tables × 2 bases) would otherwise sit in memory unread, 67 MB of it.
#[derive(Debug)]
pub struct Rope {
    style: RopeStyle,
    half: usize,
    inv_freq: Vec<f64>,
    max_positions: usize,
    device: Device,
    /// Whole tables as tensors: built in `new` off the CPU, on first use on the CPU (only the
    /// reference compositions and the static step use them there).
    tensors: std::sync::OnceLock<(Tensor, Tensor)>,
    /// CPU: chunk c holds positions c·CPU_CHUNK.. as (cos, sin), `half` values per position.
    chunks: Vec<std::sync::OnceLock<(Vec<f32>, Vec<f32>)>>,
}

impl Rope {
    /// `freq_factors` divides each pair's frequency (llama 3 style scaling), when present.
    pub fn new(
        style: RopeStyle,
        head_dim: usize,
        base: f64,
        max_positions: usize,
        freq_factors: Option<&[f32]>,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = base.powf(-2.0 * i as f64 / head_dim as f64);
                f / freq_factors.map_or(1.0, |ff| ff[i] as f64)
            })
            .collect();
        let chunks = (0..max_positions.div_ceil(CPU_CHUNK)).map(|_| std::sync::OnceLock::new()).collect();
        let rope = Self { style, half, inv_freq, max_positions, device: device.clone(), tensors: Default::default(), chunks };
        if !device.is_cpu() {
            rope.table_tensors()?;
        }
        Ok(rope)
    }

    /// cos and sin of positions `positions`, `half` values each.
    fn rows(&self, positions: std::ops::Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let n = positions.len() * self.half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for p in positions {
            for f in &self.inv_freq {
                let angle = p as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    /// The CPU chunk holding position `p`, and p's offset in it.
    fn cpu_chunk(&self, p: usize) -> (&(Vec<f32>, Vec<f32>), usize) {
        let c = p / CPU_CHUNK;
        let start = c * CPU_CHUNK;
        let chunk = self.chunks[c].get_or_init(|| self.rows(start..(start + CPU_CHUNK).min(self.max_positions)));
        (chunk, (p - start) * self.half)
    }

    fn table_tensors(&self) -> candle_core::Result<&(Tensor, Tensor)> {
        if let Some(t) = self.tensors.get() {
            return Ok(t);
        }
        let (cos, sin) = self.rows(0..self.max_positions);
        let shape = (self.max_positions, self.half);
        let t = (Tensor::from_vec(cos, shape, &self.device)?, Tensor::from_vec(sin, shape, &self.device)?);
        Ok(self.tensors.get_or_init(|| t))
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Rotates `x: [tokens, heads, head_dim]` whose tokens sit at positions start.. start+tokens.
    pub fn apply(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let (tokens, _heads, dim) = x.dims3()?;
        if dim != 2 * self.half {
            candle_core::bail!("rope: head_dim {dim} does not match the table ({})", 2 * self.half)
        }
        if start + tokens > self.max_positions() {
            candle_core::bail!("rope: position {} beyond the model's maximum {}", start + tokens, self.max_positions())
        }
        match (x.device(), x.dtype()) {
            (Device::Cpu, DType::F32) => x.contiguous()?.apply_op1_no_bwd(&RopeCpu { rope: self, start }),
            _ => {
                #[cfg(feature = "cuda")]
                if let Some(y) = self.apply_cuda(x, crate::cuda::Pos::Host(start))? {
                    return Ok(y);
                }
                self.apply_generic(x, start)
            }
        }
    }

    /// Rotates one token `x: [1, heads, head_dim]` at the position held in `pos` (a one-element
    /// u32 tensor on x's device), so that a captured step serves every position. The caller
    /// keeps the position below `max_positions`.
    pub fn apply_at(&self, x: &Tensor, pos: &Tensor) -> candle_core::Result<Tensor> {
        let (tokens, _heads, dim) = x.dims3()?;
        if tokens != 1 || dim != 2 * self.half {
            candle_core::bail!("rope: apply_at takes one token of head_dim {}", 2 * self.half)
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = self.apply_cuda(x, crate::cuda::Pos::Device(pos))? {
            return Ok(y);
        }
        let idx = pos.flatten_all()?;
        let (cos_t, sin_t) = self.table_tensors()?;
        let cos = cos_t.index_select(&idx, 0)?.to_dtype(x.dtype())?;
        let sin = sin_t.index_select(&idx, 0)?.to_dtype(x.dtype())?;
        self.rotate_generic(x, &cos, &sin)
    }

    /// The f32 tables `[max_positions, head_dim/2]` on the model's device and whether pairs are
    /// interleaved (for kernels that rotate on the fly).
    pub fn tables(&self) -> candle_core::Result<(&Tensor, &Tensor, bool)> {
        let (cos, sin) = self.table_tensors()?;
        Ok((cos, sin, self.style == RopeStyle::Interleaved))
    }

    #[cfg(feature = "cuda")]
    fn apply_cuda(&self, x: &Tensor, pos: crate::cuda::Pos<'_>) -> candle_core::Result<Option<Tensor>> {
        if !matches!(x.device(), Device::Cuda(_)) {
            return Ok(None);
        }
        let (cos, sin, interleaved) = self.tables()?;
        crate::cuda::ops::rope(&x.contiguous()?, cos, sin, pos, interleaved)
    }

    /// Device-independent composition of candle ops (the reference for the fused kernels).
    pub fn apply_generic(&self, x: &Tensor, start: usize) -> candle_core::Result<Tensor> {
        let tokens = x.dims3()?.0;
        let (cos_t, sin_t) = self.table_tensors()?;
        let cos = cos_t.narrow(0, start, tokens)?.to_dtype(x.dtype())?;
        let sin = sin_t.narrow(0, start, tokens)?.to_dtype(x.dtype())?;
        self.rotate_generic(x, &cos, &sin)
    }

    /// x `[tokens, heads, head_dim]` rotated by per-token rows `cos`, `sin` `[tokens, head_dim/2]`.
    fn rotate_generic(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let (tokens, heads, dim) = x.dims3()?;
        let half = self.half;
        match self.style {
            RopeStyle::HalfSplit => {
                let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
                let x1 = x.narrow(2, 0, half)?;
                let x2 = x.narrow(2, half, half)?;
                let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
                let b = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
                Tensor::cat(&[a, b], 2)
            }
            RopeStyle::Interleaved => {
                let pairs = x.reshape((tokens, heads, half, 2))?;
                let x0 = pairs.narrow(3, 0, 1)?;
                let x1 = pairs.narrow(3, 1, 1)?;
                let cos = cos.reshape((tokens, 1, half, 1))?;
                let sin = sin.reshape((tokens, 1, half, 1))?;
                let a = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
                let b = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
                Tensor::cat(&[a, b], 3)?.reshape((tokens, heads, dim))
            }
        }
    }
}

/// Fused CPU kernel: one pass over a contiguous f32 `[tokens, heads, head_dim]`.
struct RopeCpu<'a> {
    rope: &'a Rope,
    start: usize,
}

impl CustomOp1 for RopeCpu<'_> {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else { candle_core::bail!("rope: expected f32") };
        let (tokens, heads, dim) = layout.shape().dims3()?;
        let x = &data[layout.start_offset()..layout.start_offset() + tokens * heads * dim];
        let half = self.rope.half;
        let mut out = vec![0f32; x.len()];
        for t in 0..tokens {
            let ((cos_all, sin_all), at) = self.rope.cpu_chunk(self.start + t);
            let (cos, sin) = (&cos_all[at..at + half], &sin_all[at..at + half]);
            for h in 0..heads {
                let o = (t * heads + h) * dim;
                let (src, dst) = (&x[o..o + dim], &mut out[o..o + dim]);
                match self.rope.style {
                    RopeStyle::Interleaved => rotate_interleaved(src, dst, cos, sin),
                    RopeStyle::HalfSplit => rotate_half_split(src, dst, cos, sin),
                }
            }
        }
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

fn rotate_interleaved(src: &[f32], dst: &mut [f32], cos: &[f32], sin: &[f32]) {
    for i in 0..cos.len() {
        let (a, b) = (src[2 * i], src[2 * i + 1]);
        dst[2 * i] = a * cos[i] - b * sin[i];
        dst[2 * i + 1] = a * sin[i] + b * cos[i];
    }
}

fn rotate_half_split(src: &[f32], dst: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (src[i], src[i + half]);
        dst[i] = a * cos[i] - b * sin[i];
        dst[i + half] = a * sin[i] + b * cos[i];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_cpu_kernel_equals_generic_composition() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &dev)?;
        for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
            let rope = Rope::new(style, 8, 10000.0, 64, None, &dev)?;
            let fused = rope.apply(&x, 7)?;
            let generic = rope.apply_generic(&x, 7)?;
            let diff = (fused - generic)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-6, "{style:?}: {diff}");
        }
        Ok(())
    }

    #[test]
    fn position_zero_is_identity_and_norm_is_preserved() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 1, 4), &dev)?;
        let rope = Rope::new(RopeStyle::HalfSplit, 4, 10000.0, 8, None, &dev)?;
        let y = rope.apply(&x, 0)?;
        let row0 = (y.get(0)? - x.get(0)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(row0 < 1e-7);
        let n = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!((n(&y) - n(&x)).abs() < 1e-4);
        Ok(())
    }
}
