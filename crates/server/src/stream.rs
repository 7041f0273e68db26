//! Server-sent events. Chat: a role chunk, then content / reasoning deltas and one chunk per
//! completed tool call, a final chunk with `finish_reason`, the usage, then `data: [DONE]`.
//! Text completions: `text_completion` chunks the same way. A failure after the stream opened
//! is sent as `data: {"error": …}` and the stream ends.
//!
//! Usage: with `stream_options.include_usage` it comes in a chunk of its own with empty
//! `choices` after the final chunk (OpenAI's and mlx-lm's way); without it, the final chunk
//! carries it (so clients that never ask still see it, and none sees it twice).
//!
//! While no token has arrived for a while (a long prefill), `: keepalive` comments keep proxies
//! from timing out and let a vanished client be noticed; SSE clients ignore comments. Dropping
//! the body (the client disconnected) drops the [`Generation`], which cancels it.

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

struct SseState {
    gen: Generation,
    opts: StreamOptions,
    frames: VecDeque<Bytes>,
    tool_index: usize,
    finished: bool,
}

pub fn response(gen: Generation, opts: StreamOptions) -> Response {
    let mut frames = VecDeque::new();
    if opts.kind == Kind::Chat {
        let role = json!({"role": "assistant", "content": ""});
        frames.push_back(frame(&response::chat_chunk(&opts.meta, role, None, None, None)));
    }
    let state = SseState { gen, opts, frames, tool_index: 0, finished: false };
    let body = Body::from_stream(futures_util::stream::unfold(state, next_frame));
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

async fn next_frame(mut s: SseState) -> Option<(Result<Bytes, Infallible>, SseState)> {
    loop {
        if let Some(f) = s.frames.pop_front() {
            return Some((Ok(f), s));
        }
        if s.finished {
            return None;
        }
        let waited = tokio::time::timeout(s.opts.keepalive, s.gen.next());
        match AssertUnwindSafe(waited).catch_unwind().await {
            Err(_) => s.fail("internal error: the stream's pipeline panicked".into()),
            Ok(Err(_)) => return Some((Ok(Bytes::from_static(b": keepalive\n\n")), s)),
            Ok(Ok(None)) => s.finished = true,
            Ok(Ok(Some(piece))) => s.piece(piece),
        }
    }
}

impl SseState {
    fn piece(&mut self, piece: Piece) {
        let lp = logprobs::block(piece.logprobs);
        let d = piece.delta;
        match self.opts.kind {
            Kind::Chat => self.chat_delta(&d.content, &d.reasoning, &d.tool_calls, lp),
            Kind::Text if !d.content.is_empty() || lp.is_some() => {
                let c = response::text_completion(&self.opts.meta, &d.content, lp, None, None);
                self.frames.push_back(frame(&c));
            }
            Kind::Text => {}
        }
        match piece.end {
            None => {}
            Some(End::Finished { reason, usage }) => self.finish(reason, usage),
            Some(End::Failed(message)) => self.fail(message),
        }
    }

    fn fail(&mut self, message: String) {
        tracing::error!("generation failed mid-stream: {message}");
        self.frames.push_back(frame(&ApiError::internal(message).body()));
        self.finished = true;
    }

    fn chat_delta(&mut self, content: &str, reasoning: &str, calls: &[ferrolm_text::ToolCall], mut lp: Option<Value>) {
        let meta = &self.opts.meta;
        if !content.is_empty() || !reasoning.is_empty() || (calls.is_empty() && lp.is_some()) {
            let mut delta = json!({});
            if !content.is_empty() {
                delta["content"] = json!(content);
            }
            if !reasoning.is_empty() {
                delta["reasoning"] = json!(reasoning);
            }
            let c = response::chat_chunk(meta, delta, lp.take(), None, None);
            self.frames.push_back(frame(&c));
        }
        if !calls.is_empty() {
            let list = response::tool_calls_json(calls, Some(self.tool_index));
            self.tool_index += calls.len();
            let c = response::chat_chunk(meta, json!({"tool_calls": list}), lp.take(), None, None);
            self.frames.push_back(frame(&c));
        }
    }

    fn finish(&mut self, reason: &str, usage: Usage) {
        let meta = &self.opts.meta;
        let inline = (!self.opts.include_usage).then_some(usage);
        let last = match self.opts.kind {
            Kind::Chat => response::chat_chunk(meta, json!({}), None, Some(reason), inline),
            Kind::Text => response::text_completion(meta, "", None, Some(reason), inline),
        };
        self.frames.push_back(frame(&last));
        if self.opts.include_usage {
            let object = match self.opts.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Text => "text_completion",
            };
            self.frames.push_back(frame(&response::usage_chunk(meta, object, usage)));
        }
        self.frames.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}

fn frame(v: &Value) -> Bytes {
    let mut s = String::with_capacity(256);
    s.push_str("data: ");
    s.push_str(&v.to_string());
    s.push_str("\n\n");
    Bytes::from(s)
}
