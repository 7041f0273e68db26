//! Loading a Hugging Face model folder (tokenizer.json + tokenizer_config.json). The folder is
//! made from SmolLM2's GGUF tokenizer (saved as tokenizer.json with its control tokens as added
//! special tokens), so the GGUF path, already checked against llama.cpp, is the reference.

mod common;

use std::path::PathBuf;

use common::{model, read_fixture, SMOLLM2};
use ferrolm_text::Tokenizer;
use tokenizers::AddedToken;

fn write_hf_folder(gguf: &Tokenizer) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrolm-text-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut hf = gguf
        .hf_tokenizer()
        .expect("gpt2 tokenizer is HF-backed")
        .clone();
    let specials: Vec<AddedToken> = (0..gguf.vocab_size() as u32)
        .filter(|&id| gguf.is_special(id))
        .map(|id| AddedToken::from(gguf.id_to_token(id).unwrap(), true))
        .collect();
    hf.add_special_tokens(specials).unwrap();
    hf.save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({
        "bos_token": gguf.bos_token(),
        "eos_token": {"content": gguf.eos_token(), "special": true},
        "add_bos_token": false,
        "chat_template": [{"name": "default", "template": gguf.chat_template()}],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn hf_folder_tokenizes_like_the_gguf() {
    let Some(path) = model(SMOLLM2) else { return };
    let gguf = Tokenizer::from_gguf_file(&path).unwrap();
    let dir = write_hf_folder(&gguf);
    let hf = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();

    assert_eq!(hf.vocab_size(), gguf.vocab_size());
    assert_eq!(hf.bos_id(), gguf.bos_id());
    assert_eq!(hf.eos_id(), gguf.eos_id());
    assert_eq!(hf.eos_ids(), gguf.eos_ids());
    assert_eq!(hf.add_bos(), gguf.add_bos());
    assert_eq!(hf.chat_template(), gguf.chat_template());
    let fx = read_fixture("tokenizer/SmolLM2-135M-Instruct.Q4_1.json");
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            hf.encode(text, false).unwrap(),
            gguf.encode(text, false).unwrap(),
            "[{}]",
            case["name"]
        );
    }
    for id in 0..gguf.vocab_size() as u32 {
        assert_eq!(hf.token_bytes(id), gguf.token_bytes(id), "token {id}");
        assert_eq!(hf.is_special(id), gguf.is_special(id), "token {id}");
    }
}

#[test]
fn missing_folder_is_an_error_not_a_panic() {
    let err = Tokenizer::from_hf_dir("/nonexistent/ferrolm-model").expect_err("error");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

/// A WordPiece (BERT) tokenizer.json whose file asks for truncation at 4 and padding to 8, as
/// all-MiniLM-L6-v2's does (at 128): ferrolm encodes the whole text, unpadded, with the
/// post-processor's [CLS] … [SEP].
#[test]
fn wordpiece_with_truncation_and_padding_in_the_file_encodes_whole_text() {
    let vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "!"];
    let vocab: serde_json::Map<String, serde_json::Value> =
        vocab.iter().enumerate().map(|(i, t)| (t.to_string(), i.into())).collect();
    let special = |id: u32, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": {"max_length": 4, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                    "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"), special(3, "[SEP]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab},
    });
    let dir = std::env::temp_dir().join(format!("ferrolm-text-wordpiece-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let tk = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(tk.encode("Hello Worlds hello, world!", true).unwrap(), [2, 4, 5, 6, 4, 1, 5, 7, 3]);
    assert_eq!(tk.encode("Hello", false).unwrap(), [4]);
}
