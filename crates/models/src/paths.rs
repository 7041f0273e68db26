//! Where models live on disk.

use std::path::PathBuf;

/// File name of the default model (SmolLM2-135M-Instruct Q4_1), fetched by scripts/get_model.py.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

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
