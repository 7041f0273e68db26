//! The chat-only fields: `messages` normalized for the chat template as mlx_lm.server does
//! (text parts joined, null content as "", `developer` as `system`, tool-call arguments given as
//! JSON strings parsed to objects), `tools` / `tool_choice`, and the template variables
//! (`--chat-template-args`, `chat_template_kwargs`, `reasoning_effort`).

use crate::errors::{ApiError, ApiResult};
use ferrolm_text::ToolSpec;
use serde_json::{Map, Value};

#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    /// Tools offered to the model (after `tool_choice`); empty: none, and no tool parsing.
    pub tools: Vec<Value>,
    pub tool_specs: Vec<ToolSpec>,
    pub template_kwargs: Map<String, Value>,
    /// Text the answer continues from, appended after the rendered generation prompt
    /// (Anthropic's final assistant message, "prefill"); None for OpenAI chat, as in mlx-lm.
    pub prefill: Option<String>,
    /// `max_tokens` is only an upper bound, lowered to what fits beside the prompt (Anthropic's
    /// clients ask for what their own models allow: Claude Code sends 32,000 whatever the
    /// context); false: a request beyond the context is a 400, as in mlx_lm.server.
    pub cap_max_tokens: bool,
    /// `tool_choice` `required` or a named function: the answer must be a tool call (a
    /// constraint; see `crate::structured::for_tools`).
    pub force_tool_call: Option<ForcedCall>,
    /// OpenAI's `parallel_tool_calls` (default true): `required` may make several calls.
    pub parallel_tool_calls: bool,
}

/// A tool call the answer must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForcedCall {
    /// `required`: a call of any offered tool.
    Any,
    /// A named function: a call of that one.
    Named(String),
}

pub fn parse_chat(
    body: &Map<String, Value>,
    server_args: &Map<String, Value>,
    has_thinking: bool,
) -> ApiResult<ChatRequest> {
    let messages = parse_messages(body)?;
    let (tools, force_tool_call) = parse_tools(body)?;
    let tool_specs = tools.iter().filter_map(ToolSpec::from_openai).collect();
    let template_kwargs = template_kwargs(body, server_args, has_thinking)?;
    let parallel_tool_calls = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("parallel_tool_calls must be of type bool", Some("parallel_tool_calls"))),
    };
    Ok(ChatRequest {
        messages,
        tools,
        tool_specs,
        template_kwargs,
        prefill: None,
        cap_max_tokens: false,
        force_tool_call,
        parallel_tool_calls,
    })
}

fn parse_messages(body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    let param = Some("messages");
    let list = match body.get("messages") {
        None => return Err(ApiError::invalid("Request did not contain messages", param)),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("messages must be of type list", param)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages must be a non-empty list", param));
    }
    list.iter().enumerate().map(|(i, m)| normalize_message(i, m)).collect()
}

fn normalize_message(i: usize, m: &Value) -> ApiResult<Value> {
    let bad = |what: &str| ApiError::invalid(format!("messages[{i}]{what}"), Some("messages"));
    let Value::Object(obj) = m else {
        return Err(bad(" must be of type dict"));
    };
    let mut obj = obj.clone();
    match obj.get("role") {
        Some(Value::String(r)) if r == "developer" => {
            obj.insert("role".into(), Value::String("system".into()));
        }
        Some(Value::String(_)) => {}
        _ => return Err(bad(".role must be of type str")),
    }
    let content = match obj.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => join_text_parts(parts)
            .ok_or_else(|| ApiError::invalid("Only 'text' content type is supported.", Some("messages")))?,
        Some(_) => return Err(bad(".content must be of type str or list")),
    };
    obj.insert("content".into(), Value::String(content));
    if let Some(calls) = obj.get_mut("tool_calls") {
        parse_call_arguments(i, calls)?;
    }
    Ok(Value::Object(obj))
}

/// `[{"type": "text", "text": …}, …]` joined; None if any part is not text.
fn join_text_parts(parts: &[Value]) -> Option<String> {
    parts
        .iter()
        .map(|p| match (p.get("type")?.as_str()?, p.get("text")) {
            ("text", Some(Value::String(t))) => Some(t.as_str()),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .map(|t| t.concat())
}

/// Templates iterate over arguments as a mapping: a JSON string is parsed (as mlx-lm does).
fn parse_call_arguments(i: usize, calls: &mut Value) -> ApiResult<()> {
    let Value::Array(calls) = calls else {
        if calls.is_null() {
            return Ok(());
        }
        return Err(ApiError::invalid(format!("messages[{i}].tool_calls must be of type list"), Some("messages")));
    };
    for (j, call) in calls.iter_mut().enumerate() {
        let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments")) else {
            continue;
        };
        if let Value::String(s) = args {
            if s.is_empty() {
                continue;
            }
            *args = serde_json::from_str(s).map_err(|e| {
                ApiError::invalid(
                    format!("messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}"),
                    Some("messages"),
                )
            })?;
        }
    }
    Ok(())
}

/// The offered tools, and whether a call is forced.
fn parse_tools(body: &Map<String, Value>) -> ApiResult<(Vec<Value>, Option<ForcedCall>)> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => return Ok((Vec::new(), None)),
        Some(Value::Array(t)) => t.clone(),
        Some(_) => return Err(ApiError::invalid("tools must be of type list", Some("tools"))),
    };
    for (i, t) in tools.iter().enumerate() {
        if ToolSpec::from_openai(t).is_none() {
            return Err(ApiError::invalid(format!("tools[{i}].function.name must be of type str"), Some("tools")));
        }
    }
    select_tools(tools, body.get("tool_choice"))
}

/// `tool_choice`: `none` offers no tools; `auto` and absent offer all; `required` offers all
/// and forces a call; a named function offers only that one and forces it.
fn select_tools(tools: Vec<Value>, choice: Option<&Value>) -> ApiResult<(Vec<Value>, Option<ForcedCall>)> {
    let err = |m: String| ApiError::invalid(m, Some("tool_choice"));
    match choice {
        None | Some(Value::Null) => Ok((tools, None)),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok((Vec::new(), None)),
            "auto" => Ok((tools, None)),
            // One tool offered: `required` can only mean that one, and naming it in the
            // opening leaves the model no other name to write.
            "required" => {
                let forced = match &tools[..] {
                    [] => None,
                    [only] => ToolSpec::from_openai(only).map(|s| ForcedCall::Named(s.name)),
                    _ => Some(ForcedCall::Any),
                };
                Ok((tools, forced))
            }
            other => Err(err(format!("tool_choice must be 'none', 'auto', 'required' or a function, not '{other}'"))),
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| err("tool_choice.function.name must be of type str".into()))?;
            let chosen: Vec<Value> =
                tools.into_iter().filter(|t| ToolSpec::from_openai(t).is_some_and(|s| s.name == name)).collect();
            if chosen.is_empty() {
                return Err(err(format!("tool_choice names '{name}', which is not in tools")));
            }
            Ok((chosen, Some(ForcedCall::Named(name.to_string()))))
        }
        Some(_) => Err(err("tool_choice must be of type str or dict".into())),
    }
}

/// Server args, then `reasoning_effort` (`none` turns thinking off, a level turns it on), then
/// the request's `chat_template_kwargs`; `enable_thinking` defaults to whether the model has
/// thinking tags (mlx-lm's TokenizerWrapper does the same).
fn template_kwargs(
    body: &Map<String, Value>,
    server_args: &Map<String, Value>,
    has_thinking: bool,
) -> ApiResult<Map<String, Value>> {
    let mut kw = server_args.clone();
    match body.get("reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) => {
            kw.insert("enable_thinking".into(), Value::Bool(e != "none"));
            kw.insert("reasoning_effort".into(), Value::String(e.clone()));
        }
        Some(_) => return Err(ApiError::invalid("reasoning_effort must be of type str", Some("reasoning_effort"))),
    }
    match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(o)) => kw.extend(o.iter().map(|(k, v)| (k.clone(), v.clone()))),
        Some(_) => {
            return Err(ApiError::invalid("chat_template_kwargs must be of type dict", Some("chat_template_kwargs")))
        }
    }
    kw.entry("enable_thinking").or_insert(Value::Bool(has_thinking));
    Ok(kw)
}

/// mlx_lm.server's prompt for a model without a chat template (`convert_chat`).
pub fn convert_chat(messages: &[Value]) -> String {
    let mut prompt = String::new();
    for m in messages {
        let prefix = match m["role"].as_str().unwrap_or_default() {
            "system" => "ASSISTANT's RULE: ",
            "user" => "USER: ",
            "assistant" => "ASSISTANT: ",
            _ => "",
        };
        prompt.push_str(prefix);
        prompt.push_str(m["content"].as_str().unwrap_or_default());
        prompt.push('\n');
    }
    prompt.push_str("ASSISTANT: ");
    prompt.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn messages_are_normalized() {
        let body = obj(json!({"messages": [
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": null},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        ]}));
        let c = parse_chat(&body, &Map::new(), false).unwrap();
        assert_eq!(c.messages[0], json!({"role": "system", "content": "ab"}));
        assert_eq!(c.messages[1]["content"], "");
        assert_eq!(c.messages[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(c.template_kwargs["enable_thinking"], false);
    }

    #[test]
    fn bad_messages_are_400s() {
        let cases = [
            (json!({}), "Request did not contain messages"),
            (json!({"messages": "hi"}), "messages must be of type list"),
            (json!({"messages": []}), "messages must be a non-empty list"),
            (json!({"messages": [1]}), "messages[0] must be of type dict"),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role must be of type str"),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "Only 'text' content type is supported.",
            ),
            (json!({"messages": [{"role": "user", "content": "x"}], "tools": {}}), "tools must be of type list"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1}),
                "chat_template_kwargs must be of type dict",
            ),
        ];
        for (body, msg) in cases {
            let e = parse_chat(&obj(body), &Map::new(), false).unwrap_err();
            assert_eq!(e.message, msg);
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn tool_choice_selects_tools() {
        let tools = json!([
            {"type": "function", "function": {"name": "a"}},
            {"type": "function", "function": {"name": "b"}}]);
        let with = |choice: Value| {
            let body =
                obj(json!({"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}));
            parse_chat(&body, &Map::new(), false)
        };
        assert_eq!(with(json!("auto")).unwrap().tool_specs.len(), 2);
        assert_eq!(with(json!("none")).unwrap().tool_specs.len(), 0);
        let one = with(json!({"type": "function", "function": {"name": "b"}})).unwrap();
        assert_eq!(one.tool_specs[0].name, "b");
        assert!(with(json!({"type": "function", "function": {"name": "c"}})).is_err());
        assert!(with(json!("sometimes")).is_err());
    }

    #[test]
    fn template_kwargs_precedence() {
        let server = obj(json!({"enable_thinking": true, "x": 1}));
        let body = obj(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"}));
        let c = parse_chat(&body, &server, true).unwrap();
        assert_eq!(c.template_kwargs["enable_thinking"], false);
        let body = obj(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": true}}));
        let c = parse_chat(&body, &server, true).unwrap();
        assert_eq!(c.template_kwargs["enable_thinking"], true);
        assert_eq!(c.template_kwargs["x"], 1);
    }

    #[test]
    fn convert_chat_matches_mlx() {
        let m = vec![json!({"role": "system", "content": "S"}), json!({"role": "user", "content": "U"})];
        assert_eq!(convert_chat(&m), "ASSISTANT's RULE: S\nUSER: U\nASSISTANT:");
    }
}
