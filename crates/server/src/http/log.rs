//! One log line per request, written when the request is over (its response body sent or
//! dropped): request id, method, route, status, client address, prompt and completion tokens,
//! time to first token, duration, finish reason, the error message of a refused request and the
//! unknown fields it carried. Target `ferrolm::access`, level INFO; JSON with `--log-format
//! json`. The prompt itself only with `--log-prompts`. The id comes from the client's
//! `x-request-id` when it sends a usable one, else is made here, and is sent back in
//! `x-request-id` on every response.

use crate::errors::ErrorNote;
use crate::state::SharedState;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, FromRequestParts, MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request's log record, shared by the middleware, the handler, its generations and the
/// response body; the line is written when the last holder lets go.
#[derive(Clone)]
pub struct RequestLog(Arc<Record>);

struct Record {
    id: String,
    method: String,
    route: String,
    client: Option<SocketAddr>,
    arrived: Instant,
    log_prompts: bool,
    fields: Mutex<Fields>,
}

#[derive(Default)]
struct Fields {
    status: u16,
    prompt_tokens: usize,
    completion_tokens: usize,
    ttft: Option<Duration>,
    finish: Option<&'static str>,
    error: Option<String>,
    ignored: Vec<String>,
    prompt: Option<String>,
    /// The client's `Idempotency-Key` header (durable generations: its retry resumes).
    idempotency_key: Option<String>,
}

impl RequestLog {
    fn new(id: String, method: String, route: String, client: Option<SocketAddr>, log_prompts: bool) -> Self {
        let fields = Mutex::new(Fields::default());
        RequestLog(Arc::new(Record { id, method, route, client, arrived: Instant::now(), log_prompts, fields }))
    }

    /// When the request came in (time to first token counts from here).
    pub fn arrived(&self) -> Instant {
        self.0.arrived
    }

    pub fn id(&self) -> &str {
        &self.0.id
    }

    fn fields(&self) -> std::sync::MutexGuard<'_, Fields> {
        self.0.fields.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first generated token of any choice.
    pub fn first_token(&self) {
        let mut f = self.fields();
        if f.ttft.is_none() {
            f.ttft = Some(self.0.arrived.elapsed());
        }
    }

    /// A prompt queued (n choices of one prompt count it once).
    pub fn prompt_tokens(&self, n: usize) {
        self.fields().prompt_tokens += n;
    }

    /// A choice ended with `completion` tokens for `reason`.
    pub fn finished(&self, completion: usize, reason: &'static str) {
        let mut f = self.fields();
        f.completion_tokens += completion;
        f.finish = Some(reason);
    }

    /// The request's `Idempotency-Key` header, when it sent a usable one.
    pub fn idempotency_key(&self) -> Option<String> {
        self.fields().idempotency_key.clone()
    }

    /// Fields of the request that the server does not know (accepted, not used).
    pub fn ignored(&self, names: Vec<String>) {
        self.fields().ignored.extend(names);
    }

    /// The prompt's text, asked for only with `--log-prompts`.
    pub fn prompt(&self, text: impl FnOnce() -> String) {
        if self.0.log_prompts {
            self.fields().prompt = Some(text());
        }
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(|p| p.into_inner());
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        tracing::info!(
            target: "ferrolm::access",
            id = %self.id,
            method = %self.method,
            route = %self.route,
            status = f.status,
            client = %self.client.map_or_else(|| "-".to_string(), |a| a.to_string()),
            prompt_tokens = f.prompt_tokens,
            completion_tokens = f.completion_tokens,
            ttft_ms = f.ttft.map(ms),
            duration_ms = ms(self.arrived.elapsed()),
            finish_reason = f.finish,
            error = f.error.as_deref(),
            ignored_fields = (!f.ignored.is_empty()).then(|| f.ignored.join(",")),
            prompt = f.prompt.as_deref(),
            "request"
        );
    }
}

impl RequestLog {
    /// A record of no request (unit tests); its line is written like any other.
    pub fn detached() -> Self {
        RequestLog::new(new_id(), String::new(), String::new(), None, false)
    }
}

/// Handlers take the request's record; outside the middleware (never in the server) a fresh one.
impl<S: Send + Sync> FromRequestParts<S> for RequestLog {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Infallible> {
        Ok(parts.extensions.get::<RequestLog>().cloned().unwrap_or_else(RequestLog::detached))
    }
}

/// The outermost middleware: makes the record, sets `x-request-id`, and keeps the record alive
/// with the response body so the line is written once the body is over.
pub async fn access_log(State(state): State<SharedState>, mut req: Request, next: Next) -> Response {
    let id = client_id(&req).unwrap_or_else(new_id);
    let route = match req.extensions().get::<MatchedPath>() {
        Some(p) => p.as_str().to_string(),
        None => req.uri().path().chars().take(200).collect(),
    };
    let client = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0);
    let log = RequestLog::new(id, req.method().to_string(), route, client, state.config.log_prompts);
    log.fields().idempotency_key = idempotency_key(&req);
    req.extensions_mut().insert(log.clone());
    let resp = next.run(req).await;
    {
        let mut f = log.fields();
        f.status = resp.status().as_u16();
        f.error = resp.extensions().get::<ErrorNote>().map(|n| n.0.clone());
    }
    let (mut parts, body) = resp.into_parts();
    if let Ok(v) = HeaderValue::from_str(log.id()) {
        parts.headers.insert("x-request-id", v);
    }
    Response::from_parts(parts, Body::new(Logged { inner: body, _log: log }))
}

/// A response body that holds the request's record until it is sent or dropped.
struct Logged {
    inner: Body,
    _log: RequestLog,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The line for a request hyper refused before it reached the router (bad request line,
/// headers too large, head timeout).
pub fn refused_at_http(client: SocketAddr, path: Option<&str>, status: u16) {
    tracing::info!(target: "ferrolm::access", id = "-", route = path.unwrap_or("-"), status, client = %client, "request");
}

/// A client's own id when it is short and plain (it is echoed into a header and the logs).
fn client_id(req: &Request) -> Option<String> {
    let v = req.headers().get("x-request-id")?.to_str().ok()?;
    let plain = !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    plain.then(|| v.to_string())
}

/// `Idempotency-Key`: printable ASCII, at most 255 bytes (longer or binary keys are ignored).
fn idempotency_key(req: &Request) -> Option<String> {
    let v = req.headers().get("idempotency-key")?.to_str().ok()?;
    (!v.is_empty() && v.len() <= 255).then(|| v.to_string())
}

fn new_id() -> String {
    format!("req_{:016x}", rand::random::<u64>())
}
