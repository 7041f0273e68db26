//! Fill (docs/fill.md) on recorded tool-call turns (`tests/fixtures/fill/tool_turns.json`) with
//! Qwen2.5-Coder-0.5B: the tool-call scaffold, tool names and punctuation the request determines
//! are appended as spans, and the output — tokens and logprob bits, greedy and seeded — is
//! exactly the output with fill off, alone and batched.

mod common;

use common::record::{Out, Rec};

use ferrolm_core::{CancelToken, FillPlan, FillStats, GenerateParams, SamplingParams};
use ferrolm_engine::{bundle, fill, Batch, BatchConfig, Bundle, SeqRequest};
use ferrolm_sample::{Sampler, SamplerConfig};
use ferrolm_text::RenderOptions;
use serde_json::Value;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf";

struct Turn {
    name: String,
    prompt: Vec<u32>,
    plan: FillPlan,
}

/// The fixture's turns: each prompt as the server renders it (the template with the tools),
/// and its fill plan from the conversation rendered with a call to each tool.
fn turns(b: &Bundle) -> Vec<Turn> {
    let path = common::repo_root().join("tests/fixtures/fill/tool_turns.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let tools = fixture["tools"].as_array().unwrap().clone();
    let render = |messages: Vec<Value>, generation: bool| -> Result<Vec<u32>, String> {
        let opts = RenderOptions { add_generation_prompt: generation, tools: Some(Value::Array(tools.clone())), ..Default::default() };
        let text = b.render_chat(&Value::Array(messages), &opts).map_err(|e| e.to_string())?;
        b.tokenizer.encode_prompt(&text, false, usize::MAX).map_err(|e| e.to_string())
    };
    let mut out = Vec::new();
    for turn in fixture["turns"].as_array().unwrap() {
        let messages: Vec<Value> = turn["messages"].as_array().unwrap().iter().map(parse_arguments).collect();
        let prompt = render(messages.clone(), true).unwrap();
        let probes = fill::probe_tools(&messages, &tools, |m| render(m, false)).unwrap();
        let tool_calls = fill::tool_call_spans(&prompt, &probes, &b.tokenizer);
        assert_eq!(tool_calls.len(), tools.len(), "{}: a span for every tool", turn["name"]);
        out.push(Turn { name: turn["name"].as_str().unwrap().into(), prompt, plan: FillPlan { tool_calls, copies: false } });
    }
    out
}

/// Tool-call arguments given as a JSON string become the object templates iterate (as the
/// server does).
fn parse_arguments(m: &Value) -> Value {
    let mut m = m.clone();
    if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for c in calls {
            let args = &mut c["function"]["arguments"];
            if let Some(s) = args.as_str() {
                *args = serde_json::from_str(s).unwrap();
            }
        }
    }
    m
}

/// Fill off (None), assert spans only (Some(false)), or with copies too (Some(true)).
type Mode = Option<bool>;

fn request(b: &Bundle, turn: &Turn, sp: &SamplingParams, fill: Mode, out: &Rc<RefCell<Out>>) -> SeqRequest<'static> {
    let cfg = SamplerConfig { vocab_size: b.model.info().vocab_size, ..Default::default() };
    let fill = fill.map(|copies| FillPlan { copies, ..turn.plan.clone() });
    SeqRequest {
        prompt: turn.prompt.clone(),
        params: GenerateParams { max_tokens: 48, sampling: sp.clone(), fill, ..Default::default() },
        eos_ids: b.eos_ids.clone(),
        cancel: CancelToken::new(),
        sampler: Box::new(Sampler::new(sp, &cfg).unwrap()),
        sink: Box::new(Rec(out.clone())),
        constraint: None,
    }
}

/// Runs `turns` (together, or each alone) and returns their outputs, steps and seconds.
fn run(b: &Bundle, turns: &[Turn], sp: &SamplingParams, fill: Mode, together: bool) -> (Vec<Out>, usize, f64) {
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 16, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let groups: Vec<&[Turn]> = if together { vec![turns] } else { turns.chunks(1).collect() };
    let (mut outs, mut steps, start) = (Vec::new(), 0, Instant::now());
    for group in groups {
        let model = b.model.as_ref();
        let mut batch = Batch::new(model, cfg, Default::default());
        let recs: Vec<_> = group.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
        for (turn, r) in group.iter().zip(&recs) {
            batch.add(request(b, turn, sp, fill, r), model.make_cache());
        }
        while !batch.is_idle() {
            batch.step(&|| false);
            steps += 1;
        }
        outs.extend(recs.into_iter().map(|r| Rc::try_unwrap(r).ok().unwrap().into_inner()));
    }
    (outs, steps, start.elapsed().as_secs_f64())
}

fn fill_stats(outs: &[Out]) -> FillStats {
    let mut total = FillStats::default();
    outs.iter().for_each(|o| total.add(&o.stats.as_ref().unwrap().fill));
    total
}

#[test]
fn tool_call_turns_are_token_identical_with_fill_on_and_off() {
    let path = ferrolm_models::paths::models_dir().join(MODEL);
    if !path.exists() {
        return eprintln!("SKIP: {} not present (run scripts/get_model.py qwen2.5-coder-0.5b)", path.display());
    }
    let b = bundle::load(Some(&path), "cpu").unwrap();
    let turns = turns(&b);
    for call in &turns[0].plan.tool_calls {
        eprintln!("assert span: {:?}", b.tokenizer.decode(&call.tokens, false));
    }
    // Greedy with logprobs: tokens and logprob bits.
    let greedy = SamplingParams { logprobs: Some(2), ..Default::default() };
    let (plain, plain_steps, plain_s) = run(&b, &turns, &greedy, None, false);
    let (filled, fill_steps, fill_s) = run(&b, &turns, &greedy, Some(false), false);
    let mut calls = 0;
    for ((turn, a), f) in turns.iter().zip(&plain).zip(&filled) {
        let text = b.tokenizer.decode(&a.trace.iter().map(|t| t.0).collect::<Vec<_>>(), false);
        eprintln!("{}: {:?} fill {:?}", turn.name, text, f.stats.as_ref().unwrap().fill);
        assert!(a.trace == f.trace, "{}: the output differs with fill", turn.name);
        // The template's call format (Qwen2.5-Coder-0.5B leaves out the <tool_call> tag).
        calls += text.matches("{\"name\": \"").count();
    }
    assert!(calls >= 3, "only {calls} calls in the template's format in {} turns", turns.len());
    let stats = fill_stats(&filled);
    eprintln!("greedy: {plain_steps} steps {plain_s:.2} s without fill, {fill_steps} steps {fill_s:.2} s with; {stats:?}");
    // Every call in the template's format has its scaffold, name and punctuation appended.
    assert!(stats.assert.injected >= 5 * calls, "{stats:?}");
    assert!(stats.assert.wasted * 2 <= stats.assert.injected, "{stats:?}");
    assert_eq!(stats.verify, Default::default());
    assert!(fill_steps < plain_steps, "{fill_steps} steps with fill against {plain_steps}");

    // Batched: each turn as alone.
    let (together, _, _) = run(&b, &turns, &greedy, Some(false), true);
    for ((turn, a), t) in turns.iter().zip(&plain).zip(&together) {
        assert!(a.trace == t.trace, "{}: batched with fill differs", turn.name);
    }
    // Seeded sampling, copies too: every appended token is still the sampler's own draw.
    let seeded = SamplingParams { temperature: 0.7, seed: Some(7), logprobs: Some(0), ..Default::default() };
    let (a, _, _) = run(&b, &turns[..2], &seeded, None, true);
    let (f, _, _) = run(&b, &turns[..2], &seeded, Some(true), true);
    for ((turn, a), f) in turns.iter().zip(&a).zip(&f) {
        assert!(a.trace == f.trace, "{}: seeded sampling differs with fill", turn.name);
    }
    assert!(fill_stats(&f).assert.injected > 0, "{:?}", fill_stats(&f));
}

/// Wall time per turn, each turn alone, fill off / assert spans / assert and copies, in
/// alternating rounds (median of `FERROLM_FILL_ROUNDS`, default 5). One batch with the prompt
/// cache on runs them all, so after the first round a turn's prompt is a cache hit, as in an
/// agent's conversation, and the time is the answer's. Timing, not a check:
/// `cargo test --release -p ferrolm-engine --test fill -- --ignored --nocapture`.
#[test]
#[ignore]
fn wall_time_per_turn() {
    let path = ferrolm_models::paths::models_dir().join(MODEL);
    let b = bundle::load(Some(&path), "cpu").unwrap();
    let turns = turns(&b);
    let rounds: usize = std::env::var("FERROLM_FILL_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let greedy = SamplingParams::default();
    let modes: [(&str, Mode); 3] = [("off", None), ("assert", Some(false)), ("assert+copies", Some(true))];
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 16, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
    let model = b.model.as_ref();
    let mut batch = Batch::new(model, cfg, Default::default());
    let mut sums = vec![0.0; modes.len()];
    for turn in &turns {
        let mut times = vec![Vec::new(); modes.len()];
        let mut report = Vec::new();
        for round in 0..=rounds {
            for (m, (_, mode)) in modes.iter().enumerate() {
                let out = Rc::new(RefCell::new(Out::default()));
                batch.add(request(&b, turn, &greedy, *mode, &out), model.make_cache());
                let (start, mut steps) = (Instant::now(), 0);
                while !batch.is_idle() {
                    batch.step(&|| false);
                    steps += 1;
                }
                let out = out.borrow();
                // Round 0 computes the prompt (into the cache): not timed.
                if round > 0 {
                    times[m].push(start.elapsed().as_secs_f64());
                }
                report.push((m, steps, out.trace.len(), out.stats.as_ref().unwrap().fill));
            }
        }
        for (m, (name, _)) in modes.iter().enumerate() {
            times[m].sort_by(f64::total_cmp);
            let (_, steps, tokens, fill) = report.iter().find(|r| r.0 == m).unwrap();
            let median = times[m][rounds / 2];
            sums[m] += median;
            let (a, v) = (fill.assert, fill.verify);
            eprintln!(
                "{:>12} {:>14}: median {median:.3} s (min {:.3}), {tokens} tokens in {steps} steps; assert {}/{}/{} verify {}/{}/{} (spans/injected/wasted)",
                turn.name, name, times[m][0], a.spans, a.injected, a.wasted, v.spans, v.injected, v.wasted
            );
        }
    }
    for (m, (name, _)) in modes.iter().enumerate() {
        eprintln!("all turns {name:>14}: {:.3} s ({:+.1}% against off)", sums[m], 100.0 * (sums[m] / sums[0] - 1.0));
    }
}
