//! `/v1/adapters`: LoRA adapters mounted on the served model (docs/server.md, "LoRA adapters").
//! `POST {name, path}` mounts a PEFT folder read on the server's machine, checked against the
//! model; `GET` lists; `DELETE /v1/adapters/{name}` unmounts (running requests keep theirs).
//! A request runs with them by naming them in `"adapter"` ([`requested`]).

use crate::errors::{ApiError, ApiResult};
use crate::protocol::request::parse_body_async;
use crate::state::SharedState;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use ferrolm_models::lora::{self, LoraAdapter};
use serde_json::{json, Map, Value};

fn describe(a: &LoraAdapter) -> Value {
    json!({
        "id": a.name,
        "object": "adapter",
        "path": a.path.display().to_string(),
        "rank": a.rank,
        "alpha": a.alpha,
        "scale": a.scale,
        "target_modules": a.targets.iter().map(|t| t.peft_name()).collect::<Vec<_>>(),
        "bytes": a.bytes,
    })
}

pub async fn list(State(state): State<SharedState>) -> Response {
    let data: Vec<Value> = state.bundle().adapters.list().iter().map(|a| describe(a)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn mount(State(state): State<SharedState>, body: Bytes) -> Response {
    super::guarded(mount_body(state, body)).await
}

async fn mount_body(state: SharedState, body: Bytes) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    let field = |name: &str| -> ApiResult<String> {
        match body.get(name) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            _ => Err(ApiError::invalid(format!("{name}: a non-empty string is required"), Some(name))),
        }
    };
    let (name, path) = (field("name")?, field("path")?);
    lora::check_name(&name).map_err(|e| ApiError::invalid(e, Some("name")))?;
    if state.bundle().adapters.contains(&name) {
        return Err(conflict(&name));
    }
    let bundle = state.bundle().clone();
    let load = tokio::task::spawn_blocking(move || lora::mount(bundle.model.as_ref(), &name, std::path::Path::new(&path)));
    let adapter = load.await.map_err(|e| ApiError::internal(format!("loading the adapter failed: {e}")))?;
    let adapter = adapter.map_err(|e| ApiError::invalid(e, Some("path")))?;
    let name = adapter.name.clone();
    // Another request may have taken the name while this one loaded.
    let mounted = state.bundle().adapters.insert(adapter).map_err(|_| conflict(&name))?;
    tracing::info!("adapter {:?} mounted from {} ({} bytes)", mounted.name, mounted.path.display(), mounted.bytes);
    Ok((StatusCode::CREATED, Json(describe(&mounted))).into_response())
}

fn conflict(name: &str) -> ApiError {
    ApiError::http_status(409, format!("an adapter named {name:?} is already mounted (DELETE /v1/adapters/{name} first)"))
        .with_code("adapter_exists")
}

pub async fn unmount(State(state): State<SharedState>, Path(name): Path<String>) -> Response {
    match state.bundle().adapters.remove(&name) {
        Some(_) => {
            tracing::info!("adapter {name:?} unmounted");
            Json(json!({"id": name, "object": "adapter", "deleted": true})).into_response()
        }
        None => ApiError::not_found(format!("no adapter named {name:?} is mounted")).into_response(),
    }
}

/// A request's `"adapter"` checked against the mounted adapters: None for the base model
/// (absent, null or `"none"`); a 400 naming the field for an unknown name or a non-string.
pub(crate) fn requested(state: &SharedState, body: &Map<String, Value>) -> ApiResult<Option<String>> {
    let spec = match body.get("adapter") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s,
        Some(_) => return Err(ApiError::invalid("adapter: a string is required (a mounted adapter's name, \"a+b\" or \"none\")", Some("adapter"))),
    };
    match state.bundle().adapters.resolve(spec) {
        Ok(Some(_)) => Ok(Some(spec.clone())),
        Ok(None) => Ok(None),
        Err(e) => Err(ApiError::invalid(e, Some("adapter"))),
    }
}
