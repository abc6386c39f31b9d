#!/usr/bin/env bash
# LoRA over a Q4_K GGUF kept in its blocks (`model.quantize = "keep"`, docs/gguf.md) against the
# same file dequantized into the model dtype (`none`) and quantized again to NF4 (`nf4`): measured
# peak memory, the estimate's peak, and tokens/s, side by side in one `tallow bench` run.
#
# The model: benchmarks/models/llama-105m.json with random weights (make-random-model), exported
# to an f32 GGUF by `tallow export`, its decoder linears requantized to Q4_K by the
# `requantize-gguf` dev tool (Candle's quantizer: the Q4_K footprint; the values are not
# llama-quantize's, which the product never needs). The job is bench_job_toml's LoRA r16, rows of
# 512 tokens, micro-batch 1, in DTYPE (bf16 by default).
#
#   scripts/bench_gguf_keep.sh            # CPU; appends a table to benchmarks/gguf.md
#   DTYPE=f32 scripts/bench_gguf_keep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cpu}
DTYPE=${DTYPE:-bf16}
STEPS=${STEPS:-3}
WORK=${WORK:-target/bench-gguf}
OUT=${OUT:-benchmarks/gguf.md}
MODEL=$WORK/llama-105m
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow -p tallow-tests
  TALLOW=target/release/tallow
fi
export TALLOW_CACHE_DIR=$WORK/cache
if [ ! -f "$MODEL/model.safetensors" ]; then
  target/release/make-random-model benchmarks/models/llama-105m.json "$MODEL" --rows 16 >/dev/null
fi
if [ ! -f "$WORK/q4_k.gguf" ]; then
  "$TALLOW" export --model "$MODEL" --out "$WORK/f32.gguf" --outtype f32 >/dev/null
  target/release/requantize-gguf "$WORK/f32.gguf" "$WORK/q4_k.gguf" >/dev/null
  rm "$WORK/f32.gguf"
fi
bench_job_toml "model.path=\"$WORK/q4_k.gguf\"" "model.dtype=\"$DTYPE\"" "data.train=\"$MODEL/bench.jsonl\"" \
  "train.device=\"$DEVICE\"" "train.output_dir=\"$WORK/run\"" > "$WORK/base.toml"
{
  echo
  echo "## $(date -u +%Y-%m-%d) · $DEVICE · $(uname -n) · $(git rev-parse --short HEAD)"
  echo
  echo "\`DTYPE=$DTYPE scripts/bench_gguf_keep.sh\` (DEVICE=$DEVICE, STEPS=$STEPS): llama-105m as a Q4_K GGUF, $DTYPE, seq 512, micro-batch 1, LoRA r16 all-linear; CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores."
  echo
} >> "$OUT"
"$TALLOW" bench --config "$WORK/base.toml" --grid model.quantize=none,keep,nf4 --steps "$STEPS" \
  --markdown | tee -a "$OUT"
