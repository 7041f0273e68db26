//! The real-schema corpus (`tests/json_schemas`: SchemaStore's self-contained schemas, see its
//! README): every schema either compiles or is refused with an `Invalid` error naming why, and
//! every output of seeded random walks under a compiled schema parses and validates against
//! it (the `jsonschema` crate, formats asserted).

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use ferrolm_grammar::{ConstraintSpec, GrammarError};
use serde_json::Value;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/json_schemas")
}

/// (file name, schema) in index order.
fn corpus() -> Vec<(String, Value)> {
    let dir = corpus_dir();
    let index: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    index
        .iter()
        .map(|e| {
            let file = e["file"].as_str().unwrap().to_string();
            let text = std::fs::read_to_string(dir.join("schemastore").join(&file)).unwrap();
            (file, serde_json::from_str(&text).unwrap())
        })
        .collect()
}

/// What the corpus run found, for the summary line and the assertions.
#[derive(Default)]
struct Tally {
    compiled: usize,
    refused: BTreeMap<String, usize>,
    walks: usize,
    accepted: usize,
    invalid: Vec<String>,
    /// Schemas the validator cannot read (a pattern outside its regex dialects).
    no_oracle: Vec<String>,
}

/// The oracle for a schema (None when it refuses one of the schema's patterns: its dialect is
/// ECMA-262's, llguidance's is Rust's).
fn validator(schema: &Value) -> Option<jsonschema::Validator> {
    jsonschema::options().should_validate_formats(true).build(schema).ok()
}

#[test]
fn corpus_outputs_parse_and_validate_smollm2() {
    let t = run(SMOLLM2, 1, 2);
    assert!(
        t.compiled - t.no_oracle.len() >= 100,
        "only {} schemas compiled and checked",
        t.compiled - t.no_oracle.len()
    );
}

/// Every third schema with Gemma 3's 262,144-token vocabulary.
#[test]
fn corpus_outputs_parse_and_validate_gemma3() {
    run(GEMMA3, 3, 1);
}

/// Walks `walks` times under every `stride`-th schema; asserts that every finished output
/// parses and validates and that at least 90% of walks finished.
fn run(model: &str, stride: usize, walks: u64) -> Tally {
    let Some((tok, grammars)) = load(model) else { return Tally { compiled: usize::MAX, ..Tally::default() } };
    let schemas = corpus();
    assert!(schemas.len() >= 100, "the corpus has {} schemas", schemas.len());
    let mut t = Tally::default();
    for (i, (file, schema)) in schemas.iter().enumerate().step_by(stride) {
        let constraint = match grammars.compile(&ConstraintSpec::JsonSchema(schema.clone())) {
            Ok(c) => c,
            Err(GrammarError::Invalid { message, .. }) => {
                *t.refused.entry(reason(&message)).or_default() += 1;
                continue;
            }
            Err(e) => panic!("{file}: not an invalid-request error: {e}"),
        };
        t.compiled += 1;
        let validator = validator(schema);
        if validator.is_none() {
            t.no_oracle.push(file.clone());
        }
        for seed in 0..walks {
            let mut c = constraint.clone();
            let w = walk(&mut c, &tok, &mut rng(1000 * i as u64 + seed), 48);
            t.walks += 1;
            if !w.accepted {
                eprintln!("{file}: unfinished after {} tokens", w.tokens.len());
                continue;
            }
            t.accepted += 1;
            let text = w.text();
            match serde_json::from_str::<Value>(&text) {
                Ok(v) => {
                    let Some(validator) = &validator else { continue };
                    let errors: Vec<String> =
                        validator.iter_errors(&v).map(|e| format!("{} at {}", e, e.instance_path)).collect();
                    if !errors.is_empty() {
                        t.invalid.push(format!("{file}: {errors:?} in {text}"));
                    }
                }
                Err(e) => t.invalid.push(format!("{file}: does not parse ({e}): {text}")),
            }
        }
    }
    eprintln!(
        "corpus ({model}, every {stride}): {} schemas, {} compiled, {} refused {:?}; no validator for {:?}; {} walks, {} finished, {} invalid",
        schemas.len().div_ceil(stride),
        t.compiled,
        schemas.len().div_ceil(stride) - t.compiled,
        t.refused,
        t.no_oracle,
        t.walks,
        t.accepted,
        t.invalid.len()
    );
    assert!(t.invalid.is_empty(), "outputs that do not validate:\n{}", t.invalid.join("\n"));
    assert!(t.accepted * 10 >= t.walks * 9, "only {} of {} walks finished", t.accepted, t.walks);
    t
}

/// An error message's gist, for the tally (`Unimplemented keys: ["if", "then"]` → `if`).
fn reason(message: &str) -> String {
    let first = message.lines().next().unwrap_or("");
    match first.strip_prefix("Unimplemented keys: ") {
        Some(keys) => format!("unimplemented {keys}"),
        None => first.chars().take(60).collect(),
    }
}
