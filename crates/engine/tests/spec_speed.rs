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

/// The batched draft step against one sequence at a time: `FERROLM_SPEED_SEQS` sequences (4)
/// of `FERROLM_SPEED_CONTEXT` cached tokens (600) each guess 4 tokens with the draft model
/// (`FERROLM_SPEED_MODEL`, the 0.5B by default), all in one `draft_together` (one forward per
/// guess over all of them) or one `draft_together` per sequence (what drafting did before);
/// the same guesses either way, best of alternating rounds.
#[test]
#[ignore]
fn batched_draft_step_costs() {
    use ferrolm_engine::{draft_together, DraftCache, DraftJob};
    let file = std::env::var("FERROLM_SPEED_MODEL").unwrap_or("qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf".into());
    let Some(model) = open_model(&file) else { return };
    let model: &dyn CausalLm = model.as_ref();
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (context, seqs, guesses) = (env("FERROLM_SPEED_CONTEXT", 600), env("FERROLM_SPEED_SEQS", 4), 4);
    let histories: Vec<Vec<u32>> =
        (0..seqs as u32).map(|s| (0..context as u32).map(|i| 100 + (i * 7919 + s * 104729) % 20000).collect()).collect();
    let mut caches: Vec<DraftCache> = histories.iter().map(|_| DraftCache::new(model)).collect();
    // Each call realigns the caches to the history (the previous call's guesses trimmed) and
    // guesses again: the same work every call, after the first catches the prompts up.
    let mut draft = |together: bool| -> Vec<Vec<u32>> {
        let mut outs = vec![Vec::new(); seqs];
        let mut jobs: Vec<DraftJob> = caches
            .iter_mut()
            .zip(&histories)
            .zip(outs.iter_mut())
            .map(|((cache, history), drafts)| DraftJob { cache, history, max: guesses, min_p: None, drafts })
            .collect();
        match together {
            true => draft_together(model, &mut jobs).unwrap(),
            false => jobs.chunks_mut(1).for_each(|job| draft_together(model, job).unwrap()),
        }
        drop(jobs);
        outs
    };
    assert_eq!(draft(true), draft(false), "the same guesses batched and alone");
    let (mut batched, mut alone) = (f64::INFINITY, f64::INFINITY);
    for _round in 0..5 {
        batched = batched.min(best(2, || drop(draft(true))));
        alone = alone.min(best(2, || drop(draft(false))));
    }
    eprintln!(
        "{file}: {seqs} sequences x {guesses} guesses at {context} cached tokens: batched {:.1} ms, one sequence at a time {:.1} ms ({:.2}x)",
        batched * 1e3,
        alone * 1e3,
        alone / batched
    );
}
