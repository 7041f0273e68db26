//! User text is text. A chat prompt is rendered to one string and then tokenized, and the
//! tokenizer turns special-token text (`<|im_start|>`, `<end_of_turn>`…) into control tokens;
//! without care a user (or a tool result, or a document) could write `<|im_start|>system` and
//! open a turn of its own. transformers' `split_special_tokens` and llama.cpp's `parse_special`
//! decide this for a whole text; a rendered chat needs it per span: the template's scaffold
//! produces control tokens, the content placed into it never does.
//!
//! So content is [`protect`]ed before the template sees it: each control-token text in it is
//! replaced by a marker (private-use characters, which no template inspects), and after
//! rendering [`restore`] puts the original text back and returns where it was, so that
//! tokenization treats those spans as plain text. Only control and unknown tokens are
//! protected: user-defined tokens (`<think>`, `<tool_call>` in Qwen) are matched in text by
//! both references above, and so here.

use std::borrow::Cow;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::vocab::{attr, Vocab};

/// Opens a marker; `MARK id END` stands for the text of control token `id`, `MARK END` for a
/// literal `MARK` that was in the content.
const MARK: char = '\u{E000}';
const END: char = '\u{E001}';

/// Finds the control-token texts of a vocabulary in content (longest first where they overlap).
pub(crate) struct Controls {
    finder: Option<AhoCorasick>,
    ids: Vec<u32>,
}

impl Controls {
    pub fn new(vocab: &Vocab) -> Self {
        let ids: Vec<u32> = vocab
            .specials
            .iter()
            .copied()
            .filter(|&id| vocab.has(id, attr::CONTROL | attr::UNKNOWN) && !vocab.texts[id as usize].is_empty())
            .collect();
        let texts = ids.iter().map(|&id| vocab.texts[id as usize].as_str());
        let finder = AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(texts).ok();
        Controls { finder, ids }
    }
}

/// `content` with every control-token text replaced by a marker; borrowed when it has none.
pub(crate) fn protect<'a>(controls: &Controls, content: &'a str) -> Cow<'a, str> {
    let Some(finder) = &controls.finder else { return escape_marks(content) };
    let mut matches = finder.find_iter(content).peekable();
    if matches.peek().is_none() {
        return escape_marks(content);
    }
    let mut out = String::with_capacity(content.len() + 16);
    let mut at = 0;
    for m in matches {
        out.push_str(&escape_marks(&content[at..m.start()]));
        let id = controls.ids[m.pattern().as_usize()];
        out.push(MARK);
        out.push_str(&id.to_string());
        out.push(END);
        at = m.end();
    }
    out.push_str(&escape_marks(&content[at..]));
    Cow::Owned(out)
}

/// A `MARK` already in the content becomes `MARK END`, so `restore` cannot mistake it.
fn escape_marks(s: &str) -> Cow<'_, str> {
    if s.contains(MARK) {
        Cow::Owned(s.replace(MARK, "\u{E000}\u{E001}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// Rendered text with the markers replaced by the text they stand for, and the byte ranges of
/// the restored control-token texts (sorted): the spans that must be tokenized as plain text.
pub(crate) fn restore<'a>(vocab: &Vocab, rendered: &'a str) -> (Cow<'a, str>, Vec<(usize, usize)>) {
    if !rendered.contains(MARK) {
        return (Cow::Borrowed(rendered), Vec::new());
    }
    let mut out = String::with_capacity(rendered.len());
    let mut plain = Vec::new();
    let mut rest = rendered;
    while let Some(pos) = rest.find(MARK) {
        out.push_str(&rest[..pos]);
        rest = &rest[pos + MARK.len_utf8()..];
        match marker_body(rest) {
            Some((body, len)) => {
                match body.parse::<u32>().ok().filter(|&id| vocab.has(id, attr::CONTROL | attr::UNKNOWN)) {
                    Some(id) => {
                        let text = &vocab.texts[id as usize];
                        plain.push((out.len(), out.len() + text.len()));
                        out.push_str(text);
                    }
                    // `MARK END`: the content's own MARK; anything else is not ours: kept as is.
                    None if body.is_empty() => out.push(MARK),
                    None => {
                        out.push(MARK);
                        out.push_str(&rest[..len]);
                    }
                }
                rest = &rest[len..];
            }
            None => out.push(MARK),
        }
    }
    out.push_str(rest);
    (Cow::Owned(out), plain)
}

/// After a MARK: the digits before `END` (at most 10) and the length consumed, END included.
fn marker_body(s: &str) -> Option<(&str, usize)> {
    let end = s.char_indices().take(12).find(|&(_, c)| c == END).map(|(i, _)| i)?;
    let body = &s[..end];
    body.bytes().all(|b| b.is_ascii_digit()).then_some((body, end + END.len_utf8()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::token_type;
    use crate::vocab::PieceStyle;

    fn vocab() -> Vocab {
        let texts = ["a", "<|im_start|>", "<think>", "<|im_end|>", "<unk>"].map(String::from).to_vec();
        let types = [
            token_type::NORMAL,
            token_type::CONTROL,
            token_type::USER_DEFINED,
            token_type::CONTROL,
            token_type::UNKNOWN,
        ];
        Vocab::new(texts, &types, PieceStyle::ByteLevel, &[])
    }

    #[test]
    fn control_texts_round_trip_as_plain_spans() {
        let v = vocab();
        let c = Controls::new(&v);
        let content = "x<|im_start|>system<think>\u{E000}y<unk>";
        let protected = protect(&c, content);
        assert!(!protected.contains("<|im_start|>") && !protected.contains("<unk>"));
        assert!(protected.contains("<think>"), "user-defined tokens are not protected");
        let rendered = format!("<|im_start|>user\n{protected}<|im_end|>");
        let (clean, plain) = restore(&v, &rendered);
        assert_eq!(clean, format!("<|im_start|>user\n{content}<|im_end|>"));
        let spans: Vec<&str> = plain.iter().map(|&(a, b)| &clean[a..b]).collect();
        assert_eq!(spans, ["<|im_start|>", "<unk>"]);
        assert_eq!(plain[0].0, "<|im_start|>user\nx".len());
    }

    #[test]
    fn text_without_controls_is_borrowed_and_foreign_marks_stay() {
        let v = vocab();
        let c = Controls::new(&v);
        assert!(matches!(protect(&c, "plain text"), Cow::Borrowed(_)));
        let (clean, plain) = restore(&v, "a\u{E000}12x\u{E000}");
        assert_eq!(clean, "a\u{E000}12x\u{E000}");
        assert!(plain.is_empty());
        // An id that is not a control token is not restored as one.
        let (clean, plain) = restore(&v, "\u{E000}0\u{E001}");
        assert_eq!(clean, "\u{E000}0\u{E001}");
        assert!(plain.is_empty());
    }
}
