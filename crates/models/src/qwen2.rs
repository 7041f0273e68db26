//! Qwen2 (Qwen2.5, Qwen2.5-Coder; Qwen2-MoE with `LlamaConfig::moe`): the llama decoder of `llama.rs` with biases on the Q, K and V
//! projections, half-split (NEOX) RoPE with base 1e6, and an untied output head when the
//! checkpoint has one. A thin configuration over the shared decoder, so the two architectures
//! share every kernel and optimization.

use crate::config::{llama_family, HfConfig};
use crate::llama::{Llama, LlamaConfig};
use crate::loader::{gguf::GgufFile, WeightSource};
use crate::LoadError;
use candle_core::Device;
use ferrolm_backend::RopeStyle;

/// Reads `qwen2.*` GGUF metadata (llama.cpp keeps Qwen2's Q/K rows in half-split order).
pub fn config_from_gguf(f: &GgufFile) -> crate::Result<LlamaConfig> {
    let mut c = LlamaConfig::from_gguf(f)?;
    c.rope_style = RopeStyle::HalfSplit;
    Ok(c)
}

/// Reads a `qwen2` `config.json`.
pub fn config_from_hf(c: &HfConfig) -> crate::Result<LlamaConfig> {
    llama_family(c)
}

/// Builds the model; the QKV biases are required (a checkpoint without them is not Qwen2, or
/// its tensors are misnamed).
pub fn load(cfg: LlamaConfig, src: &dyn WeightSource, device: &Device) -> crate::Result<Llama> {
    for name in ["attn_q.bias", "attn_k.bias", "attn_v.bias"] {
        let t = format!("blk.0.{name}");
        if !src.has(&t) {
            return Err(LoadError::File {
                path: src.origin(),
                message: format!("missing tensor {t} (qwen2 has biases on q, k and v)"),
            });
        }
    }
    Llama::load(cfg, src, device)
}
