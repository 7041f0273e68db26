//! One sequence's constraint: llguidance's `Matcher` plus the mask in ferrolm's layout.

use llguidance::api::StopReason;
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use crate::GrammarError;

/// Where a constraint stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// The output is a valid prefix; more tokens are allowed (EOS too, if the output is
    /// already complete: see [`Constraint::can_end`]).
    Running,
    /// The output is complete: EOS was consumed, or nothing can follow it (the mask then
    /// allows only EOS).
    Accepted,
    /// The constraint cannot go on (a token it did not allow, a parser limit, an internal
    /// error); the message says which. The sequence should finish with an error reason.
    Failed(String),
}

/// The grammar state of one sequence, owned by it. `mask()` before sampling a row,
/// `consume(token)` after; `forced_tokens()` for jump-forward; `rollback(n)` to undo tokens
/// that speculation rejected. Clones share the compiled grammar and lexer caches (behind a
/// lock) and nothing else, so `n` choices can start from one compiled constraint.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// Words of the mask: the logits' width in bits, rounded up.
    words: usize,
    /// The last mask (reused buffer).
    mask: SimpleVob,
    /// EOS consumed after the grammar had already ended (llguidance does not record it, but
    /// the caller counts it in a later rollback).
    eos_after_end: bool,
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher, width: usize) -> Self {
        Constraint { matcher, words: width.div_ceil(32), mask: SimpleVob::new(), eos_after_end: false }
    }

    /// The tokens allowed next, as a bitset in llguidance's layout (bit `i % 32` of word
    /// `i / 32` set: token `i` allowed), `ceil(width / 32)` words, what
    /// `ferrolm_sample::Mask::Allowed` takes. EOS ids are set exactly when the output so far is
    /// complete; once nothing can follow, only they are set. Costs a parser step: call it once
    /// per sampled row (its time is what `tests/mask_timing.rs` measures).
    pub fn mask(&mut self) -> Result<&[u32], GrammarError> {
        self.mask = self.matcher.compute_mask_or_eos().map_err(|e| self.failure(e))?;
        Ok(&self.mask.as_slice()[..self.words])
    }

    /// Advances past `token` (sampled under the last mask, or forced). A token the grammar does
    /// not allow fails the constraint (see [`Status::Failed`]).
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.status() == Status::Accepted {
            // The mask of an ended grammar is EOS alone: sampling it is the normal way out.
            if self.is_eos(token) && !self.eos_after_end {
                self.eos_after_end = true;
                return Ok(());
            }
            return Err(GrammarError::Generation(format!(
                "token {token} after the output was complete (only EOS may follow)"
            )));
        }
        self.matcher.consume_token(token).map_err(|e| self.failure(e))
    }

    /// [`Constraint::consume`] for several tokens in order (a jump-forward span, accepted
    /// drafts).
    pub fn consume_all(&mut self, tokens: &[u32]) -> Result<(), GrammarError> {
        tokens.iter().try_for_each(|&t| self.consume(t))
    }

    /// Tokens the grammar forces from here (the model's own tokenization of text no other
    /// output could have), not yet consumed: append them without sampling, then
    /// `consume_all` them. Empty when nothing is forced or the constraint has stopped.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        if self.matcher.is_stopped() {
            return Vec::new();
        }
        self.matcher.compute_ff_tokens()
    }

    /// [`Constraint::forced_tokens`], consumed: what jump-forward appends.
    pub fn take_forced(&mut self) -> Result<Vec<u32>, GrammarError> {
        let forced = self.forced_tokens();
        self.consume_all(&forced)?;
        Ok(forced)
    }

    /// How many of `tokens`, in order from the current state, the grammar accepts (nothing is
    /// consumed): a speculative draft can be cut there before it is verified.
    pub fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Forgets the last `n` consumed tokens (speculative tokens the verification rejected). A
    /// constraint that was `Accepted` runs again; a failed one stays failed.
    pub fn rollback(&mut self, mut n: usize) -> Result<(), GrammarError> {
        if n > 0 && self.eos_after_end {
            self.eos_after_end = false;
            n -= 1;
        }
        self.matcher.rollback(n).map_err(|e| self.failure(e))
    }

    /// Whether the output so far is complete, i.e. EOS is allowed now.
    pub fn can_end(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    pub fn status(&self) -> Status {
        if let Some(e) = self.matcher.get_error() {
            return Status::Failed(tidy(&e));
        }
        match self.matcher.stop_reason() {
            StopReason::NotStopped => Status::Running,
            r if r.is_ok() => Status::Accepted,
            r => Status::Failed(format!("stopped: {r}")),
        }
    }

    /// Whether no more tokens will be allowed (accepted or failed).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn is_eos(&self, token: u32) -> bool {
        self.matcher.tok_env().is_ok_and(|env| env.tok_trie().eos_tokens().contains(&token))
    }

    /// A failed call's error: the matcher's own message (it keeps it), else the call's.
    fn failure(&self, e: impl std::fmt::Display) -> GrammarError {
        let msg = self.matcher.get_error().unwrap_or_else(|| e.to_string());
        GrammarError::Generation(tidy(&msg))
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("width_words", &self.words).field("status", &self.status()).finish()
    }
}

/// llguidance's message without the marker it appends when verbose errors are off.
pub(crate) fn tidy(msg: &str) -> String {
    msg.replace("\n<non-verbose/>", "").replace("<non-verbose/>", "").trim().to_string()
}
