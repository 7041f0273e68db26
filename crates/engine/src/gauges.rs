//! Counters the engine keeps for the server's metrics: lock-free, written by the engine thread
//! after each step, read by anyone.

use crate::step::StepReport;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

#[derive(Default)]
pub struct EngineGauges {
    /// Requests submitted and not yet taken by the engine thread.
    pub queued: AtomicUsize,
    /// Sequences in the batch (running), and admitted to it but waiting for room.
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    /// Steps that forwarded something, and sequences preempted (to be recomputed).
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    /// Per step: sequences in the forward, and rows forwarded.
    pub batch_size: Histogram,
    pub step_tokens: Histogram,
    /// The prompt cache: entries, bytes, requests that reused a prefix or found none, prompt
    /// tokens served from it.
    pub prompt_cache_entries: AtomicUsize,
    pub prompt_cache_bytes: AtomicUsize,
    pub prompt_cache_hits: AtomicU64,
    pub prompt_cache_misses: AtomicU64,
    pub prompt_cache_hit_tokens: AtomicU64,
    pub prompt_cache_disk_hits: AtomicU64,
    pub prompt_cache_disk_entries: AtomicUsize,
    pub prompt_cache_disk_bytes: AtomicU64,
}

impl EngineGauges {
    pub(crate) fn record_prompt_cache(&self, s: &ferrolm_kv::PromptCacheStats) {
        self.prompt_cache_entries.store(s.entries, Ordering::Relaxed);
        self.prompt_cache_bytes.store(s.bytes, Ordering::Relaxed);
        self.prompt_cache_hits.store(s.hits, Ordering::Relaxed);
        self.prompt_cache_misses.store(s.misses, Ordering::Relaxed);
        self.prompt_cache_hit_tokens.store(s.hit_tokens, Ordering::Relaxed);
        self.prompt_cache_disk_hits.store(s.disk_hits, Ordering::Relaxed);
        self.prompt_cache_disk_entries.store(s.disk_entries, Ordering::Relaxed);
        self.prompt_cache_disk_bytes.store(s.disk_bytes, Ordering::Relaxed);
    }

    pub(crate) fn record(&self, report: &StepReport, running: usize, waiting: usize) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.preemptions.fetch_add(report.preempted as u64, Ordering::Relaxed);
        if report.tokens > 0 {
            self.steps.fetch_add(1, Ordering::Relaxed);
            self.batch_size.observe(report.seqs as u64);
            self.step_tokens.observe(report.tokens as u64);
        }
    }
}

/// Bucket upper bounds (inclusive): powers of two up to 4096, then everything.
pub const BUCKETS: [u64; 13] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];

/// A histogram of small counts in power-of-two buckets (Prometheus's cumulative `le` buckets
/// are made when rendering).
#[derive(Default)]
pub struct Histogram {
    /// counts[i]: observations ≤ BUCKETS[i] and > BUCKETS[i - 1]; the last: above them all.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, v: u64) {
        let i = BUCKETS.iter().position(|&b| v <= b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
    }

    /// Cumulative counts per bucket of `BUCKETS` (then +Inf), the sum and the count.
    pub fn snapshot(&self) -> (Vec<u64>, u64, u64) {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Ordering::Relaxed);
                total
            })
            .collect();
        (cumulative, self.sum.load(Ordering::Relaxed), total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative() {
        let h = Histogram::default();
        for v in [1, 3, 4, 5, 10_000] {
            h.observe(v);
        }
        let (c, sum, n) = h.snapshot();
        assert_eq!((c[0], c[1], c[2], c[3], *c.last().unwrap()), (1, 1, 3, 4, 5));
        assert_eq!((sum, n), (10_013, 5));
    }
}
