//! The prefill planner (DESIGN §3.2): the prompt minus its last token is forwarded in chunks
//! without logits; the last token gets its own one-token forward whose hidden state gives step 0
//! (the "tail split", as mlx-lm does). A snapshot boundary splits a chunk so that a hook can run
//! while the caches hold exactly that prefix.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillChunk {
    pub start: usize,
    pub len: usize,
    /// The caches hold exactly the snapshot prefix after this chunk.
    pub snapshot_after: bool,
    /// This is the tail: the last prompt token, whose logits give step 0.
    pub is_tail: bool,
}

/// Chunks covering `prompt_len - cached` new tokens starting at `cached`.
pub fn plan_prefill(
    cached: usize,
    prompt_len: usize,
    chunk: usize,
    snapshot_at: Option<usize>,
) -> Vec<PrefillChunk> {
    assert!(
        cached < prompt_len,
        "at least one prompt token must be forwarded"
    );
    let chunk = chunk.max(1);
    let body_end = prompt_len - 1;
    let snapshot = snapshot_at.filter(|&s| s > cached && s <= prompt_len);
    let mut plan = Vec::new();
    let mut start = cached;
    while start < body_end {
        let mut end = (start + chunk).min(body_end);
        if let Some(s) = snapshot.filter(|&s| s > start && s < end) {
            end = s;
        }
        plan.push(PrefillChunk {
            start,
            len: end - start,
            snapshot_after: snapshot == Some(end),
            is_tail: false,
        });
        start = end;
    }
    plan.push(PrefillChunk {
        start: body_end,
        len: 1,
        snapshot_after: snapshot == Some(prompt_len),
        is_tail: true,
    });
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(p: &[PrefillChunk]) -> Vec<usize> {
        p.iter().map(|c| c.len).collect()
    }

    #[test]
    fn last_token_is_forwarded_alone() {
        let p = plan_prefill(0, 5000, 2048, None);
        assert_eq!(lens(&p), vec![2048, 2048, 903, 1]);
        assert!(p.last().unwrap().is_tail && p[..3].iter().all(|c| !c.is_tail));
        assert_eq!(lens(&plan_prefill(0, 1, 2048, None)), vec![1]);
        assert_eq!(lens(&plan_prefill(3, 4, 2048, None)), vec![1]);
    }

    #[test]
    fn chunks_are_contiguous_from_the_cached_prefix() {
        let p = plan_prefill(100, 300, 64, None);
        assert_eq!(p[0].start, 100);
        for w in p.windows(2) {
            assert_eq!(w[0].start + w[0].len, w[1].start);
        }
        assert_eq!(p.last().unwrap().start, 299);
    }

    #[test]
    fn snapshot_boundary_splits_a_chunk() {
        let p = plan_prefill(0, 100, 64, Some(40));
        assert_eq!(lens(&p), vec![40, 59, 1]);
        assert!(p[0].snapshot_after && !p[1].snapshot_after);
        let full = plan_prefill(0, 100, 64, Some(100));
        assert!(full.last().unwrap().snapshot_after);
    }
}
