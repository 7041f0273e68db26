//! `ferrolm generate`: one prompt, text streamed to stdout, stats to stderr (or one JSON object).

use crate::progress::{model_label, LoadProgress};
use crate::{CliError, CliResult};
use ferrolm_core::{
    CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent, TokenLogprobs,
};
use ferrolm_engine::{bundle, generate_with_adapters, Bundle, Flow, GenerateInput};
use ferrolm_sample::{Sampler, SamplerConfig};
use ferrolm_text::IncrementalDecoder;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A GGUF file (default: the default model in ~/.cache/ferrolm/models).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    prompt: Option<String>,
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// System message for the chat template.
    #[arg(long)]
    system: Option<String>,
    /// Skip the chat template: tokenize the prompt as is, with the model's BOS rule.
    #[arg(long)]
    raw: bool,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Report the sampled token's logprob and the top K alternatives (with --json).
    #[arg(long)]
    logprobs: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    #[command(flatten)]
    kv: crate::kv_args::KvArgs,
    /// Runs with the PEFT LoRA folder DIR (repeatable: stacked in the order given; NAME only
    /// labels it), as `serve --adapter` mounts it.
    #[arg(long = "adapter", value_name = "NAME=DIR")]
    adapters: Vec<String>,
}

impl Args {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temp,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            logprobs: self.logprobs,
            ..Default::default()
        }
    }

    fn prompt_text(&self) -> CliResult<String> {
        match (&self.prompt, &self.prompt_file) {
            (Some(p), _) => Ok(p.clone()),
            (None, Some(f)) => std::fs::read_to_string(f)
                .map_err(|e| CliError::usage(format!("{}: {e}", f.display()))),
            (None, None) => Err(CliError::usage("give --prompt or --prompt-file")),
        }
    }

    fn messages(&self, text: &str) -> serde_json::Value {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": text}));
        serde_json::Value::Array(messages)
    }
}

pub fn run(args: Args) -> CliResult<()> {
    let text = args.prompt_text()?;
    // A bar on a terminal only: generate's stderr carries its stats line for scripts.
    let progress = LoadProgress::new(model_label(args.model.as_deref()), 1, true);
    let loaded = bundle::load_with_progress(args.model.as_deref(), &args.device, 1, progress.callback());
    progress.finish(loaded.is_ok());
    let mut bundle = loaded.map_err(CliError::usage)?;
    args.kv.apply(bundle.model.as_mut())?;
    crate::serve::mount_adapters(&args.adapters, &bundle)?;
    let messages = (!args.raw).then(|| args.messages(&text));
    let prompt = bundle
        .prompt_ids(messages.as_ref(), &text)
        .map_err(CliError::usage)?;
    let cfg = SamplerConfig {
        vocab_size: bundle.model.info().vocab_size,
        xtc_special_tokens: bundle.xtc_special_tokens(),
        ..Default::default()
    };
    let mut sampler = Sampler::new(&args.sampling(), &cfg).map_err(CliError::usage)?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling: args.sampling(),
        adapter: adapter_stack(&args.adapters),
        ..Default::default()
    };
    let mut out = Output::new(&bundle, args.json);
    let input = GenerateInput {
        prompt: &prompt,
        params: &params,
        eos_ids: &bundle.eos_ids,
        cancel: &CancelToken::new(),
        graph: ferrolm_engine::GraphSettings::from_env(),
    };
    let stats = generate_with_adapters(
        bundle.model.as_ref(),
        Some(&bundle.adapters),
        &mut bundle.model.make_cache(),
        input,
        &mut sampler,
        &mut |e| {
            out.token(e);
            Flow::Continue
        },
    )
    .map_err(CliError::runtime)?;
    out.finish(&prompt, &stats);
    Ok(())
}

/// The `--adapter NAME=DIR`s' names stacked in order (`a+b`), None without any.
fn adapter_stack(specs: &[String]) -> Option<String> {
    let names: Vec<&str> = specs.iter().filter_map(|s| s.split_once('=').map(|(n, _)| n)).collect();
    (!names.is_empty()).then(|| names.join("+"))
}

/// Streams text to stdout, or collects everything for one JSON object.
struct Output<'a> {
    bundle: &'a Bundle,
    json: bool,
    decoder: IncrementalDecoder,
    text: String,
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
}

impl<'a> Output<'a> {
    fn new(bundle: &'a Bundle, json: bool) -> Self {
        let decoder = IncrementalDecoder::new(true);
        Self {
            bundle,
            json,
            decoder,
            text: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
        }
    }

    fn token(&mut self, e: TokenEvent) {
        self.tokens.push(e.token);
        self.logprobs.extend(e.logprobs);
        let piece = self.decoder.push(&self.bundle.tokenizer, e.token);
        self.emit(&piece);
    }

    fn emit(&mut self, piece: &str) {
        if self.json {
            self.text.push_str(piece);
        } else {
            let mut stdout = std::io::stdout().lock();
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    }

    fn finish(mut self, prompt: &[u32], stats: &GenerationStats) {
        let rest = self.decoder.finish();
        self.emit(&rest);
        let reason = stats.finish_reason.map(|r| r.as_str()).unwrap_or("stop");
        if !self.json {
            println!();
            eprintln!(
                "prompt {} tok, {:.1} tok/s | generated {} tok, {:.1} tok/s | ttft {:.0} ms | finish {reason}",
                stats.prompt_tokens, stats.prefill_tps, stats.generated_tokens, stats.decode_tps, stats.ttft_ms
            );
            return;
        }
        let mut obj = json!({
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": prompt,
            "finish_reason": reason,
            "stats": {
                "prompt_tokens": stats.prompt_tokens,
                "generated_tokens": stats.generated_tokens,
                "prefill_tps": stats.prefill_tps,
                "decode_tps": stats.decode_tps,
                "ttft_ms": stats.ttft_ms,
            },
        });
        if !self.logprobs.is_empty() {
            obj["logprobs"] = json!(self.logprobs.iter().map(|l| json!({
                "token": l.token,
                "logprob": l.logprob,
                "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>());
        }
        println!("{obj}");
    }
}
