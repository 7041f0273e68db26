//! One sequence's generation, for the CLI and the tests: the engine step (`step.rs`) over a
//! batch of one. The contract is DESIGN §3: the caches hold exactly `prompt ++ forwarded`,
//! cancellation is checked at every step, an observed finish cause wins over the length
//! limit, and stats are returned on every exit path, also when the consumer stops early.

use crate::config::{BatchConfig, GraphSettings};
use crate::sampler::TokenSampler;
use crate::seq::{SeqRequest, Sink};
use crate::step::Batch;
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, TokenEvent, TokenId};
use ferrolm_kv::SeqCache;
use ferrolm_models::CausalLm;
use std::cell::RefCell;
use std::rc::Rc;

/// The consumer's answer to each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop generating (stop string matched, client gone…); stats are still returned.
    Stop,
}

pub struct GenerateInput<'a> {
    pub prompt: &'a [TokenId],
    pub params: &'a GenerateParams,
    /// Token ids that end the generation (the model's EOS ids plus the request's stop ids).
    pub eos_ids: &'a [TokenId],
    pub cancel: &'a CancelToken,
    /// How plain greedy decode may run through a captured step.
    pub graph: GraphSettings,
}

type Outcome = Rc<RefCell<Option<Result<GenerationStats, String>>>>;

/// Tokens to the caller's closure; the end into a slot the caller reads.
struct CallbackSink<'f> {
    on_token: &'f mut dyn FnMut(TokenEvent) -> crate::Flow,
    outcome: Outcome,
}

impl Sink for CallbackSink<'_> {
    fn token(&mut self, event: TokenEvent) -> crate::Flow {
        (self.on_token)(event)
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        *self.outcome.borrow_mut() = Some(outcome);
    }
}

/// Runs one generation on `cache` (empty, or holding a prefix of the prompt); the cache is
/// left holding exactly the tokens forwarded.
pub fn generate(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    input: GenerateInput<'_>,
    sampler: &mut dyn TokenSampler,
    on_token: &mut dyn FnMut(TokenEvent) -> Flow,
) -> candle_core::Result<GenerationStats> {
    generate_with_adapters(model, None, cache, input, sampler, on_token)
}

/// [`generate`] where `input.params.adapter` names LoRA adapters mounted in `adapters`.
pub fn generate_with_adapters(
    model: &dyn CausalLm,
    adapters: Option<&ferrolm_models::lora::Adapters>,
    cache: &mut SeqCache,
    input: GenerateInput<'_>,
    sampler: &mut dyn TokenSampler,
    on_token: &mut dyn FnMut(TokenEvent) -> Flow,
) -> candle_core::Result<GenerationStats> {
    let outcome = Outcome::default();
    let request = SeqRequest {
        prompt: input.prompt.to_vec(),
        params: input.params.clone(),
        eos_ids: input.eos_ids.to_vec(),
        cancel: input.cancel.clone(),
        sampler: Box::new(sampler),
        sink: Box::new(CallbackSink { on_token, outcome: outcome.clone() }),
        constraint: None,
    };
    // One sequence: the whole prompt chunk fits a step, as before batching.
    let cfg = BatchConfig { max_batch_tokens: input.params.prefill_chunk.max(1), max_seqs: 1, kv_budget_bytes: usize::MAX, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, input.graph);
    if let Some(adapters) = adapters {
        batch.set_adapters(adapters);
    }
    batch.add(request, std::mem::replace(cache, SeqCache::new(Vec::new())));
    while !batch.is_idle() {
        for (_, c) in batch.step(&|| false).retired {
            *cache = c;
        }
    }
    let result = outcome.borrow_mut().take();
    match result {
        Some(Ok(stats)) => Ok(stats),
        Some(Err(message)) => Err(candle_core::Error::Msg(message)),
        None => candle_core::bail!("the generation ended without an outcome"),
    }
}
