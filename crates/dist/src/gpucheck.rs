//! `tallow doctor`'s multi-GPU check, the part that needs no GPU: the values each GPU holds, the
//! exact sum the all-reduce must give, and the one line the doctor prints. The all-reduce itself
//! is `crate::nccl::check_all_gpus` (feature `nccl`).

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
