use crate::cpu::threads::{filled_vec, parallel_ranges, SharedOut};
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};

/// RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) * weight.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f32) -> candle_core::Result<Self> {
        Ok(Self { weight: weight.to_dtype(DType::F32)?, eps })
    }

    /// The f32 weight and epsilon (for kernels that fuse the norm in).
    pub fn parts(&self) -> (&Tensor, f32) {
        (&self.weight, self.eps)
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if !matches!(x.device(), Device::Cpu) {
            return self.forward_device(x);
        }
        let x = x.contiguous()?;
        if x.dtype() == DType::F32 {
            // Rows split over ferrolm's CPU threads (candle's kernel runs on rayon's, which then
            // compete with ours for the cores).
            return x.apply_op2_no_bwd(&self.weight, &CpuRmsNorm(self.eps));
        }
        candle_nn::ops::rms_norm(&x, &self.weight, self.eps)
    }

    /// The residual sum `x + r` and its norm: one kernel for both on CUDA (the sum rounded to x's
    /// dtype as the separate add rounds it), the add then [`RmsNorm::forward`] elsewhere.
    pub fn forward_add(&self, x: &Tensor, r: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if !matches!(x.device(), Device::Cpu) && x.dims() == r.dims() {
            if let Some(pair) = crate::cuda::ops::add_rms_norm(&x.contiguous()?, &r.contiguous()?, &self.weight, self.eps)? {
                return Ok(pair);
            }
        }
        let sum = crate::ops::add(x, r)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }

    /// Non-CPU devices: activations may be bf16 while the weight stays f32.
    fn forward_device(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.contiguous()?;
        #[cfg(feature = "cuda")]
        if let Some(y) = crate::cuda::ops::rms_norm(&x, &self.weight, self.eps)? {
            return Ok(y);
        }
        let w = self.weight.to_dtype(x.dtype())?;
        candle_nn::ops::rms_norm(&x, &w, self.eps)
    }
}

/// RMSNorm of contiguous f32 rows on the CPU.
struct CpuRmsNorm(f32);

impl CustomOp2 for CpuRmsNorm {
    fn name(&self) -> &'static str {
        "cpu-rms-norm"
    }

    fn cpu_fwd(&self, x: &CpuStorage, xl: &Layout, w: &CpuStorage, wl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (x, w) else { candle_core::bail!("rms-norm: expected f32") };
        let dim = *xl.shape().dims().last().unwrap_or(&0);
        if dim == 0 || wl.shape().elem_count() != dim || !xl.is_contiguous() || !wl.is_contiguous() {
            candle_core::bail!("rms-norm: shapes {:?} and {:?}", xl.shape(), wl.shape())
        }
        let n = xl.shape().elem_count();
        let (x, w) = (&x[xl.start_offset()..xl.start_offset() + n], &w[wl.start_offset()..wl.start_offset() + dim]);
        let eps = self.0;
        let fill = |shared: SharedOut| {
            parallel_ranges(n / dim, 1, n >= 1 << 14, |rows| {
                for r in rows {
                    // SAFETY: each thread writes only its own rows.
                    let y = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(r * dim), dim) };
                    normalize_row(&x[r * dim..(r + 1) * dim], w, eps, y);
                }
            })
        };
        // SAFETY: the rows cover all n values.
        let out = unsafe { filled_vec(n, fill) };
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }
}

/// y = x / sqrt(mean(x²) + eps) · w, with the squares summed in 16 lanes (vectorizes).
fn normalize_row(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let mut lanes = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for c in chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let mean = (lanes.iter().sum::<f32>() + tail) / x.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
        *y = x * inv * w;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equals candle's kernel to f32 rounding, on a batch large enough to split over threads.
    #[test]
    fn cpu_rms_norm_equals_candle() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let x = (Tensor::randn(0f32, 1.0, (300, 3, 100), &dev)? * 3.0)?;
        let w = Tensor::randn(1f32, 0.5, 100, &dev)?;
        let norm = RmsNorm::new(w.clone(), 1e-6)?;
        let want = candle_nn::ops::rms_norm(&x, &w, 1e-6)?;
        let diff = (norm.forward(&x)? - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff <= 4e-7 * scale, "{diff} vs {scale}");
        Ok(())
    }
}
