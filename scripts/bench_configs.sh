#!/usr/bin/env bash
# Measured peak memory next to `tallow estimate`, with `tallow bench` (one process per cell), on
# this machine; appends the tables to benchmarks/estimate.md and writes the charts next to it.
#
#   scripts/bench_configs.sh                 # CPU: every part below
#   DEVICE=cuda TALLOW=./tallow PARTS=configs scripts/bench_configs.sh   # on a GPU machine
#
# Parts (PARTS, default "quickstart grid configs"):
#   quickstart  configs/quickstart.toml (the tiny model in the repo), a 4-cell grid: its rows are
#               ~10 tokens, padded per micro-batch, where the estimate assumes max_seq_len-long
#               rows (an upper bound); packing (data.pack) fills the rows;
#   grid        the 16-cell grid of tests/tests/bench_cli.rs on a random 105M Llama;
#   configs-large  (not in the default) llama-3.2-1b, qwen2.5-1.5b, llama-3.2-3b LoRA configs at
#               128 tokens on CPU, one cell each;
#   configs     configs/qwen2.5-0.5b/{lora,qlora}.toml with random weights of the real
#               architecture (benchmarks/models/qwen2.5-0.5b-instruct.json); on CPU at 256
#               tokens per row and grad_accum 1 (the files' 2048 x 16 would take hours here).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
DEVICE=${DEVICE:-cpu}
PARTS=${PARTS:-quickstart grid configs}
WORK=${WORK:-target/bench-configs}
OUT=${OUT:-benchmarks/estimate.md}
STEPS=${STEPS:-3}
mkdir -p "$WORK"
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow -p tallow-tests
  TALLOW=target/release/tallow
fi
MAKE=${MAKE:-target/release/make-random-model}
header() {
  {
    echo
    echo "## $(date -u +%Y-%m-%d) · measured, $DEVICE · $(uname -n) ($(nproc) cores) · $(git rev-parse --short HEAD) · $1"
    echo
    echo "\`$2\`"
    echo
  } >> "$OUT"
}
run() { # title, chart, bench args...
  local title=$1 chart=$2
  shift 2
  header "$title" "tallow bench $* --steps $STEPS --markdown --plot $chart"
  "$TALLOW" bench "$@" --steps "$STEPS" --markdown --plot "$chart" >> "$OUT"
}
for part in $PARTS; do
  case $part in
    quickstart)
      run "configs/quickstart.toml" benchmarks/quickstart.svg \
        --config configs/quickstart.toml --set "train.device=$DEVICE" \
        --grid data.pack=false,true --grid train.checkpointing=false,true
      ;;
    grid)
      M=$WORK/llama-105m
      [ -f "$M/model.safetensors" ] || "$MAKE" benchmarks/models/llama-105m.json "$M" --rows 8 >/dev/null
      bench_job_toml "model.path=\"$M\"" "data.train=\"$M/bench.jsonl\"" data.max_seq_len=128 \
        "train.device=\"$DEVICE\"" "train.output_dir=\"$WORK/run\"" > "$WORK/base.toml"
      run "random 105M Llama, LoRA / full" benchmarks/estimate-grid-a.svg --config "$WORK/base.toml" \
        --grid train.method=lora,full --grid train.checkpointing=false,true \
        --grid train.optimizer=adamw,adamw8bit
      run "random 105M Llama, LoRA r64 + dropout" benchmarks/estimate-grid-b.svg --config "$WORK/base.toml" \
        --set lora.dropout=0.05 --set lora.rank=64 --grid model.quantize=none,nf4 \
        --grid train.micro_batch_size=1,2 --grid data.max_seq_len=128,256
      ;;
    configs)
      M=$WORK/qwen2.5-0.5b
      [ -f "$M/model.safetensors" ] || "$MAKE" benchmarks/models/qwen2.5-0.5b-instruct.json "$M" --rows 8 >/dev/null
      for f in lora qlora; do
        sets=(--set "model.path=$M" --set "data.train=$M/bench.jsonl" --set "train.device=$DEVICE")
        if [ "$DEVICE" = cpu ]; then sets+=(--set data.max_seq_len=256 --set train.grad_accum=1); fi
        run "configs/qwen2.5-0.5b/$f.toml, random weights" "benchmarks/qwen2.5-0.5b-$f.svg" \
          --config "configs/qwen2.5-0.5b/$f.toml" "${sets[@]}" --grid train.checkpointing=true,false
      done
      ;;
    configs-large)
      # The other LoRA configs with random weights of their real architecture, as written
      # (checkpointing on) but on CPU at 128 tokens, grad_accum 1 and micro-batch 1, 2 steps: what
      # a 2-core machine can run. (7B / 8B: 15 GiB of weights; not run here.)
      for pair in llama-3.2-1b:llama-3.2-1b-instruct qwen2.5-1.5b:qwen2.5-1.5b-instruct \
                  llama-3.2-3b:llama-3.2-3b-instruct; do
        cfg=configs/${pair%%:*}/lora.toml
        M=$WORK/${pair#*:}
        [ -f "$M/model.safetensors" ] || "$MAKE" "benchmarks/models/${pair#*:}.json" "$M" --rows 4 >/dev/null
        sets=(--set "model.path=$M" --set "data.train=$M/bench.jsonl" --set "train.device=$DEVICE")
        if [ "$DEVICE" = cpu ]; then
          sets+=(--set data.max_seq_len=128 --set train.grad_accum=1 --set train.micro_batch_size=1)
        fi
        STEPS=2 run "$cfg, random weights" "benchmarks/${pair%%:*}-lora.svg" --config "$cfg" "${sets[@]}"
        rm -rf "$M"  # GBs of random weights
      done
      ;;
    *) echo "unknown part $part" >&2; exit 1 ;;
  esac
done
