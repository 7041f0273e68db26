//! The device path (run here on candle's CPU device) against the host reference path: same
//! processors, same kept sets, same tokens for the same seeds (up to rounding at CDF boundaries),
//! greedy as a device argmax, and masks.

mod common;

use candle_core::{Device, Tensor};
use common::chain_cases;
use ferrolm_sample::{Mask, Path, Sampler, SamplerConfig};

fn tokens(c: &common::Case, path: Path, seed: u64, n: usize, logprobs: Option<usize>) -> (Vec<u32>, Sampler) {
    let mut p = c.params.clone();
    p.seed = Some(seed);
    p.logprobs = logprobs;
    let cfg = SamplerConfig { vocab_size: c.logits.len(), xtc_special_tokens: c.special.clone(), path };
    let mut s = Sampler::new(&p, &cfg).unwrap();
    let t = Tensor::new(c.logits.as_slice(), &Device::Cpu).unwrap();
    let out = (0..n).map(|_| s.sample(&t, &c.history).unwrap().token).collect();
    (out, s)
}

#[test]
fn device_path_picks_the_host_paths_tokens() {
    let mut compared = 0;
    let mut differ = 0;
    let mut fallbacks = 0;
    for c in chain_cases() {
        let n = if c.logits.len() > 4096 { 8 } else { 40 };
        let (host, _) = tokens(&c, Path::Host, 11, n, None);
        let (dev, s) = tokens(&c, Path::Device, 11, n, None);
        fallbacks += s.host_fallbacks();
        compared += host.len();
        differ += host.iter().zip(&dev).filter(|(a, b)| a != b).count();
        // Every device token is in mlx's kept set.
        if let Some(kept) = c.kept() {
            assert!(dev.iter().all(|t| kept.contains(t)), "{}: device drew a filtered-out token", c.name);
        }
    }
    eprintln!("compared {compared}, differ {differ}, host fallbacks {fallbacks}");
    // Lists are drawn identically; whole-vocabulary draws use different block sums, which can only
    // move a draw that lands within rounding of a CDF boundary.
    assert!(differ * 1000 <= compared, "{differ} of {compared} tokens differ");
}

#[test]
fn device_logprobs_equal_host_logprobs() {
    for c in chain_cases().iter().filter(|c| c.name.starts_with("peaked/") || c.name.starts_with("gen_")) {
        let mut p = c.params.clone();
        p.logprobs = Some(5);
        let t = Tensor::new(c.logits.as_slice(), &Device::Cpu).unwrap();
        let mk = |path| {
            let cfg = SamplerConfig { vocab_size: c.logits.len(), xtc_special_tokens: c.special.clone(), path };
            Sampler::new(&p, &cfg).unwrap()
        };
        let (mut h, mut d) = (mk(Path::Host), mk(Path::Device));
        for _ in 0..5 {
            let a = h.sample(&t, &c.history).unwrap();
            let b = d.sample(&t, &c.history).unwrap();
            assert_eq!(a, b, "{}", c.name);
        }
    }
}

#[test]
fn masks_ban_tokens_on_both_paths() {
    let c = common::case("peaked/all/combo");
    let vocab = c.logits.len();
    // Allow only ids 100..164 and 777.
    let mut bits = vec![0u32; vocab.div_ceil(32)];
    for i in (100..164).chain([777]) {
        bits[i / 32] |= 1 << (i % 32);
    }
    let additive: Vec<f32> =
        (0..vocab).map(|i| if (100..164).contains(&i) || i == 777 { 0.0 } else { f32::NEG_INFINITY }).collect();
    let add = Tensor::new(additive.as_slice(), &Device::Cpu).unwrap();
    let t = Tensor::new(c.logits.as_slice(), &Device::Cpu).unwrap();
    for path in [Path::Host, Path::Device] {
        for greedy in [false, true] {
            let mut p = c.params.clone();
            if greedy {
                p.temperature = 0.0;
            }
            let cfg = SamplerConfig { vocab_size: vocab, xtc_special_tokens: c.special.clone(), path };
            let mut s = Sampler::new(&p, &cfg).unwrap();
            for mask in [Mask::Allowed(&bits), Mask::Additive(&add)] {
                for _ in 0..50 {
                    let tok = s.sample_masked(&t, &c.history, Some(mask)).unwrap().token as usize;
                    assert!((100..164).contains(&tok) || tok == 777, "{path:?} greedy {greedy}: {tok}");
                }
            }
        }
    }
}

#[test]
fn greedy_without_processors_is_the_argmax() {
    let c = common::case("peaked/none/greedy");
    let want = c.raw["argmax"].as_u64().unwrap() as u32;
    for path in [Path::Host, Path::Device] {
        let (t, _) = tokens(&c, path, 0, 3, None);
        assert_eq!(t, vec![want; 3], "{path:?}");
    }
}

/// N(0, 2.5²)-like logits with a few tokens far ahead (a typical LM step) or, when `flat`,
/// uniform in [-6, 6] (a high-entropy step).
fn wide_logits(vocab: usize, flat: bool) -> Vec<f32> {
    let mut r = ferrolm_sample::rng::StepRng::for_step(99, 0);
    (0..vocab)
        .map(|i| {
            let u: f64 = (0..4).map(|_| r.uniform()).sum::<f64>() - 2.0; // ~N(0, 1/3)
            if flat {
                (u * 3.0) as f32
            } else {
                (u * 4.3) as f32 + if i % 50_000 == 7 { 14.0 } else { 0.0 }
            }
        })
        .collect()
}

fn host_vs_device(vocab: usize, flat: bool) -> u64 {
    let t = Tensor::new(wide_logits(vocab, flat).as_slice(), &Device::Cpu).unwrap();
    let params = ferrolm_core::SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        min_p: 0.02,
        top_k: 40,
        xtc_probability: 0.5,
        xtc_threshold: 0.1,
        seed: Some(1),
        ..Default::default()
    };
    let mk =
        |path| Sampler::new(&params, &SamplerConfig { vocab_size: vocab, xtc_special_tokens: vec![2], path }).unwrap();
    let (mut h, mut d) = (mk(Path::Host), mk(Path::Device));
    for _ in 0..20 {
        assert_eq!(h.sample(&t, &[]).unwrap().token, d.sample(&t, &[]).unwrap().token);
    }
    d.host_fallbacks()
}

#[test]
fn large_vocab_device_path_resolves_without_host_copies() {
    // A typical step: the candidates decide top_p / min_p / XTC / top_k on the device.
    assert_eq!(host_vs_device(262_144, false), 0);
    // A flat step whose nucleus exceeds 512 tokens: same tokens, through the counted fallback.
    assert_eq!(host_vs_device(262_144, true), 20);
}

#[test]
fn deferred_draws_resolve_to_the_same_tokens() {
    let c = common::case("peaked/all/combo");
    let t = Tensor::new(c.logits.as_slice(), &Device::Cpu).unwrap();
    for path in [Path::Host, Path::Device] {
        let (want, _) = tokens(&c, path, 4, 10, None);
        let mut p = c.params.clone();
        p.seed = Some(4);
        let cfg = SamplerConfig { vocab_size: c.logits.len(), xtc_special_tokens: c.special.clone(), path };
        let mut s = Sampler::new(&p, &cfg).unwrap();
        let got: Vec<u32> = (0..10)
            .map(|_| {
                let d = s.sample_deferred(&t, &c.history, None).unwrap();
                assert_eq!(d.token_tensor(&Device::Cpu).unwrap().to_vec1::<u32>().unwrap().len(), 1);
                d.resolve().unwrap().token
            })
            .collect();
        assert_eq!(got, want, "{path:?}");
    }
}
