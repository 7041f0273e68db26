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
use ferrolm_kv::SeqCache;
use ferrolm_models::CausalLm;

static FORCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the engine decode plain greedy requests through the static step on every device, CPU
/// included (where it runs eagerly and is slower): lets the tests drive the GPU code path.
pub fn force_static_decode(on: bool) {
    FORCE.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the engine should decode plain greedy requests on `model` through the static step.
pub fn use_static_decode(model: &dyn CausalLm) -> bool {
    model.has_static_decode()
        && (graph::supported(model.device()) || FORCE.load(std::sync::atomic::Ordering::Relaxed))
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
}

/// A captured step, the cache buffers it was captured over (it is valid while they stay), and
/// whether it stores each token into the reader's host mirror itself.
struct Captured {
    graph: StepGraph,
    buffers: Vec<TensorId>,
    mirrored: bool,
}

/// How the steps of a decode ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    Graph,
    Eager,
}

impl GraphDecoder {
    /// `None` when the model has no static step (the caller decodes as usual).
    pub fn new(model: &dyn CausalLm) -> Result<Option<Self>> {
        if !model.has_static_decode() {
            return Ok(None);
        }
        let device = model.device().clone();
        let token = Tensor::zeros(1, DType::U32, &device)?;
        let pos = Tensor::zeros(1, DType::U32, &device)?;
        Ok(Some(Self { reader: TokenReader::new(&device)?, device, token, pos, graph: None, capture_failed: false }))
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
        // One spare slot: a step past the last delivered token may already be queued.
        let Some(kv) = cache.static_buffers(n + 1)? else { return Ok(None) };
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
        // Step 1: a replay when these buffers' graph exists (a reused slot), else eagerly: the
        // warm-up a capture needs, and a real step.
        let path = match &self.graph {
            Some(c) if c.buffers == buffer_ids(&kv) => {
                c.graph.replay()?;
                DecodePath::Graph
            }
            _ => {
                graph::warm_up(&self.device, &mut step)?;
                self.prepare_graph(&kv, &mut step)
            }
        };
        // Mirrored replays queue nothing between them; step 1 (maybe eager) reads by copy.
        let mirrored = path == DecodePath::Graph && self.graph.as_ref().is_some_and(|c| c.mirrored);
        self.reader.queue(&token, 0)?;
        let mut launched = 1;
        let mut delivered = 0;
        while delivered < n {
            // Queue the next step before waiting for this one's token.
            if launched < n {
                match &self.graph {
                    Some(c) if path == DecodePath::Graph => c.graph.replay()?,
                    _ => step()?,
                }
                if !mirrored {
                    self.reader.queue(&token, launched % graph::SLOTS)?;
                }
                launched += 1;
            }
            // Step k advanced the position from `start + k - 1` to `start + k`.
            let t = match mirrored && delivered > 0 {
                true => self.reader.wait_mirrored(start + delivered as u32 + 1)?,
                false => self.reader.wait(delivered % graph::SLOTS)?,
            };
            cache.commit_static(1)?;
            delivered += 1;
            if !on_token(t) {
                break;
            }
        }
        Ok(Some(path))
    }

    /// A new graph of `step` over these buffers (after its eager warm-up); eager when capturing
    /// is unsupported or fails.
    fn prepare_graph(&mut self, kv: &[(Tensor, Tensor)], step: &mut dyn FnMut() -> Result<()>) -> DecodePath {
        if !graph::supported(&self.device) || self.capture_failed || std::env::var("FERROLM_CUDA_GRAPH").is_ok_and(|v| v == "0") {
            return DecodePath::Eager;
        }
        let buffers = buffer_ids(kv);
        let device = &self.device;
        let (captured, mirrored) = match mirror_tokens() {
            true => self.reader.mirrored(|| graph::capture(device, step)),
            false => (graph::capture(device, step), false),
        };
        match captured {
            Ok(graph) => {
                self.graph = Some(Captured { graph, buffers, mirrored });
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
}

/// The cache buffers a captured step reads and writes: its graph is valid while they stay.
fn buffer_ids(kv: &[(Tensor, Tensor)]) -> Vec<TensorId> {
    kv.iter().flat_map(|(k, v)| [k.id(), v.id()]).collect()
}

/// Whether captured steps store their tokens into the host mirror (`FERROLM_TOKEN_MIRROR=0`:
/// read each by a copy and an event queued after its replay, as before 2026-12-05).
fn mirror_tokens() -> bool {
    !std::env::var("FERROLM_TOKEN_MIRROR").is_ok_and(|v| v == "0")
}
