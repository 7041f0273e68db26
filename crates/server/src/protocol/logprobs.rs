//! Logprobs in mlx_lm.server's block, `{"content": [entry, …]}`, one entry per generated token
//! (reasoning, tool and EOS tokens included). `token` is the raw vocabulary piece (`Ġworld`), as
//! mlx-lm's `convert_ids_to_tokens` gives it.
//!
//! mlx-lm writes `{id, logprob}` for `logprobs: true`, and for `top_logprobs: n` the first of the
//! top n merged with the list. We write a superset that is also OpenAI's shape: every entry has
//! `id`, `token`, `logprob`, `bytes` and `top_logprobs` (empty unless asked for), and the outer
//! entry is the *sampled* token (mlx's first-of-top-n; the same token under greedy decoding).

use crate::protocol::request::LogprobsMode;
use ferrolm_core::TokenLogprobs;
use ferrolm_text::Tokenizer;
use serde_json::{json, Value};

fn one(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    json!({
        "id": id,
        "token": tok.id_to_token(id).unwrap_or_default(),
        "logprob": logprob,
        "bytes": tok.token_bytes(id),
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
