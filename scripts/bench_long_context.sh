#!/usr/bin/env bash
# Long context: peak memory per phase and tokens/s of `model.attention = "eager"` vs "chunked",
# and PyTorch + PEFT (SDPA, gradient checkpointing) on the same job, at each sequence length.
# The job: the random ~105M-parameter Llama (benchmarks/models/llama-105m.json), f32 on the CPU,
# LoRA r16 on all linears, activation checkpointing on, micro-batch 1, one row of LEN tokens per
# step. tallow's peaks come from its metrics.jsonl (host heap through the counting allocator,
# max over steps), plus each process's peak RSS; PyTorch's is its peak RSS. The estimate column
# is `tallow estimate` for the same config (what tests/tests/bench_cli.rs holds to 10%).
#
#   scripts/bench_long_context.sh                 # appends a table to benchmarks/long-context.md
#   LENS="1024 2048" STEPS=3 scripts/bench_long_context.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
LENS=${LENS:-1024 2048 4096 8192}
STEPS=${STEPS:-3}
THREADS=${THREADS:-$(nproc)}
WORK=${WORK:-target/bench-long}
OUT=${OUT:-benchmarks/long-context.md}
MODEL=$WORK/llama-105m
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
cargo build --release -q -p tallow -p tallow-tests
TALLOW=target/release/tallow
mkdir -p "$WORK"
if [ ! -f "$MODEL/model.safetensors" ]; then
  # f32 weights; 4 rows of 9000 words (over 8192 tokens each), truncated to LEN by both sides
  target/release/make-random-model benchmarks/models/llama-105m.json "$MODEL" --dtype f32 \
    --rows 4 --row-words 9000 >/dev/null
fi
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+dirty")

{
  echo
  echo "## $(date -u +%Y-%m-%d) · cpu · $(uname -n) · $REV"
  echo
  echo "\`scripts/bench_long_context.sh\` (STEPS=$STEPS, $THREADS threads): llama-105m f32, LoRA r16 all-linear, checkpointing, micro-batch 1. MiB; peaks per phase are tallow's counted heap (max over steps), RSS the process's peak resident set; tok/s over the steps after the first."
  echo
  echo "| seq | side | fwd peak | bwd peak | opt peak | estimate | peak RSS | tok/s |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
} >> "$OUT"

for len in $LENS; do
  bench_job_toml "model.path=\"$MODEL\"" 'model.dtype="f32"' 'lora.targets="all-linear"' \
    "data.train=\"$MODEL/bench.jsonl\"" "data.max_seq_len=$len" "train.max_steps=$STEPS" \
    'train.checkpointing=true' "train.output_dir=\"$WORK/run\"" > "$WORK/job.toml"
  for attention in eager chunked; do
    rm -rf "$WORK/run"
    sets=(--set "model.attention=\"$attention\"")
    est=$("$TALLOW" estimate --config "$WORK/job.toml" "${sets[@]}" --json |
      $PY -c "import json,sys; print(json.load(sys.stdin)['total_bytes'])")
    if ! /usr/bin/time -f "%M" -o "$WORK/time" "$TALLOW" train --config "$WORK/job.toml" "${sets[@]}" \
        --quiet > "$WORK/log" 2>&1; then
      echo "| $len | tallow $attention | failed: $(tail -1 "$WORK/log") | | | | | |" >> "$OUT"
      continue
    fi
    $PY - "$WORK/run/metrics.jsonl" "$len" "tallow $attention" "$est" "$(cat "$WORK/time")" >> "$OUT" <<'PY'
import json, sys
path, n, side, est, rss_kb = sys.argv[1:]
steps = [json.loads(l) for l in open(path) if '"loss"' in l]
m = lambda v: f"{v / 2**20:.0f}"
peak = lambda k: max((s["peak_bytes"][k] or 0) for s in steps)
timed = steps[1:] or steps
tps = sum(s["tokens"] for s in timed) / sum(s["tokens"] / s["tokens_per_s"] for s in timed)
print(f"| {n} | {side} | {m(peak('forward'))} | {m(peak('backward'))} | {m(peak('optimizer'))} "
      f"| {m(int(est))} | {m(int(rss_kb) * 1024)} | {tps:.0f} |")
PY
    tail -1 "$OUT"
  done
  if $PY scripts/bench_peft_reference.py train --model "$MODEL" --data "$MODEL/bench.jsonl" \
      --steps "$STEPS" --warmup 1 --threads "$THREADS" --micro-batch 1 --seq "$len" \
      --checkpointing > "$WORK/peft.json" 2> "$WORK/peft.log"; then
    $PY - "$WORK/peft.json" "$len" >> "$OUT" <<'PY'
import json, sys
import torch
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | PyTorch {torch.__version__} + PEFT (sdpa, checkpointing) | | | | "
      f"| {r['peak']['max_rss_bytes'] / 2**20:.0f} | {r['tokens_per_s']:.0f} |")
PY
  else
    echo "| $len | PyTorch + PEFT | failed: $(tail -1 "$WORK/peft.log") | | | | | |" >> "$OUT"
  fi
  tail -1 "$OUT"
done
