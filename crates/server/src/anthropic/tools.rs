//! Anthropic tools as chat tools. Custom tools become function tools; server tools
//! (`web_search_…`, `bash_…`, `text_editor_…`) run on Anthropic's side and are refused. A tool
//! with `defer_loading` is not shown to the model until a tool search result (a `tool_reference`
//! block in a `tool_result`, as Claude Code's ToolSearch returns) names it, which is what
//! Anthropic does with deferred tools.

use super::request::{block_type, invalid};
use crate::errors::ApiResult;
use crate::protocol::tools::function;
use serde_json::{json, Map, Value};
use std::collections::HashSet;

/// Names of deferred tools that `tool_reference` blocks in tool results have loaded.
pub fn referenced(body: &Map<String, Value>) -> HashSet<String> {
    let blocks = |v: &Value| v.as_array().cloned().unwrap_or_default();
    let messages = body.get("messages").map(blocks).unwrap_or_default();
    let results = messages.iter().flat_map(|m| m.get("content").map(blocks).unwrap_or_default());
    let inner = results
        .filter(|b| block_type(b) == Some("tool_result"))
        .flat_map(|r| r.get("content").map(blocks).unwrap_or_default());
    inner
        .filter(|b| block_type(b) == Some("tool_reference"))
        .filter_map(|b| b.get("tool_name").and_then(Value::as_str).map(str::to_string))
        .collect()
}

/// A `tool_reference` block as the text the model reads; other blocks unchanged.
pub fn reference_as_text(b: &Value) -> Value {
    match (block_type(b), b.get("tool_name").and_then(Value::as_str)) {
        (Some("tool_reference"), Some(name)) => json!({"type": "text", "text": format!("Tool loaded: {name}")}),
        _ => b.clone(),
    }
}

/// Custom tools as function tools; server tools (`web_search_…`, `bash_…`…) run on Anthropic's
/// side and cannot run here.
pub fn tools(v: Option<&Value>, loaded: &HashSet<String>) -> ApiResult<Option<Value>> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(invalid("tools: Input should be a valid list".into())),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools.{i}");
        if let Some(kind) = t.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
            return Err(invalid(format!(
                "{at}: tools of type '{kind}' run on Anthropic's servers and are not supported here"
            )));
        }
        let name =
            t.get("name").and_then(Value::as_str).ok_or_else(|| invalid(format!("{at}.name: Field required")))?;
        let schema = match t.get("input_schema") {
            Some(Value::Object(o)) => Value::Object(o.clone()),
            _ => return Err(invalid(format!("{at}.input_schema: Field required"))),
        };
        if t.get("defer_loading").and_then(Value::as_bool) == Some(true) && !loaded.contains(name) {
            continue;
        }
        out.push(json!({"type": "function", "function": function(name, t.get("description"), schema)}));
    }
    Ok(Some(Value::Array(out)))
}

/// `auto` / `any` / `tool` / `none` as chat's `auto` / `required` / a named function / `none`.
pub fn tool_choice(v: Option<&Value>) -> ApiResult<Option<Value>> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let choice = match v.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = v.get("name").and_then(Value::as_str);
            let name = name.ok_or_else(|| invalid("tool_choice.name: Field required".into()))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => return Err(invalid("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'".into())),
    };
    Ok(Some(choice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deferred_tools_wait_for_a_reference() {
        let tools_json = json!([{"name": "a", "input_schema": {"type": "object"}},
            {"name": "b", "input_schema": {"type": "object"}, "defer_loading": true}]);
        let names = |loaded: &HashSet<String>| {
            let t = tools(Some(&tools_json), loaded).unwrap().unwrap();
            t.as_array()
                .unwrap()
                .iter()
                .map(|t| t["function"]["name"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&HashSet::new()), ["a"]);
        let body = json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
            "content": [{"type": "tool_reference", "tool_name": "b"}]}]}]});
        let loaded = referenced(body.as_object().unwrap());
        assert_eq!(names(&loaded), ["a", "b"]);
        let text = reference_as_text(&json!({"type": "tool_reference", "tool_name": "b"}));
        assert_eq!(text, json!({"type": "text", "text": "Tool loaded: b"}));
    }
}
