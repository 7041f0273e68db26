//! Seeded draws follow mlx-lm's filtered distribution: Pearson chi-square over >= 20,000 draws
//! against the fixture's probabilities, at the 0.1% level. The same statistic must reject a
//! wrong distribution, so the test can fail.

mod common;

use common::{case, chi2, chi2_critical_001};
use ferrolm_sample::{Path, Sampler, SamplerConfig};
use std::collections::BTreeMap;

const DRAWS: u64 = 24_000;

fn draw_counts(c: &common::Case, path: Path, seed: u64) -> BTreeMap<u32, u64> {
    let mut params = c.params.clone();
    params.seed = Some(seed);
    let cfg = SamplerConfig { vocab_size: c.logits.len(), xtc_special_tokens: c.special.clone(), path };
    let mut s = Sampler::new(&params, &cfg).unwrap();
    let mut counts = BTreeMap::new();
    match path {
        Path::Host => {
            for _ in 0..DRAWS {
                let t = s.sample_slice(&c.logits, &c.history, None).unwrap().token;
                *counts.entry(t).or_default() += 1;
            }
        }
        _ => {
            let logits = candle_core::Tensor::new(c.logits.as_slice(), &candle_core::Device::Cpu).unwrap();
            for _ in 0..DRAWS / 4 {
                let t = s.sample(&logits, &c.history).unwrap().token;
                *counts.entry(t).or_default() += 1;
            }
        }
    }
    counts
}

fn assert_fits(name: &str, path: Path) {
    let c = case(name);
    let counts = draw_counts(&c, path, 42);
    let n: u64 = counts.values().sum();
    let kept = c.kept().unwrap();
    assert!(counts.keys().all(|t| kept.contains(t)), "{name}: drew a filtered-out token");
    let (stat, df) = chi2(&counts, &c.probs(), n);
    let crit = chi2_critical_001(df);
    eprintln!("{name} ({path:?}): n {n} chi2 {stat:.1} df {df} critical {crit:.1}");
    assert!(stat < crit, "{name} ({path:?}): chi2 {stat:.1} >= {crit:.1} (df {df})");
}

#[test]
fn host_draws_fit_mlx_distributions() {
    for name in [
        "peaked/none/plain",
        "peaked/none/hot",
        "peaked/none/top_p_0.9",
        "peaked/all/combo",
        "peaked/none/combo_xtc",
        "flat/none/top_k_40",
        "flat/none/min_p_0.2",
        "ties/none/top_p_0.5",
        "tiny/none/top_p_0.9",
        "masked/none/xtc_0.02",
        "uniform/none/minp_xtc_topk",
    ] {
        assert_fits(name, Path::Host);
    }
}

#[test]
fn device_path_draws_fit_mlx_distributions() {
    for name in ["peaked/none/plain", "peaked/none/top_p_0.9", "peaked/none/combo_xtc", "masked/none/xtc_0.02"] {
        assert_fits(name, Path::Device);
    }
}

#[test]
fn the_test_rejects_a_wrong_temperature() {
    // Draw at T = 1.25 and test against mlx's T = 1 probabilities: must be rejected.
    let c = case("peaked/none/top_p_0.9");
    let mut hot = case("peaked/none/top_p_0.9");
    hot.params.temperature = 1.25;
    let counts = draw_counts(&hot, Path::Host, 42);
    let (stat, df) = chi2(&counts, &c.probs(), DRAWS);
    assert!(stat > chi2_critical_001(df), "chi2 {stat:.1} did not reject (df {df})");
}

#[test]
fn xtc_probability_is_a_per_step_coin() {
    // With probability 0.5, XTC removes the top tokens on about half of the steps: the draws
    // follow the half-half mixture of the two (oracle-checked) full distributions.
    let xtc = case("peaked/none/xtc_0.1");
    let mut plain = case("peaked/none/xtc_0.1");
    plain.params.xtc_probability = 0.0;
    let mut coin = case("peaked/none/xtc_0.1");
    coin.params.xtc_probability = 0.5;
    let full = |c: &common::Case| c.sampler(Path::Host).explain(&c.logits, &c.history, 0).unwrap().kept;
    let mut mix: BTreeMap<u32, f64> = BTreeMap::new();
    for (id, p) in full(&plain).into_iter().chain(full(&xtc)) {
        *mix.entry(id).or_default() += 0.5 * p;
    }
    let mix: Vec<(u32, f64)> = mix.into_iter().collect();
    let counts = draw_counts(&coin, Path::Host, 9);
    let (stat, df) = chi2(&counts, &mix, DRAWS);
    assert!(stat < chi2_critical_001(df), "chi2 {stat:.1} (df {df})");
    // And it is neither distribution alone.
    let (stat_xtc, df) = chi2(&counts, &full(&xtc), DRAWS);
    assert!(stat_xtc > chi2_critical_001(df), "indistinguishable from always-XTC");
}
