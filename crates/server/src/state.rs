//! What every handler shares: the engine handle, settings, metrics and facts about the model.

use crate::config::ServerConfig;
use crate::metrics::{Gauges, Metrics};
use crate::responses::ResponseStore;
use ferrolm_engine::{Bundle, EngineHandle};
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub struct AppState {
    pub engine: EngineHandle,
    pub config: ServerConfig,
    pub metrics: Metrics,
    /// Unix time the server started (the `created` of `/v1/models`).
    pub started: u64,
    pub fingerprint: String,
    /// The model's reasoning tags when its vocabulary has them (`<think>`, `</think>`).
    pub think_tags: Option<(String, String)>,
    /// Whether the chat template reads `tools`; otherwise tools are described in the system
    /// message (see `protocol::tools`).
    pub template_has_tools: bool,
    /// Whether tool calls are written as `<tool_call>…</tool_call>` (Hermes / Qwen): the
    /// template says so, or it ignores tools and they are described in that format. A forced
    /// call (`tool_choice: required`) is constrained to that format, else to a bare JSON call.
    pub tool_call_tags: bool,
    /// Finished Responses API responses kept for `previous_response_id` and GET.
    pub responses: ResponseStore,
    /// One `/v1/embeddings` computation at a time: each forward already takes every core.
    pub embed_gate: Arc<tokio::sync::Semaphore>,
    /// Checkpoint logs of running generations (`--checkpoint-dir`) and the shutdown state.
    pub durable: crate::durable::Durability,
    /// Unknown request fields already warned about (one warning per name).
    pub warned_fields: crate::protocol::fields::WarnedFields,
    /// Structured output's compiler for this model, built on first use (a token trie over the
    /// vocabulary: 0.1–1 s), or why the model cannot have it.
    grammars: std::sync::OnceLock<Result<ferrolm_grammar::Grammars, String>>,
}

pub type SharedState = Arc<AppState>;

impl AppState {
    /// `template_source`: the chat template in use (the model's own or `--chat-template`).
    pub fn new(engine: EngineHandle, config: ServerConfig, template_source: Option<&str>) -> Self {
        let bundle = engine.bundle().clone();
        let think_tags = think_tags(&bundle);
        let template_has_tools = template_source.is_some_and(|t| t.contains("tools"));
        let tool_call_tags = !template_has_tools || template_source.is_some_and(|t| t.contains("<tool_call>"));
        let responses = ResponseStore::new(config.responses_store_size);
        AppState {
            engine,
            config,
            metrics: Metrics::default(),
            started: unix_now(),
            fingerprint: format!("ferrolm-{}", env!("CARGO_PKG_VERSION")),
            think_tags,
            template_has_tools,
            tool_call_tags,
            responses,
            embed_gate: Arc::new(tokio::sync::Semaphore::new(1)),
            durable: Default::default(),
            warned_fields: Default::default(),
            grammars: Default::default(),
        }
    }

    /// The constraint compiler (blocking the first time: call it off the HTTP workers).
    pub fn grammars(&self) -> Result<&ferrolm_grammar::Grammars, String> {
        let build = || {
            let bundle = self.bundle();
            let width = bundle.model.info().vocab_size;
            ferrolm_grammar::Grammars::new(bundle.tokenizer.clone(), &bundle.eos_ids, width).map_err(|e| e.to_string())
        };
        self.grammars.get_or_init(build).as_ref().map_err(Clone::clone)
    }

    pub fn bundle(&self) -> &Arc<Bundle> {
        self.engine.bundle()
    }

    /// The context window requests may use: `--ctx-size`, never more than the model's.
    pub fn context_length(&self) -> usize {
        let model = self.bundle().model.info().context_length;
        self.config.context_length.map_or(model, |c| c.min(model))
    }

    pub fn gauges(&self) -> Gauges {
        let g = self.engine.gauges();
        Gauges {
            queued: g.queued.load(Ordering::Relaxed),
            running: g.running.load(Ordering::Relaxed),
            waiting: g.waiting.load(Ordering::Relaxed),
            steps: g.steps.load(Ordering::Relaxed),
            preemptions: g.preemptions.load(Ordering::Relaxed),
            batch_size: g.batch_size.snapshot(),
            step_tokens: g.step_tokens.snapshot(),
            prompt_cache: [
                g.prompt_cache_hits.load(Ordering::Relaxed),
                g.prompt_cache_misses.load(Ordering::Relaxed),
                g.prompt_cache_hit_tokens.load(Ordering::Relaxed),
                g.prompt_cache_disk_hits.load(Ordering::Relaxed),
                g.prompt_cache_entries.load(Ordering::Relaxed) as u64,
                g.prompt_cache_bytes.load(Ordering::Relaxed) as u64,
                g.prompt_cache_disk_entries.load(Ordering::Relaxed) as u64,
                g.prompt_cache_disk_bytes.load(Ordering::Relaxed),
            ],
        }
    }
}

/// `<think>`/`</think>` when both are single tokens of the vocabulary (mlx-lm's rule).
fn think_tags(bundle: &Bundle) -> Option<(String, String)> {
    let t = &bundle.tokenizer;
    let (start, end) = ("<think>", "</think>");
    (t.token_to_id(start).is_some() && t.token_to_id(end).is_some()).then(|| (start.to_string(), end.to_string()))
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
