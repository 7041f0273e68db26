//! Small hand-made vocabularies that pin down llama.cpp rules which the model fixtures may not
//! exercise: SentencePiece tie-breaking, byte fallback, space prefix after special tokens,
//! special-token order, and GGUF metadata errors and defaults.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as G;
use ferrolm_text::{token_type, Tokenizer, TokenizerSpec};

/// <unk> <s> </s>, 256 byte tokens, then the given (piece, score, type) entries.
fn spm_spec(pieces: &[(&str, f32, i32)]) -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![
        token_type::UNKNOWN,
        token_type::CONTROL,
        token_type::CONTROL,
    ];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(token_type::BYTE);
        scores.push(0.0);
    }
    for (p, s, t) in pieces {
        tokens.push(p.to_string());
        scores.push(*s);
        types.push(*t);
    }
    TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types: types,
        scores,
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_bos: true,
        add_space_prefix: false,
        ..Default::default()
    }
}

fn ids(tk: &Tokenizer, pieces: &[&str]) -> Vec<u32> {
    pieces
        .iter()
        .map(|p| tk.token_to_id(p).unwrap_or_else(|| panic!("no token {p}")))
        .collect()
}

const N: i32 = token_type::NORMAL;

#[test]
fn spm_equal_scores_merge_leftmost_first() {
    let tk = Tokenizer::from_spec(&spm_spec(&[
        ("a", -1.0, N),
        ("b", -1.0, N),
        ("c", -1.0, N),
        ("ab", -2.0, N),
        ("bc", -2.0, N),
    ]))
    .unwrap();
    assert_eq!(tk.encode("abc", false).unwrap(), ids(&tk, &["ab", "c"]));
    // A higher score wins regardless of position.
    let tk = Tokenizer::from_spec(&spm_spec(&[
        ("a", -1.0, N),
        ("b", -1.0, N),
        ("c", -1.0, N),
        ("ab", -2.0, N),
        ("bc", -1.5, N),
    ]))
    .unwrap();
    assert_eq!(tk.encode("abc", false).unwrap(), ids(&tk, &["a", "bc"]));
}

#[test]
fn spm_byte_fallback_and_bos() {
    let tk = Tokenizer::from_spec(&spm_spec(&[("▁", -1.0, N), ("a", -1.0, N)])).unwrap();
    assert_eq!(
        tk.encode("a é", true).unwrap(),
        ids(&tk, &["<s>", "a", "▁", "<0xC3>", "<0xA9>"])
    );
    assert_eq!(tk.decode(&tk.encode("a é", true).unwrap(), true), "a é");
    assert_eq!(tk.token_bytes(tk.token_to_id("<0xC3>").unwrap()), &[0xC3]);
    assert_eq!(tk.encode("", true).unwrap(), ids(&tk, &["<s>"]));
}

#[test]
fn spm_space_prefix_after_special_tokens() {
    let mut spec = spm_spec(&[
        ("▁", -1.0, N),
        ("a", -1.0, N),
        ("b", -1.0, N),
        ("▁a", -0.5, N),
    ]);
    spec.add_space_prefix = true;
    let tk = Tokenizer::from_spec(&spec).unwrap();
    assert_eq!(
        tk.encode("a</s>b", false).unwrap(),
        ids(&tk, &["▁a", "</s>", "▁", "b"])
    );
}

#[test]
fn longer_special_token_wins_over_leftmost() {
    let u = token_type::USER_DEFINED;
    let tk = Tokenizer::from_spec(&spm_spec(&[
        ("X", -1.0, N),
        ("XY", 0.0, u),
        ("YZW", 0.0, u),
    ]))
    .unwrap();
    // llama.cpp cuts out the longest special token first: "YZW", leaving "X".
    assert_eq!(tk.encode("XYZW", false).unwrap(), ids(&tk, &["X", "YZW"]));
    // The space is escaped to "▁" (E2 96 81), which this vocabulary only has as bytes.
    assert_eq!(
        tk.encode("XY XY", false).unwrap(),
        ids(&tk, &["XY", "<0xE2>", "<0x96>", "<0x81>", "XY"])
    );
}

#[test]
fn control_tokens_parse_only_when_asked() {
    let tk = Tokenizer::from_spec(&spm_spec(&[("a", -1.0, N)])).unwrap();
    assert_eq!(tk.encode("a</s>", false).unwrap(), ids(&tk, &["a", "</s>"]));
    let plain = tk.encode_with("</s>", false, false).unwrap();
    assert_eq!(plain.len(), 4, "bytes of '</s>': {plain:?}");
    assert_eq!(tk.decode(&ids(&tk, &["a", "</s>"]), true), "a");
    assert_eq!(tk.decode(&ids(&tk, &["a", "</s>"]), false), "a</s>");
    assert!(tk.is_special(2) && !tk.is_special(tk.token_to_id("a").unwrap()));
    assert_eq!(tk.eos_ids(), &[2]);
}

#[test]
fn unknown_ids_decode_to_nothing() {
    let tk = Tokenizer::from_spec(&spm_spec(&[("a", -1.0, N)])).unwrap();
    assert_eq!(tk.token_bytes(u32::MAX), b"");
    assert_eq!(
        tk.decode(&[u32::MAX, tk.token_to_id("a").unwrap()], false),
        "a"
    );
    assert_eq!(tk.id_to_token(u32::MAX), None);
}

fn strings(v: &[&str]) -> G {
    G::Array(v.iter().map(|s| G::String(s.to_string())).collect())
}

fn metadata(pairs: Vec<(&str, G)>) -> HashMap<String, G> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

#[test]
fn gguf_defaults_follow_llama_cpp() {
    let md = metadata(vec![
        ("tokenizer.ggml.model", G::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            strings(&["<unk>", "<s>", "</s>", ""]),
        ),
    ]);
    let spec = TokenizerSpec::from_gguf_metadata(&md).unwrap();
    assert_eq!(
        (spec.unk_id, spec.bos_id, spec.eos_id),
        (Some(0), Some(1), Some(2))
    );
    assert!(spec.add_bos && spec.add_space_prefix && !spec.add_eos);
    assert_eq!(spec.tokens[3], "[EMPTY_3]");
    // Serde round trip: the spec is plain data.
    let json = serde_json::to_string(&spec).unwrap();
    assert_eq!(serde_json::from_str::<TokenizerSpec>(&json).unwrap(), spec);
}

#[test]
fn gguf_llama3_pre_adds_bos_and_ids_are_read() {
    let md = metadata(vec![
        ("tokenizer.ggml.model", G::String("gpt2".into())),
        ("tokenizer.ggml.pre", G::String("llama-bpe".into())),
        (
            "tokenizer.ggml.tokens",
            strings(&["a", "b", "ab", "<|begin_of_text|>"]),
        ),
        ("tokenizer.ggml.merges", strings(&["a b"])),
        ("tokenizer.ggml.bos_token_id", G::U32(3)),
        ("tokenizer.ggml.eos_token_id", G::I32(99)), // out of range: llama.cpp keeps the default
    ]);
    let spec = TokenizerSpec::from_gguf_metadata(&md).unwrap();
    assert!(spec.add_bos);
    assert_eq!(spec.bos_id, Some(3));
    assert_eq!(spec.eos_id, None);
    let tk = Tokenizer::from_spec(&spec).unwrap();
    assert_eq!(tk.encode("ab", true).unwrap(), vec![3, 2]);
}

#[test]
fn gguf_bad_metadata_is_an_error() {
    let cases: Vec<(Vec<(&str, G)>, &str)> = vec![
        (vec![], "tokenizer.ggml.model"),
        (
            vec![("tokenizer.ggml.model", G::String("rwkv".into()))],
            "unsupported tokenizer model",
        ),
        (
            vec![("tokenizer.ggml.model", G::String("llama".into()))],
            "tokenizer.ggml.tokens",
        ),
        (
            vec![("tokenizer.ggml.model", G::U32(1))],
            "expected a string",
        ),
        (
            vec![
                ("tokenizer.ggml.model", G::String("gpt2".into())),
                ("tokenizer.ggml.tokens", strings(&["a"])),
            ],
            "merges",
        ),
        (
            vec![
                ("tokenizer.ggml.model", G::String("llama".into())),
                ("tokenizer.ggml.tokens", strings(&["a", "b"])),
                ("tokenizer.ggml.scores", G::Array(vec![G::F32(0.0)])),
            ],
            "1 entries for 2 tokens",
        ),
    ];
    for (md, want) in cases {
        let err = TokenizerSpec::from_gguf_metadata(&metadata(md))
            .expect_err("must fail")
            .to_string();
        assert!(err.contains(want), "{err:?} should mention {want:?}");
    }
}

#[test]
fn unknown_pre_tokenizer_is_an_error() {
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("no-such-pre".into()),
        tokens: vec!["a".into()],
        merges: vec![],
        ..Default::default()
    };
    let err = Tokenizer::from_spec(&spec)
        .expect_err("must fail")
        .to_string();
    assert!(err.contains("no-such-pre"), "{err}");
}
