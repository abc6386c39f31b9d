#!/usr/bin/env bash
# Side-by-side CPU benchmark: the same LoRA job (r16, all linear, AdamW, f32, micro-batch 4,
# rows of 256 tokens) in tallow and in PyTorch + PEFT, on a random Qwen2-shaped model, run
# alternately in one go so both see the same machine state. Reports tokens/s (steps after the
# first 2) and peak RSS (GNU time). Appends a dated table to benchmarks/cpu.md.
#
#   scripts/bench_cpu.sh                 # needs: cargo, python3 with scripts/requirements-fixtures.txt, /usr/bin/time
#   PY=/work/pyref/bin/python scripts/bench_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
STEPS=${STEPS:-8}
WORK=${WORK:-target/bench-cpu}
THREADS=${THREADS:-$(nproc)}
mkdir -p "$WORK"
cargo build --release -q -p tallow
if [ ! -f "$WORK/model/config.json" ]; then
  $PY scripts/bench_peft_reference.py make-model "$WORK/model" >/dev/null
fi
cat > "$WORK/tallow.toml" <<TOML
[model]
path = "$WORK/model"
dtype = "f32"
[lora]
rank = 16
alpha = 32
dropout = 0.0
targets = "all-linear"
[data]
train = "$WORK/model/bench.jsonl"
max_seq_len = 256
shuffle = false
[train]
micro_batch_size = 4
grad_accum = 1
max_steps = $STEPS
lr = 1e-4
schedule = "constant"
output_dir = "$WORK/run"
TOML
row() { # name tokens_per_s peak_kb
  printf '| %s | %.0f | %.0f |\n' "$1" "$2" "$(echo "$3/1024" | bc -l)"
}
tallow_run() {
  /usr/bin/time -f "%M" -o "$WORK/time" target/release/tallow train --config "$WORK/tallow.toml" --quiet >/dev/null 2>&1
  local tps
  tps=$($PY -c "
import json
rows=[json.loads(l) for l in open('$WORK/run/metrics.jsonl') if '\"loss\"' in l][2:]
print(sum(r['tokens'] for r in rows)/sum(r['tokens']/r['tokens_per_s'] for r in rows))")
  row "tallow $(git rev-parse --short HEAD)" "$tps" "$(cat "$WORK/time")"
}
peft_run() {
  /usr/bin/time -f "%M" -o "$WORK/time" $PY scripts/bench_peft_reference.py train --model "$WORK/model" \
    --data "$WORK/model/bench.jsonl" --steps "$STEPS" --threads "$THREADS" > "$WORK/peft.json" 2>/dev/null
  local tps
  tps=$($PY -c "import json;print(json.load(open('$WORK/peft.json'))['tokens_per_s'])")
  row "PyTorch $($PY -c 'import torch;print(torch.__version__)') + PEFT (sdpa, $THREADS threads)" "$tps" "$(cat "$WORK/time")"
}
{
  echo
  echo "### $(date -u +%Y-%m-%d) on $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo
  echo "\`scripts/bench_cpu.sh\` (STEPS=$STEPS): random Qwen2 (hidden 512, 8 layers, 8/2 heads, vocab 323, $($PY -c "import json;c=json.load(open('$WORK/model/config.json'));print(c['intermediate_size'])") intermediate), LoRA r16 all-linear, f32, micro-batch 4 x 256 tokens."
  echo
  echo "| run | tokens/s | peak RSS (MiB) |"
  echo "| --- | ---: | ---: |"
  tallow_run; peft_run; tallow_run; peft_run
} | tee -a benchmarks/cpu.md
