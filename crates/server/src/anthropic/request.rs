//! An Anthropic Messages body translated into the chat body that the chat completions path
//! runs (`routes::chat`), so templates, tools, stops and sampling behave the same on both APIs.
//!
//! `system` (string or text blocks) → a system message; content blocks → chat messages:
//! `text` joined, assistant `tool_use` → `tool_calls`, user `tool_result` → `tool` messages,
//! `thinking` → `reasoning_content` (what reasoning templates read); `tools` (`input_schema`) →
//! function tools; `tool_choice` → its chat equivalent; `stop_sequences` → `stop`; `thinking` →
//! the template's `enable_thinking`. Consecutive turns of one role are one turn (as Anthropic
//! combines them). A final assistant message is a prefill: the answer goes on from it.
//! `max_tokens: 0` (Anthropic's cache warm-up) answers at once with no output. `cache_control`,
//! `metadata`, `citations`, `output_config.effort` and other annotations are accepted and have
//! no effect; blocks and fields that would change the answer and are not implemented (images,
//! documents, server tools, MCP servers, code-execution containers) are refused with a 400.
//! Structured outputs (`output_config.format`) become the chat body's `response_format`.

use super::tools;
use crate::errors::{ApiError, ApiResult};
use serde_json::{json, Map, Value};

/// The chat body to run and the prefill (a final assistant message's text), if any.
pub struct Translated {
    pub chat: Map<String, Value>,
    pub prefill: Option<String>,
    /// `max_tokens: 0`: nothing is generated (the chat body asks for 1 token, never run).
    pub no_output: bool,
    /// `thinking.display: "omitted"`: thinking blocks come back with their text redacted.
    pub hide_thinking: bool,
}

pub(super) fn invalid(message: String) -> ApiError {
    ApiError::invalid(message, None)
}

/// `count_only`: `/v1/messages/count_tokens`, which takes no `max_tokens`.
pub fn translate(body: &Map<String, Value>, count_only: bool) -> ApiResult<Translated> {
    refuse_unimplemented(body)?;
    let mut messages = system(body.get("system"))?;
    let (turns, prefill) = conversation(body)?;
    messages.extend(turns);
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = tools::tools(body.get("tools"), &tools::referenced(body))? {
        chat.insert("tools".into(), tools);
    }
    if let Some(choice) = tools::tool_choice(body.get("tool_choice"))? {
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(kw) = thinking(body.get("thinking"))? {
        chat.insert("chat_template_kwargs".into(), kw);
    }
    if let Some(format) = output_format(body)? {
        chat.insert("response_format".into(), format);
    }
    let no_output = sampling(body, count_only, &mut chat)?;
    let display = body.get("thinking").and_then(|t| t.get("display")).and_then(Value::as_str);
    Ok(Translated { chat, prefill, no_output, hide_thinking: display == Some("omitted") })
}

/// Fields whose meaning ferrolm does not implement: a clear 400 rather than a different answer.
fn refuse_unimplemented(body: &Map<String, Value>) -> ApiResult<()> {
    let set = |k: &str| match body.get(k) {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    for field in ["mcp_servers", "container"] {
        if set(field) {
            return Err(invalid(format!("{field}: not supported by this server")));
        }
    }
    Ok(())
}

/// Structured outputs, `output_config.format: {"type": "json_schema", "schema": …}`, as the
/// chat body's `response_format`.
fn output_format(body: &Map<String, Value>) -> ApiResult<Option<Value>> {
    let Some(format) = body.get("output_config").and_then(|c| c.get("format")).filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match (format.get("type").and_then(Value::as_str), format.get("schema")) {
        (Some("json_schema"), Some(schema)) => {
            Ok(Some(json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}})))
        }
        (Some("json_schema"), None) => Err(invalid("output_config.format.schema: Field required".into())),
        _ => Err(invalid("output_config.format.type: Input should be 'json_schema'".into())),
    }
}

/// Text of a string or a list of text blocks (joined by newlines); `what` names the field.
fn text_of(v: &Value, what: &str) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                match (block_type(b), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => parts.push(t.as_str()),
                    (Some("text"), _) => return Err(invalid(format!("{what}.{i}.text: Field required"))),
                    (t, _) => return Err(unsupported_block(&format!("{what}.{i}"), t)),
                }
            }
            Ok(parts.join("\n"))
        }
        _ => Err(invalid(format!("{what}: Input should be a valid string or a list of content blocks"))),
    }
}

pub(super) fn block_type(b: &Value) -> Option<&str> {
    b.get("type").and_then(Value::as_str)
}

fn unsupported_block(at: &str, t: Option<&str>) -> ApiError {
    match t {
        Some(t) => invalid(format!("{at}: content blocks of type '{t}' are not supported by this server")),
        None => invalid(format!("{at}.type: Field required")),
    }
}

fn system(v: Option<&Value>) -> ApiResult<Vec<Value>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => {
            let text = text_of(v, "system")?;
            Ok(vec![json!({"role": "system", "content": text})])
        }
    }
}

/// The turns as chat messages, and the prefill when the last turn is the assistant's.
fn conversation(body: &Map<String, Value>) -> ApiResult<(Vec<Value>, Option<String>)> {
    let list = match body.get("messages") {
        None | Some(Value::Null) => return Err(invalid("messages: Field required".into())),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(invalid("messages: Input should be a valid list".into())),
    };
    if list.is_empty() {
        return Err(invalid("messages: at least one message is required".into()));
    }
    let mut out = Vec::new();
    let mut prefill = None;
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages.{i}");
        let Some(obj) = m.as_object() else {
            return Err(invalid(format!("{at}: Input should be a valid dictionary")));
        };
        let content = obj.get("content").ok_or_else(|| invalid(format!("{at}.content: Field required")))?;
        match obj.get("role").and_then(Value::as_str) {
            Some("user") => user_turn(content, &at, &mut out)?,
            Some("assistant") if i + 1 == list.len() && !has_tool_use(content) => {
                prefill = Some(text_of_assistant(content, &at)?);
            }
            Some("assistant") => push_turn(&mut out, assistant_turn(content, &at)?),
            _ => return Err(invalid(format!("{at}.role: Input should be 'user' or 'assistant'"))),
        }
    }
    Ok((out, prefill.filter(|p| !p.is_empty())))
}

/// Adds a user or assistant message, joined to the one before when that has the same role:
/// text by a newline, tool calls and reasoning appended.
fn push_turn(out: &mut Vec<Value>, msg: Value) {
    let Some(last) = out.last_mut().filter(|l| l["role"] == msg["role"]) else {
        return out.push(msg);
    };
    for key in ["content", "reasoning_content"] {
        let (a, b) = (last[key].as_str().unwrap_or_default(), msg[key].as_str().unwrap_or_default());
        if !b.is_empty() {
            last[key] = json!(if a.is_empty() { b.to_string() } else { format!("{a}\n{b}") });
        }
    }
    if let Some(Value::Array(calls)) = msg.get("tool_calls") {
        match last.get_mut("tool_calls") {
            Some(Value::Array(before)) => before.extend(calls.iter().cloned()),
            _ => last["tool_calls"] = Value::Array(calls.clone()),
        }
    }
}

fn has_tool_use(content: &Value) -> bool {
    content.as_array().is_some_and(|b| b.iter().any(|b| block_type(b) == Some("tool_use")))
}

/// A prefill is the assistant's text so far; thinking blocks in it are dropped.
fn text_of_assistant(content: &Value, at: &str) -> ApiResult<String> {
    let msg = assistant_turn(content, at)?;
    Ok(msg["content"].as_str().unwrap_or_default().to_string())
}

/// A user turn: its `tool_result` blocks become `tool` messages (they come first in a turn, as
/// Anthropic requires), its text one user message after them.
fn user_turn(content: &Value, at: &str, out: &mut Vec<Value>) -> ApiResult<()> {
    let Value::Array(blocks) = content else {
        push_turn(out, json!({"role": "user", "content": text_of(content, &format!("{at}.content"))?}));
        return Ok(());
    };
    let mut text = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match block_type(b) {
            Some("text") => text.push(text_of(&json!([b]), &at)?),
            Some("tool_result") => out.push(tool_result(b, &at)?),
            // Thinking the client echoes back in a user turn carries nothing for the model.
            Some("thinking" | "redacted_thinking") => {}
            t => return Err(unsupported_block(&at, t)),
        }
    }
    if !text.is_empty() {
        push_turn(out, json!({"role": "user", "content": text.join("\n")}));
    }
    Ok(())
}

fn tool_result(b: &Value, at: &str) -> ApiResult<Value> {
    let id = b.get("tool_use_id").and_then(Value::as_str);
    let id = id.ok_or_else(|| invalid(format!("{at}.tool_use_id: Field required")))?;
    let content = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::Array(blocks)) => {
            // Tool search results name the deferred tools they load (`tools::referenced`).
            let text: Vec<Value> = blocks.iter().map(tools::reference_as_text).collect();
            text_of(&Value::Array(text), &format!("{at}.content"))?
        }
        Some(v) => text_of(v, &format!("{at}.content"))?,
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

/// An assistant turn: text joined, `tool_use` as tool calls, thinking as `reasoning_content`.
fn assistant_turn(content: &Value, at: &str) -> ApiResult<Value> {
    let Value::Array(blocks) = content else {
        return Ok(json!({"role": "assistant", "content": text_of(content, &format!("{at}.content"))?}));
    };
    let (mut text, mut thinking, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content.{j}");
        match block_type(b) {
            Some("text") => text.push(text_of(&json!([b]), &at)?),
            Some("thinking") => thinking.push(b.get("thinking").and_then(Value::as_str).unwrap_or_default()),
            Some("redacted_thinking") => {}
            Some("tool_use") => calls.push(tool_use(b, &at)?),
            t => return Err(unsupported_block(&at, t)),
        }
    }
    let mut msg = json!({"role": "assistant", "content": text.join("\n")});
    if !thinking.is_empty() {
        msg["reasoning_content"] = json!(thinking.join("\n"));
    }
    if !calls.is_empty() {
        msg["tool_calls"] = Value::Array(calls);
    }
    Ok(msg)
}

fn tool_use(b: &Value, at: &str) -> ApiResult<Value> {
    let field = |k: &str| b.get(k).and_then(Value::as_str).ok_or_else(|| invalid(format!("{at}.{k}: Field required")));
    let (id, name) = (field("id")?, field("name")?);
    let input = match b.get("input") {
        Some(Value::Object(o)) => Value::Object(o.clone()),
        _ => return Err(invalid(format!("{at}.input: Input should be a valid dictionary"))),
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

/// `thinking: {type: enabled | adaptive | between_tools | disabled}` as the template's
/// `enable_thinking` (a token budget cannot be enforced: thinking ends when the model ends it).
fn thinking(v: Option<&Value>) -> ApiResult<Option<Value>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let on = match v.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive" | "between_tools") => true,
        Some("disabled") => false,
        _ => {
            let allowed = "'enabled', 'adaptive', 'between_tools' or 'disabled'";
            return Err(invalid(format!("thinking.type: Input should be {allowed}")));
        }
    };
    Ok(Some(json!({"enable_thinking": on})))
}

/// `max_tokens` (required by Messages), `stop_sequences`, `stream` and the sampling fields
/// (which Anthropic's newest SDKs no longer send; older clients do), under chat's names, whose
/// validation then applies. Returns whether `max_tokens` is 0 (no output wanted).
fn sampling(body: &Map<String, Value>, count_only: bool, chat: &mut Map<String, Value>) -> ApiResult<bool> {
    let mut no_output = false;
    match body.get("max_tokens") {
        None | Some(Value::Null) if !count_only => return Err(invalid("max_tokens: Field required".into())),
        Some(v) if !count_only => {
            no_output = v.as_u64() == Some(0);
            chat.insert("max_tokens".into(), if no_output { json!(1) } else { v.clone() });
        }
        _ => {}
    }
    match body.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            chat.insert("stop".into(), Value::Array(a.clone()));
        }
        Some(_) => return Err(invalid("stop_sequences: Input should be a valid list of strings".into())),
    }
    match body.get("stream") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(_) => return Err(invalid("stream: Input should be a valid boolean".into())),
    }
    for k in ["stream", "temperature", "top_p", "top_k"] {
        if let Some(v) = body.get(k).filter(|v| !v.is_null()) {
            chat.insert(k.into(), v.clone());
        }
    }
    Ok(no_output)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(v: Value) -> ApiResult<Translated> {
        translate(v.as_object().unwrap(), false)
    }

    #[test]
    fn blocks_become_chat_messages() {
        let t = run(
            json!({"max_tokens": 5, "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
            "stop_sequences": ["END"], "temperature": 0, "metadata": {"user_id": "u"},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "let me look"},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}]}, {"type": "text", "text": "and?"}]}]}),
        )
        .unwrap();
        let m = &t.chat["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "S"}));
        assert_eq!(m[1], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(m[2]["content"], "let me look");
        assert_eq!(m[2]["reasoning_content"], "hm");
        assert_eq!(
            m[2]["tool_calls"][0],
            json!({"id": "toolu_1", "type": "function",
            "function": {"name": "w", "arguments": {"city": "Paris"}}})
        );
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}));
        assert_eq!(m[4], json!({"role": "user", "content": "and?"}));
        assert_eq!(t.chat["stop"], json!(["END"]));
        assert_eq!(t.chat["max_tokens"], 5);
        assert!(t.prefill.is_none());
    }

    #[test]
    fn tools_choice_thinking_and_prefill() {
        let t =
            run(json!({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
            "tools": [{"name": "w", "description": "d", "input_schema": {"type": "object"}, "cache_control": {}}],
            "tool_choice": {"type": "tool", "name": "w"},
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]}))
            .unwrap();
        let f = &t.chat["tools"][0]["function"];
        assert_eq!(f, &json!({"name": "w", "description": "d", "parameters": {"type": "object"}}));
        assert_eq!(f.as_object().unwrap().keys().collect::<Vec<_>>(), ["name", "description", "parameters"]);
        assert_eq!(t.chat["tool_choice"], json!({"type": "function", "function": {"name": "w"}}));
        assert_eq!(t.chat["chat_template_kwargs"], json!({"enable_thinking": true}));
        assert!(t.hide_thinking);
        assert_eq!(t.prefill.as_deref(), Some("The answer is"));
        assert_eq!(t.chat["messages"].as_array().unwrap().len(), 1);
        let any = run(
            json!({"max_tokens": 1, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "x"}]}),
        );
        assert_eq!(any.unwrap().chat["tool_choice"], "required");
    }

    #[test]
    fn consecutive_turns_are_one_and_zero_tokens_means_no_output() {
        let t = run(json!({"max_tokens": 0, "messages": [
            {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"},
                                         {"type": "tool_result", "tool_use_id": "t2", "content": "y"}]}]}))
        .unwrap();
        let m = t.chat["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "user", "content": "a\nb"}));
        assert_eq!(m[1]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m.len(), 4);
        assert!(t.no_output && !t.hide_thinking);
        assert_eq!(t.chat["max_tokens"], 1);
    }

    #[test]
    fn bad_or_unsupported_input_is_a_400() {
        let user = json!([{"role": "user", "content": "x"}]);
        let cases = [
            (json!({"messages": user}), "max_tokens: Field required"),
            (json!({"max_tokens": 1}), "messages: Field required"),
            (json!({"max_tokens": 1, "messages": []}), "messages: at least one message is required"),
            (
                json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
                "messages.0.role: Input should be 'user' or 'assistant'",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages.0.content.0: content blocks of type 'image' are not supported by this server",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
                "tools.0: tools of type 'web_search_20250305' run on Anthropic's servers and are not supported here",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "tools": [{"name": "f"}]}),
                "tools.0.input_schema: Field required",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "stop_sequences": "x"}),
                "stop_sequences: Input should be a valid list of strings",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "mcp_servers": [{"url": "x"}]}),
                "mcp_servers: not supported by this server",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "output_config": {"format": {"type": "json_schema"}}}),
                "output_config.format.schema: Field required",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "tool_choice": {"type": "sometimes"}}),
                "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'",
            ),
        ];
        for (body, msg) in cases {
            let e = run(body).err().expect(msg);
            assert_eq!(e.message, msg);
            assert_eq!(e.status, 400);
        }
        assert!(translate(json!({"messages": user}).as_object().unwrap(), true).is_ok());
    }
}
