use crate::KvCache;

/// All layers' caches of one sequence. The engine owns it; the model writes through it.
pub struct SeqCache {
    layers: Vec<Box<dyn KvCache>>,
}

impl SeqCache {
    pub fn new(layers: Vec<Box<dyn KvCache>>) -> Self {
        Self { layers }
    }

    pub fn layer(&mut self, i: usize) -> &mut dyn KvCache {
        self.layers[i].as_mut()
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

    /// The distinct signatures of the layers, e.g. `kv:plain` or `kv:rotating+kv:plain`.
    pub fn signature(&self) -> String {
        let mut sigs: Vec<String> = self.layers.iter().map(|l| l.signature()).collect();
        sigs.dedup();
        sigs.join("+")
    }
}
