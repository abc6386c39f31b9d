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
