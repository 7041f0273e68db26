//! What the quantized caches share: their stored rows are the `k` and `v` rows of a
//! [`PlainCache`] of U8 (so slab growth, trimming, snapshots, forks and the prompt cache's tiers
//! work unchanged, and the bytes held are exactly the rows'); a [`RowCodec`] says how keys and
//! values become rows and what attention reads back. The `KvCache` methods are written once here.

use crate::{KvCache, KvView, PlainCache};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::kv_quant::KvQuant;

/// One quantized cache format's encoding.
pub trait RowCodec: Send {
    /// The format; it names the cache (`kv:<name>`).
    fn format(&self) -> KvQuant;
    /// The format that views and states of the stored rows carry: Some where attention reads
    /// the rows themselves; None where `fetch` widens them (states are then the bare rows).
    fn tag(&self) -> Option<KvQuant>;
    /// `k`, `v` `[kv_heads, tokens, head_dim]` → the `k` and `v` rows to store.
    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
    /// What attention gets from a view of every stored row.
    fn fetch(&self, rows: KvView) -> Result<KvView>;
    /// The format when attention reads the stored rows themselves and they can live in paged
    /// blocks (`BlockPool::quantized`); None for formats widened on fetch.
    fn pageable(&self) -> Option<KvQuant> {
        None
    }
}

/// A growing cache of quantized rows in the format of `C`.
pub struct RowCache<C> {
    rows: PlainCache,
    codec: C,
    /// Bytes of one stored `k` (and one `v`) row: one head of one token.
    row_bytes: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl<C: RowCodec> RowCache<C> {
    /// Rows of `row_bytes` for keys and values of head size `head_dim`.
    pub(super) fn with_codec(codec: C, kv_heads: usize, head_dim: usize, row_bytes: usize, device: &Device) -> Self {
        Self { rows: PlainCache::new(kv_heads, row_bytes, DType::U8, device), codec, row_bytes, kv_heads, head_dim }
    }

    fn tagged(&self, view: Option<KvView>) -> Option<KvView> {
        view.map(|v| KvView { quant: self.codec.tag(), ..v })
    }

    /// Whether `state` holds rows of this cache's format (a state read from disk carries no
    /// format; the entry's signature named it).
    fn check_state(&self, state: &KvView) -> Result<()> {
        let rows_fit = state.k.dtype() == DType::U8 && state.k.dims().get(2) == Some(&self.row_bytes);
        if !rows_fit || state.quant.is_some_and(|q| Some(q) != self.codec.tag()) {
            candle_core::bail!("{}: a state of other rows ({:?}, {:?})", self.signature(), state.k.dtype(), state.quant)
        }
        Ok(())
    }
}

impl<C: RowCodec> KvCache for RowCache<C> {
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let (rk, rv) = self.codec.encode(k, v)?;
        let view = self.rows.update_and_fetch(&rk, &rv)?;
        self.codec.fetch(view)
    }

    fn offset(&self) -> usize {
        self.rows.offset()
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> usize {
        self.rows.trim(n)
    }

    fn signature(&self) -> String {
        format!("kv:{}", self.codec.format().name())
    }

    fn bytes_per_token(&self) -> usize {
        self.rows.bytes_per_token()
    }

    fn bytes_held(&self) -> usize {
        self.rows.bytes_held()
    }

    fn device(&self) -> &Device {
        self.rows.device()
    }

    /// The stored rows themselves (what the prompt cache keeps), tagged with `RowCodec::tag`.
    fn state(&self) -> Result<Option<KvView>> {
        Ok(self.tagged(self.rows.state()?))
    }

    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()> {
        self.check_state(state)?;
        self.rows.load_state(state, offset)
    }

    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        Ok(self.tagged(self.rows.state_prefix(n)?))
    }

    fn quant_shape(&self) -> Option<(usize, usize, KvQuant)> {
        self.codec.pageable().map(|q| (self.kv_heads, self.head_dim, q))
    }
}
