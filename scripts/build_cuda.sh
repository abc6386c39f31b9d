#!/usr/bin/env bash
# Builds tallow's CUDA binary, `tallow-cuda`, on a machine without a GPU or a system CUDA
# install, with the CUDA toolkit taken from NVIDIA's PyPI wheels. The plain `tallow` (CPU build)
# hands `--device cuda` to a `tallow-cuda` installed beside it (docs/cuda.md says why).
#
#   scripts/build_cuda.sh                        # CUDA 13, PTX for compute 8.0 (tallow's kernels also SASS sm_80/90) -> target/release/tallow-cuda
#   CUDA_MAJOR=12 scripts/build_cuda.sh          # CUDA 12.4 (drivers 550-579; see below)
#   CUDA_ROOT=/usr/local/cuda-12.6 scripts/build_cuda.sh   # an installed toolkit
#   CUDA_COMPUTE_CAP=90 scripts/build_cuda.sh    # PTX for one capability (80 = A100 / RTX 30 and up)
#   CI_COMPILE=1 scripts/build_cuda.sh           # CI: `cargo build --features cuda,nccl,mpi --all-targets`
#                                                #     (dev profile, tests included; needs Open MPI's
#                                                #     dev packages, as `--features mpi` does), nothing installed
#   eval "$(SETUP_ONLY=1 scripts/build_cuda.sh)"  # only fetch the toolkit; print its environment
#
# Compute capability: candle's kernels are compiled to PTX for CUDA_COMPUTE_CAP (default 80); the
# driver JIT-compiles that PTX for any newer GPU (sm_86/89 cards, Hopper, Blackwell) on first use,
# so the default runs on A100, A10/A6000, L4/L40S, RTX 30/40/50, H100/H200 and B200. Older cards
# (V100 = 70, T4 = 75) need CUDA_COMPUTE_CAP=70/75 and have no bf16.
#
# Driver: the PTX is JIT-compiled by the driver, which must support the toolkit's CUDA version:
# CUDA 13.0 needs driver >= 580, 12.4 >= 550, 12.0 >= 525. `tallow doctor` prints the driver's.
# CUDA 12 (drivers 550-579): `CUDA_MAJOR=12 scripts/build_cuda.sh` builds against CUDA 12.4. Its
# PyPI wheels give the headers, libraries, ptxas and libdevice but no compiler driver
# (nvidia-cuda-nvcc-cu12 holds no nvcc or cicc), so nvcc, cicc, cudafe++, fatbinary, nvlink and
# bin2c of the same build (12.4.131) come from Debian's `nvidia-cuda-toolkit` package, downloaded
# and unpacked (no root, nothing installed), checked against its pinned SHA-256. Or point
# CUDA_ROOT at an installed CUDA 12 toolkit (NVIDIA's `cuda-toolkit-12-x`, the runfile, conda).
#
# Needs: python3 with pip (to download wheels only), curl and ar (CUDA 12 only), and gcc/g++
# <= 14 (<= 13 for CUDA 12.4). No driver: the link step
# uses a stub libcuda.so generated here from the driver functions cudarc binds (the real
# libcuda.so.1 is found at run time, from the driver).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${CUDA_ROOT:-}" ]; then
  # An installed toolkit: its nvcc, headers, libraries (lib64) and driver stub (lib64/stubs).
  ROOT=$CUDA_ROOT
  if [ ! -x "$ROOT/bin/nvcc" ]; then
    echo "error: CUDA_ROOT=$ROOT has no bin/nvcc" >&2
    exit 1
  fi
else
  CUDA_MAJOR=${CUDA_MAJOR:-13}
  case "$CUDA_MAJOR" in
    13)
      WHEELS=('nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-runtime==13.0.*'
        'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cublas==13.0.*'
        'nvidia-cuda-nvrtc==13.0.*' 'nvidia-curand==10.4.0.*') ;;
    12)
      # 12.4: the newest CUDA 12 whose compiler driver Debian packages (trixie's non-free).
      WHEELS=('nvidia-cuda-nvcc-cu12==12.4.131' 'nvidia-cuda-runtime-cu12==12.4.127'
        'nvidia-cuda-cccl-cu12==12.4.127.post1' 'nvidia-cublas-cu12==12.4.5.8'
        'nvidia-cuda-nvrtc-cu12==12.4.127' 'nvidia-curand-cu12==10.3.5.147')
      DEB=nvidia-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb
      DEB_URL=${CUDA12_DEB_MIRROR:-http://deb.debian.org/debian}/pool/non-free/n/nvidia-cuda-toolkit/$DEB
      DEB_SHA256=cd5fe85aee38d108b315f408a688641478f2402622a10c677478eb7a6c4e5319 ;;
    *)
      echo "error: CUDA_MAJOR=$CUDA_MAJOR: this script fetches CUDA 13 or 12 (12.4); for another" \
        "version install its toolkit and run CUDA_ROOT=/usr/local/cuda-X.Y scripts/build_cuda.sh" >&2
      exit 1 ;;
  esac
  CUDA_DIR=${CUDA_DIR:-$PWD/target/cuda$CUDA_MAJOR}
  ROOT=$CUDA_DIR/root
  if [ ! -x "$ROOT/bin/nvcc" ]; then
    mkdir -p "$CUDA_DIR/wheels" "$CUDA_DIR/unpacked" "$ROOT"
    python3 -m pip download --no-deps --quiet -d "$CUDA_DIR/wheels" "${WHEELS[@]}"
    for w in "$CUDA_DIR"/wheels/*.whl; do
      python3 -m zipfile -e "$w" "$CUDA_DIR/unpacked"
    done
    # The wheels unpack into nvidia/cu13/{bin,include,lib,nvvm} (CUDA 13) or one
    # nvidia/<component>/ folder each (CUDA 12): one toolkit-shaped root of symlinks.
    for component in "$CUDA_DIR"/unpacked/nvidia/*/; do
      cp -rsf "$component". "$ROOT/"
    done
    if [ -n "${DEB:-}" ]; then
      # CUDA 12: the compiler driver and its helpers from Debian's package of the same build.
      if [ ! -e "$CUDA_DIR/$DEB" ]; then
        if ! curl -fsS -o "$CUDA_DIR/$DEB.part" "$DEB_URL"; then
          echo "error: could not download $DEB_URL (a Debian mirror with trixie's non-free" \
            "nvidia-cuda-toolkit 12.4.131: set CUDA12_DEB_MIRROR, or use CUDA_ROOT)" >&2
          exit 1
        fi
        mv "$CUDA_DIR/$DEB.part" "$CUDA_DIR/$DEB"
      fi
      if ! echo "$DEB_SHA256  $CUDA_DIR/$DEB" | sha256sum -c --quiet; then
        echo "error: $CUDA_DIR/$DEB does not match its pinned SHA-256; delete it and retry" >&2
        exit 1
      fi
      mkdir -p "$CUDA_DIR/deb" "$ROOT/nvvm/bin"
      (cd "$CUDA_DIR/deb" && ar p "$CUDA_DIR/$DEB" data.tar.xz | tar -xJ)
      tk=$CUDA_DIR/deb/usr/lib/nvidia-cuda-toolkit
      cp "$tk/bin/nvcc" "$ROOT/bin/"
      cp -r "$tk/bin/crt" "$ROOT/bin/"
      cp "$tk/bin/cicc" "$ROOT/nvvm/bin/"
      for b in cudafe++ fatbinary nvlink bin2c; do cp "$CUDA_DIR/deb/usr/bin/$b" "$ROOT/bin/"; done
      # Debian's nvcc.profile names /usr paths; this one is the toolkit's own, relative to bin/.
      cat > "$ROOT/bin/nvcc.profile" <<'PROFILE'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib:
PATH            += $(TOP)/nvvm/bin:$(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib/stubs" "-L$(TOP)/lib"
PROFILE
    fi
    chmod +x "$ROOT"/bin/* "$ROOT"/nvvm/bin/* 2>/dev/null || true
  fi
fi

# Linker names for the versioned libraries.
if [ -z "${CUDA_ROOT:-}" ]; then
  (
    cd "$ROOT/lib"
    for l in cublas cublasLt cudart nvrtc curand; do
      [ -e "lib$l.so" ] || ln -sf "$(ls lib$l.so.[0-9]* | head -1)" "lib$l.so"
    done
  )
  [ -e "$ROOT/lib64" ] || ln -sf lib "$ROOT/lib64"
fi
STUBS=$PWD/target/cuda-stubs
[ -e "$ROOT/lib64/stubs/libcuda.so" ] && STUBS=$ROOT/lib64/stubs

# The driver stub: every cu* function cudarc's driver bindings name, as an empty function, in a
# library whose soname is the driver's (libcuda.so.1). Only the linker sees it.
if [ ! -e "$STUBS/libcuda.so" ]; then
  cargo fetch --quiet
  version=$(awk '/^name = "cudarc"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)
  cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-"$version" | head -1)
  mkdir -p "$STUBS"
  grep -o 'fn cu[A-Za-z0-9_]*(' "$cudarc/src/driver/sys/mod.rs" | sort -u |
    sed 's/^fn \(.*\)($/void \1(void) {}/' > "$STUBS/libcuda.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$STUBS/libcuda.so" "$STUBS/libcuda.c"
fi

export CUDA_ROOT=$ROOT CUDA_PATH=$ROOT PATH=$ROOT/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}
# candle-kernels compiles its .cu files through cudaforge, which uses half the cores by default
# (one on a 2-core CI machine) while nothing else can build: use them all.
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export LIBRARY_PATH=$ROOT/lib64:$STUBS${LIBRARY_PATH:+:$LIBRARY_PATH}
# `nccl`: the NCCL backend for CUDA ranks (tallow-data-parallel) and `tallow doctor`'s multi-GPU check.
# NCCL is loaded at run time (libnccl.so.2), not linked: nothing here needs it.
FEATURES=tallow/cuda,tallow/nccl
if [ "${SETUP_ONLY:-0}" = 1 ]; then
  # For `eval`: the variables a `cargo build --features cuda,nccl` needs.
  for v in CUDA_ROOT CUDA_PATH PATH CUDA_COMPUTE_CAP LIBRARY_PATH CUDAFORGE_THREADS; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
elif [ "${CI_COMPILE:-0}" = 1 ]; then
  # Every target with the CUDA, NCCL and MPI code compiled in: the binary, the test binaries
  # (tests/tests/distributed.rs too), the tools. One build: `tallow/nccl` and `tallow/mpi` turn on
  # tallow-data-parallel's `nccl` and `mpi` for the whole workspace, so the code only the two
  # together compile (NCCL's id carried by MPI under mpirun, data-parallel's nccl.rs) is built.
  # (A `cargo build -p tallow` plus a `cargo check` of the other targets was timed at 7.7 min
  # against this build's 5: the check compiles every dependency again, in metadata mode.)
  cargo build --workspace --all-targets --features $FEATURES,tallow/mpi,tallow-tests/cuda,tallow-tests/mpi
else
  # Its own target folder, so the CPU build of `tallow` in target/release is not overwritten.
  CUDA_TARGET=${CARGO_TARGET_DIR:-target}/cuda-build
  CARGO_TARGET_DIR=$CUDA_TARGET cargo build --release -p tallow --features $FEATURES
  mkdir -p "${CARGO_TARGET_DIR:-target}/release"
  cp "$CUDA_TARGET/release/tallow" "${CARGO_TARGET_DIR:-target}/release/tallow-cuda"
  ls -l "${CARGO_TARGET_DIR:-target}/release/tallow-cuda"
  echo "install it beside the CPU build: cp target/release/tallow-cuda \"\$(dirname \"\$(command -v tallow)\")\""
fi
