//! User text is text: every control token of each supported tokenizer, written inside message
//! content, is tokenized as plain text; only the chat template's scaffold yields control tokens.
//! GGUF tokenizers (SmolLM2, Qwen2.5, Gemma 3) and tokenizer.json folders (scripts/hf_folders.py).

mod common;

use common::{model, models_dir, GEMMA3, QWEN25, SMOLLM2};
use ferrolm_text::{ChatTemplate, RenderOptions, Tokenizer};
use serde_json::{json, Value};

const HF_FOLDERS: &[&str] = &["hf/SmolLM2-135M-Instruct-f32", "hf/gemma-3-270m-f32", "hf/qwen2.5-coder-0.5b-instruct-f32"];

fn tokenizers() -> Vec<(String, Tokenizer)> {
    let mut out = Vec::new();
    for file in [SMOLLM2, QWEN25, GEMMA3] {
        if let Some(path) = model(file) {
            out.push((file.to_string(), Tokenizer::from_gguf_file(path).unwrap()));
        }
    }
    for dir in HF_FOLDERS {
        let path = models_dir().join(dir);
        if path.exists() {
            out.push((dir.to_string(), Tokenizer::from_hf_dir(path).unwrap()));
        } else {
            eprintln!("SKIP: {} not found (scripts/hf_folders.py)", path.display());
        }
    }
    out
}

/// Control tokens whose text, read as plain text, is not that token. A tokenizer.json may hold
/// a control-typed token as an ordinary vocabulary entry too (Gemma 3's `</s>`, which ferrolm
/// types as end-of-generation, as llama.cpp does): BPE merges spell it from plain text, and
/// transformers' `split_special_tokens` gives the same id. Those are reported, not counted.
fn controls(t: &Tokenizer) -> Vec<(u32, String)> {
    let all: Vec<(u32, String)> = (0..t.vocab_size() as u32)
        .filter(|&id| t.is_special(id))
        .filter_map(|id| t.id_to_token(id).filter(|s| !s.is_empty()).map(|s| (id, s.to_string())))
        .collect();
    let (ordinary, control): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|(id, text)| t.encode_with(text, false, false).unwrap() == [*id]);
    if !ordinary.is_empty() {
        eprintln!("also ordinary vocabulary entries: {ordinary:?}");
    }
    control
}

/// Control tokens in `ids`, leaving out those that plain text may spell (see `controls`).
fn count(t: &Tokenizer, ids: &[u32]) -> usize {
    ids.iter().filter(|&&i| t.is_special(i) && t.encode_with(t.id_to_token(i).unwrap_or(""), false, false).unwrap() != [i]).count()
}

/// A user / assistant / user chat whose every message is `content`.
fn chat(content: &str) -> Value {
    json!([
        {"role": "user", "content": content},
        {"role": "assistant", "content": content},
        {"role": "user", "content": content},
    ])
}

fn protected(t: &Tokenizer, messages: &Value) -> Value {
    let mut m = messages.clone();
    for msg in m.as_array_mut().unwrap() {
        let c = msg["content"].as_str().unwrap().to_string();
        msg["content"] = Value::String(t.protect(&c).into_owned());
    }
    m
}

/// The tokenizer's own template; ChatML for one without (Gemma 3 270M's GGUF has none).
fn template_of(t: &Tokenizer) -> ChatTemplate {
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    ChatTemplate::new(t.chat_template().unwrap_or(CHATML), t.bos_token(), t.eos_token()).unwrap()
}

fn render(template: &ChatTemplate, messages: &Value) -> String {
    let opts = RenderOptions { add_generation_prompt: true, ..Default::default() };
    template.render(messages, &opts).unwrap()
}

#[test]
fn every_control_token_in_content_is_plain_text() {
    let all = tokenizers();
    assert!(!all.is_empty() || std::env::var_os("CI").is_none(), "no tokenizer to test");
    for (name, t) in all {
        let template = template_of(&t);
        let specials = controls(&t);
        assert!(!specials.is_empty(), "{name}");
        // Every control token, at the start, the end and between words of the content.
        let joined: Vec<&str> = specials.iter().map(|(_, s)| s.as_str()).collect();
        let content = format!("{}a {} b{}", joined[0], joined.join(" x "), joined[joined.len() - 1]);
        let scaffold = t.encode_prompt(&render(&template, &chat("a b")), false, usize::MAX).unwrap();
        let rendered = render(&template, &protected(&t, &chat(&content)));
        let ids = t.encode_prompt(&rendered, false, usize::MAX).unwrap();
        let count = |ids: &[u32]| count(&t, ids);
        assert_eq!(count(&ids), count(&scaffold), "{name}: control tokens beyond the template's own");
        // Nothing lost: the ids spell the chat rendered from the original content.
        assert_eq!(t.decode(&ids, false), render(&template, &chat(&content)), "{name}");
        // Without protection the same text does produce the control tokens (the test can fail).
        let unprotected = t.encode_prompt(&render(&template, &chat(&content)), false, usize::MAX).unwrap();
        assert!(count(&unprotected) > count(&scaffold) + specials.len(), "{name}");
        eprintln!("{name}: {} control tokens checked", specials.len());
    }
}

#[test]
fn each_control_token_alone_cannot_open_a_turn() {
    for (name, t) in tokenizers() {
        let template = template_of(&t);
        let scaffold = t.encode_prompt(&render(&template, &chat("hi")), false, usize::MAX).unwrap();
        let count = |ids: &[u32]| count(&t, ids);
        for (id, text) in controls(&t) {
            let content = format!("hi{text}");
            let ids = t.encode_prompt(&render(&template, &protected(&t, &chat(&content))), false, usize::MAX).unwrap();
            assert_eq!(count(&ids), count(&scaffold), "{name}: token {id} {text:?}");
        }
    }
}
