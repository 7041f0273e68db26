//! No silent ignores: every request field an endpoint knows is in one of three classes, and
//! anything else is unknown.
//!
//! - **Honoured**: the field has its effect (sampling, tools, `n`, logprobs…), or is validated
//!   and refused by the endpoint's own parser for the values it cannot honour.
//! - **No meaning here**: clients send it routinely and it changes nothing in the output of a
//!   local server (`user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`,
//!   prompt-cache hints…): accepted and listed in docs/server.md.
//! - **Refused**: it would change the output and ferrolm cannot do it (yet): 400 naming the
//!   field, unless its value asks for nothing (null, or the default, e.g. `response_format:
//!   {"type": "text"}`).
//!
//! Unknown fields are accepted, as vLLM does, so newer SDKs keep working; each is named in the
//! request's log line, and logged as a warning the first time the server sees it.

use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::sync::Mutex;

/// A field refused unless `allows` its value.
pub struct Refusal {
    pub field: &'static str,
    pub allows: fn(&Value) -> bool,
    pub what: &'static str,
}

pub struct Schema {
    pub endpoint: &'static str,
    pub honoured: &'static [&'static str],
    pub no_meaning: &'static [&'static str],
    pub refused: &'static [Refusal],
}

/// The sampling fields both OpenAI generation endpoints read (mlx_lm.server's set and OpenAI's).
macro_rules! sampling {
    ($($extra:literal),* $(,)?) => {
        &["stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
          "frequency_penalty", "frequency_context_size", "xtc_probability", "xtc_threshold",
          "logit_bias", "seed", "stop", "logprobs", "top_logprobs", "n", "num_draft_tokens",
          "speculative", "adapter", "x_ferrolm_fault",
          // Structured output (crate::structured).
          "response_format", "json_schema", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
          "structured_outputs", "grammar", "jump_forward", "fill", $($extra),*]
    };
}

fn null(v: &Value) -> bool {
    v.is_null()
}

fn null_or_empty(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(Map::is_empty)
}

pub const CHAT: Schema = Schema {
    endpoint: "/v1/chat/completions",
    honoured: sampling![
        "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
        "reasoning_effort"
    ],
    no_meaning: &[
        "model", "user", "metadata", "store", "service_tier", "prompt_cache_key",
        "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "prediction",
    ],
    refused: &[
        Refusal { field: "audio", allows: null, what: "audio output" },
        Refusal { field: "modalities", allows: |v| v.is_null() || v == &serde_json::json!(["text"]), what: "output modalities other than text" },
        Refusal { field: "functions", allows: null_or_empty, what: "the deprecated `functions` (use `tools`)" },
        Refusal { field: "function_call", allows: |v| v.is_null() || v.as_str().is_some_and(|s| s == "none" || s == "auto"), what: "the deprecated `function_call` (use `tool_choice`)" },
        Refusal { field: "web_search_options", allows: null, what: "web search" },
        Refusal { field: "verbosity", allows: |v| v.is_null() || v.as_str() == Some("medium"), what: "a verbosity other than medium" },
        Refusal { field: "moderation", allows: null, what: "moderation" },
    ],
};

pub const COMPLETIONS: Schema = Schema {
    endpoint: "/v1/completions",
    // echo, suffix and best_of are refused by the endpoint for the values it cannot honour.
    honoured: sampling!["prompt", "echo", "suffix", "best_of"],
    no_meaning: &["model", "user"],
    refused: &[],
};

pub const EMBEDDINGS: Schema = Schema {
    endpoint: "/v1/embeddings",
    honoured: &["input", "encoding_format", "dimensions"],
    no_meaning: &["model", "user"],
    refused: &[],
};

pub const MESSAGES: Schema = Schema {
    endpoint: "/v1/messages",
    // The translator refuses container, mcp_servers and output_config.format itself.
    honoured: &[
        "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
        "tools", "tool_choice", "thinking", "container", "mcp_servers", "output_config", "adapter", "x_ferrolm_fault",
    ],
    no_meaning: &[
        "metadata", "cache_control", "service_tier", "speed", "inference_geo", "diagnostics", "context_management",
        "user_profile_id", "workspace_id",
    ],
    refused: &[],
};

pub const RESPONSES: Schema = Schema {
    endpoint: "/v1/responses",
    // The translator refuses background, conversation, prompt, truncation "auto", top_logprobs
    // and non-text formats itself.
    honoured: &[
        "model", "input", "instructions", "tools", "tool_choice", "reasoning", "max_output_tokens", "temperature",
        "top_p", "stream", "previous_response_id", "store", "text", "truncation", "background", "conversation",
        "prompt", "top_logprobs", "adapter", "x_ferrolm_fault",
    ],
    no_meaning: &[
        "include", "parallel_tool_calls", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "metadata", "user", "service_tier", "safety_identifier", "stream_options", "max_tool_calls", "client_metadata",
    ],
    refused: &[
        Refusal { field: "context_management", allows: null_or_empty, what: "context management (compaction)" },
        Refusal { field: "moderation", allows: null, what: "moderation" },
        Refusal { field: "image", allows: null, what: "image generation" },
        Refusal { field: "access_programs", allows: null_or_empty, what: "access programs" },
    ],
};

impl Schema {
    /// Refuses a field this endpoint cannot honour; names the unknown ones in the log.
    pub fn check(&self, body: &Map<String, Value>, log: &RequestLog, warned: &WarnedFields) -> ApiResult<()> {
        let mut unknown = Vec::new();
        for (name, value) in body {
            if let Some(r) = self.refused.iter().find(|r| r.field == name) {
                if !(r.allows)(value) {
                    let msg = format!("{name}: {} is not supported by this server", r.what);
                    return Err(ApiError::invalid(msg, Some(name)));
                }
            } else if !self.honoured.contains(&name.as_str()) && !self.no_meaning.contains(&name.as_str()) {
                unknown.push(name.chars().take(64).collect::<String>());
            }
        }
        if !unknown.is_empty() {
            warned.first_time(self.endpoint, &unknown);
            log.ignored(unknown);
        }
        Ok(())
    }
}

/// Unknown field names already warned about (a bounded set: at most one warning per name).
#[derive(Default)]
pub struct WarnedFields(Mutex<HashSet<String>>);

const WARNED_MAX: usize = 1024;

impl WarnedFields {
    fn first_time(&self, endpoint: &str, names: &[String]) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for name in names {
            if seen.len() < WARNED_MAX && seen.insert(format!("{endpoint} {name}")) {
                // Quoted and escaped: a client's field name cannot forge a log line.
                tracing::warn!("{endpoint}: unknown request field {name:?} accepted and not used");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn classes() {
        let log = RequestLog::detached();
        let warned = WarnedFields::default();
        let body = |v: Value| v.as_object().unwrap().clone();
        assert!(CHAT.check(&body(json!({"messages": [], "user": "u", "response_format": {"type": "text"}})), &log, &warned).is_ok());
        assert!(CHAT.check(&body(json!({"response_format": {"type": "json_object"}})), &log, &warned).is_ok());
        // llama-server's GBNF `grammar` is honoured (crate::structured), on both endpoints.
        assert!(CHAT.check(&body(json!({"grammar": "root ::= \"x\""})), &log, &warned).is_ok());
        assert!(COMPLETIONS.check(&body(json!({"grammar": "root ::= \"x\""})), &log, &warned).is_ok());
        let e = CHAT.check(&body(json!({"audio": {"voice": "x"}})), &log, &warned).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("audio"));
        assert!(CHAT.check(&body(json!({"brand_new_field": 1})), &log, &warned).is_ok());
        assert_eq!(warned.0.lock().unwrap().len(), 1);
        for s in [&CHAT, &COMPLETIONS, &EMBEDDINGS, &MESSAGES, &RESPONSES] {
            let mut all: Vec<&str> = s.honoured.iter().chain(s.no_meaning).copied().collect();
            all.extend(s.refused.iter().map(|r| r.field));
            let n = all.len();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), n, "{}: a field in two classes", s.endpoint);
        }
    }
}
