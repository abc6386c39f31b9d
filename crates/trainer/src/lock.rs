//! One run per output directory: `train.output_dir/.tallow-lock`.
//!
//! A run creates the lock file with `O_EXCL` (`create_new`: of two runs racing for it exactly
//! one succeeds) before it writes anything else into the directory, and removes it when it ends,
//! by return or by error ([`RunLock`]'s `Drop`). The file names its holder: PID, host, when the
//! run started and, on Linux, the process's own start time. A second run finds the file and
//! either refuses (the holder is alive, or on another host where it cannot be checked) or takes
//! the lock over (the holder is gone: a run killed with SIGKILL, a node that rebooted). Without
//! the lock, two runs into one directory both ran to the end, interleaving `metrics.jsonl` and
//! overwriting each other's checkpoints (issue 34).
//!
//! A PID alone does not identify a process: after the holder dies the kernel may give its PID to
//! another one. The lock also stores the holder's start time in clock ticks since boot
//! (`/proc/<pid>/stat`, field 22); a process with that PID but another start time is not the
//! holder. Nor is a zombie (state `Z`): a killed run its parent has not yet waited for.

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::LockError;

/// The lock file's name inside `train.output_dir`.
pub const LOCK_FILE: &str = ".tallow-lock";

/// Who holds a lock: what the lock file holds, one JSON object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// When the run took the lock, in seconds since the Unix epoch.
    pub started_unix_s: u64,
    /// The process's start time in clock ticks since boot (`/proc/<pid>/stat` field 22); None
    /// where there is no `/proc`.
    pub proc_start: Option<u64>,
}

/// What a lock file's holder is, seen from this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// A process on this host that is running (or one that cannot be checked: no `/proc`).
    Live,
    /// On this host and gone: no process has its PID, or the one that has it started at
    /// another time (the PID was reused).
    Stale,
    /// On another host: its processes cannot be seen from here.
    OtherHost,
}

impl Holder {
    /// This process, now.
    pub fn this_process() -> Self {
        let pid = std::process::id();
        Self {
            pid,
            host: hostname(),
            started_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            proc_start: proc_start(pid),
        }
    }

    /// Whether this holder is alive, seen from `host` (this machine's [`hostname`]).
    pub fn holding(&self, host: &str) -> Holding {
        if self.host != host {
            return Holding::OtherHost;
        }
        if !Path::new("/proc/self").exists() {
            // No /proc to look in: assume the worst, the user is told how to take over.
            return Holding::Live;
        }
        match (proc_stat(self.pid), self.proc_start) {
            // No such process.
            (None, _) => Holding::Stale,
            // Killed but not yet reaped by its parent (a zombie): it runs no more code.
            (Some(('Z' | 'X', _)), _) => Holding::Stale,
            // Another process that got the PID later.
            (Some((_, now)), Some(want)) if now != want => Holding::Stale,
            _ => Holding::Live,
        }
    }

    /// "3 min ago" (from `started_unix_s`).
    fn started_ago(&self) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let s = now.saturating_sub(self.started_unix_s);
        match s {
            0..60 => format!("{s} s ago"),
            60..3600 => format!("{} min ago", s / 60),
            _ => format!("{} h {} min ago", s / 3600, s % 3600 / 60),
        }
    }
}

/// This machine's name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else "localhost").
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Process `pid`'s state (`R`, `S`, ..., `Z` for a zombie) and start time in clock ticks since
/// boot: fields 3 and 22 of `/proc/<pid>/stat`. Field 2 (the command name, in parentheses) may
/// hold spaces and parentheses itself, so the fields are counted after its last `)`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    Some((state, fields.get(22 - 3)?.parse().ok()?))
}

/// Process `pid`'s start time ([`proc_stat`]).
fn proc_start(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, start)| start)
}

/// The lock on a run's output directory, held until dropped.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    /// What this run wrote into the file (dropping removes the file only while it still holds
    /// this).
    text: String,
}

impl RunLock {
    /// Takes `dir/.tallow-lock` (`dir` exists). Refuses a directory a live run holds, or one
    /// held from another host; takes over the lock of a run that is gone and returns a note
    /// saying so.
    pub fn acquire(dir: &Path) -> Result<(Self, Option<String>), LockError> {
        let path = dir.join(LOCK_FILE);
        let io = |source| LockError::Io {
            path: path.clone(),
            source,
        };
        let me = Holder::this_process();
        let text = serde_json::to_string(&me).expect("a plain struct") + "\n";
        let mut note = None;
        // Each pass either takes the lock, refuses, or removes a stale lock and tries again.
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    f.write_all(text.as_bytes()).map_err(io)?;
                    return Ok((Self { path, text }, note));
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
            let Some((held, holder)) = read_holder(&path, dir)? else {
                continue; // released in between
            };
            match holder.holding(&me.host) {
                h @ (Holding::Live | Holding::OtherHost) => {
                    return Err(refusal(dir, path, holder, h))
                }
                Holding::Stale => {
                    take_over(&path, &held).map_err(io)?;
                    note = Some(format!(
                        "{}: the run that held it (process {} on {}, started {}) is gone; lock \
                         taken over",
                        path.display(),
                        holder.pid,
                        holder.host,
                        holder.started_ago()
                    ));
                }
            }
        }
    }
}

/// Refuses `dir` when a live run holds it (or one on another host) without taking the lock: a
/// launcher's check before it starts the ranks of a data-parallel run (rank 0 then takes it).
pub fn check(dir: &Path) -> Result<(), LockError> {
    let path = dir.join(LOCK_FILE);
    let Some((_, holder)) = read_holder(&path, dir)? else {
        return Ok(());
    };
    match holder.holding(&hostname()) {
        Holding::Stale => Ok(()),
        h => Err(refusal(dir, path, holder, h)),
    }
}

/// The error for the lock `holder` holds (`holding`: live, or on another host).
fn refusal(dir: &Path, lock: PathBuf, holder: Holder, holding: Holding) -> LockError {
    let started = holder.started_ago();
    let (dir, pid, host) = (dir.to_path_buf(), holder.pid, holder.host);
    if holding == Holding::OtherHost {
        LockError::HeldElsewhere {
            dir,
            lock,
            pid,
            host,
            started,
        }
    } else {
        LockError::Held {
            dir,
            lock,
            pid,
            host,
            started,
        }
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if std::fs::read_to_string(&self.path).is_ok_and(|t| t == self.text) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The lock file's text and holder; None when it is gone. A run that has just created the file
/// may not have written it yet: an unreadable file is read again for up to a second.
fn read_holder(path: &Path, dir: &Path) -> Result<Option<(String, Holder)>, LockError> {
    let mut tries = 0;
    loop {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(LockError::Io {
                    path: path.to_path_buf(),
                    source,
                })
            }
        };
        match serde_json::from_str::<Holder>(&text) {
            Ok(h) => return Ok(Some((text, h))),
            Err(_) if tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(LockError::Unreadable {
                    dir: dir.to_path_buf(),
                    lock: path.to_path_buf(),
                    detail: e.to_string(),
                })
            }
        }
    }
}

/// Removes the stale lock `path` whose text was `held`. Two runs may find the same stale lock:
/// each renames the file aside (one rename wins) and removes it only if it is still the stale
/// one; a lock that another run took meanwhile is put back.
fn take_over(path: &Path, held: &str) -> std::io::Result<()> {
    let aside = path.with_file_name(format!("{LOCK_FILE}.stale-{}", std::process::id()));
    match std::fs::rename(path, &aside) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    if std::fs::read_to_string(&aside).is_ok_and(|t| t != held) {
        // Another run's fresh lock: back into place unless a third run made one meanwhile.
        let _ = std::fs::hard_link(&aside, path);
    }
    std::fs::remove_file(&aside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(pid: u32, host: &str) -> Holder {
        Holder {
            pid,
            host: host.into(),
            started_unix_s: 0,
            proc_start: proc_start(pid),
        }
    }

    /// The PID of a process that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn a_lock_is_stale_only_when_its_process_on_this_host_is_gone() {
        let host = hostname();
        let me = Holder::this_process();
        assert_eq!(me.holding(&host), Holding::Live, "{me:?}");
        let dead = dead_pid();
        assert_eq!(holder(dead, &host).holding(&host), Holding::Stale);
        // Killed and not yet reaped (a zombie, as a killed run is until its parent waits).
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let running = holder(child.id(), &host);
        assert_eq!(running.holding(&host), Holding::Live);
        child.kill().unwrap();
        let t0 = std::time::Instant::now();
        while proc_stat(child.id()).is_some_and(|(state, _)| state != 'Z') {
            assert!(t0.elapsed().as_secs() < 10, "{:?}", proc_stat(child.id()));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(running.holding(&host), Holding::Stale, "a zombie");
        child.wait().unwrap();
        // Another host: its processes cannot be seen, whatever its PID.
        let elsewhere = format!("{host}-elsewhere");
        assert_eq!(holder(dead, &elsewhere).holding(&host), Holding::OtherHost);
        assert_eq!(
            holder(std::process::id(), &elsewhere).holding(&host),
            Holding::OtherHost
        );
        // This PID, but a process that started at another time: the PID was reused.
        if let Some(t) = me.proc_start {
            let reused = Holder {
                proc_start: Some(t + 1),
                ..me.clone()
            };
            assert_eq!(reused.holding(&host), Holding::Stale);
        }
    }

    #[test]
    fn a_second_lock_is_refused_a_stale_one_taken_over_and_drop_releases() {
        let dir = std::env::temp_dir().join(format!("tallow-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(LOCK_FILE);
        let (lock, note) = RunLock::acquire(&dir).unwrap();
        assert!(note.is_none());
        let err = RunLock::acquire(&dir).unwrap_err().to_string();
        let pid = std::process::id().to_string();
        assert!(
            err.contains(&pid) && err.contains(&hostname()) && err.contains(LOCK_FILE),
            "{err}"
        );
        drop(lock);
        assert!(!path.exists(), "dropping the lock removes the file");

        // A killed run's lock: taken over, with a note naming the dead PID.
        let dead = holder(dead_pid(), &hostname());
        std::fs::write(&path, serde_json::to_string(&dead).unwrap()).unwrap();
        let (lock, note) = RunLock::acquire(&dir).unwrap();
        let note = note.expect("a takeover note");
        assert!(note.contains(&format!("process {}", dead.pid)), "{note}");
        let now: Holder = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(now.pid, std::process::id());
        drop(lock);

        // Another host's lock is refused, naming the host and how to take over.
        let other = holder(1, "some-other-node");
        std::fs::write(&path, serde_json::to_string(&other).unwrap()).unwrap();
        let err = RunLock::acquire(&dir).unwrap_err().to_string();
        assert!(
            err.contains("some-other-node") && err.contains("delete"),
            "{err}"
        );
        assert!(path.exists(), "another host's lock is left in place");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
