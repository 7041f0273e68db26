//! Forced tokens (jump-forward): text the grammar leaves no choice about comes back as the
//! model's own tokens, and taking it by jump-forward gives exactly the tokens that stepping
//! the one-token masks would.

mod common;

use common::*;
use ferrolm_grammar::{Constraint, ConstraintSpec, Status};
use ferrolm_text::Tokenizer;
use serde_json::json;

fn long_keys() -> ConstraintSpec {
    ConstraintSpec::JsonSchema(json!({
        "type": "object",
        "properties": {
            "customer_billing_address_line_one": {"type": "string"},
            "customer_billing_postal_code": {"type": "integer"},
            "preferred_delivery_window": {"enum": ["morning_before_noon", "afternoon_after_lunch"]}
        },
        "required": ["customer_billing_address_line_one", "customer_billing_postal_code", "preferred_delivery_window"],
        "additionalProperties": false
    }))
}

fn feed(c: &mut Constraint, tok: &Tokenizer, text: &str) {
    c.consume_all(&tok.encode(text, false).unwrap()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
}

/// The forced text, checked to be the tokenizer's own tokens for it.
fn forced_text(c: &mut Constraint, tok: &Tokenizer) -> String {
    let forced = c.take_forced().unwrap();
    let text = tok.decode(&forced, false);
    assert_eq!(forced, tok.encode(&text, false).unwrap(), "canonical tokens for {text:?}");
    text
}

#[test]
fn long_fixed_keys_are_forced() {
    for model in [SMOLLM2, GEMMA3] {
        let Some((tok, g)) = load(model) else { return };
        let mut c = g.compile(&long_keys()).unwrap();
        // Whitespace may follow `{`: nothing is forced before the model opens the key.
        feed(&mut c, &tok, "{\"");
        let key = forced_text(&mut c, &tok);
        // Up to the closing quote at least: `"` may merge with what follows (`":`).
        assert!(key.starts_with("customer_billing_address_line_one"), "{model}: {key:?}");
        feed(&mut c, &tok, &"customer_billing_address_line_one\": \"1 Main St\", \""[key.len()..]);
        let key = forced_text(&mut c, &tok);
        assert!(key.starts_with("customer_billing_postal_code"), "{model}: {key:?}");
        feed(&mut c, &tok, &"customer_billing_postal_code\": 12345, \""[key.len()..]);
        let key = forced_text(&mut c, &tok);
        assert!(key.starts_with("preferred_delivery_window"), "{model}: {key:?}");
        // An enum value is forced from its first distinguishing character.
        feed(&mut c, &tok, &"preferred_delivery_window\": \"a"[key.len()..]);
        let value = forced_text(&mut c, &tok);
        assert!("fternoon_after_lunch\"}".starts_with(&value) && value.len() >= 12, "{model}: {value:?}");
    }
}

/// Jump-forward and one-token masks agree token for token: the text is the same with it on
/// and off (what greedy decoding would see).
#[test]
fn jump_forward_equals_stepping_the_masks() {
    let Some((tok, g)) = load(SMOLLM2) else { return };
    let spec = ConstraintSpec::JsonSchema(json!({
        "type": "object",
        "properties": {"status_code_of_the_request": {"const": "accepted_for_processing"}, "n": {"type": "integer"}},
        "required": ["status_code_of_the_request", "n"],
        "additionalProperties": false,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}
    }));
    let mut jumped = g.compile(&spec).unwrap();
    let mut stepped = jumped.clone();
    let full = r#"{"status_code_of_the_request": "accepted_for_processing", "n": 7}"#;
    let forced = jumped.take_forced().unwrap();
    let text = tok.decode(&forced, false);
    assert!(text.starts_with(r#"{"status_code_of_the_request": "accepted_for_processing""#), "{text:?}");
    let mut steps = Vec::new();
    while steps.len() < forced.len() {
        let only = allowed(stepped.mask().unwrap());
        assert_eq!(only.len(), 1, "a forced position allows one token");
        stepped.consume(only[0]).unwrap();
        steps.push(only[0]);
    }
    assert_eq!(steps, forced);
    assert_eq!(stepped.mask().unwrap(), jumped.mask().unwrap());
    for c in [&mut jumped, &mut stepped] {
        feed(c, &tok, &full[text.len()..]);
        assert_eq!(c.status(), Status::Accepted);
    }
}
