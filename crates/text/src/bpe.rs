//! Byte-level BPE ("gpt2" in GGUF) on the Hugging Face `tokenizers` crate: the pre-tokenizer
//! regexes llama.cpp uses for the file's `pre`, GPT-2 byte encoding, then BPE merges. Special
//! tokens are cut out before this runs (see `special.rs`), so the pipeline has no added tokens.

use std::collections::HashMap;

use anyhow::{anyhow, Result};
use tokenizers::models::bpe::{Vocab as BpeVocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::pretok;
use crate::spec::TokenizerSpec;

pub(crate) struct BpeModel {
    inner: tokenizers::Tokenizer,
}

impl BpeModel {
    pub fn new(spec: &TokenizerSpec, ids: &HashMap<String, u32>) -> Result<Self> {
        let pre = pretok::for_pre(spec.pre.as_deref())?;
        let vocab: BpeVocab = ids.iter().map(|(t, &i)| (t.clone(), i)).collect();
        let merges = parse_merges(&spec.merges, ids);
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre.ignore_merges)
            .build()
            .map_err(|e| anyhow!("building BPE model: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer(&pre.regexes)?));
        // Not used for our decoding (vocab.rs has the bytes), but makes a saved tokenizer.json whole.
        inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
        Ok(BpeModel { inner })
    }

    /// Tokenizes one fragment of plain text (no special tokens inside).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("BPE tokenization failed: {e}"))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The underlying Hugging Face tokenizer (e.g. to save it as tokenizer.json).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// One `Split` per regex (each splits the pieces of the previous one), then byte encoding.
fn pre_tokenizer(regexes: &[&str]) -> Result<PreTokenizerWrapper> {
    let mut steps = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("bad pre-tokenizer regex {re:?}: {e}"))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
        false, false, false,
    )));
    Ok(PreTokenizerWrapper::Sequence(Sequence::new(steps)))
}

/// GGUF merges are "left right" strings in rank order. llama.cpp splits at the first space after
/// the first byte and keeps the first rank of a repeated pair. Merges naming a piece that is not
/// in the vocabulary cannot produce a token, and the `tokenizers` builder rejects them: dropped.
fn parse_merges(merges: &[String], ids: &HashMap<String, u32>) -> Vec<(String, String)> {
    let mut seen = std::collections::HashSet::with_capacity(merges.len());
    let mut out = Vec::with_capacity(merges.len());
    for m in merges {
        let Some(pos) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        let joined = format!("{a}{b}");
        if !ids.contains_key(a) || !ids.contains_key(b) || !ids.contains_key(&joined) {
            continue;
        }
        if seen.insert((a.to_string(), b.to_string())) {
            out.push((a.to_string(), b.to_string()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// Pieces (byte-level encoded) that the pre-tokenizer for `pre` makes of `text`.
    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let pt = pre_tokenizer(&pretok::for_pre(Some(pre)).unwrap().regexes).unwrap();
        let mut s = PreTokenizedString::from(text);
        pt.pre_tokenize(&mut s).unwrap();
        let splits = s.get_splits(OffsetReferential::Original, OffsetType::Byte);
        splits.into_iter().map(|(p, _, _)| p.to_string()).collect()
    }

    /// Expected splits worked out by hand from llama.cpp's custom gpt2/llama3 splitters.
    #[test]
    fn splits_follow_llama_cpp() {
        let text = "Hello  world's 1234\n\n  x";
        assert_eq!(
            pieces("llama-bpe", text),
            ["Hello", "Ġ", "Ġworld", "'s", "Ġ", "123", "4", "ĊĊ", "Ġ", "Ġx"]
        );
        assert_eq!(
            pieces("gpt-2", text),
            ["Hello", "Ġ", "Ġworld", "'s", "Ġ1234", "ĊĊĠ", "Ġx"]
        );
        assert_eq!(
            pieces("smollm", "ab 1234  x\n"),
            ["ab", "Ġ", "1", "2", "3", "4", "Ġ", "Ġx", "Ċ"]
        );
        assert_eq!(
            pieces("qwen2", "ab 1234  x\n"),
            ["ab", "Ġ", "1", "2", "3", "4", "Ġ", "Ġx", "Ċ"]
        );
        assert_eq!(
            pieces("default", "a+b=12345!"),
            ["a", "+", "b", "=", "123", "45", "!"]
        );
    }

    #[test]
    fn every_supported_pre_compiles() {
        for pre in [
            "default", "llama3", "dbrx", "gpt-2", "smollm", "qwen2", "qwen35", "tekken", "gpt-4o",
        ] {
            assert!(
                !pieces(pre, "It's 2024: naïve café — 你好!\n").is_empty(),
                "{pre}"
            );
        }
    }
}
