//! Constrained decoding as the engine sees it: a per-sequence constraint (a grammar, in
//! practice `ferrolm-grammar`'s llguidance matcher) that says which tokens may come next, learns
//! each token delivered, and may determine the next tokens itself (jump-forward: they are
//! delivered without sampling and forwarded with the next step's decode rows).

use ferrolm_core::TokenId;

pub trait TokenConstraint: Send {
    /// The tokens allowed next, as a bitset (bit `i % 32` of word `i / 32`: token i), covering
    /// the logits' width. Called once per sampled row, after every earlier token was consumed.
    fn mask(&mut self) -> Result<Vec<u32>, String>;
    /// Learns that `token` came next (sampled under the mask, or forced).
    fn consume(&mut self, token: TokenId) -> Result<(), String>;
    /// The tokens the constraint determines from here, consumed by this call (empty: the
    /// next token is a choice).
    fn forced(&mut self) -> Vec<TokenId>;
    /// Whether the constraint has ended: its grammar accepted and allows nothing more.
    fn is_finished(&self) -> bool;
}

/// llguidance's matcher (`ferrolm-grammar`): the server compiles one per request from
/// `response_format`, a grammar field or the tools of `tool_choice`.
impl TokenConstraint for ferrolm_grammar::Constraint {
    fn mask(&mut self) -> Result<Vec<u32>, String> {
        ferrolm_grammar::Constraint::mask(self).map(<[u32]>::to_vec).map_err(|e| e.to_string())
    }

    fn consume(&mut self, token: TokenId) -> Result<(), String> {
        ferrolm_grammar::Constraint::consume(self, token).map_err(|e| e.to_string())
    }

    fn forced(&mut self) -> Vec<TokenId> {
        // A failure here shows again at the next mask, which fails the sequence.
        self.take_forced().unwrap_or_default()
    }

    fn is_finished(&self) -> bool {
        self.status() == ferrolm_grammar::Status::Accepted
    }
}

/// A constraint with jump-forward off (`"jump_forward": false`, `--no-jump-forward`): the
/// tokens it forces are sampled one at a time under its masks, which allow only the forced
/// token (llguidance masks a forced position down to it), so greedy output is the same.
pub struct NoJumpForward<C>(pub C);

impl<C: TokenConstraint> TokenConstraint for NoJumpForward<C> {
    fn mask(&mut self) -> Result<Vec<u32>, String> {
        self.0.mask()
    }

    fn consume(&mut self, token: TokenId) -> Result<(), String> {
        self.0.consume(token)
    }

    fn forced(&mut self) -> Vec<TokenId> {
        Vec::new()
    }

    fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}
