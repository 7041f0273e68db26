//! Speculative decoding by prompt lookup: the output is exactly plain decoding's (tokens,
//! logprob bits, seeded draws), alone and batched, while drafts are accepted and forwards saved.

mod common;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{Batch, BatchConfig, Flow, SeqRequest, Sink, SpecConfig};
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;

type Trace = Vec<(u32, u32)>;

#[derive(Default)]
struct Out {
    trace: Trace,
    stats: Option<GenerationStats>,
}

struct Rec(Rc<RefCell<Out>>);

impl Sink for Rec {
    fn token(&mut self, e: TokenEvent) -> Flow {
        self.0.borrow_mut().trace.push((e.token, e.logprobs.map_or(0, |l| l.logprob.to_bits())));
        Flow::Continue
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        self.0.borrow_mut().stats = Some(outcome.unwrap());
    }
}

/// Runs `prompts` together (or one by one when `together` is false) and returns each output
/// and the number of steps taken.
fn run(model: &dyn CausalLm, prompts: &[(Vec<u32>, SamplingParams)], spec: Option<SpecConfig>, together: bool) -> (Vec<Out>, usize) {
    run_with(model, None, prompts, spec, together)
}

fn run_with(
    model: &dyn CausalLm,
    draft: Option<&dyn CausalLm>,
    prompts: &[(Vec<u32>, SamplingParams)],
    spec: Option<SpecConfig>,
    together: bool,
) -> (Vec<Out>, usize) {
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 16, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let sampler_cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let mut outs = Vec::new();
    let mut steps = 0;
    let groups: Vec<&[(Vec<u32>, SamplingParams)]> = if together { vec![prompts] } else { prompts.chunks(1).collect() };
    for group in groups {
        let mut batch = Batch::new(model, cfg, Default::default());
        match (draft, spec) {
            (Some(d), Some(spec)) => batch.set_draft_model(d, spec),
            _ => batch.set_speculation(spec),
        }
        let recs: Vec<_> = group.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
        for ((prompt, sp), r) in group.iter().zip(&recs) {
            let req = SeqRequest {
                prompt: prompt.clone(),
                params: GenerateParams { max_tokens: 40, sampling: sp.clone(), ..Default::default() },
                eos_ids: vec![],
                cancel: CancelToken::new(),
                sampler: Box::new(Sampler::new(sp, &sampler_cfg).unwrap()),
                sink: Box::new(Rec(r.clone())),
                constraint: None,
            };
            batch.add(req, model.make_cache());
        }
        while !batch.is_idle() {
            batch.step(&|| false);
            steps += 1;
        }
        outs.extend(recs.into_iter().map(|r| Rc::try_unwrap(r).ok().unwrap().into_inner()));
    }
    (outs, steps)
}

/// Prompts whose continuations repeat their own text (a prompt followed by its first half), so
/// that prompt lookup guesses well; greedy with logprobs, and seeded sampling.
fn prompts(fixture: &str) -> Vec<(Vec<u32>, SamplingParams)> {
    let f = load_fixture(fixture);
    f.prompts
        .iter()
        .take(4)
        .enumerate()
        .map(|(i, p)| {
            let ids = &p.prompt_ids;
            let prompt: Vec<u32> = ids.iter().chain(&ids[1..ids.len() / 2]).copied().collect();
            let sp = match i % 2 {
                0 => SamplingParams { logprobs: Some(2), ..Default::default() },
                _ => SamplingParams { temperature: 0.7, seed: Some(i as u64), ..Default::default() },
            };
            (prompt, sp)
        })
        .collect()
}

fn check(file: &str, fixture: &str) {
    let Some(model) = open_model(file) else { return };
    let model = model.as_ref();
    let ps = prompts(fixture);
    let spec = Some(SpecConfig { max_drafts: 6, ngram_min: 2, ngram_max: 4 });
    let (plain, plain_steps) = run(model, &ps, None, false);
    for together in [false, true] {
        let (fast, steps) = run(model, &ps, spec, together);
        for (i, (a, b)) in plain.iter().zip(&fast).enumerate() {
            assert!(a.trace == b.trace, "{file}: prompt {i} (batched: {together}) differs with speculation");
        }
        let accepted: usize = fast.iter().map(|o| o.stats.as_ref().unwrap().accepted_tokens).sum();
        let drafted: usize = fast.iter().map(|o| o.stats.as_ref().unwrap().drafted_tokens).sum();
        assert!(accepted > 0 && drafted >= accepted, "{file}: {accepted} of {drafted} drafts accepted");
        if !together {
            assert!(steps < plain_steps, "{file}: {steps} steps with speculation against {plain_steps}");
        }
        eprintln!("{file}: batched {together}: {accepted} of {drafted} drafts accepted, {steps} steps (plain {plain_steps})");
    }
}

#[test]
fn prompt_lookup_gives_plain_decoding_s_output() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json");
}

#[test]
fn prompt_lookup_on_gemma3_s_sliding_windows() {
    check("gemma-3-270m-Q4_K_M.gguf", "gemma-3-270m-Q4_K_M.json");
}

#[test]
fn prompt_lookup_on_qwen2() {
    check("qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf", "qwen2.5-coder-0.5b-instruct-Q4_K_M.json");
}

/// A draft model (here a second copy of the model itself: its greedy guesses are the target's
/// own, computed one token at a time): the same output, and every greedy draft accepted.
#[test]
fn a_draft_model_gives_plain_decoding_s_output() {
    let (Some(model), Some(draft)) = (open_model("SmolLM2-135M-Instruct.Q4_1.gguf"), open_model("SmolLM2-135M-Instruct.Q4_1.gguf")) else { return };
    let ps = prompts("SmolLM2-135M-Instruct.Q4_1.json");
    let spec = Some(SpecConfig { max_drafts: 4, ngram_min: 2, ngram_max: 4 });
    let (plain, _) = run(model.as_ref(), &ps, None, false);
    for together in [false, true] {
        let (fast, _) = run_with(model.as_ref(), Some(draft.as_ref()), &ps, spec, together);
        for (i, (a, b)) in plain.iter().zip(&fast).enumerate() {
            assert!(a.trace == b.trace, "prompt {i} (batched: {together}) differs with a draft model");
            let s = b.stats.as_ref().unwrap();
            assert!(s.drafted_tokens > 0, "prompt {i}: nothing drafted");
            if ps[i].1.temperature == 0.0 {
                assert_eq!(s.accepted_tokens, s.drafted_tokens, "prompt {i}: a self-draft's greedy guesses are all right");
            }
        }
    }
}
