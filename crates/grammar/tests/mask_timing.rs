//! The mask's cost per decode step (issue 33's goal: median ≤ 3% of a decode step), at
//! SmolLM2's 49,152 and Gemma 3's 262,144 tokens, single-threaded: a realistic JSON document
//! valid under a schema, fed token by token as the model's tokenizer splits it, `mask()` timed
//! at every step. Ignored by default (a measurement, not a check):
//!
//!     cargo test --release -p ferrolm-grammar --test mask_timing -- --ignored --nocapture

mod common;

use std::time::{Duration, Instant};

use common::*;
use ferrolm_grammar::{ConstraintSpec, Grammars};
use ferrolm_text::Tokenizer;
use serde_json::json;

fn schema() -> serde_json::Value {
    json!({
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

const DOCUMENT: &str = r#"{"order_id": "ORD-004217", "created_at": "2026-12-07T10:15:00Z", "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "tier": "pro"}, "items": [{"sku": "KB-87", "description": "Mechanical keyboard, brown switches, US layout", "quantity": 1, "unit_price": 129.99}, {"sku": "USB-C-2M", "description": "Braided USB-C cable, two metres", "quantity": 3, "unit_price": 12.5}], "notes": "Please leave the parcel with the concierge if nobody answers.", "gift": false}"#;

struct Timing {
    /// The slowest steps: (time, the text before that step's token).
    slowest: Vec<(Duration, String)>,
    steps: usize,
    first: Duration,
    median: Duration,
    p99: Duration,
    max: Duration,
}

/// Feeds `text` token by token under `spec`, timing every `mask()` call (the first apart: it
/// includes the lexer's first states).
fn time_masks(tok: &Tokenizer, grammars: &Grammars, spec: &ConstraintSpec, text: &str) -> Timing {
    let ids = tok.encode(text, false).unwrap();
    let mut c = grammars.compile(spec).unwrap();
    let mut times = Vec::with_capacity(ids.len());
    for &t in &ids {
        let start = Instant::now();
        let mask = c.mask().unwrap();
        times.push(start.elapsed());
        assert!(bit(mask, t), "the document's own token {t} is not allowed");
        c.consume(t).unwrap();
    }
    assert!(c.can_end());
    let mut by_time: Vec<(Duration, String)> =
        times.iter().enumerate().map(|(i, &d)| (d, tail(&tok.decode(&ids[..i], false)))).collect();
    by_time.sort_by_key(|step| std::cmp::Reverse(step.0));
    by_time.truncate(3);
    let first = times[0];
    let mut rest = times[1..].to_vec();
    rest.sort();
    let at = |q: f64| rest[((rest.len() - 1) as f64 * q).round() as usize];
    Timing { slowest: by_time, steps: ids.len(), first, median: at(0.5), p99: at(0.99), max: *rest.last().unwrap() }
}

/// The last characters of a prefix, for naming a step.
fn tail(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(24)..].iter().collect()
}

fn report(model: &str, step_ms: f64) {
    let Some((tok, _)) = load(model) else { return };
    let start = Instant::now();
    let grammars = Grammars::new(tok.clone(), tok.eos_ids(), tok.vocab_size()).unwrap();
    println!("{model}: Grammars::new {:.0} ms", start.elapsed().as_secs_f64() * 1e3);
    let start = Instant::now();
    grammars.compile(&ConstraintSpec::JsonSchema(schema())).unwrap();
    println!("{model}: compiling the order schema {:.2} ms", start.elapsed().as_secs_f64() * 1e3);
    let cases =
        [("json_schema (order)", ConstraintSpec::JsonSchema(schema())), ("json_object", ConstraintSpec::JsonObject)];
    for (name, spec) in cases {
        // Three passes, the last reported: fresh constraints each time, warm caches in the
        // shared trie and allocator, as in a server that has already answered a request.
        let mut timing = time_masks(&tok, &grammars, &spec, DOCUMENT);
        for _ in 0..2 {
            timing = time_masks(&tok, &grammars, &spec, DOCUMENT);
        }
        let pct = |d: Duration| 100.0 * d.as_secs_f64() * 1e3 / step_ms;
        println!(
            "{model} (vocab {}), {name}: {} steps; first {:.0} µs; median {:.0} µs ({:.1}% of a {step_ms} ms step), p99 {:.0} µs ({:.1}%), max {:.0} µs",
            tok.vocab_size(),
            timing.steps,
            timing.first.as_secs_f64() * 1e6,
            timing.median.as_secs_f64() * 1e6,
            pct(timing.median),
            timing.p99.as_secs_f64() * 1e6,
            pct(timing.p99),
            timing.max.as_secs_f64() * 1e6,
        );
        for (d, at) in &timing.slowest {
            println!("    {:.0} µs after …{at:?}", d.as_secs_f64() * 1e6);
        }
    }
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn mask_time_per_step() {
    // Decode step times on the 2-core dev machine (docs/STATUS.md): SmolLM2 ~4 ms, Gemma 3 ~9 ms.
    report(SMOLLM2, 4.0);
    report(GEMMA3, 9.0);
}
