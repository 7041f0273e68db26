//! What grammar masks add to a decode step (issue 33: median ≤ 3% of the step), through the
//! engine step: B sequences under a JSON schema (llguidance), sampled with fixed seeds, at
//! SmolLM2's 49,152 and Gemma 3's 262,144 tokens, batches of 1 and 16, with each way of
//! computing the masks (`MaskSchedule`). The seeds repeat across schedules, so every schedule
//! computes the same masks and delivers the same tokens (asserted). Only steps where all B
//! rows decode under the constraint count. Ignored by default (a measurement, not a check):
//!
//!     bench/mask_cost.sh   (copies the test binary to a private path, then runs it)
//!
//! `FERROLM_BENCH_DEVICE=cuda:0` runs the models on a GPU (a `cuda` build).

mod common;

use common::record::{request_with, Out, Trace};
use ferrolm_core::SamplingParams;
use ferrolm_engine::{Batch, BatchConfig, MaskSchedule, MaskTimes};
use ferrolm_models::{paths, CausalLm, ModelSource};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SCHEDULES: [MaskSchedule; 3] = [MaskSchedule::Serial, MaskSchedule::Parallel, MaskSchedule::Overlap];
const ROUNDS: u64 = 3;
const MAX_TOKENS: usize = 160;

fn schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "created_at": {"type": "string", "format": "date-time"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 80},
                    "email": {"type": "string", "format": "email"},
                    "tier": {"enum": ["free", "pro", "enterprise"]}
                },
                "required": ["name", "email", "tier"],
                "additionalProperties": false
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "description": {"type": "string"},
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number", "minimum": 0}
                    },
                    "required": ["sku", "quantity", "unit_price"],
                    "additionalProperties": false
                }
            },
            "notes": {"type": ["string", "null"]},
            "gift": {"type": "boolean"}
        },
        "required": ["order_id", "created_at", "customer", "items", "gift"],
        "additionalProperties": false
    })
}

/// One full-batch decode step: its wall time and its masks'.
struct StepTime {
    step: Duration,
    masks: MaskTimes,
}

struct Setup<'m> {
    model: &'m dyn CausalLm,
    tokenizer: Arc<ferrolm_text::Tokenizer>,
    grammars: ferrolm_grammar::Grammars,
    spec: ferrolm_grammar::ConstraintSpec,
}

impl Setup<'_> {
    /// `batch` sequences (seeds from `seed`) to the end under `schedule`: their outputs and the
    /// steps where all of them decoded.
    fn run(&self, batch: usize, seed: u64, schedule: MaskSchedule) -> (Vec<Trace>, Vec<StepTime>) {
        let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: batch, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
        let mut engine = Batch::new(self.model, cfg, Default::default());
        engine.set_mask_schedule(schedule);
        let prompt = self.tokenizer.encode("A customer order as JSON:", true).unwrap();
        let eos = self.tokenizer.eos_ids().to_vec();
        let outs: Vec<_> = (0..batch).map(|_| Rc::new(RefCell::new(Out::default()))).collect();
        for (i, out) in outs.iter().enumerate() {
            let sp = SamplingParams { temperature: 0.8, seed: Some(seed + i as u64), ..Default::default() };
            let mut req = request_with(self.model, &prompt, &sp, MAX_TOKENS, out);
            req.eos_ids = eos.clone();
            req.constraint = Some(Box::new(self.grammars.compile(&self.spec).unwrap()));
            engine.add(req, self.model.make_cache());
        }
        let mut steps = Vec::new();
        while !engine.is_idle() {
            let start = Instant::now();
            let report = engine.step(&|| false);
            let step = start.elapsed();
            if report.masks.rows == batch && report.seqs == batch {
                steps.push(StepTime { step, masks: report.masks });
            }
        }
        (outs.iter().map(|o| o.borrow().trace.clone()).collect(), steps)
    }
}

fn quantile(mut v: Vec<Duration>, q: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn pct(part: Duration, whole: Duration) -> String {
    format!("{:.2}%", 100.0 * part.as_secs_f64() / whole.as_secs_f64())
}

/// One markdown row: steps, step median/p99, masks waited median/p99 (ms and share of the
/// median step), work median.
fn row(model: &str, batch: usize, schedule: MaskSchedule, steps: &[StepTime]) -> String {
    let step: Vec<_> = steps.iter().map(|s| s.step).collect();
    let waited: Vec<_> = steps.iter().map(|s| s.masks.waited).collect();
    let work: Vec<_> = steps.iter().map(|s| s.masks.work).collect();
    let (step_med, step_p99) = (quantile(step.clone(), 0.5), quantile(step, 0.99));
    let (w_med, w_p99) = (quantile(waited.clone(), 0.5), quantile(waited, 0.99));
    format!(
        "| {model} | {batch} | {schedule:?} | {} | {} | {} | {} ({}) | {} ({}) | {} | {} |",
        steps.len(),
        ms(step_med),
        ms(step_p99),
        ms(w_med),
        pct(w_med, step_med),
        ms(w_p99),
        pct(w_p99, step_med),
        ms(quantile(work.clone(), 0.5)),
        ms(quantile(work, 0.99)),
    )
}

fn open(file: &str) -> Option<Box<dyn CausalLm>> {
    let path = paths::models_dir().join(file);
    if !path.exists() {
        eprintln!("SKIP: {} not present (run scripts/get_model.py)", path.display());
        return None;
    }
    let device = std::env::var("FERROLM_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into());
    let device = ferrolm_backend::parse_device(&device).expect("FERROLM_BENCH_DEVICE");
    Some(ferrolm_models::load(&ModelSource::open(&path).unwrap(), &device).expect("model loads"))
}

fn measure(file: &str, label: &str) {
    let Some(model) = open(file) else { return };
    let path = paths::models_dir().join(file);
    let tokenizer = Arc::new(ferrolm_text::Tokenizer::from_gguf_file(&path).unwrap());
    let eos = tokenizer.eos_ids().to_vec();
    let grammars = ferrolm_grammar::Grammars::new(tokenizer.clone(), &eos, model.info().vocab_size).unwrap();
    let setup = Setup { model: model.as_ref(), tokenizer, grammars, spec: ferrolm_grammar::ConstraintSpec::JsonSchema(schema()) };
    setup.run(1, 0, MaskSchedule::Serial); // warm-up
    for batch in [1, 16] {
        let mut steps: Vec<Vec<StepTime>> = SCHEDULES.iter().map(|_| Vec::new()).collect();
        // Schedules interleaved within each round (a busy machine drifts); the same seeds in a
        // round, so the same tokens and masks.
        for round in 0..ROUNDS {
            let seed = 1000 * round + 1;
            let mut first: Option<Vec<Trace>> = None;
            for (s, &schedule) in SCHEDULES.iter().enumerate() {
                let (traces, times) = setup.run(batch, seed, schedule);
                match &first {
                    Some(f) => assert!(f == &traces, "{schedule:?} delivered other tokens than Serial"),
                    None => first = Some(traces),
                }
                steps[s].extend(times);
            }
        }
        for (s, &schedule) in SCHEDULES.iter().enumerate() {
            println!("{}", row(label, batch, schedule, &steps[s]));
        }
    }
}

#[test]
#[ignore = "a measurement: bench/mask_cost.sh"]
fn mask_cost_per_step() {
    println!("| model (vocab) | batch | masks | steps | step median ms | step p99 ms | masks on the step's path, median ms (of median step) | p99 ms (of median step) | mask work median ms | work p99 ms |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    measure("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M Q4_1 (49,152)");
    measure("gemma-3-270m-Q4_K_M.gguf", "Gemma 3 270M Q4_K_M (262,144)");
}

/// 16 order documents, each valid under `schema()`, different in their strings and numbers
/// (so the 16 constraints walk different lexer states).
fn documents() -> Vec<String> {
    let names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra"];
    let tiers = ["free", "pro", "enterprise", "pro"];
    (0..16)
        .map(|i| {
            let (name, tier) = (names[i % 4], tiers[i / 4]);
            let email = format!("{}@example{i}.org", name.split(' ').next().unwrap().to_lowercase());
            format!(
                r#"{{"order_id": "ORD-{:06}", "created_at": "2026-12-{:02}T10:{:02}:00Z", "customer": {{"name": "{name}", "email": "{email}", "tier": "{tier}"}}, "items": [{{"sku": "KB-{i}", "description": "Mechanical keyboard number {i}, brown switches", "quantity": {}, "unit_price": {}.99}}], "notes": {}, "gift": {}}}"#,
                4217 + 31 * i,
                1 + i,
                3 * i,
                1 + i % 3,
                10 + 7 * i,
                if i % 2 == 0 { "null".to_string() } else { format!("\"Leave it with the concierge, order {i}.\"") },
                i % 3 == 0
            )
        })
        .collect()
}

/// The masks of 16 constrained rows per step with no model: each of 16 constraints fed its own
/// document token by token, all masks of a step computed serially or over the CPU pool
/// (`MaskSchedule::Parallel`, the threads the machine has), for as long as all 16 run. Shows
/// what computing them side by side saves on a machine of more cores than the dev machine's.
/// Tokenizers from `FERROLM_BENCH_TOKENIZERS` (folders `smollm2/` and `gemma3/` holding
/// tokenizer.json), else the models dir's hf/ folders.
#[test]
#[ignore = "a measurement: bench/mask_cost.sh"]
fn masks_of_sixteen_rows_over_threads() {
    use ferrolm_engine::masks::{with_forward, MaskJob, Premask};
    use ferrolm_engine::TokenConstraint;
    let base = std::env::var("FERROLM_BENCH_TOKENIZERS").map(std::path::PathBuf::from);
    let dirs = match &base {
        Ok(b) => [("SmolLM2 (49,152)", b.join("smollm2"), 49_152), ("Gemma 3 (262,144)", b.join("gemma3"), 262_144)],
        Err(_) => {
            let hf = paths::models_dir().join("hf");
            [("SmolLM2 (49,152)", hf.join("SmolLM2-135M-Instruct-bf16"), 49_152), ("Gemma 3 (262,144)", hf.join("gemma-3-270m-f32"), 262_144)]
        }
    };
    let threads = ferrolm_backend::cpu::threads::num_threads();
    println!("| vocab | masks | threads | steps | median ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|---|");
    for (label, dir, width) in dirs {
        let Ok(tokenizer) = ferrolm_text::Tokenizer::from_hf_dir(&dir) else {
            eprintln!("SKIP: no tokenizer in {}", dir.display());
            continue;
        };
        let tokenizer = Arc::new(tokenizer);
        let eos = tokenizer.eos_ids().to_vec();
        let grammars = ferrolm_grammar::Grammars::new(tokenizer.clone(), &eos, width).unwrap();
        let spec = ferrolm_grammar::ConstraintSpec::JsonSchema(schema());
        let docs: Vec<Vec<u32>> = documents().iter().map(|d| tokenizer.encode(d, false).unwrap()).collect();
        let steps = docs.iter().map(Vec::len).min().unwrap();
        for schedule in [MaskSchedule::Serial, MaskSchedule::Parallel, MaskSchedule::Serial, MaskSchedule::Parallel] {
            let mut cs: Vec<ferrolm_grammar::Constraint> = docs.iter().map(|_| grammars.compile(&spec).unwrap()).collect();
            let mut times = Vec::with_capacity(steps);
            for step in 0..steps {
                let mut slots: Vec<Premask> = vec![None; cs.len()];
                let mut jobs: Vec<MaskJob<'_>> = cs.iter_mut().zip(&mut slots).map(|(c, s)| MaskJob::new(c as &mut dyn TokenConstraint, s)).collect();
                let ((), t) = with_forward(schedule, true, &mut jobs, || ());
                times.push(t.waited);
                drop(jobs);
                for ((c, doc), slot) in cs.iter_mut().zip(&docs).zip(&slots) {
                    let mask = slot.as_ref().unwrap().as_ref().unwrap();
                    let t = doc[step];
                    assert!(mask[t as usize / 32] >> (t % 32) & 1 == 1, "the document's token {t} is allowed");
                    TokenConstraint::consume(c, t).unwrap();
                }
            }
            let worst = *times.iter().max().unwrap();
            println!("| {label} | {schedule:?} | {threads} | {steps} | {} | {} | {} |", ms(quantile(times.clone(), 0.5)), ms(quantile(times, 0.99)), ms(worst));
        }
    }
}
