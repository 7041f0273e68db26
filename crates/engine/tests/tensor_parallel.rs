//! Tensor parallelism's split, simulated on the CPU (issue 8): the default model split over 1 and
//! 3 ranks (SmolLM2-135M has 9 heads and 3 KV heads) gives the unsharded model's logits, through
//! prefill and decode steps and through the engine's generate; a split that does not divide the
//! heads is refused with a message naming them.

mod common;
#[path = "common/parity.rs"]
mod parity;

use candle_core::Device;
use common::*;
use ferrolm_models::tensor_parallel::{self, GatherSum};
use ferrolm_models::{paths, ModelSource};
use parity::{logits_along, our_greedy};

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[test]
fn split_over_ranks_gives_the_unsharded_logits() {
    exact_activations();
    let Some(whole) = open_model(FILE) else { return };
    let source = ModelSource::open(&paths::models_dir().join(FILE)).unwrap();
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let p = fixture.prompts.iter().find(|p| p.name == "chat_code").unwrap();
    let steps = &p.greedy_ids[..6];
    let (n, chunk) = (steps.len(), p.prompt_ids.len());
    let want = logits_along(whole.as_ref(), &p.prompt_ids, steps, n, chunk);
    for world in [1, 3] {
        let devices = vec![Device::Cpu; world];
        let tp = tensor_parallel::load(&source, &devices, Box::new(GatherSum)).unwrap();
        let got = logits_along(&tp, &p.prompt_ids, steps, n, chunk);
        let max = got.iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("world {world}: max |Δlogit| {max:.2e} over {} steps", got.len());
        // Only the order of the partial sums changes (f32 rounding over 30 layers).
        assert!(max < 1e-3, "world {world}: {max}");
        assert_eq!(our_greedy(&tp, &p.prompt_ids, 8, chunk), our_greedy(whole.as_ref(), &p.prompt_ids, 8, chunk), "world {world}");
    }
}

#[test]
fn a_split_that_does_not_divide_the_heads_is_refused() {
    let path = paths::models_dir().join(FILE);
    if !path.exists() {
        return;
    }
    let source = ModelSource::open(&path).unwrap();
    let err = tensor_parallel::load(&source, &[Device::Cpu, Device::Cpu], Box::new(GatherSum)).err().unwrap();
    assert!(err.to_string().contains("attention heads (9) do not split evenly over 2 ranks"), "{err}");
}
