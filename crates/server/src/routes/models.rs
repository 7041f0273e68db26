//! `GET /v1/models` and `GET /v1/models/{id}`: the served model (one model per server).

use crate::errors::ApiError;
use crate::state::SharedState;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Json, Response};
use serde_json::{json, Value};

fn model(state: &SharedState) -> Value {
    json!({
        "id": state.config.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "ferrolm",
        "context_window": state.context_length(),
    })
}

pub async fn list(State(state): State<SharedState>) -> Response {
    Json(json!({"object": "list", "data": [model(&state)]})).into_response()
}

/// OpenAI's shape (one model object); an id we do not serve is a 404.
pub async fn one(State(state): State<SharedState>, Path(id): Path<String>) -> Response {
    if id == state.config.model_id {
        Json(model(&state)).into_response()
    } else {
        ApiError::not_found(format!("The model '{id}' does not exist")).into_response()
    }
}
