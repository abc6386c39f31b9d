//! The CPU build's `--device cuda` / `auto` path and `tallow doctor`, on a machine without a
//! GPU: a fake NVIDIA driver (`libcuda.so.1` whose answers come from environment variables), a
//! fake CUDA library (`libcublas.so.13`) and a fake `tallow-cuda` that needs it, all built here
//! with `cc`, stand in for the real ones. Each test removes one piece and checks that the one
//! message names it, or, with every piece there, that the command is handed to `tallow-cuda`
//! with its arguments unchanged.

use std::path::{Path, PathBuf};
use std::process::Command;

use tallow_tests::{scratch, tallow, tallow_env, Run};

const FAKE_DRIVER: &str = r#"
#include <stdlib.h>
#include <string.h>
static int env(const char *k, int d) { const char *v = getenv(k); return v ? atoi(v) : d; }
int cuInit(unsigned f) { (void)f; return env("FAKE_CUINIT_RC", 0); }
int cuDriverGetVersion(int *v) { *v = env("FAKE_CUDA_VERSION", 13000); return 0; }
int cuDeviceGetCount(int *n) { *n = env("FAKE_CUDA_DEVICES", 1); return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDeviceGetName(char *b, int len, int d) { (void)d; strncpy(b, "Fake GPU", len); return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) {
    (void)d; *v = a == 75 ? 8 : a == 76 ? 6 : a == 115 ? 1 : 0; return 0;
}
int cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = (size_t)24 << 30; return 0; }
"#;

const FAKE_CUBLAS: &str = "int fake_cublas(void) { return 7; }\n";

/// Prints its arguments and exits with 0 if the library answered. Records the CUDA toolkit
/// version as `tallow-cuda` does (12.8: needs a driver for CUDA >= 12.8).
const FAKE_TALLOW_CUDA: &str = r#"
#include <stdio.h>
#include <stdlib.h>
__attribute__((used)) static const char marker[] = "tallow-cuda-toolkit:12.8;";
int fake_cublas(void);
int main(int argc, char **argv) {
    printf("fake tallow-cuda:");
    for (int i = 1; i < argc; i++) printf(" %s", argv[i]);
    printf("\n");
    const char *h = getenv("TALLOW_HANDED_OFF");
    printf("handed off: %s\n", h ? h : "no");
    return fake_cublas() == 7 ? 0 : 1;
}
"#;

fn cc(args: &[&str], dir: &Path) {
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(args)
        .current_dir(dir)
        .status()
        .expect("a C compiler (cc) to build the fake driver");
    assert!(status.success(), "cc {args:?} failed");
}

/// driver/libcuda.so.1, libs/libcublas.so.13 and bin/tallow-cuda (needing libcublas.so.13).
struct Fakes {
    driver: PathBuf,
    libs: PathBuf,
    binary: PathBuf,
}

fn fakes(name: &str) -> Fakes {
    let root = scratch(name);
    let (driver, libs, bin) = (root.join("driver"), root.join("libs"), root.join("bin"));
    for d in [&driver, &libs, &bin] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(root.join("driver.c"), FAKE_DRIVER).unwrap();
    std::fs::write(root.join("cublas.c"), FAKE_CUBLAS).unwrap();
    std::fs::write(root.join("main.c"), FAKE_TALLOW_CUDA).unwrap();
    cc(
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            "driver/libcuda.so.1",
            "driver.c",
        ],
        &root,
    );
    cc(
        &[
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcublas.so.13",
            "-o",
            "libs/libcublas.so.13",
            "cublas.c",
        ],
        &root,
    );
    cc(
        &["-o", "bin/tallow-cuda", "main.c", "libs/libcublas.so.13"],
        &root,
    );
    Fakes {
        driver,
        libs,
        binary: bin.join("tallow-cuda"),
    }
}

/// `tallow ARGS` with the fake driver (and, if `with_libs`, the fake library) on the loader
/// path, `tallow-cuda` = `binary`, and extra variables.
fn run(f: &Fakes, with_libs: bool, binary: &Path, args: &[&str], extra: &[(&str, &str)]) -> Run {
    let mut path = f.driver.display().to_string();
    if with_libs {
        path = format!("{path}:{}", f.libs.display());
    }
    let mut env = vec![
        ("LD_LIBRARY_PATH", path),
        ("TALLOW_CUDA", binary.display().to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    tallow_env(args, &env)
}

#[test]
fn cuda_is_handed_to_tallow_cuda_with_the_same_arguments() {
    let f = fakes("gpu-handoff");
    let r = run(
        &f,
        true,
        &f.binary,
        &["doctor", "--device", "cuda:0", "--json"],
        &[],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        r.stdout.trim(),
        "fake tallow-cuda: doctor --device cuda:0 --json\nhanded off: 1"
    );

    // auto says which device it chose and why, then hands over too.
    let r = run(&f, true, &f.binary, &["doctor", "--device", "auto"], &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .starts_with("fake tallow-cuda: doctor --device auto"),
        "{}",
        r.stdout
    );
    assert!(
        r.stderr
            .contains("device auto -> cuda:0 (Fake GPU, compute 8.6, 24.00 GiB)"),
        "{}",
        r.stderr
    );
}

/// `--device cuda` fails with exit 1, one `error:` line containing `want`, and no backtrace;
/// `--device auto` falls back to the CPU, saying why on stderr.
fn refused(r: Run, auto: Run, want: &str) {
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains(want), "want `{want}` in:\n{}", r.stderr);
    assert!(r.stderr.starts_with("error: --device cuda"), "{}", r.stderr);
    assert_eq!(
        r.stderr.trim().lines().count(),
        1,
        "one message:\n{}",
        r.stderr
    );
    assert!(!r.stderr.contains("backtrace") && !r.stderr.contains("panicked"));
    assert!(!r.stdout.contains("fake tallow-cuda"));
    // auto: the CPU, and the same reason
    assert_eq!(auto.code, 0, "{}", auto.stderr);
    assert!(
        auto.stderr.contains("device auto -> cpu: "),
        "{}",
        auto.stderr
    );
    assert!(
        auto.stderr.contains(want),
        "want `{want}` in:\n{}",
        auto.stderr
    );
    assert!(auto.stdout.contains("device    cpu"), "{}", auto.stdout);
}

fn both(f: &Fakes, libs: bool, binary: &Path, extra: &[(&str, &str)]) -> (Run, Run) {
    (
        run(f, libs, binary, &["doctor", "--device", "cuda"], extra),
        run(f, libs, binary, &["doctor", "--device", "auto"], extra),
    )
}

#[test]
fn each_missing_piece_is_named() {
    let f = fakes("gpu-missing");
    // No driver at all (the fake driver's folder is not on the loader path; skipped where a
    // real driver is installed, which the loader would find anyway).
    let real_driver = Command::new("sh")
        .args(["-c", "ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '"])
        .status()
        .is_ok_and(|s| s.success());
    if !real_driver {
        let r = tallow_env(
            ["doctor", "--device", "cuda"],
            &[
                ("LD_LIBRARY_PATH", String::new()),
                ("TALLOW_CUDA", f.binary.display().to_string()),
            ],
        );
        let auto = tallow_env(
            ["doctor", "--device", "auto"],
            &[
                ("LD_LIBRARY_PATH", String::new()),
                ("TALLOW_CUDA", f.binary.display().to_string()),
            ],
        );
        refused(r, auto, "no NVIDIA driver: libcuda.so.1 cannot be loaded");
    }

    let (r, a) = both(&f, true, &f.binary, &[("FAKE_CUINIT_RC", "100")]);
    refused(
        r,
        a,
        "failed to initialize (cuInit error 100: no CUDA-capable device)",
    );

    let (r, a) = both(&f, true, &f.binary, &[("FAKE_CUDA_DEVICES", "0")]);
    refused(r, a, "sees no GPU");

    // The build records CUDA 12.8: a 12.4 driver cannot JIT its PTX, a 12.8 one can.
    let (r, a) = both(&f, true, &f.binary, &[("FAKE_CUDA_VERSION", "12040")]);
    refused(r, a, "the NVIDIA driver supports CUDA 12.4 but");
    let (r, _) = both(&f, true, &f.binary, &[("FAKE_CUDA_VERSION", "12040")]);
    assert!(
        r.stderr
            .contains("built with CUDA 12.8, which needs driver >= 570")
            && r.stderr.contains("`CUDA_MAJOR=12 scripts/build_cuda.sh`"),
        "{}",
        r.stderr
    );
    // A 12.2 driver is older than the CUDA 12.4 that build_cuda.sh fetches: an installed toolkit.
    let (r, _) = both(&f, true, &f.binary, &[("FAKE_CUDA_VERSION", "12020")]);
    assert!(
        r.stderr
            .contains("CUDA_ROOT=/usr/local/cuda-12.x scripts/build_cuda.sh` with a toolkit"),
        "{}",
        r.stderr
    );
    let r = run(
        &f,
        true,
        &f.binary,
        &["doctor", "--device", "cuda"],
        &[("FAKE_CUDA_VERSION", "12080")],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);

    let (r, a) = both(&f, false, &f.binary, &[]);
    refused(
        r,
        a,
        "needs CUDA libraries that cannot be loaded: libcublas.so.13",
    );

    let absent = f.binary.with_file_name("not-there");
    let (r, a) = both(&f, true, &absent, &[]);
    refused(r, a, "its CUDA build `tallow-cuda` is not installed");

    // A GPU number the driver does not have.
    let r = run(&f, true, &f.binary, &["doctor", "--device", "cuda:3"], &[]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("there is no GPU 3: the driver sees 1"),
        "{}",
        r.stderr
    );
}

#[test]
fn doctor_on_the_cpu_passes_every_check_and_prints_json() {
    let r = tallow(["doctor", "--device", "cpu", "--json"]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON object");
    assert_eq!(v["ok"], true);
    let checks = v["checks"].as_array().unwrap();
    assert!(checks.len() >= 14, "{checks:?}");
    for c in checks {
        assert_eq!(c["ok"], true, "{c}");
        assert!(c["name"].is_string() && c["max_abs_err"].is_number() && c["tol"].is_number());
        assert!(c["max_abs_err"].as_f64().unwrap() <= c["tol"].as_f64().unwrap());
    }
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    for want in [
        "rmsnorm",
        "rope",
        "softmax",
        "nf4 dequantize",
        "nf4 matmul",
        "fused loss",
        "lora linear",
        "lora dropout",
        "adamw 3",
        "adamw8bit",
        "checkpointed",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "no `{want}` check in {names:?}"
        );
    }
    assert_eq!(v["build"]["cuda"], false);
    // The CPU build has no NCCL: the multi-GPU check is skipped, saying how to get it.
    assert_eq!(v["build"]["nccl"], false);
    assert_eq!(v["nccl"]["status"], "skip");
    assert_eq!(
        v["nccl"]["line"],
        "nccl all-reduce: skipped: not built with nccl (scripts/build_cuda.sh builds it)"
    );
}
