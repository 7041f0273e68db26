//! The TurboQuant cache (`--kv-quant turbo[:k<b>v<b>]`, mlx-bun's scheme): keys as affine rows
//! (`KvQuant::keys`), values as TurboQuant rows (`kv_quant::turbo`), read back as f32 keys and
//! values when attention fetches them (mlx-bun's dequantize-on-fetch; no attention kernel reads
//! TurboQuant rows yet, so every step widens the whole cache: memory is saved, time is not).
//!
//! Storage: each (head, token) holds its key row then its value row, `key + value` bytes, cut
//! into two halves kept as the `k` and `v` rows of a [`RowCache`] (a `PlainCache` of U8: slab
//! growth, trimming, snapshots, forks and the prompt cache's tiers work unchanged, and the bytes
//! held are exactly the rows'). The halves are equal: both row sizes are multiples of 2.

use super::{RowCache, RowCodec};
use crate::KvView;
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::kv_quant::{self, turbo, KvQuant};

pub type TurboCache = RowCache<TurboRows>;

/// The joined key + value rows of a TurboQuant format.
pub struct TurboRows {
    quant: KvQuant,
    kv_heads: usize,
    head_dim: usize,
}

impl TurboCache {
    /// `quant` from `KvQuant::turbo`; panics otherwise or if `head_dim` is not taken
    /// (`KvScheme::check` first).
    pub fn new(kv_heads: usize, head_dim: usize, quant: KvQuant, device: &Device) -> Self {
        assert!(quant.turbo_values.is_some(), "a TurboQuant format");
        quant.check_head_dim(head_dim).expect("KvScheme::check before building caches");
        let rows = TurboRows::new(quant, kv_heads, head_dim);
        let half = rows.rows_half();
        RowCache::with_codec(rows, kv_heads, head_dim, half, device)
    }
}

impl TurboRows {
    pub(crate) fn new(quant: KvQuant, kv_heads: usize, head_dim: usize) -> Self {
        Self { quant, kv_heads, head_dim }
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

    /// None: attention gets widened keys and values, and a state is the bare rows.
    fn tag(&self) -> Option<KvQuant> {
        None
    }

    /// Paged blocks hold the halves; a fetch gathers the table's rows and widens them, as the
    /// contiguous cache widens all of its rows.
    fn pageable(&self) -> Option<KvQuant> {
        Some(self.quant)
    }

    /// `k`, `v` `[kv_heads, tokens, head_dim]` → the two halves of their joined rows.
    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let d = self.head_dim;
        let keys = kv_quant::quantize(self.quant.keys(), k)?.flatten_all()?.to_vec1::<u8>()?;
        let values = v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let (kb, vb, bits) = (self.key_bytes(), self.quant.value_row_bytes(d), self.quant.turbo_values.unwrap_or(3));
        let mut joined = vec![0u8; keys.len() / kb * (kb + vb)];
        for ((out, key), value) in joined.chunks_exact_mut(kb + vb).zip(keys.chunks_exact(kb)).zip(values.chunks_exact(d)) {
            out[..kb].copy_from_slice(key);
            turbo::encode_row(bits, value, &mut out[kb..]);
        }
        let tokens = k.dims()[1];
        let joined = Tensor::from_vec(joined, (self.kv_heads, tokens, kb + vb), k.device())?;
        let half = (kb + vb) / 2;
        Ok((joined.narrow(2, 0, half)?.contiguous()?, joined.narrow(2, half, half)?.contiguous()?))
    }

    /// The halves `[kv_heads, tokens, half]` → f32 keys and values `[kv_heads, tokens, d]`.
    fn fetch(&self, view: KvView) -> Result<KvView> {
        let d = self.head_dim;
        let joined = Tensor::cat(&[&view.k, &view.v], 2)?.flatten_all()?.to_vec1::<u8>()?;
        let (kb, bits) = (self.key_bytes(), self.quant.turbo_values.unwrap_or(3));
        let rows = joined.len() / (2 * self.rows_half());
        let (mut keys, mut values) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        let key_format = self.quant.keys();
        for ((row, key), value) in joined.chunks_exact(2 * self.rows_half()).zip(keys.chunks_exact_mut(d)).zip(values.chunks_exact_mut(d)) {
            key_format.dequantize_row(&row[..kb], key);
            turbo::decode_row(bits, &row[kb..], value);
        }
        let shape = (self.kv_heads, rows / self.kv_heads, d);
        let dev = view.k.device();
        Ok(KvView { k: Tensor::from_vec(keys, shape, dev)?, v: Tensor::from_vec(values, shape, dev)?, quant: None, ..view })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvCache;

    fn floats(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// What attention gets is each key row dequantized and each value row decoded, the same
    /// across appends as all at once; bytes are the rows' (k8v3 at d 64: 72 + 28 per head);
    /// trim rewinds; a state reloads bit for bit and one of another format is refused.
    #[test]
    fn fetch_decodes_the_rows_and_state_round_trips() -> Result<()> {
        let dev = Device::Cpu;
        let q = KvQuant::turbo(8, 3).unwrap();
        let mut c = TurboCache::new(2, 64, q, &dev);
        let (k, v) = (Tensor::randn(0f32, 1.0, (2, 40, 64), &dev)?, Tensor::randn(0f32, 1.0, (2, 40, 64), &dev)?);
        c.update_and_fetch(&k.narrow(1, 0, 39)?, &v.narrow(1, 0, 39)?)?;
        let view = c.update_and_fetch(&k.narrow(1, 39, 1)?, &v.narrow(1, 39, 1)?)?;
        assert_eq!(view.quant, None);
        let want_k = kv_quant::dequantize(q.keys(), &kv_quant::quantize(q.keys(), &k)?, 64)?;
        assert_eq!(floats(&view.k), floats(&want_k));
        let (mut row, mut back) = (vec![0u8; q.value_row_bytes(64)], vec![0f32; 64]);
        for (x, got) in floats(&v).chunks_exact(64).zip(floats(&view.v).chunks_exact(64)) {
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
        assert_eq!(floats(&again.v.narrow(1, 0, 40)?), floats(&view.v));
        assert!(TurboCache::new(2, 64, KvQuant::turbo(8, 2).unwrap(), &dev).load_state(&state, 40).is_err());
        assert_eq!(c.trim(10), 10);
        assert_eq!(c.offset(), 30);
        Ok(())
    }
}
