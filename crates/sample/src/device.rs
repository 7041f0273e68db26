//! The chain on a non-CPU device. Only small things cross to the host: the current logits of the
//! few tokens the processors touch, the top candidates (64, then 512 if needed) with the softmax
//! normalizer, and for a draw over the whole vocabulary two vectors of block sums. No
//! full-vocabulary copy happens unless logprobs are requested (then the processed logits are
//! copied and the host path runs) or the candidates cannot decide the filters (rare: e.g. top_p
//! needing more than 512 tokens); the latter is counted in `Sampler::host_fallbacks`.
//!
//! Top candidates without a full sort: candle's CUDA sort works on rows of at most 1024, so the
//! vocabulary is cut into rows of 1024, each row sorted on the device and its best m kept, and
//! the survivors cut again until one row remains.
//!
//! A draw over the whole vocabulary (no filter, or only XTC bans / a min_p floor) is an
//! inverse-CDF in two levels: the weights e^((x - max) / T) are summed per row of 1024 on the
//! device; the host picks the row from those sums with the request's uniform, then the token from
//! that row's weights.

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
        let token = x.argmax(0).and_then(|t| t.to_scalar::<u32>()).ie()?;
        return Ok(Sampled {
            token,
            logprobs: None,
        });
    }
    let inv_t = inv_temperature(s.temperature);
    if s.filters.is_empty() {
        let u = StepRng::for_step(s.seed(), step).uniform();
        return Ok(Sampled {
            token: draw_all(&x, None, &[], inv_t, u)?,
            logprobs: None,
        });
    }
    let want_total = s.filters.top_p.is_some() || s.filters.xtc.is_some();
    for m in [64, 512] {
        let top = Top::fetch(&x, m, want_total)?;
        // Each attempt replays the step's stream, so draws do not depend on the attempt.
        let mut rng = StepRng::for_step(s.seed(), step);
        let Some(kept) = resolve(&s.filters, &top, &mut rng) else {
            continue;
        };
        let u = rng.uniform();
        let token = match kept {
            PKept::List(mut l) => {
                l.sort_unstable_by_key(|c| c.id);
                match categorical::from_list(&l, inv_t, u) {
                    Some(c) => c.id,
                    None => x.argmax(0).and_then(|t| t.to_scalar::<u32>()).ie()?,
                }
            }
            PKept::All { floor, banned } => draw_all(&x, floor, &banned, inv_t, u)?,
        };
        return Ok(Sampled {
            token,
            logprobs: None,
        });
    }
    s.host_fallbacks += 1;
    s.run_host(&to_host_vec(&x)?, history, HostMask::None, false, step)
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
        Some(Mask::Additive(m)) => m
            .flatten_all()
            .and_then(|m| m.to_dtype(DType::F32))
            .and_then(|m| x.add(&m))
            .ie(),
        Some(Mask::Allowed(bits)) => {
            let allowed: Vec<u8> = (0..vocab)
                .map(|i| bits.get(i / 32).map_or(0, |w| ((w >> (i % 32)) & 1) as u8))
                .collect();
            let keep = Tensor::from_vec(allowed, vocab, x.device()).ie()?;
            let banned = Tensor::full(f32::NEG_INFINITY, vocab, x.device()).ie()?;
            keep.where_cond(x, &banned).ie()
        }
    }
}

/// The best candidates, sorted by descending logit (ties: lowest id first).
struct Top {
    cands: Vec<Cand>,
    /// Σ e^(x - max) over the whole vocabulary (when asked for).
    total: f64,
    /// Every token is a candidate.
    complete: bool,
}

impl Top {
    fn fetch(x: &Tensor, m: usize, want_total: bool) -> Result<Self> {
        let vocab = x.dim(0).ie()?;
        let (vals, ids) = device_top(x, m).ie()?;
        let mut cands: Vec<Cand> = vals
            .iter()
            .zip(&ids)
            .filter(|(_, &id)| (id as usize) < vocab)
            .map(|(&v, &id)| Cand::new(v, id))
            .collect();
        cands.sort_unstable_by(order(Ties::LowIds));
        let total = if want_total {
            let mx = x.max_keepdim(0).ie()?;
            let s = x
                .broadcast_sub(&mx)
                .and_then(|d| d.exp())
                .and_then(|e| e.sum_all())
                .ie()?;
            s.to_scalar::<f32>().ie()? as f64
        } else {
            0.0
        };
        Ok(Top {
            complete: cands.len() >= vocab,
            cands,
            total,
        })
    }

    fn max(&self) -> f32 {
        self.cands.first().map_or(f32::NEG_INFINITY, |c| c.x)
    }

    /// Whether every token with logit >= t is a candidate.
    fn knows_at_least(&self, t: f32) -> bool {
        self.complete || self.cands.last().is_some_and(|c| t > c.x)
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

/// The n largest logits of a 1-D tensor and their ids (device sort on rows of <= 1024).
fn device_top(x: &Tensor, m: usize) -> candle_core::Result<(Vec<f32>, Vec<u32>)> {
    let dev = x.device();
    let n = x.dim(0)?;
    let mut vals = x.clone();
    let mut ids = Tensor::arange(0u32, n as u32, dev)?;
    loop {
        let n = vals.dim(0)?;
        if n <= ROW {
            let (sv, si) = vals.sort_last_dim(false)?;
            let take = m.min(n);
            let gid = ids.gather(&si.narrow(0, 0, take)?.contiguous()?, 0)?;
            return Ok((sv.narrow(0, 0, take)?.to_vec1()?, gid.to_vec1()?));
        }
        let rows = n.div_ceil(ROW);
        let pad = rows * ROW - n;
        if pad > 0 {
            vals = Tensor::cat(&[&vals, &Tensor::full(f32::NEG_INFINITY, pad, dev)?], 0)?;
            ids = Tensor::cat(&[&ids, &Tensor::full(u32::MAX, pad, dev)?], 0)?;
        }
        let (sv, si) = vals.reshape((rows, ROW))?.sort_last_dim(false)?;
        let keep = m.min(ROW);
        let si = si.narrow(1, 0, keep)?.contiguous()?;
        ids = ids.reshape((rows, ROW))?.gather(&si, 1)?.flatten_all()?;
        vals = sv.narrow(1, 0, keep)?.contiguous()?.flatten_all()?;
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
    let max = top.max();
    let w = |c: &Cand| fastmath::weight(c.x, max, 1.0) as f64;
    let mut kept = PKept::All {
        floor: None,
        banned: Vec::new(),
    };
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
        if !top.knows_at_least(v) {
            return None;
        }
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
            PKept::All { .. } if top.cands.len() >= min_keep => PKept::All {
                floor: Some(t),
                banned: Vec::new(),
            },
            PKept::All { .. } => return None,
        };
    }
    if let Some(x) = &f.xtc {
        if rng.uniform() as f32 <= x.probability {
            kept = match kept {
                PKept::List(l) => PKept::List(xtc_list(l, max, x)),
                PKept::All {
                    floor: None,
                    banned,
                } => {
                    let limit = x.threshold as f64 * top.total;
                    if !top.complete && top.cands.last().is_some_and(|c| w(c) > limit) {
                        return None;
                    }
                    let mut banned = banned;
                    if let Some(m) = min_above(&top.cands, limit, w) {
                        let above = top.cands.iter().filter(|c| c.x > m && !is_special(x, c.id));
                        banned.extend(above.map(|c| c.id));
                    }
                    PKept::All {
                        floor: None,
                        banned,
                    }
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
                let pool: Vec<Cand> = top
                    .cands
                    .iter()
                    .copied()
                    .filter(|c| !banned.contains(&c.id))
                    .collect();
                PKept::List(top.best(&pool, k, Ties::LowIds)?)
            }
        };
    }
    Some(kept)
}

/// Inverse-CDF draw over every token with logit >= floor, minus `banned`.
fn draw_all(x: &Tensor, floor: Option<f32>, banned: &[u32], inv_t: f32, u: f64) -> Result<u32> {
    let dev = x.device();
    let vocab = x.dim(0).ie()?;
    let mut x = x.clone();
    if !banned.is_empty() {
        let idx = Tensor::from_slice(banned, banned.len(), dev).ie()?;
        let src = Tensor::full(f32::NEG_INFINITY, banned.len(), dev).ie()?;
        x = x.scatter(&idx, &src, 0).ie()?;
    }
    let mx = x.max_keepdim(0).ie()?;
    let mut w = x
        .broadcast_sub(&mx)
        .and_then(|d| d.affine(inv_t as f64, 0.0))
        .and_then(|d| d.exp())
        .ie()?;
    if let Some(t) = floor {
        w = x
            .ge(t as f64)
            .and_then(|k| k.where_cond(&w, &w.zeros_like()?))
            .ie()?;
    }
    let rows = vocab.div_ceil(ROW);
    if rows * ROW > vocab {
        let pad = Tensor::zeros(rows * ROW - vocab, DType::F32, dev).ie()?;
        w = Tensor::cat(&[&w, &pad], 0).ie()?;
    }
    let w = w.reshape((rows, ROW)).ie()?;
    let sums: Vec<f64> = w
        .sum(1)
        .and_then(|s| s.to_vec1::<f32>())
        .ie()?
        .into_iter()
        .map(f64::from)
        .collect();
    let r = u * sums.iter().sum::<f64>();
    let Some(row) = categorical::pick(&sums, r) else {
        return x.argmax(0).and_then(|t| t.to_scalar::<u32>()).ie();
    };
    let before: f64 = sums[..row].iter().sum();
    let weights: Vec<f64> = w
        .get(row)
        .and_then(|t| t.to_vec1::<f32>())
        .ie()?
        .into_iter()
        .map(f64::from)
        .collect();
    let k = categorical::pick(&weights, r - before).unwrap_or(0);
    Ok((row * ROW + k) as u32)
}
