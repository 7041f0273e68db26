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
