//! Endpoints the served model cannot answer: an embedding model generates nothing, so the
//! generation endpoints refuse it with a 400 that says why (in Anthropic's shape on its own
//! endpoints), before parsing anything. `/v1/embeddings` makes the converse check itself.

use crate::errors::ApiError;
use crate::state::SharedState;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

pub async fn generation_only(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if state.bundle().model.can_generate() {
        return next.run(req).await;
    }
    let e = ApiError::invalid(
        format!(
            "The served model '{}' cannot generate: it is an embedding model. Use /v1/embeddings.",
            state.config.model_id
        ),
        Some("model"),
    )
    .with_code("model_not_supported");
    match req.uri().path().starts_with("/v1/messages") {
        true => e.into_anthropic_response(),
        false => e.into_response(),
    }
}
