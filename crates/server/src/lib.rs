//! ferrolm's OpenAI-compatible HTTP server, a drop-in replacement for `mlx_lm.server`: axum
//! routes, protocol types and validation, SSE, errors, metrics, and the per-request streaming
//! pipeline (token → detokenizer → stop matcher → reasoning / tool-call router → SSE).
//!
//! The engine runs on its own thread ([`ferrolm_engine::EngineHandle`]); handlers only submit
//! requests and read events, so the HTTP side stays responsive during a long prefill.

mod anthropic;
mod choices;
pub mod config;
pub mod durable;
mod embeddings;
pub mod errors;
mod generation;
pub mod http;
pub mod metrics;
mod openai_stream;
pub mod pipeline;
pub mod protocol;
mod responses;
mod routes;
pub mod state;
mod stream;
mod structured;

pub use config::ServerConfig;
pub use routes::router;
pub use state::{AppState, SharedState};

pub use http::serve::{bind, serve};
