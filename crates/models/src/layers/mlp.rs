use candle_core::{Result, Tensor};
use ferrolm_backend::Linear;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

/// down(act(gate(x)) * up(x)).
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub activation: Activation,
}

impl GatedMlp {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = self.gate.forward(x)?;
        let up = self.up.forward(x)?;
        let hidden = match self.activation {
            Activation::Silu => ferrolm_backend::ops::silu_mul(&gate, &up)?,
            Activation::GeluTanh => (gate.gelu()? * up)?,
        };
        self.down.forward(&hidden)
    }

    pub fn weight_bytes(&self) -> usize {
        self.gate.weight_bytes() + self.up.weight_bytes() + self.down.weight_bytes()
    }
}
