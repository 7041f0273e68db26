//! Tool calls under `tool_choice: "required"` or a named function: the grammar accepts the chat
//! template's scaffold around valid arguments, refuses invalid arguments and unknown names,
//! forces the scaffold (jump-forward), and whatever a random walk produces parses with
//! ferrolm's own tool-call parser into a declared function with schema-valid arguments.

mod common;

use common::*;
use ferrolm_grammar::{
    Constraint, ConstraintSpec, Grammars, Status, ToolCallFormat, ToolCallSpec, ToolChoice, ToolSpec,
};
use ferrolm_text::{Tokenizer, ToolCallParser, ToolEvent};
use serde_json::{json, Value};

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "minLength": 1},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14}
            }, "required": ["city"], "additionalProperties": false}),
        },
        ToolSpec {
            name: "search_web".into(),
            parameters: json!({"type": "object", "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1}
            }, "required": ["query", "max_results"], "additionalProperties": false}),
        },
        ToolSpec { name: "get_time".into(), parameters: Value::Null },
    ]
}

fn spec(choice: ToolChoice, format: ToolCallFormat) -> ConstraintSpec {
    ConstraintSpec::ToolCalls(ToolCallSpec { tools: tools(), choice, format, parallel: true })
}

/// Feeds `text` as the model's tokenizer tokenizes it; the number of tokens accepted.
fn feed(c: &mut Constraint, tok: &Tokenizer, text: &str) -> Result<(), String> {
    let ids = tok.encode(text, false).unwrap();
    for t in ids {
        c.consume(t).map_err(|e| format!("{text:?}: {e}"))?;
    }
    Ok(())
}

fn qwen() -> Option<(std::sync::Arc<Tokenizer>, Grammars)> {
    load(QWEN25)
}

#[test]
fn the_hermes_scaffold_around_valid_arguments_is_accepted() {
    let Some((tok, g)) = qwen() else { return };
    // The format Qwen2.5's template teaches, and the one it detects.
    assert_eq!(ToolCallFormat::from_template(tok.chat_template().unwrap()), ToolCallFormat::Hermes);
    let one =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
    let two = format!("{one}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>");
    for text in [one.to_string(), two] {
        let mut c = g.compile(&spec(ToolChoice::Required, ToolCallFormat::Hermes)).unwrap();
        feed(&mut c, &tok, &text).unwrap();
        assert!(c.can_end(), "{text}");
        c.consume(tok.token_to_id("<|im_end|>").unwrap()).unwrap();
        assert_eq!(c.status(), Status::Accepted);
    }
}

#[test]
fn invalid_calls_are_refused() {
    let Some((tok, g)) = qwen() else { return };
    let bad = [
        // Argument of the wrong type, a missing required argument, an undeclared one.
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 3}}",
        "<tool_call>\n{\"name\": \"search_web\", \"arguments\": {\"query\": \"x\"}}",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\", \"zip\": 1}}",
        // An undeclared function, text instead of a call, a call outside the block.
        "<tool_call>\n{\"name\": \"delete_all\"",
        "Sure! Let me check.",
        "{\"name\": \"get_time\", \"arguments\": {}}",
    ];
    for text in bad {
        let mut c = g.compile(&spec(ToolChoice::Required, ToolCallFormat::Hermes)).unwrap();
        assert!(feed(&mut c, &tok, text).is_err(), "accepted {text:?}");
    }
    // A named function: the other tools are refused, and one call is the whole output.
    let mut c = g.compile(&spec(ToolChoice::Function("get_time".into()), ToolCallFormat::Hermes)).unwrap();
    assert!(feed(&mut c, &tok, "<tool_call>\n{\"name\": \"get_weather\"").is_err());
    let mut c = g.compile(&spec(ToolChoice::Function("get_time".into()), ToolCallFormat::Hermes)).unwrap();
    feed(&mut c, &tok, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>").unwrap();
    assert_eq!(c.status(), Status::Accepted, "nothing may follow the one call");
}

/// The scaffold is forced, in the model's own tokens (`<tool_call>` is Qwen's single token).
#[test]
fn the_scaffold_is_forced() {
    let Some((tok, g)) = qwen() else { return };
    let mut c = g.compile(&spec(ToolChoice::Required, ToolCallFormat::Hermes)).unwrap();
    // Up to the name; the last token or two stay unforced while a longer token could still
    // span them and what follows (` "` + the name's start).
    let forced = c.take_forced().unwrap();
    let text = tok.decode(&forced, false);
    assert!(text.len() >= "<tool_call>\n{\"name\":".len(), "{text:?}");
    assert!("<tool_call>\n{\"name\": \"".starts_with(&text), "{text:?}");
    assert_eq!(forced[0], tok.token_to_id("<tool_call>").unwrap());
    assert_eq!(forced, tok.encode(&text, false).unwrap(), "canonical tokens");
    feed(&mut c, &tok, &"<tool_call>\n{\"name\": \""[text.len()..]).unwrap();
    // `get_` is shared by two names: the choice is the model's; after "s" the rest is forced.
    feed(&mut c, &tok, "s").unwrap();
    let rest = tok.decode(&c.take_forced().unwrap(), false);
    assert!(rest.starts_with("earch_web\", \"arguments\":"), "{rest:?}");
    // A named function: everything up to its arguments.
    let mut c = g.compile(&spec(ToolChoice::Function("get_weather".into()), ToolCallFormat::Hermes)).unwrap();
    let forced = tok.decode(&c.take_forced().unwrap(), false);
    assert!(forced.starts_with("<tool_call>\n{\"name\": \"get_weather\", \"arguments\":"), "{forced:?}");
}

/// Whatever the model samples under the mask parses into declared calls with valid arguments.
fn random_calls_parse_and_validate(file: &str, format: ToolCallFormat, walks: u64) {
    let Some((tok, g)) = load(file) else { return };
    let validators: Vec<(String, jsonschema::Validator)> = tools()
        .iter()
        .map(|t| {
            let s = if t.parameters.is_null() {
                json!({"type": "object", "additionalProperties": false})
            } else {
                t.parameters.clone()
            };
            (t.name.clone(), jsonschema::validator_for(&s).unwrap())
        })
        .collect();
    let mut calls = 0;
    for seed in 0..walks {
        let mut c = g.compile(&spec(ToolChoice::Required, format)).unwrap();
        let w = walk(&mut c, &tok, &mut rng(seed), 60);
        if !w.accepted {
            eprintln!("unfinished after {} tokens: {:?}", w.tokens.len(), String::from_utf8_lossy(&w.bytes));
            continue;
        }
        let text = w.text();
        let mut parser = ToolCallParser::new(tools());
        let mut events = parser.push(&text);
        events.extend(parser.finish());
        assert!(!events.is_empty());
        for e in events {
            let call = match e {
                ToolEvent::Call(call) => call,
                // The newline between two blocks.
                ToolEvent::Content(s) if s.trim().is_empty() => continue,
                ToolEvent::Content(s) => panic!("not a call: {s:?} in {text:?}"),
            };
            let (_, v) = validators.iter().find(|(n, _)| *n == call.name).expect("a declared name");
            let args: Value = serde_json::from_str(&call.arguments).unwrap();
            assert!(v.is_valid(&args), "{} arguments {args} in {text:?}", call.name);
            calls += 1;
        }
    }
    assert!(calls >= walks as usize / 2, "only {calls} calls from {walks} walks");
}

#[test]
fn random_hermes_calls_parse_and_validate_qwen() {
    random_calls_parse_and_validate(QWEN25, ToolCallFormat::Hermes, 24);
}

#[test]
fn random_json_calls_parse_and_validate_smollm2() {
    random_calls_parse_and_validate(SMOLLM2, ToolCallFormat::Json, 24);
}

/// A Hugging Face tokenizer.json (Qwen2.5's, as `scripts/hf_folders.py` writes it): the
/// added token `<tool_call>` is forced as its one token there too.
#[test]
fn the_scaffold_is_forced_with_a_tokenizer_json() {
    let dir = models_dir().join("hf/qwen2.5-coder-0.5b-instruct-f32");
    if !dir.exists() {
        eprintln!("SKIP: {} not found (scripts/hf_folders.py)", dir.display());
        return;
    }
    let tok = std::sync::Arc::new(Tokenizer::from_hf_dir(&dir).unwrap());
    let g = Grammars::new(tok.clone(), tok.eos_ids(), 151_936).unwrap();
    let mut c = g.compile(&spec(ToolChoice::Function("get_time".into()), ToolCallFormat::Hermes)).unwrap();
    let forced = c.take_forced().unwrap();
    assert_eq!(forced[0], 151_657, "{:?}", tok.decode(&forced, false));
    assert!(tok.decode(&forced, false).starts_with("<tool_call>\n{\"name\": \"get_time\", \"arguments\":"));
}
