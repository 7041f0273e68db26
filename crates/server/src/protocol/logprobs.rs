//! Logprobs in mlx_lm.server's block, `{"content": [entry, …]}`, one entry per generated token
//! (reasoning, tool and EOS tokens included), and OpenAI's legacy completions block for an
//! integer `logprobs` ([`Legacy`]).
//!
//! mlx-lm writes `{id, logprob}` for `logprobs: true`, and for `top_logprobs: n` the first of the
//! top n merged with the list. We write a superset that is also OpenAI's shape: every entry has
//! `id`, `token`, `logprob`, `bytes` and `top_logprobs` (empty unless asked for), and the outer
//! entry is the *sampled* token (mlx's first-of-top-n; the same token under greedy decoding).
//! `token` is the token's text as OpenAI gives it (`" color"`, not the vocabulary piece
//! `"Ġcolor"`); a token that is only part of a UTF-8 character is named by its bytes
//! (`"bytes:\xe4"`, OpenAI's convention); `bytes` holds the exact UTF-8 bytes.

use crate::protocol::request::LogprobsMode;
use ferrolm_core::TokenLogprobs;
use ferrolm_text::Tokenizer;
use serde_json::{json, Map, Value};

/// A token's bytes as text: the string when they are valid UTF-8, else `bytes:\xNN…`.
pub fn token_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => bytes.iter().fold(String::from("bytes:"), |mut s, b| {
            s.push_str(&format!("\\x{b:02x}"));
            s
        }),
    }
}

fn one(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id);
    json!({
        "id": id,
        "token": token_text(bytes),
        "logprob": logprob,
        "bytes": bytes,
    })
}

/// The entry for one token, or None when the request asked for no logprobs.
pub fn entry(tok: &Tokenizer, mode: LogprobsMode, lp: Option<&TokenLogprobs>) -> Option<Value> {
    let lp = lp?;
    let top: Vec<Value> = match mode {
        LogprobsMode::Off => return None,
        LogprobsMode::Sampled => Vec::new(),
        LogprobsMode::Top(n) => lp.top.iter().take(n).map(|&(id, l)| one(tok, id, l)).collect(),
    };
    let mut e = one(tok, lp.token, lp.logprob);
    e["top_logprobs"] = Value::Array(top);
    Some(e)
}

/// The block for a choice, or None when nothing was collected (mlx-lm then omits the key).
pub fn block(entries: Vec<Value>) -> Option<Value> {
    (!entries.is_empty()).then(|| json!({"content": entries}))
}

/// OpenAI's legacy completions logprobs (`logprobs: k` on `/v1/completions`): parallel lists
/// `tokens`, `token_logprobs`, `top_logprobs` (one `{token: logprob}` dict per token: the
/// sampled token and the top k) and `text_offset`, each token's character offset from the
/// start of the prompt. One per choice; a stream's chunks continue its offsets.
pub struct Legacy {
    /// Characters before the next token: the prompt's and every whole character generated.
    chars: usize,
    /// The start of a character whose other bytes are still to come.
    partial: Vec<u8>,
}

impl Legacy {
    pub fn new(prompt_chars: usize) -> Self {
        Legacy { chars: prompt_chars, partial: Vec::new() }
    }

    /// The block for these entries (made by [`entry`]), or None when there are none.
    pub fn block(&mut self, entries: &[Value]) -> Option<Value> {
        if entries.is_empty() {
            return None;
        }
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        for e in entries {
            tokens.push(e["token"].clone());
            lps.push(e["logprob"].clone());
            let mut top = Map::new();
            top.insert(e["token"].as_str().unwrap_or_default().to_string(), e["logprob"].clone());
            for t in e["top_logprobs"].as_array().into_iter().flatten() {
                top.entry(t["token"].as_str().unwrap_or_default()).or_insert_with(|| t["logprob"].clone());
            }
            tops.push(Value::Object(top));
            offsets.push(self.chars);
            self.advance(&bytes_of(e));
        }
        Some(json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}))
    }

    /// Counts the characters these bytes complete (an invalid byte counts as one, as the
    /// lossy decoding of the text shows it).
    fn advance(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(s) => {
                    self.chars += s.chars().count();
                    self.partial.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.chars += std::str::from_utf8(&self.partial[..valid]).map_or(0, |s| s.chars().count());
                    match e.error_len() {
                        // An incomplete character at the end: wait for its other bytes.
                        None => {
                            self.partial.drain(..valid);
                            return;
                        }
                        Some(bad) => {
                            self.chars += 1;
                            self.partial.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }
}

fn bytes_of(entry: &Value) -> Vec<u8> {
    let list = entry["bytes"].as_array().map(Vec::as_slice).unwrap_or_default();
    list.iter().filter_map(|b| b.as_u64().map(|b| b as u8)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(token: &[u8], lp: f64, top: &[(&[u8], f64)]) -> Value {
        let t = |b: &[u8], l: f64| json!({"token": token_text(b), "logprob": l, "bytes": b});
        let mut v = t(token, lp);
        v["top_logprobs"] = top.iter().map(|(b, l)| t(b, *l)).collect();
        v
    }

    #[test]
    fn token_text_is_text_or_named_bytes() {
        assert_eq!(token_text(b" color"), " color");
        assert_eq!(token_text(&[0xe4]), "bytes:\\xe4");
        assert_eq!(token_text(&[0xe9, 0x80]), "bytes:\\xe9\\x80");
    }

    #[test]
    fn legacy_block_lists_offsets_from_the_prompt() {
        let mut l = Legacy::new(5);
        // "é" split over two tokens, then " ok": offsets count whole characters only.
        let b = l.block(&[e(&[0xc3], -0.5, &[]), e(&[0xa9], -0.1, &[]), e(b" ok", -1.0, &[(b" ok", -1.0), (b"!", -2.0)])]);
        let b = b.unwrap();
        assert_eq!(b["tokens"], json!(["bytes:\\xc3", "bytes:\\xa9", " ok"]));
        assert_eq!(b["token_logprobs"], json!([-0.5, -0.1, -1.0]));
        assert_eq!(b["text_offset"], json!([5, 5, 6]));
        assert_eq!(b["top_logprobs"][2], json!({" ok": -1.0, "!": -2.0}));
        assert_eq!(b["top_logprobs"][0], json!({"bytes:\\xc3": -0.5}));
        // A stream's next chunk goes on from there.
        let b = l.block(&[e(b"x", -0.2, &[])]).unwrap();
        assert_eq!(b["text_offset"], json!([9]));
        assert!(l.block(&[]).is_none());
    }
}
