#!/usr/bin/env bash
# Side-by-side CPU benchmark: the same LoRA job (r16, all linear, AdamW, no dropout) in
# tallow and in PyTorch + PEFT, on random Qwen2-shaped models, run alternately in one go so both
# see the same machine state, on these shapes:
#   base:       hidden 512, 8 layers, 8/2 heads, intermediate 1408, micro-batch 4 x 256 tokens
#   wide:       hidden 1024, 12 layers, 16/4 heads (GQA), intermediate 2816, micro-batch 2 x 512
#   smol135:    SmolLM2-135M's config (tests/fixtures/real-configs): deep and narrow, 30 layers x
#               576, 9/3 heads, a 49152 vocabulary; random weights, micro-batch 2 x 512
#   llama77m:   benchmarks/models/llama-77m.json: 12 layers x 768, 12/4 heads, intermediate
#               1216, a 32k vocabulary tied; micro-batch 2 x 256
#   quickstart: configs/quickstart.toml (1000 steps of the embedded tiny model), wall time,
#               against its PyTorch stand-in (scripts/make_quickstart.py --simulate)
# Reports tokens/s (steps after the first 2) and peak RSS (GNU time), and a profile summary of
# tallow (and of BASELINE) on each shape (top symbols, `perf`, when perf is installed;
# PERF_SHAPES="base" to limit it). Appends a dated section to benchmarks/cpu.md.
#
#   scripts/bench_cpu.sh                 # needs: cargo, python3 with scripts/requirements-fixtures.txt, /usr/bin/time
#   PY=/work/pyref/bin/python scripts/bench_cpu.sh
#   SHAPES="base wide" STEPS=6 scripts/bench_cpu.sh
#   DTYPE=bf16 SHAPES=base scripts/bench_cpu.sh    # the base model in bf16 on both sides (f32 by default)
#   BASELINE=/tmp/tallow-old SHAPES=base scripts/bench_cpu.sh   # also time another tallow binary
#                                                              # (a build of an earlier commit), side by side
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
STEPS=${STEPS:-8}
WORK=${WORK:-target/bench-cpu}
THREADS=${THREADS:-$(nproc)}
mkdir -p "$WORK"
SHAPES=${SHAPES:-base wide smol135 llama77m quickstart}
DTYPE=${DTYPE:-f32}
BASELINE=${BASELINE:-}
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
cargo build --release -q -p tallow
REV=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates || echo "+dirty")

# shape name -> make-model arguments, micro-batch, row length
shape_args() {
  case "$1" in
    base) echo "--hidden 512 --intermediate 1408 --layers 8 --heads 8 --kv-heads 2|4|256" ;;
    wide) echo "--hidden 1024 --intermediate 2816 --layers 12 --heads 16 --kv-heads 4 --row-words 400|2|512" ;;
    smol135) echo "--config tests/fixtures/real-configs/HuggingFaceTB--SmolLM2-135M-Instruct.json --row-words 400|2|512" ;;
    llama77m) echo "--config benchmarks/models/llama-77m.json|2|256" ;;
  esac
}
row() { # name tokens_per_s peak_kb
  printf '| %s | %.0f | %.0f |\n' "$1" "$2" "$(echo "$3/1024" | bc -l)"
}
prepare() { # shape
  local dir="$WORK/$1" args mb seq
  IFS='|' read -r args mb seq <<< "$(shape_args "$1")"
  if [ ! -f "$dir/model/config.json" ]; then
    # shellcheck disable=SC2086
    $PY scripts/bench_peft_reference.py make-model "$dir/model" $args >/dev/null
  fi
  bench_job_toml "model.path=\"$dir/model\"" "model.dtype=\"$DTYPE\"" 'lora.targets="all-linear"' \
    "data.train=\"$dir/model/bench.jsonl\"" "data.max_seq_len=$seq" "train.micro_batch_size=$mb" \
    "train.max_steps=$STEPS" "train.output_dir=\"$dir/run\"" > "$dir/tallow.toml"
}
tallow_run() { # shape [binary label]
  local dir="$WORK/$1" bin=${2:-target/release/tallow} label=${3:-$REV}
  rm -rf "$dir/run"
  /usr/bin/time -f "%M" -o "$WORK/time" "$bin" train --config "$dir/tallow.toml" --quiet >/dev/null 2>&1
  local tps
  tps=$($PY -c "
import json
rows=[json.loads(l) for l in open('$dir/run/metrics.jsonl') if '\"loss\"' in l][2:]
print(sum(r['tokens'] for r in rows)/sum(r['tokens']/r['tokens_per_s'] for r in rows))")
  row "$1 | tallow $label" "$tps" "$(cat "$WORK/time")"
}
peft_run() { # shape
  local dir="$WORK/$1" args mb seq
  IFS='|' read -r args mb seq <<< "$(shape_args "$1")"
  /usr/bin/time -f "%M" -o "$WORK/time" $PY scripts/bench_peft_reference.py train --model "$dir/model" \
    --data "$dir/model/bench.jsonl" --steps "$STEPS" --threads "$THREADS" --micro-batch "$mb" --seq "$seq" --dtype "$DTYPE" \
    > "$WORK/peft.json" 2>/dev/null
  local tps
  tps=$($PY -c "import json;print(json.load(open('$WORK/peft.json'))['tokens_per_s'])")
  row "$1 | PyTorch $($PY -c 'import torch;print(torch.__version__)') + PEFT (sdpa, $THREADS threads, $DTYPE)" "$tps" "$(cat "$WORK/time")"
}
quickstart_run() { # tallow | pytorch: wall seconds of the whole 1000-step job, peak RSS
  local t0 t1
  rm -rf runs/quickstart
  t0=$(date +%s.%N)
  if [ "$1" = tallow ]; then
    /usr/bin/time -f "%M" -o "$WORK/time" target/release/tallow train --config configs/quickstart.toml --quiet >/dev/null 2>&1
  else
    /usr/bin/time -f "%M" -o "$WORK/time" $PY scripts/make_quickstart.py --simulate --threads "$THREADS" >/dev/null 2>&1
  fi
  t1=$(date +%s.%N)
  local name="quickstart | tallow $REV"
  [ "$1" = tallow ] || name="quickstart | PyTorch stand-in (make_quickstart.py --simulate, $THREADS threads)"
  printf '| %s | %.1f s | %.0f |\n' "$name" "$(echo "$t1 - $t0" | bc -l)" "$(echo "$(cat "$WORK/time")/1024" | bc -l)"
}
for s in $SHAPES; do
  case "$s" in base|wide|smol135|llama77m) mkdir -p "$WORK/$s"; prepare "$s" ;; esac
done
{
  echo
  echo "### $(date -u +%Y-%m-%d) on $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo
  echo "\`SHAPES=\"$SHAPES\" STEPS=$STEPS DTYPE=$DTYPE${BASELINE:+ BASELINE=$BASELINE} scripts/bench_cpu.sh\`: LoRA r16 all-linear, $DTYPE, random models (base: Qwen2, hidden 512, 8 layers, 8/2 heads, 4 x 256 tokens; wide: Qwen2, hidden 1024, 12 layers, 16/4 heads, 2 x 512 tokens; smol135: SmolLM2-135M's Llama config, 2 x 512; llama77m: benchmarks/models/llama-77m.json, 2 x 256); the quickstart as wall time of its 1000 steps."
  echo
  echo "| shape | run | tokens/s | peak RSS (MiB) |"
  echo "| --- | --- | ---: | ---: |"
  for s in $SHAPES; do
    case "$s" in
      base|wide|smol135|llama77m)
        for _ in 1 2; do
          tallow_run "$s"
          [ -z "$BASELINE" ] || tallow_run "$s" "$BASELINE" "baseline ($BASELINE)"
          peft_run "$s"
        done ;;
      quickstart) quickstart_run tallow; quickstart_run pytorch; quickstart_run tallow; quickstart_run pytorch ;;
    esac
  done
  if command -v perf >/dev/null; then
    # Where tallow's time goes on each shape (PERF_SHAPES, default: every model shape run):
    # the top symbols by self time, of this build (the profiling profile: release with
    # symbols) and of BASELINE when given.
    cargo build --profile profiling -q -p tallow
    for s in ${PERF_SHAPES:-$SHAPES}; do
      [ "$s" = quickstart ] && continue
      for who in "tallow $REV|target/profiling/tallow" ${BASELINE:+"baseline ($BASELINE)|$BASELINE"}; do
        rm -rf "$WORK/$s/run"
        perf record -q -F 499 -o "$WORK/perf.data" "${who#*|}" train --config "$WORK/$s/tallow.toml" --quiet >/dev/null 2>&1 || true
        echo
        echo "${who%%|*}, $s shape, top symbols (\`perf record\`; self time, all threads):"
        echo
        echo '```text'
        perf report -i "$WORK/perf.data" --no-children --sort symbol --stdio 2>/dev/null > "$WORK/perf.txt" || true
        grep -E '^ +[0-9]' "$WORK/perf.txt" | head -12 | cut -c1-110 | sed 's/ *$//' || true
        echo '```'
      done
    done
  fi
} | tee -a benchmarks/cpu.md
