//! The chain on a non-CPU device. Only small things cross to the host: the current logits of the
//! few tokens the processors touch; the best 64 logits of every row of 1024 with the rows'
//! maxima and exp-sums (1/16 of the vocabulary, one read-back); and for a draw over the whole
//! vocabulary the rows' maxima and weight sums, then one row. No full-vocabulary copy happens
//! unless logprobs are requested (then the processed logits are copied and the host path runs)
//! or the candidates cannot decide the filters (e.g. a top-p nucleus wider than the candidates);
//! the latter is counted in `Sampler::host_fallbacks`.
//!
//! Rows of 1024 because candle's CUDA sort sorts rows of at most 1024. Every token that is not a
//! candidate is at most its row's 64th best, so the candidates hold every token above
//! L = the largest of those 64th values: the filters are decided on the host whenever their cuts
//! lie above L. Reductions are two-level (per row on the device, across rows on the host in f64):
//! a single-row reduction over the whole vocabulary would run in one CUDA block.

use crate::categorical::{self, inv_temperature};
use crate::fastmath;
use crate::filters::{is_special, min_above, min_p_floor, min_p_list, xtc_list, Filters};
use crate::rng::StepRng;
use crate::sampler::{to_host_vec, HostMask, Mask, Sampled, Sampler};
use crate::select::{keep_best, order, Cand, Ties};
use candle_core::{DType, Tensor};
use ferrolm_core::{Error, Result};

const ROW: usize = 1024;

trait Ie<T> {
    fn ie(self) -> Result<T>;
}
impl<T> Ie<T> for candle_core::Result<T> {
    fn ie(self) -> Result<T> {
        self.map_err(Error::internal)
    }
}

pub(crate) fn sample(
    s: &mut Sampler,
    logits: &Tensor,
    history: &[u32],
    mask: Option<Mask>,
    step: u64,
) -> Result<Sampled> {
    let x = logits.to_dtype(DType::F32).ie()?;
    s.check_width(x.dim(0).ie()?)?;
    let x = apply_processors(s, &x, history)?;
    let x = apply_mask(&x, mask)?;
    if s.logprobs.is_some() {
        // Logprobs need the whole distribution on the host anyway.
        return s.run_host(&to_host_vec(&x)?, history, HostMask::None, false, step);
    }
    if s.is_greedy() {
        let token = argmax(&x).and_then(|t| t.to_vec1::<u32>()).ie()?;
        return Ok(Sampled { token: token[0], logprobs: None });
    }
    let inv_t = inv_temperature(s.temperature);
    if s.filters.is_empty() {
        let u = StepRng::for_step(s.seed(), step).uniform();
        return Ok(Sampled { token: draw_all(&x, None, &[], inv_t, u)?, logprobs: None });
    }
    let want_total = s.filters.top_p.is_some() || s.filters.xtc.is_some();
    let top = Top::fetch(&x, want_total)?;
    let mut rng = StepRng::for_step(s.seed(), step);
    let Some(kept) = resolve(&s.filters, &top, &mut rng) else {
        s.host_fallbacks += 1;
        return s.run_host(&to_host_vec(&x)?, history, HostMask::None, false, step);
    };
    let u = rng.uniform();
    let token = match kept {
        PKept::List(mut l) => {
            l.sort_unstable_by_key(|c| c.id);
            match categorical::from_list(&l, inv_t, u) {
                Some(c) => c.id,
                None => argmax(&x).and_then(|t| t.to_vec1::<u32>()).ie()?[0],
            }
        }
        PKept::All { floor, banned } => draw_all(&x, floor, &banned, inv_t, u)?,
    };
    Ok(Sampled { token, logprobs: None })
}

/// The logits as rows of [`ROW`], the last padded with -inf.
fn rows(x: &Tensor) -> candle_core::Result<Tensor> {
    let vocab = x.dim(0)?;
    let n = vocab.div_ceil(ROW);
    let x = if n * ROW > vocab {
        Tensor::cat(&[x, &Tensor::full(f32::NEG_INFINITY, n * ROW - vocab, x.device())?], 0)?
    } else {
        x.clone()
    };
    x.reshape((n, ROW))
}

/// First index of the maximum as a `[1]` u32 tensor, on the device (row argmax, then across rows).
pub(crate) fn argmax(x: &Tensor) -> candle_core::Result<Tensor> {
    let r = rows(x)?;
    let row_max = r.max(1)?;
    let row_arg = r.argmax(1)?;
    let best = row_max.argmax_keepdim(0)?;
    let within = row_arg.gather(&best, 0)?;
    let base = Tensor::new(&[ROW as u32], x.device())?;
    best.mul(&base)?.add(&within)
}

/// Sparse processor updates: read the touched logits, compute on the host, scatter back.
fn apply_processors(s: &Sampler, x: &Tensor, history: &[u32]) -> Result<Tensor> {
    if s.processors.is_empty() {
        return Ok(x.clone());
    }
    let vocab = x.dim(0).ie()?;
    let ids = s.processors.touched_ids(history, vocab);
    if ids.is_empty() {
        return Ok(x.clone());
    }
    let dev = x.device();
    let ids_t = Tensor::from_slice(&ids, ids.len(), dev).ie()?;
    let cur: Vec<f32> = x.index_select(&ids_t, 0).and_then(|t| t.to_vec1()).ie()?;
    let read = |id: u32| ids.binary_search(&id).map_or(0.0, |i| cur[i]);
    let ups = s.processors.updates(history, vocab, &read);
    let up_ids: Vec<u32> = ups.iter().map(|u| u.0).collect();
    let up_vals: Vec<f32> = ups.iter().map(|u| u.1).collect();
    let idx = Tensor::from_vec(up_ids, ups.len(), dev).ie()?;
    let src = Tensor::from_vec(up_vals, ups.len(), dev).ie()?;
    x.scatter(&idx, &src, 0).ie()
}

fn apply_mask(x: &Tensor, mask: Option<Mask>) -> Result<Tensor> {
    let vocab = x.dim(0).ie()?;
    match mask {
        None => Ok(x.clone()),
        Some(Mask::Additive(m)) => m.flatten_all().and_then(|m| m.to_dtype(DType::F32)).and_then(|m| x.add(&m)).ie(),
        Some(Mask::Allowed(bits)) => {
            let allowed: Vec<u8> =
                (0..vocab).map(|i| bits.get(i / 32).map_or(0, |w| ((w >> (i % 32)) & 1) as u8)).collect();
            let keep = Tensor::from_vec(allowed, vocab, x.device()).ie()?;
            let banned = Tensor::full(f32::NEG_INFINITY, vocab, x.device()).ie()?;
            keep.where_cond(x, &banned).ie()
        }
    }
}

/// The candidates: every token with logit above `bound`, sorted by descending logit (ties:
/// lowest id first).
struct Top {
    cands: Vec<Cand>,
    /// Every token that is not a candidate has a logit <= bound.
    bound: f32,
    max: f32,
    /// Σ e^(x - max) over the whole vocabulary (when asked for).
    total: f64,
    /// Every token is a candidate.
    complete: bool,
}

/// Per row: the best logits kept as candidates.
const PER_ROW: usize = 64;

impl Top {
    fn fetch(x: &Tensor, want_total: bool) -> Result<Self> {
        let vocab = x.dim(0).ie()?;
        let r = rows(x).ie()?;
        let n = r.dim(0).ie()?;
        let (sv, si) = r.sort_last_dim(false).ie()?;
        let keep = PER_ROW.min(ROW);
        let mut parts = vec![sv.narrow(1, 0, keep).and_then(|t| t.flatten_all()).ie()?];
        if want_total {
            let row_max = sv.narrow(1, 0, 1).ie()?;
            let sums = r.broadcast_sub(&row_max).and_then(|d| d.exp()).and_then(|e| e.sum(1)).ie()?;
            parts.push(row_max.flatten_all().ie()?);
            parts.push(sums);
        }
        // One read-back for the values (and sums), one for the ids.
        let f: Vec<f32> = Tensor::cat(&parts, 0).and_then(|t| t.to_vec1()).ie()?;
        let ids: Vec<u32> = si.narrow(1, 0, keep).and_then(|t| t.flatten_all()).and_then(|t| t.to_vec1()).ie()?;
        let (vals, rest) = f.split_at(n * keep);
        // Each row's last kept value bounds everything the row did not send.
        let bound = if keep >= ROW {
            f32::NEG_INFINITY
        } else {
            vals.chunks(keep).map(|c| c[keep - 1]).fold(f32::NEG_INFINITY, f32::max)
        };
        let mut cands: Vec<Cand> = Vec::new();
        for (k, (&v, &i)) in vals.iter().zip(&ids).enumerate() {
            let id = (k / keep * ROW) as u32 + i;
            if (id as usize) < vocab && v > bound {
                cands.push(Cand::new(v, id));
            }
        }
        cands.sort_unstable_by(order(Ties::LowIds));
        let max = vals.chunks(keep).map(|c| c[0]).fold(f32::NEG_INFINITY, f32::max);
        let total = if want_total {
            let (maxima, sums) = rest.split_at(n);
            let scaled = maxima.iter().zip(sums).filter(|(m, s)| **m > f32::NEG_INFINITY && s.is_finite());
            scaled.map(|(&m, &s)| (m as f64 - max as f64).exp() * s as f64).sum()
        } else {
            0.0
        };
        Ok(Top { complete: bound == f32::NEG_INFINITY, cands, bound, max, total })
    }

    /// Whether every token with logit >= t is a candidate.
    fn knows_at_least(&self, t: f32) -> bool {
        self.complete || t > self.bound
    }

    /// The n best of `pool` (sorted) by the tie rule, if the candidates decide it.
    fn best(&self, pool: &[Cand], n: usize, ties: Ties) -> Option<Vec<Cand>> {
        if n == 0 {
            return Some(Vec::new());
        }
        if n >= pool.len() {
            return self.complete.then(|| pool.to_vec());
        }
        let v = pool[n - 1].x;
        if !self.knows_at_least(v) {
            return None;
        }
        let mut group: Vec<Cand> = pool.iter().copied().filter(|c| c.x >= v).collect();
        keep_best(&mut group, n, ties);
        Some(group)
    }
}

/// What survives, as far as the candidates tell.
enum PKept {
    /// Tokens with logit >= floor (all if None), minus `banned`.
    All {
        floor: Option<f32>,
        banned: Vec<u32>,
    },
    List(Vec<Cand>),
}

/// The filter chain over the candidates; None when they cannot decide it.
fn resolve(f: &Filters, top: &Top, rng: &mut StepRng) -> Option<PKept> {
    let max = top.max;
    let w = |c: &Cand| fastmath::weight(c.x, max, 1.0) as f64;
    let mut kept = PKept::All { floor: None, banned: Vec::new() };
    if let Some(p) = f.top_p {
        let target = p as f64 * top.total;
        let mut cum = 0.0;
        let v = match top.cands.iter().find(|c| {
            cum += w(c);
            cum >= target
        }) {
            Some(c) => c.x,
            None if top.complete => top.cands.last()?.x,
            None => return None,
        };
        kept = PKept::List(top.cands.iter().copied().filter(|c| c.x >= v).collect());
    }
    if let Some((p, min_keep)) = f.min_p {
        let t = min_p_floor(max, p);
        kept = match kept {
            PKept::List(l) => PKept::List(min_p_list(l, t, min_keep)),
            PKept::All { .. } if top.knows_at_least(t) => {
                let l: Vec<Cand> = top.cands.iter().copied().filter(|c| c.x >= t).collect();
                if l.len() >= min_keep {
                    PKept::List(l)
                } else {
                    PKept::List(top.best(&top.cands, min_keep, Ties::HighIds)?)
                }
            }
            // Every candidate is >= t, so at least min_keep tokens pass the floor.
            PKept::All { .. } if top.cands.len() >= min_keep => PKept::All { floor: Some(t), banned: Vec::new() },
            PKept::All { .. } => return None,
        };
    }
    if let Some(x) = &f.xtc {
        if rng.uniform() as f32 <= x.probability {
            kept = match kept {
                PKept::List(l) => PKept::List(xtc_list(l, max, x)),
                PKept::All { floor: None, banned } => {
                    let limit = x.threshold as f64 * top.total;
                    // Tokens below the bound must not reach the threshold.
                    if !top.complete && fastmath::weight(top.bound, max, 1.0) as f64 > limit {
                        return None;
                    }
                    let mut banned = banned;
                    if let Some(m) = min_above(&top.cands, limit, w) {
                        let above = top.cands.iter().filter(|c| c.x > m && !is_special(x, c.id));
                        banned.extend(above.map(|c| c.id));
                    }
                    PKept::All { floor: None, banned }
                }
                // XTC would need the mass of the floor set.
                PKept::All { floor: Some(_), .. } => return None,
            };
        }
    }
    if let Some(k) = f.top_k {
        kept = match kept {
            PKept::List(mut l) => {
                keep_best(&mut l, k, Ties::LowIds);
                PKept::List(l)
            }
            PKept::All { banned, .. } => {
                // k <= candidates, all above any floor: the top k of what is not banned.
                let pool: Vec<Cand> = top.cands.iter().copied().filter(|c| !banned.contains(&c.id)).collect();
                PKept::List(top.best(&pool, k, Ties::LowIds)?)
            }
        };
    }
    Some(kept)
}

/// Inverse-CDF draw over every token with logit >= floor, minus `banned`: per row, weights
/// relative to the row's maximum and their sum on the device; the row picked on the host with
/// those sums rescaled to the global maximum (f64), then the token from that row's weights.
fn draw_all(x: &Tensor, floor: Option<f32>, banned: &[u32], inv_t: f32, u: f64) -> Result<u32> {
    let dev = x.device();
    let mut x = x.clone();
    if !banned.is_empty() {
        let idx = Tensor::from_slice(banned, banned.len(), dev).ie()?;
        let src = Tensor::full(f32::NEG_INFINITY, banned.len(), dev).ie()?;
        x = x.scatter(&idx, &src, 0).ie()?;
    }
    let r = rows(&x).ie()?;
    let n = r.dim(0).ie()?;
    let row_max = r.max_keepdim(1).ie()?;
    let mut w = r.broadcast_sub(&row_max).and_then(|d| d.affine(inv_t as f64, 0.0)).and_then(|d| d.exp()).ie()?;
    if let Some(t) = floor {
        w = r.ge(t as f64).and_then(|k| k.where_cond(&w, &w.zeros_like()?)).ie()?;
    }
    let sums = w.sum(1).ie()?;
    let f: Vec<f32> = Tensor::cat(&[&row_max.flatten_all().ie()?, &sums], 0).and_then(|t| t.to_vec1()).ie()?;
    let (maxima, sums) = f.split_at(n);
    let max = maxima.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let row_w: Vec<f64> = maxima
        .iter()
        .zip(sums)
        .map(|(&m, &s)| {
            if m > f32::NEG_INFINITY && s.is_finite() {
                ((m - max) as f64 * inv_t as f64).exp() * s as f64
            } else {
                0.0
            }
        })
        .collect();
    let r_u = u * row_w.iter().sum::<f64>();
    let Some(row) = categorical::pick(&row_w, r_u) else {
        return argmax(&x).and_then(|t| t.to_vec1::<u32>()).map(|t| t[0]).ie();
    };
    let before: f64 = row_w[..row].iter().sum();
    // Back to the row's own scale, where the device computed its weights.
    let scale = row_w[row] / sums[row] as f64;
    let weights: Vec<f64> =
        w.get(row).and_then(|t| t.to_vec1::<f32>()).ie()?.into_iter().map(|v| v as f64 * scale).collect();
    let k = categorical::pick(&weights, r_u - before).unwrap_or(0);
    Ok((row * ROW + k) as u32)
}
