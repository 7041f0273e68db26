//! The one place that maps an architecture name to its implementation. GGUF files name it in
//! `general.architecture`, Hugging Face folders in `config.json`'s `model_type`.

use crate::bert::{Bert, BertConfig, BertNames};
use crate::config::llama_family;
use crate::gemma3::{Gemma3, Gemma3Config};
use crate::llama::{Llama, LlamaConfig};
use crate::loader::gguf::GgufFile;
use crate::loader::ProgressFn;
use crate::loader::safetensors::HfModel;
use crate::sentence::SentenceConfig;
use crate::{qwen2, CausalLm, LoadError, Result};
use candle_core::Device;
use std::path::Path;

/// A model on disk, opened and validated but not yet loaded onto a device.
pub enum ModelSource {
    /// A `.gguf` file.
    Gguf(GgufFile),
    /// A Hugging Face folder: config.json, safetensors weights, tokenizer files.
    HfDir(HfModel),
}

type Loader = fn(&ModelSource, &Device) -> Result<Box<dyn CausalLm>>;

/// Architecture name (GGUF or `model_type`) → loader. `SUPPORTED` lists the names.
const ARCHITECTURES: &[(&str, Loader)] = &[
    ("llama", load_llama),
    ("mistral", load_llama),
    ("qwen2", load_qwen2),
    // The llama decoder with per-head q/k norms (LlamaConfig::qk_norm).
    ("qwen3", load_llama),
    // …with mixture-of-experts MLPs (LlamaConfig::moe); GGUF and model_type spellings.
    ("qwen3moe", load_llama),
    ("qwen3_moe", load_llama),
    // Qwen2 with experts and a gated shared expert (biases required as for qwen2).
    ("qwen2moe", load_qwen2),
    ("qwen2_moe", load_qwen2),
    // GGUF names Mixtral `llama` (with experts).
    ("mixtral", load_llama),
    ("gemma3", load_gemma3),
    ("gemma3_text", load_gemma3),
    ("bert", load_bert),
];

/// Architectures this build can run.
pub const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "qwen3moe", "qwen3_moe", "qwen2moe", "qwen2_moe", "mixtral", "gemma3", "gemma3_text", "bert"];

impl ModelSource {
    /// A directory is a Hugging Face folder; anything else is read as GGUF.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(LoadError::File {
                path: path.display().to_string(),
                message: "no such file or directory".into(),
            });
        }
        if path.is_dir() {
            return Ok(ModelSource::HfDir(HfModel::open(path)?));
        }
        Ok(ModelSource::Gguf(GgufFile::open(path)?))
    }

    pub fn architecture(&self) -> Result<String> {
        match self {
            ModelSource::Gguf(f) => f.architecture(),
            ModelSource::HfDir(m) => m.architecture(),
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(f) => f.path(),
            ModelSource::HfDir(m) => m.dir(),
        }
    }

    /// Calls `f(done, total)` (bytes of tensors) as the load hands each tensor to the model:
    /// for progress bars.
    pub fn on_progress(&self, f: ProgressFn) {
        match self {
            ModelSource::Gguf(g) => g.progress.set(f),
            ModelSource::HfDir(m) => m.files().progress.set(f),
        }
    }
}

/// Builds the model for `source` on `device`; an architecture without an implementation is an
/// error naming it.
pub fn load(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    let arch = source.architecture()?;
    let loader = ARCHITECTURES
        .iter()
        .find(|(name, _)| *name == arch)
        .map(|(_, l)| l)
        .ok_or_else(|| LoadError::UnsupportedArchitecture(arch.clone(), SUPPORTED.join(", ")))?;
    loader(source, device)
}

fn load_llama(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    Ok(Box::new(match source {
        ModelSource::Gguf(f) => Llama::load(LlamaConfig::from_gguf(f)?, f, device)?,
        ModelSource::HfDir(m) => Llama::load(llama_family(&m.config)?, m, device)?,
    }))
}

fn load_qwen2(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    Ok(Box::new(match source {
        ModelSource::Gguf(f) => qwen2::load(qwen2::config_from_gguf(f)?, f, device)?,
        ModelSource::HfDir(m) => qwen2::load(qwen2::config_from_hf(&m.config)?, m, device)?,
    }))
}

fn load_gemma3(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    Ok(Box::new(match source {
        ModelSource::Gguf(f) => Gemma3::load(Gemma3Config::from_gguf(f)?, f, device)?,
        ModelSource::HfDir(m) => Gemma3::load(Gemma3Config::from_hf(&m.config)?, m, device)?,
    }))
}

/// BERT embedding models from Hugging Face folders (with their sentence-transformers files);
/// a GGUF BERT's WordPiece tokenizer is not read by ferrolm-text, so GGUF is refused here.
fn load_bert(source: &ModelSource, device: &Device) -> Result<Box<dyn CausalLm>> {
    match source {
        ModelSource::HfDir(m) => {
            let cfg = BertConfig::from_hf(&m.config)?;
            let sentence = SentenceConfig::load(m.dir())?;
            Ok(Box::new(Bert::load(cfg, sentence, &BertNames::new(m), device)?))
        }
        ModelSource::Gguf(f) => Err(LoadError::File {
            path: f.path().display().to_string(),
            message: "BERT models are loaded from Hugging Face folders (config.json, model.safetensors, tokenizer.json), not GGUF".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_architecture_has_a_loader() {
        let names: Vec<&str> = ARCHITECTURES.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, SUPPORTED);
    }

    #[test]
    fn an_unsupported_model_type_is_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("ferrolm-registry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "phi3"}"#).unwrap();
        // An empty safetensors file: header length 8, header `{}` padded with spaces.
        let mut st = 8u64.to_le_bytes().to_vec();
        st.extend(b"{}      ");
        std::fs::write(dir.join("model.safetensors"), st).unwrap();
        let source = ModelSource::open(&dir).unwrap();
        let err = load(&source, &Device::Cpu).err().unwrap().to_string();
        std::fs::remove_dir_all(&dir).ok();
        // The error lists what is supported.
        for name in ["\"phi3\"", "supported: llama", "qwen3", "qwen3_moe", "gemma3"] {
            assert!(err.contains(name), "{name} missing from {err}");
        }
    }
}
