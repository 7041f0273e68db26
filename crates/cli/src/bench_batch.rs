//! `ferrolm bench --concurrency N`: N greedy sequences of the same prompt length run together
//! through the engine step (continuous batching), as N concurrent requests would. Reports the
//! aggregate decode rate once all N are decoding, and the time to every sequence's first token.

use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{Batch, BatchConfig, Flow, SeqRequest, Sink};
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

/// What one concurrent run measured.
pub struct BatchFigures {
    /// Decoded tokens per second summed over the sequences, from the step after the last
    /// sequence's first token to the end.
    pub decode_tps: f64,
    /// When the last sequence got its first token (ms from the start).
    pub last_first_token_ms: f64,
    /// Steps while all sequences decoded.
    pub decode_steps: usize,
    /// Each sequence's greedy tokens.
    pub tokens: Vec<Vec<u32>>,
}

/// Per sequence: tokens so far, when the first came.
type Counter = Rc<RefCell<(Vec<u32>, Option<Instant>)>>;

/// Records tokens; remembers when the first came.
struct Count(Counter);

impl Sink for Count {
    fn token(&mut self, e: TokenEvent) -> Flow {
        let mut c = self.0.borrow_mut();
        c.0.push(e.token);
        c.1.get_or_insert_with(Instant::now);
        Flow::Continue
    }

    fn finish(&mut self, _: Result<GenerationStats, String>) {}
}

/// Sequence i's prompt: `prompt` rotated left by i tokens (distinct prompts of one length).
pub fn prompt_of(prompt: &[u32], i: usize) -> Vec<u32> {
    let k = i % prompt.len().max(1);
    prompt[k..].iter().chain(&prompt[..k]).copied().collect()
}

/// `n` sequences (`prompt_of(prompt, i)`), `decode` greedy tokens each, admitted together.
pub fn run(model: &dyn CausalLm, prompt: &[u32], n: usize, decode: usize, max_batch_tokens: usize) -> candle_core::Result<BatchFigures> {
    let cfg = BatchConfig { max_batch_tokens, max_seqs: n, prompt_cache_bytes: 0, ..Default::default() };
    let mut batch = Batch::new(model, cfg, Default::default());
    let counts: Vec<Counter> = (0..n).map(|_| Rc::new(RefCell::new((Vec::new(), None)))).collect();
    let sampler_cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    for (i, c) in counts.iter().enumerate() {
        let sampler = Sampler::new(&SamplingParams::default(), &sampler_cfg).map_err(candle_core::Error::wrap)?;
        let req = SeqRequest {
            prompt: prompt_of(prompt, i),
            params: GenerateParams { max_tokens: decode, ..Default::default() },
            eos_ids: vec![],
            cancel: CancelToken::new(),
            sampler: Box::new(sampler),
            sink: Box::new(Count(c.clone())),
            constraint: None,
        };
        batch.add(req, model.make_cache());
    }
    let start = Instant::now();
    let mut decoding: Option<(Instant, usize)> = None;
    let mut steps = 0;
    while !batch.is_idle() {
        batch.step(&|| false);
        let all_started = counts.iter().all(|c| c.borrow().1.is_some());
        match decoding {
            None if all_started => decoding = Some((Instant::now(), total(&counts))),
            Some(_) => steps += 1,
            None => {}
        }
    }
    let end = Instant::now();
    let (from, tokens_then) = decoding.unwrap_or((end, total(&counts)));
    let last_first = counts.iter().filter_map(|c| c.borrow().1).max().unwrap_or(end);
    Ok(BatchFigures {
        decode_tps: (total(&counts) - tokens_then) as f64 / (end - from).as_secs_f64().max(1e-9),
        last_first_token_ms: (last_first - start).as_secs_f64() * 1e3,
        decode_steps: steps,
        tokens: counts.iter().map(|c| c.borrow().0.clone()).collect(),
    })
}

fn total(counts: &[Counter]) -> usize {
    counts.iter().map(|c| c.borrow().0.len()).sum()
}

/// Each sequence of `batched` against the same prompt decoded alone (`generate`, greedy):
/// how many tokens agree from the start.
pub fn agreement(model: &dyn CausalLm, prompt: &[u32], batched: &[Vec<u32>]) -> candle_core::Result<Vec<usize>> {
    let sampler_cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let mut out = Vec::with_capacity(batched.len());
    for (i, got) in batched.iter().enumerate() {
        let p = prompt_of(prompt, i);
        let params = GenerateParams { max_tokens: got.len(), ..Default::default() };
        let mut sampler = Sampler::new(&SamplingParams::default(), &sampler_cfg).map_err(candle_core::Error::wrap)?;
        let mut solo = Vec::new();
        let input = ferrolm_engine::GenerateInput { prompt: &p, params: &params, eos_ids: &[], cancel: &CancelToken::new(), graph: Default::default() };
        ferrolm_engine::generate(model, &mut model.make_cache(), input, &mut sampler, &mut |e| {
            solo.push(e.token);
            Flow::Continue
        })?;
        out.push(got.iter().zip(&solo).take_while(|(a, b)| a == b).count());
    }
    Ok(out)
}
