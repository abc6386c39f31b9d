#!/usr/bin/env bash
# Data parallel on CPU ranks, side by side in one run: the per-rank memory of a full fine-tune
# of the 105M random Llama (benchmarks/models/llama-105m.json, f32, AdamW, micro-batch 1,
# 128 tokens) on one process with grad_accum 2, and on 2 ranks (`--nproc 2`, Open MPI) with
# and without `train.shard_optimizer` (ZeRO-1): the same global batch in each cell. Each cell is
# a `tallow bench` cell (3 steps): rank 0's measured peak per phase beside the per-rank
# estimate, and tokens/s over all ranks. Appends to benchmarks/distributed.md.
#
#   scripts/bench_distributed.sh                       # release build with --features mpi
#   TALLOW=target/debug/tallow scripts/bench_distributed.sh   # a binary already built with mpi
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-target/bench-dist}
MODEL=${MODEL:-$WORK/llama-105m}
OUT=${OUT:-benchmarks/distributed.md}
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow -p tallow-tests --features tallow/mpi
  TALLOW=target/release/tallow
fi
MAKE=${MAKE:-$(dirname "$TALLOW")/make-random-model}
mkdir -p "$WORK"
if [ ! -f "$MODEL/model.safetensors" ]; then
  "$MAKE" benchmarks/models/llama-105m.json "$MODEL" --dtype f32 --rows 16 >/dev/null
fi
cat > "$WORK/job.toml" <<TOML
[model]
path = "$MODEL"
dtype = "f32"
[data]
train = "$MODEL/bench.jsonl"
max_seq_len = 128
[train]
method = "full"
optimizer = "adamw"
micro_batch_size = 1
warmup_steps = 0
output_dir = "$WORK/run"
TOML
# Open MPI refuses root unless told (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+dirty")
one=$("$TALLOW" bench --config "$WORK/job.toml" --steps 3 --markdown --set train.grad_accum=2 2>/dev/null)
two=$("$TALLOW" bench --config "$WORK/job.toml" --steps 3 --markdown --set train.grad_accum=1 \
  --nproc 2 --grid train.shard_optimizer=false,true 2>/dev/null)
{
  echo
  echo "## $(date -u +%Y-%m-%d) · cpu · $(uname -n) ($(nproc) cores) · $REV"
  echo
  echo "\`$0\` with \`$TALLOW\`: llama-105m f32, full fine-tuning, AdamW, micro-batch 1, 128 tokens, 3 steps; the same global batch (2 rows per step) in every cell. MiB; peaks per phase are rank 0's counted heap; the estimate is \`tallow estimate --nproc N\`'s per-rank peak."
  echo
  echo "One process, grad_accum = 2:"
  echo
  echo "$one"
  echo
  echo "Two ranks (\`--nproc 2\`), grad_accum = 1:"
  echo
  echo "$two"
} | tee -a "$OUT"
