//! A model ready to serve: weights on a device, tokenizer, chat template and EOS ids.

use ferrolm_backend::parse_device;
use ferrolm_models::loader::ProgressFn;
use ferrolm_models::{paths, CausalLm, GenerationConfig, ModelSource};
use ferrolm_text::{ChatTemplate, RenderOptions, Tokenizer, TokenizerSpec};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why a model could not be loaded; the message names the file and the problem.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BundleError(pub String);

pub struct Bundle {
    pub path: PathBuf,
    /// Name under which the model is served (the file name without extension).
    pub name: String,
    pub model: Box<dyn CausalLm>,
    /// Shared: the grammar compiler (structured output) holds it too.
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The tokenizer's EOS ids plus `generation_config.json`'s `eos_token_id`s.
    pub eos_ids: Vec<u32>,
    /// Sampling defaults from `generation_config.json` (empty for GGUF files): they sit between
    /// the server's built-in defaults and a request's own values.
    pub generation: GenerationConfig,
    /// LoRA adapters mounted on the model (`--adapter`, `POST /v1/adapters`), by name.
    pub adapters: ferrolm_models::lora::Adapters,
}

/// Loads `path` (or the default model) on `device` (`auto`, `cpu`, `cuda[:N]`).
pub fn load(path: Option<&Path>, device: &str) -> Result<Bundle, BundleError> {
    load_parallel(path, device, 1)
}

/// `load` with the model split over `tensor_parallel` ranks (llama family): `cuda[:N]` gives
/// ranks on consecutive GPUs from N (reduced with NCCL in builds with it), `cpu` simulates the ranks on the CPU
/// (reduced by a gather-sum on rank 0; see `ferrolm_models::tensor_parallel`).
pub fn load_parallel(path: Option<&Path>, device: &str, tensor_parallel: usize) -> Result<Bundle, BundleError> {
    load_with_progress(path, device, tensor_parallel, None)
}

/// `load_parallel` calling `progress(done, total)` (bytes of tensors) as the weights load: see
/// `ferrolm_models::ModelSource::on_progress`.
pub fn load_with_progress(
    path: Option<&Path>,
    device: &str,
    tensor_parallel: usize,
    progress: Option<ProgressFn>,
) -> Result<Bundle, BundleError> {
    let path = path
        .map(Path::to_path_buf)
        .unwrap_or_else(paths::default_model_path);
    let source = ModelSource::open(&path).map_err(|e| match path.exists() {
        false if path == paths::default_model_path() => BundleError(format!(
            "{e} (the default model is fetched by `python3 scripts/get_model.py`)"
        )),
        _ => BundleError(e.to_string()),
    })?;
    if let Some(f) = progress {
        source.on_progress(f);
    }
    let devices = rank_devices(device, tensor_parallel.max(1))?;
    let tokenizer = match &source {
        ModelSource::Gguf(f) => {
            TokenizerSpec::from_gguf_metadata(f.metadata()).and_then(|s| Tokenizer::from_spec(&s))
        }
        ModelSource::HfDir(m) => Tokenizer::from_hf_dir(m.dir()),
    }
    .map_err(|e| BundleError(format!("{}: tokenizer: {e}", path.display())))?;
    // FERROLM_TENSOR_PARALLEL_LOADER=1 loads even one rank through the tensor-parallel model
    // (and its reducer): checks that path on a machine with one GPU.
    let split = devices.len() > 1 || std::env::var("FERROLM_TENSOR_PARALLEL_LOADER").is_ok_and(|v| v == "1");
    let model: Box<dyn ferrolm_models::CausalLm> = match split {
        false => ferrolm_models::load(&source, &devices[0]).map_err(|e| BundleError(e.to_string()))?,
        true => Box::new(
            ferrolm_models::tensor_parallel::load(&source, &devices, reducer(&devices))
                .map_err(|e| BundleError(e.to_string()))?,
        ),
    };
    let template = ChatTemplate::from_tokenizer(&tokenizer).ok();
    let generation = match &source {
        ModelSource::HfDir(m) => m.generation.clone(),
        ModelSource::Gguf(_) => GenerationConfig::default(),
    };
    let mut eos_ids = tokenizer.eos_ids().to_vec();
    for id in &generation.eos_token_ids {
        if !eos_ids.contains(id) {
            eos_ids.push(*id);
        }
    }
    // A folder's name is its model name ("Qwen2.5-0.5B" has no extension to strip).
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    }
    .map(|s| s.to_string_lossy().into_owned())
    .unwrap_or_default();
    Ok(Bundle {
        path,
        name,
        model,
        tokenizer: Arc::new(tokenizer),
        template,
        eos_ids,
        generation,
        adapters: Default::default(),
    })
}

/// NCCL when every rank is a GPU and the build has it (feature `nccl`; a gather-sum on rank 0
/// when NCCL cannot start), else the gather-sum (the CPU simulation; GPUs without NCCL).
fn reducer(devices: &[ferrolm_backend::Device]) -> Box<dyn ferrolm_models::tensor_parallel::AllReduce> {
    #[cfg(feature = "nccl")]
    if devices.iter().all(|d| d.is_cuda()) {
        match ferrolm_models::tensor_parallel::NcclSum::new(devices) {
            Ok(nccl) => return Box::new(nccl),
            Err(e) => tracing::warn!("NCCL did not start ({e}); reducing by gathering on rank 0"),
        }
    }
    let _ = devices;
    Box::new(ferrolm_models::tensor_parallel::GatherSum)
}

impl Bundle {
    /// Renders a chat through the model's template.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        opts: &RenderOptions,
    ) -> Result<String, BundleError> {
        let template = self.template.as_ref().ok_or_else(|| {
            BundleError(format!(
                "{}: the model has no chat template",
                self.path.display()
            ))
        })?;
        template
            .render(messages, opts)
            .map_err(|e| BundleError(e.to_string()))
    }

    /// Token ids of a chat rendered through the model's template, or of raw text with the
    /// model's BOS rule. Templates write their own BOS, so chat text adds no special tokens.
    pub fn prompt_ids(
        &self,
        messages: Option<&serde_json::Value>,
        raw: &str,
    ) -> Result<Vec<u32>, BundleError> {
        let ids = match messages {
            Some(messages) => {
                let opts = RenderOptions {
                    add_generation_prompt: true,
                    ..Default::default()
                };
                let text = self.render_chat(messages, &opts)?;
                self.tokenizer.encode(&text, false)
            }
            None => self.tokenizer.encode(raw, true),
        };
        ids.map_err(|e| BundleError(e.to_string()))
    }

    /// Ids XTC never removes: "\n" and the EOS ids, as mlx_lm.server passes them.
    pub fn xtc_special_tokens(&self) -> Vec<u32> {
        let mut ids = self.tokenizer.encode("\n", false).unwrap_or_default();
        ids.extend(&self.eos_ids);
        ids
    }
}

/// The devices of `n` ranks: `cpu` n times, or n consecutive GPUs from the one `spec` names.
fn rank_devices(spec: &str, n: usize) -> Result<Vec<candle_core::Device>, BundleError> {
    let err = |e: candle_core::Error| BundleError(e.to_string());
    let first = parse_device(spec).map_err(err)?;
    if n == 1 {
        return Ok(vec![first]);
    }
    match first {
        candle_core::Device::Cpu => Ok(vec![candle_core::Device::Cpu; n]),
        _ => {
            let base = spec.strip_prefix("cuda:").and_then(|i| i.parse::<usize>().ok()).unwrap_or(0);
            (base..base + n).map(|i| ferrolm_backend::device::new_cuda(i).map_err(err)).collect()
        }
    }
}
