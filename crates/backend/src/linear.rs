use crate::cpu::{matmul::WeightBytes, CpuMatmul, Format};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Module, Shape, Tensor};
use std::sync::Arc;

/// A weight matrix `[out, in]` exactly as the checkpoint stores it (GGML blocks or dense),
/// usually borrowed from the model file's memory map.
#[derive(Clone)]
pub struct Weight {
    pub dtype: GgmlDType,
    /// GGML order reversed to the usual `[rows, cols]`.
    pub dims: Vec<usize>,
    pub data: Arc<dyn WeightBytes>,
}

impl Weight {
    pub fn bytes(&self) -> usize {
        self.data.bytes().len()
    }

    /// A candle tensor of the blocks on `device` (a copy).
    pub fn qtensor(&self, device: &Device) -> candle_core::Result<QTensor> {
        qtensor_from_ggml(self.dtype, self.data.bytes(), self.dims.clone(), device)
    }

    /// Dequantized to f32 on `device`.
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        self.qtensor(&Device::Cpu)?
            .dequantize(&Device::Cpu)?
            .to_device(device)
    }

    fn cpu_matmul(&self) -> Option<CpuMatmul> {
        let [rows, cols] = self.dims[..] else {
            return None;
        };
        CpuMatmul::new(
            Format::from_ggml(self.dtype)?,
            rows,
            cols,
            self.data.clone(),
        )
    }
}

enum Kernel {
    /// ferrolm's CPU kernels over the mapped blocks.
    Cpu(Arc<CpuMatmul>),
    /// candle's quantized or dense matmul (CUDA, or formats without a CPU kernel).
    Candle(QMatMul),
}

/// y = x Wᵀ (+ b) over the last dimension of x.
pub struct Linear {
    kernel: Kernel,
    bias: Option<Tensor>,
    out_features: usize,
    bytes: usize,
}

impl Linear {
    pub fn new(
        weight: &Weight,
        bias: Option<Tensor>,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let out_features = weight.dims[0];
        let kernel = match (device, weight.cpu_matmul()) {
            (Device::Cpu, Some(mm)) => Kernel::Cpu(Arc::new(mm)),
            _ => Kernel::Candle(QMatMul::from_arc(Arc::new(weight.qtensor(device)?))?),
        };
        Ok(Self {
            kernel,
            bias,
            out_features,
            bytes: weight.bytes(),
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes of weight read per forward (for roofline figures).
    pub fn weight_bytes(&self) -> usize {
        self.bytes
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.kernel {
            Kernel::Cpu(mm) => x.contiguous()?.apply_op1_no_bwd(&CpuLinearOp(mm))?,
            Kernel::Candle(mm) => mm.forward(x)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

struct CpuLinearOp<'a>(&'a CpuMatmul);

impl CustomOp1 for CpuLinearOp<'_> {
    fn name(&self) -> &'static str {
        "cpu-linear"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("cpu-linear: expected f32 input")
        };
        let dims = layout.shape().dims();
        let k = *dims.last().unwrap_or(&0);
        if k != self.0.cols() {
            candle_core::bail!(
                "cpu-linear: input has {k} features, weight expects {}",
                self.0.cols()
            )
        }
        let t = layout.shape().elem_count() / k.max(1);
        let x = &data[layout.start_offset()..layout.start_offset() + t * k];
        let mut y = vec![0f32; t * self.0.rows()];
        self.0.forward(x, t, &mut y);
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().unwrap() = self.0.rows();
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}
