//! Block tables of a paged KV cache (`ferrolm_kv::PagedCache`): a layer's keys (and values) live
//! in one pool tensor `[blocks, Hkv, B, D]` (each head's rows of a block contiguous, as in a
//! contiguous cache) shared by every sequence, and a sequence's tokens are
//! the pool blocks its table lists, in order. The CPU attention kernels read rows through the
//! table (`cpu::attn::Kv`), never through a gathered copy.

use crate::cpu::attn::Kv;
use candle_core::{Layout, Result, Tensor};

/// The pool blocks holding a sequence's tokens, in temporal order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTable {
    /// Block indices in the pool (dimension 0 of its tensor).
    pub blocks: Vec<usize>,
    /// Tokens per block (a power of two).
    pub block_tokens: usize,
    /// Tokens in use: the first `tokens` rows of the listed blocks.
    pub tokens: usize,
}

impl BlockTable {
    fn shift(&self) -> u32 {
        self.block_tokens.trailing_zeros()
    }

    /// Kv heads of a pool laid out `[blocks, Hkv, B, D]`, checking that it fits this table.
    pub fn kv_heads(&self, pool: &Layout) -> Result<usize> {
        let dims = pool.dims();
        if dims.len() != 4 || dims[2] != self.block_tokens || !self.block_tokens.is_power_of_two() {
            candle_core::bail!("paged attention: pool {dims:?} is not [blocks, kv_heads, {}, head_dim]", self.block_tokens)
        }
        if pool.stride()[3] != 1 {
            candle_core::bail!("paged attention: the pool's head_dim must be contiguous")
        }
        if self.tokens > self.blocks.len() * self.block_tokens || self.blocks.iter().any(|&b| b >= dims[0]) {
            candle_core::bail!("paged attention: {} tokens in blocks {:?} of a pool of {}", self.tokens, self.blocks, dims[0])
        }
        Ok(dims[1])
    }

    /// Element offsets of the table's blocks in the pool's storage.
    pub fn offsets(&self, pool: &Layout) -> Vec<usize> {
        self.blocks.iter().map(|&b| b * pool.stride()[0]).collect()
    }

    /// The table's rows of a pool's storage `data` (laid out as `pool`) through `offsets`.
    pub fn view<'a, E>(&self, data: &'a [E], pool: &Layout, offsets: &'a [usize]) -> Kv<'a, E> {
        let s = pool.stride();
        Kv { data: &data[pool.start_offset()..], head_stride: s[1], token_stride: s[2], blocks: offsets, block_shift: self.shift() }
    }

    /// The table's rows of `pool` gathered into `[kv_heads, tokens, width]` (a copy: for the
    /// per-row fallback over quantized rows, which dequantizes what it reads).
    pub fn gather(&self, pool: &Tensor) -> Result<Tensor> {
        let hkv = self.kv_heads(pool.layout())?;
        let ids = Tensor::from_vec(self.blocks.iter().map(|&b| b as u32).collect::<Vec<_>>(), self.blocks.len(), pool.device())?;
        let width = pool.dims()[3];
        let rows = pool.index_select(&ids, 0)?.transpose(0, 1)?.contiguous()?;
        rows.reshape((hkv, self.blocks.len() * self.block_tokens, width))?.narrow(1, 0, self.tokens)
    }

    /// This table limited to its first `tokens` tokens.
    pub fn truncated(&self, tokens: usize) -> Self {
        Self { tokens: tokens.min(self.tokens), ..self.clone() }
    }
}
