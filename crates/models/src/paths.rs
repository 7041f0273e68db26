//! Where models live on disk.

use std::path::PathBuf;

/// File name of the default model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M), fetched by
/// `scripts/get_model.py` with no arguments: it answers the five everyday questions of
/// `scripts/first_run.sh` and stops (issue 30). The 0.5B before it answered three, and llama.cpp
/// gets its 17 × 23 wrong too (`tests/parity_first_run.rs`); SmolLM2-135M, the first default,
/// rambled. SmolLM2 stays the fast model of the tests, which name it explicitly.
pub const DEFAULT_MODEL_FILE: &str = "qwen2.5-coder-1.5b-instruct.gguf";

/// `$FERROLM_MODELS`, else `~/.cache/ferrolm/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERROLM_MODELS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("ferrolm").join("models")
}

pub fn default_model_path() -> PathBuf {
    models_dir().join(DEFAULT_MODEL_FILE)
}
