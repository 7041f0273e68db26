//! PEFT LoRA folders: `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
//! `adapter_model.safetensors` (`…layers.N.self_attn.q_proj.lora_A.weight` `[r, in]` and
//! `…lora_B.weight` `[out, r]`). Options that change the arithmetic beyond `y + scale·B(A·x)`
//! (DoRA, LoRA biases, per-module ranks or alphas, fully trained modules) are refused by name.

use super::{LoraAdapter, LoraBase, Pair, Target};
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

#[derive(Deserialize)]
struct PeftConfig {
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    lora_bias: bool,
    bias: Option<String>,
    target_modules: Option<Value>,
    /// Every other option, checked against [`REFUSED`].
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Options that, when set (not null, false, `{}` or `[]`), change what an adapter computes or
/// which weights it replaces beyond `y + scale·B(A·x)` on the projections: refused by name.
const REFUSED: &[(&str, &str)] = &[
    ("modules_to_save", "fully trained module copies"),
    ("rank_pattern", "per-module ranks"),
    ("alpha_pattern", "per-module alphas"),
    ("layer_replication", "replicated layers"),
    ("trainable_token_indices", "trained token embeddings"),
    ("target_parameters", "adapted parameters"),
    ("alora_invocation_tokens", "activated LoRA"),
    ("use_qalora", "QA-LoRA"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("arrow_config", "Arrow routing"),
];

/// Whether a JSON option is set to something other than null, false, `{}` or `[]`.
fn is_set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

impl PeftConfig {
    fn read(dir: &Path) -> Result<Self, String> {
        let path = dir.join("adapter_config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let cfg: Self = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        cfg.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(cfg)
    }

    /// Refuses what ferrolm does not compute, naming the option.
    fn check(&self) -> Result<(), String> {
        if let Some(t) = self.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(format!("peft_type {t:?} is not supported (only LORA adapters are)"));
        }
        let refused = [
            (self.use_dora, "use_dora (DoRA) is not supported"),
            (self.fan_in_fan_out, "fan_in_fan_out is not supported (llama-family linears are [out, in])"),
            (self.lora_bias, "lora_bias is not supported"),
            (self.bias.as_deref().is_some_and(|b| b != "none"), "bias other than \"none\" is not supported"),
            (self.r == 0, "r must be at least 1"),
        ];
        if let Some((_, why)) = refused.iter().find(|(bad, _)| *bad) {
            return Err(why.to_string());
        }
        if let Some((name, what)) = REFUSED.iter().find(|(name, _)| is_set(self.other.get(*name))) {
            return Err(format!("{name} ({what}) is not supported"));
        }
        // A list of module names must name modules ferrolm adapts; a string (a regular
        // expression, or "all-linear") is checked through the tensors it produced.
        if let Some(Value::Array(names)) = &self.target_modules {
            for n in names {
                let name = n.as_str().unwrap_or_default();
                let last = name.rsplit('.').next().unwrap_or(name);
                if Target::from_peft_name(last).is_none() {
                    return Err(format!("target module {name:?} is not supported (supported: {})", supported()));
                }
            }
        }
        Ok(())
    }

    fn scale(&self) -> f64 {
        match self.use_rslora {
            true => self.lora_alpha / (self.r as f64).sqrt(),
            false => self.lora_alpha / self.r as f64,
        }
    }
}

fn supported() -> String {
    Target::ALL.iter().map(|t| t.peft_name()).collect::<Vec<_>>().join(", ")
}

/// A tensor name's layer, target and side (`A` or `B`).
fn parse_name(name: &str) -> Option<(usize, Target, char)> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    let (layer, rest) = rest.split_once('.')?;
    let target = Target::ALL.into_iter().find(|t| rest.starts_with(&format!("{}.", t.module_path())))?;
    let tail = &rest[target.module_path().len() + 1..];
    // `lora_A.weight`, or with the adapter's name (`lora_A.default.weight`).
    let side = match tail.split('.').collect::<Vec<_>>()[..] {
        ["lora_A", .., "weight"] => 'A',
        ["lora_B", .., "weight"] => 'B',
        _ => return None,
    };
    Some((layer.parse().ok()?, target, side))
}

/// Loads the PEFT folder `dir` as adapter `name` onto `device`, checked against `base`.
pub fn load_peft(name: &str, dir: &Path, base: &LoraBase, device: &Device) -> Result<LoraAdapter, String> {
    let cfg = PeftConfig::read(dir)?;
    let file = dir.join("adapter_model.safetensors");
    if !file.exists() {
        return Err(format!("{}: no such file (a PEFT LoRA folder holds adapter_config.json and adapter_model.safetensors)", file.display()));
    }
    let tensors = candle_core::safetensors::load(&file, &Device::Cpu).map_err(|e| format!("{}: {e}", file.display()))?;
    let pairs = pair_up(&tensors).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut layers: Vec<[Option<Pair>; 7]> = (0..base.layers.len()).map(|_| Default::default()).collect();
    let (mut targets, mut bytes) = (BTreeSet::new(), 0);
    for ((layer, target), (a, b)) in pairs {
        let (a, b) = fit(&cfg, base, layer, target, a, b).map_err(|e| format!("adapter {name:?} does not fit this {} model: {e}", base.architecture))?;
        let pair = place(a, b, cfg.r, device).map_err(|e| e.to_string())?;
        bytes += pair.bytes();
        layers[layer][target.index()] = Some(pair);
        targets.insert(target);
    }
    Ok(LoraAdapter {
        name: name.to_string(),
        path: dir.to_path_buf(),
        rank: cfg.r,
        alpha: cfg.lora_alpha,
        scale: cfg.scale(),
        targets: targets.into_iter().collect(),
        bytes,
        layers,
    })
}

/// A and B (f32) where the forward reads them: host rows on the CPU, transposed tensors in the
/// activation dtype elsewhere.
fn place(a: Tensor, b: Tensor, rank: usize, device: &Device) -> candle_core::Result<Pair> {
    if device.is_cpu() {
        let rows = |t: Tensor| t.flatten_all()?.to_vec1::<f32>();
        return Ok(Pair::Host { a: rows(a)?, b: rows(b)?, rank });
    }
    let dtype = ferrolm_backend::device::activation_dtype(device);
    let on_device = |t: Tensor| t.t()?.contiguous()?.to_dtype(dtype)?.to_device(device);
    Ok(Pair::Device { a_t: on_device(a)?, b_t: on_device(b)? })
}

impl Pair {
    fn bytes(&self) -> usize {
        match self {
            Pair::Host { a, b, .. } => (a.len() + b.len()) * 4,
            Pair::Device { a_t, b_t } => (a_t.elem_count() + b_t.elem_count()) * a_t.dtype().size_in_bytes(),
        }
    }
}

type Pairs<'a> = BTreeMap<(usize, Target), (&'a Tensor, &'a Tensor)>;

/// Every (layer, target)'s A and B; an unknown tensor or a half pair is an error.
fn pair_up(tensors: &HashMap<String, Tensor>) -> Result<Pairs<'_>, String> {
    let mut halves: BTreeMap<(usize, Target), [Option<&Tensor>; 2]> = BTreeMap::new();
    for (name, t) in tensors {
        let Some((layer, target, side)) = parse_name(name) else {
            return Err(format!("tensor {name:?} is not a LoRA pair of a decoder layer's projection (supported: {})", supported()));
        };
        halves.entry((layer, target)).or_default()[usize::from(side == 'B')] = Some(t);
    }
    if halves.is_empty() {
        return Err("no LoRA tensors".into());
    }
    halves
        .into_iter()
        .map(|((layer, target), h)| match h {
            [Some(a), Some(b)] => Ok(((layer, target), (a, b))),
            _ => Err(format!("layer {layer} {} has only one of lora_A and lora_B", target.peft_name())),
        })
        .collect()
}

/// A and B as f32 after checking them against the rank and the base linear's shape; B's rows
/// permuted as the base's when it is a llama GGUF's Q or K.
fn fit(cfg: &PeftConfig, base: &LoraBase, layer: usize, target: Target, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor), String> {
    let name = target.peft_name();
    let Some(shapes) = base.layers.get(layer) else {
        return Err(format!("it adapts layer {layer}, the model has {} layers", base.layers.len()));
    };
    let Some((inp, out)) = shapes[target.index()] else {
        return Err(format!("layer {layer} has no dense {name} (a mixture-of-experts layer?)"));
    };
    let (a_dims, b_dims) = (a.dims().to_vec(), b.dims().to_vec());
    if a_dims != [cfg.r, inp] || b_dims != [out, cfg.r] {
        return Err(format!(
            "layer {layer} {name}: lora_A is {a_dims:?} and lora_B {b_dims:?}, the model's {name} needs [{r}, {inp}] and [{out}, {r}] (r = {r})",
            r = cfg.r
        ));
    }
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).map_err(|e| e.to_string());
    let (a, mut b) = (f32(a)?, f32(b)?);
    if let Some((heads, kv_heads)) = base.permute_qk {
        let heads = match target {
            Target::Q => Some(heads),
            Target::K => Some(kv_heads),
            _ => None,
        };
        if let Some(h) = heads {
            b = permute_rows(&b, h).map_err(|e| e.to_string())?;
        }
    }
    Ok((a, b))
}

/// llama.cpp's `permute` of Q/K rows for interleaved RoPE: per head, `[2, d/2]` → `[d/2, 2]`.
fn permute_rows(w: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((heads, 2, rows / heads / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_parse_as_peft_writes_them() {
        let n = "base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight";
        assert_eq!(parse_name(n), Some((3, Target::K, 'B')));
        assert_eq!(parse_name("base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight"), Some((0, Target::Down, 'A')));
        assert_eq!(parse_name("base_model.model.lm_head.lora_A.weight"), None);
        assert_eq!(parse_name("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"), None);
    }

    #[test]
    fn options_that_change_the_arithmetic_are_refused_by_name() {
        let cfg = |extra: &str| serde_json::from_str::<PeftConfig>(&format!(r#"{{"peft_type": "LORA", "r": 4, "lora_alpha": 8{extra}}}"#)).unwrap();
        assert!(cfg("").check().is_ok());
        assert!(cfg(r#", "rank_pattern": {}, "modules_to_save": null, "use_qalora": false"#).check().is_ok());
        for (extra, word) in [
            (r#", "use_dora": true"#, "DoRA"),
            (r#", "bias": "all""#, "bias"),
            (r#", "rank_pattern": {"q_proj": 2}"#, "rank_pattern"),
            (r#", "modules_to_save": ["lm_head"]"#, "modules_to_save"),
            (r#", "target_modules": ["q_proj", "embed_tokens"]"#, "embed_tokens"),
        ] {
            let err = cfg(extra).check().unwrap_err();
            assert!(err.contains(word), "{extra}: {err}");
        }
        assert_eq!(cfg(r#", "use_rslora": true"#).scale(), 4.0);
        assert_eq!(cfg("").scale(), 2.0);
    }
}
