#!/usr/bin/env bash
# GPU benchmark: tallow and PyTorch + PEFT side by side, on random-weight models with the real
# shapes of Qwen2.5-0.5B / 1.5B and Llama-3.2-1B / 3B / Llama-3.1-8B (benchmarks/models/*.json):
# LoRA over a bf16 base and QLoRA over an NF4 base, activation checkpointing off and on, rows of
# 512 and 2048 tokens. Appends a dated section (command, commit, machine, driver) to
# benchmarks/cuda.md, one table row per cell as soon as the cell is done: tokens/s of both, tallow's
# measured peak and `tallow estimate`'s error against it, PyTorch's max allocated / reserved, and
# the device memory nvidia-smi saw each process use.
#
#   scripts/bench_cuda.sh                                   # every cell (more than 10 minutes)
#   scripts/bench_cuda.sh --models qwen2.5-0.5b --seq 512   # a subset, for 10-minute commands
#   scripts/bench_cuda.sh --models llama-3.1-8b --seq 2048 --methods qlora --deadline 540
#   scripts/bench_cuda.sh --list [...]                      # the cells that would run, nothing else
#   scripts/bench_cuda.sh --smoke                           # the whole pipeline on CPU, toy shapes
#
# Options (comma lists): --models (qwen2.5-0.5b,qwen2.5-1.5b,llama-3.2-1b,llama-3.2-3b,llama-3.1-8b)
# --seq (512,2048) --methods (lora,qlora) --checkpointing (off,on) --sides (tallow,peft)
# --steps N (10) --warmup N (3) --timeout S (per process, 300) --deadline S (stop starting
# processes S seconds after the start; cells left are listed as not run; 0 = none) --out FILE.
#
# Environment:
#   TALLOW=path   the tallow binary (default target/release/tallow): a CUDA build, or the CPU
#                 binary with `tallow-cuda` beside it (it hands `--device cuda` over). No Rust
#                 toolchain is needed on the GPU machine: only the built binary.
#   PY=python     a Python with torch, transformers, peft (QLoRA: bitsandbytes, accelerate); as
#                 in scripts/requirements-fixtures.txt, with a CUDA torch on the GPU machine.
#                 Without torch the PEFT side is not run (each row says so) and the models must
#                 come from MAKE; the table is still written (CI's smoke run has no torch). Its
#                 `nvidia/cu13/lib` and `nvidia/nccl/lib`, when present, are put on tallow's
#                 LD_LIBRARY_PATH (the CUDA 13 libraries and NCCL scripts/build_cuda.sh links
#                 against).
#   WORK=dir      models and cell outputs (default target/bench-cuda; smoke: target/bench-cuda-smoke)
#   MAKE=path     make the models with a carried `make-random-model` binary instead of Python
#                 (with --smoke: `--shrink true`, the same toy shapes as Python's --shrink)
#   COMMIT=sha    recorded in the header when the copy has no .git
#   GPU=index     the GPU nvidia-smi samples (default 0: the one both sides use)
#   DEVICE=cpu    the real shapes on CPU (a check of the model files and both sides; slow)
#   PEFT_QLORA_CPU=1  on CPU, run the PEFT QLoRA cells on bitsandbytes' CPU 4-bit layers
#                 (where that bitsandbytes has them) instead of skipping them
#
# Models: random weights (N(0, 0.02), norms 1) with the shapes of benchmarks/models/<name>-instruct.json,
# the fixture tokenizer tests/fixtures/tokenizers/bos and rows of 1000 words (~2800 tokens, so every
# row is cut to exactly --seq tokens on both sides). Made once per WORK by
# `scripts/bench_peft_reference.py make-model --config` (the Python twin of
# tests/src/bin/make-random-model.rs, same layout and rows; initialized on the GPU; 16 GB on
# disk for 8B) because the GPU machine has Python but no Rust toolchain; MAKE= uses the Rust tool.
#
# --smoke: DEVICE=cpu, the same five architectures at toy sizes (hidden 64, 2 layers, vocab 384),
# rows of 32 tokens, 3 steps (1 warm-up), written to $WORK/smoke.md; the PEFT QLoRA cells
# are skipped with the reason (bitsandbytes 4-bit needs CUDA) unless PEFT_QLORA_CPU=1. Needs
# the PyTorch venv:
#   PY=/work/pyref/bin/python scripts/bench_cuda.sh --smoke
#   PEFT_QLORA_CPU=1 PY=/work/pyref/bin/python scripts/bench_cuda.sh --smoke
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_lib.sh
. scripts/bench_lib.sh
ALL_MODELS=qwen2.5-0.5b,qwen2.5-1.5b,llama-3.2-1b,llama-3.2-3b,llama-3.1-8b
MODELS=$ALL_MODELS SEQS= METHODS=lora,qlora CKPTS=off,on SIDES=tallow,peft
STEPS= WARMUP= TIMEOUT=300 DEADLINE=0 OUT= SMOKE=0 LIST=0
COMMAND="scripts/bench_cuda.sh $*"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case $1 in
    --models) MODELS=$2; shift ;;
    --seq) SEQS=$2; shift ;;
    --methods) METHODS=$2; shift ;;
    --checkpointing) CKPTS=$2; shift ;;
    --sides) SIDES=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --warmup) WARMUP=$2; shift ;;
    --timeout) TIMEOUT=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --out) OUT=$2; shift ;;
    --smoke) SMOKE=1 ;;
    --list) LIST=1 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ "$MODELS" = all ] && MODELS=$ALL_MODELS
if [ "$SMOKE" = 1 ]; then
  DEVICE=cpu SEQS=${SEQS:-32} STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
  WORK=${WORK:-target/bench-cuda-smoke}
  OUT=${OUT:-$WORK/smoke.md}
  TOY=-toy KIND=" smoke (toy shapes, not GPU numbers)"
else
  TOY= KIND=
  DEVICE=${DEVICE:-cuda} SEQS=${SEQS:-512,2048} STEPS=${STEPS:-10} WARMUP=${WARMUP:-3}
  WORK=${WORK:-target/bench-cuda}
  OUT=${OUT:-benchmarks/cuda.md}
fi
TALLOW=${TALLOW:-target/release/tallow}
PY=${PY:-python3}
if [ "$STEPS" -le "$WARMUP" ]; then echo "--steps must be more than --warmup" >&2; exit 2; fi
for m in ${MODELS//,/ }; do
  [ -f "benchmarks/models/$m-instruct.json" ] || { echo "unknown model $m (one of $ALL_MODELS)" >&2; exit 2; }
done
for x in ${METHODS//,/ }; do case $x in lora|qlora) ;; *) echo "unknown method $x" >&2; exit 2 ;; esac; done
for x in ${CKPTS//,/ }; do case $x in off|on) ;; *) echo "--checkpointing takes off,on" >&2; exit 2 ;; esac; done
for x in ${SIDES//,/ }; do case $x in tallow|peft) ;; *) echo "unknown side $x" >&2; exit 2 ;; esac; done
has() { [[ ",$1," == *",$2,"* ]]; }

if [ "$LIST" = 1 ]; then
  for m in ${MODELS//,/ }; do for s in ${SEQS//,/ }; do for q in ${METHODS//,/ }; do for c in ${CKPTS//,/ }; do
    echo "$m $q checkpointing=$c seq=$s ($SIDES, $DEVICE, $STEPS steps)"
  done; done; done; done
  exit 0
fi

mkdir -p "$WORK" "$(dirname "$OUT")"
T0=$SECONDS
left() { # seconds this process may run: the per-process timeout, capped by the deadline
  local t=$TIMEOUT
  if [ "$DEADLINE" -gt 0 ]; then
    local r=$((DEADLINE - (SECONDS - T0)))
    [ "$r" -lt "$t" ] && t=$r
  fi
  echo "$t"
}

# tallow's CUDA libraries: CUDA 13 from the Python's nvidia wheels, when there (build_cuda.sh).
TALLOW_LD=${LD_LIBRARY_PATH:-}
if [ "$DEVICE" = cuda ]; then
  CU13=$($PY -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))' 2>/dev/null || true)
  [ -n "$CU13" ] && [ -d "$CU13" ] && TALLOW_LD=$CU13${TALLOW_LD:+:$TALLOW_LD}
  # libnccl.so.2 (tallow-cuda is built with the `nccl` feature): its own wheel's folder.
  NCCL=${CU13%/cu13/lib}/nccl/lib
  [ -n "$CU13" ] && [ -d "$NCCL" ] && TALLOW_LD=$NCCL:$TALLOW_LD
fi
tallow() { LD_LIBRARY_PATH=$TALLOW_LD "$TALLOW" "$@"; }
TALLOW_VERSION=$(tallow --version 2>&1 | head -1) || {
  echo "cannot run $TALLOW: $TALLOW_VERSION (set TALLOW=path/to/tallow)" >&2; exit 1; }
NO_TORCH=
VERSIONS=$($PY - <<'PY' 2>&1
import importlib
out = []
for m in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
    try:
        out.append(f"{m} {importlib.import_module(m).__version__}")
    except Exception as e:
        out.append(f"{m} absent ({type(e).__name__})")
import torch
out.append(f"CUDA {torch.version.cuda}, visible: {torch.cuda.is_available()}")
print(", ".join(out))
PY
) || {
  # No torch: tallow's side alone (the summary below needs only the Python standard library).
  $PY -c 'import json' 2>/dev/null || { echo "cannot run $PY (set PY=path/to/python3)" >&2; exit 1; }
  [ -n "${MAKE:-}" ] || { echo "cannot run $PY with torch: $(echo "$VERSIONS" | tail -1); set PY=path/to/python with torch, or MAKE=path/to/make-random-model for tallow's side alone" >&2; exit 1; }
  NO_TORCH="no torch in $PY: $(echo "$VERSIONS" | tail -1 | cut -c1-80)"
  VERSIONS=$NO_TORCH
  SIDES=$(echo ",$SIDES," | sed 's/,peft,/,/; s/^,//; s/,$//')
}
SMI=0
if [ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null; then
  SMI=1
  MACHINE="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1), $(nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1)"
elif [ "$DEVICE" = cuda ]; then
  MACHINE="no nvidia-smi on PATH"
else
  MACHINE="CPU only: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
fi
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if git rev-parse --git-dir >/dev/null 2>&1 && ! git diff --quiet HEAD -- crates scripts 2>/dev/null; then
  COMMIT="$COMMIT (with local changes)"
fi

{
  echo
  echo "## $(date -u '+%Y-%m-%d %H:%M UTC') · $DEVICE$KIND · $COMMIT"
  echo
  echo "- command: \`$COMMAND\` (STEPS=$STEPS, WARMUP=$WARMUP, TIMEOUT=$TIMEOUT, DEADLINE=$DEADLINE${PEFT_QLORA_CPU:+, PEFT_QLORA_CPU=$PEFT_QLORA_CPU})"
  echo "- machine: $MACHINE; host $(uname -n)"
  echo "- tallow: \`$TALLOW\` ($TALLOW_VERSION); Python: $VERSIONS"
  echo "- job: LoRA r16 alpha 32 all-linear, dropout 0, adapters f32; base bf16 (lora) or NF4 with"
  echo "  double quantization (qlora); micro-batch 1, grad_accum 1, AdamW lr 1e-4 constant, clip 1.0;"
  echo "  every row cut to exactly seq tokens; $STEPS optimizer steps, the first $WARMUP warm-up."
  echo
  echo "| model | method | ckpt | seq | tallow tok/s | PEFT tok/s | tallow / PEFT | tallow peak | estimate | est. error | torch max alloc. | torch max reserved | nvidia-smi tallow / PEFT | step-1 loss tallow / PEFT | notes |"
  echo "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
} >> "$OUT"

CHILD= SAMPLER=
stop() { # INT / TERM: end the running cell (timeout passes the signal to its group) and stop
  [ -n "$CHILD" ] && kill "$CHILD" 2>/dev/null
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
  echo "interrupted; rows so far are in $OUT" >&2
  exit 130
}
trap stop INT TERM

# One process, bounded in time, with nvidia-smi sampling the device's used memory meanwhile.
# Writes $1.rc and (CUDA) $1.smi = peak used minus used before, MiB.
measured() {
  local base=$1 t
  shift
  t=$(left)
  if [ "$t" -le 0 ]; then echo deadline > "$base.rc"; return; fi
  local before=0 pid=
  if [ "$SMI" = 1 ]; then
    before=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${GPU:-0}")
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "${GPU:-0}" -lms 100 > "$base.smi-log" &
    pid=$!
  fi
  local rc=0
  # In the background so that an interrupt of this script reaches it (timeout runs the command
  # in a process group of its own, which the terminal's Ctrl-C does not reach): see the trap.
  timeout -k 10 "$t" "$@" > "$base.out" 2> "$base.err" &
  CHILD=$!
  SAMPLER=$pid
  wait "$CHILD" || rc=$?
  CHILD=
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    if [ "$t" -lt "$TIMEOUT" ]; then rc="stopped at --deadline after ${t}s"; else rc="timeout after ${t}s"; fi
  fi
  echo "$rc" > "$base.rc"
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    SAMPLER=
    sort -n "$base.smi-log" | tail -1 | awk -v b="$before" '{print $1 - b}' > "$base.smi"
  fi
}

make_model() { # name dir
  local json=benchmarks/models/$1-instruct.json dir=$2 t rc=0
  [ -f "$dir/bench.jsonl" ] && return 0
  rm -rf "$dir"
  t=$(left)
  [ "$t" -gt 0 ] || return 1
  echo "making $dir" >&2
  if [ -n "${MAKE:-}" ]; then
    timeout -k 10 "$t" "$MAKE" "$json" "$dir" --rows 32 --row-words 1000 --shrink "$([ "$SMOKE" = 1 ] && echo true || echo false)" >&2 || rc=$?
  else
    local shrink=()
    [ "$SMOKE" = 1 ] && shrink=(--shrink --device cpu)
    timeout -k 10 "$t" $PY scripts/bench_peft_reference.py make-model "$dir" --config "$json" \
      "${shrink[@]}" --rows 32 --row-words 1000 >&2 || rc=$?
  fi
  if [ "$rc" != 0 ]; then rm -rf "$dir"; return 1; fi
}

bench_job_toml 'lora.targets="all-linear"' 'train.method="lora"' 'train.optimizer="adamw"' \
  train.weight_decay=0.0 train.max_grad_norm=1.0 "train.device=\"$DEVICE\"" 'train.output_dir="unset"' \
  > "$WORK/base.toml"

THREADS=${THREADS:-$(nproc)}
for m in ${MODELS//,/ }; do
  dir=$WORK/models/$m$TOY
  made=1
  make_model "$m" "$dir" || made=0
  for s in ${SEQS//,/ }; do for q in ${METHODS//,/ }; do for c in ${CKPTS//,/ }; do
    cell=$WORK/cells/$m-$q-ckpt$c-$s
    rm -rf "$cell"
    mkdir -p "$cell"
    if [ "$made" = 0 ]; then
      echo "| $m | $q | $c | $s | | | | | | | | | | | not run: the model could not be made (deadline, or see the output above) |" >> "$OUT"
      continue
    fi
    quant=none ck=false
    [ "$q" = qlora ] && quant=nf4
    [ "$c" = on ] && ck=true
    echo "[$(( SECONDS - T0 ))s] $m $q checkpointing=$c seq=$s" >&2
    if has "$SIDES" tallow; then
      sets=(--set "model.path=$dir" --set "data.train=$dir/bench.jsonl" --set "data.max_seq_len=$s"
            --set "train.checkpointing=$ck" --set "model.quantize=$quant")
      [ "$q" = qlora ] && sets+=(--set model.double_quant=true)
      measured "$cell/tallow" env LD_LIBRARY_PATH="$TALLOW_LD" "$TALLOW" bench --config "$WORK/base.toml" \
        "${sets[@]}" --steps "$STEPS" --json --work-dir "$cell/tallow-work"
    fi
    if has "$SIDES" peft; then
      ckf=()
      [ "$c" = on ] && ckf=(--checkpointing)
      if [ "${PEFT_QLORA_CPU:-0}" = 1 ] && [ "$DEVICE" = cpu ]; then ckf+=(--cpu-4bit); fi
      measured "$cell/peft" $PY scripts/bench_peft_reference.py train --model "$dir" \
        --data "$dir/bench.jsonl" --steps "$STEPS" --warmup "$WARMUP" --micro-batch 1 --seq "$s" \
        --threads "$THREADS" --device "$DEVICE" --dtype bf16 --quantize "$quant" "${ckf[@]}"
    fi
    NO_TORCH=$NO_TORCH $PY - "$cell" "$m" "$q" "$c" "$s" "$WARMUP" >> "$OUT" <<'PY'
import json, os, sys
cell, model, method, ckpt, seq, warm = sys.argv[1:7]
warm = int(warm)
MiB = 2**20
def read(p, default=None):
    try:
        with open(p) as f:
            return f.read().strip()
    except OSError:
        return default
def last_json(p):
    for line in reversed((read(p) or "").splitlines()):
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line) if line.startswith("{") else None
            except ValueError:
                pass
    return None
def tail(p):
    lines = [l for l in (read(p) or "").splitlines() if l.strip()]
    err = [l for l in lines if l.startswith("error") or "Error" in l]
    return ((err or lines or ["no output"])[-1]).strip()[:160].replace("|", "/")
mib = lambda b: "-" if b is None else f"{b / MiB:.0f}"
notes, t_tps, p_tps, losses = [], None, None, [None, None]
cols = {k: "-" for k in ("t_peak", "est", "err", "alloc", "resv")}
smi = [read(f"{cell}/{side}.smi") for side in ("tallow", "peft")]

def ran(side, name):
    """The side's exit status, or None (noted) when it did not run."""
    rc = read(f"{cell}/{side}.rc")
    if rc is None and side == "peft" and os.environ.get("NO_TORCH"):
        notes.append(f"{name} not run: {os.environ['NO_TORCH']}")
    elif rc is None:
        notes.append(f"{name} not run (--sides)")
    elif rc == "deadline":
        notes.append(f"{name} not run: --deadline reached")
    else:
        return rc
    return None

rc = ran("tallow", "tallow")
if rc is not None:
    try:
        rows = json.loads(read(f"{cell}/tallow.out") or "null")
    except ValueError:
        rows = None
    if not rows:
        notes.append(f"tallow failed (exit {rc}): {tail(f'{cell}/tallow.err')}")
    else:
        r = rows[0]
        cols["t_peak"] = mib(r["measured_peak_bytes"])
        cols["est"] = mib(r["estimated_peak_bytes"])
        if r.get("estimate_error") is not None:
            cols["err"] = f"{100 * r['estimate_error']:+.1f}%"
        if r.get("oom"):
            notes.append(f"tallow out of memory ({r.get('oom_phase')})")
        elif r.get("error"):
            notes.append(f"tallow failed: {r['error'][:300].replace('|', '/')}")
        # tokens/s: tokens of the steps after the warm-up over their wall time (elapsed_s).
        steps = []
        p = f"{cell}/tallow-work/cell-0/run/metrics.jsonl"
        for line in (read(p) or "").splitlines():
            v = json.loads(line)
            if "loss" in v and "tokens" in v and "elapsed_s" in v:
                steps.append(v)
        if steps:
            losses[0] = steps[0]["loss"]
        if len(steps) > warm and not r.get("oom") and not r.get("error"):
            w = steps[warm - 1]["elapsed_s"] if warm > 0 else steps[0]["elapsed_s"] - steps[0]["tokens"] / steps[0]["tokens_per_s"]
            t_tps = sum(s["tokens"] for s in steps[warm:]) / (steps[-1]["elapsed_s"] - w)
            bad = [s["tokens"] for s in steps if s["tokens"] != int(seq)]
            if bad:
                notes.append(f"tallow rows of {bad[0]} tokens, not {seq}")
        if rc != "0" and not r.get("oom") and not r.get("error"):
            notes.append(f"tallow exit {rc}")

rc = ran("peft", "PEFT")
if rc is not None:
    v = last_json(f"{cell}/peft.out")
    if v is None:
        notes.append(f"PEFT failed (exit {rc}): {tail(f'{cell}/peft.err')}")
    elif "skipped" in v:
        notes.append(f"PEFT skipped: {v['skipped']}")
    else:
        pk = v.get("peak", {})
        cols["alloc"] = mib(pk.get("max_allocated_bytes"))
        cols["resv"] = mib(pk.get("max_reserved_bytes"))
        if "oom" in v:
            notes.append(f"PEFT out of memory after {v['steps_done']} steps")
        else:
            p_tps = v["tokens_per_s"]
            losses[1] = v["loss_first"]
            if any(t != int(seq) for t in v["tokens"]):
                notes.append(f"PEFT rows of {v['tokens'][0]} tokens, not {seq}")
            if "max_allocated_bytes" not in pk:
                notes.append(f"PEFT peak RSS {mib(pk.get('max_rss_bytes'))} MiB")
fmt = lambda t: "-" if t is None else (f"{t:.0f}" if t >= 100 else f"{t:.1f}")
ratio = f"{t_tps / p_tps:.2f}" if t_tps and p_tps else "-"
smi_col = " / ".join(s if s is not None else "-" for s in smi)
# Same model, rows and adapters' init scheme: the first step's loss (before any update) should
# agree to bf16 / NF4 rounding; a gap means the two sides did not train the same thing.
loss_col = " / ".join("-" if l is None else f"{l:.4f}" for l in losses)
if None not in losses and abs(losses[0] - losses[1]) > 0.01 * abs(losses[1]):
    notes.append(f"step-1 losses differ by {100 * abs(losses[0] / losses[1] - 1):.1f}%")
print(f"| {model} | {method} | {ckpt} | {seq} | {fmt(t_tps)} | {fmt(p_tps)} | {ratio} | {cols['t_peak']} | "
      f"{cols['est']} | {cols['err']} | {cols['alloc']} | {cols['resv']} | {smi_col} | {loss_col} | {'; '.join(notes)} |")
PY
    tail -1 "$OUT" >&2
  done; done; done
done
echo "appended to $OUT" >&2
