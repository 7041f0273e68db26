use crate::KvCache;

/// All layers' caches of one sequence. The engine owns it; the model writes through it.
pub struct SeqCache {
    layers: Vec<Box<dyn KvCache>>,
}

impl SeqCache {
    pub fn new(layers: Vec<Box<dyn KvCache>>) -> Self {
        Self { layers }
    }

    /// The layers' caches, for building another `SeqCache` from them.
    pub fn into_layers(self) -> Vec<Box<dyn KvCache>> {
        self.layers
    }

    pub fn layer(&mut self, i: usize) -> &mut dyn KvCache {
        self.layers[i].as_mut()
    }

    pub fn layer_ref(&self, i: usize) -> &dyn KvCache {
        self.layers[i].as_ref()
    }

    /// The device of the layers' buffers (CPU for a cache without layers).
    pub fn device(&self) -> candle_core::Device {
        self.layers.first().map_or(candle_core::Device::Cpu, |l| l.device().clone())
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Tokens in the cache (all layers agree by construction).
    /// Every layer's whole buffers with room for `extra` more tokens (see
    /// [`KvCache::static_buffers`]); `None` when some layer keeps no such buffers.
    pub fn static_buffers(&mut self, extra: usize) -> candle_core::Result<Option<Vec<(candle_core::Tensor, candle_core::Tensor)>>> {
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &mut self.layers {
            match l.static_buffers(extra)? {
                Some(kv) => out.push(kv),
                None => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// Counts `n` tokens written in place by static steps, in every layer.
    pub fn commit_static(&mut self, n: usize) -> candle_core::Result<()> {
        self.layers.iter_mut().try_for_each(|l| l.commit_static(n))
    }

    pub fn offset(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offset())
    }

    pub fn is_trimmable(&self) -> bool {
        self.layers.iter().all(|l| l.is_trimmable())
    }

    /// How many tokens every layer can trim exactly.
    pub fn max_trim(&self) -> usize {
        self.layers.iter().map(|l| l.max_trim()).min().unwrap_or(0)
    }

    /// Removes the same number of tokens, at most `n` and at most `max_trim`, from every layer
    /// (so the layers stay aligned); returns that number.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.max_trim());
        for l in &mut self.layers {
            let removed = l.trim(n);
            debug_assert_eq!(removed, n, "{} trimmed {removed} of {n}", l.signature());
        }
        n
    }

    pub fn bytes_per_token(&self) -> usize {
        self.layers.iter().map(|l| l.bytes_per_token()).sum()
    }

    /// A copy of this cache's contents in `empty` (fresh caches of the same model): the same
    /// tokens, bits and positions, so a sequence forked from it continues exactly as this one
    /// would (several choices of one prompt share its prefill this way).
    pub fn fork_into(&self, mut empty: SeqCache) -> candle_core::Result<SeqCache> {
        if empty.layers.len() != self.layers.len() {
            candle_core::bail!("fork: {} layers into {}", self.layers.len(), empty.layers.len())
        }
        for (from, to) in self.layers.iter().zip(&mut empty.layers) {
            if let Some(shared) = from.share_prefix(from.offset()) {
                *to = shared; // paged: the same blocks, copied on write
            } else if let Some(state) = from.state()? {
                to.load_state(&state, from.offset())?;
            }
        }
        Ok(empty)
    }

    /// A copy of this cache's first `n` tokens in `empty` (fresh caches of the same model), or
    /// None when some layer no longer holds what that prefix needs (see
    /// [`KvCache::state_prefix`]).
    pub fn fork_prefix(&self, n: usize, mut empty: SeqCache) -> candle_core::Result<Option<SeqCache>> {
        if empty.layers.len() != self.layers.len() || n > self.offset() {
            return Ok(None);
        }
        for (from, to) in self.layers.iter().zip(&mut empty.layers) {
            if let Some(shared) = from.share_prefix(n) {
                *to = shared;
                continue;
            }
            match from.state_prefix(n)? {
                Some(state) => to.load_state(&state, n)?,
                None if n == 0 => {}
                None => return Ok(None),
            }
        }
        Ok(Some(empty))
    }

    /// Bytes the layers' buffers hold (their capacity, not only the tokens in use).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes_held()).sum()
    }

    /// The distinct signatures of the layers, e.g. `kv:plain` or `kv:rotating+kv:plain`.
    pub fn signature(&self) -> String {
        let mut sigs: Vec<String> = self.layers.iter().map(|l| l.signature()).collect();
        sigs.dedup();
        sigs.join("+")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{PlainCache, RotatingCache};
    use candle_core::{DType, Device, Tensor};

    /// A fork holds the same keys and values and continues like the original, on plain and
    /// rotating (wrapped) layers.
    #[test]
    fn a_fork_continues_like_the_original() {
        let dev = Device::Cpu;
        let make = || SeqCache::new(vec![Box::new(PlainCache::new(2, 4, DType::F32, &dev)), Box::new(RotatingCache::new(2, 4, 8, DType::F32, &dev))]);
        let mut a = make();
        let x = Tensor::randn(0f32, 1.0, (2, 11, 4), &dev).unwrap();
        for i in 0..a.num_layers() {
            a.layer(i).update_and_fetch(&x, &x).unwrap();
        }
        let mut b = a.fork_into(make()).unwrap();
        assert_eq!(b.offset(), 11);
        let y = Tensor::randn(0f32, 1.0, (2, 1, 4), &dev).unwrap();
        for i in 0..a.num_layers() {
            let (va, vb) = (a.layer(i).update_and_fetch(&y, &y).unwrap(), b.layer(i).update_and_fetch(&y, &y).unwrap());
            assert_eq!(va.key_start, vb.key_start);
            let diff = (va.k - vb.k).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "layer {i}");
        }
    }
}
