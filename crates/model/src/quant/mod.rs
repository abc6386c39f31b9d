//! Quantized storage, bitsandbytes-compatible.
//!
//! - [`dynamic`]: the 8-bit dynamic maps and blockwise 8-bit quantization (`quantize_blockwise`
//!   in bitsandbytes): 8-bit optimizer state, and the nested absmax of NF4 double quantization.
//! - [`nf4`]: 4-bit NormalFloat weights (QLoRA): packing, double quantization, dequantization.

pub mod dynamic;
pub mod nf4;
