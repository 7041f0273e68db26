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

/// A model that times each forward by its rows (decode rows of the one sequence, pending token
/// and drafts) and each projection to logits: where a speculating generation's time goes.
struct Timed<'m> {
    inner: &'m dyn CausalLm,
    /// (rows, seconds) per forward_hidden, and seconds of all projections.
    forwards: std::sync::Mutex<Vec<(usize, f64)>>,
    logits_secs: std::sync::Mutex<f64>,
}

impl CausalLm for Timed<'_> {
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
        let rows = batch.iter().map(|s| s.tokens.len()).sum();
        let t = Instant::now();
        let out = self.inner.forward_hidden(batch);
        self.forwards.lock().unwrap().push((rows, t.elapsed().as_secs_f64()));
        out
    }
    fn project_logits(&self, hidden: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        let t = Instant::now();
        let out = self.inner.project_logits(hidden);
        *self.logits_secs.lock().unwrap() += t.elapsed().as_secs_f64();
        out
    }
}

/// bench/speculation.py's code edit (a ~200-line Python module rewritten with one function
/// renamed), as the server's ChatML template renders it for Qwen2.5.
fn code_edit_prompt() -> String {
    let mut file = String::from("\"\"\"Inventory helpers.\"\"\"\n\nimport math\n\n");
    for i in 0..16 {
        file += &format!(
            "def item_{i}_total(prices, quantity):\n    \"\"\"Total of item {i}: the sum of its prices times the quantity.\"\"\"\n    \
             subtotal = 0.0\n    for price in prices:\n        subtotal += price\n    discount = {} / 100\n    \
             total = subtotal * quantity * (1 - discount)\n    return math.floor(total * 100) / 100\n\n\n",
            i + 1
        );
    }
    let user = format!(
        "Here is a Python file:\n\n```python\n{file}```\n\nRewrite the whole file with the function `item_3_total` renamed to \
         `item_three_total`. Output the complete file, every function, and nothing else."
    );
    format!(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// The code edit through the engine (`Batch`, greedy, gated prompt lookup as `serve --draft-kind
/// ngram` runs it), plain against each of `FERROLM_SPEED_DRAFTS` (comma-separated γ, "8,16"),
/// in alternating rounds (`FERROLM_SPEED_ROUNDS`, 2): the time, the forwards by rows (mean ms
/// per forward), the logits and the rest of the step (sampling, lookup, bookkeeping).
///
///     FERROLM_SPEED_MODEL=qwen2.5-coder-1.5b-instruct.gguf cargo test --release -p ferrolm-engine \
///         --test spec_speed code_edit -- --ignored --nocapture
#[test]
#[ignore]
fn code_edit_through_the_engine() {
    use ferrolm_core::{CancelToken, GenerateParams};
    use ferrolm_engine::{Batch, BatchConfig, SeqRequest, SpecConfig};
    let file = std::env::var("FERROLM_SPEED_MODEL").unwrap_or("qwen2.5-coder-1.5b-instruct.gguf".into());
    let Some(model) = open_model(&file) else { return };
    let tok = ferrolm_text::Tokenizer::from_gguf_file(ferrolm_models::paths::models_dir().join(&file)).unwrap();
    let prompt = tok.encode_prompt(&code_edit_prompt(), false, usize::MAX).unwrap();
    let eos = tok.encode_prompt("<|im_end|>", false, 8).unwrap();
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or(d.into());
    let gammas: Vec<usize> = env("FERROLM_SPEED_DRAFTS", "8").split(',').map(|g| g.trim().parse().unwrap()).collect();
    let rounds: usize = env("FERROLM_SPEED_ROUNDS", "2").parse().unwrap();
    let run = |spec: Option<SpecConfig>| {
        let timed = Timed { inner: model.as_ref(), forwards: Default::default(), logits_secs: Default::default() };
        let cfg = BatchConfig { max_batch_tokens: 2048, max_seqs: 1, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
        let mut batch = Batch::new(&timed, cfg, Default::default());
        batch.set_speculation(spec);
        let out = std::rc::Rc::new(std::cell::RefCell::new(record::Out::default()));
        let sp = SamplingParams::default();
        let sampler_cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
        batch.add(
            SeqRequest {
                prompt: prompt.clone(),
                params: GenerateParams { max_tokens: 1500, sampling: sp.clone(), ..Default::default() },
                eos_ids: eos.clone(),
                cancel: CancelToken::new(),
                sampler: Box::new(Sampler::new(&sp, &sampler_cfg).unwrap()),
                sink: Box::new(record::Rec(out.clone())),
                constraint: None,
            },
            model.make_cache(),
        );
        // The prompt's forward first (not timed: the same for all).
        while timed.forwards.lock().unwrap().is_empty() {
            batch.step(&|| false);
        }
        *timed.logits_secs.lock().unwrap() = 0.0;
        timed.forwards.lock().unwrap().clear();
        let t = Instant::now();
        record::run(&mut batch);
        let secs = t.elapsed().as_secs_f64();
        drop(batch);
        let out = std::rc::Rc::try_unwrap(out).ok().unwrap().into_inner();
        (secs, out, timed.forwards.into_inner().unwrap(), timed.logits_secs.into_inner().unwrap())
    };
    let mut plain_trace = None;
    for round in 0..rounds {
        let (plain_secs, plain, fw, logits) = run(None);
        let n = plain.trace.len();
        let fsum: f64 = fw.iter().map(|f| f.1).sum();
        eprintln!(
            "round {round}: plain {n} tokens {plain_secs:.2} s ({:.1} tok/s), {} forwards {fsum:.2} s, logits {logits:.2} s, rest {:.2} s",
            n as f64 / plain_secs,
            fw.len(),
            plain_secs - fsum - logits
        );
        plain_trace.get_or_insert(plain.trace.clone());
        for &g in &gammas {
            let (secs, fast, fw, logits) = run(Some(SpecConfig { max_drafts: g, ngram_min: 1, ngram_max: 3 }));
            assert!(fast.trace == plain.trace, "γ {g}: the output differs from plain decoding's");
            let s = fast.stats.as_ref().unwrap();
            let fsum: f64 = fw.iter().map(|f| f.1).sum();
            let mut by_rows = std::collections::BTreeMap::<usize, (usize, f64)>::new();
            fw.iter().for_each(|&(r, t)| {
                let e = by_rows.entry(r).or_default();
                (e.0, e.1) = (e.0 + 1, e.1 + t);
            });
            let rows: Vec<String> = by_rows.iter().map(|(r, (c, t))| format!("{r}:{c}x{:.0}ms", t / *c as f64 * 1e3)).collect();
            eprintln!(
                "round {round}: γ {g}: {:.2} s ({:.2}x plain), {} forwards {fsum:.2} s, logits {logits:.2} s, rest {:.2} s, {} / {} drafts kept; rows:count x mean: {}",
                secs,
                plain_secs / secs,
                fw.len(),
                secs - fsum - logits,
                s.accepted_tokens,
                s.drafted_tokens,
                rows.join(" ")
            );
        }
    }
}
