//! The llama architecture (SmolLM2, Llama 2/3 with Llama 3.x RoPE scaling, Mistral): RMSNorm,
//! grouped-query attention with RoPE, SwiGLU MLP, tied or untied output head. Qwen2 reuses it
//! with QKV biases and half-split RoPE, Qwen3 with per-head q/k norms.

use crate::layers::{self, fused_decode_step, Activation, Embedding, FusedLinear, GatedMlp, MoeMlp, Routing, SelfAttention, SelfAttentionConfig, SharedExpert};
use crate::loader::{gguf::GgufFile, WeightSource};
use crate::lora::LoraBase;
use crate::{CausalLm, ModelInfo, SeqInput};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::norm::RmsNorm;
use ferrolm_backend::{AttentionParams, Linear, Rope, RopeStyle, RowInput};
use ferrolm_kv::{KvCache, KvScheme, RotatingCache, SeqCache};
use crate::batch_graph::{BatchGraphSettings, BatchGraphs, ModelShape};
use std::sync::{Arc, Mutex};

/// Hyper-parameters, named as in Hugging Face `config.json`.
#[derive(Clone, Debug)]
pub struct LlamaConfig {
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub rope_style: RopeStyle,
    /// Per layer, the sliding window (keys fewer than this many positions back) of a windowed
    /// layer (Mistral); empty when no layer has one.
    pub layer_windows: Vec<Option<usize>>,
    /// Per-head RMSNorm of queries and keys before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Divisors of each RoPE pair's frequency (Llama 3.x scaling: GGUF's `rope_freqs.weight`,
    /// computed from `rope_scaling` for folders); `None` for plain RoPE.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral) on the layers that have a
    /// router (`blk.N.ffn_gate_inp.weight`); the other layers are dense.
    pub moe: Option<MoeConfig>,
}

#[derive(Clone, Copy, Debug)]
pub struct MoeConfig {
    pub experts: usize,
    pub routing: Routing,
}

impl MoeConfig {
    /// `<arch>.expert_count` / `expert_used_count`; the renormalization is the family's
    /// (llama.cpp's graph fixes it per architecture: on for qwen3moe and Mixtral's llama, off
    /// for qwen2moe).
    fn from_gguf(f: &GgufFile, arch: &str) -> Option<Self> {
        let experts = f.opt_u32(&format!("{arch}.expert_count")).filter(|&n| n > 0)? as usize;
        let top_k = f.opt_u32(&format!("{arch}.expert_used_count")).unwrap_or(2) as usize;
        Some(Self { experts, routing: Routing { top_k, renormalize: arch != "qwen2moe" } })
    }
}

impl LlamaConfig {
    /// Reads `<arch>.*` GGUF metadata. llama.cpp permutes llama Q/K rows for interleaved RoPE;
    /// other architectures in this family (qwen2) keep half-split.
    pub fn from_gguf(f: &GgufFile) -> crate::Result<Self> {
        let arch = f.architecture()?;
        let key = |k: &str| format!("{arch}.{k}");
        let heads = f.u32(&key("attention.head_count"))? as usize;
        let hidden = f.u32(&key("embedding_length"))? as usize;
        let vocab = match f.metadata().get("tokenizer.ggml.tokens") {
            Some(v) => v.to_vec().map(|v| v.len()).unwrap_or(0),
            None => 0,
        };
        let vocab = f
            .opt_u32(&key("vocab_size"))
            .map(|v| v as usize)
            .unwrap_or(vocab);
        Ok(Self {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: f.u32(&key("feed_forward_length"))? as usize,
            num_hidden_layers: f.u32(&key("block_count"))? as usize,
            num_attention_heads: heads,
            num_key_value_heads: f
                .opt_u32(&key("attention.head_count_kv"))
                .unwrap_or(heads as u32) as usize,
            head_dim: f
                .opt_u32(&key("attention.key_length"))
                .map_or(hidden / heads, |v| v as usize),
            rms_norm_eps: f
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f64,
            rope_theta: f.opt_f32(&key("rope.freq_base")).unwrap_or(10_000.0) as f64,
            max_position_embeddings: f.opt_u32(&key("context_length")).unwrap_or(4096) as usize,
            rope_style: if arch == "llama" {
                RopeStyle::Interleaved
            } else {
                RopeStyle::HalfSplit
            },
            layer_windows: Vec::new(),
            qk_norm: matches!(arch.as_str(), "qwen3" | "qwen3moe"),
            rope_freq_factors: rope_freq_factors(f)?,
            moe: MoeConfig::from_gguf(f, &arch),
            architecture: arch,
        })
    }
}

/// llama.cpp's converter writes Llama 3.x RoPE scaling as one divisor per frequency pair.
fn rope_freq_factors(f: &GgufFile) -> crate::Result<Option<Vec<f32>>> {
    if !f.has_tensor("rope_freqs.weight") {
        return Ok(None);
    }
    let t = f.tensor("rope_freqs.weight", &Device::Cpu)?;
    Ok(Some(t.flatten_all()?.to_vec1::<f32>()?))
}

impl LlamaConfig {
    /// The facts the engine needs, with the weight bytes a decode step reads.
    pub fn model_info(&self, weight_bytes: usize) -> ModelInfo {
        ModelInfo {
            architecture: self.architecture.clone(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_hidden_layers,
            context_length: self.max_position_embeddings,
            weight_bytes,
        }
    }
}

/// The output projection: `output.weight`, or the token embeddings when they are tied.
pub(crate) fn output_head(src: &dyn WeightSource, embed_w: &ferrolm_backend::Weight, device: &Device) -> crate::Result<Linear> {
    Ok(match src.has("output.weight") {
        true => Linear::head(&src.weight("output.weight")?, device)?,
        false => Linear::head(embed_w, device)?,
    })
}

struct Layer {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    ffn_norm: RmsNorm,
    mlp: Ffn,
}

/// A layer's feed-forward block.
enum Ffn {
    Dense(GatedMlp),
    Sparse(MoeMlp),
}

impl Ffn {
    /// Layer `layer`'s block over `x`; LoRA adapters apply to dense MLPs only (the base refuses
    /// adapters for expert layers when they are mounted).
    fn forward(&self, x: &Tensor, rows: &layers::BatchRows, layer: usize) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward_adapted(x, rows, layer),
            Ffn::Sparse(m) => m.forward(x, rows.decode_rows),
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Ffn::Dense(m) => m.weight_bytes(),
            Ffn::Sparse(m) => m.weight_bytes(),
        }
    }
}

pub struct Llama {
    info: ModelInfo,
    cfg: LlamaConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    device: Device,
    /// How full-attention layers cache keys and values (`--kv-bits`).
    kv: KvScheme,
    /// Captured batched decode steps per batch-size bucket (`batch_graph`).
    batch_graphs: Mutex<BatchGraphs>,
}

impl Llama {
    pub fn load(cfg: LlamaConfig, src: &dyn WeightSource, device: &Device) -> crate::Result<Self> {
        let rope = Arc::new(Rope::new(
            cfg.rope_style,
            cfg.head_dim,
            cfg.rope_theta,
            cfg.max_position_embeddings,
            cfg.rope_freq_factors.as_deref(),
            device,
        )?);
        if let Some(ff) = &cfg.rope_freq_factors {
            if ff.len() != cfg.head_dim / 2 {
                return Err(crate::LoadError::File {
                    path: src.origin(),
                    message: format!("{} RoPE frequency factors for head_dim {}", ff.len(), cfg.head_dim),
                });
            }
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| load_layer(&cfg, src, device, i, &rope))
            .collect::<crate::Result<Vec<_>>>()?;
        let embed_w = src.weight("token_embd.weight")?;
        let lm_head = output_head(src, &embed_w, device)?;
        let tied = !src.has("output.weight");
        let weight_bytes = layers
            .iter()
            .map(|l| l.attn.weight_bytes() + l.mlp.weight_bytes())
            .sum::<usize>()
            + lm_head.weight_bytes();
        let info = cfg.model_info(weight_bytes);
        Ok(Self {
            info,
            embed: Embedding::tied(embed_w, None, device, tied.then_some(&lm_head))?,
            norm: RmsNorm::new(
                src.tensor("output_norm.weight", device)?,
                cfg.rms_norm_eps as f32,
            )?,
            lm_head,
            layers,
            device: device.clone(),
            cfg,
            kv: KvScheme::default(),
            batch_graphs: Mutex::new(BatchGraphs::new(BatchGraphSettings::default())),
        })
    }

    /// The layers of [`CausalLm::decode_static`]: the last hidden row before the final norm.
    fn static_hidden(&self, token: &Tensor, pos: &Tensor, kv: &[(Tensor, Tensor)]) -> Result<Option<Tensor>> {
        if kv.len() != self.layers.len() || !self.has_static_decode() {
            return Ok(None);
        }
        let mut x = self.embed.forward_tensor(token, &self.device)?;
        for (layer, (ck, cv)) in self.layers.iter().zip(kv) {
            let Ffn::Dense(mlp) = &layer.mlp else { return Ok(None) };
            if let Some(y) = fused_decode_step(&layer.attn_norm, &layer.attn, &layer.ffn_norm, mlp, &x, pos, ck, cv)? {
                x = y;
                continue;
            }
            x = layer.attn.forward_static(&x, &layer.attn_norm, pos, ck, cv)?;
            x = mlp.forward_row(&x, &layer.ffn_norm)?;
        }
        Ok(Some(x))
    }

    /// A forward of one-token decode rows only, through a captured step of their batch-size
    /// bucket (`batch_graph`); None when the batch, the model or the device does not take it.
    fn batched_step(&self, batch: &mut [SeqInput<'_>]) -> Result<Option<Tensor>> {
        if batch.is_empty() || !self.has_static_decode() || !ferrolm_backend::graph::supported(&self.device) {
            return Ok(None);
        }
        let c = &self.cfg;
        let shape = ModelShape { layers: c.num_hidden_layers, heads: c.num_attention_heads, hidden: c.hidden_size, dtype: ferrolm_backend::activation_dtype(&self.device) };
        let mut graphs = self.batch_graphs.lock().map_err(|_| candle_core::Error::Msg("batched step graphs: a step panicked".into()))?;
        let step = |tokens: &Tensor, tables: &Tensor, splits: usize| self.table_hidden(tokens, tables, splits);
        graphs.forward(&self.device, &shape, batch, &|| self.make_cache(), &step)
    }

    /// The batched step over device inputs (`batch_graph::TableStep`): token ids `[B]`, each
    /// layer's decode table, the attention's split count → the final-normed hidden rows.
    fn table_hidden(&self, tokens: &Tensor, tables: &Tensor, splits: usize) -> Result<Option<Tensor>> {
        let rows = layers::BatchRows::decode_only(tokens.dim(0)?);
        let mut x = self.embed.forward_tensor(tokens, &self.device)?;
        let Some(first) = self.layers.first() else { return Ok(None) };
        let mut normed = first.attn_norm.forward(&x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let Some(h) = layer.attn.forward_table(&normed, &tables.get(i)?, splits)? else { return Ok(None) };
            let (sum, ffn_in) = layer.ffn_norm.forward_add(&x, &h)?;
            let h = layer.mlp.forward(&ffn_in, &rows, i)?;
            match self.layers.get(i + 1) {
                Some(next) => (x, normed) = next.attn_norm.forward_add(&sum, &h)?,
                None => x = (sum + h)?,
            }
        }
        self.norm.forward(&x).map(Some)
    }

    /// The final norm and the f32 logits of a static step's hidden row: inside the head's
    /// product where the backend can (its blocks each normalize the 2-8 KB row once).
    fn static_logits(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(logits) = self.lm_head.forward_row_logits(RowInput::Normed(x, &self.norm))? {
            return Ok(logits);
        }
        self.project_logits(&self.norm.forward(x)?)
    }
}

fn load_layer(
    cfg: &LlamaConfig,
    src: &dyn WeightSource,
    dev: &Device,
    i: usize,
    rope: &Arc<Rope>,
) -> crate::Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let linear = |n: &str, bias: &str| -> crate::Result<Linear> {
        Ok(Linear::new(
            &src.weight(&p(n))?,
            src.opt_tensor(&p(bias), dev)?,
            dev,
        )?)
    };
    // Projections of one input, stacked into one product where the formats allow.
    let fused = |names: &[&str]| -> crate::Result<FusedLinear> {
        let weights = names.iter().map(|n| src.weight(&p(&format!("{n}.weight")))).collect::<crate::Result<Vec<_>>>()?;
        let biases = names.iter().map(|n| src.opt_tensor(&p(&format!("{n}.bias")), dev)).collect::<crate::Result<Vec<_>>>()?;
        Ok(FusedLinear::new(&weights.iter().collect::<Vec<_>>(), &biases, dev)?)
    };
    let eps = cfg.rms_norm_eps as f32;
    let norm = |n: &str| -> crate::Result<RmsNorm> { Ok(RmsNorm::new(src.tensor(&p(n), dev)?, eps)?) };
    let attn = SelfAttention {
        qkv: fused(&["attn_q", "attn_k", "attn_v"])?,
        o: linear("attn_output.weight", "attn_output.bias")?,
        q_norm: cfg.qk_norm.then(|| norm("attn_q_norm.weight")).transpose()?,
        k_norm: cfg.qk_norm.then(|| norm("attn_k_norm.weight")).transpose()?,
        rope: rope.clone(),
        cfg: SelfAttentionConfig {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            params: AttentionParams {
                scale: (cfg.head_dim as f32).powf(-0.5),
                window: cfg.layer_windows.get(i).copied().flatten(),
                softcap: None,
            },
        },
    };
    let mlp = match cfg.moe {
        Some(moe) if src.has(&p("ffn_gate_inp.weight")) => Ffn::Sparse(load_moe(moe, src, dev, i)?),
        _ => Ffn::Dense(GatedMlp {
            gate_up: fused(&["ffn_gate", "ffn_up"])?,
            down: linear("ffn_down.weight", "ffn_down.bias")?,
            activation: Activation::Silu,
        }),
    };
    Ok(Layer {
        attn_norm: norm("attn_norm.weight")?,
        attn,
        ffn_norm: norm("ffn_norm.weight")?,
        mlp,
    })
}

/// Layer i's router, experts (split from the stacked tensors) and shared expert, if any.
fn load_moe(moe: MoeConfig, src: &dyn WeightSource, dev: &Device, i: usize) -> crate::Result<MoeMlp> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let gate = src.expert_weights(&p("ffn_gate_exps.weight"), moe.experts)?;
    let up = src.expert_weights(&p("ffn_up_exps.weight"), moe.experts)?;
    let down = src.expert_weights(&p("ffn_down_exps.weight"), moe.experts)?;
    let experts = (0..moe.experts)
        .map(|e| -> crate::Result<GatedMlp> {
            Ok(GatedMlp {
                gate_up: FusedLinear::new(&[&gate[e], &up[e]], &[None, None], dev)?,
                down: Linear::new(&down[e], None, dev)?,
                activation: Activation::Silu,
            })
        })
        .collect::<crate::Result<Vec<_>>>()?;
    let shared = match src.has(&p("ffn_gate_shexp.weight")) {
        false => None,
        true => Some(SharedExpert {
            mlp: GatedMlp {
                gate_up: FusedLinear::new(&[&src.weight(&p("ffn_gate_shexp.weight"))?, &src.weight(&p("ffn_up_shexp.weight"))?], &[None, None], dev)?,
                down: Linear::new(&src.weight(&p("ffn_down_shexp.weight"))?, None, dev)?,
                activation: Activation::Silu,
            },
            gate: match src.has(&p("ffn_gate_inp_shexp.weight")) {
                true => Some(Linear::new(&as_matrix(src.weight(&p("ffn_gate_inp_shexp.weight"))?), None, dev)?),
                false => None,
            },
        }),
    };
    Ok(MoeMlp { router: Linear::new(&src.weight(&p("ffn_gate_inp.weight"))?, None, dev)?, experts, routing: moe.routing, shared })
}

/// A vector weight (GGUF's `[hidden]` shared-expert gate) as the one-row matrix `[1, hidden]`.
fn as_matrix(mut w: ferrolm_backend::Weight) -> ferrolm_backend::Weight {
    if w.dims.len() == 1 {
        w.dims.insert(0, 1);
    }
    w
}

/// A layer's dense linears as `(in, out)` in `Target` order (q, k, v, o, gate, up, down); the
/// MLP's are None on an expert layer.
fn lora_shapes(hidden: usize, layer: &Layer) -> [Option<(usize, usize)>; 7] {
    let widths = |f: &FusedLinear| -> Vec<usize> {
        match f {
            FusedLinear::Stacked { widths, .. } => widths.clone(),
            FusedLinear::Separate(parts) => parts.iter().map(Linear::out_features).collect(),
        }
    };
    let qkv = widths(&layer.attn.qkv);
    let attn = [(hidden, qkv[0]), (hidden, qkv[1]), (hidden, qkv[2]), (qkv[0], layer.attn.o.out_features())].map(Some);
    let mlp = match &layer.mlp {
        Ffn::Dense(m) => {
            let gu = widths(&m.gate_up);
            [(hidden, gu[0]), (hidden, gu[1]), (gu[1], m.down.out_features())].map(Some)
        }
        Ffn::Sparse(_) => [None; 3],
    };
    [attn[0], attn[1], attn[2], attn[3], mlp[0], mlp[1], mlp[2]]
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn make_cache(&self) -> SeqCache {
        let c = &self.cfg;
        let layers = (0..c.num_hidden_layers)
            .map(|i| match c.layer_windows.get(i).copied().flatten() {
                Some(w) => Box::new(RotatingCache::new(
                    c.num_key_value_heads,
                    c.head_dim,
                    w,
                    ferrolm_backend::kv_dtype(&self.device),
                    &self.device,
                )) as Box<dyn KvCache>,
                None => self.kv.full_layer(c.num_key_value_heads, c.head_dim, ferrolm_backend::kv_dtype(&self.device), &self.device),
            })
            .collect();
        SeqCache::new(layers)
    }

    fn set_kv_scheme(&mut self, scheme: KvScheme) -> std::result::Result<(), String> {
        scheme.check(self.cfg.head_dim, &self.device)?;
        self.kv = scheme;
        Ok(())
    }

    fn set_batch_graphs(&mut self, settings: BatchGraphSettings) {
        self.batch_graphs = Mutex::new(BatchGraphs::new(settings));
    }

    fn forward_hidden(&self, batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        if let Some(hidden) = self.batched_step(batch)? {
            return Ok(hidden);
        }
        let rows = layers::BatchRows::of(batch)?;
        let mut x = self.embed.forward(&layers::BatchRows::ids(batch), &self.device)?;
        // Each residual add goes with the norm after it (one kernel for both on CUDA).
        let Some(first) = self.layers.first() else { return rows.decode_part(&x, |h| self.norm.forward(h)) };
        let mut normed = first.attn_norm.forward(&x)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let mut caches: Vec<&mut dyn KvCache> =
                batch.iter_mut().map(|s| s.cache.layer(i)).collect();
            let h = layer.attn.forward_adapted(&normed, &rows, &mut caches, Some(i))?;
            let (sum, ffn_in) = layer.ffn_norm.forward_add(&x, &h)?;
            let h = layer.mlp.forward(&ffn_in, &rows, i)?;
            match self.layers.get(i + 1) {
                Some(next) => (x, normed) = next.attn_norm.forward_add(&sum, &h)?,
                None => x = (sum + h)?,
            }
        }
        rows.decode_part(&x, |h| self.norm.forward(h))
    }

    fn lora_base(&self) -> Option<LoraBase> {
        let c = &self.cfg;
        let layers = self.layers.iter().map(|l| lora_shapes(c.hidden_size, l)).collect();
        let permute_qk = (c.rope_style == RopeStyle::Interleaved).then_some((c.num_attention_heads, c.num_key_value_heads));
        Some(LoraBase { architecture: c.architecture.clone(), layers, permute_qk })
    }

    fn project_logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward_rows(hidden, hidden.dim(0)?)?.to_dtype(DType::F32)
    }

    /// Windowed layers (Mistral) keep rotating caches, which have no static buffers; expert
    /// layers route on the host.
    fn has_static_decode(&self) -> bool {
        self.cfg.layer_windows.iter().all(Option::is_none) && self.layers.iter().all(|l| matches!(l.mlp, Ffn::Dense(_)))
    }

    fn decode_static(&self, token: &Tensor, pos: &Tensor, kv: &[(Tensor, Tensor)]) -> Result<Option<Tensor>> {
        let Some(x) = self.static_hidden(token, pos, kv)? else { return Ok(None) };
        self.static_logits(&x).map(Some)
    }

    fn decode_static_greedy(&self, token: &Tensor, pos: &Tensor, kv: &[(Tensor, Tensor)]) -> Result<bool> {
        let Some(x) = self.static_hidden(token, pos, kv)? else { return Ok(false) };
        // The argmax and the position's advance inside the head's product where the backend
        // can (its last block reduces the others' maxima): no argmax kernels in the step.
        if self.lm_head.forward_row_greedy(RowInput::Normed(&x, &self.norm), token, pos)?.is_none() {
            ferrolm_backend::ops::argmax_and_advance(&self.static_logits(&x)?, token, pos)?;
        }
        Ok(true)
    }
}

