#!/usr/bin/env bash
# Measured peak memory of each memory lever, side by side in one run, on a random ~105M-parameter
# Llama (benchmarks/models/llama-105m.json: 8 layers, hidden 1024, vocab 2048, so that the
# decoder's linear weights are 98% of the parameters) in bf16, rows of 512 tokens, micro-batch 1.
# Each cell is its own `tallow train` process (clean peaks); numbers come from its metrics.jsonl
# (host heap through the counting allocator on CPU, the CUDA memory pool on GPU).
#
#   scripts/bench_memory.sh                       # CPU; appends a table to benchmarks/memory.md
#   DEVICE=cuda TALLOW=./tallow scripts/bench_memory.sh   # on a GPU machine with a cuda build
#
# Columns: after load = bytes in use once model + adapters are loaded; base = after load minus
# the f32 LoRA parameters (LoRA cells: the frozen base weights and what else is loaded); fwd / bwd
# / opt = peak bytes during the forward, backward and optimizer phases (max over steps), each
# including what is live across phases (weights, optimizer state); state = bytes in use after
# the last step minus after load (measured), and opt. state = the optimizer's state tensors
# (counted from their sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cpu}
STEPS=${STEPS:-2}
WORK=${WORK:-target/bench-mem}
OUT=${OUT:-benchmarks/memory.md}
MODEL=$WORK/llama-105m
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow -p tallow-tests
  TALLOW=target/release/tallow
fi
if [ ! -f "$MODEL/model.safetensors" ]; then
  target/release/make-random-model benchmarks/models/llama-105m.json "$MODEL" --rows 16 >/dev/null
fi
bench_job_toml "model.path=\"$MODEL\"" "data.train=\"$MODEL/bench.jsonl\"" "train.max_steps=$STEPS" \
  "train.device=\"$DEVICE\"" "train.output_dir=\"$WORK/run\"" > "$WORK/base.toml"

CELLS=(
  "lora bf16|"
  "lora bf16, checkpointing|train.checkpointing=true"
  "lora nf4|model.quantize=nf4"
  "lora nf4, checkpointing|model.quantize=nf4 train.checkpointing=true"
  "lora bf16, adamw8bit|train.optimizer=adamw8bit"
  "full bf16, adamw|train.method=full"
  "full bf16, adamw8bit|train.method=full train.optimizer=adamw8bit"
  "full bf16, adamw8bit, checkpointing|train.method=full train.optimizer=adamw8bit train.checkpointing=true"
)

mib() { python3 -c "import sys; v=sys.argv[1]; print('-' if v in ('None','') else f'{int(v)/2**20:.0f}')" "$1"; }
{
  echo
  echo "## $(date -u +%Y-%m-%d) · $DEVICE · $(uname -n) · $(git rev-parse --short HEAD)"
  echo
  echo "\`scripts/bench_memory.sh\` (DEVICE=$DEVICE, STEPS=$STEPS): llama-105m bf16, seq 512, micro-batch 1, LoRA r16 all-linear. MiB."
  echo
  echo "| cell | after load | base | fwd peak | bwd peak | opt peak | state | opt. state | tok/s |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
} >> "$OUT"
for cell in "${CELLS[@]}"; do
  name=${cell%%|*}
  sets=()
  for kv in ${cell#*|}; do sets+=(--set "$kv"); done
  rm -rf "$WORK/run"
  if ! "$TALLOW" train --config "$WORK/base.toml" "${sets[@]}" --quiet > "$WORK/log" 2>&1; then
    echo "| $name | failed: $(tail -1 "$WORK/log") | | | | | | | |" >> "$OUT"
    continue
  fi
  python3 - "$WORK/run/metrics.jsonl" "$name" >> "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
load = next(r for r in rows if "load_live_bytes" in r)
steps = [r for r in rows if "loss" in r]
m = lambda v: "-" if v is None else f"{v / 2**20:.0f}"
peak = lambda k: max((s["peak_bytes"][k] or 0) for s in steps)
state = steps[-1]["live_bytes"] - load["load_live_bytes"]
tps = sum(s["tokens"] for s in steps[1:] or steps) / sum(s["tokens"] / s["tokens_per_s"] for s in steps[1:] or steps)
base = m(load["load_live_bytes"] - 4 * load["trainable_params"]) if sys.argv[2].startswith("lora") else "-"
print(f"| {sys.argv[2]} | {m(load['load_live_bytes'])} | {base} | {m(peak('forward'))} | {m(peak('backward'))} | {m(peak('optimizer'))} | {m(state)} | {m(steps[-1]['optimizer_state_bytes'])} | {tps:.1f} |")
PY
  tail -1 "$OUT"
done
