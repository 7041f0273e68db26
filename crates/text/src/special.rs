//! Splitting input text around special tokens before the model tokenizes it, exactly as
//! llama.cpp's `tokenizer_st_partition` does with `parse_special = true`: each special token in
//! turn (longest text first) is cut out of every remaining raw-text fragment, left to right.
//! Aho-Corasick leftmost-longest matching (what Hugging Face does) can differ from this when
//! special tokens overlap, so the llama.cpp order is kept.

use crate::vocab::{attr, Vocab};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A byte range of the input that still needs the model.
    Text(usize, usize),
    Token(u32),
}

/// `parse_special = false` still matches user-defined tokens, like llama.cpp.
pub(crate) fn partition(vocab: &Vocab, text: &str, parse_special: bool) -> Vec<Fragment> {
    let mut frags = Vec::new();
    if text.is_empty() {
        return frags;
    }
    frags.push(Fragment::Text(0, text.len()));
    for &id in &vocab.specials {
        if !parse_special && vocab.has(id, attr::CONTROL | attr::UNKNOWN) {
            continue;
        }
        let needle = vocab.texts[id as usize].as_str();
        // Cheap check first: most special tokens never occur in a given text.
        if needle.is_empty() || !text.contains(needle) {
            continue;
        }
        frags = split_all(&frags, text, needle, id);
    }
    frags
}

fn split_all(frags: &[Fragment], text: &str, needle: &str, id: u32) -> Vec<Fragment> {
    let mut out = Vec::with_capacity(frags.len() + 2);
    for &f in frags {
        let Fragment::Text(mut start, end) = f else {
            out.push(f);
            continue;
        };
        while let Some(pos) = text[start..end].find(needle) {
            let at = start + pos;
            if at > start {
                out.push(Fragment::Text(start, at));
            }
            out.push(Fragment::Token(id));
            start = at + needle.len();
        }
        if start < end {
            out.push(Fragment::Text(start, end));
        }
    }
    out
}
