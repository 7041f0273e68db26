//! One pre-norm decoder layer (attention, then a gated SiLU MLP) for one decode token as a single
//! kernel, where the device has one (CUDA: `cuda/layer.rs`). Otherwise, or when the layer is
//! outside what the kernel takes, `fused_decode_layer` returns None and the caller runs the
//! layer op by op (with identical results).

use crate::attention::AttentionParams;
use crate::norm::RmsNorm;
use crate::{Linear, Rope};
use candle_core::{Result, Tensor};

/// A layer's parts for one token at the device position `pos`; `qkv` and `gate_up` are stacked
/// products (q, k, v rows; gate, up rows), the caches the whole `[kv_heads, capacity, head_dim]`
/// buffers.
pub struct DecodeLayer<'a> {
    pub attn_norm: &'a RmsNorm,
    pub qkv: &'a Linear,
    pub o: &'a Linear,
    pub ffn_norm: &'a RmsNorm,
    pub gate_up: &'a Linear,
    pub down: &'a Linear,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope: &'a Rope,
    pub params: &'a AttentionParams,
}

/// The residual stream after the layer, or None when no single kernel applies.
pub fn fused_decode_layer(l: &DecodeLayer<'_>, x: &Tensor, pos: &Tensor, cache_k: &Tensor, cache_v: &Tensor) -> Result<Option<Tensor>> {
    // Off by default (`FERROLM_CUDA_LAYER=1`): checked first, as this runs for every layer of
    // every eager decode step.
    #[cfg(feature = "cuda")]
    if matches!(x.device(), candle_core::Device::Cuda(_)) && crate::cuda::policy().layer_kernel {
        let weights = (l.qkv.dense_weight(), l.o.dense_weight(), l.gate_up.dense_weight(), l.down.dense_weight());
        let (Some(wqkv), Some(wo), Some(wgu), Some(wdown)) = weights else { return Ok(None) };
        let (cos, sin, interleaved) = l.rope.tables()?;
        let args = crate::cuda::layer::DecodeLayerArgs {
            x,
            attn_norm: l.attn_norm.parts(),
            ffn_norm: l.ffn_norm.parts(),
            wqkv,
            wo,
            wgu,
            wdown,
            heads: l.heads,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            cache_k,
            cache_v,
            rope: crate::cuda::ops::RopeTables { cos, sin, interleaved },
            pos,
            params: l.params,
        };
        return crate::cuda::layer::decode_layer(&args);
    }
    let _ = (l, x, pos, cache_k, cache_v);
    Ok(None)
}
