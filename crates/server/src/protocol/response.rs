//! Response bodies and stream chunks: `chat.completion`, `chat.completion.chunk`,
//! `text_completion`, usage, and tool calls, in the shapes mlx_lm.server and OpenAI use.

use ferrolm_text::ToolCall;
use rand::Rng;
use serde_json::{json, Map, Value};

/// What every body of one response repeats.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Speculative decoding: draft tokens verified and kept (reported when any were drafted).
    pub drafted: usize,
    pub accepted: usize,
    /// Fill: spans appended, tokens kept and rows wasted, by policy (reported when any span was).
    pub fill: ferrolm_core::FillStats,
}

impl Usage {
    pub fn json(&self) -> Value {
        let mut u = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        });
        if self.drafted > 0 {
            u["speculation"] = json!({"drafted": self.drafted, "accepted": self.accepted});
        }
        if !self.fill.is_empty() {
            let counts = |c: &ferrolm_core::SpanCounts| json!({"spans": c.spans, "injected": c.injected, "wasted": c.wasted});
            u["fill"] = json!({"assert": counts(&self.fill.assert), "verify": counts(&self.fill.verify)});
        }
        u
    }
}

/// `<prefix>-<uuid4>`, as mlx_lm.server names responses.
pub fn response_id(prefix: &str) -> String {
    let b: [u8; 16] = rand::rng().random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}-{}-{}-4{}-{:x}{}-{}", &h[0..8], &h[8..12], &h[13..16], 8 + (b[8] & 3), &h[17..20], &h[20..32])
}

/// `call_` and 24 alphanumerics, as OpenAI names tool calls.
pub fn tool_call_id() -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let tail: String = (0..24).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect();
    format!("call_{tail}")
}

/// Tool calls as the API lists them; streams number them with `index` from `first_index`.
pub fn tool_calls_json(calls: &[ToolCall], first_index: Option<usize>) -> Vec<Value> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": tool_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if let Some(first) = first_index {
                v["index"] = json!(first + i);
            }
            v
        })
        .collect()
}

fn envelope(meta: &Meta, object: &str, choices: Value) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("id".into(), json!(meta.id));
    m.insert("object".into(), json!(object));
    m.insert("created".into(), json!(meta.created));
    m.insert("model".into(), json!(meta.model));
    m.insert("system_fingerprint".into(), json!(meta.fingerprint));
    m.insert("choices".into(), choices);
    m
}

/// The assistant message of a whole answer; `content` is null when empty (the schema wants the
/// key), `reasoning` and `tool_calls` appear only when present.
pub fn assistant_message(content: &str, reasoning: &str, tool_calls: Vec<Value>) -> Value {
    let mut msg = json!({"role": "assistant", "content": (!content.is_empty()).then_some(content)});
    if !reasoning.is_empty() {
        msg["reasoning"] = json!(reasoning);
    }
    if !tool_calls.is_empty() {
        msg["tool_calls"] = Value::Array(tool_calls);
    }
    msg
}

/// One choice of a whole chat answer.
pub fn chat_choice(index: usize, message: Value, logprobs: Option<Value>, finish_reason: &str) -> Value {
    let mut choice = json!({"index": index, "message": message, "finish_reason": finish_reason});
    if let Some(lp) = logprobs {
        choice["logprobs"] = lp;
    }
    choice
}

pub fn chat_completion(meta: &Meta, choices: Vec<Value>, usage: Usage) -> Value {
    let mut m = envelope(meta, "chat.completion", Value::Array(choices));
    m.insert("usage".into(), usage.json());
    Value::Object(m)
}

/// A stream chunk of one choice (`index`); OpenAI sends each choice's deltas in chunks of their own.
pub fn chat_chunk(
    meta: &Meta,
    index: usize,
    delta: Value,
    logprobs: Option<Value>,
    finish_reason: Option<&str>,
    usage: Option<Usage>,
) -> Value {
    let mut choice = json!({"index": index, "delta": delta, "finish_reason": finish_reason});
    if let Some(lp) = logprobs {
        choice["logprobs"] = lp;
    }
    let mut m = envelope(meta, "chat.completion.chunk", json!([choice]));
    if let Some(u) = usage {
        m.insert("usage".into(), u.json());
    }
    Value::Object(m)
}

/// The usage-only chunk of `stream_options.include_usage` (empty `choices`, as OpenAI sends it).
pub fn usage_chunk(meta: &Meta, object: &str, usage: Usage) -> Value {
    let mut m = envelope(meta, object, json!([]));
    m.insert("usage".into(), usage.json());
    Value::Object(m)
}

/// One choice of a text completion (whole, or a stream chunk's).
pub fn text_choice(index: usize, text: &str, logprobs: Option<Value>, finish_reason: Option<&str>) -> Value {
    json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
}

pub fn text_completion(meta: &Meta, choices: Vec<Value>, usage: Option<Usage>) -> Value {
    let mut m = envelope(meta, "text_completion", Value::Array(choices));
    if let Some(u) = usage {
        m.insert("usage".into(), u.json());
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_look_like_mlx_and_openai_ids() {
        let id = response_id("chatcmpl");
        assert_eq!(id.len(), "chatcmpl-".len() + 36);
        assert_eq!(&id[9 + 14..9 + 15], "4");
        let c = tool_call_id();
        assert!(c.starts_with("call_") && c.len() == 29);
    }

    #[test]
    fn message_and_usage_shapes() {
        let m = assistant_message("", "", vec![]);
        assert!(m["content"].is_null());
        assert!(m.get("reasoning").is_none() && m.get("tool_calls").is_none());
        let u = Usage { prompt_tokens: 3, completion_tokens: 2, cached_tokens: 1, ..Default::default() };
        assert_eq!(u.json()["total_tokens"], 5);
        assert_eq!(u.json()["prompt_tokens_details"]["cached_tokens"], 1);
        assert!(u.json().get("fill").is_none());
        let mut fill = ferrolm_core::FillStats::default();
        fill.assert = ferrolm_core::SpanCounts { spans: 2, injected: 9, wasted: 1 };
        let f = Usage { fill, ..u }.json()["fill"].clone();
        assert_eq!(f, json!({"assert": {"spans": 2, "injected": 9, "wasted": 1}, "verify": {"spans": 0, "injected": 0, "wasted": 0}}));
        let calls = tool_calls_json(&[ToolCall { name: "f".into(), arguments: "{}".into() }], Some(2));
        assert_eq!(calls[0]["index"], 2);
        assert_eq!(calls[0]["function"]["arguments"], "{}");
    }
}
