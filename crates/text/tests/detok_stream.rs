//! The incremental decoder on real tokenizers: fed token by token it never yields a broken
//! character, holds partial ones back, and adds up to the one-shot decode.

mod common;

use common::{model, GEMMA3, QWEN25, SMOLLM2};
use ferrolm_text::{IncrementalDecoder, Tokenizer};

const TEXTS: &[&str] = &[
    "👨‍👩‍👧‍👦 family 🏳️‍🌈 flag 👩🏽‍💻 coder 🦀🔥",
    "你好，世界！日本語のテキスト。한국어 텍스트입니다.",
    "ℌ𝔢𝔩𝔩𝔬 𝟙𝟚𝟛 e\u{301} naïve — “quotes”",
    "<|im_start|>user\nHi 😀<|im_end|>",
];

fn stream(tk: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut dec = IncrementalDecoder::new(skip_special);
    let mut chunks: Vec<String> = ids.iter().map(|&id| dec.push(tk, id)).collect();
    chunks.push(dec.finish());
    let joined = chunks.concat();
    (chunks, joined)
}

fn check(file: &str) {
    let Some(path) = model(file) else { return };
    let tk = Tokenizer::from_gguf_file(&path).expect("load tokenizer");
    let mut held_back = 0;
    for text in TEXTS {
        let ids = tk.encode(text, false).unwrap();
        let (chunks, joined) = stream(&tk, &ids, false);
        assert_eq!(joined, *text, "{file}: streamed text differs");
        assert!(
            chunks.iter().all(|c| !c.contains('\u{FFFD}')),
            "{file}: replacement char in {chunks:?}"
        );
        // A token that ends inside a character must produce an empty chunk, never half of it.
        held_back += ids
            .iter()
            .zip(&chunks)
            .filter(|(&id, c)| c.is_empty() && !tk.token_bytes(id).is_empty())
            .count();
        let (_, skipped) = stream(&tk, &ids, true);
        assert_eq!(
            skipped,
            tk.decode(&ids, true),
            "{file}: skip_special stream differs from decode"
        );
    }
    // Emoji and CJK split across tokens in all three vocabularies, so something was held back.
    assert!(held_back > 0, "{file}: no token ever ended mid-character");
}

#[test]
fn smollm2_stream_never_breaks_characters() {
    check(SMOLLM2);
}

#[test]
fn gemma3_stream_never_breaks_characters() {
    check(GEMMA3);
}

#[test]
fn qwen25_stream_never_breaks_characters() {
    check(QWEN25);
}

/// Ids that form invalid UTF-8 (a lone continuation byte token) give exactly one U+FFFD.
#[test]
fn invalid_bytes_become_replacement_once() {
    let Some(path) = model(GEMMA3) else { return };
    let tk = Tokenizer::from_gguf_file(&path).unwrap();
    let lone = tk.token_to_id("<0x80>").expect("byte token");
    let lead = tk.token_to_id("<0xE2>").expect("byte token");
    let a = tk.token_to_id("a").expect("a");
    let mut dec = IncrementalDecoder::new(false);
    assert_eq!(dec.push(&tk, lone), "\u{FFFD}");
    assert_eq!(dec.push(&tk, lead), "");
    assert_eq!(dec.push(&tk, a), "\u{FFFD}a");
    assert_eq!(dec.push(&tk, lead), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}
