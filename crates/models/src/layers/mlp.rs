use candle_core::{Result, Tensor};
use super::FusedLinear;
use ferrolm_backend::Linear;

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
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(x)?
            .try_into()
            .map_err(|_| candle_core::Error::Msg("gate_up: expected two projections".into()))?;
        let hidden = match self.activation {
            Activation::Silu => ferrolm_backend::ops::silu_mul(&gate, &up)?,
            Activation::GeluTanh => (gate.gelu()? * up)?,
        };
        self.down.forward(&hidden)
    }

    pub fn weight_bytes(&self) -> usize {
        self.gate_up.weight_bytes() + self.down.weight_bytes()
    }
}
