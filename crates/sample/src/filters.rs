//! The filters of mlx-lm's `make_sampler`, in its order: top_p, min_p, XTC, top_k. Each works on
//! the output of the one before (mlx passes the -inf-masked logprobs along the chain).
//!
//! Exact definitions (mlx-lm 0.32 `sample_utils.py`), with x the processed logits:
//! - top_p (applied when 0 < p < 1): sort descending, keep the shortest prefix whose mass reaches
//!   p * total, then every token tied with its last member.
//! - min_p (when min_p != 0): keep x >= max + ln(min_p); also keep the top `min_tokens_to_keep`
//!   of what is left (ties: highest ids, see `select`).
//! - XTC (when probability > 0, with probability `xtc_probability` per step): with p the
//!   renormalized probabilities of what is left, let m be the smallest p above the threshold;
//!   remove every token with p > m except the special ids (EOS, newline). Nothing happens when
//!   fewer than two tokens exceed the threshold.
//! - top_k (when k > 0): keep exactly k tokens, ties at the boundary going to the lowest ids.
//!
//! Comparisons are made on the processed logits in f32; mlx compares logprobs (x - lse in f32 or
//! the model's dtype), which can only differ where two logits are within an ulp of a boundary.

use crate::dist::Dist;
use crate::fastmath::{self, Bins};
use crate::rng::StepRng;
use crate::select::{self, Cand, Ties};

/// Kept sets larger than this stay implicit (a floor over the view) instead of a list.
const LIST_MAX: usize = 16_384;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filters {
    pub top_p: Option<f32>,
    pub min_p: Option<(f32, usize)>,
    pub xtc: Option<Xtc>,
    pub top_k: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Xtc {
    pub probability: f32,
    pub threshold: f32,
    /// Never removed; sorted.
    pub special: Vec<u32>,
}

/// What survives the filters so far.
#[derive(Clone, Debug, PartialEq)]
pub enum Kept {
    /// Every token of the distribution's view with logit >= the floor (-inf: every token);
    /// tokens XTC removed are -inf in the view.
    Floor(f32),
    /// Exactly these tokens (any order).
    List(Vec<Cand>),
}

impl Filters {
    pub fn is_empty(&self) -> bool {
        self.top_p.is_none() && self.min_p.is_none() && self.xtc.is_none() && self.top_k.is_none()
    }

    /// Runs the chain. Draws the XTC coin from `rng` when XTC is on (one draw per step).
    pub fn apply(&self, d: &mut Dist, rng: &mut StepRng) -> Kept {
        // mlx: `mx.where(uniform(0, 1) > xtc_probability, logits, filtered)`; one draw per step.
        let xtc_now = self.xtc.as_ref().filter(|x| rng.uniform() as f32 <= x.probability);
        let mut kept = Kept::Floor(f32::NEG_INFINITY);
        match (self.top_p, self.top_k) {
            // top_k keeps at most the k best tokens, so top_p's cut only matters among them
            // (unless XTC, which renormalizes over the whole nucleus, runs this step).
            (Some(p), Some(k)) if xtc_now.is_none() => kept = Kept::List(top_p_within_top_k(d, p, k)),
            (Some(p), _) => kept = top_p(d, p),
            _ => {}
        }
        if let Some((p, m)) = self.min_p {
            kept = min_p(d, kept, p, m);
        }
        if let Some(x) = xtc_now {
            kept = xtc(d, kept, x);
        }
        if let Some(k) = self.top_k {
            kept = Kept::List(top_k(d, kept, k));
        }
        kept
    }
}

/// The tokens >= t as a list when small, else as a floor.
fn at_least(d: &Dist, t: f32) -> Kept {
    if d.view.count_at_least(&d.cmax, t) > LIST_MAX {
        return Kept::Floor(t);
    }
    let mut l = Vec::new();
    select::collect_at_least(&d.view, &d.cmax, t, &mut l);
    Kept::List(l)
}

pub fn top_p(d: &mut Dist, p: f32) -> Kept {
    let target = p as f64 * d.sums().1;
    let max = d.max;
    // Usually the nucleus lies in the few best chunks: probe them first.
    for n in [8, 64] {
        let t = select::nth_chunk_max(&d.cmax, n);
        let mut cands = Vec::new();
        select::collect_at_least(&d.view, &d.cmax, t, &mut cands);
        let mass: f64 = cands.iter().map(|c| fastmath::weight(c.x, max, 1.0) as f64).sum();
        if mass >= target {
            let v = select::mass_threshold(&cands, max, target);
            return Kept::List(cands.into_iter().filter(|c| c.x >= v).collect());
        }
    }
    let v = nucleus_floor(d, target);
    at_least(d, v)
}

/// top_p followed (later in the chain) by top_k: the k best tokens (top_k's tie rule), cut by
/// top_p where its cut falls among them. When their mass stays below the target the nucleus
/// holds all of them (and more, which top_k would drop): they are kept whole. Costs one pass for
/// the normalizer instead of a histogram of the whole vocabulary.
fn top_p_within_top_k(d: &mut Dist, p: f32, k: usize) -> Vec<Cand> {
    let target = p as f64 * d.sums().1;
    let max = d.max;
    let best = select::top_n(&d.view, &d.cmax, k, Ties::LowIds);
    let mass: f64 = best.iter().map(|c| fastmath::weight(c.x, max, 1.0) as f64).sum();
    if mass < target {
        return best;
    }
    let v = select::mass_threshold(&best, max, target);
    best.into_iter().filter(|c| c.x >= v).collect()
}

/// The top-p threshold for a wide nucleus: a histogram of the mass by distance below the max
/// finds the bin where the cumulative mass reaches the target; only that bin is selected exactly.
fn nucleus_floor(d: &mut Dist, target: f64) -> f32 {
    let bins = Bins { max: d.max, per_nat: 64.0, count: 64 * 40 + 1 };
    let tail = d.sums().0.to_vec();
    let view = &d.view;
    let hist = fastmath::histogram(d.cmax.len(), &|c| view.chunk(c), &d.cmax, &tail, &bins);
    let mut before = 0.0;
    let b = hist
        .iter()
        .position(|&m| {
            before += m;
            before >= target
        })
        .unwrap_or(bins.count - 1);
    before -= hist.get(b).copied().unwrap_or(0.0);
    let mut cands = Vec::new();
    // Bin b holds (top_of(b + 1), top_of(b)]; a loose value test first, the exact bin second.
    let (lo, hi) = (bins.top_of(b + 1) - 1e-3, bins.top_of(b) + 1e-3);
    for (c, &m) in d.cmax.iter().enumerate() {
        if bins.of(m) > b {
            continue;
        }
        let chunk = view.chunk(c);
        let mut hits = fastmath::mask_between(chunk, lo, hi);
        while hits != 0 {
            let k = hits.trailing_zeros() as usize;
            hits &= hits - 1;
            if bins.of(chunk[k]) == b {
                cands.push(Cand::new(chunk[k], (c * fastmath::CHUNK + k) as u32));
            }
        }
    }
    select::mass_threshold(&cands, d.max, target - before)
}

pub fn min_p(d: &Dist, kept: Kept, p: f32, min_keep: usize) -> Kept {
    let t = min_p_floor(d.max, p);
    match kept {
        Kept::Floor(f) => {
            let t = t.max(f);
            if d.view.count_at_least(&d.cmax, t) >= min_keep {
                return at_least(d, t);
            }
            // The kept set is a top set smaller than min_keep: the top min_keep contain it.
            let mut l = select::top_n(&d.view, &d.cmax, min_keep, Ties::HighIds);
            l.retain(|c| c.x >= f);
            Kept::List(l)
        }
        Kept::List(l) => Kept::List(min_p_list(l, t, min_keep)),
    }
}

/// min_p's cut: `max + ln(min_p)` (the max is unchanged by top_p, which keeps the best token).
pub fn min_p_floor(max: f32, p: f32) -> f32 {
    max + (p as f64).ln() as f32
}

pub fn min_p_list(mut l: Vec<Cand>, t: f32, min_keep: usize) -> Vec<Cand> {
    if l.iter().filter(|c| c.x >= t).count() < min_keep {
        select::keep_best(&mut l, min_keep, Ties::HighIds);
    } else {
        l.retain(|c| c.x >= t);
    }
    l
}

pub fn xtc(d: &mut Dist, kept: Kept, x: &Xtc) -> Kept {
    let max = d.max;
    match kept {
        Kept::List(l) => Kept::List(xtc_list(l, max, x)),
        Kept::Floor(f) => {
            let limit = x.threshold as f64 * d.mass_from(f);
            let w = |c: &Cand| fastmath::weight(c.x, max, 1.0) as f64;
            // Candidates for p > threshold: a little below the exact bound, then tested exactly.
            let t = if limit > 0.0 { max + (limit.ln() as f32) - 1e-3 } else { f32::NEG_INFINITY };
            let mut cands = Vec::new();
            select::collect_at_least(&d.view, &d.cmax, t.max(f), &mut cands);
            let Some(m) = min_above(&cands, limit, w) else {
                return Kept::Floor(f);
            };
            let mut above = Vec::new();
            select::collect_above(&d.view, &d.cmax, m, &mut above);
            let ban: Vec<u32> = above.iter().map(|c| c.id).filter(|&id| !is_special(x, id)).collect();
            d.ban(&ban);
            Kept::Floor(f)
        }
    }
}

/// XTC on an explicit list (probabilities renormalized over it).
pub fn xtc_list(mut l: Vec<Cand>, max: f32, x: &Xtc) -> Vec<Cand> {
    let w = |c: &Cand| fastmath::weight(c.x, max, 1.0) as f64;
    let total: f64 = l.iter().map(w).sum();
    if let Some(m) = min_above(&l, x.threshold as f64 * total, w) {
        l.retain(|c| c.x <= m || is_special(x, c.id));
    }
    l
}

/// The smallest logit among tokens whose weight exceeds `limit`, if at least one does.
pub fn min_above(cands: &[Cand], limit: f64, w: impl Fn(&Cand) -> f64) -> Option<f32> {
    cands.iter().filter(|c| w(c) > limit).map(|c| c.x).min_by(|a, b| a.total_cmp(b))
}

/// Whether XTC must never remove `id`.
pub fn is_special(x: &Xtc, id: u32) -> bool {
    x.special.binary_search(&id).is_ok()
}

pub fn top_k(d: &Dist, kept: Kept, k: usize) -> Vec<Cand> {
    match kept {
        Kept::Floor(f) => {
            // The top k of the floor set are the top k overall, or the whole set if smaller.
            let mut l = select::top_n(&d.view, &d.cmax, k, Ties::LowIds);
            l.retain(|c| c.x >= f);
            l
        }
        Kept::List(mut l) => {
            select::keep_best(&mut l, k, Ties::LowIds);
            l
        }
    }
}
