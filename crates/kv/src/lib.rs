//! The KV-cache family behind one trait (DESIGN §4). Models call `update_and_fetch`; the caller
//! (the engine) owns the caches.

mod disk;
mod paged;
mod paged_prefix;
mod plain;
mod prefix;
mod quant;
mod rotating;
mod seq;

pub use disk::DiskTier;
pub use paged::{BlockPool, PagedCache};
pub use paged_prefix::{BlockIndex, PagedPools};
pub use ferrolm_backend::paged::BlockTable;
pub use plain::PlainCache;
pub use prefix::{Hit, PromptCache, PromptCacheStats};
pub use quant::{KvScheme, QuantCache};
pub use ferrolm_backend::kv_quant::KvQuant;
pub use rotating::RotatingCache;
pub use seq::SeqCache;

use candle_core::{Result, Tensor};

/// Keys and values a layer attends over, in temporal order, `[kv_heads, tokens, head_dim]`.
pub struct KvView {
    pub k: Tensor,
    pub v: Tensor,
    /// Absolute position of the first key in the view.
    pub key_start: usize,
    /// `Some`: k and v are quantized rows (U8 `[kv_heads, tokens, row_bytes]`) of this format;
    /// attention reads them with `attend_quant` / `attend_prompt_quant`.
    pub quant: Option<KvQuant>,
    /// `Some`: k and v are a paged layer's pools `[blocks, B, kv_heads, head_dim]` and this
    /// lists the sequence's blocks; attention reads them with `attend_paged`.
    pub table: Option<BlockTable>,
}

/// One layer's cache for one sequence.
pub trait KvCache: Send {
    /// Appends `k`, `v` `[kv_heads, new_tokens, head_dim]` and returns everything to attend over.
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView>;
    /// Tokens written so far (the position of the next token).
    fn offset(&self) -> usize;
    /// Whether `trim` can remove tokens from the end.
    fn is_trimmable(&self) -> bool;
    /// How many tokens `trim` can remove exactly right now (all of them when trimmable; a
    /// sliding-window cache that evicted tokens can still drop its newest ones).
    fn max_trim(&self) -> usize {
        if self.is_trimmable() {
            self.offset()
        } else {
            0
        }
    }
    /// Removes up to `n` tokens from the end (at most `max_trim`); returns how many were removed.
    fn trim(&mut self, n: usize) -> usize;
    /// Names the scheme: `kv:plain`, `kv:rotating`, …
    fn signature(&self) -> String;
    /// Bytes held per cached token (all heads, keys and values).
    fn bytes_per_token(&self) -> usize;

    /// Bytes of memory the cache's buffers hold now.
    fn bytes_held(&self) -> usize;

    /// The device its buffers live on.
    fn device(&self) -> &candle_core::Device;
    /// The cached keys and values (temporal order) and the offset, for snapshots.
    fn state(&self) -> Result<Option<KvView>>;
    /// Restores a state produced by `state` of a cache with the same signature.
    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()>;

    /// The state this cache had when it held only its first `n` tokens (for `load_state` with
    /// offset `n`), if it still holds what that state needs; None otherwise (a sliding window
    /// that has moved past it).
    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        let _ = n;
        Ok(None)
    }

    /// A cache holding this one's first `n` tokens by sharing its storage (reference-counted
    /// blocks, copied on write), if it can; None: copy through `state_prefix` instead.
    fn share_prefix(&self, n: usize) -> Option<Box<dyn KvCache>> {
        let _ = n;
        None
    }

    /// This layer as a paged cache, when it is one (the prefix index keeps its blocks).
    fn as_paged(&self) -> Option<&PagedCache> {
        None
    }

    /// Kv heads, head size and dtype of a plain float cache (the layers `--kv-layout paged`
    /// replaces); None for other kinds.
    fn plain_shape(&self) -> Option<(usize, usize, candle_core::DType)> {
        None
    }

    /// Kv heads, head size and format of a cache of affine-quantized rows (`QuantCache`, the
    /// layers `--kv-layout paged` replaces by blocks of quantized rows); None for other kinds.
    fn quant_shape(&self) -> Option<(usize, usize, KvQuant)> {
        None
    }

    /// Kv heads, head size, dtype and window of a sliding-window float cache (the rings
    /// `--kv-layout paged` replaces by windowed block tables); None for other kinds.
    fn sliding_shape(&self) -> Option<(usize, usize, candle_core::DType, usize)> {
        None
    }

    /// Whole buffers `[kv_heads, capacity, head_dim]` with room for at least `extra` tokens
    /// after `offset()`, for steps that write one token in place at a position held on the
    /// device (a captured decode step). `None`: this cache keeps no such buffers.
    fn static_buffers(&mut self, extra: usize) -> Result<Option<(Tensor, Tensor)>> {
        let _ = extra;
        Ok(None)
    }

    /// Counts `n` tokens that static steps wrote in place after `offset()`.
    fn commit_static(&mut self, n: usize) -> Result<()> {
        let _ = n;
        candle_core::bail!("{} keeps no static buffers", self.signature())
    }
}
