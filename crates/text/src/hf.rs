//! Loading a Hugging Face model folder: `tokenizer.json`, plus `tokenizer_config.json` (BOS/EOS
//! names, chat template) and `chat_template.jinja` when present.

use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::Value;

use crate::spec::token_type;
use crate::tokenizer::read_to_string;
use crate::vocab::{parse_byte_token, PieceStyle};

pub(crate) struct HfFiles {
    pub tokenizer: tokenizers::Tokenizer,
    pub config: Value,
    pub chat_template: Option<String>,
}

impl HfFiles {
    pub fn load(dir: &Path) -> Result<Self> {
        let tk_path = dir.join("tokenizer.json");
        let mut tokenizer = tokenizers::Tokenizer::from_file(&tk_path)
            .map_err(|e| anyhow!("loading {}: {e}", tk_path.display()))?;
        // Some tokenizer.json files carry truncation and padding settings (all-MiniLM-L6-v2:
        // cut at 128, pad to 128 with [PAD]); transformers and sentence-transformers set their
        // own per call. ferrolm encodes whole prompts and checks lengths itself: never cut or pad.
        tokenizer
            .with_truncation(None)
            .map_err(|e| anyhow!("{}: {e}", tk_path.display()))?
            .with_padding(None);
        let cfg_path = dir.join("tokenizer_config.json");
        let config: Value = if cfg_path.exists() {
            serde_json::from_str(&read_to_string(&cfg_path)?)
                .map_err(|e| anyhow!("parsing {}: {e}", cfg_path.display()))?
        } else {
            Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.exists() {
            Some(read_to_string(&jinja)?)
        } else {
            template_from_config(&config)
        };
        Ok(HfFiles {
            tokenizer,
            config,
            chat_template,
        })
    }

    /// Token texts by id, added tokens included; ids nobody uses get a placeholder.
    pub fn texts(&self) -> Vec<String> {
        let vocab = self.tokenizer.get_vocab(true);
        let n = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let mut texts: Vec<String> = (0..n).map(|i| format!("[EMPTY_{i}]")).collect();
        for (text, id) in vocab {
            texts[id as usize] = text;
        }
        texts
    }

    /// GGUF-style token types: special added tokens are control, other added tokens
    /// user-defined, `<0xXX>` pieces of a SentencePiece-style vocabulary are bytes.
    pub fn token_types(&self) -> Vec<i32> {
        let texts = self.texts();
        let sp = self.style() == PieceStyle::SentencePiece;
        let mut types: Vec<i32> = texts
            .iter()
            .map(|t| {
                if sp && parse_byte_token(t).is_some() {
                    token_type::BYTE
                } else {
                    token_type::NORMAL
                }
            })
            .collect();
        for (id, tok) in self.tokenizer.get_added_tokens_decoder() {
            if let Some(ty) = types.get_mut(id as usize) {
                *ty = if tok.special {
                    token_type::CONTROL
                } else {
                    token_type::USER_DEFINED
                };
            }
        }
        types
    }

    /// Byte-level when the decoder is (or contains) a ByteLevel decoder.
    pub fn style(&self) -> PieceStyle {
        let decoder = serde_json::to_string(&self.tokenizer.get_decoder()).unwrap_or_default();
        if decoder.contains("ByteLevel") {
            PieceStyle::ByteLevel
        } else {
            PieceStyle::SentencePiece
        }
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.special_id("bos_token")
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.special_id("eos_token")
    }

    /// Whether the tokenizer's own post-processor prepends BOS: asked of the tokenizer itself,
    /// since `add_bos_token` in the config does not always match what tokenizer.json does.
    pub fn add_bos(&self) -> bool {
        let Some(bos) = self.bos_id() else {
            return false;
        };
        let enc = self.tokenizer.encode_fast("", true);
        enc.is_ok_and(|e| e.get_ids().first() == Some(&bos))
    }

    /// `"bos_token": "<s>"` or `"bos_token": {"content": "<s>", ...}`.
    fn special_id(&self, key: &str) -> Option<u32> {
        let v = self.config.get(key)?;
        let text = v
            .as_str()
            .or_else(|| v.get("content").and_then(Value::as_str))?;
        self.tokenizer.token_to_id(text)
    }
}

/// `chat_template` is a string, or a list of `{name, template}` where "default" is the one used.
fn template_from_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}
