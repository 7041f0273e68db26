//! The request fields both completion endpoints share: the body as JSON, mlx_lm.server's
//! parameter validation (its messages, verbatim), `stream`, `stream_options`, `stop`,
//! `max_tokens` / `max_completion_tokens`, logprobs and the sampling fields.

use crate::config::ServerConfig;
use crate::errors::{ApiError, ApiResult};
use ferrolm_core::SamplingParams;
use ferrolm_sample::json::params_from_body;
use serde_json::{Map, Value};

/// Which logprobs a request wants (mlx-lm: `top_logprobs > 0` wins over `logprobs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogprobsMode {
    Off,
    /// `logprobs: true`: the sampled token's logprob.
    Sampled,
    /// `top_logprobs: n`: the top n alternatives with each token.
    Top(usize),
}

#[derive(Clone, Debug)]
pub struct CommonParams {
    pub stream: bool,
    pub include_usage: bool,
    /// As the request gave it; None: the server default (capped by the context).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub logprobs: LogprobsMode,
    /// OpenAI's `n`: choices generated for each prompt (1 unless asked).
    pub n: usize,
    /// ferrolm's `speculative`: false keeps the server's speculative decoding off for this
    /// request (the output is the same either way; only speed differs).
    pub speculative: bool,
    /// Structured output the request asks for (`response_format`, vLLM's `guided_*`…).
    pub constraint: Option<crate::structured::Requested>,
    /// ferrolm's `jump_forward` (default `--no-jump-forward`'s opposite): tokens a constraint
    /// forces are appended without sampling.
    pub jump_forward: bool,
    /// ferrolm's `fill` (default `--no-fill`'s opposite): spans the request determines (a tool
    /// call's scaffold, names, punctuation) appended and verified in one forward.
    pub fill: bool,
}

/// Fields that carry the prompt, never read by the sampling parser.
const PROMPT_FIELDS: &[&str] = &["messages", "prompt", "tools", "input", "system", "instructions"];

/// The most choices one request may ask for: each is a sequence of the engine's batch, so a
/// large `n` would take every seat (`--max-seqs`) from other clients.
pub const MAX_CHOICES: usize = 16;

/// Bodies from this size on are parsed on the blocking pool: parsing megabytes of JSON takes
/// tens of milliseconds, which on the HTTP worker would hold up every other request (`/health`
/// included).
const PARSE_OFF_WORKER: usize = 256 << 10;

/// [`parse_body`], off the HTTP worker for a large body.
pub async fn parse_body_async(bytes: axum::body::Bytes) -> ApiResult<Map<String, Value>> {
    if bytes.len() < PARSE_OFF_WORKER {
        return parse_body(&bytes);
    }
    let parsed = tokio::task::spawn_blocking(move || parse_body(&bytes)).await;
    parsed.map_err(|e| ApiError::internal(format!("parsing the body failed: {e}")))?
}

/// Parses the body; mlx_lm.server's messages for invalid JSON and a non-object body.
pub fn parse_body(bytes: &[u8]) -> ApiResult<Map<String, Value>> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("Invalid JSON in request body: {e}"), None))?;
    match value {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::invalid("Request should be a JSON dictionary", None)),
    }
}

pub fn parse_common(body: &Map<String, Value>, cfg: &ServerConfig, vocab_size: usize) -> ApiResult<CommonParams> {
    // The sampling parser reads only its own fields: the prompt's (possibly large) ones are
    // left out of its copy.
    let sampling_fields = body.iter().filter(|(k, _)| !PROMPT_FIELDS.contains(&k.as_str()));
    let whole = Value::Object(sampling_fields.map(|(k, v)| (k.clone(), v.clone())).collect());
    let sampling = params_from_body(&whole, &cfg.sampling).map_err(ApiError::from_validation)?;
    ferrolm_sample::validate_for_vocab(&sampling, vocab_size).map_err(ApiError::from_validation)?;
    let logprobs = match sampling.logprobs {
        None => LogprobsMode::Off,
        Some(0) => LogprobsMode::Sampled,
        Some(n) => LogprobsMode::Top(n),
    };
    Ok(CommonParams {
        stream: body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: include_usage(body)?,
        max_tokens: max_tokens(body),
        sampling,
        stop: stop_strings(body)?,
        logprobs,
        n: choices(body)?,
        speculative: flag(body, "speculative", true)?,
        constraint: crate::structured::from_body(body)?,
        jump_forward: flag(body, "jump_forward", cfg.jump_forward)?,
        fill: flag(body, "fill", cfg.fill)?,
    })
}

/// A boolean field (`default` when absent or null); anything else is a 400 naming it.
fn flag(body: &Map<String, Value>, name: &str, default: bool) -> ApiResult<bool> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(format!("{name} must be of type bool"), Some(name))),
    }
}

/// `n`: an integer in 1..=MAX_CHOICES; absent or null is 1.
fn choices(body: &Map<String, Value>) -> ApiResult<usize> {
    let err = |m: String| ApiError::invalid(m, Some("n"));
    match body.get("n") {
        None | Some(Value::Null) => Ok(1),
        // An integer beyond i64 is still an integer: too large, not of the wrong type.
        Some(Value::Number(v)) => match v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)) {
            Some(n) if n < 1 => Err(err("n must be at least 1".into())),
            Some(n) if n as usize > MAX_CHOICES => Err(err(format!("n must be at most {MAX_CHOICES}"))),
            Some(n) => Ok(n as usize),
            None => Err(err("n must be of type int".into())),
        },
        Some(_) => Err(err("n must be of type int".into())),
    }
}

/// `max_completion_tokens` wins unless absent or null (validated as an int >= 1 already).
fn max_tokens(body: &Map<String, Value>) -> Option<usize> {
    let v = match body.get("max_completion_tokens") {
        Some(v) if !v.is_null() => v,
        _ => body.get("max_tokens")?,
    };
    match v {
        Value::Bool(b) => Some(*b as usize),
        v => v.as_u64().map(|n| n as usize),
    }
}

fn include_usage(body: &Map<String, Value>) -> ApiResult<bool> {
    match body.get("stream_options") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => {
                Err(ApiError::invalid("stream_options.include_usage must be of type bool", Some("stream_options")))
            }
        },
        Some(_) => Err(ApiError::invalid("stream_options must be of type dict", Some("stream_options"))),
    }
}

/// `stop`: a string or a list of strings; empty strings are ignored.
fn stop_strings(body: &Map<String, Value>) -> ApiResult<Vec<String>> {
    let err = || ApiError::invalid("stop must be of type str or list of str", Some("stop"));
    let list = match body.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            items.iter().map(|v| v.as_str().map(str::to_string).ok_or_else(err)).collect::<ApiResult<Vec<_>>>()?
        }
        Some(_) => return Err(err()),
    };
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> ApiResult<CommonParams> {
        let Value::Object(m) = v else { panic!() };
        parse_common(&m, &ServerConfig::default(), 1000)
    }

    #[test]
    fn defaults_and_fields() {
        let p = parse(json!({"messages": []})).unwrap();
        assert!(!p.stream && !p.include_usage);
        assert_eq!(p.max_tokens, None);
        assert_eq!(p.logprobs, LogprobsMode::Off);
        assert_eq!(p.n, 1);
        assert_eq!(parse(json!({"n": 3})).unwrap().n, 3);
        let p = parse(json!({"stream": true, "stream_options": {"include_usage": true},
            "max_tokens": 5, "max_completion_tokens": 7, "stop": ["a", ""], "temperature": 0.5,
            "logprobs": true, "top_logprobs": 3, "seed": 4}))
        .unwrap();
        assert!(p.stream && p.include_usage);
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(p.stop, vec!["a"]);
        assert_eq!(p.logprobs, LogprobsMode::Top(3));
        assert_eq!(p.sampling.seed, Some(4));
        assert_eq!(p.sampling.temperature, 0.5);
        let p = parse(json!({"logprobs": true, "stop": "x"})).unwrap();
        assert_eq!(p.logprobs, LogprobsMode::Sampled);
        assert_eq!(p.stop, vec!["x"]);
    }

    #[test]
    fn errors_name_the_field_with_mlx_messages() {
        let cases = [
            (json!({"temperature": "hot"}), "temperature must be of type ('float', 'int')", "temperature"),
            (json!({"top_p": 2}), "top_p must be at most 1", "top_p"),
            (json!({"max_tokens": 0}), "max_tokens must be at least 1", "max_tokens"),
            (json!({"max_tokens": 1.5}), "max_tokens must be of type int", "max_tokens"),
            (json!({"logprobs": 1}), "logprobs must be of type bool", "logprobs"),
            (json!({"top_logprobs": 12}), "top_logprobs must be at most 11", "top_logprobs"),
            (json!({"stop": 3}), "stop must be of type str or list of str", "stop"),
            (json!({"stream_options": 1}), "stream_options must be of type dict", "stream_options"),
            (json!({"n": 0}), "n must be at least 1", "n"),
            (json!({"n": -2}), "n must be at least 1", "n"),
            (json!({"n": 17}), "n must be at most 16", "n"),
            (json!({"n": 1.5}), "n must be of type int", "n"),
            (json!({"n": "2"}), "n must be of type int", "n"),
            (json!({"n": true}), "n must be of type int", "n"),
            (
                json!({"temperature": 1, "top_k": 5000}),
                "`top_k` has to be an integer in the (0, 1000) interval, but is 5000.",
                "top_k",
            ),
        ];
        for (body, msg, param) in cases {
            let e = parse(body).unwrap_err();
            assert_eq!(e.message, msg);
            assert_eq!(e.param.as_deref(), Some(param), "{msg}");
        }
    }

    #[test]
    fn body_must_be_a_json_object() {
        assert_eq!(parse_body(b"[1]").unwrap_err().message, "Request should be a JSON dictionary");
        assert!(parse_body(b"{bad").unwrap_err().message.starts_with("Invalid JSON in request body: "));
    }
}
