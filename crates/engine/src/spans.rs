//! One forward over spans of several sequences, as the engine step and the batched draft step
//! both run it: each sequence's new rows with its own cache, decode spans first (what
//! `forward_hidden` asks, so that their rows form one block for the decode kernels).

use candle_core::{Result, Tensor};
use ferrolm_models::{CausalLm, RowKind, SeqInput};

/// Forwards `spans` (in any order) in one `forward_hidden`; returns the decode rows' hidden
/// states and, per span in the order given, the index of its first hidden row (None for a
/// prompt span, which returns none).
pub fn forward_spans(model: &dyn CausalLm, spans: Vec<SeqInput<'_>>) -> Result<(Tensor, Vec<Option<usize>>)> {
    let mut rows = 0;
    let first = spans
        .iter()
        .map(|s| {
            (s.kind == RowKind::Decode).then(|| {
                rows += s.tokens.len();
                rows - s.tokens.len()
            })
        })
        .collect();
    let (mut inputs, mut prompt): (Vec<_>, Vec<_>) = spans.into_iter().partition(|s| s.kind == RowKind::Decode);
    inputs.append(&mut prompt);
    Ok((model.forward_hidden(&mut inputs)?, first))
}
