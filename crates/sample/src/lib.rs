//! ferrolm's sampler: logits processors, the filter chain and logprobs with mlx-lm's semantics.
//!
//! One step, in mlx-lm's order (`generate.py` `_step`, `sample_utils.py`):
//!
//! 1. processors on the raw logits: logit_bias, repetition, presence, frequency
//!    (`processors.rs`), then the optional grammar [`Mask`];
//! 2. `logprobs = logits - logsumexp(logits)`: the distribution reported as logprobs;
//! 3. if temperature is 0: argmax (the filters are skipped, as `make_sampler` does);
//! 4. filters in `make_sampler`'s order: top_p, min_p, XTC, top_k (`filters.rs`);
//! 5. a categorical draw with probabilities ∝ e^(logprob / T) over what is left.
//!
//! Randomness is per request and per step ([`rng`]); a seed reproduces its tokens whatever else runs.
//! Nothing sorts the vocabulary: filters use chunk maxima to find their candidates (`select.rs`),
//! and ties are broken by token id exactly as mlx's CPU `argpartition` does.
//!
//! Deviations from mlx-lm, all at rounding level unless stated:
//! - logits are converted to f32 first (mlx keeps bf16 logits in bf16);
//! - filters compare processed logits, mlx compares logprobs (x - lse rounded);
//! - top_p sums probabilities in f64 in selection order; mlx sums a sorted f32 cumsum;
//! - chunks of 64 logits lying more than 64 nats (after temperature) below the maximum count as
//!   zero mass (each < e^-64; mlx's Gumbel sampling cannot pick such tokens either);
//! - the random streams differ from mlx's (its global key); the distributions are the same;
//! - top logprobs are sorted by descending logprob (mlx returns argpartition order);
//! - sampler-time errors (top_k >= vocabulary, XTC threshold > 0.5, min_tokens_to_keep < 1) are
//!   raised when the sampler is built, with mlx's text, instead of in the middle of generation.

mod categorical;
mod device;
mod dist;
pub mod fastmath;
mod filters;
pub mod json;
mod logprobs;
mod processors;
pub mod rng;
mod sampler;
mod select;
pub mod validate;
mod view;

pub use filters::{Filters, Xtc};
pub use processors::Processors;
pub use sampler::{Explained, Mask, Path, Sampled, Sampler, SamplerConfig};
pub use validate::{validate, validate_for_vocab, MAX_TOP_LOGPROBS};
