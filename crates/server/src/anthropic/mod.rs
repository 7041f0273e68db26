//! Anthropic's Messages API: `POST /v1/messages` (streaming and not) and
//! `POST /v1/messages/count_tokens`. A request is translated into a chat request
//! ([`request`]) and runs through the same path as `/v1/chat/completions` (template, tools,
//! stops, sampling, the text pipeline); only the bodies ([`response`]), the event stream
//! ([`stream`]) and the error shape are Anthropic's. Claude Code's extras (`?beta=true`, the
//! `anthropic-version` / `anthropic-beta` / `x-api-key` headers, `cache_control` on blocks)
//! are accepted; `x-api-key` is checked when the server has API keys (`crate::http::access`).

mod request;
mod response;
mod stream;
mod tools;

use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use crate::protocol::fields;
use crate::protocol::chat::ChatRequest;
use crate::protocol::request::{parse_body_async, CommonParams};
use crate::protocol::response::Usage;
use crate::routes::{chat, finished, guarded_as, launch, prompt};
use crate::state::SharedState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use serde_json::{json, Map, Value};
use std::time::Duration;

pub async fn messages(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    guarded_as(run(&state, body, &log), ApiError::into_anthropic_response).await
}

pub async fn count_tokens(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    guarded_as(count(&state, body, &log), ApiError::into_anthropic_response).await
}

/// The chat request a Messages body stands for (its prefill included).
struct Parsed {
    common: CommonParams,
    chat: ChatRequest,
    /// `max_tokens: 0`: answer at once, generate nothing.
    no_output: bool,
    hide_thinking: bool,
}

fn parse(state: &SharedState, body: &Map<String, Value>, count_only: bool) -> ApiResult<Parsed> {
    let t = request::translate(body, count_only)?;
    let (common, mut chat) = chat::parse(state, &t.chat)?;
    chat.prefill = t.prefill;
    chat.cap_max_tokens = true;
    Ok(Parsed { common, chat, no_output: t.no_output, hide_thinking: t.hide_thinking })
}

async fn run(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    fields::MESSAGES.check(&body, log, &state.warned_fields)?;
    let parsed = parse(state, &body, false)?;
    let id = response::id("msg_");
    let model = &state.config.model_id;
    if parsed.no_output {
        return without_output(state, parsed, &id).await;
    }
    let hide_thinking = parsed.hide_thinking;
    let p = chat::prepare_parsed(state, parsed.common, parsed.chat).await?;
    let prompt_tokens = p.prompt.len();
    let stream = p.common.stream;
    let mut gen = launch(state, &body, p, log)?;
    if stream {
        let (first, encoder) = stream::start(&id, model, prompt_tokens, hide_thinking);
        let keepalive = Duration::from_secs_f64(state.config.keepalive_secs);
        return Ok(crate::stream::sse(gen, encoder, vec![first], keepalive));
    }
    let out = finished(&mut gen).await?;
    let d = &out.all.delta;
    let stop_reason = response::stop_reason(out.reason, out.stop.as_deref());
    let message = response::Message {
        id: &id,
        model,
        thinking: (!d.reasoning.is_empty()).then_some(if hide_thinking { "" } else { &d.reasoning }),
        text: &d.content,
        calls: &d.tool_calls,
        stop_reason: Some(stop_reason),
        stop_sequence: out.stop.as_deref().filter(|_| stop_reason == "stop_sequence"),
        usage: response::usage(&out.usage),
    };
    Ok(Json(message.json()?).into_response())
}

/// `max_tokens: 0` (a cache warm-up on Anthropic's side; ferrolm has no prompt cache yet): the
/// prompt is rendered and counted, nothing is generated, `stop_reason` is `max_tokens`.
async fn without_output(state: &SharedState, parsed: Parsed, id: &str) -> ApiResult<Response> {
    let stream = parsed.common.stream;
    let prompt_tokens = prompt::chat(state, parsed.chat).await?.ids.len();
    let model = &state.config.model_id;
    if stream {
        return Ok(crate::stream::sse_frames(stream::without_output(id, model, prompt_tokens)));
    }
    let usage = Usage { prompt_tokens, completion_tokens: 0, cached_tokens: 0, ..Default::default() };
    let message = response::Message {
        id,
        model,
        thinking: None,
        text: "",
        calls: &[],
        stop_reason: Some("max_tokens"),
        stop_sequence: None,
        usage: response::usage(&usage),
    };
    Ok(Json(message.json()?).into_response())
}

/// `{"input_tokens": n}`: the prompt the same request would run, rendered and tokenized.
async fn count(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    fields::MESSAGES.check(&body, log, &state.warned_fields)?;
    let rendered = prompt::chat(state, parse(state, &body, true)?.chat).await?;
    Ok(Json(json!({"input_tokens": rendered.ids.len()})).into_response())
}
