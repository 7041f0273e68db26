//! Splitting input text around special tokens before the model tokenizes it, exactly as
//! llama.cpp's `tokenizer_st_partition` does with `parse_special = true`: each special token in
//! turn (longest text first) is cut out of every remaining raw-text fragment, left to right.
//! Aho-Corasick leftmost-longest matching (what Hugging Face does) can differ from this when
//! special tokens overlap, so the llama.cpp order is kept; an automaton only finds which special
//! tokens occur at all (vocabularies hold thousands, a text a few).

use std::collections::HashSet;

use aho_corasick::AhoCorasick;

use crate::vocab::{attr, Vocab};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A byte range of the input that still needs the model.
    Text(usize, usize),
    Token(u32),
}

/// Finds which special tokens a text contains, in one pass.
pub(crate) struct SpecialFinder {
    finder: Option<AhoCorasick>,
}

impl SpecialFinder {
    pub fn new(vocab: &Vocab) -> Self {
        let texts = vocab.specials.iter().map(|&id| vocab.texts[id as usize].as_str());
        SpecialFinder { finder: AhoCorasick::new(texts).ok() }
    }

    /// Ids of `vocab.specials` whose text occurs in `text` (None: check each one).
    fn present(&self, vocab: &Vocab, text: &str) -> Option<HashSet<u32>> {
        let finder = self.finder.as_ref()?;
        let found = finder.find_overlapping_iter(text).map(|m| vocab.specials[m.pattern().as_usize()]);
        Some(found.collect())
    }
}

/// `parse_special = false` still matches user-defined tokens, like llama.cpp. Matches that
/// overlap a range of `plain` (sorted byte ranges: content that must stay text) are not cut.
pub(crate) fn partition(
    vocab: &Vocab,
    finder: &SpecialFinder,
    text: &str,
    parse_special: bool,
    plain: &[(usize, usize)],
) -> Vec<Fragment> {
    let mut frags = Vec::new();
    if text.is_empty() {
        return frags;
    }
    frags.push(Fragment::Text(0, text.len()));
    let present = finder.present(vocab, text);
    for &id in &vocab.specials {
        if !parse_special && vocab.has(id, attr::CONTROL | attr::UNKNOWN) {
            continue;
        }
        let needle = vocab.texts[id as usize].as_str();
        let absent = match &present {
            Some(set) => !set.contains(&id),
            None => !text.contains(needle),
        };
        if needle.is_empty() || absent {
            continue;
        }
        frags = split_all(&frags, text, needle, id, plain);
    }
    frags
}

fn split_all(frags: &[Fragment], text: &str, needle: &str, id: u32, plain: &[(usize, usize)]) -> Vec<Fragment> {
    let mut out = Vec::with_capacity(frags.len() + 2);
    for &f in frags {
        let Fragment::Text(mut start, end) = f else {
            out.push(f);
            continue;
        };
        let mut search = start;
        while let Some(pos) = text[search..end].find(needle) {
            let at = search + pos;
            if overlaps(plain, at, at + needle.len()) {
                // Content's own text: step past its first character and look again.
                search = at + text[at..].chars().next().map_or(1, char::len_utf8);
                continue;
            }
            if at > start {
                out.push(Fragment::Text(start, at));
            }
            out.push(Fragment::Token(id));
            start = at + needle.len();
            search = start;
        }
        if start < end {
            out.push(Fragment::Text(start, end));
        }
    }
    out
}

/// Whether `[a, b)` meets any of the sorted, disjoint ranges.
fn overlaps(ranges: &[(usize, usize)], a: usize, b: usize) -> bool {
    let i = ranges.partition_point(|&(_, end)| end <= a);
    ranges.get(i).is_some_and(|&(start, _)| start < b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::token_type;
    use crate::vocab::PieceStyle;

    #[test]
    fn plain_ranges_are_not_cut() {
        let texts = ["a", "<s>", "<|x|>"].map(String::from).to_vec();
        let v = Vocab::new(texts, &[token_type::NORMAL, token_type::CONTROL, token_type::CONTROL], PieceStyle::ByteLevel, &[]);
        let f = SpecialFinder::new(&v);
        let text = "<s>a<|x|>b<|x|>";
        let all = partition(&v, &f, text, true, &[]);
        assert_eq!(all, [Fragment::Token(1), Fragment::Text(3, 4), Fragment::Token(2), Fragment::Text(9, 10), Fragment::Token(2)]);
        // The first <|x|> (bytes 4..9) is content: it stays inside the text fragment.
        let kept = partition(&v, &f, text, true, &[(4, 9)]);
        assert_eq!(kept, [Fragment::Token(1), Fragment::Text(3, 10), Fragment::Token(2)]);
        assert!(overlaps(&[(4, 9)], 8, 12) && !overlaps(&[(4, 9)], 9, 12) && !overlaps(&[(4, 9)], 0, 4));
    }
}
