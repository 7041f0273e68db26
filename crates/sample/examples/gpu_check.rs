//! The device path on a GPU against the host path on the CPU: same tokens for the same seeds,
//! fallback counts, and per-step times. Without a GPU it runs the device path on the CPU.
//!
//!   cargo run -p ferrolm-sample --release --features cuda --example gpu_check
use candle_core::{DType, Device, Tensor};
use ferrolm_core::SamplingParams;
use ferrolm_sample::rng::StepRng;
use ferrolm_sample::{Mask, Path, Sampler, SamplerConfig};
use std::time::Instant;

fn logits(vocab: usize, peaked: bool, seed: u64) -> Vec<f32> {
    let mut r = StepRng::for_step(seed, 0);
    let sigma = if peaked { 2.5 } else { 1.0 };
    let mut x: Vec<f32> = (0..vocab)
        .map(|_| {
            let (u1, u2) = (r.uniform().max(1e-300), r.uniform());
            (sigma * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect();
    if peaked {
        for (k, boost) in [18.0, 16.5, 15.0, 13.0, 12.0].iter().enumerate() {
            x[(k * 7919 + 13) % vocab] += boost;
        }
    }
    x
}

fn configs() -> Vec<(&'static str, SamplingParams)> {
    let d = SamplingParams::default;
    let all = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        min_p: 0.05,
        top_k: 40,
        xtc_probability: 0.5,
        xtc_threshold: 0.1,
        seed: Some(1),
        ..d()
    };
    let procs = SamplingParams {
        repetition_penalty: Some(1.1),
        presence_penalty: Some(0.5),
        frequency_penalty: Some(0.3),
        logit_bias: vec![(11, -5.0), (12, 2.0), (13, -100.0)],
        ..all.clone()
    };
    vec![
        ("greedy", d()),
        ("greedy + processors", SamplingParams { temperature: 0.0, ..procs.clone() }),
        ("temperature only", SamplingParams { temperature: 0.8, seed: Some(1), ..d() }),
        ("top_p 0.9", SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(1), ..d() }),
        ("min_p 0.05", SamplingParams { temperature: 0.8, min_p: 0.05, seed: Some(1), ..d() }),
        (
            "xtc only",
            SamplingParams { temperature: 1.0, xtc_probability: 1.0, xtc_threshold: 0.05, seed: Some(1), ..d() },
        ),
        ("top_k 40", SamplingParams { temperature: 1.0, top_k: 40, seed: Some(1), ..d() }),
        ("all filters", all.clone()),
        ("all + processors", procs.clone()),
        ("all + processors + logprobs 5", SamplingParams { logprobs: Some(5), ..procs }),
    ]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gpu = Device::cuda_if_available(0)?;
    let path = if gpu.is_cpu() { Path::Device } else { Path::Auto };
    let history: Vec<u32> = (0..1000u32).map(|i| (i * 2654435761u32) % 49_152).collect();
    let mut bad = 0;
    println!("| vocab | logits | config | CPU host µs | device µs | tokens equal | fallbacks |");
    println!("|---|---|---|---|---|---|---|");
    for vocab in [49_152usize, 262_144] {
        for peaked in [true, false] {
            let x = logits(vocab, peaked, 5);
            let tc = Tensor::new(x.as_slice(), &Device::Cpu).unwrap();
            let tg = Tensor::new(x.as_slice(), &gpu).unwrap();
            for (name, p) in configs() {
                let mk = |path| {
                    Sampler::new(&p, &SamplerConfig { vocab_size: vocab, xtc_special_tokens: vec![0, 1], path })
                        .unwrap()
                };
                let (mut h, mut g) = (mk(Path::Auto), mk(path));
                let steps = 60;
                let (mut th, mut tgpu, mut eq) = (Vec::new(), Vec::new(), 0);
                for i in 0..steps {
                    let t0 = Instant::now();
                    let a = h.sample(&tc, &history).unwrap();
                    th.push(t0.elapsed().as_secs_f64() * 1e6);
                    gpu.synchronize()?;
                    let t1 = Instant::now();
                    let b = g.sample(&tg, &history).unwrap();
                    tgpu.push(t1.elapsed().as_secs_f64() * 1e6);
                    if a.token == b.token {
                        eq += 1;
                    }
                    if let (Some(la), Some(lb)) = (&a.logprobs, &b.logprobs) {
                        if la.top.iter().map(|t| t.0).collect::<Vec<_>>()
                            != lb.top.iter().map(|t| t.0).collect::<Vec<_>>()
                            || (la.logprob - lb.logprob).abs() > 1e-4
                        {
                            bad += 1;
                            if i == 0 {
                                println!("logprobs differ: {la:?} vs {lb:?}");
                            }
                        }
                    }
                }
                th.sort_by(|a, b| a.total_cmp(b));
                tgpu.sort_by(|a, b| a.total_cmp(b));
                let kind = if peaked { "peaked" } else { "flat" };
                println!(
                    "| {vocab} | {kind} | {name} | {:.1} | {:.1} | {eq}/{steps} | {} |",
                    th[steps / 2],
                    tgpu[steps / 2],
                    g.host_fallbacks()
                );
                // Whole-vocabulary draws may differ only at CDF rounding boundaries; lists never.
                if eq + 1 < steps {
                    bad += 1;
                }
            }
        }
    }
    // bf16 logits and masks on the GPU.
    let x = logits(49_152, true, 9);
    let tg = Tensor::new(x.as_slice(), &gpu).unwrap().to_dtype(DType::BF16).unwrap();
    let p = SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: Some(3), ..Default::default() };
    let mut s = Sampler::new(&p, &SamplerConfig { vocab_size: 49_152, path, ..Default::default() }).unwrap();
    let mut bits = vec![0u32; 49_152 / 32];
    for i in 100..164 {
        bits[i / 32] |= 1 << (i % 32);
    }
    for _ in 0..20 {
        let t = s.sample_masked(&tg.unsqueeze(0).unwrap(), &[], Some(Mask::Allowed(&bits))).unwrap().token;
        if !(100..164).contains(&t) {
            bad += 1;
            println!("mask violated: {t}");
        }
    }
    println!("bad: {bad}");
    if bad > 0 {
        std::process::exit(1);
    }
    Ok(())
}
