//! The models room: one file per architecture (named after the checkpoint's `model_type`),
//! shared layers, loaders and a single registry. Models are stateless about caching: they write
//! through the caches the caller passes in.

pub mod batch_graph;
pub mod bert;
pub mod config;
pub mod gemma3;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod lora;
mod model;
pub mod paths;
pub mod qwen2;
pub mod registry;
pub mod sentence;
pub mod tensor_parallel;

pub use config::{GenerationConfig, HfConfig};
pub use loader::gguf::GgufFile;
pub use loader::safetensors::HfModel;
pub use model::{CausalLm, ModelInfo, RowKind, SeqInput};
pub use registry::{load, ModelSource};

/// Errors while opening or building a model; always name the file or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("unsupported architecture {0:?} (supported: {1})")]
    UnsupportedArchitecture(String, String),
    #[error("{0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, LoadError>;
