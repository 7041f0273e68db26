//! One request's generation as owned state: its tokens, how many of them the cache holds, its
//! sampler, where its tokens go, its stats. The step (`step.rs`) forwards and samples it; the
//! scheduler sees it only through `SeqView`.

use crate::constraint::TokenConstraint;
use crate::fill::{Fill, Policy};
use crate::masks::{MaskJob, Premask};
use crate::sampler::TokenSampler;
use crate::scheduler::{SeqView, Want};
use crate::spec::{DraftJob, Proposal, Proposer, SpecStats};
use crate::Flow;
use candle_core::Tensor;
use ferrolm_core::{CancelToken, FinishReason, GenerateParams, GenerationStats, TokenEvent, TokenId};
use ferrolm_kv::SeqCache;
use ferrolm_models::lora::LoraStack;
use std::sync::Arc;
use std::time::Instant;

/// Where a sequence's tokens and its end go.
pub trait Sink {
    /// One generated token; `Flow::Stop` ends the generation (client gone, stop string…).
    fn token(&mut self, event: TokenEvent) -> Flow;
    /// Exactly once, last: the stats, or why the generation failed.
    fn finish(&mut self, outcome: Result<GenerationStats, String>);
    /// Whether nobody listens any more (the generation is then cancelled at the next step).
    fn is_closed(&self) -> bool {
        false
    }
    /// Write what a durable generation emitted so far to its log now (graceful shutdown).
    fn checkpoint(&mut self) {}
}

/// A request ready to run: the engine's input for one sequence.
pub struct SeqRequest<'a> {
    pub prompt: Vec<TokenId>,
    pub params: GenerateParams,
    /// The model's EOS ids plus the request's stop ids.
    pub eos_ids: Vec<TokenId>,
    pub cancel: CancelToken,
    pub sampler: Box<dyn TokenSampler + 'a>,
    pub sink: Box<dyn Sink + 'a>,
    /// Structured output: what may come next (None: anything).
    pub constraint: Option<Box<dyn TokenConstraint + 'a>>,
}

pub struct Sequence<'a> {
    pub id: u64,
    /// Prompt ++ generated tokens. The last one is pending (sampled and delivered, not yet
    /// forwarded) once decoding has started.
    pub tokens: Vec<TokenId>,
    /// Tokens forwarded as prompt rows before decoding (re)starts: the prompt, or after a
    /// preemption every token but the pending one (they are recomputed).
    prefill_len: usize,
    pub cache: SeqCache,
    params: GenerateParams,
    eos_ids: Vec<TokenId>,
    cancel: CancelToken,
    sampler: Box<dyn TokenSampler + 'a>,
    sink: Box<dyn Sink + 'a>,
    stats: GenerationStats,
    started: Option<Instant>,
    first_token: Option<Instant>,
    /// Set once the generation has ended: the reason (None: the consumer stopped it).
    ended: Option<Option<FinishReason>>,
    failure: Option<String>,
    /// Sequences of the same prompt (OpenAI's `n`) waiting for this one's prefill: they start
    /// from a copy of its cache once its prompt, all but the last token, is in.
    pub followers: Vec<Sequence<'a>>,
    /// Speculative decoding: the proposer, the drafts of the coming step, how many to ask for
    /// (adapted to what was accepted), the decode rows being forwarded, and the counters.
    proposer: Option<Box<dyn Proposer + 'a>>,
    drafts: Vec<TokenId>,
    /// This step's request for the draft model's guesses (max, min_p): the step's batched draft
    /// forward fills `drafts` (`draft_job`).
    model_request: Option<(usize, Option<f32>)>,
    gamma: usize,
    max_gamma: usize,
    rows: Vec<TokenId>,
    spec: SpecStats,
    /// Fill (`fill.rs`): spans the request determines or copies, proposed before speculation's
    /// drafts and verified the same way; which of them this step's drafts are (None: the
    /// proposer's).
    fill: Option<Fill>,
    drafts_from: Option<Policy>,
    constraint: Option<Box<dyn TokenConstraint + 'a>>,
    /// The mask of this step's first sampled row, computed ahead by the step (`masks.rs`);
    /// None: computed when sampling.
    premask: Premask,
    /// Rows of the step in flight that were delivered before it (the last one's logits are
    /// the first to sample).
    pending_rows: usize,
    /// The LoRA adapters its rows run with (`GenerateParams::adapter`, resolved).
    lora: Option<Arc<LoraStack>>,
}

impl<'a> Sequence<'a> {
    /// A sequence for `req` over `cache` (empty, or holding a prefix of the prompt).
    pub fn new(id: u64, req: SeqRequest<'a>, mut cache: SeqCache) -> Self {
        let cached = reuse_cached_prefix(&mut cache, req.prompt.len());
        let stats = GenerationStats { prompt_tokens: req.prompt.len(), cached_tokens: cached, ..Default::default() };
        // A constrained sequence's forced tokens are jump-forward's (the grammar's own).
        let fill = req.params.fill.clone().filter(|_| req.constraint.is_none()).map(|plan| Fill::new(plan, req.prompt.len()));
        let mut seq = Self {
            id,
            prefill_len: req.prompt.len(),
            tokens: req.prompt,
            cache,
            params: req.params,
            eos_ids: req.eos_ids,
            cancel: req.cancel,
            sampler: req.sampler,
            sink: req.sink,
            stats,
            started: None,
            first_token: None,
            ended: None,
            failure: None,
            followers: Vec::new(),
            proposer: None,
            drafts: Vec::new(),
            model_request: None,
            gamma: 0,
            max_gamma: 0,
            rows: Vec::new(),
            spec: SpecStats::default(),
            fill,
            drafts_from: None,
            constraint: req.constraint,
            premask: None,
            pending_rows: 1,
            lora: None,
        };
        if seq.tokens.is_empty() {
            seq.fail("the prompt is empty".into());
        } else if seq.cache.offset() >= seq.tokens.len() {
            seq.fail("the cache holds the whole prompt and cannot drop its last token".into());
        } else if seq.params.max_tokens == 0 {
            seq.ended = Some(Some(FinishReason::Length));
        }
        seq
    }

    /// Continues a generation that emitted `emitted` before (a checkpoint of an earlier
    /// process): they are delivered again, in order, and become tokens the cache has not seen.
    /// The prompt is then forwarded as prompt rows and `emitted` as one multi-token decode row
    /// (`Want::Decode { pending }`), which is bit-identical to decoding them one at a time, so
    /// the generation goes on exactly as if never interrupted. Every emitted token was one draw
    /// of the sampler (no constraint forces tokens), so the random stream resumes at step
    /// `emitted.len()`.
    pub fn resume(&mut self, emitted: &[TokenId]) {
        if emitted.is_empty() || self.is_done() {
            return;
        }
        if self.constraint.is_some() {
            return self.fail("a constrained generation cannot be resumed from a checkpoint".into());
        }
        if !self.sampler.resume_at(emitted.len() as u64) {
            return self.fail("this sampler cannot resume a checkpointed generation".into());
        }
        for &token in emitted {
            if self.is_done() {
                break;
            }
            self.deliver(token, None);
        }
    }

    /// What the scheduler needs to know.
    pub fn view(&self) -> SeqView {
        let seats = 1 + self.followers.len();
        SeqView {
            want: self.want(),
            seats,
            kv_tokens: seats * (self.tokens.len() + 1),
            max_kv_tokens: self.max_kv_tokens(),
            max_chunk: self.params.prefill_chunk,
        }
    }

    /// The next rows to forward: prompt rows up to the tail, then a decode row at a time (with
    /// the drafts proposed for it).
    pub fn want(&self) -> Want {
        let computed = self.cache.offset();
        if self.is_done() {
            Want::Nothing
        } else if computed + 1 < self.prefill_len {
            Want::Prompt { remaining: self.prefill_len - 1 - computed }
        } else {
            Want::Decode { pending: self.tokens.len() - computed, drafts: self.drafts.len() }
        }
    }

    pub fn is_decoding(&self) -> bool {
        matches!(self.want(), Want::Decode { .. })
    }

    /// Speculates with `proposer`, at most `max_gamma` drafts per step.
    pub fn set_proposer(&mut self, proposer: Box<dyn Proposer + 'a>, max_gamma: usize) {
        if self.params.speculative && max_gamma > 0 {
            (self.proposer, self.gamma, self.max_gamma) = (Some(proposer), max_gamma, max_gamma);
        }
    }

    /// Runs every row with `lora` from now on (set before the first forward).
    pub fn set_lora(&mut self, lora: Option<Arc<LoraStack>>) {
        self.lora = lora;
    }

    pub fn lora(&self) -> Option<&Arc<LoraStack>> {
        self.lora.as_ref()
    }

    pub fn speculates(&self) -> bool {
        self.proposer.is_some()
    }

    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// Asks fill, then the proposer, for this step's drafts: no more than the tokens left to
    /// generate allow, nor than the cache can take back (a sliding window that has moved on
    /// cannot).
    pub fn propose(&mut self) {
        self.drafts.clear();
        self.drafts_from = None;
        self.model_request = None;
        if (self.proposer.is_none() && self.fill.is_none()) || !self.is_decoding() {
            return;
        }
        let limit = self.remaining().saturating_sub(1).min(self.cache.max_trim());
        let copy = self.proposer.is_none();
        if let Some((span, policy)) = self.fill.as_mut().and_then(|f| f.propose(&self.tokens, limit, copy)) {
            (self.drafts, self.drafts_from) = (span, Some(policy));
        } else if let Some(p) = self.proposer.as_mut() {
            let gamma = if p.sizes_its_drafts() { self.max_gamma } else { self.gamma };
            match p.plan(&self.tokens, limit.min(gamma)) {
                Proposal::Drafts(drafts) => self.drafts = drafts,
                Proposal::Model { max, min_p } => self.model_request = Some((max, min_p)),
            }
        }
    }

    /// This step's request for draft-model guesses, if it made one: the draft model's cache of
    /// this sequence, its tokens, and where the guesses go (its drafts).
    pub fn draft_job(&mut self) -> Option<DraftJob<'_>> {
        let (max, min_p) = self.model_request.take()?;
        let cache = self.proposer.as_mut()?.draft_cache()?;
        Some(DraftJob { cache, history: &self.tokens, max, min_p, drafts: &mut self.drafts })
    }

    /// Whether fill would append a span the request determines after the tokens so far.
    pub fn fill_ready(&self) -> bool {
        self.fill.as_ref().is_some_and(|f| f.has_assert_span(&self.tokens))
    }

    /// The most cache tokens this sequence can reach: prompt plus every token it may generate.
    pub fn max_kv_tokens(&self) -> usize {
        self.stats.prompt_tokens + self.params.max_tokens
    }

    /// Marks the start of work (admission) for the stats' clock.
    pub fn start_clock(&mut self) {
        self.started.get_or_insert_with(Instant::now);
    }

    /// The tokens whose keys and values prompt rows computed (the prompt but its last token,
    /// or after a preemption every token recomputed, or as much of them as was forwarded),
    /// unless the sequence failed: what the prompt cache may keep.
    pub fn prompt_rows(&self) -> Option<Vec<TokenId>> {
        // A prompt cut short (cancelled mid-prompt) is kept too: its rows are as valid.
        // Rows computed with adapters are not kept: the prompt cache is keyed by tokens only.
        let n = self.prefill_len.saturating_sub(1).min(self.cache.offset());
        (self.failure.is_none() && n > 0 && self.lora.is_none()).then(|| self.tokens[..n].to_vec())
    }

    /// Whether its followers can start: its prompt but the last token is in the cache.
    pub fn ready_to_fork(&self) -> bool {
        !self.followers.is_empty() && self.is_decoding()
    }

    /// Starts a follower from a copy of this sequence's cache (see `followers`).
    pub fn fork(&self, mut follower: Sequence<'a>, empty: SeqCache) -> Sequence<'a> {
        match self.cache.fork_into(empty) {
            Ok(cache) => {
                follower.stats.cached_tokens = cache.offset();
                follower.cache = cache;
            }
            Err(e) => follower.fail(format!("could not share the prompt's cache: {e}")),
        }
        follower.start_clock();
        follower
    }

    /// The decode rows to forward (the pending token and the first `rows - 1` drafts, the
    /// others dropped) with the cache they extend.
    pub fn decode_input(&mut self, rows: usize) -> ferrolm_models::SeqInput<'_> {
        self.decode_parts(rows).0
    }

    /// [`Sequence::decode_input`], and when the sequence is constrained the job that computes
    /// its first row's mask (from the tokens consumed so far, so during the forward if the step
    /// wants; `sample_row` takes it).
    pub fn decode_parts(&mut self, rows: usize) -> (ferrolm_models::SeqInput<'_>, Option<MaskJob<'_>>) {
        let start = self.cache.offset();
        self.pending_rows = self.tokens.len() - start;
        self.drafts.truncate(rows.saturating_sub(self.pending_rows));
        self.rows.clear();
        self.rows.extend_from_slice(&self.tokens[start..]);
        self.rows.extend_from_slice(&self.drafts);
        self.premask = None;
        let job = match self.constraint.as_deref_mut() {
            Some(c) => Some(MaskJob::new(c, &mut self.premask)),
            None => None,
        };
        (ferrolm_models::SeqInput::decode(&self.rows, &mut self.cache).with_lora(self.lora.clone()), job)
    }

    /// Whether this step's token is the plain argmax of its last row (no drafts, no constraint,
    /// a plain greedy sampler): the engine may then take it from one argmax over the batch.
    pub fn samples_plain_argmax(&self) -> bool {
        self.drafts.is_empty() && self.constraint.is_none() && self.sampler.is_plain_greedy()
    }

    /// Delivers `token`, the argmax of this sequence's row from the batch's argmax (only when
    /// [`Sequence::samples_plain_argmax`]): what `verify` would deliver, without its launches and
    /// read-back for this sequence alone.
    pub fn deliver_argmax(&mut self, token: TokenId) {
        self.sampler.count_argmax();
        self.deliver(token, None);
    }

    /// Samples each forwarded row's logits (`logits.get(first + i)`) in turn with this
    /// sequence's sampler and delivers the token, going on while it equals the next draft; then
    /// takes the rejected drafts' keys and values back out of the cache.
    pub fn verify(&mut self, logits: &Tensor, first: usize) -> candle_core::Result<()> {
        let drafts = std::mem::take(&mut self.drafts);
        let first = first + self.pending_rows - 1;
        let mut accepted = 0;
        for i in 0..=drafts.len() {
            let (token, forced) = self.sample_row(&logits.get(first + i)?)?;
            if self.is_done() || forced || drafts.get(i) != Some(&token) {
                break;
            }
            accepted += 1;
        }
        match (self.drafts_from.take(), self.fill.as_mut()) {
            (Some(policy), Some(fill)) if !drafts.is_empty() => fill.record(policy, drafts.len(), accepted),
            _ => {
                self.spec.drafted += drafts.len();
                self.spec.accepted += accepted;
                self.adapt_gamma(accepted, drafts.len());
            }
        }
        // The rejected drafts' rows leave the cache; it then holds a prefix of the tokens.
        let extra = drafts.len() - accepted;
        if self.cache.trim(extra) != extra {
            candle_core::bail!("speculation: {extra} rejected rows could not be taken back from the cache");
        }
        Ok(())
    }

    /// Samples one row (under the constraint's mask when there is one) and delivers the token,
    /// then the tokens the constraint forces after it (jump-forward); returns the sampled token
    /// and whether tokens were forced.
    fn sample_row(&mut self, logits: &Tensor) -> candle_core::Result<(TokenId, bool)> {
        let Some(c) = self.constraint.as_mut() else {
            let next = self.sampler.sample(logits, &self.tokens)?;
            self.deliver(next.token, next.logprobs);
            return Ok((next.token, false));
        };
        // The first row's mask was computed ahead (the same mask: nothing was consumed since).
        let mask = self.premask.take().unwrap_or_else(|| c.mask()).map_err(candle_core::Error::Msg)?;
        let next = self.sampler.sample_masked(logits, &self.tokens, Some(&mask))?;
        c.consume(next.token).map_err(candle_core::Error::Msg)?;
        let forced = c.forced();
        self.deliver(next.token, next.logprobs);
        for &t in &forced {
            if self.is_done() {
                break;
            }
            self.deliver(t, None);
        }
        self.check_constraint();
        Ok((next.token, !forced.is_empty()))
    }

    /// Ends the generation when the constraint has (an observed cause: "stop").
    fn check_constraint(&mut self) {
        if self.constraint.as_ref().is_some_and(|c| c.is_finished()) && !self.is_done() {
            self.ended = Some(Some(FinishReason::Stop));
        }
    }

    /// More drafts after a round that kept them all, fewer after one that did not.
    fn adapt_gamma(&mut self, accepted: usize, drafted: usize) {
        if drafted == 0 {
            return;
        }
        self.gamma = match accepted == drafted {
            true => (self.gamma + 2).min(self.max_gamma),
            false => (accepted + 1).min(self.max_gamma),
        };
    }

    /// Appends `token` (sampled elsewhere, e.g. by the captured greedy step) and sends it to the
    /// sink; ends the generation on EOS, the length limit, cancellation or the sink's stop.
    pub fn deliver(&mut self, token: TokenId, logprobs: Option<ferrolm_core::TokenLogprobs>) {
        self.first_token.get_or_insert_with(Instant::now);
        self.tokens.push(token);
        self.stats.generated_tokens += 1;
        let event = TokenEvent { token, index: self.stats.generated_tokens - 1, logprobs };
        if self.sink.token(event) == Flow::Stop {
            self.ended = Some(None);
        } else if let Some(cause) = self.finish_cause(token) {
            self.ended = Some(Some(cause));
        }
    }

    /// Why generation ends after delivering `token`, if it does: EOS (or a stop id), the length
    /// limit, or cancellation, in that order (an observed cause wins over the limit).
    fn finish_cause(&self, token: TokenId) -> Option<FinishReason> {
        if self.eos_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if self.stats.generated_tokens >= self.params.max_tokens {
            Some(FinishReason::Length)
        } else if self.cancel.is_cancelled() {
            Some(FinishReason::Cancelled)
        } else {
            None
        }
    }

    /// Ends a generation cancelled from outside (checked before every step).
    pub fn check_cancelled(&mut self) {
        if !self.is_done() && (self.cancel.is_cancelled() || self.sink.is_closed()) {
            self.ended = Some(Some(FinishReason::Cancelled));
        }
    }

    /// Writes what this sequence (and the choices waiting on it) emitted to their logs now.
    pub fn checkpoint(&mut self) {
        self.sink.checkpoint();
        self.followers.iter_mut().for_each(Sequence::checkpoint);
    }

    /// Ends the generation with an error (reported to this request only).
    pub fn fail(&mut self, message: String) {
        self.failure = Some(message);
        self.ended = Some(Some(FinishReason::Error));
    }

    pub fn is_done(&self) -> bool {
        self.ended.is_some()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.stats.generated_tokens
    }

    /// Tokens left to generate.
    pub fn remaining(&self) -> usize {
        self.params.max_tokens.saturating_sub(self.stats.generated_tokens)
    }

    /// Whether every step is a plain argmax (no processors, no logprobs).
    pub fn is_plain_greedy(&self) -> bool {
        self.sampler.is_plain_greedy()
    }

    /// Drops the cache (to free memory for others): its tokens but the pending one become
    /// prompt rows again, recomputed when the sequence next runs.
    pub fn preempt(&mut self, empty: SeqCache) {
        self.cache = empty;
        self.prefill_len = self.tokens.len();
    }

    /// Sends the end to the sink: stats (also after an early stop) or the failure; returns the
    /// cache for reuse.
    pub fn retire(mut self) -> SeqCache {
        // Followers that never started end as their leader did.
        for mut follower in std::mem::take(&mut self.followers) {
            match &self.failure {
                Some(message) => follower.fail(message.clone()),
                None => follower.ended = follower.ended.or(self.ended),
            }
            follower.retire();
        }
        let outcome = match self.failure.take() {
            Some(message) => Err(message),
            None => Ok(self.final_stats()),
        };
        self.sink.finish(outcome);
        self.cache
    }

    fn final_stats(&self) -> GenerationStats {
        let mut stats = self.stats.clone();
        let end = Instant::now();
        let start = self.started.unwrap_or(end);
        let first = self.first_token.unwrap_or(end);
        stats.prefill_ms = ms(first.saturating_duration_since(start));
        stats.ttft_ms = stats.prefill_ms;
        stats.decode_ms = ms(end - first);
        let new_prompt = (stats.prompt_tokens - stats.cached_tokens) as f64;
        stats.prefill_tps = rate(new_prompt, stats.prefill_ms);
        // mlx-lm's convention: token 0 is free on the decode clock.
        stats.decode_tps = rate(stats.generated_tokens as f64, stats.decode_ms);
        stats.cache_tokens = self.tokens[..self.cache.offset().min(self.tokens.len())].to_vec();
        (stats.drafted_tokens, stats.accepted_tokens) = (self.spec.drafted, self.spec.accepted);
        stats.fill = self.fill.as_ref().map(|f| f.stats).unwrap_or_default();
        stats.finish_reason = self.ended.flatten();
        stats
    }
}

/// A cache that already holds the whole prompt must recompute the last token's logits: drop it.
fn reuse_cached_prefix(cache: &mut SeqCache, prompt_len: usize) -> usize {
    let cached = cache.offset();
    if cached >= prompt_len && cache.is_trimmable() {
        cache.trim(cached - prompt_len + 1);
    }
    cache.offset()
}

fn rate(n: f64, ms: f64) -> f64 {
    if ms > 0.0 {
        n / (ms / 1e3)
    } else {
        0.0
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
