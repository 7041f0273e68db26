//! The engine without HTTP, to measure what the server adds (bench/server_bench.py): the same
//! `EngineHandle` the server uses, warm, in one process. One JSON line in per request
//! (`{"prompt": text, "max_tokens": n}`, the prompt tokenized raw with the model's BOS rule as
//! `/v1/completions` does), one line out: `{"ttft_ms", "decode_tps", "tokens"}`. TTFT runs from
//! before tokenization to the first token event; decode tok/s is tokens after the first over
//! the time from the first to the last.
//!
//!     cargo run --release -p ferrolm-server --example engine_direct -- [MODEL.gguf]

use ferrolm_core::{CancelToken, GenerateParams};
use ferrolm_engine::{bundle, EngineConfig, EngineHandle, Event, Request};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let model = std::env::args().nth(1).map(PathBuf::from);
    let bundle = Arc::new(bundle::load(model.as_deref(), "auto").expect("load the model"));
    let engine = EngineHandle::spawn(bundle.clone(), EngineConfig::default());
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let req: Value = serde_json::from_str(&line).expect("a JSON request");
        let prompt = req["prompt"].as_str().unwrap_or_default();
        let max_tokens = req["max_tokens"].as_u64().unwrap_or(128) as usize;
        let t0 = Instant::now();
        let ids = bundle.prompt_ids(None, prompt).expect("tokenize");
        let params = GenerateParams { max_tokens, ..Default::default() };
        let request = Request { prompt: ids, params, cancel: CancelToken::new(), constraint: None };
        let mut events = engine.submit(request).expect("submit");
        let stamps = rt.block_on(async {
            let mut stamps = Vec::new();
            while let Some(ev) = events.recv().await {
                match ev {
                    Event::Token(_) => stamps.push(Instant::now()),
                    Event::Done(_) => break,
                    Event::Error(e) => panic!("generation failed: {e}"),
                }
            }
            stamps
        });
        let ttft = stamps.first().map_or(0.0, |t| (*t - t0).as_secs_f64() * 1e3);
        let span = match (stamps.first(), stamps.last()) {
            (Some(a), Some(b)) => (*b - *a).as_secs_f64(),
            _ => 0.0,
        };
        let tps = if span > 0.0 { (stamps.len() - 1) as f64 / span } else { 0.0 };
        let out = json!({"ttft_ms": ttft, "decode_tps": tps, "tokens": stamps.len()});
        let mut w = stdout.lock();
        let _ = writeln!(w, "{out}");
        let _ = w.flush();
    }
}
