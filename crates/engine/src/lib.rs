//! The engine room: the generation loop (prefill planner, decode loop), the engine thread and
//! its request queue, and later batching, speculative decoding and checkpoints. Knows models
//! through `CausalLm` and nothing of HTTP.

pub mod bundle;
mod generate;
pub mod graph_decode;
mod prefill;
mod sampler;
pub mod service;

pub use bundle::{Bundle, BundleError};
pub use graph_decode::{DecodePath, GraphDecoder};
pub use generate::{generate, Flow, GenerateInput, SnapshotHook};
pub use prefill::{plan_prefill, PrefillChunk};
pub use sampler::{Sampled, TokenSampler};
pub use service::{EngineConfig, EngineHandle, Event, Request, SubmitError};
