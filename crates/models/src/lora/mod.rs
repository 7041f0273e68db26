//! LoRA adapters applied per request without merging: each targeted linear of a sequence that
//! runs with adapters computes `y + scale·B(A·x)` for that sequence's rows only, after the base
//! product. The base product runs as before for every row of the batch, so rows without an
//! adapter keep their bits whatever other rows (or earlier requests) ran with.
//!
//! Adapters come from PEFT folders (`peft.rs`), checked against the base model's shapes
//! ([`LoraBase`]) when they are mounted.

mod peft;
mod registry;

use crate::layers::BatchRows;
use candle_core::{Result, Tensor};
use std::sync::Arc;

pub use peft::load_peft;
pub use registry::{check_name, Adapters, NONE};

/// Loads the PEFT folder `dir` as adapter `name` for `model`, on its device; an error naming
/// the reason when the model takes no adapters or the adapter does not fit it.
pub fn mount(model: &dyn crate::CausalLm, name: &str, dir: &std::path::Path) -> std::result::Result<LoraAdapter, String> {
    let Some(base) = model.lora_base() else {
        return Err(format!("this model ({}) does not take LoRA adapters", model.info().architecture));
    };
    load_peft(name, dir, &base, model.device())
}

/// The linears an adapter may target, named as transformers' llama-family modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Target {
    pub const ALL: [Target; 7] = [Target::Q, Target::K, Target::V, Target::O, Target::Gate, Target::Up, Target::Down];

    /// The module's name in PEFT's `target_modules` (`q_proj`…).
    pub fn peft_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// The module's path inside a decoder layer (`self_attn.q_proj`…).
    fn module_path(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    fn index(self) -> usize {
        self as usize
    }

    fn from_peft_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.peft_name() == name)
    }
}

/// What an adapter must fit: the base model's dense linears, per layer and target, as
/// `(in, out)`; None where the layer has no such dense linear (a mixture-of-experts layer's MLP).
#[derive(Clone, Debug)]
pub struct LoraBase {
    pub architecture: String,
    pub layers: Vec<[Option<(usize, usize)>; 7]>,
    /// `(heads, kv_heads)` when the model's Q and K rows are permuted for interleaved RoPE (a
    /// llama GGUF, as llama.cpp's converter writes it): B's rows of q and k are permuted alike.
    pub permute_qk: Option<(usize, usize)>,
}

/// One targeted linear's pair, stored transposed for `x·Aᵀ·Bᵀ`: `a_t` `[in, r]`, `b_t` `[r, out]`.
struct Pair {
    a_t: Tensor,
    b_t: Tensor,
}

/// A mounted adapter: its low-rank pairs on the model's device, in its activation dtype.
pub struct LoraAdapter {
    pub name: String,
    pub path: std::path::PathBuf,
    pub rank: usize,
    pub alpha: f64,
    /// `alpha / r`, or `alpha / √r` with rsLoRA.
    pub scale: f64,
    pub targets: Vec<Target>,
    pub bytes: usize,
    layers: Vec<[Option<Pair>; 7]>,
}

impl LoraAdapter {
    /// The adapter's layers that have a pair for `target`.
    pub fn layers_with(&self, target: Target) -> usize {
        self.layers.iter().filter(|l| l[target.index()].is_some()).count()
    }

    /// `scale·B(A·x)` for `target` of `layer`, or None where this adapter does not touch it.
    fn delta(&self, layer: usize, target: Target, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(pair) = self.layers.get(layer).and_then(|l| l[target.index()].as_ref()) else { return Ok(None) };
        let x = x.to_dtype(pair.a_t.dtype())?;
        let d = x.matmul(&pair.a_t)?.matmul(&pair.b_t)?;
        (d * self.scale).map(Some)
    }
}

/// The adapters one request runs with, applied in order (`"a+b"`).
pub struct LoraStack {
    pub adapters: Vec<Arc<LoraAdapter>>,
}

impl LoraStack {
    /// The stack's name as requests spell it (`a+b`).
    pub fn name(&self) -> String {
        self.adapters.iter().map(|a| a.name.as_str()).collect::<Vec<_>>().join("+")
    }

    /// `y` plus each adapter's delta for `target` of `layer`, in stack order; `y` itself when
    /// none touches it.
    fn apply(&self, layer: usize, target: Target, x: &Tensor, y: Tensor) -> Result<Tensor> {
        let mut y = y;
        for a in &self.adapters {
            if let Some(d) = a.delta(layer, target, x)? {
                let d = d.to_dtype(y.dtype())?;
                y = (y + d)?;
            }
        }
        Ok(y)
    }
}

/// `y = base(x)` of `target` in `layer` with each sequence's adapters added to its own rows
/// (`rows.lora`); rows of sequences without adapters are copied unchanged. `y` itself when no
/// sequence of the batch has adapters (nothing is copied).
pub fn apply(rows: &BatchRows, layer: usize, target: Target, x: &Tensor, y: Tensor) -> Result<Tensor> {
    if rows.lora.iter().all(Option::is_none) {
        return Ok(y);
    }
    let mut parts = Vec::with_capacity(rows.spans.len());
    for (span, lora) in rows.spans.iter().zip(&rows.lora) {
        let part = y.narrow(0, span.row, span.len)?;
        parts.push(match lora {
            Some(stack) => stack.apply(layer, target, &x.narrow(0, span.row, span.len)?, part)?,
            None => part,
        });
    }
    Tensor::cat(&parts, 0)
}
