//! The engine as a service: one thread owns the model and advances every admitted request one
//! engine step at a time (`step.rs`); callers submit from any thread into a bounded queue and
//! receive events on a channel. A closed receiver (client gone) or a cancelled token ends the
//! request at the next step; a failure in one request is reported to that request only.

use crate::bundle::Bundle;
use crate::config::{BatchConfig, DiskSettings, GraphSettings};
use crate::spec::SpecConfig;
use crate::gauges::EngineGauges;
use crate::seq::{SeqRequest, Sink};
use crate::step::Batch;
use crate::Flow;
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, TokenEvent, TokenId};
use ferrolm_sample::{Sampler, SamplerConfig};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

#[derive(Clone)]
pub struct EngineConfig {
    /// Requests that may wait for the engine; more are refused (HTTP 429).
    pub queue_capacity: usize,
    pub batch: BatchConfig,
    pub graph: GraphSettings,
    /// The prompt cache's disk tier, if any.
    pub kv_disk: Option<DiskSettings>,
    /// Speculative decoding, if on: by prompt lookup, or with `draft` when given (a model of
    /// the target's vocabulary: `draft::check_compatible`).
    pub spec: Option<SpecConfig>,
    pub draft: Option<Arc<Bundle>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 64,
            batch: BatchConfig::default(),
            graph: GraphSettings::default(),
            kv_disk: None,
            spec: None,
            draft: None,
        }
    }
}

/// What a request receives, in order: tokens, then exactly one `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Token(TokenEvent),
    Done(GenerationStats),
    Error(String),
}

pub struct Request {
    pub prompt: Vec<TokenId>,
    pub params: GenerateParams,
    pub cancel: CancelToken,
    /// Structured output: what the generation must be (a compiled grammar), if anything.
    pub constraint: Option<Box<dyn crate::TokenConstraint>>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: the request queue is full")]
    QueueFull,
    #[error("the engine has stopped")]
    Stopped,
    #[error("the request needs {needed} tokens of KV cache (prompt and max_tokens), more than this server's KV budget of {budget}")]
    TooLarge { needed: usize, budget: usize },
}

/// What the engine thread receives.
enum Job {
    /// Requests of one prompt (one, or OpenAI's `n` choices) with their event channels.
    Run(Vec<(Request, UnboundedSender<Event>)>),
    /// Write the prompt cache's pending disk entries, then answer.
    Flush(SyncSender<()>),
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: SyncSender<Job>,
    gauges: Arc<EngineGauges>,
    bundle: Arc<Bundle>,
    kv_budget_tokens: usize,
}

impl EngineHandle {
    /// Starts the engine thread for `bundle`.
    pub fn spawn(bundle: Arc<Bundle>, cfg: EngineConfig) -> Self {
        let (jobs, rx) = sync_channel(cfg.queue_capacity);
        let gauges = Arc::new(EngineGauges::default());
        let bytes_per_token = bundle.model.make_cache().bytes_per_token();
        let kv_budget_tokens = crate::scheduler::kv_budget_tokens(&cfg.batch, bytes_per_token);
        let worker = Worker { bundle: bundle.clone(), gauges: gauges.clone(), cfg };
        std::thread::Builder::new()
            .name("ferrolm-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawn the engine thread");
        Self { jobs, gauges, bundle, kv_budget_tokens }
    }

    pub fn bundle(&self) -> &Arc<Bundle> {
        &self.bundle
    }

    pub fn gauges(&self) -> &EngineGauges {
        &self.gauges
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request. A request whose prompt and `max_tokens` could never fit the KV
    /// budget is refused here, before any work.
    pub fn submit(&self, request: Request) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let mut rx = self.submit_group(vec![request])?;
        Ok(rx.pop().expect("one receiver per request"))
    }

    /// Queues requests of one prompt (OpenAI's `n` choices, each with its own sampling
    /// parameters and seed): the prompt is computed once and its cache copied for the others.
    /// One receiver per request, in order.
    pub fn submit_group(&self, requests: Vec<Request>) -> Result<Vec<UnboundedReceiver<Event>>, SubmitError> {
        let needed: usize = requests.iter().map(|r| r.prompt.len() + r.params.max_tokens).sum();
        if requests.is_empty() || needed > self.kv_budget_tokens {
            return Err(SubmitError::TooLarge { needed, budget: self.kv_budget_tokens });
        }
        let (mut receivers, mut pairs) = (Vec::new(), Vec::new());
        for r in requests {
            let (events, rx) = unbounded_channel();
            receivers.push(rx);
            pairs.push((r, events));
        }
        self.gauges.queued.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(Job::Run(pairs)) {
            Ok(()) => Ok(receivers),
            Err(e) => {
                self.gauges.queued.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }
}

impl EngineHandle {
    /// Waits until the prompt cache's disk tier has written every finished prefix (at
    /// shutdown: entries then survive the process), at most `timeout`.
    pub fn flush_prompt_cache(&self, timeout: std::time::Duration) {
        let (done, wait) = sync_channel(1);
        if self.jobs.send(Job::Flush(done)).is_ok() {
            let _ = wait.recv_timeout(timeout);
        }
    }
}

/// A request's events channel as the sequence's sink.
struct ChannelSink {
    events: UnboundedSender<Event>,
    cancel: CancelToken,
}

impl Sink for ChannelSink {
    fn token(&mut self, event: TokenEvent) -> Flow {
        match self.events.send(Event::Token(event)) {
            Ok(()) if !self.cancel.is_cancelled() => Flow::Continue,
            _ => Flow::Stop,
        }
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        let _ = self.events.send(match outcome {
            Ok(stats) => Event::Done(stats),
            Err(message) => Event::Error(message),
        });
    }

    fn is_closed(&self) -> bool {
        self.events.is_closed()
    }
}

struct Worker {
    bundle: Arc<Bundle>,
    gauges: Arc<EngineGauges>,
    cfg: EngineConfig,
}

impl Worker {
    /// Steps every admitted request until none is left, then waits for the next one.
    fn run(self, jobs: Receiver<Job>) {
        let model = self.bundle.model.as_ref();
        let mut batch = Batch::new(model, self.cfg.batch, self.cfg.graph);
        match (&self.cfg.draft, self.cfg.spec) {
            (Some(draft), Some(spec)) => batch.set_draft_model(draft.model.as_ref(), spec),
            (_, spec) => batch.set_speculation(spec),
        }
        if let Some(d) = &self.cfg.kv_disk {
            match ferrolm_kv::DiskTier::open(&d.dir, d.max_bytes, &d.identity) {
                Ok(tier) => batch.set_disk_tier(tier),
                Err(e) => tracing::warn!("prompt cache: the disk tier {} is unusable ({e}); RAM only", d.dir.display()),
            }
        }
        loop {
            if batch.is_idle() {
                let Ok(job) = jobs.recv() else { return };
                self.add(&mut batch, job);
            }
            // Jobs leave the bounded queue only as the batch can take them, so that the queue
            // (and its 429s) is where requests wait when the batch is full.
            while batch.waiting() == 0 {
                let Ok(job) = jobs.try_recv() else { break };
                self.add(&mut batch, job);
            }
            let gauges = &self.gauges;
            let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| batch.step(&|| gauges.queued.load(Ordering::Relaxed) > 0)));
            match stepped {
                Ok(report) => {
                    gauges.record(&report, batch.running(), batch.waiting());
                    if let Some(s) = batch.prompt_cache_stats() {
                        gauges.record_prompt_cache(&s);
                    }
                }
                Err(panic) => {
                    let message = panic_message(panic);
                    tracing::error!("engine step panicked: {message}");
                    batch.fail_all(&message);
                }
            }
        }
    }

    /// Turns a queued job into sequences of the batch (or answers it at once).
    fn add(&self, batch: &mut Batch<'_>, job: Job) {
        let requests = match job {
            Job::Run(requests) => requests,
            Job::Flush(done) => {
                batch.flush_prompt_cache();
                let _ = done.send(());
                return;
            }
        };
        self.gauges.queued.fetch_sub(1, Ordering::SeqCst);
        let mut reqs = Vec::with_capacity(requests.len());
        for (r, events) in requests {
            // A client that left while waiting is dropped from the queue without work.
            if events.is_closed() || r.cancel.is_cancelled() {
                continue;
            }
            match self.sequence_request(r, events) {
                Some(req) => reqs.push(req),
                None => continue,
            }
        }
        if !reqs.is_empty() {
            batch.add_group(reqs, self.bundle.model.make_cache());
        }
    }

    /// The sequence of one request, or None after answering it with an error.
    fn sequence_request(&self, r: Request, events: UnboundedSender<Event>) -> Option<SeqRequest<'static>> {
        let b = &self.bundle;
        let cfg = SamplerConfig { vocab_size: b.model.info().vocab_size, xtc_special_tokens: b.xtc_special_tokens(), ..Default::default() };
        let sampler = match Sampler::new(&r.params.sampling, &cfg) {
            Ok(s) => s,
            Err(e) => {
                let _ = events.send(Event::Error(e.to_string()));
                return None;
            }
        };
        let mut eos_ids = b.eos_ids.clone();
        eos_ids.extend(&r.params.stop_token_ids);
        let sink = ChannelSink { events, cancel: r.cancel.clone() };
        Some(SeqRequest { prompt: r.prompt, params: r.params, eos_ids, cancel: r.cancel, sampler: Box::new(sampler), sink: Box::new(sink), constraint: r.constraint })
    }
}

pub(crate) fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    let what = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error: {what}")
}
