//! `POST /v1/chat/completions` (and mlx_lm.server's `/chat/completions`).

use super::prompt::{self, token_budget};
use super::{start, Started};
use crate::errors::ApiResult;
use crate::pipeline::PipelineConfig;
use crate::protocol::chat::parse_chat;
use crate::protocol::logprobs;
use crate::protocol::request::{parse_body, parse_common};
use crate::protocol::response;
use crate::state::SharedState;
use crate::stream::Kind;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use std::time::Instant;

pub async fn handle(State(state): State<SharedState>, body: Bytes) -> Response {
    let arrived = Instant::now();
    super::guarded(run(&state, &body, arrived)).await
}

async fn run(state: &SharedState, body: &[u8], arrived: Instant) -> ApiResult<Response> {
    let body = parse_body(body)?;
    let info = state.bundle().model.info().clone();
    let common = parse_common(&body, &state.config, info.vocab_size)?;
    let args = &state.config.chat_template_args;
    let chat = parse_chat(&body, args, state.think_tags.is_some())?;
    let tool_specs = chat.tool_specs.clone();
    let prompt = prompt::chat(state, chat).await?;
    let budget = state.config.max_tokens;
    let max_tokens = token_budget(prompt.ids.len(), common.max_tokens, budget, info.context_length, "messages")?;
    let pipeline = PipelineConfig {
        stops: common.stop.clone(),
        reasoning: (state.think_tags.clone()).map(|(s, e)| (s, e, prompt.opens_reasoning)),
        tools: (!tool_specs.is_empty()).then_some(tool_specs),
        trim_leading_space: true,
    };
    let started = start(state, &body, Kind::Chat, &common, prompt.ids, max_tokens, pipeline, arrived)?;
    let (meta, all, reason, usage) = match started {
        Started::Stream(resp) => return Ok(resp),
        Started::Whole(mut gen, meta) => {
            let (all, reason, usage) = super::finished(&mut gen).await?;
            (meta, all, reason, usage)
        }
    };
    let d = all.delta;
    let calls = response::tool_calls_json(&d.tool_calls, None);
    // Whitespace between tool-call blocks is not an answer.
    let blank = !calls.is_empty() && d.content.trim().is_empty();
    let content = if blank { "" } else { &d.content };
    let message = response::assistant_message(content, &d.reasoning, calls);
    let lp = logprobs::block(all.logprobs);
    Ok(Json(response::chat_completion(&meta, message, lp, reason, usage)).into_response())
}
