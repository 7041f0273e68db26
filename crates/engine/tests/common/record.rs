//! Requests through the engine with a recording sink, and the same request alone through
//! `generate`: each token with its logprob's bits, so paths can be compared bit for bit.
#![allow(dead_code)]

use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{generate, Batch, Flow, GenerateInput, SeqRequest, Sink};
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;

/// (token, bits of its logprob) per generated token.
pub type Trace = Vec<(u32, u32)>;

/// What a recorded request delivered.
#[derive(Default)]
pub struct Out {
    pub trace: Trace,
    pub stats: Option<GenerationStats>,
}

/// A sink that records into a shared `Out`.
pub struct Rec(pub Rc<RefCell<Out>>);

impl Sink for Rec {
    fn token(&mut self, e: TokenEvent) -> Flow {
        self.0.borrow_mut().trace.push((e.token, e.logprobs.map_or(0, |l| l.logprob.to_bits())));
        Flow::Continue
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        self.0.borrow_mut().stats = Some(outcome.unwrap());
    }
}

/// Greedy with the top-3 logprobs (so every token's logprob bits are compared too).
pub fn sampling() -> SamplingParams {
    SamplingParams { logprobs: Some(3), ..Default::default() }
}

/// A greedy request of `max_tokens` recording into `out`.
pub fn request(model: &dyn CausalLm, prompt: &[u32], max_tokens: usize, out: &Rc<RefCell<Out>>) -> SeqRequest<'static> {
    request_with(model, prompt, &sampling(), max_tokens, out)
}

/// A request of `max_tokens` with sampling `sp` recording into `out`.
pub fn request_with(model: &dyn CausalLm, prompt: &[u32], sp: &SamplingParams, max_tokens: usize, out: &Rc<RefCell<Out>>) -> SeqRequest<'static> {
    let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    SeqRequest {
        prompt: prompt.to_vec(),
        params: GenerateParams { max_tokens, sampling: sp.clone(), ..Default::default() },
        eos_ids: vec![],
        cancel: CancelToken::new(),
        sampler: Box::new(Sampler::new(sp, &cfg).unwrap()),
        sink: Box::new(Rec(out.clone())),
        constraint: None,
    }
}

/// The same request alone through `generate` on a fresh contiguous cache, no prompt cache.
pub fn solo(model: &dyn CausalLm, prompt: &[u32], max_tokens: usize) -> Trace {
    let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let params = GenerateParams { max_tokens, sampling: sampling(), ..Default::default() };
    let input = GenerateInput { prompt, params: &params, eos_ids: &[], cancel: &CancelToken::new(), graph: Default::default() };
    let mut trace = Trace::new();
    generate(model, &mut model.make_cache(), input, &mut Sampler::new(&sampling(), &cfg).unwrap(), &mut |e| {
        trace.push((e.token, e.logprobs.map_or(0, |l| l.logprob.to_bits())));
        Flow::Continue
    })
    .unwrap();
    trace
}

/// Steps the batch until every sequence has ended; the number of steps taken.
pub fn run(batch: &mut Batch<'_>) -> usize {
    let mut steps = 0;
    while !batch.is_idle() {
        batch.step(&|| false);
        steps += 1;
    }
    steps
}
