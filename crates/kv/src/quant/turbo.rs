//! The TurboQuant cache (`--kv-quant turbo[:k<b>v<b>]`, mlx-bun's scheme): keys as affine rows
//! (`KvQuant::keys`), values as TurboQuant rows (`kv_quant::turbo`), handed to attention as the
//! stored rows, which its CPU kernels read in place (`ferrolm_backend::cpu::turbo_rows`; mlx-bun
//! and ferrolm before widened the whole cache to f32 on every fetch).
//!
//! Storage: each (head, token) holds its key row then its value row, `key + value` bytes, cut
//! into two halves kept as the `k` and `v` rows of a [`RowCache`] (a `PlainCache` of U8: slab
//! growth, trimming, snapshots, forks and the prompt cache's tiers work unchanged, and the bytes
//! held are exactly the rows'). The halves are equal: both row sizes are multiples of 2.

use super::{RowCache, RowCodec};
use crate::KvView;
use candle_core::{Device, Result, Tensor};
use ferrolm_backend::kv_quant::{turbo, KvQuant};

pub type TurboCache = RowCache<TurboRows>;

/// The joined key + value rows of a TurboQuant format.
pub struct TurboRows {
    quant: KvQuant,
    head_dim: usize,
}

impl TurboCache {
    /// `quant` from `KvQuant::turbo`; panics otherwise or if `head_dim` is not taken
    /// (`KvScheme::check` first).
    pub fn new(kv_heads: usize, head_dim: usize, quant: KvQuant, device: &Device) -> Self {
        assert!(quant.turbo_values.is_some(), "a TurboQuant format");
        quant.check_head_dim(head_dim).expect("KvScheme::check before building caches");
        let rows = TurboRows::new(quant, head_dim);
        let half = rows.rows_half();
        RowCache::with_codec(rows, kv_heads, head_dim, half, device)
    }
}

impl TurboRows {
    pub(crate) fn new(quant: KvQuant, head_dim: usize) -> Self {
        Self { quant, head_dim }
    }

    fn key_bytes(&self) -> usize {
        self.quant.row_bytes(self.head_dim)
    }

    pub(crate) fn rows_half(&self) -> usize {
        (self.key_bytes() + self.quant.value_row_bytes(self.head_dim)) / 2
    }
}

impl RowCodec for TurboRows {
    fn format(&self) -> KvQuant {
        self.quant
    }

    /// None: a state is the bare rows (paged blocks are gathered before attention reads them).
    fn tag(&self) -> Option<KvQuant> {
        None
    }

    /// Paged blocks hold the halves; a fetch gathers the table's rows, which attention reads as
    /// it reads the contiguous cache's.
    fn pageable(&self) -> Option<KvQuant> {
        Some(self.quant)
    }

    /// `k`, `v` `[kv_heads, tokens, head_dim]` → the two halves of their joined rows.
    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        turbo::encode(self.quant, k, v)
    }

    /// The halves themselves, tagged with the format: attention reads them in place
    /// (`ferrolm_backend::cpu::turbo_rows`; paths without that kernel widen them,
    /// `kv_quant::turbo::widen`).
    fn fetch(&self, view: KvView) -> Result<KvView> {
        Ok(KvView { quant: Some(self.quant), ..view })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvCache;
    use ferrolm_backend::kv_quant;

    fn floats(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// What attention gets is the stored halves, tagged; widened (`turbo::widen`) they are each
    /// key row dequantized and each value row decoded, the same across appends as all at once;
    /// bytes are the rows' (k8v3 at d 64: 72 + 28 per head); trim rewinds; a state reloads bit
    /// for bit and one of another format is refused.
    #[test]
    fn fetch_gives_the_rows_and_state_round_trips() -> Result<()> {
        let dev = Device::Cpu;
        let q = KvQuant::turbo(8, 3).unwrap();
        let mut c = TurboCache::new(2, 64, q, &dev);
        let (k, v) = (Tensor::randn(0f32, 1.0, (2, 40, 64), &dev)?, Tensor::randn(0f32, 1.0, (2, 40, 64), &dev)?);
        c.update_and_fetch(&k.narrow(1, 0, 39)?, &v.narrow(1, 0, 39)?)?;
        let view = c.update_and_fetch(&k.narrow(1, 39, 1)?, &v.narrow(1, 39, 1)?)?;
        assert_eq!((view.quant, view.k.dims()), (Some(q), &[2, 40, 50][..]));
        let (wide_k, wide_v) = turbo::widen(q, &view.k, &view.v, 64)?;
        let want_k = kv_quant::dequantize(q.keys(), &kv_quant::quantize(q.keys(), &k)?, 64)?;
        assert_eq!(floats(&wide_k), floats(&want_k));
        let (mut row, mut back) = (vec![0u8; q.value_row_bytes(64)], vec![0f32; 64]);
        for (x, got) in floats(&v).chunks_exact(64).zip(floats(&wide_v).chunks_exact(64)) {
            turbo::encode_row(3, x, &mut row);
            turbo::decode_row(3, &row, &mut back);
            assert_eq!(back, got);
        }
        assert_eq!(c.bytes_per_token(), 2 * (72 + 28));
        assert_eq!(c.signature(), "kv:turbo-k8v3");
        let state = c.state()?.unwrap();
        let mut other = TurboCache::new(2, 64, q, &dev);
        other.load_state(&state, 40)?;
        let again = other.update_and_fetch(&k.narrow(1, 0, 1)?, &v.narrow(1, 0, 1)?)?;
        let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
        assert_eq!(bytes(&again.v.narrow(1, 0, 40)?), bytes(&view.v));
        assert!(TurboCache::new(2, 64, KvQuant::turbo(8, 2).unwrap(), &dev).load_state(&state, 40).is_err());
        assert_eq!(c.trim(10), 10);
        assert_eq!(c.offset(), 30);
        Ok(())
    }
}
