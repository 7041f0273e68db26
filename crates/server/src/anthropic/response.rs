//! Anthropic Messages response bodies: the `message` object, its content blocks, `stop_reason`
//! and `usage`, and the ids (`msg_…`, `toolu_…`) in Anthropic's form.

use crate::errors::{ApiError, ApiResult};
use crate::protocol::response::Usage;
use ferrolm_text::ToolCall;
use rand::Rng;
use serde_json::{json, Value};

/// `<prefix>01` and 22 alphanumerics, as Anthropic's ids look (`msg_01XFDUDYJgAACzvnptvVoYEL`).
pub fn id(prefix: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..22).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect();
    format!("{prefix}01{tail}")
}

/// The chat finish reason (and whether a stop string ended it) as Anthropic's `stop_reason`.
pub fn stop_reason(reason: &str, stop: Option<&str>) -> &'static str {
    match (reason, stop) {
        ("tool_calls", _) => "tool_use",
        ("length", _) => "max_tokens",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

/// Anthropic counts prompt tokens read from a cache apart from `input_tokens`.
pub fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
    })
}

/// A `tool_use` block; `input` is the call's arguments as an object.
pub fn tool_use_block(call: &ToolCall) -> ApiResult<Value> {
    Ok(json!({"type": "tool_use", "id": id("toolu_"), "name": call.name, "input": tool_input(call)?}))
}

/// The parser only emits calls whose arguments are a JSON object; anything else is a bug here.
pub fn tool_input(call: &ToolCall) -> ApiResult<Value> {
    match serde_json::from_str::<Value>(&call.arguments) {
        Ok(v @ Value::Object(_)) => Ok(v),
        _ => Err(ApiError::internal(format!("tool call {} has arguments that are not an object", call.name))),
    }
}

pub fn thinking_block(text: &str) -> Value {
    json!({"type": "thinking", "thinking": text, "signature": ""})
}

pub fn text_block(text: &str) -> Value {
    json!({"type": "text", "text": text})
}

/// The whole message. Text that is only whitespace (between tool calls, or nothing at all) is
/// not a block.
pub struct Message<'a> {
    pub id: &'a str,
    pub model: &'a str,
    /// The reasoning; None: no thinking block (none, or redacted text for `display: omitted`
    /// is given as Some("")).
    pub thinking: Option<&'a str>,
    pub text: &'a str,
    pub calls: &'a [ToolCall],
    pub stop_reason: Option<&'a str>,
    pub stop_sequence: Option<&'a str>,
    pub usage: Value,
}

impl Message<'_> {
    pub fn json(&self) -> ApiResult<Value> {
        let mut content = Vec::new();
        if let Some(thinking) = self.thinking {
            content.push(thinking_block(thinking));
        }
        if !self.text.trim().is_empty() {
            content.push(text_block(self.text));
        }
        for c in self.calls {
            content.push(tool_use_block(c)?);
        }
        Ok(json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_reasons() {
        let m = id("msg_");
        assert!(m.starts_with("msg_01") && m.len() == 28);
        assert_eq!(stop_reason("stop", None), "end_turn");
        assert_eq!(stop_reason("stop", Some("END")), "stop_sequence");
        assert_eq!(stop_reason("length", None), "max_tokens");
        assert_eq!(stop_reason("tool_calls", None), "tool_use");
    }

    #[test]
    fn message_shape() {
        let calls = [ToolCall { name: "w".into(), arguments: "{\"city\": \"Paris\"}".into() }];
        let usage = usage(&Usage { prompt_tokens: 9, completion_tokens: 4, cached_tokens: 0, ..Default::default() });
        let m = Message {
            id: "msg_01x",
            model: "m",
            thinking: None,
            text: " \n",
            calls: &calls,
            stop_reason: Some("tool_use"),
            stop_sequence: None,
            usage,
        };
        let v = m.json().unwrap();
        assert_eq!(v["content"].as_array().unwrap().len(), 1);
        assert_eq!(v["content"][0]["input"], json!({"city": "Paris"}));
        assert!(v["content"][0]["id"].as_str().unwrap().starts_with("toolu_01"));
        assert_eq!(v["usage"]["input_tokens"], 9);
        assert_eq!(v["usage"]["output_tokens"], 4);
        assert!(v["stop_sequence"].is_null());
    }
}
