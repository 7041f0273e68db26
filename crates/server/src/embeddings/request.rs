//! `POST /v1/embeddings` request fields as OpenAI defines them: `input` (a string, a list of
//! strings, a list of token ids, or a list of token-id lists), `encoding_format` (`float` or
//! `base64`), `dimensions`, and `model` / `user` (accepted; the served model answers).

use crate::errors::{ApiError, ApiResult};
use serde_json::{Map, Value};

/// The most inputs one request may hold (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One input to embed.
#[derive(Debug, PartialEq)]
pub enum Input {
    /// Text, tokenized with the model's special tokens (BERT: `[CLS] … [SEP]`).
    Text(String),
    /// The model's own token ids, used as given (as vLLM does): special tokens included.
    Ids(Vec<u32>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A JSON list of numbers.
    Float,
    /// The little-endian f32 bytes in base64 (what the openai SDKs ask for by default).
    Base64,
}

#[derive(Debug)]
pub struct EmbeddingRequest {
    pub inputs: Vec<Input>,
    pub encoding: Encoding,
    pub dimensions: Option<usize>,
}

pub fn parse(body: &Map<String, Value>, vocab: usize) -> ApiResult<EmbeddingRequest> {
    Ok(EmbeddingRequest {
        inputs: inputs(body.get("input"), vocab as u64)?,
        encoding: encoding(body.get("encoding_format"))?,
        dimensions: dimensions(body.get("dimensions"))?,
    })
}

/// `dimensions` must be the model's own width: shortening a vector is only meaningful for
/// models trained for it (Matryoshka), and a BERT sentence model is not.
pub fn check_dimensions(asked: Option<usize>, dim: usize) -> ApiResult<()> {
    match asked {
        Some(n) if n != dim => Err(ApiError::invalid(
            format!("This model does not support 'dimensions' = {n}: its embeddings have {dim} dimensions, which is the only value accepted"),
            Some("dimensions"),
        )),
        _ => Ok(()),
    }
}

fn inputs(input: Option<&Value>, vocab: u64) -> ApiResult<Vec<Input>> {
    let bad = || {
        ApiError::invalid(
            "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists",
            Some("input"),
        )
    };
    let items = match input {
        None | Some(Value::Null) => return Err(ApiError::invalid("'input' is a required property", Some("input"))),
        Some(Value::String(s)) => return Ok(vec![text(s.clone(), None)?]),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(bad()),
    };
    if items.is_empty() {
        return Err(ApiError::invalid("'input' must not be empty", Some("input")));
    }
    if items.iter().all(Value::is_number) {
        return Ok(vec![Input::Ids(token_ids(items, vocab, None)?)]);
    }
    if items.len() > MAX_INPUTS {
        return Err(ApiError::invalid(format!("'input' holds {} items; at most {MAX_INPUTS} are allowed", items.len()), Some("input")));
    }
    let one = |(i, v): (usize, &Value)| match v {
        Value::String(s) => text(s.clone(), Some(i)),
        Value::Array(ids) if ids.iter().all(Value::is_number) => Ok(Input::Ids(token_ids(ids, vocab, Some(i))?)),
        _ => Err(bad()),
    };
    items.iter().enumerate().map(one).collect()
}

/// `input` or `input[i]`, for messages.
fn name(index: Option<usize>) -> String {
    index.map_or_else(|| "'input'".to_string(), |i| format!("'input[{i}]'"))
}

fn text(s: String, index: Option<usize>) -> ApiResult<Input> {
    if s.is_empty() {
        return Err(ApiError::invalid(format!("{} must not be an empty string", name(index)), Some("input")));
    }
    Ok(Input::Text(s))
}

fn token_ids(items: &[Value], vocab: u64, index: Option<usize>) -> ApiResult<Vec<u32>> {
    if items.is_empty() {
        return Err(ApiError::invalid(format!("{} must not be an empty list of token ids", name(index)), Some("input")));
    }
    items
        .iter()
        .map(|v| v.as_u64().filter(|&id| id < vocab).map(|id| id as u32))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| ApiError::invalid(format!("{} token ids must be integers from 0 to {}", name(index), vocab - 1), Some("input")))
}

fn encoding(v: Option<&Value>) -> ApiResult<Encoding> {
    match v {
        None | Some(Value::Null) => Ok(Encoding::Float),
        Some(Value::String(s)) if s == "float" => Ok(Encoding::Float),
        Some(Value::String(s)) if s == "base64" => Ok(Encoding::Base64),
        Some(other) => Err(ApiError::invalid(
            format!("'encoding_format' must be 'float' or 'base64', not {other}"),
            Some("encoding_format"),
        )),
    }
}

fn dimensions(v: Option<&Value>) -> ApiResult<Option<usize>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(d) => match d.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            _ => Err(ApiError::invalid(format!("'dimensions' must be a positive integer, not {d}"), Some("dimensions"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_input(input: Value) -> ApiResult<Vec<Input>> {
        let body = json!({"input": input, "model": "any"});
        parse(body.as_object().unwrap(), 100).map(|r| r.inputs)
    }

    #[test]
    fn every_input_shape_openai_defines() {
        assert_eq!(parse_input(json!("hi")).unwrap(), [Input::Text("hi".into())]);
        assert_eq!(parse_input(json!(["a", "b"])).unwrap(), [Input::Text("a".into()), Input::Text("b".into())]);
        assert_eq!(parse_input(json!([1, 2, 3])).unwrap(), [Input::Ids(vec![1, 2, 3])]);
        assert_eq!(parse_input(json!([[1], [2, 3]])).unwrap(), [Input::Ids(vec![1]), Input::Ids(vec![2, 3])]);
        assert_eq!(parse_input(json!(["a", [5]])).unwrap(), [Input::Text("a".into()), Input::Ids(vec![5])]);
    }

    #[test]
    fn bad_inputs_are_400s_naming_the_field() {
        let cases = [
            (Value::Null, "required"),
            (json!(""), "empty string"),
            (json!([]), "must not be empty"),
            (json!(["ok", ""]), "'input[1]' must not be an empty string"),
            (json!([[1], []]), "'input[1]' must not be an empty list"),
            (json!([100]), "from 0 to 99"),
            (json!([-1]), "from 0 to 99"),
            (json!([1.5]), "from 0 to 99"),
            (json!({"text": "x"}), "must be a string"),
            (json!([{"text": "x"}]), "must be a string"),
            (json!(vec!["x"; MAX_INPUTS + 1]), "at most 2048"),
        ];
        for (input, want) in cases {
            let e = parse_input(input.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{input}");
            assert_eq!(e.param.as_deref(), Some("input"));
            assert!(e.message.contains(want), "{input}: {}", e.message);
        }
    }

    #[test]
    fn encoding_and_dimensions() {
        let req = |body: Value| parse(body.as_object().unwrap(), 10);
        assert_eq!(req(json!({"input": "x"})).unwrap().encoding, Encoding::Float);
        assert_eq!(req(json!({"input": "x", "encoding_format": "base64"})).unwrap().encoding, Encoding::Base64);
        let e = req(json!({"input": "x", "encoding_format": "int8"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("encoding_format"));
        assert_eq!(req(json!({"input": "x", "dimensions": 384})).unwrap().dimensions, Some(384));
        assert_eq!(req(json!({"input": "x", "dimensions": 0})).unwrap_err().param.as_deref(), Some("dimensions"));
        assert!(check_dimensions(Some(384), 384).is_ok() && check_dimensions(None, 384).is_ok());
        let e = check_dimensions(Some(128), 384).unwrap_err();
        assert!(e.message.contains("384") && e.param.as_deref() == Some("dimensions"), "{}", e.message);
    }
}
