//! Model families against transformers on tiny random-weight models in each family's real
//! configuration shape (scripts/fixtures/tiny_families.py: f16 weights from a fixed seed, the
//! Hugging Face folder and its GGUF made by llama.cpp's converter, transformers' logits in f32).
//! For each family, both the folder and the GGUF:
//! - teacher-forced logits over the whole vocabulary at every position from the last prompt
//!   token on (the prompt prefilled in chunks, then one token per decode step) within `F32_TOL`
//!   of transformers';
//! - the folder and the GGUF within `SAME_WEIGHTS_TOL` of each other (the same f16 values);
//! - greedy continuations equal to transformers' up to the first near-tie (ours, < `TIE`).

mod common;
#[path = "common/parity.rs"]
mod parity;

use common::{exact_activations, repo_root};
use ferrolm_models::{CausalLm, ModelSource, SeqInput};
use parity::{argmax, logits_along, our_greedy};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Both sides compute in f32 on the same f16 weights; logits spread over ±20. Measured
/// (2026-12-07): max |Δ| ≤ 1e-5 on every family.
const F32_TOL: f32 = 1e-3;
/// The folder and the GGUF hold the same values; only the summation order may differ (llama's
/// GGUF Q/K rows are permuted for interleaved RoPE).
const SAME_WEIGHTS_TOL: f32 = 1e-4;
/// Top-1 minus top-2 below this is a near-tie: greedy paths may part there.
const TIE: f32 = 1e-2;

#[derive(Deserialize)]
struct Record {
    ids: Vec<u32>,
    prompt_len: usize,
    logits_file: String,
    logits_shape: [usize; 2],
    greedy: Vec<u32>,
}

fn dir(family: &str) -> PathBuf {
    repo_root().join("tests/fixtures/tiny").join(family)
}

fn record(family: &str) -> (Record, Vec<Vec<f32>>) {
    let d = dir(family);
    let r: Record = serde_json::from_str(&std::fs::read_to_string(d.join("logits.json")).unwrap()).unwrap();
    let bytes = std::fs::read(d.join(&r.logits_file)).unwrap();
    let [rows, vocab] = r.logits_shape;
    assert_eq!(bytes.len(), rows * vocab * 4, "{family}: logits file size");
    let values: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (r, values.chunks(vocab).map(<[f32]>::to_vec).collect())
}

fn open(path: &Path) -> Box<dyn CausalLm> {
    let source = ModelSource::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ferrolm_models::load(&source, &candle_core::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn max_delta(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Our teacher-forced logits along the record's ids, the prompt prefilled in `chunk`s.
fn ours(model: &dyn CausalLm, r: &Record, chunk: usize) -> Vec<Vec<f32>> {
    let (prompt, rest) = r.ids.split_at(r.prompt_len);
    logits_along(model, prompt, rest, r.logits_shape[0], chunk)
}

/// Greedy tokens equal up to the first step where our own top-2 margin is a near-tie.
fn check_greedy(label: &str, model: &dyn CausalLm, r: &Record) {
    let prompt = &r.ids[..r.prompt_len];
    let got = our_greedy(model, prompt, r.greedy.len(), 7);
    let along = logits_along(model, prompt, &r.greedy, r.greedy.len(), usize::MAX);
    for (i, logits) in along.iter().enumerate() {
        let top = argmax(logits) as usize;
        let second = logits.iter().enumerate().filter(|&(j, _)| j != top).fold(f32::MIN, |m, (_, &v)| m.max(v));
        if logits[top] - second < TIE {
            eprintln!("{label}: greedy compared up to step {i} (near-tie)");
            return;
        }
        assert_eq!(got[i], r.greedy[i], "{label}: greedy step {i}: {got:?} vs {:?}", r.greedy);
    }
    eprintln!("{label}: greedy equal over all {} steps", r.greedy.len());
}

fn check_family(family: &str) {
    exact_activations();
    let (r, want) = record(family);
    let folder = open(&dir(family));
    let gguf = open(&dir(family).join("model-f16.gguf"));
    assert_eq!(folder.info().vocab_size, r.logits_shape[1]);
    let mut results = Vec::new();
    for (label, model) in [("folder", &folder), ("gguf", &gguf)] {
        for chunk in [5, usize::MAX] {
            let got = ours(model.as_ref(), &r, chunk);
            let d = max_delta(&got, &want);
            let top1 = got.iter().zip(&want).all(|(a, b)| argmax(a) == argmax(b));
            let chunks = if chunk == usize::MAX { "whole".to_string() } else { format!("chunks of {chunk}") };
            eprintln!("{family} {label:<6} prompt prefilled {chunks:<12}: max |Δ| vs transformers {d:.2e}, top-1 equal {top1}");
            assert!(d <= F32_TOL, "{family} {label}: {d}");
            assert!(top1, "{family} {label}: top-1 differs");
            results.push(got);
        }
        check_greedy(&format!("{family} {label}"), model.as_ref(), &r);
    }
    let d = max_delta(&results[1], &results[3]);
    eprintln!("{family}: folder vs GGUF max |Δ| {d:.2e}");
    assert!(d <= SAME_WEIGHTS_TOL, "{family}: folder vs GGUF {d}");
}

#[test]
fn qwen3_matches_transformers() {
    check_family("qwen3");
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    check_family("llama3");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_family("qwen3moe");
}

#[test]
fn qwen2_moe_matches_transformers() {
    check_family("qwen2moe");
}

#[test]
fn mixtral_matches_transformers() {
    check_family("mixtral");
}

/// A decode row's hidden state is the same bits in a batch (beside other decode rows and a
/// prompt chunk, whose tokens share experts with it) as alone: the experts run the decode rows
/// of their groups on the decode kernels, and each token sums its experts in expert order.
#[test]
fn expert_rows_in_a_batch_equal_their_solo_run() {
    exact_activations();
    let (r, _) = record("qwen3moe");
    let model = open(&dir("qwen3moe").join("model-f16.gguf"));
    let prefilled = |ids: &[u32]| {
        let mut c = model.make_cache();
        model.forward_hidden(&mut [SeqInput::prompt(ids, &mut c)]).unwrap();
        c
    };
    let (a, b, c) = (&r.ids[..20], &r.ids[3..30], &r.ids[10..40]);
    let solo = |ids: &[u32], next: u32| -> Vec<f32> {
        let mut cache = prefilled(ids);
        let h = model.forward_hidden(&mut [SeqInput::decode(&[next], &mut cache)]).unwrap();
        h.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (want_a, want_b) = (solo(a, 7), solo(b, 9));
    let (mut ca, mut cb, mut cc) = (prefilled(a), prefilled(b), model.make_cache());
    let h = model
        .forward_hidden(&mut [SeqInput::decode(&[7], &mut ca), SeqInput::decode(&[9], &mut cb), SeqInput::prompt(c, &mut cc)])
        .unwrap();
    let rows: Vec<Vec<f32>> = h.to_vec2().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0], want_a, "first decode row differs from its solo run");
    assert_eq!(rows[1], want_b, "second decode row differs from its solo run");
}
