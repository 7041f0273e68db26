//! Raw-JSON helpers for the server: mlx_lm.server's `validate_model_parameters` on the request
//! body, with Python's type rules, and the conversion of a valid body into `SamplingParams`.
//!
//! Python rules reproduced: `isinstance(True, int)` holds (a JSON boolean passes an `int` check and
//! compares as 0/1); a JSON number written with `.` or an exponent is a `float` and fails an `int`
//! check; `xtc_probability` and `xtc_threshold` must be floats, so `0` (an int) is rejected, as in
//! mlx; an explicit `null` fails every non-optional check. Checks run in server.py's order and the
//! first failure is reported, so the body-level fields that are not sampling parameters (stream,
//! max_tokens, num_draft_tokens, model, adapters) are checked here too, in their places.
//!
//! logit_bias keys go through Python's `int()` (surrounding whitespace, a sign, `_` between digits)
//! and values through `float()` (numbers, booleans, numeric strings, `inf`/`nan`). Deviations: a
//! negative or non-u32 key and a `null`/array/object value are rejected with the same message
//! (mlx raises an uncaught TypeError or indexes from the end); non-ASCII digits are not accepted.

use crate::validate::MAX_TOP_LOGPROBS;
use ferrolm_core::SamplingParams;
use serde_json::{Map, Value};

/// Python's view of a JSON value's type.
#[derive(Clone, Copy, PartialEq)]
enum Ty {
    Bool,
    Int,
    Float,
    Str,
    Dict,
    Other,
}

fn ty(v: &Value) -> Ty {
    match v {
        Value::Bool(_) => Ty::Bool,
        Value::Number(n) if n.is_f64() => Ty::Float,
        Value::Number(_) => Ty::Int,
        Value::String(_) => Ty::Str,
        Value::Object(_) => Ty::Dict,
        _ => Ty::Other,
    }
}

/// A numeric value as Python compares it (bools are 0 and 1).
fn num(v: &Value) -> Option<f64> {
    match v {
        Value::Bool(b) => Some(*b as u8 as f64),
        Value::Number(n) => n.as_f64(),
        _ => None,
    }
}

#[derive(Clone, Copy)]
enum Expect {
    Bool,
    Int,
    Float,
    Number,
    Str,
    Dict,
}

impl Expect {
    fn accepts(self, t: Ty) -> bool {
        match self {
            Expect::Bool => t == Ty::Bool,
            Expect::Int => matches!(t, Ty::Int | Ty::Bool),
            Expect::Float => t == Ty::Float,
            Expect::Number => matches!(t, Ty::Int | Ty::Bool | Ty::Float),
            Expect::Str => t == Ty::Str,
            Expect::Dict => t == Ty::Dict,
        }
    }

    /// How server.py names the expected type(s) in its message.
    fn name(self) -> &'static str {
        match self {
            Expect::Bool => "bool",
            Expect::Int => "int",
            Expect::Float => "float",
            Expect::Number => "('float', 'int')",
            Expect::Str => "str",
            Expect::Dict => "dict",
        }
    }
}

/// One `_validate(name, expected_type, min_val, max_val, optional, whitelist)` call.
struct Check {
    name: &'static str,
    expect: Expect,
    min: Option<i64>,
    max: Option<i64>,
    optional: bool,
    whitelist: Option<i64>,
}

const fn check(name: &'static str, expect: Expect, min: Option<i64>, max: Option<i64>) -> Check {
    Check { name, expect, min, max, optional: false, whitelist: None }
}

/// server.py's `validate_model_parameters`, in order.
const CHECKS: &[Check] = &[
    check("stream", Expect::Bool, None, None),
    check("max_tokens", Expect::Int, Some(1), None),
    check("temperature", Expect::Number, Some(0), None),
    check("top_p", Expect::Number, Some(0), Some(1)),
    check("top_k", Expect::Int, Some(0), None),
    check("min_p", Expect::Number, Some(0), Some(1)),
    check("num_draft_tokens", Expect::Int, Some(0), None),
    check("repetition_penalty", Expect::Number, Some(0), None),
    check("repetition_context_size", Expect::Int, Some(0), None),
    check("presence_penalty", Expect::Number, None, None),
    check("presence_context_size", Expect::Int, Some(0), None),
    check("frequency_penalty", Expect::Number, None, None),
    check("frequency_context_size", Expect::Int, Some(0), None),
    check("logprobs", Expect::Bool, None, None),
    Check { whitelist: Some(-1), ..check("top_logprobs", Expect::Int, Some(0), Some(MAX_TOP_LOGPROBS as i64)) },
    check("xtc_probability", Expect::Float, Some(0), Some(1)),
    check("xtc_threshold", Expect::Float, Some(0), Some(1)),
    check("requested_model", Expect::Str, None, None),
    Check { optional: true, ..check("adapter", Expect::Str, None, None) },
    Check { optional: true, ..check("seed", Expect::Int, None, None) },
    Check { optional: true, ..check("logit_bias", Expect::Dict, None, None) },
];

/// The body value server.py reads for a checked attribute; None when absent (the server's
/// default applies, and its defaults are valid).
fn field<'a>(body: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    match name {
        // `max_completion_tokens` wins unless absent or null.
        "max_tokens" => match body.get("max_completion_tokens") {
            Some(v) if !v.is_null() => Some(v),
            _ => body.get("max_tokens"),
        },
        "requested_model" => body.get("model"),
        "adapter" => body.get("adapters"),
        _ => body.get(name),
    }
}

fn run(c: &Check, v: &Value) -> Result<(), String> {
    if c.optional && v.is_null() {
        return Ok(());
    }
    if !c.expect.accepts(ty(v)) {
        return Err(format!("{} must be of type {}", c.name, c.expect.name()));
    }
    let Some(x) = num(v) else { return Ok(()) };
    if c.whitelist.is_some_and(|w| x == w as f64) {
        return Ok(());
    }
    if let Some(min) = c.min.filter(|&m| x < m as f64) {
        return Err(format!("{} must be at least {min}", c.name));
    }
    if let Some(max) = c.max.filter(|&m| x > m as f64) {
        return Err(format!("{} must be at most {max}", c.name));
    }
    Ok(())
}

/// mlx_lm.server's `validate_model_parameters` on a request body: the first error, verbatim.
pub fn validate_body(body: &Value) -> Result<(), String> {
    let Some(body) = body.as_object() else {
        return Err("Request should be a JSON dictionary".into());
    };
    for c in CHECKS {
        if let Some(v) = field(body, c.name) {
            run(c, v)?;
        }
    }
    if let Some(Value::Object(bias)) = body.get("logit_bias") {
        parse_logit_bias(bias)?;
    }
    Ok(())
}

const BIAS_ERROR: &str = "logit_bias must be a dict of int to float";

/// `{int(k): float(v) for k, v in logit_bias.items()}` with mlx_lm.server's error message.
pub fn parse_logit_bias(bias: &Map<String, Value>) -> Result<Vec<(u32, f32)>, String> {
    bias.iter()
        .map(|(k, v)| {
            let id = py_int(k).and_then(|i| u32::try_from(i).ok()).ok_or(BIAS_ERROR)?;
            let b = py_float_of(v).ok_or(BIAS_ERROR)?;
            Ok((id, b as f32))
        })
        .collect()
}

/// Python's `int(str)` for ASCII input.
fn py_int(s: &str) -> Option<i64> {
    let t = s.trim();
    let (neg, digits) = match t.as_bytes().first()? {
        b'-' => (true, &t[1..]),
        b'+' => (false, &t[1..]),
        _ => (false, t),
    };
    let clean = strip_underscores(digits)?;
    if clean.is_empty() || !clean.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let v: i64 = clean.parse().ok()?;
    Some(if neg { -v } else { v })
}

/// Python's `float(v)` for a JSON value.
fn py_float_of(v: &Value) -> Option<f64> {
    match v {
        Value::Bool(b) => Some(*b as u8 as f64),
        Value::Number(n) => n.as_f64(),
        Value::String(s) => py_float_str(s),
        _ => None,
    }
}

fn py_float_str(s: &str) -> Option<f64> {
    let t = s.trim();
    let body = t.trim_start_matches(['+', '-']);
    if t.len() - body.len() > 1 {
        return None;
    }
    let lower = body.to_ascii_lowercase();
    if ["inf", "infinity", "nan"].contains(&lower.as_str()) {
        return t.to_ascii_lowercase().parse().ok();
    }
    let clean = strip_underscores(t)?;
    let ok = clean.bytes().all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
    if !ok || !clean.bytes().any(|b| b.is_ascii_digit()) {
        return None;
    }
    clean.parse().ok()
}

/// Removes `_` that sit between two ASCII digits (PEP 515); any other `_` is an error.
fn strip_underscores(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    for (i, &c) in b.iter().enumerate() {
        if c == b'_' {
            let between = i > 0 && b[i - 1].is_ascii_digit() && b.get(i + 1).is_some_and(u8::is_ascii_digit);
            if !between {
                return None;
            }
        } else {
            out.push(c as char);
        }
    }
    Some(out)
}

/// Builds `SamplingParams` from a body that passed [`validate_body`]. `defaults` carries the
/// server-flag defaults (mlx: `--temp`, `--top-p`, `--top-k`, `--min-p`); the other fields fall
/// back to server.py's literals (penalties 0 = off, context sizes 20, xtc 0 / 0.1).
pub fn params_from_body(body: &Value, defaults: &SamplingParams) -> Result<SamplingParams, String> {
    validate_body(body)?;
    let empty = Map::new();
    let b = body.as_object().unwrap_or(&empty);
    let f = |k: &str| b.get(k).and_then(num);
    let u = |k: &str, d: usize| f(k).map_or(d, |x| x as usize);
    let top_logprobs = f("top_logprobs").unwrap_or(-1.0);
    let logprobs = b.get("logprobs").and_then(Value::as_bool).unwrap_or(false);
    Ok(SamplingParams {
        temperature: f("temperature").map_or(defaults.temperature, |x| x as f32),
        top_p: f("top_p").map_or(defaults.top_p, |x| x as f32),
        top_k: u("top_k", defaults.top_k),
        min_p: f("min_p").map_or(defaults.min_p, |x| x as f32),
        min_tokens_to_keep: defaults.min_tokens_to_keep,
        repetition_penalty: f("repetition_penalty").map(|x| x as f32).or(defaults.repetition_penalty),
        repetition_context_size: u("repetition_context_size", 20),
        presence_penalty: f("presence_penalty").map(|x| x as f32).or(defaults.presence_penalty),
        presence_context_size: u("presence_context_size", 20),
        frequency_penalty: f("frequency_penalty").map(|x| x as f32).or(defaults.frequency_penalty),
        frequency_context_size: u("frequency_context_size", 20),
        logit_bias: match b.get("logit_bias") {
            Some(Value::Object(m)) => parse_logit_bias(m)?,
            _ => Vec::new(),
        },
        xtc_probability: f("xtc_probability").map_or(0.0, |x| x as f32),
        xtc_threshold: f("xtc_threshold").map_or(0.1, |x| x as f32),
        // Python ints are unbounded; a negative seed wraps (mlx would reject it).
        seed: b.get("seed").and_then(|s| s.as_u64().or_else(|| s.as_i64().map(|i| i as u64))),
        logprobs: if top_logprobs > 0.0 {
            Some(top_logprobs as usize)
        } else if logprobs {
            Some(0)
        } else {
            None
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_int_and_float_parsing() {
        assert_eq!(py_int(" 12 "), Some(12));
        assert_eq!(py_int("+1_000"), Some(1000));
        assert_eq!(py_int("-3"), Some(-3));
        for bad in ["1.0", "1__0", "_1", "1_", "", "abc", "0x10", "--1"] {
            assert_eq!(py_int(bad), None, "{bad}");
        }
        assert_eq!(py_float_str(" 1.5 "), Some(1.5));
        assert_eq!(py_float_str("1_0.5"), Some(10.5));
        assert_eq!(py_float_str("-Infinity"), Some(f64::NEG_INFINITY));
        assert_eq!(py_float_str("1e3"), Some(1000.0));
        assert_eq!(py_float_str(".5"), Some(0.5));
        for bad in ["", "abc", "1,5", "1._5", "--1", "e5"] {
            assert_eq!(py_float_str(bad), None, "{bad}");
        }
    }
}
