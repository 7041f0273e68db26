//! Teacher-forced and greedy comparisons against an oracle's record, shared by the per-model
//! parity tests (include with `#[path = "common/parity.rs"] mod parity;` next to `mod common;`).
#![allow(dead_code)]

use crate::common::{FixturePrompt, Greedy, Step};
use ferrolm_core::{CancelToken, GenerateParams};
use ferrolm_engine::{generate, Flow, GenerateInput};
use ferrolm_models::{CausalLm, SeqInput};

#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Steps whose oracle top-1/top-2 margin is at most this are near-ties, not checked for
    /// top-1 (and end the stretch where greedy continuations must agree).
    pub margin: f32,
    /// Largest tolerated |Δlogit| on the oracle's top-5.
    pub delta: f32,
}

#[derive(Debug, Default)]
pub struct Report {
    pub agree: usize,
    pub checked: usize,
    pub max_delta: f32,
}

/// Prefills `prompt[..n-1]` in forwards of at most `chunk` tokens, then feeds the last prompt
/// token and `continuation` one at a time; returns the full logits of each of `steps` steps.
pub fn logits_along(
    model: &dyn CausalLm,
    prompt: &[u32],
    continuation: &[u32],
    steps: usize,
    chunk: usize,
) -> Vec<Vec<f32>> {
    let mut cache = model.make_cache();
    let n = prompt.len();
    for part in prompt[..n - 1].chunks(chunk.max(1)) {
        model
            .forward_hidden(&mut [SeqInput::prompt(part, &mut cache)])
            .unwrap();
    }
    let mut feed = prompt[n - 1];
    let mut out = Vec::with_capacity(steps);
    for i in 0..steps {
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
        out.push(logits);
        if i + 1 < steps {
            feed = continuation[i];
        }
    }
    out
}

/// Compares our logits, teacher-forced along the oracle's continuation, with its record.
pub fn teacher_forced(
    model: &dyn CausalLm,
    prompt: &[u32],
    continuation: &[u32],
    steps: &[Step],
    tol: &Tolerance,
) -> Report {
    let all = logits_along(model, prompt, continuation, steps.len(), usize::MAX);
    let mut r = Report::default();
    for (logits, step) in all.iter().zip(steps) {
        for (id, want) in step.top_ids.iter().zip(&step.top_logits) {
            r.max_delta = r.max_delta.max((logits[*id as usize] - want).abs());
        }
        if step.margin() > tol.margin {
            r.checked += 1;
            r.agree += (argmax(logits) == step.top_ids[0]) as usize;
        }
    }
    r
}

pub fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
}

/// Our greedy continuation through the engine's generation loop, with a prefill chunk smaller
/// than the prompts so that chunked prefill (and cache eviction on sliding-window layers) runs.
pub fn our_greedy(model: &dyn CausalLm, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let mut cache = model.make_cache();
    let params = GenerateParams {
        max_tokens: n,
        prefill_chunk: chunk,
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

/// One oracle's record of a prompt: its greedy continuation and each step's top-5.
pub struct OracleRun<'a> {
    pub name: &'a str,
    pub greedy: &'a [u32],
    pub steps: &'a [Step],
    pub tol: Tolerance,
}

/// Checks each oracle's record for one prompt: teacher-forced top-1 at clear steps, max |Δ| on
/// the oracle's top-5, and equal greedy continuations up to the oracle's first near-tie (our
/// greedy run is shared by the oracles). Returns failures as messages, and one report per
/// oracle.
pub fn check_prompt(
    model: &dyn CausalLm,
    p: &FixturePrompt,
    oracles: &[OracleRun<'_>],
    chunk: usize,
) -> (Vec<String>, Vec<Report>) {
    let longest = oracles.iter().map(|o| o.greedy.len()).max().unwrap_or(0);
    let ours = our_greedy(model, &p.prompt_ids, longest, chunk);
    let mut failures = Vec::new();
    let mut reports = Vec::new();
    for o in oracles {
        let (f, r) = check_oracle(model, p, o, &ours);
        failures.extend(f);
        reports.push(r);
    }
    (failures, reports)
}

fn check_oracle(
    model: &dyn CausalLm,
    p: &FixturePrompt,
    o: &OracleRun<'_>,
    ours: &[u32],
) -> (Vec<String>, Report) {
    let (oracle, greedy, steps, tol) = (o.name, o.greedy, o.steps, &o.tol);
    let mut failures = Vec::new();
    let r = teacher_forced(model, &p.prompt_ids, greedy, steps, tol);
    let clear = steps
        .iter()
        .take_while(|s| s.margin() > tol.margin)
        .count()
        .min(greedy.len());
    let same = ours.iter().zip(greedy).take_while(|(a, b)| a == b).count();
    eprintln!(
        "{oracle:>9} {:<18} {:>5} tok  top-1 {:>2}/{:<2} max|Δ| {:.5}  greedy equal {:>2}/{} (clear {clear})",
        p.name,
        p.prompt_ids.len(),
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
    (failures, r)
}
