use candle_core::Tensor;
use ferrolm_core::{TokenId, TokenLogprobs};

/// What the sampler picked for one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: TokenId,
    pub logprobs: Option<TokenLogprobs>,
}

/// The engine's view of a sampler: logits `[vocab]` on the model's device and the token history
/// (prompt ++ generated) in, one token out.
pub trait TokenSampler {
    fn sample(&mut self, logits: &Tensor, history: &[TokenId]) -> candle_core::Result<Sampled>;
    /// Whether every step is a plain argmax of the logits (no processors, no logprobs): the
    /// engine may then decode with its captured on-device step.
    fn is_plain_greedy(&self) -> bool {
        false
    }
}

/// The request sampler (mlx-lm semantics) plugs in directly.
impl TokenSampler for ferrolm_sample::Sampler {
    fn sample(&mut self, logits: &Tensor, history: &[TokenId]) -> candle_core::Result<Sampled> {
        let s = ferrolm_sample::Sampler::sample(self, logits, history)
            .map_err(candle_core::Error::wrap)?;
        Ok(Sampled {
            token: s.token,
            logprobs: s.logprobs,
        })
    }

    fn is_plain_greedy(&self) -> bool {
        ferrolm_sample::Sampler::is_plain_greedy(self)
    }
}

/// A borrowed sampler samples as the sampler it borrows (for `generate`).
impl<T: TokenSampler + ?Sized> TokenSampler for &mut T {
    fn sample(&mut self, logits: &Tensor, history: &[TokenId]) -> candle_core::Result<Sampled> {
        (**self).sample(logits, history)
    }

    fn is_plain_greedy(&self) -> bool {
        (**self).is_plain_greedy()
    }
}
