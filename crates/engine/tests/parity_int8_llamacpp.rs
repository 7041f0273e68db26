//! The default CPU decode path (8-bit activations on AVX-512 VNNI, `ferrolm_backend::cpu`'s
//! fast mode) on the default model, SmolLM2-135M Q4_1, against llama.cpp. llama.cpp quantizes
//! activations to 8 bits too, so our fast path must stay within what that rounding costs:
//! |Δlogit| ≤ 2.5 on its top-5 (as parity_llamacpp.rs), top-1 and greedy agreement wherever its
//! margin is clear. The distance to the exact reference is printed, not checked. Its own file:
//! the exact/fast switch is per process. On CPUs without VNNI this runs the f32 path, which
//! passes the same bounds (parity_llamacpp.rs checks tighter ones).

mod common;
#[path = "common/parity.rs"]
mod parity;

use common::*;
use parity::*;

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Measured 2026-12-03 over the 10 prompts (590 steps): max |Δ| 1.71 (raw_cyrillic; exact f32
/// activations: 1.44), and one top-1 disagreement at a llama.cpp margin above 0.5: 0.63
/// (raw_cyrillic step 16, where our own margin is 0.02). Both engines now round activations to
/// 8 bits but from slightly different inputs (our prefill keeps f32 activations, so the KV cache
/// differs), so the two roundings add rather than cancel; the margin is 1.0 instead of the exact
/// path's 0.5 (largest disagreement there: 0.33).
const LLAMA_CPP: Tolerance = Tolerance {
    margin: 1.0,
    delta: 2.5,
};
/// Only for the printed comparison with the exact reference.
const LOOSE: Tolerance = Tolerance {
    margin: 1.0,
    delta: f32::INFINITY,
};

#[test]
fn smollm2_q4_1_int8_decode_matches_llama_cpp() {
    ferrolm_backend::cpu::set_exact_activations(false);
    let Some(model) = open_model(FILE) else {
        return;
    };
    let fixture = load_fixture(&FILE.replace(".gguf", ".json"));
    let mut failures = Vec::new();
    let (mut worst_llama, mut worst_exact) = (0f32, 0f32);
    for p in &fixture.prompts {
        let oracles = [
            OracleRun {
                name: "llama.cpp",
                greedy: &p.greedy_ids,
                steps: &p.steps,
                tol: LLAMA_CPP,
            },
            OracleRun {
                name: "reference",
                greedy: &p.reference.greedy_ids,
                steps: &p.reference.steps,
                tol: LOOSE,
            },
        ];
        let (f, reports) = check_prompt(model.as_ref(), p, &oracles, 256);
        // Only llama.cpp's checks count; the reference run is informational.
        failures.extend(f.into_iter().filter(|m| m.starts_with("llama.cpp")));
        worst_llama = worst_llama.max(reports[0].max_delta);
        worst_exact = worst_exact.max(reports[1].max_delta);
    }
    eprintln!("max |Δlogit| on the top-5: vs llama.cpp {worst_llama:.3}, vs exact reference {worst_exact:.3}");
    assert!(failures.is_empty(), "{failures:#?}");
}

