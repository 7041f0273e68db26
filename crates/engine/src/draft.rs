//! The draft model of speculative decoding (`--draft-model`): loaded beside the target and
//! accepted only when it speaks the same vocabulary, token for token.

use crate::bundle::{Bundle, BundleError};

/// Refuses a draft whose tokens are not the target's (different ids for the same text would
/// make every draft a miss at best) or whose logits could name ids the target lacks.
pub fn check_compatible(target: &Bundle, draft: &Bundle) -> Result<(), BundleError> {
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    let refuse = |why: String| {
        Err(BundleError(format!(
            "--draft-model {}: not usable with {}: {why} (a draft model must share the target's tokenizer)",
            draft.path.display(),
            target.path.display()
        )))
    };
    if t.vocab_size() != d.vocab_size() {
        return refuse(format!("vocabularies of {} and {} tokens", d.vocab_size(), t.vocab_size()));
    }
    if let Some(id) = (0..t.vocab_size() as u32).find(|&id| t.token_bytes(id) != d.token_bytes(id)) {
        return refuse(format!("token {id} differs"));
    }
    if draft.model.info().vocab_size > target.model.info().vocab_size {
        return refuse(format!(
            "its head has {} outputs, the target's {}",
            draft.model.info().vocab_size,
            target.model.info().vocab_size
        ));
    }
    if draft.model.device().location() != target.model.device().location() {
        return refuse("they are on different devices".into());
    }
    Ok(())
}
