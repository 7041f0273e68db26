//! Tensor parallelism for the llama family (llama, mistral without windows, qwen2): the model is
//! split over `world` ranks, attention by heads (each rank holds its Q/K/V rows, the matching O
//! columns and the KV cache of its heads) and the MLP by intermediate units (gate/up rows, down
//! columns). Embedding, norms and output head are replicated; logits come from rank 0. After each
//! attention and MLP block the ranks' partial outputs are all-reduced ([`AllReduce`]).
//!
//! One driver runs the ranks in lockstep. [`GatherSum`] reduces by summing on rank 0's device:
//! on one device that is the CPU simulation of a split (the tests check it against the unsharded
//! model). On GPUs [`NcclSum`] reduces with NCCL (feature `nccl`).

use crate::config::llama_family;
use crate::layers::{self, Activation, Embedding, FusedLinear, GatedMlp, SelfAttention, SelfAttentionConfig};
use crate::llama::LlamaConfig;
use crate::loader::WeightSource;
use crate::{CausalLm, LoadError, ModelInfo, ModelSource, SeqInput};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::norm::RmsNorm;
use ferrolm_backend::shard::Rank;
use ferrolm_backend::{AttentionParams, Linear, Rope};
use ferrolm_kv::{KvCache, PlainCache, SeqCache};
use std::sync::Arc;

/// Sums the ranks' partial outputs so that every rank continues from the same activations.
pub trait AllReduce: Send + Sync {
    fn sum(&self, parts: Vec<Tensor>) -> Result<Tensor>;
}

/// NCCL's reduce to rank 0 (CUDA ranks on distinct GPUs of one host).
#[cfg(feature = "nccl")]
pub struct NcclSum(ferrolm_backend::cuda::nccl::Nccl);

#[cfg(feature = "nccl")]
impl NcclSum {
    pub fn new(devices: &[Device]) -> Result<Self> {
        Ok(Self(ferrolm_backend::cuda::nccl::Nccl::new(devices)?))
    }
}

#[cfg(feature = "nccl")]
impl AllReduce for NcclSum {
    fn sum(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        let parts = parts.into_iter().map(|p| p.contiguous()).collect::<Result<Vec<_>>>()?;
        self.0.reduce_to_first(&parts)?;
        Ok(parts[0].clone())
    }
}

/// Sums on the first part's device (in rank order, so results are deterministic).
pub struct GatherSum;

impl AllReduce for GatherSum {
    fn sum(&self, parts: Vec<Tensor>) -> Result<Tensor> {
        let mut it = parts.into_iter();
        let first = it.next().ok_or_else(|| candle_core::Error::Msg("all-reduce of no parts".into()))?;
        let dev = first.device().clone();
        it.try_fold(first, |acc, p| acc + p.to_device(&dev)?)
    }
}

struct RankLayer {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    ffn_norm: RmsNorm,
    mlp: GatedMlp,
}

struct RankModel {
    device: Device,
    layers: Vec<RankLayer>,
}

pub struct TensorParallelLlama {
    info: ModelInfo,
    cfg: LlamaConfig,
    embed: Embedding,
    norm: RmsNorm,
    lm_head: Linear,
    ranks: Vec<RankModel>,
    reduce: Box<dyn AllReduce>,
}

/// Loads a llama-family model split over one rank per device in `devices`.
pub fn load(source: &ModelSource, devices: &[Device], reduce: Box<dyn AllReduce>) -> crate::Result<TensorParallelLlama> {
    let arch = source.architecture()?;
    let cfg = match source {
        ModelSource::Gguf(f) if arch == "qwen2" => crate::qwen2::config_from_gguf(f)?,
        ModelSource::Gguf(f) => LlamaConfig::from_gguf(f)?,
        ModelSource::HfDir(m) => llama_family(&m.config)?,
    };
    let src: &dyn WeightSource = match source {
        ModelSource::Gguf(f) => f,
        ModelSource::HfDir(m) => m,
    };
    if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2") || cfg.layer_windows.iter().any(Option::is_some) || cfg.moe.is_some() {
        return Err(LoadError::UnsupportedArchitecture(format!("{arch} (tensor parallel)"), "llama and qwen2 dense, mistral without windows".into()));
    }
    TensorParallelLlama::load(cfg, src, devices, reduce)
}

impl TensorParallelLlama {
    fn load(cfg: LlamaConfig, src: &dyn WeightSource, devices: &[Device], reduce: Box<dyn AllReduce>) -> crate::Result<Self> {
        let world = devices.len();
        let ranks = devices
            .iter()
            .enumerate()
            .map(|(rank, dev)| load_rank(&cfg, src, dev, Rank { rank, world }))
            .collect::<crate::Result<Vec<_>>>()?;
        let dev0 = &devices[0];
        let embed_w = src.weight("token_embd.weight")?;
        let lm_head = crate::llama::output_head(src, &embed_w, dev0)?;
        let tied = !src.has("output.weight");
        let weight_bytes = ranks[0].layers.iter().map(|l| l.attn.weight_bytes() + l.mlp.weight_bytes()).sum::<usize>()
            + lm_head.weight_bytes();
        let info = cfg.model_info(weight_bytes);
        Ok(Self {
            info,
            embed: Embedding::tied(embed_w, None, dev0, tied.then_some(&lm_head))?,
            norm: RmsNorm::new(src.tensor("output_norm.weight", dev0)?, cfg.rms_norm_eps as f32)?,
            lm_head,
            ranks,
            reduce,
            cfg,
        })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }
}

fn shard_err(e: String) -> LoadError {
    LoadError::File { path: "tensor parallel split".into(), message: e }
}

/// One rank's layers: Q/K/V rows of its heads, O columns of its heads, gate/up rows and down
/// columns of its intermediate units.
fn load_rank(cfg: &LlamaConfig, src: &dyn WeightSource, dev: &Device, rank: Rank) -> crate::Result<RankModel> {
    let d = cfg.head_dim;
    let heads = rank.share(cfg.num_attention_heads, "attention heads").map_err(shard_err)?;
    let kv = rank.share(cfg.num_key_value_heads, "key/value heads").map_err(shard_err)?;
    let units = rank.share(cfg.intermediate_size, "intermediate units").map_err(shard_err)?;
    let rope = Arc::new(Rope::new(cfg.rope_style, d, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_freq_factors.as_deref(), dev)?);
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = |n: &str| format!("blk.{i}.{n}");
        let rows = |n: &str, r: std::ops::Range<usize>| src.weight(&p(n))?.slice_rows(r).map_err(shard_err);
        let cols = |n: &str, c: std::ops::Range<usize>| src.weight(&p(n))?.slice_cols(c).map_err(shard_err);
        let bias = |n: &str, r: std::ops::Range<usize>| -> crate::Result<Option<Tensor>> {
            Ok(match src.opt_tensor(&p(n), dev)? {
                Some(b) => Some(b.narrow(0, r.start, r.len())?),
                None => None,
            })
        };
        let (q_rows, kv_rows) = (heads.start * d..heads.end * d, kv.start * d..kv.end * d);
        let qkv = [rows("attn_q.weight", q_rows.clone())?, rows("attn_k.weight", kv_rows.clone())?, rows("attn_v.weight", kv_rows.clone())?];
        let qkv_bias = [bias("attn_q.bias", q_rows.clone())?, bias("attn_k.bias", kv_rows.clone())?, bias("attn_v.bias", kv_rows)?];
        let attn = SelfAttention {
            qkv: FusedLinear::new(&qkv.iter().collect::<Vec<_>>(), &qkv_bias, dev)?,
            o: Linear::new(&cols("attn_output.weight", q_rows)?, None, dev)?,
            q_norm: None,
            k_norm: None,
            rope: rope.clone(),
            cfg: SelfAttentionConfig {
                heads: heads.len(),
                kv_heads: kv.len(),
                head_dim: d,
                params: AttentionParams { scale: (d as f32).powf(-0.5), window: None, softcap: None },
            },
        };
        let gate_up = [rows("ffn_gate.weight", units.clone())?, rows("ffn_up.weight", units.clone())?];
        let mlp = GatedMlp {
            gate_up: FusedLinear::new(&gate_up.iter().collect::<Vec<_>>(), &[None, None], dev)?,
            down: Linear::new(&cols("ffn_down.weight", units.clone())?, None, dev)?,
            activation: Activation::Silu,
        };
        let eps = cfg.rms_norm_eps as f32;
        layers.push(RankLayer {
            attn_norm: RmsNorm::new(src.tensor(&p("attn_norm.weight"), dev)?, eps)?,
            attn,
            ffn_norm: RmsNorm::new(src.tensor(&p("ffn_norm.weight"), dev)?, eps)?,
            mlp,
        });
    }
    Ok(RankModel { device: dev.clone(), layers })
}

impl CausalLm for TensorParallelLlama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.ranks[0].device
    }

    /// Layer i of rank r is cache layer `i * world + r` (each holds that rank's heads).
    fn make_cache(&self) -> SeqCache {
        let kv_heads = self.cfg.num_key_value_heads / self.world();
        let layers = (0..self.cfg.num_hidden_layers)
            .flat_map(|_| self.ranks.iter())
            .map(|r| {
                let dtype = ferrolm_backend::kv_dtype(&r.device);
                Box::new(PlainCache::new(kv_heads, self.cfg.head_dim, dtype, &r.device)) as Box<dyn KvCache>
            })
            .collect();
        SeqCache::new(layers)
    }

    fn forward_hidden(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        let rows = layers::BatchRows::of(batch)?;
        let dev0 = self.device();
        let mut x = self.embed.forward(&layers::BatchRows::ids(batch), dev0)?;
        let world = self.world();
        for i in 0..self.cfg.num_hidden_layers {
            let mut parts = Vec::with_capacity(world);
            for (r, rank) in self.ranks.iter().enumerate() {
                let layer = &rank.layers[i];
                let mut caches: Vec<&mut dyn KvCache> = batch.iter_mut().map(|s| s.cache.layer(i * world + r)).collect();
                let xr = x.to_device(&rank.device)?;
                parts.push(layer.attn.forward(&layer.attn_norm.forward(&xr)?, &rows, &mut caches)?);
            }
            x = (x + self.reduce.sum(parts)?)?;
            let mut parts = Vec::with_capacity(world);
            for rank in &self.ranks {
                let layer = &rank.layers[i];
                let xr = x.to_device(&rank.device)?;
                parts.push(layer.mlp.forward(&layer.ffn_norm.forward(&xr)?, rows.decode_rows)?);
            }
            x = (x + self.reduce.sum(parts)?)?;
        }
        rows.decode_part(&x, |h| self.norm.forward(h))
    }

    fn project_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward_rows(hidden, hidden.dim(0)?)?.to_dtype(DType::F32)
    }
}
