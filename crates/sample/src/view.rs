//! A copy-on-write view of one step's logits on the host.
//!
//! The logits stay where the tensor keeps them (no full-vocabulary copy); processors, masks and XTC
//! write into private copies of just the chunks they touch. Whole-vocabulary passes run over the
//! borrowed slice and then redo the patched chunks.
#![allow(clippy::neg_cmp_op_on_partial_ord)] // NaN maxima count as below any floor

use crate::fastmath::{self, CHUNK};

pub struct View<'a> {
    base: &'a [f32],
    /// Private copies of touched chunks, sorted by chunk index.
    patches: Vec<(usize, Vec<f32>)>,
}

impl<'a> View<'a> {
    pub fn new(base: &'a [f32]) -> Self {
        View { base, patches: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.base.len()
    }

    pub fn is_empty(&self) -> bool {
        self.base.is_empty()
    }

    pub fn chunk_count(&self) -> usize {
        fastmath::chunk_count(self.base.len())
    }

    fn range(&self, c: usize) -> std::ops::Range<usize> {
        c * CHUNK..((c + 1) * CHUNK).min(self.base.len())
    }

    /// The logits of chunk `c`, patched or borrowed.
    pub fn chunk(&self, c: usize) -> &[f32] {
        match self.patches.binary_search_by_key(&c, |p| p.0) {
            Ok(i) => &self.patches[i].1,
            Err(_) => &self.base[self.range(c)],
        }
    }

    pub fn get(&self, i: usize) -> f32 {
        self.chunk(i / CHUNK)[i % CHUNK]
    }

    fn chunk_mut(&mut self, c: usize) -> &mut Vec<f32> {
        let i = match self.patches.binary_search_by_key(&c, |p| p.0) {
            Ok(i) => i,
            Err(i) => {
                let copy = self.base[self.range(c)].to_vec();
                self.patches.insert(i, (c, copy));
                i
            }
        };
        &mut self.patches[i].1
    }

    /// Overwrites single logits; ids past the end are ignored.
    pub fn set_many(&mut self, updates: &[(u32, f32)]) {
        for &(id, v) in updates {
            let i = id as usize;
            if i < self.base.len() {
                self.chunk_mut(i / CHUNK)[i % CHUNK] = v;
            }
        }
    }

    /// Bans (sets to -inf) every token whose bit is clear in `allowed` (bit i of word i / 32);
    /// tokens past the bitset's end are banned too.
    pub fn apply_allowed(&mut self, allowed: &[u32]) {
        for c in 0..self.chunk_count() {
            let r = self.range(c);
            // A chunk is two bitset words: skip fully allowed chunks without testing bits.
            let words = (allowed.get(2 * c), allowed.get(2 * c + 1));
            if r.len() == CHUNK && words == (Some(&u32::MAX), Some(&u32::MAX)) {
                continue;
            }
            if r.len() < CHUNK && r.clone().all(|i| bit(allowed, i)) {
                continue;
            }
            let chunk = self.chunk_mut(c);
            for (k, v) in chunk.iter_mut().enumerate() {
                if !bit(allowed, r.start + k) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Adds `mask` (same length as the logits) after the processors.
    pub fn apply_additive(&mut self, mask: &[f32]) {
        for c in 0..self.chunk_count() {
            let r = self.range(c);
            if mask[r.clone()].iter().all(|&m| m == 0.0) {
                continue;
            }
            let chunk = self.chunk_mut(c);
            for (v, &m) in chunk.iter_mut().zip(&mask[r]) {
                *v += m;
            }
        }
    }

    /// Chunk maxima of the view.
    pub fn maxima(&self, out: &mut Vec<f32>) {
        fastmath::chunk_maxima(self.base, out);
        for (c, data) in &self.patches {
            out[*c] = fastmath::max_of(data);
        }
    }

    /// Recomputes the maxima of patched chunks only (after a filter patched the view).
    pub fn refresh_maxima(&self, out: &mut [f32]) {
        for (c, data) in &self.patches {
            out[*c] = fastmath::max_of(data);
        }
    }

    /// Chunk sums of weight(x, shift, scale) over logits >= floor, skipping negligible chunks.
    pub fn sums(&self, cmax: &[f32], shift: f32, scale: f32, floor: f32, out: &mut Vec<f32>) {
        fastmath::chunk_sums(self.base, cmax, shift, scale, floor, out);
        for (c, data) in &self.patches {
            out[*c] = if fastmath::skipped(cmax[*c], shift, scale) || !(cmax[*c] >= floor) {
                0.0
            } else {
                fastmath::sum_weights(data, shift, scale, floor)
            };
        }
    }

    /// Number of logits >= t, visiting only chunks whose maximum reaches t.
    pub fn count_at_least(&self, cmax: &[f32], t: f32) -> usize {
        let visit = cmax.iter().enumerate().filter(|(_, &m)| m >= t);
        visit.map(|(c, _)| fastmath::count_at_least(self.chunk(c), t)).sum()
    }
}

fn bit(words: &[u32], i: usize) -> bool {
    words.get(i / 32).is_some_and(|w| (w >> (i % 32)) & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_are_private_and_passes_see_them() {
        let base: Vec<f32> = (0..200).map(|i| i as f32 * 0.25).collect();
        let mut v = View::new(&base);
        v.set_many(&[(5, 99.0), (199, -1.0), (500, 3.0)]);
        assert_eq!(v.get(5), 99.0);
        assert_eq!(v.get(199), -1.0);
        assert_eq!(base[5], 1.25);
        let mut m = Vec::new();
        v.maxima(&mut m);
        assert_eq!(m, vec![99.0, 31.75, 47.75, 49.5]);
        let mut allowed = vec![0u32; 7];
        allowed[0] = 1 << 3;
        v.apply_allowed(&allowed);
        assert_eq!(v.get(3), 0.75);
        assert_eq!(v.get(5), f32::NEG_INFINITY);
        assert_eq!(v.get(150), f32::NEG_INFINITY);
    }
}
