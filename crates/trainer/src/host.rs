//! Every device-to-host read of the training loop goes through [`read`]: on CUDA each one waits
//! for the stream to drain, so the loop reads once per optimizer step (the step's loss and
//! gradient norm together) and the count is kept, per thread, for tests and `metrics.jsonl`
//! (`host_reads`). Evaluation reads once per evaluation; checkpoints and the final adapter are
//! bulk copies at save steps, not counted here.

use std::cell::Cell;

use candle_core::{DType, Tensor};

thread_local! {
    static READS: Cell<u64> = const { Cell::new(0) };
}

/// Copies `t` to the host as f64 values (one sync on CUDA), counted.
pub fn read(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    READS.with(|r| r.set(r.get() + 1));
    t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()
}

/// Host reads made by this thread so far.
pub fn reads() -> u64 {
    READS.with(|r| r.get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn reads_are_counted() {
        let before = reads();
        let t = Tensor::new(&[1f32, 2.5], &Device::Cpu).unwrap();
        assert_eq!(read(&t).unwrap(), vec![1.0, 2.5]);
        assert_eq!(reads(), before + 1);
    }
}
