//! `ferrolm bench`: prefill tok/s on an N-token prompt and decode tok/s over M greedy tokens,
//! median of R runs after a warm-up. The prompt is real text, tokenized and cut to length.

use crate::{CliError, CliResult};
use ferrolm_engine::{bundle, DecodePath, GraphDecoder};
use ferrolm_kv::SeqCache;
use ferrolm_models::{CausalLm, SeqInput};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Decoded tokens per run.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    #[arg(long, default_value = "auto")]
    device: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// A JSON array of prompt token ids to use instead of the built-in text (e.g. the ids a
    /// peer was given, so both run on identical input).
    #[arg(long)]
    prompt_ids_file: Option<PathBuf>,
    /// Decode through the regular forward even where the captured static step is available
    /// (GPUs); FERROLM_CUDA_GRAPH=0 keeps the static step but runs it eagerly.
    #[arg(long)]
    no_static: bool,
    /// Run N sequences together through the engine step (continuous batching) and report
    /// their aggregate decode rate instead of one sequence's figures.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// With --concurrency: also decode each sequence alone and report how many tokens agree.
    #[arg(long)]
    check: bool,
    /// Tokens per engine step at most with --concurrency (see `ferrolm serve`).
    #[arg(long, default_value_t = ferrolm_engine::config::DEFAULT_MAX_BATCH_TOKENS)]
    max_batch_tokens: usize,
    /// Split the model over N ranks (see `ferrolm serve --tensor-parallel`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    tensor_parallel: u32,
    #[command(flatten)]
    kv: crate::kv_args::KvArgs,
}

const TEXT: &str = "The history of the printing press is the history of how ideas learned to travel. \
Before movable type, every book was copied by hand, and a single manuscript could take a scribe many \
months to finish. Gutenberg combined an adjustable mould for casting metal type with an oil-based ink \
and a press adapted from those used to make wine. Within fifty years, printing shops had opened in more \
than two hundred cities, and millions of volumes were in circulation. ";

pub fn run(args: Args) -> CliResult<()> {
    let load_start = Instant::now();
    let mut b = bundle::load_parallel(args.model.as_deref(), &args.device, args.tensor_parallel as usize)
        .map_err(CliError::usage)?;
    args.kv.apply(b.model.as_mut())?;
    let load_s = load_start.elapsed().as_secs_f64();
    let prompt = match &args.prompt_ids_file {
        Some(f) => read_ids(f)?,
        None => bench_prompt(&b.tokenizer, args.prompt_tokens)?,
    };
    let model = b.model.as_ref();
    if args.concurrency > 1 {
        return concurrent(&args, model, &prompt);
    }
    let (mut prefill, mut decode, mut ttft) = (Vec::new(), Vec::new(), Vec::new());
    // The captured step pays off where launches cost (GPUs); on CPU the regular forward is faster.
    let use_static = !args.no_static && !model.device().is_cpu();
    let mut decoder = match use_static {
        true => GraphDecoder::new(model, ferrolm_engine::GraphSettings::from_env()).map_err(CliError::runtime)?,
        false => None,
    };
    // One cache for all runs, as a server slot is reused: a captured step stays valid.
    let mut cache = model.make_cache();
    let mut last = RunFigures::default();
    for run in 0..=args.runs {
        cache.trim(cache.offset());
        let r = one_run(model, &mut cache, decoder.as_mut(), &prompt, args.decode_tokens).map_err(CliError::runtime)?;
        if run > 0 {
            prefill.push(r.prefill_tps);
            decode.push(r.decode_tps);
            ttft.push(r.ttft_ms);
        }
        last = r;
    }
    let (p, d, t) = (median(&mut prefill), median(&mut decode), median(&mut ttft));
    let rss = peak_rss_mb();
    if args.json {
        let obj = serde_json::json!({
            "model": b.path.display().to_string(), "load_s": load_s, "threads": ferrolm_backend::cpu::threads::num_threads(),
            "prompt_tokens": prompt.len(), "decode_tokens": args.decode_tokens, "runs": args.runs,
            "prefill_tps": p, "decode_tps": d, "ttft_ms": t, "peak_rss_mb": rss,
            "prefill_runs": prefill, "decode_runs": decode, "weight_bytes": model.info().weight_bytes,
            "device": format!("{:?}", model.device()), "tensor_parallel": args.tensor_parallel,
            "decode_path": last.path, "decoded_ids": last.ids,
            "kv": cache.signature(), "kv_bytes_per_token": cache.bytes_per_token(),
        });
        println!("{obj}");
    } else {
        println!("model {} (load {load_s:.2} s, peak RSS {rss:.0} MB)", b.path.display());
        println!(
            "prefill {p:.1} tok/s ({} tokens, ttft {t:.0} ms), decode {d:.1} tok/s ({} tokens), median of {}",
            prompt.len(),
            args.decode_tokens,
            args.runs
        );
    }
    Ok(())
}

/// `--concurrency N`: median of the runs of `bench_batch::run`.
fn concurrent(args: &Args, model: &dyn CausalLm, prompt: &[u32]) -> CliResult<()> {
    let n = args.concurrency;
    let (mut decode, mut first, mut steps, mut tokens) = (Vec::new(), Vec::new(), 0, Vec::new());
    for run in 0..=args.runs {
        let r = crate::bench_batch::run(model, prompt, n, args.decode_tokens, args.max_batch_tokens).map_err(CliError::runtime)?;
        if run > 0 {
            decode.push(r.decode_tps);
            first.push(r.last_first_token_ms);
            steps = r.decode_steps;
        }
        tokens = r.tokens;
    }
    let agree = match args.check {
        true => Some(crate::bench_batch::agreement(model, prompt, &tokens).map_err(CliError::runtime)?),
        false => None,
    };
    let (d, f) = (median(&mut decode), median(&mut first));
    let rss = peak_rss_mb();
    if args.json {
        let obj = serde_json::json!({
            "concurrency": n, "prompt_tokens": prompt.len(), "decode_tokens": args.decode_tokens,
            "runs": args.runs, "decode_tps": d, "decode_runs": decode, "last_first_token_ms": f,
            "max_batch_tokens": args.max_batch_tokens, "peak_rss_mb": rss, "decode_steps": steps,
            "agree_with_solo": agree, "device": format!("{:?}", model.device()),
            "threads": ferrolm_backend::cpu::threads::num_threads(),
        });
        println!("{obj}");
    } else {
        println!("{n} sequences of {} prompt tokens: decode {d:.1} tok/s in aggregate ({} tokens each), all first tokens by {f:.0} ms, median of {} (peak RSS {rss:.0} MB)", prompt.len(), args.decode_tokens, args.runs);
        if let Some(a) = agree {
            let full = a.iter().filter(|&&k| k == args.decode_tokens).count();
            println!("agreement with each sequence alone: {full} of {n} identical; tokens agreeing from the start: {a:?}");
        }
    }
    Ok(())
}

fn read_ids(f: &std::path::Path) -> CliResult<Vec<u32>> {
    let text = std::fs::read_to_string(f).map_err(|e| CliError::usage(format!("{}: {e}", f.display())))?;
    let ids: Vec<u32> = serde_json::from_str(&text)
        .map_err(|e| CliError::usage(format!("{}: expected a JSON array of token ids: {e}", f.display())))?;
    if ids.is_empty() {
        return Err(CliError::usage(format!("{}: no token ids", f.display())));
    }
    Ok(ids)
}

/// Peak resident memory of this process (VmHWM), in MB.
fn peak_rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn bench_prompt(tok: &ferrolm_text::Tokenizer, n: usize) -> CliResult<Vec<u32>> {
    let mut ids = tok.encode("", true).map_err(CliError::runtime)?;
    let body = tok.encode(TEXT, false).map_err(CliError::runtime)?;
    while ids.len() < n {
        ids.extend(&body);
    }
    ids.truncate(n);
    Ok(ids)
}

#[derive(Default)]
struct RunFigures {
    prefill_tps: f64,
    decode_tps: f64,
    ttft_ms: f64,
    /// "graph", "eager-static" or "regular".
    path: &'static str,
    /// The greedy tokens decoded (graph and eager runs must agree bit for bit).
    ids: Vec<u32>,
}

/// One prefill of the prompt (chunked as the engine does, last token alone) and `n` greedy decode
/// steps. Time to first token is the prefill plus the first token's sampling.
fn one_run(
    model: &dyn CausalLm,
    cache: &mut SeqCache,
    decoder: Option<&mut GraphDecoder>,
    prompt: &[u32],
    n: usize,
) -> candle_core::Result<RunFigures> {
    profile(model, "prefill", 1)?;
    let start = Instant::now();
    let (body, tail) = prompt.split_at(prompt.len() - 1);
    for chunk in body.chunks(2048) {
        model.forward_hidden(&mut [SeqInput::prompt(chunk, cache)])?;
    }
    let first = next_token(model, cache, tail)?;
    let ttft = start.elapsed().as_secs_f64();
    profile(model, "prefill", 1)?;
    let start = Instant::now();
    let mut ids = Vec::with_capacity(n);
    let mut path = "regular";
    let ran = match decoder {
        Some(d) => d.run(model, cache, first, n, &mut |t| {
            ids.push(t);
            true
        })?,
        None => None,
    };
    match ran {
        Some(DecodePath::Graph) => path = "graph",
        Some(DecodePath::Eager) => path = "eager-static",
        None => {
            let mut token = first;
            for _ in 0..n {
                token = next_token(model, cache, &[token])?;
                ids.push(token);
            }
        }
    }
    let decode = start.elapsed().as_secs_f64();
    profile(model, "decode", n)?;
    Ok(RunFigures {
        prefill_tps: prompt.len() as f64 / ttft,
        decode_tps: n as f64 / decode,
        ttft_ms: ttft * 1e3,
        path,
        ids,
    })
}

/// Prints the kernel profile of the work since the last call (FERROLM_CUDA_PROFILE=1).
fn profile(model: &dyn CausalLm, what: &str, steps: usize) -> candle_core::Result<()> {
    if let Some(r) = ferrolm_backend::graph::profile_report(model.device(), steps)? {
        eprintln!("{what}: {r}");
    }
    Ok(())
}

fn next_token(
    model: &dyn CausalLm,
    cache: &mut ferrolm_kv::SeqCache,
    tokens: &[u32],
) -> candle_core::Result<u32> {
    let h = model.forward_hidden(&mut [SeqInput::decode(tokens, cache)])?;
    model
        .project_logits(&h)?
        .squeeze(0)?
        .argmax(0)?
        .to_scalar::<u32>()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
