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

/// An error as the API at `path` shapes it.
pub fn error_response(path: &str, e: ApiError) -> Response {
    if anthropic_path(path) {
        e.into_anthropic_response()
    } else {
        e.into_response()
    }
}
