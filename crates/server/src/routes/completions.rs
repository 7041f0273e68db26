//! `POST /v1/completions`: raw text in, raw text out (no template, no reasoning or tool
//! parsing; stop strings apply).

use super::prompt::{self, token_budget};
use super::{start, Prepared, Started};
use crate::errors::ApiResult;
use crate::pipeline::PipelineConfig;
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
    let mut body = parse_body(body)?;
    let info = state.bundle().model.info().clone();
    let common = parse_common(&body, &state.config, info.vocab_size)?;
    let ids = prompt::text(state, body.remove("prompt")).await?;
    let budget = state.config.max_tokens;
    let max_tokens = token_budget(ids.len(), common.max_tokens, budget, info.context_length, "prompt")?;
    let pipeline = PipelineConfig { stops: common.stop.clone(), ..Default::default() };
    let prepared = Prepared { common, prompt: ids, max_tokens, pipeline };
    match start(state, &body, Kind::Text, prepared, arrived)? {
        Started::Stream(resp) => Ok(resp),
        Started::Whole(mut gen, meta) => {
            let out = super::finished(&mut gen).await?;
            let lp = logprobs::block(out.all.logprobs);
            let text = &out.all.delta.content;
            let body = response::text_completion(&meta, text, lp, Some(out.reason), Some(out.usage));
            Ok(Json(body).into_response())
        }
    }
}
