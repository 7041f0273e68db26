//! `ferrolm perplexity`: perplexity of a text and, per KV scheme, the KL divergence of its
//! next-token distributions from the first scheme's (docs/kv_quant.md), chunked as llama.cpp's
//! `llama-perplexity`: the token stream (BOS first when the model adds one) cut into windows of
//! `--ctx` tokens, each window's first token replaced by BOS (when there is one), each window
//! run on fresh caches, and the predictions of its second half scored. Every scheme runs on the
//! same windows in one process, so the KL needs no stored logits.

use crate::kv_args::{parse_scheme, scheme_name};
use crate::{CliError, CliResult};
use candle_core::Tensor;
use ferrolm_engine::bundle;
use ferrolm_kv::KvScheme;
use ferrolm_models::{CausalLm, SeqInput};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    /// The text (UTF-8).
    #[arg(long)]
    text_file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Windows at most (default: as many whole windows as the text holds).
    #[arg(long)]
    chunks: Option<usize>,
    /// KV schemes, comma-separated: f16, q8g32, q4g64, … The first is the KL reference.
    #[arg(long, default_value = "f16,q8g32,q4g32")]
    kv: String,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Also write the figures as one JSON object here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One scheme's running sums.
#[derive(Default)]
struct Tally {
    nll: f64,
    kl: f64,
    kl_max: f64,
    top1_same: usize,
    tokens: usize,
    seconds: f64,
    bytes_per_token_layer: usize,
}

pub fn run(args: Args) -> CliResult<()> {
    let schemes: Vec<KvScheme> = args.kv.split(',').map(|s| parse_scheme(s.trim())).collect::<Result<_, _>>().map_err(CliError::usage)?;
    if args.ctx < 4 {
        return Err(CliError::usage("--ctx must be at least 4"));
    }
    let mut b = bundle::load(Some(&args.model), &args.device).map_err(CliError::usage)?;
    let text = std::fs::read_to_string(&args.text_file).map_err(|e| CliError::usage(format!("{}: {e}", args.text_file.display())))?;
    let ids = b.tokenizer.encode(&text, true).map_err(CliError::runtime)?;
    let bos = b.tokenizer.encode("", true).map_err(CliError::runtime)?.first().copied();
    let windows = (ids.len() / args.ctx).min(args.chunks.unwrap_or(usize::MAX));
    if windows == 0 {
        return Err(CliError::usage(format!("the text has {} tokens, fewer than --ctx {}", ids.len(), args.ctx)));
    }
    eprintln!("{} tokens, {windows} windows of {}, scoring {} per window", ids.len(), args.ctx, args.ctx - 1 - args.ctx / 2);
    let mut tallies: Vec<Tally> = schemes.iter().map(|_| Tally::default()).collect();
    for w in 0..windows {
        let mut window = ids[w * args.ctx..(w + 1) * args.ctx].to_vec();
        if let Some(bos) = bos {
            window[0] = bos;
        }
        score_window(b.model.as_mut(), &schemes, &window, &mut tallies).map_err(CliError::runtime)?;
        let t = &tallies[0];
        eprintln!("window {}/{windows}: ppl {:.4}", w + 1, (t.nll / t.tokens as f64).exp());
    }
    report(&args, &schemes, &tallies, ids.len(), windows)
}

/// Runs `window` under every scheme, adding each one's NLL and its KL from the first's.
fn score_window(model: &mut dyn CausalLm, schemes: &[KvScheme], window: &[u32], tallies: &mut [Tally]) -> candle_core::Result<()> {
    let first = window.len() / 2;
    let mut reference: Option<Vec<f32>> = None;
    for (s, tally) in schemes.iter().zip(tallies.iter_mut()) {
        model.set_kv_scheme(*s).map_err(candle_core::Error::Msg)?;
        let start = Instant::now();
        let logp = log_probs(model, window, first, tally)?;
        tally.seconds += start.elapsed().as_secs_f64();
        let vocab = logp.len() / (window.len() - 1 - first);
        for (r, row) in logp.chunks_exact(vocab).enumerate() {
            tally.nll -= row[window[first + r + 1] as usize] as f64;
            tally.tokens += 1;
            if let Some(base) = &reference {
                let base_row = &base[r * vocab..(r + 1) * vocab];
                let kl: f64 = base_row.iter().zip(row).map(|(&p, &q)| (p as f64).exp() * (p as f64 - q as f64)).sum();
                tally.kl += kl;
                tally.kl_max = tally.kl_max.max(kl);
                tally.top1_same += (argmax(base_row) == argmax(row)) as usize;
            }
        }
        if reference.is_none() {
            reference = Some(logp);
        }
    }
    Ok(())
}

/// Log-probabilities `[(len − 1 − first) × vocab]` of the predictions after positions
/// `first..len−1`, the window run as decode rows on fresh caches.
fn log_probs(model: &dyn CausalLm, window: &[u32], first: usize, tally: &mut Tally) -> candle_core::Result<Vec<f32>> {
    let mut cache = model.make_cache();
    let hidden = model.forward_hidden(&mut [SeqInput::decode(window, &mut cache)])?;
    tally.bytes_per_token_layer = cache.bytes_per_token() / cache.num_layers().max(1);
    let rows: Tensor = hidden.narrow(0, first, window.len() - 1 - first)?;
    let logits = model.project_logits(&rows)?;
    log_softmax_rows(&logits)
}

/// Row-wise log-softmax in f64 sums (the logits are f32 `[rows, vocab]`).
fn log_softmax_rows(logits: &Tensor) -> candle_core::Result<Vec<f32>> {
    let (_, vocab) = logits.dims2()?;
    let mut data = logits.flatten_all()?.to_vec1::<f32>()?;
    for row in data.chunks_exact_mut(vocab) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let lse = max as f64 + sum.ln();
        row.iter_mut().for_each(|x| *x = (*x as f64 - lse) as f32);
    }
    Ok(data)
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
}

fn report(args: &Args, schemes: &[KvScheme], tallies: &[Tally], tokens: usize, windows: usize) -> CliResult<()> {
    let mut rows = Vec::new();
    println!("{:<12} {:>10} {:>10} {:>12} {:>10} {:>10} {:>12}", "kv", "ppl", "Δppl", "mean KL", "max KL", "top1 same", "B/tok/layer");
    let base_ppl = (tallies[0].nll / tallies[0].tokens as f64).exp();
    for (s, t) in schemes.iter().zip(tallies) {
        let ppl = (t.nll / t.tokens as f64).exp();
        let (kl, same) = (t.kl / t.tokens as f64, t.top1_same as f64 / t.tokens as f64);
        println!("{:<12} {ppl:>10.4} {:>10.4} {kl:>12.6} {:>10.4} {:>9.2}% {:>12}", scheme_name(s), ppl - base_ppl, t.kl_max, 100.0 * same, t.bytes_per_token_layer);
        rows.push(serde_json::json!({
            "kv": scheme_name(s), "ppl": ppl, "delta_ppl": ppl - base_ppl, "mean_kl": kl, "max_kl": t.kl_max,
            "top1_same": same, "scored_tokens": t.tokens, "seconds": t.seconds, "bytes_per_token_per_layer": t.bytes_per_token_layer,
        }));
    }
    if let Some(path) = &args.json {
        let obj = serde_json::json!({
            "model": args.model.display().to_string(), "text": args.text_file.display().to_string(),
            "text_tokens": tokens, "ctx": args.ctx, "windows": windows, "schemes": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&obj).unwrap_or_default()).map_err(|e| CliError::runtime(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}
