use candle_core::{DType, Device, Tensor};

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
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
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
