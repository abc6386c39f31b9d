//! The doctor's multi-GPU line: one NCCL all-reduce of known values over every visible GPU, from
//! this process ([`tallow_data_parallel::nccl::all_reduce_sum_over_gpus`], feature `nccl`),
//! compared with the exact sum. The values, the sum and the line need no GPU, and are tested here.

// Without `nccl` the check is skipped: only the tests use the values and the sum.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

/// What the multi-GPU check found.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuCheck {
    /// It did not run: why.
    Skipped(String),
    /// The all-reduce ran over `gpus` GPUs; the first wrong element, if any.
    Ran {
        gpus: usize,
        mismatch: Option<String>,
    },
}

/// Why a build without the `nccl` feature skips the check.
#[cfg(any(not(feature = "nccl"), test))]
pub const NOT_BUILT: &str = "not built with nccl (scripts/build_cuda.sh builds it)";

/// The value GPU `gpu` contributes at element `j`: `(gpu + 1) * (j % 251 + 1)`, so a sum that
/// drops, doubles or misplaces one GPU's or one element's share is wrong.
pub fn value(gpu: usize, j: usize) -> f32 {
    ((gpu + 1) * (j % 251 + 1)) as f32
}

/// The exact sum of [`value`] over `gpus` GPUs at element `j`: `(j % 251 + 1) * g (g + 1) / 2`.
/// Every partial sum is an integer below 2^24, so f32 holds it exactly in whatever order NCCL
/// adds (up to 64 GPUs).
pub fn sum(gpus: usize, j: usize) -> f32 {
    ((j % 251 + 1) * gpus * (gpus + 1) / 2) as f32
}

/// The first element of `got` (GPU `gpu`'s result over `gpus` GPUs) that is not [`sum`], as
/// the doctor says it.
pub fn first_mismatch(gpu: usize, gpus: usize, got: &[f32]) -> Option<String> {
    let j = got
        .iter()
        .enumerate()
        .position(|(j, &g)| g != sum(gpus, j))?;
    Some(format!(
        "GPU {gpu} element {j}: got {}, want {}",
        got[j],
        sum(gpus, j)
    ))
}

/// f32 elements of the multi-GPU all-reduce: 4 MiB per GPU, past NCCL's small-message
/// protocols, and not a multiple of any chunk size.
#[cfg(feature = "nccl")]
const ELEMENTS: usize = (1 << 20) + 3;

/// How long the multi-GPU all-reduce may take: a broken link between GPUs makes NCCL hang,
/// not fail.
#[cfg(feature = "nccl")]
const WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The multi-GPU check, on its own thread so that a hang is reported rather than waited out (a
/// hung thread ends with the process).
#[cfg(feature = "nccl")]
pub fn check() -> Result<GpuCheck, String> {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(all_gpus(ELEMENTS).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(WAIT) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => Err(format!(
            "no result within {} s: NCCL hangs between these GPUs (NCCL_DEBUG=INFO says where; \
             NCCL_P2P_DISABLE=1 tries without peer-to-peer copies)",
            WAIT.as_secs()
        )),
        Err(RecvTimeoutError::Disconnected) => Err("the check panicked".into()),
    }
}

#[cfg(not(feature = "nccl"))]
pub fn check() -> Result<GpuCheck, String> {
    Ok(GpuCheck::Skipped(NOT_BUILT.into()))
}

/// One all-reduce (sum) of `elements` f32 over every visible GPU, GPU i holding
/// [`value`]`(i, j)`, every GPU's result compared element by element with [`sum`]; the first
/// difference is reported. Skipped with fewer than 2 GPUs or without NCCL (one-GPU work does not
/// need it: a skip that says how to get it, not a failure).
#[cfg(feature = "nccl")]
fn all_gpus(elements: usize) -> tallow_data_parallel::Result<GpuCheck> {
    use tallow_data_parallel::{libnccl, nccl};
    let gpus = nccl::visible_gpus()?;
    if gpus < 2 {
        return Ok(GpuCheck::Skipped(format!(
            "{gpus} GPU visible: the all-reduce between GPUs needs 2 or more (CUDA_VISIBLE_DEVICES)"
        )));
    }
    if let Err(why) = libnccl::get() {
        return Ok(GpuCheck::Skipped(why));
    }
    let inputs: Vec<Vec<f32>> = (0..gpus)
        .map(|i| (0..elements).map(|j| value(i, j)).collect())
        .collect();
    let results = nccl::all_reduce_sum_over_gpus(&inputs)?;
    let mismatch = results
        .iter()
        .enumerate()
        .find_map(|(i, got)| first_mismatch(i, gpus, got));
    Ok(GpuCheck::Ran { gpus, mismatch })
}

impl GpuCheck {
    /// "ok", "FAIL" or "skip", and the rest of the doctor's line.
    pub fn line(result: &Result<GpuCheck, String>) -> (&'static str, String) {
        match result {
            Ok(GpuCheck::Skipped(why)) => ("skip", format!("nccl all-reduce: skipped: {why}")),
            Ok(GpuCheck::Ran {
                gpus,
                mismatch: None,
            }) => ("ok", format!("nccl all-reduce over {gpus} GPUs: ok")),
            Ok(GpuCheck::Ran {
                gpus,
                mismatch: Some(m),
            }) => (
                "FAIL",
                format!("nccl all-reduce over {gpus} GPUs: mismatch at {m}"),
            ),
            Err(e) => ("FAIL", format!("nccl all-reduce: error: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expected_sums_are_exact_in_any_order_and_catch_a_wrong_share() {
        for gpus in [2, 3, 8, 64] {
            for j in [0, 1, 250, 251, 1000, 1 << 20] {
                let parts: Vec<f32> = (0..gpus).map(|g| value(g, j)).collect();
                let forward: f32 = parts.iter().sum();
                let backward: f32 = parts.iter().rev().sum();
                // A ring's order: each GPU's share added starting from another one.
                let rotated: f32 = (0..gpus).map(|k| parts[(k + gpus / 2) % gpus]).sum();
                for s in [forward, backward, rotated] {
                    assert_eq!(s, sum(gpus, j), "{gpus} GPUs, element {j}");
                }
                // One GPU's share dropped or doubled, or the neighbouring element's values.
                for p in &parts {
                    assert_ne!(forward - p, sum(gpus, j));
                    assert_ne!(forward + p, sum(gpus, j));
                }
                assert_ne!(sum(gpus, j + 1), sum(gpus, j));
            }
        }
        let mut got: Vec<f32> = (0..300).map(|j| sum(4, j)).collect();
        assert_eq!(first_mismatch(1, 4, &got), None);
        got[257] += 1.0;
        assert_eq!(
            first_mismatch(1, 4, &got).unwrap(),
            "GPU 1 element 257: got 71, want 70"
        );
    }

    #[test]
    fn doctor_lines() {
        let (s, l) = GpuCheck::line(&Ok(GpuCheck::Ran {
            gpus: 8,
            mismatch: None,
        }));
        assert_eq!((s, l.as_str()), ("ok", "nccl all-reduce over 8 GPUs: ok"));
        let (s, l) = GpuCheck::line(&Ok(GpuCheck::Skipped(NOT_BUILT.into())));
        assert_eq!(s, "skip");
        assert_eq!(
            l,
            "nccl all-reduce: skipped: not built with nccl (scripts/build_cuda.sh builds it)"
        );
        let (s, l) = GpuCheck::line(&Ok(GpuCheck::Ran {
            gpus: 2,
            mismatch: Some("GPU 1 element 3: got 1, want 12".into()),
        }));
        assert_eq!(s, "FAIL");
        assert!(
            l.ends_with("mismatch at GPU 1 element 3: got 1, want 12"),
            "{l}"
        );
    }
}
