//! Structured output from the server's side: which request field asks for which constraint,
//! compiling it off the HTTP worker (a 400 naming the field when it cannot be built), and the
//! per-choice constraint handed to the engine. The grammar machinery itself is
//! `ferrolm-grammar` (llguidance); the field mapping is in docs/grammar.md.
//!
//! Fields, one at most per request:
//! - OpenAI `response_format` (`json_object`, `json_schema`; llama-server's `json_object` with a
//!   `schema`), llama-server's top-level `json_schema`;
//! - vLLM's `guided_json`, `guided_regex`, `guided_grammar` (llguidance's Lark), `guided_choice`
//!   and their newer form `structured_outputs: {json | regex | grammar | choice}`;
//! - llama-server's `grammar` (llama.cpp's GBNF, translated to Lark by `ferrolm-grammar`);
//! - `tool_choice` `required` or a named function (chat): the tools' own call format, arguments
//!   valid under each tool's schema (see `for_tools`).

use crate::errors::{ApiError, ApiResult};
use crate::state::SharedState;
use ferrolm_engine::TokenConstraint;
use ferrolm_grammar::{Constraint, ConstraintSpec, GrammarError, ToolCallFormat, ToolCallSpec, ToolChoice, ToolSpec};
use serde_json::{Map, Value};

/// vLLM's guided-decoding fields: (field, its key in `structured_outputs`).
const GUIDED: &[(&str, &str)] =
    &[("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"), ("guided_choice", "choice")];

/// Every field that asks for a constraint (so that two of them are refused, not merged).
pub const FIELDS: &[&str] = &[
    "response_format", "json_schema", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
    "structured_outputs", "grammar",
];

/// What a request constrains its output to, and through which field (the 400's `param`).
#[derive(Debug, Clone)]
pub struct Requested {
    pub spec: ConstraintSpec,
    pub field: &'static str,
}

/// The constraint an OpenAI body (chat or completions) asks for, if any.
pub fn from_body(body: &Map<String, Value>) -> ApiResult<Option<Requested>> {
    let given: Vec<&'static str> =
        FIELDS.iter().copied().filter(|f| body.get(*f).is_some_and(|v| !asks_nothing(f, v))).collect();
    let field = match given[..] {
        [] => return Ok(None),
        [one] => one,
        _ => {
            let msg = format!("only one of {} may constrain the output", given.join(", "));
            return Err(ApiError::invalid(msg, Some(given[1])));
        }
    };
    let value = &body[field];
    let spec = match field {
        "response_format" => ConstraintSpec::from_response_format(value).map_err(|e| invalid(field, e))?,
        "json_schema" => Some(json_schema(field, value)?),
        "structured_outputs" => Some(structured_outputs(value)?),
        "grammar" => Some(gbnf(value)?),
        _ => {
            let kind = GUIDED.iter().find(|(f, _)| *f == field).map(|(_, k)| *k).unwrap_or("json");
            Some(guided(field, kind, value)?)
        }
    };
    Ok(spec.map(|spec| Requested { spec, field }))
}

/// Values that ask for no constraint: null, `response_format: {"type": "text"}`, llama-server's
/// default `grammar: ""`.
fn asks_nothing(field: &str, v: &Value) -> bool {
    v.is_null()
        || (field == "response_format" && v.get("type").and_then(Value::as_str) == Some("text"))
        || (field == "grammar" && v.as_str() == Some(""))
}

/// llama-server's `grammar`: GBNF text (translated, and refused with the line and column when
/// it is not valid GBNF, when compiled).
fn gbnf(v: &Value) -> ApiResult<ConstraintSpec> {
    let s = v.as_str().ok_or_else(|| ApiError::invalid("grammar must be a string (a GBNF grammar)", Some("grammar")))?;
    Ok(ConstraintSpec::Gbnf(s.to_string()))
}

/// vLLM's `structured_outputs`: an object with exactly one of `json`, `regex`, `grammar`,
/// `choice` (other keys, e.g. `disable_any_whitespace`, are refused rather than ignored).
fn structured_outputs(v: &Value) -> ApiResult<ConstraintSpec> {
    const FIELD: &str = "structured_outputs";
    let obj = v.as_object().ok_or_else(|| ApiError::invalid(format!("{FIELD} must be an object"), Some(FIELD)))?;
    let keys: Vec<&String> = obj.keys().filter(|k| !obj[k.as_str()].is_null()).collect();
    let [key] = keys[..] else {
        let msg = format!("{FIELD} must hold exactly one of json, regex, grammar, choice");
        return Err(ApiError::invalid(msg, Some(FIELD)));
    };
    if !GUIDED.iter().any(|(_, k)| k == key) {
        let msg = format!("{FIELD}.{key} is not supported by this server (json, regex, grammar or choice)");
        return Err(ApiError::invalid(msg, Some(FIELD)));
    }
    guided(FIELD, key, &obj[key.as_str()])
}

/// One guided-decoding value of `kind` (json, regex, grammar, choice).
fn guided(field: &'static str, kind: &str, v: &Value) -> ApiResult<ConstraintSpec> {
    let bad = |what: &str| ApiError::invalid(format!("{field} must be {what}"), Some(field));
    match kind {
        "json" => json_schema(field, v),
        "regex" => v.as_str().map(|s| ConstraintSpec::Regex(s.to_string())).ok_or_else(|| bad("a string (a regex)")),
        "grammar" => v.as_str().map(|s| ConstraintSpec::Lark(s.to_string())).ok_or_else(|| bad("a string (a Lark grammar)")),
        _ => {
            let items = v.as_array().ok_or_else(|| bad("a list of strings"))?;
            let strings: Option<Vec<String>> = items.iter().map(|s| s.as_str().map(str::to_string)).collect();
            strings.map(ConstraintSpec::Choice).ok_or_else(|| bad("a list of strings"))
        }
    }
}

/// A JSON schema given as an object (or, as vLLM also takes it, as a JSON string).
fn json_schema(field: &'static str, v: &Value) -> ApiResult<ConstraintSpec> {
    let parsed;
    let schema = match v {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| ApiError::invalid(format!("{field} is not valid JSON: {e}"), Some(field)))?;
            &parsed
        }
        other => other,
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(ConstraintSpec::JsonSchema(schema.clone())),
        _ => Err(ApiError::invalid(format!("{field} must be a JSON schema object"), Some(field))),
    }
}

/// `tool_choice` `required` (`named`: None) or a named function: a call in the template's
/// format (`hermes`: `<tool_call>` blocks; else Llama 3.x's bare JSON object), arguments
/// valid under the tool's schema. `parallel`: OpenAI's `parallel_tool_calls` (default true).
pub fn for_tools(tools: Vec<ToolSpec>, named: Option<String>, hermes: bool, parallel: bool) -> Requested {
    let choice = named.map_or(ToolChoice::Required, ToolChoice::Function);
    let format = if hermes { ToolCallFormat::Hermes } else { ToolCallFormat::Json };
    Requested { spec: ConstraintSpec::ToolCalls(ToolCallSpec { tools, choice, format, parallel }), field: "tool_choice" }
}

/// Compiles the constraint on the blocking pool (a large schema takes milliseconds; the token
/// environment is built on first use). 400 naming the field when the spec cannot be built.
pub async fn compile(state: &SharedState, requested: Requested) -> ApiResult<Constraint> {
    let state = state.clone();
    let job = move || {
        let grammars = state.grammars().map_err(|e| ApiError::invalid(e, Some(requested.field)))?;
        grammars.compile(&requested.spec).map_err(|e| invalid(requested.field, e))
    };
    tokio::task::spawn_blocking(job)
        .await
        .map_err(|e| ApiError::internal(format!("compiling the constraint failed: {e}")))?
}

fn invalid(field: &'static str, e: GrammarError) -> ApiError {
    ApiError::invalid(format!("{field}: {e}"), Some(field))
}

/// The engine's view of a choice's constraint; `jump_forward: false` samples forced tokens one
/// at a time under one-token masks instead of appending them (the same tokens under greedy).
pub fn for_engine(c: Constraint, jump_forward: bool) -> Box<dyn TokenConstraint> {
    if jump_forward {
        Box::new(c)
    } else {
        Box::new(ferrolm_engine::constraint::NoJumpForward(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: Value) -> ApiResult<Option<ConstraintSpec>> {
        from_body(v.as_object().unwrap()).map(|r| r.map(|r| r.spec))
    }

    #[test]
    fn fields_map_to_specs() {
        let schema = json!({"type": "object"});
        assert_eq!(spec(json!({})).unwrap(), None);
        assert_eq!(spec(json!({"response_format": {"type": "text"}})).unwrap(), None);
        assert_eq!(spec(json!({"response_format": {"type": "json_object"}})).unwrap(), Some(ConstraintSpec::JsonObject));
        let rf = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}});
        assert_eq!(spec(rf).unwrap(), Some(ConstraintSpec::JsonSchema(schema.clone())));
        assert_eq!(spec(json!({"json_schema": schema})).unwrap(), Some(ConstraintSpec::JsonSchema(schema.clone())));
        assert_eq!(spec(json!({"guided_json": "{\"type\": \"object\"}"})).unwrap(), Some(ConstraintSpec::JsonSchema(schema)));
        assert_eq!(spec(json!({"guided_regex": "a+"})).unwrap(), Some(ConstraintSpec::Regex("a+".into())));
        assert_eq!(spec(json!({"guided_grammar": "start: \"x\""})).unwrap(), Some(ConstraintSpec::Lark("start: \"x\"".into())));
        let choice = Some(ConstraintSpec::Choice(vec!["a".into(), "b".into()]));
        assert_eq!(spec(json!({"guided_choice": ["a", "b"]})).unwrap(), choice);
        assert_eq!(spec(json!({"grammar": "root ::= \"x\""})).unwrap(), Some(ConstraintSpec::Gbnf("root ::= \"x\"".into())));
        assert_eq!(spec(json!({"grammar": ""})).unwrap(), None);
        assert_eq!(spec(json!({"structured_outputs": {"choice": ["a", "b"]}})).unwrap(), choice);
    }

    #[test]
    fn bad_fields_are_400s_naming_the_field() {
        let cases = [
            (json!({"response_format": {"type": "xml"}}), "response_format"),
            (json!({"guided_regex": 3}), "guided_regex"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"json_schema": [1]}), "json_schema"),
            (json!({"structured_outputs": {"json": {}, "regex": "a"}}), "structured_outputs"),
            (json!({"structured_outputs": {"structural_tag": {}}}), "structured_outputs"),
            (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "guided_regex"),
            (json!({"grammar": 3}), "grammar"),
            (json!({"grammar": "root ::= \"x\"", "guided_grammar": "start: \"x\""}), "grammar"),
        ];
        for (body, field) in cases {
            let e = spec(body.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(field)), "{body}: {}", e.message);
        }
    }
}
