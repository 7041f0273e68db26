use crate::{KvCache, KvView};
use candle_core::{DType, Device, Result, Tensor};

/// Growth step in tokens, as mlx-lm's KVCache: capacity grows in slabs so appends are in place.
const STEP: usize = 256;

/// A growing cache holding every token: `[kv_heads, capacity, head_dim]` buffers.
pub struct PlainCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    offset: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl PlainCache {
    /// Names a float cache holding every token in order; a paged layer's state is the same
    /// (`PagedCache` signs with it too, so snapshots and disk files move between the layouts).
    pub(crate) const SIGNATURE: &'static str = "kv:plain";

    pub fn new(kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Self {
        Self {
            k: None,
            v: None,
            offset: 0,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
    }

    fn capacity(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[1])
    }

    /// Makes room for `extra` more tokens, copying the filled part into a larger buffer.
    fn reserve(&mut self, extra: usize) -> Result<()> {
        let needed = self.offset + extra;
        if needed <= self.capacity() {
            return Ok(());
        }
        let capacity = needed.div_ceil(STEP) * STEP;
        let shape = (self.kv_heads, capacity, self.head_dim);
        let k = Tensor::zeros(shape, self.dtype, &self.device)?;
        let v = Tensor::zeros(shape, self.dtype, &self.device)?;
        if let (Some(old_k), Some(old_v)) = (&self.k, &self.v) {
            k.slice_set(&old_k.narrow(1, 0, self.offset)?.contiguous()?, 1, 0)?;
            v.slice_set(&old_v.narrow(1, 0, self.offset)?.contiguous()?, 1, 0)?;
        }
        self.k = Some(k);
        self.v = Some(v);
        Ok(())
    }

    /// The first `n` tokens (at most `offset`); None before any buffer exists.
    fn first(&self, n: usize) -> Result<Option<KvView>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => {
                Ok(Some(KvView { k: k.narrow(1, 0, n)?, v: v.narrow(1, 0, n)?, key_start: 0, quant: None, table: None }))
            }
            _ => Ok(None),
        }
    }
}

impl KvCache for PlainCache {
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let new = k.dims()[1];
        self.reserve(new)?;
        let (bk, bv) = (self.k.as_ref().unwrap(), self.v.as_ref().unwrap());
        bk.slice_set(&k.to_dtype(self.dtype)?.contiguous()?, 1, self.offset)?;
        bv.slice_set(&v.to_dtype(self.dtype)?.contiguous()?, 1, self.offset)?;
        self.offset += new;
        Ok(self.first(self.offset)?.expect("reserved above"))
    }

    fn offset(&self) -> usize {
        self.offset
    }

    fn is_trimmable(&self) -> bool {
        true
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    fn signature(&self) -> String {
        Self::SIGNATURE.into()
    }

    fn plain_shape(&self) -> Option<(usize, usize, DType)> {
        Some((self.kv_heads, self.head_dim, self.dtype))
    }

    fn bytes_per_token(&self) -> usize {
        2 * self.kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    fn bytes_held(&self) -> usize {
        self.capacity() * self.bytes_per_token()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn state(&self) -> Result<Option<KvView>> {
        self.first(self.offset)
    }

    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()> {
        self.k = None;
        self.v = None;
        self.offset = 0;
        self.update_and_fetch(&state.k, &state.v)?;
        self.offset = offset;
        Ok(())
    }

    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        if n > self.offset {
            return Ok(None);
        }
        self.first(n)
    }

    fn static_buffers(&mut self, extra: usize) -> Result<Option<(Tensor, Tensor)>> {
        self.reserve(extra.max(1))?;
        Ok(self.k.clone().zip(self.v.clone()))
    }

    fn commit_static(&mut self, n: usize) -> Result<()> {
        if self.offset + n > self.capacity() {
            candle_core::bail!("kv:plain: {n} static tokens overflow the buffers ({} of {})", self.offset, self.capacity())
        }
        self.offset += n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Static buffers keep their identity while they have room; committed tokens count.
    #[test]
    fn static_buffers_are_stable_and_commits_advance() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = PlainCache::new(2, 4, DType::F32, &dev);
        let a = Tensor::randn(0f32, 1.0, (2, 10, 4), &dev)?;
        c.update_and_fetch(&a, &a)?;
        let (k1, _) = c.static_buffers(100)?.unwrap();
        assert!(k1.dims()[1] >= 110);
        c.commit_static(3)?;
        assert_eq!(c.offset(), 13);
        let (k2, _) = c.static_buffers(50)?.unwrap();
        assert_eq!(k1.id(), k2.id());
        assert!(c.commit_static(1000).is_err());
        Ok(())
    }

    #[test]
    fn appends_grow_across_steps_and_trim_rewinds() -> Result<()> {
        let dev = Device::Cpu;
        let mut c = PlainCache::new(2, 4, DType::F32, &dev);
        let a = Tensor::randn(0f32, 1.0, (2, 300, 4), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (2, 1, 4), &dev)?;
        c.update_and_fetch(&a, &a)?;
        let view = c.update_and_fetch(&b, &b)?;
        assert_eq!(c.offset(), 301);
        assert_eq!(view.k.dims(), &[2, 301, 4]);
        let expect = Tensor::cat(&[&a, &b], 1)?;
        let diff = (view.k - &expect)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        assert_eq!(c.trim(2), 2);
        let view = c.update_and_fetch(&b, &b)?;
        assert_eq!(view.k.dims(), &[2, 300, 4]);
        let last = view.k.narrow(1, 299, 1)?;
        assert_eq!((last - &b)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }
}
