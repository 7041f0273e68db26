//! Sentence embeddings of a served embedding model: token ids in, one f32 vector per input
//! out, computed in chunks so that memory stays bounded and a cancelled request (client gone)
//! stops between chunks. The caller runs this off the async runtime (it is CPU work).

use crate::bundle::{Bundle, BundleError};
use ferrolm_core::CancelToken;

/// Tokens forwarded together at most: bounds the activations (a 2,048-input request of 256
/// tokens each would otherwise be half a million rows at once).
const CHUNK_TOKENS: usize = 4096;

impl Bundle {
    /// The embedding width when the model embeds (an empty batch answers `[0, dim]` at once),
    /// else `None` (a generative model).
    pub fn embedding_dim(&self) -> Option<usize> {
        match self.model.forward_embeddings(&[]) {
            Ok(Some(t)) => t.dim(1).ok(),
            _ => None,
        }
    }

    /// One vector per input, in order. Inputs are token ids with the special tokens the
    /// tokenizer adds; each must fit the model's context (the caller says which does not).
    pub fn embed(&self, inputs: &[Vec<u32>], cancel: &CancelToken) -> Result<Vec<Vec<f32>>, BundleError> {
        let err = |e: candle_core::Error| BundleError(e.to_string());
        let mut out = Vec::with_capacity(inputs.len());
        for chunk in chunks(inputs, CHUNK_TOKENS) {
            if cancel.is_cancelled() {
                return Err(BundleError("cancelled".into()));
            }
            let refs: Vec<&[u32]> = chunk.iter().map(Vec::as_slice).collect();
            let vectors = self
                .model
                .forward_embeddings(&refs)
                .map_err(err)?
                .ok_or_else(|| BundleError("this model does not compute embeddings".into()))?;
            out.extend(vectors.to_vec2::<f32>().map_err(err)?);
        }
        Ok(out)
    }
}

/// Consecutive runs of inputs of at most `max_tokens` tokens each (an input longer than that
/// forms a run alone).
fn chunks(inputs: &[Vec<u32>], max_tokens: usize) -> Vec<&[Vec<u32>]> {
    let mut runs = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, input) in inputs.iter().enumerate() {
        if i > start && tokens + input.len() > max_tokens {
            runs.push(&inputs[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += input.len();
    }
    if start < inputs.len() {
        runs.push(&inputs[start..]);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_keep_order_and_stay_under_the_budget() {
        let inputs: Vec<Vec<u32>> = [3, 4, 2, 9, 1, 1].iter().map(|&n| vec![0; n]).collect();
        let lens: Vec<Vec<usize>> = chunks(&inputs, 6).iter().map(|c| c.iter().map(Vec::len).collect()).collect();
        assert_eq!(lens, [vec![3], vec![4, 2], vec![9], vec![1, 1]]);
        assert!(chunks(&[], 6).is_empty());
    }
}
