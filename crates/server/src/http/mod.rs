//! The HTTP layer around the API: ferrolm's own accept loop on hyper's HTTP/1 connections
//! ([`serve`]), and the middleware every request passes before a handler: the access log line
//! and request id ([`log`]), the Host / Origin / API-key checks and CORS ([`access`]), the body
//! limit and read timeout ([`body`]). Every error this layer produces — hyper's own 400 / 431 /
//! 414 included ([`conn`]) — is in the API's error shape: Anthropic's under `/v1/messages`,
//! OpenAI's elsewhere.

pub mod access;
pub mod body;
mod conn;
pub mod log;
pub mod serve;

use crate::errors::ApiError;
use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::time::Duration;

/// Limits of the HTTP layer (`serve` flags).
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// `--max-body-bytes`: larger bodies get 413 (from Content-Length, before reading).
    pub max_body_bytes: usize,
    /// `--header-timeout`: a request head (and an idle keep-alive connection's next one) must
    /// arrive within this; a half-sent head gets 408, an idle connection is closed.
    pub header_timeout: Duration,
    /// `--read-timeout`: the whole body must arrive within this after the head (408).
    pub read_timeout: Duration,
    /// `--max-connections`: open connections at most; more are answered 503 and closed.
    pub max_connections: usize,
    /// Request line and headers together at most (431 beyond).
    pub max_header_bytes: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_body_bytes: 16 << 20,
            header_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(60),
            max_connections: 2048,
            max_header_bytes: 64 << 10,
        }
    }
}

/// Whether errors on `path` take Anthropic's shape (its Messages endpoints) or OpenAI's.
pub fn anthropic_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/") || path.starts_with("/v1/messages?")
}

/// The safety net: an error response that is not JSON (an extractor's rejection, such as a
/// path segment that is not UTF-8) is rewritten in the API's shape with the same status.
pub async fn api_shaped(req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let is_json = resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if resp.status().as_u16() < 400 || is_json {
        return resp;
    }
    let status = resp.status();
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.map(|b| String::from_utf8_lossy(&b).trim().to_string());
    let message = text.ok().filter(|t| !t.is_empty()).unwrap_or_else(|| status.canonical_reason().unwrap_or("Error").into());
    let mut e = ApiError::http_status(status.as_u16(), message);
    if status.is_server_error() {
        e.kind = "server_error";
    }
    let mut out = error_response(&path, e);
    for (name, value) in parts.headers.iter().filter(|(n, _)| *n != header::CONTENT_TYPE && *n != header::CONTENT_LENGTH) {
        out.headers_mut().insert(name.clone(), value.clone());
    }
    out
}

/// An error as the API at `path` shapes it.
pub fn error_response(path: &str, e: ApiError) -> Response {
    if anthropic_path(path) {
        e.into_anthropic_response()
    } else {
        e.into_response()
    }
}
