//! Continuous batching on the CPU: every sequence of a batch gets exactly the tokens and
//! logprobs (bit for bit) it gets alone, at batch 1, 3 and 16, with sequences joining and
//! leaving mid-stream, prompts of mixed lengths chunked differently than alone (prompt chunks
//! mixed with decode rows in one forward), greedy and seeded sampling; cancellation leaves at
//! the next step, even mid-prompt; preempted sequences still complete.

mod common;

use common::*;
use ferrolm_core::{CancelToken, FinishReason, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{generate, Batch, BatchConfig, Flow, GenerateInput, SeqRequest, Sink};
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;

/// A generation's output: each token with its logprob bits and top alternatives' bits.
type Trace = Vec<(u32, u32, Vec<(u32, u32)>)>;

fn trace_of(e: &TokenEvent) -> (u32, u32, Vec<(u32, u32)>) {
    let lp = e.logprobs.as_ref();
    let top = lp.map(|l| l.top.iter().map(|(t, p)| (*t, p.to_bits())).collect()).unwrap_or_default();
    (e.token, lp.map_or(0, |l| l.logprob.to_bits()), top)
}

#[derive(Default)]
struct Recorded {
    trace: Trace,
    stats: Option<Result<GenerationStats, String>>,
}

struct Recorder(Rc<RefCell<Recorded>>);

impl Sink for Recorder {
    fn token(&mut self, event: TokenEvent) -> Flow {
        self.0.borrow_mut().trace.push(trace_of(&event));
        Flow::Continue
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        self.0.borrow_mut().stats = Some(outcome);
    }
}

/// One request of the tests: greedy with logprobs, or seeded sampling.
#[derive(Clone)]
struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
}

fn sampler(model: &dyn CausalLm, sp: &SamplingParams) -> Sampler {
    Sampler::new(sp, &SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() }).unwrap()
}

fn params(c: &Case) -> GenerateParams {
    GenerateParams { max_tokens: c.max_tokens, sampling: c.sampling.clone(), ..Default::default() }
}

/// The case alone, through `generate` (its whole prompt in one chunk).
fn solo(model: &dyn CausalLm, c: &Case) -> Trace {
    let mut out = Trace::new();
    let input = GenerateInput { prompt: &c.prompt, params: &params(c), eos_ids: &[], cancel: &CancelToken::new(), graph: Default::default() };
    generate(model, &mut model.make_cache(), input, &mut sampler(model, &c.sampling), &mut |e| {
        out.push(trace_of(&e));
        Flow::Continue
    })
    .unwrap();
    out
}

/// The cases in one batch: case i joins before step `joins[i]`.
fn batched(model: &dyn CausalLm, cases: &[Case], joins: &[usize], cfg: BatchConfig) -> (Vec<Rc<RefCell<Recorded>>>, usize) {
    let mut batch = Batch::new(model, cfg, Default::default());
    let records: Vec<_> = cases.iter().map(|_| Rc::new(RefCell::new(Recorded::default()))).collect();
    let (mut step, mut max_running) = (0, 0);
    loop {
        for (i, c) in cases.iter().enumerate().filter(|(i, _)| joins[*i] == step) {
            let req = SeqRequest {
                prompt: c.prompt.clone(),
                params: params(c),
                eos_ids: vec![],
                cancel: CancelToken::new(),
                sampler: Box::new(sampler(model, &c.sampling)),
                sink: Box::new(Recorder(records[i].clone())),
                constraint: None,
            };
            batch.add(req, model.make_cache());
        }
        if batch.is_idle() && joins.iter().all(|&j| j < step) {
            break;
        }
        batch.step(&|| false);
        max_running = max_running.max(batch.running());
        step += 1;
    }
    (records, max_running)
}

fn cases(model: &dyn CausalLm, n: usize) -> Vec<Case> {
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    (0..n)
        .map(|i| {
            let p = &fixture.prompts[i % fixture.prompts.len()];
            // Mixed lengths: whole fixture prompts, and prefixes of them.
            let len = if i % 3 == 1 { (p.prompt_ids.len() / 2).max(2) } else { p.prompt_ids.len() };
            let sampling = match i % 2 {
                0 => SamplingParams { logprobs: Some(4), ..Default::default() },
                _ => SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(1000 + i as u64), ..Default::default() },
            };
            let _ = model;
            Case { prompt: p.prompt_ids[..len].to_vec(), max_tokens: 12 + (i * 5) % 17, sampling }
        })
        .collect()
}

fn check_equal_to_solo(model: &dyn CausalLm, n: usize, stagger: usize, max_batch_tokens: usize) {
    let cases = cases(model, n);
    let joins: Vec<usize> = (0..n).map(|i| i * stagger).collect();
    let cfg = BatchConfig { max_batch_tokens, max_seqs: 64, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let (records, max_running) = batched(model, &cases, &joins, cfg);
    assert!(n == 1 || max_running > 1, "the sequences never ran together");
    for (i, (c, r)) in cases.iter().zip(&records).enumerate() {
        let r = r.borrow();
        let stats = r.stats.as_ref().expect("finished").as_ref().expect("no error");
        assert_eq!(stats.finish_reason, Some(FinishReason::Length));
        assert_eq!(r.trace.len(), c.max_tokens);
        assert!(r.trace == solo(model, c), "batch of {n}: sequence {i} differs from its solo run");
    }
}

#[test]
fn batched_sequences_equal_their_solo_runs_bit_for_bit() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    check_equal_to_solo(model, 1, 0, 48);
    // Joining mid-stream, prompts chunked by a small budget beside running decodes.
    check_equal_to_solo(model, 3, 4, 40);
    check_equal_to_solo(model, 16, 2, 96);
}

/// Gemma 3: sliding-window (rotating) caches, K-quant formats, soft-capped logits.
#[test]
fn gemma3_batched_sequences_equal_their_solo_runs() {
    let Some(model) = open_model("gemma-3-270m-Q4_K_M.gguf") else { return };
    let fixture = load_fixture("gemma-3-270m-Q4_K_M.json");
    let long = fixture.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap();
    let cases: Vec<Case> = fixture
        .prompts
        .iter()
        .take(3)
        .chain([long])
        .map(|p| Case { prompt: p.prompt_ids.clone(), max_tokens: 10, sampling: SamplingParams { logprobs: Some(3), ..Default::default() } })
        .collect();
    let cfg = BatchConfig { max_batch_tokens: 300, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let (records, _) = batched(model.as_ref(), &cases, &[0, 0, 3, 5], cfg);
    for (i, (c, r)) in cases.iter().zip(&records).enumerate() {
        assert!(r.borrow().trace == solo(model.as_ref(), c), "gemma3: sequence {i} differs from its solo run");
    }
}

/// A cancelled sequence leaves at the next step, also in the middle of its prompt; the others
/// are not touched.
#[test]
fn cancellation_mid_prompt_leaves_at_the_next_step() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let c = cases(model, 2);
    let long: Vec<u32> = c[0].prompt.iter().cycle().take(600).copied().collect();
    let cfg = BatchConfig { max_batch_tokens: 64, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let cancel = CancelToken::new();
    let (a, b) = (Rc::new(RefCell::new(Recorded::default())), Rc::new(RefCell::new(Recorded::default())));
    let greedy = SamplingParams::default();
    let long_case = Case { prompt: long, max_tokens: 8, sampling: greedy.clone() };
    for (case, rec, cancel) in [(&long_case, &a, cancel.clone()), (&c[1], &b, CancelToken::new())] {
        let req = SeqRequest {
            prompt: case.prompt.clone(),
            params: params(case),
            eos_ids: vec![],
            cancel,
            sampler: Box::new(sampler(model, &case.sampling)),
            sink: Box::new(Recorder(rec.clone())),
            constraint: None,
        };
        batch.add(req, model.make_cache());
    }
    batch.step(&|| false);
    batch.step(&|| false);
    cancel.cancel();
    let report = batch.step(&|| false);
    assert_eq!(report.retired.len(), 1, "the cancelled sequence retires at the next step");
    assert!(report.retired[0].1.offset() < 600, "it left in the middle of its prompt");
    let stats = a.borrow().stats.clone().unwrap().unwrap();
    assert_eq!(stats.finish_reason, Some(FinishReason::Cancelled));
    assert!(a.borrow().trace.is_empty());
    while !batch.is_idle() {
        batch.step(&|| false);
    }
    assert!(b.borrow().trace == solo(model, &c[1]), "the other sequence is untouched");
}

/// With a KV budget too small for everyone, the newest sequences are preempted and recomputed:
/// every request still completes with all its tokens (greedy: the same tokens here, although
/// a recomputed cache is not bit-identical in general: prompt kernels, not decode kernels).
#[test]
fn preempted_sequences_complete() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let cases: Vec<Case> = cases(model, 4).into_iter().map(|c| Case { max_tokens: 20, sampling: SamplingParams::default(), ..c }).collect();
    let per_token = model.make_cache().bytes_per_token();
    let longest = cases.iter().map(|c| c.prompt.len() + c.max_tokens).max().unwrap();
    let budget = per_token * (longest + 40);
    let cfg = BatchConfig { max_batch_tokens: 64, max_seqs: 8, kv_budget_bytes: budget, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let records: Vec<_> = cases.iter().map(|_| Rc::new(RefCell::new(Recorded::default()))).collect();
    for (c, r) in cases.iter().zip(&records) {
        let req = SeqRequest {
            prompt: c.prompt.clone(),
            params: params(c),
            eos_ids: vec![],
            cancel: CancelToken::new(),
            sampler: Box::new(sampler(model, &c.sampling)),
            sink: Box::new(Recorder(r.clone())),
            constraint: None,
        };
        batch.add(req, model.make_cache());
    }
    let mut preempted = 0;
    while !batch.is_idle() {
        preempted += batch.step(&|| false).preempted;
    }
    for r in &records {
        let r = r.borrow();
        assert_eq!(r.trace.len(), 20);
        assert_eq!(r.stats.as_ref().unwrap().as_ref().unwrap().finish_reason, Some(FinishReason::Length));
    }
    eprintln!("{preempted} preemptions");
}

/// OpenAI's `n`: choices of one prompt share its prefill (one sequence computes it, the others
/// start from a copy of its cache) and each equals its own solo run bit for bit.
#[test]
fn choices_of_one_prompt_share_the_prefill_and_equal_their_solo_runs() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let prompt = cases(model, 1).remove(0).prompt;
    let choices: Vec<Case> = (0..3)
        .map(|i| Case {
            prompt: prompt.clone(),
            max_tokens: 10,
            sampling: SamplingParams { temperature: 1.0, seed: Some(7 + i), logprobs: Some(2), ..Default::default() },
        })
        .collect();
    let cfg = BatchConfig { max_batch_tokens: 32, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let records: Vec<_> = choices.iter().map(|_| Rc::new(RefCell::new(Recorded::default()))).collect();
    let reqs = choices
        .iter()
        .zip(&records)
        .map(|(c, r)| SeqRequest {
            prompt: c.prompt.clone(),
            params: params(c),
            eos_ids: vec![],
            cancel: CancelToken::new(),
            sampler: Box::new(sampler(model, &c.sampling)),
            sink: Box::new(Recorder(r.clone())),
            constraint: None,
        })
        .collect();
    batch.add_group(reqs, model.make_cache());
    let mut prompt_rows = 0;
    while !batch.is_idle() {
        let r = batch.step(&|| false);
        prompt_rows += r.tokens.saturating_sub(r.seqs.min(3));
    }
    assert!(prompt_rows < 2 * prompt.len(), "the prompt was computed once, not per choice");
    let traces: Vec<Trace> = records.iter().map(|r| r.borrow().trace.clone()).collect();
    assert_ne!(traces[0], traces[1], "different seeds, different choices");
    for (i, (c, t)) in choices.iter().zip(&traces).enumerate() {
        assert!(*t == solo(model, c), "choice {i} differs from its solo run");
        let stats = records[i].borrow().stats.clone().unwrap().unwrap();
        assert_eq!(stats.cached_tokens, if i == 0 { 0 } else { prompt.len() - 1 });
    }
}
