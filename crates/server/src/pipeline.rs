//! One request's text pipeline: token → incremental detokenizer (holds partial UTF-8) → stop
//! matcher (on decoded text, across token boundaries; holds back what could begin a stop; the
//! stop text is never emitted) → reasoning splitter (`<think>…</think>`) → tool-call parser
//! (content channel only). Every stage holds back only what is ambiguous, so text streams as
//! soon as it is decided.
//!
//! Stops come first: a stop string ends the generation wherever it appears in the model's
//! text, inside reasoning or a tool call too (as in mlx-lm, whose stop sequences act on tokens
//! before its reasoning/tool state machine).

use ferrolm_text::{
    IncrementalDecoder, ReasoningSplitter, StopMatcher, Tokenizer, ToolCall, ToolCallParser, ToolEvent, ToolSpec,
};

/// Text decided by one step, by channel.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Delta {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }

    fn append(&mut self, other: Delta) {
        self.content.push_str(&other.content);
        self.reasoning.push_str(&other.reasoning);
        self.tool_calls.extend(other.tool_calls);
    }
}

/// How a request's output is routed.
#[derive(Debug, Default, Clone)]
pub struct PipelineConfig {
    pub stops: Vec<String>,
    /// (start, end, starts inside reasoning).
    pub reasoning: Option<(String, String, bool)>,
    /// Offered tools; None: tool calls are not parsed.
    pub tools: Option<Vec<ToolSpec>>,
    /// Drop one space at the very start of the output, as mlx-lm's detokenizers do (a chat
    /// answer's first token is often " Hello"; SentencePiece pieces start with "▁").
    pub trim_leading_space: bool,
}

pub struct TextPipeline {
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    reasoning: Option<ReasoningSplitter>,
    tools: Option<ToolCallParser>,
    finished: bool,
    /// Still waiting for the first decoded text (for `trim_leading_space`).
    at_start: bool,
}

impl TextPipeline {
    pub fn new(cfg: PipelineConfig) -> Self {
        TextPipeline {
            decoder: IncrementalDecoder::new(true),
            stop: StopMatcher::new(cfg.stops),
            reasoning: cfg.reasoning.map(|(s, e, inside)| ReasoningSplitter::new(s, e, inside)),
            tools: cfg.tools.map(ToolCallParser::new),
            finished: false,
            at_start: cfg.trim_leading_space,
        }
    }

    /// Adds one generated token. Returns the decided text and the stop string that matched, if
    /// one did (then the pipeline is finished: everything held was flushed into this delta).
    /// Anthropic's `stop_sequence` reports which one.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> (Delta, Option<String>) {
        if self.finished {
            return (Delta::default(), None);
        }
        let text = self.decoder.push(tokenizer, token);
        let text = self.trim_start(text);
        let (safe, hit) = self.stop.push(&text);
        let mut delta = self.route(&safe);
        if hit.is_some() {
            delta.append(self.flush_stages());
        }
        (delta, hit.map(|h| h.stop))
    }

    /// End of generation (EOS, length, error): everything held is released.
    pub fn finish(&mut self) -> Delta {
        if self.finished {
            return Delta::default();
        }
        let rest = self.decoder.finish();
        let rest = self.trim_start(rest);
        let (mut safe, hit) = self.stop.push(&rest);
        if hit.is_none() {
            safe.push_str(&self.stop.flush());
        }
        let mut delta = self.route(&safe);
        delta.append(self.flush_stages());
        delta
    }

    /// One space off the first non-empty text (mlx-lm: `_maybe_trim_space`).
    fn trim_start(&mut self, text: String) -> String {
        if !self.at_start || text.is_empty() {
            return text;
        }
        self.at_start = false;
        match text.strip_prefix(' ') {
            Some(rest) => rest.to_string(),
            None => text,
        }
    }

    fn route(&mut self, text: &str) -> Delta {
        if text.is_empty() {
            return Delta::default();
        }
        let (reasoning, content) = match self.reasoning.as_mut() {
            Some(r) => {
                let split = r.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_string()),
        };
        let mut delta = Delta { reasoning, ..Default::default() };
        self.tool_stage(&content, false, &mut delta);
        delta
    }

    fn flush_stages(&mut self) -> Delta {
        self.finished = true;
        let mut delta = Delta::default();
        let content = match self.reasoning.as_mut() {
            Some(r) => {
                let split = r.finish();
                delta.reasoning = split.reasoning;
                split.content
            }
            None => String::new(),
        };
        self.tool_stage(&content, true, &mut delta);
        delta
    }

    fn tool_stage(&mut self, content: &str, finish: bool, out: &mut Delta) {
        let Some(parser) = self.tools.as_mut() else {
            out.content.push_str(content);
            return;
        };
        let mut events = parser.push(content);
        if finish {
            events.extend(parser.finish());
        }
        for e in events {
            match e {
                ToolEvent::Content(c) => out.content.push_str(&c),
                ToolEvent::Call(c) => out.tool_calls.push(c),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer is not needed to test the stages: feed decoded text through `route`.
    fn run(cfg: PipelineConfig, deltas: &[&str]) -> (Delta, bool) {
        let mut p = TextPipeline::new(cfg);
        let mut all = Delta::default();
        for d in deltas {
            let (safe, hit) = p.stop.push(d);
            all.append(p.route(&safe));
            if hit.is_some() {
                all.append(p.flush_stages());
                return (all, true);
            }
        }
        all.append(p.finish());
        (all, false)
    }

    #[test]
    fn one_leading_space_is_trimmed_when_asked() {
        let tok = |cfg: PipelineConfig, parts: &[&str]| {
            let mut p = TextPipeline::new(cfg);
            parts.iter().map(|t| p.trim_start(t.to_string())).collect::<String>()
        };
        let trim = PipelineConfig { trim_leading_space: true, ..Default::default() };
        assert_eq!(tok(trim.clone(), &["", " Hello", " world"]), "Hello world");
        assert_eq!(tok(trim.clone(), &[" ", " x"]), " x");
        assert_eq!(tok(trim, &["Hi", " there"]), "Hi there");
        assert_eq!(tok(PipelineConfig::default(), &[" Paris"]), " Paris");
    }

    #[test]
    fn stop_spanning_deltas_is_never_emitted() {
        let cfg = PipelineConfig { stops: vec!["END".into()], ..Default::default() };
        let (d, hit) = run(cfg, &["hello E", "N", "D more"]);
        assert!(hit);
        assert_eq!(d.content, "hello ");
    }

    #[test]
    fn reasoning_then_tool_call() {
        let cfg = PipelineConfig {
            reasoning: Some(("<think>".into(), "</think>".into(), false)),
            tools: Some(vec![ToolSpec { name: "f".into(), ..Default::default() }]),
            ..Default::default()
        };
        let (d, _) =
            run(cfg, &["<think>hm", "m</think>", "ok <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"]);
        assert_eq!(d.reasoning, "hmm");
        assert_eq!(d.content, "ok ");
        assert_eq!(d.tool_calls.len(), 1);
    }

    #[test]
    fn a_stop_inside_a_tool_call_flushes_it_as_content() {
        let cfg = PipelineConfig { stops: vec!["}}".into()], tools: Some(vec![]), ..Default::default() };
        let (d, hit) = run(cfg, &["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"]);
        assert!(hit);
        assert!(d.tool_calls.is_empty());
        assert_eq!(d.content, "<tool_call>{\"name\": \"f\", \"arguments\": {");
    }
}
