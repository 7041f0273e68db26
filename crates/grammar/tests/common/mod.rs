//! Helpers shared by the integration tests: the models' tokenizers, and a driver that walks a
//! constraint with random allowed tokens (the stand-in for a model that samples anything the
//! mask allows).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use ferrolm_grammar::{Constraint, Grammars, Status};
use ferrolm_text::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-Q4_K_M.gguf";
pub const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf";

/// `$FERROLM_MODELS`, else `~/.cache/ferrolm/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERROLM_MODELS") {
        return PathBuf::from(dir);
    }
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ferrolm/models")
}

/// A model's tokenizer and its `Grammars` (logits as wide as the vocabulary), or None after a
/// skip notice when the model file is absent.
pub fn load(file: &str) -> Option<(Arc<Tokenizer>, Grammars)> {
    let path = models_dir().join(file);
    if !path.exists() {
        eprintln!("SKIP: model {} not found (fetch it with scripts/get_model.py)", path.display());
        return None;
    }
    let tokenizer = Arc::new(Tokenizer::from_gguf_file(&path).expect("tokenizer"));
    let grammars = Grammars::new(tokenizer.clone(), tokenizer.eos_ids(), tokenizer.vocab_size()).expect("grammars");
    Some((tokenizer, grammars))
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// The ids set in a mask.
pub fn allowed(mask: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, &bits) in mask.iter().enumerate() {
        let mut b = bits;
        while b != 0 {
            out.push(w as u32 * 32 + b.trailing_zeros());
            b &= b - 1;
        }
    }
    out
}

pub fn bit(mask: &[u32], id: u32) -> bool {
    mask.get(id as usize / 32).is_some_and(|w| w >> (id % 32) & 1 == 1)
}

/// What a walk produced.
pub struct Walk {
    pub tokens: Vec<u32>,
    /// The output's bytes (EOS excluded).
    pub bytes: Vec<u8>,
    /// The constraint accepted the output (EOS consumed or nothing could follow).
    pub accepted: bool,
    /// Tokens that came from `take_forced` (jump-forward).
    pub forced: usize,
}

impl Walk {
    pub fn text(&self) -> String {
        String::from_utf8(self.bytes.clone()).expect("constrained output is UTF-8")
    }
}

/// Drives `c` like a sampler that may pick anything the mask allows: uniform over the allowed
/// tokens for `budget` steps, then preferring tokens that close what is open (EOS, `}` `]`,
/// `"`…) so that walks end; up to `10 * budget` steps. Forced tokens are taken by jump-forward
/// half the time (and then must be what the mask alone allows, one by one).
pub fn walk(c: &mut Constraint, tok: &Tokenizer, rng: &mut StdRng, budget: usize) -> Walk {
    let mut w = Walk { tokens: Vec::new(), bytes: Vec::new(), accepted: false, forced: 0 };
    for step in 0..10 * budget {
        if c.is_stopped() {
            break;
        }
        if rng.random_bool(0.5) {
            let forced = c.take_forced().expect("forced tokens consume");
            w.forced += forced.len();
            for t in forced {
                w.push(tok, t);
            }
            if c.is_stopped() {
                break;
            }
        }
        let mask = c.mask().unwrap_or_else(|e| panic!("mask after {:?}: {e}", String::from_utf8_lossy(&w.bytes)));
        let ids = allowed(mask);
        assert!(!ids.is_empty(), "a mask without any token");
        let t = pick(&ids, tok, rng, step >= budget);
        c.consume(t).unwrap_or_else(|e| panic!("consuming allowed token {t}: {e}"));
        if tok.eos_ids().contains(&t) {
            break;
        }
        w.push(tok, t);
    }
    w.accepted = c.status() == Status::Accepted;
    w
}

impl Walk {
    fn push(&mut self, tok: &Tokenizer, t: u32) {
        self.tokens.push(t);
        self.bytes.extend_from_slice(tok.token_bytes(t));
    }
}

/// One allowed token: uniform while exploring; while closing, the first class present among
/// EOS, a quote (it ends a string; outside one it starts a string that the next quote ends), a
/// closing bracket, single bytes, anything.
fn pick(ids: &[u32], tok: &Tokenizer, rng: &mut StdRng, closing: bool) -> u32 {
    let eos: Vec<u32> = ids.iter().copied().filter(|t| tok.eos_ids().contains(t)).collect();
    if !closing {
        if !eos.is_empty() && rng.random_bool(0.2) {
            return eos[0];
        }
        return ids[rng.random_range(0..ids.len())];
    }
    let class =
        |want: &[&[u8]]| -> Vec<u32> { ids.iter().copied().filter(|&t| want.contains(&tok.token_bytes(t))).collect() };
    let single: Vec<u32> = ids.iter().copied().filter(|&t| tok.token_bytes(t).len() == 1).collect();
    for group in [eos, class(&[b"\""]), class(&[b"}", b"]"]), single] {
        if !group.is_empty() {
            return group[rng.random_range(0..group.len())];
        }
    }
    ids[rng.random_range(0..ids.len())]
}
