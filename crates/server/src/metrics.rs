//! Prometheus metrics in the text exposition format, kept by hand (no registry crate): request
//! counts by endpoint and status, prompt and generated tokens, time to first token and
//! inter-token latency histograms, request duration, and the engine's queue depth.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds in seconds (`le`), Prometheus style; +Inf is implicit.
const TTFT_BUCKETS: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0];
const DURATION_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    spec_drafted: AtomicU64,
    spec_accepted: AtomicU64,
    fill_injected: AtomicU64,
    fill_wasted: AtomicU64,
    cancelled: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    duration: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            spec_drafted: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            fill_injected: AtomicU64::new(0),
            fill_wasted: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            duration: Mutex::new(Histogram::new(DURATION_BUCKETS)),
        }
    }
}

/// Instantaneous values read from elsewhere when rendering.
pub struct Gauges {
    pub queued: usize,
    pub running: usize,
    /// Admitted to the batch, waiting for room (KV budget or sequence seats).
    pub waiting: usize,
    pub steps: u64,
    pub preemptions: u64,
    /// Per engine step: sequences in the forward, and rows forwarded (cumulative buckets of
    /// `ferrolm_engine::BUCKETS`, then +Inf; sum; count).
    pub batch_size: (Vec<u64>, u64, u64),
    pub step_tokens: (Vec<u64>, u64, u64),
    /// The prompt cache: counters (hits, misses, tokens served, disk hits) and sizes (entries,
    /// bytes, disk entries, disk bytes).
    pub prompt_cache: [u64; 8],
}

impl Metrics {
    pub fn request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_default() += 1;
        }
    }

    pub fn prompt_tokens(&self, n: usize) {
        self.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Draft tokens a finished generation verified and kept.
    /// Fill's tokens kept and rows wasted (both policies).
    pub fn fill(&self, fill: &ferrolm_core::FillStats) {
        self.fill_injected.fetch_add((fill.assert.injected + fill.verify.injected) as u64, Ordering::Relaxed);
        self.fill_wasted.fetch_add((fill.assert.wasted + fill.verify.wasted) as u64, Ordering::Relaxed);
    }

    pub fn speculation(&self, drafted: usize, accepted: usize) {
        self.spec_drafted.fetch_add(drafted as u64, Ordering::Relaxed);
        self.spec_accepted.fetch_add(accepted as u64, Ordering::Relaxed);
    }

    pub fn generated_token(&self) {
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
    }

    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    pub fn ttft(&self, seconds: f64) {
        observe(&self.ttft, seconds);
    }

    pub fn inter_token(&self, seconds: f64) {
        observe(&self.itl, seconds);
    }

    pub fn duration(&self, seconds: f64) {
        observe(&self.duration, seconds);
    }

    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::new();
        out.push_str("# HELP ferrolm_requests_total HTTP requests by endpoint and status code.\n");
        out.push_str("# TYPE ferrolm_requests_total counter\n");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(out, "ferrolm_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}");
            }
        }
        counter(&mut out, "ferrolm_prompt_tokens_total", "Prompt tokens of admitted requests.", &self.prompt_tokens);
        counter(&mut out, "ferrolm_generation_tokens_total", "Tokens generated.", &self.generation_tokens);
        counter(&mut out, "ferrolm_spec_drafted_tokens_total", "Draft tokens verified (speculative decoding).", &self.spec_drafted);
        counter(&mut out, "ferrolm_spec_accepted_tokens_total", "Draft tokens kept (speculative decoding).", &self.spec_accepted);
        counter(&mut out, "ferrolm_fill_injected_tokens_total", "Tokens fill appended and kept (docs/fill.md).", &self.fill_injected);
        counter(&mut out, "ferrolm_fill_wasted_tokens_total", "Rows fill appended and took back.", &self.fill_wasted);
        counter(
            &mut out,
            "ferrolm_requests_cancelled_total",
            "Generations stopped because the client went away.",
            &self.cancelled,
        );
        gauge(&mut out, "ferrolm_queue_depth", "Requests waiting for the engine.", gauges.queued);
        gauge(&mut out, "ferrolm_requests_running", "Sequences the engine is running (decoding together).", gauges.running);
        gauge(&mut out, "ferrolm_requests_waiting", "Sequences admitted to the batch and waiting for room.", gauges.waiting);
        let total = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        total(&mut out, "ferrolm_engine_steps_total", "Engine steps that forwarded tokens.", gauges.steps);
        total(&mut out, "ferrolm_preemptions_total", "Sequences preempted for KV memory (recomputed later).", gauges.preemptions);
        let pc = &gauges.prompt_cache;
        for (i, (name, help)) in [
            ("hits_total", "Requests that reused a cached prompt prefix."),
            ("misses_total", "Requests that found no cached prefix."),
            ("hit_tokens_total", "Prompt tokens served from the prompt cache."),
            ("disk_hits_total", "Prefixes read back from the disk tier."),
        ]
        .iter()
        .enumerate()
        {
            total(&mut out, &format!("ferrolm_prompt_cache_{name}"), help, pc[i]);
        }
        for (i, (name, help)) in [
            ("entries", "Prompt cache entries in memory."),
            ("bytes", "Prompt cache bytes in memory."),
            ("disk_entries", "Prompt cache entries on disk."),
            ("disk_bytes", "Prompt cache bytes on disk."),
        ]
        .iter()
        .enumerate()
        {
            gauge(&mut out, &format!("ferrolm_prompt_cache_{name}"), help, pc[4 + i] as usize);
        }
        count_histogram(&mut out, "ferrolm_batch_size", "Sequences per engine step.", &gauges.batch_size);
        count_histogram(&mut out, "ferrolm_step_tokens", "Tokens forwarded per engine step.", &gauges.step_tokens);
        let hist = |h: &Mutex<Histogram>, out: &mut String, name: &str, help: &str| {
            if let Ok(h) = h.lock() {
                h.render(out, name, help);
            }
        };
        hist(
            &self.ttft,
            &mut out,
            "ferrolm_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
        );
        hist(
            &self.itl,
            &mut out,
            "ferrolm_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
        );
        hist(
            &self.duration,
            &mut out,
            "ferrolm_request_duration_seconds",
            "From request arrival to the end of its generation.",
        );
        out
    }
}

/// A histogram of counts from the engine (`ferrolm_engine::Histogram::snapshot`).
fn count_histogram(out: &mut String, name: &str, help: &str, (cumulative, sum, count): &(Vec<u64>, u64, u64)) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (le, n) in ferrolm_engine::BUCKETS.iter().map(|b| b.to_string()).chain(["+Inf".to_string()]).zip(cumulative) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {n}");
    }
    let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
}

fn observe(h: &Mutex<Histogram>, v: f64) {
    if let Ok(mut h) = h.lock() {
        h.observe(v);
    }
}

fn counter(out: &mut String, name: &str, help: &str, v: &AtomicU64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
}

fn gauge(out: &mut String, name: &str, help: &str, v: usize) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("/v1/chat/completions", 200);
        m.request("/v1/chat/completions", 200);
        m.prompt_tokens(12);
        m.generated_token();
        m.ttft(0.03);
        m.inter_token(0.012);
        let hist = (vec![0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, 1);
        let g = Gauges {
            queued: 2,
            running: 1,
            waiting: 0,
            steps: 5,
            preemptions: 0,
            batch_size: hist.clone(),
            step_tokens: hist,
            prompt_cache: [3, 1, 700, 1, 2, 4096, 1, 2048],
        };
        let text = m.render(&g);
        assert!(text.contains("ferrolm_batch_size_bucket{le=\"2\"} 1"));
        assert!(text.contains("ferrolm_step_tokens_count 1"));
        assert!(text.contains("ferrolm_engine_steps_total 5"));
        assert!(text.contains("ferrolm_prompt_cache_hit_tokens_total 700"));
        assert!(text.contains("ferrolm_prompt_cache_disk_bytes 2048"));
        assert!(text.contains("ferrolm_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"));
        assert!(text.contains("ferrolm_prompt_tokens_total 12"));
        assert!(text.contains("ferrolm_queue_depth 2"));
        assert!(text.contains("ferrolm_time_to_first_token_seconds_bucket{le=\"0.025\"} 0"));
        assert!(text.contains("ferrolm_time_to_first_token_seconds_bucket{le=\"0.05\"} 1"));
        assert!(text.contains("ferrolm_inter_token_latency_seconds_count 1"));
        assert!(text.contains("ferrolm_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1"));
    }
}
