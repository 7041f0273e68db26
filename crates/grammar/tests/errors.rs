//! Constraints that cannot be built are refused before any generation, with a typed error
//! naming the request field and what is wrong (the server's 400).

mod common;

use common::*;
use ferrolm_grammar::{ConstraintSpec, GrammarError, Grammars, ToolCallFormat, ToolCallSpec, ToolChoice, ToolSpec};
use serde_json::{json, Value};

/// The error for `spec`, which must be `Invalid` on `field`; its message.
fn refused(grammars: &Grammars, spec: ConstraintSpec, field: &str) -> String {
    match grammars.compile(&spec) {
        Ok(_) => panic!("{spec:?} compiled"),
        Err(GrammarError::Invalid { field: f, message }) => {
            eprintln!("{field}: {message}");
            assert_eq!(f, field, "{message}");
            assert!(!message.contains("non-verbose"), "{message}");
            message
        }
        Err(e) => panic!("not an invalid-request error: {e:?}"),
    }
}

fn schema(v: Value) -> ConstraintSpec {
    ConstraintSpec::JsonSchema(v)
}

#[test]
fn unsupported_schema_keywords_are_named_not_ignored() {
    let Some((_, g)) = load(SMOLLM2) else { return };
    let m =
        refused(&g, schema(json!({"type": "array", "items": {"type": "integer"}, "uniqueItems": true})), "json_schema");
    assert!(m.contains("uniqueItems"), "{m}");
    let m = refused(
        &g,
        schema(json!({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}})),
        "json_schema",
    );
    assert!(m.contains("if") && m.contains("then"), "{m}");
    // The rest of what docs/grammar.md lists as refused.
    let cases = [
        (json!({"not": {"type": "string"}}), "not"),
        (json!({"type": "array", "contains": {"type": "integer"}}), "contains"),
        (json!({"type": "object", "dependentRequired": {"a": ["b"]}}), "dependentRequired"),
        (json!({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}), "propertyNames"),
        (json!({"type": "string", "format": "iri"}), "iri"),
        (json!({"$ref": "https://example.com/schemas/person.json"}), "example.com"),
    ];
    for (s, word) in cases {
        let m = refused(&g, schema(s), "json_schema");
        assert!(m.contains(word), "{word}: {m}");
    }
    // oneOf is enforced where its branches cannot overlap (different types)…
    assert!(g.compile(&schema(json!({"oneOf": [{"type": "string"}, {"type": "integer"}]}))).is_ok());
    // …and refused where anyOf would let an instance match two branches.
    let overlapping = json!({"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}},
        {"type": "object", "properties": {"b": {"type": "string"}}}
    ]});
    let m = refused(&g, schema(overlapping), "json_schema");
    assert!(m.contains("oneOf"), "{m}");
}

#[test]
fn invalid_schemas_are_refused() {
    let Some((_, g)) = load(SMOLLM2) else { return };
    let m = refused(&g, schema(json!({"type": "strung"})), "json_schema");
    assert!(m.contains("strung"), "{m}");
    let m = refused(&g, schema(json!({"$ref": "#/$defs/missing"})), "json_schema");
    assert!(m.contains("missing"), "{m}");
    let m = refused(&g, schema(json!({"type": "integer", "minimum": 5, "maximum": 1})), "json_schema");
    assert!(m.to_lowercase().contains("unsatisfiable") || m.contains("minimum"), "{m}");
    let m = refused(&g, schema(json!(false)), "json_schema");
    assert!(m.contains("false"), "{m}");
    refused(&g, schema(json!([1, 2])), "json_schema");
    let m = refused(&g, schema(json!({"type": "string", "pattern": "(unclosed"})), "json_schema");
    assert!(m.contains("unclosed") || m.to_lowercase().contains("regex"), "{m}");
}

#[test]
fn bad_regexes_grammars_and_choices_are_refused() {
    let Some((_, g)) = load(SMOLLM2) else { return };
    let m = refused(&g, ConstraintSpec::Regex("[a-z".into()), "regex");
    assert!(m.to_lowercase().contains("class") || m.contains("[a-z"), "{m}");
    let m = refused(&g, ConstraintSpec::Lark("start: item+\n".into()), "grammar");
    assert!(m.contains("item"), "{m}");
    let m = refused(&g, ConstraintSpec::Lark("start: \"a\" (\n".into()), "grammar");
    assert!(!m.is_empty());
    refused(&g, ConstraintSpec::Lark("  \n".into()), "grammar");
    refused(&g, ConstraintSpec::Choice(vec![]), "choice");
    let m = refused(&g, ConstraintSpec::Lark("start: <|no_such_token|>\n".into()), "grammar");
    assert!(m.contains("no_such_token"), "{m}");
}

fn tools(spec: Vec<(&str, Value)>, choice: ToolChoice) -> ConstraintSpec {
    let tools = spec.into_iter().map(|(n, p)| ToolSpec { name: n.into(), parameters: p }).collect();
    ConstraintSpec::ToolCalls(ToolCallSpec { tools, choice, format: ToolCallFormat::Hermes, parallel: true })
}

#[test]
fn bad_tools_are_refused_naming_the_tool() {
    let Some((_, g)) = load(SMOLLM2) else { return };
    let ok = json!({"type": "object", "properties": {"q": {"type": "string"}}});
    let bad = json!({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": true}}});
    let m = refused(&g, tools(vec![("search", ok.clone()), ("tag", bad)], ToolChoice::Required), "tools");
    assert!(m.contains("tools[1]") && m.contains("'tag'") && m.contains("uniqueItems"), "{m}");
    let m = refused(&g, tools(vec![("search", ok.clone())], ToolChoice::Function("find".into())), "tools");
    assert!(m.contains("'find'"), "{m}");
    let m = refused(&g, tools(vec![("a", ok.clone()), ("a", ok.clone())], ToolChoice::Required), "tools");
    assert!(m.contains("twice"), "{m}");
    let m = refused(&g, tools(vec![("s", json!({"type": "string"}))], ToolChoice::Required), "tools");
    assert!(m.contains("'object'"), "{m}");
    refused(&g, tools(vec![], ToolChoice::Required), "tools");
}
