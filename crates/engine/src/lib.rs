//! The engine room: the generation loop (prefill planner, decode loop), and later the scheduler,
//! speculative decoding and checkpoints. Knows models through `CausalLm` and nothing of HTTP.

mod generate;
mod prefill;
mod sampler;

pub use generate::{generate, Flow, GenerateInput, SnapshotHook};
pub use prefill::{plan_prefill, PrefillChunk};
pub use sampler::{Sampled, TokenSampler};
