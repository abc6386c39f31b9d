//! Device ops of the CUDA paths, counted on the CPU (`benchmarks/cuda-ops.md`).
//!
//! The device-generic code (plain Candle tensor ops) is what runs on CUDA; run on the CPU it does
//! the same ops. Every Candle op except an in-place copy allocates exactly one output buffer of
//! its result's size, so a counting allocator (per thread, so parallel tests do not mix) that
//! sorts allocations by size counts the ops: "full" ones (the size of the weight or parameter)
//! and "small" ones (the size of the per-block scales). Shapes, layouts and other metadata
//! allocate far less than the smallest threshold used here. An in-place copy (`Var::set`) is
//! counted by reading the code, and added by hand below.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use tallow_model::kernels::nf4::Nf4Matmul;
use tallow_model::Nf4Weight;
use tallow_trainer::optim::{AdamW8bit, AdamWParams, Optimizer};

struct Counting;

thread_local! {
    /// Sizes of the allocations made on this thread while `ON` is set.
    static ON: Cell<bool> = const { Cell::new(false) };
    static FULL: Cell<usize> = const { Cell::new(0) };
    static SMALL: Cell<usize> = const { Cell::new(0) };
    static BOUNDS: Cell<(usize, usize)> = const { Cell::new((usize::MAX, usize::MAX)) };
}

fn note(size: usize) {
    // try_with: the thread-locals may be gone while a thread shuts down
    let _ = ON.try_with(|on| {
        if on.get() {
            let (small, full) = BOUNDS.with(Cell::get);
            if size >= full {
                FULL.with(|c| c.set(c.get() + 1));
            } else if size >= small {
                SMALL.with(|c| c.set(c.get() + 1));
            }
        }
    });
}

// SAFETY: forwards every call to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// (full, small): allocations on this thread during `f` of at least `full` bytes, and of
/// `small` up to `full` bytes.
fn count<R>(small: usize, full: usize, f: impl FnOnce() -> R) -> (R, (usize, usize)) {
    BOUNDS.with(|b| b.set((small, full)));
    FULL.with(|c| c.set(0));
    SMALL.with(|c| c.set(0));
    ON.with(|on| on.set(true));
    let r = f();
    ON.with(|on| on.set(false));
    (r, (FULL.with(Cell::get), SMALL.with(Cell::get)))
}

/// NF4 generic dequantization of a (1024, 1024) weight: 3 full ops (gather, multiply, cast;
/// 2 for f32, whose cast is a no-op), and 4 small ones with double quantization (codes to u32,
/// gather, multiply, + offset), none with an f32 absmax.
#[test]
fn nf4_generic_dequantize_is_three_ops_on_the_weight() {
    let dev = Device::Cpu;
    let n = 1024 * 1024;
    let w = Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap();
    for double_quant in [false, true] {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let mut q = Nf4Weight::quantize(&w, double_quant).unwrap();
            q.dtype = dtype;
            q.dequantize_generic().unwrap(); // warm the constant cache
                                             // full: >= n/2 bytes (a bf16 weight is 2n, the packed bytes n/2); small: the
                                             // (n/64,) absmax in f32 or u32 is n/16 bytes
            let (out, (full, small)) = count(n / 16, n / 2, || q.dequantize_generic().unwrap());
            assert_eq!(out.dtype(), dtype);
            let want_full = if dtype == DType::F32 { 2 } else { 3 };
            let want_small = if double_quant { 4 } else { 0 };
            assert_eq!(
                (full, small),
                (want_full, want_small),
                "{dtype:?} double_quant={double_quant}: (full, small) ops"
            );
        }
    }
}

/// The dequantization kernel (`Nf4Weight::dequantize`: the CPU loop here, one launch of
/// `tallow_nf4_dequant*` on CUDA, same structure) allocates its output and nothing else, with a
/// double-quantized absmax too: the 8-bit absmax is decoded in place, not into an (n/64,) f32
/// temporary by the 4 tensor ops of the generic path (it allocated 4 small buffers before).
#[test]
fn nf4_dequantize_kernel_allocates_only_its_output() {
    let dev = Device::Cpu;
    let n = 1024 * 1024;
    let w = Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap();
    for double_quant in [false, true] {
        for dtype in [DType::BF16, DType::F32] {
            let mut q = Nf4Weight::quantize(&w, double_quant).unwrap();
            q.dtype = dtype;
            q.dequantize().unwrap(); // warm any cache
            let (out, ops) = count(n / 256, n / 2, || q.dequantize().unwrap());
            assert_eq!(out.dtype(), dtype);
            assert_eq!(
                ops,
                (1, 0),
                "{dtype:?} double_quant={double_quant}: (full, small)"
            );
        }
    }
}

/// The matmul op's forward on the CPU runs the CPU kernel (one full buffer: the dequantized
/// weight) plus the matmul output; shown for contrast, and to pin that the forward does not
/// keep a dequantized copy in the graph.
#[test]
fn nf4_matmul_forward_allocates_one_weight() {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap();
    let q = Arc::new(Nf4Weight::quantize(&w, true).unwrap());
    let x = Tensor::randn(0f32, 1.0, (4, 1024), &dev).unwrap();
    x.apply_op1(Nf4Matmul { w: q.clone() }).unwrap();
    // full: at least the f32 weight's 4 MiB (gemm's own packing buffer for this product,
    // ~1-2 MiB with its AVX-512 kernels, is not the weight)
    let (_, (full, _)) = count(1 << 14, 4 << 20, || {
        x.apply_op1(Nf4Matmul { w: q.clone() }).unwrap()
    });
    assert_eq!(full, 1, "dequantized weight buffers");
}

/// One AdamW8bit step of a (1024, 1024) f32 parameter on the generic path: 35 full-size
/// allocating ops + 1 in-place copy (the new value into the parameter) = 36, and 6 on the
/// 4096 block scales (per quantization: max, clamp to 1e-38, reciprocal): 42 in all.
#[test]
fn adamw8bit_generic_step_op_count() {
    let dev = Device::Cpu;
    let n = 1024 * 1024;
    let hp = AdamWParams::default();
    let p = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap()).unwrap();
    let g = Tensor::randn(0f32, 0.01, (1024, 1024), &dev).unwrap();
    let mut opt = AdamW8bit::new(hp).with_generic_quantizer();
    let params = [p];
    opt.step(&params, std::slice::from_ref(&g), 1e-3).unwrap(); // state and constants
                                                                // full: >= n bytes (u8 codes are n, f32 values 4n); small: the (n/256,) f32 scales, 4n/256
    let (_, (full, small)) = count(n / 64, n, || {
        opt.step(&params, std::slice::from_ref(&g), 1e-3).unwrap()
    });
    let in_place_copies = 1; // Var::set
    eprintln!(
        "adamw8bit generic step: {full} full allocations + {in_place_copies} in-place copy, \
         {small} small"
    );
    assert_eq!((full, small), (35, 6));
    assert_eq!(full + in_place_copies + small, 42);
}

/// Eight (64, 128) parameters form one group: the group's ops run once (the same 35 + 6 as a
/// lone parameter, over the group's 65536 elements) plus the two concatenations that build its
/// flat inputs (2 allocations; 8 copy launches each) and 8 in-place copies back. Launches:
/// 35 + 6 + 2 x 8 + 8 = 65, about 8 per parameter instead of 42.
#[test]
fn adamw8bit_group_step_op_count() {
    let dev = Device::Cpu;
    let k = 8;
    let n = 64 * 128;
    let params: Vec<Var> = (0..k)
        .map(|_| Var::from_tensor(&Tensor::randn(0f32, 1.0, (64, 128), &dev).unwrap()).unwrap())
        .collect();
    let grads: Vec<Tensor> = (0..k)
        .map(|_| Tensor::randn(0f32, 0.01, (64, 128), &dev).unwrap())
        .collect();
    let mut opt = AdamW8bit::new(AdamWParams::default()).with_generic_quantizer();
    opt.step(&params, &grads, 1e-3).unwrap();
    assert_eq!(opt.groups(), 1);
    // full: >= the group's u8 codes (k n bytes); small: its (k n / 256,) f32 scales
    let (_, (full, small)) = count(k * n / 64, k * n, || {
        opt.step(&params, &grads, 1e-3).unwrap()
    });
    assert_eq!((full, small), (35 + 2, 6));
    let launches = (full - 2) + small + 2 * k + k;
    eprintln!(
        "adamw8bit group of {k}: {launches} launches, {:.1} per parameter",
        launches as f64 / k as f64
    );
}

/// The one-op LoRA linear's CUDA kernels for a bf16 x (`crates/model/kernels/lora_gemm.cuh`:
/// s x Aᵀ and s dY B, the rounding sum with the product with Bᵀ and the bias, dB and dA, with
/// and without LoRA dropout's mask) run on the CPU: the kernel source compiled as C++ by g++ (`tests/cuda_host/lora_gemm_host.cpp`),
/// each block's threads on CPU threads with a barrier for `__syncthreads`, every output
/// compared bit for bit with a sequential loop in the kernels' order of f32 operations, at
/// sizes that cross every tile edge, with two problems per launch, r past one tile, and dB /
/// dA summed in one block per tile and split over blocks of 32 rows. So
/// the kernels' indexing, tiling and barriers are checked before a GPU runs them (`tallow
/// doctor` then compares them with the CPU twin). Checked: one tile's index off by one (a
/// column of R read from its neighbour) fails 4 of the cases; a skipped column 33 of dA fails
/// the r = 40 case; the last split left out of the sum, or its ticket not reset, fails; dA's
/// rows read without the mask fails the dropout case.
#[test]
fn lora_kernels_run_on_cpu_threads_bit_for_bit() {
    let out = run_host_kernels("lora_gemm_host.cpp");
    assert_eq!(
        out.lines().filter(|l| l.ends_with(": ok")).count(),
        6,
        "{out}"
    );
}

/// The gradient norm's CUDA kernel (`crates/model/kernels/sum_squares.cuh`) run on the CPU the
/// same way (`tests/cuda_host/sum_squares_host.cpp`): per-thread sums, the block's tree, the
/// blocks added in order by the last one, and its ticket reset, bit for bit against a loop in
/// that order, over 1, 3 and 7 blocks with empty tensors among the others. Checked: the
/// block tree's last step left out fails 12 of the 15 cases; stepping over tensors with `<`
/// instead of `<=` reads past a tensor (the harness crashes).
#[test]
fn sum_squares_kernel_runs_on_cpu_threads_bit_for_bit() {
    let out = run_host_kernels("sum_squares_host.cpp");
    assert_eq!(
        out.lines().filter(|l| l.contains(": ok (")).count(),
        15,
        "{out}"
    );
}

/// Chunked attention's CUDA kernels (`crates/model/kernels/flash_attn.cuh`: the forward with its
/// online log-sum-exp, dK / dV per key tile, dQ per query tile) run on the CPU the same way
/// (`tests/cuda_host/flash_attn_host.cpp`), six cases: one tile; grouped heads (3 per kv head)
/// over a packed row with partial tiles; a sliding window with a soft-cap; head dim 256; a
/// window across packed documents; all of these at once (head dims 64, 80, 96, 256, 128, 64),
/// three of them with v, y and dY laid out tokens-major as the decoder layer has them. Each
/// output bit for bit against a loop in the kernels' order, and within 2% of its largest value
/// against attention computed plainly in f64 (measured 0.23-0.73%, bf16's rounding of the
/// scores and outputs). Checked: the causal rule off by one (j < p) fails all 6 cases; the
/// soft-cap's derivative left out fails the capped case; dK / dV summing the first query head
/// of a group only fails the 4 grouped cases; the running sum not rescaled when the max grows
/// fails 5; a key tile's query walk stopped at the first tile whose first key reaches the
/// tile's start (not its end) fails all 6; v read with k's strides, or dV written with v's,
/// fails the 3 tokens-major cases.
#[test]
fn flash_attention_kernels_run_on_cpu_threads_bit_for_bit() {
    let out = run_host_kernels("flash_attn_host.cpp");
    assert_eq!(
        out.lines().filter(|l| l.ends_with(": ok")).count(),
        6,
        "{out}"
    );
}

/// Compiles `tests/cuda_host/<src>` with g++ (C++20) and runs it: its stdout, after checking
/// it exited 0.
fn run_host_kernels(src: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = root.join("cuda_host").join(src);
    let exe = std::env::temp_dir().join(format!(
        "tallow-{}-{}",
        src.file_stem().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let built = std::process::Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-pthread"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx} ({e}): this test needs a C++20 compiler"));
    assert!(
        built.status.success(),
        "{cxx} failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let run = std::process::Command::new(&exe)
        .output()
        .expect("run the host kernels");
    let _ = std::fs::remove_file(&exe);
    let out = String::from_utf8_lossy(&run.stdout).into_owned();
    assert!(run.status.success(), "the kernels disagree:\n{out}");
    out
}
