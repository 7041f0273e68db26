//! Reading request bodies, bounded: a body beyond `--max-body-bytes` is refused with 413 — from
//! its Content-Length before a byte of it is read, or as soon as a chunked body passes the
//! limit — and a body that does not arrive within `--read-timeout` gets 408. Handlers then
//! read the buffered body; nothing else in the server reads a request body.

use super::error_response;
use crate::errors::ApiError;
use crate::state::SharedState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::{BodyExt, LengthLimitError, Limited};

pub async fn bounded(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let limits = &state.config.http;
    let path = req.uri().path().to_string();
    if declared_length(&req).is_some_and(|n| n > limits.max_body_bytes as u64) {
        return close(error_response(&path, ApiError::body_too_large(limits.max_body_bytes)));
    }
    let (parts, body) = req.into_parts();
    let read = Limited::new(body, limits.max_body_bytes).collect();
    let bytes = match tokio::time::timeout(limits.read_timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return close(error_response(&path, ApiError::body_too_large(limits.max_body_bytes)));
        }
        Ok(Err(e)) => {
            let e = ApiError::http_status(400, format!("The request body could not be read: {e}"));
            return close(error_response(&path, e));
        }
        Err(_) => {
            let secs = limits.read_timeout.as_secs();
            let e = ApiError::timeout(format!("The request body did not arrive within {secs} s (--read-timeout)"));
            return close(error_response(&path, e));
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

fn declared_length(req: &Request) -> Option<u64> {
    req.headers().get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// The rest of an unread body cannot be skipped on a kept-alive connection: close it.
fn close(mut resp: Response) -> Response {
    resp.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    resp
}
