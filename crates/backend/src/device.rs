use candle_core::Device;

/// Parses `cpu`, `cuda` or `cuda:N`; `auto` picks CUDA when the build and the machine have it.
pub fn parse_device(spec: &str) -> candle_core::Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(Device::cuda_if_available(0).unwrap_or(Device::Cpu)),
        "cuda" => Device::new_cuda(0),
        s => match s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => Device::new_cuda(n),
            None => candle_core::bail!("unknown device {s:?}: expected cpu, cuda or cuda:N"),
        },
    }
}
