//! Parity on the same GGUF with two oracles (fixtures from scripts/fixtures/llamacpp_fixtures.py):
//!
//! - the exact float64 reference (dequantized weights, no activation quantization): ferrolm
//!   computes the same arithmetic in f32, so the bound is tight;
//! - llama.cpp, which quantizes activations to 8 bits: on SmolLM2-135M Q4_1 that alone moves its
//!   logits by up to 1.98 (mean 0.86) from the exact reference (measured 2026-12-02 on
//!   chat_capital), so the comparison uses a tolerance sized by that measurement.
//!
//! Each checks teacher-forced top-1 agreement wherever the oracle's top-1/top-2 margin is clear,
//! the largest |Δlogit| over the oracle's top-5, and equal greedy continuations up to the
//! oracle's first near-tie (whole continuations on tie-free prompts).

mod common;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams};
use ferrolm_engine::{generate, Flow, GenerateInput};
use ferrolm_models::{CausalLm, SeqInput};

struct Tolerance {
    /// Steps whose oracle margin is at most this are near-ties, not checked for top-1.
    margin: f32,
    /// Largest tolerated |Δlogit| on the oracle's top-5.
    delta: f32,
}

/// Exact reference: f32 vs f64 rounding over 30 layers (measured max 6e-5 on short prompts).
const EXACT: Tolerance = Tolerance {
    margin: 0.01,
    delta: 0.005,
};
/// llama.cpp: its 8-bit activations move logits by up to ~2 from the exact result, but the
/// top-1 and top-2 move together; the largest margin at which a top-1 disagreement was observed
/// over 590 steps was 0.33.
const LLAMA_CPP: Tolerance = Tolerance {
    margin: 0.5,
    delta: 2.5,
};

struct Report {
    agree: usize,
    checked: usize,
    max_delta: f32,
}

/// Feeds the prompt, then `continuation` one token at a time, comparing each step's logits with
/// the oracle's record.
fn teacher_forced(
    model: &dyn CausalLm,
    prompt: &[u32],
    continuation: &[u32],
    steps: &[Step],
    tol: &Tolerance,
) -> Report {
    let mut cache = model.make_cache();
    let n = prompt.len();
    if n > 1 {
        model
            .forward_hidden(&mut [SeqInput::prompt(&prompt[..n - 1], &mut cache)])
            .unwrap();
    }
    let mut feed = prompt[n - 1];
    let mut r = Report {
        agree: 0,
        checked: 0,
        max_delta: 0.0,
    };
    for (i, step) in steps.iter().enumerate() {
        let h = model
            .forward_hidden(&mut [SeqInput::decode(&[feed], &mut cache)])
            .unwrap();
        let logits: Vec<f32> = model
            .project_logits(&h)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        for (id, want) in step.top_ids.iter().zip(&step.top_logits) {
            r.max_delta = r.max_delta.max((logits[*id as usize] - want).abs());
        }
        if step.margin() > tol.margin {
            r.checked += 1;
            r.agree += (argmax(&logits) == step.top_ids[0]) as usize;
        }
        if i + 1 < steps.len() {
            feed = continuation[i];
        }
    }
    r
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
}

fn our_greedy(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.make_cache();
    // A small chunk so that the chunked prefill path is exercised on the long prompts.
    let params = GenerateParams {
        max_tokens: n,
        prefill_chunk: 256,
        ..Default::default()
    };
    let input = GenerateInput {
        prompt,
        params: &params,
        eos_ids: &[],
        cancel: &CancelToken::new(),
        graph: Default::default(),
    };
    let mut out = Vec::new();
    generate(model, &mut cache, input, &mut Greedy, &mut |e| {
        out.push(e.token);
        Flow::Continue
    })
    .unwrap();
    out
}

/// Checks one oracle's record for one prompt; returns failures as messages.
fn check_oracle(
    model: &dyn CausalLm,
    p: &FixturePrompt,
    oracle: &str,
    greedy: &[u32],
    steps: &[Step],
    tol: &Tolerance,
) -> (Vec<String>, f32) {
    let mut failures = Vec::new();
    let r = teacher_forced(model, &p.prompt_ids, greedy, steps, tol);
    let clear = steps
        .iter()
        .take_while(|s| s.margin() > tol.margin)
        .count()
        .min(greedy.len());
    let ours = our_greedy(model, &p.prompt_ids, greedy.len());
    let same = ours.iter().zip(greedy).take_while(|(a, b)| a == b).count();
    eprintln!(
        "{oracle:>9} {:<18} top-1 {:>2}/{:<2} max|Δ| {:.5}  greedy equal {:>2}/{} (clear {clear})",
        p.name,
        r.agree,
        r.checked,
        r.max_delta,
        same,
        greedy.len()
    );
    if r.agree != r.checked {
        failures.push(format!(
            "{oracle} {}: teacher-forced top-1 {}/{}",
            p.name, r.agree, r.checked
        ));
    }
    if same < clear {
        failures.push(format!(
            "{oracle} {}: greedy differs at step {same}, within the first {clear} clear steps",
            p.name
        ));
    }
    if r.max_delta > tol.delta {
        failures.push(format!(
            "{oracle} {}: max |Δlogit| {} > {}",
            p.name, r.max_delta, tol.delta
        ));
    }
    (failures, r.max_delta)
}

fn check_model(file: &str) {
    let Some(model) = open_model(file) else {
        return;
    };
    let fixture = load_fixture(&file.replace(".gguf", ".json"));
    let mut failures = Vec::new();
    let mut tie_free = 0;
    for p in &fixture.prompts {
        let (f, _) = check_oracle(
            model.as_ref(),
            p,
            "reference",
            &p.reference.greedy_ids,
            &p.reference.steps,
            &EXACT,
        );
        failures.extend(f);
        let (f, _) = check_oracle(
            model.as_ref(),
            p,
            "llama.cpp",
            &p.greedy_ids,
            &p.steps,
            &LLAMA_CPP,
        );
        failures.extend(f);
        tie_free += p.reference.steps.iter().all(|s| s.margin() > EXACT.margin) as usize;
    }
    // The greedy check must be meaningful: most prompts are tie-free against the exact oracle.
    assert!(
        tie_free * 2 >= fixture.prompts.len(),
        "only {tie_free} tie-free prompts"
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn smollm2_q4_1_matches_llama_cpp_and_exact_reference() {
    exact_activations();
    check_model("SmolLM2-135M-Instruct.Q4_1.gguf");
}
