//! mlx_lm's `--quantized-kv-start N`: a layer's cache stays float while it holds at most N
//! tokens; the first write after a step left it holding more quantizes everything cached so far
//! and the cache is quantized from then on (mlx_lm's `maybe_quantize_kv_cache`, which runs after
//! each step and converts the whole cache once `offset > quantized_kv_start`).
//!
//! As in mlx_lm, where the switch happens depends on how a prompt was cut into steps: a prompt
//! longer than N prefilled in one step attends in float throughout, in several steps partly over
//! quantized rows. So with N > 0 ferrolm's "same bits however a prompt is chunked" and "a
//! prompt-cache hit continues as the uncached run" hold only while caches stay below N.

use super::{KvScheme, TurboCache};
use crate::{KvCache, KvView, PlainCache};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::kv_quant::KvQuant;

pub struct DeferredCache {
    /// The float phase; None once quantized.
    float: Option<PlainCache>,
    quant: Box<dyn KvCache>,
    /// The format with its `start`.
    format: KvQuant,
}

impl DeferredCache {
    /// `format.start > 0`; `dtype` the float phase's (the device's KV dtype).
    pub fn new(kv_heads: usize, head_dim: usize, format: KvQuant, dtype: DType, device: &Device) -> Self {
        let rows = format.starting_at(0);
        let quant: Box<dyn KvCache> = match rows.turbo_values {
            Some(_) => Box::new(TurboCache::new(kv_heads, head_dim, rows, device)),
            None => Box::new(super::QuantCache::new(kv_heads, head_dim, rows, device)),
        };
        Self { float: Some(PlainCache::new(kv_heads, head_dim, dtype, device)), quant, format }
    }

    fn active(&self) -> &dyn KvCache {
        match &self.float {
            Some(f) => f,
            None => self.quant.as_ref(),
        }
    }

    /// Quantizes everything the float phase holds (the quantized cache is empty until now).
    fn convert(&mut self) -> Result<()> {
        if let Some(float) = self.float.take() {
            if let Some(view) = float.state()? {
                self.quant.update_and_fetch(&view.k, &view.v)?;
            }
        }
        Ok(())
    }
}

impl KvCache for DeferredCache {
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        if self.float.as_ref().is_some_and(|f| f.offset() > self.format.start) {
            self.convert()?;
        }
        match &mut self.float {
            Some(f) => f.update_and_fetch(k, v),
            None => self.quant.update_and_fetch(k, v),
        }
    }

    fn offset(&self) -> usize {
        self.active().offset()
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    /// Trimming keeps the phase (mlx_lm does not turn a quantized cache back into a float one).
    fn trim(&mut self, n: usize) -> usize {
        match &mut self.float {
            Some(f) => f.trim(n),
            None => self.quant.trim(n),
        }
    }

    fn signature(&self) -> String {
        format!("kv:{}", self.format.name())
    }

    /// The phase's bytes: float while the cache is short, quantized after.
    fn bytes_per_token(&self) -> usize {
        self.active().bytes_per_token()
    }

    fn bytes_held(&self) -> usize {
        self.float.as_ref().map_or(0, |f| f.bytes_held()) + self.quant.bytes_held()
    }

    fn device(&self) -> &Device {
        self.quant.device()
    }

    /// The phase's own state: float rows, or the quantized rows.
    fn state(&self) -> Result<Option<KvView>> {
        self.active().state()
    }

    /// A float state restores the float phase, a state of quantized rows the quantized one.
    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()> {
        if state.k.dtype() == DType::U8 {
            self.float = None;
            return self.quant.load_state(state, offset);
        }
        match &mut self.float {
            Some(f) => f.load_state(state, offset),
            None => candle_core::bail!("{}: a float state for a cache that is already quantized", self.signature()),
        }
    }

    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        self.active().state_prefix(n)
    }
}

/// A scheme's cache for one full-attention layer, deferred when its format has a `start`.
pub(super) fn layer(format: KvQuant, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Box<dyn KvCache> {
    match (format.start, format.turbo_values) {
        (0, Some(_)) => Box::new(TurboCache::new(kv_heads, head_dim, format, device)),
        (0, None) => Box::new(super::QuantCache::new(kv_heads, head_dim, format, device)),
        _ => Box::new(DeferredCache::new(kv_heads, head_dim, format, dtype, device)),
    }
}

impl KvScheme {
    /// This scheme quantizing only once a cache holds more than `start` tokens (0: from the
    /// first token; a float scheme stays float).
    pub fn starting_at(self, start: usize) -> Self {
        match self {
            Self::Quant(q) => Self::Quant(q.starting_at(start)),
            float => float,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(t: &Tensor) -> Vec<u8> {
        t.flatten_all().unwrap().to_vec1::<u8>().unwrap()
    }

    /// Float while at most N tokens are held (also the write that crosses N); the next write
    /// quantizes everything, giving the rows a quantized cache written with all of it holds;
    /// states restore either phase.
    #[test]
    fn float_until_past_start_then_all_quantized() -> Result<()> {
        let dev = Device::Cpu;
        let q = KvQuant::new(8, 32).unwrap();
        let mut c = DeferredCache::new(2, 64, q.starting_at(10), DType::F16, &dev);
        assert_eq!(c.signature(), "kv:q8g32@10");
        let x = Tensor::randn(0f32, 1.0, (2, 20, 64), &dev)?.to_dtype(DType::F16)?;
        let view = c.update_and_fetch(&x.narrow(1, 0, 8)?, &x.narrow(1, 0, 8)?)?;
        assert_eq!((view.quant, view.k.dtype()), (None, DType::F16));
        let view = c.update_and_fetch(&x.narrow(1, 8, 4)?, &x.narrow(1, 8, 4)?)?;
        assert_eq!((view.quant, c.offset()), (None, 12));
        let float_state = c.state()?.unwrap();
        assert_eq!(c.bytes_per_token(), 2 * 2 * 64 * 2);
        let view = c.update_and_fetch(&x.narrow(1, 12, 1)?, &x.narrow(1, 12, 1)?)?;
        assert_eq!(view.quant, Some(q));
        let mut whole = super::super::QuantCache::new(2, 64, q, &dev);
        whole.update_and_fetch(&x.narrow(1, 0, 13)?, &x.narrow(1, 0, 13)?)?;
        assert_eq!(bytes(&view.k), bytes(&whole.state()?.unwrap().k));
        assert_eq!(c.bytes_per_token(), 2 * 2 * 72);
        assert_eq!(c.trim(10), 10);
        assert_eq!(c.update_and_fetch(&x.narrow(1, 3, 1)?, &x.narrow(1, 3, 1)?)?.quant, Some(q));
        // States: a quantized one restores the quantized phase, a float one the float phase.
        let mut back = DeferredCache::new(2, 64, q.starting_at(10), DType::F16, &dev);
        back.load_state(&float_state, 12)?;
        assert_eq!(back.update_and_fetch(&x.narrow(1, 12, 1)?, &x.narrow(1, 12, 1)?)?.quant, Some(q));
        let mut back = DeferredCache::new(2, 64, q.starting_at(10), DType::F16, &dev);
        back.load_state(&c.state()?.unwrap(), 4)?;
        assert_eq!((back.offset(), back.update_and_fetch(&x.narrow(1, 4, 1)?, &x.narrow(1, 4, 1)?)?.quant), (4, Some(q)));
        Ok(())
    }

    #[test]
    fn start_zero_is_the_plain_quantized_cache() {
        let dev = Device::Cpu;
        let s = KvScheme::Quant(KvQuant::new(4, 32).unwrap());
        assert_eq!(s.starting_at(0).full_layer(1, 64, DType::F16, &dev).signature(), "kv:q4g32");
        assert_eq!(s.starting_at(64).full_layer(1, 64, DType::F16, &dev).signature(), "kv:q4g32@64");
        assert_eq!(KvScheme::Float.starting_at(64), KvScheme::Float);
        let turbo = KvScheme::from_kv_quant("turbo").unwrap().starting_at(5000);
        assert_eq!(turbo.full_layer(1, 64, DType::F16, &dev).signature(), "kv:turbo-k8v3@5000");
    }
}
