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
    /// `sample` with only the tokens of `allowed` (a bitset: bit `i % 32` of word `i / 32`)
    /// possible, applied after the processors and before the log-softmax (DESIGN §5).
    fn sample_masked(&mut self, logits: &Tensor, history: &[TokenId], allowed: Option<&[u32]>) -> candle_core::Result<Sampled> {
        match allowed {
            None => self.sample(logits, history),
            Some(_) => candle_core::bail!("this sampler cannot apply a constraint's mask"),
        }
    }
    /// Whether every step is a plain argmax of the logits (no processors, no logprobs): the
    /// engine may then decode with its captured on-device step.
    fn is_plain_greedy(&self) -> bool {
        false
    }
    /// Positions the random stream at `step` draws already made (resuming a checkpointed
    /// generation); false when this sampler cannot, and the generation must not resume.
    fn resume_at(&mut self, _step: u64) -> bool {
        false
    }
    /// Counts a plain greedy step whose token the engine computed for the whole batch at once.
    fn count_argmax(&mut self) {}
}

/// The request sampler (mlx-lm semantics) plugs in directly.
impl TokenSampler for ferrolm_sample::Sampler {
    fn sample(&mut self, logits: &Tensor, history: &[TokenId]) -> candle_core::Result<Sampled> {
        TokenSampler::sample_masked(self, logits, history, None)
    }

    fn sample_masked(&mut self, logits: &Tensor, history: &[TokenId], allowed: Option<&[u32]>) -> candle_core::Result<Sampled> {
        let mask = allowed.map(ferrolm_sample::Mask::Allowed);
        let s = ferrolm_sample::Sampler::sample_masked(self, logits, history, mask)
            .map_err(candle_core::Error::wrap)?;
        Ok(Sampled {
            token: s.token,
            logprobs: s.logprobs,
        })
    }

    fn is_plain_greedy(&self) -> bool {
        ferrolm_sample::Sampler::is_plain_greedy(self)
    }

    /// The stream is keyed by (seed, step) alone, so the step is its whole position.
    fn resume_at(&mut self, step: u64) -> bool {
        self.set_step(step);
        true
    }

    fn count_argmax(&mut self) {
        self.skip_step();
    }
}

/// A borrowed sampler samples as the sampler it borrows (for `generate`).
impl<T: TokenSampler + ?Sized> TokenSampler for &mut T {
    fn sample(&mut self, logits: &Tensor, history: &[TokenId]) -> candle_core::Result<Sampled> {
        (**self).sample(logits, history)
    }

    fn sample_masked(&mut self, logits: &Tensor, history: &[TokenId], allowed: Option<&[u32]>) -> candle_core::Result<Sampled> {
        (**self).sample_masked(logits, history, allowed)
    }

    fn is_plain_greedy(&self) -> bool {
        (**self).is_plain_greedy()
    }

    fn resume_at(&mut self, step: u64) -> bool {
        (**self).resume_at(step)
    }

    fn count_argmax(&mut self) {
        (**self).count_argmax()
    }
}
