//! Logits processors with mlx-lm's semantics (`make_logits_processors`), applied in its order:
//! logit_bias, repetition, presence, frequency. Each touches a handful of token ids, so they are
//! computed as sparse updates `(id, new logit)` that the host view or the device tensor applies.
//!
//! - logit_bias: `logits[id] += bias` (`.at[].add`, so a repeated id adds twice).
//! - repetition: for each distinct id in the window, `x < 0 ? x * p : x / p` (set once per id).
//! - presence: `x -= p` once per distinct id in the window (`logits[:, tokens] -= p`).
//! - frequency: `x -= p` once per occurrence (`.at[].subtract`), subtracted one at a time as
//!   mlx's scatter does, so the rounding matches.
//!
//! The window is the last `context_size` ids of the history (prompt + generated); 0 means the whole
//! history (Python's `tokens[-0:]`). A penalty of 0 (or None) disables its processor, as in mlx-lm.
//! History ids outside the vocabulary are ignored.

use ferrolm_core::SamplingParams;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Penalty {
    value: f32,
    context: usize,
}

impl Penalty {
    fn new(value: Option<f32>, context: usize) -> Option<Self> {
        value.filter(|&v| v != 0.0).map(|value| Penalty { value, context })
    }

    fn window<'h>(&self, history: &'h [u32]) -> &'h [u32] {
        if self.context == 0 || self.context >= history.len() {
            history
        } else {
            &history[history.len() - self.context..]
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Processors {
    bias: Vec<(u32, f32)>,
    repetition: Option<Penalty>,
    presence: Option<Penalty>,
    frequency: Option<Penalty>,
}

impl Processors {
    pub fn new(p: &SamplingParams) -> Self {
        Processors {
            bias: p.logit_bias.clone(),
            repetition: Penalty::new(p.repetition_penalty, p.repetition_context_size),
            presence: Penalty::new(p.presence_penalty, p.presence_context_size),
            frequency: Penalty::new(p.frequency_penalty, p.frequency_context_size),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.bias.is_empty() && !self.needs_history()
    }

    /// Whether any processor reads the token history.
    pub fn needs_history(&self) -> bool {
        self.repetition.is_some() || self.presence.is_some() || self.frequency.is_some()
    }

    /// The ids these processors may touch for this history (sorted, distinct, < vocab).
    pub fn touched_ids(&self, history: &[u32], vocab: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = self.bias.iter().map(|b| b.0).collect();
        for p in [self.repetition, self.presence, self.frequency].iter().flatten() {
            ids.extend_from_slice(p.window(history));
        }
        ids.retain(|&id| (id as usize) < vocab);
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// New values `(id, logit)` of the touched tokens, sorted by id; `read` gives current logits.
    pub fn updates(&self, history: &[u32], vocab: usize, read: &dyn Fn(u32) -> f32) -> Vec<(u32, f32)> {
        let ids = self.touched_ids(history, vocab);
        let mut out: Vec<(u32, f32)> = ids.iter().map(|&id| (id, read(id))).collect();
        // Every in-vocabulary id looked up below is in `ids` by construction.
        let at = |id: u32| ids.binary_search(&id).ok();
        for &(id, b) in &self.bias {
            if let Some(i) = at(id) {
                out[i].1 += b;
            }
        }
        if let Some(p) = self.repetition {
            for (id, _) in counts(p.window(history)) {
                if let Some(i) = at(id) {
                    let x = out[i].1;
                    out[i].1 = if x < 0.0 { x * p.value } else { x / p.value };
                }
            }
        }
        if let Some(p) = self.presence {
            for (id, _) in counts(p.window(history)) {
                if let Some(i) = at(id) {
                    out[i].1 -= p.value;
                }
            }
        }
        if let Some(p) = self.frequency {
            for (id, n) in counts(p.window(history)) {
                if let Some(i) = at(id) {
                    for _ in 0..n {
                        out[i].1 -= p.value;
                    }
                }
            }
        }
        out
    }
}

/// Distinct ids of a window with their number of occurrences.
fn counts(window: &[u32]) -> Vec<(u32, usize)> {
    let mut ids = window.to_vec();
    ids.sort_unstable();
    let mut out: Vec<(u32, usize)> = Vec::new();
    for id in ids {
        match out.last_mut() {
            Some((last, n)) if *last == id => *n += 1,
            _ => out.push((id, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(p: &SamplingParams, logits: &[f32], history: &[u32]) -> Vec<f32> {
        let read = |id: u32| logits[id as usize];
        let mut out = logits.to_vec();
        for (id, v) in Processors::new(p).updates(history, logits.len(), &read) {
            out[id as usize] = v;
        }
        out
    }

    #[test]
    fn matches_mlx_hand_cases() {
        // Values printed by mlx-lm 0.32.2 for these exact inputs.
        let lg = [1.0, 2.0, -3.0, 4.0];
        let h = [1, 1, 1, 2];
        let freq = SamplingParams { frequency_penalty: Some(0.5), ..Default::default() };
        assert_eq!(run(&freq, &lg, &h), vec![1.0, 0.5, -3.5, 4.0]);
        let pres = SamplingParams { presence_penalty: Some(0.5), ..Default::default() };
        assert_eq!(run(&pres, &lg, &h), vec![1.0, 1.5, -3.5, 4.0]);
        let rep = SamplingParams { repetition_penalty: Some(1.5), ..Default::default() };
        assert_eq!(run(&rep, &lg, &h), vec![1.0, 2.0 / 1.5, -4.5, 4.0]);
        let whole = SamplingParams { repetition_penalty: Some(1.5), repetition_context_size: 0, ..Default::default() };
        assert_eq!(run(&whole, &lg, &[0, 1, 1, 2]), vec![1.0 / 1.5, 2.0 / 1.5, -4.5, 4.0]);
        let short = SamplingParams { presence_penalty: Some(1.0), presence_context_size: 1, ..Default::default() };
        assert_eq!(run(&short, &lg, &[0, 3]), vec![1.0, 2.0, -3.0, 3.0]);
    }

    #[test]
    fn zero_penalty_is_off_and_bad_ids_are_ignored() {
        let p = SamplingParams { repetition_penalty: Some(0.0), presence_penalty: None, ..Default::default() };
        assert!(Processors::new(&p).is_empty());
        let b =
            SamplingParams { logit_bias: vec![(9, 5.0), (0, 1.0)], presence_penalty: Some(1.0), ..Default::default() };
        assert_eq!(run(&b, &[0.0, 0.0], &[7, 1]), vec![1.0, -1.0]);
    }
}
