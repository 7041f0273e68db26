//! A request's generation seen from the server: submitted to the engine's bounded FIFO (full →
//! 429), its token events run through the text pipeline, logprob entries collected, metrics
//! recorded. Dropping a [`Generation`] (the client went away, the response was dropped) cancels
//! it: the engine stops at its next prefill chunk or decode step and frees the request's caches.

use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use crate::pipeline::{Delta, PipelineConfig, TextPipeline};
use crate::protocol::logprobs;
use crate::protocol::request::LogprobsMode;
use crate::protocol::response::Usage;
use crate::state::SharedState;
use ferrolm_core::{CancelToken, FinishReason, GenerateParams, TokenEvent, TokenId};
use ferrolm_engine::{Event, Request, SubmitError};
use serde_json::Value;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

pub struct GenerationSpec {
    pub prompt: Vec<TokenId>,
    pub params: GenerateParams,
    pub pipeline: PipelineConfig,
    pub logprobs: LogprobsMode,
    pub constraint: Option<Box<dyn ferrolm_engine::TokenConstraint>>,
}

/// How a generation ended.
#[derive(Debug, Clone)]
pub enum End {
    /// `stop`: the stop string that ended it, if one did (Anthropic reports it).
    Finished {
        reason: &'static str,
        usage: Usage,
        stop: Option<String>,
    },
    Failed(String),
}

/// Output decided since the previous piece; `end` is set on the last one.
#[derive(Debug, Default)]
pub struct Piece {
    pub delta: Delta,
    pub logprobs: Vec<Value>,
    pub end: Option<End>,
}

pub struct Generation {
    state: SharedState,
    events: UnboundedReceiver<Event>,
    cancel: CancelToken,
    pipeline: TextPipeline,
    logprobs: LogprobsMode,
    /// The request's log record: first token, usage and finish reason go there.
    log: RequestLog,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    completion_tokens: usize,
    saw_tool_calls: bool,
    /// The stop string that matched; the generation is over once set.
    stop_hit: Option<String>,
    pending: Piece,
    ended: bool,
    /// A durable generation's log, removed once the answer is complete.
    durable: Option<crate::durable::Done>,
}

impl Generation {
    /// Queues generations of one prompt (OpenAI's `n` choices, each with its own sampling
    /// parameters): the engine computes the prompt once and copies its cache for the others.
    /// TTFT counts from when the HTTP request came in (`log.arrived()`).
    pub fn start_group(state: &SharedState, mut specs: Vec<GenerationSpec>, log: &RequestLog) -> ApiResult<Vec<Self>> {
        let prompt_tokens = specs.first().map_or(0, |s| s.prompt.len());
        // A durable request takes its seed (and the tokens to resume from) from its log.
        let planned = crate::durable::prepare(state, &mut specs, log)?;
        if let Some(first) = specs.first() {
            log.prompt(|| state.bundle().tokenizer.decode(&first.prompt, false));
        }
        let mut requests = Vec::with_capacity(specs.len());
        let mut rest = Vec::with_capacity(specs.len());
        for spec in specs {
            let cancel = CancelToken::new();
            requests.push(Request { prompt: spec.prompt, params: spec.params, cancel: cancel.clone(), constraint: spec.constraint });
            rest.push((cancel, spec.pipeline, spec.logprobs));
        }
        let (receivers, mut done) = crate::durable::submit(state, requests, planned).map_err(|e| match e {
            SubmitError::QueueFull => ApiError::queue_full(),
            SubmitError::Stopped => ApiError::unavailable(e.to_string()),
            SubmitError::TooLarge { .. } => ApiError::invalid(e.to_string(), Some("max_tokens")),
        })?;
        // The prompt is computed once however many choices share it.
        state.metrics.prompt_tokens(prompt_tokens);
        log.prompt_tokens(prompt_tokens);
        let arrived = log.arrived();
        let gens = receivers.into_iter().zip(rest).map(|(events, (cancel, pipeline, logprobs))| Generation {
            state: state.clone(),
            events,
            cancel,
            pipeline: TextPipeline::new(pipeline),
            logprobs,
            log: log.clone(),
            arrived,
            last_token: None,
            prompt_tokens,
            completion_tokens: 0,
            saw_tool_calls: false,
            stop_hit: None,
            pending: Piece::default(),
            ended: false,
            durable: done.take(),
        });
        Ok(gens.collect())
    }

    /// Whether the piece with the end was returned (`next` sets and returns it in one call).
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The next piece with text, tool calls or an end; None after the end. Cancel-safe: state
    /// lives in `self`, so a dropped call loses nothing.
    pub async fn next(&mut self) -> Option<Piece> {
        if self.ended {
            return None;
        }
        loop {
            let event = self.events.recv().await;
            self.on_event(event);
            let p = &self.pending;
            if p.end.is_some() || !p.delta.is_empty() {
                return Some(std::mem::take(&mut self.pending));
            }
        }
    }

    /// Runs to the end, concatenating every piece (non-streaming responses).
    pub async fn collect(&mut self) -> Piece {
        let mut all = Piece::default();
        while let Some(p) = self.next().await {
            all.delta.content.push_str(&p.delta.content);
            all.delta.reasoning.push_str(&p.delta.reasoning);
            all.delta.tool_calls.extend(p.delta.tool_calls);
            all.logprobs.extend(p.logprobs);
            all.end = p.end;
        }
        all
    }

    fn on_event(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token(t)) => self.on_token(t),
            Some(Event::Done(stats)) => {
                let reason = self.finish_reason(stats.finish_reason);
                let usage = Usage {
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: self.completion_tokens,
                    cached_tokens: stats.cached_tokens,
                    drafted: stats.drafted_tokens,
                    accepted: stats.accepted_tokens,
                    fill: stats.fill,
                };
                self.state.metrics.speculation(stats.drafted_tokens, stats.accepted_tokens);
                self.state.metrics.fill(&stats.fill);
                self.end(End::Finished { reason, usage, stop: self.stop_hit.clone() });
            }
            Some(Event::Error(message)) => self.end(End::Failed(message)),
            None => self.end(End::Failed("the engine stopped unexpectedly".into())),
        }
    }

    fn on_token(&mut self, t: TokenEvent) {
        let now = Instant::now();
        let metrics = &self.state.metrics;
        metrics.generated_token();
        match self.last_token {
            None => {
                metrics.ttft((now - self.arrived).as_secs_f64());
                self.log.first_token();
            }
            Some(prev) => metrics.inter_token((now - prev).as_secs_f64()),
        }
        self.last_token = Some(now);
        // After a stop string the engine may still deliver the token it was computing.
        if self.stop_hit.is_some() {
            return;
        }
        self.completion_tokens += 1;
        let bundle = self.state.bundle();
        let entry = logprobs::entry(&bundle.tokenizer, self.logprobs, t.logprobs.as_ref());
        self.pending.logprobs.extend(entry);
        // The EOS token ends the text; it is not decoded (mlx-lm does the same).
        if bundle.eos_ids.contains(&t.token) {
            return;
        }
        let (delta, hit) = self.pipeline.push(&bundle.tokenizer, t.token);
        self.add(delta);
        if hit.is_some() {
            self.stop_hit = hit;
            self.cancel.cancel();
        }
    }

    fn add(&mut self, delta: Delta) {
        self.saw_tool_calls |= !delta.tool_calls.is_empty();
        let p = &mut self.pending.delta;
        p.content.push_str(&delta.content);
        p.reasoning.push_str(&delta.reasoning);
        p.tool_calls.extend(delta.tool_calls);
    }

    fn end(&mut self, end: End) {
        let tail = self.pipeline.finish();
        self.add(tail);
        self.ended = true;
        // Answered whole (or failed for good): a retry starts over, so the log goes. A client
        // that left (drop without an end) keeps it for its retry.
        if let Some(d) = self.durable.take() {
            d.complete();
        }
        self.state.metrics.duration(self.arrived.elapsed().as_secs_f64());
        let end = match end {
            End::Finished { reason, usage, stop } if self.saw_tool_calls && reason == "stop" => {
                End::Finished { reason: "tool_calls", usage, stop }
            }
            e => e,
        };
        let reason = match &end {
            End::Finished { reason, .. } => reason,
            End::Failed(_) => "error",
        };
        self.log.finished(self.completion_tokens, reason);
        self.pending.end = Some(end);
    }

    /// A stop string or the engine's observed cause; tool calls turn `stop` into `tool_calls`.
    fn finish_reason(&self, engine: Option<FinishReason>) -> &'static str {
        if self.stop_hit.is_some() {
            return "stop";
        }
        match engine {
            Some(FinishReason::Length) => "length",
            _ => "stop",
        }
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if !self.ended {
            self.cancel.cancel();
            self.state.metrics.cancelled();
            self.log.finished(self.completion_tokens, "cancelled");
        }
    }
}
