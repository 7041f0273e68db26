//! Splits streamed text into reasoning and content at `<think>` / `</think>` tags (or any
//! start/end pair). Deltas go in; what comes out is text whose channel is decided. A suffix that
//! could be the beginning of the next tag is held back until the following delta decides it, so
//! a tag cut across tokens (`<th` + `ink>`) is never leaked as text. The tags themselves are
//! never emitted.

/// Text of one push, by channel; either may be empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReasoningSplit {
    pub reasoning: String,
    pub content: String,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    start: String,
    end: String,
    in_reasoning: bool,
    held: String,
}

impl ReasoningSplitter {
    /// `in_reasoning`: the prompt ended inside an open start tag (e.g. a template that writes
    /// `<think>\n` after the assistant header), so the output begins as reasoning.
    pub fn new(start: impl Into<String>, end: impl Into<String>, in_reasoning: bool) -> Self {
        ReasoningSplitter { start: start.into(), end: end.into(), in_reasoning, held: String::new() }
    }

    /// The `<think>` / `</think>` pair.
    pub fn think(in_reasoning: bool) -> Self {
        Self::new("<think>", "</think>", in_reasoning)
    }

    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    /// Whether a rendered prompt leaves the model inside an open reasoning block: its last start
    /// tag comes after its last end tag.
    pub fn prompt_opens_reasoning(prompt: &str, start: &str, end: &str) -> bool {
        match (prompt.rfind(start), prompt.rfind(end)) {
            (Some(s), Some(e)) => s > e,
            (Some(_), None) => true,
            _ => false,
        }
    }

    /// Feeds a delta; returns what is decided.
    pub fn push(&mut self, delta: &str) -> ReasoningSplit {
        self.held.push_str(delta);
        let mut out = ReasoningSplit::default();
        loop {
            let tag = if self.in_reasoning { &self.end } else { &self.start };
            match self.held.find(tag.as_str()) {
                Some(at) => {
                    let before = self.held[..at].to_string();
                    let rest = self.held[at + tag.len()..].to_string();
                    self.channel(&mut out).push_str(&before);
                    self.held = rest;
                    self.in_reasoning = !self.in_reasoning;
                }
                None => {
                    let keep = partial_suffix_len(&self.held, tag);
                    let cut = self.held.len() - keep;
                    let emit: String = self.held.drain(..cut).collect();
                    self.channel(&mut out).push_str(&emit);
                    return out;
                }
            }
        }
    }

    /// End of stream: held text goes to the current channel.
    pub fn finish(&mut self) -> ReasoningSplit {
        let mut out = ReasoningSplit::default();
        let held = std::mem::take(&mut self.held);
        self.channel(&mut out).push_str(&held);
        out
    }

    fn channel<'a>(&self, out: &'a mut ReasoningSplit) -> &'a mut String {
        if self.in_reasoning {
            &mut out.reasoning
        } else {
            &mut out.content
        }
    }
}

/// Length of the longest suffix of `text` that is a proper, non-empty prefix of `tag`.
pub(crate) fn partial_suffix_len(text: &str, tag: &str) -> usize {
    let max = tag.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(s: &mut ReasoningSplitter, deltas: &[&str]) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        for d in deltas {
            let o = s.push(d);
            r += &o.reasoning;
            c += &o.content;
        }
        let o = s.finish();
        (r + &o.reasoning, c + &o.content)
    }

    #[test]
    fn splits_tags_cut_across_deltas() {
        let mut s = ReasoningSplitter::think(false);
        let (r, c) = run(&mut s, &["<th", "ink>I think", " so</", "thi", "nk>\n\nYes", "."]);
        assert_eq!(r, "I think so");
        assert_eq!(c, "\n\nYes.");
    }

    #[test]
    fn holds_back_only_ambiguous_suffixes() {
        let mut s = ReasoningSplitter::think(false);
        assert_eq!(s.push("a <").content, "a ");
        assert_eq!(s.push("b").content, "<b");
        assert_eq!(s.push("x<thi").content, "x");
        assert_eq!(s.finish().content, "<thi");
    }

    #[test]
    fn starts_in_reasoning_when_the_prompt_opened_it() {
        assert!(ReasoningSplitter::prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", "<think>", "</think>"));
        assert!(!ReasoningSplitter::prompt_opens_reasoning("<think>\n\n</think>\n\n", "<think>", "</think>"));
        let mut s = ReasoningSplitter::think(true);
        let (r, c) = run(&mut s, &["plan", "</think>", "answer"]);
        assert_eq!((r.as_str(), c.as_str()), ("plan", "answer"));
    }

    #[test]
    fn multibyte_text_is_never_split_inside_a_character() {
        let mut s = ReasoningSplitter::new("<é>", "</é>", false);
        let (r, c) = run(&mut s, &["aé", "<", "é", ">ü</é", ">z"]);
        assert_eq!((r.as_str(), c.as_str()), ("ü", "aéz"));
    }
}
