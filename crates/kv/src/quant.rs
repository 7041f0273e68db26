//! Quantized KV caches (`--kv-bits 8|4`, `--kv-group-size`): keys and values quantized as they
//! are written (affine groups along head_dim, `ferrolm_backend::kv_quant`), held as U8 rows in
//! a growing contiguous buffer; attention reads the rows directly. TurboQuant
//! (`--kv-quant turbo`) is the format `KvQuant::turbo` in a [`TurboCache`].

use crate::{KvCache, KvView, PlainCache};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::kv_quant::{self, KvQuant};

mod deferred;
mod rows;
mod turbo;
pub(crate) use rows::RowCodec;
use rows::RowCache;
pub use turbo::TurboCache;

/// The codec of `quant`'s rows for keys and values of head size `head_dim` (affine rows, or
/// TurboQuant's joined halves) and the bytes of one stored `k` (and `v`) row; for paged blocks.
pub(crate) fn row_codec(quant: KvQuant, head_dim: usize) -> (Box<dyn RowCodec + Sync>, usize) {
    match quant.turbo_values {
        Some(_) => {
            let rows = turbo::TurboRows::new(quant, head_dim);
            let half = rows.rows_half();
            (Box::new(rows), half)
        }
        None => (Box::new(AffineRows(quant)), quant.row_bytes(head_dim)),
    }
}

/// How a model's full-attention layers cache keys and values. Sliding-window layers (Gemma 3's
/// local layers, Mistral-style windows) stay float: their caches are small and bounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvScheme {
    /// The device's KV dtype (f16 on the CPU).
    #[default]
    Float,
    Quant(KvQuant),
}

impl KvScheme {
    /// From `--kv-bits` (none: float; 16 or 32 also float) and `--kv-group-size`.
    pub fn from_flags(bits: Option<u8>, group: usize) -> std::result::Result<Self, String> {
        match bits {
            None | Some(16) | Some(32) => Ok(Self::Float),
            Some(b) => KvQuant::new(b, group).map(Self::Quant),
        }
    }

    /// Whether layers of head size `head_dim` on `device` can be cached this way.
    pub fn check(&self, head_dim: usize, device: &Device) -> std::result::Result<(), String> {
        match self {
            Self::Float => Ok(()),
            Self::Quant(_) if !device.is_cpu() => Err("quantized KV (--kv-bits) runs on the CPU only for now".into()),
            Self::Quant(q) => q.check_head_dim(head_dim),
        }
    }

    /// A fresh cache for one full-attention layer.
    pub fn full_layer(&self, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Box<dyn KvCache> {
        match self {
            Self::Float => Box::new(PlainCache::new(kv_heads, head_dim, dtype, device)),
            Self::Quant(q) => deferred::layer(*q, kv_heads, head_dim, dtype, device),
        }
    }

    /// From `--kv-quant`: `turbo` (mlx-bun's default, keys 8 bits and values 3) or
    /// `turbo:k<b>v<b>` (`turbo:k4v3`); also `turbo-k<b>v<b>`, the format's name.
    pub fn from_kv_quant(spec: &str) -> std::result::Result<Self, String> {
        let bad = || format!("--kv-quant `{spec}`: expected turbo or turbo:k<bits>v<bits> (turbo:k8v3)");
        let bits = match spec {
            "turbo" => (8, 3),
            _ => {
                let rest = spec.strip_prefix("turbo:").or_else(|| spec.strip_prefix("turbo-")).ok_or_else(bad)?;
                let (k, v) = rest.strip_prefix('k').and_then(|r| r.split_once('v')).ok_or_else(bad)?;
                (k.parse::<u8>().map_err(|_| bad())?, v.parse::<u8>().map_err(|_| bad())?)
            }
        };
        KvQuant::turbo(bits.0, bits.1).map(Self::Quant)
    }
}

/// A growing cache of affine-quantized rows `[kv_heads, tokens, row_bytes]` (a [`RowCache`]:
/// the same slab growth, trimming and snapshots as a [`PlainCache`]), quantizing what is
/// written; attention reads the rows.
pub type QuantCache = RowCache<AffineRows>;

/// The affine row format (`--kv-bits`): keys and values quantized alike.
pub struct AffineRows(KvQuant);

impl QuantCache {
    /// Panics if `head_dim` is not whole groups (`KvScheme::check` first).
    pub fn new(kv_heads: usize, head_dim: usize, quant: KvQuant, device: &Device) -> Self {
        quant.check_head_dim(head_dim).expect("KvScheme::check before building caches");
        RowCache::with_codec(AffineRows(quant), kv_heads, head_dim, quant.row_bytes(head_dim), device)
    }
}

impl RowCodec for AffineRows {
    fn format(&self) -> KvQuant {
        self.0
    }

    fn tag(&self) -> Option<KvQuant> {
        Some(self.0)
    }

    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((kv_quant::quantize(self.0, k)?, kv_quant::quantize(self.0, v)?))
    }

    fn fetch(&self, rows: KvView) -> Result<KvView> {
        Ok(KvView { quant: Some(self.0), ..rows })
    }

    fn pageable(&self) -> Option<KvQuant> {
        Some(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SeqCache;

    fn bits(t: &Tensor) -> Vec<u8> {
        t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
    }

    /// Rows written across appends are the rows of quantizing everything at once; trimming
    /// rewinds; bytes are the quantized rows'; a fork holds the same bits.
    #[test]
    fn appends_trim_bytes_and_forks() -> Result<()> {
        let dev = Device::Cpu;
        let q = KvQuant::new(4, 32).unwrap();
        let mut c = QuantCache::new(2, 64, q, &dev);
        let a = Tensor::randn(0f32, 1.0, (2, 300, 64), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (2, 1, 64), &dev)?;
        c.update_and_fetch(&a, &a)?;
        let view = c.update_and_fetch(&b, &b)?;
        assert_eq!(view.quant, Some(q));
        assert_eq!(view.k.dims(), &[2, 301, 40]);
        let whole = kv_quant::quantize(q, &Tensor::cat(&[&a, &b], 1)?)?;
        assert_eq!(bits(&view.k), bits(&whole));
        assert_eq!(c.bytes_per_token(), 2 * 2 * 40);
        assert_eq!(c.signature(), "kv:q4g32");
        assert_eq!(c.trim(1), 1);
        assert_eq!(c.offset(), 300);
        let mut seq = SeqCache::new(vec![Box::new(c)]);
        let fork = seq.fork_into(SeqCache::new(vec![Box::new(QuantCache::new(2, 64, q, &dev))]))?;
        let (va, vb) = (seq.layer(0).state()?.unwrap(), fork.layer_ref(0).state()?.unwrap());
        assert_eq!(bits(&va.k), bits(&vb.k));
        assert_eq!(fork.offset(), 300);
        Ok(())
    }

    /// A state of another format is refused, not misread.
    #[test]
    fn other_formats_are_refused() -> Result<()> {
        let dev = Device::Cpu;
        let mut c8 = QuantCache::new(1, 64, KvQuant::new(8, 32).unwrap(), &dev);
        let x = Tensor::randn(0f32, 1.0, (1, 3, 64), &dev)?;
        c8.update_and_fetch(&x, &x)?;
        let state = c8.state()?.unwrap();
        let mut c4 = QuantCache::new(1, 64, KvQuant::new(4, 32).unwrap(), &dev);
        assert!(c4.load_state(&state, 3).is_err());
        let mut plain = PlainCache::new(1, 64, DType::F32, &dev);
        plain.update_and_fetch(&x, &x)?;
        assert!(c8.load_state(&plain.state()?.unwrap(), 3).is_err());
        Ok(())
    }

    /// The disk tier stores the quantized rows and reads them back, bit for bit, into a cache
    /// of the same format; a cache of another format does not take the entry.
    #[test]
    fn quantized_rows_survive_the_disk_tier() -> Result<()> {
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("ferrolm-kvq-disk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let q = KvQuant::new(4, 32).unwrap();
        let make = |q: KvQuant| SeqCache::new(vec![Box::new(QuantCache::new(2, 64, q, &dev)) as Box<dyn KvCache>]);
        let mut seq = make(q);
        let x = Tensor::randn(0f32, 1.0, (2, 9, 64), &dev)?;
        seq.layer(0).update_and_fetch(&x, &x)?;
        let tokens: Vec<u32> = (1..=9).collect();
        {
            let mut tier = crate::DiskTier::open(&dir, 1 << 30, "test").map_err(candle_core::Error::wrap)?;
            tier.store(&tokens, &seq)?;
            tier.flush();
        }
        let mut tier = crate::DiskTier::open(&dir, 1 << 30, "test").map_err(candle_core::Error::wrap)?;
        let (i, n) = tier.best(&tokens, 9).expect("the entry is indexed");
        assert_eq!(n, 9);
        let (_, back) = tier.load(i, make(q)).expect("the entry loads");
        assert_eq!(bits(&back.layer_ref(0).state()?.unwrap().k), bits(&seq.layer(0).state()?.unwrap().k));
        assert_eq!(back.offset(), 9);
        assert!(tier.best(&tokens, 9).is_some_and(|(i, _)| tier.load(i, make(q.with_rotation(false))).is_none()));
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn turbo_schemes() {
        assert_eq!(KvScheme::from_kv_quant("turbo"), Ok(KvScheme::Quant(KvQuant::turbo(8, 3).unwrap())));
        assert_eq!(KvScheme::from_kv_quant("turbo:k4v2"), Ok(KvScheme::Quant(KvQuant::turbo(4, 2).unwrap())));
        assert_eq!(KvScheme::from_kv_quant("turbo-k8v4"), Ok(KvScheme::Quant(KvQuant::turbo(8, 4).unwrap())));
        for bad in ["turbo:k8", "turbo:k3v3", "turbo:k8v5", "turbo:v3k8", "tq", "turbo:"] {
            assert!(KvScheme::from_kv_quant(bad).is_err(), "{bad}");
        }
        let s = KvScheme::from_kv_quant("turbo").unwrap();
        assert!(s.check(128, &Device::Cpu).is_ok() && s.check(96, &Device::Cpu).is_err());
        assert_eq!(s.full_layer(2, 128, DType::F16, &Device::Cpu).signature(), "kv:turbo-k8v3");
    }

    #[test]
    fn schemes_from_flags() {
        assert_eq!(KvScheme::from_flags(None, 32), Ok(KvScheme::Float));
        assert_eq!(KvScheme::from_flags(Some(16), 32), Ok(KvScheme::Float));
        assert!(KvScheme::from_flags(Some(5), 32).is_err());
        assert!(KvScheme::from_flags(Some(8), 32).unwrap().check(96, &Device::Cpu).is_ok());
        assert!(KvScheme::from_flags(Some(8), 64).unwrap().check(96, &Device::Cpu).is_err());
    }
}
