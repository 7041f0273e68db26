//! Loading the mlx-lm fixtures (scripts/fixtures/sampler_fixtures.py) and shared test helpers.
#![allow(dead_code)]

use ferrolm_core::SamplingParams;
use ferrolm_sample::{Path, Sampler, SamplerConfig};
use serde_json::Value;
use std::collections::BTreeMap;

pub fn fixture(name: &str) -> Value {
    let path = format!("{}/../../tests/fixtures/sampler/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("fixture json")
}

/// null encodes -inf, "inf" +inf.
pub fn dec(v: &Value) -> f32 {
    match v {
        Value::Null => f32::NEG_INFINITY,
        Value::String(s) if s == "inf" => f32::INFINITY,
        v => v.as_f64().expect("number") as f32,
    }
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().map(|a| a.iter().map(|x| x.as_u64().unwrap() as u32).collect()).unwrap_or_default()
}

/// (id, value) pairs.
pub fn pairs(v: &Value) -> Vec<(u32, f64)> {
    v.as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap() as u32, dec(&p[1]) as f64)).collect()
}

pub struct Case {
    pub name: String,
    pub logits: Vec<f32>,
    pub history: Vec<u32>,
    pub special: Vec<u32>,
    pub params: SamplingParams,
    pub raw: Value,
}

impl Case {
    pub fn sampler(&self, path: Path) -> Sampler {
        let cfg = SamplerConfig { vocab_size: self.logits.len(), xtc_special_tokens: self.special.clone(), path };
        Sampler::new(&self.params, &cfg).unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }

    /// The kept ids as mlx reported them.
    pub fn kept(&self) -> Option<Vec<u32>> {
        if self.raw.get("id_sum").is_some() {
            return None;
        }
        if let Some(k) = self.raw.get("kept") {
            return Some(ids(k));
        }
        let removed = ids(self.raw.get("removed")?);
        Some((0..self.logits.len() as u32).filter(|i| !removed.contains(i)).collect())
    }

    /// Compares a kept set (sorted ids) with mlx's: the full list, or for wide vocabularies the
    /// count and the sums of ids and squared ids.
    pub fn check_kept(&self, got: &[u32]) -> Result<(), String> {
        let count = self.raw["kept_count"].as_u64().unwrap() as usize;
        if got.len() != count {
            return Err(format!("kept {} want {count}", got.len()));
        }
        if let Some(want) = self.kept() {
            if got != want.as_slice() {
                let extra: Vec<_> = got.iter().filter(|i| !want.contains(i)).take(8).collect();
                let missing: Vec<_> = want.iter().filter(|i| !got.contains(i)).take(8).collect();
                return Err(format!("extra {extra:?} missing {missing:?}"));
            }
            return Ok(());
        }
        let sum: u64 = got.iter().map(|&i| i as u64).sum();
        let sq: u64 = got.iter().map(|&i| (i as u64) * (i as u64)).sum();
        let want = (self.raw["id_sum"].as_u64().unwrap(), self.raw["id_sq_sum"].as_u64().unwrap());
        if (sum, sq) != want {
            return Err(format!("id sums {:?} want {want:?}", (sum, sq)));
        }
        Ok(())
    }

    /// mlx's probabilities of its least likely kept tokens (wide vocabularies only).
    pub fn low_probs(&self) -> Vec<(u32, f64)> {
        self.raw.get("low_probs").map(pairs).unwrap_or_default()
    }

    /// mlx's final sampling probabilities of its most likely kept tokens.
    pub fn probs(&self) -> Vec<(u32, f64)> {
        pairs(&self.raw["probs"])
    }
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// The fixture's processor and filter settings as SamplingParams.
fn params(procs: &Value, filt: &Value) -> SamplingParams {
    let bias: Vec<(u32, f32)> = procs
        .get("logit_bias")
        .and_then(Value::as_object)
        .map(|m| m.iter().map(|(k, v)| (k.parse().unwrap(), v.as_f64().unwrap() as f32)).collect())
        .unwrap_or_default();
    let f32_of = |v: &Value, k: &str| num(v, k).map(|x| x as f32);
    let usize_of = |v: &Value, k: &str, d: usize| num(v, k).map_or(d, |x| x as usize);
    SamplingParams {
        temperature: f32_of(filt, "temp").unwrap(),
        top_p: f32_of(filt, "top_p").unwrap_or(0.0),
        min_p: f32_of(filt, "min_p").unwrap_or(0.0),
        min_tokens_to_keep: usize_of(filt, "min_tokens_to_keep", 1),
        top_k: usize_of(filt, "top_k", 0),
        xtc_probability: f32_of(filt, "xtc_probability").unwrap_or(0.0),
        xtc_threshold: f32_of(filt, "xtc_threshold").unwrap_or(0.1),
        repetition_penalty: f32_of(procs, "repetition_penalty"),
        repetition_context_size: usize_of(procs, "repetition_context_size", 20),
        presence_penalty: f32_of(procs, "presence_penalty"),
        presence_context_size: usize_of(procs, "presence_context_size", 20),
        frequency_penalty: f32_of(procs, "frequency_penalty"),
        frequency_context_size: usize_of(procs, "frequency_context_size", 20),
        logit_bias: bias,
        seed: Some(1234),
        logprobs: None,
    }
}

/// The wide fixture logits, regenerated exactly as scripts/fixtures/sampler_fixtures.py does.
pub fn generated(vocab: usize, kind: &str) -> Vec<f32> {
    let keys = [(2654435761u64, 12345u64), (2246822519, 6789), (3266489917, 101)];
    (0..vocab as u64)
        .map(|i| {
            let u: f64 = keys.iter().map(|(a, b)| ((i * a + b) % (1 << 32)) as f64 / 4294967296.0).sum::<f64>() - 1.5;
            let x = if kind == "flat" { 3.0 * u } else { 5.0 * u + if i % 40000 == 123 { 14.0 } else { 0.0 } };
            x as f32
        })
        .collect()
}

pub fn chain_cases() -> Vec<Case> {
    let f = fixture("chain.json");
    let mut bases: BTreeMap<String, Vec<f32>> = f["bases"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_array().unwrap().iter().map(dec).collect()))
        .collect();
    for (k, g) in f["generated"].as_object().unwrap() {
        bases.insert(k.clone(), generated(g["vocab"].as_u64().unwrap() as usize, g["kind"].as_str().unwrap()));
    }
    f["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut params = params(&c["processors"], &c["filters"]);
            let logits = bases[c["base"].as_str().unwrap()].clone();
            params.logit_bias.retain(|b| (b.0 as usize) < logits.len());
            Case {
                name: c["name"].as_str().unwrap().to_string(),
                logits,
                history: ids(&c["history"]),
                special: ids(&c["special"]),
                params,
                raw: c.clone(),
            }
        })
        .collect()
}

pub fn case(name: &str) -> Case {
    chain_cases().into_iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no case {name}"))
}

/// Upper 0.1% point of chi-square with `df` degrees of freedom (Wilson–Hilferty).
pub fn chi2_critical_001(df: usize) -> f64 {
    let k = df as f64;
    let z = 3.090_232; // standard normal upper 0.1%
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// Pearson chi-square of `counts` against `probs` (id → p); ids not listed and bins expecting
/// fewer than 5 draws are pooled into one bin. Returns (statistic, degrees of freedom).
pub fn chi2(counts: &BTreeMap<u32, u64>, probs: &[(u32, f64)], n: u64) -> (f64, usize) {
    let mut bins: Vec<(f64, f64)> = Vec::new(); // (observed, expected)
    let mut pooled = (0.0, 0.0);
    let listed: Vec<u32> = probs.iter().map(|p| p.0).collect();
    for &(id, p) in probs {
        let obs = *counts.get(&id).unwrap_or(&0) as f64;
        let exp = p * n as f64;
        if exp >= 5.0 {
            bins.push((obs, exp));
        } else {
            pooled.0 += obs;
            pooled.1 += exp;
        }
    }
    let listed_mass: f64 = probs.iter().map(|p| p.1).sum();
    pooled.0 += counts.iter().filter(|(id, _)| !listed.contains(id)).map(|(_, &c)| c as f64).sum::<f64>();
    pooled.1 += (1.0 - listed_mass).max(0.0) * n as f64;
    if pooled.1 >= 5.0 {
        bins.push(pooled);
    } else if pooled.0 > 0.0 {
        // Draws where almost none are expected: count them against the smallest bin's share.
        bins.push((pooled.0, pooled.1.max(1e-9)));
    }
    let stat = bins.iter().map(|(o, e)| (o - e) * (o - e) / e).sum();
    (stat, bins.len().saturating_sub(1).max(1))
}
