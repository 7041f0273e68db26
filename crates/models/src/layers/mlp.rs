use candle_core::{Result, Tensor};
use super::{BatchRows, FusedLinear};
use crate::lora::{self, Target};
use ferrolm_backend::norm::RmsNorm;
use ferrolm_backend::{Linear, RowInput};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

/// down(act(gate(x)) * up(x)).
pub struct GatedMlp {
    /// gate and up projections (stacked where the backend can).
    pub gate_up: FusedLinear,
    pub down: Linear,
    pub activation: Activation,
}

impl GatedMlp {
    /// x `[tokens, hidden]` whose first `decode_rows` rows are decode rows (see
    /// `Linear::forward_rows`).
    pub fn forward(&self, x: &Tensor, decode_rows: usize) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward_rows(x, decode_rows)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("gate_up: expected two projections".into()))?;
        let hidden = self.activate(&gate, &up)?;
        self.down.forward_rows(&hidden, decode_rows)
    }

    /// [`GatedMlp::forward`] with each sequence's LoRA adapters (`rows.lora`) added to the
    /// gate/up/down products of decoder layer `layer`.
    pub fn forward_adapted(&self, x: &Tensor, rows: &BatchRows, layer: usize) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward_rows(x, rows.decode_rows)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("gate_up: expected two projections".into()))?;
        let gate = lora::apply(rows, layer, Target::Gate, x, gate)?;
        let up = lora::apply(rows, layer, Target::Up, x, up)?;
        let hidden = self.activate(&gate, &up)?;
        let y = self.down.forward_rows(&hidden, rows.decode_rows)?;
        lora::apply(rows, layer, Target::Down, &hidden, y)
    }

    fn activate(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self.activation {
            Activation::Silu => ferrolm_backend::ops::silu_mul(gate, up),
            Activation::GeluTanh => ferrolm_backend::ops::gelu_tanh_mul(gate, up),
        }
    }

    /// One decode row: returns `x + down(act(gate(n)) * up(n))` with `n = norm(x)`, the norm
    /// fused into the gate|up product and the activation and residual add into the down product
    /// where the backend can.
    pub fn forward_row(&self, x: &Tensor, norm: &RmsNorm) -> Result<Tensor> {
        // One kernel for gate|up and the activation where the backend has it: the down product
        // then only copies its input.
        if let (Activation::Silu, Some((gate_up, [g, u]))) = (self.activation, self.gate_up.stacked()) {
            if g == u {
                if let Some(act) = gate_up.forward_row_swiglu(RowInput::Normed(x, norm))? {
                    return self.down.forward_row(RowInput::Plain(&act), Some(x));
                }
            }
        }
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward_row(RowInput::Normed(x, norm))?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("gate_up: expected two projections".into()))?;
        match self.activation {
            Activation::Silu => self.down.forward_row(RowInput::SiluMul(&gate, &up), Some(x)),
            Activation::GeluTanh => self.down.forward_row(RowInput::Plain(&(gate.gelu()? * up)?), Some(x)),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        self.gate_up.weight_bytes() + self.down.weight_bytes()
    }
}
