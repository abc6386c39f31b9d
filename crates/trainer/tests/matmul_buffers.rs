//! The `gemm` crate's per-thread packing buffers are made when the thread pools are sized
//! ([`threads::make_matmul_buffers`]), not on each thread's first matmul: made lazily, they
//! landed in whichever phase first ran a matmul on a given pool thread (work stealing decides)
//! and moved measured host peaks by megabytes between runs of the same job. A test binary of its
//! own: it installs the counting allocator and no other test allocates meanwhile.

use tallow_trainer::memory::{self, CountingAlloc, Probe};
use tallow_trainer::threads;

#[global_allocator]
static GLOBAL: CountingAlloc<std::alloc::System> = CountingAlloc(std::alloc::System);

/// A matmul on every thread of the pool and on this one, after the buffers are made, grows the
/// heap by less than half a packing buffer (the buffer is the L2 cache's size: 2 MiB on the
/// Xeon this was written on). What is left is gemm's per-call packing of the right operand,
/// 64 KiB at this size. Without `make_matmul_buffers` each thread's first matmul makes its
/// buffer and the peak grows by a whole one per thread (measured: 2 MiB x 3 here).
#[test]
fn matmuls_make_no_packing_buffer_once_the_pools_are_sized() {
    memory::mark_counting_installed();
    threads::make_matmul_buffers();
    let slab = gemm_common::cache::CACHE_INFO[1].cache_bytes as u64;
    let n = 128;
    let (lhs, rhs) = (vec![1.0f32; n * n], vec![0.5f32; n * n]);
    let mut outs: Vec<Vec<f32>> = (0..rayon::current_num_threads() + 1)
        .map(|_| vec![0.0f32; n * n])
        .collect();
    let matmul = |dst: &mut [f32]| unsafe {
        // SAFETY: row-major (n, n) buffers of n * n elements each.
        gemm::gemm(
            n,
            n,
            n,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.as_ptr(),
            1,
            n as isize,
            rhs.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
    let probe = Probe::for_device(&candle_core::Device::Cpu);
    probe.start_phase();
    let before = probe.current().unwrap();
    let (mine, pool) = outs.split_first_mut().unwrap();
    let pool: Vec<std::sync::Mutex<&mut Vec<f32>>> =
        pool.iter_mut().map(std::sync::Mutex::new).collect();
    matmul(mine);
    rayon::broadcast(|ctx| matmul(&mut pool[ctx.index()].lock().unwrap()[..]));
    let grew = probe.peak().unwrap() - before;
    assert!(
        grew < slab / 2,
        "matmuls on {} threads grew the heap by {grew} bytes: a packing buffer ({slab} bytes) \
         was made after the pools were sized",
        rayon::current_num_threads() + 1
    );
    assert!(outs.iter().all(|o| o[0] == 0.5 * n as f32), "matmul ran");
}
