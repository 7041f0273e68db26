//! OpenAI's chat and text completion streams, for one choice or `n` (and, for text, a batch of
//! prompts). Every chunk carries one choice, tagged with its `index`; choices interleave as
//! their tokens arrive.
//!
//! Chat: a role chunk per choice, then content / reasoning deltas and one chunk per completed
//! tool call (numbered per choice), a final chunk with each choice's `finish_reason`, the usage,
//! then `data: [DONE]` once every choice has ended. Text completions: `text_completion` chunks
//! the same way. A failure after the stream opened is sent as `data: {"error": …}` and the
//! stream ends.
//!
//! Usage (each prompt once, the completion tokens of every choice): with
//! `stream_options.include_usage` it comes in a chunk of its own with empty `choices` after the
//! last final chunk (OpenAI's and mlx-lm's way); without it, the last choice's final chunk
//! carries it (so clients that never ask still see it, and none sees it twice).

use crate::choices::{Choices, UsageSum};
use crate::errors::ApiError;
use crate::generation::{End, Piece};
use crate::protocol::logprobs::{self, Legacy};
use crate::protocol::response::{self, Meta};
use crate::stream::{frame, sse, Encoder};
use axum::body::Bytes;
use axum::response::Response;
use ferrolm_text::ToolCall;
use serde_json::{json, Value};
use std::collections::VecDeque;
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
    /// Choices per prompt (OpenAI's `n`).
    pub n: usize,
    /// For OpenAI's legacy completions logprobs: each prompt's length in characters (the
    /// first `text_offset`); None for the `{"content": […]}` block.
    pub legacy_prompt_chars: Option<Vec<usize>>,
}

struct OpenAiEncoder {
    kind: Kind,
    meta: Meta,
    include_usage: bool,
    /// Tool calls sent so far, per choice (a call's `index` counts within its choice).
    tool_index: Vec<usize>,
    usage: UsageSum,
    /// Choices that have not ended yet.
    open: usize,
    legacy: Option<Vec<Legacy>>,
}

pub fn response(choices: Choices, opts: StreamOptions) -> Response {
    let count = choices.len();
    let mut first = Vec::new();
    if opts.kind == Kind::Chat {
        for index in 0..count {
            let role = json!({"role": "assistant", "content": ""});
            first.push(frame(&response::chat_chunk(&opts.meta, index, role, None, None, None)));
        }
    }
    let n = opts.n.max(1);
    let legacy = opts.legacy_prompt_chars.map(|chars| (0..count).map(|i| Legacy::new(chars[i / n])).collect());
    let encoder = OpenAiEncoder {
        kind: opts.kind,
        meta: opts.meta,
        include_usage: opts.include_usage,
        tool_index: vec![0; count],
        usage: UsageSum::new(n),
        open: count,
        legacy,
    };
    sse(choices, encoder, first, opts.keepalive)
}

impl Encoder for OpenAiEncoder {
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>) {
        self.choice(0, piece, out)
    }

    fn choice(&mut self, index: usize, piece: Piece, out: &mut VecDeque<Bytes>) {
        let lp = match self.legacy.as_mut() {
            Some(l) => l[index].block(&piece.logprobs),
            None => logprobs::block(piece.logprobs),
        };
        let d = piece.delta;
        match self.kind {
            Kind::Chat => self.chat_delta(index, &d.content, &d.reasoning, &d.tool_calls, lp, out),
            Kind::Text if !d.content.is_empty() || lp.is_some() => {
                let c = response::text_choice(index, &d.content, lp, None);
                out.push_back(frame(&response::text_completion(&self.meta, vec![c], None)));
            }
            Kind::Text => {}
        }
        match piece.end {
            None => {}
            Some(End::Finished { reason, usage, .. }) => {
                self.usage.add(index, &usage);
                self.finish(index, reason, out)
            }
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
        index: usize,
        content: &str,
        reasoning: &str,
        calls: &[ToolCall],
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
            out.push_back(frame(&response::chat_chunk(meta, index, delta, lp.take(), None, None)));
        }
        if !calls.is_empty() {
            let list = response::tool_calls_json(calls, Some(self.tool_index[index]));
            self.tool_index[index] += calls.len();
            let c = response::chat_chunk(meta, index, json!({"tool_calls": list}), lp.take(), None, None);
            out.push_back(frame(&c));
        }
    }

    /// The choice's final chunk; after the last choice's, the usage and `[DONE]`.
    fn finish(&mut self, index: usize, reason: &str, out: &mut VecDeque<Bytes>) {
        self.open = self.open.saturating_sub(1);
        let last = self.open == 0;
        let meta = &self.meta;
        let usage = self.usage.total;
        let inline = (last && !self.include_usage).then_some(usage);
        let chunk = match self.kind {
            Kind::Chat => response::chat_chunk(meta, index, json!({}), None, Some(reason), inline),
            Kind::Text => response::text_completion(meta, vec![response::text_choice(index, "", None, Some(reason))], inline),
        };
        out.push_back(frame(&chunk));
        if !last {
            return;
        }
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
