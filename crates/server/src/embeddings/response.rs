//! The `/v1/embeddings` response in OpenAI's shape: `{"object": "list", "data": [{"object":
//! "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`,
//! each embedding a list of floats or, for `encoding_format: "base64"`, its little-endian f32
//! bytes in base64 (what the openai SDKs decode with numpy's `frombuffer(…, dtype="float32")`).
//! Typed structs rather than `json!`: serde writes an f32 in its shortest form ("0.1"), a JSON
//! value would widen it to f64 first ("0.10000000149011612"), half again as many bytes.

use super::request::Encoding;
use base64::Engine;
use serde::Serialize;

#[derive(Serialize)]
pub struct Body<'a> {
    object: &'static str,
    data: Vec<Item>,
    model: &'a str,
    usage: Usage,
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    total_tokens: usize,
}

pub fn body(model: &str, vectors: Vec<Vec<f32>>, encoding: Encoding, prompt_tokens: usize) -> Body<'_> {
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| Item { object: "embedding", index, embedding: encode(v, encoding) })
        .collect();
    Body { object: "list", data, model, usage: Usage { prompt_tokens, total_tokens: prompt_tokens } }
}

fn encode(v: Vec<f32>, encoding: Encoding) -> Vector {
    match encoding {
        Encoding::Float => Vector::Float(v),
        Encoding::Base64 => {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn value(v: &[Vec<f32>], encoding: Encoding) -> Value {
        serde_json::to_value(body("m", v.to_vec(), encoding, 7)).unwrap()
    }

    #[test]
    fn float_and_base64_carry_the_same_values() {
        let v = vec![vec![1.0f32, -0.5, 0.1], vec![0.0, 2.5, -3.25]];
        let f = value(&v, Encoding::Float);
        assert_eq!(f["data"][1]["embedding"], json!([0.0, 2.5, -3.25]));
        assert_eq!(f["data"][1]["index"], 1);
        assert_eq!(f["usage"], json!({"prompt_tokens": 7, "total_tokens": 7}));
        let b = value(&v, Encoding::Base64);
        // 1.0, -0.5, 0.1 as little-endian f32: 0000803f 000000bf cdcccc3d.
        assert_eq!(b["data"][0]["embedding"], "AACAPwAAAL/NzMw9");
        assert_eq!(b["object"], "list");
        assert_eq!(b["data"][0]["object"], "embedding");
    }

    #[test]
    fn floats_are_written_in_their_shortest_f32_form() {
        let text = serde_json::to_string(&body("m", vec![vec![0.1f32, -0.062771834]], Encoding::Float, 1)).unwrap();
        assert!(text.contains("[0.1,-0.062771834]"), "{text}");
    }
}
