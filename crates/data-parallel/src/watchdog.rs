//! A rank left waiting in a collective (a peer died without its launcher noticing, or hangs)
//! must not wait forever: the watchdog thread ends the process when one collective has lasted
//! longer than `train.dist_timeout_s`, with a message naming this rank, the collective and the
//! wait. Exiting without finalizing MPI makes mpirun end the other ranks too, and
//! `tallow train --nproc` ends the others when one exits non-zero.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The collective in flight, if any: when it began and what it is.
type InFlight = Arc<Mutex<Option<(Instant, String)>>>;

extern "C" {
    fn _exit(code: i32) -> !;
}

pub struct Watchdog {
    in_flight: InFlight,
}

/// A collective in flight; dropping it marks the collective done.
pub struct Guard<'a> {
    in_flight: &'a InFlight,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// The message a rank prints when it gives up waiting.
pub fn timeout_message(rank: usize, world: usize, what: &str, waited: Duration) -> String {
    format!(
        "tallow: rank {rank} of {world}: waited {:.0} s for the other ranks in {what}: one of \
         them died or hangs (train.dist_timeout_s); stopping this rank",
        waited.as_secs_f64()
    )
}

impl Watchdog {
    /// Starts the watchdog thread of rank `rank` of `world`.
    pub fn start(rank: usize, world: usize, timeout: Duration) -> Watchdog {
        let in_flight: InFlight = Arc::new(Mutex::new(None));
        let watched = Arc::clone(&in_flight);
        let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        std::thread::Builder::new()
            .name("tallow-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(tick);
                let late = watched
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .filter(|(since, _)| since.elapsed() > timeout)
                    .map(|(since, what)| (since.elapsed(), what.clone()));
                if let Some((waited, what)) = late {
                    eprintln!("{}", timeout_message(rank, world, &what, waited));
                    // _exit: no atexit handlers (an MPI library's may wait on the peers too).
                    // SAFETY: ends the process; nothing after it runs.
                    unsafe { _exit(1) }
                }
            })
            .expect("spawning the watchdog thread");
        Watchdog { in_flight }
    }

    /// Marks the collective `what` in flight until the guard drops.
    pub fn guard(&self, what: &str) -> Guard<'_> {
        *self.in_flight.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Instant::now(), what.to_string()));
        Guard {
            in_flight: &self.in_flight,
        }
    }
}
