//! Quantized KV caches (`--kv-bits`, docs/kv_quant.md) through the engine: a sequence gets the
//! same tokens and logprob bits batched as alone, and a prompt-cache hit continues bit for bit
//! as the uncached run (the cached rows are the quantized rows themselves); the KV budget counts
//! the quantized bytes.

mod common;

use common::record::*;
use common::*;
use ferrolm_engine::{Batch, BatchConfig};
use ferrolm_kv::{KvQuant, KvScheme};
use ferrolm_models::CausalLm;
use std::cell::RefCell;
use std::rc::Rc;

fn quantized(file: &str, scheme: KvScheme) -> Option<Box<dyn CausalLm>> {
    let mut model = open_model(file)?;
    model.set_kv_scheme(scheme).unwrap();
    Some(model)
}

fn bits(b: u8) -> KvScheme {
    KvScheme::Quant(KvQuant::new(b, 32).unwrap())
}

/// TurboQuant (mlx-bun's default, k8v3), its rows read in place by the attention kernels.
fn turbo() -> KvScheme {
    KvScheme::from_kv_quant("turbo").unwrap()
}

/// Prompts of the fixture (and halves of them), joining at different steps, chunked by a small
/// budget beside running decodes: each equals its solo run.
fn check_batched_equals_solo(file: &str, fixture: &str, scheme: KvScheme) {
    let Some(model) = quantized(file, scheme) else { return };
    let model = model.as_ref();
    let f = load_fixture(fixture);
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|i| {
            let p = &f.prompts[i % f.prompts.len()].prompt_ids;
            if i % 2 == 1 { p[..(p.len() / 2).max(2)].to_vec() } else { p.clone() }
        })
        .collect();
    let cfg = BatchConfig { max_batch_tokens: 40, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let outs: Vec<_> = prompts.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    let mut step = 0;
    while step < 3 * prompts.len() || !batch.is_idle() {
        if step % 3 == 0 && step / 3 < prompts.len() {
            let i = step / 3;
            batch.add(request(model, &prompts[i], 10 + i, &outs[i]), model.make_cache());
        }
        batch.step(&|| false);
        step += 1;
    }
    for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
        assert_eq!(o.borrow().trace.len(), 10 + i);
        assert!(o.borrow().trace == solo(model, p, 10 + i), "{file} {scheme:?}: sequence {i} differs from its solo run");
    }
}

#[test]
fn batched_equals_solo_with_8_bit_kv() {
    check_batched_equals_solo("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json", bits(8));
}

#[test]
fn batched_equals_solo_with_4_bit_kv() {
    check_batched_equals_solo("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json", bits(4));
}

#[test]
fn batched_equals_solo_with_turbo_kv() {
    check_batched_equals_solo("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json", turbo());
}

/// Gemma 3: global layers quantized, sliding-window layers float.
#[test]
fn gemma3_batched_equals_solo_with_8_bit_kv() {
    check_batched_equals_solo("gemma-3-270m-Q4_K_M.gguf", "gemma-3-270m-Q4_K_M.json", bits(8));
}

/// A second turn reuses the first prompt's quantized rows from the prompt cache and equals the
/// uncached run bit for bit.
#[test]
fn cached_equals_uncached_with_8_bit_kv() {
    check_cached_equals_uncached(bits(8));
}

#[test]
fn cached_equals_uncached_with_turbo_kv() {
    check_cached_equals_uncached(turbo());
}

fn check_cached_equals_uncached(scheme: KvScheme) {
    let Some(model) = quantized("SmolLM2-135M-Instruct.Q4_1.gguf", scheme) else { return };
    let model = model.as_ref();
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let first: Vec<u32> = f.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone();
    let cfg = BatchConfig { max_batch_tokens: 256, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let turn1 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &first, 12, &turn1), model.make_cache());
    run(&mut batch);
    let answer: Vec<u32> = turn1.borrow().trace.iter().map(|t| t.0).collect();
    let second: Vec<u32> = first.iter().chain(&answer).chain(&f.prompts[0].prompt_ids[1..]).copied().collect();
    let turn2 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 10, &turn2), model.make_cache());
    run(&mut batch);
    assert_eq!(turn2.borrow().stats.clone().unwrap().cached_tokens, first.len() - 1);
    assert!(turn2.borrow().trace == solo(model, &second, 10), "cached turn 2 differs from uncached");
}

/// The budget's bytes per token are the quantized rows': SmolLM2-135M (30 layers, 3 kv heads,
/// head_dim 64) holds 2·3·(64 + 2·4) bytes per layer at 8 bits, 2·3·(32 + 2·4) at 4, against
/// 2·3·128 in f16.
#[test]
fn the_kv_budget_counts_quantized_bytes() {
    let Some(mut model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    assert_eq!(model.make_cache().bytes_per_token(), 30 * 2 * 3 * 128);
    model.set_kv_scheme(KvScheme::Quant(KvQuant::new(8, 32).unwrap())).unwrap();
    assert_eq!(model.make_cache().bytes_per_token(), 30 * 2 * 3 * 72);
    assert_eq!(model.make_cache().signature(), "kv:q8g32");
    model.set_kv_scheme(KvScheme::Quant(KvQuant::new(4, 32).unwrap())).unwrap();
    assert_eq!(model.make_cache().bytes_per_token(), 30 * 2 * 3 * 40);
    // A group that does not divide head_dim is refused.
    assert!(model.set_kv_scheme(KvScheme::Quant(KvQuant::new(8, 128).unwrap())).is_err());
}
