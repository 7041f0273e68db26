//! `POST /v1/completions`: raw text in, raw text out (no template, no reasoning or tool
//! parsing; stop strings apply). `prompt` may be a batch (one completion per prompt, `n` each);
//! an integer `logprobs` asks for OpenAI's legacy logprobs block.

use super::prompt::{self, token_budget};
use super::{start, Prepared, Started};
use crate::choices::UsageSum;
use crate::errors::{ApiError, ApiResult};
use crate::http::log::RequestLog;
use crate::openai_stream::Kind;
use crate::protocol::fields;
use crate::pipeline::PipelineConfig;
use crate::protocol::logprobs::{self, Legacy};
use crate::protocol::request::{parse_body_async, parse_common};
use crate::protocol::response;
use crate::state::SharedState;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Json, Response};
use ferrolm_sample::MAX_TOP_LOGPROBS;
use serde_json::{Map, Value};

pub async fn handle(State(state): State<SharedState>, log: RequestLog, body: Bytes) -> Response {
    super::guarded(run(&state, body, &log)).await
}

async fn run(state: &SharedState, body: Bytes, log: &RequestLog) -> ApiResult<Response> {
    let mut body = parse_body_async(body).await?;
    fields::COMPLETIONS.check(&body, log, &state.warned_fields)?;
    let legacy = legacy_logprobs(&mut body)?;
    let vocab_size = state.bundle().model.info().vocab_size;
    let common = parse_common(&body, &state.config, vocab_size)?;
    refuse_unsupported(&body, common.n)?;
    let prompts = prompt::text(state, body.remove("prompt")).await?;
    let constraint = match common.constraint.clone() {
        Some(r) => Some(crate::structured::compile(state, r).await?),
        None => None,
    };
    let (budget, context) = (state.config.max_tokens, state.context_length());
    // Fill: a text prompt has no tools, so only copies (`--fill-copies`).
    let copies = common.fill && state.config.fill_copies && constraint.is_none();
    let fill = copies.then(|| ferrolm_core::FillPlan { tool_calls: Vec::new(), copies: true });
    let mut runs = Vec::with_capacity(prompts.len());
    let mut prompt_chars = Vec::with_capacity(prompts.len());
    for p in prompts {
        let max_tokens = token_budget(p.ids.len(), common.max_tokens, budget, context, "prompt")?;
        let pipeline = PipelineConfig { stops: common.stop.clone(), ..Default::default() };
        runs.push(Prepared { common: common.clone(), prompt: p.ids, max_tokens, pipeline, constraint: constraint.clone(), fill: fill.clone() });
        prompt_chars.push(p.chars);
    }
    let legacy_chars = legacy.then_some(prompt_chars);
    let (meta, mut choices) = match start(state, &body, Kind::Text, runs, log, legacy_chars.clone())? {
        Started::Stream(resp) => return Ok(resp),
        Started::Whole(choices, meta) => (meta, choices),
    };
    let n = common.n;
    let mut usage = UsageSum::new(n);
    let mut list = Vec::with_capacity(choices.len());
    for (i, out) in super::finished_all(&mut choices).await?.into_iter().enumerate() {
        usage.add(i, &out.usage);
        let lp = match &legacy_chars {
            Some(chars) => Legacy::new(chars[i / n]).block(&out.all.logprobs),
            None => logprobs::block(out.all.logprobs),
        };
        list.push(response::text_choice(i, &out.all.delta.content, lp, Some(out.reason)));
    }
    Ok(Json(response::text_completion(&meta, list, Some(usage.total))).into_response())
}

/// OpenAI's `logprobs` on completions is an integer k (the sampled token's logprob and the top
/// k alternatives, in the legacy block); mlx_lm.server's is a bool with `top_logprobs` (its
/// `{"content": […]}` block), which stays as it was. An integer is turned into mlx's fields
/// here; returns whether it was one.
fn legacy_logprobs(body: &mut Map<String, Value>) -> ApiResult<bool> {
    let Some(Value::Number(k)) = body.get("logprobs") else {
        return Ok(false);
    };
    let max = MAX_TOP_LOGPROBS as u64;
    let k = k.as_u64().filter(|&k| k <= max).ok_or_else(|| {
        ApiError::invalid(format!("logprobs must be a bool or an integer from 0 to {max}"), Some("logprobs"))
    })?;
    body.insert("logprobs".into(), Value::Bool(true));
    body.insert("top_logprobs".into(), Value::from(k));
    Ok(true)
}

/// Completions fields whose meaning ferrolm does not implement yet: a 400 rather than an answer
/// that silently ignores them.
fn refuse_unsupported(body: &Map<String, Value>, n: usize) -> ApiResult<()> {
    let refuse = |param: &str, what: &str| {
        Err(ApiError::invalid(format!("{param}: {what} is not supported yet"), Some(param)))
    };
    if body.get("echo").is_some_and(|v| v.as_bool() == Some(true)) {
        return refuse("echo", "returning the prompt (with its logprobs)");
    }
    if body.get("suffix").is_some_and(|v| v.as_str().is_some_and(|s| !s.is_empty())) {
        return refuse("suffix", "text after the insertion point");
    }
    match body.get("best_of") {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v.as_u64().is_some_and(|b| b as usize == n) => Ok(()),
        Some(_) => refuse("best_of", "choosing the best of several completions (best_of other than n)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn integer_logprobs_become_top_logprobs() {
        let mut b = obj(json!({"logprobs": 2}));
        assert!(legacy_logprobs(&mut b).unwrap());
        assert_eq!(b["logprobs"], true);
        assert_eq!(b["top_logprobs"], 2);
        let mut b = obj(json!({"logprobs": true, "top_logprobs": 3}));
        assert!(!legacy_logprobs(&mut b).unwrap());
        assert_eq!(b["top_logprobs"], 3);
        for bad in [json!(-1), json!(1.5), json!(12)] {
            let e = legacy_logprobs(&mut obj(json!({"logprobs": bad}))).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("logprobs"));
        }
    }

    #[test]
    fn unsupported_fields_are_refused() {
        assert!(refuse_unsupported(&obj(json!({"echo": false, "suffix": "", "best_of": 2})), 2).is_ok());
        for (body, param) in [
            (json!({"echo": true}), "echo"),
            (json!({"suffix": "x"}), "suffix"),
            (json!({"best_of": 3}), "best_of"),
        ] {
            let e = refuse_unsupported(&obj(body), 1).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
        }
    }
}
