//! Reading a [`TokenizerSpec`] from GGUF metadata, with the defaults llama.cpp applies
//! (`llama_vocab::impl::load` in llama.cpp's `src/llama-vocab.cpp`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};

use crate::spec::TokenizerSpec;

type Metadata = HashMap<String, Value>;

/// `tokenizer.ggml.pre` values for which llama.cpp turns `add_bos` on by default.
const PRE_WITH_BOS: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "tekken",
    "chameleon",
];

impl TokenizerSpec {
    /// Reads only the metadata section of a GGUF file (tensor data is not touched).
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("opening GGUF file {}", path.display()))?;
        let mut reader = std::io::BufReader::new(&mut file);
        let content = Content::read(&mut reader)
            .map_err(|e| anyhow!("reading GGUF metadata of {}: {e}", path.display()))?;
        Self::from_gguf_metadata(&content.metadata)
    }

    pub fn from_gguf_metadata(md: &Metadata) -> Result<Self> {
        let model = get_string(md, "tokenizer.ggml.model")?
            .ok_or_else(|| anyhow!("GGUF has no tokenizer.ggml.model"))?;
        let is_spm = match model.as_str() {
            "llama" => true,
            "gpt2" => false,
            other => bail!("unsupported tokenizer model {other:?} (supported: gpt2, llama)"),
        };
        let pre = get_string(md, "tokenizer.ggml.pre")?;
        let tokens = read_tokens(md)?;
        let n = tokens.len();
        let mut spec = TokenizerSpec {
            token_types: get_i32_array(md, "tokenizer.ggml.token_type", n)?,
            scores: get_f32_array(md, "tokenizer.ggml.scores", n)?,
            merges: get_string_array(md, "tokenizer.ggml.merges")?.unwrap_or_default(),
            chat_template: get_string(md, "tokenizer.chat_template")?,
            model,
            pre,
            tokens,
            ..Default::default()
        };
        if !is_spm && spec.merges.is_empty() {
            bail!("GGUF gpt2 tokenizer has no tokenizer.ggml.merges");
        }
        apply_special_ids(md, &mut spec, is_spm)?;
        apply_flags(md, &mut spec, is_spm)?;
        Ok(spec)
    }
}

/// llama.cpp replaces empty token texts with a placeholder so every text maps to one id.
fn read_tokens(md: &Metadata) -> Result<Vec<String>> {
    let mut tokens = get_string_array(md, "tokenizer.ggml.tokens")?
        .ok_or_else(|| anyhow!("GGUF has no tokenizer.ggml.tokens"))?;
    for (i, t) in tokens.iter_mut().enumerate() {
        if t.is_empty() {
            *t = format!("[EMPTY_{i}]");
        }
    }
    Ok(tokens)
}

/// Default ids per model family, then the file's ids when they are in range (as llama.cpp does).
fn apply_special_ids(md: &Metadata, spec: &mut TokenizerSpec, is_spm: bool) -> Result<()> {
    let n = spec.tokens.len() as u64;
    let in_range = |id: Option<u32>| id.filter(|&i| (i as u64) < n);
    // llama.cpp's defaults: SPM <unk>=0 <s>=1 </s>=2; BPE bos=eos=11 (a GPT-2 era quirk).
    let (bos, eos, unk) = if is_spm {
        (Some(1), Some(2), Some(0))
    } else {
        (Some(11), Some(11), None)
    };
    let read = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
        Ok(match get_u64(md, key)? {
            Some(v) if v < n => Some(v as u32),
            _ => in_range(default),
        })
    };
    spec.bos_id = read("tokenizer.ggml.bos_token_id", bos)?;
    spec.eos_id = read("tokenizer.ggml.eos_token_id", eos)?;
    spec.unk_id = read("tokenizer.ggml.unknown_token_id", unk)?;
    spec.pad_id = read("tokenizer.ggml.padding_token_id", None)?;
    spec.eot_id = read("tokenizer.ggml.eot_token_id", None)?;
    spec.eom_id = read("tokenizer.ggml.eom_token_id", None)?;
    Ok(())
}

fn apply_flags(md: &Metadata, spec: &mut TokenizerSpec, is_spm: bool) -> Result<()> {
    let pre = spec.pre.as_deref().unwrap_or("");
    let default_bos = is_spm || PRE_WITH_BOS.contains(&pre);
    spec.add_bos = get_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_bos);
    spec.add_eos = get_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    spec.add_space_prefix = get_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(is_spm);
    if spec.add_bos && spec.bos_id.is_none() {
        bail!("tokenizer.ggml.add_bos_token is true, but there is no BOS token");
    }
    if spec.add_eos && spec.eos_id.is_none() {
        bail!("tokenizer.ggml.add_eos_token is true, but there is no EOS token");
    }
    Ok(())
}

fn get_string(md: &Metadata, key: &str) -> Result<Option<String>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => bail!(
            "GGUF key {key}: expected a string, found {:?}",
            v.value_type()
        ),
    }
}

fn get_bool(md: &Metadata, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => int_of(v)
            .map(|i| Some(i != 0))
            .with_context(|| format!("GGUF key {key}")),
    }
}

fn get_u64(md: &Metadata, key: &str) -> Result<Option<u64>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => {
            let i = int_of(v).with_context(|| format!("GGUF key {key}"))?;
            // A negative id (-1) means "none" in some converters.
            Ok(u64::try_from(i).ok())
        }
    }
}

fn int_of(v: &Value) -> Result<i64> {
    Ok(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x)?,
        Value::I64(x) => *x,
        Value::Bool(b) => *b as i64,
        other => bail!("expected an integer, found {:?}", other.value_type()),
    })
}

fn get_array<'a>(md: &'a Metadata, key: &str) -> Result<Option<&'a Vec<Value>>> {
    match md.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(v) => bail!(
            "GGUF key {key}: expected an array, found {:?}",
            v.value_type()
        ),
    }
}

fn get_string_array(md: &Metadata, key: &str) -> Result<Option<Vec<String>>> {
    let Some(arr) = get_array(md, key)? else {
        return Ok(None);
    };
    arr.iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => bail!(
                "GGUF key {key}: expected strings, found {:?}",
                other.value_type()
            ),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// Per-token array that must cover the vocabulary when present; absent gives an empty Vec.
fn get_i32_array(md: &Metadata, key: &str, n: usize) -> Result<Vec<i32>> {
    let Some(arr) = get_array(md, key)? else {
        return Ok(Vec::new());
    };
    if arr.len() < n {
        bail!("GGUF key {key}: {} entries for {n} tokens", arr.len());
    }
    arr.iter()
        .map(|v| {
            int_of(v)
                .map(|i| i as i32)
                .with_context(|| format!("GGUF key {key}"))
        })
        .collect()
}

fn get_f32_array(md: &Metadata, key: &str, n: usize) -> Result<Vec<f32>> {
    let Some(arr) = get_array(md, key)? else {
        return Ok(Vec::new());
    };
    if arr.len() < n {
        bail!("GGUF key {key}: {} entries for {n} tokens", arr.len());
    }
    arr.iter()
        .map(|v| match v {
            Value::F32(f) => Ok(*f),
            Value::F64(f) => Ok(*f as f32),
            other => int_of(other)
                .map(|i| i as f32)
                .with_context(|| format!("GGUF key {key}")),
        })
        .collect()
}
