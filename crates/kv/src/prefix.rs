//! The prompt cache: a byte-capped LRU of whole prefix entries (mlx-lm's and mlx-bun's model).
//! An entry is the token ids of a prompt prefix and a cache holding exactly their keys and
//! values. A new request takes a copy of the longest prefix it shares with an entry (at most
//! its prompt minus one token: the last one is forwarded to give the first logits), so entries
//! are never written by the sequences that use them.
//!
//! What goes in is the caller's choice; the engine stores only keys and values that prompt rows
//! produced (a finished sequence's cache trimmed to its prompt minus the tail), because the
//! prefill kernels give the same bits however a prompt is cut: a cached prefix then continues
//! exactly as an uncached run would.

use crate::{DiskTier, SeqCache};
use ferrolm_core::TokenId;

struct Entry {
    tokens: Vec<TokenId>,
    cache: SeqCache,
    bytes: usize,
    /// LRU clock: higher is more recent.
    used: u64,
}

/// A hit: the copy of an entry's prefix and how many tokens it holds.
pub struct Hit {
    pub cache: SeqCache,
    pub tokens: usize,
}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptCacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub max_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens served from the cache.
    pub hit_tokens: u64,
    /// Hits served from the disk tier, and its entries and bytes.
    pub disk_hits: u64,
    pub disk_entries: usize,
    pub disk_bytes: u64,
}

pub struct PromptCache {
    entries: Vec<Entry>,
    max_bytes: usize,
    clock: u64,
    stats: PromptCacheStats,
    /// Where entries are also written, to outlive their RAM entry and the process.
    disk: Option<DiskTier>,
}

impl PromptCache {
    /// An empty cache holding at most `max_bytes` of entries.
    pub fn new(max_bytes: usize) -> Self {
        Self::with_disk(max_bytes, None)
    }

    /// A cache whose entries are also written to `disk` (and found there after a restart).
    pub fn with_disk(max_bytes: usize, disk: Option<DiskTier>) -> Self {
        let stats = PromptCacheStats { max_bytes, ..Default::default() };
        Self { entries: Vec::new(), max_bytes, clock: 0, stats, disk }
    }

    /// This cache keeping nothing in RAM, only its disk tier (the paged layout's block index
    /// keeps prefixes in RAM instead, `BlockIndex`).
    pub fn disk_only(self) -> Self {
        Self::with_disk(0, self.disk)
    }

    /// The disk entry sharing more than `better_than` tokens of `prompt` (at most all but its
    /// last token), read into fresh caches from `fresh`, not kept in RAM: its tokens and cache.
    pub fn take_from_disk(&mut self, prompt: &[TokenId], better_than: usize, fresh: &dyn Fn() -> SeqCache) -> Option<(Vec<TokenId>, SeqCache)> {
        let disk = self.disk.as_mut()?;
        let (j, _) = disk.best(prompt, prompt.len().saturating_sub(1)).filter(|&(_, n)| n > better_than)?;
        let loaded = disk.load(j, fresh())?;
        self.stats.disk_hits += 1;
        Some(loaded)
    }

    pub fn stats(&self) -> PromptCacheStats {
        let bytes = self.entries.iter().map(|e| e.bytes).sum();
        let (disk_entries, disk_bytes) = self.disk.as_ref().map_or((0, 0), DiskTier::usage);
        PromptCacheStats { entries: self.entries.len(), bytes, disk_entries, disk_bytes, ..self.stats }
    }

    /// Waits for the disk tier's queued writes (tests; a clean shutdown).
    pub fn flush(&mut self) {
        if let Some(d) = self.disk.as_mut() {
            d.flush();
        }
    }

    /// A copy (into fresh caches of the model from `fresh`) of the longest cached prefix of
    /// `prompt`, in RAM or on disk, that leaves at least one prompt token to forward; None on a
    /// miss.
    pub fn take(&mut self, prompt: &[TokenId], fresh: &dyn Fn() -> SeqCache) -> candle_core::Result<Option<Hit>> {
        let limit = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let n = common_prefix(&e.tokens, prompt).min(limit);
            if n > 0 && best.is_none_or(|(_, b)| n > b) {
                best = Some((i, n));
            }
        }
        if let Some((i, n)) = self.from_disk(prompt, limit, best.map_or(0, |b| b.1), fresh) {
            best = Some((i, n));
            self.stats.disk_hits += 1;
        }
        let Some((i, n)) = best else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.clock += 1;
        let entry = &mut self.entries[i];
        entry.used = self.clock;
        match entry.cache.fork_prefix(n, fresh())? {
            Some(cache) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += n as u64;
                Ok(Some(Hit { cache, tokens: n }))
            }
            None => {
                self.stats.misses += 1;
                Ok(None)
            }
        }
    }

    /// Stores `cache`, which holds exactly `tokens`. Entries that are prefixes of it are
    /// superseded (it serves every request they would); least recently used entries are
    /// evicted past the byte cap; an entry larger than the cap is not kept.
    pub fn put(&mut self, tokens: Vec<TokenId>, cache: SeqCache) {
        let bytes = cache.bytes();
        if tokens.is_empty() || cache.offset() != tokens.len() {
            return;
        }
        if let Some(d) = self.disk.as_mut() {
            if let Err(e) = d.store(&tokens, &cache) {
                tracing::warn!("prompt cache: not written to disk: {e}");
            }
        }
        if bytes > self.max_bytes {
            return;
        }
        self.entries.retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        if self.entries.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return; // a longer entry already serves every request this one would
        }
        self.clock += 1;
        self.entries.push(Entry { tokens, cache, bytes, used: self.clock });
        self.evict();
    }

    /// Loads the disk entry sharing more of `prompt` than `ram_best` tokens, if there is one,
    /// into RAM; returns its index there and the usable prefix.
    fn from_disk(&mut self, prompt: &[TokenId], limit: usize, ram_best: usize, fresh: &dyn Fn() -> SeqCache) -> Option<(usize, usize)> {
        let disk = self.disk.as_mut()?;
        let (j, n) = disk.best(prompt, limit).filter(|&(_, n)| n > ram_best)?;
        let (tokens, cache) = disk.load(j, fresh())?;
        let bytes = cache.bytes();
        self.clock += 1;
        self.entries.push(Entry { tokens, cache, bytes, used: self.clock });
        self.evict();
        // Eviction keeps the most recent entry: the one just loaded, unless it alone exceeds the cap.
        let i = self.entries.iter().position(|e| e.used == self.clock)?;
        Some((i, n))
    }

    fn evict(&mut self) {
        let mut total: usize = self.entries.iter().map(|e| e.bytes).sum();
        while total > self.max_bytes {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else { break };
            total -= self.entries.swap_remove(oldest).bytes;
        }
    }
}

fn common_prefix(a: &[TokenId], b: &[TokenId]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvCache, PlainCache};
    use candle_core::{DType, Device, Tensor};

    fn cache_of(n: usize) -> SeqCache {
        let dev = Device::Cpu;
        let mut c = SeqCache::new(vec![Box::new(PlainCache::new(1, 4, DType::F32, &dev)) as Box<dyn KvCache>]);
        if n > 0 {
            let data: Vec<f32> = (0..n * 4).map(|i| (i / 4) as f32).collect();
            let x = Tensor::from_vec(data, (1, n, 4), &dev).unwrap();
            c.layer(0).update_and_fetch(&x, &x).unwrap();
        }
        c
    }

    #[test]
    fn takes_the_longest_prefix_leaving_one_token_to_forward() {
        let mut pc = PromptCache::new(1 << 20);
        pc.put(vec![1, 2, 3, 4, 5], cache_of(5));
        pc.put(vec![1, 2, 9], cache_of(3));
        let hit = pc.take(&[1, 2, 3, 4, 5, 6, 7], &|| cache_of(0)).unwrap().unwrap();
        assert_eq!((hit.tokens, hit.cache.offset()), (5, 5));
        // The whole prompt cached: its last token is still forwarded.
        let hit = pc.take(&[1, 2, 3, 4, 5], &|| cache_of(0)).unwrap().unwrap();
        assert_eq!(hit.tokens, 4);
        let key = hit.cache.offset();
        assert_eq!(key, 4);
        assert!(pc.take(&[7, 8], &|| cache_of(0)).unwrap().is_none());
        let s = pc.stats();
        assert_eq!((s.hits, s.misses, s.entries), (2, 1, 2));
    }

    #[test]
    fn a_hit_is_a_copy_that_later_writes_do_not_reach() {
        let mut pc = PromptCache::new(1 << 20);
        pc.put(vec![1, 2, 3, 4], cache_of(4));
        let mut hit = pc.take(&[1, 2, 3, 4, 5], &|| cache_of(0)).unwrap().unwrap().cache;
        let x = Tensor::full(-1f32, (1, 1, 4), &Device::Cpu).unwrap();
        hit.layer(0).update_and_fetch(&x, &x).unwrap();
        let mut again = pc.take(&[1, 2, 3, 4, 9], &|| cache_of(0)).unwrap().unwrap().cache;
        let keys: Vec<f32> = again.layer(0).state().unwrap().unwrap().k.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(keys, (0..16).map(|i| (i / 4) as f32).collect::<Vec<_>>(), "the entry kept its own keys");
    }

    #[test]
    fn supersedes_prefixes_and_evicts_the_least_recently_used_past_the_cap() {
        let per_entry = cache_of(3).bytes();
        let mut pc = PromptCache::new(2 * per_entry);
        pc.put(vec![1, 2], cache_of(2));
        pc.put(vec![1, 2, 3], cache_of(3));
        assert_eq!(pc.stats().entries, 1, "the shorter prefix is superseded");
        pc.put(vec![5, 6, 7], cache_of(3));
        pc.take(&[1, 2, 3, 4], &|| cache_of(0)).unwrap();
        pc.put(vec![8, 9, 10], cache_of(3));
        let s = pc.stats();
        assert_eq!(s.entries, 2);
        assert!(pc.take(&[5, 6, 7, 1], &|| cache_of(0)).unwrap().is_none(), "the least recently used went");
        assert!(pc.take(&[1, 2, 3, 1], &|| cache_of(0)).unwrap().is_some());
    }
}
