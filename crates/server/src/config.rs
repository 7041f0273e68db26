//! Server settings, resolved once at start from the `serve` flags. Request fields override the
//! sampling defaults here (request > server flag > built-in).

use crate::http::access::AccessConfig;
use crate::http::HttpLimits;
use ferrolm_core::SamplingParams;
use serde_json::{Map, Value};

#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// `--temp`, `--top-p`, `--top-k`, `--min-p` (mlx_lm.server's defaults: 0, 1, 0, 0).
    pub sampling: SamplingParams,
    /// `--max-tokens`: the default cap when a request names none (mlx: 512).
    pub max_tokens: usize,
    /// `--chat-template-args`: extra template variables; a request's `chat_template_kwargs`
    /// override them key by key.
    pub chat_template_args: Map<String, Value>,
    /// `--prefill-step-size`.
    pub prefill_chunk: usize,
    /// The id the model is served under (echoed in `model`, listed by `/v1/models`).
    pub model_id: String,
    /// Seconds between SSE keep-alive comments while a stream waits for its first token.
    pub keepalive_secs: f64,
    /// Test-only (`FERROLM_TEST_FAULTS=1` at start): a request field `x_ferrolm_fault`
    /// (`"panic"`: the handler panics; `"engine"`: the engine gets an empty prompt and fails)
    /// exercises the failure paths of the real server.
    pub fault_injection: bool,
    /// `--responses-store-size`: how many Responses API responses are kept in memory for
    /// `previous_response_id` (least recently used dropped first; 0 keeps none).
    pub responses_store_size: usize,
    /// `--ctx-size`: the context window requests may use (prompt + completion), at most the
    /// model's; None: the model's.
    pub context_length: Option<usize>,
    /// Body, header and connection limits and timeouts of the HTTP layer.
    pub http: HttpLimits,
    /// API keys, CORS origins, the Host check.
    pub access: AccessConfig,
    /// `--log-prompts`: the prompt's text in each request's log line.
    pub log_prompts: bool,
    /// Structured output appends the tokens a grammar forces without sampling them
    /// (`--no-jump-forward` turns that off; a request's `jump_forward` overrides).
    pub jump_forward: bool,
    /// Fill (docs/fill.md): the tool-call scaffold, tool names and punctuation a request
    /// determines appended as spans and verified (`--no-fill` turns that off; a request's
    /// `fill` overrides).
    pub fill: bool,
    /// Fill's verify spans (`--fill-copies`): continuations copied from earlier in the
    /// conversation, when speculative decoding is not running.
    pub fill_copies: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            sampling: SamplingParams::default(),
            max_tokens: 512,
            chat_template_args: Map::new(),
            prefill_chunk: 2048,
            model_id: "default_model".into(),
            keepalive_secs: 2.0,
            fault_injection: false,
            responses_store_size: 256,
            context_length: None,
            http: HttpLimits::default(),
            access: AccessConfig::default(),
            log_prompts: false,
            jump_forward: true,
            fill: true,
            fill_copies: false,
        }
    }
}
