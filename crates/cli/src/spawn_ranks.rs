//! `tallow train --nproc N`: starts N local ranks of the same command and waits for them.
//!
//! - CPU ranks talk through MPI, so they are started by Open MPI's `mpirun` (this process
//!   becomes `mpirun -np N tallow train ...`, which ends every rank when one fails).
//! - CUDA ranks (one per GPU) talk through NCCL: this process makes the NCCL id, starts N
//!   children with torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`) and `TALLOW_NCCL_ID`, and when one exits with an error or a signal
//!   ends the others and says which rank it was.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The variable naming the NCCL id for `--nproc` children (see `tallow_data_parallel::nccl`).
pub const NCCL_ID_VAR: &str = "TALLOW_NCCL_ID";

/// This command's arguments without `--nproc N` / `--nproc=N`.
pub fn args_without_nproc() -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        if a == "--nproc" {
            args.next();
            continue;
        }
        if a.to_str().is_some_and(|s| s.starts_with("--nproc=")) {
            continue;
        }
        out.push(a);
    }
    out
}

/// Whether the configured device (`train.device`) is a GPU, without opening it.
fn wants_gpu(spec: &str) -> bool {
    match spec {
        "cpu" => false,
        "auto" => crate::gpu::probe_driver().is_ok_and(|d| !d.devices.is_empty()),
        _ => true,
    }
}

/// Runs `tallow train` as `nproc` local ranks; returns when all have finished.
pub fn run(nproc: usize, device_spec: &str) -> Result<()> {
    if nproc == 0 {
        bail!("--nproc 0: give the number of ranks to start (1 or more)");
    }
    if wants_gpu(device_spec) {
        gpu_ranks(nproc, device_spec)
    } else {
        cpu_ranks(nproc)
    }
}

/// CPU ranks: this process becomes `mpirun -np N` of the same command without `--nproc`.
fn cpu_ranks(nproc: usize) -> Result<()> {
    if !cfg!(feature = "mpi") {
        bail!(
            "--nproc {nproc} on the CPU: CPU ranks talk through MPI, and this tallow was built \
             without it; build with `cargo build --release --features mpi` (needs Debian's \
             openmpi-bin, libopenmpi-dev and libclang-dev; docs/distributed.md)"
        );
    }
    let exe = std::env::current_exe().context("finding this tallow binary")?;
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &nproc.to_string()]);
    // Ranks may outnumber the cores (tests, a laptop); each sizes its own thread pools.
    cmd.arg("--oversubscribe");
    cmd.args(["--bind-to", "none"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { geteuid() } == 0 {
        // Open MPI refuses root unless told; containers and CI often run as root.
        cmd.arg("--allow-run-as-root");
    }
    cmd.arg(exe).args(args_without_nproc());
    use std::os::unix::process::CommandExt;
    let err = cmd.exec();
    bail!(
        "--nproc {nproc}: cannot start mpirun ({err}); install Open MPI (Debian: `apt install \
         openmpi-bin`), or start the ranks yourself with your MPI's launcher"
    )
}

extern "C" {
    fn geteuid() -> u32;
}

/// CUDA ranks: N children, one per GPU, joined by the NCCL id made here.
fn gpu_ranks(nproc: usize, device_spec: &str) -> Result<()> {
    if device_spec.starts_with("cuda:") {
        bail!(
            "--nproc {nproc} with train.device = {device_spec:?}: each rank takes the GPU of \
             its local rank; set train.device = \"cuda\" (and CUDA_VISIBLE_DEVICES to choose the \
             GPUs)"
        );
    }
    let gpus = crate::gpu::probe_driver()
        .map(|d| d.devices.len())
        .unwrap_or(0);
    if nproc > gpus {
        bail!("--nproc {nproc}: the driver sees {gpus} GPU(s); start at most one rank per GPU");
    }
    let id = nccl_id()?;
    let exe = std::env::current_exe().context("finding this tallow binary")?;
    let args = args_without_nproc();
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let child = Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env(NCCL_ID_VAR, &id)
            .spawn()
            .with_context(|| format!("starting rank {rank}"));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop_all(&mut children);
                return Err(e);
            }
        }
    }
    supervise(children)
}

#[cfg(feature = "nccl")]
fn nccl_id() -> Result<String> {
    Ok(tallow_data_parallel::nccl::new_id_hex()?)
}

#[cfg(not(feature = "nccl"))]
fn nccl_id() -> Result<String> {
    bail!(
        "--nproc on GPUs: CUDA ranks talk through NCCL, and this tallow was built without it; \
         build with `scripts/build_cuda.sh` (which enables the nccl feature)"
    )
}

/// Waits for every rank; the first that fails ends the others, and its failure is the error.
fn supervise(mut children: Vec<Child>) -> Result<()> {
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait().context("waiting for the ranks")? {
                done[rank] = true;
                if !status.success() {
                    let others = children.len() - 1;
                    eprintln!(
                        "tallow: rank {rank} {}; stopping the other {others} rank(s)",
                        describe(status)
                    );
                    stop_all(&mut children);
                    bail!("rank {rank} {}", describe(status));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Ends every child still running (SIGTERM, then SIGKILL after 5 s) and reaps them.
fn stop_all(children: &mut [Child]) {
    for c in children.iter() {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { kill(c.id() as i32, 15) };
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    for c in children.iter_mut() {
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// "exited with status 3" / "was killed by signal 9".
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_rank_stops_the_others_and_is_named() {
        let start = std::time::Instant::now();
        let children = vec![
            Command::new("sleep").arg("30").spawn().unwrap(),
            Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap(),
        ];
        let e = supervise(children).unwrap_err().to_string();
        assert_eq!(e, "rank 1 exited with status 3");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the sleeper was not stopped"
        );
        let ok = vec![Command::new("true").spawn().unwrap()];
        supervise(ok).unwrap();
    }
}
