//! The OpenAI / mlx_lm.server wire protocol: request parsing and validation, response bodies,
//! logprobs, and tools for templates that do not take them.

pub mod chat;
pub mod fields;
pub mod logprobs;
pub mod request;
pub mod response;
pub mod tools;
