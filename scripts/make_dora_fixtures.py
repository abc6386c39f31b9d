#!/usr/bin/env python3
"""Generate tallow's DoRA reference fixtures from HF peft (dev-only).

Run (from the repository root, after scripts/make_fixtures.py and make_peft_fixtures.py):

    /work/pyref/bin/python scripts/make_dora_fixtures.py

Pinned reference stack (scripts/requirements-fixtures.txt):

    torch==2.8.0  transformers==4.57.1  tokenizers==0.22.2  peft==0.17.1  safetensors==0.8.0

Deterministic (fixed seeds, single-threaded CPU torch, deterministic algorithms). Writes only:

    tests/fixtures/adapters/<M>-peft-dora/           LoRA r=4, alpha=8, use_dora=True on all
        seven linears, as PeftModel.save_pretrained writes it (its README.md model card deleted);
        lora_A / lora_B overwritten with 0.2 * randn, and the magnitude vector (PEFT's
        `lora_magnitude_vector`, initialized to ||W|| per row) multiplied by (1 + 0.1 * randn),
        so that B A, and m against ||W + s B A||, are far from their initial values.
    tests/fixtures/reference/peft-dora-<M>.json      per-format loss (unmerged, reloaded, merged)
    tests/fixtures/reference/peft-dora-<M>-sgd.safetensors   one plain-SGD step (lr 0.5) from the
        adapter over the "text" rows: "after.<key>" and "grad.<key>" for every adapter tensor,
        magnitude included.

for M in make_peft_fixtures.MODELS (tiny-phi3 on its fused modules). Losses are computed as make_peft_fixtures.py does
(rows separately, f32 model, eager attention, NLL sums in f64).

transformers 5 (the same adapters on the models in the 5.x config layout, tiny-qwen3 there with
linear rope scaling), after scripts/make_v5_fixtures.py:

    /work/pyref5/bin/python scripts/make_dora_fixtures.py --v5

writes tests/fixtures/v5/reference/peft-dora-<M>.json (loss and merged_loss per format, the
SGD step's losses) and peft-dora-<M>-sgd.safetensors, from PEFT 0.21 + transformers 5
(scripts/requirements-fixtures-v5.txt). The adapters are read, never rewritten.

DoRA with LoRA dropout (tallow's masks injected into PEFT) is scripts/make_dora_dropout_fixtures.py,
QDoRA (PEFT over bitsandbytes' NF4) scripts/make_qdora_fixtures.py.

Check mode (a DoRA adapter tallow wrote, loaded by PEFT):

    /work/pyref/bin/python scripts/make_dora_fixtures.py --check-adapter DIR --model MODEL_DIR --out FILE.json

loads DIR with PeftModel.from_pretrained, checks that every tensor of the file landed in an
adapter parameter as-is and that every adapter parameter came from the file, and writes the
per-format loss and merged_loss.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_env import pin_hash_seed_and_go_offline  # noqa: E402

if __name__ == "__main__":
    pin_hash_seed_and_go_offline(__file__)

import warnings  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

import fixturelib as fl  # noqa: E402
import make_fixtures as mf  # noqa: E402
import make_peft_fixtures as mp  # noqa: E402

REPO = mf.REPO
FIX = mf.FIX
MODELS = mp.MODELS
SEED = 20240607 + 9000
INIT_STD = mp.INIT_STD
MAG_STD = 0.1
SGD_LR = mp.SGD_LR
SPEC = dict(r=4, lora_alpha=8, target_modules=mp.ALL_TARGETS)
MERGE_TOL = mp.MERGE_TOL


def dora_config(name):
    spec = dict(SPEC, target_modules=mp.targets_for(name, SPEC["target_modules"]))
    return mp.lora_config(spec, use_dora=True)


def file_key_to_param(key: str, adapter_name: str = "default") -> str:
    """adapter_model.safetensors key -> PeftModel parameter name (A, B or DoRA magnitude)."""
    if key.endswith(".lora_magnitude_vector"):
        return f"{key}.{adapter_name}.weight"
    return mp.file_key_to_param(key, adapter_name)


def check_loaded(model, adapter_dir: Path):
    """make_peft_fixtures.check_loaded with the magnitude keys mapped too."""
    return mp.check_loaded(model, adapter_dir, file_key_to_param)


def build_adapter(name, model_dir: Path, ref, seed):
    out = FIX / "adapters" / f"{name}-peft-dora"
    shutil.rmtree(out, ignore_errors=True)
    base = mf.load_model(model_dir)
    model = get_peft_model(base, dora_config(name))
    counts = mp.randomize_adapter(model, seed, MAG_STD)
    n_mod = base.config.num_hidden_layers * len(mp.targets_for(name, SPEC["target_modules"]))  # layers x targets
    assert counts == {"ab": 2 * n_mod, "m": n_mod}, counts
    model.eval()
    mem = mp.eval_losses(model, ref)

    cfg = mp.save_adapter(model, name, out)
    assert cfg["use_dora"] is True, cfg

    keys, formats = mp.reload_formats(model_dir, out, ref, mem, file_key_to_param, tag=(name,))
    assert any(k.endswith(".lora_magnitude_vector") for k in keys), keys
    res = {
        "adapter_dir": str(out.relative_to(REPO)),
        "seed": seed,
        "init_std": INIT_STD,
        "magnitude_std": MAG_STD,
        "r": SPEC["r"],
        "lora_alpha": SPEC["lora_alpha"],
        "use_dora": True,
        "scaling": SPEC["lora_alpha"] / SPEC["r"],
        "keys": keys,
        "formats": formats,
    }
    return out, res


def sgd_step(name, model_dir: Path, adapter_dir: Path, ref, out_root=FIX):
    model = mp.load_peft(model_dir, adapter_dir, trainable=True)
    model.eval()
    # lr 0.5 overshoots on tiny-gemma2's and tiny-gemma3's DoRA adapters (text loss 7.0049 ->
    # 7.0158, 6.6894 -> 7.0279): the tests compare the step's gradients and weights with
    # tallow's, not its effect on the loss
    before, after, tensors, sd = mp.text_sgd(
        model, adapter_dir, ref, SGD_LR, file_key_to_param,
        must_decrease=name not in ("tiny-gemma2", "tiny-gemma3"),
    )
    saved = get_peft_model_state_dict(model)
    assert set(saved) == set(sd), set(saved) ^ set(sd)
    path = out_root / "reference" / f"peft-dora-{name}-sgd.safetensors"
    fl.save_tensors(tensors, path)
    return {
        "lr": SGD_LR,
        "sgd_loss_before": before,
        "sgd_loss_after": after,
        "tensors": str(path.relative_to(REPO)),
    }


def generate():
    for mi, name in enumerate(MODELS):
        model_dir = FIX / "models" / name
        ref = json.loads((FIX / "reference" / f"{name}.json").read_text(encoding="utf-8"))
        adir, res = build_adapter(name, model_dir, ref, SEED + 100 * mi)
        sgd = sgd_step(name, model_dir, adir, ref)
        out = {
            "versions": mf.VERSIONS,
            "model": name,
            "reference": f"tests/fixtures/reference/{name}.json",
            "adapter": res,
            "sgd": sgd,
        }
        mf.write_json(FIX / "reference" / f"peft-dora-{name}.json", out)
        print(name)
        for fmt, f in res["formats"].items():
            print(f"  {fmt:18s} loss={f['loss']:.9f} merged={f['merged_loss']:.9f}")
        print(f"  sgd {sgd['sgd_loss_before']:.9f} -> {sgd['sgd_loss_after']:.9f}")


def generate_v5():
    root = FIX / "v5"
    import peft

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "peft": peft.__version__}
    assert transformers.__version__.startswith("5."), transformers.__version__
    for name in MODELS:
        model_dir = root / "models" / name
        ref = json.loads((root / "reference" / f"{name}.json").read_text(encoding="utf-8"))
        adir = FIX / "adapters" / f"{name}-peft-dora"
        m = mp.load_peft(model_dir, adir)
        check_loaded(m, adir)
        mem = mp.eval_losses(m, ref)
        mrg = mp.merged_losses(mp.load_peft(model_dir, adir), ref)
        sgd = sgd_step(name, model_dir, adir, ref, out_root=root)
        out = {
            "versions": versions,
            "model": name,
            "reference": f"tests/fixtures/v5/reference/{name}.json",
            "adapter": {
                "adapter_dir": str(adir.relative_to(REPO)),
                "formats": {
                    fmt: {"loss": mem[fmt]["loss"], "merged_loss": mrg[fmt]["loss"]} for fmt in mem
                },
            },
            "sgd": sgd,
        }
        mf.write_json(root / "reference" / f"peft-dora-{name}.json", out)
        print(name, {f: round(v["loss"], 9) for f, v in out["adapter"]["formats"].items()})


def check_adapter(adapter_dir: Path, model_dir: Path, out_path: Path):
    ref = json.loads((FIX / "reference" / f"{model_dir.resolve().name}.json").read_text(encoding="utf-8"))
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    assert cfg.get("use_dora") is True, cfg
    m = mp.load_peft(model_dir, adapter_dir)
    keys = check_loaded(m, adapter_dir)
    res = mp.eval_losses(m, ref)
    mrg = mp.merged_losses(m, ref)
    out = {
        "versions": mf.VERSIONS,
        "model": model_dir.resolve().name,
        "adapter_dir": str(adapter_dir),
        "adapter_config": cfg,
        "keys": keys,
        "formats": {
            fmt: {"loss": res[fmt]["loss"], "merged_loss": mrg[fmt]["loss"]} for fmt in res
        },
    }
    mf.write_json(out_path, out)
    for fmt, f in out["formats"].items():
        print(f"{fmt:18s} loss={f['loss']:.9f} merged={f['merged_loss']:.9f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-adapter", type=Path)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--v5", action="store_true")
    args = ap.parse_args()
    if not args.v5:
        fl.warn_unpinned(mf.VERSIONS, mf.PINNED)
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"Unable to fetch remote file")
    warnings.filterwarnings("ignore", message=r"Could not find a config file")
    if args.check_adapter is not None:
        check_adapter(args.check_adapter, args.model, args.out)
    elif args.v5:
        generate_v5()
    else:
        generate()


if __name__ == "__main__":
    main()
