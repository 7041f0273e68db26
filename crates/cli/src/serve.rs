//! `ferrolm serve`: the OpenAI-compatible server, a drop-in replacement for `mlx_lm.server`.
//! Its flags carry mlx_lm.server's names and defaults, plus the ones users bring from
//! llama-server and vLLM where they mean the same (`--ctx-size`, `--threads`, `--alias`,
//! `--chat-template-file`). No flag is accepted without an effect: flags for features ferrolm
//! does not have yet (adapters, draft models, pipelining) are refused, and
//! mlx-lm's tuning knobs without a ferrolm equivalent are accepted only at their default value
//! (which scripts written for mlx_lm.server pass), refused otherwise.

use crate::{CliError, CliResult};
use ferrolm_core::SamplingParams;
use ferrolm_engine::{bundle, BatchConfig, DiskSettings, EngineConfig, EngineHandle, GraphSettings, SpecConfig};
use ferrolm_models::GenerationConfig;
use crate::banner;
use crate::progress::{model_label, LoadProgress};
use ferrolm_server::http::access::AccessConfig;
use ferrolm_server::http::HttpLimits;
use ferrolm_server::{AppState, ServerConfig, SharedState};
use ferrolm_text::ChatTemplate;
use serde_json::{Map, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file (default: the default model in ~/.cache/ferrolm/models).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The model id reported by /v1/models and in responses [default: the file name].
    #[arg(long, visible_alias = "served-model-name")]
    alias: Option<String>,
    /// Context window requests may use, in tokens (prompt and completion); at most the model's,
    /// 0 is the model's [default: the model's].
    #[arg(long, short = 'c', visible_alias = "max-model-len")]
    ctx_size: Option<usize>,
    /// CPU threads for the model's kernels [default: one per core].
    #[arg(long, short = 't', value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// 0 picks a free port (the line printed at start says which).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// An origin (e.g. http://localhost:3000) whose web pages may call the server (CORS);
    /// repeat it or separate by commas; `*` allows all [default: none: cross-origin requests
    /// are refused].
    #[arg(long = "cors-origin", visible_alias = "allowed-origins", value_delimiter = ',')]
    cors_origin: Vec<String>,
    /// An API key clients must send, as `Authorization: Bearer KEY` or `x-api-key: KEY` (every
    /// route but /health); repeat for several. Also from FERROLM_API_KEY (comma-separated),
    /// which keeps keys out of the process list [default: none: no key needed].
    #[arg(long = "api-key", env = "FERROLM_API_KEY", value_delimiter = ',', hide_env_values = true)]
    api_key: Vec<String>,
    /// A Host name to accept besides loopback names and the bound address (when bound to
    /// loopback, other Host values are refused: the DNS-rebinding guard); repeatable.
    #[arg(long = "allowed-host", value_delimiter = ',')]
    allowed_host: Vec<String>,
    /// The largest request body read: bytes, or with M/MB/G/GB; larger bodies get 413.
    #[arg(long, value_parser = parse_size, default_value_t = 16 << 20)]
    max_body_bytes: usize,
    /// Seconds a request head may take to arrive (also how long an idle connection stays open).
    #[arg(long, default_value_t = 10.0, value_parser = seconds)]
    header_timeout: f64,
    /// Seconds a request body may take to arrive after its head.
    #[arg(long, default_value_t = 60.0, value_parser = seconds)]
    read_timeout: f64,
    /// Open connections at most; more are answered 503 and closed.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Log each request's prompt text in its log line (never logged otherwise).
    #[arg(long)]
    log_prompts: bool,
    /// Structured output: sample the tokens a grammar forces one at a time instead of
    /// appending them unsampled (jump-forward; the output is the same under greedy decoding).
    #[arg(long)]
    no_jump_forward: bool,
    /// Fill: sample the tool-call scaffold, tool names and punctuation up to a call's
    /// arguments one token at a time instead of appending them as spans verified in one
    /// forward (the output is the same; docs/fill.md).
    #[arg(long)]
    no_fill: bool,
    /// Fill also appends continuations copied from earlier in the conversation (prompt
    /// lookup, verified; gated per sequence), when no speculative decoding runs.
    #[arg(long, conflicts_with = "no_fill")]
    fill_copies: bool,
    /// Log lines as text or as JSON objects, one per line.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
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
    /// A file holding a chat template (Jinja) to use instead of the model's.
    #[arg(long, conflicts_with_all = ["chat_template", "use_default_chat_template"])]
    chat_template_file: Option<PathBuf>,
    /// Use a ChatML template instead of the model's.
    #[arg(long)]
    use_default_chat_template: bool,
    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 2048)]
    prefill_step_size: usize,
    /// What is logged to stderr [default: FERROLM_LOG, else warnings and errors].
    #[arg(long, value_parser = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])]
    pub log_level: Option<String>,
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
    /// mlx_lm.server's one adapter for every request: refused; mount adapters with --adapter
    /// and name them per request.
    #[arg(long)]
    adapter_path: Option<String>,
    /// Mounts the PEFT LoRA folder DIR (adapter_config.json, adapter_model.safetensors) as NAME
    /// (repeatable); a request runs with it when it names it in `"adapter"` (`"a+b"` stacks).
    #[arg(long = "adapter", value_name = "NAME=DIR")]
    adapters: Vec<String>,
    /// A draft model for speculative decoding (a GGUF file or folder sharing the model's
    /// tokenizer; checked at load): it guesses, the model verifies several guesses per forward.
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Quantize the KV cache of full-attention layers to 8 or 4 bits (affine groups along
    /// head_dim, Hadamard-rotated; CPU only; docs/kv_quant.md): the KV budget counts the
    /// quantized bytes, so more sequences fit. Quantized from the first token.
    #[arg(long)]
    kv_bits: Option<u32>,
    /// Prompt cache memory: bytes, or with M/MB/G/GB (powers of 10, as mlx_lm.server reads
    /// it); 0 turns the cache off [default: an eighth of the available memory, at most 2 GiB].
    #[arg(long, value_parser = parse_size)]
    prompt_cache_bytes: Option<usize>,
    /// How the layers hold keys and values: `contiguous` (a buffer or ring per sequence) or
    /// `paged` (blocks in per-layer pools, also for sliding-window and quantized layers; requests
    /// sharing a prompt prefix share its blocks by reference; CPU only; docs/paged_kv.md).
    #[arg(long, default_value = "contiguous", value_parser = ["contiguous", "paged"])]
    kv_layout: String,
    /// Tokens per block of `--kv-layout paged`: 16, 32 or 64.
    #[arg(long, default_value_t = ferrolm_engine::config::DEFAULT_BLOCK_TOKENS)]
    kv_block_size: usize,
    /// A directory where the prompt cache also writes its entries (in the background), so that
    /// prefixes outlive their RAM entry and restarts. Another model's files there are ignored.
    #[arg(long)]
    kv_disk: Option<PathBuf>,
    /// The disk tier's size cap: bytes, or with M/MB/G/GB [default: 10 GB].
    #[arg(long, value_parser = parse_size, default_value = "10GB")]
    kv_disk_bytes: usize,
    /// Accepted: ferrolm runs no code from model repositories, so there is nothing to trust.
    #[arg(long)]
    trust_remote_code: bool,
    /// Speculative decoding: `ngram` drafts by prompt lookup (the output is the same; only
    /// speed differs), `none` turns it off. Requests may opt out with `"speculative": false`.
    #[arg(long, default_value = "none", value_parser = ["none", "ngram"])]
    draft_kind: String,
    /// Draft tokens verified per step at most (the number adapts to what gets accepted)
    /// [default: 3 with --draft-model, as mlx_lm.server; 32 for prompt lookup alone, which drafts
    /// that many only while the output copies a long stretch of the context].
    #[arg(long)]
    num_draft_tokens: Option<usize>,
    /// Prompt lookup's n-gram lengths: the longest that matches, from --ngram-max down to
    /// --ngram-min tokens.
    #[arg(long, default_value_t = 1)]
    ngram_min: usize,
    #[arg(long, default_value_t = 3)]
    ngram_max: usize,
    /// Only mlx_lm.server's default (8): prompts share each step's --max-batch-tokens instead.
    #[arg(long)]
    prompt_concurrency: Option<usize>,
    /// Only mlx_lm.server's default (10): the prompt cache is capped by --prompt-cache-bytes.
    #[arg(long)]
    prompt_cache_size: Option<usize>,
    /// Values per KV quantization group along head_dim with --kv-bits: 32, 64 or 128 [default:
    /// 32, measured better than mlx's 64 at 6% more bytes (docs/kv_quant.md)].
    #[arg(long)]
    kv_group_size: Option<usize>,
    /// With --kv-bits or --kv-quant: keep a layer's cache float until a step leaves it holding
    /// more than N tokens, then quantize all of it (mlx_lm's meaning) [default: 0, quantized
    /// from the first token; mlx_lm's default is 5000].
    #[arg(long)]
    quantized_kv_start: Option<usize>,
    /// TurboQuant KV (mlx-bun's scheme, docs/kv_quant.md): `turbo` (keys 8-bit, values 3-bit
    /// Lloyd–Max codes after a sign flip and Walsh–Hadamard rotation) or `turbo:k<bits>v<bits>`.
    /// CPU only; not with --kv-bits. Saves memory, not decode time (rows are decoded per step).
    #[arg(long)]
    kv_quant: Option<String>,
    /// Not supported yet (refused): pipeline parallelism over several machines.
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
    /// Durable generations: each running generation appends its tokens to a log in DIR, so
    /// that after a crash or restart the client's retry (same body, or same Idempotency-Key)
    /// continues it, byte-identical (docs/durable.md).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Tokens between two records of a generation's log.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    checkpoint_every: u32,
    /// Seconds a log that was not completed (cancelled, crashed) is kept for a retry.
    #[arg(long, default_value_t = 3600.0, value_parser = seconds)]
    checkpoint_ttl: f64,
    /// Sync logs to stable storage (group commit on the log's own thread); `false` survives a
    /// killed process but not a power loss.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    checkpoint_fsync: bool,
}

impl Args {
    /// The engine's settings: flags, then the environment's levers (read once, here).
    fn engine_config(&self, model_path: &std::path::Path) -> CliResult<EngineConfig> {
        let mut batch = BatchConfig { max_batch_tokens: self.max_batch_tokens.max(1), max_seqs: self.max_seqs.max(1), ..Default::default() };
        if let Some(mb) = self.kv_budget_mb {
            batch.kv_budget_bytes = mb << 20;
        }
        if let Some(bytes) = self.prompt_cache_bytes {
            batch.prompt_cache_bytes = bytes;
        }
        let kv_disk = match &self.kv_disk {
            Some(dir) => Some(DiskSettings {
                dir: dir.clone(),
                max_bytes: self.kv_disk_bytes as u64,
                identity: ferrolm_engine::identity::model_identity(model_path)
                    .map_err(|e| CliError::usage(format!("{}: {e}", model_path.display())))?,
            }),
            None => None,
        };
        let spec = (self.draft_kind == "ngram" || self.draft_model.is_some()).then(|| SpecConfig {
            max_drafts: self.num_draft_tokens.unwrap_or(if self.draft_model.is_some() { 3 } else { LOOKUP_DRAFTS }),
            ngram_min: self.ngram_min.max(1),
            ngram_max: self.ngram_max.max(self.ngram_min.max(1)),
        });
        let kv_layout = ferrolm_engine::config::KvLayout::from_flags(&self.kv_layout, self.kv_block_size).map_err(CliError::usage)?;
        Ok(EngineConfig { queue_capacity: self.queue_size.max(1), batch, graph: GraphSettings::from_env(), kv_disk, kv_layout, spec, draft: None })
    }
}

/// Prompt lookup's γ by default: its drafts are sized by the match (`NgramProposer::sized`), so
/// the cap binds only while copying, where 32 rows a step verified the 1.5B's code edit in 49
/// forwards against 169 with 8 (bench/results/speculation.md).
const LOOKUP_DRAFTS: usize = 32;

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A positive number of seconds.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}

fn json_object(s: &str) -> Result<Map<String, Value>, String> {
    match serde_json::from_str(s) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("expected a JSON object".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A size as mlx_lm.server's `_parse_size` reads it: digits (a decimal point allowed), then
/// nothing (bytes), M / MB (10^6) or G / GB (10^9), in any case.
fn parse_size(s: &str) -> Result<usize, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (digits, unit) = (&s[..split], s[split..].trim().to_ascii_uppercase());
    let scale = match unit.as_str() {
        "" => 1.0,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        _ => return Err(format!("unknown unit {unit:?} (bytes, M, MB, G or GB)")),
    };
    let n: f64 = digits.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512MB, 2GB)"))?;
    Ok((n * scale).round() as usize)
}

impl Args {
    /// Flags of features ferrolm does not have, and mlx-lm knobs away from their defaults.
    fn refuse_unsupported(&self) -> CliResult<()> {
        let changed = |v: Option<usize>, default: usize| v.is_some_and(|v| v != default);
        let refused = [
            ("--adapter-path", self.adapter_path.is_some(), "one adapter for every request; mount adapters with --adapter NAME=DIR and name them per request"),
            ("--prompt-concurrency", changed(self.prompt_concurrency, 8), "a cap on prompts prefilled together; prompts share each step's --max-batch-tokens"),
            ("--prompt-cache-size", changed(self.prompt_cache_size, 10), "a cap on prompt cache entries; use --prompt-cache-bytes"),
            ("--pipeline", self.pipeline, "pipeline parallelism"),
        ];
        match refused.iter().find(|(_, set, _)| *set) {
            Some((flag, _, what)) => Err(CliError::usage(format!("{flag} is not supported by ferrolm serve yet ({what})"))),
            None => Ok(()),
        }
    }

    /// `--threads`: the CPU kernels' pool reads FERROLM_THREADS once, when the model's first
    /// kernel runs, and candle's own CPU ops read RAYON_NUM_THREADS; both are set before the
    /// model loads (this runs first, while the process has one thread).
    fn apply_threads(&self) {
        if let Some(n) = self.threads {
            std::env::set_var("FERROLM_THREADS", n.to_string());
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
    }

    /// `--ctx-size`: 0 or absent is the model's own; more than the model's is an error.
    fn context_length(&self, model: usize) -> CliResult<Option<usize>> {
        match self.ctx_size {
            None | Some(0) => Ok(None),
            Some(c) if c > model => Err(CliError::usage(format!(
                "--ctx-size {c} is larger than the model's context of {model} tokens"
            ))),
            Some(c) => Ok(Some(c)),
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

    /// `--chat-template`, `--chat-template-file` or `--use-default-chat-template` override the
    /// model's template.
    fn template_override(&self) -> CliResult<Option<String>> {
        if let Some(path) = &self.chat_template_file {
            let read = std::fs::read_to_string(path);
            return read.map(Some).map_err(|e| CliError::usage(format!("--chat-template-file {}: {e}", path.display())));
        }
        Ok(if !self.chat_template.is_empty() {
            Some(self.chat_template.clone())
        } else if self.use_default_chat_template {
            Some(CHATML.to_string())
        } else {
            None
        })
    }
}

pub fn run(args: Args) -> CliResult<()> {
    let start = Instant::now();
    args.refuse_unsupported()?;
    args.apply_threads();
    let template_override = args.template_override()?;
    let mut bundle = load(&args)?;
    mount_adapters(&args.adapters, &bundle)?;
    let sampling = args.sampling(&bundle.generation)?;
    let context_length = args.context_length(bundle.model.info().context_length)?;
    if let Some(src) = &template_override {
        let t = &bundle.tokenizer;
        let template = ChatTemplate::new(src, t.bos_token(), t.eos_token())
            .map_err(|e| CliError::usage(format!("--chat-template: {e}")))?;
        bundle.template = Some(template);
    }
    let template_source = template_override.or_else(|| bundle.tokenizer.chat_template().map(str::to_string));
    let (http, access) = args.http_settings();
    let config = ServerConfig {
        sampling,
        max_tokens: args.max_tokens,
        chat_template_args: args.chat_template_args.clone(),
        prefill_chunk: args.prefill_step_size.max(1),
        model_id: args.alias.clone().unwrap_or_else(|| bundle.name.clone()),
        fault_injection: std::env::var("FERROLM_TEST_FAULTS").as_deref() == Ok("1"),
        responses_store_size: args.responses_store_size,
        context_length,
        http,
        access,
        log_prompts: args.log_prompts,
        jump_forward: !args.no_jump_forward,
        fill: !args.no_fill,
        fill_copies: args.fill_copies,
        ..Default::default()
    };
    let mut engine_config = args.engine_config(&bundle.path)?;
    engine_config.draft = load_draft(&args, &bundle)?;
    let engine = EngineHandle::spawn(Arc::new(bundle), engine_config);
    let mut app = AppState::new(engine, config, template_source.as_deref());
    app.durable = args.durability(&app.bundle().path)?;
    let state = Arc::new(app);
    listen(&args, state, start)
}

/// `--adapter NAME=DIR`, each mounted on the model (checked against it).
pub(crate) fn mount_adapters(specs: &[String], bundle: &bundle::Bundle) -> CliResult<()> {
    for spec in specs {
        let Some((name, dir)) = spec.split_once('=') else {
            return Err(CliError::usage(format!("--adapter {spec}: expected NAME=DIR")));
        };
        let adapter = ferrolm_models::lora::mount(bundle.model.as_ref(), name, std::path::Path::new(dir))
            .map_err(|e| CliError::usage(format!("--adapter {spec}: {e}")))?;
        bundle.adapters.insert(adapter).map_err(|e| CliError::usage(format!("--adapter {spec}: {e}")))?;
    }
    Ok(())
}

impl Args {
    /// The checkpoint store of `--checkpoint-dir`, or none.
    fn durability(&self, model_path: &std::path::Path) -> CliResult<ferrolm_server::durable::Durability> {
        let Some(dir) = &self.checkpoint_dir else { return Ok(Default::default()) };
        let model = ferrolm_engine::identity::model_identity(model_path)
            .map_err(|e| CliError::usage(format!("{}: {e}", model_path.display())))?;
        let settings = ferrolm_engine::durable::CheckpointSettings {
            dir: dir.clone(),
            every: self.checkpoint_every as usize,
            ttl: Duration::from_secs_f64(self.checkpoint_ttl),
            fsync: self.checkpoint_fsync,
            model,
        };
        ferrolm_server::durable::Durability::open(settings)
            .map_err(|e| CliError::usage(format!("--checkpoint-dir {}: {e}", dir.display())))
    }
}

/// The draft model (`--draft-model`), on the model's device, if it shares its tokenizer.
fn load_draft(args: &Args, target: &bundle::Bundle) -> CliResult<Option<Arc<bundle::Bundle>>> {
    let Some(path) = &args.draft_model else { return Ok(None) };
    let progress = LoadProgress::new(model_label(Some(path)), 1, false);
    let loaded = bundle::load_with_progress(Some(path), &args.device, 1, progress.callback());
    progress.finish(loaded.is_ok());
    let draft = loaded.map_err(CliError::usage)?;
    ferrolm_engine::draft::check_compatible(target, &draft).map_err(CliError::usage)?;
    Ok(Some(Arc::new(draft)))
}

impl Args {
    /// The HTTP layer's limits and the access settings (keys, origins, hosts, bound address).
    fn http_settings(&self) -> (HttpLimits, AccessConfig) {
        let http = HttpLimits {
            max_body_bytes: self.max_body_bytes,
            header_timeout: Duration::from_secs_f64(self.header_timeout),
            read_timeout: Duration::from_secs_f64(self.read_timeout),
            max_connections: self.max_connections as usize,
            ..Default::default()
        };
        let mut access = AccessConfig {
            cors_origins: self.cors_origin.iter().map(|o| o.trim().to_string()).filter(|o| !o.is_empty()).collect(),
            allowed_hosts: self.allowed_host.iter().map(|h| h.trim().to_string()).filter(|h| !h.is_empty()).collect(),
            bind: bind_ip(&self.host),
            ..Default::default()
        };
        access.set_api_keys(self.api_key.iter().map(|k| k.trim()));
        (http, access)
    }
}

/// The address `--host` names (the first it resolves to).
fn bind_ip(host: &str) -> Option<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    (host, 0).to_socket_addrs().ok()?.next().map(|a| a.ip())
}

/// The model, with a progress bar on a terminal (plain lines on stderr otherwise).
fn load(args: &Args) -> CliResult<bundle::Bundle> {
    let ranks = args.tensor_parallel as usize;
    let progress = LoadProgress::new(model_label(args.model.as_deref()), ranks, false);
    let loaded = bundle::load_with_progress(args.model.as_deref(), &args.device, ranks, progress.callback());
    progress.finish(loaded.is_ok());
    let mut bundle = loaded.map_err(CliError::usage)?;
    bundle.model.set_kv_scheme(args.kv_scheme()?).map_err(CliError::usage)?;
    bundle.model.set_batch_graphs(ferrolm_models::batch_graph::BatchGraphSettings::from_env());
    if args.kv_layout == "paged" && (!bundle.model.device().is_cpu() || ranks > 1) {
        return Err(CliError::usage("--kv-layout paged runs on the CPU, without --tensor-parallel, for now"));
    }
    Ok(bundle)
}

impl Args {
    /// `--kv-bits` / `--kv-group-size` or `--kv-quant`, from `--quantized-kv-start` on (none,
    /// 16: the float cache).
    fn kv_scheme(&self) -> CliResult<ferrolm_kv::KvScheme> {
        let bits = self.kv_bits.map(|b| u8::try_from(b).map_err(|_| CliError::usage(format!("--kv-bits {b}: expected 8 or 4")))).transpose()?;
        let start = self.quantized_kv_start.unwrap_or(0);
        if let Some(spec) = &self.kv_quant {
            if bits.is_some_and(|b| b != 16) {
                return Err(CliError::usage("--kv-quant takes its own bits: it is not combined with --kv-bits"));
            }
            let scheme = ferrolm_kv::KvScheme::from_kv_quant(spec).map_err(|e| CliError::usage(format!("--kv-quant: {e}")))?;
            return Ok(scheme.starting_at(start));
        }
        let group = self.kv_group_size.unwrap_or(crate::kv_args::DEFAULT_GROUP);
        let scheme = ferrolm_kv::KvScheme::from_flags(bits, group).map_err(|e| CliError::usage(format!("--kv-bits/--kv-group-size: {e}")))?;
        Ok(scheme.starting_at(start))
    }
}

/// Serves `state` until Ctrl-C / SIGTERM; prints the ready line, then what is served and how to
/// call it.
fn listen(args: &Args, state: SharedState, start: Instant) -> CliResult<()> {
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
        let listener = ferrolm_server::bind(&args.host, args.port)
            .await
            .map_err(|e| CliError::usage(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
        let addr = listener.local_addr().map_err(CliError::runtime)?;
        if !addr.ip().is_loopback() && state.config.access.api_keys.is_empty() {
            tracing::warn!(
                "listening on {addr} without an API key: anyone who can reach this address can use the model \
                 (set --api-key or FERROLM_API_KEY)"
            );
        }
        let bundle = state.bundle();
        println!("ferrolm serve: {} at http://{addr} (ready in {:.2} s)", bundle.path.display(), start.elapsed().as_secs_f64());
        let model = &bundle.model;
        let device = device_name(model.device());
        let served = banner::Served {
            model_id: &state.config.model_id,
            architecture: &model.info().architecture,
            context: state.context_length(),
            device: &device,
            generates: model.can_generate(),
        };
        println!("{}", banner::lines(addr, &served));
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let engine = state.engine.clone();
        let served = ferrolm_server::serve(state.clone(), listener, shutdown(state)).await.map_err(CliError::runtime);
        // Finished prefixes reach the disk tier before the process ends.
        engine.flush_prompt_cache(std::time::Duration::from_secs(SHUTDOWN_GRACE_SECS));
        served
    })
}

/// `cpu (N threads)` or `cuda:N`.
fn device_name(device: &candle_core::Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => format!("cpu, {} threads", ferrolm_backend::cpu::threads::num_threads()),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

/// Seconds in-flight requests get to finish after Ctrl-C / SIGTERM before the process exits.
const SHUTDOWN_GRACE_SECS: u64 = 5;

/// Resolves on Ctrl-C or SIGTERM (new connections stop; open ones may finish), and arms a
/// timer that ends the process if they do not finish in time. With `--checkpoint-dir`, running
/// generations are checkpointed instead (new ones get 503) and the process exits at once:
/// their clients' retries resume them after the restart.
async fn shutdown(state: ferrolm_server::SharedState) {
    shutdown_signal().await;
    eprintln!("ferrolm serve: shutting down");
    if state.durable.store().is_some() {
        ferrolm_server::durable::drain(&state, std::time::Duration::from_secs(SHUTDOWN_GRACE_SECS)).await;
        std::process::exit(0);
    }
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

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_read_as_mlx_lm_reads_them() {
        assert_eq!(parse_size("1234"), Ok(1234));
        assert_eq!(parse_size("512MB"), Ok(512_000_000));
        assert_eq!(parse_size("1.5g"), Ok(1_500_000_000));
        assert_eq!(parse_size("2 GB"), Ok(2_000_000_000));
        assert!(parse_size("2TB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("MB").is_err());
    }
}
