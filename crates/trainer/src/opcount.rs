//! Tensor ops per phase, counted the same way on every device (`ops_forward` / `ops_backward` in
//! `metrics.jsonl`), so a change to the model code can be compared before and after on any
//! machine (`benchmarks/op-counts.md`).
//!
//! What is counted: the Candle tensors created. Candle gives every tensor it creates a fresh
//! `TensorId` from one process-wide counter (candle-core 0.11.1, `tensor.rs`, `TensorId::new`):
//! one per op result, whether the op launches a kernel (matmul, add, a custom op, a copy) or
//! only makes a view (reshape, transpose, narrow, broadcast), one per `detach`, and one per
//! tensor made from host data. Ops that return their input unchanged (`contiguous()` of a
//! contiguous tensor, `to_dtype` to its own dtype) create none. The work inside a custom op
//! (Candle storage calls) is one tensor, its result. That includes Candle's own backward
//! (each gradient formula's ops) and the layers activation checkpointing recomputes there.
//!
//! The counter is process-wide: ops of other threads of the process would be counted too (the
//! trainer runs on one thread; tests that compare counts run the `tallow` binary).

use candle_core::{Device, Tensor};

/// The process-wide tensor count now: a mark to subtract (see [`since`]). Makes one tiny host
/// tensor (1 byte), which [`since`] leaves out.
pub fn mark() -> u64 {
    let t = Tensor::new(0u8, &Device::Cpu).expect("a 1-byte host tensor");
    // `TensorId` is opaque; its Debug form is `TensorId(n)`.
    let id = format!("{:?}", t.id());
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .expect("candle-core 0.11 prints a TensorId as TensorId(n)")
}

/// Tensors created since `start` (a [`mark`]), not counting the marks' own tensors.
pub fn since(start: u64) -> u64 {
    mark() - start - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ops are three tensors; a no-op (`contiguous` of a contiguous tensor) none. Other
    /// tests of this binary run in parallel and create tensors too, so the exact count is
    /// asserted as a minimum over a few tries.
    #[test]
    fn counts_the_tensors_ops_create() {
        let x = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
        let counts: Vec<u64> = (0..20)
            .map(|_| {
                let start = mark();
                let y = (x.exp().unwrap() + 1.0).unwrap().contiguous().unwrap();
                let _z = y.reshape((3, 1)).unwrap();
                since(start)
            })
            .collect();
        assert_eq!(counts.iter().min(), Some(&3), "{counts:?}");
    }
}
