//! Captured batched decode steps (issue 38): a forward whose rows are all one-token decode rows
//! (no prompt chunk, no drafts, no adapters; at most `max_rows` of them, 32 by default) is padded
//! up to a batch-size bucket (1, 2, 4 … 256)
//! and replayed as a CUDA graph recorded once per (bucket, split count), instead of issuing each
//! layer's ~15 operations from the host.
//!
//! Nothing a sequence owns is baked into a graph: the token ids and each layer's table of cache
//! buffers and positions (`attention_device::decode_table_row`) are device buffers that the host
//! rewrites before every replay, so a graph stays valid while sequences come and go and their
//! caches grow. The attention grid's split dimension is the longest row's split count rounded up
//! to a power of two or three quarters of one (`split_bucket`). Padded rows decode token 0 at position 0 of a spare cache: they never
//! touch a real sequence's cache, and their hidden rows are cut off before anyone sees them.
//!
//! The first step of a (bucket, splits) pair runs eagerly (the warm-up: a real step), then is
//! captured; a capture that fails leaves that pair eager through the same step function. Off
//! (`FERROLM_BATCH_GRAPHS=0`) or on devices without graphs, the model's usual forward runs.

use crate::{RowKind, SeqInput};
use candle_core::{DType, Device, Result, Tensor, TensorId};
use ferrolm_backend::attention_device::{decode_table_row, DECODE_SPLIT_KEYS, DECODE_TABLE_FIELDS};
use ferrolm_backend::graph::{self, StepGraph};
use ferrolm_kv::SeqCache;
use std::collections::HashMap;

/// The largest bucket: bigger batches run eagerly.
pub const MAX_BUCKET: usize = 256;

/// Whether batched decode steps are captured, read once at start (DESIGN §3.7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchGraphSettings {
    /// Capture and replay (`FERROLM_BATCH_GRAPHS=0`: the eager forward, for A/B).
    pub on: bool,
    /// After every replay, run the same step eagerly and require the same bits
    /// (`FERROLM_BATCH_GRAPH_CHECK=1`; slow: for `scripts/gpu/batch_graph_check.sh`).
    pub check: bool,
    /// Batches of more rows run eagerly (`FERROLM_BATCH_GRAPH_MAX_ROWS`, 1 to 256). At 32 rows
    /// and fewer the replay wins (H100, 1B shape: 1.6x at 8 rows, 1.25x at 32; 8B: 1.07x,
    /// 1.03x); from 64 rows on the step is no longer host-bound and the replayed step measured
    /// slower than the eager one (8B at 128 rows: 0.88x), see bench/results/batching-gpu.md.
    pub max_rows: usize,
}

/// The default [`BatchGraphSettings::max_rows`].
pub const DEFAULT_MAX_ROWS: usize = 32;

impl Default for BatchGraphSettings {
    fn default() -> Self {
        Self { on: true, check: false, max_rows: DEFAULT_MAX_ROWS }
    }
}

impl BatchGraphSettings {
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let max_rows = var("FERROLM_BATCH_GRAPH_MAX_ROWS").and_then(|v| v.parse::<usize>().ok()).unwrap_or(DEFAULT_MAX_ROWS);
        Self {
            on: var("FERROLM_BATCH_GRAPHS").as_deref() != Some("0"),
            check: var("FERROLM_BATCH_GRAPH_CHECK").as_deref() == Some("1"),
            max_rows: max_rows.clamp(1, MAX_BUCKET),
        }
    }
}

/// The model's batched step over device inputs: token ids `[B]` u32, per layer a table i64
/// `[layers, B · DECODE_TABLE_FIELDS]`, and the split count → the final-normed hidden rows
/// `[B, hidden]`; None when the model cannot take this path.
pub type TableStep<'a> = dyn Fn(&Tensor, &Tensor, usize) -> Result<Option<Tensor>> + 'a;

/// What a model tells the graphs about itself.
pub struct ModelShape {
    pub layers: usize,
    pub heads: usize,
    pub hidden: usize,
    pub dtype: DType,
}

/// The persistent inputs and output of one bucket (shared by its split counts' graphs).
struct Bucket {
    tokens: Tensor,
    tables: Tensor,
    hidden: Tensor,
}

/// A cache buffer pair's table words (`decode_table_row`) and its capacity in tokens.
#[derive(Clone, Copy)]
struct Buffers {
    k: i64,
    v: i64,
    head_stride: i64,
    capacity: usize,
}

/// One (bucket, splits) pair: its graph, or None once capturing failed (eager from then on).
type Key = (usize, usize);

pub struct BatchGraphs {
    settings: BatchGraphSettings,
    buckets: HashMap<usize, Bucket>,
    graphs: HashMap<Key, Option<StepGraph>>,
    /// The cache padded rows write into (never committed: it stays at position 0).
    spare: Option<SeqCache>,
    /// The buffer pairs of the last step's table, checked.
    seen: HashMap<(TensorId, TensorId), Buffers>,
    /// Steps replayed and checked against eager (for the check's report).
    pub replays: usize,
    pub checked: usize,
}

/// The bucket of `n` rows: the next power of two, at most [`MAX_BUCKET`].
pub fn bucket_of(n: usize) -> Option<usize> {
    (n > 0 && n <= MAX_BUCKET).then(|| n.next_power_of_two())
}

/// The attention grid's split dimension for rows of at most `n` splits: the next power of two,
/// or three quarters of it when that holds them (at most a third of the grid's items idle, and
/// two graphs per doubling of the context).
pub fn split_bucket(n: usize) -> usize {
    let p = n.max(1).next_power_of_two();
    match p >= 4 && n <= p / 4 * 3 {
        true => p / 4 * 3,
        false => p,
    }
}

impl BatchGraphs {
    pub fn new(settings: BatchGraphSettings) -> Self {
        Self { settings, buckets: HashMap::new(), graphs: HashMap::new(), spare: None, seen: HashMap::new(), replays: 0, checked: 0 }
    }

    pub fn settings(&self) -> BatchGraphSettings {
        self.settings
    }

    /// The hidden rows of `batch` (final-normed, `[n, hidden]`) through a captured step, the
    /// caches advanced by one token each; None (nothing written) when the batch or the device
    /// does not take this path, and the caller forwards as usual.
    pub fn forward(&mut self, device: &Device, shape: &ModelShape, batch: &mut [SeqInput<'_>], make_cache: &dyn Fn() -> SeqCache, step: &TableStep<'_>) -> Result<Option<Tensor>> {
        let n = batch.len();
        let plain = batch.iter().all(|s| s.kind == RowKind::Decode && s.tokens.len() == 1 && s.lora.is_none());
        let wanted = self.settings.on && n <= self.settings.max_rows && plain;
        let Some(bucket) = bucket_of(n).filter(|_| wanted && graph::supported(device)) else { return Ok(None) };
        let Some((tokens, fields, splits)) = self.table(shape, batch, bucket, make_cache)? else { return Ok(None) };
        let inputs = self.bucket(device, shape, bucket)?;
        inputs.tokens.slice_set(&Tensor::from_vec(tokens, bucket, device)?, 0, 0)?;
        inputs.tables.slice_set(&Tensor::from_vec(fields, (shape.layers, bucket * DECODE_TABLE_FIELDS), device)?, 0, 0)?;
        if !self.run(device, (bucket, splits), step)? {
            return Ok(None);
        }
        for s in batch.iter_mut() {
            s.cache.commit_static(1)?;
        }
        // A copy: the bucket's buffer is the next replay's output.
        self.buckets[&bucket].hidden.narrow(0, 0, n)?.copy().map(Some)
    }

    /// The token ids and every layer's table for `batch` padded to `bucket`, and the split
    /// count of the grid; None when a cache keeps no whole buffers the kernel can read.
    #[allow(clippy::type_complexity)]
    fn table(&mut self, shape: &ModelShape, batch: &mut [SeqInput<'_>], bucket: usize, make_cache: &dyn Fn() -> SeqCache) -> Result<Option<(Vec<u32>, Vec<i64>, usize)>> {
        let mut rows = Vec::with_capacity(bucket);
        for s in batch.iter_mut() {
            let pos = s.cache.offset();
            let Some(kv) = s.cache.static_buffers(1)? else { return Ok(None) };
            rows.push((s.tokens[0], pos, kv));
        }
        let spare = self.spare.get_or_insert_with(make_cache);
        let Some(spare_kv) = spare.static_buffers(1)? else { return Ok(None) };
        let longest = rows.iter().map(|r| r.1).max().unwrap_or(0);
        let splits = split_bucket((longest + 1).div_ceil(DECODE_SPLIT_KEYS));
        let mut fields = Vec::with_capacity(shape.layers * bucket * DECODE_TABLE_FIELDS);
        let mut seen = HashMap::with_capacity(self.seen.len().max(bucket * shape.layers));
        for layer in 0..shape.layers {
            for i in 0..bucket {
                let (pos, kv) = match rows.get(i) {
                    Some((_, pos, kv)) => (*pos, kv.get(layer)),
                    None => (0, spare_kv.get(layer)),
                };
                let Some((k, v)) = kv else { return Ok(None) };
                let Some(b) = self.buffers(k, v, &mut seen)? else { return Ok(None) };
                if b.capacity <= pos {
                    return Ok(None);
                }
                fields.extend([b.k, b.v, b.head_stride, pos as i64, (i * shape.heads * splits) as i64]);
            }
        }
        // Only the buffers in use stay known (a freed buffer's id never comes back).
        self.seen = seen;
        let mut tokens: Vec<u32> = rows.iter().map(|r| r.0).collect();
        tokens.resize(bucket, 0);
        Ok(Some((tokens, fields, splits)))
    }

    /// The table words of a cache buffer pair, checked once per pair (the host's share of a
    /// replayed step: every layer of every row, each step) and carried into `seen`.
    fn buffers(&self, k: &Tensor, v: &Tensor, seen: &mut HashMap<(TensorId, TensorId), Buffers>) -> Result<Option<Buffers>> {
        let id = (k.id(), v.id());
        if let Some(b) = self.seen.get(&id).or_else(|| seen.get(&id)).copied() {
            seen.insert(id, b);
            return Ok(Some(b));
        }
        let Some(row) = decode_table_row(k, v, 0, 0)? else { return Ok(None) };
        let b = Buffers { k: row[0], v: row[1], head_stride: row[2], capacity: k.dim(1)? };
        seen.insert(id, b);
        Ok(Some(b))
    }

    /// The persistent buffers of `bucket`, made on first use.
    fn bucket(&mut self, device: &Device, shape: &ModelShape, bucket: usize) -> Result<&Bucket> {
        if !self.buckets.contains_key(&bucket) {
            let b = Bucket {
                tokens: Tensor::zeros(bucket, DType::U32, device)?,
                tables: Tensor::zeros((shape.layers, bucket * DECODE_TABLE_FIELDS), DType::I64, device)?,
                hidden: Tensor::zeros((bucket, shape.hidden), shape.dtype, device)?,
            };
            self.buckets.insert(bucket, b);
        }
        Ok(&self.buckets[&bucket])
    }

    /// Runs the step of `key` into its bucket's hidden buffer: a replay of its graph, or eagerly
    /// (then captured, the first time). Returns false when the model has no table step (nothing
    /// was kept; the caller's forward rewrites whatever the attempt wrote, with the same values).
    fn run(&mut self, device: &Device, key: Key, step: &TableStep<'_>) -> Result<bool> {
        let b = &self.buckets[&key.0];
        let (tokens, tables, hidden) = (b.tokens.clone(), b.tables.clone(), b.hidden.clone());
        let mut eager = || -> Result<()> {
            match step(&tokens, &tables, key.1)? {
                Some(h) => hidden.slice_set(&h, 0, 0),
                None => candle_core::bail!("the model has no batched table step"),
            }
        };
        match self.graphs.get(&key) {
            Some(Some(g)) => {
                g.replay()?;
                self.replays += 1;
                if self.settings.check {
                    self.check(key, &hidden, &tokens, &tables, step)?;
                }
                Ok(true)
            }
            Some(None) => eager().map(|_| true),
            None => {
                if let Err(e) = graph::warm_up(device, &mut eager) {
                    tracing::warn!("batched decode steps run through the model's forward: {e}");
                    self.settings.on = false;
                    return Ok(false);
                }
                let captured = graph::capture(device, &mut eager);
                if let Err(e) = &captured {
                    tracing::warn!("batched decode step (bucket {}, {} splits) not captured, running it eagerly: {e}", key.0, key.1);
                }
                self.graphs.insert(key, captured.ok());
                Ok(true)
            }
        }
    }

    /// The replayed hidden rows against the same step run eagerly (the step is idempotent: it
    /// rewrites each row's key and value at the same position with the same values).
    fn check(&mut self, key: Key, replayed: &Tensor, tokens: &Tensor, tables: &Tensor, step: &TableStep<'_>) -> Result<()> {
        let Some(eager) = step(tokens, tables, key.1)? else { candle_core::bail!("batched step check: no eager step") };
        let bits = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>() };
        let (a, b) = (bits(replayed)?, bits(&eager)?);
        let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        if differ > 0 {
            tracing::error!("batched step graph (bucket {}, {} splits) differs from eager in {differ} of {} values", key.0, key.1, a.len());
            candle_core::bail!("batched step graph (bucket {}, {} splits) differs from eager in {differ} of {} values", key.0, key.1, a.len());
        }
        self.checked += 1;
        if self.checked.is_power_of_two() {
            tracing::info!("batched step graph = eager, bit for bit: {} checks (bucket {}, {} splits)", self.checked, key.0, key.1);
        }
        Ok(())
    }
}

impl Drop for BatchGraphs {
    /// The check's totals (`FERROLM_BATCH_GRAPH_CHECK=1`), for the check script's log.
    fn drop(&mut self) {
        if self.settings.check {
            let captured: Vec<Key> = self.graphs.iter().filter(|(_, g)| g.is_some()).map(|(k, _)| *k).collect();
            tracing::info!("batched step graphs: {} replays, {} checked equal to eager bit for bit; captured (bucket, splits): {captured:?}", self.replays, self.checked);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets are the powers of two 1..=256 that hold n rows; more rows have none (eager).
    #[test]
    fn buckets_round_up_to_powers_of_two_up_to_256() {
        let got: Vec<Option<usize>> = [0, 1, 2, 3, 5, 8, 9, 100, 128, 129, 256, 257].iter().map(|&n| bucket_of(n)).collect();
        let want = [None, Some(1), Some(2), Some(4), Some(8), Some(8), Some(16), Some(128), Some(128), Some(256), Some(256), None];
        assert_eq!(got, want);
    }

    /// Split counts round up to 1, 2, 3, 4, 6, 8, 12, 16, 24, 32 …
    #[test]
    fn split_buckets_are_powers_of_two_and_three_quarters() {
        let got: Vec<usize> = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 12, 13, 17, 25, 33].iter().map(|&n| split_bucket(n)).collect();
        assert_eq!(got, [1, 1, 2, 3, 4, 6, 6, 8, 12, 12, 12, 16, 24, 32, 48]);
    }

    /// The levers: on unless FERROLM_BATCH_GRAPHS=0, up to 32 rows; the check only when asked.
    #[test]
    fn settings_default_to_graphs_on_without_the_check() {
        assert_eq!(BatchGraphSettings::default(), BatchGraphSettings { on: true, check: false, max_rows: 32 });
    }
}
