//! Speculative decoding by prompt lookup: the output is exactly plain decoding's (tokens,
//! logprob bits, seeded draws), alone and batched, while drafts are accepted and forwards saved.

mod common;

use common::record::{request_with, Out};
use common::*;
use ferrolm_core::SamplingParams;
use ferrolm_engine::{draft_together, Batch, BatchConfig, DraftCache, DraftJob, DraftModelProposer, Proposer, SpecConfig};
use ferrolm_models::{CausalLm, RowKind, SeqInput};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
            batch.add(request_with(model, prompt, sp, 40, r), model.make_cache());
        }
        steps += record::run(&mut batch);
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

/// A model that counts, per forward, the decode spans it was given (how many sequences a
/// draft step guessed for at once): the real model underneath does the work.
struct CountingSpans<'m> {
    inner: &'m dyn CausalLm,
    most_decode_spans: AtomicUsize,
    forwards: AtomicUsize,
}

impl CausalLm for CountingSpans<'_> {
    fn info(&self) -> &ferrolm_models::ModelInfo {
        self.inner.info()
    }
    fn device(&self) -> &candle_core::Device {
        self.inner.device()
    }
    fn make_cache(&self) -> ferrolm_kv::SeqCache {
        self.inner.make_cache()
    }
    fn forward_hidden(&self, batch: &mut [SeqInput<'_>]) -> candle_core::Result<candle_core::Tensor> {
        let spans = batch.iter().filter(|s| s.kind == RowKind::Decode).count();
        self.most_decode_spans.fetch_max(spans, Ordering::Relaxed);
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.inner.forward_hidden(batch)
    }
    fn project_logits(&self, hidden: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        self.inner.project_logits(hidden)
    }
}

/// A draft model (here a second copy of the model itself), with prompt lookup first and the gate
/// that rests the model where it does not pay (`--draft-model`): the same output, alone and
/// batched; batched, the draft guesses for several sequences in one forward, and needs fewer
/// forwards than the sequences alone.
#[test]
fn a_draft_model_gives_plain_decoding_s_output() {
    let (Some(model), Some(draft)) = (open_model("SmolLM2-135M-Instruct.Q4_1.gguf"), open_model("SmolLM2-135M-Instruct.Q4_1.gguf")) else { return };
    let ps = prompts("SmolLM2-135M-Instruct.Q4_1.json");
    let spec = Some(SpecConfig { max_drafts: 4, ngram_min: 2, ngram_max: 4 });
    let (plain, _) = run(model.as_ref(), &ps, None, false);
    let mut forwards = Vec::new();
    for together in [false, true] {
        let counted = CountingSpans { inner: draft.as_ref(), most_decode_spans: AtomicUsize::new(0), forwards: AtomicUsize::new(0) };
        let (fast, _) = run_with(model.as_ref(), Some(&counted), &ps, spec, together);
        for (i, (a, b)) in plain.iter().zip(&fast).enumerate() {
            assert!(a.trace == b.trace, "prompt {i} (batched: {together}) differs with a draft model");
            let s = b.stats.as_ref().unwrap();
            assert!(s.drafted_tokens > 0 && s.accepted_tokens > 0, "prompt {i}: {} of {} accepted", s.accepted_tokens, s.drafted_tokens);
        }
        let most = counted.most_decode_spans.load(Ordering::Relaxed);
        assert_eq!(most > 1, together, "batched: {together}: at most {most} sequences in a draft forward");
        forwards.push(counted.forwards.load(Ordering::Relaxed));
    }
    eprintln!("draft forwards: {} one sequence at a time, {} batched", forwards[0], forwards[1]);
}

/// The draft model guesses for several sequences at once (`draft_together`: one forward per
/// guess over all of them) exactly what it guesses for each alone; a self-draft's guesses are
/// the target's greedy tokens. The sequences differ in length and in the state of their draft
/// caches: fresh (the prompt caught up as prompt rows), and realigned after a verification that
/// kept part of the guesses (a short catch-up in decode rows) or went elsewhere (a trim).
#[test]
fn the_draft_model_guesses_for_several_sequences_together_as_for_each_alone() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let prompts: Vec<Vec<u32>> = fixture.prompts.iter().take(4).map(|p| p.prompt_ids.clone()).collect();
    let truth: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_after(model, p, 12)).collect();
    // Each sequence's histories over three rounds: the prompt; three guesses kept and the
    // target's own fourth token; (even ones) a token other than the greedy one after the first.
    let history = |i: usize, round: usize| -> Vec<u32> {
        let (p, t) = (&prompts[i], &truth[i]);
        match (round, i % 2) {
            (0, _) => p.clone(),
            (1, _) => p.iter().chain(&t[..4]).copied().collect(),
            (_, 0) => p.iter().chain(&t[..1]).chain(&[t[1] ^ 1]).copied().collect(),
            _ => p.iter().chain(&t[..5]).copied().collect(),
        }
    };
    let (mut together, mut alone): (Vec<DraftCache>, Vec<DraftModelProposer>) =
        prompts.iter().map(|_| (DraftCache::new(model), DraftModelProposer::model_only(model))).unzip();
    for round in 0..3 {
        let histories: Vec<Vec<u32>> = (0..prompts.len()).map(|i| history(i, round)).collect();
        // Different numbers of guesses, so that sequences leave the batched forwards at different steps.
        let max = |i: usize| 3 + i;
        let mut outs = vec![Vec::new(); prompts.len()];
        let mut jobs: Vec<DraftJob> = together
            .iter_mut()
            .zip(&histories)
            .zip(outs.iter_mut())
            .enumerate()
            .map(|(i, ((cache, history), drafts))| DraftJob { cache, history, max: max(i), min_p: None, drafts })
            .collect();
        draft_together(model, &mut jobs).unwrap();
        for (i, h) in histories.iter().enumerate() {
            assert_eq!(outs[i], alone[i].propose(h, max(i)), "round {round}, sequence {i}: batched guesses differ from its guesses alone");
            if round < 2 || i % 2 == 1 {
                let kept = h.len() - prompts[i].len();
                assert_eq!(outs[i], truth[i][kept..kept + max(i)], "round {round}, sequence {i}: not the target's greedy tokens");
            }
        }
    }
}

/// The greedy tokens after `prompt`, decoded one at a time as the engine does (prompt rows, then
/// one decode row per token).
fn greedy_after(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.make_cache();
    let (last, head) = prompt.split_last().unwrap();
    model.forward_hidden(&mut [ferrolm_models::SeqInput::prompt(head, &mut cache)]).unwrap();
    let (mut token, mut out) = (*last, Vec::new());
    for _ in 0..n {
        let hidden = model.forward_hidden(&mut [ferrolm_models::SeqInput::decode(&[token], &mut cache)]).unwrap();
        token = model.project_logits(&hidden).unwrap().squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(token);
    }
    out
}

/// The draft model's own guesses: a self-draft guesses exactly the target's greedy tokens, also
/// after its cache is realigned to a verification that kept part of its drafts (the kept
/// tokens and the bonus one go in as decode rows, as the target computed them).
#[test]
fn a_self_draft_guesses_the_target_s_greedy_tokens() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let prompt = load_fixture("SmolLM2-135M-Instruct.Q4_1.json").prompts[0].prompt_ids.clone();
    let truth = greedy_after(model, &prompt, 12);
    let mut draft = DraftModelProposer::model_only(model);
    assert_eq!(draft.propose(&prompt, 6), truth[..6]);
    // Three drafts kept, then the target's own fourth token: the guesses go on from there.
    let history: Vec<u32> = prompt.iter().chain(&truth[..4]).copied().collect();
    assert_eq!(draft.propose(&history, 6), truth[4..10]);
    // A rejected stretch: the sequence went elsewhere after the first kept token.
    let other: Vec<u32> = prompt.iter().chain(&truth[..1]).chain(&[truth[1] ^ 1]).copied().collect();
    assert_eq!(draft.propose(&other, 3), greedy_after(model, &other, 3));
}

/// Probabilities of `logits` (f32) with `bias` added to token `biased`, at temperature 1.
fn target_probs(logits: &[f32], biased: u32, bias: f32) -> Vec<f64> {
    let z: Vec<f64> = logits.iter().enumerate().map(|(i, &l)| (l + if i as u32 == biased { bias } else { 0.0 }) as f64).collect();
    let max = z.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = z.iter().map(|v| (v - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// Pearson's statistic of `counts` against `probs` (bins expected below 5 merged into one) and
/// its degrees of freedom.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut bins, mut rest_obs, mut rest_exp) = (0.0, 0, 0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let expected = p * n as f64;
        if expected < 5.0 {
            (rest_obs, rest_exp) = (rest_obs + c as f64, rest_exp + expected);
        } else {
            stat += (c as f64 - expected).powi(2) / expected;
            bins += 1;
        }
    }
    if rest_exp > 0.0 {
        stat += (rest_obs - rest_exp).powi(2) / rest_exp;
        bins += 1;
    }
    (stat, bins - 1)
}

/// The chi-square quantile at p = 1e-4 (Wilson–Hilferty; z = 3.719).
fn critical(df: usize) -> f64 {
    let k = df as f64;
    k * (1.0 - 2.0 / (9.0 * k) + 3.719 * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// The logits of the next token after `context` (plain decoding: prompt rows, then one decode row).
fn next_logits(model: &dyn CausalLm, context: &[u32]) -> Vec<f32> {
    let mut cache = model.make_cache();
    let (last, head) = context.split_last().unwrap();
    model.forward_hidden(&mut [ferrolm_models::SeqInput::prompt(head, &mut cache)]).unwrap();
    let hidden = model.forward_hidden(&mut [ferrolm_models::SeqInput::decode(&[*last], &mut cache)]).unwrap();
    model.project_logits(&hidden).unwrap().get(0).unwrap().to_vec1().unwrap()
}

/// Sampled speculation keeps the target's distribution: 20,000 seeded draws at temperature 1
/// on a fixed context whose prompt lookup drafts token `DRAFT` (the prompt repeats "5 6", which
/// was followed by 7), the draft made likely by a logit bias so that both outcomes are common.
/// The first token's counts against the target's probabilities, and the second token's counts
/// after an accepted draft (sampled from the verify forward's second row) against the target's
/// probabilities given that draft, by Pearson's chi-square at p = 1e-4. A tiny random-weight
/// llama (tests/fixtures/tiny/llama3), so that the draws take seconds.
#[test]
fn sampled_speculation_keeps_the_target_distribution() {
    const DRAWS: u64 = 20_000;
    const DRAFT: u32 = 7;
    const BIAS: f32 = 5.5;
    let path = repo_root().join("tests/fixtures/tiny/llama3/model-f16.gguf");
    let model = ferrolm_models::load(&ferrolm_models::ModelSource::open(&path).unwrap(), &candle_core::Device::Cpu).unwrap();
    let model = model.as_ref();
    let vocab = model.info().vocab_size;
    let prompt: Vec<u32> = vec![5, 6, DRAFT, 8, 5, 6];
    let sp = |seed| SamplingParams { temperature: 1.0, seed: Some(seed), logit_bias: vec![(DRAFT, BIAS)], ..Default::default() };
    let cfg = BatchConfig { max_batch_tokens: 4096, max_seqs: 512, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let (mut first, mut second) = (vec![0usize; vocab], vec![0usize; vocab]);
    let (mut drafted, mut accepted) = (0, 0);
    for chunk in (0..DRAWS).collect::<Vec<_>>().chunks(500) {
        let mut batch = Batch::new(model, cfg, Default::default());
        batch.set_speculation(Some(SpecConfig { max_drafts: 4, ngram_min: 2, ngram_max: 2 }));
        let outs: Vec<_> = chunk.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
        for (&seed, out) in chunk.iter().zip(&outs) {
            batch.add(request_with(model, &prompt, &sp(seed), 2, out), model.make_cache());
        }
        record::run(&mut batch);
        for out in outs {
            let d = out.borrow();
            let (tokens, stats) = (&d.trace, d.stats.as_ref().unwrap());
            first[tokens[0].0 as usize] += 1;
            if tokens[0].0 == DRAFT {
                second[tokens[1].0 as usize] += 1;
            }
            (drafted, accepted) = (drafted + stats.drafted_tokens, accepted + stats.accepted_tokens);
        }
    }
    assert_eq!(drafted as u64, DRAWS, "every sequence verified one draft");
    assert_eq!(accepted, first[DRAFT as usize], "a draft is kept exactly when the draw equals it");
    let p1 = target_probs(&next_logits(model, &prompt), DRAFT, BIAS);
    let p2 = target_probs(&next_logits(model, &[prompt.clone(), vec![DRAFT]].concat()), DRAFT, BIAS);
    let (s1, df1) = chi_square(&first, &p1);
    let (s2, df2) = chi_square(&second, &p2);
    eprintln!("first token: chi2 {s1:.1} (df {df1}, limit {:.1}); after the accepted draft ({accepted} draws): chi2 {s2:.1} (df {df2}, limit {:.1}); p(draft) {:.3}", critical(df1), critical(df2), p1[DRAFT as usize]);
    assert!(accepted > 2_000 && accepted < 18_000, "both outcomes common: {accepted} accepted");
    assert!(s1 < critical(df1), "first token: chi2 {s1:.1} over {:.1} (df {df1})", critical(df1));
    assert!(s2 < critical(df2), "second token: chi2 {s2:.1} over {:.1} (df {df2})", critical(df2));
    // The test can fail: keeping the draft whenever either of two draws equals it (a wrong rule)
    // shifts its probability from p to 1 − (1 − p)², which these many draws see.
    let p = p1[DRAFT as usize];
    let wrong: Vec<usize> = p1
        .iter()
        .enumerate()
        .map(|(i, &q)| (DRAWS as f64 * if i as u32 == DRAFT { 1.0 - (1.0 - p).powi(2) } else { q * (1.0 - p) }).round() as usize)
        .collect();
    let (sw, dfw) = chi_square(&wrong, &p1);
    assert!(sw > critical(dfw), "a wrong rule's expected counts pass too: chi2 {sw:.1}");
}
