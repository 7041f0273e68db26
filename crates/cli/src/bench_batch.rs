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
}

/// Counts tokens; remembers when the first came.
struct Count(Rc<RefCell<(usize, Option<Instant>)>>);

impl Sink for Count {
    fn token(&mut self, _: TokenEvent) -> Flow {
        let mut c = self.0.borrow_mut();
        c.0 += 1;
        c.1.get_or_insert_with(Instant::now);
        Flow::Continue
    }

    fn finish(&mut self, _: Result<GenerationStats, String>) {}
}

/// `n` sequences of `prompt`, `decode` greedy tokens each, admitted together.
pub fn run(model: &dyn CausalLm, prompt: &[u32], n: usize, decode: usize, max_batch_tokens: usize) -> candle_core::Result<BatchFigures> {
    let cfg = BatchConfig { max_batch_tokens, max_seqs: n, ..Default::default() };
    let mut batch = Batch::new(model, cfg, Default::default());
    let counts: Vec<_> = (0..n).map(|_| Rc::new(RefCell::new((0, None)))).collect();
    let sampler_cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    for c in &counts {
        let sampler = Sampler::new(&SamplingParams::default(), &sampler_cfg).map_err(candle_core::Error::wrap)?;
        let req = SeqRequest {
            prompt: prompt.to_vec(),
            params: GenerateParams { max_tokens: decode, ..Default::default() },
            eos_ids: vec![],
            cancel: CancelToken::new(),
            sampler: Box::new(sampler),
            sink: Box::new(Count(c.clone())),
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
    })
}

fn total(counts: &[Rc<RefCell<(usize, Option<Instant>)>>]) -> usize {
    counts.iter().map(|c| c.borrow().0).sum()
}
