//! The backend room: candle devices and dtypes, linear layers over quantized or dense weights,
//! RoPE styles, attention dispatch and custom kernels. Knows nothing of models or requests.

pub mod attention;
pub mod attention_device;
pub mod decode_layer;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod graph;
pub mod kv_quant;
pub mod linear;
pub mod norm;
pub mod ops;
pub mod paged;
pub mod rope;
pub mod shard;

pub use attention::{attend, AttentionParams};
pub use candle_core::{DType, Device, Tensor};
pub use cpu::matmul::WeightBytes;
pub use device::{activation_dtype, kv_dtype, parse_device};
pub use linear::{Linear, RowInput, Weight};
pub use rope::{Rope, RopeStyle};

pub type Result<T> = candle_core::Result<T>;
