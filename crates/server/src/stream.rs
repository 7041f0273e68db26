//! Server-sent events. The loop here (keep-alives, a panic in the pipeline caught, the end)
//! serves every protocol; an [`Encoder`] turns pieces of output into one protocol's frames:
//! OpenAI's chat and text completions here, Anthropic's and the Responses API's in their own
//! modules.
//!
//! OpenAI chat: a role chunk, then content / reasoning deltas and one chunk per completed tool
//! call, a final chunk with `finish_reason`, the usage, then `data: [DONE]`. Text completions:
//! `text_completion` chunks the same way. A failure after the stream opened is sent as
//! `data: {"error": …}` and the stream ends.
//!
//! Usage: with `stream_options.include_usage` it comes in a chunk of its own with empty
//! `choices` after the final chunk (OpenAI's and mlx-lm's way); without it, the final chunk
//! carries it (so clients that never ask still see it, and none sees it twice).
//!
//! While no token has arrived for a while (a long prefill), keep-alives (`: keepalive` comments,
//! or the protocol's own ping) keep proxies from timing out and let a vanished client be noticed.
//! Dropping the body (the client disconnected) drops the [`Generation`], which cancels it.

use crate::errors::ApiError;
use crate::generation::{End, Generation, Piece};
use crate::protocol::logprobs;
use crate::protocol::response::{self, Meta, Usage};
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

/// One protocol's stream: frames for each piece of output and for a failure.
pub trait Encoder: Send + 'static {
    /// Frames for one piece (its end included, when the piece carries one).
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>);
    /// Frames for a failure after the stream opened; the stream ends after them.
    fn fail(&mut self, message: String, out: &mut VecDeque<Bytes>);
    /// Sent when nothing was sent for the keep-alive interval.
    fn keepalive(&self) -> Bytes {
        Bytes::from_static(b": keepalive\n\n")
    }
}

struct SseState<E> {
    gen: Generation,
    encoder: E,
    keepalive: Duration,
    frames: VecDeque<Bytes>,
    finished: bool,
}

/// The streaming response: `first` frames at once, then the encoder's frames as output comes.
pub fn sse<E: Encoder>(gen: Generation, encoder: E, first: Vec<Bytes>, keepalive: Duration) -> Response {
    let state = SseState { gen, encoder, keepalive, frames: first.into(), finished: false };
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
        let waited = tokio::time::timeout(s.keepalive, s.gen.next());
        match AssertUnwindSafe(waited).catch_unwind().await {
            Err(_) => s.fail("internal error: the stream's pipeline panicked".into()),
            Ok(Err(_)) => return Some((Ok(s.encoder.keepalive()), s)),
            Ok(Ok(None)) => s.finished = true,
            Ok(Ok(Some(piece))) => {
                s.finished = piece.end.is_some();
                if let Some(End::Failed(m)) = &piece.end {
                    tracing::error!("generation failed mid-stream: {m}");
                }
                s.encoder.piece(piece, &mut s.frames);
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Text,
}

pub struct StreamOptions {
    pub kind: Kind,
    pub meta: Meta,
    pub include_usage: bool,
    pub keepalive: Duration,
}

/// OpenAI's chat and text completion chunks.
struct OpenAiEncoder {
    kind: Kind,
    meta: Meta,
    include_usage: bool,
    tool_index: usize,
}

pub fn response(gen: Generation, opts: StreamOptions) -> Response {
    let mut first = Vec::new();
    if opts.kind == Kind::Chat {
        let role = json!({"role": "assistant", "content": ""});
        first.push(frame(&response::chat_chunk(&opts.meta, role, None, None, None)));
    }
    let encoder = OpenAiEncoder { kind: opts.kind, meta: opts.meta, include_usage: opts.include_usage, tool_index: 0 };
    sse(gen, encoder, first, opts.keepalive)
}

impl Encoder for OpenAiEncoder {
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>) {
        let lp = logprobs::block(piece.logprobs);
        let d = piece.delta;
        match self.kind {
            Kind::Chat => self.chat_delta(&d.content, &d.reasoning, &d.tool_calls, lp, out),
            Kind::Text if !d.content.is_empty() || lp.is_some() => {
                let c = response::text_completion(&self.meta, &d.content, lp, None, None);
                out.push_back(frame(&c));
            }
            Kind::Text => {}
        }
        match piece.end {
            None => {}
            Some(End::Finished { reason, usage, .. }) => self.finish(reason, usage, out),
            Some(End::Failed(message)) => self.fail(message, out),
        }
    }

    fn fail(&mut self, message: String, out: &mut VecDeque<Bytes>) {
        out.push_back(frame(&ApiError::internal(message).body()));
    }
}

impl OpenAiEncoder {
    fn chat_delta(
        &mut self,
        content: &str,
        reasoning: &str,
        calls: &[ferrolm_text::ToolCall],
        mut lp: Option<Value>,
        out: &mut VecDeque<Bytes>,
    ) {
        let meta = &self.meta;
        if !content.is_empty() || !reasoning.is_empty() || (calls.is_empty() && lp.is_some()) {
            let mut delta = json!({});
            if !content.is_empty() {
                delta["content"] = json!(content);
            }
            if !reasoning.is_empty() {
                delta["reasoning"] = json!(reasoning);
            }
            out.push_back(frame(&response::chat_chunk(meta, delta, lp.take(), None, None)));
        }
        if !calls.is_empty() {
            let list = response::tool_calls_json(calls, Some(self.tool_index));
            self.tool_index += calls.len();
            let c = response::chat_chunk(meta, json!({"tool_calls": list}), lp.take(), None, None);
            out.push_back(frame(&c));
        }
    }

    fn finish(&mut self, reason: &str, usage: Usage, out: &mut VecDeque<Bytes>) {
        let meta = &self.meta;
        let inline = (!self.include_usage).then_some(usage);
        let last = match self.kind {
            Kind::Chat => response::chat_chunk(meta, json!({}), None, Some(reason), inline),
            Kind::Text => response::text_completion(meta, "", None, Some(reason), inline),
        };
        out.push_back(frame(&last));
        if self.include_usage {
            let object = match self.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Text => "text_completion",
            };
            out.push_back(frame(&response::usage_chunk(meta, object, usage)));
        }
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}
