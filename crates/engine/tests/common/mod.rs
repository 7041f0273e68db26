//! Shared helpers for the parity tests: fixture loading and model opening.
#![allow(dead_code)]

pub mod paged;
pub mod record;

use candle_core::{Device, Tensor};
use ferrolm_engine::{Sampled, TokenSampler};
use ferrolm_models::{paths, CausalLm, ModelSource};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
pub struct Fixture {
    pub model: String,
    pub prompts: Vec<FixturePrompt>,
}

#[derive(Deserialize)]
pub struct FixturePrompt {
    pub name: String,
    pub kind: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub steps: Vec<Step>,
    /// The exact float64 reference along its own greedy continuation (absent: none recorded,
    /// e.g. for models too large for the float64 reference).
    #[serde(default)]
    pub reference: Oracle,
}

#[derive(Deserialize, Default)]
pub struct Oracle {
    pub greedy_ids: Vec<u32>,
    pub steps: Vec<Step>,
}

#[derive(Deserialize)]
pub struct Step {
    pub top_ids: Vec<u32>,
    pub top_logits: Vec<f32>,
    /// log Σ exp(logits) over the whole vocabulary (f64), where the fixture records it:
    /// the oracle's logprob of a token is its logit minus this.
    #[serde(default)]
    pub log_norm: Option<f64>,
}

impl Step {
    /// The oracle's top-1 minus top-2 logit.
    pub fn margin(&self) -> f32 {
        self.top_logits[0] - self.top_logits[1]
    }
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn load_fixture(name: &str) -> Fixture {
    let path = repo_root().join("tests/fixtures/llamacpp").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture parses")
}

/// Keeps CPU activations in f32 for this test process (the default decode quantizes them to
/// 8 bits, which would move logits far beyond the exact reference's tolerances).
pub fn exact_activations() {
    ferrolm_backend::cpu::set_exact_activations(true);
}

/// Opens a model from the models dir; None (with a notice) when it has not been fetched.
pub fn open_model(file: &str) -> Option<Box<dyn CausalLm>> {
    let path = paths::models_dir().join(file);
    if !path.exists() {
        eprintln!(
            "SKIP: {} not present (run scripts/get_model.py)",
            path.display()
        );
        return None;
    }
    let source = ModelSource::open(&path).expect("model opens");
    Some(ferrolm_models::load(&source, &Device::Cpu).expect("model loads"))
}

pub struct Greedy;

impl TokenSampler for Greedy {
    fn sample(&mut self, logits: &Tensor, _history: &[u32]) -> candle_core::Result<Sampled> {
        Ok(Sampled {
            token: logits.argmax(0)?.to_scalar::<u32>()?,
            logprobs: None,
        })
    }
}
