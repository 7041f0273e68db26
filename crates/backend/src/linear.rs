use crate::cpu::threads::filled_vec;
use crate::cpu::{matmul::WeightBytes, CpuMatmul, Format};
use crate::norm::RmsNorm;
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Module, Shape, Tensor};
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
        self.qtensor(&Device::Cpu)?.dequantize(&Device::Cpu)?.to_device(device)
    }

    /// Whether the weight is stored dense (F32, F16 or BF16), not in quantized blocks.
    pub fn is_dense(&self) -> bool {
        is_dense(self.dtype)
    }

    /// A dense weight on `device` in its activation dtype (see [`Weight::is_dense`]).
    pub fn to_dense(&self, device: &Device) -> candle_core::Result<Tensor> {
        dense_stack(&[self], device)
    }

    fn rows_cols(&self) -> Option<(usize, usize)> {
        match self.dims[..] {
            [rows, cols] => Some((rows, cols)),
            _ => None,
        }
    }
}

/// One CPU kernel for weights stacked along the output, when they share format and width; for
/// an output `head` (one token per step), laid out for decode (`CpuMatmul::head`).
fn cpu_stack(weights: &[&Weight], head: bool) -> Option<CpuMatmul> {
    let (format, cols, parts) = cpu_parts(weights)?;
    match head {
        true => CpuMatmul::head(format, cols, parts),
        false => CpuMatmul::stacked(format, cols, parts),
    }
}

/// The CPU kernels' inputs for `weights` stacked (format, input width, (bytes, rows) per
/// weight), if they share a format and a width the kernels take. Checking this is cheap;
/// building the `CpuMatmul` copies the weights.
fn cpu_parts(weights: &[&Weight]) -> Option<(Format, usize, Vec<(Arc<dyn WeightBytes>, usize)>)> {
    let format = Format::from_ggml(weights[0].dtype)?;
    let (_, cols) = weights[0].rows_cols()?;
    let mut parts = Vec::new();
    for w in weights {
        let (rows, c) = w.rows_cols()?;
        if w.dtype != weights[0].dtype || c != cols {
            return None;
        }
        parts.push((w.data.clone(), rows));
    }
    CpuMatmul::accepts(format, cols, &parts).then_some((format, cols, parts))
}

enum Kernel {
    /// ferrolm's CPU kernels over the mapped blocks (all stacked weights in one region).
    Cpu(Arc<CpuMatmul>),
    /// candle's quantized or dense matmul (CUDA, or formats without a CPU kernel), one per
    /// stacked weight; outputs are concatenated.
    Candle(Vec<QMatMul>),
    /// Dense weights on a non-CPU device, converted once to the activation dtype and stacked
    /// `[out, in]`: one product (cuBLAS, or ferrolm's matrix-vector kernel for one row).
    Dense(Tensor),
}

/// y = x Wᵀ (+ b) over the last dimension of x. Several weights may be stacked along the
/// output (Q|K|V, gate|up) so they run as one product; `forward` returns them side by side.
pub struct Linear {
    kernel: Kernel,
    bias: Option<Tensor>,
    out_features: usize,
    bytes: usize,
}

impl Linear {
    pub fn new(weight: &Weight, bias: Option<Tensor>, device: &Device) -> candle_core::Result<Self> {
        Self::stacked(&[weight], &[bias], device)
    }

    /// An output head: it sees one token per step (logits are computed for the last position
    /// only), so on the CPU its weights are laid out for decode (see `CpuMatmul::head`).
    pub fn head(weight: &Weight, device: &Device) -> candle_core::Result<Self> {
        Self::build(&[weight], &[None], device, true)
    }

    /// Weights stacked along the output; `biases[i]` belongs to `weights[i]` (a missing bias of
    /// a stack where others have one counts as zeros).
    pub fn stacked(weights: &[&Weight], biases: &[Option<Tensor>], device: &Device) -> candle_core::Result<Self> {
        Self::build(weights, biases, device, false)
    }

    fn build(weights: &[&Weight], biases: &[Option<Tensor>], device: &Device, head: bool) -> candle_core::Result<Self> {
        let out_features = weights.iter().map(|w| w.dims[0]).sum();
        let bytes = weights.iter().map(|w| w.bytes()).sum();
        // Only on the CPU: building the CPU kernel copies the weights.
        let cpu = matches!(device, Device::Cpu).then(|| cpu_stack(weights, head)).flatten();
        let kernel = match (device, cpu) {
            (Device::Cpu, Some(mm)) => Kernel::Cpu(Arc::new(mm)),
            (Device::Cpu, None) => Kernel::Candle(
                weights
                    .iter()
                    .map(|w| QMatMul::from_arc(Arc::new(w.qtensor(device)?)))
                    .collect::<candle_core::Result<_>>()?,
            ),
            _ if weights.iter().all(|w| is_dense(w.dtype)) => Kernel::Dense(dense_stack(weights, device)?),
            _ => Kernel::Candle(
                weights
                    .iter()
                    .map(|w| QMatMul::from_arc(Arc::new(w.qtensor(device)?)))
                    .collect::<candle_core::Result<_>>()?,
            ),
        };
        let mut bias = stack_biases(weights, biases, device)?;
        if !matches!(device, Device::Cpu) {
            let dtype = crate::device::activation_dtype(device);
            bias = bias.map(|b| b.to_dtype(dtype)).transpose()?;
        }
        Ok(Self { kernel, bias, out_features, bytes })
    }

    /// Whether `weights` would run as one product when stacked on `device`: one format and
    /// width, with ferrolm's CPU kernel for it on CPU, or dense (one cuBLAS/GEMV call) elsewhere.
    /// Otherwise stacking only concatenates separate products, and callers keep them apart.
    pub fn can_stack(weights: &[&Weight], device: &Device) -> bool {
        let same = weights.iter().all(|w| w.dtype == weights[0].dtype && w.dims.get(1) == weights[0].dims.get(1));
        same && match device {
            Device::Cpu => cpu_parts(weights).is_some(),
            _ => is_dense(weights[0].dtype),
        }
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Bytes of weight read per forward (for roofline figures).
    pub fn weight_bytes(&self) -> usize {
        self.bytes
    }

    /// y = x Wᵀ (+ b); on the CPU one row is a decode row and several are prompt rows (see
    /// [`Linear::forward_rows`]).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let rows = x.elem_count() / x.dim(candle_core::D::Minus1)?.max(1);
        self.forward_rows(x, usize::from(rows == 1))
    }

    /// `forward` where the first `decode_rows` rows of x are decode rows (one token of each of
    /// several sequences) and the rest prompt rows. On the CPU each decode row's result is then
    /// bit-identical to its product alone and each prompt row's independent of how its prompt
    /// was cut into chunks (`CpuMatmul::forward_rows`); other devices ignore the split.
    pub fn forward_rows(&self, x: &Tensor, decode_rows: usize) -> candle_core::Result<Tensor> {
        let y = match &self.kernel {
            Kernel::Cpu(mm) => x.contiguous()?.apply_op1_no_bwd(&CpuLinearOp { mm, decode_rows })?,
            Kernel::Dense(w) => dense_forward(x, w)?,
            Kernel::Candle(mms) if !matches!(x.device(), Device::Cpu) => device_forward(mms, x)?,
            Kernel::Candle(mms) if mms.len() == 1 => mms[0].forward(x)?,
            Kernel::Candle(mms) => {
                let ys = mms.iter().map(|m| m.forward(x)).collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&ys, candle_core::D::Minus1)?
            }
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// How the one input row of [`Linear::forward_row`] is made from the previous step's output.
#[derive(Clone, Copy)]
pub enum RowInput<'a> {
    Plain(&'a Tensor),
    /// RMSNorm of x.
    Normed(&'a Tensor, &'a RmsNorm),
    /// silu(gate) · up.
    SiluMul(&'a Tensor, &'a Tensor),
}

impl<'a> RowInput<'a> {
    /// The same input for the CUDA kernels that make it themselves.
    #[cfg(feature = "cuda")]
    fn on_cuda(self) -> crate::cuda::ops::GemvInput<'a> {
        use crate::cuda::ops::GemvInput;
        match self {
            Self::Plain(x) => GemvInput::Plain(x),
            Self::Normed(x, n) => GemvInput::Normed(x, n.parts().0, n.parts().1),
            Self::SiluMul(g, u) => GemvInput::SiluMul(g, u),
        }
    }

    /// The input row, computed by separate operations.
    pub fn compose(self) -> candle_core::Result<Tensor> {
        match self {
            Self::Plain(x) => Ok(x.clone()),
            Self::Normed(x, norm) => norm.forward(x),
            Self::SiluMul(g, u) => crate::ops::silu_mul(g, u),
        }
    }
}

impl Linear {
    /// The weights `[out, in]` when they are dense on a non-CPU device and there is no bias
    /// (what single-kernel decode layers read directly).
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match (&self.kernel, &self.bias) {
            (Kernel::Dense(w), None) => Some(w),
            _ => None,
        }
    }

    /// One decode row: the step that makes the input (`input`), this product, and a residual
    /// add after it. On CUDA with dense bf16 weights and no bias that is one kernel; elsewhere
    /// the same operations one after another (identical results on CPU).
    pub fn forward_row(&self, input: RowInput<'_>, residual: Option<&Tensor>) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Kernel::Dense(w), None) = (&self.kernel, &self.bias) {
            if let Some(y) = crate::cuda::ops::gemv_fused(input.on_cuda(), w, residual)? {
                return Ok(y);
            }
        }
        let y = self.forward(&input.compose()?)?;
        match residual {
            Some(r) => r + y,
            None => Ok(y),
        }
    }

    /// One decode row of a stacked gate|up product (`[2·I, in]`, gate rows first) with
    /// silu(gate)·up applied in the same kernel: `[1, I]`. None where the backend has no such
    /// kernel (the caller then runs the product and the activation separately).
    pub fn forward_row_swiglu(&self, input: RowInput<'_>) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        return self.dense_row_kernel(input, crate::cuda::ops::gemv_swiglu);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = input;
            Ok(None)
        }
    }

    /// One decode row through an output head, as f32 logits `[1, out]` (the product's values
    /// in its own precision, converted), in one kernel where the backend has one; else None.
    pub fn forward_row_logits(&self, input: RowInput<'_>) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        return self.dense_row_kernel(input, crate::cuda::ops::gemv_logits);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = input;
            Ok(None)
        }
    }

    /// [`Linear::forward_row_logits`] that also ends a greedy decode step in the same kernel:
    /// `token[0]` ← the logits' argmax (first index on ties) and `pos[0] += 1` (one-element u32
    /// tensors on the device). None where the backend has no such kernel (nothing was run).
    pub fn forward_row_greedy(&self, input: RowInput<'_>, token: &Tensor, pos: &Tensor) -> candle_core::Result<Option<Tensor>> {
        #[cfg(feature = "cuda")]
        if let (Kernel::Dense(w), None) = (&self.kernel, &self.bias) {
            return crate::cuda::ops::gemv_logits_argmax(input.on_cuda(), w, token, Some(pos));
        }
        let _ = (input, token, pos);
        Ok(None)
    }

    /// `kernel` on this product's weights when they are dense on CUDA with no bias, else None.
    #[cfg(feature = "cuda")]
    fn dense_row_kernel(
        &self,
        input: RowInput<'_>,
        kernel: fn(crate::cuda::ops::GemvInput<'_>, &Tensor) -> candle_core::Result<Option<Tensor>>,
    ) -> candle_core::Result<Option<Tensor>> {
        match (&self.kernel, &self.bias) {
            (Kernel::Dense(w), None) => kernel(input.on_cuda(), w),
            _ => Ok(None),
        }
    }
}

fn is_dense(dtype: GgmlDType) -> bool {
    matches!(dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// Dense weights `[rows, cols]` stacked along the rows on `device`, in the activation dtype.
fn dense_stack(weights: &[&Weight], device: &Device) -> candle_core::Result<Tensor> {
    let act = crate::device::activation_dtype(device);
    let parts = weights
        .iter()
        .map(|w| {
            let dtype = match w.dtype {
                GgmlDType::F32 => DType::F32,
                GgmlDType::F16 => DType::F16,
                _ => DType::BF16,
            };
            Tensor::from_raw_buffer(w.data.bytes(), dtype, &w.dims, device)?.to_dtype(act)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    match parts.len() {
        1 => Ok(parts.into_iter().next().unwrap()),
        _ => Tensor::cat(&parts, 0),
    }
}

/// x `[.., in]` · wᵀ on a non-CPU device; one row goes through the matrix-vector kernel.
fn dense_forward(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let x = x.to_dtype(w.dtype())?.contiguous()?;
    let (out, inp) = w.dims2()?;
    #[cfg(feature = "cuda")]
    if x.elem_count() == inp {
        if let Some(y) = crate::cuda::ops::gemv(&x, w)? {
            return Ok(y);
        }
    }
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / inp.max(1);
    *dims.last_mut().unwrap() = out;
    let product = || x.reshape((rows, inp))?.matmul(&w.t()?)?.reshape(dims);
    #[cfg(feature = "cuda")]
    return crate::cuda::profile::region(x.device(), || format!("gemm {rows}x{out}x{inp}"), product);
    #[cfg(not(feature = "cuda"))]
    product()
}

/// candle's quantized matmul on a non-CPU device: activations go in as they are where candle's
/// kernels take them (bf16 on CUDA), else as f32; the output keeps the input's dtype.
fn device_forward(mms: &[QMatMul], x: &Tensor) -> candle_core::Result<Tensor> {
    let one = |m: &QMatMul| match m.forward(x) {
        Ok(y) => y.to_dtype(x.dtype()),
        Err(_) if x.dtype() != DType::F32 => m.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype()),
        Err(e) => Err(e),
    };
    let ys = mms.iter().map(one).collect::<candle_core::Result<Vec<_>>>()?;
    match ys.len() {
        1 => Ok(ys.into_iter().next().unwrap()),
        _ => Tensor::cat(&ys, candle_core::D::Minus1),
    }
}

fn stack_biases(
    weights: &[&Weight],
    biases: &[Option<Tensor>],
    device: &Device,
) -> candle_core::Result<Option<Tensor>> {
    if biases.iter().all(Option::is_none) {
        return Ok(None);
    }
    let parts = weights
        .iter()
        .zip(biases)
        .map(|(w, b)| match b {
            Some(b) => b.to_device(device),
            None => Tensor::zeros(w.dims[0], candle_core::DType::F32, device),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0).map(Some)
}

struct CpuLinearOp<'a> {
    mm: &'a CpuMatmul,
    decode_rows: usize,
}

impl CustomOp1 for CpuLinearOp<'_> {
    fn name(&self) -> &'static str {
        "cpu-linear"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else { candle_core::bail!("cpu-linear: expected f32 input") };
        let dims = layout.shape().dims();
        let k = *dims.last().unwrap_or(&0);
        let mm = self.mm;
        if k != mm.cols() {
            candle_core::bail!("cpu-linear: input has {k} features, weight expects {}", mm.cols())
        }
        let t = layout.shape().elem_count() / k.max(1);
        let x = &data[layout.start_offset()..layout.start_offset() + t * k];
        // SAFETY: every product writes all of its output (stores, never accumulates).
        let y = unsafe { filled_vec(t * mm.rows(), |y| mm.forward_rows_into(x, t, self.decode_rows, y)) };
        let mut out_dims = dims.to_vec();
        *out_dims.last_mut().unwrap() = mm.rows();
        Ok((CpuStorage::F32(y), Shape::from(out_dims)))
    }
}
