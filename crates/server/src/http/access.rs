//! Who may call the server. Three checks before any handler, each refusing in the API's shape:
//!
//! - **Host** (when bound to a loopback address, or when `--allowed-host` names hosts): the
//!   DNS-rebinding guard. A web page can point its own domain at 127.0.0.1 and then call the
//!   local server as "same origin"; its requests still carry that domain in `Host`, which is
//!   refused (403) unless it is a loopback name, the bound address or an `--allowed-host`.
//! - **Origin**: a browser names the page that sends a request. Cross-origin requests are
//!   refused (403) unless `--cors-origin` allows that origin; CORS headers (tower-http) go only
//!   to allowed origins, and none by default. `/health` stays open.
//! - **API key** (`--api-key`, any number, or `FERROLM_API_KEY`): every route but `/health` and
//!   CORS preflights needs `Authorization: Bearer KEY` or `x-api-key: KEY` (401 otherwise).
//!   Keys are compared as SHA-256 digests, every configured key every time, without early
//!   exit, so the time taken says nothing about how much of a key was right.

use super::error_response;
use crate::errors::ApiError;
use crate::state::SharedState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

#[derive(Clone, Debug, Default)]
pub struct AccessConfig {
    /// SHA-256 of each accepted API key; empty: no key needed.
    pub api_keys: Vec<[u8; 32]>,
    /// Origins allowed cross-origin (`*`: any); empty: none (CORS off).
    pub cors_origins: Vec<String>,
    /// Host names accepted besides loopback names and the bound address.
    pub allowed_hosts: Vec<String>,
    /// The address the server is bound to.
    pub bind: Option<IpAddr>,
}

impl AccessConfig {
    pub fn set_api_keys<'a>(&mut self, keys: impl IntoIterator<Item = &'a str>) {
        self.api_keys = keys.into_iter().filter(|k| !k.is_empty()).map(digest).collect();
    }

    /// Whether Host is checked: bound to loopback, or hosts were named.
    fn checks_host(&self) -> bool {
        self.bind.is_none_or(|ip| ip.is_loopback()) || !self.allowed_hosts.is_empty()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Host and Origin, before CORS (so a refused origin never gets a preflight answer).
pub async fn check_origin(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let access = &state.config.access;
    let path = req.uri().path();
    if access.checks_host() {
        if let Some(host) = request_host(&req) {
            if !host_allowed(access, &host) {
                let e = ApiError::forbidden(format!("Host {host:?} is not allowed (--allowed-host)"), "host_not_allowed");
                return error_response(path, e);
            }
        }
    }
    if path != "/health" {
        if let Some(origin) = req.headers().get(header::ORIGIN) {
            if !origin_allowed(access, origin, req.headers()) {
                let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
                let e = ApiError::forbidden(format!("Origin {origin:?} is not allowed (--cors-origin)"), "origin_not_allowed");
                return error_response(path, e);
            }
        }
    }
    next.run(req).await
}

/// The API key, after CORS (so a refusal still carries the CORS headers a page needs to read it).
pub async fn check_key(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let keys = &state.config.access.api_keys;
    let path = req.uri().path();
    if keys.is_empty() || path == "/health" || is_preflight(&req) {
        return next.run(req).await;
    }
    let refusal = match presented_key(req.headers()) {
        None => "Missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`",
        Some(key) if key_matches(keys, key) => return next.run(req).await,
        Some(_) => "Incorrect API key provided",
    };
    let mut resp = error_response(path, ApiError::unauthorized(refusal));
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// CORS headers for the allowed origins; None when no origin is allowed (the default).
pub fn cors_layer(access: &AccessConfig) -> Option<CorsLayer> {
    if access.cors_origins.is_empty() {
        return None;
    }
    let origins = if access.cors_origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(access.cors_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    let methods = [Method::GET, Method::POST, Method::DELETE, Method::OPTIONS];
    Some(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods(methods)
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([header::HeaderName::from_static("x-request-id")])
            .max_age(Duration::from_secs(600)),
    )
}

fn is_preflight(req: &Request) -> bool {
    req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
}

fn presented_key(h: &HeaderMap) -> Option<&str> {
    let bearer = h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, key) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
    });
    bearer.or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim))
}

/// Constant time in the key: one digest, then every configured digest compared in full.
fn key_matches(keys: &[[u8; 32]], presented: &str) -> bool {
    let d = digest(presented);
    let mut matched = 0u8;
    for k in keys {
        let diff = k.iter().zip(&d).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        matched |= (diff == 0) as u8;
    }
    std::hint::black_box(matched) == 1
}

/// The host the request names (Host, else the URI's authority), without the port, lowercase.
fn request_host(req: &Request) -> Option<String> {
    let raw = match req.headers().get(header::HOST) {
        Some(h) => h.to_str().ok()?.to_string(),
        None => req.uri().authority()?.as_str().to_string(),
    };
    Some(strip_port(&raw).to_ascii_lowercase())
}

fn strip_port(hostport: &str) -> &str {
    if let Some(rest) = hostport.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match hostport.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => hostport,
    }
}

fn host_allowed(access: &AccessConfig, host: &str) -> bool {
    let loopback_name = host == "localhost" || host.ends_with(".localhost");
    let ip = host.parse::<IpAddr>().ok();
    let loopback_ip = ip.is_some_and(|ip| ip.is_loopback());
    let bound = ip.is_some_and(|ip| Some(ip) == access.bind);
    let named = access.allowed_hosts.iter().any(|h| h == "*" || h.eq_ignore_ascii_case(host));
    loopback_name || loopback_ip || bound || named
}

/// Same-origin (the Origin's host:port is the Host header) or listed by `--cors-origin`.
fn origin_allowed(access: &AccessConfig, origin: &HeaderValue, h: &HeaderMap) -> bool {
    let Ok(origin) = origin.to_str() else { return false };
    if access.cors_origins.iter().any(|o| o == "*" || o.eq_ignore_ascii_case(origin)) {
        return true;
    }
    let authority = origin.split_once("://").map(|(_, a)| a);
    let host = h.get(header::HOST).and_then(|v| v.to_str().ok());
    matches!((authority, host), (Some(a), Some(h)) if a.eq_ignore_ascii_case(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_only_in_full() {
        let mut a = AccessConfig::default();
        a.set_api_keys(["sk-one", "sk-two", ""]);
        assert_eq!(a.api_keys.len(), 2);
        assert!(key_matches(&a.api_keys, "sk-two"));
        assert!(!key_matches(&a.api_keys, "sk-tw"));
        assert!(!key_matches(&a.api_keys, ""));
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer  sk-one "));
        assert_eq!(presented_key(&h), Some("sk-one"));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("k"));
        assert_eq!(presented_key(&h), Some("k"));
    }

    #[test]
    fn hosts_and_origins() {
        let mut a = AccessConfig { bind: Some("127.0.0.1".parse().unwrap()), ..Default::default() };
        assert!(a.checks_host());
        for ok in ["localhost", "127.0.0.1", "::1", "app.localhost", "127.0.0.2"] {
            assert!(host_allowed(&a, ok), "{ok}");
        }
        assert!(!host_allowed(&a, "evil.example"));
        a.allowed_hosts = vec!["Box.lan".into()];
        assert!(host_allowed(&a, "box.lan"));
        assert_eq!(strip_port("[::1]:8080"), "::1");
        assert_eq!(strip_port("localhost:80"), "localhost");
        let open = AccessConfig { bind: Some("0.0.0.0".parse().unwrap()), ..Default::default() };
        assert!(!open.checks_host());
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        let same = HeaderValue::from_static("http://127.0.0.1:8080");
        assert!(origin_allowed(&a, &same, &h));
        assert!(!origin_allowed(&a, &HeaderValue::from_static("http://evil.example"), &h));
        a.cors_origins = vec!["http://evil.example".into()];
        assert!(origin_allowed(&a, &HeaderValue::from_static("http://evil.example"), &h));
    }
}
