#!/usr/bin/env python3
"""Models that tallow writes (merge, full fine-tuning) load in transformers 4.57 and 5.x with the
same loss (dev-only).

Run (from the repository root, with both reference venvs of scripts/requirements-fixtures.txt
and scripts/requirements-fixtures-v5.txt, after the fixtures they make):

    cargo build --release -p tallow
    /work/pyref5/bin/python scripts/make_saved_model_fixtures.py \
        [--py4 /work/pyref/bin/python] [--py5 /work/pyref5/bin/python]

(TALLOW=target/debug/tallow runs another build of tallow.)

For each case below the script runs the release `tallow` exactly as
tests/tests/saved_models.rs does (merge of the PEFT adapter tests/fixtures/adapters/<M>-peft,
or 2 steps of full fine-tuning with SGD on the text rows), then loads the output dir with
AutoModelForCausalLM.from_pretrained under transformers 4.57 and under 5.x and computes the loss
of every format on the rows of <root>/reference/<M>.json as scripts/make_fixtures.py does
(f32, eager attention, rows alone, NLL in float64). It asserts the two versions agree (1e-5)
and writes tests/fixtures/reference/saved-models.json:

    {"cases": [{"name", "kind": "merge"|"full", "layout": ""|"v5", "model",
                "config": <config.json as tallow wrote it>,
                "losses": {"<transformers version>": {format: loss}}}]}

The test checks that tallow still writes that config.json and that tallow's eval of its output
gives those losses.

tiny-gemma3-mm is an image-text Gemma3ForConditionalGeneration (scripts/make_gemma3_mm_fixtures.py)
whose merge is a text-only Gemma3ForCausalLM: its rows are tiny-gemma3's (its language model), and
the script also asserts that both versions give the loss PEFT computed with the adapter on the
image-text model (<root>/reference/tiny-gemma3-mm.json's "peft", 1e-4: what the adapter moves is
0.05 .. 0.33).

Inner mode (run by the script under each venv):

    python scripts/make_saved_model_fixtures.py --losses MODEL_DIR ROWS_JSON
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
TALLOW = Path(os.environ.get("TALLOW", REPO / "target" / "release" / "tallow"))
# (kind, layout root under tests/fixtures ("" = transformers 4.57's, "v5"), model)
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
CASES = [("merge", layout, m) for layout in ("", "v5") for m in MODELS]
CASES += [("full", "v5", m) for m in MODELS] + [("full", "", "tiny-llama")]
# added later, after the cases above (their order in the file is kept)
CASES += [("merge", layout, "tiny-mistral") for layout in ("", "v5")] + [("full", "v5", "tiny-mistral")]
CASES += [("merge", layout, "tiny-gemma2") for layout in ("", "v5")] + [("full", "v5", "tiny-gemma2")]
CASES += [("merge", layout, "tiny-phi3") for layout in ("", "v5")] + [("full", "v5", "tiny-phi3")]
CASES += [("merge", layout, "tiny-gemma3") for layout in ("", "v5")] + [("full", "v5", "tiny-gemma3")]
CASES += [("merge", layout, "tiny-gemma3-mm") for layout in ("", "v5")]
# A model whose reference rows are another's: an image-text model's are its language model's.
ROWS = {"tiny-gemma3-mm": "tiny-gemma3"}

# Kept in step with tests/tests/saved_models.rs::full_config.
FULL_CONFIG = """[model]
path = "{model}"
dtype = "f32"
[data]
train = "{data}"
max_seq_len = 32
shuffle = false
[train]
method = "full"
optimizer = "sgd"
lr = 0.05
schedule = "constant"
max_grad_norm = 0.0
max_steps = 2
micro_batch_size = 2
grad_accum = 1
output_dir = "{out}"
"""


def losses(model_dir, rows_json):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    m = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    m.eval()
    ref = json.loads(Path(rows_json).read_text())
    out = {}
    with torch.no_grad():
        for fmt, f in ref["formats"].items():
            total, n = 0.0, 0
            for r in f["rows"]:
                ids, tg = r["ids"], r["targets"]
                logits = m(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
                lp = torch.log_softmax(logits.double(), dim=-1)
                pos = [i for i, t in enumerate(tg) if t and i >= 1]
                total += -lp[[i - 1 for i in pos], [ids[i] for i in pos]].sum().item()
                n += len(pos)
            out[fmt] = total / n
    print(json.dumps({"version": transformers.__version__, "losses": out}))


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{cmd}: {r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--losses", nargs=2)
    ap.add_argument("--py4", default="/work/pyref/bin/python")
    ap.add_argument("--py5", default="/work/pyref5/bin/python")
    a = ap.parse_args()
    if a.losses:
        return losses(*a.losses)
    assert TALLOW.exists(), "cargo build --release -p tallow first"
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, layout, model in CASES:
            root = FIX / layout if layout else FIX
            mdir = root / "models" / model
            name = f"{kind}-{layout or 'v4'}-{model}"
            out = Path(tmp) / name
            if kind == "merge":
                adapter = FIX / "adapters" / f"{model}-peft"
                run([str(TALLOW), "merge", "--model", str(mdir), "--adapter", str(adapter), "--out", str(out)])
                saved = out
            else:
                out.mkdir()
                cfg = FULL_CONFIG.format(model=mdir, data=FIX / "data" / "text.jsonl", out=out / "run")
                (out / "full.toml").write_text(cfg)
                run([str(TALLOW), "train", "--config", str(out / "full.toml"), "--quiet"])
                saved = out / "run" / "model"
            rows = root / "reference" / f"{ROWS.get(model, model)}.json"
            by_version = {}
            for py in (a.py4, a.py5):
                r = json.loads(run([py, __file__, "--losses", str(saved), str(rows)]).strip().splitlines()[-1])
                by_version[r["version"]] = r["losses"]
            (l4, l5) = by_version.values()
            for fmt in l4:
                assert abs(l4[fmt] - l5[fmt]) < 1e-5, (name, fmt, l4[fmt], l5[fmt])
            if model in ROWS:
                peft = json.loads((root / "reference" / f"{model}.json").read_text())["peft"]
                for fmt, l in l4.items():
                    assert abs(l - peft[fmt]["loss"]) < 1e-4, (name, fmt, l, peft[fmt]["loss"])
            config = json.loads((saved / "config.json").read_text())
            print(name, {v: {f: round(x, 6) for f, x in l.items()} for v, l in by_version.items()})
            cases.append({"name": name, "kind": kind, "layout": layout, "model": model,
                          "config": config, "losses": by_version})
    path = FIX / "reference" / "saved-models.json"
    path.write_text(json.dumps({"cases": cases}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
