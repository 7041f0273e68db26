//! Prefix sharing over paged caches: full blocks of prompt tokens are keyed by a hash chain of
//! their tokens (salted with the model's identity, the cache kind and the block size), so a new
//! request finds the longest cached prefix block by block and takes its blocks by reference —
//! no copy. A partial last block (a previous prompt that ended inside a block, or a cached block
//! the new prompt leaves part way) is shared too and copied on the first write
//! (`PagedCache::writable_block`).
//!
//! The index holds one reference on each block it keeps. `--prompt-cache-bytes` caps the bytes
//! of the index's blocks: least recently used leaves whose blocks nobody else references are
//! evicted; a block a running sequence holds is never evicted (it may keep the index over its
//! cap until that sequence lets go).
//!
//! Sliding-window layers (Gemma 3's local layers) release the blocks their window has left, so
//! a node may hold no block for such a layer (`None`). A prefix of `t` tokens is shared only if
//! every sliding layer's nodes hold the blocks covering its last `window - 1` positions (what the
//! query at `t` sees); else the hit shrinks to the longest block boundary that is covered. The
//! index's reference keeps a block alive after its sequence released it, so what a running
//! sequence registers when its prompt is in (its window's blocks, with a block's margin, see
//! `PagedCache`) stays reusable after it decoded far past it; at retirement the blocks it still
//! holds fill the nodes' missing ones. The keys stay the tokens' hash chain: which blocks a node
//! holds never changes its key.
//!
//! What goes in is the caller's choice; the engine registers only keys and values its prompt
//! rows produced (see `prefix.rs`), so a shared prefix continues bit for bit as an uncached one.

use crate::{BlockPool, KvCache, PagedCache, PromptCacheStats, SeqCache};
use ferrolm_core::TokenId;
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

/// The block pools of one model's layers: `Some` for each layer `--kv-layout paged` pages (the
/// float layers, full attention or sliding windows, and the layers of affine-quantized rows),
/// `None` for the others (TurboQuant, deferred quantization).
#[derive(Clone)]
pub struct PagedPools {
    pools: Vec<Option<Arc<BlockPool>>>,
    /// The window of each sliding-window layer.
    windows: Vec<Option<usize>>,
    block_tokens: usize,
}

impl PagedPools {
    /// Pools for the plain, sliding-window and quantized layers of `template` (a fresh cache of
    /// the model).
    pub fn for_model(template: &SeqCache, block_tokens: usize) -> Self {
        let (mut pools, mut windows) = (Vec::new(), Vec::new());
        for i in 0..template.num_layers() {
            let layer = template.layer_ref(i);
            let shape = layer.plain_shape().map(|(h, d, dt)| (h, d, dt, None)).or(layer.sliding_shape().map(|(h, d, dt, w)| (h, d, dt, Some(w))));
            let quantized = layer.quant_shape().map(|(h, d, q)| BlockPool::quantized(block_tokens, h, d, q, layer.device()));
            pools.push(shape.map(|(h, d, dt, _)| BlockPool::new(block_tokens, h, d, dt, layer.device())).or(quantized));
            windows.push(shape.and_then(|s| s.3));
        }
        Self { pools, windows, block_tokens }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Whether every layer is paged (prefix sharing by blocks needs it).
    pub fn all_paged(&self) -> bool {
        !self.pools.is_empty() && self.pools.iter().all(Option::is_some)
    }

    /// `template` (a fresh cache of the model) with its plain, sliding-window and quantized
    /// layers paged.
    pub fn make(&self, template: SeqCache) -> SeqCache {
        let layers = template
            .into_layers()
            .into_iter()
            .zip(self.pools.iter().zip(&self.windows))
            .map(|(layer, (pool, window))| match (pool, window) {
                (Some(pool), None) => Box::new(PagedCache::new(pool.clone())) as Box<dyn KvCache>,
                (Some(pool), Some(w)) => Box::new(PagedCache::sliding(pool.clone(), *w)),
                (None, _) => layer,
            })
            .collect();
        SeqCache::new(layers)
    }

    /// Blocks referenced now (by sequences or the index) over all layers, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        self.pools.iter().flatten().fold((0, 0), |(n, b), p| {
            let used = p.usage().0;
            (n + used, b + used * p.block_bytes())
        })
    }

    fn paged(&self) -> impl Iterator<Item = &Arc<BlockPool>> {
        self.pools.iter().flatten()
    }
}

/// One cached block of prompt tokens: the same token positions in every layer's pool.
struct Node {
    parent: u64,
    /// The block's tokens: `block_tokens` of them, fewer for a partial block.
    tokens: Vec<TokenId>,
    /// Its block in each layer's pool; None where a sliding window had released it.
    blocks: Vec<Option<usize>>,
    /// LRU clock: higher is more recent.
    used: u64,
    /// Blocks before it in its chain.
    depth: usize,
}

/// The prefix index: cached blocks of prompts, found by the hash chain of their tokens.
pub struct BlockIndex {
    pools: PagedPools,
    /// The chain's root: the model, the cache kind and the block size.
    salt: u64,
    nodes: HashMap<u64, Node>,
    children: HashMap<u64, Vec<u64>>,
    max_bytes: usize,
    /// Bytes of the blocks the nodes hold.
    bytes: usize,
    clock: u64,
    stats: PromptCacheStats,
}

impl BlockIndex {
    /// An index over `pools` (every layer paged) holding at most `max_bytes` of blocks;
    /// `identity` names the model and `kind` the cache (its signature).
    pub fn new(pools: PagedPools, identity: &str, kind: &str, max_bytes: usize) -> Self {
        assert!(pools.all_paged(), "prefix sharing by blocks needs every layer paged");
        let mut h = DefaultHasher::new();
        (identity, kind, pools.block_tokens).hash(&mut h);
        let stats = PromptCacheStats { max_bytes, ..Default::default() };
        Self { pools, salt: h.finish(), nodes: HashMap::new(), children: HashMap::new(), max_bytes, bytes: 0, clock: 0, stats }
    }

    fn chain(parent: u64, tokens: &[TokenId]) -> u64 {
        let mut h = DefaultHasher::new();
        (parent, tokens).hash(&mut h);
        h.finish()
    }

    pub fn stats(&self) -> PromptCacheStats {
        PromptCacheStats { entries: self.nodes.len(), bytes: self.bytes, ..self.stats }
    }

    /// Takes a reference on `block` of `layer` for a node.
    fn hold(&mut self, layer: usize, block: usize) {
        let pool = self.pools.pools[layer].as_ref().expect("every layer paged");
        pool.retain(&[block]);
        self.bytes += pool.block_bytes();
    }

    /// Keeps the blocks holding `tokens` (the first `tokens.len()` tokens of `cache`, a cache of
    /// these pools): every whole block, and with `partial` the last part-filled one too.
    /// Blocks already kept for the same tokens stay as they are.
    pub fn register(&mut self, tokens: &[TokenId], cache: &SeqCache, partial: bool) {
        let layers: Option<Vec<&PagedCache>> = (0..cache.num_layers()).map(|i| cache.layer_ref(i).as_paged()).collect();
        let Some(layers) = layers.filter(|l| l.len() == self.pools.pools.len() && tokens.len() <= cache.offset()) else { return };
        self.clock += 1;
        let bt = self.pools.block_tokens;
        let mut parent = self.salt;
        for (i, chunk) in tokens.chunks(bt).enumerate() {
            if chunk.len() < bt && !partial {
                break;
            }
            let key = Self::chain(parent, chunk);
            let held: Vec<Option<usize>> = layers.iter().map(|l| l.block_at(i)).collect();
            if let Some(node) = self.nodes.get_mut(&key).filter(|n| n.parent == parent && n.tokens == chunk) {
                node.used = self.clock;
                // Blocks a sliding window had released before: taken from this cache if it holds them.
                let fill: Vec<(usize, usize)> = node.blocks.iter_mut().zip(&held).enumerate().filter_map(|(l, (slot, b))| (slot.is_none() && b.is_some()).then(|| (l, *slot.insert(b.expect("checked"))))).collect();
                fill.into_iter().for_each(|(l, b)| self.hold(l, b));
            } else if !self.nodes.contains_key(&key) {
                held.iter().enumerate().filter_map(|(l, b)| b.map(|b| (l, b))).for_each(|(l, b)| self.hold(l, b));
                self.nodes.insert(key, Node { parent, tokens: chunk.to_vec(), blocks: held, used: self.clock, depth: i });
                self.children.entry(parent).or_default().push(key);
            } else {
                return; // a hash collision: keep what is there, stop the chain
            }
            parent = key;
        }
        self.evict();
    }

    /// A cache sharing the longest cached prefix of `prompt` that leaves at least one token to
    /// forward (fresh layers for the model come from `fresh`), and its length; None on a miss.
    pub fn take(&mut self, prompt: &[TokenId], fresh: &dyn Fn() -> SeqCache) -> Option<(SeqCache, usize)> {
        self.evict(); // blocks finished sequences let go of since the last call
        let found = self.lookup(prompt, prompt.len().saturating_sub(1), fresh);
        match &found {
            Some((_, tokens)) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += *tokens as u64;
            }
            None => self.stats.misses += 1,
        }
        found
    }

    /// A cache sharing all of `tokens` if the index holds them (and the sliding windows before
    /// their end), not counted as a hit: a finished prompt written to the disk tier from here
    /// when its own cache could not trim back to it.
    pub fn share(&mut self, tokens: &[TokenId], fresh: &dyn Fn() -> SeqCache) -> Option<SeqCache> {
        self.lookup(tokens, tokens.len(), fresh).filter(|h| h.1 == tokens.len()).map(|h| h.0)
    }

    /// The longest cached prefix of `prompt[..limit]` whose windows are held, shared.
    fn lookup(&mut self, prompt: &[TokenId], limit: usize, fresh: &dyn Fn() -> SeqCache) -> Option<(SeqCache, usize)> {
        let bt = self.pools.block_tokens;
        self.clock += 1;
        let (mut parent, mut chain) = (self.salt, Vec::new());
        while chain.len() * bt + bt <= limit {
            let chunk = &prompt[chain.len() * bt..chain.len() * bt + bt];
            let key = Self::chain(parent, chunk);
            match self.nodes.get(&key) {
                Some(n) if n.parent == parent && n.tokens == chunk => {
                    chain.push(key);
                    parent = key;
                }
                _ => break,
            }
        }
        // The block after the whole ones: any cached child sharing a first part of the rest.
        let rest = &prompt[chain.len() * bt..limit];
        let common = |n: &Node| n.tokens.iter().zip(rest).take_while(|(a, b)| a == b).count();
        let part = self.children.get(&parent).and_then(|kids| kids.iter().map(|k| (*k, common(&self.nodes[k]))).filter(|(_, c)| *c > 0).max_by_key(|(_, c)| *c));
        let whole = chain.len();
        chain.extend(part.map(|p| p.0));
        let tokens = self.covered_length(&chain, whole * bt + part.map_or(0, |p| p.1))?;
        chain.truncate(tokens.div_ceil(bt));
        for key in &chain {
            self.nodes.get_mut(key).expect("found above").used = self.clock;
        }
        let layers = fresh().into_layers().into_iter().enumerate().map(|(layer, _)| {
            let pool = self.pools.pools[layer].clone().expect("every layer paged");
            let window = self.pools.windows[layer];
            let first = self.window_start(window, tokens) / bt;
            let blocks: Vec<usize> = chain[first..].iter().map(|k| self.nodes[k].blocks[layer].expect("covered")).collect();
            Box::new(PagedCache::sharing_from(pool, window, first, &blocks, tokens)) as Box<dyn KvCache>
        });
        Some((SeqCache::new(layers.collect()), tokens))
    }

    /// The first position the query at `t` sees in a layer of `window` (0 for full attention).
    fn window_start(&self, window: Option<usize>, t: usize) -> usize {
        window.map_or(0, |w| (t + 1).saturating_sub(w))
    }

    /// The longest prefix length, `tokens` or a block boundary below it, whose nodes (`chain`,
    /// in order) hold every block the query after it reads in every layer; None if none does.
    fn covered_length(&self, chain: &[u64], tokens: usize) -> Option<usize> {
        let bt = self.pools.block_tokens;
        let whole = (tokens / bt).min(chain.len());
        let covered = |t: usize| {
            self.pools.windows.iter().enumerate().all(|(layer, &w)| {
                let first = self.window_start(w, t) / bt;
                chain[first..t.div_ceil(bt)].iter().all(|k| self.nodes[k].blocks[layer].is_some())
            })
        };
        std::iter::once(tokens).chain((1..=whole).rev().map(|k| k * bt)).filter(|&t| t > 0 && t <= tokens).find(|&t| covered(t))
    }

    /// Evicts least recently used leaves nobody else references (deeper ones first among
    /// equals) while the index holds more than its cap.
    fn evict(&mut self) {
        while self.bytes > self.max_bytes {
            let pools = &self.pools.pools;
            let unreferenced = |n: &Node| n.blocks.iter().zip(pools).all(|(b, p)| b.is_none_or(|b| p.as_ref().is_some_and(|p| p.refs(b) == 1)));
            let victim = self
                .nodes
                .iter()
                .filter(|(k, n)| self.children.get(k).is_none_or(Vec::is_empty) && unreferenced(n))
                .min_by_key(|(_, n)| (n.used, std::cmp::Reverse(n.depth)))
                .map(|(k, _)| *k);
            let Some(key) = victim else { break };
            let node = self.nodes.remove(&key).expect("found above");
            self.release(&node);
            if let Some(kids) = self.children.get_mut(&node.parent) {
                kids.retain(|k| *k != key);
            }
            self.children.remove(&key);
        }
    }
}

impl BlockIndex {
    /// Drops a node's references on its blocks.
    fn release(&mut self, node: &Node) {
        for (p, b) in self.pools.paged().zip(&node.blocks) {
            if let Some(b) = *b {
                p.release(&[b]);
                self.bytes -= p.block_bytes();
            }
        }
    }
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        for node in std::mem::take(&mut self.nodes).values() {
            self.release(node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PlainCache;
    use candle_core::{DType, Device, Tensor};

    const LAYERS: usize = 2;

    fn template() -> SeqCache {
        SeqCache::new((0..LAYERS).map(|_| Box::new(PlainCache::new(1, 4, DType::F32, &Device::Cpu)) as Box<dyn KvCache>).collect())
    }

    /// A paged cache holding `tokens`, each token's rows filled with its id.
    fn filled(pools: &PagedPools, tokens: &[TokenId]) -> SeqCache {
        let mut c = pools.make(template());
        let data: Vec<f32> = tokens.iter().flat_map(|&t| [t as f32; 4]).collect();
        let x = Tensor::from_vec(data, (1, tokens.len(), 4), &Device::Cpu).unwrap();
        for i in 0..LAYERS {
            c.layer(i).update_and_fetch(&x, &x).unwrap();
        }
        c
    }

    fn keys(c: &SeqCache) -> Vec<f32> {
        c.layer_ref(1).state().unwrap().unwrap().k.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().step_by(4).copied().collect()
    }

    #[test]
    fn shares_the_longest_prefix_by_reference() {
        let pools = PagedPools::for_model(&template(), 4);
        let mut index = BlockIndex::new(pools.clone(), "m", "kv:plain", 1 << 20);
        let prompt: Vec<TokenId> = (1..=10).collect();
        let a = filled(&pools, &prompt);
        index.register(&prompt, &a, true);
        let used = pools.usage().0;
        // Two whole blocks and 1 token of the third (the partial block [9, 10]).
        let (b, n) = index.take(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 77, 78], &|| pools.make(template())).unwrap();
        assert_eq!(n, 9);
        assert_eq!(keys(&b), (1..=9).map(|t| t as f32).collect::<Vec<_>>());
        assert_eq!(pools.usage().0, used, "a hit copies nothing");
        assert_eq!(b.layer_ref(0).as_paged().unwrap().blocks(), &a.layer_ref(0).as_paged().unwrap().blocks()[..3]);
        // The whole prompt cached: its last token is still forwarded.
        let (_, n) = index.take(&prompt, &|| pools.make(template())).unwrap();
        assert_eq!(n, 9);
        assert!(index.take(&[5, 6, 7], &|| pools.make(template())).is_none());
        let s = index.stats();
        assert_eq!((s.hits, s.misses, s.entries, s.hit_tokens), (2, 1, 3, 18));
    }

    /// Eviction takes least recently used blocks nobody else holds, never one a running
    /// sequence holds, and frees them in the pools.
    #[test]
    fn evicts_only_unreferenced_blocks() {
        let pools = PagedPools::for_model(&template(), 4);
        let node = 2 * pools.pools[0].as_ref().unwrap().block_bytes();
        let mut index = BlockIndex::new(pools.clone(), "m", "kv:plain", 2 * node);
        let (p1, p2): (Vec<TokenId>, Vec<TokenId>) = ((1..=8).collect(), (11..=18).collect());
        let running = filled(&pools, &p1);
        index.register(&p1, &running, false);
        let done = filled(&pools, &p2);
        index.register(&p2, &done, false);
        assert_eq!(index.stats().entries, 4, "over the cap while every block is held");
        drop(done);
        // Over the cap by two nodes: p2's blocks go (unreferenced), p1's stay (running holds them).
        assert!(index.take(&[11, 12, 13, 14, 15, 16, 17, 18, 0], &|| pools.make(template())).is_none());
        assert_eq!(index.stats().entries, 2);
        let (hit, n) = index.take(&[1, 2, 3, 4, 5, 6, 7, 8, 0], &|| pools.make(template())).unwrap();
        assert_eq!((n, keys(&hit)), (8, (1..=8).map(|t| t as f32).collect::<Vec<_>>()));
        assert_eq!(keys(&running), (1..=8).map(|t| t as f32).collect::<Vec<_>>(), "the running sequence's blocks are intact");
        drop((hit, running));
        let p3: Vec<TokenId> = (21..=24).collect();
        let third = filled(&pools, &p3);
        index.register(&p3, &third, false);
        drop(third);
        assert_eq!(index.stats().entries, 2, "now unreferenced, the oldest leaf went");
        drop(index);
        assert_eq!(pools.usage().0, 0, "every block is free again");
    }

    /// With a sliding-window layer, a prefix is shared only where the index holds the blocks of
    /// the window before its end: the end of a long registered prompt is, an early part the
    /// window had released is not (a miss), until a cache holding those blocks fills them in.
    #[test]
    fn sliding_layers_share_only_a_held_window() {
        let dev = Device::Cpu;
        let template = || SeqCache::new(vec![Box::new(PlainCache::new(1, 4, DType::F32, &dev)) as Box<dyn KvCache>, Box::new(crate::RotatingCache::new(1, 4, 6, DType::F32, &dev))]);
        let pools = PagedPools::for_model(&template(), 4);
        let mut index = BlockIndex::new(pools.clone(), "m", "kv:plain+kv:rotating", 1 << 20);
        let fill = |tokens: &[TokenId], chunk: usize| {
            let mut c = pools.make(template());
            for part in tokens.chunks(chunk) {
                let data: Vec<f32> = part.iter().flat_map(|&t| [t as f32; 4]).collect();
                let x = Tensor::from_vec(data, (1, part.len(), 4), &dev).unwrap();
                for i in 0..2 {
                    c.layer(i).update_and_fetch(&x, &x).unwrap();
                }
            }
            c
        };
        let long: Vec<TokenId> = (1..=40).collect();
        let a = fill(&long, 1);
        assert!(a.layer_ref(1).as_paged().unwrap().first_block() > 3, "the window released early blocks");
        index.register(&long, &a, false);
        drop(a);
        let mut more = long.clone();
        more.push(99);
        let (hit, n) = index.take(&more, &|| pools.make(template())).unwrap();
        assert_eq!(n, 40);
        let sliding = hit.layer_ref(1).as_paged().unwrap();
        assert_eq!(sliding.first_block(), (40 + 1 - 6) / 4, "only the window's blocks are shared");
        assert_eq!(hit.layer_ref(1).state().unwrap().unwrap().k.dims()[1], 40 - sliding.first_block() * 4);
        drop(hit);
        let early: Vec<TokenId> = (1..=12).chain([77, 78]).collect();
        assert!(index.take(&early, &|| pools.make(template())).is_none(), "the window before token 12 was released");
        let b = fill(&long[..12], 12);
        index.register(&long[..12], &b, false);
        drop(b);
        let (_, n) = index.take(&early, &|| pools.make(template())).unwrap();
        assert_eq!(n, 12, "filled in by a cache that held them");
        drop(index);
        assert_eq!(pools.usage().0, 0, "every block is free again");
    }
}
