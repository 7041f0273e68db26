//! The one place that maps an architecture name to its implementation.

use crate::llama::{Llama, LlamaConfig};
use crate::loader::gguf::GgufFile;
use crate::{CausalLm, LoadError, Result};
use candle_core::Device;
use std::path::Path;

/// A model on disk, opened and validated but not yet loaded onto a device.
pub enum ModelSource {
    Gguf(GgufFile),
}

/// Architectures this build can run.
pub const SUPPORTED: &[&str] = &["llama", "qwen2"];

impl ModelSource {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(LoadError::File {
                path: path.display().to_string(),
                message: "no such file or directory".into(),
            });
        }
        Ok(ModelSource::Gguf(GgufFile::open(path)?))
    }

    pub fn architecture(&self) -> Result<String> {
        match self {
            ModelSource::Gguf(f) => f.architecture(),
        }
    }
}

/// Builds the model for `source` on `device`.
pub fn load(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    let arch = source.architecture()?;
    match (source, arch.as_str()) {
        (ModelSource::Gguf(f), "llama" | "qwen2") => Ok(Box::new(Llama::load(
            LlamaConfig::from_gguf(f)?,
            f,
            device,
        )?)),
        _ => Err(LoadError::UnsupportedArchitecture(
            arch,
            SUPPORTED.join(", "),
        )),
    }
}
