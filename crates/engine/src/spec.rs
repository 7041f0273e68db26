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

/// The index right after the most recent earlier occurrence of `history`'s last `n` tokens.
fn last_earlier_match(history: &[TokenId], n: usize) -> Option<usize> {
    if history.len() <= n {
        return None;
    }
    let tail = &history[history.len() - n..];
    // Occurrences ending before the tail itself; the latest one first.
    (0..history.len() - n).rev().find(|&i| &history[i..i + n] == tail).map(|i| i + n)
}

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

    fn draft(&mut self, history: &[TokenId], max: usize) -> candle_core::Result<Vec<TokenId>> {
        let (pending, known) = history.split_last().expect("a decoding sequence has tokens");
        self.follow(known)?;
        let mut token = *pending;
        let mut drafts = Vec::with_capacity(max);
        for _ in 0..max {
            let hidden = self.model.forward_hidden(&mut [ferrolm_models::SeqInput::decode(&[token], &mut self.cache)])?;
            self.cached.push(token);
            token = self.model.project_logits(&hidden)?.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
            drafts.push(token);
        }
        Ok(drafts)
    }
}

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
        self.draft(history, max).unwrap_or_else(|e| {
            tracing::warn!("draft model: {e}; no drafts this step");
            Vec::new()
        })
    }
}
