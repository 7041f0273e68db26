//! Logprobs as mlx-lm reports them: from `logprobs = logits - logsumexp(logits)` after the
//! processors (and the grammar mask) and before the filters and the temperature.
//!
//! The top alternatives are the n largest, sorted by descending logprob, ties by lowest id
//! (mlx_lm.server returns `argpartition` order, unsorted; ties also go to the lowest ids).

use crate::dist::Dist;
use crate::select::{self, order, Ties};
use ferrolm_core::TokenLogprobs;

/// What is known before the token is drawn.
pub struct Pending {
    lse: f32,
    top: Vec<(u32, f32)>,
}

/// Captures the normalizer and the top `n` of the unfiltered distribution.
pub fn capture(d: &mut Dist, n: usize) -> Pending {
    let lse = d.log_normalizer();
    let mut top = select::top_n(&d.view, &d.cmax, n.min(d.view.len()), Ties::LowIds);
    top.sort_by(order(Ties::LowIds));
    Pending { lse, top: top.iter().map(|c| (c.id, c.x - lse)).collect() }
}

impl Pending {
    /// Completes the record once the token (and its processed logit) is known.
    pub fn finish(self, token: u32, x: f32) -> TokenLogprobs {
        TokenLogprobs { token, logprob: x - self.lse, top: self.top }
    }
}
