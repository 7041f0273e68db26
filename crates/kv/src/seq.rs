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
    pub fn offset(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offset())
    }

    pub fn is_trimmable(&self) -> bool {
        self.layers.iter().all(|l| l.is_trimmable())
    }

    pub fn trim(&mut self, n: usize) -> usize {
        self.layers.iter_mut().map(|l| l.trim(n)).min().unwrap_or(0)
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
