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
}
