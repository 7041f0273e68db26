//! Qwen2.5-Coder-0.5B-Instruct Q4_K_M against llama.cpp and the exact float64 reference
//! (fixtures from scripts/fixtures/llamacpp_fixtures.py with prompts.QWEN2_PROMPTS: chat and raw
//! prompts and a chat with tools), with the method of parity_llamacpp.rs. Also checks that
//! ferrolm's chat template renders the tool prompt to the fixture's token ids.

mod common;
#[path = "common/parity.rs"]
mod parity;

use common::*;
use ferrolm_models::paths;
use ferrolm_text::{ChatTemplate, RenderOptions, Tokenizer};
use parity::*;

const FILE: &str = "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf";

/// Exact reference: f32 against f64 arithmetic on the same dequantized weights. Measured
/// 2026-12-02 over the 11 prompts (up to 741 tokens, 64 steps): max |Δ| 3e-5, every top-1 and
/// every greedy token equal. The bound leaves 30× headroom for summation order.
const EXACT: Tolerance = Tolerance {
    margin: 0.01,
    delta: 1e-3,
};
/// llama.cpp quantizes activations to 8 bits (Q8_0 / Q8_K) for these weight types: measured max
/// |Δ| 0.40 (raw_cjk); no top-1 disagreement at margins > 0.5.
const LLAMA_CPP: Tolerance = Tolerance {
    margin: 0.5,
    delta: 1.0,
};

#[test]
fn qwen2_coder_0_5b_matches_llama_cpp_and_exact_reference() {
    exact_activations();
    let Some(model) = open_model(FILE) else {
        return;
    };
    assert_eq!(model.info().architecture, "qwen2");
    let fixture = load_fixture(&FILE.replace(".gguf", ".json"));
    assert!(fixture.prompts.iter().any(|p| p.name == "chat_tools"));
    let mut failures = Vec::new();
    for p in &fixture.prompts {
        let oracles = [
            OracleRun {
                name: "reference",
                greedy: &p.reference.greedy_ids,
                steps: &p.reference.steps,
                tol: EXACT,
            },
            OracleRun {
                name: "llama.cpp",
                greedy: &p.greedy_ids,
                steps: &p.steps,
                tol: LLAMA_CPP,
            },
        ];
        failures.extend(check_prompt(model.as_ref(), p, &oracles, 256).0);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every chat prompt of the fixture, tools included, renders through ferrolm's template and
/// tokenizer to the ids llama.cpp was given (rendered there by transformers-style jinja2).
#[test]
fn qwen2_chat_prompts_with_tools_render_to_the_fixture_ids() {
    let path = paths::models_dir().join(FILE);
    if !path.exists() {
        eprintln!("SKIP: {} not present (run scripts/get_model.py)", path.display());
        return;
    }
    let tokenizer = Tokenizer::from_gguf_file(&path).unwrap();
    let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap();
    let text = std::fs::read_to_string(
        repo_root().join("tests/fixtures/llamacpp").join(FILE.replace(".gguf", ".json")),
    )
    .unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut chats = 0;
    for p in fixture["prompts"].as_array().unwrap() {
        if p["kind"] != "chat" {
            continue;
        }
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: p.get("tools").cloned(),
            ..Default::default()
        };
        let rendered = template.render(&p["messages"], &opts).unwrap();
        assert_eq!(rendered, p["prompt_text"].as_str().unwrap(), "{}", p["name"]);
        let ids = tokenizer.encode(&rendered, false).unwrap();
        let want: Vec<u32> = serde_json::from_value(p["prompt_ids"].clone()).unwrap();
        assert_eq!(ids, want, "{}", p["name"]);
        if opts.tools.is_some() {
            assert!(rendered.contains("<tools>") && rendered.contains("get_current_weather"));
        }
        chats += 1;
    }
    assert!(chats >= 6, "{chats} chat prompts");
}
