#!/usr/bin/env python3
"""A checkpoint stored in float16 on disk, and transformers' loss on it (dev-only).

Run (from the repository root, after scripts/make_fixtures.py):

    /work/pyref/bin/python scripts/make_f16_fixture.py

Writes tests/fixtures/models/tiny-qwen2-f16/ (tiny-qwen2's weights rounded to float16 and saved
by save_pretrained with dtype float16; tokenizer files copied as written) and
tests/fixtures/reference/tiny-qwen2-f16.json: per format the loss of the rows of
reference/tiny-qwen2.json computed as make_fixtures.py does (the f16 weights loaded into an f32
model, eager attention), and f16_effect = the largest |loss - loss of the f32 tiny-qwen2| over
the formats (what reading the f16 weights wrongly, or not at all, would move).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

FIX = mf.FIX
SRC = FIX / "models" / "tiny-qwen2"
OUT = FIX / "models" / "tiny-qwen2-f16"


def main():
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    shutil.rmtree(OUT, ignore_errors=True)
    m = mf.load_model(SRC).to(torch.float16)
    m.save_pretrained(str(OUT))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(SRC / f, OUT / f)
    cfg = json.loads((OUT / "config.json").read_text())
    assert cfg["dtype"] == "float16", cfg
    ref = json.loads((FIX / "reference" / "tiny-qwen2.json").read_text())
    m32 = mf.load_model(OUT)  # f16 on disk -> f32 compute
    assert next(m32.parameters()).dtype == torch.float32
    out = {"versions": mf.VERSIONS, "model": "tiny-qwen2-f16", "formats": {}}
    effect = 0.0
    with torch.no_grad():
        for fmt, f in ref["formats"].items():
            nll = sum(mf.row_nll(m32, r["ids"], r["targets"])[0].item() for r in f["rows"])
            loss = nll / sum(sum(r["targets"]) for r in f["rows"])
            out["formats"][fmt] = {"loss": loss}
            effect = max(effect, abs(loss - f["loss"]))
    out["f16_effect"] = effect
    mf.write_json(FIX / "reference" / "tiny-qwen2-f16.json", out)
    print(out)


if __name__ == "__main__":
    main()
