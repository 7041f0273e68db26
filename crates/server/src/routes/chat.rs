//! `POST /v1/chat/completions` (and mlx_lm.server's `/chat/completions`). [`prepare`] is the
//! chat request's whole path from a body to a request ready to queue; the Anthropic and
//! Responses endpoints translate their bodies into a chat body and run it too.

use super::prompt::{self, token_budget};
use super::{start, Prepared, Started};
use crate::choices::UsageSum;
use crate::errors::ApiResult;
use crate::pipeline::PipelineConfig;
use crate::http::log::RequestLog;
use crate::errors::ApiError;
use crate::protocol::chat::{parse_chat, ChatRequest, ForcedCall};
use crate::structured::{self, Requested};
use ferrolm_grammar::ConstraintSpec;
use crate::protocol::fields;
use crate::protocol::logprobs;
use crate::protocol::request::{parse_body_async, parse_common, CommonParams};
use crate::protocol::response;
use crate::state::SharedState;
use crate::openai_stream::Kind;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde_json::{Map, Value};

pub async fn handle(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    super::guarded(run(&state, body, &log)).await
}

/// Validates a chat body, renders and tokenizes its prompt, and sets the token budget and the
/// output routing (stops, reasoning tags, offered tools).
pub(crate) async fn prepare(state: &SharedState, body: &Map<String, Value>) -> ApiResult<Prepared> {
    let (common, chat) = parse(state, body)?;
    prepare_parsed(state, common, chat).await
}

/// The sampling / stream fields and the chat (messages, tools, template variables) of a body.
pub(crate) fn parse(state: &SharedState, body: &Map<String, Value>) -> ApiResult<(CommonParams, ChatRequest)> {
    let vocab_size = state.bundle().model.info().vocab_size;
    let common = parse_common(body, &state.config, vocab_size)?;
    let chat = parse_chat(body, &state.config.chat_template_args, state.think_tags.is_some())?;
    Ok((common, chat))
}

pub(crate) async fn prepare_parsed(
    state: &SharedState,
    common: CommonParams,
    chat: ChatRequest,
) -> ApiResult<Prepared> {
    let context = state.context_length();
    let tool_specs = chat.tool_specs.clone();
    // A prefilled answer goes on from its last character: no space is trimmed.
    let trim_leading_space = chat.prefill.is_none();
    let cap = chat.cap_max_tokens;
    let mut requested = constraint_of(state, &common, &chat)?;
    // Fill's spans are a free-running tool call's: a constrained answer has jump-forward.
    let fill = common.fill && requested.is_none();
    let prompt = prompt::chat_with_fill(state, chat, fill).await?;
    if let Some(r) = requested.as_mut().filter(|_| prompt.opens_reasoning) {
        // The prompt opened the model's reasoning: it thinks freely up to its end tag, and the
        // constraint binds the answer after it.
        let Some((_, end)) = &state.think_tags else {
            let msg = "structured output cannot follow a prompt that opens the model's reasoning: turn thinking off \
                       (chat_template_kwargs: {\"enable_thinking\": false})";
            return Err(ApiError::invalid(msg, Some(r.field)));
        };
        let answer = Box::new(std::mem::replace(&mut r.spec, ConstraintSpec::JsonObject));
        r.spec = ConstraintSpec::AfterReasoning { end: end.clone(), answer };
    }
    let constraint = match requested {
        Some(r) => Some(structured::compile(state, r).await?),
        None => None,
    };
    let (budget, len) = (state.config.max_tokens, prompt.ids.len());
    let requested = common.max_tokens.map(|n| if cap { n.min(context.saturating_sub(len).max(1)) } else { n });
    let max_tokens = token_budget(len, requested, budget, context, "messages")?;
    let pipeline = PipelineConfig {
        stops: common.stop.clone(),
        reasoning: (state.think_tags.clone()).map(|(s, e)| (s, e, prompt.opens_reasoning)),
        tools: (!tool_specs.is_empty()).then_some(tool_specs),
        trim_leading_space,
    };
    Ok(Prepared { common, prompt: prompt.ids, max_tokens, pipeline, constraint, fill: prompt.fill })
}

/// The request's constraint: its structured-output field, or the forced tool call of
/// `tool_choice` (`required` / a named function: a call in the template's format, arguments
/// valid under the tool's schema). Both at once, or a forced call after a prefilled answer,
/// are refused.
fn constraint_of(state: &SharedState, common: &CommonParams, chat: &ChatRequest) -> ApiResult<Option<Requested>> {
    let Some(forced) = &chat.force_tool_call else {
        return Ok(common.constraint.clone());
    };
    let refuse = |why: &str| Err(ApiError::invalid(format!("tool_choice: a forced tool call {why}"), Some("tool_choice")));
    if let Some(other) = &common.constraint {
        return refuse(&format!("cannot be combined with {}", other.field));
    }
    if chat.prefill.is_some() {
        return refuse("cannot follow a prefilled answer");
    }
    let named = match forced {
        ForcedCall::Any => None,
        ForcedCall::Named(name) => Some(name.clone()),
    };
    Ok(Some(structured::for_tools(chat.tool_specs.clone(), named, state.tool_call_tags, chat.parallel_tool_calls)))
}

async fn run(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    fields::CHAT.check(&body, log, &state.warned_fields)?;
    let prepared = prepare(state, &body).await?;
    let n = prepared.common.n;
    let (meta, mut choices) = match start(state, &body, Kind::Chat, vec![prepared], log, None)? {
        Started::Stream(resp) => return Ok(resp),
        Started::Whole(choices, meta) => (meta, choices),
    };
    let mut usage = UsageSum::new(n);
    let mut list = Vec::with_capacity(choices.len());
    for (index, out) in super::finished_all(&mut choices).await?.into_iter().enumerate() {
        usage.add(index, &out.usage);
        list.push(choice(index, out));
    }
    Ok(Json(response::chat_completion(&meta, list, usage.total)).into_response())
}

/// One whole choice: its message (content, reasoning, tool calls) and logprobs.
fn choice(index: usize, out: super::Outcome) -> Value {
    let d = out.all.delta;
    let calls = response::tool_calls_json(&d.tool_calls, None);
    // Whitespace between tool-call blocks is not an answer.
    let blank = !calls.is_empty() && d.content.trim().is_empty();
    let content = if blank { "" } else { &d.content };
    let message = response::assistant_message(content, &d.reasoning, calls);
    response::chat_choice(index, message, logprobs::block(out.all.logprobs), out.reason)
}
