use super::GatedMlp;
use candle_core::{DType, Device, Result, Tensor};
use ferrolm_backend::Linear;

/// How a family turns router logits into expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// Whether the top-k softmax weights are divided by their sum (Qwen3-MoE's
    /// `norm_topk_prob`; always for Mixtral, never for Qwen2-MoE).
    pub renormalize: bool,
}

/// A shared expert that every token passes through, scaled by `sigmoid(gate(x))` (Qwen2-MoE).
pub struct SharedExpert {
    pub mlp: GatedMlp,
    pub gate: Option<Linear>,
}

/// A sparse mixture-of-experts MLP: a linear router, softmax over the experts, the top k per
/// token; each expert a gated MLP run only on the tokens routed to it, so only the selected
/// experts' weights are read (in prefill, each once for all of its tokens).
pub struct MoeMlp {
    pub router: Linear,
    pub experts: Vec<GatedMlp>,
    pub routing: Routing,
    pub shared: Option<SharedExpert>,
}

/// The tokens routed to one expert, in row order, with their routing weights.
#[derive(Default, Debug, PartialEq)]
struct Group {
    rows: Vec<u32>,
    weights: Vec<f32>,
}

impl MoeMlp {
    /// x `[tokens, hidden]` whose first `decode_rows` rows are decode rows; returns
    /// `[tokens, hidden]` (f32 on the CPU): per token, the experts' outputs summed in expert
    /// order (as transformers does), then the shared expert's.
    pub fn forward(&self, x: &Tensor, decode_rows: usize) -> Result<Tensor> {
        let (tokens, hidden) = x.dims2()?;
        let logits = self.router.forward_rows(x, decode_rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let groups = group_by_expert(&logits, self.experts.len(), self.routing);
        let active: Vec<usize> = (0..groups.len()).filter(|&e| !groups[e].rows.is_empty()).collect();
        let outputs = self.run_experts(x, decode_rows, &groups, &active)?;
        let mut out = vec![0f32; tokens * hidden];
        for (&e, y) in active.iter().zip(&outputs) {
            let group = &groups[e];
            for ((&row, &w), yr) in group.rows.iter().zip(&group.weights).zip(y) {
                let dst = &mut out[row as usize * hidden..(row as usize + 1) * hidden];
                dst.iter_mut().zip(yr).for_each(|(d, v)| *d += w * v);
            }
        }
        if let Some(shared) = &self.shared {
            self.add_shared(shared, x, decode_rows, &mut out, hidden)?;
        }
        Tensor::from_vec(out, (tokens, hidden), &Device::Cpu)?.to_device(x.device())?.to_dtype(x.dtype())
    }

    /// Each active expert on its rows: `[rows of its group][hidden]` f32, in `active`'s order.
    /// Decode-only forwards on the CPU run the experts side by side, one per thread at a time
    /// (each product on one thread: a decode token's experts are too small to split, and one
    /// handoff per layer replaces three per expert); a row's result is the same either way
    /// (each output element is computed whole by one thread), so the bits do not depend on it.
    fn run_experts(&self, x: &Tensor, decode_rows: usize, groups: &[Group], active: &[usize]) -> Result<Vec<Vec<Vec<f32>>>> {
        let one = |e: usize| -> Result<Vec<Vec<f32>>> {
            let group = &groups[e];
            // Decode rows come first in x, so they come first in each group: the expert runs
            // them on the decode kernels, whose result for a row does not depend on the others.
            let group_decode = group.rows.iter().take_while(|&&r| (r as usize) < decode_rows).count();
            let y = self.experts[e].forward(&gather(x, &group.rows)?, group_decode)?;
            y.to_dtype(DType::F32)?.to_vec2::<f32>()
        };
        if !(x.device().is_cpu() && decode_rows == x.dim(0)? && active.len() > 1) {
            return active.iter().map(|&e| one(e)).collect();
        }
        let slots: Vec<std::sync::Mutex<Option<Result<Vec<Vec<f32>>>>>> = active.iter().map(|_| Default::default()).collect();
        ferrolm_backend::cpu::threads::parallel_ranges(active.len(), 1, true, |range| {
            for i in range {
                *slots[i].lock().unwrap() = Some(one(active[i]));
            }
        });
        slots.into_iter().map(|s| s.into_inner().unwrap().expect("every expert ran")).collect()
    }

    fn add_shared(&self, shared: &SharedExpert, x: &Tensor, decode_rows: usize, out: &mut [f32], hidden: usize) -> Result<()> {
        let y = shared.mlp.forward(x, decode_rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let gates = match &shared.gate {
            Some(g) => g.forward_rows(x, decode_rows)?.to_dtype(DType::F32)?.to_vec2::<f32>()?.into_iter().map(|r| sigmoid(r[0])).collect(),
            None => vec![1.0; y.len()],
        };
        for ((dst, yr), g) in out.chunks_mut(hidden).zip(&y).zip(gates) {
            dst.iter_mut().zip(yr).for_each(|(d, v)| *d += g * v);
        }
        Ok(())
    }

    /// Bytes of weights one decode token reads: the router, its top-k experts (taking the
    /// experts as equal in size) and the shared expert.
    pub fn weight_bytes(&self) -> usize {
        let expert = self.experts.first().map_or(0, GatedMlp::weight_bytes);
        let shared = self.shared.as_ref().map_or(0, |s| s.mlp.weight_bytes() + s.gate.as_ref().map_or(0, Linear::weight_bytes));
        self.router.weight_bytes() + self.routing.top_k * expert + shared
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Rows `rows` of x (x itself when they are all of its rows, in order).
fn gather(x: &Tensor, rows: &[u32]) -> Result<Tensor> {
    if rows.len() == x.dim(0)? && rows.iter().enumerate().all(|(i, &r)| i as u32 == r) {
        return Ok(x.clone());
    }
    let idx = Tensor::from_slice(rows, rows.len(), x.device())?;
    x.index_select(&idx, 0)
}

/// Each token's top-k experts by softmax probability (ties to the lower index), weighted as
/// `routing` says, grouped by expert.
fn group_by_expert(logits: &[Vec<f32>], experts: usize, routing: Routing) -> Vec<Group> {
    let mut groups: Vec<Group> = (0..experts).map(|_| Group::default()).collect();
    for (row, l) in logits.iter().enumerate() {
        let max = l.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let exp: Vec<f32> = l.iter().map(|&v| (v - max).exp()).collect();
        let total: f32 = exp.iter().sum();
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
        let top = &order[..routing.top_k.min(l.len())];
        let picked: f32 = top.iter().map(|&e| exp[e] / total).sum();
        for &e in top {
            let p = exp[e] / total;
            groups[e].rows.push(row as u32);
            groups[e].weights.push(if routing.renormalize { p / picked } else { p });
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::{Activation, FusedLinear};
    use candle_core::quantized::{GgmlDType, QTensor};
    use ferrolm_backend::Weight;

    fn weight(rows: usize, cols: usize, dtype: GgmlDType) -> Weight {
        let t = (Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap() / (cols as f64).sqrt()).unwrap();
        let data = match dtype {
            GgmlDType::F32 => t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => QTensor::quantize(&t, dtype).unwrap().data().unwrap().to_vec(),
        };
        Weight { dtype, dims: vec![rows, cols], data: std::sync::Arc::new(data) }
    }

    /// Experts large enough that their products are split over the CPU threads.
    fn layer(dtype: GgmlDType) -> MoeMlp {
        let (hidden, ff, experts) = (512, 256, 8);
        let expert = |_| GatedMlp {
            gate_up: FusedLinear::new(&[&weight(ff, hidden, dtype), &weight(ff, hidden, dtype)], &[None, None], &Device::Cpu).unwrap(),
            down: Linear::new(&weight(hidden, ff, dtype), None, &Device::Cpu).unwrap(),
            activation: Activation::Silu,
        };
        MoeMlp {
            router: Linear::new(&weight(experts, hidden, GgmlDType::F32), None, &Device::Cpu).unwrap(),
            experts: (0..experts).map(expert).collect(),
            routing: Routing { top_k: 2, renormalize: true },
            shared: None,
        }
    }

    /// A decode row's output is the same bits alone (experts side by side, each product on
    /// one thread) as beside prompt rows (each product split over the threads).
    #[test]
    fn a_decode_row_is_the_same_bits_alone_and_in_a_batch() {
        for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
            let moe = layer(dtype);
            let x = Tensor::randn(0f32, 1.0, (9, 512), &Device::Cpu).unwrap();
            let alone = moe.forward(&x.narrow(0, 0, 1).unwrap(), 1).unwrap().to_vec2::<f32>().unwrap();
            let batch = moe.forward(&x, 1).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(alone[0], batch[0], "{dtype:?}");
            let two = moe.forward(&x.narrow(0, 0, 2).unwrap(), 2).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(alone[0], two[0], "{dtype:?}: two decode rows");
        }
    }

    #[test]
    fn routing_picks_the_top_k_and_renormalizes_when_asked() {
        let logits = vec![vec![0.0, 2.0, 1.0, 2.0], vec![3.0, 0.0, 0.0, 0.0]];
        let plain = group_by_expert(&logits, 4, Routing { top_k: 2, renormalize: false });
        // Row 0: experts 1 and 3 tie at the top (lower index first); row 1: expert 0, then 1.
        assert_eq!(plain[1].rows, vec![0, 1]);
        assert_eq!(plain[3].rows, vec![0]);
        assert_eq!(plain[0].rows, vec![1]);
        assert!(plain[2].rows.is_empty());
        let z: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|v| (v - 2.0).exp()).sum();
        assert!((plain[3].weights[0] - 1.0 / z).abs() < 1e-6);
        let norm = group_by_expert(&logits, 4, Routing { top_k: 2, renormalize: true });
        assert!((norm[1].weights[0] - 0.5).abs() < 1e-6 && (norm[3].weights[0] - 0.5).abs() < 1e-6);
        assert!((norm[0].weights[0] + norm[1].weights[1] - 1.0).abs() < 1e-6);
    }
}
