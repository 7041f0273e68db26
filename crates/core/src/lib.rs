//! Shared vocabulary of ferrolm: token ids, sampling parameters, generation events, stats and
//! errors. No tensors, no async runtime, no HTTP.

mod cancel;
mod error;
mod params;
mod stats;

pub use cancel::CancelToken;
pub use error::{Error, Result};
pub use params::{FillPlan, GenerateParams, SamplingParams, ToolCallSpan};
pub use stats::{FillStats, FinishReason, GenerationStats, SpanCounts, TokenEvent, TokenLogprobs};

/// A token id in a model's vocabulary.
pub type TokenId = u32;
