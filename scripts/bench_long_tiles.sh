#!/usr/bin/env bash
# Long context with token tiles: peak memory per phase against `tallow estimate`, and tokens/s,
# of a Llama-3.2-1B-shaped model (benchmarks/models/llama-3.2-1b-instruct.json, random weights)
# as QLoRA: NF4 base (double quant), f32 compute, LoRA r32 on all linears, activation
# checkpointing, micro-batch 1, one row of LEN tokens per step, on the CPU. Sides:
#   tiled    the default: the checkpointed layers' token-wise parts (MLP half, q/k/v and o
#            projections) in tiles of `train.checkpoint_tile_tokens` (0 = the hidden size)
#   untiled  `train.checkpoint_tile_tokens` = LEN: each layer rebuilt in one piece
# The optimizer is SGD unless OPT says otherwise: it keeps no state, so the first step is
# already the steady state and one step (STEPS=1) measures the peak of a long row; the
# activations, the subject here, do not depend on the optimizer.
#
#   LENS="4096" SIDES="tiled untiled" STEPS=3 scripts/bench_long_tiles.sh   # the price of tiles
#   LENS="16384 32768" SIDES=tiled STEPS=1 scripts/bench_long_tiles.sh      # memory vs length
#   LAYERS=4 LENS="4096 16384 32768" scripts/bench_long_tiles.sh             # the same, faster
# Appends a table to benchmarks/long-context.md.
set -euo pipefail
cd "$(dirname "$0")/.."
LENS=${LENS:-4096 16384 32768}
SIDES=${SIDES:-tiled}
STEPS=${STEPS:-1}
OPT=${OPT:-sgd}
THREADS=${THREADS:-$(nproc)}
WORK=${WORK:-target/bench-long}
OUT=${OUT:-benchmarks/long-context.md}
# LAYERS: decoder layers of the model (Llama-3.2-1B has 16); fewer make the long lengths
# affordable on 2 cores (a layer's transients do not depend on how many there are; the kept
# inputs are counted per layer by both sides).
LAYERS=${LAYERS:-16}
MODEL=$WORK/llama-1b-l$LAYERS
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
cargo build --release -q -p tallow -p tallow-tests
TALLOW=target/release/tallow
mkdir -p "$WORK"
if [ ! -f "$MODEL/config.json" ]; then
  # bf16 weights (2.5 GB, quantized to NF4 at load); 4 rows of 34000 words (over 32768 tokens
  # each), truncated to LEN
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['num_hidden_layers']=int(sys.argv[2]); \
json.dump(c, open(sys.argv[3], 'w'), indent=2)" benchmarks/models/llama-3.2-1b-instruct.json \
    "$LAYERS" "$WORK/llama-1b-l$LAYERS.json"
  target/release/make-random-model "$WORK/llama-1b-l$LAYERS.json" "$MODEL" \
    --dtype bf16 --rows 4 --row-words 34000 >/dev/null
fi
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+dirty")

{
  echo
  echo "## $(date -u +%Y-%m-%d) · cpu · $(uname -n) · $REV · Llama-3.2-1B shape ($LAYERS layers), QLoRA"
  echo
  echo "\`LAYERS=$LAYERS LENS=\"$LENS\" SIDES=\"$SIDES\" STEPS=$STEPS OPT=$OPT scripts/bench_long_tiles.sh\` ($THREADS threads): random Llama-3.2-1B-shaped model with $LAYERS layers, NF4 + double quant, f32 compute, LoRA r32 all-linear, checkpointing, micro-batch 1, $OPT. MiB; peaks per phase are tallow's counted heap (max over steps); \"vs estimate\" is (estimate - measured peak) / measured peak; RSS the process's peak resident set; tok/s over the steps after the first (the only step when STEPS=1)."
  echo
  echo "| seq | side | fwd peak | bwd peak | opt peak | estimate | vs estimate | peak RSS | tok/s |"
  echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
} >> "$OUT"

for len in $LENS; do
  bench_job_toml "model.path=\"$MODEL\"" 'model.dtype="f32"' 'model.quantize="nf4"' \
    lora.rank=32 lora.alpha=64 'lora.targets="all-linear"' "data.train=\"$MODEL/bench.jsonl\"" \
    "data.max_seq_len=$len" "train.max_steps=$STEPS" "train.optimizer=\"$OPT\"" \
    'train.checkpointing=true' "train.output_dir=\"$WORK/run\"" > "$WORK/job.toml"
  for side in $SIDES; do
    case $side in
      tiled) sets=() ;;
      untiled) sets=(--set "train.checkpoint_tile_tokens=$len") ;;
      *) echo "unknown side $side (tiled | untiled)" >&2; exit 2 ;;
    esac
    rm -rf "$WORK/run"
    est=$("$TALLOW" estimate --config "$WORK/job.toml" ${sets[@]+"${sets[@]}"} --json |
      python3 -c "import json,sys; print(json.load(sys.stdin)['total_bytes'])")
    if ! /usr/bin/time -f "%M" -o "$WORK/time" "$TALLOW" train --config "$WORK/job.toml" \
        ${sets[@]+"${sets[@]}"} --quiet > "$WORK/log" 2>&1; then
      echo "| $len | tallow $side | failed: $(tail -1 "$WORK/log") | | | | | | |" >> "$OUT"
      continue
    fi
    python3 - "$WORK/run/metrics.jsonl" "$len" "$side" "$est" "$(cat "$WORK/time")" >> "$OUT" <<'PY'
import json, sys
path, n, side, est, rss_kb = sys.argv[1:]
steps = [json.loads(l) for l in open(path) if '"loss"' in l]
m = lambda v: f"{v / 2**20:.0f}"
peak = lambda k: max((s["peak_bytes"][k] or 0) for s in steps)
top = max(peak(k) for k in ("forward", "backward", "optimizer"))
timed = steps[1:] or steps
tps = sum(s["tokens"] for s in timed) / sum(s["tokens"] / s["tokens_per_s"] for s in timed)
print(f"| {n} | {side} | {m(peak('forward'))} | {m(peak('backward'))} | {m(peak('optimizer'))} "
      f"| {m(int(est))} | {(int(est) - top) / top * 100:+.1f}% | {m(int(rss_kb) * 1024)} "
      f"| {tps:.1f} |")
PY
    tail -1 "$OUT"
  done
done
