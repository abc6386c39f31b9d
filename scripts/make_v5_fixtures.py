#!/usr/bin/env python3
"""Reference fixtures from transformers 5.x: the tiny models in the config.json layout that
transformers 5 writes, and what transformers 5 + PEFT compute on them (dev-only).

Run (from the repository root, after scripts/make_fixtures.py, make_peft_fixtures.py and
make_generate_fixtures.py have made the transformers 4.57 fixtures):

    python -m venv /work/pyref5
    /work/pyref5/bin/pip install -r scripts/requirements-fixtures-v5.txt
    /work/pyref5/bin/python scripts/make_v5_fixtures.py

Only tests/fixtures/v5/ is deleted and rewritten; the 4.57 fixtures are read, never modified.

    tests/fixtures/v5/models/<M>/                 the 4.57 model <M>, loaded by transformers 5 and
                                                  saved by its save_pretrained: config.json with
                                                  `rope_parameters` (no `rope_theta` /
                                                  `rope_scaling`) and `dtype`; the tokenizer files
                                                  copied as written (tokenizer.json,
                                                  tokenizer_config.json, chat_template.jinja).
                                                  tiny-qwen3 is switched to linear rope scaling
                                                  (factor 2, theta 1e6) so that a second rope type
                                                  has a 5.x fixture. tiny-mistral keeps its
                                                  sliding_window (8); tiny-gemma2 its
                                                  layer_types, windows and soft-caps;
                                                  tiny-gemma3 its rope_parameters per layer
                                                  type (sliding: base 1000, full: 1e5 with
                                                  linear scaling 4).
    tests/fixtures/v5/reference/<M>.json          rows (the 4.57 reference's ids and targets), and
                                                  per format: nll_sum, n_targets, loss
    tests/fixtures/v5/reference/peft-<M>.json     the 4.57 PEFT adapter tests/fixtures/adapters/
                                                  <M>-peft loaded by PEFT 0.21 on this model: loss
                                                  per format; one SGD step (lr 0.5) on the text
                                                  rows: sgd_loss_before / sgd_loss_after
    tests/fixtures/v5/reference/peft-<M>-sgd.safetensors   "after.<key>" / "grad.<key>"
    tests/fixtures/v5/reference/generate.json     the cases of tests/fixtures/reference/
                                                  generate.json (same prompt ids), greedy
                                                  `generate` under transformers 5

Every loss is computed as scripts/make_fixtures.py computes it (row_nll: f32 model, eager
attention, each row alone, NLL summed in float64). The tokenizer is never rebuilt:
transformers 5's AutoTokenizer may construct a family's pre-tokenizer from its class instead
of using tokenizer.json as written; these fixtures only reuse the 4.57 reference's token ids,
and the script checks that a tokenizer loaded from tokenizer.json (PreTrainedTokenizerFast with
tokenizer_file) reproduces them.
"""

import json
import os
import shutil
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixturelib as fl  # noqa: E402
import make_fixtures as mf  # noqa: E402  (DATASETS, write_json)
import make_peft_fixtures as mp  # noqa: E402  (eval_losses, text_loss, file_key_to_param)

FIX = mf.FIX
OUT = FIX / "v5"
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-phi3", "tiny-gemma3"]
SGD_LR = 0.5
PINNED = {"transformers": "5.23.0", "peft": "0.21.2", "torch": "2.8.0"}
VERSIONS = {
    "torch": torch.__version__,
    "transformers": transformers.__version__,
    "peft": peft.__version__,
}
# A second rope type under the 5.x layout (the 4.57 tiny-qwen3 has plain rope, theta 1e6).
ROPE_OVERRIDE = {"tiny-qwen3": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def load(model_dir: Path, config=None):
    kw = {"config": config} if config is not None else {}
    m = AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="eager", dtype=torch.float32, **kw
    )
    m.eval()
    return m


def build_model(name: str) -> Path:
    src = FIX / "models" / name
    out = OUT / "models" / name
    cfg = AutoConfig.from_pretrained(str(src))
    if name in ROPE_OVERRIDE:
        cfg.rope_parameters = dict(ROPE_OVERRIDE[name])
    model = load(src, cfg)
    model.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    c = json.loads((out / "config.json").read_text())
    assert "rope_parameters" in c and "rope_theta" not in c and "rope_scaling" not in c, c
    assert "dtype" in c and "torch_dtype" not in c, c
    assert c["transformers_version"].startswith("5."), c["transformers_version"]
    # same weights as the 4.57 model
    ref = load(src)
    for (k, a), (k2, b) in zip(ref.state_dict().items(), load(out).state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    return out


def check_tokenizer(model_dir: Path, ref):
    """tokenizer.json as written gives the 4.57 reference's ids for the text rows."""
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    for row, r in zip(mf.DATASETS["text"], ref["formats"]["text"]["rows"]):
        ids = tok(row["text"], add_special_tokens=True).input_ids
        n = min(len(ids), len(r["ids"]))  # reference rows: + eos, truncated to 32
        assert ids[:n] == r["ids"][:n], (model_dir.name, ids, r["ids"])


def formats_of(model, ref):
    """Per format: the reference rows and their losses (make_peft_fixtures.eval_losses)."""
    losses = mp.eval_losses(model, ref)
    return {
        fmt: {"rows": f["rows"], "nll_sum": losses[fmt]["nll_sum"],
              "n_targets": losses[fmt]["n_targets"], "loss": losses[fmt]["loss"]}
        for fmt, f in ref["formats"].items()
    }


def peft_reference(name: str, model_dir: Path, ref):
    adapter = FIX / "adapters" / f"{name}-peft"
    m = PeftModel.from_pretrained(load(model_dir), str(adapter))
    m.eval()
    losses = {fmt: {"loss": v["loss"]} for fmt, v in mp.eval_losses(m, ref).items()}

    m = PeftModel.from_pretrained(load(model_dir), str(adapter), is_trainable=True)
    m.eval()
    mp.check_loaded(m, adapter)  # the file's tensors, as they are
    # tiny-gemma3: lr 0.5 overshoots (as in make_peft_fixtures.py)
    before, after, tensors, _ = mp.text_sgd(m, adapter, ref, SGD_LR, must_decrease=name != "tiny-gemma3")
    path = OUT / "reference" / f"peft-{name}-sgd.safetensors"
    fl.save_tensors(tensors, path)
    return {
        "versions": VERSIONS,
        "adapters": {"peft": {"adapter_dir": str(adapter.relative_to(mf.REPO)), "formats": losses}},
        "sgd": {"adapter": "peft", "lr": SGD_LR, "sgd_loss_before": before, "sgd_loss_after": after},
    }


def generate_reference():
    src = json.loads((FIX / "reference" / "generate.json").read_text())
    max_new = src["max_new_tokens"]
    cases = []
    for case in src["cases"]:
        mdir = OUT / "models" / case["model"]
        model = load(mdir)
        if case["adapter"]:
            model = PeftModel.from_pretrained(model, str(FIX / "adapters" / case["adapter"]))
            model.eval()
        gen = fl.greedy(model, case["prompt_ids"], max_new_tokens=max_new,
                        repetition_penalty=case["repetition_penalty"], pad_token_id=0)
        c = dict(case, generated_ids=gen, stopped_at_eos=fl.stopped_at_eos(model, gen))
        c["same_as_4_57"] = gen == case["generated_ids"]
        if case["model"] == "tiny-phi3":
            # 5.x's cached generate recomputes the cache when the sequence passes
            # original_max_position_embeddings: the uncached ids (the 4.57 reference's)
            nocache = fl.greedy(model, case["prompt_ids"], max_new_tokens=max_new, use_cache=False,
                                repetition_penalty=case["repetition_penalty"], pad_token_id=0)
            assert gen == nocache and c["same_as_4_57"], (case["name"], gen, nocache)
        print(f"  generate {case['name']}: {len(gen)} ids, same as 4.57: {c['same_as_4_57']}")
        cases.append(c)
    doc = {"versions": VERSIONS, "max_new_tokens": max_new, "cases": cases}
    (OUT / "reference" / "generate.json").write_text(json.dumps(doc, indent=1) + "\n")


def main():
    fl.warn_unpinned(VERSIONS, PINNED)
    torch.manual_seed(0)
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "reference").mkdir(parents=True)
    for name in MODELS:
        ref4 = json.loads((FIX / "reference" / f"{name}.json").read_text())
        mdir = build_model(name)
        check_tokenizer(mdir, ref4)
        formats = formats_of(load(mdir), ref4)
        doc = {"versions": VERSIONS, "model": name, "formats": formats}
        mf.write_json(OUT / "reference" / f"{name}.json", doc)
        mf.write_json(OUT / "reference" / f"peft-{name}.json", peft_reference(name, mdir, ref4))
        print(name, {fmt: round(f["loss"], 6) for fmt, f in formats.items()},
              "4.57:", {fmt: round(f["loss"], 6) for fmt, f in ref4["formats"].items()})
    generate_reference()
    (OUT / "README.md").write_text(
        "# transformers 5.x fixtures (generated; do not edit by hand)\n\n"
        "Made by `scripts/make_v5_fixtures.py` (see its docstring) with "
        f"transformers {VERSIONS['transformers']}, peft {VERSIONS['peft']}, torch {VERSIONS['torch']}.\n"
    )


if __name__ == "__main__":
    main()
