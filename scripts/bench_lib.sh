# shellcheck shell=bash
# Shared by the benchmark scripts (sourced from the repository root: `. scripts/bench_lib.sh`).

# bench_job_toml [SECTION.KEY=VALUE ...] > FILE
# The LoRA job the benchmarks run, as a tallow config: LoRA r16, alpha 32, no dropout, over a bf16
# model; rows in file order, at most 512 tokens; micro-batch 1, grad_accum 1, constant lr 1e-4.
# model.path and data.train are placeholders ("unset") to set here or with `--set`. Each
# SECTION.KEY=VALUE (VALUE as TOML: strings quoted) sets KEY of [SECTION]: in its default's place,
# or after the section's defaults for a key without one.
bench_job_toml() {
  local defaults=(
    'model.path="unset"' 'model.dtype="bf16"'
    lora.rank=16 lora.alpha=32 lora.dropout=0.0
    'data.train="unset"' data.max_seq_len=512 data.shuffle=false
    train.micro_batch_size=1 train.grad_accum=1 train.lr=1e-4 'train.schedule="constant"'
  )
  local section kv arg key value seen=" "
  for section in model lora data train; do
    echo "[$section]"
    for kv in "${defaults[@]}" "$@"; do
      key=${kv%%=*}
      if [[ $key != "$section".* || $seen == *" $key "* ]]; then continue; fi
      seen+="$key "
      value=${kv#*=}
      for arg in "$@"; do
        if [[ ${arg%%=*} == "$key" ]]; then value=${arg#*=}; fi
      done
      echo "${key#*.} = $value"
    done
  done
}

# gpu_run_env PY DIR
# For a run of the carried tallow-cuda on a GPU machine (scripts/gpu_first_contact.sh,
# scripts/gpu_probe.sh): the CUDA 13 libraries of PY's NVIDIA wheels (`nvidia/cu13/lib`, what
# scripts/build_cuda.sh links against) on LD_LIBRARY_PATH, and the driver's JIT cache kept in
# DIR/nv-cache for the whole run, so only the first process compiles the PTX.
gpu_run_env() {
  local cu13
  cu13=$($1 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))' 2>/dev/null || true)
  if [ -n "$cu13" ] && [ -d "$cu13" ]; then
    export LD_LIBRARY_PATH=$cu13${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  # (a CUDA_CACHE_PATH already set is kept: two scripts in one call share one cache)
  export CUDA_CACHE_MAXSIZE=4294967296 CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$2/nv-cache}
}
