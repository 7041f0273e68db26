//! Helpers shared by the integration tests: where models and fixtures live.
#![allow(dead_code)]

use std::path::PathBuf;

/// `$FERROLM_MODELS`, else `~/.cache/ferrolm/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERROLM_MODELS") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").unwrap_or_default();
    PathBuf::from(home).join(".cache/ferrolm/models")
}

/// The model file, or None after printing a skip notice (the test then returns early).
pub fn model(file: &str) -> Option<PathBuf> {
    let path = models_dir().join(file);
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "SKIP: model {} not found (fetch it with scripts/get_model.py)",
            path.display()
        );
        None
    }
}

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn read_fixture(rel: &str) -> serde_json::Value {
    let path = fixtures_dir().join(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

pub fn hex_to_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-Q4_K_M.gguf";
pub const QWEN25: &str = "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf";
