//! bf16 matmuls on Intel AMX tiles, for a bf16 model's base matmuls on the CPU (PyTorch's oneDNN
//! multiplies bf16 with them too). AMX-BF16's `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a
//! 32 x 16 one and accumulates into a 16 x 16 f32 tile: the products of two bf16 are exact in
//! f32 and summed in f32, as in the CPU twin, which widens both operands to f32 and multiplies
//! them with `gemm` (what Candle's bf16 matmul does). The two differ in the order of the f32
//! sums, and AMX reads bf16 subnormals as zero.
//!
//! Used when the CPU has AMX-BF16 (CPUID) and Linux grants the process the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), on shapes whose reduced and output dimensions are
//! multiples of 32 and with at least [`MIN_ROWS`] rows; `TALLOW_CPU_AMX=0` turns it off.
//! Otherwise [`gemm_bf16`] returns `false` and the caller runs the twin.
//!
//! Layout: the right operand is packed per call into AMX's pair-interleaved ("VNNI") tiles,
//! 32 output columns (a panel) at a time; the left operand's rows are loaded into tiles straight
//! from the caller's row-major buffer. Each block of 32 rows x 32 columns keeps its four f32
//! accumulator tiles in registers over the whole reduced dimension and is stored once.

use std::cell::Cell;
use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

/// Fewer rows than this run the twin: the packing of the right operand (one pass over it) is
/// not paid back (a decoding step has one row).
pub const MIN_ROWS: usize = 16;

/// Rows of one rayon task (times [`TASK_PANELS`] panels of 32 columns).
const TASK_ROWS: usize = 128;
const TASK_PANELS: usize = 4;

/// k-blocks of 32 per pass over a task's rows and panels: a longer K (the LM head's backward
/// reduces over the vocabulary) is summed in slices of 1024 whose operands (128 rows and 4
/// panels: 512 KiB) stay in L2, the accumulators stored and reloaded between slices.
const SLICE_KBS: usize = 32;

thread_local! {
    static OFF_HERE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with AMX off on this thread (the twin instead): the tests that hold tallow's bf16
/// kernels to Candle's graph bit for bit use it.
pub fn without_amx<R>(f: impl FnOnce() -> R) -> R {
    let before = OFF_HERE.with(|o| o.replace(true));
    let r = f();
    OFF_HERE.with(|o| o.set(before));
    r
}

/// Whether [`gemm_bf16`] runs on AMX on this thread (the CPU, the kernel's permission,
/// `TALLOW_CPU_AMX`, [`without_amx`]).
pub fn enabled() -> bool {
    !OFF_HERE.with(|o| o.get()) && available()
}

/// Whether this process may use AMX-BF16: decided once.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        std::env::var("TALLOW_CPU_AMX").map_or(true, |v| v.trim() != "0") && imp::detect()
    })
}

/// `dst (M, N) := lhs (M, K) · B` in f32, `lhs` bf16 row-major, `B` bf16 given as `rhs`: a
/// row-major (N, K) matrix used transposed when `rhs_t` (a linear's weight in x Wᵀ), else a
/// row-major (K, N) one. Returns `false`, with `dst` untouched, when AMX is not
/// [`enabled`] or the shape is not one it takes (K or N not a multiple of 32, M below
/// [`MIN_ROWS`]).
pub fn gemm_bf16(
    dst: &mut [f32],
    lhs: &[bf16],
    rhs: &[bf16],
    rhs_t: bool,
    (m, n, k): (usize, usize, usize),
) -> bool {
    if m < MIN_ROWS {
        return false;
    }
    match Packed::new(rhs, rhs_t, (n, k)) {
        Some(b) => b.gemm(dst, lhs, m),
        None => false,
    }
}

/// `dst (M, N) := x (M, K) · Wᵀ` in f32 for a row-major `w` (N, K) that is not packed: the
/// product runs transposed, W xᵀ, with W as the tiles' left operand (read as it is stored) and
/// x, M rows, packed as the right one, and each 32 x 32 block is written back transposed. For
/// a wide W and few rows (the LM head: N a vocabulary, M a chunk of positions) that packs
/// M x K elements instead of N x K. Each element is the same sum in the same order as
/// [`gemm_bf16`]'s (AMX's pair products commute), so the same bits. With `round`, each value
/// is rounded to bf16 precision (kept in f32) as it is written: a bf16 matmul's result.
/// `false`, with `dst` untouched, when AMX is not [`enabled`], K is not a multiple of 32 or
/// N is below 32.
pub fn gemm_bf16_wt(
    dst: &mut [f32],
    x: &[bf16],
    w: &[bf16],
    (m, n, k): (usize, usize, usize),
    round: bool,
) -> bool {
    if k % 32 != 0 || k == 0 || n < 32 || m == 0 || !enabled() {
        return false;
    }
    assert!(dst.len() >= m * n && x.len() >= m * k && w.len() >= n * k);
    // x's rows padded with zero rows to a whole panel of 32 columns of B = xᵀ.
    let m32 = m.div_ceil(32) * 32;
    let packed = if m32 == m {
        pack(&x[..m * k], true, k, m)
    } else {
        let mut padded = vec![bf16::ZERO; m32 * k];
        padded[..m * k].copy_from_slice(&x[..m * k]);
        pack(&padded, true, k, m32)
    };
    imp::run_t(dst, w, &packed, (n, m32, k), m, round);
    true
}

/// A right operand B (K, N) packed for AMX once, for several products with it (the LM head's
/// chunks of rows): [`Packed::new`] then [`Packed::gemm`] per left operand.
pub struct Packed {
    words: Vec<u32>,
    n: usize,
    k: usize,
}

impl Packed {
    /// `rhs` as [`gemm_bf16`] takes it; None when AMX is not [`enabled`] or K or N is not a
    /// multiple of 32 (the caller runs the twin).
    pub fn new(rhs: &[bf16], rhs_t: bool, (n, k): (usize, usize)) -> Option<Self> {
        if n % 32 != 0 || k % 32 != 0 || n == 0 || k == 0 || !enabled() {
            return None;
        }
        assert!(rhs.len() >= n * k);
        Some(Self {
            words: pack(rhs, rhs_t, k, n),
            n,
            k,
        })
    }

    /// B's columns: the N of every product with it.
    pub fn cols(&self) -> usize {
        self.n
    }

    /// `dst (M, N) := lhs (M, K) · B`; `false`, with `dst` untouched, below [`MIN_ROWS`] rows
    /// or on a thread where AMX is off.
    pub fn gemm(&self, dst: &mut [f32], lhs: &[bf16], m: usize) -> bool {
        let (n, k) = (self.n, self.k);
        if m < MIN_ROWS || !enabled() {
            return false;
        }
        assert!(dst.len() >= m * n && lhs.len() >= m * k);
        imp::run(dst, lhs, &self.words, (m, n, k));
        true
    }
}

/// `rhs` as B (K, N) in tile order: panel p (columns 32p .. 32p + 32), k-block kb (rows
/// 32kb .. 32kb + 32): two 16 x 16 tiles of u32 (columns 0..16 and 16..32 of the panel), row r
/// of a tile holding for each column c the pair (B[32kb + 2r][c], B[32kb + 2r + 1][c]), the
/// lower-indexed element in the low half. Read in the order `rhs` is stored (the packing runs
/// at every call: a frozen weight is not kept packed, which would double its memory).
fn pack(rhs: &[bf16], rhs_t: bool, k: usize, n: usize) -> Vec<u32> {
    let kbs = k / 32;
    let panel = kbs * 512; // u32 per panel: kbs x 2 tiles x 16 x 16
    let mut packed = crate::kernels::fused::uninit::<u32>(n / 32 * panel);
    packed
        .par_chunks_mut(panel)
        .enumerate()
        .for_each(|(p, out)| pack_panel(out, rhs, rhs_t, p, (k, n)));
    packed
}

crate::kernels::fused::multiversion!(
    /// Panel `p` of [`pack`] into `out`.
    fn pack_panel(out: &mut [u32], rhs: &[bf16], rhs_t: bool, p: usize, kn: (usize, usize)) => pack_panel_body
);

#[inline(always)]
fn pack_panel_body(out: &mut [u32], rhs: &[bf16], rhs_t: bool, p: usize, (k, n): (usize, usize)) {
    let pair = |lo: bf16, hi: bf16| lo.to_bits() as u32 | (hi.to_bits() as u32) << 16;
    if rhs_t {
        // B[kk][c] = rhs[c][kk]: a tile is 16 rows of rhs, 32 elements (16 pairs) each, read
        // row by row and written transposed, 16 pairs of one k-pair row at a time.
        let mut block = [[0u32; 16]; 16];
        for (kb, tiles) in out.chunks_mut(512).enumerate() {
            for (t, tile) in tiles.chunks_mut(256).enumerate() {
                for (j, row) in block.iter_mut().enumerate() {
                    let c = p * 32 + t * 16 + j;
                    let src = &rhs[c * k + kb * 32..][..32];
                    for (r, w) in row.iter_mut().enumerate() {
                        *w = pair(src[2 * r], src[2 * r + 1]);
                    }
                }
                for (r, dst) in tile.chunks_mut(16).enumerate() {
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = block[j][r];
                    }
                }
            }
        }
    } else {
        // B = rhs (K, N): a tile row r interleaves 16 elements of rhs's rows 2r, 2r + 1.
        for (kb, tiles) in out.chunks_mut(512).enumerate() {
            for r in 0..16 {
                let kk = kb * 32 + 2 * r;
                let lo = &rhs[kk * n + p * 32..][..32];
                let hi = &rhs[(kk + 1) * n + p * 32..][..32];
                for t in 0..2 {
                    let dst = &mut tiles[t * 256 + r * 16..][..16];
                    for (j, d) in dst.iter_mut().enumerate() {
                        *d = pair(lo[t * 16 + j], hi[t * 16 + j]);
                    }
                }
            }
        }
    }
}

/// A pointer that rayon tasks writing disjoint blocks of one buffer share.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: each task writes only its own (rows, columns) block of the buffer.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The element at `i` (a method, so that closures capture the whole `Out`, not its pointer).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use super::{bf16, Out, ParallelIterator, SLICE_KBS, TASK_PANELS, TASK_ROWS};
    use rayon::prelude::*;
    use std::arch::asm;
    use std::ops::Range;

    /// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); then the kernel's permission
    /// for the tile data state (Linux 5.16+: `ARCH_REQ_XCOMP_PERM` = 0x1023,
    /// `XFEATURE_XTILEDATA` = 18), without which the first tile instruction is a SIGILL.
    pub fn detect() -> bool {
        use std::arch::x86_64::__cpuid_count;
        #[allow(unused_unsafe)]
        let (max, l7) = unsafe { (__cpuid_count(0, 0).eax, __cpuid_count(7, 0)) };
        if max < 7 || l7.edx & (1 << 22) == 0 || l7.edx & (1 << 24) == 0 {
            return false;
        }
        // SAFETY: arch_prctl with an integer argument; it changes only the process's permitted
        // extended state.
        unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1023, 18) == 0 }
    }

    /// Palette 1, all eight tiles 16 rows x 64 bytes: tmm0..3 the f32 accumulators of a 32 x 32
    /// block, tmm4..5 two 16-row slices of the left operand, tmm6..7 two 16-column tiles of B.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    const CONFIG: TileConfig = {
        let mut c = [0u8; 64];
        c[0] = 1;
        let mut t = 0;
        while t < 8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little endian)
            c[48 + t] = 16; // rows
            t += 1;
        }
        TileConfig(c)
    };

    /// The body of [`block`]: `$init` starts the four accumulators (zeroed or loaded from `c`).
    macro_rules! block_asm {
        ($a:expr, $lda:expr, $b:expr, $kbs:expr, $c:expr, $ldc:expr, $($init:literal),+) => {
            asm!(
                $($init,)+
                "2:",
                "tileloadd tmm4, [{a0} + {lda}*1]",
                "tileloadd tmm5, [{a1} + {lda}*1]",
                "tileloadd tmm6, [{b} + {s64}*1]",
                "tileloadd tmm7, [{b} + {s64}*1 + 1024]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b}, 2048",
                "dec {kbs}",
                "jnz 2b",
                "tilestored [{c0} + {ldc}*1], tmm0",
                "tilestored [{c0} + {ldc}*1 + 64], tmm1",
                "tilestored [{c1} + {ldc}*1], tmm2",
                "tilestored [{c1} + {ldc}*1 + 64], tmm3",
                a0 = inout(reg) $a => _,
                a1 = inout(reg) $a.add(16 * $lda) => _,
                b = inout(reg) $b => _,
                kbs = inout(reg) $kbs => _,
                lda = in(reg) $lda * 2,
                s64 = in(reg) 64usize,
                c0 = in(reg) $c,
                c1 = in(reg) $c.add(16 * $ldc),
                ldc = in(reg) $ldc * 4,
                options(nostack),
            )
        };
    }

    /// dst block (32, 32) at `c` (row stride `ldc` f32) := lhs rows at `a` (32 rows, stride
    /// `lda` bf16) times the panel slice at `b` over `kbs` (>= 1) k-blocks of 32; with `acc`,
    /// added to what the block holds.
    ///
    /// # Safety
    /// The tile configuration is loaded on this thread; `a` has 32 rows of `32 kbs` elements,
    /// `b` `kbs` x 512 u32, `c` 32 rows of 32 f32.
    #[inline]
    unsafe fn block(
        a: *const bf16,
        lda: usize,
        b: *const u32,
        kbs: usize,
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        unsafe {
            if acc {
                block_asm!(
                    a,
                    lda,
                    b,
                    kbs,
                    c,
                    ldc,
                    "tileloadd tmm0, [{c0} + {ldc}*1]",
                    "tileloadd tmm1, [{c0} + {ldc}*1 + 64]",
                    "tileloadd tmm2, [{c1} + {ldc}*1]",
                    "tileloadd tmm3, [{c1} + {ldc}*1 + 64]"
                );
            } else {
                block_asm!(
                    a,
                    lda,
                    b,
                    kbs,
                    c,
                    ldc,
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3"
                );
            }
        }
    }

    /// Rayon's tasks over a product of `rows` rows and `panels` panels: each gets its rows
    /// (at most [`TASK_ROWS`]) and panels (at most [`TASK_PANELS`]), its own to write.
    fn for_each_task(rows: usize, panels: usize, f: impl Fn(Range<usize>, Range<usize>) + Sync) {
        let col_tasks = panels.div_ceil(TASK_PANELS);
        (0..rows.div_ceil(TASK_ROWS) * col_tasks)
            .into_par_iter()
            .for_each(|task| {
                let (m0, p0) = (
                    (task / col_tasks) * TASK_ROWS,
                    (task % col_tasks) * TASK_PANELS,
                );
                f(
                    m0..(m0 + TASK_ROWS).min(rows),
                    p0..(p0 + TASK_PANELS).min(panels),
                );
            });
    }

    /// The rows `rs` of `lhs` (K wide) times the panels `ps` of `packed`, over every k slice:
    /// the 32-row block from row `mb` of panel `p` goes to `dest(mb, p)` (a pointer and its
    /// row stride in f32). The last rows, fewer than 32, run on a zero-padded copy as the
    /// block from the first of them.
    ///
    /// # Safety
    /// `dest` gives each (mb, p) a 32 x 32 block of its own, valid for writes and kept over
    /// the k slices.
    unsafe fn task_product(
        lhs: &[bf16],
        packed: &[u32],
        k: usize,
        (rs, ps): (Range<usize>, Range<usize>),
        dest: impl Fn(usize, usize) -> (*mut f32, usize),
    ) {
        let kbs = k / 32;
        let full = rs.start + rs.len() / 32 * 32;
        let tail = (full < rs.end).then(|| {
            let mut pad = vec![bf16::ZERO; 32 * k];
            pad[..(rs.end - full) * k].copy_from_slice(&lhs[full * k..rs.end * k]);
            pad
        });
        // SAFETY: the configuration is a valid palette-1 one; every block reads rows of `lhs`
        // / `pad` and a panel slice of `packed` within bounds (K = 32 kbs) and writes where
        // `dest` says; the tiles are released before the task ends.
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
            for kb0 in (0..kbs).step_by(SLICE_KBS) {
                let slice = SLICE_KBS.min(kbs - kb0);
                let acc = kb0 > 0;
                for p in ps.clone() {
                    let b = packed.as_ptr().add((p * kbs + kb0) * 512);
                    for mb in (rs.start..full).step_by(32) {
                        let (c, ldc) = dest(mb, p);
                        block(
                            lhs.as_ptr().add(mb * k + kb0 * 32),
                            k,
                            b,
                            slice,
                            c,
                            ldc,
                            acc,
                        );
                    }
                    if let Some(pad) = &tail {
                        let (c, ldc) = dest(full, p);
                        block(pad.as_ptr().add(kb0 * 32), k, b, slice, c, ldc, acc);
                    }
                }
            }
            asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// `dst (cols, rows)` := (`lhs (rows, K)` · the packed B (K, n))ᵀ, for B's first `cols`
    /// columns (the rest are padding); with `round`, each value rounded to bf16 precision.
    /// The tasks' blocks go to a scratch of their own, then out transposed.
    pub fn run_t(
        dst: &mut [f32],
        lhs: &[bf16],
        packed: &[u32],
        (rows, n, k): (usize, usize, usize),
        cols: usize,
        round: bool,
    ) {
        let out = Out(dst.as_mut_ptr());
        const LDS: usize = TASK_PANELS * 32;
        for_each_task(rows, n / 32, |rs, ps| {
            let (m0, p0) = (rs.start, ps.start);
            // This task's (rows, 32 panels) block, row stride LDS; 32-row blocks, the tail's
            // padded to 32.
            let mut scratch = vec![0f32; TASK_ROWS * LDS];
            let sc = scratch.as_mut_ptr();
            // SAFETY: every (mb, p) block is its own 32 x 32 block of `scratch`, whose
            // TASK_ROWS rows hold the task's rows rounded up to 32.
            unsafe {
                task_product(lhs, packed, k, (rs.clone(), ps.clone()), |mb, p| {
                    (sc.add((mb - m0) * LDS + (p - p0) * 32), LDS)
                })
            };
            // Out transposed: dst row j (a column of B) gets the task's rows.
            let rounded = |v: f32| {
                if round {
                    crate::kernels::fused::round_bf16(v)
                } else {
                    v
                }
            };
            for j in p0 * 32..(ps.end * 32).min(cols) {
                let c = j - p0 * 32;
                // SAFETY: dst holds `cols` rows of `rows`; row j, columns rs belong to this
                // task alone (its rows of A).
                let drow =
                    unsafe { std::slice::from_raw_parts_mut(out.at(j * rows + m0), rs.len()) };
                for (i, d) in drow.iter_mut().enumerate() {
                    *d = rounded(scratch[i * LDS + c]);
                }
            }
        });
    }

    pub fn run(dst: &mut [f32], lhs: &[bf16], packed: &[u32], (m, n, k): (usize, usize, usize)) {
        let out = Out(dst.as_mut_ptr());
        for_each_task(m, n / 32, |rs, ps| {
            let (m1, p0) = (rs.end, ps.start);
            let full = rs.start + rs.len() / 32 * 32;
            // The last rows, fewer than 32, go to a scratch block per panel, then to dst.
            let mut scratch = [0f32; 32 * 32 * TASK_PANELS];
            let sc = scratch.as_mut_ptr();
            // SAFETY: a whole block writes its own 32 x 32 block of dst (rows rs and columns
            // 32 ps belong to this task alone), the tail its panel's scratch block.
            unsafe {
                task_product(lhs, packed, k, (rs, ps.clone()), |mb, p| {
                    if mb < full {
                        (out.at(mb * n + p * 32), n)
                    } else {
                        (sc.add((p - p0) * 1024), 32)
                    }
                })
            };
            if full < m1 {
                for p in ps {
                    let sc = &scratch[(p - p0) * 1024..][..1024];
                    for (i, row) in sc.chunks(32).take(m1 - full).enumerate() {
                        // SAFETY: rows full..m1, columns 32p..32p + 32 of dst are this task's.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                row.as_ptr(),
                                out.at((full + i) * n + p * 32),
                                32,
                            )
                        };
                    }
                }
            }
        });
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    pub fn detect() -> bool {
        false
    }
    pub fn run(_: &mut [f32], _: &[super::bf16], _: &[u32], _: (usize, usize, usize)) {
        unreachable!("AMX is detected only on x86_64 Linux")
    }
    pub fn run_t(
        _: &mut [f32],
        _: &[super::bf16],
        _: &[u32],
        _: (usize, usize, usize),
        _: usize,
        _: bool,
    ) {
        unreachable!("AMX is detected only on x86_64 Linux")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn random(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed;
        (0..len)
            .map(|_| bf16::from_f32(lcg(&mut s) * 4.0))
            .collect()
    }

    /// The exact product (f64) and the bound of an f32 sum of `k` terms in any order:
    /// k · ε_f32 · Σ|a||b| per element.
    fn reference(
        lhs: &[bf16],
        rhs: &[bf16],
        rhs_t: bool,
        (m, n, k): (usize, usize, usize),
    ) -> (Vec<f64>, Vec<f64>) {
        let b = |kk: usize, c: usize| {
            f64::from(if rhs_t {
                rhs[c * k + kk]
            } else {
                rhs[kk * n + c]
            })
        };
        let mut exact = vec![0f64; m * n];
        let mut bound = vec![0f64; m * n];
        for i in 0..m {
            for c in 0..n {
                let (mut s, mut a) = (0f64, 0f64);
                for kk in 0..k {
                    let p = f64::from(lhs[i * k + kk]) * b(kk, c);
                    s += p;
                    a += p.abs();
                }
                exact[i * n + c] = s;
                bound[i * n + c] = k as f64 * f32::EPSILON as f64 * a;
            }
        }
        (exact, bound)
    }

    /// On a CPU with AMX: every shape it takes (rows in whole 32-blocks, a tail of 1 .. 31 rows,
    /// several tasks of rows and panels; B given transposed and plain) is within the f32
    /// summation bound of the exact product, and a wrong pair order in the packing (B's rows 2r
    /// and 2r + 1 swapped) is caught (it moves results by ~1, the bound is ~1e-4). Without AMX
    /// the kernel must say it did nothing.
    #[test]
    fn amx_gemm_is_within_the_f32_summation_bound_of_the_exact_product() {
        let shapes = [
            (16, 32, 32),
            (32, 32, 64),
            (33, 64, 96),
            (47, 160, 32),
            (300, 192, 576),
            (129, 32 * 9, 64),
            // K over several slices of SLICE_KBS k-blocks, the last one partial; a row tail
            (40, 64, 32 * (2 * SLICE_KBS + 3)),
        ];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            for rhs_t in [true, false] {
                let lhs = random(m * k, 1 + si as u64);
                let rhs = random(n * k, 100 + si as u64);
                let mut dst = vec![f32::NAN; m * n];
                if !gemm_bf16(&mut dst, &lhs, &rhs, rhs_t, (m, n, k)) {
                    assert!(!available(), "AMX available but {m}x{n}x{k} refused");
                    eprintln!("no AMX on this CPU: the kernel is not exercised");
                    return;
                }
                let (exact, bound) = reference(&lhs, &rhs, rhs_t, (m, n, k));
                for (i, ((&d, &e), &b)) in dst.iter().zip(&exact).zip(&bound).enumerate() {
                    assert!(
                        (f64::from(d) - e).abs() <= b,
                        "{m}x{n}x{k} rhs_t={rhs_t} [{}, {}]: {d} vs exact {e} (bound {b})",
                        i / n,
                        i % n
                    );
                }
            }
        }
        // The check can fail: swap B's rows 0 and 1 and the product moves far beyond the bound.
        let (m, n, k) = (32, 32, 32);
        let lhs = random(m * k, 7);
        let rhs = random(n * k, 8);
        let mut swapped = rhs.clone();
        for c in 0..n {
            swapped.swap(c * k, c * k + 1);
        }
        let mut dst = vec![0f32; m * n];
        assert!(gemm_bf16(&mut dst, &lhs, &swapped, true, (m, n, k)));
        let (exact, bound) = reference(&lhs, &rhs, true, (m, n, k));
        let worst = dst
            .iter()
            .zip(&exact)
            .zip(&bound)
            .map(|((&d, &e), &b)| (f64::from(d) - e).abs() / b)
            .fold(0f64, f64::max);
        assert!(
            worst > 100.0,
            "a swapped pair moved results by only {worst} bounds"
        );
    }

    /// x Wᵀ run transposed ([`gemm_bf16_wt`]: W unpacked as the left operand, x packed) gives
    /// [`gemm_bf16`]'s bits, rounded or not: M below, at and above 32-multiples (x padded), N
    /// with a tail of rows (W's last rows padded), several row and panel tasks, K over several
    /// slices. Writing the blocks back untransposed, or one column off, breaks it.
    #[test]
    fn transposed_product_gives_the_direct_products_bits() {
        let shapes = [
            (16, 32, 32),
            (40, 96, 64),
            (64, 1000, 96),
            (200, 33 * 32 + 7, 128),
            (33, 64, 32 * (2 * SLICE_KBS + 3)),
        ];
        for (si, &(m, n, k)) in shapes.iter().enumerate() {
            let x = random(m * k, 11 + si as u64);
            let w = random(n * k, 300 + si as u64);
            let mut direct = vec![f32::NAN; m * n];
            let mut wt = vec![f32::NAN; m * n];
            if !gemm_bf16_wt(&mut wt, &x, &w, (m, n, k), false) {
                assert!(!available(), "AMX available but {m}x{n}x{k} refused");
                eprintln!("no AMX on this CPU: the kernel is not exercised");
                return;
            }
            if n % 32 == 0 {
                assert!(gemm_bf16(&mut direct, &x, &w, true, (m, n, k)));
            } else {
                // the direct kernel takes no N tail: the f32 reference sums in the same order
                let (exact, bound) = reference(&x, &w, true, (m, n, k));
                for (i, &got) in wt.iter().enumerate() {
                    assert!(
                        (f64::from(got) - exact[i]).abs() <= bound[i],
                        "{m}x{n}x{k} [{i}]"
                    );
                }
                continue;
            }
            for (i, (&a, &b)) in wt.iter().zip(&direct).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{m}x{n}x{k} [{}, {}]",
                    i / n,
                    i % n
                );
            }
            let mut rounded = vec![f32::NAN; m * n];
            assert!(gemm_bf16_wt(&mut rounded, &x, &w, (m, n, k), true));
            for (&r, &d) in rounded.iter().zip(&direct) {
                assert_eq!(r.to_bits(), crate::kernels::fused::round_bf16(d).to_bits());
            }
        }
    }

    #[test]
    fn shapes_it_does_not_take_and_amx_off_fall_back() {
        let mut dst = vec![0f32; 64 * 48];
        let (lhs, rhs) = (random(64 * 32, 1), random(48 * 32, 2));
        assert!(
            !gemm_bf16(&mut dst, &lhs, &rhs, true, (64, 48, 32)),
            "N % 32"
        );
        assert!(
            !gemm_bf16(&mut dst, &lhs, &rhs, true, (8, 32, 32)),
            "M < MIN_ROWS"
        );
        let rhs = random(32 * 32, 2);
        assert!(!without_amx(|| gemm_bf16(
            &mut dst,
            &lhs,
            &rhs,
            true,
            (32, 32, 32)
        )));
        assert!(dst.iter().all(|&d| d == 0.0), "dst untouched");
    }
}
