//! Device operations issued, counted where every op reaches a backend (`Storage`'s methods, and
//! `Device::zeros` and the host-to-device copies): one per op that runs a kernel, a memset, a
//! copy or a library call (cuBLAS) on CUDA, whatever the device it runs on, so a CPU run of
//! the CUDA path counts what the GPU would launch. Views (reshape, transpose, narrow,
//! broadcast) are not counted: they run nothing. A custom op counts as one, whatever its
//! body runs through the backend directly.
//!
//! Not in upstream candle-core: added for tallow (vendor/README.md). The total is one relaxed
//! atomic add per op; the per-op breakdown is kept only while [`set_breakdown`] is on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

static TOTAL: AtomicU64 = AtomicU64::new(0);
static BREAKDOWN_ON: AtomicBool = AtomicBool::new(false);
static BREAKDOWN: Mutex<Option<HashMap<&'static str, u64>>> = Mutex::new(None);

/// Device operations issued by this process so far.
pub fn count() -> u64 {
    TOTAL.load(Ordering::Relaxed)
}

/// Keeps (or stops keeping) a count per op name from now on.
pub fn set_breakdown(on: bool) {
    BREAKDOWN_ON.store(on, Ordering::Relaxed);
}

/// The per-op counts kept so far, largest first.
pub fn breakdown() -> Vec<(&'static str, u64)> {
    let mut v: Vec<(&'static str, u64)> = BREAKDOWN
        .lock()
        .map(|g| g.as_ref().map(|m| m.iter().map(|(k, v)| (*k, *v)).collect()).unwrap_or_default())
        .unwrap_or_default();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    v
}

thread_local! {
    static UNCOUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static ON_THIS_THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Device operations issued by this thread so far (for tests, which share the process with
/// others running in parallel).
pub fn count_on_this_thread() -> u64 {
    ON_THIS_THREAD.with(|c| c.get())
}

/// Runs `f` without counting the operations it issues on this thread: for a CPU twin of a
/// device op that computes the device op's values with a different sequence of operations
/// and counts the device op's own launches itself (with [`add`] after the scope).
pub fn uncounted<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            UNCOUNTED.with(|u| u.set(self.0));
        }
    }
    let _restore = Restore(UNCOUNTED.with(|u| u.replace(true)));
    f()
}

/// One operation named `name` issued.
#[inline]
pub fn add(name: &'static str) {
    if UNCOUNTED.with(|u| u.get()) {
        return;
    }
    TOTAL.fetch_add(1, Ordering::Relaxed);
    ON_THIS_THREAD.with(|c| c.set(c.get() + 1));
    if BREAKDOWN_ON.load(Ordering::Relaxed) {
        if let Ok(mut g) = BREAKDOWN.lock() {
            *g.get_or_insert_with(HashMap::new).entry(name).or_insert(0) += 1;
        }
    }
    if TIMING_ON.load(Ordering::Relaxed) {
        time(name);
    }
}

/// Synchronizes the device the timed ops run on (the application's device handle).
pub type SyncHook = Box<dyn Fn() + Send + Sync>;

/// Device time per op name ([`set_timing`]): a development measure for a GPU machine with no
/// profiler. While it is on, every counted op first synchronizes the device through the hook,
/// and the time since the previous op was issued goes to that previous op: its kernels (all of
/// a custom op's, cuBLAS included) plus the host's work between the two. It slows the run (one
/// sync per op); [`timing_pause`] leaves gaps (the host's work between steps) uncounted.
struct Timing {
    hook: SyncHook,
    last: Option<(&'static str, std::time::Instant)>,
}

static TIMING_ON: AtomicBool = AtomicBool::new(false);
static TIMING: Mutex<Option<Timing>> = Mutex::new(None);
static TIMES: Mutex<Option<HashMap<&'static str, (u64, f64)>>> = Mutex::new(None);

/// Starts timing ops with `hook` (Some) or stops (None); the totals are kept until read.
pub fn set_timing(hook: Option<SyncHook>) {
    let mut t = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(old) = t.as_mut() {
        close(old);
    }
    TIMING_ON.store(hook.is_some(), Ordering::Relaxed);
    *t = hook.map(|hook| Timing { hook, last: None });
}

/// Synchronizes, gives the op in flight its time, and counts nothing until the next op.
pub fn timing_pause() {
    if let Some(t) = TIMING.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        close(t);
    }
}

/// Per op name: ops timed and seconds, most seconds first.
pub fn timing() -> Vec<(&'static str, u64, f64)> {
    let mut v: Vec<(&'static str, u64, f64)> = TIMES
        .lock()
        .map(|g| g.as_ref().map(|m| m.iter().map(|(k, (n, s))| (*k, *n, *s)).collect()).unwrap_or_default())
        .unwrap_or_default();
    v.sort_by(|a, b| b.2.total_cmp(&a.2).then(a.0.cmp(b.0)));
    v
}

fn close(t: &mut Timing) {
    if let Some((name, since)) = t.last.take() {
        (t.hook)();
        credit(name, since.elapsed().as_secs_f64());
    }
}

fn credit(name: &'static str, secs: f64) {
    if let Ok(mut g) = TIMES.lock() {
        let e = g.get_or_insert_with(HashMap::new).entry(name).or_insert((0, 0.0));
        e.0 += 1;
        e.1 += secs;
    }
}

#[cold]
fn time(name: &'static str) {
    let mut g = TIMING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = g.as_mut() {
        close(t);
        t.last = Some((name, std::time::Instant::now()));
    }
}
