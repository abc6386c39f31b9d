#!/usr/bin/env bash
# First contact with a GPU: everything one lent GPU window should tell us about tallow on CUDA,
# in one command, in at most --deadline seconds (default 480), each step bounded by its own
# timeout; a step that fails or hangs is recorded and the next one runs. In order of value:
#
#   1. machine: nvidia-smi, driver and CUDA versions, what `tallow doctor` prints of the build;
#   2. `tallow doctor --device cuda --json` in f32, then bf16 (every op against the CPU reference);
#   3. one LoRA cell beside PyTorch + PEFT (sdpa), both bf16: Qwen2.5-0.5B shapes, random weights,
#      rows of 2048 tokens, micro-batch 1, 10 steps (3 warm-up): tokens/s, tallow's measured peak
#      against `tallow estimate`, torch.cuda.max_memory_allocated, nvidia-smi (scripts/bench_cuda.sh);
#   4. Llama-3.1-8B QLoRA (NF4, double quant, checkpointing) at 2048 tokens: tokens/s and peak
#      against the estimate (PEFT's side only where bitsandbytes imports);
#   5. while time is left: the longest context the estimate says fits 8B QLoRA in 24 GiB, run at
#      that length and at 2x (packed rows), measured.
#
#   scripts/gpu_first_contact.sh --out DIR [--deadline 480] [--skip-long]   # --skip-long: no step 5
#   scripts/gpu_first_contact.sh --smoke --out DIR      # the same on the CPU, toy shapes (CI)
#
# Writes at most 8 files into DIR (none over 16 MB): section.md (a dated section ready to append
# to benchmarks/cuda.md), summary.json (every step's status and numbers), machine.txt,
# doctor-f32.json, doctor-bf16.json, bench.md (scripts/bench_cuda.sh's rows), logs.tar.xz (each
# step's output).
#
# Environment:
#   TALLOW    the tallow binary: a CUDA build (`tallow-cuda`). Default: the carried
#             target/gpu-carry/tallow-cuda.tar.xz, unpacked into WORK (docs/cuda.md, "First
#             contact"); with --smoke, target/debug/tallow.
#   MAKE      `make-random-model` for the models (default: Python on the GPU; --smoke: the
#             carried or built one). PY: python3 with torch, transformers, peft (default python3).
#   WORK      scratch (default /tmp/tallow-first-contact; models of 16 GB for 8B).
#   COMMIT    recorded in the header when the copy has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=480 OUT= SMOKE=0 LONG=1
COMMAND="scripts/gpu_first_contact.sh $*"
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --smoke) SMOKE=1 ;;
    --skip-long) LONG=0 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "--out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# a fresh report (bench.md is appended to by bench_cuda.sh)
rm -f "$OUT"/{section.md,summary.json,machine.txt,doctor-f32.json,doctor-bf16.json,bench.md,logs.tar.xz}
WORK=${WORK:-/tmp/tallow-first-contact}
LOGS=$WORK/logs
rm -rf "$LOGS"
mkdir -p "$WORK" "$LOGS"
PY=${PY:-python3}
T0=$SECONDS
STEPS_TSV=$WORK/steps.tsv
: > "$STEPS_TSV"

if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu DTYPES=(f32 bf16) LORA_SEQ=32 QLORA_SEQ=32 BUDGET=32MiB STEPS=3 WARMUP=1
  TALLOW=${TALLOW:-target/debug/tallow}
  MAKE=${MAKE:-target/debug/make-random-model}
else
  DEVICE=cuda DTYPES=(f32 bf16) LORA_SEQ=2048 QLORA_SEQ=2048 BUDGET=24GiB STEPS=10 WARMUP=3
fi

# The carried binary (docs/cuda.md): tallow-cuda, xz-compressed beside the tree.
if [ -z "${TALLOW:-}" ]; then
  CARRY=target/gpu-carry/tallow-cuda.tar.xz
  if [ ! -f "$CARRY" ]; then
    echo "no TALLOW and no $CARRY: build it with scripts/build_cuda.sh and pack it (docs/cuda.md)" >&2
    exit 1
  fi
  mkdir -p "$WORK/bin"
  tar -xJf "$CARRY" -C "$WORK/bin"
  TALLOW=$WORK/bin/tallow-cuda
  [ -x "$WORK/bin/make-random-model" ] && MAKE=${MAKE:-$WORK/bin/make-random-model}
fi
TALLOW=$(cd "$(dirname "$TALLOW")" && pwd)/$(basename "$TALLOW")
export TALLOW PY WORK DEVICE BUDGET
[ -n "${MAKE:-}" ] && export MAKE=$(cd "$(dirname "$MAKE")" && pwd)/$(basename "$MAKE")
# CUDA 13 libraries from the Python's nvidia wheels, and the driver's JIT cache kept for the
# whole run (scripts/bench_lib.sh).
. scripts/bench_lib.sh
[ "$DEVICE" = cuda ] && gpu_run_env "$PY" "$WORK"

left() { echo $((DEADLINE - (SECONDS - T0))); }
# step NAME LIMIT CMD...: runs CMD with its stdout in $LOGS/NAME.log and stderr in NAME.err,
# bounded by LIMIT and by what is left of the deadline; records NAME, status, seconds in
# steps.tsv.
step() {
  local name=$1 limit=$2 t status rc=0 start=$SECONDS
  shift 2
  t=$(left)
  [ "$t" -lt "$limit" ] && limit=$t
  if [ "$limit" -lt 5 ]; then
    printf '%s\tnot run: deadline\t0\n' "$name" >> "$STEPS_TSV"
    echo "[$((SECONDS - T0))s] $name: not run (deadline)" >&2
    return 1
  fi
  echo "[$((SECONDS - T0))s] $name (up to ${limit}s)" >&2
  if declare -F "$1" >/dev/null; then
    # a function of this script: in a shell of its own, so that timeout can end it
    timeout -k 5 "$limit" bash -c "$(declare -f "$1"); $*" > "$LOGS/$name.log" 2> "$LOGS/$name.err" || rc=$?
  else
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2> "$LOGS/$name.err" || rc=$?
  fi
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${limit}s" ;;
    *) status="exit $rc" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - start)) >> "$STEPS_TSV"
  echo "[$((SECONDS - T0))s] $name: $status" >&2
  [ "$rc" = 0 ]
}

# 1. The machine.
machine() {
  echo "## nvidia-smi"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  echo "## nvidia-smi -q (head)"
  nvidia-smi -q 2>&1 | head -60 || true
  echo "## CPU"
  nproc; grep -m1 'model name' /proc/cpuinfo || true; free -g || true
  echo "## tallow"
  "$TALLOW" --version
  "$TALLOW" doctor --device "$DEVICE" --dtype f32 2>&1 | sed -n '1,/^$/p'
  echo "## python"
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available()); print("transformers", transformers.__version__)' 2>&1 || true
}
step machine 60 machine
cat "$LOGS/machine.log" "$LOGS/machine.err" > "$OUT/machine.txt"

# 2. The doctor, one dtype at a time (a crash in bf16 leaves f32's answer).
for dt in "${DTYPES[@]}"; do
  step "doctor-$dt" 120 "$TALLOW" doctor --device "$DEVICE" --dtype "$dt" --json
  cp "$LOGS/doctor-$dt.log" "$OUT/doctor-$dt.json"
done

# 3 and 4: scripts/bench_cuda.sh cells, their rows in bench.md.
BENCH=(scripts/bench_cuda.sh --out "$OUT/bench.md" --steps "$STEPS" --warmup "$WARMUP")
[ "$SMOKE" = 1 ] && BENCH+=(--smoke)
export WORK_BENCH=$WORK/bench
step lora-cell 200 env WORK="$WORK/bench" "${BENCH[@]}" --models qwen2.5-0.5b --seq "$LORA_SEQ" \
  --methods lora --checkpointing off --timeout 150 --deadline 190
peft_qlora=tallow
$PY -c 'import bitsandbytes' 2>/dev/null && peft_qlora=tallow,peft
step qlora-8b 260 env WORK="$WORK/bench" "${BENCH[@]}" --models llama-3.1-8b --seq "$QLORA_SEQ" \
  --methods qlora --checkpointing on --sides "$peft_qlora" --timeout 240 --deadline 250

# 5. Long context: the longest max_seq_len the estimate fits into BUDGET for 8B QLoRA with
# checkpointing (packed rows), then a measured run at it and at 2x.
suffix=
[ "$SMOKE" = 1 ] && suffix=-toy
MODEL8=$WORK/bench/models/llama-3.1-8b$suffix
export LC=$WORK/long-context
mkdir -p "$LC"
if [ "$LONG" = 0 ]; then
  printf 'long-context\tnot run: --skip-long\t0\n' >> "$STEPS_TSV"
elif [ -f "$MODEL8/bench.jsonl" ]; then
  cat > "$LC/job.toml" <<EOF
[model]
path = "$MODEL8"
dtype = "bf16"
quantize = "nf4"
double_quant = true
[lora]
rank = 32
alpha = 64
dropout = 0.0
[data]
train = "$MODEL8/bench.jsonl"
pack = true
shuffle = false
[train]
micro_batch_size = 1
grad_accum = 1
lr = 1e-4
schedule = "constant"
checkpointing = true
device = "$DEVICE"
output_dir = "$LC/run"
EOF
  # `tallow estimate --budget`'s plan gives the longest max_seq_len that fits (a multiple of 64).
  longest() {
    "$TALLOW" estimate --config "$LC/job.toml" --budget "$BUDGET" --json |
      $PY -c 'import json,sys; print(json.load(sys.stdin)["plan"]["longest_max_seq_len"] or 0)'
  }
  if step long-context-estimate 60 longest; then
    L=$(tail -1 "$LOGS/long-context-estimate.log")
    # One optimizer step each: the backward holds the peak, and one 8B step at ~44k tokens took
    # longer than 150 s on an H200 (benchmarks/cuda.md, 2026-11-27): the first length gets what
    # is left of the deadline, up to 240 s, and twice it runs only if time remains.
    for n in "$L" $((2 * L)); do
      [ "$n" -gt 0 ] || continue
      step "long-context-$n" 240 "$TALLOW" bench --config "$LC/job.toml" --set "data.max_seq_len=$n" \
        --steps 1 --json --work-dir "$LC/work-$n"
    done
  fi
else
  printf 'long-context\tnot run: no 8B model (qlora-8b did not make it)\t0\n' >> "$STEPS_TSV"
fi

# The report: section.md and summary.json from the logs (Python's standard library only).
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=$OUT LOGS=$LOGS STEPS_TSV=$STEPS_TSV COMMIT=$COMMIT COMMAND=$COMMAND DEVICE=$DEVICE \
  SMOKE=$SMOKE BUDGET=$BUDGET TOTAL_S=$((SECONDS - T0)) $PY - <<'PY'
import datetime, glob, json, os, re
out, logs = os.environ["OUT"], os.environ["LOGS"]
def read(p, default=""):
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return default
steps = []
for line in read(os.environ["STEPS_TSV"]).splitlines():
    name, status, secs = line.split("\t")
    steps.append({"step": name, "status": status, "seconds": int(secs)})
summary = {"command": os.environ["COMMAND"], "commit": os.environ["COMMIT"],
           "device": os.environ["DEVICE"], "smoke": os.environ["SMOKE"] == "1",
           "seconds": int(os.environ["TOTAL_S"]), "steps": steps, "doctor": {}, "long_context": []}
machine = read(f"{out}/machine.txt")
gpu = re.search(r"\|\s+\d+\s+(NVIDIA[^|]*?)\s{2,}", machine)
drv = re.search(r"Driver Version: ([0-9.]+)", machine)
cuda = re.search(r"CUDA Version: ([0-9.]+)", machine)
summary["gpu"] = gpu.group(1).strip() if gpu else None
summary["driver"] = drv.group(1) if drv else None
summary["cuda"] = cuda.group(1) if cuda else None
lines = []
when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
kind = " · smoke (CPU, toy shapes: not GPU numbers)" if summary["smoke"] else ""
lines += [f"## First contact · {when} · {summary['gpu'] or os.environ['DEVICE']}{kind} · {summary['commit']}", "",
          f"- command: `{summary['command']}` ({summary['seconds']} s in all)",
          f"- machine: {summary['gpu']}, driver {summary['driver']}, CUDA {summary['cuda']}", "",
          "| step | status | seconds |", "| --- | --- | ---: |"]
lines += [f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in steps]
for dt in ("f32", "bf16"):
    try:
        d = json.loads(read(f"{out}/doctor-{dt}.json") or "null")
    except ValueError:
        d = None
    if not d:
        err = (read(f"{logs}/doctor-{dt}.err").strip().splitlines() or ["no output"])[-1][:300]
        lines += ["", f"**doctor {dt}**: no JSON: {err} (logs.tar.xz: doctor-{dt}.err)"]
        summary["doctor"][dt] = None
        continue
    fails = [c for c in d["checks"] if not c["ok"]]
    summary["doctor"][dt] = {"ok": d["ok"], "checks": len(d["checks"]), "failed": [c["name"] for c in fails]}
    lines += ["", f"**doctor {dt}**: {len(d['checks']) - len(fails)} of {len(d['checks'])} checks pass"
              f"; build {d.get('build')}", "", "| check | ok | output | max abs err | tol | note |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for c in d["checks"]:
        lines.append(f"| {c['name']} | {'ok' if c['ok'] else '**FAIL**'} | {c.get('output', '')} | {c['max_abs_err']:.3e} | {c['tol']:.1e} | {c.get('note') or ''} |")
bench = [l for l in read(f"{out}/bench.md").splitlines() if l.startswith("| ")]
rows = [l for l in bench if not l.startswith("| model") and not l.startswith("| ---")]
summary["bench_rows"] = rows
if bench:
    lines += ["", "**LoRA and QLoRA cells** (scripts/bench_cuda.sh):", ""] + bench[:2] + rows
lc = glob.glob(f"{logs}/long-context-[0-9]*.log")
for p in sorted(lc, key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0])):
    n = int(p.rsplit("-", 1)[1].split(".")[0])
    try:
        r = json.loads(read(p))[0]
    except (ValueError, IndexError, TypeError):
        err = read(p[:-4] + ".err").strip().splitlines()
        summary["long_context"].append({"tokens": n, "error": err[-1:] or ["no output"]})
        continue
    summary["long_context"].append({"tokens": n, "measured_peak_bytes": r["measured_peak_bytes"],
                                    "estimated_peak_bytes": r["estimated_peak_bytes"], "oom": r["oom"],
                                    "tokens_per_s": r["tokens_per_s"], "error": r.get("error")})
if summary["long_context"]:
    lines += ["", f"**Long context**, 8B QLoRA r32, checkpointing, packed rows; the longest length the estimate fits "
              f"in {os.environ['BUDGET']}, and twice it:", "",
              "| tokens | measured peak | estimate | tok/s | note |", "| ---: | ---: | ---: | ---: | --- |"]
    for r in summary["long_context"]:
        if "measured_peak_bytes" in r:
            lines.append(f"| {r['tokens']} | {r['measured_peak_bytes'] / 2**30:.2f} GiB | {r['estimated_peak_bytes'] / 2**30:.2f} GiB | "
                         f"{r['tokens_per_s']:.0f} | {'out of memory' if r['oom'] else (r['error'] or '')} |")
        else:
            lines.append(f"| {r['tokens']} | | | | failed: {r['error'][0][:200]} |")
with open(f"{out}/section.md", "w") as f:
    f.write("\n".join(lines) + "\n")
with open(f"{out}/summary.json", "w") as f:
    json.dump(summary, f, indent=1)
print("\n".join(lines))
PY
tar -cJf "$OUT/logs.tar.xz" -C "$WORK" logs
echo "wrote $(ls "$OUT" | wc -l) files to $OUT in $((SECONDS - T0)) s" >&2
