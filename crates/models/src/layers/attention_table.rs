//! The attention block of a batched decode step over device inputs (`crate::batch_graph`): one
//! decode row per row of a table of cache buffers and positions, so that a captured step
//! depends on the sequences only through the table's contents.

use super::SelfAttention;
use candle_core::{Result, Tensor};
use ferrolm_backend::attention_device::{append_and_attend_table, TableStep};

impl SelfAttention {
    /// `x` `[B, hidden]`: one decode row per table row (`table`: i64 `[B · 5]` of
    /// `attention_device::decode_table_row`s, `splits` at least each row's split count), each
    /// key and value written in place at its row's position. Returns `[B, hidden]` after the
    /// output product; None where the device has no batched kernel.
    pub fn forward_table(&self, x: &Tensor, table: &Tensor, splits: usize) -> Result<Option<Tensor>> {
        let c = &self.cfg;
        let b = x.dim(0)?;
        let [q, k, v]: [Tensor; 3] =
            self.qkv.forward_rows(x, b)?.try_into().map_err(|_| candle_core::Error::Msg("qkv: expected three projections".into()))?;
        // Per-head q/k norms (Qwen3) on the rows split into heads, as the eager forward does.
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => {
                let q = qn.forward(&q.reshape((b, c.heads, c.head_dim))?)?.flatten_from(1)?;
                let k = kn.forward(&k.reshape((b, c.kv_heads, c.head_dim))?)?.flatten_from(1)?;
                (q, k)
            }
            _ => (q, k),
        };
        let step = TableStep { q: &q, k: &k, v: &v, table, kv_heads: c.kv_heads, head_dim: c.head_dim, splits, rope: &self.rope, params: &c.params };
        let Some(out) = append_and_attend_table(&step)? else { return Ok(None) };
        self.o.forward_rows(&out, b).map(Some)
    }
}
