//! BERT encoders as sentence embedders (all-MiniLM-L6-v2, bge, e5…): word + position + token
//! type embeddings, post-norm layers of bidirectional attention and a GELU MLP, then the
//! sentence-transformers pooling (`sentence.rs`). An encoder generates nothing: it binds as a
//! model whose only forward is `forward_embeddings` (DESIGN §6).
//!
//! Inputs are packed, not padded: the linear layers run on every token of the batch at once,
//! attention runs per input over its own rows. No padding means no mask, and every input's
//! vector is the same whatever else is in the batch.

use crate::config::HfConfig;
use crate::layers::Embedding;
use crate::loader::safetensors::{HfModel, SafetensorsFiles};
use crate::loader::WeightSource;
use crate::sentence::SentenceConfig;
use crate::{CausalLm, LoadError, ModelInfo, SeqInput};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::{activation_dtype, Linear, Weight};
use ferrolm_kv::SeqCache;

/// Hyper-parameters, named as in Hugging Face `config.json`.
#[derive(Clone, Debug)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub layer_norm_eps: f64,
    /// `gelu` (erf, BERT's) or a tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    pub exact_gelu: bool,
}

impl BertConfig {
    /// Reads config.json; what this encoder does not implement (relative positions, other
    /// activations) is an error rather than a silently different model.
    pub fn from_hf(c: &HfConfig) -> crate::Result<Self> {
        let bad = |message: String| LoadError::File { path: c.path().display().to_string(), message };
        let position = c.get("position_embedding_type").and_then(|v| v.as_str()).unwrap_or("absolute");
        if position != "absolute" {
            return Err(bad(format!("position_embedding_type {position:?} is not supported (only absolute)")));
        }
        let act = c.get("hidden_act").and_then(|v| v.as_str()).unwrap_or("gelu");
        let exact_gelu = match act {
            "gelu" => true,
            "gelu_new" | "gelu_pytorch_tanh" => false,
            other => return Err(bad(format!("hidden_act {other:?} is not supported (gelu, gelu_new)"))),
        };
        Ok(Self {
            vocab_size: c.usize("vocab_size")?,
            hidden_size: c.usize("hidden_size")?,
            intermediate_size: c.usize("intermediate_size")?,
            num_hidden_layers: c.usize("num_hidden_layers")?,
            num_attention_heads: c.usize("num_attention_heads")?,
            max_position_embeddings: c.usize_or("max_position_embeddings", 512)?,
            layer_norm_eps: c.f64_or("layer_norm_eps", 1e-12)?,
            exact_gelu,
        })
    }
}

/// LayerNorm with its weight and bias in the activation dtype.
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn load(src: &dyn WeightSource, name: &str, eps: f64, device: &Device) -> crate::Result<Self> {
        let dtype = activation_dtype(device);
        Ok(Self {
            weight: src.tensor(&format!("{name}.weight"), device)?.to_dtype(dtype)?,
            bias: src.tensor(&format!("{name}.bias"), device)?.to_dtype(dtype)?,
            eps: eps as f32,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        candle_nn::ops::layer_norm(x, &self.weight, &self.bias, self.eps)
    }
}

struct Layer {
    /// Query | key | value in one product.
    qkv: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

pub struct Bert {
    info: ModelInfo,
    cfg: BertConfig,
    sentence: SentenceConfig,
    words: Embedding,
    positions: Embedding,
    /// Row 0 of the token-type table: every input is one segment.
    segment: Tensor,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    device: Device,
}

impl Bert {
    /// Builds the encoder from tensors named as llama.cpp's BERT GGUF files name them
    /// (`token_embd`, `blk.N.attn_q`…; a Hugging Face folder is read through [`BertNames`]).
    pub fn load(cfg: BertConfig, sentence: SentenceConfig, src: &dyn WeightSource, device: &Device) -> crate::Result<Self> {
        let layers = (0..cfg.num_hidden_layers).map(|i| load_layer(&cfg, src, device, i)).collect::<crate::Result<Vec<Layer>>>()?;
        let weight_bytes = layers.iter().map(|l| [&l.qkv, &l.attn_out, &l.up, &l.down].iter().map(|x| x.weight_bytes()).sum::<usize>()).sum();
        // The longest input: sentence-transformers' max_seq_length where it is set (it
        // truncates there), never beyond the position table.
        let max_len = sentence.max_seq_length.unwrap_or(cfg.max_position_embeddings).min(cfg.max_position_embeddings);
        let info = ModelInfo {
            architecture: "bert".into(),
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.hidden_size,
            num_layers: cfg.num_hidden_layers,
            context_length: max_len,
            weight_bytes,
        };
        let types = src.weight("token_types.weight")?.dequantize(device)?;
        Ok(Self {
            info,
            words: Embedding::new(src.weight("token_embd.weight")?, None, device)?,
            positions: Embedding::new(src.weight("position_embd.weight")?, None, device)?,
            segment: types.get(0)?.to_dtype(activation_dtype(device))?,
            embed_norm: LayerNorm::load(src, "token_embd_norm", cfg.layer_norm_eps, device)?,
            layers,
            device: device.clone(),
            sentence,
            cfg,
        })
    }

    /// Every input's final token states, packed `[all tokens, hidden]` in input order.
    fn encode(&self, inputs: &[&[u32]]) -> Result<Tensor> {
        let ids: Vec<u32> = inputs.iter().flat_map(|s| s.iter().copied()).collect();
        let positions: Vec<u32> = inputs.iter().flat_map(|s| 0..s.len() as u32).collect();
        let x = (self.words.forward(&ids, &self.device)? + self.positions.forward(&positions, &self.device)?)?;
        let mut x = self.embed_norm.forward(&x.broadcast_add(&self.segment)?)?;
        let lens: Vec<usize> = inputs.iter().map(|s| s.len()).collect();
        for layer in &self.layers {
            x = self.layer(layer, &x, &lens)?;
        }
        Ok(x)
    }

    /// One post-norm encoder layer over packed rows.
    fn layer(&self, l: &Layer, x: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let qkv = l.qkv.forward(x)?;
        let attn = self.attention(&qkv, lens)?;
        let x = l.attn_norm.forward(&(l.attn_out.forward(&attn)? + x)?)?;
        let h = l.up.forward(&x)?;
        let h = if self.cfg.exact_gelu { h.gelu_erf()? } else { h.gelu()? };
        l.out_norm.forward(&(l.down.forward(&h)? + x)?)
    }

    /// Bidirectional attention of each input over its own rows of the packed `[rows, 3·hidden]`.
    fn attention(&self, qkv: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (heads, hidden) = (self.cfg.num_attention_heads, self.cfg.hidden_size);
        let head_dim = hidden / heads;
        let scale = (head_dim as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(lens.len());
        let mut row = 0;
        for &len in lens {
            let rows = qkv.narrow(0, row, len)?;
            // [len, hidden] → [heads, len, head_dim]
            let split = |i: usize| rows.narrow(1, i * hidden, hidden)?.reshape((len, heads, head_dim))?.transpose(0, 1)?.contiguous();
            let (q, k, v) = (split(0)?, split(1)?, split(2)?);
            let scores = (q.matmul(&k.t()?)? * scale)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(v.dtype())?;
            outs.push(probs.matmul(&v)?.transpose(0, 1)?.reshape((len, hidden))?);
            row += len;
        }
        Tensor::cat(&outs, 0)
    }
}

fn load_layer(cfg: &BertConfig, src: &dyn WeightSource, dev: &Device, i: usize) -> crate::Result<Layer> {
    let p = |n: &str| format!("blk.{i}.{n}");
    let weight = |n: &str| src.weight(&p(&format!("{n}.weight")));
    let bias = |n: &str| src.tensor(&p(&format!("{n}.bias")), dev).map(Some);
    let linear = |n: &str| -> crate::Result<Linear> { Ok(Linear::new(&weight(n)?, bias(n)?, dev)?) };
    let (q, k, v) = (weight("attn_q")?, weight("attn_k")?, weight("attn_v")?);
    let qkv = Linear::stacked(&[&q, &k, &v], &[bias("attn_q")?, bias("attn_k")?, bias("attn_v")?], dev)?;
    let eps = cfg.layer_norm_eps;
    Ok(Layer {
        qkv,
        attn_out: linear("attn_output")?,
        attn_norm: LayerNorm::load(src, &p("attn_output_norm"), eps, dev)?,
        up: linear("ffn_up")?,
        down: linear("ffn_down")?,
        out_norm: LayerNorm::load(src, &p("layer_output_norm"), eps, dev)?,
    })
}

impl CausalLm for Bert {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.device
    }

    /// No layer keeps keys and values: an encoder sees each input whole.
    fn make_cache(&self) -> SeqCache {
        SeqCache::new(Vec::new())
    }

    fn forward_hidden(&self, _batch: &mut [SeqInput<'_>]) -> Result<Tensor> {
        candle_core::bail!("this model cannot generate: it is an embedding model (BERT encoder)")
    }

    fn project_logits(&self, _hidden: &Tensor) -> Result<Tensor> {
        candle_core::bail!("this model cannot generate: it is an embedding model (BERT encoder)")
    }

    fn can_generate(&self) -> bool {
        false
    }

    fn forward_embeddings(&self, inputs: &[&[u32]]) -> Result<Option<Tensor>> {
        if let Some(s) = inputs.iter().find(|s| s.is_empty() || s.len() > self.info.context_length) {
            candle_core::bail!("an input of {} tokens: this model embeds 1 to {} tokens", s.len(), self.info.context_length)
        }
        if inputs.is_empty() {
            return Ok(Some(Tensor::zeros((0, self.cfg.hidden_size), DType::F32, &Device::Cpu)?));
        }
        let states = self.encode(inputs)?;
        let mut row = 0;
        let mut pooled = Vec::with_capacity(inputs.len());
        for s in inputs {
            pooled.push(self.sentence.pool(&states.narrow(0, row, s.len())?)?);
            row += s.len();
        }
        Tensor::stack(&pooled, 0).map(Some)
    }
}

/// A Hugging Face BERT folder's tensors under the GGUF names [`Bert::load`] asks for
/// (`blk.3.attn_q.weight` → `encoder.layer.3.attention.self.query.weight`). Checkpoints saved
/// from a task model nest the encoder under `bert.`; older ones name LayerNorm parameters
/// `gamma` / `beta`.
pub struct BertNames<'a> {
    files: &'a SafetensorsFiles,
    origin: String,
    prefix: &'static str,
}

impl<'a> BertNames<'a> {
    pub fn new(model: &'a HfModel) -> Self {
        let files = model.files();
        let prefix = if files.has("bert.embeddings.word_embeddings.weight") { "bert." } else { "" };
        Self { files, origin: model.dir().display().to_string(), prefix }
    }

    /// The checkpoint's name for a GGUF tensor name, if it has one.
    fn hf_name(&self, gguf: &str) -> Option<String> {
        let (stem, kind) = gguf.rsplit_once('.')?;
        let path = match stem {
            "token_embd" => "embeddings.word_embeddings".to_string(),
            "position_embd" => "embeddings.position_embeddings".to_string(),
            "token_types" => "embeddings.token_type_embeddings".to_string(),
            "token_embd_norm" => "embeddings.LayerNorm".to_string(),
            _ => {
                let (layer, tensor) = stem.strip_prefix("blk.")?.split_once('.')?;
                let part = match tensor {
                    "attn_q" => "attention.self.query",
                    "attn_k" => "attention.self.key",
                    "attn_v" => "attention.self.value",
                    "attn_output" => "attention.output.dense",
                    "attn_output_norm" => "attention.output.LayerNorm",
                    "ffn_up" => "intermediate.dense",
                    "ffn_down" => "output.dense",
                    "layer_output_norm" => "output.LayerNorm",
                    _ => return None,
                };
                format!("encoder.layer.{layer}.{part}")
            }
        };
        let name = format!("{}{path}.{kind}", self.prefix);
        if self.files.has(&name) || !path.ends_with("LayerNorm") {
            return Some(name);
        }
        let old = if kind == "weight" { "gamma" } else { "beta" };
        Some(format!("{}{path}.{old}", self.prefix))
    }

    fn mapped(&self, gguf: &str) -> crate::Result<String> {
        self.hf_name(gguf).ok_or_else(|| LoadError::File { path: self.origin.clone(), message: format!("no checkpoint name for tensor {gguf}") })
    }
}

impl WeightSource for BertNames<'_> {
    fn weight(&self, name: &str) -> crate::Result<Weight> {
        self.files.weight(&self.mapped(name)?)
    }

    fn tensor(&self, name: &str, device: &Device) -> crate::Result<Tensor> {
        let (values, shape) = self.files.f32_values(&self.mapped(name)?)?;
        Ok(Tensor::from_vec(values, shape, device)?)
    }

    fn has(&self, name: &str) -> bool {
        self.hf_name(name).is_some_and(|n| self.files.has(&n))
    }

    fn origin(&self) -> String {
        self.origin.clone()
    }
}
