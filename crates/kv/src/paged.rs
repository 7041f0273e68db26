//! Paged KV (`--kv-layout paged`): per float layer (full attention, or a sliding window whose
//! blocks are released as the window leaves them, see `PagedCache`) one pool of fixed-size
//! blocks shared by every sequence, and per sequence a block table. A block is `[kv_heads, B, head_dim]`: each
//! head's rows of a block are contiguous, as in a contiguous cache, so attention streams them
//! alike (token-major blocks, each head's rows strided, measured 30-45% slower decode attention
//! than contiguous at 4k keys; head-major ones 0-25%, docs/paged_kv.md).
//! The pool tensor is `[blocks, kv_heads, B, head_dim]` and attention reads it through the table
//! (`ferrolm_backend::paged::BlockTable`), never through a gathered copy.
//!
//! A quantized layer (`--kv-bits 8|4`, `BlockPool::quantized`) has a pool of U8 blocks
//! `[blocks, kv_heads, B, row_bytes]`: each block holds `B` rows of the format's row layout
//! (`ferrolm_backend::kv_quant`), quantized as they are written, and attention reads them through
//! the table as it reads a contiguous `QuantCache`'s rows, with the same bits. TurboQuant
//! (`--kv-quant turbo`) blocks hold its joined key + value rows (halves, as `TurboCache`); a
//! fetch gathers the table's rows, which attention reads as it reads a `TurboCache`'s.
//!
//! Blocks are reference counted: a sequence's table holds one reference on each of its blocks,
//! the prefix index (`paged_prefix`) one on each block it keeps. A block is written only by a
//! sequence holding its sole reference: writing into a shared block first copies it
//! (copy-on-write), so a shared block is never written.

use crate::quant::{row_codec, RowCodec};
use crate::{KvCache, KvView, PlainCache};
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::kv_quant::KvQuant;
use ferrolm_backend::paged::BlockTable;
use std::sync::{Arc, Mutex, MutexGuard};

/// The pool's first size in blocks; it doubles when full.
const FIRST_BLOCKS: usize = 16;

/// One layer's blocks, shared by all sequences of a model.
pub struct BlockPool {
    inner: Mutex<PoolInner>,
    block_tokens: usize,
    kv_heads: usize,
    /// The head size of the keys and values written.
    head_dim: usize,
    /// Elements of one stored row: `head_dim`, or the quantized row's bytes.
    width: usize,
    dtype: DType,
    /// Quantized rows of this format (dtype U8) and their codec; None: float rows.
    quant: Option<KvQuant>,
    codec: Option<Box<dyn RowCodec + Sync>>,
    device: Device,
}

struct PoolInner {
    /// `[capacity, kv_heads, B, head_dim]` each.
    k: Option<Tensor>,
    v: Option<Tensor>,
    refs: Vec<u32>,
    free: Vec<usize>,
}

impl BlockPool {
    /// An empty pool of blocks of `block_tokens` (a power of two) tokens.
    pub fn new(block_tokens: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Arc<Self> {
        assert!(block_tokens.is_power_of_two(), "block size {block_tokens} is not a power of two");
        let inner = Mutex::new(PoolInner { k: None, v: None, refs: Vec::new(), free: Vec::new() });
        Arc::new(Self { inner, block_tokens, kv_heads, head_dim, width: head_dim, dtype, quant: None, codec: None, device: device.clone() })
    }

    /// An empty pool of blocks of quantized rows of `quant` (affine rows, or TurboQuant's
    /// joined rows). Panics if `head_dim` is not taken by the format (`KvScheme::check`).
    pub fn quantized(block_tokens: usize, kv_heads: usize, head_dim: usize, quant: KvQuant, device: &Device) -> Arc<Self> {
        assert!(block_tokens.is_power_of_two(), "block size {block_tokens} is not a power of two");
        quant.check_head_dim(head_dim).expect("KvScheme::check before building caches");
        let inner = Mutex::new(PoolInner { k: None, v: None, refs: Vec::new(), free: Vec::new() });
        let (codec, width) = row_codec(quant, head_dim);
        let (quant, codec) = (Some(quant), Some(codec));
        Arc::new(Self { inner, block_tokens, kv_heads, head_dim, width, dtype: DType::U8, quant, codec, device: device.clone() })
    }

    /// The format views and states of the rows carry: Some where attention reads the stored
    /// rows (affine), None for float rows and for rows widened on fetch (TurboQuant).
    fn tag(&self) -> Option<KvQuant> {
        self.codec.as_ref().and_then(|c| c.tag())
    }

    /// The quantized format of the rows; None for float rows.
    pub fn quant(&self) -> Option<KvQuant> {
        self.quant
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Bytes of one block (keys and values).
    pub fn block_bytes(&self) -> usize {
        2 * self.block_tokens * self.kv_heads * self.width * self.dtype.size_in_bytes()
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        // A panic while the lock was held left the counts as they were before that call.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks in use (referenced) and the pool's capacity in blocks.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.lock();
        (g.refs.len() - g.free.len(), g.refs.len())
    }

    /// References held on `block`.
    pub fn refs(&self, block: usize) -> u32 {
        self.lock().refs[block]
    }

    /// One more reference on each of `blocks`.
    pub fn retain(&self, blocks: &[usize]) {
        let mut g = self.lock();
        for &b in blocks {
            debug_assert!(g.refs[b] > 0, "retain of free block {b}");
            g.refs[b] += 1;
        }
    }

    /// Drops one reference on each of `blocks`; a block nobody references is free again.
    pub fn release(&self, blocks: &[usize]) {
        let mut g = self.lock();
        for &b in blocks {
            g.refs[b] -= 1;
            if g.refs[b] == 0 {
                g.free.push(b);
            }
        }
    }

    /// The pool as rows `[capacity·kv_heads·B, head_dim]`: row `(block·kv_heads + head)·B + t`.
    fn rows(t: &Tensor) -> Result<Tensor> {
        let (cap, h, b, d) = t.dims4()?;
        t.reshape((cap * h * b, d))
    }

    fn shape(&self, blocks: usize) -> (usize, usize, usize, usize) {
        (blocks, self.kv_heads, self.block_tokens, self.width)
    }

    /// Keys and values `[kv_heads, n, head_dim]` as the rows this pool stores, contiguous.
    fn encode(&self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        match &self.codec {
            Some(codec) => codec.encode(k, v),
            None => Ok((k.to_dtype(self.dtype)?.contiguous()?, v.to_dtype(self.dtype)?.contiguous()?)),
        }
    }

    /// Whether `state` holds rows this pool stores as they are: float rows of a float pool
    /// (converted to its dtype), quantized rows of the same format for a quantized one.
    fn check_state(&self, state: &KvView) -> Result<()> {
        let fits = match self.codec {
            None => state.quant.is_none() && state.k.dtype() != DType::U8,
            Some(_) => state.k.dtype() == DType::U8 && state.quant.is_none_or(|s| Some(s) == self.tag()),
        };
        if !fits || state.k.dims().get(2) != Some(&self.width) {
            candle_core::bail!("kv:paged: a state of other rows ({:?} {:?}, {:?}) for rows of {} × {:?}", state.k.dtype(), state.k.dims(), state.quant, self.width, self.quant)
        }
        Ok(())
    }

    /// The row of token `t` of `head` in `block`.
    fn row(&self, block: usize, head: usize, t: usize) -> usize {
        (block * self.kv_heads + head) * self.block_tokens + t
    }
}

impl PoolInner {
    /// A free block with one reference, growing the pool (doubling it) when none is free.
    fn alloc(&mut self, pool: &BlockPool) -> Result<usize> {
        if let Some(b) = self.free.pop() {
            self.refs[b] = 1;
            return Ok(b);
        }
        let cap = self.refs.len();
        let new_cap = (2 * cap).max(FIRST_BLOCKS);
        for slot in [&mut self.k, &mut self.v] {
            let grown = Tensor::zeros(pool.shape(new_cap), pool.dtype, &pool.device)?;
            if let Some(old) = slot.as_ref() {
                grown.slice_set(old, 0, 0)?;
            }
            *slot = Some(grown);
        }
        self.refs.resize(new_cap, 0);
        self.free.extend((cap + 1..new_cap).rev());
        self.refs[cap] = 1;
        Ok(cap)
    }

    /// Writes `k`, `v` `[kv_heads, n, head_dim]` (contiguous) at token `at` of `block`: one
    /// contiguous copy per head.
    fn write(&self, pool: &BlockPool, block: usize, at: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (pk, pv) = (BlockPool::rows(self.k.as_ref().expect("allocated"))?, BlockPool::rows(self.v.as_ref().expect("allocated"))?);
        for h in 0..pool.kv_heads {
            let row = pool.row(block, h, at);
            pk.slice_set(&k.get(h)?, 0, row)?;
            pv.slice_set(&v.get(h)?, 0, row)?;
        }
        Ok(())
    }

    /// The first `n` tokens of every head of block `from` copied into the fresh block `to`.
    fn copy_rows(&self, pool: &BlockPool, from: usize, to: usize, n: usize) -> Result<()> {
        let (k, v) = (BlockPool::rows(self.k.as_ref().expect("allocated"))?, BlockPool::rows(self.v.as_ref().expect("allocated"))?);
        for h in 0..pool.kv_heads {
            let (src, dst) = (pool.row(from, h, 0), pool.row(to, h, 0));
            k.slice_set(&k.narrow(0, src, n)?.copy()?, 0, dst)?;
            v.slice_set(&v.narrow(0, src, n)?.copy()?, 0, dst)?;
        }
        Ok(())
    }
}

/// One layer's cache of one sequence: its block table over a shared pool.
///
/// A sliding-window layer (`sliding`: Gemma 3's local layers, Mistral windows) keeps the ring
/// semantics of `RotatingCache` on blocks: before each write, the blocks wholly before the keys
/// the next query needs (its `window - 1` predecessors) and one block more are released to the
/// pool. The table keeps its logical positions (`blocks[j]` holds the sequence's block
/// `first + j`), and attention gets the held blocks with `key_start = first · B`, masking by
/// position as over a ring. The extra block lets a prefix ending at any block boundary of the
/// last block still find its window (the prefix index shares prompts at block boundaries).
pub struct PagedCache {
    pool: Arc<BlockPool>,
    /// The blocks held, in order: `blocks[j]` is the sequence's block `first + j`.
    blocks: Vec<usize>,
    /// Blocks before `blocks[0]` that a sliding window let go of (0 for full attention).
    first: usize,
    /// The oldest position held: `first · B`, or later when a loaded state began inside that
    /// block (its rows before `start` are zeros that no query sees).
    start: usize,
    offset: usize,
    /// Sliding-window layer: queries see the last `window` positions, their own included.
    window: Option<usize>,
}

impl PagedCache {
    pub fn new(pool: Arc<BlockPool>) -> Self {
        Self { pool, blocks: Vec::new(), first: 0, start: 0, offset: 0, window: None }
    }

    /// A sliding-window layer's cache (see the type's doc).
    pub fn sliding(pool: Arc<BlockPool>, window: usize) -> Self {
        assert!(window > 0, "a sliding window holds at least one token");
        Self { pool, blocks: Vec::new(), first: 0, start: 0, offset: 0, window: Some(window) }
    }

    /// A cache holding the first `tokens` tokens of `blocks` (one reference taken on each).
    pub fn sharing(pool: Arc<BlockPool>, blocks: &[usize], tokens: usize) -> Self {
        Self::sharing_from(pool, None, 0, blocks, tokens)
    }

    /// A cache of `tokens` tokens whose blocks from the sequence's block `first` on are
    /// `blocks` (one reference taken on each of those holding tokens); `window` as in
    /// `sliding`. The caller makes sure the blocks cover the window of the next query.
    pub fn sharing_from(pool: Arc<BlockPool>, window: Option<usize>, first: usize, blocks: &[usize], tokens: usize) -> Self {
        let blocks = blocks[..tokens.div_ceil(pool.block_tokens) - first].to_vec();
        pool.retain(&blocks);
        let start = first * pool.block_tokens;
        Self { pool, blocks, first, start, offset: tokens, window }
    }

    pub fn pool(&self) -> &Arc<BlockPool> {
        &self.pool
    }

    /// The blocks held, in order (from the sequence's block `first_block()` on).
    pub fn blocks(&self) -> &[usize] {
        &self.blocks
    }

    /// The sequence's blocks before `blocks()[0]`, released by a sliding window.
    pub fn first_block(&self) -> usize {
        self.first
    }

    /// The pool block holding the sequence's block `i` (tokens `i·B..`), if still held.
    pub fn block_at(&self, i: usize) -> Option<usize> {
        i.checked_sub(self.first).and_then(|j| self.blocks.get(j).copied())
    }

    /// The window of a sliding-window layer; None for full attention.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    fn table(&self) -> BlockTable {
        let key_start = self.first * self.pool.block_tokens;
        BlockTable { blocks: self.blocks.clone(), block_tokens: self.pool.block_tokens, tokens: self.offset - key_start }
    }

    /// A sliding window's release before writing at `offset`: the blocks wholly before
    /// position `offset + 1 - window - B` (the next query's window and one block more).
    fn release_out_of_window(&mut self) {
        let Some(window) = self.window else { return };
        let bt = self.pool.block_tokens;
        let keep_from = (self.offset + 1).saturating_sub(window + bt);
        let n = (keep_from / bt).saturating_sub(self.first).min(self.blocks.len());
        if n > 0 {
            self.pool.release(&self.blocks[..n]);
            self.blocks.drain(..n);
            self.first += n;
            self.start = self.start.max(self.first * bt);
        }
    }

    /// The block to write token `offset` into: a new one at a block boundary, the last one if
    /// this sequence alone holds it, else a private copy of it (copy-on-write).
    fn writable_block(&mut self, g: &mut PoolInner) -> Result<usize> {
        let bt = self.pool.block_tokens;
        let (i, within) = (self.offset / bt - self.first, self.offset % bt);
        if i == self.blocks.len() {
            let b = g.alloc(&self.pool)?;
            self.blocks.push(b);
            return Ok(b);
        }
        let shared = self.blocks[i];
        if g.refs[shared] == 1 {
            return Ok(shared);
        }
        let private = g.alloc(&self.pool)?;
        if within > 0 {
            g.copy_rows(&self.pool, shared, private, within)?;
        }
        g.refs[shared] -= 1; // still referenced by its other holders
        self.blocks[i] = private;
        Ok(private)
    }

    /// The keys and values of tokens `from..n` (held ones), `[kv_heads, n - from, head_dim]`,
    /// gathered (for snapshots: the disk tier, forks into other layouts; attention never
    /// gathers).
    fn gather(&self, from: usize, n: usize) -> Result<Option<KvView>> {
        if n <= from {
            return Ok(None);
        }
        let g = self.pool.lock();
        let bt = self.pool.block_tokens;
        let (h, d, m) = (self.pool.kv_heads, self.pool.width, n - from);
        let block = |t: usize| self.block_at(t / bt).expect("held tokens");
        let ids: Vec<u32> = (0..h).flat_map(|head| (from..n).map(move |t| (head, t))).map(|(head, t)| self.pool.row(block(t), head, t % bt) as u32).collect();
        let ids = Tensor::from_vec(ids, h * m, &self.pool.device)?;
        let take = |t: &Tensor| -> Result<Tensor> { BlockPool::rows(t)?.index_select(&ids, 0)?.reshape((h, m, d)) };
        let (k, v) = (take(g.k.as_ref().expect("allocated"))?, take(g.v.as_ref().expect("allocated"))?);
        Ok(Some(KvView { k, v, key_start: from, quant: self.pool.tag(), table: None }))
    }

    /// Whether the tokens held cover what a cache of the first `n` tokens needs: all of them,
    /// or for a sliding window at least the `window - 1` before `n` (as `RotatingCache`).
    fn covers(&self, n: usize) -> bool {
        n <= self.offset && (self.start == 0 || self.window.is_some_and(|w| n + 1 >= self.start + w))
    }

    /// Appends `k`, `v` (`[kv_heads, n, width]`, stored rows, contiguous) after `offset`.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        let pool = self.pool.clone();
        let n = k.dims()[1];
        let mut g = pool.lock();
        let mut done = 0;
        while done < n {
            let block = self.writable_block(&mut g)?;
            let within = self.offset % pool.block_tokens;
            let m = (pool.block_tokens - within).min(n - done);
            g.write(&pool, block, within, &k.narrow(1, done, m)?.contiguous()?, &v.narrow(1, done, m)?.contiguous()?)?;
            self.offset += m;
            done += m;
        }
        Ok(())
    }

    fn release_from(&mut self, keep_blocks: usize) {
        if keep_blocks < self.blocks.len() {
            self.pool.release(&self.blocks[keep_blocks..]);
            self.blocks.truncate(keep_blocks);
        }
    }
}

impl Drop for PagedCache {
    fn drop(&mut self) {
        self.release_from(0);
    }
}

impl KvCache for PagedCache {
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let (h, n, d) = k.dims3()?;
        let pool = self.pool.clone();
        if (h, d) != (pool.kv_heads, pool.head_dim) || v.dims3()? != (h, n, d) {
            candle_core::bail!("kv:paged: rows {:?} into a pool of {} heads × {}", k.dims(), pool.kv_heads, pool.head_dim)
        }
        let (k, v) = pool.encode(k, v)?;
        // Released before writing: every query of this chunk still finds its window.
        self.release_out_of_window();
        self.append(&k, &v)?;
        let (pk, pv) = {
            let g = pool.lock();
            (g.k.clone().expect("allocated"), g.v.clone().expect("allocated"))
        };
        let key_start = self.first * pool.block_tokens;
        let (table, tag) = (self.table(), pool.tag());
        match &pool.codec {
            // Rows attention does not read through a table (TurboQuant): the table's rows gathered.
            Some(codec) if tag.is_none() => {
                let rows = KvView { k: table.gather(&pk)?, v: table.gather(&pv)?, key_start, quant: None, table: None };
                codec.fetch(rows)
            }
            _ => Ok(KvView { k: pk, v: pv, key_start, quant: tag, table: Some(table) }),
        }
    }

    fn offset(&self) -> usize {
        self.offset
    }

    /// True while no block was released (always for full attention): any trim is then exact.
    fn is_trimmable(&self) -> bool {
        self.start == 0
    }

    /// After a sliding window released blocks, as `RotatingCache`: the next query (at
    /// `offset - n`) must still find its `window - 1` predecessors, so a trim never reaches
    /// into a released block.
    fn max_trim(&self) -> usize {
        match self.window {
            Some(w) if self.start > 0 => (self.offset + 1).saturating_sub(self.start + w),
            _ => self.offset,
        }
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.max_trim());
        self.offset -= n;
        self.release_from(self.offset.div_ceil(self.pool.block_tokens).saturating_sub(self.first));
        n
    }

    /// The same state as a contiguous cache's (`state` gathers it), so snapshots and disk files
    /// are interchangeable between the layouts: `kv:plain`, `kv:rotating` for a window, the
    /// format's (`kv:q8g32`, as `QuantCache`) for quantized rows.
    fn signature(&self) -> String {
        match (self.window, self.pool.quant) {
            (_, Some(q)) => format!("kv:{}", q.name()),
            (Some(_), None) => "kv:rotating".into(),
            (None, None) => PlainCache::SIGNATURE.into(),
        }
    }

    fn bytes_per_token(&self) -> usize {
        self.pool.block_bytes() / self.pool.block_tokens
    }

    fn bytes_held(&self) -> usize {
        self.blocks.len() * self.pool.block_bytes()
    }

    fn device(&self) -> &Device {
        &self.pool.device
    }

    /// The tokens held, from `start` (a ring's state: the newest tokens and their key start).
    fn state(&self) -> Result<Option<KvView>> {
        self.gather(self.start, self.offset)
    }

    /// `state.k` holds the newest `n` tokens of a sequence of `offset` tokens; full attention
    /// also takes more (`n > offset`: the first `offset` are kept).
    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()> {
        self.pool.check_state(state)?;
        self.release_from(0);
        let n = state.k.dims()[1];
        let bt = self.pool.block_tokens;
        let start = match self.window {
            Some(_) if n > offset => candle_core::bail!("kv:rotating (paged): state holds {n} tokens but offset is {offset}"),
            Some(_) => offset - n,
            None => 0,
        };
        (self.first, self.offset, self.start) = (start / bt, start / bt * bt, start / bt * bt);
        let (h, d, dt) = (self.pool.kv_heads, self.pool.width, self.pool.dtype);
        let head_rows = |t: &Tensor| -> Result<Tensor> { t.to_dtype(dt)?.contiguous() };
        if start > self.offset {
            // The rows of the first block before the state's first token: zeros, never visible.
            let zeros = Tensor::zeros((h, start - self.offset, d), dt, &self.pool.device)?;
            self.append(&zeros, &zeros)?;
        }
        self.append(&head_rows(&state.k)?, &head_rows(&state.v)?)?;
        self.start = start;
        if self.window.is_none() {
            self.trim(self.offset.saturating_sub(offset));
        }
        Ok(())
    }

    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        if !self.covers(n) {
            return Ok(None);
        }
        self.gather(self.start, n)
    }

    fn share_prefix(&self, n: usize) -> Option<Box<dyn KvCache>> {
        if !self.covers(n) || n < self.first * self.pool.block_tokens {
            return None;
        }
        let mut shared = PagedCache::sharing_from(self.pool.clone(), self.window, self.first, &self.blocks, n);
        shared.start = self.start;
        Some(Box::new(shared))
    }

    fn as_paged(&self) -> Option<&PagedCache> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, seed: f32) -> Tensor {
        let data: Vec<f32> = (0..2 * n * 8).map(|i| seed + i as f32).collect();
        Tensor::from_vec(data, (2, n, 8), &Device::Cpu).unwrap()
    }

    fn gathered(c: &dyn KvCache) -> Vec<f32> {
        c.state().unwrap().map_or(Vec::new(), |s| s.k.flatten_all().unwrap().to_vec1().unwrap())
    }

    /// Appends across block boundaries, trims and reloads hold what a contiguous cache holds.
    #[test]
    fn holds_what_a_contiguous_cache_holds() {
        let pool = BlockPool::new(4, 2, 8, DType::F32, &Device::Cpu);
        let mut paged = PagedCache::new(pool.clone());
        let mut plain = PlainCache::new(2, 8, DType::F32, &Device::Cpu);
        for (n, seed) in [(3, 0.0), (6, 100.0), (1, 200.0), (9, 300.0)] {
            let x = rows(n, seed);
            let view = paged.update_and_fetch(&x, &(&x * 2.0).unwrap()).unwrap();
            plain.update_and_fetch(&x, &(&x * 2.0).unwrap()).unwrap();
            assert_eq!(view.table.as_ref().unwrap().tokens, paged.offset());
            assert_eq!(gathered(&paged), gathered(&plain));
        }
        assert_eq!((paged.offset(), paged.blocks().len()), (19, 5));
        assert_eq!(paged.trim(8), 8);
        plain.trim(8);
        assert_eq!((paged.blocks().len(), pool.usage().0), (3, 3), "blocks past the end are freed");
        assert_eq!(gathered(&paged), gathered(&plain));
        let state = plain.state().unwrap().unwrap();
        let mut loaded = PagedCache::new(pool.clone());
        loaded.load_state(&state, 11).unwrap();
        assert_eq!(gathered(&loaded), gathered(&plain));
        drop((paged, loaded));
        assert_eq!(pool.usage().0, 0, "dropped caches free their blocks");
    }

    /// A shared block is never written: the sharer writing into it gets a private copy, and
    /// the original holder still reads its own rows.
    #[test]
    fn writing_into_a_shared_block_copies_it() {
        let pool = BlockPool::new(4, 2, 8, DType::F32, &Device::Cpu);
        let mut a = PagedCache::new(pool.clone());
        a.update_and_fetch(&rows(6, 0.0), &rows(6, 0.0)).unwrap();
        let before = gathered(&a);
        let mut b = PagedCache::sharing(pool.clone(), a.blocks(), 5);
        assert_eq!(b.blocks(), a.blocks());
        assert_eq!(pool.refs(a.blocks()[0]), 2);
        b.update_and_fetch(&rows(3, -50.0), &rows(3, -50.0)).unwrap();
        assert_eq!(b.blocks()[0], a.blocks()[0], "the full block stays shared");
        assert_ne!(b.blocks()[1], a.blocks()[1], "the partial block was copied");
        assert_eq!(gathered(&a), before, "the holder's rows are untouched");
        let b_rows = gathered(&b);
        assert_eq!(b_rows[..5 * 8], before[..5 * 8], "the copy keeps the shared rows");
        assert_eq!(b_rows[5 * 8], -50.0);
        a.update_and_fetch(&rows(1, 7.0), &rows(1, 7.0)).unwrap();
        assert_eq!(gathered(&b), b_rows, "the sharer's rows are untouched by the holder's writes");
    }

    fn bytes(t: &Tensor) -> Vec<u8> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Quantized rows in blocks: across appends, trims, reloads and a shared block written by
    /// its sharer, the rows held (and the view's format) are a contiguous `QuantCache`'s, bit
    /// for bit; bytes are the quantized rows'; states move between the layouts; float states
    /// and states of another format are refused.
    #[test]
    fn quantized_blocks_hold_what_a_quant_cache_holds() {
        let dev = Device::Cpu;
        for q in [KvQuant::new(8, 32).unwrap(), KvQuant::new(4, 32).unwrap().with_rotation(false)] {
            let pool = BlockPool::quantized(4, 2, 64, q, &dev);
            let mut paged = PagedCache::new(pool.clone());
            let mut contiguous = crate::QuantCache::new(2, 64, q, &dev);
            for n in [3, 6, 1, 9] {
                let (k, v) = (Tensor::randn(0f32, 1.0, (2, n, 64), &dev).unwrap(), Tensor::randn(0f32, 1.0, (2, n, 64), &dev).unwrap());
                let view = paged.update_and_fetch(&k, &v).unwrap();
                let want = contiguous.update_and_fetch(&k, &v).unwrap();
                assert_eq!((view.quant, view.k.dims()[3]), (Some(q), want.k.dims()[2]));
                let (a, b) = (paged.state().unwrap().unwrap(), contiguous.state().unwrap().unwrap());
                assert_eq!((bytes(&a.k), bytes(&a.v), a.quant), (bytes(&b.k), bytes(&b.v), b.quant));
            }
            assert_eq!((paged.signature(), paged.bytes_per_token()), (contiguous.signature(), contiguous.bytes_per_token()));
            assert_eq!(pool.block_bytes(), 4 * contiguous.bytes_per_token());
            assert_eq!(paged.trim(8), 8);
            contiguous.trim(8);
            assert_eq!(bytes(&paged.state().unwrap().unwrap().k), bytes(&contiguous.state().unwrap().unwrap().k));
            let mut sharer = PagedCache::sharing(pool.clone(), paged.blocks(), 10);
            let before = bytes(&paged.state().unwrap().unwrap().k);
            let x = Tensor::randn(0f32, 1.0, (2, 2, 64), &dev).unwrap();
            sharer.update_and_fetch(&x, &x).unwrap();
            assert_eq!(bytes(&paged.state().unwrap().unwrap().k), before, "a shared block is copied before it is written");
            let mut loaded = PagedCache::new(pool.clone());
            loaded.load_state(&contiguous.state().unwrap().unwrap(), 11).unwrap();
            assert_eq!(bytes(&loaded.state().unwrap().unwrap().v), bytes(&contiguous.state().unwrap().unwrap().v));
            let mut back = crate::QuantCache::new(2, 64, q, &dev);
            back.load_state(&loaded.state().unwrap().unwrap(), 11).unwrap();
            let mut float = PlainCache::new(2, 64, DType::F32, &dev);
            float.update_and_fetch(&x, &x).unwrap();
            assert!(loaded.load_state(&float.state().unwrap().unwrap(), 2).is_err(), "float rows are not quantized rows");
            let other = BlockPool::quantized(4, 2, 64, q.with_rotation(!q.rotate), &dev);
            assert!(PagedCache::new(other).load_state(&paged.state().unwrap().unwrap(), 11).is_err(), "another format");
            let f16_pool = BlockPool::new(4, 2, 64, DType::F16, &dev);
            assert!(PagedCache::new(f16_pool).load_state(&paged.state().unwrap().unwrap(), 11).is_err(), "quantized rows into a float pool");
        }
    }

    /// TurboQuant rows in blocks: what attention gets (the table's rows gathered) and the states
    /// (the bare rows) are `TurboCache`'s, bit for bit, across appends, trims, a shared block written
    /// by its sharer and reloads both ways.
    #[test]
    fn turbo_blocks_fetch_what_a_turbo_cache_fetches() {
        let dev = Device::Cpu;
        for q in [KvQuant::turbo(8, 3).unwrap(), KvQuant::turbo(4, 2).unwrap()] {
            let pool = BlockPool::quantized(4, 2, 64, q, &dev);
            let mut paged = PagedCache::new(pool.clone());
            let mut contiguous = crate::quant::TurboCache::new(2, 64, q, &dev);
            for n in [3, 6, 1, 9] {
                let (k, v) = (Tensor::randn(0f32, 1.0, (2, n, 64), &dev).unwrap(), Tensor::randn(0f32, 1.0, (2, n, 64), &dev).unwrap());
                let (got, want) = (paged.update_and_fetch(&k, &v).unwrap(), contiguous.update_and_fetch(&k, &v).unwrap());
                assert_eq!((got.quant, got.table.is_none(), got.key_start), (Some(q), true, 0));
                assert_eq!((bytes(&got.k), bytes(&got.v)), (bytes(&want.k), bytes(&want.v)));
            }
            assert_eq!((paged.signature(), paged.bytes_per_token()), (contiguous.signature(), contiguous.bytes_per_token()));
            assert_eq!(paged.trim(5), 5);
            contiguous.trim(5);
            let (a, b) = (paged.state().unwrap().unwrap(), contiguous.state().unwrap().unwrap());
            assert_eq!((bytes(&a.k), bytes(&a.v), a.quant), (bytes(&b.k), bytes(&b.v), b.quant));
            let mut sharer = PagedCache::sharing(pool.clone(), paged.blocks(), 13);
            let x = Tensor::randn(0f32, 1.0, (2, 2, 64), &dev).unwrap();
            sharer.update_and_fetch(&x, &x).unwrap();
            assert_eq!(bytes(&paged.state().unwrap().unwrap().k), bytes(&a.k), "a shared block is copied before it is written");
            let mut loaded = PagedCache::new(pool.clone());
            loaded.load_state(&b, 14).unwrap();
            let mut back = crate::quant::TurboCache::new(2, 64, q, &dev);
            back.load_state(&loaded.state().unwrap().unwrap(), 14).unwrap();
            let (got, want) = (loaded.update_and_fetch(&x, &x).unwrap(), contiguous.update_and_fetch(&x, &x).unwrap());
            assert_eq!((bytes(&got.k), bytes(&got.v)), (bytes(&want.k), bytes(&want.v)));
            let affine = BlockPool::quantized(4, 2, 64, KvQuant::new(8, 32).unwrap(), &dev);
            assert!(PagedCache::new(affine).load_state(&b, 14).is_err(), "TurboQuant rows are not affine rows");
        }
    }

    /// Token t's key is the constant t (one head, head_dim 2), so positions can be read back.
    fn positions_rows(range: std::ops::Range<usize>) -> Tensor {
        let data: Vec<f32> = range.flat_map(|t| [t as f32, t as f32]).collect();
        let n = data.len() / 2;
        Tensor::from_vec(data, (1, n, 2), &Device::Cpu).unwrap()
    }

    fn held_positions(c: &dyn KvCache) -> (usize, Vec<usize>) {
        let s = c.state().unwrap().unwrap();
        let k: Vec<Vec<f32>> = s.k.get(0).unwrap().to_vec2().unwrap();
        (s.key_start, k.iter().map(|r| r[0] as usize).collect())
    }

    /// A sliding window on blocks: every view starts at a block boundary at or before the
    /// window of its first query, blocks wholly before it (and a block's margin) go back to the
    /// pool, so a long sequence holds a bounded number of blocks; trims stop where the ring's
    /// do (never into a released block); states load into a ring and back.
    #[test]
    fn a_sliding_window_on_blocks_releases_what_it_left() {
        let (window, bt) = (8, 4);
        let pool = BlockPool::new(bt, 1, 2, DType::F32, &Device::Cpu);
        for chunks in [vec![1; 60], vec![3, 5, 7, 1, 1, 20, 2, 1, 1, 30], vec![17, 1, 1, 1, 9, 40, 1]] {
            let mut c = PagedCache::sliding(pool.clone(), window);
            let mut ring = crate::RotatingCache::new(1, 2, window, DType::F32, &Device::Cpu);
            let mut pos = 0;
            for n in chunks {
                let x = positions_rows(pos..pos + n);
                let view = c.update_and_fetch(&x, &x).unwrap();
                ring.update_and_fetch(&x, &x).unwrap();
                assert_eq!(view.key_start % bt, 0);
                assert!(view.key_start <= (pos + 1).saturating_sub(window), "the chunk's first query sees its window");
                assert_eq!(view.table.as_ref().unwrap().tokens, pos + n - view.key_start);
                let (start, held) = held_positions(&c);
                assert_eq!((start, held), (view.key_start, (view.key_start..pos + n).collect::<Vec<_>>()));
                assert!(c.blocks().len() <= (window - 1 + bt).div_ceil(bt) + 1 + n.div_ceil(bt), "{} blocks", c.blocks().len());
                pos += n;
            }
            assert_eq!(pool.usage().0, c.blocks().len(), "released blocks are free in the pool");
            // The state (newest tokens from the key start) loads into a ring and back alike.
            let mut from_ring = PagedCache::sliding(pool.clone(), window);
            from_ring.load_state(&ring.state().unwrap().unwrap(), ring.offset()).unwrap();
            let mut to_ring = crate::RotatingCache::new(1, 2, window, DType::F32, &Device::Cpu);
            to_ring.load_state(&c.state().unwrap().unwrap(), c.offset()).unwrap();
            let next = positions_rows(pos..pos + 1);
            for other in [&mut from_ring as &mut dyn KvCache, &mut to_ring] {
                let a = other.update_and_fetch(&next, &next).unwrap();
                assert_eq!(other.offset(), pos + 1);
                let (_, held) = held_positions(other);
                let need = pos + 1 - window;
                assert!(a.key_start <= need && held.ends_with(&(need..=pos).collect::<Vec<_>>()), "{held:?}");
            }
            drop(from_ring);
            assert!(!c.is_trimmable());
            let can = c.max_trim();
            assert!(can >= bt && can < c.offset(), "{can}");
            assert_eq!(c.trim(1000), can, "never into a released block");
            assert!(c.offset() >= c.first_block() * bt + window - 1);
            // A prefix shares the blocks of the window before it, nothing before.
            let shared = c.share_prefix(c.offset()).unwrap();
            assert_eq!(shared.as_paged().unwrap().blocks(), c.blocks());
            assert!(c.share_prefix(c.first_block() * bt + 2).is_none(), "its window was released");
        }
        assert_eq!(pool.usage().0, 0);
    }
}
