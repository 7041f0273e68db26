//! A model ready to use: weights on a device, tokenizer, chat template and EOS ids.

use crate::{CliError, CliResult};
use ferrolm_backend::parse_device;
use ferrolm_models::{paths, CausalLm, ModelSource};
use ferrolm_text::{ChatTemplate, RenderOptions, Tokenizer, TokenizerSpec};
use std::path::{Path, PathBuf};

pub struct Bundle {
    pub path: PathBuf,
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub eos_ids: Vec<u32>,
}

/// Loads `path` (or the default model) on `device` (`auto`, `cpu`, `cuda[:N]`).
pub fn load(path: Option<&Path>, device: &str) -> CliResult<Bundle> {
    let path = path
        .map(Path::to_path_buf)
        .unwrap_or_else(paths::default_model_path);
    let source = ModelSource::open(&path).map_err(|e| match path.exists() {
        false if path == paths::default_model_path() => CliError::usage(format!(
            "{e} (the default model is fetched by `python3 scripts/get_model.py`)"
        )),
        _ => CliError::usage(e),
    })?;
    let device = parse_device(device).map_err(CliError::usage)?;
    let tokenizer = match &source {
        ModelSource::Gguf(f) => {
            TokenizerSpec::from_gguf_metadata(f.metadata()).and_then(|s| Tokenizer::from_spec(&s))
        }
    }
    .map_err(|e| CliError::usage(format!("{}: tokenizer: {e}", path.display())))?;
    let model = ferrolm_models::load(&source, &device).map_err(CliError::usage)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer).ok();
    let eos_ids = tokenizer.eos_ids().to_vec();
    Ok(Bundle {
        path,
        model,
        tokenizer,
        template,
        eos_ids,
    })
}

impl Bundle {
    /// Token ids of a chat rendered through the model's template, or of raw text with the
    /// model's BOS rule. Templates write their own BOS, so chat text adds no special tokens.
    pub fn prompt_ids(
        &self,
        messages: Option<&serde_json::Value>,
        raw: &str,
    ) -> CliResult<Vec<u32>> {
        let ids = match messages {
            Some(messages) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    CliError::usage(format!(
                        "{}: the model has no chat template; use --raw",
                        self.path.display()
                    ))
                })?;
                let opts = RenderOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                };
                let text = template.render(messages, &opts).map_err(CliError::usage)?;
                self.tokenizer.encode(&text, false)
            }
            None => self.tokenizer.encode(raw, true),
        };
        ids.map_err(CliError::usage)
    }
}
