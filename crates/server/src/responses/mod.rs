//! OpenAI's Responses API: `POST /v1/responses` (streaming and not), `GET` and `DELETE
//! /v1/responses/{id}`. A request is translated into a chat request ([`request`]) and runs
//! through the same path as `/v1/chat/completions`; the response object and its items
//! ([`response`]), the event stream ([`stream`]) and the stored conversations behind
//! `previous_response_id` ([`store`]) are the Responses API's. Errors keep OpenAI's shape.

mod request;
mod response;
mod store;
mod stream;

pub use store::ResponseStore;

use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use crate::protocol::fields;
use crate::protocol::request::parse_body_async;
use crate::routes::{chat, finished, guarded_as, launch};
use crate::state::SharedState;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Json, Response};
use serde_json::{json, Map, Value};
use std::time::Duration;
use store::Stored;

pub async fn create(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    guarded_as(run(&state, body, &log), ApiError::into_response).await
}

pub async fn get(State(state): State<SharedState>, Path(id): Path<String>) -> Response {
    match state.responses.get(&id) {
        Some(stored) => Json(stored.response.clone()).into_response(),
        None => not_found(&id).into_response(),
    }
}

pub async fn delete(State(state): State<SharedState>, Path(id): Path<String>) -> Response {
    match state.responses.remove(&id) {
        true => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        false => not_found(&id).into_response(),
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found."))
}

/// The stored conversation `previous_response_id` continues (empty without one).
fn history(state: &SharedState, body: &Map<String, Value>) -> ApiResult<Vec<Value>> {
    let param = Some("previous_response_id");
    match body.get("previous_response_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(id)) => match state.responses.get(id) {
            Some(stored) => Ok(stored.conversation.clone()),
            None => Err(ApiError::invalid(format!("Previous response with id '{id}' not found."), param)
                .with_code("previous_response_not_found")),
        },
        Some(_) => Err(ApiError::invalid("previous_response_id must be a string", param)),
    }
}

/// `store` (default true): whether the finished response is kept.
fn store_flag(body: &Map<String, Value>) -> ApiResult<bool> {
    match body.get("store") {
        None | Some(Value::Null) => Ok(true),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid("store must be a boolean", Some("store"))),
    }
}

async fn run(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let body = parse_body_async(body).await?;
    fields::RESPONSES.check(&body, log, &state.warned_fields)?;
    let store = store_flag(&body)?;
    let mut conversation = history(state, &body)?;
    let t = request::translate(&body, &conversation)?;
    let p = chat::prepare(state, &t.chat).await?;
    conversation.extend(t.input);
    let stream = p.common.stream;
    let mut gen = launch(state, &body, p, log)?;
    let id = response::id("resp");
    let mut object = response::skeleton(&id, &state.config.model_id, &body);
    if stream {
        let save = store.then(|| stream::Save { state: state.clone(), conversation });
        let (first, encoder) = stream::ResponsesEncoder::start(object, save);
        let keepalive = Duration::from_secs_f64(state.config.keepalive_secs);
        return Ok(crate::stream::sse(gen, encoder, first, keepalive));
    }
    let out = finished(&mut gen).await?;
    let d = &out.all.delta;
    let items = response::output_items(&d.reasoning, &d.content, &d.tool_calls);
    response::finish(&mut object, items.clone(), out.reason, &out.usage);
    if store {
        conversation.extend(items);
        state.responses.insert(id, Stored { response: object.clone(), conversation });
    }
    Ok(Json(object).into_response())
}
