//! Hugging Face model folders: `config.json` + `model.safetensors` (or shards listed in
//! `model.safetensors.index.json`). Tensors are read in place from memory maps; models ask for
//! them by GGUF name and [`HfModel`] maps that to the checkpoint's name.
//!
//! The safetensors format is an 8-byte little-endian header length, a JSON header
//! `{name: {dtype, shape, data_offsets: [begin, end]}}` and the tensor bytes (row-major,
//! little-endian); it is parsed here directly, with every tensor's extent checked.

use crate::config::{GenerationConfig, HfConfig};
use crate::loader::{Progress, WeightSource};
use crate::{LoadError, Result};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use ferrolm_backend::cpu::formats::f16_to_f32;
use ferrolm_backend::{Weight, WeightBytes};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Element types ferrolm loads from safetensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StDType {
    F32,
    F16,
    BF16,
}

impl StDType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            _ => return None,
        })
    }

    fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    fn ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::BF16 => GgmlDType::BF16,
        }
    }
}

struct Entry {
    shard: usize,
    dtype: StDType,
    shape: Vec<usize>,
    /// Byte range inside the shard's memory map.
    start: usize,
    len: usize,
}

/// A tensor's bytes inside a memory map (weights are used in place on CPU).
struct MappedSlice {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl WeightBytes for MappedSlice {
    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

/// All safetensors files of a folder, indexed by tensor name.
pub struct SafetensorsFiles {
    paths: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    tensors: HashMap<String, Entry>,
    /// Bytes of all tensors (the denominator of `progress`).
    total_bytes: u64,
    pub(crate) progress: Progress,
}

impl SafetensorsFiles {
    /// `model.safetensors.index.json`'s shards when present, else every `model*.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let paths = shard_paths(dir)?;
        let mut this = Self {
            paths: Vec::new(),
            maps: Vec::new(),
            tensors: HashMap::new(),
            total_bytes: 0,
            progress: Progress::default(),
        };
        for path in paths {
            this.add_shard(&path)?;
        }
        Ok(this)
    }

    fn add_shard(&mut self, path: &Path) -> Result<()> {
        let err = |message: String| LoadError::File {
            path: path.display().to_string(),
            message,
        };
        let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        // SAFETY: opened read-only and treated as immutable for the model's lifetime.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| err(e.to_string()))?;
        let shard = self.maps.len();
        for (name, entry) in parse_header(&map, shard).map_err(err)? {
            self.total_bytes += entry.len as u64;
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(err(format!("tensor {name} appears in more than one shard")));
            }
        }
        self.paths.push(path.to_path_buf());
        self.maps.push(Arc::new(map));
        Ok(())
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor's entry, as it is handed to the model (which counts towards `progress`).
    fn entry(&self, name: &str) -> Result<&Entry> {
        let e = self.tensors.get(name).ok_or_else(|| LoadError::File {
            path: self.paths.first().map_or_else(String::new, |p| p.display().to_string()),
            message: format!("missing tensor {name}"),
        })?;
        self.progress.advance(e.len as u64, self.total_bytes);
        Ok(e)
    }

    fn bytes(&self, e: &Entry) -> &[u8] {
        &self.maps[e.shard][e.start..e.start + e.len]
    }

    /// A weight in place in the memory map, `[rows, cols]` as stored.
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let e = self.entry(name)?;
        let data: Arc<dyn WeightBytes> = if (self.maps[e.shard].as_ptr() as usize + e.start)
            % e.dtype.size()
            == 0
        {
            Arc::new(MappedSlice {
                map: self.maps[e.shard].clone(),
                start: e.start,
                len: e.len,
            })
        } else {
            // candle's dense fallback reinterprets the bytes as elements: keep them aligned.
            Arc::new(self.bytes(e).to_vec())
        };
        Ok(Weight {
            dtype: e.dtype.ggml(),
            dims: e.shape.clone(),
            data,
        })
    }

    /// A tensor converted to f32 (norms, biases).
    pub fn f32_values(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let e = self.entry(name)?;
        let b = self.bytes(e);
        let values = match e.dtype {
            StDType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StDType::F16 => b
                .chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            StDType::BF16 => b
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
                .collect(),
        };
        Ok((values, e.shape.clone()))
    }
}

fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let err = |path: &Path, message: String| LoadError::File {
        path: path.display().to_string(),
        message,
    };
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| err(&index, e.to_string()))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| err(&index, format!("invalid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| err(&index, "missing \"weight_map\"".into()))?;
        let files: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| err(dir, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(err(dir, "no model.safetensors (or model.safetensors.index.json)".into()));
    }
    Ok(paths)
}

fn parse_header(map: &[u8], shard: usize) -> std::result::Result<Vec<(String, Entry)>, String> {
    let n = map
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
        .ok_or("not a safetensors file: shorter than its header length")?;
    let header = map
        .get(8..8usize.saturating_add(n))
        .ok_or("not a safetensors file: truncated header")?;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(header)
        .map_err(|e| format!("not a safetensors file: header is not JSON: {e}"))?;
    let data = 8 + n;
    let mut out = Vec::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: &str| format!("tensor {name}: {what}");
        let dtype_name = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        // Integer tensors are buffers saved beside the weights (BERT's `position_ids`), never
        // weights: left out of the index rather than failing the whole file.
        if matches!(dtype_name, "I64" | "I32" | "I16" | "I8" | "U64" | "U32" | "U16" | "U8" | "BOOL") {
            continue;
        }
        let dtype = StDType::parse(dtype_name)
            .ok_or_else(|| bad(&format!("unsupported dtype {dtype_name} (supported: F32, F16, BF16)")))?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("missing shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("bad shape"))?;
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|o| o.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
            .unwrap_or_default();
        let [begin, end] = offsets[..] else {
            return Err(bad("missing data_offsets"));
        };
        let elems: usize = shape.iter().product();
        if end < begin || end - begin != elems * dtype.size() {
            return Err(bad(&format!("{} bytes for shape {shape:?}", end.saturating_sub(begin))));
        }
        if data + end > map.len() {
            return Err(bad(&format!(
                "truncated: needs bytes {}..{} but the file has {}",
                data + begin,
                data + end,
                map.len()
            )));
        }
        let entry = Entry {
            shard,
            dtype,
            shape,
            start: data + begin,
            len: end - begin,
        };
        out.push((name, entry));
    }
    Ok(out)
}

/// Which checkpoint names the GGUF layer names map to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// llama, mistral, qwen2: `ffn_norm` is `post_attention_layernorm`.
    Llama,
    /// gemma3: sandwich norms, and RMSNorm weights stored as `w - 1`.
    Gemma3,
    /// mixtral: the llama names, experts under `block_sparse_moe` as w1 (gate), w3 (up), w2 (down).
    Mixtral,
}

/// A Hugging Face model folder opened and validated: config, generation config, tensors.
pub struct HfModel {
    dir: PathBuf,
    pub config: HfConfig,
    pub generation: GenerationConfig,
    files: SafetensorsFiles,
    family: Family,
    /// Prefix of the decoder's tensors (`model.`, or a multimodal wrapper's language model).
    prefix: String,
    head: String,
}

impl HfModel {
    pub fn open(dir: &Path) -> Result<Self> {
        let config = HfConfig::load(dir)?;
        let generation = GenerationConfig::load(dir)?;
        let files = SafetensorsFiles::open(dir)?;
        let family = match config.model_type()?.as_str() {
            "gemma3" | "gemma3_text" => Family::Gemma3,
            "mixtral" => Family::Mixtral,
            _ => Family::Llama,
        };
        // Gemma 3 multimodal checkpoints nest the language model; older and newer transformers
        // name it differently.
        let prefixes = [
            ("model.", "lm_head.weight"),
            ("language_model.model.", "language_model.lm_head.weight"),
            ("model.language_model.", "lm_head.weight"),
        ];
        let (prefix, head) = prefixes
            .iter()
            .find(|(p, _)| files.has(&format!("{p}embed_tokens.weight")))
            .copied()
            .unwrap_or(prefixes[0]);
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            generation,
            files,
            family,
            prefix: prefix.to_string(),
            head: head.to_string(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn architecture(&self) -> Result<String> {
        self.config.model_type()
    }

    pub fn files(&self) -> &SafetensorsFiles {
        &self.files
    }

    /// The checkpoint's name for a GGUF tensor name (`blk.3.attn_q.weight` →
    /// `model.layers.3.self_attn.q_proj.weight`).
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        let p = &self.prefix;
        match gguf {
            "token_embd.weight" => return Some(format!("{p}embed_tokens.weight")),
            "output_norm.weight" => return Some(format!("{p}norm.weight")),
            "output.weight" => return Some(self.head.clone()),
            _ => {}
        }
        let rest = gguf.strip_prefix("blk.")?;
        let (layer, rest) = rest.split_once('.')?;
        let (tensor, kind) = rest.rsplit_once('.')?;
        let hf = match (self.family, tensor) {
            (_, "attn_norm") => "input_layernorm",
            (_, "attn_q") => "self_attn.q_proj",
            (_, "attn_k") => "self_attn.k_proj",
            (_, "attn_v") => "self_attn.v_proj",
            (_, "attn_output") => "self_attn.o_proj",
            (_, "attn_q_norm") => "self_attn.q_norm",
            (_, "attn_k_norm") => "self_attn.k_norm",
            (_, "ffn_gate") => "mlp.gate_proj",
            (_, "ffn_up") => "mlp.up_proj",
            (_, "ffn_down") => "mlp.down_proj",
            (Family::Mixtral, "ffn_gate_inp") => "block_sparse_moe.gate",
            (_, "ffn_gate_inp") => "mlp.gate",
            (_, "ffn_gate_shexp") => "mlp.shared_expert.gate_proj",
            (_, "ffn_up_shexp") => "mlp.shared_expert.up_proj",
            (_, "ffn_down_shexp") => "mlp.shared_expert.down_proj",
            (_, "ffn_gate_inp_shexp") => "mlp.shared_expert_gate",
            (Family::Llama | Family::Mixtral, "ffn_norm") => "post_attention_layernorm",
            (Family::Gemma3, "post_attention_norm") => "post_attention_layernorm",
            (Family::Gemma3, "ffn_norm") => "pre_feedforward_layernorm",
            (Family::Gemma3, "post_ffw_norm") => "post_feedforward_layernorm",
            _ => return None,
        };
        Some(format!("{p}layers.{layer}.{hf}.{kind}"))
    }

    fn mapped(&self, gguf: &str) -> Result<String> {
        self.hf_name(gguf).ok_or_else(|| LoadError::File {
            path: self.dir.display().to_string(),
            message: format!("no checkpoint name for tensor {gguf}"),
        })
    }
}

impl WeightSource for HfModel {
    fn weight(&self, name: &str) -> Result<Weight> {
        self.files.weight(&self.mapped(name)?)
    }

    fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (mut values, shape) = self.files.f32_values(&self.mapped(name)?)?;
        // Gemma's RMSNorm multiplies by (1 + w); GGUF stores 1 + w, checkpoints store w.
        if self.family == Family::Gemma3 && name.ends_with("norm.weight") {
            values.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(Tensor::from_vec(values, shape, device)?)
    }

    fn has(&self, name: &str) -> bool {
        self.hf_name(name).is_some_and(|n| self.files.has(&n))
    }

    fn origin(&self) -> String {
        self.dir.display().to_string()
    }

    /// Checkpoints keep one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's
    /// `block_sparse_moe.experts.3.w1.weight`).
    fn expert_weights(&self, name: &str, experts: usize) -> Result<Vec<Weight>> {
        let mixtral = self.family == Family::Mixtral;
        let proj = |tensor: &str| match (tensor, mixtral) {
            ("ffn_gate_exps", false) => Some("mlp.experts.{e}.gate_proj"),
            ("ffn_up_exps", false) => Some("mlp.experts.{e}.up_proj"),
            ("ffn_down_exps", false) => Some("mlp.experts.{e}.down_proj"),
            ("ffn_gate_exps", true) => Some("block_sparse_moe.experts.{e}.w1"),
            ("ffn_up_exps", true) => Some("block_sparse_moe.experts.{e}.w3"),
            ("ffn_down_exps", true) => Some("block_sparse_moe.experts.{e}.w2"),
            _ => None,
        };
        let parsed = name.strip_prefix("blk.").and_then(|r| r.strip_suffix(".weight")).and_then(|r| r.split_once('.'));
        let Some((layer, Some(proj))) = parsed.map(|(l, t)| (l, proj(t))) else {
            return Err(LoadError::File { path: self.dir.display().to_string(), message: format!("no checkpoint name for tensor {name}") });
        };
        let p = &self.prefix;
        (0..experts)
            .map(|e| self.files.weight(&format!("{p}layers.{layer}.{}.weight", proj.replace("{e}", &e.to_string()))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a safetensors file the way the reference library lays it out.
    pub(crate) fn write(path: &Path, tensors: &[(&str, StDType, Vec<usize>, Vec<u8>)]) {
        let mut header = serde_json::Map::new();
        let mut offset = 0;
        for (name, dtype, shape, bytes) in tensors {
            let dt = match dtype {
                StDType::F32 => "F32",
                StDType::F16 => "F16",
                StDType::BF16 => "BF16",
            };
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}),
            );
            offset += bytes.len();
        }
        let mut h = Value::Object(header).to_string().into_bytes();
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend(h);
        for (_, _, _, bytes) in tensors {
            out.extend(bytes);
        }
        std::fs::write(path, out).unwrap();
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_tensors_in_every_dtype_and_checks_extents() {
        let dir = std::env::temp_dir().join(format!("ferrolm-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vals = [1.5f32, -2.0, 0.25, 3.0];
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        let f16: Vec<u8> = [0x3e00u16, 0xc000, 0x3400, 0x4200]
            .iter()
            .flat_map(|h| h.to_le_bytes())
            .collect();
        write(
            &dir.join("model.safetensors"),
            &[
                ("a", StDType::F32, vec![2, 2], f32_bytes(&vals)),
                ("b", StDType::BF16, vec![4], bf16),
                ("c", StDType::F16, vec![4], f16),
            ],
        );
        let files = SafetensorsFiles::open(&dir).unwrap();
        for name in ["a", "b", "c"] {
            assert_eq!(files.f32_values(name).unwrap().0, vals, "{name}");
        }
        let w = files.weight("a").unwrap();
        assert_eq!(w.dims, vec![2, 2]);
        assert_eq!(w.dequantize(&Device::Cpu).unwrap().to_vec2::<f32>().unwrap(), [[1.5, -2.0], [0.25, 3.0]]);
        // A truncated file is an error naming the tensor.
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() - 2]).unwrap();
        let e = SafetensorsFiles::open(&dir).err().unwrap().to_string();
        assert!(e.contains("tensor c") && e.contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
