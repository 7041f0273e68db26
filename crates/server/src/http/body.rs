//! Reading request bodies, bounded: a body beyond `--max-body-bytes` is refused with 413 (from
//! its Content-Length, or as soon as a chunked body passes the limit), and a body that does not
//! arrive within `--read-timeout` gets 408. Handlers then read the buffered body; nothing else
//! in the server reads a request body.
//!
//! A refused body is still read to its end and thrown away (up to `DRAIN_MAX` bytes, within the
//! read timeout) before the 413 goes out: a server that answers and closes while the client is
//! still sending makes the client's kernel see a reset, and the client never reads the answer.

use super::error_response;
use crate::errors::ApiError;
use crate::state::SharedState;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;
use tokio::time::Instant;

/// The most bytes of a refused body read (and discarded) so the client can read the 413.
const DRAIN_MAX: u64 = 256 << 20;

pub async fn bounded(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let limits = &state.config.http;
    let path = req.uri().path().to_string();
    let (parts, body) = req.into_parts();
    let deadline = Instant::now() + limits.read_timeout;
    let declared = declared_length(&parts.headers);
    let read = if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        if declared.is_some_and(|n| n <= DRAIN_MAX) {
            drain(body, deadline).await;
        }
        Read::TooLarge
    } else {
        let expected = declared.map_or(0, |n| n as usize);
        read_body(body, limits.max_body_bytes, expected, deadline).await
    };
    let e = match read {
        Read::Whole(bytes) => return next.run(Request::from_parts(parts, Body::from(bytes))).await,
        Read::TooLarge => ApiError::body_too_large(limits.max_body_bytes),
        Read::Failed(e) => ApiError::http_status(400, format!("The request body could not be read: {e}")),
        Read::TimedOut => {
            let secs = limits.read_timeout.as_secs();
            ApiError::timeout(format!("The request body did not arrive within {secs} s (--read-timeout)"))
        }
    };
    close(error_response(&path, e))
}

enum Read {
    Whole(Bytes),
    TooLarge,
    Failed(String),
    TimedOut,
}

/// The body, if it ends within `limit` bytes by `deadline`; past the limit the rest is drained.
async fn read_body(mut body: Body, limit: usize, expected: usize, deadline: Instant) -> Read {
    let mut buf = Vec::with_capacity(expected.min(limit));
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Read::TimedOut,
            Ok(None) => return Read::Whole(Bytes::from(buf)),
            Ok(Some(Err(e))) => return Read::Failed(e.to_string()),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else { continue };
                if buf.len() + data.len() > limit {
                    drain(body, deadline).await;
                    return Read::TooLarge;
                }
                buf.extend_from_slice(&data);
            }
        }
    }
}

/// Reads and discards the rest of a refused body (bounded in bytes and time).
async fn drain(mut body: Body, deadline: Instant) {
    let mut seen = 0u64;
    while seen < DRAIN_MAX && !body.is_end_stream() {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => seen += frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => return,
        }
    }
}

fn declared_length(h: &header::HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// A connection whose body was not (wholly) read cannot carry another request: close it.
fn close(mut resp: Response) -> Response {
    resp.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    resp
}
