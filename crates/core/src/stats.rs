use crate::TokenId;
use serde::{Deserialize, Serialize};

/// Why a generation ended. An observed cause (EOS, stop string, tool call) wins over `Length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    Cancelled,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error => "error",
        }
    }
}

/// The sampled token's log-probability and the top alternatives, from the distribution after the
/// logits processors and before the filters, sorted by descending log-probability.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub token: TokenId,
    pub logprob: f32,
    pub top: Vec<(TokenId, f32)>,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub token: TokenId,
    /// 0 for the first generated token.
    pub index: usize,
    pub logprobs: Option<TokenLogprobs>,
}

/// Stats of one generation; present also when the consumer stopped early.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub prefill_tps: f64,
    pub decode_tps: f64,
    /// Time from the start of the generation to the first token.
    pub ttft_ms: f64,
    /// Exactly the tokens whose KV is in the caches: prompt ++ forwarded.
    pub cache_tokens: Vec<TokenId>,
    /// Speculative decoding: draft tokens verified, and how many of them were kept.
    pub drafted_tokens: usize,
    pub accepted_tokens: usize,
    /// Fill (docs/fill.md): spans appended, tokens kept and rows taken back, by policy.
    pub fill: FillStats,
    pub finish_reason: Option<FinishReason>,
}

/// Fill's counters for one generation (`usage.fill`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillStats {
    /// Spans the request determines (tool-call scaffold, tool names).
    pub assert: SpanCounts,
    /// Spans copied from earlier in the conversation.
    pub verify: SpanCounts,
}

impl FillStats {
    pub fn is_empty(&self) -> bool {
        self.assert.spans + self.verify.spans == 0
    }

    pub fn add(&mut self, other: &FillStats) {
        self.assert.add(&other.assert);
        self.verify.add(&other.verify);
    }
}

/// Spans appended with one forward each, the tokens of them kept (emitted without a forward of
/// their own) and those taken back out of the cache (rows computed in vain).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanCounts {
    pub spans: usize,
    pub injected: usize,
    pub wasted: usize,
}

impl SpanCounts {
    pub fn add(&mut self, other: &SpanCounts) {
        self.spans += other.spans;
        self.injected += other.injected;
        self.wasted += other.wasted;
    }
}
