//! Chunked tokenization (`bounded.rs`) against whole-fragment tokenization on the test models'
//! tokenizers, and the length guard. Models missing from the cache skip with a notice.

use super::*;

fn model(file: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("FERROLM_MODELS").map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ferrolm/models")
    });
    let path = dir.join(file);
    path.exists().then_some(path).or_else(|| {
        eprintln!("SKIP: {file} not found (scripts/get_model.py)");
        None
    })
}

/// Prose, code, numbers, whitespace runs, accents, CJK and emoji, repeated past many chunks.
fn long_text() -> String {
    let parts = [
        "The quick brown fox jumps over the lazy dog. It's 2024, and naïve café owners say \"hello\"!\n",
        "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{:?}\", x);  // comment\n}\n\n",
        "Numbers 1234567 and 3.14159 and 0xDEADBEEF; tabs\tand   three spaces   here.\n",
        "你好，世界。日本語のテキスト。 emoji 🚀✨ and mixed: a-b_c/d\\e.\r\n",
        "Words words words more prose to give the chunker places to cut between letters ",
    ];
    let mut s = String::new();
    let mut i = 0;
    while s.len() < 60_000 {
        s.push_str(parts[i % parts.len()]);
        i += 7;
    }
    s
}

#[test]
fn chunked_equals_whole_on_every_gguf_tokenizer() {
    for file in ["SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf", "gemma-3-270m-Q4_K_M.gguf"] {
        let Some(path) = model(file) else { continue };
        let chunked = Tokenizer::from_gguf_file(&path).unwrap();
        let mut whole = Tokenizer::from_gguf_file(&path).unwrap();
        assert!(chunked.chunkable, "{file}: expected chunking to be safe");
        whole.chunkable = false;
        let text = long_text();
        assert!(bounded::chunks(&text, true).count() > 5, "the text spans several chunks");
        let a = chunked.encode(&text, true).unwrap();
        let b = whole.encode(&text, true).unwrap();
        assert_eq!(a, b, "{file}");
        assert_eq!(chunked.decode(&a, true).trim_start(), text.trim_start(), "{file}");
    }
}

#[test]
fn limits_stop_early_and_refuse_from_length() {
    let Some(path) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let t = Tokenizer::from_gguf_file(&path).unwrap();
    let text = long_text();
    let n = t.encode(&text, false).unwrap().len();
    assert_eq!(t.encode_limited(&text, false, n).unwrap().len(), n);
    match t.encode_limited(&text, false, 100) {
        // Stopped after the first chunk that passed the limit, not at the end of the text.
        Err(EncodeError::TooLong { limit: 100, at_least }) => assert!(at_least > 100 && at_least < 2_000, "{at_least}"),
        other => panic!("{other:?}"),
    }
    // 10 MB could never be 1,000 tokens: refused from the length, before any tokenizing.
    let huge = "a".repeat(10 << 20);
    let started = std::time::Instant::now();
    assert!(matches!(t.encode_limited(&huge, false, 1_000), Err(EncodeError::TooLong { .. })));
    assert!(started.elapsed().as_millis() < 50);
}
