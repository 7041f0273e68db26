//! Token table shared by every tokenizer kind: texts, attributes, the exact bytes of each token,
//! end-of-generation ids and the special tokens matched in input text. The attribute rules follow
//! llama.cpp's `llama_vocab::impl::load`, so `is_special`, `eos_ids` and `token_bytes` agree
//! with what llama.cpp does for the same GGUF.

use std::collections::HashMap;

use crate::spec::token_type;

/// llama.cpp `llama_token_attr` subset (bit flags).
pub(crate) mod attr {
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;
}

/// Token texts llama.cpp treats as end of generation (and forces to control type).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// FIM pad / repo / file-separator tokens: llama.cpp marks them control and end-of-generation.
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Other FIM tokens: llama.cpp forces them to control type (so they are matched in text).
const FIM_CONTROL_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];

/// How a normal token's text maps to bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceStyle {
    /// GPT-2 byte-level: every char stands for one byte.
    ByteLevel,
    /// SentencePiece: `▁` is a space, `<0xXX>` byte tokens are raw bytes.
    SentencePiece,
}

pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub attrs: Vec<u8>,
    pub ids: HashMap<String, u32>,
    /// All token bytes back to back; token i is `bytes[offsets[i]..offsets[i + 1]]`.
    bytes: Vec<u8>,
    offsets: Vec<usize>,
    /// Ids matched as whole tokens in input text, longest text first (llama.cpp order).
    pub specials: Vec<u32>,
    pub eog: Vec<u32>,
}

impl Vocab {
    /// `extra_eog` holds the eos/eot/eom ids named by the model file.
    pub fn new(
        texts: Vec<String>,
        types: &[i32],
        style: PieceStyle,
        extra_eog: &[Option<u32>],
    ) -> Self {
        let mut ids = HashMap::with_capacity(texts.len());
        for (i, t) in texts.iter().enumerate() {
            // First id wins on duplicates, like a lookup that stops at the first hit.
            ids.entry(t.clone()).or_insert(i as u32);
        }
        let mut attrs: Vec<u8> = (0..texts.len())
            .map(|i| attr_of(types.get(i).copied()))
            .collect();
        let eog = mark_eog(&ids, &mut attrs, extra_eog);
        let (bytes, offsets) = build_pieces(&texts, &attrs, style);
        let specials = special_order(&texts, &attrs);
        Vocab {
            texts,
            attrs,
            ids,
            bytes,
            offsets,
            specials,
            eog,
        }
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn has(&self, id: u32, flags: u8) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & flags != 0)
    }

    /// The token's bytes as llama.cpp's `token_to_piece(special = true)` gives them.
    pub fn piece(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a..b],
            _ => &[],
        }
    }
}

fn attr_of(ty: Option<i32>) -> u8 {
    match ty.unwrap_or(token_type::NORMAL) {
        token_type::NORMAL => attr::NORMAL,
        token_type::UNKNOWN => attr::UNKNOWN,
        token_type::CONTROL => attr::CONTROL,
        token_type::USER_DEFINED => attr::USER_DEFINED,
        token_type::UNUSED => attr::UNUSED,
        token_type::BYTE => attr::BYTE,
        _ => 0,
    }
}

/// Collects end-of-generation ids and forces control type on tokens that look like control
/// tokens, as llama.cpp does (some converters mark `<|im_end|>` and FIM tokens as normal).
fn mark_eog(ids: &HashMap<String, u32>, attrs: &mut [u8], extra: &[Option<u32>]) -> Vec<u32> {
    let mut eog: Vec<u32> = Vec::new();
    let mut force_control = |id: u32| attrs[id as usize] |= attr::CONTROL;
    for group in FIM_EOG_TEXTS {
        // llama.cpp takes one token per FIM role.
        if let Some(&id) = group.iter().find_map(|t| ids.get(*t)) {
            force_control(id);
            eog.push(id);
        }
    }
    for t in FIM_CONTROL_TEXTS {
        if let Some(&id) = ids.get(*t) {
            force_control(id);
        }
    }
    for t in EOG_TEXTS {
        if let Some(&id) = ids.get(*t) {
            force_control(id);
            eog.push(id);
        }
    }
    eog.extend(
        extra
            .iter()
            .flatten()
            .copied()
            .filter(|&id| (id as usize) < attrs.len()),
    );
    eog.sort_unstable();
    eog.dedup();
    eog
}

fn build_pieces(texts: &[String], attrs: &[u8], style: PieceStyle) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::with_capacity(texts.iter().map(String::len).sum());
    let mut offsets = Vec::with_capacity(texts.len() + 1);
    offsets.push(0);
    for (text, &a) in texts.iter().zip(attrs) {
        append_piece(&mut bytes, text, a, style);
        offsets.push(bytes.len());
    }
    (bytes, offsets)
}

/// llama.cpp `token_to_piece` for one token: control, unknown and user-defined tokens are
/// their text; normal tokens are decoded; byte tokens are one byte; anything else is empty.
fn append_piece(out: &mut Vec<u8>, text: &str, a: u8, style: PieceStyle) {
    if a & (attr::CONTROL | attr::UNKNOWN | attr::USER_DEFINED) != 0 {
        out.extend_from_slice(text.as_bytes());
    } else if a & attr::NORMAL != 0 {
        match style {
            PieceStyle::ByteLevel => crate::bytelevel::decode_into(text, out),
            PieceStyle::SentencePiece => out.extend_from_slice(text.replace('▁', " ").as_bytes()),
        }
    } else if a & attr::BYTE != 0 {
        match parse_byte_token(text) {
            Some(b) => out.push(b),
            // A byte-typed token that is not <0xXX>: a byte-level vocab names the byte itself.
            None => crate::bytelevel::decode_into(text, out),
        }
    }
}

/// `<0xAB>` -> 0xAB.
pub(crate) fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Tokens matched in input text before the model runs: control, user-defined and unknown,
/// longest text first so a longer token wins over a shorter one it contains.
fn special_order(texts: &[String], attrs: &[u8]) -> Vec<u32> {
    let flags = attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN;
    let mut ids: Vec<u32> = (0..texts.len() as u32)
        .filter(|&i| attrs[i as usize] & flags != 0)
        .collect();
    ids.sort_by(|&a, &b| {
        texts[b as usize]
            .len()
            .cmp(&texts[a as usize].len())
            .then(a.cmp(&b))
    });
    ids
}
