use crate::TokenId;
use serde::{Deserialize, Serialize};

/// Sampling parameters with mlx-lm's meaning and defaults (mlx_lm.server: temp 0, top_p 1,
/// top_k 0 = off, min_p 0 = off, no penalties).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 disables top-k filtering.
    pub top_k: usize,
    /// 0 disables min-p filtering.
    pub min_p: f32,
    pub min_tokens_to_keep: usize,
    /// Multiplicative penalty on tokens seen in the last `repetition_context_size` tokens.
    pub repetition_penalty: Option<f32>,
    /// 0 means the whole history.
    pub repetition_context_size: usize,
    pub presence_penalty: Option<f32>,
    pub presence_context_size: usize,
    pub frequency_penalty: Option<f32>,
    pub frequency_context_size: usize,
    /// Additive bias per token id.
    pub logit_bias: Vec<(TokenId, f32)>,
    /// XTC ("exclude top choices"): probability of applying, threshold in [0, 0.5].
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// Per-request seed; None draws a fresh one.
    pub seed: Option<u64>,
    /// Number of top alternatives to report with each token; None: no logprobs at all.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            repetition_penalty: None,
            repetition_context_size: 20,
            presence_penalty: None,
            presence_context_size: 20,
            frequency_penalty: None,
            frequency_context_size: 20,
            logit_bias: Vec::new(),
            xtc_probability: 0.0,
            // mlx_lm.server's default when the request gives none (`body.get("xtc_threshold", 0.1)`).
            xtc_threshold: 0.1,
            seed: None,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// Everything the engine needs to run one generation, resolved once when the request starts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Extra stop token ids on top of the model's EOS ids.
    pub stop_token_ids: Vec<TokenId>,
    /// Prompt chunk size for prefill.
    pub prefill_chunk: usize,
    /// Fire the prompt-snapshot hook when the cache holds exactly this many tokens.
    pub snapshot_at: Option<usize>,
    /// Whether the server's speculative decoding may run for this request (`"speculative":
    /// false` opts out); the output is the same either way.
    pub speculative: bool,
    /// The LoRA adapters to run with, as the request names them (`a`, `a+b`); None (or `none`):
    /// the base model. Resolved against the mounted adapters when the sequence starts.
    pub adapter: Option<String>,
    /// Fill (token fast-forwarding, docs/fill.md): the spans this request determines, verified
    /// like drafts; None: fill off for this request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fill: Option<FillPlan>,
}

/// What fill may append to one request's output without sampling it first (every appended
/// token is still checked against the request's own draw at its position, see docs/fill.md).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillPlan {
    /// Assert spans: per offered tool, a call to it from its first token up to its arguments,
    /// sliced from the conversation rendered with that call by the model's own chat template.
    pub tool_calls: Vec<ToolCallSpan>,
    /// Verify spans: whether continuations copied from earlier in the conversation are tried
    /// too (prompt lookup; left to speculative decoding when the server runs it).
    pub copies: bool,
}

/// The tokens of one tool's call up to its arguments, and which of them hold a letter (a span
/// is appended only after output that matched such a token: bare markup such as `{"` opens too
/// much ordinary text).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallSpan {
    pub tokens: Vec<TokenId>,
    pub letters: Vec<bool>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 512,
            sampling: SamplingParams::default(),
            stop_token_ids: Vec::new(),
            prefill_chunk: 2048,
            snapshot_at: None,
            speculative: true,
            adapter: None,
            fill: None,
        }
    }
}
