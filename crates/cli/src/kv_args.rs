//! `--kv-bits` / `--kv-group-size`: how the model's full-attention layers cache keys and values
//! (see docs/kv_quant.md). Applied once, right after the model loads.

use crate::{CliError, CliResult};
use ferrolm_kv::{KvQuant, KvScheme};
use ferrolm_models::CausalLm;

/// Values per quantization group by default (docs/kv_quant.md: chosen by KL on SmolLM2-135M and
/// Qwen2.5-Coder-0.5B).
pub const DEFAULT_GROUP: usize = 32;

#[derive(clap::Args, Clone, Debug)]
pub struct KvArgs {
    /// Quantize the KV cache of full-attention layers to 8 or 4 bits (affine groups along
    /// head_dim, CPU only); 16 or unset: f16. Sliding-window layers stay f16.
    #[arg(long, value_parser = ["4", "8", "16"])]
    kv_bits: Option<String>,
    /// Values per quantization group along head_dim: 32, 64 or 128.
    #[arg(long, default_value_t = DEFAULT_GROUP)]
    kv_group_size: usize,
    /// Quantize keys and values as they are, without the Walsh–Hadamard rotation.
    #[arg(long)]
    kv_no_rotate: bool,
    /// TurboQuant KV (mlx-bun's scheme, docs/kv_quant.md): `turbo` (keys 8-bit affine, values
    /// 3-bit Lloyd–Max codes after a sign flip and Walsh–Hadamard rotation) or
    /// `turbo:k<bits>v<bits>` (keys 8 or 4, values 2, 3 or 4). CPU only; not with --kv-bits.
    #[arg(long)]
    kv_quant: Option<String>,
    /// With --kv-bits or --kv-quant: keep a layer's cache float until a step leaves it holding
    /// more than N tokens, then quantize all of it (mlx_lm's meaning; its default is 5000).
    /// 0: quantize from the first token.
    #[arg(long, default_value_t = 0)]
    quantized_kv_start: usize,
}

impl KvArgs {
    pub fn scheme(&self) -> CliResult<KvScheme> {
        let bits = self.kv_bits.as_deref().map(|b| b.parse::<u8>().map_err(|e| CliError::usage(format!("--kv-bits: {e}")))).transpose()?;
        if let Some(spec) = &self.kv_quant {
            if bits.is_some_and(|b| b != 16) || self.kv_no_rotate {
                return Err(CliError::usage("--kv-quant takes its own bits: it is not combined with --kv-bits or --kv-no-rotate"));
            }
            return KvScheme::from_kv_quant(spec).map(|s| s.starting_at(self.quantized_kv_start)).map_err(CliError::usage);
        }
        let scheme = KvScheme::from_flags(bits, self.kv_group_size).map_err(CliError::usage)?;
        Ok(match scheme {
            KvScheme::Quant(q) => KvScheme::Quant(q.with_rotation(!self.kv_no_rotate).starting_at(self.quantized_kv_start)),
            float => float,
        })
    }

    /// Sets the scheme on `model`; a model or device that cannot take it is a usage error.
    /// Also sets whether batched decode steps are captured (`FERROLM_BATCH_GRAPHS`, read here
    /// once).
    pub fn apply(&self, model: &mut dyn CausalLm) -> CliResult<()> {
        model.set_batch_graphs(ferrolm_models::batch_graph::BatchGraphSettings::from_env());
        model.set_kv_scheme(self.scheme()?).map_err(CliError::usage)
    }
}

/// `f16` (or `f32`) or `q<bits>g<group>` (`q8g32`, `q4g64`), `-norot` appended for a format
/// without the rotation, or TurboQuant: `turbo`, `turbo-k8v3`; `@N` appended: quantized only
/// once a cache holds more than N tokens (`q8g32@5000`).
pub fn parse_scheme(s: &str) -> Result<KvScheme, String> {
    if let Some((scheme, start)) = s.split_once('@') {
        let start = start.parse::<usize>().map_err(|_| format!("KV scheme `{s}`: `@` takes a token count"))?;
        return parse_scheme(scheme).map(|k| k.starting_at(start));
    }
    if s == "f16" || s == "f32" {
        return Ok(KvScheme::Float);
    }
    if s.starts_with("turbo") {
        return KvScheme::from_kv_quant(s);
    }
    let bad = || format!("KV scheme `{s}`: expected f16 or q<bits>g<group>[-norot] (q8g32, q4g64-norot)");
    let (s, rotate) = match s.strip_suffix("-norot") {
        Some(rest) => (rest, false),
        None => (s, true),
    };
    let rest = s.strip_prefix('q').ok_or_else(bad)?;
    let (bits, group) = rest.split_once('g').ok_or_else(bad)?;
    let (bits, group) = (bits.parse::<u8>().map_err(|_| bad())?, group.parse::<usize>().map_err(|_| bad())?);
    KvQuant::new(bits, group).map(|q| KvScheme::Quant(q.with_rotation(rotate)))
}

/// The name [`parse_scheme`] reads; a float cache is named by the CPU's KV dtype (f32 with
/// FERROLM_CPU_EXACT=1).
pub fn scheme_name(s: &KvScheme) -> String {
    match s {
        KvScheme::Float => format!("{:?}", ferrolm_backend::kv_dtype(&candle_core::Device::Cpu)).to_lowercase(),
        KvScheme::Quant(q) => q.name(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheme_names_round_trip() {
        for name in ["f16", "q8g32", "q8g64", "q4g32", "q4g128", "q8g32-norot", "turbo-k8v3", "turbo-k4v2", "q8g32@5000", "turbo-k8v3@64"] {
            let back = scheme_name(&parse_scheme(name).unwrap());
            assert!(back == name || (name == "f16" && back == "f32"), "{name}: {back}");
        }
        for bad in ["q8", "q3g32", "q8g48", "int8", "q8gx", "q8g32@", "q8g32@x"] {
            assert!(parse_scheme(bad).is_err(), "{bad}");
        }
    }
}
