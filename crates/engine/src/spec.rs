//! Speculative decoding: a proposer guesses the next tokens of a sequence; the step forwards
//! `[pending, drafts…]` as decode rows in one forward and the sequence's own sampler samples
//! each row in turn, keeping drafts while they equal what it sampled (token-match acceptance:
//! every emitted token is the sampler's own draw given the tokens before it, so the output is
//! exactly what decoding one token at a time gives — the same tokens, logprobs and seeded
//! draws — and only the number of forwards changes).

mod gate;

use gate::{DraftGate, DraftMode};
use ferrolm_core::TokenId;

/// Guesses continuations of a token history.
pub trait Proposer {
    /// Up to `max` tokens that may follow `history` (prompt ++ generated).
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId>;
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
}

impl NgramProposer {
    /// Lookup with the gate (what `--draft-kind ngram` runs).
    pub fn new(cfg: &SpecConfig) -> Self {
        Self { gate: Some(DraftGate::default()), ..Self::ungated(cfg) }
    }

    /// Lookup on every step.
    pub fn ungated(cfg: &SpecConfig) -> Self {
        Self { min_n: cfg.ngram_min.max(1), max_n: cfg.ngram_max.max(cfg.ngram_min.max(1)), gate: None }
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        if self.gate.as_mut().is_some_and(|g| g.next(history.len()) == DraftMode::Lean) || max == 0 {
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

/// A small model of the same vocabulary guesses greedily: its own cache follows the sequence
/// (realigned to the tokens kept after each verification, the new ones forwarded), then it
/// decodes up to `max` tokens one at a time. Prompt lookup goes first where it matches (free
/// guesses, and on text that repeats its input better ones), and a `DraftGate` measures whether
/// the model's guesses pay for their cost on this sequence, resting the model while they do not.
pub struct DraftModelProposer<'a> {
    model: &'a dyn ferrolm_models::CausalLm,
    cache: ferrolm_kv::SeqCache,
    /// The tokens whose keys and values `cache` holds.
    cached: Vec<TokenId>,
    /// Prompt lookup tried first, and the gate that rests the model (None: the model alone).
    lookup: Option<(NgramProposer, DraftGate)>,
}

impl<'a> DraftModelProposer<'a> {
    /// Prompt lookup (n-grams of 4 down to 2 tokens: a longer match than plain lookup's
    /// default asks, since the model's guess is the alternative) where it matches, the model
    /// where the gate finds that it pays: what `--draft-model` runs.
    pub fn new(model: &'a dyn ferrolm_models::CausalLm) -> Self {
        let lookup = NgramProposer::ungated(&SpecConfig::default());
        Self { lookup: Some((lookup, DraftGate::default())), ..Self::model_only(model) }
    }

    /// The model's guesses alone, every step.
    pub fn model_only(model: &'a dyn ferrolm_models::CausalLm) -> Self {
        Self { model, cache: model.make_cache(), cached: Vec::new(), lookup: None }
    }

    /// The cache holding `tokens` (a prefix of it kept, the rest forwarded).
    fn follow(&mut self, tokens: &[TokenId]) -> candle_core::Result<()> {
        let common = self.cached.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let extra = self.cached.len() - common;
        if self.cache.trim(extra) != extra {
            (self.cache, self.cached) = (self.model.make_cache(), Vec::new());
            return self.follow(tokens);
        }
        self.cached.truncate(common);
        // The prompt, and long stretches the model did not draft (while prompt lookup guessed
        // or the model rested), go in as prompt rows (the prefill products: several times
        // cheaper per row); the token or two a verification adds as decode rows, as the
        // target computed them, so that a draft of the same weights guesses exactly what the
        // target would.
        let as_prompt = common == 0 || tokens.len() - common > DECODE_CATCH_UP;
        for chunk in tokens[common..].chunks(DRAFT_CHUNK) {
            let input = match as_prompt {
                true => ferrolm_models::SeqInput::prompt(chunk, &mut self.cache),
                false => ferrolm_models::SeqInput::decode(chunk, &mut self.cache),
            };
            self.model.forward_hidden(&mut [input])?;
            self.cached.extend_from_slice(chunk);
        }
        Ok(())
    }

    /// Up to `max` greedy guesses; with `min_p`, ending before the first guess the draft gives
    /// less than that probability (a guess it doubts is likely rejected, and costs a decode of
    /// the draft plus a verified row).
    fn draft(&mut self, history: &[TokenId], max: usize, min_p: Option<f32>) -> candle_core::Result<Vec<TokenId>> {
        let (pending, known) = history.split_last().expect("a decoding sequence has tokens");
        self.follow(known)?;
        let mut token = *pending;
        let mut drafts = Vec::with_capacity(max);
        for _ in 0..max {
            let hidden = self.model.forward_hidden(&mut [ferrolm_models::SeqInput::decode(&[token], &mut self.cache)])?;
            self.cached.push(token);
            let logits = self.model.project_logits(&hidden)?.squeeze(0)?.to_vec1::<f32>()?;
            let (best, p) = argmax_and_probability(&logits);
            if min_p.is_some_and(|m| p < m) {
                break;
            }
            token = best;
            drafts.push(token);
        }
        Ok(drafts)
    }
}

/// The largest logit's token and its softmax probability (the first of equal maxima, as
/// `argmax` takes it).
fn argmax_and_probability(logits: &[f32]) -> (TokenId, f32) {
    let (best, max) = logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |(b, m), (i, &v)| if v > m { (i, v) } else { (b, m) });
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    (best as TokenId, 1.0 / sum)
}

/// The draft model's guesses stop at one it gives less than this probability (with prompt
/// lookup and the gate; the model alone guesses every step).
const DRAFT_MIN_P: f32 = 0.5;

/// Catch-ups longer than this go in as prompt rows (see `DraftModelProposer::follow`).
const DECODE_CATCH_UP: usize = 4;

/// Prompt rows the draft model forwards at a time while it catches up with a sequence.
const DRAFT_CHUNK: usize = 512;

impl Proposer for DraftModelProposer<'_> {
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        if let Some((lookup, gate)) = self.lookup.as_mut() {
            let mode = gate.next(history.len());
            let found = lookup.propose(history, max);
            if !found.is_empty() || mode == DraftMode::Lean {
                return found;
            }
        }
        if max == 0 || history.is_empty() {
            return Vec::new();
        }
        let min_p = self.lookup.is_some().then_some(DRAFT_MIN_P);
        self.draft(history, max, min_p).unwrap_or_else(|e| {
            tracing::warn!("draft model: {e}; no drafts this step");
            Vec::new()
        })
    }
}
