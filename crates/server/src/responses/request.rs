//! A Responses API body translated into the chat body that the chat completions path runs.
//!
//! `instructions` → a system message first (not carried over from a previous response, as in
//! OpenAI's API); `input` (a string, or items: `message` with text parts, `function_call`,
//! `function_call_output`; `reasoning` items are dropped, as chat templates drop earlier
//! reasoning) → chat messages after the stored conversation of `previous_response_id`; flat
//! function tools → chat tools; `max_output_tokens` → `max_tokens`; `reasoning.effort` →
//! `reasoning_effort`. Tools that are not functions (web search, file search, Codex's
//! `local_shell`, freeform `custom` tools and `namespace` groups) are not offered to the model,
//! which cannot call them. Fields that would change the answer and are not implemented are
//! refused with a 400.

use crate::errors::{ApiError, ApiResult};
use crate::protocol::tools::function;
use serde_json::{json, Map, Value};

pub struct Translated {
    pub chat: Map<String, Value>,
    /// This request's input as items (a string becomes one user message).
    pub input: Vec<Value>,
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// `history`: the stored conversation of `previous_response_id` (empty without one).
pub fn translate(body: &Map<String, Value>, history: &[Value]) -> ApiResult<Translated> {
    refuse_unimplemented(body)?;
    let input = input_items(body.get("input"))?;
    let mut messages = Vec::new();
    match body.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(invalid("instructions must be a string", "instructions")),
    }
    let all: Vec<&Value> = history.iter().chain(input.iter()).collect();
    messages.extend(to_messages(&all)?);
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = tools(body.get("tools"))? {
        chat.insert("tools".into(), tools);
    }
    if let Some(choice) = tool_choice(body.get("tool_choice"))? {
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(format) = text_format(body)? {
        chat.insert("response_format".into(), format);
    }
    if let Some(effort) = body.get("reasoning").and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    for (from, to) in [("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.into(), v.clone());
        }
    }
    match body.get("stream") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => {
            chat.insert("stream".into(), json!(b));
        }
        Some(_) => return Err(invalid("stream must be a boolean", "stream")),
    }
    Ok(Translated { chat, input })
}

/// Background runs, server-side conversations, prompt templates, structured output, automatic
/// truncation and logprobs are not implemented: each is a 400 naming the field.
fn refuse_unimplemented(body: &Map<String, Value>) -> ApiResult<()> {
    let refuse = |field: &str| Err(invalid(format!("{field} is not supported by this server"), field));
    let truthy = |k: &str| body.get(k).is_some_and(|v| !matches!(v, Value::Null | Value::Bool(false)));
    for field in ["background", "conversation", "prompt"] {
        if truthy(field) {
            return refuse(field);
        }
    }
    if body.get("truncation").and_then(Value::as_str).is_some_and(|t| t != "disabled") {
        return refuse("truncation");
    }
    if body.get("top_logprobs").and_then(Value::as_u64).is_some_and(|n| n > 0) {
        return refuse("top_logprobs");
    }
    Ok(())
}

/// Structured output, `text.format` (`json_schema` with its name, schema and strict, or
/// `json_object`), as the chat body's `response_format`; `text` asks for nothing.
fn text_format(body: &Map<String, Value>) -> ApiResult<Option<Value>> {
    let Some(format) = body.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut inner = Map::new();
            for key in ["name", "description", "schema", "strict"] {
                if let Some(v) = format.get(key) {
                    inner.insert(key.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": inner})))
        }
        _ => Err(invalid("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format")),
    }
}

fn input_items(v: Option<&Value>) -> ApiResult<Vec<Value>> {
    match v {
        None | Some(Value::Null) => Err(invalid("Missing required parameter: 'input'.", "input")),
        Some(Value::String(s)) => Ok(vec![json!({"type": "message", "role": "user", "content": s})]),
        Some(Value::Array(items)) => Ok(items.clone()),
        Some(_) => Err(invalid("input must be a string or a list of items", "input")),
    }
}

/// Items as chat messages: consecutive function calls join the assistant message before them.
pub fn to_messages(items: &[&Value]) -> ApiResult<Vec<Value>> {
    let mut out: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        let kind = kind.or_else(|| item.get("role").map(|_| "message"));
        match kind {
            Some("message") => out.push(message(item, &at)?),
            Some("function_call") => function_call(item, &at, &mut out)?,
            Some("function_call_output") => out.push(call_output(item, &at)?),
            Some("reasoning") => {}
            Some(other) => return Err(invalid(format!("{at}: items of type '{other}' are not supported"), "input")),
            None => return Err(invalid(format!("{at}.type is required"), "input")),
        }
    }
    Ok(out)
}

fn message(item: &Value, at: &str) -> ApiResult<Value> {
    let role = item.get("role").and_then(Value::as_str);
    let role = match role {
        Some(r @ ("user" | "assistant" | "system" | "developer")) => r,
        _ => return Err(invalid(format!("{at}.role must be 'user', 'assistant', 'system' or 'developer'"), "input")),
    };
    let content = text(item.get("content"), &format!("{at}.content"))?;
    Ok(json!({"role": role, "content": content}))
}

/// A string, or parts of type `input_text` / `output_text` / `text` / `refusal` joined by
/// newlines (Codex sends sections of its instructions as separate parts).
fn text(v: Option<&Value>, at: &str) -> ApiResult<String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or_default();
                let field = if kind == "refusal" { "refusal" } else { "text" };
                match (kind, p.get(field).and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text" | "refusal", Some(t)) => texts.push(t),
                    _ => return Err(invalid(format!("{at}[{j}]: parts of type '{kind}' are not supported"), "input")),
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(invalid(format!("{at} must be a string or a list of parts"), "input")),
    }
}

fn function_call(item: &Value, at: &str, out: &mut Vec<Value>) -> ApiResult<()> {
    let field =
        |k: &str| item.get(k).and_then(Value::as_str).ok_or_else(|| invalid(format!("{at}.{k} is required"), "input"));
    let (call_id, name) = (field("call_id")?, field("name")?);
    let arguments = item.get("arguments").cloned().unwrap_or(json!("{}"));
    let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}});
    match out.last_mut() {
        Some(m) if m["role"] == "assistant" => match m.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => m["tool_calls"] = json!([call]),
        },
        _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
    }
    Ok(())
}

fn call_output(item: &Value, at: &str) -> ApiResult<Value> {
    let call_id = item.get("call_id").and_then(Value::as_str);
    let call_id = call_id.ok_or_else(|| invalid(format!("{at}.call_id is required"), "input"))?;
    let output = text(item.get("output"), &format!("{at}.output"))?;
    Ok(json!({"role": "tool", "tool_call_id": call_id, "content": output}))
}

/// Function tools (`{type, name, description, parameters}`) in chat's nested shape; other tool
/// types are not offered.
fn tools(v: Option<&Value>) -> ApiResult<Option<Value>> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(invalid("tools must be a list", "tools")),
    };
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            continue;
        }
        let name = t.get("name").and_then(Value::as_str);
        let name = name.ok_or_else(|| invalid(format!("tools[{i}].name is required"), "tools"))?;
        let parameters = t.get("parameters").cloned().unwrap_or(json!({}));
        out.push(json!({"type": "function", "function": function(name, t.get("description"), parameters)}));
    }
    Ok(Some(Value::Array(out)))
}

/// `none` / `auto` / `required` / `{type: function, name}`; choosing a tool that is not a
/// function cannot be honoured.
fn tool_choice(v: Option<&Value>) -> ApiResult<Option<Value>> {
    let err = |m: String| invalid(m, "tool_choice");
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => Ok(Some(json!(s))),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str);
            let name = name.ok_or_else(|| err("tool_choice.name is required".into()))?;
            Ok(Some(json!({"type": "function", "function": {"name": name}})))
        }
        Some(other) => {
            Err(err(format!("tool_choice {other} is not supported: use none, auto, required or a function")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(v: Value, history: &[Value]) -> ApiResult<Translated> {
        translate(v.as_object().unwrap(), history)
    }

    #[test]
    fn codex_shaped_request() {
        let body = json!({"model": "m", "instructions": "You are Codex.", "store": false, "stream": true,
            "include": ["reasoning.encrypted_content"], "parallel_tool_calls": false,
            "reasoning": {"effort": "medium", "summary": "auto"}, "tool_choice": "auto", "prompt_cache_key": "k",
            "tools": [{"type": "function", "name": "shell", "description": "run", "strict": false,
                       "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}},
                      {"type": "local_shell"}, {"type": "web_search"}],
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
                {"type": "reasoning", "summary": [], "encrypted_content": "x"},
                {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\": [\"ls\"]}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]});
        let t = run(body, &[]).unwrap();
        let m = t.chat["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "You are Codex."}));
        assert_eq!(m[1], json!({"role": "developer", "content": "env"}));
        assert_eq!(m[2], json!({"role": "user", "content": "list files"}));
        assert_eq!(m[3]["tool_calls"][0]["function"]["name"], "shell");
        assert_eq!(m[4], json!({"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}));
        assert_eq!(t.chat["tools"].as_array().unwrap().len(), 1);
        assert_eq!(t.chat["tools"][0]["function"]["parameters"]["type"], "object");
        assert_eq!(t.chat["reasoning_effort"], "medium");
        assert_eq!(t.chat["stream"], true);
        assert_eq!(t.input.len(), 5);
    }

    #[test]
    fn string_input_history_and_fields() {
        let history = vec![
            json!({"type": "message", "role": "user", "content": "hi"}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello", "annotations": []}]}),
        ];
        let t = run(
            json!({"input": "again", "max_output_tokens": 9, "temperature": 0,
            "tool_choice": {"type": "function", "name": "f"}}),
            &history,
        )
        .unwrap();
        let m = t.chat["messages"].as_array().unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m[1], json!({"role": "assistant", "content": "hello"}));
        assert_eq!(m[2], json!({"role": "user", "content": "again"}));
        assert_eq!(t.chat["max_tokens"], 9);
        assert_eq!(t.chat["tool_choice"], json!({"type": "function", "function": {"name": "f"}}));
        assert_eq!(t.input, vec![json!({"type": "message", "role": "user", "content": "again"})]);
    }

    #[test]
    fn text_format_becomes_response_format() {
        let schema = json!({"type": "object"});
        let body = json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "o", "schema": schema, "strict": true}}});
        let t = translate(body.as_object().unwrap(), &[]).unwrap();
        let expected = json!({"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": true}});
        assert_eq!(t.chat["response_format"], expected);
        let body = json!({"input": "x", "text": {"format": {"type": "text"}}});
        assert!(translate(body.as_object().unwrap(), &[]).unwrap().chat.get("response_format").is_none());
    }

    #[test]
    fn unimplemented_fields_are_refused() {
        let cases = [
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "text": {"format": {"type": "xml"}}}), "text.format"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (json!({"input": "x", "conversation": "conv_1"}), "conversation"),
            (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
            (json!({"input": "x", "tool_choice": {"type": "web_search"}}), "tool_choice"),
            (json!({"input": [{"type": "input_image"}]}), "input"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}), "input"),
            (json!({}), "input"),
        ];
        for (body, param) in cases {
            let e = run(body.clone(), &[]).err().unwrap_or_else(|| panic!("{body}"));
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
        assert!(run(
            json!({"input": "x", "truncation": "disabled", "text": {"format": {"type": "text"}, "verbosity": "low"},
            "background": false, "store": true, "metadata": {"a": "b"}, "service_tier": "auto", "user": "u"}),
            &[]
        )
        .is_ok());
    }
}
