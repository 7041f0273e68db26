//! `TokenizerSpec`: a tokenizer described the way GGUF metadata describes it (`tokenizer.ggml.*`).

use serde::{Deserialize, Serialize};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Everything needed to build a [`crate::Tokenizer`]. Defaults that llama.cpp applies when a key is
/// missing are already resolved by [`TokenizerSpec::from_gguf_metadata`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: names the pre-tokenizer regexes (gpt2 only).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// One entry per token (see [`token_type`]); empty means every token is normal.
    pub token_types: Vec<i32>,
    /// SentencePiece merge priorities; empty means all zero.
    pub scores: Vec<f32>,
    /// BPE merges, "left right", in rank order.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// End-of-turn token when the file names one (`tokenizer.ggml.eot_token_id`).
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// SentencePiece: prepend a space to text that starts the input or follows a special token.
    pub add_space_prefix: bool,
    pub chat_template: Option<String>,
}

impl TokenizerSpec {
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The GGUF token type of `id` (normal when the file has no types).
    pub fn token_type(&self, id: usize) -> i32 {
        self.token_types
            .get(id)
            .copied()
            .unwrap_or(token_type::NORMAL)
    }

    pub fn score(&self, id: usize) -> f32 {
        self.scores.get(id).copied().unwrap_or(0.0)
    }

    /// The text of a token id, when it exists.
    pub fn token_text(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|i| self.tokens.get(i as usize))
            .map(String::as_str)
    }
}
