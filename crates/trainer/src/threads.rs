//! `train.threads`: one thread count for every CPU pool a step uses: the matmuls (the `gemm`
//! crate on rayon's global pool, sized by Candle from `RAYON_NUM_THREADS`), tallow's fused
//! kernels (rayon) and Candle's element-wise barrier pool (`CANDLE_NUM_THREADS`). Applied once,
//! before the first tensor op of a command.

/// The thread count: `RAYON_NUM_THREADS` when set (> 0), else `configured` when > 0, else the
/// number of physical cores (Candle's default, and PyTorch's `torch.get_num_threads()`).
pub fn resolve(configured: usize, rayon_env: Option<&str>, physical: usize) -> usize {
    rayon_env
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .or((configured > 0).then_some(configured))
        .unwrap_or(physical)
        .max(1)
}

/// Threads of Candle's element-wise pool for `n` threads in all. Up to 4: one (the calling
/// thread alone). What is left in Candle's pool after tallow's fused kernels (residual adds,
/// the backward's gradient sums) is memory-bound, and the pool's worker spins after each op
/// (up to 25000 `pause`s) on a core the next matmul's rayon threads need. Measured on 2 cores
/// (`scripts/bench_cpu.sh` shapes, 2026-11-24): base 1038-1060 tokens/s with one thread
/// against 950-1018 with two, wide 203-205 against 195-200. Above 4 threads, n, Candle's own
/// default (not measured here).
pub fn candle_pool(n: usize) -> usize {
    if n <= 4 {
        1
    } else {
        n
    }
}

/// Sizes the pools for `configured` threads (0 = physical cores) and returns the count used.
/// Must run before any tensor op: Candle reads the variables when its pools start.
pub fn apply(configured: usize) -> usize {
    let rayon_env = std::env::var("RAYON_NUM_THREADS").ok();
    // Candle's count: the physical cores (or RAYON_NUM_THREADS, which `resolve` takes first).
    let n = resolve(
        configured,
        rayon_env.as_deref(),
        candle_core::utils::get_num_threads(),
    );
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", candle_pool(n).to_string());
    }
    // Fails only when the global pool already runs (then its size stands).
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global();
    make_matmul_buffers();
    n
}

/// Makes the `gemm` crate's packing buffer on this thread and on every thread of rayon's global
/// pool now. gemm keeps one per thread, the size of the L2 cache (2 MiB on a Xeon), made on the
/// thread's first matmul that packs; which pool threads run such a matmul first, and in which
/// phase, depends on work stealing. Made lazily, they landed in a random phase of a random step
/// and moved the measured host peaks by whole megabytes from one run of the same job to the
/// next (a tiny model's forward peak with checkpointing above the one without, on one machine
/// and not another). Made here, they are part of the load phase's memory, every run alike.
pub fn make_matmul_buffers() {
    let touch = || gemm_common::gemm::L2_SLAB.with(|slab| drop(slab.borrow()));
    touch();
    rayon::broadcast(|_| touch());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_wins_then_the_config_then_physical_cores() {
        assert_eq!(resolve(0, None, 8), 8, "default: physical cores");
        assert_eq!(resolve(3, None, 8), 3, "train.threads");
        assert_eq!(resolve(3, Some("5"), 8), 5, "RAYON_NUM_THREADS wins");
        assert_eq!(
            resolve(3, Some("0"), 8),
            3,
            "RAYON_NUM_THREADS=0 means unset"
        );
        assert_eq!(resolve(0, Some("x"), 8), 8, "unparsable: ignored");
        assert_eq!(resolve(0, None, 0), 1, "at least one");
        assert_eq!(
            (candle_pool(2), candle_pool(4), candle_pool(16)),
            (1, 1, 16)
        );
    }
}
