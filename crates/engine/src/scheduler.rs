//! Scheduling policy, host-only (no tensors): which sequences run, how many tokens each
//! forwards in the next step, who is admitted and who is preempted. vLLM v1's model: no
//! prefill or decode phases, only sequences that want rows. Each step, within a token budget:
//! every running decode first (one row each), then prompt chunks in arrival order.

use crate::config::BatchConfig;

/// What a sequence wants from the next step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// Prompt rows still to forward before its tail.
    Prompt { remaining: usize },
    /// Decode rows: the `pending` tokens delivered but not yet forwarded (the prompt's last
    /// token or the last sampled one; more after a jump-forward), and up to `drafts` more rows
    /// of draft tokens to verify.
    Decode { pending: usize, drafts: usize },
    /// Nothing: it has ended and waits to be retired.
    Nothing,
}

/// A sequence as the scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqView {
    pub want: Want,
    /// Sequences it stands for: 1, or 1 + the choices waiting to share its prompt.
    pub seats: usize,
    /// Cache tokens it holds after its next row.
    pub kv_tokens: usize,
    /// Cache tokens it may reach (prompt and every token it may generate).
    pub max_kv_tokens: usize,
    /// Prompt rows it forwards per step at most (the request's prefill chunk).
    pub max_chunk: usize,
}

/// One step's work, by index into the running list (in running order): decode rows first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// (sequence, decode rows: 1 + the drafts granted).
    pub decode: Vec<(usize, usize)>,
    /// (sequence, prompt rows).
    pub prompt: Vec<(usize, usize)>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.decode.is_empty() && self.prompt.is_empty()
    }

    pub fn tokens(&self) -> usize {
        self.decode.iter().map(|d| d.1).sum::<usize>() + self.prompt.iter().map(|p| p.1).sum::<usize>()
    }
}

/// The budget in cache tokens for sequences of `bytes_per_token`.
pub fn kv_budget_tokens(cfg: &BatchConfig, bytes_per_token: usize) -> usize {
    cfg.kv_budget_bytes / bytes_per_token.max(1)
}

/// How many of `waiting` (in arrival order) to admit next to `running`: while there is room
/// for another sequence and the cache tokens of all of them (each with its next row) fit the
/// budget. Arrival order is kept: a large request at the head waits for room rather than being
/// overtaken.
pub fn admit(cfg: &BatchConfig, kv_budget: usize, running: &[SeqView], waiting: &[SeqView]) -> usize {
    let mut used: usize = running.iter().map(|s| s.kv_tokens).sum();
    let mut seats: usize = running.iter().map(|s| s.seats).sum();
    let mut n = 0;
    for w in waiting {
        // The head always fits an empty batch (a request larger than the budget is refused
        // at submission; a group larger than the seats runs alone).
        let first = running.is_empty() && n == 0;
        if !first && (seats + w.seats > cfg.max_seqs || used + w.kv_tokens > kv_budget) {
            break;
        }
        used += w.kv_tokens;
        seats += w.seats;
        n += 1;
    }
    n
}

/// The running sequences to preempt (newest first) so that the others' next rows fit the
/// budget; the oldest always stays (a request that can never fit is refused at submission).
pub fn preempt(kv_budget: usize, running: &[SeqView]) -> Vec<usize> {
    let mut used: usize = running.iter().map(|s| s.kv_tokens).sum();
    let mut out = Vec::new();
    for i in (1..running.len()).rev() {
        if used <= kv_budget {
            break;
        }
        used -= running[i].kv_tokens;
        out.push(i);
    }
    out
}

/// The next step: every decode row, then prompt chunks in order, then draft rows to verify,
/// while the token budget lasts.
pub fn plan(cfg: &BatchConfig, running: &[SeqView]) -> Plan {
    let mut budget = cfg.max_batch_tokens.max(1);
    let mut plan = Plan::default();
    for (i, s) in running.iter().enumerate() {
        if let (Want::Decode { pending, .. }, true) = (s.want, budget > 0) {
            plan.decode.push((i, pending));
            budget = budget.saturating_sub(pending);
        }
    }
    for (i, s) in running.iter().enumerate() {
        if let Want::Prompt { remaining } = s.want {
            let n = remaining.min(budget).min(s.max_chunk.max(1));
            if n == 0 {
                break;
            }
            plan.prompt.push((i, n));
            budget -= n;
        }
    }
    for (i, rows) in plan.decode.iter_mut() {
        if let Want::Decode { drafts, .. } = running[*i].want {
            let granted = drafts.min(budget);
            *rows += granted;
            budget -= granted;
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_batch_tokens: usize, max_seqs: usize) -> BatchConfig {
        BatchConfig { max_batch_tokens, max_seqs, kv_budget_bytes: 0, prompt_cache_bytes: 0 }
    }

    fn seq(want: Want, kv_tokens: usize) -> SeqView {
        SeqView { want, seats: 1, kv_tokens, max_kv_tokens: kv_tokens + 10, max_chunk: 1000 }
    }

    #[test]
    fn decodes_come_first_then_prompt_chunks_in_order_within_the_budget() {
        let running = [
            seq(Want::Prompt { remaining: 300 }, 10),
            seq(Want::Decode { pending: 1, drafts: 0 }, 50),
            seq(Want::Prompt { remaining: 100 }, 10),
            seq(Want::Nothing, 5),
            seq(Want::Decode { pending: 1, drafts: 4 }, 70),
        ];
        let p = plan(&cfg(256, 8), &running);
        assert_eq!(p.decode, vec![(1, 1), (4, 1)]);
        assert_eq!(p.prompt, vec![(0, 254)]);
        assert_eq!(p.tokens(), 256);
        // Drafts take what prompt chunks leave.
        let p = plan(&cfg(1000, 8), &running);
        assert_eq!(p.prompt, vec![(0, 300), (2, 100)]);
        assert_eq!(p.decode, vec![(1, 1), (4, 5)]);
        let p = plan(&cfg(404, 8), &running);
        assert_eq!(p.decode, vec![(1, 1), (4, 3)]);
        // A budget smaller than the decodes: the first ones run, nothing else.
        let p = plan(&cfg(1, 8), &running);
        assert_eq!((p.decode, p.prompt), (vec![(1, 1)], vec![]));
    }

    #[test]
    fn admission_keeps_arrival_order_and_respects_seats_and_memory() {
        let d = Want::Decode { pending: 1, drafts: 0 };
        let running = [seq(d, 100)];
        let waiting = [seq(Want::Prompt { remaining: 10 }, 50), seq(Want::Prompt { remaining: 10 }, 500), seq(d, 1)];
        assert_eq!(admit(&cfg(512, 8), 1000, &running, &waiting), 3);
        assert_eq!(admit(&cfg(512, 8), 600, &running, &waiting), 1, "the large one blocks the queue");
        assert_eq!(admit(&cfg(512, 2), 1000, &running, &waiting), 1, "seats");
    }

    #[test]
    fn preemption_takes_the_newest_until_the_rest_fit_and_keeps_the_oldest() {
        let d = Want::Decode { pending: 1, drafts: 0 };
        let running = [seq(d, 100), seq(d, 100), seq(d, 100)];
        assert_eq!(preempt(300, &running), Vec::<usize>::new());
        assert_eq!(preempt(250, &running), vec![2]);
        assert_eq!(preempt(150, &running), vec![2, 1]);
        assert_eq!(preempt(10, &running), vec![2, 1]);
    }
}
