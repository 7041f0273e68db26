//! Hugging Face model-folder configuration: `config.json` (architecture hyper-parameters) and
//! `generation_config.json` (EOS ids and sampling defaults). Each architecture reads the keys it
//! needs through [`HfConfig`], with the defaults transformers applies when a key is absent.

use crate::layers::Routing;
use crate::llama::{LlamaConfig, MoeConfig};
use crate::{LoadError, Result};
use ferrolm_backend::RopeStyle;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `config.json` of a model folder. Multimodal wrappers (`gemma3`) keep the language model's
/// keys under `text_config`; lookups read there first, then the root.
#[derive(Clone, Debug)]
pub struct HfConfig {
    path: PathBuf,
    root: Value,
}

impl HfConfig {
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let value = read_json(&path)?;
        Self::from_value(path, value)
    }

    pub fn from_value(path: PathBuf, root: Value) -> Result<Self> {
        let this = Self { path, root };
        if !this.root.is_object() {
            return Err(this.error("not a JSON object".into()));
        }
        this.model_type()?;
        Ok(this)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoint's `model_type` (`llama`, `qwen2`, `gemma3_text`, `gemma3`, `mistral`…).
    pub fn model_type(&self) -> Result<String> {
        self.root
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| self.error("missing \"model_type\"".into()))
    }

    /// The value of `key`, from `text_config` when the folder is a multimodal wrapper.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let text = self.root.get("text_config").and_then(|t| t.get(key));
        text.or_else(|| self.root.get(key)).filter(|v| !v.is_null())
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.error(format!("\"{key}\" must be a non-negative integer"))),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.error(format!("missing \"{key}\"")))
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(format!("\"{key}\" must be a number"))),
        }
    }

    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> bool {
        self.get(key).and_then(Value::as_bool).unwrap_or(default)
    }

    /// The RoPE section for one kind of attention layer. transformers ≥ 5 writes
    /// `rope_parameters`, flat (`{rope_theta, rope_type, factor…}`) or per layer type
    /// (`{"full_attention": {…}, "sliding_attention": {…}}`, Gemma 3); older configs have
    /// `rope_scaling` (type and factor only) beside a top-level `rope_theta`.
    pub fn rope_section(&self, layer_kind: &str) -> Option<&Value> {
        let s = self.get("rope_scaling").or_else(|| self.get("rope_parameters"))?;
        match s.get(layer_kind) {
            Some(per_kind) if per_kind.is_object() => Some(per_kind),
            _ if s.get("full_attention").is_some() || s.get("sliding_attention").is_some() => None,
            _ => Some(s),
        }
    }

    /// RoPE base of `layer_kind` (`full_attention` or `sliding_attention`): the section's
    /// `rope_theta`, else the top-level `legacy_key` (`rope_theta`, Gemma's
    /// `rope_local_base_freq`), else `default`.
    pub fn rope_theta(&self, layer_kind: &str, legacy_key: &str, default: f64) -> Result<f64> {
        let from_section = self.rope_section(layer_kind).and_then(|s| s.get("rope_theta")).and_then(Value::as_f64);
        match from_section {
            Some(theta) => Ok(theta),
            None => self.f64_or(legacy_key, default),
        }
    }

    /// RoPE scaling of `layer_kind` as `(type, factor)`; `None` when absent or of the plain
    /// `default` type.
    pub fn rope_scaling(&self, layer_kind: &str) -> Result<Option<(String, f64)>> {
        let Some(s) = self.rope_section(layer_kind) else {
            return Ok(None);
        };
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if kind == "default" {
            return Ok(None);
        }
        let factor = s.get("factor").and_then(Value::as_f64).unwrap_or(1.0);
        Ok(Some((kind.to_string(), factor)))
    }

    /// Per-layer "uses the sliding window" from `layer_types`, when the config lists them.
    pub fn sliding_layers(&self) -> Result<Option<Vec<bool>>> {
        let Some(list) = self.get("layer_types") else {
            return Ok(None);
        };
        let list = list
            .as_array()
            .ok_or_else(|| self.error("\"layer_types\" must be a list".into()))?;
        list.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                other => Err(self.error(format!("unsupported layer type {other:?}"))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    pub fn error(&self, message: String) -> LoadError {
        LoadError::File {
            path: self.path.display().to_string(),
            message,
        }
    }
}

/// Layer kinds as transformers' `layer_types` and `rope_parameters` name them.
pub const FULL: &str = "full_attention";
pub const SLIDING: &str = "sliding_attention";

/// `config.json` of the llama family (`llama`, `mistral`, `qwen2`, `qwen3`), with transformers'
/// defaults for absent keys. Checkpoints keep Q/K rows in half-split order (only llama.cpp's
/// GGUF conversion permutes them).
pub fn llama_family(c: &HfConfig) -> Result<LlamaConfig> {
    let arch = c.model_type()?;
    let heads = c.usize("num_attention_heads")?;
    let hidden = c.usize("hidden_size")?;
    let head_dim = c.usize_or("head_dim", hidden / heads)?;
    let rope_theta = c.rope_theta(FULL, "rope_theta", 10_000.0)?;
    let rope_freq_factors = match c.rope_scaling(FULL)? {
        None => None,
        Some((kind, _)) if kind == "llama3" => Some(llama3_freq_factors(c, head_dim, rope_theta)?),
        Some((kind, _)) => return Err(c.error(format!("unsupported rope_scaling type {kind:?} for {arch}"))),
    };
    let act = c.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
    if act != "silu" {
        return Err(c.error(format!("unsupported hidden_act {act:?}")));
    }
    let layers = c.usize("num_hidden_layers")?;
    let window = match arch.as_str() {
        // transformers applies Mixtral's window as Mistral's (null in its released configs).
        "mistral" | "mixtral" => c.opt_usize("sliding_window")?,
        "qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe" if c.bool_or("use_sliding_window", false) => {
            return Err(c.error(format!("{arch} with use_sliding_window is not supported")))
        }
        _ => None,
    };
    // `layer_types` (newer transformers, mlx-lm's llama) names the kind of each layer;
    // otherwise Mistral's window applies to every layer.
    let layer_windows = match (c.sliding_layers()?, window) {
        (Some(l), _) if l.len() != layers => {
            return Err(c.error(format!("{} layer_types for {layers} layers", l.len())))
        }
        (Some(l), _) if l.iter().any(|&s| s) => {
            let w = c.opt_usize("sliding_window")?.ok_or_else(|| {
                c.error("sliding_attention layers without \"sliding_window\"".into())
            })?;
            l.iter().map(|&s| s.then_some(w)).collect()
        }
        (Some(_), _) | (None, None) => Vec::new(),
        (None, Some(w)) => vec![Some(w); layers],
    };
    Ok(LlamaConfig {
        vocab_size: c.usize("vocab_size")?,
        hidden_size: hidden,
        intermediate_size: c.usize("intermediate_size")?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: c.usize_or("num_key_value_heads", heads)?,
        head_dim,
        rms_norm_eps: c.f64_or("rms_norm_eps", 1e-6)?,
        rope_theta,
        max_position_embeddings: c.usize_or("max_position_embeddings", 4096)?,
        rope_style: RopeStyle::HalfSplit,
        layer_windows,
        qk_norm: matches!(arch.as_str(), "qwen3" | "qwen3_moe"),
        rope_freq_factors,
        moe: moe_config(c, &arch)?,
        architecture: arch,
    })
}

/// The experts of a sparse `config.json` (`num_experts`, or `num_local_experts` as Mixtral and
/// transformers 5 write it); `None` for dense models. Qwen3-MoE and Qwen2-MoE renormalize the
/// top-k weights when `norm_topk_prob` says so, Mixtral always. Which layers are sparse
/// (`decoder_sparse_step`, `mlp_only_layers`) is read from the weights: a layer with a router.
fn moe_config(c: &HfConfig, arch: &str) -> Result<Option<MoeConfig>> {
    let experts = match c.opt_usize("num_experts")? {
        Some(n) => Some(n),
        None => c.opt_usize("num_local_experts")?,
    };
    let Some(experts) = experts.filter(|&n| n > 0) else { return Ok(None) };
    let renormalize = match arch {
        "mixtral" => true,
        _ => c.bool_or("norm_topk_prob", false),
    };
    let top_k = c.usize("num_experts_per_tok")?;
    if top_k == 0 || top_k > experts {
        return Err(c.error(format!("num_experts_per_tok {top_k} for {experts} experts")));
    }
    Ok(Some(MoeConfig { experts, routing: Routing { top_k, renormalize } }))
}

/// Llama 3.x RoPE scaling as a divisor per frequency pair, as transformers'
/// `_compute_llama3_parameters` and llama.cpp's converter (`rope_freqs.weight`) compute it:
/// wavelengths shorter than `original / high_freq_factor` are kept, longer than
/// `original / low_freq_factor` divided by `factor`, those between smoothly interpolated.
fn llama3_freq_factors(c: &HfConfig, head_dim: usize, theta: f64) -> Result<Vec<f32>> {
    let s = c.rope_section(FULL).ok_or_else(|| c.error("llama3 rope_scaling without parameters".into()))?;
    let num = |k: &str| s.get(k).and_then(Value::as_f64).ok_or_else(|| c.error(format!("llama3 rope_scaling without \"{k}\"")));
    let (factor, low, high) = (num("factor")?, num("low_freq_factor")?, num("high_freq_factor")?);
    let original = num("original_max_position_embeddings")?;
    if high <= low {
        return Err(c.error(format!("llama3 rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}")));
    }
    let (low_wavelen, high_wavelen) = (original / low, original / high);
    let factors = (0..head_dim / 2).map(|i| {
        let wavelen = 2.0 * std::f64::consts::PI * theta.powf(2.0 * i as f64 / head_dim as f64);
        if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor as f32
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
        }
    });
    Ok(factors.collect())
}

/// Sampling defaults and stop ids from `generation_config.json` (all optional): the layer
/// between the server's built-in defaults and a request's own values (DESIGN §2).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// `eos_token_id`, a number or a list.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json`; an absent file gives the empty config.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        Ok(Self::from_value(&read_json(&path)?))
    }

    pub fn from_value(v: &Value) -> Self {
        let f = |k: &str| v.get(k).and_then(Value::as_f64).map(|x| x as f32);
        let u = |k: &str| v.get(k).and_then(Value::as_u64);
        let eos_token_ids = match v.get("eos_token_id") {
            Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_u64).map(|i| i as u32).collect(),
            Some(id) => id.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
            None => Vec::new(),
        };
        Self {
            eos_token_ids,
            bos_token_id: u("bos_token_id").map(|i| i as u32),
            do_sample: v.get("do_sample").and_then(Value::as_bool),
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: u("top_k").map(|k| k as usize),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
            max_new_tokens: u("max_new_tokens").map(|k| k as usize),
        }
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let err = |message: String| LoadError::File {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_config_keys_win_and_nulls_are_absent() {
        let c = HfConfig::from_value(
            "config.json".into(),
            json!({"model_type": "gemma3", "hidden_size": 1, "sliding_window": null,
                   "text_config": {"hidden_size": 640, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}}),
        )
        .unwrap();
        assert_eq!(c.usize("hidden_size").unwrap(), 640);
        assert_eq!(c.opt_usize("sliding_window").unwrap(), None);
        assert_eq!(c.rope_scaling(FULL).unwrap(), Some(("linear".into(), 8.0)));
        assert!(c.usize("num_hidden_layers").unwrap_err().to_string().contains("num_hidden_layers"));
    }

    /// transformers 5 writes `rope_parameters`: flat for llama, per layer type for Gemma 3.
    #[test]
    fn rope_parameters_of_transformers_5_configs() {
        let c = HfConfig::from_value(
            "config.json".into(),
            json!({"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}),
        )
        .unwrap();
        assert_eq!(c.rope_theta(FULL, "rope_theta", 10_000.0).unwrap(), 500000.0);
        assert_eq!(c.rope_scaling(FULL).unwrap(), None);
        let c = HfConfig::from_value(
            "config.json".into(),
            json!({"model_type": "gemma3_text", "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
        )
        .unwrap();
        assert_eq!(c.rope_theta(FULL, "rope_theta", 1.0).unwrap(), 1e6);
        assert_eq!(c.rope_theta(SLIDING, "rope_local_base_freq", 1.0).unwrap(), 1e4);
        assert_eq!(c.rope_scaling(FULL).unwrap(), Some(("linear".into(), 8.0)));
        assert_eq!(c.rope_scaling(SLIDING).unwrap(), None);
        let legacy = HfConfig::from_value("config.json".into(), json!({"model_type": "llama", "rope_theta": 5.0})).unwrap();
        assert_eq!(legacy.rope_theta(FULL, "rope_theta", 10_000.0).unwrap(), 5.0);
    }

    #[test]
    fn generation_config_accepts_one_or_many_eos_ids() {
        let g = GenerationConfig::from_value(&json!({"eos_token_id": [1, 106], "top_k": 64, "temperature": 1.0}));
        assert_eq!(g.eos_token_ids, vec![1, 106]);
        assert_eq!(g.top_k, Some(64));
        assert_eq!(g.temperature, Some(1.0));
        let g = GenerationConfig::from_value(&json!({"eos_token_id": 151645}));
        assert_eq!(g.eos_token_ids, vec![151645]);
    }
}
