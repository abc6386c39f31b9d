#!/usr/bin/env bash
# A second, short call on a lent GPU after scripts/gpu_first_contact.sh: where a LoRA step's time
# goes, and whether the long-context estimate holds. Everything is tallow's own `bench` (plus one
# PyTorch + PEFT cell), so nothing here needs a profiler the machine lacks (no nsys there):
#
#   1. Qwen2.5-0.5B LoRA, bf16: attention chunked vs eager x rows of 512 vs 2048 tokens, 4 steps
#      (eager at 2048 is what the chunked path costs over a (T, T) one; 512 vs 2048 separates
#      the per-launch cost from the per-token one);
#   2. PyTorch + PEFT (sdpa) on the same model at 512 tokens, beside step 1's 512 cells; then
#      where the time of a chunked bf16 step at 2048 tokens goes, op by op (`TALLOW_OP_TIMES=1
#      tallow train`: one device sync per op, each op's time to the next op's start; 5 steps,
#      the last 4 timed);
#   3. Llama-3.1-8B QLoRA, checkpointing, at --long tokens (default 8192), 2 steps: measured
#      peak against `tallow estimate`, tokens/s.
#
#   scripts/gpu_probe.sh --out DIR [--deadline 270] [--long 8192]
#   scripts/gpu_probe.sh --smoke --out DIR        # the CPU at toy shapes (a rehearsal; .ci/run,
#                                                 # with MAKE=make-random-model where torch is absent)
#
# Writes DIR/probe.md (the rows, ready for benchmarks/cuda.md) and DIR/logs.tar.xz.
# Same binary and environment as scripts/gpu_first_contact.sh (the carried tallow-cuda).
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=270 OUT= SMOKE=0 LONG=8192
COMMAND="scripts/gpu_probe.sh $*"
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --long) LONG=$2; shift ;;
    --smoke) SMOKE=1 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "--out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-/tmp/tallow-probe}
rm -rf "$WORK/logs" "$WORK/models"
mkdir -p "$WORK/logs"
LOGS=$WORK/logs
PY=${PY:-python3}
T0=$SECONDS
if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu SHORT=32 MID=64 LONG=64 TOY="--shrink --device cpu"
  TALLOW=${TALLOW:-target/debug/tallow}
else
  DEVICE=cuda SHORT=512 MID=2048 TOY=
fi
if [ -z "${TALLOW:-}" ]; then
  mkdir -p "$WORK/bin"
  tar -xJf target/gpu-carry/tallow-cuda.tar.xz -C "$WORK/bin" || exit 1
  TALLOW=$WORK/bin/tallow-cuda
fi
. scripts/bench_lib.sh
[ "$DEVICE" = cuda ] && gpu_run_env "$PY" "$WORK"
left() { echo $((DEADLINE - (SECONDS - T0))); }
# run NAME LIMIT CMD...: bounded by LIMIT and the deadline; stdout in NAME.out, stderr NAME.err
run() {
  local name=$1 limit=$2 t rc=0 start=$SECONDS
  shift 2
  t=$(left)
  [ "$t" -lt "$limit" ] && limit=$t
  if [ "$limit" -lt 5 ]; then echo "| $name | not run (deadline) | |" >> "$WORK/steps.md"; return 1; fi
  echo "[$((SECONDS - T0))s] $name (up to ${limit}s)" >&2
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err" || rc=$?
  echo "| $name | $([ $rc = 0 ] && echo ok || echo "exit $rc") | $((SECONDS - start)) |" >> "$WORK/steps.md"
  echo "[$((SECONDS - T0))s] $name: exit $rc" >&2
  return $rc
}
echo "| step | status | seconds |" > "$WORK/steps.md"
echo "| --- | --- | ---: |" >> "$WORK/steps.md"

# The models: Python (torch) on the GPU machine, or MAKE (make-random-model, for a rehearsal
# where torch is absent: CI).
if [ -n "${MAKE:-}" ]; then
  shrink=false
  [ "$SMOKE" = 1 ] && shrink=true
  make_model() { "$MAKE" "$2" "$1" --rows 32 --row-words 1000 --shrink "$shrink"; }
else
  make_model() { $PY scripts/bench_peft_reference.py make-model "$1" --config "$2" --rows 32 --row-words 1000 $TOY; }
fi
export -f make_model
export MAKE PY shrink SMOKE TOY
Q=$WORK/models/qwen2.5-0.5b L8=$WORK/models/llama-3.1-8b
bench_job_toml 'lora.targets="all-linear"' 'train.method="lora"' 'train.optimizer="adamw"' \
  train.weight_decay=0.0 train.max_grad_norm=1.0 "train.device=\"$DEVICE\"" 'train.output_dir="unset"' \
  > "$WORK/base.toml"

# 1 and 2: where the 0.5B LoRA step's time goes.
if run make-qwen 40 bash -c 'make_model "$0" "$1"' "$Q" benchmarks/models/qwen2.5-0.5b-instruct.json; then
  run qwen-grid 110 "$TALLOW" bench --config "$WORK/base.toml" --set "model.path=$Q" \
    --set "data.train=$Q/bench.jsonl" --grid "data.max_seq_len=$SHORT,$MID" \
    --grid model.attention=chunked,eager --steps 4 --json --work-dir "$WORK/qwen-grid"
  run peft-short 40 $PY scripts/bench_peft_reference.py train --model "$Q" --data "$Q/bench.jsonl" \
    --steps 6 --warmup 2 --micro-batch 1 --seq "$SHORT" --device "$DEVICE" --dtype bf16
  run op-times 60 env TALLOW_OP_TIMES=1 "$TALLOW" train --config "$WORK/base.toml" --quiet \
    --set "model.path=$Q" --set "data.train=$Q/bench.jsonl" --set "data.max_seq_len=$MID" \
    --set train.max_steps=5 --set train.log_every=1 --set "train.output_dir=$WORK/op-times"
fi
# 3: long context, 8B QLoRA.
if run make-8b 40 bash -c 'make_model "$0" "$1"' "$L8" benchmarks/models/llama-3.1-8b-instruct.json; then
  run "long-$LONG" 300 "$TALLOW" bench --config "$WORK/base.toml" --set "model.path=$L8" \
    --set "data.train=$L8/bench.jsonl" --set data.pack=true --set "data.max_seq_len=$LONG" \
    --set model.quantize=nf4 --set model.double_quant=true --set train.checkpointing=true \
    --set lora.rank=32 --set lora.alpha=64 --steps 2 --json --work-dir "$WORK/long"
fi

# The report.
LOGS=$LOGS STEPS_MD=$WORK/steps.md COMMAND=$COMMAND MID=$MID $PY - > "$OUT/probe.md" <<'PY'
import datetime, json, os
logs = os.environ["LOGS"]
def rows(name):
    try:
        return json.load(open(f"{logs}/{name}.out"))
    except (OSError, ValueError):
        return None
when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
print(f"## Probe · {when}\n\n- command: `{os.environ['COMMAND']}`\n")
print(open(os.environ["STEPS_MD"]).read())
print("| cell | tok/s | measured peak MiB | estimate MiB | error |")
print("| --- | ---: | ---: | ---: | --- |")
for name in ("qwen-grid",) + tuple(n[:-4] for n in sorted(os.listdir(logs)) if n.startswith("long-") and n.endswith(".out")):
    for r in rows(name) or []:
        cell = " ".join(f"{k}={v}" for k, v in (r.get("config") or {}).items()) or name
        mp, ep = r.get("measured_peak_bytes"), r.get("estimated_peak_bytes")
        print(f"| {name}: {cell} | {r.get('tokens_per_s') or 0:.0f} | {(mp or 0) / 2**20:.0f} | {(ep or 0) / 2**20:.0f} | "
              f"{'oom' if r.get('oom') else (r.get('error') or '')} |")
try:
    err = open(f"{logs}/op-times.err").read().splitlines()
    i = next(i for i, l in enumerate(err) if l.startswith("device time by op"))
    print(f"\nQwen2.5-0.5B LoRA bf16, chunked, {os.environ['MID']} tokens, {err[i]}\n\n```")
    print("\n".join(l for l in err[i + 1:i + 40] if l.startswith("  ")))
    print("```")
except (OSError, StopIteration) as e:
    print(f"\nop times: no result ({e})")
try:
    p = [json.loads(l) for l in open(f"{logs}/peft-short.out") if l.startswith("{")][-1]
    print(f"\nPEFT at the short length: {p.get('tokens_per_s', 0):.0f} tok/s, peak {json.dumps(p.get('peak'))}")
except (OSError, IndexError, ValueError) as e:
    print(f"\nPEFT at the short length: no result ({e})")
PY
cat "$OUT/probe.md"
for n in "$LOGS"/*.out; do cp "$n" "$OUT/$(basename "$n" .out).json" 2>/dev/null; done
tar -cJf "$OUT/logs.tar.xz" -C "$WORK" logs
echo "done in $((SECONDS - T0)) s" >&2
