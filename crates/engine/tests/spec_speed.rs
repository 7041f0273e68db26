//! Timing of speculative decoding's parts on the CPU (#[ignore]: a measurement, not a check):
//! a decode forward of k rows of one sequence (the pending token and k − 1 drafts) against one
//! row, the logits of those rows, and sampling one row. Best of alternating rounds, so that a
//! busy machine's noise falls out of the ratios.
//!
//!     FERROLM_SPEED_MODEL=qwen2.5-coder-1.5b-instruct.gguf \
//!     cargo test --release -p ferrolm-engine --test spec_speed -- --ignored --nocapture

mod common;

use common::*;
use ferrolm_core::SamplingParams;
use ferrolm_models::{CausalLm, SeqInput};
use ferrolm_sample::{Sampler, SamplerConfig};
use std::time::Instant;

const ROWS: [usize; 10] = [1, 2, 3, 4, 5, 7, 9, 12, 13, 17];

/// Seconds of `f`'s fastest of `rounds` calls.
fn best(rounds: usize, mut f: impl FnMut()) -> f64 {
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
#[ignore]
fn verify_forward_costs() {
    let file = std::env::var("FERROLM_SPEED_MODEL").unwrap_or("qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf".into());
    let Some(model) = open_model(&file) else { return };
    let model: &dyn CausalLm = model.as_ref();
    // FERROLM_SPEED_CONTEXT: cached tokens before the rows (600).
    let context: usize = std::env::var("FERROLM_SPEED_CONTEXT").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let mut cache = model.make_cache();
    let prompt: Vec<u32> = (0..context as u32).map(|i| 100 + (i * 7919) % 20000).collect();
    model.forward_hidden(&mut [SeqInput::prompt(&prompt, &mut cache)]).unwrap();
    let tokens: Vec<u32> = (0..32).map(|i| 300 + i).collect();
    let mut forward = vec![f64::INFINITY; ROWS.len()];
    let mut logits = vec![f64::INFINITY; ROWS.len()];
    for _round in 0..5 {
        for (i, &k) in ROWS.iter().enumerate() {
            let mut hidden = None;
            forward[i] = forward[i].min(best(2, || {
                hidden = Some(model.forward_hidden(&mut [SeqInput::decode(&tokens[..k], &mut cache)]).unwrap());
                assert_eq!(cache.trim(k), k);
            }));
            let hidden = hidden.unwrap();
            logits[i] = logits[i].min(best(2, || {
                model.project_logits(&hidden).unwrap();
            }));
        }
    }
    let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let row = model
        .project_logits(&model.forward_hidden(&mut [SeqInput::decode(&tokens[..1], &mut cache)]).unwrap())
        .unwrap()
        .get(0)
        .unwrap();
    for (name, sp) in [
        ("greedy", SamplingParams::default()),
        ("greedy+logprobs", SamplingParams { logprobs: Some(2), ..Default::default() }),
        ("t=0.7", SamplingParams { temperature: 0.7, seed: Some(1), ..Default::default() }),
    ] {
        let mut s = Sampler::new(&sp, &cfg).unwrap();
        let t = best(20, || {
            s.sample(&row, &prompt).unwrap();
        });
        eprintln!("{file}: sample one row ({name}): {:.3} ms", t * 1e3);
    }
    for (i, &k) in ROWS.iter().enumerate() {
        eprintln!(
            "{file}: {k:2} decode rows at {context}: forward {:6.2} ms ({:.2}x one row), logits {:5.2} ms ({:.2}x)",
            forward[i] * 1e3,
            forward[i] / forward[0],
            logits[i] * 1e3,
            logits[i] / logits[0]
        );
    }
}
