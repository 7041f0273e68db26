//! Tokenization with a bound: a prompt that cannot fit the context is refused without
//! tokenizing all of it. Two guards: a text longer than `limit` tokens of the vocabulary's
//! longest piece could ever cover is refused from its length alone; otherwise the text is
//! tokenized in chunks and the count checked after each, so the work and memory spent on an
//! oversized prompt stay proportional to the limit, not to the text.
//!
//! A chunk ends just before a space that has an ASCII letter on both sides. Every pre-tokenizer
//! regex ferrolm uses (GPT-2, llama3, Qwen2, tekken, GPT-4o…) starts a new piece there (` b`
//! or `[^\r\n\p{L}\p{N}]?\p{L}+` after a letter run that cannot take the space), and byte-level
//! BPE merges never cross pieces, so the chunks' tokens are the whole text's. SentencePiece has
//! no pre-tokenizer: there chunking is used only when no vocabulary piece holds a letter
//! followed by a space, so no merge can cross the cut (checked at load).

use std::fmt;

/// Bytes per chunk before looking for a cut: small enough that the tokenizer's per-byte
/// bookkeeping for one chunk stays in the low megabytes.
const CHUNK: usize = 4096;

#[derive(Debug)]
pub enum EncodeError {
    /// The text is longer than `limit` tokens; `at_least` is how many were counted (or proven
    /// from the length) before stopping.
    TooLong { limit: usize, at_least: usize },
    Failed(anyhow::Error),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::TooLong { limit, at_least } => {
                write!(f, "the text is longer than {limit} tokens (at least {at_least})")
            }
            EncodeError::Failed(e) => write!(f, "tokenization failed: {e}"),
        }
    }
}

impl std::error::Error for EncodeError {}

impl From<anyhow::Error> for EncodeError {
    fn from(e: anyhow::Error) -> Self {
        EncodeError::Failed(e)
    }
}

/// Output ids with the limit checked as they grow.
pub(crate) struct Sink {
    pub out: Vec<u32>,
    limit: usize,
}

impl Sink {
    pub fn new(limit: usize) -> Self {
        Sink { out: Vec::new(), limit }
    }

    pub fn check(&self) -> Result<(), EncodeError> {
        if self.out.len() > self.limit {
            return Err(EncodeError::TooLong { limit: self.limit, at_least: self.out.len() });
        }
        Ok(())
    }

    pub fn push(&mut self, id: u32) -> Result<(), EncodeError> {
        self.out.push(id);
        self.check()
    }
}

/// Refuses from its length a text that needs more than `limit` tokens: no token covers more
/// than `max_piece` bytes of text.
pub(crate) fn precheck(text_len: usize, max_piece: usize, limit: usize) -> Result<(), EncodeError> {
    let at_least = text_len.div_ceil(max_piece.max(1));
    if at_least > limit {
        return Err(EncodeError::TooLong { limit, at_least });
    }
    Ok(())
}

/// Byte ranges covering `text`, cut only before a space between two ASCII letters.
pub(crate) fn chunks(text: &str, enabled: bool) -> impl Iterator<Item = (usize, usize)> + '_ {
    let bytes = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= bytes.len() {
            return None;
        }
        let end = if enabled { next_cut(bytes, start + CHUNK).unwrap_or(bytes.len()) } else { bytes.len() };
        let range = (start, end);
        start = end;
        Some(range)
    })
}

/// The first `i >= from` where `bytes[i]` is a space between two ASCII letters.
fn next_cut(bytes: &[u8], from: usize) -> Option<usize> {
    let letter = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_alphabetic);
    (from.max(1)..bytes.len().saturating_sub(1)).find(|&i| bytes[i] == b' ' && letter(i - 1) && letter(i + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cut_before_a_space_between_letters() {
        let text = format!("{}a b{}", "1".repeat(CHUNK), "x".repeat(10));
        let parts: Vec<_> = chunks(&text, true).collect();
        assert_eq!(parts, [(0, CHUNK + 1), (CHUNK + 1, text.len())]);
        assert_eq!(&text[parts[1].0..parts[1].0 + 2], " b");
        assert_eq!(chunks(&text, false).collect::<Vec<_>>(), [(0, text.len())]);
        assert_eq!(chunks("", true).count(), 0);
        // No cut anywhere: one chunk.
        let digits = "7".repeat(3 * CHUNK);
        assert_eq!(chunks(&digits, true).count(), 1);
    }

    #[test]
    fn limits() {
        assert!(precheck(100, 10, 10).is_ok());
        assert!(matches!(precheck(101, 10, 10), Err(EncodeError::TooLong { at_least: 11, .. })));
        let mut s = Sink::new(1);
        assert!(s.push(5).is_ok());
        assert!(s.push(6).is_err());
    }
}
