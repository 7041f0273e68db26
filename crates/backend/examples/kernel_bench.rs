//! Kernel micro-benchmark: best-of-N time of CPU matmuls at SmolLM2 shapes per format.
//!   cargo run --release -p ferrolm-backend --example kernel_bench [t]
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrolm_backend::cpu::{CpuMatmul, Format};
use std::sync::Arc;
use std::time::Instant;

/// CPU time of the whole process (all threads), robust to other load on the machine.
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn main() -> candle_core::Result<()> {
    let t: usize = std::env::args().nth(1).map_or(1, |s| s.parse().unwrap());
    let dev = Device::Cpu;
    for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q5_0] {
        for (n, k) in [(1536, 576), (576, 1536), (49152, 576)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let q = QTensor::quantize(&w, dt)?;
            let mm = CpuMatmul::new(Format::from_ggml(dt).unwrap(), n, k, Arc::new(q.data()?.to_vec())).unwrap();
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (t, k), &dev)?.flatten_all()?.to_vec1()?;
            let mut y = vec![0f32; t * n];
            let reps = (2e8 as usize / (n * k * t)).clamp(3, 2000);
            let (mut best, mut best_cpu) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                let (start, cpu) = (Instant::now(), cpu_seconds());
                for _ in 0..reps {
                    mm.forward(&x, t, &mut y);
                }
                best = best.min(start.elapsed().as_secs_f64() / reps as f64);
                best_cpu = best_cpu.min((cpu_seconds() - cpu) / reps as f64);
            }
            let gmacs = (n * k * t) as f64 / best / 1e9;
            let per_core = (n * k * t) as f64 / best_cpu / 1e9;
            println!(
                "{dt:?} t={t} {n}x{k}: {:.1} us  {gmacs:.1} GMAC/s wall, {per_core:.1} GMAC per CPU-second",
                best * 1e6
            );
        }
    }
    Ok(())
}
