//! Server-sent events. The loop here (keep-alives, a panic in the pipeline caught, the end)
//! serves every protocol; an [`Encoder`] turns pieces of output into one protocol's frames:
//! OpenAI's chat and text completions in `openai_stream.rs`, Anthropic's and the Responses
//! API's in their own modules. The pieces come from [`Choices`]: one generation, or OpenAI's
//! `n` choices interleaved as their tokens arrive.
//!
//! While no token has arrived for a while (a long prefill), keep-alives (`: keepalive` comments,
//! or the protocol's own ping) keep proxies from timing out and let a vanished client be noticed.
//! Dropping the body (the client disconnected) drops the [`Generation`], which cancels it.

use crate::choices::Choices;
use crate::generation::{End, Piece};
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use serde_json::Value;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

/// One protocol's stream: frames for each piece of output and for a failure.
pub trait Encoder: Send + 'static {
    /// Frames for one piece (its end included, when the piece carries one).
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>);
    /// Frames for a piece of choice `index` (protocols with one choice need only `piece`).
    fn choice(&mut self, index: usize, piece: Piece, out: &mut VecDeque<Bytes>) {
        debug_assert_eq!(index, 0, "a one-choice protocol got a second choice");
        self.piece(piece, out)
    }
    /// Frames for a failure after the stream opened; the stream ends after them.
    fn fail(&mut self, message: String, out: &mut VecDeque<Bytes>);
    /// Sent when nothing was sent for the keep-alive interval.
    fn keepalive(&self) -> Bytes {
        Bytes::from_static(b": keepalive\n\n")
    }
}

struct SseState<E> {
    choices: Choices,
    encoder: E,
    keepalive: Duration,
    frames: VecDeque<Bytes>,
    finished: bool,
}

/// The streaming response: `first` frames at once, then the encoder's frames as output comes,
/// until every choice has ended (or one failed).
pub fn sse<E: Encoder>(choices: impl Into<Choices>, encoder: E, first: Vec<Bytes>, keepalive: Duration) -> Response {
    let state = SseState { choices: choices.into(), encoder, keepalive, frames: first.into(), finished: false };
    sse_body(Body::from_stream(futures_util::stream::unfold(state, next_frame)))
}

/// A stream whose frames are all known already (a request that generates nothing).
pub fn sse_frames(frames: Vec<Bytes>) -> Response {
    sse_body(Body::from(frames.concat()))
}

fn sse_body(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        body,
    )
        .into_response()
}

async fn next_frame<E: Encoder>(mut s: SseState<E>) -> Option<(Result<Bytes, Infallible>, SseState<E>)> {
    loop {
        if let Some(f) = s.frames.pop_front() {
            return Some((Ok(f), s));
        }
        if s.finished {
            return None;
        }
        let waited = tokio::time::timeout(s.keepalive, s.choices.next());
        match AssertUnwindSafe(waited).catch_unwind().await {
            Err(_) => s.fail("internal error: the stream's pipeline panicked".into()),
            Ok(Err(_)) => return Some((Ok(s.encoder.keepalive()), s)),
            Ok(Ok(None)) => s.finished = true,
            Ok(Ok(Some((index, piece)))) => {
                // A failed choice ends the stream (the others are cancelled when it is dropped).
                if let Some(End::Failed(m)) = &piece.end {
                    tracing::error!("generation failed mid-stream: {m}");
                    s.finished = true;
                }
                s.encoder.choice(index, piece, &mut s.frames);
            }
        }
    }
}

impl<E: Encoder> SseState<E> {
    fn fail(&mut self, message: String) {
        tracing::error!("stream failed: {message}");
        self.encoder.fail(message, &mut self.frames);
        self.finished = true;
    }
}

/// `data: <json>` (OpenAI's chat and text streams name no events).
pub fn frame(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// `event: <name>` then `data: <json>` (Anthropic's and the Responses API's streams).
pub fn event(name: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}
