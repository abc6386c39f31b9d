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

/// A point to count from: the tensor counter and the device operations issued
/// (`candle_core::launches`, the vendored candle-core's count of ops that run something on
/// the device: kernels, copies, memsets, library calls; not views).
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    tensors: u64,
    launches: u64,
}

/// What happened since a [`Mark`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Tensors created (ops and views).
    pub ops: u64,
    /// Device operations issued.
    pub launches: u64,
}

impl std::ops::AddAssign for Counts {
    fn add_assign(&mut self, o: Counts) {
        self.ops += o.ops;
        self.launches += o.launches;
    }
}

fn tensor_id() -> u64 {
    let t = Tensor::new(0u8, &Device::Cpu).expect("a 1-byte host tensor");
    // `TensorId` is opaque; its Debug form is `TensorId(n)`.
    let id = format!("{:?}", t.id());
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .expect("candle-core 0.11 prints a TensorId as TensorId(n)")
}

/// The counts now: a mark to subtract (see [`since`]). Makes one tiny host tensor (1 byte),
/// which [`since`] leaves out of both counts.
pub fn mark() -> Mark {
    let tensors = tensor_id();
    Mark {
        tensors,
        launches: candle_core::launches::count(),
    }
}

/// Tensors created and device operations issued since `start`, not counting the marks' own.
pub fn since(start: Mark) -> Counts {
    let launches = candle_core::launches::count() - start.launches;
    Counts {
        ops: tensor_id() - start.tensors - 1,
        launches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three ops are three tensors and two launches (the reshape is a view); a no-op
    /// (`contiguous` of a contiguous tensor) neither. Other
    /// tests of this binary run in parallel and create tensors too, so the exact count is
    /// asserted as a minimum over a few tries.
    #[test]
    fn counts_the_tensors_ops_create() {
        let x = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
        let counts: Vec<Counts> = (0..20)
            .map(|_| {
                let start = mark();
                let y = (x.exp().unwrap() + 1.0).unwrap().contiguous().unwrap();
                let _z = y.reshape((3, 1)).unwrap();
                since(start)
            })
            .collect();
        // exp and the `+ 1.0` (an affine) launch; contiguous of a contiguous tensor and
        // reshape do not.
        let min = |f: fn(&Counts) -> u64| counts.iter().map(f).min();
        assert_eq!(min(|c| c.ops), Some(3), "{counts:?}");
        assert_eq!(min(|c| c.launches), Some(2), "{counts:?}");
    }
}
