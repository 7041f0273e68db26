//! Greedy decode as one captured step (the analogue of mlx-bun's compiled decode): the model's
//! static decode step (`CausalLm::decode_static`), the argmax into the token buffer and the
//! position increment are recorded once as a CUDA graph and replayed every step. Nothing in the
//! step synchronizes with the host; the host reads each token id one step behind (pipelined),
//! through pinned memory.
//!
//! Capture is transactional: the first step over new buffers runs eagerly (it is also the
//! warm-up the capture needs; a reused slot replays its graph from the first step), and when
//! capturing fails the steps keep running eagerly through the same code, with the same results.
//! On devices without graphs (CPU) the eager path is all there is, which is
//! what the tests exercise.

use candle_core::{DType, Device, Result, Tensor, TensorId};
use ferrolm_backend::graph::{self, StepGraph, TokenReader};
use crate::config::GraphSettings;
use ferrolm_kv::SeqCache;
use ferrolm_models::CausalLm;

/// Whether the engine should decode plain greedy requests on `model` through the static step:
/// on devices with step graphs, or everywhere when `settings.on_cpu` (tests).
pub fn use_static_decode(model: &dyn CausalLm, settings: &GraphSettings) -> bool {
    model.has_static_decode() && (graph::supported(model.device()) || settings.on_cpu)
}

/// Device-resident state of a greedy decode, reusable across generations: the graph stays
/// valid as long as the cache keeps the same buffers.
pub struct GraphDecoder {
    device: Device,
    token: Tensor,
    pos: Tensor,
    graph: Option<Captured>,
    reader: TokenReader,
    capture_failed: bool,
    settings: GraphSettings,
}

/// A captured graph of `steps` consecutive steps, the cache buffers it was captured over (it is
/// valid while they stay), and whether it stores each token into the reader's host mirror
/// itself (always so when it holds more than one step: the host reads every step's token).
struct Captured {
    graph: StepGraph,
    buffers: Vec<TensorId>,
    mirrored: bool,
    steps: usize,
}

/// How the steps of a decode ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    Graph,
    Eager,
}

impl GraphDecoder {
    /// `None` when the model has no static step (the caller decodes as usual).
    pub fn new(model: &dyn CausalLm, settings: GraphSettings) -> Result<Option<Self>> {
        if !model.has_static_decode() {
            return Ok(None);
        }
        let device = model.device().clone();
        let token = Tensor::zeros(1, DType::U32, &device)?;
        let pos = Tensor::zeros(1, DType::U32, &device)?;
        Ok(Some(Self { reader: TokenReader::new(&device)?, device, token, pos, graph: None, capture_failed: false, settings }))
    }

    /// Decodes up to `n` tokens greedily after `first` (the token the prefill's logits gave,
    /// not yet in the cache). `on_token` gets each new token in order and returns false to
    /// stop. The cache ends holding exactly the tokens forwarded: `first` and every token
    /// before the last one delivered. Returns `None` when the model or cache has no static
    /// step (nothing was run).
    pub fn run(
        &mut self,
        model: &dyn CausalLm,
        cache: &mut SeqCache,
        first: u32,
        n: usize,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Option<DecodePath>> {
        if !model.has_static_decode() {
            return Ok(None);
        }
        if n == 0 {
            return Ok(Some(DecodePath::Eager));
        }
        // Spare rows: the steps queued past the last delivered token (at most two graphs).
        let Some(kv) = cache.static_buffers(n + 2 * self.settings.steps)? else { return Ok(None) };
        let start = cache.offset() as u32;
        self.reader.clear_mirror()?;
        self.token.slice_set(&Tensor::new(&[first], &self.device)?, 0, 0)?;
        self.pos.slice_set(&Tensor::new(&[start], &self.device)?, 0, 0)?;
        let (token, pos) = (self.token.clone(), self.pos.clone());
        let mut step = || -> Result<()> {
            match model.decode_static_greedy(&token, &pos, &kv)? {
                true => Ok(()),
                false => candle_core::bail!("the model has no static decode step"),
            }
        };
        // The first launch: a replay when these buffers' graph exists (a reused slot), else one
        // eager step: the warm-up a capture needs, and a real step.
        let first_replayed = matches!(&self.graph, Some(c) if c.buffers == buffer_ids(&kv));
        let path = match first_replayed {
            true => DecodePath::Graph,
            false => {
                graph::warm_up(&self.device, &mut step)?;
                self.prepare_graph(&kv, &mut step)
            }
        };
        let (steps, mirrored) = match (&self.graph, path) {
            (Some(c), DecodePath::Graph) => (c.steps, c.mirrored),
            _ => (1, false),
        };
        // Step 1's token is read by a copy unless a mirrored replay made it.
        match first_replayed {
            true => self.launch(&token, path, &mut step, 0)?,
            false => self.reader.queue(&token, 0)?,
        }
        let mut launched = if first_replayed { steps } else { 1 };
        let mut delivered = 0;
        while delivered < n {
            if launch_now(launched, delivered, n, steps) {
                self.launch(&token, path, &mut step, launched)?;
                launched += steps;
            }
            // Step k advanced the position from `start + k - 1` to `start + k`.
            let by_copy = !mirrored || (delivered == 0 && !first_replayed);
            let t = match by_copy {
                true => self.reader.wait(delivered % graph::SLOTS)?,
                false => self.reader.wait_mirrored(start + delivered as u32 + 1)?,
            };
            cache.commit_static(1)?;
            delivered += 1;
            if !on_token(t) {
                break;
            }
        }
        Ok(Some(path))
    }

    /// Queues the launch that follows `launched` steps: a replay of the graph (all its steps),
    /// or one eager step. The eager path reads each token by a copy queued behind its step.
    fn launch(&mut self, token: &Tensor, path: DecodePath, step: &mut dyn FnMut() -> Result<()>, launched: usize) -> Result<()> {
        match &self.graph {
            Some(c) if path == DecodePath::Graph => {
                c.graph.replay()?;
                if !c.mirrored {
                    self.reader.queue(token, launched % graph::SLOTS)?;
                }
                Ok(())
            }
            _ => {
                step()?;
                self.reader.queue(token, launched % graph::SLOTS)
            }
        }
    }

    /// A new graph of `step` over these buffers (after its eager warm-up); eager when capturing
    /// is unsupported or fails. A graph of several steps needs the token mirror (the host reads
    /// every step's token); without it the graph holds one step.
    fn prepare_graph(&mut self, kv: &[(Tensor, Tensor)], step: &mut dyn FnMut() -> Result<()>) -> DecodePath {
        if !graph::supported(&self.device) || self.capture_failed || !self.settings.capture {
            return DecodePath::Eager;
        }
        let buffers = buffer_ids(kv);
        let device = self.device.clone();
        let mut steps = if self.settings.mirror { self.settings.steps } else { 1 };
        let mut captured = self.capture(&device, steps, step);
        if steps > 1 {
            if let Ok((graph, false)) = captured {
                // The head took no mirror (no greedy head kernel): one step per graph, read by
                // copy, captured over the same buffers.
                graph.rearm();
                steps = 1;
                captured = self.capture(&device, 1, step);
            }
        }
        match captured {
            Ok((graph, mirrored)) => {
                self.graph = Some(Captured { graph, buffers, mirrored, steps });
                DecodePath::Graph
            }
            Err(e) => {
                tracing::warn!("decode step not captured, running it eagerly: {e}");
                self.capture_failed = true;
                self.graph = None;
                DecodePath::Eager
            }
        }
    }

    /// Records `steps` consecutive steps as one graph (in the mirror when the tokens are read
    /// through it); returns the graph and whether its head kernels took the mirror.
    fn capture(&mut self, device: &Device, steps: usize, step: &mut dyn FnMut() -> Result<()>) -> Result<(StepGraph, bool)> {
        let mut all = || -> Result<()> {
            for i in 0..steps {
                if i > 0 {
                    graph::next_captured_step(device)?;
                }
                step()?;
            }
            Ok(())
        };
        match self.settings.mirror {
            true => {
                let (g, mirrored) = self.reader.mirrored(|| graph::capture(device, &mut all));
                Ok((g?, mirrored))
            }
            false => Ok((graph::capture(device, &mut all)?, false)),
        }
    }
}

/// Whether to queue another launch of `steps` steps before waiting for token `delivered + 1`,
/// with `launched` steps queued so far out of `n`: yes while fewer than one launch lies beyond
/// the awaited step, so that the device never waits for the host, and at most two launches
/// (2 · steps) are ever unread (the mirror's slots, the cache's spare rows).
fn launch_now(launched: usize, delivered: usize, n: usize, steps: usize) -> bool {
    launched < n && launched < delivered + 1 + steps
}

/// The cache buffers a captured step reads and writes: its graph is valid while they stay.
fn buffer_ids(kv: &[(Tensor, Tensor)]) -> Vec<TensorId> {
    kv.iter().flat_map(|(k, v)| [k.id(), v.id()]).collect()
}


#[cfg(test)]
mod tests {
    use super::*;

    /// The host loop's schedule for every graph size, length and first launch (one eager step
    /// or a replay): the next launch is always queued while a token is awaited, at most two
    /// launches are unread (mirror slots, spare cache rows), and every token is launched.
    #[test]
    fn launches_stay_one_ahead_and_within_the_spare_rows() {
        for steps in 1..=graph::MIRROR_SLOTS / 2 {
            for n in 1..40 {
                for first_replayed in [false, true] {
                    let mut launched = if first_replayed { steps } else { 1 };
                    let mut delivered = 0;
                    while delivered < n {
                        if launch_now(launched, delivered, n, steps) {
                            launched += steps;
                        }
                        let awaited = delivered + 1;
                        assert!(launched >= awaited, "step {awaited} awaited before its launch");
                        // A whole launch past the awaited step is queued (or every step is).
                        assert!(launched >= n.min(awaited + steps), "the device would wait: {steps} {n} {delivered}");
                        assert!(launched - delivered <= 2 * steps, "more unread than the mirror holds");
                        assert!(launched <= n + 2 * steps, "past the spare rows");
                        delivered += 1;
                    }
                    assert!(launched >= n && launched < n + steps.max(2));
                }
            }
        }
    }
}
