//! Building blocks shared by the architectures.

mod attention;
mod decoder;
mod embedding;
mod fused;
mod mlp;

pub use attention::{SelfAttention, SelfAttentionConfig};
pub use decoder::fused_decode_step;
pub use embedding::Embedding;
pub use fused::FusedLinear;
pub use mlp::{Activation, GatedMlp};

/// The rows of one sequence inside a batch's flattened token matrix.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// First row in the flattened `[tokens, hidden]` matrix.
    pub row: usize,
    pub len: usize,
    /// Absolute position of the first token (the cache offset before this forward).
    pub position: usize,
}

/// Spans of consecutive sequences with the given lengths and starting positions.
pub fn spans(lens_and_positions: impl Iterator<Item = (usize, usize)>) -> Vec<Span> {
    let mut row = 0;
    lens_and_positions
        .map(|(len, position)| {
            let s = Span { row, len, position };
            row += len;
            s
        })
        .collect()
}
