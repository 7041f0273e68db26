//! Partial selection over the chunked view: the n largest logits and the top-p cut, without sorting
//! the vocabulary.
//!
//! Bounding with chunk maxima: if c is the n-th largest chunk maximum, at least n logits are >= c,
//! so every member of the top n is >= c and lives in a chunk whose maximum is >= c. Scanning those
//! chunks for logits >= c gives every candidate, ties included, so tie-breaking stays exact.
//!
//! Ties (equal logits) are broken by token id, reproducing mlx's `argpartition` on CPU, which
//! was measured to partition stably: `top_k` (and `argmax`, and the reported top logprobs) keep
//! the lowest ids of a tie, while `min_p`'s `min_tokens_to_keep` (the last m of an ascending
//! partition) keeps the highest ids.

use crate::fastmath::{self, CHUNK};
use crate::view::View;
use std::cmp::Ordering;

/// A candidate token: its (processed) logit and id.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cand {
    pub x: f32,
    pub id: u32,
}

impl Cand {
    /// NaN counts as -inf and -0 as +0, so `total_cmp` orders like IEEE comparison and sorts
    /// can never see an inconsistent order.
    pub fn new(x: f32, id: u32) -> Self {
        Cand { x: if x.is_nan() { f32::NEG_INFINITY } else { x + 0.0 }, id }
    }
}

/// Which id wins a tie of equal logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ties {
    LowIds,
    HighIds,
}

/// Descending logit, then the tie rule.
pub fn order(ties: Ties) -> impl Fn(&Cand, &Cand) -> Ordering + Copy {
    move |a, b| {
        let by_x = b.x.total_cmp(&a.x);
        match ties {
            Ties::LowIds => by_x.then(a.id.cmp(&b.id)),
            Ties::HighIds => by_x.then(b.id.cmp(&a.id)),
        }
    }
}

/// Appends every token with logit >= t, visiting only chunks whose maximum reaches t.
pub fn collect_at_least(view: &View, cmax: &[f32], t: f32, out: &mut Vec<Cand>) {
    for (c, &m) in cmax.iter().enumerate() {
        if m >= t || (t == f32::NEG_INFINITY) {
            let base = (c * CHUNK) as u32;
            for (k, &x) in view.chunk(c).iter().enumerate() {
                if x >= t || t == f32::NEG_INFINITY {
                    out.push(Cand::new(x, base + k as u32));
                }
            }
        }
    }
}

/// Appends every token with logit > t (strictly).
pub fn collect_above(view: &View, cmax: &[f32], t: f32, out: &mut Vec<Cand>) {
    for (c, &m) in cmax.iter().enumerate() {
        if m > t {
            let base = (c * CHUNK) as u32;
            for (k, &x) in view.chunk(c).iter().enumerate() {
                if x > t {
                    out.push(Cand::new(x, base + k as u32));
                }
            }
        }
    }
}

/// The n-th largest chunk maximum (n >= 1), or -inf when there are fewer than n chunks.
pub fn nth_chunk_max(cmax: &[f32], n: usize) -> f32 {
    if n == 0 || n > cmax.len() {
        return f32::NEG_INFINITY;
    }
    let mut m: Vec<f32> = cmax.iter().map(|&x| Cand::new(x, 0).x).collect();
    let (_, nth, _) = m.select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a));
    *nth
}

/// Keeps the n best of `cands` by the tie rule (unsorted).
pub fn keep_best(cands: &mut Vec<Cand>, n: usize, ties: Ties) {
    if cands.len() > n {
        if n > 0 {
            cands.select_nth_unstable_by(n - 1, order(ties));
        }
        cands.truncate(n);
    }
}

/// The n largest logits of the view by the tie rule, unsorted.
pub fn top_n(view: &View, cmax: &[f32], n: usize, ties: Ties) -> Vec<Cand> {
    let mut cands = Vec::new();
    if n == 0 {
        return cands;
    }
    collect_at_least(view, cmax, nth_chunk_max(cmax, n), &mut cands);
    keep_best(&mut cands, n, ties);
    cands
}

/// The smallest logit v such that the tokens >= v (in descending order) are the shortest prefix
/// whose mass reaches `target`: mlx's top-p threshold. Weights are `weight(x, shift, 1)` summed in
/// f64. Returns the smallest candidate when the mass never reaches the target (keep all).
/// Weighted quickselect: expected O(len), no sort.
pub fn mass_threshold(cands: &[Cand], shift: f32, target: f64) -> f32 {
    let mut items: Vec<(f32, f64)> = cands.iter().map(|c| (c.x, fastmath::weight(c.x, shift, 1.0) as f64)).collect();
    let mut need = target;
    let mut lo = 0;
    let mut hi = items.len();
    while hi - lo > 32 {
        let p = median3(items[lo].0, items[(lo + hi) / 2].0, items[hi - 1].0);
        let (gt, eq) = partition3(&mut items[lo..hi], p);
        let mass_gt: f64 = items[lo..lo + gt].iter().map(|e| e.1).sum();
        let mass_eq: f64 = items[lo + gt..lo + gt + eq].iter().map(|e| e.1).sum();
        if mass_gt >= need {
            hi = lo + gt;
        } else if mass_gt + mass_eq >= need || lo + gt + eq == hi {
            return p;
        } else {
            need -= mass_gt + mass_eq;
            lo += gt + eq;
        }
    }
    let rest = &mut items[lo..hi];
    rest.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
    let mut cum = 0.0;
    for e in rest.iter() {
        cum += e.1;
        if cum >= need {
            return e.0;
        }
    }
    rest.last().map_or(f32::NEG_INFINITY, |e| e.0)
}

fn median3(a: f32, b: f32, c: f32) -> f32 {
    let mut v = [a, b, c];
    v.sort_unstable_by(|x, y| x.total_cmp(y));
    v[1]
}

/// Reorders into [> p][== p][< p]; returns the sizes of the first two groups.
fn partition3(items: &mut [(f32, f64)], p: f32) -> (usize, usize) {
    let mut gt = 0;
    for i in 0..items.len() {
        if items[i].0 > p {
            items.swap(i, gt);
            gt += 1;
        }
    }
    let mut eq = gt;
    for i in gt..items.len() {
        if items[i].0 == p {
            items.swap(i, eq);
            eq += 1;
        }
    }
    (gt, eq - gt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_top(x: &[f32], n: usize, ties: Ties) -> Vec<u32> {
        let mut all: Vec<Cand> = x.iter().enumerate().map(|(i, &v)| Cand::new(v, i as u32)).collect();
        all.sort_by(order(ties));
        let mut ids: Vec<u32> = all[..n].iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn top_n_equals_sorting_with_ties() {
        let x: Vec<f32> = (0..5000).map(|i| ((i * 7919 + 13) % 37) as f32).collect();
        let mut cmax = Vec::new();
        let view = View::new(&x);
        view.maxima(&mut cmax);
        for n in [1, 2, 5, 64, 100, 1000, 4999] {
            for ties in [Ties::LowIds, Ties::HighIds] {
                let mut got: Vec<u32> = top_n(&view, &cmax, n, ties).iter().map(|c| c.id).collect();
                got.sort_unstable();
                assert_eq!(got, reference_top(&x, n, ties), "n {n} {ties:?}");
            }
        }
    }

    #[test]
    fn mass_threshold_equals_sorted_scan() {
        let x: Vec<f32> = (0..3000).map(|i| ((i * 104729) % 1009) as f32 * 0.01).collect();
        let cands: Vec<Cand> = x.iter().enumerate().map(|(i, &v)| Cand::new(v, i as u32)).collect();
        let mut sorted = x.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let total: f64 = x.iter().map(|&v| fastmath::weight(v, 10.0, 1.0) as f64).sum();
        for p in [0.01, 0.3, 0.5, 0.9, 0.999] {
            let target = p * total;
            let mut cum = 0.0;
            let want = *sorted
                .iter()
                .find(|&&v| {
                    cum += fastmath::weight(v, 10.0, 1.0) as f64;
                    cum >= target
                })
                .unwrap();
            assert_eq!(mass_threshold(&cands, 10.0, target), want, "p {p}");
        }
    }
}
