//! SentencePiece ("llama" in GGUF) tokenization, the algorithm of llama.cpp's
//! `llm_tokenizer_spm_session`: start from UTF-8 characters, repeatedly merge the adjacent pair
//! whose concatenation is the vocabulary token with the highest score (ties: leftmost pair), then
//! emit `<0xXX>` byte tokens for characters that are not tokens.
//!
//! Why not a `tokenizers` BPE with merges derived from the scores: BPE ranks each *pair*
//! (left piece, right piece), while this algorithm ranks the *resulting token* and breaks ties by
//! position. A token reachable through several splits, or two tokens with equal scores, can then
//! merge in a different order, so a derived BPE is not guaranteed to match llama.cpp token for
//! token. Deriving merges for a 262k vocabulary is also slow at load time. This module is short and
//! matches llama.cpp by construction.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use anyhow::{anyhow, Result};

use crate::vocab::Vocab;

#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    /// Byte range in the input text.
    start: usize,
    len: usize,
}

#[derive(PartialEq)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// Highest score first; on equal scores the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Tokenizes `text` (spaces already escaped to `▁`) and appends the ids to `out`.
pub(crate) fn encode_into(
    vocab: &Vocab,
    scores: &[f32],
    text: &str,
    out: &mut Vec<u32>,
) -> Result<()> {
    let mut symbols = split_chars(text);
    let mut queue = BinaryHeap::new();
    for i in 1..symbols.len() {
        try_add_bigram(vocab, scores, text, &symbols, i - 1, i, &mut queue);
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Skip pairs made stale by an earlier merge of either side.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        if let Some(p) = symbols[b.left].prev {
            try_add_bigram(vocab, scores, text, &symbols, p, b.left, &mut queue);
        }
        if let Some(n) = symbols[b.left].next {
            try_add_bigram(vocab, scores, text, &symbols, b.left, n, &mut queue);
        }
    }
    emit(vocab, text, &symbols, out)
}

fn split_chars(text: &str) -> Vec<Symbol> {
    let n = text.chars().count();
    text.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
            start,
            len: c.len_utf8(),
        })
        .collect()
}

fn try_add_bigram(
    vocab: &Vocab,
    scores: &[f32],
    text: &str,
    symbols: &[Symbol],
    left: usize,
    right: usize,
    queue: &mut BinaryHeap<Bigram>,
) {
    let (l, r) = (symbols[left], symbols[right]);
    let piece = &text[l.start..r.start + r.len];
    if let Some(&id) = vocab.ids.get(piece) {
        let score = scores.get(id as usize).copied().unwrap_or(0.0);
        queue.push(Bigram {
            left,
            right,
            score,
            size: piece.len(),
        });
    }
}

/// Walks the final symbol chain: a symbol that is a token is emitted as such, anything else
/// (only single characters can be non-tokens) falls back to its UTF-8 bytes.
fn emit(vocab: &Vocab, text: &str, symbols: &[Symbol], out: &mut Vec<u32>) -> Result<()> {
    let mut cur = if symbols.is_empty() { None } else { Some(0) };
    while let Some(i) = cur {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.ids.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    out.push(byte_token(vocab, b)?);
                }
            }
        }
        cur = s.next;
    }
    Ok(())
}

/// llama.cpp `byte_to_token`: `<0xXX>`, else the byte itself as a one-char token.
fn byte_token(vocab: &Vocab, b: u8) -> Result<u32> {
    let hex = format!("<0x{b:02X}>");
    if let Some(&id) = vocab.ids.get(&hex) {
        return Ok(id);
    }
    let single = (b < 0x80).then(|| (b as char).to_string());
    single
        .and_then(|s| vocab.ids.get(&s).copied())
        .ok_or_else(|| anyhow!("vocabulary has no byte-fallback token for byte 0x{b:02X}"))
}
