//! 4-bit NormalFloat (NF4) weights, bitsandbytes layout.
