//! What a request asks the output to be, and how each kind becomes an llguidance grammar.
//! OpenAI's `response_format` shapes are parsed here; other request fields (vLLM's
//! `guided_regex`, llama-server's `json_schema`…) map onto the same variants in the server.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

use crate::tools::ToolCallSpec;
use crate::GrammarError;

/// A constraint on a whole generation.
#[derive(Debug, Clone, PartialEq)]
pub enum ConstraintSpec {
    /// Any JSON object (`{"type": "json_object"}`).
    JsonObject,
    /// A value valid under this JSON schema. Keywords llguidance cannot enforce are refused,
    /// never ignored; `strict: false` does not loosen that.
    JsonSchema(Value),
    /// Text the regex matches as a whole (Rust `regex` syntax; a leading `^` and a trailing
    /// `$` are accepted and mean nothing more).
    Regex(String),
    /// A grammar in llguidance's Lark dialect (may inline JSON schemas with `%json {…}`).
    Lark(String),
    /// A grammar in llama.cpp's GBNF (llama-server's `grammar`), translated to Lark.
    Gbnf(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// Tool calls in the model's own format, arguments valid under the tools' schemas.
    ToolCalls(ToolCallSpec),
    /// Free reasoning text up to and including `end` (the model's reasoning end tag, e.g.
    /// `</think>`), optional blank space, then `answer` (not itself `AfterReasoning`): for a
    /// prompt that already opened the model's reasoning (Qwen3 and DeepSeek-R1-style templates),
    /// so the model thinks freely and the constraint binds its answer only.
    AfterReasoning { end: String, answer: Box<ConstraintSpec> },
}

impl ConstraintSpec {
    /// OpenAI's `response_format`: `{"type": "text"}` is no constraint (`None`),
    /// `{"type": "json_object"}` any object (with llama-server's optional `"schema"`),
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` a schema.
    pub fn from_response_format(v: &Value) -> Result<Option<ConstraintSpec>, GrammarError> {
        let bad = |m: &str| GrammarError::invalid("response_format", m);
        let obj = v.as_object().ok_or_else(|| bad("must be an object"))?;
        let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| bad("'type' must be a string"))?;
        match kind {
            "text" => Ok(None),
            "json_object" => match obj.get("schema") {
                None | Some(Value::Null) => Ok(Some(ConstraintSpec::JsonObject)),
                Some(schema) => Ok(Some(ConstraintSpec::JsonSchema(schema.clone()))),
            },
            "json_schema" => {
                let inner =
                    obj.get("json_schema").ok_or_else(|| bad("type 'json_schema' needs a 'json_schema' object"))?;
                Self::from_openai_json_schema(inner).map(Some)
            }
            other => Err(bad(&format!("type must be 'text', 'json_object' or 'json_schema', not '{other}'"))),
        }
    }

    /// OpenAI's `json_schema` object: `{"name", "description"?, "schema", "strict"?}`.
    pub fn from_openai_json_schema(v: &Value) -> Result<ConstraintSpec, GrammarError> {
        let bad = |m: &str| GrammarError::invalid("json_schema", m);
        let obj = v.as_object().ok_or_else(|| bad("must be an object with a 'schema'"))?;
        if let Some(name) = obj.get("name") {
            name.as_str().ok_or_else(|| bad("'name' must be a string"))?;
        }
        if let Some(strict) = obj.get("strict") {
            if !strict.is_boolean() && !strict.is_null() {
                return Err(bad("'strict' must be a boolean"));
            }
        }
        match obj.get("schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(ConstraintSpec::JsonSchema(schema.clone())),
            Some(_) => Err(bad("'schema' must be a JSON schema object")),
            None => Err(bad("'schema' is required")),
        }
    }

    /// The request field an error about this spec names.
    pub(crate) fn field(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonObject | ConstraintSpec::JsonSchema(_) => "json_schema",
            ConstraintSpec::Regex(_) => "regex",
            ConstraintSpec::Lark(_) | ConstraintSpec::Gbnf(_) => "grammar",
            ConstraintSpec::Choice(_) => "choice",
            ConstraintSpec::ToolCalls(_) => "tools",
            ConstraintSpec::AfterReasoning { answer, .. } => answer.field(),
        }
    }

    /// The llguidance grammar for this spec (checked further when the parser is built).
    pub(crate) fn to_grammar(&self, tokenizer: &ferrolm_text::Tokenizer) -> Result<TopLevelGrammar, GrammarError> {
        let field = self.field();
        Ok(match self {
            ConstraintSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(with_json_layout(json!({"type": "object"})))
            }
            ConstraintSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(prepare_schema(schema, field)?),
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(unanchored(rx)),
            ConstraintSpec::Lark(src) => {
                if src.trim().is_empty() {
                    return Err(GrammarError::invalid(field, "the grammar is empty"));
                }
                TopLevelGrammar::from_lark(src.clone())
            }
            ConstraintSpec::Gbnf(src) => TopLevelGrammar::from_lark(crate::gbnf_to_lark(src)?),
            ConstraintSpec::Choice(options) => TopLevelGrammar::from_lark(choice_lark(options)?),
            ConstraintSpec::ToolCalls(spec) => TopLevelGrammar::from_lark(spec.to_lark(tokenizer, "start")?),
            ConstraintSpec::AfterReasoning { end, answer } => {
                TopLevelGrammar::from_lark(after_reasoning_lark(end, answer, tokenizer)?)
            }
        })
    }
}

/// `start`: any text ending in `end`, optional blank space, then the answer's grammar as rule
/// `answer`. The reasoning is one lazy lexeme (it ends at the first `end`), so nothing in it is
/// constrained and nothing forced.
fn after_reasoning_lark(end: &str, answer: &ConstraintSpec, tokenizer: &ferrolm_text::Tokenizer) -> Result<String, GrammarError> {
    let field = answer.field();
    let refuse = |what: &str| {
        GrammarError::invalid(field, format!("{what} cannot follow the model's opened reasoning yet: turn thinking off (chat_template_kwargs: {{\"enable_thinking\": false}})"))
    };
    if end.is_empty() || tokenizer.token_to_id(end).is_some_and(|id| tokenizer.is_special(id)) {
        return Err(refuse("structured output"));
    }
    let body = match answer {
        ConstraintSpec::JsonObject => format!("answer: %json {}", with_json_layout(json!({"type": "object"}))),
        ConstraintSpec::JsonSchema(schema) => format!("answer: %json {}", prepare_schema(schema, field)?),
        ConstraintSpec::Choice(options) => choice_rule("answer", options)?,
        ConstraintSpec::ToolCalls(spec) => spec.to_lark(tokenizer, "answer")?,
        ConstraintSpec::Regex(_) => return Err(refuse("a regex")),
        ConstraintSpec::Gbnf(src) => crate::gbnf::to_lark_rule(src, "answer")?,
        ConstraintSpec::Lark(_) => return Err(refuse("a Lark grammar")),
        ConstraintSpec::AfterReasoning { .. } => return Err(refuse("a nested reasoning constraint")),
    };
    let end = lark_literal(end);
    Ok(format!("start: reasoning answer | reasoning BLANK answer\nreasoning[suffix={end}]: /(.|\\n)*/\nBLANK: /[ \\t\\n]+/\n{body}\n"))
}

/// Whitespace a JSON value may hold between tokens: at most a few spaces or tabs, or one
/// newline and an indent (as llama.cpp's JSON grammars allow). Unbounded whitespace lets a
/// small model loop on blank lines forever; none at all would refuse pretty-printed JSON.
pub(crate) const JSON_WHITESPACE: &str = r"[ \t]{1,4}|\n[ \t]{0,32}";

/// Sets ferrolm's JSON layout (separators and bounded whitespace) through llguidance's
/// `x-guidance` options, unless the schema sets its own.
pub(crate) fn with_json_layout(mut schema: Value) -> Value {
    if let Value::Object(obj) = &mut schema {
        obj.entry("x-guidance").or_insert_with(|| {
            json!({"whitespace_flexible": true, "whitespace_pattern": JSON_WHITESPACE,
                   "item_separator": ",", "key_separator": ":"})
        });
    }
    schema
}

/// A request's schema ready for llguidance: `true` is the empty schema, `false` is refused.
pub(crate) fn prepare_schema(schema: &Value, field: &'static str) -> Result<Value, GrammarError> {
    match schema {
        Value::Bool(true) => Ok(with_json_layout(Value::Object(Map::new()))),
        Value::Bool(false) => Err(GrammarError::invalid(field, "the schema `false` accepts no value")),
        Value::Object(_) => Ok(with_json_layout(schema.clone())),
        _ => Err(GrammarError::invalid(field, "a JSON schema must be an object or a boolean")),
    }
}

/// The regex without the anchors that whole-output matching already implies.
fn unanchored(rx: &str) -> &str {
    let rx = rx.strip_prefix('^').unwrap_or(rx);
    match rx.strip_suffix('$') {
        // `\$` is a literal dollar sign, not an anchor.
        Some(r) if !r.ends_with('\\') || r.ends_with("\\\\") => r,
        _ => rx,
    }
}

fn choice_lark(options: &[String]) -> Result<String, GrammarError> {
    choice_rule("start", options)
}

/// Rule `name`: exactly one of `options`.
fn choice_rule(name: &str, options: &[String]) -> Result<String, GrammarError> {
    if options.is_empty() {
        return Err(GrammarError::invalid("choice", "needs at least one option"));
    }
    let alts: Vec<String> = options.iter().map(|o| lark_literal(o)).collect();
    Ok(format!("{name}: {}\n", alts.join(" | ")))
}

/// A Lark string literal for `text` (llguidance reads literals as JSON strings).
pub(crate) fn lark_literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_formats() {
        assert_eq!(ConstraintSpec::from_response_format(&json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            ConstraintSpec::from_response_format(&json!({"type": "json_object"})).unwrap(),
            Some(ConstraintSpec::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        assert_eq!(ConstraintSpec::from_response_format(&rf).unwrap(), Some(ConstraintSpec::JsonSchema(schema)));
    }

    #[test]
    fn malformed_response_formats_name_the_problem() {
        let err = |v: Value| ConstraintSpec::from_response_format(&v).unwrap_err().to_string();
        assert!(err(json!({"type": "xml"})).contains("not 'xml'"));
        assert!(err(json!({"type": "json_schema"})).contains("needs a 'json_schema'"));
        assert!(err(json!({"type": "json_schema", "json_schema": {"name": "x"}})).contains("'schema' is required"));
        assert!(
            err(json!({"type": "json_schema", "json_schema": {"schema": 3}})).contains("must be a JSON schema object")
        );
        assert!(err(json!("json")).contains("response_format"));
    }

    #[test]
    fn anchors_are_dropped_but_escaped_dollars_kept() {
        assert_eq!(unanchored("^[a-z]+$"), "[a-z]+");
        assert_eq!(unanchored(r"cost \$"), r"cost \$");
        assert_eq!(unanchored(r"a\\$"), r"a\\");
    }

    #[test]
    fn a_schema_keeps_its_own_layout_options() {
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": false}});
        assert_eq!(with_json_layout(own.clone()), own);
        assert!(with_json_layout(json!({"type": "object"}))["x-guidance"]["whitespace_pattern"].is_string());
    }
}
