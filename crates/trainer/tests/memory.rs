//! The counting allocator sees every heap byte: a test binary of its own installs it.

use candle_core::{DType, Device, Tensor};
use tallow_trainer::memory::{self, CountingAlloc, Probe};

#[global_allocator]
static GLOBAL: CountingAlloc<std::alloc::System> = CountingAlloc(std::alloc::System);

#[test]
fn probe_sees_a_tensor_and_resets_per_phase() {
    memory::mark_counting_installed();
    let probe = Probe::for_device(&Device::Cpu);
    assert_eq!(probe.what(), "host heap");
    probe.start_phase();
    let before = probe.current().unwrap();
    let t = Tensor::zeros((1024, 1024, 16), DType::F32, &Device::Cpu).unwrap(); // 64 MiB
    let during = probe.current().unwrap();
    assert!(
        during >= before + (64 << 20),
        "live bytes grew by {} for a 64 MiB tensor",
        during - before
    );
    drop(t);
    let peak = probe.peak().unwrap();
    assert!(peak >= before + (64 << 20), "peak {peak} missed the tensor");
    // A new phase starts from what is live now: the dropped tensor is not in its peak.
    probe.start_phase();
    let peak2 = probe.peak().unwrap();
    assert!(
        peak2 < before + (8 << 20),
        "peak after reset {peak2} still counts the dropped tensor (before: {before})"
    );
}
