//! One sequence's generation: prefill by the planner, then the decode loop. The contract is
//! DESIGN §3: the caches hold exactly `prompt ++ forwarded`, cancellation is checked at every
//! chunk and step, an observed finish cause wins over the length limit, and stats are returned
//! on every exit path, also when the consumer stops early.

use crate::graph_decode::GraphDecoder;
use crate::prefill::plan_prefill;
use crate::sampler::TokenSampler;
use candle_core::Tensor;
use ferrolm_core::{
    CancelToken, FinishReason, GenerateParams, GenerationStats, TokenEvent, TokenId,
};
use ferrolm_kv::SeqCache;
use ferrolm_models::{CausalLm, SeqInput};
use std::time::Instant;

/// The consumer's answer to each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop generating (stop string matched, client gone…); stats are still returned.
    Stop,
}

/// Called once while the caches hold exactly `snapshot_at` tokens.
pub type SnapshotHook<'a> = &'a mut dyn FnMut(&SeqCache, &[TokenId]);

pub struct GenerateInput<'a> {
    pub prompt: &'a [TokenId],
    pub params: &'a GenerateParams,
    /// Token ids that end the generation (the model's EOS ids plus the request's stop ids).
    pub eos_ids: &'a [TokenId],
    pub cancel: &'a CancelToken,
}

struct Clock {
    start: Instant,
    first_token: Option<Instant>,
}

/// Runs one generation on `cache` (empty, or holding a prefix of the prompt).
pub fn generate(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    input: GenerateInput<'_>,
    sampler: &mut dyn TokenSampler,
    mut on_snapshot: Option<SnapshotHook<'_>>,
    on_token: &mut dyn FnMut(TokenEvent) -> Flow,
) -> candle_core::Result<GenerationStats> {
    let prompt = input.prompt;
    if prompt.is_empty() {
        candle_core::bail!("the prompt is empty");
    }
    let mut clock = Clock {
        start: Instant::now(),
        first_token: None,
    };
    let cached = reuse_cached_prefix(cache, prompt.len());
    let mut history: Vec<TokenId> = prompt.to_vec();
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        cached_tokens: cached,
        ..Default::default()
    };
    if input.params.max_tokens == 0 {
        return Ok(finish(
            stats,
            &clock,
            cache,
            &history,
            Some(FinishReason::Length),
        ));
    }
    let Some(logits) = prefill(model, cache, &input, &mut on_snapshot)? else {
        return Ok(finish(
            stats,
            &clock,
            cache,
            &history,
            Some(FinishReason::Cancelled),
        ));
    };
    let mut next = sampler.sample(&logits, &history)?;
    clock.first_token = Some(Instant::now());
    if let Some(reason) = captured_greedy(model, cache, &input, sampler, next.token, &mut history, &mut stats, on_token)? {
        return Ok(finish(stats, &clock, cache, &history, reason));
    }
    let reason = loop {
        let token = next.token;
        history.push(token);
        stats.generated_tokens += 1;
        let event = TokenEvent {
            token,
            index: stats.generated_tokens - 1,
            logprobs: next.logprobs.take(),
        };
        if on_token(event) == Flow::Stop {
            break None;
        }
        if let Some(cause) = finish_cause(&input, token, stats.generated_tokens) {
            break Some(cause);
        }
        let logits = step(model, cache, &[token])?;
        next = sampler.sample(&logits, &history)?;
    };
    Ok(finish(stats, &clock, cache, &history, reason))
}

/// Why generation ends after delivering `token` as the `generated`-th token, if it does: EOS
/// (or a stop id), the length limit, or cancellation, in that order.
fn finish_cause(input: &GenerateInput<'_>, token: TokenId, generated: usize) -> Option<FinishReason> {
    if input.eos_ids.contains(&token) {
        Some(FinishReason::Stop)
    } else if generated >= input.params.max_tokens {
        Some(FinishReason::Length)
    } else if input.cancel.is_cancelled() {
        Some(FinishReason::Cancelled)
    } else {
        None
    }
}

thread_local! {
    /// The engine thread's captured decode step, kept across requests (its graph is reused while
    /// the cache buffers are the same, and recaptured otherwise).
    static DECODER: std::cell::RefCell<Option<GraphDecoder>> = const { std::cell::RefCell::new(None) };
}

/// Plain greedy requests on a device with step graphs decode through the captured step
/// (`graph_decode`): the same tokens, without a host round trip per step. Returns the finish
/// reason (`Some(None)`: the consumer stopped), or `None` when this path does not apply and
/// nothing was decoded.
#[allow(clippy::too_many_arguments)]
fn captured_greedy(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    input: &GenerateInput<'_>,
    sampler: &dyn TokenSampler,
    first: TokenId,
    history: &mut Vec<TokenId>,
    stats: &mut GenerationStats,
    on_token: &mut dyn FnMut(TokenEvent) -> Flow,
) -> candle_core::Result<Option<Option<FinishReason>>> {
    if !sampler.is_plain_greedy() || !crate::graph_decode::use_static_decode(model) {
        return Ok(None);
    }
    let reason = std::cell::Cell::new(None);
    let mut deliver = |token: TokenId, history: &mut Vec<TokenId>, stats: &mut GenerationStats| -> bool {
        history.push(token);
        stats.generated_tokens += 1;
        let event = TokenEvent { token, index: stats.generated_tokens - 1, logprobs: None };
        if on_token(event) == Flow::Stop {
            return false;
        }
        reason.set(finish_cause(input, token, stats.generated_tokens));
        reason.get().is_none()
    };
    if !deliver(first, history, stats) {
        return Ok(Some(reason.get()));
    }
    let remaining = input.params.max_tokens - stats.generated_tokens;
    DECODER.with(|slot| -> candle_core::Result<Option<Option<FinishReason>>> {
        let mut slot = slot.borrow_mut();
        if slot.is_none() {
            *slot = GraphDecoder::new(model)?;
        }
        let decoder = slot.as_mut().expect("llama-family models have a static step");
        let ran = decoder.run(model, cache, first, remaining, &mut |t| deliver(t, history, stats))?;
        debug_assert!(ran.is_some(), "checked has_static_decode above");
        Ok(Some(reason.get()))
    })
}

/// A cache that already holds the whole prompt must recompute the last token's logits: drop it.
fn reuse_cached_prefix(cache: &mut SeqCache, prompt_len: usize) -> usize {
    let cached = cache.offset();
    if cached >= prompt_len && cache.is_trimmable() {
        cache.trim(cached - prompt_len + 1);
    }
    cache.offset()
}

/// Forwards the uncached prompt; returns the logits of the last prompt token, or None when
/// cancelled.
fn prefill(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    input: &GenerateInput<'_>,
    on_snapshot: &mut Option<SnapshotHook<'_>>,
) -> candle_core::Result<Option<Tensor>> {
    let prompt = input.prompt;
    let plan = plan_prefill(
        cache.offset(),
        prompt.len(),
        input.params.prefill_chunk,
        input.params.snapshot_at,
    );
    let mut logits = None;
    for chunk in plan {
        if input.cancel.is_cancelled() {
            return Ok(None);
        }
        let tokens = &prompt[chunk.start..chunk.start + chunk.len];
        if chunk.is_tail {
            logits = Some(step(model, cache, tokens)?);
        } else {
            model.forward_hidden(&mut [SeqInput { tokens, cache }])?;
        }
        if chunk.snapshot_after {
            if let Some(hook) = on_snapshot.as_mut() {
                hook(cache, &prompt[..chunk.start + chunk.len]);
            }
        }
    }
    Ok(logits)
}

/// One forward of `tokens` and the logits of the last one, `[vocab]`.
fn step(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    tokens: &[TokenId],
) -> candle_core::Result<Tensor> {
    let hidden = model.forward_hidden(&mut [SeqInput { tokens, cache }])?;
    model.project_logits(&hidden)?.squeeze(0)
}

fn finish(
    mut stats: GenerationStats,
    clock: &Clock,
    cache: &SeqCache,
    history: &[TokenId],
    reason: Option<FinishReason>,
) -> GenerationStats {
    let end = Instant::now();
    let first = clock.first_token.unwrap_or(end);
    stats.prefill_ms = ms(first - clock.start);
    stats.ttft_ms = stats.prefill_ms;
    stats.decode_ms = ms(end - first);
    let new_prompt = (stats.prompt_tokens - stats.cached_tokens) as f64;
    stats.prefill_tps = if stats.prefill_ms > 0.0 {
        new_prompt / (stats.prefill_ms / 1e3)
    } else {
        0.0
    };
    // mlx-lm's convention: token 0 is free on the decode clock.
    stats.decode_tps = if stats.decode_ms > 0.0 {
        stats.generated_tokens as f64 / (stats.decode_ms / 1e3)
    } else {
        0.0
    };
    stats.cache_tokens = history[..cache.offset().min(history.len())].to_vec();
    stats.finish_reason = reason;
    stats
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
