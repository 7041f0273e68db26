//! The sliding-window cache for local-attention layers (Gemma 3, Mistral): it keeps only the
//! keys a query can still see, `window - 1` behind the newest token.
//!
//! Layout: one `[kv_heads, capacity, head_dim]` buffer holding the most recent `len` tokens in
//! temporal order from index 0, so `update_and_fetch` returns a contiguous narrow view with
//! `key_start = offset - len` (no gather, no mask reordering). Appends write after the held
//! tokens; when the buffer is full the last `window - 1` tokens are moved to its front (the only
//! ones a new query can still see) and the rest is evicted. With `capacity = 2 · window` that
//! copy happens at most once per `window` decoded tokens, i.e. about one token copied per token
//! written, while the view never holds more than `2 · window` keys. A prefill chunk longer than
//! the window grows the buffer to `window - 1 + chunk` for that forward and shrinks back at the
//! next compaction. The view may hold keys that are already outside the window of every query;
//! attention masks them by position (`AttentionParams::window`).
//!
//! Trimming: while nothing has been evicted the cache holds every token and trims exactly like
//! the plain cache (`is_trimmable`). After an eviction it can still drop its newest tokens as
//! long as the remaining ones cover the window of the next query (`max_trim`).

use crate::{KvCache, KvView};
use candle_core::{DType, Device, Result, Tensor};

/// Buffers grow in slabs of this many tokens until they reach `2 · window`.
const STEP: usize = 256;

pub struct RotatingCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// Tokens held, at buffer indices `0..len`, in temporal order.
    len: usize,
    /// Tokens written in total (the position of the next token).
    offset: usize,
    window: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl RotatingCache {
    /// A cache for a layer whose queries see the last `window` positions (their own included).
    pub fn new(
        kv_heads: usize,
        head_dim: usize,
        window: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        assert!(window > 0, "a sliding window holds at least one token");
        Self {
            k: None,
            v: None,
            len: 0,
            offset: 0,
            window,
            kv_heads,
            head_dim,
            dtype,
            device: device.clone(),
        }
    }

    pub fn window(&self) -> usize {
        self.window
    }

    /// Absolute position of the oldest held token.
    pub fn key_start(&self) -> usize {
        self.offset - self.len
    }

    fn capacity(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[1])
    }

    /// Makes room for `new` tokens after the held ones, evicting tokens no query can see.
    fn reserve(&mut self, new: usize) -> Result<()> {
        if self.len + new <= self.capacity() {
            return Ok(());
        }
        let bound = 2 * self.window;
        if self.len + new <= bound {
            // Still growing towards the bound: keep everything (the cache stays trimmable).
            let capacity = ((self.len + new).div_ceil(STEP) * STEP).min(bound);
            return self.reallocate(capacity, self.len);
        }
        let keep = self.len.min(self.window - 1);
        let capacity = (keep + new).max(bound);
        if capacity == self.capacity() {
            self.shift_to_front(keep)
        } else {
            self.reallocate(capacity, keep)
        }
    }

    /// A fresh buffer of `capacity` tokens holding the last `keep` held tokens at its front.
    fn reallocate(&mut self, capacity: usize, keep: usize) -> Result<()> {
        let shape = (self.kv_heads, capacity, self.head_dim);
        let k = Tensor::zeros(shape, self.dtype, &self.device)?;
        let v = Tensor::zeros(shape, self.dtype, &self.device)?;
        if let (Some(old_k), Some(old_v), true) = (&self.k, &self.v, keep > 0) {
            let from = self.len - keep;
            k.slice_set(&old_k.narrow(1, from, keep)?.contiguous()?, 1, 0)?;
            v.slice_set(&old_v.narrow(1, from, keep)?.contiguous()?, 1, 0)?;
        }
        self.k = Some(k);
        self.v = Some(v);
        self.len = keep;
        Ok(())
    }

    /// Moves the last `keep` held tokens to the front of the same buffer.
    fn shift_to_front(&mut self, keep: usize) -> Result<()> {
        let from = self.len - keep;
        if keep > 0 && from > 0 {
            for buf in [&self.k, &self.v].into_iter().flatten() {
                // Copy the source first so the overlapping ranges are safe (`contiguous` alone
                // returns a view of the same storage when there is one kv head).
                let tail = buf.narrow(1, from, keep)?;
                let tail = if tail.is_contiguous() {
                    tail.copy()?
                } else {
                    tail.contiguous()?
                };
                buf.slice_set(&tail, 1, 0)?;
            }
        }
        self.len = keep;
        Ok(())
    }

    fn view(&self) -> Result<Option<KvView>> {
        match (&self.k, &self.v) {
            (Some(k), Some(v)) => Ok(Some(KvView {
                k: k.narrow(1, 0, self.len)?,
                v: v.narrow(1, 0, self.len)?,
                key_start: self.key_start(),
                quant: None,
                table: None,
            })),
            _ => Ok(None),
        }
    }
}

impl KvCache for RotatingCache {
    fn update_and_fetch(&mut self, k: &Tensor, v: &Tensor) -> Result<KvView> {
        let new = k.dims()[1];
        self.reserve(new)?;
        let (bk, bv) = (self.k.as_ref().unwrap(), self.v.as_ref().unwrap());
        bk.slice_set(&k.to_dtype(self.dtype)?.contiguous()?, 1, self.len)?;
        bv.slice_set(&v.to_dtype(self.dtype)?.contiguous()?, 1, self.len)?;
        self.len += new;
        self.offset += new;
        Ok(self.view()?.expect("reserved above"))
    }

    fn offset(&self) -> usize {
        self.offset
    }

    /// True while no token has been evicted: any trim is then exact.
    fn is_trimmable(&self) -> bool {
        self.key_start() == 0
    }

    fn max_trim(&self) -> usize {
        if self.is_trimmable() {
            self.offset
        } else {
            // The next query (at `offset - n`) must still find its `window - 1` predecessors.
            self.len.saturating_sub(self.window - 1)
        }
    }

    fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.max_trim());
        self.len -= n;
        self.offset -= n;
        n
    }

    fn signature(&self) -> String {
        "kv:rotating".into()
    }

    fn sliding_shape(&self) -> Option<(usize, usize, DType, usize)> {
        Some((self.kv_heads, self.head_dim, self.dtype, self.window))
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
        self.view()
    }

    /// Held tokens `[key_start, n)`, when they are what a cache of `n` tokens needs: every
    /// token from 0 (nothing evicted yet), or at least the `window - 1` before `n`.
    fn state_prefix(&self, n: usize) -> Result<Option<KvView>> {
        let start = self.key_start();
        let covers = n <= self.offset && (start == 0 || n >= start + self.window - 1);
        match (&self.k, &self.v) {
            (Some(k), Some(v)) if covers && n > start => Ok(Some(KvView {
                k: k.narrow(1, 0, n - start)?,
                v: v.narrow(1, 0, n - start)?,
                key_start: start,
                quant: None,
                table: None,
            })),
            _ => Ok(None),
        }
    }

    /// `state.k` holds the newest `n` tokens of a sequence of `offset` tokens (`n <= offset`).
    fn load_state(&mut self, state: &KvView, offset: usize) -> Result<()> {
        let n = state.k.dims()[1];
        if n > offset {
            candle_core::bail!("rotating cache: state holds {n} tokens but offset is {offset}")
        }
        self.k = None;
        self.v = None;
        self.len = 0;
        self.offset = 0;
        self.update_and_fetch(&state.k, &state.v)?;
        self.offset = offset;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PlainCache;

    /// Token t's key is the constant t (one head, head_dim 2), so views can be read back.
    fn tokens(range: std::ops::Range<usize>) -> Tensor {
        let data: Vec<f32> = range.flat_map(|t| [t as f32, t as f32]).collect();
        let n = data.len() / 2;
        Tensor::from_vec(data, (1, n, 2), &Device::Cpu).unwrap()
    }

    fn positions(view: &KvView) -> Vec<usize> {
        let k: Vec<Vec<f32>> = view.k.get(0).unwrap().to_vec2().unwrap();
        k.iter().map(|r| r[0] as usize).collect()
    }

    /// Every view is contiguous in time, starts at `key_start`, ends at the newest token and
    /// covers the window of each new query, whatever the chunking.
    #[test]
    fn views_cover_every_new_query_window_for_any_chunking() {
        let window = 8;
        for chunks in [
            vec![1; 40],
            vec![3, 5, 7, 1, 1, 20, 2, 1, 1, 30],
            vec![17, 1, 1, 1, 9, 40, 1],
            vec![8, 8, 8, 1, 7, 1, 1],
        ] {
            let mut c = RotatingCache::new(1, 2, window, DType::F32, &Device::Cpu);
            let mut pos = 0;
            for n in chunks {
                let view = c.update_and_fetch(&tokens(pos..pos + n), &tokens(pos..pos + n)).unwrap();
                let got = positions(&view);
                let want: Vec<usize> = (view.key_start..pos + n).collect();
                assert_eq!(got, want, "temporal order from key_start");
                assert!(view.key_start <= (pos + 1).saturating_sub(window), "window covered");
                assert!(got.len() <= (window - 1 + n).max(2 * window));
                pos += n;
                assert_eq!(c.offset(), pos);
            }
        }
    }

    #[test]
    fn trims_exactly_until_the_first_eviction() {
        let mut c = RotatingCache::new(1, 2, 4, DType::F32, &Device::Cpu);
        c.update_and_fetch(&tokens(0..6), &tokens(0..6)).unwrap();
        assert!(c.is_trimmable());
        assert_eq!(c.trim(2), 2);
        let view = c.update_and_fetch(&tokens(4..5), &tokens(4..5)).unwrap();
        assert_eq!(positions(&view), vec![0, 1, 2, 3, 4]);
        // Fill past 2·window: the oldest tokens go, and only the newest remain trimmable.
        for t in 5..12 {
            c.update_and_fetch(&tokens(t..t + 1), &tokens(t..t + 1)).unwrap();
        }
        assert!(!c.is_trimmable());
        let can = c.max_trim();
        assert!(can < c.offset());
        assert_eq!(c.trim(100), can);
        let view = c.update_and_fetch(&tokens(12 - can..13 - can), &tokens(0..1)).unwrap();
        let got = positions(&view);
        assert!(got.len() >= 4, "the window of the next query survives: {got:?}");
        assert_eq!(*got.last().unwrap(), 12 - can);
    }

    #[test]
    fn state_round_trip_keeps_positions() {
        let mut c = RotatingCache::new(1, 2, 4, DType::F32, &Device::Cpu);
        for t in 0..11 {
            c.update_and_fetch(&tokens(t..t + 1), &tokens(t..t + 1)).unwrap();
        }
        let state = c.state().unwrap().unwrap();
        let mut d = RotatingCache::new(1, 2, 4, DType::F32, &Device::Cpu);
        d.load_state(&state, c.offset()).unwrap();
        let a = c.update_and_fetch(&tokens(11..12), &tokens(11..12)).unwrap();
        let b = d.update_and_fetch(&tokens(11..12), &tokens(11..12)).unwrap();
        assert_eq!(a.key_start, b.key_start);
        assert_eq!(positions(&a), positions(&b));
        assert_eq!(c.signature(), "kv:rotating");
        assert_eq!(c.bytes_per_token(), PlainCache::new(1, 2, DType::F32, &Device::Cpu).bytes_per_token());
    }
}
