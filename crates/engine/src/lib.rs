//! The engine room: sequences advanced together by the engine step (continuous batching:
//! `scheduler`, `seq`, `step`), the engine thread and its request queue (`service`), the
//! one-sequence path (`generate`) and the captured greedy step (`graph_decode`). Knows models
//! through `CausalLm` and nothing of HTTP.

pub mod bundle;
pub mod config;
pub mod constraint;
pub mod draft;
pub mod durable;
pub mod fill;
mod embed;
mod gauges;
mod generate;
pub mod graph_decode;
pub mod identity;
pub mod masks;
mod sampler;
pub mod scheduler;
mod seq;
pub mod service;
mod spans;
pub mod spec;
mod step;

pub use bundle::{Bundle, BundleError};
pub use config::{BatchConfig, DiskSettings, GraphSettings};
pub use constraint::TokenConstraint;
pub use gauges::{EngineGauges, Histogram, BUCKETS};
pub use generate::{generate, generate_with_adapters, Flow, GenerateInput};
pub use graph_decode::{DecodePath, GraphDecoder};
pub use masks::{MaskSchedule, MaskTimes};
pub use sampler::{Sampled, TokenSampler};
pub use seq::{SeqRequest, Sink};
pub use service::{Durable, EngineConfig, EngineHandle, Event, Request, SubmitError};
pub use spec::{draft_together, DraftCache, DraftJob, DraftModelProposer, NgramProposer, Proposal, Proposer, SpecConfig};
pub use step::{Batch, StepReport};
