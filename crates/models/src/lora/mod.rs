//! LoRA adapters applied per request without merging: each targeted linear of a sequence that
//! runs with adapters computes `y + scale·B(A·x)` for that sequence's rows only, after the base
//! product. The base product runs as before for every row of the batch, so rows without an
//! adapter keep their bits whatever other rows (or earlier requests) ran with.
//!
//! Adapters come from PEFT folders (`peft.rs`), checked against the base model's shapes
//! ([`LoraBase`]) when they are mounted.

mod host;
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

/// One targeted linear's pair. On the CPU as f32 rows for the per-row kernel (`host.rs`): A
/// `[r, in]`, B `[out, r]`; elsewhere as tensors in the activation dtype, transposed for
/// `x·Aᵀ·Bᵀ`: `a_t` `[in, r]`, `b_t` `[r, out]`.
enum Pair {
    Host { a: Vec<f32>, b: Vec<f32>, rank: usize },
    Device { a_t: Tensor, b_t: Tensor },
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

    fn pair(&self, layer: usize, target: Target) -> Option<&Pair> {
        self.layers.get(layer).and_then(|l| l[target.index()].as_ref())
    }

    /// `scale·B(A·x)` for `target` of `layer` on the device, or None where this adapter does
    /// not touch it.
    fn delta(&self, layer: usize, target: Target, x: &Tensor) -> Result<Option<Tensor>> {
        match self.pair(layer, target) {
            None => Ok(None),
            Some(Pair::Device { a_t, b_t }) => {
                let d = x.to_dtype(a_t.dtype())?.matmul(a_t)?.matmul(b_t)?;
                (d * self.scale).map(Some)
            }
            Some(Pair::Host { .. }) => candle_core::bail!("lora: a host pair on a device forward"),
        }
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
    match x.device().is_cpu() {
        true => host::apply(rows, layer, target, x, y),
        false => apply_device(rows, layer, target, x, y),
    }
}

/// [`apply`] with candle's products, per sequence (GPUs: bf16 activations and pairs).
fn apply_device(rows: &BatchRows, layer: usize, target: Target, x: &Tensor, y: Tensor) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::Span;
    use crate::RowKind;
    use candle_core::Device;

    fn adapter(a: &Tensor, b: &Tensor, host: bool) -> Arc<LoraAdapter> {
        let pair = match host {
            true => Pair::Host { a: a.flatten_all().unwrap().to_vec1().unwrap(), b: b.flatten_all().unwrap().to_vec1().unwrap(), rank: a.dim(0).unwrap() },
            false => Pair::Device { a_t: a.t().unwrap().contiguous().unwrap(), b_t: b.t().unwrap().contiguous().unwrap() },
        };
        let mut layer: [Option<Pair>; 7] = Default::default();
        layer[Target::Up.index()] = Some(pair);
        let (rank, alpha) = (a.dim(0).unwrap(), 6.0);
        Arc::new(LoraAdapter { name: "t".into(), path: "t".into(), rank, alpha, scale: alpha / rank as f64, targets: vec![Target::Up], bytes: 0, layers: vec![layer] })
    }

    /// The CPU's per-row kernel and the device path's candle products (run here on the CPU)
    /// compute the same deltas, and leave rows without adapters untouched.
    #[test]
    fn the_host_kernel_and_the_device_path_agree() {
        let dev = Device::Cpu;
        let (inp, out, r) = (96, 160, 8);
        let a = (Tensor::randn(0f32, 1., (r, inp), &dev).unwrap() / (inp as f64).sqrt()).unwrap();
        let b = Tensor::randn(0f32, 1., (out, r), &dev).unwrap();
        let x = Tensor::randn(0f32, 1., (7, inp), &dev).unwrap();
        let y = Tensor::randn(0f32, 1., (7, out), &dev).unwrap();
        let span = |row, len| Span { row, len, position: 0, kind: RowKind::Prompt };
        let rows_with = |host: bool| BatchRows {
            spans: vec![span(0, 3), span(3, 1), span(4, 3)],
            decode_rows: 0,
            lora: vec![Some(Arc::new(LoraStack { adapters: vec![adapter(&a, &b, host)] })), None, Some(Arc::new(LoraStack { adapters: vec![adapter(&a, &b, host)] }))],
        };
        let host: Vec<Vec<f32>> = host::apply(&rows_with(true), 0, Target::Up, &x, y.clone()).unwrap().to_vec2().unwrap();
        let device: Vec<Vec<f32>> = apply_device(&rows_with(false), 0, Target::Up, &x, y.clone()).unwrap().to_vec2().unwrap();
        let base: Vec<Vec<f32>> = y.to_vec2().unwrap();
        let d = host.iter().flatten().zip(device.iter().flatten()).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(d < 1e-4, "{d}");
        assert!(host[3] == base[3] && device[3] == base[3], "a row without adapters changed");
        let moved = host[0].iter().zip(&base[0]).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(moved > 1.0, "{moved}");
        // Other targets are untouched.
        let other: Vec<Vec<f32>> = host::apply(&rows_with(true), 0, Target::Gate, &x, y.clone()).unwrap().to_vec2().unwrap();
        assert!(other == base);
    }
}
