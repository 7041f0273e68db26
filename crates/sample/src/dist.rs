//! One step's distribution on the host: the processed logits (a view), chunk maxima, and, when
//! something needs it, the chunk sums of e^(x - max) that give the log-softmax normalizer.

use crate::fastmath;
use crate::view::View;

pub struct Dist<'a> {
    pub view: View<'a>,
    /// Chunk maxima of `view`.
    pub cmax: Vec<f32>,
    /// Largest processed logit.
    pub max: f32,
    /// Chunk sums of weight(x, max, 1) and their total, once computed; dropped when the view
    /// changes.
    sums: Option<(Vec<f32>, f64)>,
}

impl<'a> Dist<'a> {
    pub fn new(view: View<'a>) -> Self {
        let mut cmax = Vec::new();
        view.maxima(&mut cmax);
        let max = max_of(&cmax);
        Dist { view, cmax, max, sums: None }
    }

    /// Σ e^(x - max) over the vocabulary (f64) with its chunk sums.
    pub fn sums(&mut self) -> (&[f32], f64) {
        if self.sums.is_none() {
            let mut s = Vec::new();
            self.view.sums(&self.cmax, self.max, 1.0, f32::NEG_INFINITY, &mut s);
            let total = s.iter().map(|&v| v as f64).sum();
            self.sums = Some((s, total));
        }
        let (s, t) = self.sums.as_ref().map(|(s, t)| (s.as_slice(), *t)).unwrap_or((&[], 0.0));
        (s, t)
    }

    /// Σ e^(x - max) over the logits >= floor.
    pub fn mass_from(&mut self, floor: f32) -> f64 {
        if floor == f32::NEG_INFINITY {
            return self.sums().1;
        }
        let mut s = Vec::new();
        self.view.sums(&self.cmax, self.max, 1.0, floor, &mut s);
        s.iter().map(|&v| v as f64).sum()
    }

    /// log Σ e^x: what mlx subtracts to get logprobs.
    pub fn log_normalizer(&mut self) -> f32 {
        let (_, total) = self.sums();
        (self.max as f64 + total.ln()) as f32
    }

    /// Bans tokens (sets them to -inf) and refreshes the maxima.
    pub fn ban(&mut self, ids: &[u32]) {
        let updates: Vec<(u32, f32)> = ids.iter().map(|&id| (id, f32::NEG_INFINITY)).collect();
        self.view.set_many(&updates);
        self.view.refresh_maxima(&mut self.cmax);
        self.max = max_of(&self.cmax);
        self.sums = None;
    }

    /// The first token holding the maximum (mlx's argmax), or 0 when every logit is NaN.
    pub fn argmax(&self) -> u32 {
        let Some(c) = self.cmax.iter().position(|&m| m == self.max) else {
            return 0;
        };
        let k = self.view.chunk(c).iter().position(|&x| x == self.max).unwrap_or(0);
        (c * fastmath::CHUNK + k) as u32
    }
}

fn max_of(cmax: &[f32]) -> f32 {
    cmax.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
}
