//! ferrolm's sampler: logits processors, the filter chain and logprobs with mlx-lm's semantics.
//!
//! One step, in mlx-lm's order (`generate.py` `_step`, `sample_utils.py` 0.32):
//!
//! 1. processors on the raw logits: logit_bias, repetition, presence, frequency
//!    (`processors.rs`), then the optional grammar [`Mask`] (0/-inf; applied after them);
//! 2. `logprobs = logits - logsumexp(logits)`: the distribution reported as logprobs;
//! 3. if temperature is 0: argmax, first index of the maximum (`make_sampler` skips the filters);
//! 4. filters in `make_sampler`'s order: top_p (0 < p < 1), min_p (!= 0, with
//!    min_tokens_to_keep), XTC (probability > 0; a coin per step; EOS/newline ids exempt),
//!    top_k (> 0) (`filters.rs`);
//! 5. a categorical draw with probabilities ∝ e^(logprob / T) over what is left.
//!
//! Engine use: build a [`Sampler`] per request ([`Sampler::new`] validates with mlx's messages),
//! then call [`Sampler::sample`]`(&logits, history)` each step with the history = prompt +
//! generated ids (only read when [`Sampler::needs_history`]). CPU logits are read in place; on
//! other devices the chain runs on the device and only small vectors cross (`device.rs`);
//! [`Sampler::sample_deferred`] keeps a greedy token on the device for pipelined decode.
//!
//! Randomness is per request and per step ([`rng`]): step n draws from a stream keyed by
//! (seed, n), so a seed reproduces its tokens whatever else runs, and [`Sampler::set_step`]
//! replays from any step. Without a seed, one comes from the clock mixed with a Weyl counter.
//!
//! Nothing sorts the vocabulary: chunk maxima bound every top-n selection, a histogram of mass
//! by logit finds wide top-p cuts, and ties are broken by token id exactly as mlx's CPU
//! `argpartition` does (measured: top_k, argmax and top logprobs keep the lowest ids of a tie;
//! min_p's min_tokens_to_keep keeps the highest). top_p keeps every token tied with its cut, XTC
//! keeps every token tied with the least likely token above its threshold.
//!
//! Deviations from mlx-lm:
//! - sums are exact (f64 across chunks): mlx's CPU f32 reductions drift with the vocabulary; at
//!   262,144 tokens its logsumexp is off by ~8e-4 and its top-p cut moves by ~3% of the nucleus.
//!   The fixtures check us against mlx (vocab <= 1,000, identical) and against mlx's definition
//!   evaluated exactly (65,536 and 262,144 tokens, identical; mlx itself within those bounds);
//! - logits are converted to f32 first (mlx keeps bf16 logits in bf16); filters compare the
//!   processed logits, mlx compares logprobs (x - lse rounded): boundaries within an ulp only;
//! - chunks of 64 logits more than 64 nats (after temperature) below the maximum count as zero
//!   mass (each token < e^-64 of the best; mlx's Gumbel draw cannot pick them either);
//! - the random streams differ from mlx's (its global key); the distributions are the same;
//! - top logprobs are sorted by descending logprob (mlx returns argpartition order);
//! - sampler-time errors (top_k >= vocabulary, XTC threshold > 0.5, min_tokens_to_keep < 1) are
//!   raised by [`Sampler::new`] with mlx's text instead of in the middle of generation;
//!   min_tokens_to_keep larger than the vocabulary keeps everything (mlx raises);
//! - out-of-vocabulary logit_bias ids are an error (undefined in mlx); out-of-vocabulary history
//!   ids are ignored.

mod categorical;
mod device;
mod dist;
mod fastmath;
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
pub use sampler::{Draw, Explained, Mask, Path, Sampled, Sampler, SamplerConfig};
pub use validate::{validate, validate_for_vocab, MAX_TOP_LOGPROBS};
