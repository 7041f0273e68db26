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

    /// Whether it chooses how many drafts to make itself: the step then offers it the full γ
    /// (`--num-draft-tokens`) instead of a length adapted to the last step's acceptance.
    fn sizes_its_drafts(&self) -> bool {
        false
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
///
/// Standalone (`--draft-kind ngram`, [`NgramProposer::sized`]) it also chooses how many tokens
/// to draft from how strong the match is (`draft_len`): a match whose context agrees over many
/// tokens is a copy in progress and drafts as many tokens as agreed, up to γ, so that a long
/// copy is verified in few steps; a weak one drafts no more than it matched, nor more than the
/// last steps' acceptance suggests (two more after a step that kept all its drafts, one more
/// than were kept after one that did not).
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
    gate: Option<DraftGate>,
    /// The drafts of the previous step (what the gate is told about it).
    last_drafts: usize,
    /// Sizing by match strength (None: drafts up to the `max` it is given).
    sizing: Option<Sizing>,
}

/// The state of [`NgramProposer`]'s draft sizing.
#[derive(Clone, Copy, Debug)]
struct Sizing {
    /// Drafts for a weak match, adapted to acceptance.
    gamma: usize,
    /// The history's length when the previous drafts were proposed (what they became is the
    /// growth since: the kept drafts and the step's own token).
    last_len: usize,
}

impl NgramProposer {
    /// Lookup with the gate, up to the `max` drafts it is asked for (beside the draft model,
    /// whose γ adapts to acceptance in the step).
    pub fn new(cfg: &SpecConfig) -> Self {
        Self { gate: Some(DraftGate::drafting_first()), ..Self::ungated(cfg) }
    }

    /// Lookup with the gate that sizes its own drafts (what `--draft-kind ngram` runs).
    pub fn sized(cfg: &SpecConfig) -> Self {
        Self { sizing: Some(Sizing { gamma: usize::MAX, last_len: 0 }), ..Self::new(cfg) }
    }

    /// Lookup on every step.
    pub fn ungated(cfg: &SpecConfig) -> Self {
        let min_n = cfg.ngram_min.max(1);
        Self { min_n, max_n: cfg.ngram_max.max(min_n), gate: None, last_drafts: 0, sizing: None }
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        // Lookup's drafts are what the gate weighs (their cost is the verified rows).
        let note = StepNote { tested: self.last_drafts > 0, drafts: self.last_drafts, ..Default::default() };
        self.propose_noted(history, max, note)
    }

    fn sizes_its_drafts(&self) -> bool {
        self.sizing.is_some()
    }
}

impl NgramProposer {
    /// Drafts under the gate, told what the previous step drafted by the caller (a draft model
    /// beside lookup: its steps are not lookup's, nor plain ones).
    pub(crate) fn propose_noted(&mut self, history: &[TokenId], max: usize, previous: StepNote) -> Vec<TokenId> {
        self.adapt(history.len());
        let lean = self.gate.as_mut().is_some_and(|g| g.next(history.len(), previous) == DraftMode::Lean);
        let drafts = if lean { Vec::new() } else { self.lookup(history, max) };
        self.last_drafts = drafts.len();
        if let Some(s) = self.sizing.as_mut() {
            s.last_len = history.len();
        }
        drafts
    }

    /// Sizing: how many of the previous step's drafts were kept (the history grew by them and
    /// the step's own token) sets the length drafted for a weak match.
    fn adapt(&mut self, history_len: usize) {
        let (Some(s), drafted) = (self.sizing.as_mut(), self.last_drafts) else { return };
        if drafted == 0 {
            return;
        }
        let kept = history_len.saturating_sub(s.last_len + 1);
        // Unbounded here; `draft_len` caps it at the γ it is given.
        s.gamma = match kept >= drafted {
            true => s.gamma.saturating_add(2),
            false => kept + 1,
        };
    }

    /// What followed the latest best earlier occurrence of the longest matching n-gram.
    fn lookup(&self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        if max == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n).rev() {
            if let Some((start, agreed)) = last_earlier_match(history, n) {
                let len = self.draft_len(n + agreed, max);
                let end = (start + len).min(history.len());
                return history[start..end].to_vec();
            }
        }
        Vec::new()
    }

    /// Drafts for a match of `strength` tokens (the n-gram and the context before it that
    /// agrees), at most `max`: unsized, `max`; a copy in progress (`COPYING` tokens or more),
    /// the strength or the adapted length, the larger; a weak match, the smaller.
    fn draft_len(&self, strength: usize, max: usize) -> usize {
        let Some(s) = self.sizing else { return max };
        let adapted = s.gamma.min(max);
        match strength >= COPYING {
            true => adapted.max(strength).min(max),
            false => adapted.min(strength),
        }
    }
}

/// The index right after the earlier occurrence of `history`'s last `n` tokens whose preceding
/// tokens agree longest with those before the tail (up to `AGREE` more), the latest of those,
/// and how many tokens agree: text that repeats with variations (a file of similar functions,
/// a list) has many copies of a short n-gram, and the copy with the longest shared context is
/// the one being repeated.
fn last_earlier_match(history: &[TokenId], n: usize) -> Option<(usize, usize)> {
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
    best.map(|(agreed, end)| (end, agreed))
}

/// Match strength (n-gram and agreeing context, tokens) from which a sized lookup takes the
/// text for a copy in progress: the code edit's matches are either 30 tokens or more (copying)
/// or a few (a function's differing number, open text), and 8 separates them.
const COPYING: usize = 8;

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

    /// Sized lookup without the gate (whose verdicts depend on time).
    fn sized(max_n: usize) -> NgramProposer {
        let cfg = SpecConfig { max_drafts: 32, ngram_min: 1, ngram_max: max_n };
        NgramProposer { sizing: Some(Sizing { gamma: usize::MAX, last_len: 0 }), ..NgramProposer::ungated(&cfg) }
    }

    #[test]
    fn sized_lookup_drafts_a_copy_in_progress_at_length_and_a_weak_match_briefly() {
        // 40 distinct tokens, then their first 12 again: the match agrees over all 12, a copy.
        let text: Vec<u32> = (100..140).collect();
        let h: Vec<u32> = text.iter().chain(&text[..12]).copied().collect();
        assert_eq!(sized(3).propose(&h, 32), h[12..44].to_vec());
        assert_eq!(sized(3).propose(&h, 5), h[12..17].to_vec());
        // "1 2" seen once, in no shared context: 2 tokens of strength, 2 drafts (unsized: 8).
        let h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2];
        assert_eq!(sized(3).propose(&h, 32), vec![3, 4]);
        assert_eq!(NgramProposer::ungated(&SpecConfig { max_drafts: 32, ngram_min: 1, ngram_max: 3 }).propose(&h, 8).len(), 8);
    }

    #[test]
    fn sized_lookup_drafts_fewer_after_a_rejection_and_more_after_full_acceptance() {
        let mut p = sized(2);
        let mut h = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 1, 2];
        assert_eq!(p.propose(&h, 32), vec![3, 4]);
        // The step kept none of them (its own token 77 only): a weak match now drafts one.
        h.push(77);
        assert_eq!(p.propose(&h, 32), Vec::<u32>::new());
        h.extend([60, 1, 2]);
        assert_eq!(p.propose(&h, 32), vec![77]);
        // Kept (77, then the step's token 60): two more next time (3), within the match's
        // strength ("77 60" and the "1 2" before it agree: 4).
        h.extend([77, 60]);
        assert_eq!(p.propose(&h, 32), vec![1, 2, 77]);
        // A copy in progress is drafted at its strength (the n-gram and 8 agreeing tokens) though
        // the last step kept nothing.
        let text: Vec<u32> = (100..140).collect();
        h.push(99);
        assert_eq!(p.propose(&h, 32).len(), 0);
        h.extend(&text);
        h.extend(&text[..10]);
        assert_eq!(p.propose(&h, 32), text[10..20].to_vec());
    }
}
