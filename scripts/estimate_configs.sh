#!/usr/bin/env bash
# `tallow estimate` for every training config in configs/, on CUDA (what they are written for),
# from the models' config.json alone: the real architectures are in benchmarks/models/ (public
# config.json values), so nothing is downloaded. Appends a table to benchmarks/estimate.md with
# the predicted peak, its breakdown, and the plan `--budget 24GiB` gives.
#
#   scripts/estimate_configs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/estimate.md}
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow
  TALLOW=target/release/tallow
fi
rows=()
for cfg in configs/*/*.toml; do
  repo=$(sed -n 's/^path = "\(.*\)"/\1/p' "$cfg" | head -1)
  json="benchmarks/models/$(basename "$repo" | tr 'A-Z' 'a-z').json"
  [ -f "$repo/config.json" ] && json="$repo/config.json"  # a local model dir
  [ -f "$json" ] || { echo "no $json for $cfg" >&2; exit 1; }
  est=$("$TALLOW" estimate --config "$cfg" --set "model.path=$json" --set train.device=cuda --budget 24GiB --json)
  rows+=("$cfg|$est")
done
python3 - "$OUT" "$(git rev-parse --short HEAD)" "${rows[@]}" <<'PY'
import json, sys, datetime
out, commit, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
g = lambda b: f"{b / 2**30:.1f}"
lines = [f"\n## {datetime.date.today()} · estimate, CUDA · {commit}\n",
         "`scripts/estimate_configs.sh`: `tallow estimate --config FILE --set model.path=benchmarks/models/MODEL.json --set train.device=cuda --budget 24GiB --json`. GiB; the total includes 0.6 GiB of CUDA context outside the memory pool.\n",
         "| config | tokens / micro-batch | weights | activations | optimizer state | peak (phase) | plan for 24 GiB |",
         "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
for r in rows:
    cfg, est = r.split("|", 1)
    e = json.loads(est)
    c = e["components"]
    p = e["plan"]
    if p["fits"]:
        plan = f"fits; largest micro-batch {p['largest_micro_batch']}"
    elif not p["possible"]:
        plan = "nothing fits"
    else:
        plan = "; ".join(f"{s['what']} -> {g(s['peak_bytes'])}" for s in p["steps"])
    lines.append(f"| `{cfg}` | {e['tokens_per_micro_batch']} | {g(c['frozen_weights'] + c['trainable_params'])} | "
                 f"{g(c.get('activations', 0))} | {g(c.get('optimizer_state', 0))} | {g(e['total_bytes'])} ({e['peak_phase']}) | {plan} |")
with open(out, "a") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
