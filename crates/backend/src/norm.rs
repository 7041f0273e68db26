use candle_core::{DType, Tensor};

/// RMSNorm over the last dimension: x / sqrt(mean(x²) + eps) * weight.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f32) -> candle_core::Result<Self> {
        Ok(Self {
            weight: weight.to_dtype(DType::F32)?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)
    }
}
