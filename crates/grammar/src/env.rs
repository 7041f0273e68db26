//! The model's tokens as llguidance sees them: a token trie whose words are the exact bytes of
//! each token (`Tokenizer::token_bytes`, what the detokenizer emits), as wide as the model's
//! logits, and a tokenizer callback that is ferrolm's own encoder, so the tokens llguidance
//! forces are the ones the model's tokenizer would produce for that text.

use std::sync::Arc;

use ferrolm_text::Tokenizer;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::GrammarError;

/// A [`TokenizerEnv`] over ferrolm's tokenizer.
struct ModelTokens {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
    /// Whether `tokenize_bytes` gives the model's own tokenization (checked at build time);
    /// llguidance only forces tokens (jump-forward) for canonical tokenizers.
    canonical: bool,
}

/// Builds the token environment: `width` words (the logits' width; ids past the tokenizer's
/// vocabulary get no bytes, so no grammar ever allows them), control tokens behind toktrie's
/// special-token marker so text can never spell them, `eos_ids` as the tokens that end a
/// grammar.
pub(crate) fn token_env(tokenizer: Arc<Tokenizer>, eos_ids: &[u32], width: usize) -> Result<TokEnv, GrammarError> {
    let vocab = tokenizer.vocab_size();
    if width < vocab {
        return Err(GrammarError::Tokenizer(format!(
            "the logits have {width} entries, fewer than the tokenizer's {vocab} tokens"
        )));
    }
    let eos: Vec<u32> = eos_ids.iter().copied().filter(|&id| (id as usize) < width).collect();
    let Some(&first_eos) = eos.first() else {
        return Err(GrammarError::Tokenizer(
            "the model has no end-of-sequence token: a grammar could never end".into(),
        ));
    };
    let words: Vec<Vec<u8>> = (0..width as u32).map(|id| word(&tokenizer, id, &eos)).collect();
    let info = TokRxInfo {
        vocab_size: width as u32,
        tok_eos: first_eos,
        tok_bos: tokenizer.bos_id(),
        tok_pad: None,
        tok_unk: None,
        tok_end_of_turn: None,
    };
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    let mut env = ModelTokens { tokenizer, trie, canonical: false };
    env.canonical = env.round_trips();
    Ok(Arc::new(env))
}

/// A token's trie word. Control and unknown tokens (and EOS) are `0xFF` + their text, as
/// toktrie expects of special tokens: 0xFF never occurs in UTF-8, so grammar text cannot match
/// them, while Lark grammars can still name them (`<|im_end|>`). Unused tokens have no bytes.
fn word(tokenizer: &Tokenizer, id: u32, eos: &[u32]) -> Vec<u8> {
    let bytes = tokenizer.token_bytes(id);
    let special = tokenizer.is_special(id) || eos.contains(&id);
    if special && !bytes.is_empty() {
        let mut w = Vec::with_capacity(bytes.len() + 1);
        w.push(TokTrie::SPECIAL_TOKEN_MARKER);
        w.extend_from_slice(bytes);
        w
    } else {
        bytes.to_vec()
    }
}

impl ModelTokens {
    /// The model's tokenization of `s`, when its tokens spell exactly `s`.
    fn encode_exact(&self, s: &[u8]) -> Option<Vec<TokenId>> {
        let text = std::str::from_utf8(s).ok()?;
        // Added tokens match, as in the model's own encoding: Qwen's `<tool_call>` is one token.
        // Control-token text is text in a grammar: a control token found here spells its
        // trie word (0xFF + text), not the text, so the check below sends it to the fallback.
        let ids = self.tokenizer.encode_with(text, false, true).ok()?;
        let spelled: Vec<u8> = ids.iter().flat_map(|&t| self.trie.token(t).iter().copied()).collect();
        (spelled == s).then_some(ids)
    }

    /// Whether the encoder spells its input back on typical grammar text (a SentencePiece
    /// tokenizer that adds a leading space, for one, does not: then no tokens are forced).
    fn round_trips(&self) -> bool {
        const PROBES: &[&str] =
            &["{\"name\": \"", "\", \"arguments\": {", "}\n</tool_call>", "a b  c\n\t1.5e-3", "Zürich 東京"];
        PROBES.iter().all(|p| self.encode_exact(p.as_bytes()).is_some())
    }
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Bytes llguidance wants as tokens (forced text). Text that is not whole UTF-8, or that
    /// the encoder does not spell back exactly, is tokenized greedily over the trie instead: a
    /// valid spelling, if not the model's own.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let valid = match std::str::from_utf8(s) {
            Ok(_) => s.len(),
            Err(e) => e.valid_up_to(),
        };
        match self.encode_exact(&s[..valid]) {
            Some(mut ids) => {
                ids.extend(self.trie.greedy_tokenize(&s[valid..]));
                ids
            }
            None => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}
