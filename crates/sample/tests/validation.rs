//! Validation messages equal mlx_lm.server's (tests/fixtures/sampler/validation.json).

mod common;

use common::fixture;
use ferrolm_core::SamplingParams;
use ferrolm_sample::json::{params_from_body, parse_logit_bias, validate_body};
use ferrolm_sample::{validate, Sampler, SamplerConfig};
use serde_json::{json, Value};

#[test]
fn body_validation_matches_mlx_server() {
    let f = fixture("validation.json");
    let bodies = f["bodies"].as_array().unwrap();
    assert!(bodies.len() > 40);
    for b in bodies {
        let want = b["error"].as_str().map(str::to_string);
        let got = validate_body(&b["body"]).err();
        assert_eq!(got, want, "body {}", b["body"]);
    }
}

#[test]
fn sampler_time_errors_match_mlx() {
    let f = fixture("validation.json");
    for c in f["sampler"].as_array().unwrap() {
        let p = &c["params"];
        let params = SamplingParams {
            temperature: 1.0,
            top_k: p.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize,
            min_p: p.get("min_p").and_then(Value::as_f64).unwrap_or(0.0) as f32,
            min_tokens_to_keep: p.get("min_tokens_to_keep").and_then(Value::as_u64).unwrap_or(1) as usize,
            xtc_probability: p.get("xtc_probability").and_then(Value::as_f64).unwrap_or(0.0) as f32,
            xtc_threshold: p.get("xtc_threshold").and_then(Value::as_f64).unwrap_or(0.1) as f32,
            ..Default::default()
        };
        let cfg = SamplerConfig { vocab_size: c["vocab"].as_u64().unwrap() as usize, ..Default::default() };
        let got = Sampler::new(&params, &cfg).err();
        assert_eq!(got.as_deref(), c["error"].as_str(), "params {p}");
    }
}

#[test]
fn typed_validation_uses_the_same_messages() {
    let f = fixture("validation.json");
    let mlx = |body: Value| -> String {
        f["bodies"].as_array().unwrap().iter().find(|b| b["body"] == body).unwrap()["error"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let bad = |p: SamplingParams| validate(&p).unwrap_err();
    let d = SamplingParams::default;
    assert_eq!(bad(SamplingParams { temperature: -0.1, ..d() }), mlx(json!({"temperature": -0.1})));
    assert_eq!(bad(SamplingParams { top_p: 1.5, ..d() }), mlx(json!({"top_p": 1.5})));
    assert_eq!(bad(SamplingParams { top_p: -0.01, ..d() }), mlx(json!({"top_p": -0.01})));
    assert_eq!(bad(SamplingParams { min_p: 2.0, ..d() }), mlx(json!({"min_p": 2})));
    assert_eq!(bad(SamplingParams { repetition_penalty: Some(-1.0), ..d() }), mlx(json!({"repetition_penalty": -1})));
    assert_eq!(bad(SamplingParams { logprobs: Some(12), ..d() }), mlx(json!({"logprobs": true, "top_logprobs": 12})));
    assert_eq!(bad(SamplingParams { xtc_probability: 1.5, ..d() }), mlx(json!({"xtc_probability": 1.5})));
    assert_eq!(
        bad(SamplingParams { xtc_threshold: 1.5, ..d() }),
        mlx(json!({"xtc_probability": 0.5, "xtc_threshold": 1.5}))
    );
    assert!(validate(&SamplingParams { temperature: f32::NAN, ..d() }).is_err());
    assert!(validate(&SamplingParams { logprobs: Some(11), top_p: 1.0, ..d() }).is_ok());
}

#[test]
fn bodies_convert_with_python_semantics() {
    let d = SamplingParams { temperature: 0.6, top_p: 0.95, ..Default::default() };
    let p =
        params_from_body(&json!({"top_k": true, "logit_bias": {" 12 ": "2.5", "1_0": true}, "top_logprobs": 3}), &d)
            .unwrap();
    assert_eq!(p.temperature, 0.6);
    assert_eq!(p.top_p, 0.95);
    assert_eq!(p.top_k, 1);
    assert_eq!(p.xtc_threshold, 0.1, "mlx_lm.server's default when absent");
    assert_eq!(p.logprobs, Some(3));
    let mut bias = p.logit_bias.clone();
    bias.sort_by_key(|b| b.0);
    assert_eq!(bias, vec![(10, 1.0), (12, 2.5)]);
    let q = params_from_body(&json!({"logprobs": true, "seed": 9, "repetition_penalty": 1.1}), &d).unwrap();
    assert_eq!((q.logprobs, q.seed, q.repetition_penalty), (Some(0), Some(9), Some(1.1)));
    assert_eq!(params_from_body(&json!({"temperature": -1}), &d).unwrap_err(), "temperature must be at least 0");
    let m = json!({"-1": 1.0});
    assert!(parse_logit_bias(m.as_object().unwrap()).is_err(), "negative ids are rejected");
}

#[test]
fn out_of_vocab_bias_is_an_error_not_a_panic() {
    let p = SamplingParams { logit_bias: vec![(50, 1.0)], ..Default::default() };
    let cfg = SamplerConfig { vocab_size: 10, ..Default::default() };
    assert!(Sampler::new(&p, &cfg).is_err());
}
