//! Gemma 3 (text): local sliding-window layers interleaved with global layers, separate RoPE
//! bases for the two kinds, per-head q/k RMSNorm, "sandwich" norms around attention and MLP,
//! embeddings scaled by sqrt(hidden), GELU-tanh gated MLP, head_dim independent of hidden/heads,
//! tied output head. Local layers use the rotating cache (`kv:rotating`), global ones the plain
//! cache.
//!
//! Norm weights are used as GGUF stores them, with Gemma's `1 + w` already folded in; the
//! safetensors loader adds the 1 to checkpoint weights.

use crate::config::HfConfig;
use crate::layers::{self, Activation, Embedding, FusedLinear, GatedMlp, SelfAttention, SelfAttentionConfig};
use crate::loader::{gguf::GgufFile, WeightSource};
use crate::{CausalLm, ModelInfo, SeqInput};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::norm::RmsNorm;
use ferrolm_backend::{AttentionParams, Linear, Rope, RopeStyle};
use ferrolm_kv::{KvCache, KvScheme, RotatingCache, SeqCache};
use std::sync::Arc;

/// Hyper-parameters, named as in Hugging Face `Gemma3TextConfig`.
#[derive(Clone, Debug)]
pub struct Gemma3Config {
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    /// RoPE base of the global layers.
    pub rope_theta: f64,
    /// RoPE base of the local (sliding-window) layers.
    pub rope_local_base_freq: f64,
    /// Linear RoPE scaling factor of the global layers (Gemma 3 4B and larger use 8).
    pub rope_scaling_factor: Option<f64>,
    /// Queries are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: f64,
    pub sliding_window: usize,
    /// Per layer: true for a local (sliding-window) layer.
    pub sliding_layers: Vec<bool>,
    pub max_position_embeddings: usize,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
}

/// Every `pattern`-th layer is global (layers 5, 11, 17… for 6), the rest local.
fn pattern_layers(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers)
        .map(|i| pattern == 0 || (i + 1) % pattern != 0)
        .collect()
}

impl Gemma3Config {
    /// Reads `gemma3.*` GGUF metadata. llama.cpp hard-codes what the GGUF does not record: the
    /// local RoPE base 10000, the 5-local-1-global pattern, and the query scale
    /// 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B model).
    pub fn from_gguf(f: &GgufFile) -> crate::Result<Self> {
        let arch = f.architecture()?;
        let key = |k: &str| format!("{arch}.{k}");
        let hidden = f.u32(&key("embedding_length"))? as usize;
        let heads = f.u32(&key("attention.head_count"))? as usize;
        let layers = f.u32(&key("block_count"))? as usize;
        let head_dim = f
            .opt_u32(&key("attention.key_length"))
            .map_or(hidden / heads, |v| v as usize);
        let vocab = f
            .metadata()
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok().map(|v| v.len()))
            .unwrap_or(0);
        let scaling = match f.str(&key("rope.scaling.type")).ok() {
            Some("linear") => f.opt_f32(&key("rope.scaling.factor")).map(|x| x as f64),
            _ => None,
        };
        let query_pre_attn_scalar = if layers == 62 {
            (hidden / heads) as f64
        } else {
            head_dim as f64
        };
        Ok(Self {
            architecture: arch.clone(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: f.u32(&key("feed_forward_length"))? as usize,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: f
                .opt_u32(&key("attention.head_count_kv"))
                .unwrap_or(heads as u32) as usize,
            head_dim,
            rms_norm_eps: f
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6) as f64,
            rope_theta: f.opt_f32(&key("rope.freq_base")).unwrap_or(1e6) as f64,
            rope_local_base_freq: f.opt_f32(&key("rope.freq_base_swa")).unwrap_or(10_000.0) as f64,
            rope_scaling_factor: scaling,
            query_pre_attn_scalar,
            sliding_window: f.opt_u32(&key("attention.sliding_window")).unwrap_or(512) as usize,
            sliding_layers: pattern_layers(layers, 6),
            max_position_embeddings: f.opt_u32(&key("context_length")).unwrap_or(32768) as usize,
            attn_logit_softcapping: f.opt_f32(&key("attn_logit_softcapping")).map(|x| x as f64),
            final_logit_softcapping: f.opt_f32(&key("final_logit_softcapping")).map(|x| x as f64),
        })
    }

    /// Reads `config.json` (`gemma3_text`, or `gemma3` with a `text_config`), with the
    /// defaults of transformers' `Gemma3TextConfig` for absent keys.
    pub fn from_hf(c: &HfConfig) -> crate::Result<Self> {
        let layers = c.usize_or("num_hidden_layers", 26)?;
        let sliding_layers = match c.sliding_layers()? {
            Some(l) if l.len() == layers => l,
            Some(l) => {
                return Err(c.error(format!("{} layer_types for {layers} layers", l.len())))
            }
            None => pattern_layers(layers, c.usize_or("sliding_window_pattern", 6)?),
        };
        use crate::config::{FULL, SLIDING};
        // Scaling applies to the global (full-attention) layers only, as in transformers.
        let rope_scaling_factor = match c.rope_scaling(FULL)? {
            None => None,
            Some((kind, factor)) if kind == "linear" => Some(factor),
            Some((kind, _)) => {
                return Err(c.error(format!("unsupported rope_scaling type {kind:?} for gemma3")))
            }
        };
        let act = c
            .get("hidden_activation")
            .and_then(|v| v.as_str())
            .unwrap_or("gelu_pytorch_tanh");
        if act != "gelu_pytorch_tanh" {
            return Err(c.error(format!("unsupported hidden_activation {act:?}")));
        }
        Ok(Self {
            architecture: c.model_type()?,
            vocab_size: c.usize_or("vocab_size", 262_208)?,
            hidden_size: c.usize_or("hidden_size", 2304)?,
            intermediate_size: c.usize_or("intermediate_size", 9216)?,
            num_hidden_layers: layers,
            num_attention_heads: c.usize_or("num_attention_heads", 8)?,
            num_key_value_heads: c.usize_or("num_key_value_heads", 4)?,
            head_dim: c.usize_or("head_dim", 256)?,
            rms_norm_eps: c.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta: c.rope_theta(FULL, "rope_theta", 1e6)?,
            rope_local_base_freq: c.rope_theta(SLIDING, "rope_local_base_freq", 10_000.0)?,
            rope_scaling_factor,
            query_pre_attn_scalar: c.f64_or("query_pre_attn_scalar", 256.0)?,
            sliding_window: c.usize_or("sliding_window", 4096)?,
            sliding_layers,
            max_position_embeddings: c.usize_or("max_position_embeddings", 131_072)?,
            attn_logit_softcapping: c.opt_f64("attn_logit_softcapping")?,
            final_logit_softcapping: c.opt_f64("final_logit_softcapping")?,
        })
    }
}

struct Layer {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    post_attn_norm: RmsNorm,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
    post_ffn_norm: RmsNorm,
}

pub struct Gemma3 {
    info: ModelInfo,
    cfg: Gemma3Config,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    device: Device,
    /// How the global (full-attention) layers cache keys and values (`--kv-bits`); the local
    /// sliding-window layers stay float.
    kv: KvScheme,
}

impl Gemma3 {
    pub fn load(cfg: Gemma3Config, src: &dyn WeightSource, device: &Device) -> crate::Result<Self> {
        let half = cfg.head_dim / 2;
        let rope = |base: f64, factor: Option<f64>| -> crate::Result<Arc<Rope>> {
            let factors = factor.map(|f| vec![f as f32; half]);
            Ok(Arc::new(Rope::new(
                RopeStyle::HalfSplit,
                cfg.head_dim,
                base,
                cfg.max_position_embeddings,
                factors.as_deref(),
                device,
            )?))
        };
        let local = rope(cfg.rope_local_base_freq, None)?;
        let global = rope(cfg.rope_theta, cfg.rope_scaling_factor)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let r = if cfg.sliding_layers[i] { &local } else { &global };
                load_layer(&cfg, src, device, i, r)
            })
            .collect::<crate::Result<Vec<_>>>()?;
        let embed_w = src.weight("token_embd.weight")?;
        let tied = !src.has("output.weight");
        let lm_head = match !tied {
            true => Linear::head(&src.weight("output.weight")?, device)?,
            false => Linear::head(&embed_w, device)?,
        };
        let weight_bytes = layers
            .iter()
            .map(|l| l.attn.weight_bytes() + l.mlp.weight_bytes())
            .sum::<usize>()
            + lm_head.weight_bytes();
        let info = ModelInfo {
            architecture: cfg.architecture.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            num_layers: cfg.num_hidden_layers,
            context_length: cfg.max_position_embeddings,
            weight_bytes,
        };
        let scale = (cfg.hidden_size as f64).sqrt();
        Ok(Self {
            info,
            embed: Embedding::tied(embed_w, Some(scale), device, tied.then_some(&lm_head))?,
            norm: RmsNorm::new(
                src.tensor("output_norm.weight", device)?,
                cfg.rms_norm_eps as f32,
            )?,
            lm_head,
            layers,
            device: device.clone(),
            cfg,
            kv: KvScheme::default(),
        })
    }
}

fn load_layer(
    cfg: &Gemma3Config,
    src: &dyn WeightSource,
    dev: &Device,
    i: usize,
    rope: &Arc<Rope>,
) -> crate::Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let linear = |n: &str| -> crate::Result<Linear> {
        Ok(Linear::new(&src.weight(&p(n))?, None, dev)?)
    };
    let fused = |names: &[&str]| -> crate::Result<FusedLinear> {
        let weights = names.iter().map(|n| src.weight(&p(&format!("{n}.weight")))).collect::<crate::Result<Vec<_>>>()?;
        Ok(FusedLinear::new(&weights.iter().collect::<Vec<_>>(), &vec![None; names.len()], dev)?)
    };
    let eps = cfg.rms_norm_eps as f32;
    let norm = |n: &str| -> crate::Result<RmsNorm> {
        Ok(RmsNorm::new(src.tensor(&p(n), dev)?, eps)?)
    };
    let attn = SelfAttention {
        qkv: fused(&["attn_q", "attn_k", "attn_v"])?,
        o: linear("attn_output.weight")?,
        q_norm: Some(norm("attn_q_norm.weight")?),
        k_norm: Some(norm("attn_k_norm.weight")?),
        rope: rope.clone(),
        cfg: SelfAttentionConfig {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            params: AttentionParams {
                scale: cfg.query_pre_attn_scalar.powf(-0.5) as f32,
                window: cfg.sliding_layers[i].then_some(cfg.sliding_window),
                softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            },
        },
    };
    let mlp = GatedMlp {
        gate_up: fused(&["ffn_gate", "ffn_up"])?,
        down: linear("ffn_down.weight")?,
        activation: Activation::GeluTanh,
    };
    Ok(Layer {
        attn_norm: norm("attn_norm.weight")?,
        attn,
        post_attn_norm: norm("post_attention_norm.weight")?,
        ffn_norm: norm("ffn_norm.weight")?,
        mlp,
        post_ffn_norm: norm("post_ffw_norm.weight")?,
    })
}

impl CausalLm for Gemma3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn make_cache(&self) -> SeqCache {
        let c = &self.cfg;
        let (heads, dim, dev) = (c.num_key_value_heads, c.head_dim, &self.device);
        let layers = c
            .sliding_layers
            .iter()
            .map(|&local| -> Box<dyn KvCache> {
                if local {
                    Box::new(RotatingCache::new(heads, dim, c.sliding_window, ferrolm_backend::kv_dtype(dev), dev))
                } else {
                    self.kv.full_layer(heads, dim, ferrolm_backend::kv_dtype(dev), dev)
                }
            })
            .collect();
        SeqCache::new(layers)
    }

    fn set_kv_scheme(&mut self, scheme: KvScheme) -> std::result::Result<(), String> {
        scheme.check(self.cfg.head_dim, &self.device)?;
        self.kv = scheme;
        Ok(())
    }

    fn forward_hidden(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        let rows = layers::BatchRows::of(batch)?;
        let mut x = self.embed.forward(&layers::BatchRows::ids(batch), &self.device)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut caches: Vec<&mut dyn KvCache> =
                batch.iter_mut().map(|s| s.cache.layer(i)).collect();
            let h = layer
                .attn
                .forward(&layer.attn_norm.forward(&x)?, &rows, &mut caches)?;
            x = (x + layer.post_attn_norm.forward(&h)?)?;
            let h = layer.mlp.forward(&layer.ffn_norm.forward(&x)?, rows.decode_rows)?;
            x = (x + layer.post_ffn_norm.forward(&h)?)?;
        }
        rows.decode_part(&x, |h| self.norm.forward(h))
    }

    fn project_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward_rows(hidden, hidden.dim(0)?)?.to_dtype(DType::F32)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::pattern_layers;

    #[test]
    fn every_sixth_layer_is_global() {
        let l = pattern_layers(18, 6);
        let global: Vec<usize> = (0..18).filter(|&i| !l[i]).collect();
        assert_eq!(global, vec![5, 11, 17]);
    }
}
