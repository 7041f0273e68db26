//! A BERT embedding model (all-MiniLM-L6-v2, fetched by `scripts/get_model.py
//! all-minilm-l6-v2`) through the same `Bundle` the server loads, against sentence-transformers
//! on CPU in f32 (tests/fixtures/embeddings, from scripts/fixtures/embedding_fixtures.py):
//! the tokenizer's ids equal the oracle's, and every embedding is within cosine 1e-4 of the
//! oracle's, in one batch and alone. Skips with a notice when the model has not been fetched.

use ferrolm_engine::bundle;
use ferrolm_models::paths;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// 1 − cosine similarity allowed between ferrolm's embedding and the oracle's. Issue 30 asks
/// for 1e-4; measured 1.1e-12 (f32 sums in another order), and a near miss such as the tanh
/// GELU in place of BERT's erf GELU gives 3.4e-7, so the bar is set where that fails.
const COSINE_TOL: f64 = 1e-8;
/// Largest element difference allowed (unit vectors; measured 2.8e-7, tanh GELU 1.5e-4).
const ABS_TOL: f32 = 1e-5;

#[derive(Deserialize)]
struct Fixture {
    model: String,
    dimension: usize,
    max_seq_length: usize,
    normalized: bool,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn fixture() -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embeddings/all-MiniLM-L6-v2.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture parses")
}

fn model_dir(name: &str) -> Option<PathBuf> {
    let dir = paths::models_dir().join(name);
    if !dir.join("model.safetensors").exists() {
        eprintln!("SKIP: {} not present (python3 scripts/get_model.py all-minilm-l6-v2)", dir.display());
        return None;
    }
    Some(dir)
}

fn one_minus_cos(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    1.0 - dot / (na * nb)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn minilm_equals_sentence_transformers() {
    let fx = fixture();
    let Some(dir) = model_dir(&fx.model) else { return };
    let b = bundle::load(Some(&dir), "cpu").expect("the embedding model loads");
    assert!(!b.model.can_generate());
    assert_eq!(b.model.info().context_length, fx.max_seq_length);
    for c in &fx.cases {
        assert_eq!(b.tokenizer.encode(&c.text, true).unwrap(), c.ids, "token ids of {:?}", c.text);
    }
    let inputs: Vec<&[u32]> = fx.cases.iter().map(|c| c.ids.as_slice()).collect();
    let batch = b.model.forward_embeddings(&inputs).unwrap().expect("BERT embeds").to_vec2::<f32>().unwrap();
    let (mut worst_cos, mut worst_abs) = (0f64, 0f32);
    for (c, got) in fx.cases.iter().zip(&batch) {
        assert_eq!(got.len(), fx.dimension);
        let solo = b.model.forward_embeddings(&[&c.ids]).unwrap().unwrap().to_vec2::<f32>().unwrap().remove(0);
        for v in [got, &solo] {
            let (d, a) = (one_minus_cos(v, &c.embedding), max_abs(v, &c.embedding));
            assert!(d <= COSINE_TOL && a <= ABS_TOL, "{:?}: 1-cos {d:.2e}, max |Δ| {a:.2e}", c.text);
            worst_cos = worst_cos.max(d);
            worst_abs = worst_abs.max(a);
        }
        if fx.normalized {
            let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
        }
    }
    eprintln!("{} texts vs sentence-transformers: max 1-cos {worst_cos:.2e}, max |Δ| {worst_abs:.2e}", fx.cases.len());
}

#[test]
fn an_embedding_model_refuses_to_generate_and_overlong_inputs() {
    let fx = fixture();
    let Some(dir) = model_dir(&fx.model) else { return };
    let b = bundle::load(Some(&dir), "cpu").unwrap();
    let mut cache = b.model.make_cache();
    let mut batch = [ferrolm_models::SeqInput::prompt(&[101, 102], &mut cache)];
    let e = b.model.forward_hidden(&mut batch).unwrap_err().to_string();
    assert!(e.contains("cannot generate"), "{e}");
    let long = vec![1000u32; fx.max_seq_length + 1];
    let e = b.model.forward_embeddings(&[&long]).unwrap_err().to_string();
    assert!(e.contains("1 to 256 tokens"), "{e}");
}
