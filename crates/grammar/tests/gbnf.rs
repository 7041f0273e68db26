//! GBNF (llama-server's `grammar`) against llama.cpp's own parser: tests/fixtures/gbnf/corpus.json
//! (scripts/fixtures/gbnf_corpus.py) holds llama.cpp's example grammars and the grammars of its
//! tests/test-grammar-integration.cpp, with strings that llama.cpp's GBNF parser labelled as
//! matching or not. Each grammar's translation must accept exactly the strings llama.cpp
//! accepts (fed as SmolLM2's tokens through the compiled constraint), and must be refused
//! exactly when llama.cpp refuses it (plus token references, which ferrolm refuses).

mod common;

use std::path::PathBuf;

use common::*;
use ferrolm_grammar::{gbnf_to_lark, ConstraintSpec, GrammarError, Grammars, Status};
use ferrolm_text::Tokenizer;
use serde_json::Value;

fn corpus() -> Vec<Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gbnf/corpus.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["grammars"].as_array().unwrap().clone()
}

/// Whether the constraint accepts `text` as a whole output.
fn accepts(grammars: &Grammars, tok: &Tokenizer, grammar: &str, text: &str) -> bool {
    let mut c = grammars.compile(&ConstraintSpec::Gbnf(grammar.to_string())).unwrap();
    let tokens = tok.encode(text, false).unwrap();
    if c.accepted_prefix(&tokens) < tokens.len() {
        return false;
    }
    c.consume_all(&tokens).unwrap();
    c.status() == Status::Accepted || c.can_end()
}

fn uses_tokens(grammar: &str) -> bool {
    grammar.contains("<[") || grammar.contains("!<")
}

#[test]
fn translations_match_llama_cpp_on_its_corpus() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let (mut strings, mut mismatches) = (0, Vec::new());
    for g in corpus() {
        let (name, grammar) = (g["name"].as_str().unwrap(), g["grammar"].as_str().unwrap());
        let compiled = grammars.compile(&ConstraintSpec::Gbnf(grammar.to_string()));
        if !g["builds"].as_bool().unwrap() {
            assert!(compiled.is_err(), "{name}: llama.cpp refuses it, we compiled it:\n{grammar}");
            continue;
        }
        if uses_tokens(grammar) {
            let e = compiled.unwrap_err().to_string();
            assert!(e.contains("token references"), "{name}: {e}");
            continue;
        }
        compiled.unwrap_or_else(|e| panic!("{name}: llama.cpp builds it, we refused it: {e}"));
        for case in g["cases"].as_array().unwrap() {
            let (text, want) = (case["text"].as_str().unwrap(), case["matches"].as_bool().unwrap());
            strings += 1;
            if accepts(&grammars, &tok, grammar, text) != want {
                mismatches.push(format!("{name}: {text:?} llama.cpp says {want}"));
            }
        }
    }
    assert!(mismatches.is_empty(), "{} of {strings} differ:\n{}", mismatches.len(), mismatches.join("\n"));
    assert!(strings >= 900, "only {strings} strings checked");
}

/// Every bad-grammar error names `grammar` and says where.
#[test]
fn bad_gbnf_is_refused_with_line_and_column() {
    let e = gbnf_to_lark("root ::= item+\nitem ::= \"- \" [^\\n+ \"\\n\"\n").unwrap_err();
    let GrammarError::Invalid { field, message } = &e else { panic!("{e:?}") };
    assert_eq!(*field, "grammar");
    assert_eq!(message, "GBNF line 2, column 15: unterminated character class (it starts here)");
}

/// Random walks under llama.cpp's json.gbnf (a recursive grammar: one-character lexemes) end
/// in text that parses as JSON (serde_json, an oracle independent of both grammars); prints the
/// time per token (mask + consume) next to `response_format: json_object`'s.
#[test]
fn json_gbnf_walks_parse_as_json() {
    let Some((tok, grammars)) = load(SMOLLM2) else { return };
    let entry = corpus().into_iter().find(|g| g["name"] == "grammars/json.gbnf").unwrap();
    let gbnf = ConstraintSpec::Gbnf(entry["grammar"].as_str().unwrap().to_string());
    let mut rng = rng(33);
    let mut per_token = |spec: &ConstraintSpec| {
        let mut times = Vec::new();
        for _ in 0..8 {
            let mut c = grammars.compile(spec).unwrap();
            let t0 = std::time::Instant::now();
            let w = walk(&mut c, &tok, &mut rng, 40);
            times.push(t0.elapsed().as_secs_f64() * 1e3 / w.tokens.len().max(1) as f64);
            assert!(w.accepted, "walk not accepted: {:?}", w.text());
            let v: Value = serde_json::from_str(&w.text()).unwrap_or_else(|e| panic!("{e}: {:?}", w.text()));
            assert!(v.is_object());
        }
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let (g, j) = (per_token(&gbnf), per_token(&ConstraintSpec::JsonObject));
    eprintln!(
        "per token (mask + consume), median of 8 walks, busy machine: json.gbnf {g:.2} ms, json_object {j:.2} ms"
    );
}
