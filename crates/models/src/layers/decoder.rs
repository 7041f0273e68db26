use super::{Activation, GatedMlp, SelfAttention};
use candle_core::{Result, Tensor};
use ferrolm_backend::decode_layer::{fused_decode_layer, DecodeLayer};
use ferrolm_backend::norm::RmsNorm;

/// One decode token through a whole pre-norm layer (`x + attn(norm(x))`, then the same with the
/// MLP) as a single kernel, where the backend has one: plain attention (no q/k norms), a gated
/// SiLU MLP, q|k|v and gate|up each one stacked product. None otherwise: the caller runs
/// `SelfAttention::forward_static` and `GatedMlp::forward_row`, which give the same result.
pub fn fused_decode_step(
    attn_norm: &RmsNorm,
    attn: &SelfAttention,
    ffn_norm: &RmsNorm,
    mlp: &GatedMlp,
    x: &Tensor,
    pos: &Tensor,
    cache_k: &Tensor,
    cache_v: &Tensor,
) -> Result<Option<Tensor>> {
    let c = &attn.cfg;
    if attn.q_norm.is_some() || attn.k_norm.is_some() || mlp.activation != Activation::Silu {
        return Ok(None);
    }
    let (Some((qkv, qkv_widths)), Some((gate_up, gu_widths))) = (attn.qkv.stacked(), mlp.gate_up.stacked()) else {
        return Ok(None);
    };
    let kv = c.kv_heads * c.head_dim;
    if qkv_widths != [c.heads * c.head_dim, kv, kv] || gu_widths.len() != 2 || gu_widths[0] != gu_widths[1] {
        return Ok(None);
    }
    let layer = DecodeLayer {
        attn_norm,
        qkv,
        o: &attn.o,
        ffn_norm,
        gate_up,
        down: &mlp.down,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        rope: &attn.rope,
        params: &c.params,
    };
    fused_decode_layer(&layer, x, pos, cache_k, cache_v)
}
