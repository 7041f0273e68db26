//! `POST /v1/embeddings`: sentence embeddings from a served embedding model (a BERT encoder
//! such as all-MiniLM-L6-v2). A generative model answers 400. Inputs are tokenized on the
//! blocking pool and embedded there one request at a time (the model's forward takes every
//! core); a client that disconnects stops its request between chunks.

mod request;
mod response;

use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use crate::protocol::fields;
use crate::protocol::request::parse_body_async;
use crate::routes::guarded_as;
use crate::state::SharedState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use ferrolm_core::CancelToken;
use ferrolm_engine::Bundle;
use ferrolm_text::EncodeError;
use request::Input;
use std::sync::Arc;

pub async fn create(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    guarded_as(run(&state, body, &log), ApiError::into_response).await
}

async fn run(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    fields::EMBEDDINGS.check(&body, log, &state.warned_fields)?;
    let bundle = state.bundle().clone();
    let Some(dim) = bundle.embedding_dim() else {
        return Err(ApiError::invalid(
            format!(
                "The served model '{}' cannot compute embeddings: it is a generative model. Serve an embedding model (e.g. `ferrolm serve --model <all-MiniLM-L6-v2 folder>`) for /v1/embeddings.",
                state.config.model_id
            ),
            Some("model"),
        )
        .with_code("model_not_supported"));
    };
    let req = request::parse(&body, bundle.model.info().vocab_size)?;
    request::check_dimensions(req.dimensions, dim)?;
    let ids = tokenize(bundle.clone(), req.inputs).await?;
    let prompt_tokens = ids.iter().map(Vec::len).sum();
    let vectors = embed(state, bundle, ids).await?;
    Ok(Json(response::body(&state.config.model_id, vectors, req.encoding, prompt_tokens)).into_response())
}

/// Token ids of every input, each checked against the model's longest input: an input beyond
/// it is refused, as OpenAI refuses, never silently truncated.
async fn tokenize(bundle: Arc<Bundle>, inputs: Vec<Input>) -> ApiResult<Vec<Vec<u32>>> {
    let max = bundle.model.info().context_length;
    let work = move || -> ApiResult<Vec<Vec<u32>>> {
        let mut out = Vec::with_capacity(inputs.len());
        let too_long = |i: usize, n: usize| {
            let message = format!(
                "'input[{i}]' is {n} tokens long (special tokens included); this model embeds at most {max} tokens. Shorten the input: it is not truncated."
            );
            ApiError::invalid(message, Some("input")).with_code("context_length_exceeded")
        };
        for (i, input) in inputs.into_iter().enumerate() {
            // Bounded: an input far beyond the model's length is not tokenized whole (the count
            // in the message is then where tokenizing stopped: "at least").
            let ids = match input {
                Input::Ids(ids) => ids,
                Input::Text(text) => match bundle.tokenizer.encode_limited(&text, true, max) {
                    Ok(ids) => ids,
                    Err(EncodeError::TooLong { at_least, .. }) => return Err(too_long(i, at_least)),
                    Err(e) => return Err(ApiError::internal(e.to_string())),
                },
            };
            if ids.len() > max {
                return Err(too_long(i, ids.len()));
            }
            out.push(ids);
        }
        Ok(out)
    };
    tokio::task::spawn_blocking(work).await.map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))?
}

/// Cancels the embedding it guards when the request's future is dropped (client gone).
struct CancelOnDrop(CancelToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The vectors, computed on the blocking pool while this request holds the embedding gate
/// (released when the computation ends, even if the client has gone).
async fn embed(state: &SharedState, bundle: Arc<Bundle>, ids: Vec<Vec<u32>>) -> ApiResult<Vec<Vec<f32>>> {
    let turn = state.embed_gate.clone().acquire_owned().await.map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let guard = CancelOnDrop(CancelToken::new());
    let cancel = guard.0.clone();
    let work = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        bundle.embed(&ids, &cancel)
    });
    let vectors = work.await.map_err(|e| ApiError::internal(format!("embedding failed: {e}")))?;
    vectors.map_err(|e| ApiError::internal(format!("embedding failed: {e}")))
}
