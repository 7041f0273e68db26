//! The engine as a service: one thread owns the model and runs requests from a bounded FIFO;
//! callers submit from any thread and receive events on a channel. A closed receiver (client
//! gone) or a cancelled token stops the request at the next step; a panic in one request is
//! reported to that request only.

use crate::bundle::Bundle;
use crate::{generate, Flow, GenerateInput};
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, TokenEvent, TokenId};
use ferrolm_sample::{Sampler, SamplerConfig};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Requests that may wait for the engine; more are refused (HTTP 429).
    pub queue_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { queue_capacity: 64 }
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
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the server is busy: the request queue is full")]
    QueueFull,
    #[error("the engine has stopped")]
    Stopped,
}

struct Job {
    request: Request,
    events: UnboundedSender<Event>,
}

/// Counters the server exports as metrics.
#[derive(Default)]
pub struct EngineGauges {
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: SyncSender<Job>,
    gauges: Arc<EngineGauges>,
    bundle: Arc<Bundle>,
}

impl EngineHandle {
    /// Starts the engine thread for `bundle`.
    pub fn spawn(bundle: Arc<Bundle>, cfg: EngineConfig) -> Self {
        let (jobs, rx) = sync_channel(cfg.queue_capacity);
        let gauges = Arc::new(EngineGauges::default());
        let worker = Worker {
            bundle: bundle.clone(),
            gauges: gauges.clone(),
        };
        std::thread::Builder::new()
            .name("ferrolm-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawn the engine thread");
        Self {
            jobs,
            gauges,
            bundle,
        }
    }

    pub fn bundle(&self) -> &Arc<Bundle> {
        &self.bundle
    }

    pub fn gauges(&self) -> &EngineGauges {
        &self.gauges
    }

    /// Queues a request; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn submit(&self, request: Request) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let (events, rx) = unbounded_channel();
        self.gauges.queued.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(Job { request, events }) {
            Ok(()) => Ok(rx),
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

struct Worker {
    bundle: Arc<Bundle>,
    gauges: Arc<EngineGauges>,
}

impl Worker {
    fn run(self, jobs: Receiver<Job>) {
        while let Ok(job) = jobs.recv() {
            self.gauges.queued.fetch_sub(1, Ordering::SeqCst);
            // A client that left while waiting is dropped from the queue without work.
            if job.events.is_closed() || job.request.cancel.is_cancelled() {
                continue;
            }
            self.gauges.running.fetch_add(1, Ordering::SeqCst);
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.execute(&job)));
            let last = match outcome {
                Ok(Ok(stats)) => Event::Done(stats),
                Ok(Err(message)) => Event::Error(message),
                Err(panic) => Event::Error(panic_message(panic)),
            };
            let _ = job.events.send(last);
            self.gauges.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn execute(&self, job: &Job) -> Result<GenerationStats, String> {
        let b = &self.bundle;
        let r = &job.request;
        let cfg = SamplerConfig {
            vocab_size: b.model.info().vocab_size,
            xtc_special_tokens: b.xtc_special_tokens(),
            ..Default::default()
        };
        let mut sampler = Sampler::new(&r.params.sampling, &cfg)?;
        let mut eos = b.eos_ids.clone();
        eos.extend(&r.params.stop_token_ids);
        let input = GenerateInput {
            prompt: &r.prompt,
            params: &r.params,
            eos_ids: &eos,
            cancel: &r.cancel,
        };
        let mut cache = b.model.make_cache();
        let mut on_token = |e: TokenEvent| match job.events.send(Event::Token(e)) {
            Ok(()) if !r.cancel.is_cancelled() => Flow::Continue,
            _ => Flow::Stop,
        };
        generate(
            b.model.as_ref(),
            &mut cache,
            input,
            &mut sampler,
            None,
            &mut on_token,
        )
        .map_err(|e| e.to_string())
    }
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    let what = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into());
    format!("internal error: {what}")
}
