//! The Responses API's `response` object and its output items (`reasoning`, `message` with
//! `output_text`, `function_call`), ids in OpenAI's form (`resp_…`, `msg_…`, `fc_…`, `rs_…`),
//! status, usage.

use crate::protocol::response::{tool_call_id, Usage};
use crate::state::unix_now;
use ferrolm_text::ToolCall;
use rand::Rng;
use serde_json::{json, Map, Value};

/// `<prefix>_` and 48 hex digits, as OpenAI's response and item ids look.
pub fn id(prefix: &str) -> String {
    let b: [u8; 24] = rand::rng().random();
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}_{hex}")
}

pub fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"id": id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
}

pub fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// A message item; `text` None: just opened, no content part yet.
pub fn message_item(id: &str, text: Option<&str>, status: &str) -> Value {
    let content: Vec<Value> = text.map(output_text).into_iter().collect();
    json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
}

pub fn function_call_item(id: &str, call_id: &str, call: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id, "name": call.name,
           "arguments": arguments})
}

/// The output items of a whole generation: reasoning, the text (unless only whitespace), calls.
pub fn output_items(reasoning: &str, text: &str, calls: &[ToolCall]) -> Vec<Value> {
    let mut items = Vec::new();
    if !reasoning.is_empty() {
        items.push(reasoning_item(&id("rs"), reasoning));
    }
    if !text.trim().is_empty() {
        items.push(message_item(&id("msg"), Some(text), "completed"));
    }
    for c in calls {
        items.push(function_call_item(&id("fc"), &tool_call_id(), c, &c.arguments, "completed"));
    }
    items
}

pub fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The response object before it has output: the request's settings echoed, as OpenAI does.
pub fn skeleton(id: &str, model: &str, body: &Map<String, Value>) -> Value {
    let get = |k: &str, default: Value| body.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
    json!({
        "id": id,
        "object": "response",
        "created_at": unix_now(),
        "status": "in_progress",
        "error": null,
        "incomplete_details": null,
        "instructions": get("instructions", Value::Null),
        "max_output_tokens": get("max_output_tokens", Value::Null),
        "model": model,
        "output": [],
        "parallel_tool_calls": get("parallel_tool_calls", json!(true)),
        "previous_response_id": get("previous_response_id", Value::Null),
        "reasoning": get("reasoning", json!({"effort": null, "summary": null})),
        "store": get("store", json!(true)),
        "temperature": get("temperature", Value::Null),
        "text": get("text", json!({"format": {"type": "text"}})),
        "tool_choice": get("tool_choice", json!("auto")),
        "tools": get("tools", json!([])),
        "top_p": get("top_p", Value::Null),
        "truncation": "disabled",
        "usage": null,
        "user": get("user", Value::Null),
        "metadata": get("metadata", json!({})),
    })
}

/// Fills in the end: `completed`, or `incomplete` when the token limit cut it short.
pub fn finish(response: &mut Value, output: Vec<Value>, reason: &str, u: &Usage) {
    let length = reason == "length";
    response["status"] = json!(if length { "incomplete" } else { "completed" });
    if length {
        response["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    response["output"] = Value::Array(output);
    response["usage"] = usage(u);
}

pub fn fail(response: &mut Value, output: Vec<Value>, message: &str) {
    response["status"] = json!("failed");
    response["error"] = json!({"code": "server_error", "message": message});
    response["output"] = Value::Array(output);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let r = id("resp");
        assert!(r.starts_with("resp_") && r.len() == 53);
        let calls = [ToolCall { name: "f".into(), arguments: "{}".into() }];
        let items = output_items("", "  ", &calls);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0]["type"], "function_call");
        assert!(items[0]["call_id"].as_str().unwrap().starts_with("call_"));
        let body = json!({"instructions": "be brief", "store": false}).as_object().unwrap().clone();
        let mut resp = skeleton("resp_1", "m", &body);
        assert_eq!(resp["instructions"], "be brief");
        assert_eq!(resp["store"], false);
        let u = Usage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 0, ..Default::default() };
        finish(&mut resp, output_items("", "hi", &[]), "length", &u);
        assert_eq!(resp["status"], "incomplete");
        assert_eq!(resp["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(resp["output"][0]["content"][0]["text"], "hi");
        assert_eq!(resp["usage"]["total_tokens"], 5);
    }
}
