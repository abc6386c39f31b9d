#!/usr/bin/env bash
# Preference tuning's memory and speed, side by side in one run, on the quickstart's tiny Qwen2
# (examples/quickstart/model), LoRA r16 on every linear, f32, CPU: DPO with the live reference
# (adapters off, no graph), DPO with `preference.precompute_ref`, and supervised LoRA on the
# same number of sequences per micro-batch (4 pairs = 8 sequences vs 8 rows), every row filled
# to max_seq_len = 128 tokens (generated below: prompts of 8 made-up words, completions of 40
# cut to fit). Each cell is a `tallow bench` cell (its own process, 3 steps): measured peak per
# phase next to `tallow estimate`, and tokens/s.
#
#   scripts/bench_preference.sh          # prints the markdown tables
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-target/bench-pref}
mkdir -p "$WORK"
if [ -z "${TALLOW:-}" ]; then
  cargo build --release -q -p tallow
  TALLOW=target/release/tallow
fi
python3 - "$WORK" <<'PY'
import json, random, sys
out = sys.argv[1]
random.seed(0)
words = "smoke shave crask fluck chide ouke clonk snish froll sweem brant glim".split()
sent = lambda n: " ".join(random.choice(words) for _ in range(n))
with open(f"{out}/pairs.jsonl", "w") as f:
    for _ in range(32):
        f.write(json.dumps({"prompt": sent(8), "chosen": " " + sent(40).upper(), "rejected": " " + sent(40)}) + "\n")
with open(f"{out}/text.jsonl", "w") as f:
    for _ in range(64):
        f.write(json.dumps({"text": sent(80)}) + "\n")
PY
common=(--config configs/quickstart-dpo.toml --steps 3 --markdown
        --set train.warmup_steps=0 --set data.eval= --set data.max_seq_len=128)
echo "DPO, live reference (4 pairs = 8 sequences per micro-batch):"
"$TALLOW" bench "${common[@]}" --set "data.train=$WORK/pairs.jsonl" --set train.micro_batch_size=4
echo "DPO, precompute_ref = true:"
"$TALLOW" bench "${common[@]}" --set "data.train=$WORK/pairs.jsonl" --set train.micro_batch_size=4 \
  --set preference.precompute_ref=true
echo "Supervised LoRA, 8 rows per micro-batch:"
"$TALLOW" bench "${common[@]}" --set "data.train=$WORK/text.jsonl" --set train.micro_batch_size=8 \
  --set 'train.method="lora"'
