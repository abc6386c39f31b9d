#!/usr/bin/env bash
# Builds `tallow` with `--features cuda` on a machine without a GPU or a system CUDA install,
# against CUDA 13.0 taken from NVIDIA's PyPI wheels, so that the binary links the CUDA 13
# libraries (libcublas.so.13, libcudart.so.13, ...) an H100/H200 machine with a CUDA 13 driver
# has (e.g. inside its PyTorch environment's `nvidia` package).
#
#   scripts/build_cuda.sh                 # -> target/release/tallow (stripped), PTX for sm_90
#   CUDA_COMPUTE_CAP=80 scripts/build_cuda.sh
#   CHECK_ONLY=1 scripts/build_cuda.sh    # `cargo check --features cuda` only (needs the wheels; not in CI)
#
# Needs: python3 with pip (only to download wheels), gcc/g++ <= 14, and the driver stub
# `libcuda.so.1` at link time (Debian: `apt-get install libcuda1`, any version; or set
# LIBCUDA=/path/to/libcuda.so.1). With a normal CUDA >= 12 install, skip this script:
#   CUDA_COMPUTE_CAP=90 cargo build --release --features cuda
#
# Running the binary on the GPU machine: point LD_LIBRARY_PATH at the CUDA 13 libs there, e.g.
#   export LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))')
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_DIR=${CUDA_DIR:-$PWD/target/cuda13}
ROOT=$CUDA_DIR/nvidia/cu13
if [ ! -x "$ROOT/bin/nvcc" ]; then
  mkdir -p "$CUDA_DIR/wheels"
  python3 -m pip download --no-deps --quiet -d "$CUDA_DIR/wheels" \
    'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-runtime==13.0.*' \
    'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cublas==13.0.*' \
    'nvidia-cuda-nvrtc==13.0.*' 'nvidia-curand==10.4.0.*'
  for w in "$CUDA_DIR"/wheels/*.whl; do
    python3 -m zipfile -e "$w" "$CUDA_DIR"
  done
  chmod +x "$ROOT"/bin/* "$ROOT"/nvvm/bin/* 2>/dev/null || true
fi
# Linker names for the versioned libraries, and the driver stub.
(
  cd "$ROOT/lib"
  for l in cublas cublasLt cudart nvrtc; do
    [ -e "lib$l.so" ] || ln -sf "$(ls lib$l.so.13* | head -1)" "lib$l.so"
  done
  [ -e libcurand.so ] || ln -sf "$(ls libcurand.so.10* | head -1)" libcurand.so
  if [ ! -e libcuda.so ]; then
    LIBCUDA=${LIBCUDA:-$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')}
    if [ -z "$LIBCUDA" ]; then
      echo "error: no libcuda.so.1 to link against; install Debian's libcuda1 (non-free) or set LIBCUDA" >&2
      exit 1
    fi
    ln -sf "$LIBCUDA" libcuda.so
  fi
)
[ -e "$ROOT/lib64" ] || ln -sf lib "$ROOT/lib64"
export CUDA_ROOT=$ROOT CUDA_PATH=$ROOT PATH=$ROOT/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
if [ "${CHECK_ONLY:-0}" = 1 ]; then
  cargo check --workspace --all-targets --features tallow/cuda,tallow-tests/cuda
else
  cargo build --release -p tallow --features cuda
  ls -l "${CARGO_TARGET_DIR:-target}/release/tallow"
fi
