//! Building blocks shared by the architectures.

mod attention;
mod attention_table;
mod decoder;
mod embedding;
mod fused;
mod mlp;
mod moe;

pub use attention::{SelfAttention, SelfAttentionConfig};
pub use decoder::fused_decode_step;
pub use embedding::Embedding;
pub use fused::FusedLinear;
pub use mlp::{Activation, GatedMlp};
pub use moe::{MoeMlp, Routing, SharedExpert};

use crate::{RowKind, SeqInput};
use candle_core::{Result, Tensor};

/// The rows of one sequence inside a batch's flattened token matrix.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// First row in the flattened `[tokens, hidden]` matrix.
    pub row: usize,
    pub len: usize,
    /// Absolute position of the first token (the cache offset before this forward).
    pub position: usize,
    pub kind: RowKind,
}

/// The layout of one forward's flattened token matrix: each sequence's span, the decode
/// sequences' spans first, so that rows `0..decode_rows` are the decode rows.
pub struct BatchRows {
    pub spans: Vec<Span>,
    pub decode_rows: usize,
    /// Each span's LoRA adapters (`crate::lora::apply`).
    pub lora: Vec<Option<std::sync::Arc<crate::lora::LoraStack>>>,
}

impl BatchRows {
    /// The rows of `batch`; an error if a decode sequence follows a prompt sequence.
    pub fn of(batch: &[SeqInput<'_>]) -> Result<Self> {
        let mut row = 0;
        let mut decode_rows = 0;
        let mut spans = Vec::with_capacity(batch.len());
        for s in batch {
            let span = Span { row, len: s.tokens.len(), position: s.cache.offset(), kind: s.kind };
            if span.kind == RowKind::Decode {
                if decode_rows != row {
                    candle_core::bail!("forward: decode sequences must come before prompt sequences")
                }
                decode_rows += span.len;
            }
            row += span.len;
            spans.push(span);
        }
        let lora = batch.iter().map(|s| s.lora.clone()).collect();
        Ok(Self { spans, decode_rows, lora })
    }

    /// `n` one-token decode rows without adapters (a batched step over device inputs: the
    /// positions are the table's, not these spans').
    pub fn decode_only(n: usize) -> Self {
        let spans = (0..n).map(|row| Span { row, len: 1, position: 0, kind: RowKind::Decode }).collect();
        Self { spans, decode_rows: n, lora: vec![None; n] }
    }

    /// Every token id of the batch in row order.
    pub fn ids(batch: &[SeqInput<'_>]) -> Vec<u32> {
        batch.iter().flat_map(|s| s.tokens.iter().copied()).collect()
    }

    /// `finish` (the final norm) of the decode rows of the hidden states `x`; `[0, hidden]`
    /// when there are none (no kernel runs on an empty tensor: a CUDA launch of no blocks fails).
    pub fn decode_part(&self, x: &Tensor, finish: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        match self.decode_rows {
            0 => Tensor::zeros((0, x.dim(1)?), x.dtype(), x.device()),
            n => finish(&x.narrow(0, 0, n)?),
        }
    }
}
