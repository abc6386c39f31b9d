//! Peak memory, measured (not estimated), per phase of a training step.
//!
//! - CPU: [`CountingAlloc`] wraps the binary's global allocator and keeps exact live and peak
//!   heap bytes in two atomics. The `tallow` binary installs it (around mimalloc); a library user
//!   who does not gets no CPU numbers (`None`), never wrong ones.
//! - CUDA: Candle allocates through cudarc from the device's default memory pool
//!   (`cuMemAllocAsync`), so the pool's `USED_MEM_CURRENT` / `USED_MEM_HIGH` attributes see every
//!   tensor; the high-water mark is reset at the start of each phase.
//!
//! A [`Probe`] is made for the training device; the trainer calls [`Probe::start_phase`] before
//! load, each forward, each backward and each optimizer step, and [`Probe::peak`] after it, on
//! the steps that ask: those logged to `metrics.jsonl` (the `bench` command logs every step) and
//! every step under `--memory-limit`. On CUDA each probe call synchronizes the stream, so the
//! other steps make none ([`probes`] counts them, per thread).
//!
//! On CUDA the probe also sets the pool's release threshold to the maximum: with the default
//! (0) every stream synchronization (a probe, a host read) hands the pool's free memory back to
//! the driver, and the next allocations map it again (CUDA programming guide, "Stream Ordered
//! Memory Allocator", physical page caching behavior). Candle frees and reallocates the same
//! activation sizes every step, so the pool keeps them.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_core::Device;
use serde::Serialize;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    static PROBES: Cell<u64> = const { Cell::new(0) };
}

/// Probe calls ([`Probe::start_phase`], [`Probe::peak`], [`Probe::current`]) made by this thread
/// so far, whatever the device: on CUDA each one is a stream synchronization.
pub fn probes() -> u64 {
    PROBES.with(|p| p.get())
}

fn probed() {
    PROBES.with(|p| p.set(p.get() + 1));
}

/// A global allocator that counts live and peak bytes around another one:
///
/// ```ignore
/// #[global_allocator]
/// static GLOBAL: CountingAlloc<mimalloc::MiMalloc> = CountingAlloc(mimalloc::MiMalloc);
/// ```
pub struct CountingAlloc<A>(pub A);

impl<A> CountingAlloc<A> {
    #[inline]
    fn grew(size: usize) -> usize {
        let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(live, Ordering::Relaxed);
        live
    }
}

// SAFETY: every call is forwarded unchanged to the wrapped allocator; only counters are added.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            let live = Self::grew(layout.size());
            trace::alloc(p, layout.size(), live);
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            let live = Self::grew(layout.size());
            trace::alloc(p, layout.size(), live);
        }
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        trace::dealloc(ptr, layout.size());
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            trace::dealloc(ptr, layout.size());
            let live = if new_size >= layout.size() {
                Self::grew(new_size - layout.size())
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed)
                    - (layout.size() - new_size)
            };
            trace::alloc(p, new_size, live);
        }
        p
    }
}

/// Tells this module that [`CountingAlloc`] is the global allocator (the binary calls it first
/// thing in `main`), so host numbers are reported.
pub fn mark_counting_installed() {
    INSTALLED.store(true, Ordering::Relaxed);
    trace::init();
}

/// `TALLOW_TRACE_PEAK=1` (a development switch, CPU device): the counting allocator also keeps
/// a backtrace of every live allocation of 1 MiB or more and, at each new high-water mark, a
/// snapshot of them; [`trace::report`] prints the snapshot of the highest, grouped by where in
/// tallow's code each block was allocated. It is how a miss of `tallow estimate` is found (which
/// tensors are alive at the peak) without a heap profiler; with
/// `TALLOW_CUDA_PATHS_ON_CPU=1` (`tallow_model::kernels::dispatch`) it shows the CUDA path's.
/// Slow (a backtrace per large allocation): for a step or two of a small model.
pub mod trace {
    use std::backtrace::Backtrace;
    use std::cell::Cell;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    const MIN: usize = 1 << 20;
    static ON: AtomicBool = AtomicBool::new(false);
    static HIGH: AtomicUsize = AtomicUsize::new(0);

    struct State {
        live: HashMap<usize, (usize, Arc<Backtrace>)>,
        /// (live bytes, the tracked blocks) at the highest mark so far.
        peak: (usize, Vec<(usize, Arc<Backtrace>)>),
    }
    static STATE: Mutex<Option<State>> = Mutex::new(None);

    thread_local! {
        static BUSY: Cell<bool> = const { Cell::new(false) };
    }

    pub(super) fn init() {
        if std::env::var("TALLOW_TRACE_PEAK").is_ok_and(|v| v.trim() == "1") {
            ON.store(true, Ordering::Relaxed);
        }
    }

    /// Runs `f` on the state unless this thread is already inside (the tracer's own
    /// allocations are counted, not traced).
    fn with(f: impl FnOnce(&mut State)) {
        if BUSY.with(|b| b.replace(true)) {
            return;
        }
        if let Ok(mut g) = STATE.lock() {
            let st = g.get_or_insert_with(|| State {
                live: HashMap::new(),
                peak: (0, Vec::new()),
            });
            f(st);
        }
        BUSY.with(|b| b.set(false));
    }

    #[inline]
    pub(super) fn alloc(p: *mut u8, size: usize, live: usize) {
        if size < MIN || !ON.load(Ordering::Relaxed) {
            return;
        }
        with(|st| {
            st.live
                .insert(p as usize, (size, Arc::new(Backtrace::force_capture())));
            if live > HIGH.load(Ordering::Relaxed) {
                HIGH.store(live, Ordering::Relaxed);
                st.peak = (live, st.live.values().cloned().collect());
            }
        });
    }

    #[inline]
    pub(super) fn dealloc(p: *mut u8, size: usize) {
        if size < MIN || !ON.load(Ordering::Relaxed) {
            return;
        }
        with(|st| {
            st.live.remove(&(p as usize));
        });
    }

    /// A backtrace's innermost Candle tensor op and its first `n` frames in tallow's crates
    /// (`name@file:line`, innermost first), as one key.
    fn site(bt: &Backtrace, n: usize) -> String {
        let text = bt.to_string();
        let mut frames = Vec::new();
        let mut op = None;
        let mut name = "";
        for line in text.lines().map(str::trim) {
            if let Some(at) = line.strip_prefix("at ") {
                if op.is_none() && at.contains("candle-core/src/tensor") {
                    op = Some(name.to_string());
                }
                if let Some((_, file)) = at.split_once("/crates/") {
                    if !file.starts_with("trainer/src/memory.rs") && frames.len() < n {
                        frames.push(format!("{name}@{file}"));
                    }
                }
            } else if let Some((_, f)) = line.split_once(": ") {
                name = f.split('<').next().unwrap_or(f);
            }
        }
        if std::env::var_os("TALLOW_TRACE_PEAK_RAW").is_some() {
            eprintln!("{text}");
        }
        format!("[{}] {}", op.unwrap_or_default(), frames.join(" < "))
    }

    /// Prints the highest mark's tracked blocks to stderr, grouped by allocation site, largest
    /// first; nothing when the switch is off.
    pub fn report() {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        let mut rows: Vec<(String, usize, usize)> = Vec::new();
        let mut total = 0;
        with(|st| {
            total = st.peak.0;
            let mut by: HashMap<String, (usize, usize)> = HashMap::new();
            for (size, bt) in &st.peak.1 {
                let e = by.entry(site(bt, 4)).or_default();
                e.0 += size;
                e.1 += 1;
            }
            rows = by.into_iter().map(|(k, (b, n))| (k, b, n)).collect();
        });
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        let tracked: usize = rows.iter().map(|r| r.1).sum();
        eprintln!(
            "peak trace: {:.1} MiB live at the highest mark, {:.1} MiB of it in blocks of 1 MiB or more:",
            total as f64 / 1048576.0,
            tracked as f64 / 1048576.0
        );
        for (site, bytes, n) in rows {
            eprintln!("  {:>9.1} MiB  {n:>4} x  {site}", bytes as f64 / 1048576.0);
        }
    }
}

/// Live heap bytes right now, when [`CountingAlloc`] is installed.
pub fn host_live_bytes() -> Option<u64> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| LIVE.load(Ordering::Relaxed) as u64)
}

/// Where peak memory is read from.
pub enum Probe {
    /// The counting allocator (CPU device).
    Host,
    /// The CUDA device's default memory pool.
    #[cfg(feature = "cuda")]
    Cuda(cuda::PoolProbe),
    /// Nothing to measure with (CPU without the counting allocator).
    Off,
}

impl Probe {
    /// The probe for the training device (on CUDA: also keeps freed memory in the pool, see the
    /// module doc).
    pub fn for_device(device: &Device) -> Probe {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => match cuda::PoolProbe::new(d) {
                Ok(p) => Probe::Cuda(p),
                Err(_) => Probe::Off,
            },
            Device::Cpu if INSTALLED.load(Ordering::Relaxed) => Probe::Host,
            _ => Probe::Off,
        }
    }

    /// What is measured, for messages: "host heap", "CUDA memory pool" or "none".
    pub fn what(&self) -> &'static str {
        match self {
            Probe::Host => "host heap",
            #[cfg(feature = "cuda")]
            Probe::Cuda(_) => "CUDA memory pool",
            Probe::Off => "none",
        }
    }

    /// Resets the high-water mark to the bytes in use now.
    pub fn start_phase(&self) {
        probed();
        match self {
            Probe::Host => PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed),
            #[cfg(feature = "cuda")]
            Probe::Cuda(p) => p.reset_peak(),
            Probe::Off => {}
        }
    }

    /// Peak bytes in use since the last [`Probe::start_phase`] (waits for the device on CUDA).
    pub fn peak(&self) -> Option<u64> {
        probed();
        match self {
            Probe::Host => Some(PEAK.load(Ordering::Relaxed) as u64),
            #[cfg(feature = "cuda")]
            Probe::Cuda(p) => p.peak(),
            Probe::Off => None,
        }
    }

    /// The memory there is to use: the GPU's total on CUDA; None on the CPU.
    pub fn device_total(&self) -> Option<u64> {
        match self {
            #[cfg(feature = "cuda")]
            Probe::Cuda(p) => p.total(),
            _ => None,
        }
    }

    /// Bytes in use now.
    pub fn current(&self) -> Option<u64> {
        probed();
        match self {
            Probe::Host => Some(LIVE.load(Ordering::Relaxed) as u64),
            #[cfg(feature = "cuda")]
            Probe::Cuda(p) => p.current(),
            Probe::Off => None,
        }
    }
}

/// A step's view of the [`Probe`]: the probe itself on the steps that measure, nothing (no
/// call, no sync) on the others.
#[derive(Clone, Copy)]
pub struct StepProbe<'a>(Option<&'a Probe>);

impl StepProbe<'_> {
    pub fn start_phase(&self) {
        if let Some(p) = self.0 {
            p.start_phase()
        }
    }

    pub fn peak(&self) -> Option<u64> {
        self.0.and_then(Probe::peak)
    }

    pub fn current(&self) -> Option<u64> {
        self.0.and_then(Probe::current)
    }
}

impl Probe {
    /// This probe for a step that measures (`measure`), or a silent one.
    pub fn on_step(&self, measure: bool) -> StepProbe<'_> {
        StepProbe(measure.then_some(self))
    }
}

/// Peak bytes per phase of a training step (`None` where nothing measures).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PhasePeaks {
    pub forward: Option<u64>,
    pub backward: Option<u64>,
    pub optimizer: Option<u64>,
}

impl PhasePeaks {
    /// The largest of the three.
    pub fn max(&self) -> Option<u64> {
        [self.forward, self.backward, self.optimizer]
            .into_iter()
            .flatten()
            .max()
    }

    /// Phase-wise maximum of two records.
    pub fn merge(&self, o: &PhasePeaks) -> PhasePeaks {
        let m = |a: Option<u64>, b: Option<u64>| a.max(b);
        PhasePeaks {
            forward: m(self.forward, o.forward),
            backward: m(self.backward, o.backward),
            optimizer: m(self.optimizer, o.optimizer),
        }
    }
}

/// `1.23 GiB`-style text for a byte count.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Parses a byte count as users write it: `24GiB`, `1.5 GB`, `800MiB`, `512M`, `1048576`.
/// Binary units (KiB, MiB, GiB, TiB; K, M, G, T alone are binary too) and decimal ones (KB, MB,
/// GB, TB).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}`: expected a size like 24GiB, 800MiB or 1.5GB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        u => {
            return Err(format!(
                "`{text}`: unknown unit `{u}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            ))
        }
    };
    Ok((value * mult).round() as u64)
}

#[cfg(feature = "cuda")]
pub mod cuda {
    //! The default memory pool of a CUDA device (what cudarc's `cuMemAllocAsync` draws from).
    use std::sync::Arc;

    use cudarc::driver::sys;
    use cudarc::driver::CudaStream;

    pub struct PoolProbe {
        pool: sys::CUmemoryPool,
        stream: Arc<CudaStream>,
    }

    // SAFETY: a CUmemoryPool handle is a plain driver handle, valid on any thread of the
    // process once the device's context is bound.
    unsafe impl Send for PoolProbe {}
    unsafe impl Sync for PoolProbe {}

    impl PoolProbe {
        pub fn new(dev: &candle_core::CudaDevice) -> Result<Self, String> {
            let stream = dev.cuda_stream();
            let ctx = stream.context();
            ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let mut pool = std::ptr::null_mut();
            // SAFETY: valid out pointer and device handle of a live context.
            unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
                .result()
                .map_err(|e| e.to_string())?;
            // Keep freed memory in the pool across synchronizations (module doc). A speed
            // setting: should the driver refuse it, the peaks are still right.
            let mut keep_all: u64 = u64::MAX;
            // SAFETY: RELEASE_THRESHOLD is a cuuint64_t; valid pool handle.
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep_all as *mut u64 as *mut _,
                )
            };
            Ok(Self { pool, stream })
        }

        fn attr(&self, a: sys::CUmemPool_attribute) -> Option<u64> {
            self.stream.synchronize().ok()?;
            let mut v: u64 = 0;
            // SAFETY: the USED_MEM_* attributes are cuuint64_t.
            unsafe { sys::cuMemPoolGetAttribute(self.pool, a, &mut v as *mut u64 as *mut _) }
                .result()
                .ok()?;
            Some(v)
        }

        pub fn peak(&self) -> Option<u64> {
            self.attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
        }

        pub fn current(&self) -> Option<u64> {
            self.attr(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
        }

        /// Total memory of the device (`cuMemGetInfo`).
        pub fn total(&self) -> Option<u64> {
            self.stream.context().bind_to_thread().ok()?;
            cudarc::driver::result::mem_get_info()
                .ok()
                .map(|(_, total)| total as u64)
        }

        pub fn reset_peak(&self) {
            let _ = self.stream.synchronize();
            let mut zero: u64 = 0;
            // SAFETY: setting USED_MEM_HIGH to 0 resets it to the current use (driver API docs).
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    self.pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut _,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_as_users_write_them() {
        assert_eq!(parse_bytes("24GiB"), Ok(24 << 30));
        assert_eq!(parse_bytes("800 MiB"), Ok(800 << 20));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert!(parse_bytes("12XB").unwrap_err().contains("XB"));
        assert!(parse_bytes("GiB").is_err());
    }

    #[test]
    fn phase_peaks_merge_and_max() {
        let a = PhasePeaks {
            forward: Some(10),
            backward: Some(30),
            optimizer: None,
        };
        let b = PhasePeaks {
            forward: Some(20),
            backward: Some(5),
            optimizer: Some(1),
        };
        let m = a.merge(&b);
        assert_eq!(
            m,
            PhasePeaks {
                forward: Some(20),
                backward: Some(30),
                optimizer: Some(1)
            }
        );
        assert_eq!(m.max(), Some(30));
        assert_eq!(PhasePeaks::default().max(), None);
    }

    #[test]
    fn human_bytes_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
    }
}
