//! Logprobs of the greedy tokens, as the server reports them (ferrolm_sample::Sampler with
//! `logprobs` on, temperature 0), against llama.cpp's and the exact float64 reference's on the
//! same GGUF (fixtures from scripts/fixtures/llamacpp_fixtures.py, which record each step's
//! full-vocabulary log-normalizer: logprob = logit − log_norm, a log-softmax of the raw logits,
//! which is what llama.cpp's server reports).
//!
//! Teacher-forced along each oracle's own greedy continuation. Tolerances:
//! - exact reference: f32 vs f64 over 30 layers; logits agree within 5e-5 (parity_llamacpp), so
//!   a logprob (a difference of two such numbers) within 1e-3;
//! - llama.cpp: its 8-bit activation quantization moves logprobs too. Over the 158 steps where
//!   llama.cpp and the exact reference follow the same tokens, the fixture alone shows llama.cpp's
//!   greedy-token logprob up to 0.222 from the exact one and its top-5 alternatives' up to 0.780
//!   (low-probability tokens move most). Along llama.cpp's whole continuations ferrolm, still
//!   within 3e-5 of exact arithmetic, measured (2026-12-03) max 0.356 (greedy) and 1.349 (top-5),
//!   mean 0.018 (greedy): that is llama.cpp's own error. The bounds add about 30% to the maxima,
//!   and the mean bound catches a systematic shift that the maxima would hide.

mod common;

use common::*;
use ferrolm_core::SamplingParams;
use ferrolm_models::{CausalLm, SeqInput};
use ferrolm_sample::{Sampler, SamplerConfig};

const EXACT_TOL: f64 = 1e-3;
/// Greedy token's logprob vs llama.cpp, largest (measured 0.356) and mean over all steps.
const LLAMA_CPP_GREEDY_TOL: f64 = 0.5;
const LLAMA_CPP_GREEDY_MEAN_TOL: f64 = 0.04;
/// Top-5 alternatives' logprobs vs llama.cpp (measured 1.349).
const LLAMA_CPP_TOP_TOL: f64 = 1.75;

struct Worst {
    greedy: f64,
    greedy_sum: f64,
    top: f64,
    steps: usize,
}

/// Runs the prompt and `continuation` teacher-forced, sampling each step with logprobs on;
/// compares the greedy token's logprob and the top-5 alternatives' with the oracle's.
fn compare(model: &dyn CausalLm, prompt: &[u32], continuation: &[u32], steps: &[Step]) -> Worst {
    let params = SamplingParams { logprobs: Some(5), ..Default::default() };
    let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let mut sampler = Sampler::new(&params, &cfg).unwrap();
    let mut cache = model.make_cache();
    let n = prompt.len();
    model.forward_hidden(&mut [SeqInput::prompt(&prompt[..n - 1], &mut cache)]).unwrap();
    let mut history = prompt.to_vec();
    let mut feed = prompt[n - 1];
    let mut w = Worst { greedy: 0.0, greedy_sum: 0.0, top: 0.0, steps: 0 };
    for (i, step) in steps.iter().enumerate() {
        let h = model.forward_hidden(&mut [SeqInput::decode(&[feed], &mut cache)]).unwrap();
        let logits = model.project_logits(&h).unwrap().squeeze(0).unwrap();
        let s = sampler.sample(&logits, &history).unwrap();
        let lp = s.logprobs.expect("logprobs were asked for");
        let norm = step.log_norm.expect("fixture records log_norm");
        let want = |j: usize| step.top_logits[j] as f64 - norm;
        if step.margin() > 0.5 {
            assert_eq!(lp.token, step.top_ids[0], "step {i}: greedy token");
            let d = (lp.logprob as f64 - want(0)).abs();
            w.greedy = w.greedy.max(d);
            w.greedy_sum += d;
        }
        for (j, id) in step.top_ids.iter().enumerate() {
            if let Some(&(_, got)) = lp.top.iter().find(|(t, _)| t == id) {
                w.top = w.top.max((got as f64 - want(j)).abs());
            }
        }
        w.steps += 1;
        history.push(continuation[i]);
        feed = continuation[i];
    }
    w
}

#[test]
fn smollm2_greedy_logprobs_match_llama_cpp_and_exact_reference() {
    exact_activations();
    let file = "SmolLM2-135M-Instruct.Q4_1.gguf";
    let Some(model) = open_model(file) else { return };
    let fixture = load_fixture(&file.replace(".gguf", ".json"));
    let mut failures = Vec::new();
    let (mut sum, mut steps) = (0.0, 0);
    for p in &fixture.prompts {
        let exact = compare(model.as_ref(), &p.prompt_ids, &p.reference.greedy_ids, &p.reference.steps);
        let llama = compare(model.as_ref(), &p.prompt_ids, &p.greedy_ids, &p.steps);
        eprintln!(
            "{:<18} exact: greedy {:.2e} top-5 {:.2e} ({} steps)   llama.cpp: greedy {:.3} top-5 {:.3} ({} steps)",
            p.name, exact.greedy, exact.top, exact.steps, llama.greedy, llama.top, llama.steps
        );
        sum += llama.greedy_sum;
        steps += llama.steps;
        if exact.greedy.max(exact.top) > EXACT_TOL {
            failures.push(format!("{}: vs exact {:.2e} > {EXACT_TOL}", p.name, exact.greedy.max(exact.top)));
        }
        if llama.greedy > LLAMA_CPP_GREEDY_TOL || llama.top > LLAMA_CPP_TOP_TOL {
            failures.push(format!("{}: vs llama.cpp greedy {:.3} top-5 {:.3}", p.name, llama.greedy, llama.top));
        }
    }
    let mean = sum / steps as f64;
    eprintln!("llama.cpp: mean |Δ| of the greedy token's logprob {mean:.4} over {steps} steps");
    if mean > LLAMA_CPP_GREEDY_MEAN_TOL {
        failures.push(format!("vs llama.cpp: mean greedy |Δ| {mean:.4} > {LLAMA_CPP_GREEDY_MEAN_TOL}"));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
