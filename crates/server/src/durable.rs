//! Durable generations, the server's side (issue 35, docs/durable.md): which requests write a
//! checkpoint log, under which key (the client's `Idempotency-Key`, else the request's
//! identity), resuming from a log an earlier process left, removing it once the answer is
//! complete, and the graceful shutdown (503 + `Retry-After` while every running generation
//! writes what it emitted). The log itself is `ferrolm_engine::durable`.

use crate::errors::{ApiError, ApiResult};
use crate::generation::GenerationSpec;
use crate::http::log::RequestLog;
use crate::state::SharedState;
use ferrolm_engine::durable::{CheckpointSettings, CheckpointStore, Claim, Completion, Header};
use ferrolm_engine::{Durable, Event, Request, SubmitError};
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedReceiver;

/// The checkpoint store (None: `--checkpoint-dir` not given) and whether the server is
/// shutting down.
#[derive(Default)]
pub struct Durability {
    store: Option<Arc<CheckpointStore>>,
    draining: AtomicBool,
}

impl Durability {
    /// Opens `settings.dir` (created if missing; expired logs removed).
    pub fn open(settings: CheckpointSettings) -> std::io::Result<Self> {
        Ok(Self { store: Some(CheckpointStore::open(settings)?), draining: AtomicBool::new(false) })
    }

    pub fn store(&self) -> Option<&Arc<CheckpointStore>> {
        self.store.as_ref()
    }
}

/// A request that will write a log: its key (held), its header, the tokens to resume from.
pub struct Planned {
    claim: Claim,
    header: Header,
    resume: Vec<u32>,
}

/// Removes the log once the generation's answer is complete.
pub struct Done {
    store: Arc<CheckpointStore>,
    completion: Completion,
}

impl Done {
    pub fn complete(self) {
        self.store.complete(&self.completion);
    }
}

/// Decides whether `specs` (one request's choices) run durably, and resumes a log left by an
/// earlier process: its seed replaces a server-chosen one, its tokens are replayed. Refuses
/// (503) while the server shuts down.
pub fn prepare(state: &SharedState, specs: &mut [GenerationSpec], log: &RequestLog) -> ApiResult<Option<Planned>> {
    let d = &state.durable;
    if d.draining.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable("The server is shutting down; retry (running generations resume)."));
    }
    let Some(store) = d.store.as_ref() else { return Ok(None) };
    let [spec] = specs else {
        tracing::debug!("checkpoint: n > 1 choices are not durable");
        return Ok(None);
    };
    if spec.params.sampling.logprobs.is_some() {
        // Replayed tokens would come back without their logprobs.
        tracing::debug!("checkpoint: requests with logprobs are not durable");
        return Ok(None);
    }
    let model = &store.settings().model;
    let identity = identity(model, spec);
    let key = match (log.idempotency_key(), spec.params.sampling.seed) {
        (Some(k), _) => hex(&Sha256::digest(format!("idempotency-key\0{k}").as_bytes())[..16]),
        (None, Some(_)) => identity.clone(),
        // Without a key, a resent unseeded request cannot be told from a client asking for
        // another sample (a "regenerate"): it must not continue someone's earlier draw.
        (None, None) => {
            tracing::debug!("checkpoint: an unseeded request without an Idempotency-Key is not durable");
            return Ok(None);
        }
    };
    let Some(claim) = store.claim(&key) else {
        tracing::warn!("checkpoint {key}: already running in this server; this request runs without checkpoints");
        return Ok(None);
    };
    let (header, resume) = match store.load(&key) {
        Some(saved) if saved.header.model == *model && saved.header.identity == identity => {
            tracing::info!("checkpoint {key}: resuming after {} tokens", saved.tokens.len());
            (saved.header, saved.tokens)
        }
        Some(saved) if saved.header.model == *model && log.idempotency_key().is_some() => {
            return Err(ApiError::invalid(
                "Idempotency-Key: this key was used for a different request (its prompt, parameters or the server's defaults differ)",
                Some("Idempotency-Key"),
            ));
        }
        _ => {
            let seed = spec.params.sampling.seed.unwrap_or_else(ferrolm_sample::rng::fresh_seed);
            let header = Header { identity, model: model.clone(), seed, prompt_tokens: spec.prompt.len(), created: crate::state::unix_now() };
            (header, Vec::new())
        }
    };
    spec.params.sampling.seed = Some(header.seed);
    Ok(Some(Planned { claim, header, resume }))
}

/// Queues `requests`: durably when planned and the request allows it (one choice, no
/// constraint: a grammar's forced tokens are not sampler draws), else as usual.
pub fn submit(
    state: &SharedState,
    mut requests: Vec<Request>,
    planned: Option<Planned>,
) -> Result<(Vec<UnboundedReceiver<Event>>, Option<Done>), SubmitError> {
    let store = state.durable.store.as_ref();
    let durable = match (planned, store) {
        (Some(p), Some(store)) if requests.len() == 1 && requests[0].constraint.is_none() => Some((p, store)),
        _ => None,
    };
    let Some((p, store)) = durable else { return Ok((state.engine.submit_group(requests)?, None)) };
    let done = Done { store: store.clone(), completion: p.claim.completion() };
    let checkpointer = p.claim.begin(&p.header, &p.resume);
    let request = requests.pop().expect("one request");
    let fresh = p.resume.is_empty();
    match state.engine.submit_durable(request, Durable { checkpointer, resume: p.resume }) {
        Ok(rx) => Ok((vec![rx], Some(done))),
        Err(e) => {
            // Refused (429…): a new log would only wait for its TTL; a resumed one is kept.
            if fresh {
                done.complete();
            }
            Err(e)
        }
    }
}

/// Graceful shutdown: new generations get 503 + `Retry-After`; every running one writes what
/// it emitted to its log, synced; then the prompt cache's disk tier is flushed as at any
/// shutdown; at most `timeout` in all (the engine answers between steps, so a step longer than
/// that is not waited for). Their clients' retries resume.
pub async fn drain(state: &SharedState, timeout: Duration) {
    state.durable.draining.store(true, Ordering::SeqCst);
    let Some(store) = state.durable.store.clone() else { return };
    let engine = state.engine.clone();
    let started = std::time::Instant::now();
    let work = tokio::task::spawn_blocking(move || {
        let answered = engine.checkpoint_all(timeout);
        let synced = answered && store.flush(timeout.saturating_sub(started.elapsed()));
        engine.flush_prompt_cache(timeout.saturating_sub(started.elapsed()));
        synced
    });
    // The blocking side may wait on a busy engine thread: the bound holds regardless.
    let done = matches!(tokio::time::timeout(timeout, work).await, Ok(Ok(true)));
    let ms = started.elapsed().as_secs_f64() * 1e3;
    match done {
        true => eprintln!("ferrolm serve: running generations checkpointed in {ms:.1} ms"),
        false => eprintln!("ferrolm serve: checkpointing did not finish within {} s", timeout.as_secs_f64()),
    }
}

/// A hash of everything that decides the generation's tokens: the model, the prompt's ids, the
/// generation parameters (the seed only when the request gave one: a server-chosen seed is kept
/// in the log instead) and the output routing (stop strings, tools, reasoning tags).
fn identity(model: &str, spec: &GenerationSpec) -> String {
    let mut h = Sha256::new();
    h.update(b"ferrolm-durable-v1\0");
    h.update(model.as_bytes());
    h.update((spec.prompt.len() as u64).to_le_bytes());
    spec.prompt.iter().for_each(|t| h.update(t.to_le_bytes()));
    h.update(serde_json::to_vec(&spec.params).unwrap_or_default());
    h.update(format!("{:?}", spec.pipeline).as_bytes());
    hex(&h.finalize()[..16])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
