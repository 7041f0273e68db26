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
    /// How the layers hold keys and values (`--kv-layout`).
    pub kv_layout: crate::config::KvLayout,
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
            kv_layout: Default::default(),
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

/// A request that writes a checkpoint log (`durable`): its log's writer, and the tokens an
/// earlier process emitted (they are delivered again, then the generation continues).
pub struct Durable {
    pub checkpointer: crate::durable::Checkpointer,
    pub resume: Vec<TokenId>,
}

/// What the engine thread receives.
enum Job {
    /// Requests of one prompt (one, or OpenAI's `n` choices) with their event channels.
    Run(Vec<(Request, UnboundedSender<Event>)>),
    /// One request with a checkpoint log.
    Durable(Request, UnboundedSender<Event>, Durable),
    /// Wakes an idle engine thread to answer `Control::checkpoints`.
    Checkpoint,
    /// Write the prompt cache's pending disk entries, then answer.
    Flush(SyncSender<()>),
}

/// Requests to the engine thread that must not wait behind queued jobs.
#[derive(Default)]
struct Control {
    /// Answered after every durable sequence wrote its emitted tokens to its log.
    checkpoints: std::sync::Mutex<Vec<SyncSender<()>>>,
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: SyncSender<Job>,
    control: Arc<Control>,
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
        let control = Arc::new(Control::default());
        let worker = Worker { bundle: bundle.clone(), gauges: gauges.clone(), cfg, control: control.clone() };
        std::thread::Builder::new()
            .name("ferrolm-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawn the engine thread");
        Self { jobs, control, gauges, bundle, kv_budget_tokens }
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
        self.queue(Job::Run(pairs))?;
        Ok(receivers)
    }

    /// Queues one request that writes a checkpoint log and, when `durable.resume` holds
    /// tokens, continues the generation that emitted them (`Sequence::resume`).
    pub fn submit_durable(&self, request: Request, durable: Durable) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let needed = request.prompt.len() + request.params.max_tokens;
        if needed > self.kv_budget_tokens {
            return Err(SubmitError::TooLarge { needed, budget: self.kv_budget_tokens });
        }
        let (events, rx) = unbounded_channel();
        self.queue(Job::Durable(request, events, durable))?;
        Ok(rx)
    }

    fn queue(&self, job: Job) -> Result<(), SubmitError> {
        self.gauges.queued.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(job) {
            Ok(()) => Ok(()),
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
    /// Has every running or waiting durable sequence write what it emitted to its log (at
    /// shutdown), waiting at most `timeout`; returns whether the engine thread answered.
    pub fn checkpoint_all(&self, timeout: std::time::Duration) -> bool {
        let (done, wait) = sync_channel(1);
        self.control.checkpoints.lock().unwrap_or_else(|p| p.into_inner()).push(done);
        // An idle engine thread waits for a job; a busy one sees the request at its next step.
        let _ = self.jobs.try_send(Job::Checkpoint);
        wait.recv_timeout(timeout).is_ok()
    }

    /// Waits until the prompt cache's disk tier has written every finished prefix (at
    /// shutdown: entries then survive the process), at most `timeout`.
    pub fn flush_prompt_cache(&self, timeout: std::time::Duration) {
        let (done, wait) = sync_channel(1);
        if self.jobs.send(Job::Flush(done)).is_ok() {
            let _ = wait.recv_timeout(timeout);
        }
    }
}

/// A request's events channel as the sequence's sink (and its log, when durable).
struct ChannelSink {
    events: UnboundedSender<Event>,
    cancel: CancelToken,
    checkpointer: Option<crate::durable::Checkpointer>,
}

impl Sink for ChannelSink {
    fn token(&mut self, event: TokenEvent) -> Flow {
        if let Some(c) = self.checkpointer.as_mut() {
            c.token(event.token);
        }
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

    fn checkpoint(&mut self) {
        if let Some(c) = self.checkpointer.as_mut() {
            c.checkpoint();
        }
    }
}

struct Worker {
    bundle: Arc<Bundle>,
    gauges: Arc<EngineGauges>,
    cfg: EngineConfig,
    control: Arc<Control>,
}

impl Worker {
    /// Steps every admitted request until none is left, then waits for the next one.
    fn run(self, jobs: Receiver<Job>) {
        let model = self.bundle.model.as_ref();
        let mut batch = Batch::new(model, self.cfg.batch, self.cfg.graph);
        batch.set_adapters(&self.bundle.adapters);
        match (&self.cfg.draft, self.cfg.spec) {
            (Some(draft), Some(spec)) => batch.set_draft_model(draft.model.as_ref(), spec),
            (_, spec) => batch.set_speculation(spec),
        }
        if let Err(e) = batch.set_kv_layout(self.cfg.kv_layout) {
            tracing::error!("--kv-layout: {e}; keeping contiguous caches");
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
            self.answer_checkpoints(&mut batch);
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

    fn answer_checkpoints(&self, batch: &mut Batch<'_>) {
        let waiters = std::mem::take(&mut *self.control.checkpoints.lock().unwrap_or_else(|p| p.into_inner()));
        if !waiters.is_empty() {
            batch.checkpoint_all();
            for w in waiters {
                let _ = w.send(());
            }
        }
    }

    /// Turns a queued job into sequences of the batch (or answers it at once).
    fn add(&self, batch: &mut Batch<'_>, job: Job) {
        let requests = match job {
            Job::Run(requests) => requests,
            Job::Durable(r, events, durable) => return self.add_durable(batch, r, events, durable),
            Job::Checkpoint => return self.answer_checkpoints(batch),
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
            match self.sequence_request(r, events, None) {
                Some(req) => reqs.push(req),
                None => continue,
            }
        }
        if !reqs.is_empty() {
            batch.add_group(reqs, self.bundle.model.make_cache());
        }
    }

    /// A durable request: its sink also writes its log; a resumed one replays its tokens.
    fn add_durable(&self, batch: &mut Batch<'_>, r: Request, events: UnboundedSender<Event>, durable: Durable) {
        self.gauges.queued.fetch_sub(1, Ordering::SeqCst);
        if events.is_closed() || r.cancel.is_cancelled() {
            return;
        }
        let Durable { checkpointer, resume } = durable;
        let Some(req) = self.sequence_request(r, events, Some(checkpointer)) else { return };
        batch.add_resumed(req, self.bundle.model.make_cache(), &resume);
    }

    /// The sequence of one request, or None after answering it with an error.
    fn sequence_request(
        &self,
        r: Request,
        events: UnboundedSender<Event>,
        checkpointer: Option<crate::durable::Checkpointer>,
    ) -> Option<SeqRequest<'static>> {
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
        let sink = ChannelSink { events, cancel: r.cancel.clone(), checkpointer };
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
