//! Per-step sampling cost on CPU tensors at vocab 49,152 and 262,144.
//!
//!   cargo run -p ferrolm-sample --release --example sample_bench [-- --device]
//!
//! `--device` also times the device path (on candle's CPU device unless built with a GPU).
//! `--step-ms VOCAB=MS` (repeatable) gives a model's decode step time at that vocabulary
//! (bench/sampling.sh measures them with `ferrolm bench` in the same run); the table then shows
//! sampling's share of the step: sample / (step + sample).
//! Logits: "peaked" = N(0, 2.5²) with a few tokens 12-18 nats up (a typical LM step);
//! "flat" = N(0, 1) (a high-entropy step, the worst case for top_p).

use candle_core::{Device, Tensor};
use ferrolm_core::SamplingParams;
use ferrolm_sample::rng::StepRng;
use ferrolm_sample::{Path, Sampler, SamplerConfig};
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
    let all_filters = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        min_p: 0.05,
        top_k: 40,
        xtc_probability: 0.5,
        xtc_threshold: 0.1,
        seed: Some(1),
        ..d()
    };
    let processors = SamplingParams {
        repetition_penalty: Some(1.1),
        presence_penalty: Some(0.5),
        frequency_penalty: Some(0.3),
        logit_bias: vec![(11, -5.0), (12, 2.0), (13, -100.0)],
        ..all_filters.clone()
    };
    vec![
        ("greedy", d()),
        ("greedy + processors", SamplingParams { temperature: 0.0, ..processors.clone() }),
        ("temperature only", SamplingParams { temperature: 0.8, seed: Some(1), ..d() }),
        ("top_p 0.9 only", SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(1), ..d() }),
        ("all filters", all_filters.clone()),
        ("all filters + processors", processors.clone()),
        ("all + processors + logprobs 5", SamplingParams { logprobs: Some(5), ..processors }),
    ]
}

fn time_us(s: &mut Sampler, t: &Tensor, history: &[u32], iters: usize) -> (f64, f64) {
    for _ in 0..5 {
        s.sample(t, history).unwrap();
    }
    let mut v: Vec<f64> = (0..iters)
        .map(|_| {
            let t0 = Instant::now();
            std::hint::black_box(s.sample(t, history).unwrap());
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[v.len() * 9 / 10])
}

/// `--step-ms VOCAB=MS` pairs from the command line.
fn step_times() -> Vec<(usize, f64)> {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2)
        .filter(|w| w[0] == "--step-ms")
        .filter_map(|w| {
            let (v, ms) = w[1].split_once('=')?;
            Some((v.parse().ok()?, ms.parse().ok()?))
        })
        .collect()
}

fn main() {
    let device_too = std::env::args().any(|a| a == "--device");
    let steps = step_times();
    let history: Vec<u32> = (0..1000u32).map(|i| (i * 2654435761u32) % 49_152).collect();
    println!("| vocab | logits | config | path | median µs | p90 µs | share of decode step |");
    println!("|---|---|---|---|---|---|---|");
    for vocab in [49_152usize, 262_144] {
        for peaked in [true, false] {
            let x = logits(vocab, peaked, 5);
            let t = Tensor::new(x.as_slice(), &Device::Cpu).unwrap();
            for (name, p) in configs() {
                let paths: &[Path] = if device_too { &[Path::Auto, Path::Device] } else { &[Path::Auto] };
                for &path in paths {
                    let cfg = SamplerConfig { vocab_size: vocab, xtc_special_tokens: vec![0, 1], path };
                    let mut s = Sampler::new(&p, &cfg).unwrap();
                    let iters = if path == Path::Device { 30 } else { 300 };
                    let (med, p90) = time_us(&mut s, &t, &history, iters);
                    let kind = if peaked { "peaked" } else { "flat" };
                    let share = match steps.iter().find(|(v, _)| *v == vocab) {
                        Some((_, ms)) => format!("{:.2}%", 100.0 * med / (ms * 1e3 + med)),
                        None => "-".into(),
                    };
                    println!("| {vocab} | {kind} | {name} | {path:?} | {med:.1} | {p90:.1} | {share} |");
                }
            }
        }
    }
}
