//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status that goes with them; Anthropic's shape for its endpoints ([`ApiError::anthropic_body`]).
//! Messages for parameter validation are mlx_lm.server's, verbatim.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 for a request the server will not run; `param` names the offending field.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 400 from one of mlx_lm.server's validation messages, which start with the field name.
    pub fn from_validation(message: String) -> Self {
        let param = message
            .split_whitespace()
            .next()
            .map(|w| w.trim_matches('`'))
            .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            // sample_utils.py names XTC's threshold without its prefix.
            .map(|w| if w == "threshold" { "xtc_threshold" } else { w })
            .map(str::to_string);
        let mut e = Self::invalid(message, None);
        e.param = param;
        e
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: None,
            code: None,
        }
    }

    pub fn method_not_allowed() -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: "Method not allowed".into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn queue_full() -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "The server is busy: the request queue is full. Retry later.".into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("engine_unavailable"),
        }
    }

    /// 500: this request failed inside the server; others are not affected.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// An error of the HTTP layer with its own status (408, 413, 414, 431…).
    pub fn http_status(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 400 for what hyper could not parse as HTTP (a bad request line or header).
    pub fn bad_request_line() -> Self {
        Self::http_status(400, "Bad request: the request line or a header is not valid HTTP/1.1").with_code("bad_request")
    }

    /// 431 (headers) or 414 (URI) beyond the HTTP layer's limit.
    pub fn head_too_large(status: u16) -> Self {
        let what = if status == 414 { "The request URI is too long" } else { "The request headers are too large" };
        Self::http_status(status, what).with_code("request_too_large")
    }

    /// 408: the request (head or body) did not arrive in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::http_status(408, message).with_code("request_timeout")
    }

    /// 413: a body beyond `--max-body-bytes`.
    pub fn body_too_large(limit: usize) -> Self {
        Self::http_status(413, format!("The request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"))
            .with_code("request_too_large")
    }

    /// 401 for a missing or wrong API key (OpenAI's type and code for it).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 403: the request is not allowed from where it came (Host, Origin).
    pub fn forbidden(message: impl Into<String>, code: &'static str) -> Self {
        ApiError { status: StatusCode::FORBIDDEN, message: message.into(), kind: "permission_error", param: None, code: Some(code) }
    }

    /// 503: every connection slot is taken.
    pub fn too_many_connections() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The server has too many open connections. Retry later.".into(),
            kind: "server_error",
            param: None,
            code: Some("too_many_connections"),
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The same error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with
/// Anthropic's type names for the status (its documented set).
impl ApiError {
    pub fn anthropic_body(&self) -> Value {
        let kind = match self.status.as_u16() {
            400 | 405 | 408 | 414 | 422 | 431 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": self.message}})
    }

    pub fn into_anthropic_response(self) -> Response {
        let body = self.anthropic_body();
        self.respond(body)
    }

    /// The response with `body`; a full queue says when to retry, in either shape. The message
    /// rides along in the response's extensions for the access log.
    fn respond(self, body: Value) -> Response {
        let mut response = (self.status, axum::Json(body)).into_response();
        response.extensions_mut().insert(ErrorNote(self.message.clone()));
        // A full queue drains within seconds, and a server shutting down comes back as soon as
        // it restarts: tell clients (and SDKs' retry logic) when to retry.
        if self.status == StatusCode::TOO_MANY_REQUESTS || self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        self.respond(body)
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// An error response's message, for the request's log line.
#[derive(Clone, Debug)]
pub struct ErrorNote(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_messages_name_their_field() {
        let e = ApiError::from_validation("top_p must be at most 1".into());
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = ApiError::from_validation("`top_k` has to be an integer".into());
        assert_eq!(e.param.as_deref(), Some("top_k"));
        let e = ApiError::from_validation("Request should be a JSON dictionary".into());
        assert_eq!(e.param, None);
        let b = e.body();
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert!(b["error"]["code"].is_null());
    }

    #[test]
    fn anthropic_shape_names_the_type_by_status() {
        let b = ApiError::invalid("max_tokens: Field required", None).anthropic_body();
        assert_eq!(
            b,
            json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "max_tokens: Field required"}})
        );
        assert_eq!(ApiError::internal("x").anthropic_body()["error"]["type"], "api_error");
        assert_eq!(ApiError::queue_full().anthropic_body()["error"]["type"], "rate_limit_error");
        assert_eq!(ApiError::not_found("x").anthropic_body()["error"]["type"], "not_found_error");
        assert_eq!(ApiError::unavailable("x").anthropic_body()["error"]["type"], "overloaded_error");
        let full = ApiError::queue_full().into_anthropic_response();
        assert_eq!(full.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(full.headers()[axum::http::header::RETRY_AFTER], "1");
    }
}
