//! `Tokenizer`: text <-> token ids for one model, built from GGUF metadata or a Hugging Face
//! `tokenizer.json`. Encoding follows llama.cpp (`llama_vocab::impl::tokenize` with
//! `parse_special = true`) for GGUF models; decoding is the concatenation of each token's exact
//! bytes (llama.cpp `token_to_piece`), so streaming and one-shot decoding agree.

use std::borrow::Cow;
use std::path::Path;
use std::sync::OnceLock;

use anyhow::{Context, Result};

use crate::bounded::{self, EncodeError, Sink};
use crate::bpe::BpeModel;
use crate::plain::{self, Controls};
use crate::spec::TokenizerSpec;
use crate::special::{partition, Fragment, SpecialFinder};
use crate::vocab::{attr, PieceStyle, Vocab};
use crate::{hf, spm};

enum Model {
    /// GGUF "gpt2": byte-level BPE on the `tokenizers` crate.
    Bpe(Box<BpeModel>),
    /// GGUF "llama": SentencePiece with scores (llama.cpp's algorithm, see `spm.rs`).
    Spm { scores: Vec<f32> },
    /// A Hugging Face tokenizer.json, used as is (its own added-token matching and BOS rule).
    Hf(Box<tokenizers::Tokenizer>),
}

pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    chat_template: Option<String>,
    /// Bytes of text the longest token covers: a text of n bytes needs at least n / max_piece
    /// tokens (the length check of bounded tokenization).
    max_piece: usize,
    /// Whether plain text may be tokenized in chunks (see `bounded.rs`).
    chunkable: bool,
    finder: SpecialFinder,
    controls: Controls,
    /// tokenizer.json models: a copy that reads special-token text as text, for spans that must
    /// stay text (made on first use).
    hf_plain: OnceLock<Box<tokenizers::Tokenizer>>,
}

impl Tokenizer {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self> {
        let style = if spec.model == "llama" {
            PieceStyle::SentencePiece
        } else {
            PieceStyle::ByteLevel
        };
        let vocab = Vocab::new(
            spec.tokens.clone(),
            &spec.token_types,
            style,
            &[spec.eos_id, spec.eot_id, spec.eom_id],
        );
        let model = match spec.model.as_str() {
            "gpt2" => Model::Bpe(Box::new(BpeModel::new(spec, &vocab.ids)?)),
            "llama" => Model::Spm {
                scores: spec.scores.clone(),
            },
            other => {
                anyhow::bail!("unsupported tokenizer model {other:?} (supported: gpt2, llama)")
            }
        };
        let chunkable = match &model {
            Model::Bpe(_) => true,
            _ => !has_letter_space_piece(&vocab),
        };
        Ok(Tokenizer {
            max_piece: max_piece(&vocab),
            chunkable,
            finder: SpecialFinder::new(&vocab),
            controls: Controls::new(&vocab),
            hf_plain: OnceLock::new(),
            vocab,
            model,
            bos: spec.bos_id,
            eos: spec.eos_id,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            // Byte-level BPE never adds a space prefix (llama.cpp forces it off).
            add_space_prefix: spec.add_space_prefix && style == PieceStyle::SentencePiece,
            chat_template: spec.chat_template.clone(),
        })
    }

    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_spec(&TokenizerSpec::from_gguf_file(path)?)
    }

    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` / `chat_template.jinja`
    /// (optional) from a model folder.
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let files = hf::HfFiles::load(dir.as_ref())?;
        let eos_extra = [files.eos_id()];
        let vocab = Vocab::new(
            files.texts(),
            &files.token_types(),
            files.style(),
            &eos_extra,
        );
        Ok(Tokenizer {
            bos: files.bos_id(),
            eos: files.eos_id(),
            add_bos: files.add_bos(),
            add_eos: false,
            add_space_prefix: false,
            chat_template: files.chat_template.clone(),
            max_piece: max_piece(&vocab),
            // A tokenizer.json pipeline may prepend to every input (Metaspace, Prepend): whole.
            chunkable: false,
            finder: SpecialFinder::new(&vocab),
            controls: Controls::new(&vocab),
            hf_plain: OnceLock::new(),
            vocab,
            model: Model::Hf(Box::new(files.tokenizer)),
        })
    }

    /// Text to ids. Special-token text in `text` (e.g. `<|im_start|>`) becomes that token;
    /// `add_special` applies the model's BOS/EOS rule.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Like [`Tokenizer::encode`]; with `parse_special = false` control-token text is tokenized
    /// as plain text (user-defined tokens still match, as in llama.cpp).
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>> {
        self.encode_spans(text, &[], add_special, parse_special, usize::MAX)
            .map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// [`Tokenizer::encode`] that gives up once the text is longer than `limit` tokens (or is
    /// provably so from its length), having done work in proportion to `limit`.
    pub fn encode_limited(&self, text: &str, add_special: bool, limit: usize) -> Result<Vec<u32>, EncodeError> {
        self.encode_spans(text, &[], add_special, true, limit)
    }

    /// Content (a user message, a tool result, a document) to place into a chat template: its
    /// control-token texts are hidden from the template and from special-token matching, and
    /// [`Tokenizer::encode_prompt`] tokenizes them as plain text. Borrowed when there are none.
    pub fn protect<'a>(&self, content: &'a str) -> Cow<'a, str> {
        plain::protect(&self.controls, content)
    }

    /// A rendered chat prompt to ids, bounded like [`Tokenizer::encode_limited`]: the
    /// template's own special-token text becomes control tokens, text that came from
    /// [`Tokenizer::protect`]ed content never does.
    pub fn encode_prompt(&self, rendered: &str, add_special: bool, limit: usize) -> Result<Vec<u32>, EncodeError> {
        let (text, plain) = plain::restore(&self.vocab, rendered);
        self.encode_spans(&text, &plain, add_special, true, limit)
    }

    /// The one encoder: `plain` ranges are never cut out as special tokens.
    fn encode_spans(
        &self,
        text: &str,
        plain: &[(usize, usize)],
        add_special: bool,
        parse_special: bool,
        limit: usize,
    ) -> Result<Vec<u32>, EncodeError> {
        bounded::precheck(text.len(), self.max_piece, limit)?;
        if let Model::Hf(tk) = &self.model {
            if plain.is_empty() && parse_special {
                // Hugging Face's own added-token matching, as before; counted once whole.
                let enc = tk.encode_fast(text, add_special).map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
                let mut sink = Sink::new(limit);
                sink.out = enc.get_ids().to_vec();
                sink.check()?;
                return Ok(sink.out);
            }
        }
        let mut sink = Sink::new(limit);
        if add_special && self.add_bos {
            if let Some(bos) = self.bos {
                sink.push(bos)?;
            }
        }
        self.encode_fragments(text, parse_special, plain, &mut sink)?;
        if add_special && self.add_eos {
            if let Some(eos) = self.eos {
                sink.push(eos)?;
            }
        }
        Ok(sink.out)
    }

    fn encode_fragments(
        &self,
        text: &str,
        parse_special: bool,
        plain: &[(usize, usize)],
        sink: &mut Sink,
    ) -> Result<(), EncodeError> {
        // SentencePiece adds its space prefix at the start and after every special token.
        let mut after_special = true;
        for frag in partition(&self.vocab, &self.finder, text, parse_special, plain) {
            match frag {
                Fragment::Token(id) => {
                    sink.push(id)?;
                    after_special = true;
                }
                Fragment::Text(a, b) => {
                    for (c, d) in bounded::chunks(&text[a..b], self.chunkable) {
                        self.encode_text(&text[a + c..a + d], after_special, &mut sink.out)?;
                        after_special = false;
                        sink.check()?;
                    }
                }
            }
        }
        Ok(())
    }

    fn encode_text(&self, text: &str, after_special: bool, out: &mut Vec<u32>) -> Result<()> {
        match &self.model {
            Model::Bpe(bpe) => bpe.encode_into(text, out),
            Model::Spm { scores } => {
                let prefix = if self.add_space_prefix && after_special {
                    " "
                } else {
                    ""
                };
                let escaped = format!("{prefix}{text}").replace(' ', "▁");
                spm::encode_into(&self.vocab, scores, &escaped, out)
            }
            // Fragments between special tokens, as Hugging Face cuts them itself; special-token
            // text inside is plain text here (only `encode_spans`' own cuts make tokens).
            Model::Hf(tk) => {
                let plain = self.hf_plain.get_or_init(|| {
                    let mut copy = tk.clone();
                    copy.set_encode_special_tokens(true);
                    copy
                });
                let enc = plain
                    .encode_fast(text, false)
                    .map_err(|e| anyhow::anyhow!("tokenization failed: {e}"))?;
                out.extend_from_slice(enc.get_ids());
                Ok(())
            }
        }
    }

    /// Ids to text: each token's bytes, joined; bytes that are not UTF-8 become U+FFFD.
    /// `skip_special` drops control and unknown tokens (BOS, `<|im_end|>`…).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.piece(id, skip_special));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Exact bytes of a token: byte-level decoded (gpt2), `▁` -> space and `<0xXX>` -> byte
    /// (SentencePiece), the token text for control tokens. Empty for an unknown id.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.vocab.piece(id)
    }

    /// [`Tokenizer::token_bytes`], but empty for special tokens when `skip_special` is set.
    pub fn piece(&self, id: u32, skip_special: bool) -> &[u8] {
        if skip_special && self.is_special(id) {
            return &[];
        }
        self.vocab.piece(id)
    }

    /// Control or unknown tokens: what `decode(.., skip_special = true)` leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        self.vocab.has(id, attr::CONTROL | attr::UNKNOWN)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Every end-of-generation token (EOS, end-of-turn, `<|endoftext|>`…), as llama.cpp's EOG set.
    pub fn eos_ids(&self) -> &[u32] {
        &self.vocab.eog
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.vocab.ids.get(token).copied()
    }

    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The model's Jinja chat template source, when it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The BOS token's text, e.g. `<bos>`, for templates.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.and_then(|id| self.id_to_token(id))
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos.and_then(|id| self.id_to_token(id))
    }

    /// The Hugging Face tokenizer behind a gpt2 or tokenizer.json model (None for SentencePiece).
    pub fn hf_tokenizer(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.model {
            Model::Bpe(b) => Some(b.hf()),
            Model::Hf(t) => Some(t),
            Model::Spm { .. } => None,
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.model {
            Model::Bpe(_) => "bpe",
            Model::Spm { .. } => "spm",
            Model::Hf(_) => "hf",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids())
            .finish()
    }
}

/// The most bytes of text one token stands for (at least 4: an unknown character's token
/// covers up to 4 bytes).
fn max_piece(vocab: &Vocab) -> usize {
    (0..vocab.len() as u32).map(|id| vocab.piece(id).len()).max().unwrap_or(0).max(4)
}

/// Whether a piece holds an ASCII letter followed by a space: a SentencePiece merge could then
/// cross a chunk cut, so such a vocabulary is tokenized whole.
fn has_letter_space_piece(vocab: &Vocab) -> bool {
    (0..vocab.len() as u32).any(|id| vocab.piece(id).windows(2).any(|w| w[0].is_ascii_alphabetic() && w[1] == b' '))
}

/// Context for errors about a file path.
pub(crate) fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
