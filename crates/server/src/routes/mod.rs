//! The router: mlx_lm.server's endpoints (`/v1/chat/completions` and its `/chat/completions`
//! alias, `/v1/completions`, `/v1/models`, `/health`) plus `/metrics`, Anthropic's Messages
//! (`/v1/messages`, `/v1/messages/count_tokens`) and OpenAI's Responses (`/v1/responses`); the
//! HTTP layer's middleware around them (`crate::http`: log line and request id, Host / Origin
//! checks, CORS, API key, bounded body); every response counted by endpoint and status; errors
//! in OpenAI's shape (Anthropic's on its endpoints), also for unknown paths and methods.

mod adapters;
mod capability;
pub(crate) mod chat;
mod completions;
mod models;
mod page;
pub(crate) mod prompt;

use crate::choices::Choices;
use crate::errors::{ApiError, ApiResult};
use crate::generation::{End, Generation, GenerationSpec, Piece};
use crate::http::{access, body, log::{self, RequestLog}};
use crate::openai_stream::{self, Kind, StreamOptions};
use crate::pipeline::PipelineConfig;
use crate::protocol::request::CommonParams;
use crate::protocol::response::{self, Meta, Usage};
use crate::state::{unix_now, SharedState};
use crate::{anthropic, embeddings, responses};
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::FutureExt;
use serde_json::{Map, Value};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

pub fn router(state: SharedState) -> Router {
    // The generation endpoints, refused up front when the served model only embeds.
    let generation = Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route_layer(middleware::from_fn_with_state(state.clone(), capability::generation_only));
    let cors = access::cors_layer(&state.config.access);
    let routes = Router::new()
        .merge(generation)
        .route("/v1/responses/{id}", get(responses::get).delete(responses::delete))
        .route("/v1/embeddings", post(embeddings::create))
        .route("/", get(page::chat))
        .route("/v1/models", get(models::list))
        .route("/v1/models/{*id}", get(models::one))
        .route("/v1/adapters", get(adapters::list).post(adapters::mount))
        .route("/v1/adapters/{name}", axum::routing::delete(adapters::unmount))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Innermost first: the body (bounded by http::body, not by axum's default), the key.
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(state.clone(), body::bounded))
        .layer(middleware::from_fn_with_state(state.clone(), access::check_key));
    let routes = match cors {
        Some(cors) => routes.layer(cors),
        None => routes,
    };
    routes
        .layer(middleware::from_fn_with_state(state.clone(), access::check_origin))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .layer(middleware::from_fn(crate::http::api_shaped))
        .layer(middleware::from_fn_with_state(state.clone(), log::access_log))
        .with_state(state)
}

/// `{"status": "ok"}`, byte for byte what mlx_lm.server answers. Never touches the engine
/// thread, so it answers during a long prefill.
async fn health() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], r#"{"status": "ok"}"#).into_response()
}

async fn metrics(State(state): State<SharedState>) -> Response {
    let text = state.metrics.render(&state.gauges());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    crate::http::error_response(uri.path(), ApiError::not_found(format!("Not found: {method} {}", uri.path())))
}

async fn method_not_allowed(uri: axum::http::Uri) -> Response {
    crate::http::error_response(uri.path(), ApiError::method_not_allowed())
}

/// The request counter, by endpoint and status.
async fn observe(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map_or("other", |p| p.as_str()).to_string();
    let resp = next.run(req).await;
    state.metrics.request(&endpoint, resp.status().as_u16());
    resp
}

/// Runs a handler; a panic becomes a 500 for this request only. Errors in OpenAI's shape.
async fn guarded(fut: impl Future<Output = Result<Response, ApiError>>) -> Response {
    guarded_as(fut, ApiError::into_response).await
}

/// `guarded` with the protocol's own error shape (`shape` turns an error into the response).
pub(crate) async fn guarded_as(
    fut: impl Future<Output = Result<Response, ApiError>>,
    shape: fn(ApiError) -> Response,
) -> Response {
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => shape(e),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!("request handler panicked: {what}");
            shape(ApiError::internal(format!("internal error: {what}")))
        }
    }
}

/// The test-only fault a request asks for (see `ServerConfig::fault_injection`).
fn injected_fault(state: &SharedState, body: &Map<String, Value>) -> Option<String> {
    if !state.config.fault_injection {
        return None;
    }
    let fault = body.get("x_ferrolm_fault")?.as_str()?.to_string();
    if fault == "panic" {
        panic!("injected fault");
    }
    Some(fault)
}

/// A response's generations once queued: already a streaming response, or to be collected.
enum Started {
    Stream(Response),
    Whole(Choices, Meta),
}

/// Queues one generation (429 when the queue is full): the part every protocol shares.
pub(crate) fn launch(state: &SharedState, body: &Map<String, Value>, run: Prepared, log: &RequestLog) -> ApiResult<Generation> {
    let mut one = launch_group(state, body, 1, run, log)?;
    Ok(one.pop().expect("one generation"))
}

/// Queues `n` choices of one prompt; the engine computes the prompt once. Choice i samples
/// with `seed + i` when the request gives a seed, so it equals a one-choice request with that
/// seed (and the choices differ); each has its own copy of the constraint.
fn launch_group(
    state: &SharedState,
    body: &Map<String, Value>,
    n: usize,
    mut run: Prepared,
    log: &RequestLog,
) -> ApiResult<Vec<Generation>> {
    if injected_fault(state, body).as_deref() == Some("engine") {
        run.prompt.clear();
    }
    let adapter = adapters::requested(state, body)?;
    let common = &run.common;
    let spec = |i: usize| {
        let mut sampling = common.sampling.clone();
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
        let params = ferrolm_core::GenerateParams {
            max_tokens: run.max_tokens,
            sampling,
            prefill_chunk: state.config.prefill_chunk,
            speculative: common.speculative,
            adapter: adapter.clone(),
            fill: run.fill.clone(),
            ..Default::default()
        };
        let constraint = run.constraint.clone().map(|c| crate::structured::for_engine(c, common.jump_forward));
        GenerationSpec {
            prompt: run.prompt.clone(),
            params,
            pipeline: run.pipeline.clone(),
            logprobs: common.logprobs,
            constraint,
        }
    };
    Generation::start_group(state, (0..n).map(spec).collect(), log)
}

/// Queues an OpenAI chat / text generation, `n` choices of each prompt in `runs` (choice
/// `p * n + j` is the j-th of prompt p), and for `stream` opens the SSE response.
/// `legacy_prompt_chars`: the prompts' lengths in characters, for legacy completions logprobs.
fn start(
    state: &SharedState,
    body: &Map<String, Value>,
    kind: Kind,
    runs: Vec<Prepared>,
    log: &RequestLog,
    legacy_prompt_chars: Option<Vec<usize>>,
) -> ApiResult<Started> {
    let Some(common) = runs.first().map(|r| r.common.clone()) else {
        return Err(ApiError::invalid("The prompt is empty", Some("prompt")));
    };
    let mut gens = Vec::with_capacity(runs.len() * common.n);
    for run in runs {
        gens.extend(launch_group(state, body, common.n, run, log)?);
    }
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Text => "cmpl",
    };
    let meta = Meta {
        id: response::response_id(prefix),
        created: unix_now(),
        model: state.config.model_id.clone(),
        fingerprint: state.fingerprint.clone(),
    };
    let choices = Choices::new(gens);
    if !common.stream {
        return Ok(Started::Whole(choices, meta));
    }
    let opts = StreamOptions {
        kind,
        meta,
        include_usage: common.include_usage,
        keepalive: Duration::from_secs_f64(state.config.keepalive_secs),
        n: common.n,
        legacy_prompt_chars,
    };
    Ok(Started::Stream(openai_stream::response(choices, opts)))
}

/// A request ready to queue: its parameters, prompt ids, token budget and output routing.
pub(crate) struct Prepared {
    pub common: CommonParams,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub pipeline: PipelineConfig,
    /// Structured output: the compiled constraint every choice starts from.
    pub constraint: Option<ferrolm_grammar::Constraint>,
    /// Fill (docs/fill.md): what every choice may append as spans; None: off.
    pub fill: Option<ferrolm_core::FillPlan>,
}

/// A whole generation: all its output, why it ended, its usage and the stop string that ended it.
pub(crate) struct Outcome {
    pub all: Piece,
    pub reason: &'static str,
    pub usage: Usage,
    pub stop: Option<String>,
}

/// Runs every choice to its end, together; a failure of any is a 500.
async fn finished_all(choices: &mut Choices) -> ApiResult<Vec<Outcome>> {
    let all = futures_util::future::join_all(choices.generations().iter_mut().map(finished)).await;
    all.into_iter().collect()
}

/// Runs a non-streaming generation to its end; a failure is a 500.
pub(crate) async fn finished(gen: &mut Generation) -> ApiResult<Outcome> {
    let mut all = gen.collect().await;
    match all.end.take() {
        Some(End::Finished { reason, usage, stop }) => Ok(Outcome { all, reason, usage, stop }),
        Some(End::Failed(message)) => Err(ApiError::internal(message)),
        None => Err(ApiError::internal("the generation ended without a result")),
    }
}
