//! Token ids, decoded text, token bytes and end-of-generation ids against llama.cpp fixtures
//! (scripts/fixtures/tokenizer_fixtures.py), for each model whose GGUF is present.

mod common;

use common::{hex_to_bytes, model, read_fixture, GEMMA3, QWEN25, SMOLLM2};
use ferrolm_text::Tokenizer;
use serde_json::Value;

/// llama.cpp attribute bits (`llama_token_attr`).
const ATTR_UNKNOWN: u64 = 1;
const ATTR_CONTROL: u64 = 8;

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check_model(file: &str) {
    let Some(path) = model(file) else { return };
    let stem = file.trim_end_matches(".gguf");
    let fx = read_fixture(&format!("tokenizer/{stem}.json"));
    let tk = Tokenizer::from_gguf_file(&path).expect("load tokenizer");
    let mut failures = Vec::new();

    check_vocab_facts(&tk, &fx, &mut failures);
    for case in fx["cases"].as_array().expect("cases") {
        check_case(&tk, case, &mut failures);
    }
    check_token_bytes(&tk, &fx, &mut failures);

    let n = fx["cases"].as_array().map_or(0, Vec::len);
    assert!(
        failures.is_empty(),
        "{file}: {} mismatches vs llama.cpp:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("{file}: {n} texts identical to llama.cpp");
}

fn check_vocab_facts(tk: &Tokenizer, fx: &Value, failures: &mut Vec<String>) {
    let facts = [
        (
            "n_vocab",
            tk.vocab_size() as i64,
            fx["n_vocab"].as_i64().unwrap(),
        ),
        (
            "bos",
            tk.bos_id().map_or(-1, i64::from),
            fx["bos"].as_i64().unwrap(),
        ),
        (
            "eos",
            tk.eos_id().map_or(-1, i64::from),
            fx["eos"].as_i64().unwrap(),
        ),
        (
            "add_bos",
            tk.add_bos() as i64,
            fx["add_bos"].as_bool().unwrap() as i64,
        ),
    ];
    for (name, ours, theirs) in facts {
        if ours != theirs {
            failures.push(format!("{name}: ours {ours}, llama.cpp {theirs}"));
        }
    }
    let eog = ids_of(&fx["eog"]);
    if tk.eos_ids() != eog.as_slice() {
        failures.push(format!(
            "eos_ids: ours {:?}, llama.cpp {eog:?}",
            tk.eos_ids()
        ));
    }
}

fn check_case(tk: &Tokenizer, case: &Value, failures: &mut Vec<String>) {
    let name = case["name"].as_str().unwrap();
    let text = case["text"].as_str().unwrap();
    let want = ids_of(&case["ids"]);
    let want_bos = ids_of(&case["ids_bos"]);
    match tk.encode(text, false) {
        Ok(got) if got == want => {}
        Ok(got) => failures.push(format!(
            "[{name}] ids\n  ours      {got:?}\n  llama.cpp {want:?}"
        )),
        Err(e) => failures.push(format!("[{name}] encode error: {e}")),
    }
    match tk.encode(text, true) {
        Ok(got) if got == want_bos => {}
        Ok(got) => failures.push(format!(
            "[{name}] ids with BOS\n  ours      {got:?}\n  llama.cpp {want_bos:?}"
        )),
        Err(e) => failures.push(format!("[{name}] encode error: {e}")),
    }
    // llama_detokenize(remove_special = false, unparse_special = false / true).
    for (skip, key) in [(true, "detok_hex"), (false, "detok_special_hex")] {
        let want = String::from_utf8_lossy(&hex_to_bytes(case[key].as_str().unwrap())).into_owned();
        let got = tk.decode(&ids_of(&case["ids"]), skip);
        if got != want {
            failures.push(format!(
                "[{name}] decode(skip_special={skip})\n  ours      {got:?}\n  llama.cpp {want:?}"
            ));
        }
    }
}

fn check_token_bytes(tk: &Tokenizer, fx: &Value, failures: &mut Vec<String>) {
    for (id, info) in fx["tokens"].as_object().expect("tokens") {
        let id: u32 = id.parse().unwrap();
        let want = hex_to_bytes(info["piece_hex"].as_str().unwrap());
        if tk.token_bytes(id) != want.as_slice() {
            failures.push(format!(
                "token {id} bytes: ours {:?}, llama.cpp {want:?}",
                tk.token_bytes(id)
            ));
        }
        let special = info["attr"].as_u64().unwrap() & (ATTR_CONTROL | ATTR_UNKNOWN) != 0;
        if tk.is_special(id) != special {
            failures.push(format!(
                "token {id} is_special: ours {}, llama.cpp {special}",
                tk.is_special(id)
            ));
        }
    }
}

#[test]
fn smollm2_matches_llama_cpp() {
    check_model(SMOLLM2);
}

#[test]
fn gemma3_matches_llama_cpp() {
    check_model(GEMMA3);
}

#[test]
fn qwen25_matches_llama_cpp() {
    check_model(QWEN25);
}

/// The text in every fixture decodes back to itself (nothing lost in encode + decode).
#[test]
fn round_trip_is_lossless() {
    for file in [SMOLLM2, GEMMA3, QWEN25] {
        let Some(path) = model(file) else { continue };
        let tk = Tokenizer::from_gguf_file(&path).expect("load tokenizer");
        let fx = read_fixture(&format!(
            "tokenizer/{}.json",
            file.trim_end_matches(".gguf")
        ));
        for case in fx["cases"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids = tk.encode(text, false).unwrap();
            assert_eq!(tk.decode(&ids, false), text, "{file} [{}]", case["name"]);
        }
    }
}

/// Pathological inputs (long runs that stress regex backtracking and merge loops) neither fail
/// nor lose text.
#[test]
fn long_runs_encode_and_round_trip() {
    let inputs = [
        " ".repeat(100_000),
        "a".repeat(50_000),
        "😀".repeat(10_000),
        "\n \t".repeat(20_000),
        "7".repeat(30_000),
    ];
    for file in [SMOLLM2, GEMMA3, QWEN25] {
        let Some(path) = model(file) else { continue };
        let tk = Tokenizer::from_gguf_file(&path).expect("load tokenizer");
        for text in &inputs {
            let t0 = std::time::Instant::now();
            let ids = tk
                .encode(text, false)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(tk.decode(&ids, false), *text, "{file}");
            eprintln!(
                "{file}: {} bytes -> {} tokens in {:?}",
                text.len(),
                ids.len(),
                t0.elapsed()
            );
        }
    }
}
