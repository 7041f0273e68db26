//! Categorical draw at temperature T from what the filters kept: token i has probability
//! proportional to e^((x_i - max) / T) (mlx: `categorical(logprobs * (1 / T))`, shift-invariant).
//!
//! Inverse-CDF with one uniform in [0, 1) and f64 running sums. Over the whole vocabulary it is two
//! levels: chunk sums locate the chunk, then the chunk's weights locate the token, so only one
//! vectorized pass touches every logit.

use crate::dist::Dist;
use crate::fastmath::{self, CHUNK};
use crate::select::Cand;

/// mlx multiplies by the reciprocal computed in Python (f64) and rounded to f32.
pub fn inv_temperature(t: f32) -> f32 {
    (1.0 / t as f64) as f32
}

/// Draws from an explicit list; `u` in [0, 1). Returns the chosen candidate.
pub fn from_list(list: &[Cand], inv_t: f32, u: f64) -> Option<Cand> {
    let shift = list.iter().map(|c| c.x).fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = list.iter().map(|c| fastmath::weight(c.x, shift, inv_t) as f64).collect();
    let total: f64 = weights.iter().sum();
    let i = pick(&weights, u * total)?;
    Some(list[i])
}

/// Draws from every token of the distribution's view with logit >= floor (-inf: all).
/// Returns (token, its logit).
pub fn from_floor(d: &mut Dist, floor: f32, inv_t: f32, u: f64) -> Option<Cand> {
    let shift = d.max;
    let own;
    let sums: &[f32] = if inv_t == 1.0 && floor == f32::NEG_INFINITY {
        d.sums().0
    } else {
        let mut s = Vec::new();
        d.view.sums(&d.cmax, shift, inv_t, floor, &mut s);
        own = s;
        &own
    };
    let sums64: Vec<f64> = sums.iter().map(|&s| s as f64).collect();
    let total: f64 = sums64.iter().sum();
    let r = u * total;
    let c = pick(&sums64, r)?;
    let before: f64 = sums64[..c].iter().sum();
    let chunk = d.view.chunk(c);
    let weights: Vec<f64> = chunk.iter().map(|&x| fastmath::weight_from(x, shift, inv_t, floor) as f64).collect();
    // The chunk's lane-order sum and this sequential walk can differ in the last bits; `pick`
    // falls back to the last positive weight.
    let k = pick(&weights, r - before)?;
    Some(Cand::new(chunk[k], (c * CHUNK + k) as u32))
}

/// The first index whose running sum exceeds r; the last positive weight if rounding leaves r
/// beyond the total; None when every weight is zero.
pub(crate) fn pick(weights: &[f64], r: f64) -> Option<usize> {
    let mut cum = 0.0;
    let mut last = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last = Some(i);
            if cum > r {
                return Some(i);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_walks_the_cdf_and_skips_zero_weights() {
        let w = [0.0, 1.0, 0.0, 3.0];
        assert_eq!(pick(&w, 0.0), Some(1));
        assert_eq!(pick(&w, 0.999), Some(1));
        assert_eq!(pick(&w, 1.0), Some(3));
        assert_eq!(pick(&w, 10.0), Some(3));
        assert_eq!(pick(&[0.0, 0.0], 0.5), None);
    }
}
