//! The generations of one response: OpenAI's `n` choices of each prompt (one prompt for chat, a
//! batch of prompts for `/v1/completions`), numbered prompt by prompt as OpenAI numbers them:
//! choice `p * n + j` is the j-th of prompt p. A stream interleaves their pieces as they come;
//! the usage counts each prompt once and the completion tokens of every choice.

use crate::generation::{Generation, Piece};
use crate::protocol::response::Usage;

pub struct Choices {
    gens: Vec<Generation>,
    /// Which choice is polled first next time, so that one busy choice cannot starve the others.
    turn: usize,
}

impl From<Generation> for Choices {
    fn from(gen: Generation) -> Self {
        Choices::new(vec![gen])
    }
}

impl Choices {
    pub fn new(gens: Vec<Generation>) -> Self {
        Choices { gens, turn: 0 }
    }

    pub fn len(&self) -> usize {
        self.gens.len()
    }

    pub fn generations(&mut self) -> &mut [Generation] {
        &mut self.gens
    }

    /// The next piece of any choice, with its index; None once every choice has ended.
    /// Cancel-safe, as `Generation::next` is: a dropped call loses nothing.
    pub async fn next(&mut self) -> Option<(usize, Piece)> {
        if let [one] = self.gens.as_mut_slice() {
            return one.next().await.map(|p| (0, p));
        }
        let mut live: Vec<_> = self
            .gens
            .iter_mut()
            .enumerate()
            .filter(|(_, g)| !g.is_ended())
            .map(|(i, g)| Box::pin(async move { (i, g.next().await) }))
            .collect();
        if live.is_empty() {
            return None;
        }
        // `select_all` polls in order: rotate so that each choice is first in turn.
        let first = self.turn % live.len();
        live.rotate_left(first);
        self.turn = self.turn.wrapping_add(1);
        let ((i, piece), _, _) = futures_util::future::select_all(live).await;
        piece.map(|p| (i, p))
    }
}

/// The usage of a response whose choices come `n` per prompt: the prompt (and its cached
/// tokens) counted once, from its first choice; completion tokens summed over all choices.
#[derive(Clone, Copy, Debug)]
pub struct UsageSum {
    n: usize,
    pub total: Usage,
}

impl UsageSum {
    pub fn new(n: usize) -> Self {
        UsageSum { n: n.max(1), total: Usage::default() }
    }

    pub fn add(&mut self, index: usize, usage: &Usage) {
        if index.is_multiple_of(self.n) {
            self.total.prompt_tokens += usage.prompt_tokens;
            self.total.cached_tokens += usage.cached_tokens;
        }
        self.total.completion_tokens += usage.completion_tokens;
        self.total.drafted += usage.drafted;
        self.total.accepted += usage.accepted;
        self.total.fill.add(&usage.fill);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_count_once_completions_all() {
        let mut sum = UsageSum::new(2);
        let u = |p, c| Usage { prompt_tokens: p, completion_tokens: c, cached_tokens: 0, ..Default::default() };
        // Two prompts of 10 and 7 tokens, two choices each.
        for (i, usage) in [u(10, 3), u(10, 4), u(7, 1), u(7, 2)].iter().enumerate() {
            sum.add(i, usage);
        }
        assert_eq!(sum.total, u(17, 10));
    }
}
