//! A constraint after a prompt that opened the model's reasoning: the reasoning is free text up
//! to the end tag, the constraint binds the answer after it.

mod common;

use common::*;
use ferrolm_grammar::{Constraint, ConstraintSpec};
use ferrolm_text::Tokenizer;
use serde_json::json;

fn after_think(answer: ConstraintSpec) -> ConstraintSpec {
    ConstraintSpec::AfterReasoning { end: "</think>".into(), answer: Box::new(answer) }
}

/// Feeds `text` token by token; the number of tokens accepted before the first refusal.
fn accepted(c: &mut Constraint, tok: &Tokenizer, text: &str) -> (usize, usize) {
    let ids = tok.encode(text, false).unwrap();
    let n = ids.iter().take_while(|&&t| c.consume(t).is_ok()).count();
    (n, ids.len())
}

#[test]
fn the_answer_after_the_reasoning_follows_the_schema() {
    let Some((tok, g)) = load(SMOLLM2) else { return };
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
    let spec = after_think(ConstraintSpec::JsonSchema(schema));
    // Reasoning may hold anything, braces and tags included, until the first end tag.
    let mut c = g.compile(&spec).unwrap();
    let (n, all) = accepted(&mut c, &tok, "Let me think: {\"b\": x} <think>?\nSo a is 1.</think>\n\n{\"a\": 1}");
    assert_eq!(n, all);
    assert!(c.can_end(), "a finished answer may end");
    // Without blank space after the tag too.
    let mut c = g.compile(&spec).unwrap();
    assert_eq!(accepted(&mut c, &tok, "ok</think>{\"a\": 2}").0, tok.encode("ok</think>{\"a\": 2}", false).unwrap().len());
    // After the tag, text that is not the schema's JSON is refused.
    let mut c = g.compile(&spec).unwrap();
    let (n, all) = accepted(&mut c, &tok, "ok</think>\nThe answer is 1");
    assert!(n < all, "free text after the reasoning must be refused");
    let mut c = g.compile(&spec).unwrap();
    let (n, all) = accepted(&mut c, &tok, "ok</think>{\"b\": 1}");
    assert!(n < all, "a key outside the schema must be refused");
    // The reasoning alone is not a finished output.
    let mut c = g.compile(&spec).unwrap();
    accepted(&mut c, &tok, "still thinking");
    assert!(!c.can_end());
}

#[test]
fn choices_and_objects_after_the_reasoning() {
    let Some((tok, g)) = load(SMOLLM2) else { return };
    let mut c = g.compile(&after_think(ConstraintSpec::Choice(vec!["yes".into(), "no".into()]))).unwrap();
    let text = "Hmm.</think>\nno";
    assert_eq!(accepted(&mut c, &tok, text).0, tok.encode(text, false).unwrap().len());
    assert!(c.can_end());
    let mut c = g.compile(&after_think(ConstraintSpec::JsonObject)).unwrap();
    let text = "x</think>\n{\"k\": [1, 2]}";
    assert_eq!(accepted(&mut c, &tok, text).0, tok.encode(text, false).unwrap().len());
    assert!(c.can_end());
}

#[test]
fn regexes_and_grammars_after_the_reasoning_are_refused_by_name() {
    let Some((_, g)) = load(SMOLLM2) else { return };
    let err = g.compile(&after_think(ConstraintSpec::Regex("[a-z]+".into()))).unwrap_err().to_string();
    assert!(err.contains("regex") && err.contains("enable_thinking"), "{err}");
    let err = g.compile(&after_think(ConstraintSpec::Lark("start: \"a\"".into()))).unwrap_err().to_string();
    assert!(err.contains("grammar"), "{err}");
}

/// GBNF is translated by ferrolm, so it can bind the answer after the reasoning: a regular
/// grammar (one terminal) and a recursive one (rules over one-character lexemes).
#[test]
fn gbnf_after_the_reasoning_binds_the_answer() {
    let Some((tok, g)) = load(SMOLLM2) else { return };
    let cases = [
        ("root ::= (\"yes\" | \"no\") \".\"", [("Hmm (a).</think>\nno.", true), ("x</think>((abc.))", false)]),
        ("root ::= \"(\" root \")\" | [a-z]+ \".\"", [("x</think>((abc.))", true), ("x</think>((abc.)", false)]),
    ];
    for (gbnf, texts) in cases {
        let spec = after_think(ConstraintSpec::Gbnf(gbnf.into()));
        for (text, ok) in texts {
            let mut c = g.compile(&spec).unwrap();
            let (n, all) = accepted(&mut c, &tok, text);
            assert_eq!(n == all && c.can_end(), ok, "{gbnf} on {text:?}");
        }
        let mut c = g.compile(&spec).unwrap();
        let (n, all) = accepted(&mut c, &tok, "ok</think>\nThe answer");
        assert!(n < all, "{gbnf}: free text after the reasoning must be refused");
    }
}
