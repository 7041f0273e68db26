//! Figures for docs/paged_kv.md (`#[ignore]`: minutes on a 2-core machine; run with
//! `cargo test --release -p ferrolm-engine --test paged_kv_bench -- --ignored --nocapture`,
//! best from a private copy of the test binary). Prints JSON lines:
//! - `decode`: decode tok/s of one sequence after a prompt of 512 and 4,096 tokens, contiguous
//!   and paged with blocks of 16, 32 and 64 tokens (the block size was chosen from this), and
//!   the calling thread's CPU ms per token (the whole step's with `FERROLM_THREADS=1`: the
//!   figure to compare on a busy machine);
//! - `ram`: KV bytes while 4 conversations sharing a system prompt run interleaved (3 turns,
//!   each turn of the 4 batched), contiguous vs paged, and the process's peak RSS
//!   (`FERROLM_BENCH_LAYOUT=contiguous|paged` runs one layout per process for a clean RSS).

mod common;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::config::KvLayout;
use ferrolm_engine::{generate, Batch, BatchConfig, Flow, GenerateInput, SeqRequest, Sink};
use ferrolm_kv::PagedPools;
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `n` tokens of the fixture prompts' text, repeated as needed.
fn text_tokens(n: usize) -> Vec<u32> {
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    f.prompts.iter().flat_map(|p| p.prompt_ids.iter().copied()).cycle().take(n).collect()
}

/// This thread's CPU time in ns (`/proc/thread-self/schedstat`): with `FERROLM_THREADS=1` the
/// whole forward runs on it, and unlike wall time it does not count the time other processes of
/// a busy machine hold the core.
fn thread_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// Decode tok/s (wall) and this thread's CPU ms per token, between the first and last token.
fn decode_rate(model: &dyn CausalLm, cache: &mut ferrolm_kv::SeqCache, prompt: &[u32], n: usize) -> (f64, f64) {
    let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
    let sampling = SamplingParams::default();
    let params = GenerateParams { max_tokens: n, sampling: sampling.clone(), ..Default::default() };
    let input = GenerateInput { prompt, params: &params, eos_ids: &[], cancel: &CancelToken::new(), graph: Default::default() };
    let mut times = Vec::new();
    generate(model, cache, input, &mut Sampler::new(&sampling, &cfg).unwrap(), &mut |_| {
        times.push((Instant::now(), thread_cpu_ns()));
        Flow::Continue
    })
    .unwrap();
    let ((t0, c0), (t1, c1)) = (times[0], times[times.len() - 1]);
    let tokens = (times.len() - 1) as f64;
    (tokens / (t1 - t0).as_secs_f64(), (c1 - c0) as f64 / 1e6 / tokens)
}

#[test]
#[ignore = "a measurement: minutes on a 2-core machine"]
fn decode_speed_by_layout() {
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    for context in [512, 4096] {
        let prompt = text_tokens(context);
        for round in 0..2 {
            for layout in ["contiguous", "paged16", "paged32", "paged64"] {
                let mut cache = match layout.strip_prefix("paged") {
                    Some(bt) => PagedPools::for_model(&model.make_cache(), bt.parse().unwrap()).make(model.make_cache()),
                    None => model.make_cache(),
                };
                let (rate, cpu_ms) = decode_rate(model, &mut cache, &prompt, 64);
                println!("{{\"figure\":\"decode\",\"context\":{context},\"layout\":\"{layout}\",\"round\":{round},\"tok_s\":{rate:.2},\"cpu_ms_per_token\":{cpu_ms:.3}}}");
            }
        }
    }
}

struct Done(Rc<RefCell<Vec<u32>>>, Rc<RefCell<bool>>);

impl Sink for Done {
    fn token(&mut self, e: TokenEvent) -> Flow {
        self.0.borrow_mut().push(e.token);
        Flow::Continue
    }
    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        outcome.unwrap();
        *self.1.borrow_mut() = true;
    }
}

fn peak_rss_kib() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
#[ignore = "a measurement: minutes on a 2-core machine"]
fn ram_of_four_conversations_sharing_a_system_prompt() {
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    let layouts: Vec<String> = match std::env::var("FERROLM_BENCH_LAYOUT") {
        Ok(one) => vec![one],
        Err(_) => vec!["contiguous".into(), "paged".into()],
    };
    let system = text_tokens(1500);
    let users = text_tokens(4 * 3 * 60 + 2000);
    for layout in layouts {
        let rss0 = peak_rss_kib();
        let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 8, kv_budget_bytes: 1 << 32, prompt_cache_bytes: 1 << 30 };
        let mut batch = Batch::new(model, cfg, Default::default());
        if layout == "paged" {
            batch.set_kv_layout(KvLayout::Paged { block_tokens: ferrolm_engine::config::DEFAULT_BLOCK_TOKENS }).unwrap();
        }
        let mut convs: Vec<Vec<u32>> = vec![system.clone(); 4];
        let (mut peak, mut cached) = (0usize, 0usize);
        for turn in 0..3 {
            let mut outs = Vec::new();
            for (c, conv) in convs.iter_mut().enumerate() {
                let at = 2000 + (turn * 4 + c) * 60;
                conv.extend(&users[at..at + 60]);
                let (tokens, done) = (Rc::new(RefCell::new(Vec::new())), Rc::new(RefCell::new(false)));
                let cfg = SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
                let sampling = SamplingParams::default();
                batch.add(
                    SeqRequest {
                        prompt: conv.clone(),
                        params: GenerateParams { max_tokens: 32, sampling: sampling.clone(), ..Default::default() },
                        eos_ids: vec![],
                        cancel: CancelToken::new(),
                        sampler: Box::new(Sampler::new(&sampling, &cfg).unwrap()),
                        sink: Box::new(Done(tokens.clone(), done.clone())),
                        constraint: None,
                    },
                    model.make_cache(),
                );
                outs.push(tokens);
            }
            while !batch.is_idle() {
                batch.step(&|| false);
                peak = peak.max(batch.kv_bytes());
            }
            for (conv, out) in convs.iter_mut().zip(&outs) {
                conv.extend(out.borrow().iter());
            }
            cached = batch.prompt_cache_stats().map_or(0, |s| s.hit_tokens as usize);
        }
        let tokens: usize = convs.iter().map(Vec::len).sum();
        println!(
            "{{\"figure\":\"ram\",\"layout\":\"{layout}\",\"conversation_tokens\":{tokens},\"peak_kv_bytes\":{peak},\"end_kv_bytes\":{},\"cached_tokens\":{cached},\"peak_rss_kib\":{},\"rss_before_kib\":{rss0}}}",
            batch.kv_bytes(),
            peak_rss_kib()
        );
    }
}
