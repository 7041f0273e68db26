//! What turns an encoder's token states into one sentence embedding, as sentence-transformers
//! does it: `modules.json` lists the pipeline (Transformer → Pooling → Normalize),
//! `1_Pooling/config.json` (or whichever folder modules.json names) the pooling mode, and
//! `sentence_bert_config.json` the longest input. A folder without modules.json is a bare
//! encoder: sentence-transformers then mean-pools without normalizing, and so does ferrolm.

use crate::{LoadError, Result};
use candle_core::{DType, Tensor, D};
use serde_json::Value;
use std::path::Path;

/// How token states become one vector (sentence-transformers' `pooling_mode_*` keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The first token's state (`[CLS]`).
    Cls,
    /// The mean over all tokens (special tokens included, as sentence-transformers does).
    Mean,
    /// The element-wise maximum over all tokens.
    Max,
    /// The sum over all tokens divided by √length.
    MeanSqrtLen,
    /// The last token's state (decoder-style embedding models).
    LastToken,
}

/// The sentence-transformers pipeline after the encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct SentenceConfig {
    pub pooling: Pooling,
    /// L2-normalize the pooled vector (a `Normalize` module in modules.json).
    pub normalize: bool,
    /// `max_seq_length` of sentence_bert_config.json: the longest input, in tokens.
    pub max_seq_length: Option<usize>,
}

impl SentenceConfig {
    /// Reads the sentence-transformers files of `dir`; modules it cannot run (a `Dense`
    /// projection, a custom module) are an error naming them, never skipped.
    pub fn load(dir: &Path) -> Result<Self> {
        let max_seq_length = read_opt(&dir.join("sentence_bert_config.json"))?
            .and_then(|v| v.get("max_seq_length").and_then(Value::as_u64))
            .map(|n| n as usize);
        let modules_path = dir.join("modules.json");
        let Some(modules) = read_opt(&modules_path)? else {
            return Ok(Self { pooling: Pooling::Mean, normalize: false, max_seq_length });
        };
        let err = |message: String| LoadError::File { path: modules_path.display().to_string(), message };
        let list = modules.as_array().ok_or_else(|| err("not a JSON list".into()))?;
        let mut this = Self { pooling: Pooling::Mean, normalize: false, max_seq_length };
        for module in list {
            let kind = module.get("type").and_then(Value::as_str).unwrap_or("?");
            let sub = module.get("path").and_then(Value::as_str).unwrap_or("");
            match kind.rsplit('.').next().unwrap_or(kind) {
                "Transformer" => {}
                "Pooling" => this.pooling = pooling_mode(&dir.join(sub).join("config.json"))?,
                "Normalize" => this.normalize = true,
                _ => return Err(err(format!("module {kind:?} is not supported (supported: Transformer, Pooling, Normalize)"))),
            }
        }
        Ok(this)
    }

    /// Pools the token states `[tokens, hidden]` of one input into `[hidden]` (f32), normalized
    /// when the pipeline says so.
    pub fn pool(&self, states: &Tensor) -> candle_core::Result<Tensor> {
        let states = states.to_dtype(DType::F32)?;
        let len = states.dim(0)?;
        if len == 0 {
            candle_core::bail!("cannot pool an empty input")
        }
        let v = match self.pooling {
            Pooling::Cls => states.get(0)?,
            Pooling::LastToken => states.get(len - 1)?,
            Pooling::Mean => (states.sum(0)? / len as f64)?,
            Pooling::Max => states.max(0)?,
            Pooling::MeanSqrtLen => (states.sum(0)? / (len as f64).sqrt())?,
        };
        if !self.normalize {
            return Ok(v);
        }
        // torch.nn.functional.normalize: v / max(‖v‖, 1e-12).
        let norm = v.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
        v.broadcast_div(&norm)
    }
}

/// The one mode a Pooling config turns on; none or several is an error.
fn pooling_mode(path: &Path) -> Result<Pooling> {
    let err = |message: String| LoadError::File { path: path.display().to_string(), message };
    let cfg = read_opt(path)?.ok_or_else(|| err("missing (modules.json names a Pooling module here)".into()))?;
    // sentence-transformers ≥ 3 may write the mode as one string.
    if let Some(mode) = cfg.get("pooling_mode").and_then(Value::as_str) {
        return mode_named(mode).ok_or_else(|| err(format!("pooling_mode {mode:?} is not supported")));
    }
    let on: Vec<&str> = cfg
        .as_object()
        .map(|o| o.iter().filter(|(k, v)| k.starts_with("pooling_mode_") && v.as_bool() == Some(true)).map(|(k, _)| k.as_str()).collect())
        .unwrap_or_default();
    match on[..] {
        [key] => mode_named(key.trim_start_matches("pooling_mode_").trim_end_matches("_token").trim_end_matches("_tokens"))
            .ok_or_else(|| err(format!("{key} is not supported"))),
        _ => Err(err(format!("expected exactly one pooling mode, found {on:?}"))),
    }
}

fn mode_named(name: &str) -> Option<Pooling> {
    Some(match name {
        "cls" => Pooling::Cls,
        "mean" => Pooling::Mean,
        "max" => Pooling::Max,
        "mean_sqrt_len" => Pooling::MeanSqrtLen,
        "lasttoken" | "last" => Pooling::LastToken,
        _ => return None,
    })
}

/// A JSON file, or `None` when it does not exist.
fn read_opt(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let err = |message: String| LoadError::File { path: path.display().to_string(), message };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text).map(Some).map_err(|e| err(format!("invalid JSON: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn folder(files: &[(&str, &str)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrolm-sentence-{}-{}", std::process::id(), files.len()));
        std::fs::remove_dir_all(&dir).ok();
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    const MODULES: &str = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
        {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
        {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#;

    #[test]
    fn reads_the_minilm_pipeline_and_refuses_what_it_cannot_run() {
        let pooling = r#"{"word_embedding_dimension": 4, "pooling_mode_cls_token": false,
            "pooling_mode_mean_tokens": true, "pooling_mode_max_tokens": false}"#;
        let dir = folder(&[("modules.json", MODULES), ("1_Pooling/config.json", pooling), ("sentence_bert_config.json", r#"{"max_seq_length": 256}"#)]);
        let cfg = SentenceConfig::load(&dir).unwrap();
        assert_eq!(cfg, SentenceConfig { pooling: Pooling::Mean, normalize: true, max_seq_length: Some(256) });
        let dense = MODULES.replace("Normalize", "Dense");
        std::fs::write(dir.join("modules.json"), dense).unwrap();
        let e = SentenceConfig::load(&dir).unwrap_err().to_string();
        assert!(e.contains("Dense") && e.contains("not supported"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
        // A bare encoder folder: mean pooling, no normalization (sentence-transformers' default).
        let bare = folder(&[("config.json", "{}")]);
        assert_eq!(SentenceConfig::load(&bare).unwrap().pooling, Pooling::Mean);
        std::fs::remove_dir_all(&bare).ok();
    }

    #[test]
    fn pools_and_normalizes_like_sentence_transformers() {
        let states = Tensor::new(&[[3.0f32, 0.0], [1.0, 4.0]], &Device::Cpu).unwrap();
        let pool = |pooling, normalize| {
            let cfg = SentenceConfig { pooling, normalize, max_seq_length: None };
            cfg.pool(&states).unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(pool(Pooling::Mean, false), [2.0, 2.0]);
        assert_eq!(pool(Pooling::Cls, false), [3.0, 0.0]);
        assert_eq!(pool(Pooling::LastToken, false), [1.0, 4.0]);
        assert_eq!(pool(Pooling::Max, false), [3.0, 4.0]);
        let s = pool(Pooling::MeanSqrtLen, false);
        assert!((s[0] - 4.0 / 2f32.sqrt()).abs() < 1e-6);
        let n = pool(Pooling::Mean, true);
        assert!((n[0] - 0.5f32.sqrt()).abs() < 1e-6 && (n[1] - 0.5f32.sqrt()).abs() < 1e-6, "{n:?}");
    }
}
