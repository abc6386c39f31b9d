#!/usr/bin/env bash
# Device operations (launches on CUDA) per decoder layer of a training step, on the CUDA path,
# counted on the CPU: `tallow train` under TALLOW_CUDA_PATHS_ON_CPU=1 (docs/cuda.md, "Status")
# reports `launches_forward` / `launches_backward` / `launches_optimizer` per step in
# metrics.jsonl; a random tiny
# Llama with 1 and with 2 decoder layers gives the count one layer adds. Prints the Markdown
# table of benchmarks/op-counts.md ("Launches per decoder layer"), then, for the first
# variant, one layer's launches in step 2 by op name (TALLOW_LAUNCH_BREAKDOWN).
#
#   scripts/op_counts.sh [TALLOW]      # default target/release/tallow
#
# tests/tests/train_cli.rs (`cuda_path_launches_per_layer_do_not_grow`) runs the same variants
# and fails when a count goes above the table's.
set -euo pipefail
cd "$(dirname "$0")/.."
TALLOW=${1:-target/release/tallow}
MAKE=${MAKE:-$(dirname "$TALLOW")/make-random-model}
WORK=${WORK:-/tmp/tallow-op-counts}
rm -rf "$WORK"
mkdir -p "$WORK"
# The variants: name, then `--set` overrides of the base job (bf16, LoRA r8 on every linear,
# chunked attention, rows of 64 tokens: one attention block).
VARIANTS=(
  "LoRA, chunked attention|"
  "LoRA dropout 0.05, chunked|lora.dropout=0.05"
  "LoRA, eager attention|model.attention=\"eager\""
  "QLoRA (NF4, double quant), chunked|model.quantize=\"nf4\""
  "LoRA, chunked, checkpointing|train.checkpointing=true"
)
for layers in 1 2; do
  python3 - "$layers" "$WORK/llama-$layers.json" <<'PY'
import json, sys
cfg = json.load(open("tests/fixtures/models/tiny-llama/config.json"))
cfg["num_hidden_layers"] = int(sys.argv[1])
json.dump(cfg, open(sys.argv[2], "w"))
PY
  "$MAKE" "$WORK/llama-$layers.json" "$WORK/llama-$layers" --rows 8 > /dev/null
done
# run LAYERS SETS... -> "forward backward" launches of step 2 (step 1 also makes constants)
run() {
  local layers=$1 out=$WORK/run-$RANDOM
  shift
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  cat > "$WORK/job.toml" <<EOF
[model]
path = "$WORK/llama-$layers"
dtype = "bf16"
[lora]
rank = 8
dropout = 0.0
targets = "all-linear"
[data]
train = "$WORK/llama-$layers/bench.jsonl"
max_seq_len = 64
[train]
max_steps = ${STEPS:-2}
micro_batch_size = 1
grad_accum = 1
log_every = 1
device = "cpu"
output_dir = "$out"
EOF
  TALLOW_CUDA_PATHS_ON_CPU=1 "$TALLOW" train --config "$WORK/job.toml" ${sets[@]+"${sets[@]}"} --quiet \
    2> "$out.err" > /dev/null
  python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "\"loss\"" in l]
r = rows[min(1, len(rows) - 1)]
print(r["launches_forward"], r["launches_backward"], r.get("launches_optimizer", 0))' "$out/metrics.jsonl"
}
echo "| variant | forward | backward | optimizer | in all |"
echo "| --- | ---: | ---: | ---: | ---: |"
for v in "${VARIANTS[@]}"; do
  name=${v%%|*} sets=${v#*|}
  read -r f1 b1 o1 <<< "$(run 1 $sets)"
  read -r f2 b2 o2 <<< "$(run 2 $sets)"
  f=$((f2 - f1)) b=$((b2 - b1)) o=$((o2 - o1))
  echo "| $name | $f | $b | $o | $((f + b + o)) |"
done
# What one layer launches in step 2, by op (the first variant): the 2-layer run minus the
# 1-layer run, each run of 2 steps minus the same run of 1 step (loading, attaching and the
# first step's constants cancel).
echo
echo "By op, one layer of the first variant, step 2 (2-layer run minus 1-layer run):"
for layers in 1 2; do
  for steps in 1 2; do
    STEPS=$steps TALLOW_LAUNCH_BREAKDOWN=1 run "$layers" > /dev/null
    sed -n '/^device operations by op/,$p' "$(ls -t "$WORK"/run-*.err | head -1)" | tail -n +2 \
      > "$WORK/ops-$layers-$steps.txt"
  done
done
python3 - "$WORK" <<'PY'
import sys
def read(p):
    d = {}
    for line in open(p):
        n, op = line.split()
        d[op] = int(n)
    return d
w = sys.argv[1]
a = {(l, s): read(f"{w}/ops-{l}-{s}.txt") for l in (1, 2) for s in (1, 2)}
keys = set().union(*a.values())
step2 = lambda l, k: a[(l, 2)].get(k, 0) - a[(l, 1)].get(k, 0)
rows = sorted(((step2(2, k) - step2(1, k), k) for k in keys), reverse=True)
print("| op | launches |")
print("| --- | ---: |")
for n, k in rows:
    if n:
        print(f"| {k} | {n} |")
PY
