//! The Responses API's stream: `response.created`, `response.in_progress`; per output item
//! `response.output_item.added`, its content (`response.content_part.added`,
//! `response.output_text.delta`…`.done`, `response.content_part.done` for a message;
//! `response.reasoning_text.delta`…`.done` for reasoning; `response.function_call_arguments.delta`
//! and `.done` for a call) and `response.output_item.done`; then `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut it, `response.failed` on a failure). Every
//! event carries its `sequence_number`, from 0.
//!
//! Items follow the pipeline's channels as they switch; a message item opens only once its text
//! has more than whitespace (the whole response drops whitespace-only text the same way). Each
//! tool call comes whole from the parser, so its arguments are one delta.

use super::response::{self as resp, id};
use super::store::Stored;
use crate::generation::{End, Piece};
use crate::protocol::response::{tool_call_id, Usage};
use crate::state::SharedState;
use crate::stream::{event, Encoder};
use axum::body::Bytes;
use ferrolm_text::ToolCall;
use serde_json::{json, Value};
use std::collections::VecDeque;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
}

struct OpenItem {
    kind: Kind,
    id: String,
    text: String,
}

/// Where a finished response is stored (None: `store: false`).
pub struct Save {
    pub state: SharedState,
    /// The conversation before this response's output (history and this request's input).
    pub conversation: Vec<Value>,
}

pub struct ResponsesEncoder {
    response: Value,
    seq: u64,
    /// Items already done, in output order.
    output: Vec<Value>,
    open: Option<OpenItem>,
    held: String,
    save: Option<Save>,
}

impl ResponsesEncoder {
    /// The encoder and its first frames (`response.created`, `response.in_progress`).
    pub fn start(response: Value, save: Option<Save>) -> (Vec<Bytes>, Self) {
        let mut enc = ResponsesEncoder { response, seq: 0, output: Vec::new(), open: None, held: String::new(), save };
        let snapshot = enc.response.clone();
        let first = vec![
            enc.event("response.created", json!({"response": snapshot})),
            enc.event("response.in_progress", json!({"response": snapshot})),
        ];
        (first, enc)
    }

    /// One event: its `type` and `sequence_number` added to `fields`.
    fn event(&mut self, kind: &str, mut fields: Value) -> Bytes {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.seq);
        self.seq += 1;
        event(kind, &fields)
    }
}

impl Encoder for ResponsesEncoder {
    fn piece(&mut self, piece: Piece, out: &mut VecDeque<Bytes>) {
        let d = piece.delta;
        if !d.reasoning.is_empty() {
            self.open_item(Kind::Reasoning, out);
            self.text_delta(&d.reasoning, out);
        }
        if !d.content.is_empty() {
            self.content(&d.content, out);
        }
        for call in &d.tool_calls {
            self.function_call(call, out);
        }
        match piece.end {
            None => {}
            Some(End::Finished { reason, usage, .. }) => self.finish(reason, usage, out),
            Some(End::Failed(message)) => self.fail(message, out),
        }
    }

    fn fail(&mut self, message: String, out: &mut VecDeque<Bytes>) {
        self.close(out);
        resp::fail(&mut self.response, std::mem::take(&mut self.output), &message);
        let snapshot = self.response.clone();
        out.push_back(self.event("response.failed", json!({"response": snapshot})));
    }
}

impl ResponsesEncoder {
    fn content(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        if self.open.as_ref().is_some_and(|o| o.kind == Kind::Message) {
            return self.text_delta(text, out);
        }
        self.held.push_str(text);
        if self.held.trim().is_empty() {
            return;
        }
        self.open_item(Kind::Message, out);
        let text = std::mem::take(&mut self.held);
        self.text_delta(&text, out);
    }

    fn open_item(&mut self, kind: Kind, out: &mut VecDeque<Bytes>) {
        if self.open.as_ref().is_some_and(|o| o.kind == kind) {
            return;
        }
        self.close(out);
        let item_id = match kind {
            Kind::Reasoning => id("rs"),
            Kind::Message => id("msg"),
        };
        let output_index = self.output.len();
        let item = match kind {
            Kind::Reasoning => json!({"id": item_id, "type": "reasoning", "summary": [], "content": []}),
            Kind::Message => resp::message_item(&item_id, None, "in_progress"),
        };
        out.push_back(self.event("response.output_item.added", json!({"output_index": output_index, "item": item})));
        if kind == Kind::Message {
            let part = json!({"item_id": item_id, "output_index": output_index, "content_index": 0,
                              "part": resp::output_text("")});
            out.push_back(self.event("response.content_part.added", part));
        }
        self.open = Some(OpenItem { kind, id: item_id, text: String::new() });
    }

    fn text_delta(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        let output_index = self.output.len();
        let Some(open) = self.open.as_mut() else { return };
        open.text.push_str(text);
        let (kind, item_id) = (open.kind, open.id.clone());
        let mut fields = json!({"item_id": item_id, "output_index": output_index, "content_index": 0, "delta": text});
        let name = match kind {
            Kind::Reasoning => "response.reasoning_text.delta",
            Kind::Message => {
                fields["logprobs"] = json!([]);
                "response.output_text.delta"
            }
        };
        out.push_back(self.event(name, fields));
    }

    /// Ends the open item: its `.done` events, then `response.output_item.done`.
    fn close(&mut self, out: &mut VecDeque<Bytes>) {
        let Some(open) = self.open.take() else { return };
        let output_index = self.output.len();
        let at = json!({"item_id": open.id, "output_index": output_index, "content_index": 0});
        let item = match open.kind {
            Kind::Reasoning => {
                let mut done = at;
                done["text"] = json!(open.text);
                out.push_back(self.event("response.reasoning_text.done", done));
                resp::reasoning_item(&open.id, &open.text)
            }
            Kind::Message => {
                let mut done = at.clone();
                done["text"] = json!(open.text);
                done["logprobs"] = json!([]);
                out.push_back(self.event("response.output_text.done", done));
                let mut part = at;
                part["part"] = resp::output_text(&open.text);
                out.push_back(self.event("response.content_part.done", part));
                resp::message_item(&open.id, Some(&open.text), "completed")
            }
        };
        self.item_done(item, out);
    }

    fn item_done(&mut self, item: Value, out: &mut VecDeque<Bytes>) {
        let output_index = self.output.len();
        out.push_back(self.event("response.output_item.done", json!({"output_index": output_index, "item": item})));
        self.output.push(item);
    }

    fn function_call(&mut self, call: &ToolCall, out: &mut VecDeque<Bytes>) {
        self.close(out);
        self.held.clear();
        let (item_id, call_id) = (id("fc"), tool_call_id());
        let output_index = self.output.len();
        let added = resp::function_call_item(&item_id, &call_id, call, "", "in_progress");
        out.push_back(self.event("response.output_item.added", json!({"output_index": output_index, "item": added})));
        let at = json!({"item_id": item_id, "output_index": output_index});
        let mut delta = at.clone();
        delta["delta"] = json!(call.arguments);
        out.push_back(self.event("response.function_call_arguments.delta", delta));
        let mut done = at;
        done["arguments"] = json!(call.arguments);
        done["name"] = json!(call.name);
        out.push_back(self.event("response.function_call_arguments.done", done));
        let item = resp::function_call_item(&item_id, &call_id, call, &call.arguments, "completed");
        self.item_done(item, out);
    }

    fn finish(&mut self, reason: &str, usage: Usage, out: &mut VecDeque<Bytes>) {
        self.close(out);
        let output = std::mem::take(&mut self.output);
        resp::finish(&mut self.response, output.clone(), reason, &usage);
        if let Some(save) = self.save.take() {
            let mut conversation = save.conversation;
            conversation.extend(output);
            let id = self.response["id"].as_str().unwrap_or_default().to_string();
            save.state.responses.insert(id, Stored { response: self.response.clone(), conversation });
        }
        let name = if reason == "length" { "response.incomplete" } else { "response.completed" };
        let snapshot = self.response.clone();
        out.push_back(self.event(name, json!({"response": snapshot})));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Delta;

    fn names(frames: &[Bytes]) -> Vec<String> {
        frames
            .iter()
            .map(|f| std::str::from_utf8(f).unwrap().lines().next().unwrap().trim_start_matches("event: ").to_string())
            .collect()
    }

    fn piece(content: &str, calls: Vec<ToolCall>, end: Option<End>) -> Piece {
        Piece {
            delta: Delta { content: content.into(), reasoning: String::new(), tool_calls: calls },
            logprobs: vec![],
            end,
        }
    }

    #[test]
    fn reasoning_then_text() {
        let skeleton = resp::skeleton("resp_1", "m", &serde_json::Map::new());
        let (first, mut enc) = ResponsesEncoder::start(skeleton, None);
        let mut out = VecDeque::from(first);
        let mut p = piece("", vec![], None);
        p.delta.reasoning = "hmm".into();
        enc.piece(p, &mut out);
        let usage = Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: 0, ..Default::default() };
        enc.piece(piece(" \nOK", vec![], Some(End::Finished { reason: "stop", usage, stop: None })), &mut out);
        let frames: Vec<Bytes> = out.into();
        assert_eq!(
            names(&frames)[2..],
            [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let last = std::str::from_utf8(frames.last().unwrap()).unwrap();
        assert!(last.contains(r#""type":"reasoning_text","text":"hmm""#), "{last}");
        assert!(last.contains(r#""output_index""#) == false);
    }

    #[test]
    fn text_then_call_event_chain() {
        let skeleton = resp::skeleton("resp_1", "m", &serde_json::Map::new());
        let (first, mut enc) = ResponsesEncoder::start(skeleton, None);
        let mut out = VecDeque::from(first);
        enc.piece(piece("Hel", vec![], None), &mut out);
        enc.piece(piece("lo", vec![], None), &mut out);
        let call = ToolCall { name: "f".into(), arguments: "{\"a\": 1}".into() };
        let usage = Usage { prompt_tokens: 4, completion_tokens: 5, cached_tokens: 0, ..Default::default() };
        enc.piece(piece("", vec![call], Some(End::Finished { reason: "tool_calls", usage, stop: None })), &mut out);
        let frames: Vec<Bytes> = out.into();
        assert_eq!(
            names(&frames),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        let data: Vec<Value> = frames
            .iter()
            .map(|f| {
                serde_json::from_str(
                    std::str::from_utf8(f).unwrap().lines().nth(1).unwrap().trim_start_matches("data: "),
                )
                .unwrap()
            })
            .collect();
        for (i, d) in data.iter().enumerate() {
            assert_eq!(d["sequence_number"], i as u64);
        }
        assert_eq!(data[6]["text"], "Hello");
        let done = &data[13]["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][1]["arguments"], "{\"a\": 1}");
        assert_eq!(done["output"][1]["output_index"], Value::Null);
        assert_eq!(data[12]["output_index"], 1);
    }
}
