//! Speculative decoding: a proposer guesses the next tokens of a sequence; the step forwards
//! `[pending, drafts…]` as decode rows in one forward and the sequence's own sampler samples
//! each row in turn, keeping drafts while they equal what it sampled (token-match acceptance:
//! every emitted token is the sampler's own draw given the tokens before it, so the output is
//! exactly what decoding one token at a time gives — the same tokens, logprobs and seeded
//! draws — and only the number of forwards changes).

mod draft_model;
mod gate;

pub use draft_model::{draft_together, DraftCache, DraftJob, DraftModelProposer};
use gate::{DraftGate, DraftMode, StepNote};
use ferrolm_core::TokenId;

/// Guesses continuations of a token history.
pub trait Proposer {
    /// Up to `max` tokens that may follow `history` (prompt ++ generated).
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId>;

    /// The engine step's call: this step's drafts, or a request that the step's batched draft
    /// forward guess them (a draft model: every speculating sequence's guesses in one forward
    /// per draft token, `draft_together`).
    fn plan(&mut self, history: &[TokenId], max: usize) -> Proposal {
        Proposal::Drafts(self.propose(history, max))
    }

    /// The draft model's cache of this sequence (for the batched draft step), if it has one.
    fn draft_cache(&mut self) -> Option<&mut DraftCache> {
        None
    }
}

/// What a proposer answers for a step.
#[derive(Clone, Debug, PartialEq)]
pub enum Proposal {
    /// The drafts (none: a plain step).
    Drafts(Vec<TokenId>),
    /// Guesses of the draft model, up to `max`, ending before the first it gives less than
    /// `min_p` probability.
    Model { max: usize, min_p: Option<f32> },
}

/// How speculation runs (server settings, read once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    /// Drafts per step at most (γ).
    pub max_drafts: usize,
    /// n-gram lengths tried, longest first.
    pub ngram_min: usize,
    pub ngram_max: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self { max_drafts: 8, ngram_min: 2, ngram_max: 4 }
    }
}

/// Prompt lookup (model-free): finds the most recent earlier occurrence of the history's last
/// n tokens (n from `max_n` down to `min_n`) and proposes the tokens that followed it. Code
/// edits and quoting repeat long stretches of the prompt, where this guesses well. A gate rests
/// it on a sequence where its verified rows cost more than they save (`gate`).
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
    gate: Option<DraftGate>,
    /// The drafts of the previous step (what the gate is told about it).
    last_drafts: usize,
}

impl NgramProposer {
    /// Lookup with the gate (what `--draft-kind ngram` runs).
    pub fn new(cfg: &SpecConfig) -> Self {
        Self { gate: Some(DraftGate::drafting_first()), ..Self::ungated(cfg) }
    }

    /// Lookup on every step.
    pub fn ungated(cfg: &SpecConfig) -> Self {
        Self { min_n: cfg.ngram_min.max(1), max_n: cfg.ngram_max.max(cfg.ngram_min.max(1)), gate: None, last_drafts: 0 }
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        // Lookup's drafts are what the gate weighs (their cost is the verified rows).
        let note = StepNote { tested: self.last_drafts > 0, drafts: self.last_drafts, ..Default::default() };
        self.propose_noted(history, max, note)
    }
}

impl NgramProposer {
    /// Drafts under the gate, told what the previous step drafted by the caller (a draft model
    /// beside lookup: its steps are not lookup's, nor plain ones).
    pub(crate) fn propose_noted(&mut self, history: &[TokenId], max: usize, previous: StepNote) -> Vec<TokenId> {
        let lean = self.gate.as_mut().is_some_and(|g| g.next(history.len(), previous) == DraftMode::Lean);
        let drafts = if lean { Vec::new() } else { self.lookup(history, max) };
        self.last_drafts = drafts.len();
        drafts
    }

    /// What followed the latest best earlier occurrence of the longest matching n-gram.
    fn lookup(&self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        if max == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n).rev() {
            if let Some(start) = last_earlier_match(history, n) {
                let end = (start + max).min(history.len());
                return history[start..end].to_vec();
            }
        }
        Vec::new()
    }
}

/// The index right after the earlier occurrence of `history`'s last `n` tokens whose preceding
/// tokens agree longest with those before the tail (up to `AGREE` more), the latest of those:
/// text that repeats with variations (a file of similar functions, a list) has many copies of
/// a short n-gram, and the copy with the longest shared context is the one being repeated.
fn last_earlier_match(history: &[TokenId], n: usize) -> Option<usize> {
    if history.len() <= n {
        return None;
    }
    let start = history.len() - n;
    let tail = &history[start..];
    // How many tokens before occurrence `i` equal those before the tail.
    let agree = |i: usize| (1..=AGREE.min(i)).take_while(|&k| history[i - k] == history[start - k]).count();
    let mut best: Option<(usize, usize)> = None;
    // Occurrences ending before the tail itself; the latest first, so that it wins ties.
    for i in (0..start).rev().filter(|&i| &history[i..i + n] == tail) {
        let a = agree(i);
        if best.is_none_or(|(b, _)| a > b) {
            best = Some((a, i + n));
        }
        if a == AGREE {
            break;
        }
    }
    best.map(|(_, end)| end)
}

/// Tokens of context beyond the n-gram compared when choosing among its earlier occurrences.
const AGREE: usize = 32;

/// Counters of one sequence's speculation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    pub drafted: usize,
    pub accepted: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_earlier_occurrence() {
        let mut p = NgramProposer::new(&SpecConfig { max_drafts: 8, ngram_min: 1, ngram_max: 3 });
        // "a b c d a b c" -> after "a b c" came "d a b c".
        let h = [1, 2, 3, 4, 1, 2, 3];
        assert_eq!(p.propose(&h, 3), vec![4, 1, 2]);
        assert_eq!(p.propose(&h, 10), vec![4, 1, 2, 3]);
        assert_eq!(p.propose(&[5, 6, 7], 4), Vec::<u32>::new());
        // The longest n that matches wins; the latest occurrence of it.
        let h = [9, 1, 2, 7, 8, 1, 2, 5, 1, 2];
        assert_eq!(p.propose(&h, 2), vec![5, 1]);
        assert_eq!(p.propose(&h, 0), Vec::<u32>::new());
    }

    #[test]
    fn among_copies_of_the_n_gram_the_one_in_the_longest_shared_context_wins() {
        let mut p = NgramProposer::ungated(&SpecConfig { max_drafts: 8, ngram_min: 1, ngram_max: 2 });
        // "f3 ( a b ) 30" … "f2 ( a b ) 20" … "f3 ( a b": the later copy of "a b" follows f2, the
        // earlier one f3 — as the tail does — so what followed the earlier one is proposed.
        let h = [103, 40, 1, 2, 41, 30, 102, 40, 1, 2, 41, 20, 103, 40, 1, 2];
        assert_eq!(p.propose(&h, 2), vec![41, 30]);
    }
}
