//! Anthropic's stream: `message_start`; per content block `content_block_start`, its deltas
//! (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`; `ping` after
//! the first block starts (and as the keep-alive); `message_delta` with `stop_reason`,
//! `stop_sequence` and usage; `message_stop`. A failure mid-stream is an `error` event.
//!
//! Blocks follow the pipeline's channels: reasoning opens a thinking block, content a text
//! block, each tool call is a block of its own with its whole input in one `input_json_delta`
//! (the parser decides a call only once it is complete). A text block opens only once it has
//! more than whitespace, as the whole message drops whitespace-only text.

use super::response::{self as resp, Message};
use crate::errors::ApiError;
use crate::generation::{End, Piece};
use crate::protocol::response::Usage;
use crate::stream::{event, Encoder};
use axum::body::Bytes;
use ferrolm_text::ToolCall;
use serde_json::{json, Value};
use std::collections::VecDeque;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

pub struct AnthropicEncoder {
    /// The next block's index.
    index: usize,
    open: Option<Open>,
    pinged: bool,
    /// Whitespace held until a text block has something else to show.
    held: String,
    /// `thinking.display: "omitted"`: thinking blocks open and close with no text.
    hide_thinking: bool,
}

/// The `message_start` frame and the encoder for the rest.
pub fn start(id: &str, model: &str, prompt_tokens: usize, hide_thinking: bool) -> (Bytes, AnthropicEncoder) {
    let usage = resp::usage(&Usage { prompt_tokens, completion_tokens: 0, cached_tokens: 0, ..Default::default() });
    let empty =
        Message { id, model, thinking: None, text: "", calls: &[], stop_reason: None, stop_sequence: None, usage };
    // An empty message has no tool input to fail on.
    let message = empty.json().unwrap_or_default();
    let first = event("message_start", &json!({"type": "message_start", "message": message}));
    (first, AnthropicEncoder { index: 0, open: None, pinged: false, held: String::new(), hide_thinking })
}

/// The whole stream of a request that generates nothing (`max_tokens: 0`).
pub fn without_output(id: &str, model: &str, prompt_tokens: usize) -> Vec<Bytes> {
    let (first, mut encoder) = start(id, model, prompt_tokens, false);
    let mut out = VecDeque::from([first]);
    let usage = Usage { prompt_tokens, completion_tokens: 0, cached_tokens: 0, ..Default::default() };
    encoder.finish("length", usage, None, &mut out);
    out.into()
}

impl Encoder for AnthropicEncoder {
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>) {
        let d = piece.delta;
        if !d.reasoning.is_empty() {
            self.open_block(Open::Thinking, out);
            if !self.hide_thinking {
                self.delta(json!({"type": "thinking_delta", "thinking": d.reasoning}), out);
            }
        }
        if !d.content.is_empty() {
            self.text(&d.content, out);
        }
        for call in &d.tool_calls {
            if let Err(e) = self.tool_use(call, out) {
                return self.fail(e.message, out);
            }
        }
        match piece.end {
            None => {}
            Some(End::Finished { reason, usage, stop }) => self.finish(reason, usage, stop, out),
            Some(End::Failed(message)) => self.fail(message, out),
        }
    }

    fn fail(&mut self, message: String, out: &mut VecDeque<Bytes>) {
        out.push_back(event("error", &ApiError::internal(message).anthropic_body()));
    }

    fn keepalive(&self) -> Bytes {
        event("ping", &json!({"type": "ping"}))
    }
}

impl AnthropicEncoder {
    fn text(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        if self.open != Some(Open::Text) {
            self.held.push_str(text);
            if self.held.trim().is_empty() {
                return;
            }
            self.open_block(Open::Text, out);
            let text = std::mem::take(&mut self.held);
            return self.delta(json!({"type": "text_delta", "text": text}), out);
        }
        self.delta(json!({"type": "text_delta", "text": text}), out);
    }

    /// Closes the open block unless it is `kind`, and opens a `kind` block.
    fn open_block(&mut self, kind: Open, out: &mut VecDeque<Bytes>) {
        if self.open == Some(kind) {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Thinking => resp::thinking_block(""),
            Open::Text => resp::text_block(""),
        };
        self.block_start(block, out);
        self.open = Some(kind);
    }

    fn block_start(&mut self, block: Value, out: &mut VecDeque<Bytes>) {
        let start = json!({"type": "content_block_start", "index": self.index, "content_block": block});
        out.push_back(event("content_block_start", &start));
        if !self.pinged {
            out.push_back(self.keepalive());
            self.pinged = true;
        }
    }

    fn delta(&self, delta: Value, out: &mut VecDeque<Bytes>) {
        let d = json!({"type": "content_block_delta", "index": self.index, "delta": delta});
        out.push_back(event("content_block_delta", &d));
    }

    fn close(&mut self, out: &mut VecDeque<Bytes>) {
        if self.open.take().is_some() {
            self.stop_block(out);
        }
    }

    fn stop_block(&mut self, out: &mut VecDeque<Bytes>) {
        out.push_back(event("content_block_stop", &json!({"type": "content_block_stop", "index": self.index})));
        self.index += 1;
    }

    fn tool_use(&mut self, call: &ToolCall, out: &mut VecDeque<Bytes>) -> Result<(), ApiError> {
        let input = resp::tool_input(call)?;
        self.close(out);
        self.held.clear();
        let block = json!({"type": "tool_use", "id": resp::id("toolu_"), "name": call.name, "input": {}});
        self.block_start(block, out);
        self.delta(json!({"type": "input_json_delta", "partial_json": input.to_string()}), out);
        self.stop_block(out);
        Ok(())
    }

    fn finish(&mut self, reason: &str, usage: Usage, stop: Option<String>, out: &mut VecDeque<Bytes>) {
        self.close(out);
        let stop_reason = resp::stop_reason(reason, stop.as_deref());
        let stop_sequence = stop.filter(|_| stop_reason == "stop_sequence");
        let d = json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": resp::usage(&usage),
        });
        out.push_back(event("message_delta", &d));
        out.push_back(event("message_stop", &json!({"type": "message_stop"})));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Delta;

    fn names(frames: &VecDeque<Bytes>) -> Vec<String> {
        frames
            .iter()
            .map(|f| std::str::from_utf8(f).unwrap().lines().next().unwrap().trim_start_matches("event: ").to_string())
            .collect()
    }

    fn piece(reasoning: &str, content: &str, calls: Vec<ToolCall>, end: Option<End>) -> Piece {
        Piece {
            delta: Delta { content: content.into(), reasoning: reasoning.into(), tool_calls: calls },
            logprobs: vec![],
            end,
        }
    }

    #[test]
    fn event_order_with_thinking_text_and_a_tool() {
        let (first, mut enc) = start("msg_01x", "m", 5, false);
        let mut out = VecDeque::from([first]);
        enc.piece(piece("hm", "", vec![], None), &mut out);
        enc.piece(piece("", "\n", vec![], None), &mut out);
        enc.piece(piece("", "Hi", vec![], None), &mut out);
        let call = ToolCall { name: "w".into(), arguments: "{\"a\": 1}".into() };
        let usage = Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 0, ..Default::default() };
        let end = End::Finished { reason: "tool_calls", usage, stop: None };
        enc.piece(piece("", "", vec![call], Some(end)), &mut out);
        assert_eq!(
            names(&out),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        let text = std::str::from_utf8(&out[6]).unwrap();
        assert!(text.contains(r#""index":1"#) && text.contains(r#""text":"\nHi""#), "{text}");
        let json_delta = std::str::from_utf8(&out[9]).unwrap();
        assert!(json_delta.contains(r#""partial_json":"{\"a\":1}""#), "{json_delta}");
        assert!(std::str::from_utf8(&out[11]).unwrap().contains(r#""stop_reason":"tool_use""#));
    }

    #[test]
    fn omitted_thinking_is_an_empty_block() {
        let (first, mut enc) = start("msg_01x", "m", 5, true);
        let mut out = VecDeque::from([first]);
        enc.piece(piece("secret", "", vec![], None), &mut out);
        let usage = Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 0, ..Default::default() };
        enc.piece(piece("", "Hi", vec![], Some(End::Finished { reason: "stop", usage, stop: None })), &mut out);
        let names = names(&out);
        assert_eq!(names[1..5], ["content_block_start", "ping", "content_block_stop", "content_block_start"]);
        assert!(out.iter().all(|f| !std::str::from_utf8(f).unwrap().contains("secret")));
    }
}
