use candle_core::{DType, Device};

/// Parses `cpu`, `cuda` or `cuda:N`; `auto` picks CUDA when the build and the machine have it.
pub fn parse_device(spec: &str) -> candle_core::Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(new_cuda(0).unwrap_or(Device::Cpu)),
        "cuda" => new_cuda(0),
        s => match s.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => new_cuda(n),
            None => candle_core::bail!("unknown device {s:?}: expected cpu, cuda or cuda:N"),
        },
    }
}

/// A CUDA device set up for ferrolm (own stream, no per-tensor events; see `cuda::new_device`).
/// Builds without the `cuda` feature report that CUDA is not compiled in.
pub fn new_cuda(ordinal: usize) -> candle_core::Result<Device> {
    #[cfg(feature = "cuda")]
    return crate::cuda::new_device(ordinal);
    #[cfg(not(feature = "cuda"))]
    Device::new_cuda(ordinal)
}

/// The dtype of activations on `device`: f32 on CPU (ferrolm's CPU kernels take f32), bf16
/// elsewhere (dense weights are held in bf16 on GPUs; candle's quantized CUDA kernels take bf16
/// input too).
pub fn activation_dtype(device: &Device) -> DType {
    match device {
        Device::Cpu => DType::F32,
        _ => DType::BF16,
    }
}

/// The dtype of KV-cache buffers on `device`: on CPU f16, as llama.cpp's default (half the bytes
/// a decode step reads from the cache; the decode attention kernel widens rows exactly on load),
/// or f32 when exact activations are asked for (`cpu::exact_activations`); elsewhere the
/// activation dtype.
pub fn kv_dtype(device: &Device) -> DType {
    match device {
        Device::Cpu if !crate::cpu::exact_activations() => DType::F16,
        _ => activation_dtype(device),
    }
}
