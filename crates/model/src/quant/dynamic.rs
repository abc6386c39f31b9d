//! 8-bit dynamic maps and blockwise 8-bit quantization (bitsandbytes `quantize_blockwise`).
