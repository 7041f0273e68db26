//! `ferrolm serve`: the OpenAI-compatible server, a drop-in replacement for `mlx_lm.server`.
//! Its flags carry mlx_lm.server's names and defaults; flags for features ferrolm does not have
//! yet (adapters, draft models, KV quantization) are refused rather than ignored, and flags
//! that only tune mlx-lm's batching or prompt cache are accepted and have no effect yet.

use crate::{CliError, CliResult};
use ferrolm_core::SamplingParams;
use ferrolm_engine::{bundle, BatchConfig, EngineConfig, EngineHandle, GraphSettings};
use ferrolm_models::GenerationConfig;
use ferrolm_server::{AppState, ServerConfig};
use ferrolm_text::ChatTemplate;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file (default: the default model in ~/.cache/ferrolm/models).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the line printed at start says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Comma-separated CORS origins; `*` allows all.
    #[arg(long, default_value = "*", value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// Default sampling temperature [default: generation_config.json's, else 0.0].
    #[arg(long, visible_alias = "temperature")]
    temp: Option<f32>,
    /// Default nucleus sampling top-p [default: generation_config.json's, else 1.0].
    #[arg(long)]
    top_p: Option<f32>,
    /// Default top-k, 0 disables it [default: generation_config.json's, else 0].
    #[arg(long)]
    top_k: Option<usize>,
    /// Default min-p, 0 disables it [default: generation_config.json's, else 0.0].
    #[arg(long)]
    min_p: Option<f32>,
    /// Default maximum number of tokens to generate.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// JSON object of chat template variables, e.g. '{"enable_thinking":false}'.
    #[arg(long, default_value = "{}", value_parser = json_object)]
    chat_template_args: Map<String, Value>,
    /// A chat template (Jinja source) to use instead of the model's.
    #[arg(long, default_value = "")]
    chat_template: String,
    /// Use a ChatML template instead of the model's.
    #[arg(long)]
    use_default_chat_template: bool,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 2048)]
    prefill_step_size: usize,
    #[arg(long, default_value = "INFO", value_parser = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])]
    log_level: String,
    /// Requests that may wait for the engine; more get 429.
    #[arg(long, default_value_t = 64)]
    queue_size: usize,
    /// Sequences decoded together at most (continuous batching); more wait in the queue.
    #[arg(long, visible_alias = "decode-concurrency", default_value_t = ferrolm_engine::config::DEFAULT_MAX_SEQS)]
    max_seqs: usize,
    /// Tokens forwarded per engine step at most: every running decode's row, then prompt chunks.
    #[arg(long, default_value_t = ferrolm_engine::config::DEFAULT_MAX_BATCH_TOKENS)]
    max_batch_tokens: usize,
    /// KV-cache memory the running sequences may hold, in MiB (default: half the available
    /// memory). A request that could never fit is refused; others wait, or the newest running
    /// one is preempted and recomputed later.
    #[arg(long)]
    kv_budget_mb: Option<usize>,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Not supported yet (refused).
    #[arg(long)]
    adapter_path: Option<String>,
    /// Not supported yet (refused).
    #[arg(long)]
    draft_model: Option<String>,
    /// Not supported yet (refused).
    #[arg(long)]
    kv_bits: Option<u32>,
    /// Accepted for compatibility; no effect yet (mlx_lm.server's batching and cache knobs).
    #[arg(long, default_value_t = 3)]
    num_draft_tokens: usize,
    #[arg(long)]
    trust_remote_code: bool,
    #[arg(long, default_value_t = 8)]
    prompt_concurrency: usize,
    #[arg(long, default_value_t = 10)]
    prompt_cache_size: usize,
    #[arg(long)]
    prompt_cache_bytes: Option<String>,
    #[arg(long, default_value_t = 64)]
    kv_group_size: usize,
    #[arg(long, default_value_t = 5000)]
    quantized_kv_start: usize,
    #[arg(long)]
    pipeline: bool,
    /// Responses API responses kept in memory for `previous_response_id` (least recently used
    /// dropped first; 0 keeps none).
    #[arg(long, default_value_t = 256)]
    responses_store_size: usize,
    /// Split the model over N ranks (llama family): N consecutive GPUs from --device, or N
    /// simulated ranks on the CPU with `--device cpu`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    tensor_parallel: u32,
}

impl Args {
    /// The engine's settings: flags, then the environment's levers (read once, here).
    fn engine_config(&self) -> EngineConfig {
        let mut batch = BatchConfig { max_batch_tokens: self.max_batch_tokens.max(1), max_seqs: self.max_seqs.max(1), ..Default::default() };
        if let Some(mb) = self.kv_budget_mb {
            batch.kv_budget_bytes = mb << 20;
        }
        EngineConfig { queue_capacity: self.queue_size.max(1), batch, graph: GraphSettings::from_env(), kv_disk: None }
    }
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
{{ '<|im_start|>assistant\n' }}{% endif %}";

fn json_object(s: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object".into()),
        Err(e) => Err(e.to_string()),
    }
}

impl Args {
    fn refuse_unsupported(&self) -> CliResult<()> {
        let refused = [
            ("--adapter-path", self.adapter_path.is_some()),
            ("--draft-model", self.draft_model.is_some()),
            ("--kv-bits", self.kv_bits.is_some()),
        ];
        match refused.iter().find(|(_, set)| *set) {
            Some((flag, _)) => Err(CliError::usage(format!("{flag} is not supported by ferrolm serve yet"))),
            None => Ok(()),
        }
    }

    /// Sampling defaults: a flag, else the model's `generation_config.json`, else mlx_lm.server's
    /// built-in values (greedy). A request's own fields override all of them.
    fn sampling(&self, gen: &GenerationConfig) -> CliResult<SamplingParams> {
        let config_temp = match gen.do_sample {
            Some(false) => Some(0.0),
            _ => gen.temperature,
        };
        let p = SamplingParams {
            temperature: self.temp.or(config_temp).unwrap_or(0.0),
            top_p: self.top_p.or(gen.top_p).unwrap_or(1.0),
            top_k: self.top_k.or(gen.top_k).unwrap_or(0),
            min_p: self.min_p.or(gen.min_p).unwrap_or(0.0),
            repetition_penalty: gen.repetition_penalty,
            ..Default::default()
        };
        ferrolm_sample::validate(&p).map_err(CliError::usage)?;
        Ok(p)
    }

    /// `--chat-template` / `--use-default-chat-template` override the model's template.
    fn template_override(&self) -> Option<&str> {
        if !self.chat_template.is_empty() {
            Some(&self.chat_template)
        } else if self.use_default_chat_template {
            Some(CHATML)
        } else {
            None
        }
    }
}

pub fn run(args: Args) -> CliResult<()> {
    let start = Instant::now();
    args.refuse_unsupported()?;
    let mut bundle = bundle::load_parallel(args.model.as_deref(), &args.device, args.tensor_parallel as usize)
        .map_err(CliError::usage)?;
    let sampling = args.sampling(&bundle.generation)?;
    if let Some(src) = args.template_override() {
        let t = &bundle.tokenizer;
        let template = ChatTemplate::new(src, t.bos_token(), t.eos_token())
            .map_err(|e| CliError::usage(format!("--chat-template: {e}")))?;
        bundle.template = Some(template);
    }
    let template_source =
        args.template_override().map(str::to_string).or_else(|| bundle.tokenizer.chat_template().map(str::to_string));
    let config = ServerConfig {
        sampling,
        max_tokens: args.max_tokens,
        chat_template_args: args.chat_template_args.clone(),
        allowed_origins: args.allowed_origins.clone(),
        prefill_chunk: args.prefill_step_size.max(1),
        model_id: bundle.name.clone(),
        fault_injection: std::env::var("FERROLM_TEST_FAULTS").as_deref() == Ok("1"),
        responses_store_size: args.responses_store_size,
        ..Default::default()
    };
    let model_name = bundle.path.display().to_string();
    let engine = EngineHandle::spawn(Arc::new(bundle), args.engine_config());
    let state = Arc::new(AppState::new(engine, config, template_source.as_deref()));
    // HTTP work per token is small (one SSE chunk), but on a machine with few cores every worker
    // that wakes takes a core from the compute threads: measured 4% of decode on 2 cores with two
    // workers (bench/results/server.md). One suffices there; the engine has its own thread.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(if cores <= 4 { 1 } else { 2 })
        .thread_name("ferrolm-http")
        .enable_all()
        .build()
        .map_err(CliError::runtime)?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(|e| CliError::usage(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
        let addr = listener.local_addr().map_err(CliError::runtime)?;
        println!("ferrolm serve: {model_name} at http://{addr} (ready in {:.2} s)", start.elapsed().as_secs_f64());
        use std::io::Write;
        let _ = std::io::stdout().flush();
        ferrolm_server::serve(state, listener, shutdown()).await.map_err(CliError::runtime)
    })
}

/// Seconds in-flight requests get to finish after Ctrl-C / SIGTERM before the process exits.
const SHUTDOWN_GRACE_SECS: u64 = 5;

/// Resolves on Ctrl-C or SIGTERM (new connections stop; open ones may finish), and arms a
/// timer that ends the process if they do not finish in time.
async fn shutdown() {
    shutdown_signal().await;
    eprintln!("ferrolm serve: shutting down");
    tokio::spawn(async {
        tokio::time::sleep(std::time::Duration::from_secs(SHUTDOWN_GRACE_SECS)).await;
        eprintln!("ferrolm serve: requests still running after {SHUTDOWN_GRACE_SECS} s; exiting");
        std::process::exit(0);
    });
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
