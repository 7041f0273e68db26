//! `--kv-layout paged` in the engine step (docs/paged_kv.md): fresh caches page the model's
//! plain layers into per-layer block pools, and when every layer is paged the prompt cache keeps
//! prefixes as blocks in a `BlockIndex` shared by reference instead of copied entries. The
//! disk tier stays as it is (whole prefixes per file): a disk hit is loaded into blocks and
//! registered in the index.
//!
//! Blocks of a running sequence's prompt rows are registered as soon as its prompt is in, so a
//! request arriving while it still decodes shares them; its partial last block is registered when
//! it retires (until then it is still being written). For sliding-window layers the first
//! registration is what counts: it holds the window's blocks at the prompt's end, which the
//! sequence releases as it decodes on (the index's reference keeps them); at retirement the
//! blocks it still holds fill in what is missing.

use crate::seq::Sequence;
use ferrolm_kv::{BlockIndex, PagedPools, PromptCache, PromptCacheStats, SeqCache};
use ferrolm_models::CausalLm;
use std::collections::HashSet;

pub(crate) struct PagedKv {
    pools: PagedPools,
    /// Prefix sharing by blocks; None when the prompt cache is off, or when some layer is not
    /// paged (`--quantized-kv-start`: the copying prompt cache then serves, its paged layers
    /// shared by reference all the same, `SeqCache::fork_prefix`). Layers of `--kv-bits` and
    /// TurboQuant rows are paged (blocks of quantized rows); the index's hash chain is salted
    /// with the cache's signature (`kv:q8g32`, …), so blocks of different kinds never mix. Sliding-window layers are paged: a
    /// prefix is shared where the index holds the blocks of their window (`BlockIndex`).
    index: Option<BlockIndex>,
    /// Running sequences whose whole prompt blocks are in the index already.
    registered: HashSet<u64>,
}

impl PagedKv {
    pub fn new(model: &dyn CausalLm, block_tokens: usize, prompt_cache_bytes: usize) -> Result<Self, String> {
        if !model.device().is_cpu() {
            return Err("--kv-layout paged runs on the CPU only for now".into());
        }
        let template = model.make_cache();
        let pools = PagedPools::for_model(&template, block_tokens);
        let info = model.info();
        let identity = format!("{}/{}/{}/{}", info.architecture, info.num_layers, info.hidden_size, info.vocab_size);
        let index = (prompt_cache_bytes > 0 && pools.all_paged()).then(|| BlockIndex::new(pools.clone(), &identity, &template.signature(), prompt_cache_bytes));
        Ok(Self { pools, index, registered: HashSet::new() })
    }

    /// A fresh cache of `model` with its plain layers paged.
    pub fn fresh(&self, model: &dyn CausalLm) -> SeqCache {
        self.pools.make(model.make_cache())
    }

    /// Whether prefixes are kept as shared blocks (else the copying prompt cache keeps them).
    pub fn shares_prefixes(&self) -> bool {
        self.index.is_some()
    }

    /// A cache sharing the longest cached prefix of `prompt`: from the index, or from the disk
    /// tier of `disk` when a file holds more (loaded into blocks and registered). None: a miss.
    pub fn take(&mut self, model: &dyn CausalLm, prompt: &[u32], disk: Option<&mut PromptCache>) -> Option<SeqCache> {
        let (pools, index) = (&self.pools, self.index.as_mut()?);
        let fresh = || pools.make(model.make_cache());
        let hit = index.take(prompt, &fresh);
        let held = hit.as_ref().map_or(0, |h| h.1);
        if let Some((tokens, cache)) = disk.and_then(|pc| pc.take_from_disk(prompt, held, &fresh)) {
            index.register(&tokens, &cache, true);
            drop((hit, cache));
            return index.take(prompt, &fresh).map(|h| h.0);
        }
        hit.map(|h| h.0)
    }

    /// Keeps a retired sequence's prompt rows (the first `tokens.len()` of `cache`): their
    /// blocks in the index, partial last block included, and the whole prefix in the disk tier:
    /// `cache` itself when it was trimmed back to them, else the index's blocks of them (a
    /// sliding window that moved on cannot trim back, the index still holds its window).
    pub fn keep(&mut self, tokens: Vec<u32>, cache: SeqCache, disk: Option<&mut PromptCache>, model: &dyn CausalLm) {
        let Some(index) = self.index.as_mut() else { return };
        index.register(&tokens, &cache, true);
        let Some(pc) = disk else { return };
        let (pools, whole) = (&self.pools, cache.offset() == tokens.len());
        let from_index = (!whole).then(|| index.share(&tokens, &|| pools.make(model.make_cache()))).flatten();
        if let Some(prefix) = from_index.or(whole.then_some(cache)) {
            pc.put(tokens, prefix); // RAM cap 0 (`PromptCache::disk_only`): written, not kept
        }
    }

    /// Registers the whole prompt blocks of running sequences whose prompt is in, and the prompt
    /// rows of those that just ended (partial last block included) before their retirement
    /// trims them: a sliding window that moved on cannot trim back to its prompt, but the
    /// blocks it still holds serve later prompts all the same.
    pub fn register_running(&mut self, running: &[Sequence<'_>]) {
        let Some(index) = self.index.as_mut() else { return };
        for seq in running {
            let ended = seq.is_done();
            if !(ended || seq.is_decoding()) || (!ended && !self.registered.insert(seq.id)) {
                continue;
            }
            if let Some(rows) = seq.prompt_rows() {
                index.register(&rows, &seq.cache, ended);
            }
        }
    }

    /// A sequence left the batch.
    pub fn forget(&mut self, id: u64) {
        self.registered.remove(&id);
    }

    /// The index's counters, with the disk tier's from `pc`.
    pub fn stats(&self, pc: Option<&PromptCache>) -> Option<PromptCacheStats> {
        let s = self.index.as_ref()?.stats();
        let disk = pc.map(PromptCache::stats).unwrap_or_default();
        Some(PromptCacheStats { disk_hits: disk.disk_hits, disk_entries: disk.disk_entries, disk_bytes: disk.disk_bytes, ..s })
    }

    /// Blocks referenced now over all layers, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        self.pools.usage()
    }
}
