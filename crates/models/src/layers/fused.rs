use candle_core::{Device, Result, Tensor, D};
use ferrolm_backend::{Linear, RowInput, Weight};

/// Projections of one input (Q|K|V, gate|up), run as one stacked product when the backend can
/// (same format and width), else one by one. `forward` returns each projection's output.
pub enum FusedLinear {
    Stacked { linear: Linear, widths: Vec<usize> },
    Separate(Vec<Linear>),
}

impl FusedLinear {
    pub fn new(weights: &[&Weight], biases: &[Option<Tensor>], device: &Device) -> Result<Self> {
        if Linear::can_stack(weights, device) {
            let widths = weights.iter().map(|w| w.dims[0]).collect();
            return Ok(Self::Stacked { linear: Linear::stacked(weights, biases, device)?, widths });
        }
        let parts = weights.iter().zip(biases).map(|(w, b)| Linear::new(w, b.clone(), device));
        Ok(Self::Separate(parts.collect::<Result<_>>()?))
    }

    /// Each projection of x, whose first `decode_rows` rows are decode rows (see
    /// `Linear::forward_rows`).
    pub fn forward_rows(&self, x: &Tensor, decode_rows: usize) -> Result<Vec<Tensor>> {
        match self {
            Self::Separate(parts) => parts.iter().map(|l| l.forward_rows(x, decode_rows)).collect(),
            Self::Stacked { linear, widths } => split(linear.forward_rows(x, decode_rows)?, widths),
        }
    }

    /// One decode row, its input made as `input` says (fused into the product where the backend
    /// can, see `Linear::forward_row`); returns each projection's output.
    pub fn forward_row(&self, input: RowInput<'_>) -> Result<Vec<Tensor>> {
        match self {
            Self::Stacked { linear, widths } => split(linear.forward_row(input, None)?, widths),
            Self::Separate(parts) => {
                let x = input.compose()?;
                parts.iter().map(|l| l.forward(&x)).collect()
            }
        }
    }

    /// The one stacked product and its projections' widths, when the backend could stack them.
    pub fn stacked(&self) -> Option<(&Linear, &[usize])> {
        match self {
            Self::Stacked { linear, widths } => Some((linear, widths)),
            Self::Separate(_) => None,
        }
    }

    pub fn weight_bytes(&self) -> usize {
        match self {
            Self::Stacked { linear, .. } => linear.weight_bytes(),
            Self::Separate(parts) => parts.iter().map(Linear::weight_bytes).sum(),
        }
    }
}

/// The side-by-side outputs of a stacked product, one view per projection.
fn split(y: Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let mut start = 0;
    widths
        .iter()
        .map(|&w| {
            let part = y.narrow(D::Minus1, start, w);
            start += w;
            part
        })
        .collect()
}
