use crate::lora::{LoraBase, LoraStack};
use candle_core::{Device, Tensor};
use ferrolm_kv::{KvScheme, SeqCache};
use std::sync::Arc;

/// Facts about a loaded model that the engine and server need.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The architecture name as the checkpoint spells it (`llama`, `qwen2`, `gemma3`…).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// The longest sequence the model was trained for.
    pub context_length: usize,
    /// Bytes of weights read per decoded token (the decode roofline's numerator).
    pub weight_bytes: usize,
}

/// The new tokens of one sequence in a forward, with the caches they extend.
/// Their positions continue from `cache.offset()`.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
    pub kind: RowKind,
    /// The LoRA adapters these rows run with (`crate::lora`); None: the base model alone.
    pub lora: Option<Arc<LoraStack>>,
}

/// What a sequence's rows are in a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// Prompt tokens whose keys and values are all that is wanted (no hidden state returned),
    /// computed by the prefill kernels: the same bits however the prompt is cut into chunks.
    Prompt,
    /// Tokens whose hidden states are returned (one decode token, or several being verified),
    /// computed by the decode kernels: a sequence gets the same bits in a batch as alone.
    Decode,
}

impl<'a> SeqInput<'a> {
    /// Prompt rows: their keys and values go into the cache; nothing is returned for them.
    pub fn prompt(tokens: &'a [u32], cache: &'a mut SeqCache) -> Self {
        Self { tokens, cache, kind: RowKind::Prompt, lora: None }
    }

    /// Decode rows: every token's final hidden state is returned.
    pub fn decode(tokens: &'a [u32], cache: &'a mut SeqCache) -> Self {
        Self { tokens, cache, kind: RowKind::Decode, lora: None }
    }

    /// The same rows run with `lora` added to the targeted linears.
    pub fn with_lora(mut self, lora: Option<Arc<LoraStack>>) -> Self {
        self.lora = lora;
        self
    }
}

/// A causal language model bound to a device: the backend seam of DESIGN §6.
/// Forwards take a batch of sequences; one sequence is the common case.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn device(&self) -> &Device;
    /// Fresh, empty caches for one sequence.
    fn make_cache(&self) -> SeqCache;
    /// Caches the full-attention layers' keys and values as `scheme` says (`--kv-bits`): called
    /// once after loading, before caches are made. A model without quantized caches, or whose
    /// head size or device does not take them, refuses any but `Float` with the reason.
    fn set_kv_scheme(&mut self, scheme: KvScheme) -> Result<(), String> {
        match scheme {
            KvScheme::Float => Ok(()),
            KvScheme::Quant(_) => Err(format!("quantized KV is not implemented for {}", self.info().architecture)),
        }
    }
    /// Whether batched decode steps are captured per batch-size bucket (`batch_graph`; read
    /// once at start). Models without such steps ignore it.
    fn set_batch_graphs(&mut self, settings: crate::batch_graph::BatchGraphSettings) {
        let _ = settings;
    }

    /// The dense linears a LoRA adapter may target, to check adapters against when they are
    /// mounted; None: this model does not take adapters (requests with one are refused then).
    fn lora_base(&self) -> Option<LoraBase> {
        None
    }
    /// Runs the new tokens of every sequence through the model, writing their keys and values
    /// into the caches, and returns the final hidden state (final norm applied) of every decode
    /// row, in order, `[decode rows, hidden]` (`[0, hidden]` when there are none): the whole
    /// prompt is never projected to logits. Decode sequences come first in `batch` (an error
    /// otherwise), so that their rows form one block that the decode kernels take.
    fn forward_hidden(&self, batch: &mut [SeqInput<'_>]) -> candle_core::Result<Tensor>;
    /// Final norm already applied: hidden `[batch, hidden]` → logits `[batch, vocab]` (f32).
    fn project_logits(&self, hidden: &Tensor) -> candle_core::Result<Tensor>;
    /// Whether the model generates text; `false` for encoder-only embedding models, whose
    /// `forward_hidden` is an error.
    fn can_generate(&self) -> bool {
        true
    }
    /// Sentence embeddings (DESIGN §6: optional on a binding): each input's token ids, special
    /// tokens included, → `[inputs, dim]` f32, pooled and normalized as the model's own
    /// configuration says (sentence-transformers' modules); an empty batch answers `[0, dim]` at
    /// once. `Ok(None)`: the model does not embed.
    fn forward_embeddings(&self, inputs: &[&[u32]]) -> candle_core::Result<Option<Tensor>> {
        let _ = inputs;
        Ok(None)
    }
    /// One decode step whose inputs stay on the device, so that it can be captured once and
    /// replayed (CUDA graphs): `token` and `pos` are one-element u32 tensors; each layer's key
    /// and value are written in place at `pos` of its whole buffers `kv[layer]`
    /// (`SeqCache::static_buffers`). Returns logits `[1, vocab]` (f32). `Ok(None)`: this model
    /// has no such step (the caller decodes through `forward_hidden`).
    /// Whether [`CausalLm::decode_static`] is implemented for this model's configuration.
    fn has_static_decode(&self) -> bool {
        false
    }
    fn decode_static(&self, token: &Tensor, pos: &Tensor, kv: &[(Tensor, Tensor)]) -> candle_core::Result<Option<Tensor>> {
        let _ = (token, pos, kv);
        Ok(None)
    }
    /// A greedy [`CausalLm::decode_static`] step: the argmax of its logits into `token` (the
    /// next step's input) and `pos` advanced by one, all on the device. `Ok(false)`: no static
    /// step (nothing was run). Models may end the step in fewer kernels (Llama: inside the
    /// head's product).
    fn decode_static_greedy(&self, token: &Tensor, pos: &Tensor, kv: &[(Tensor, Tensor)]) -> candle_core::Result<bool> {
        let Some(logits) = self.decode_static(token, pos, kv)? else { return Ok(false) };
        ferrolm_backend::ops::argmax_and_advance(&logits, token, pos)?;
        Ok(true)
    }
}
