//! From a request to prompt token ids, and the token budget against the context window.
//! Rendering and tokenizing run on the blocking pool, so a huge prompt never stalls the HTTP
//! threads.

use crate::errors::{ApiError, ApiResult};
use crate::protocol::chat::{convert_chat, ChatRequest};
use crate::protocol::tools;
use crate::state::SharedState;
use ferrolm_text::{ReasoningSplitter, RenderOptions};
use serde_json::Value;

/// A chat rendered and tokenized.
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// Whether the rendered prompt leaves the model inside an open `<think>`.
    pub opens_reasoning: bool,
}

pub async fn chat(state: &SharedState, chat: ChatRequest) -> ApiResult<ChatPrompt> {
    let state = state.clone();
    blocking(move || render_chat(&state, chat)).await
}

fn render_chat(state: &SharedState, chat: ChatRequest) -> ApiResult<ChatPrompt> {
    let bundle = state.bundle();
    let mut messages = chat.messages;
    let mut tools = (!chat.tools.is_empty()).then(|| Value::Array(chat.tools.clone()));
    if !state.template_has_tools {
        if !chat.tools.is_empty() {
            tools::describe_in_system(&mut messages, &chat.tools);
            tools = None;
        }
        messages = tools::inline_tool_history(messages);
    }
    let (text, add_special) = match bundle.template {
        Some(_) => {
            let opts = RenderOptions { add_generation_prompt: true, tools, extra: chat.template_kwargs };
            let text = bundle
                .render_chat(&Value::Array(messages), &opts)
                .map_err(|e| ApiError::invalid(format!("prompt build failed: {e}"), Some("messages")))?;
            (text, false)
        }
        None => (convert_chat(&messages), true),
    };
    let text = match chat.prefill {
        Some(prefill) => text + &prefill,
        None => text,
    };
    let ids = bundle
        .tokenizer
        .encode(&text, add_special)
        .map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))?;
    let opens_reasoning =
        state.think_tags.as_ref().is_some_and(|(s, e)| ReasoningSplitter::prompt_opens_reasoning(&text, s, e));
    Ok(ChatPrompt { ids, opens_reasoning })
}

/// `/v1/completions`' `prompt`: a string (the tokenizer's own BOS rule, as mlx-lm encodes it), a
/// one-element list of a string, or a list of token ids.
pub async fn text(state: &SharedState, prompt: Option<Value>) -> ApiResult<Vec<u32>> {
    let state = state.clone();
    blocking(move || text_ids(&state, prompt)).await
}

fn text_ids(state: &SharedState, prompt: Option<Value>) -> ApiResult<Vec<u32>> {
    let bundle = state.bundle();
    let param = Some("prompt");
    let bad = || ApiError::invalid("prompt must be of type str", param);
    let text = match prompt {
        None => return Err(ApiError::invalid("Request did not contain a prompt", param)),
        Some(Value::String(s)) => s,
        Some(Value::Array(items)) if items.iter().all(Value::is_u64) && !items.is_empty() => {
            let vocab = bundle.model.info().vocab_size as u64;
            return items
                .iter()
                .map(|v| v.as_u64().filter(|&id| id < vocab).map(|id| id as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| ApiError::invalid(format!("prompt token ids must be below {vocab}"), param));
        }
        Some(Value::Array(mut items)) if items.len() == 1 && items[0].is_string() => match items.pop() {
            Some(Value::String(s)) => s,
            _ => return Err(bad()),
        },
        Some(_) => return Err(bad()),
    };
    bundle.prompt_ids(None, &text).map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> ApiResult<T> + Send + 'static) -> ApiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("prompt preparation failed: {e}")))?
}

/// The tokens a request may generate. An explicit `max_tokens` that does not fit beside the
/// prompt is a 400 (never a silent truncation); the server default is capped to what fits.
pub fn token_budget(
    prompt_len: usize,
    requested: Option<usize>,
    default: usize,
    context: usize,
    param: &str,
) -> ApiResult<usize> {
    if prompt_len == 0 {
        return Err(ApiError::invalid("The prompt is empty", Some(param)));
    }
    let over = |completion: usize| {
        ApiError::invalid(
            format!(
                "This model's maximum context length is {context} tokens. However, you requested \
                 {} tokens ({prompt_len} in the {param}, {completion} in the completion). Please \
                 reduce the length of the {param} or completion.",
                prompt_len + completion
            ),
            Some(param),
        )
        .with_code("context_length_exceeded")
    };
    match requested {
        Some(n) if prompt_len + n > context => Err(over(n)),
        Some(n) => Ok(n),
        None if prompt_len >= context => Err(over(default)),
        None => Ok(default.min(context - prompt_len)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets() {
        assert_eq!(token_budget(10, Some(5), 512, 100, "messages").unwrap(), 5);
        assert_eq!(token_budget(10, None, 512, 100, "messages").unwrap(), 90);
        let e = token_budget(90, Some(11), 512, 100, "messages").unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("you requested 101 tokens (90 in the messages, 11 in the completion)"));
        assert!(token_budget(100, None, 512, 100, "prompt").is_err());
        assert!(token_budget(0, None, 512, 100, "prompt").is_err());
    }
}
