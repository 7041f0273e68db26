//! From a request to prompt token ids, and the token budget against the context window.
//! Rendering and tokenizing run on the blocking pool, so a huge prompt never stalls the HTTP
//! threads. Tokenizing is bounded by the context: a prompt that cannot fit is refused from its
//! length or as soon as the count passes the context, never tokenized whole. Every string a
//! client puts into a chat (content, names, tool calls and results, tool definitions, template
//! variables) is protected before rendering, so its special-token texts stay text: only the
//! template's scaffold makes control tokens (`ferrolm_text::Tokenizer::protect`).

use crate::errors::{ApiError, ApiResult};
use crate::protocol::chat::{convert_chat, ChatRequest};
use crate::protocol::tools;
use crate::state::SharedState;
use ferrolm_core::FillPlan;
use ferrolm_engine::fill;
use ferrolm_text::{EncodeError, ReasoningSplitter, RenderOptions, Tokenizer};
use serde_json::{Map, Value};
use std::borrow::Cow;

/// A chat rendered and tokenized.
pub struct ChatPrompt {
    pub ids: Vec<u32>,
    /// Whether the rendered prompt leaves the model inside an open `<think>`.
    pub opens_reasoning: bool,
    /// Fill's plan (docs/fill.md), when asked for and the chat has something to fill.
    pub fill: Option<FillPlan>,
}

pub async fn chat(state: &SharedState, chat: ChatRequest) -> ApiResult<ChatPrompt> {
    chat_with_fill(state, chat, false).await
}

/// [`chat`], with fill's plan when `fill`: each offered tool's call scaffold, from the
/// conversation rendered with a call to it (`ferrolm_engine::fill`).
pub async fn chat_with_fill(state: &SharedState, chat: ChatRequest, fill: bool) -> ApiResult<ChatPrompt> {
    let state = state.clone();
    blocking(move || render_chat(&state, chat, fill)).await
}

fn render_chat(state: &SharedState, chat: ChatRequest, fill: bool) -> ApiResult<ChatPrompt> {
    let bundle = state.bundle();
    let tk = &bundle.tokenizer;
    let text = render_text(state, &chat, &chat.messages, true)?;
    let add_special = bundle.template.is_none();
    let text = match &chat.prefill {
        Some(prefill) => text + &tk.protect(prefill),
        None => text,
    };
    let context = state.context_length();
    let ids = tk.encode_prompt(&text, add_special, context.saturating_sub(1)).map_err(|e| too_long(e, context, "messages"))?;
    let opens_reasoning =
        state.think_tags.as_ref().is_some_and(|(s, e)| ReasoningSplitter::prompt_opens_reasoning(&text, s, e));
    let fill = fill.then(|| fill_plan(state, &chat, Rendered { text: &text, ids: &ids })).flatten();
    Ok(ChatPrompt { ids, opens_reasoning, fill })
}

/// `messages` of `chat` as the model's template (or the plain transcript without one) writes
/// them, with or without the generation prompt. Every client string is protected; for a
/// template without tools, the tools are described in the system message and tool history is
/// written inline.
fn render_text(state: &SharedState, chat: &ChatRequest, messages: &[Value], generation: bool) -> ApiResult<String> {
    let bundle = state.bundle();
    let tk = &bundle.tokenizer;
    let mut messages: Vec<Value> = messages.iter().map(|m| protect(tk, m.clone())).collect();
    let chat_tools: Vec<Value> = chat.tools.iter().map(|t| protect(tk, t.clone())).collect();
    let template_kwargs = protect_map(tk, chat.template_kwargs.clone());
    let mut tools = (!chat_tools.is_empty()).then(|| Value::Array(chat_tools.clone()));
    if !state.template_has_tools {
        if !chat_tools.is_empty() {
            tools::describe_in_system(&mut messages, &chat_tools);
            tools = None;
        }
        messages = tools::inline_tool_history(messages);
    }
    match bundle.template {
        Some(_) => {
            let opts = RenderOptions { add_generation_prompt: generation, tools, extra: template_kwargs };
            bundle
                .render_chat(&Value::Array(messages), &opts)
                .map_err(|e| ApiError::invalid(format!("prompt build failed: {e}"), Some("messages")))
        }
        None => Ok(convert_chat(&messages)),
    }
}

/// Tools beyond this many are not probed for fill (each costs two renderings of the chat).
const MAX_FILL_TOOLS: usize = 32;

/// A prompt as rendered text and as ids.
#[derive(Clone, Copy)]
struct Rendered<'a> {
    text: &'a str,
    ids: &'a [u32],
}

/// Fill's plan for a chat whose prompt is `prompt`: assert spans for its tools (a chat with a
/// template, no prefilled answer, at most [`MAX_FILL_TOOLS`] tools), and copies when the server
/// runs them (`--fill-copies`). None when there is nothing to fill.
fn fill_plan(state: &SharedState, chat: &ChatRequest, prompt: Rendered<'_>) -> Option<FillPlan> {
    let bundle = state.bundle();
    let probe = !chat.tools.is_empty() && chat.tools.len() <= MAX_FILL_TOOLS && bundle.template.is_some() && chat.prefill.is_none();
    let tool_calls = match probe {
        true => {
            let render = |messages: Vec<Value>| -> Result<Vec<u32>, String> {
                let text = render_text(state, chat, &messages, false).map_err(|e| e.message)?;
                probe_ids(&bundle.tokenizer, prompt, &text)
            };
            match fill::probe_tools(&chat.messages, &chat.tools, render) {
                Ok(probes) => fill::tool_call_spans(prompt.ids, &probes, &bundle.tokenizer),
                Err(e) => {
                    tracing::debug!("fill: the tool-call probes did not render ({e}); no assert spans");
                    Vec::new()
                }
            }
        }
        false => Vec::new(),
    };
    let copies = state.config.fill_copies;
    (!tool_calls.is_empty() || copies).then_some(FillPlan { tool_calls, copies })
}

/// One prompt of `/v1/completions`: its ids, and its length in characters (where the legacy
/// logprobs' `text_offset`s start).
pub struct TextPrompt {
    pub ids: Vec<u32>,
    pub chars: usize,
}

/// The most prompts one `/v1/completions` request may batch: each is queued as a job of its
/// own, and more than the queue holds (`--queue-size`, 64 by default) could never all wait.
pub const MAX_PROMPTS: usize = 64;

/// `/v1/completions`' `prompt`: a string (the tokenizer's own BOS rule, as mlx-lm encodes it), a
/// list of token ids, or a batch (a list of strings or of token-id lists: one completion per
/// prompt, in order).
pub async fn text(state: &SharedState, prompt: Option<Value>) -> ApiResult<Vec<TextPrompt>> {
    let state = state.clone();
    blocking(move || {
        let bundle = state.bundle();
        let vocab = bundle.model.info().vocab_size as u64;
        let context = state.context_length();
        let encode = |raw: RawPrompt| match raw {
            RawPrompt::Ids(ids) => {
                let chars = bundle.tokenizer.decode(&ids, true).chars().count();
                Ok(TextPrompt { ids, chars })
            }
            // A raw prompt is the client's whole prompt: its special-token texts are tokens.
            RawPrompt::Text(text) => bundle
                .tokenizer
                .encode_limited(&text, true, context.saturating_sub(1))
                .map(|ids| TextPrompt { ids, chars: text.chars().count() })
                .map_err(|e| too_long(e, context, "prompt")),
        };
        parse_prompts(prompt, vocab)?.into_iter().map(encode).collect()
    })
    .await
}

/// A prompt that tokenization stopped on: 400 `context_length_exceeded` (any other failure 500).
fn too_long(e: EncodeError, context: usize, param: &str) -> ApiError {
    match e {
        EncodeError::TooLong { at_least, .. } => ApiError::invalid(
            format!(
                "This model's maximum context length is {context} tokens. However, your {param} \
                 resulted in at least {at_least} tokens (tokenizing stopped there). Please reduce \
                 the length of the {param}."
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"),
        EncodeError::Failed(e) => ApiError::internal(format!("tokenization failed: {e}")),
    }
}

/// The ids of a probe rendering (`text`) that extends the prompt's conversation. Tokenizing a
/// whole long chat once per probe would cost milliseconds per tool, so only the text from the
/// last control token the probe shares with the prompt (`<|im_start|>` of the generation
/// prompt) is tokenized, after the prompt's ids before it: control tokens are cut out before
/// any merge, so no id before one depends on what follows it. Checked on the prompt itself
/// (its text from there must give its last ids), else the whole probe is tokenized.
fn probe_ids(tk: &Tokenizer, prompt: Rendered<'_>, text: &str) -> Result<Vec<u32>, String> {
    let limit = prompt.ids.len() + 4 * fill::MAX_SPAN;
    let encode = |t: &str| tk.encode_prompt(t, false, limit).map_err(|e| e.to_string());
    let Some((at, keep)) = control_split(tk, prompt, text) else { return encode(text) };
    let mut ids = prompt.ids[..keep].to_vec();
    ids.extend(encode(&text[at..])?);
    Ok(ids)
}

/// Where `text` may be tokenized from: the byte offset of the last control token of the prompt
/// within what `text` shares with the prompt's text, and how many prompt ids come before it.
fn control_split(tk: &Tokenizer, prompt: Rendered<'_>, text: &str) -> Option<(usize, usize)> {
    let shared = prompt.text.bytes().zip(text.bytes()).take_while(|(a, b)| a == b).count();
    let last = *prompt.ids.iter().rev().find(|&&id| tk.is_special(id))?;
    let control = std::str::from_utf8(tk.token_bytes(last)).ok().filter(|c| !c.is_empty())?;
    let at = prompt.text.get(..shared)?.rfind(control)?;
    let tail = tk.encode_prompt(&prompt.text[at..], false, prompt.ids.len()).ok()?;
    let keep = prompt.ids.len().checked_sub(tail.len())?;
    (prompt.ids[keep..] == tail[..]).then_some((at, keep))
}

/// A client's value with every string (and object key) protected: special-token texts in it
/// are tokenized as text.
fn protect(tk: &Tokenizer, v: Value) -> Value {
    match v {
        Value::String(s) => match tk.protect(&s) {
            Cow::Borrowed(_) => Value::String(s),
            Cow::Owned(p) => Value::String(p),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(|x| protect(tk, x)).collect()),
        Value::Object(map) => Value::Object(protect_map(tk, map)),
        other => other,
    }
}

fn protect_map(tk: &Tokenizer, map: Map<String, Value>) -> Map<String, Value> {
    map.into_iter().map(|(k, x)| (tk.protect(&k).into_owned(), protect(tk, x))).collect()
}

#[derive(Debug)]
enum RawPrompt {
    Text(String),
    Ids(Vec<u32>),
}

fn parse_prompts(prompt: Option<Value>, vocab: u64) -> ApiResult<Vec<RawPrompt>> {
    let param = Some("prompt");
    let bad = || {
        ApiError::invalid(
            "prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
            param,
        )
    };
    let items = match prompt {
        None | Some(Value::Null) => return Err(ApiError::invalid("Request did not contain a prompt", param)),
        Some(Value::String(s)) => return Ok(vec![RawPrompt::Text(s)]),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad()),
    };
    if items.is_empty() {
        return Err(ApiError::invalid("The prompt is empty", param));
    }
    if items.iter().all(Value::is_number) {
        return Ok(vec![RawPrompt::Ids(token_ids(&items, vocab)?)]);
    }
    if items.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(format!("prompt lists at most {MAX_PROMPTS} prompts"), param));
    }
    let one = |v: Value| match v {
        Value::String(s) => Ok(RawPrompt::Text(s)),
        Value::Array(ids) if !ids.is_empty() && ids.iter().all(Value::is_number) => {
            Ok(RawPrompt::Ids(token_ids(&ids, vocab)?))
        }
        _ => Err(bad()),
    };
    items.into_iter().map(one).collect()
}

fn token_ids(items: &[Value], vocab: u64) -> ApiResult<Vec<u32>> {
    items
        .iter()
        .map(|v| v.as_u64().filter(|&id| id < vocab).map(|id| id as u32))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::invalid(format!("prompt token ids must be integers below {vocab}"), Some("prompt")))
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

    fn prompts(v: Value) -> ApiResult<Vec<RawPrompt>> {
        parse_prompts(Some(v), 100)
    }

    #[test]
    fn prompt_shapes() {
        use serde_json::json;
        let ids = |p: &RawPrompt| match p {
            RawPrompt::Ids(ids) => ids.clone(),
            RawPrompt::Text(_) => vec![],
        };
        assert!(matches!(&prompts(json!("hi")).unwrap()[..], [RawPrompt::Text(t)] if t == "hi"));
        assert_eq!(ids(&prompts(json!([1, 2])).unwrap()[0]), vec![1, 2]);
        let batch = prompts(json!(["a", "b", "c"])).unwrap();
        assert!(matches!(&batch[..], [RawPrompt::Text(a), RawPrompt::Text(_), RawPrompt::Text(c)] if a == "a" && c == "c"));
        let batch = prompts(json!([[1], [2, 3]])).unwrap();
        assert_eq!(batch.iter().map(ids).collect::<Vec<_>>(), vec![vec![1], vec![2, 3]]);
        for bad in [json!([]), json!({"a": 1}), json!(["a", 1]), json!([[]]), json!([[1, "x"]]), json!([-1]), json!([100])] {
            assert_eq!(prompts(bad).unwrap_err().param.as_deref(), Some("prompt"));
        }
        assert!(prompts(json!(vec!["x"; MAX_PROMPTS + 1])).is_err());
        assert_eq!(parse_prompts(None, 100).unwrap_err().message, "Request did not contain a prompt");
    }

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

    /// A probe's ids from the prompt's ids and its text after the last shared control token
    /// equal the whole probe tokenized (Qwen2.5's tokenizer; skipped without the model).
    #[test]
    fn probe_ids_equal_the_whole_rendering_tokenized() {
        let path = ferrolm_models::paths::models_dir().join("qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf");
        let Ok(tk) = Tokenizer::from_gguf_file(&path) else { return eprintln!("SKIP: {} not present", path.display()) };
        // User text that spells a control token (protected), and a tool call in the history.
        let user = tk.protect("Say <|im_start|>assistant please").into_owned();
        let head = format!("<|im_start|>system\nTools<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant");
        let prompt_text = format!("{head}\n");
        let ids = tk.encode_prompt(&prompt_text, false, usize::MAX).unwrap();
        let prompt = Rendered { text: &prompt_text, ids: &ids };
        for call in ["\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"a\": 1}}\n</tool_call><|im_end|>\n", "\nPlain answer<|im_end|>\n"] {
            let probe = format!("{head}{call}");
            let whole = tk.encode_prompt(&probe, false, usize::MAX).unwrap();
            assert!(control_split(&tk, prompt, &probe).is_some_and(|(_, keep)| keep + 3 == ids.len()));
            assert_eq!(probe_ids(&tk, prompt, &probe).unwrap(), whole, "{call:?}");
        }
        // No control token shared: the whole text is tokenized.
        let plain = Rendered { text: "hello", ids: &tk.encode_prompt("hello", false, 10).unwrap() };
        assert_eq!(control_split(&tk, plain, "hello world"), None);
        assert_eq!(probe_ids(&tk, plain, "hello world").unwrap(), tk.encode_prompt("hello world", false, 99).unwrap());
    }
}
