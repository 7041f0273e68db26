//! `ferrolm`: serve, generate and benchmark LLMs on CPUs and NVIDIA GPUs.

mod banner;
mod bench;
mod bench_batch;
mod dump_logits;
mod generate;
mod kv_args;
mod perplexity;
mod progress;
mod serve;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferrolm",
    version,
    about = "LLM inference engine and OpenAI-compatible server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the model over an OpenAI-compatible HTTP API (drop-in for mlx_lm.server).
    // Boxed: its many flags make it far larger than the other commands' arguments.
    Serve(Box<serve::Args>),
    /// Generate a completion for one prompt; text streams to stdout, stats to stderr.
    Generate(generate::Args),
    /// Measure prefill and decode speed on the model.
    Bench(bench::Args),
    /// Write teacher-forced logits (correctness checks against other implementations).
    #[command(hide = true)]
    DumpLogits(dump_logits::Args),
    /// Perplexity of a text and the KL divergence of quantized KV caches (as llama-perplexity).
    Perplexity(perplexity::Args),
    /// Check ferrolm's CUDA kernels against candle's compositions on a GPU (builds with `cuda`).
    #[command(hide = true)]
    GpuCheck {
        #[arg(long, default_value = "cuda")]
        device: String,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (log_level, json) = match &cli.command {
        Command::Serve(args) => (args.log_level.as_deref(), args.log_format == "json"),
        _ => (None, false),
    };
    init_logging(log_level, json);
    let result = match cli.command {
        Command::Serve(args) => serve::run(*args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::DumpLogits(args) => dump_logits::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::GpuCheck { device } => gpu_check(&device),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Logs go to stderr, filtered by `serve --log-level` (mlx_lm.server's level names), else by
/// `FERROLM_LOG` (tracing's filter syntax, e.g. `ferrolm_server=debug`), else warnings and
/// errors. The one line per request (target `ferrolm::access`) is on at every level but ERROR
/// and CRITICAL, as mlx_lm.server prints its access lines. Colours only on a terminal; JSON
/// objects with `serve --log-format json`.
fn init_logging(level: Option<&str>, json: bool) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let directives = match level {
        Some("DEBUG") => "debug".to_string(),
        Some("INFO") => "info".to_string(),
        Some("WARNING") => "warn,ferrolm::access=info".to_string(),
        Some(_) => "error".to_string(),
        None => match std::env::var("FERROLM_LOG") {
            Ok(f) if f.contains("ferrolm::access") => f,
            Ok(f) => format!("{f},ferrolm::access=info"),
            Err(_) => "warn,ferrolm::access=info".to_string(),
        },
    };
    let filter = EnvFilter::try_new(&directives).unwrap_or_else(|_| EnvFilter::new("warn,ferrolm::access=info"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        fmt.json().flatten_event(true).with_current_span(false).init();
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// Runs the CUDA kernel self-checks and prints one line per check; fails if any check fails.
#[cfg(feature = "cuda")]
fn gpu_check(device: &str) -> Result<(), CliError> {
    let dev = ferrolm_backend::parse_device(device).map_err(CliError::usage)?;
    let checks = ferrolm_backend::cuda::selftest::run(&dev).map_err(CliError::runtime)?;
    let failed = checks.iter().filter(|c| !c.passed()).count();
    for c in &checks {
        let verdict = if c.passed() { "ok  " } else { "FAIL" };
        println!("{verdict} {:<60} error {:.3e} (bound {:.1e})", c.name, c.error, c.bound);
    }
    println!("{} checks, {failed} failed", checks.len());
    if failed > 0 {
        return Err(CliError::runtime(format!("{failed} CUDA kernel checks failed")));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn gpu_check(_device: &str) -> Result<(), CliError> {
    Err(CliError::usage("this ferrolm was built without CUDA (cargo feature `cuda`)"))
}

/// A command's failure with the exit code it maps to: 2 for a bad model or bad input.
#[derive(Debug)]
pub struct CliError {
    message: String,
    code: u8,
}

impl CliError {
    pub fn usage(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            code: 2,
        }
    }
    pub fn runtime(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            code: 1,
        }
    }
    fn exit_code(&self) -> u8 {
        self.code
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

pub type CliResult<T> = Result<T, CliError>;
