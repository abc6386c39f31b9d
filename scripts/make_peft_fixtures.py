#!/usr/bin/env python3
"""Generate tallow's PEFT (LoRA adapter) reference fixtures from HF peft (dev-only).

Run (from the repository root, AFTER scripts/make_fixtures.py has produced the tiny models
and tests/fixtures/reference/<model>.json):

    /work/pyref/bin/python scripts/make_peft_fixtures.py

(the script re-executes itself with PYTHONHASHSEED=0 so that the set-ordered
"target_modules" list in adapter_config.json is reproducible), or, in any virtualenv:

    pip install -r scripts/requirements-fixtures.txt
    python scripts/make_peft_fixtures.py

Pinned reference stack (see scripts/requirements-fixtures.txt):

    torch==2.8.0  transformers==4.57.1  tokenizers==0.22.2  peft==0.17.1
    safetensors==0.8.0  numpy==2.4.6  jinja2==3.1.6

Deterministic: fixed seeds, single-threaded CPU torch, deterministic algorithms. Only the
following are deleted and rewritten (existing fixtures are read, never modified):

    tests/fixtures/adapters/<M>-peft/             LoRA r=4, alpha=8 on q,k,v,o,gate,up,down
    tests/fixtures/adapters/<M>-peft-rslora/      LoRA r=8, alpha=8, use_rslora, on q,v only
        adapter_model.safetensors + adapter_config.json exactly as PeftModel.save_pretrained
        writes them (the README.md model card it also writes is deleted);
        adapter_config.json "base_model_name_or_path" = "<M>" (the model's dir name).
    tests/fixtures/reference/peft-<M>.json        losses (see below)
    tests/fixtures/reference/peft-<M>-sgd.safetensors   one plain-SGD step of the "peft" adapter

for M in tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-gemma2, tiny-phi3, tiny-gemma3 (tests/fixtures/models/<M>).
tiny-phi3's modules are PEFT's fused names (targets_for): "peft" on qkv_proj, o_proj,
gate_up_proj, down_proj, "peft-rslora" on qkv_proj.

Adapters: LoraConfig(lora_dropout=0, bias="none", task_type="CAUSAL_LM"). A fresh adapter has
B = 0 (no effect), so every lora_A / lora_B weight is overwritten with 0.2 * randn (seeded
torch.Generator, in named_parameters order) before saving. Scaling = alpha / r (2.0) for
"peft" and alpha / sqrt(r) (2.828...) for "peft-rslora".

Losses (computed exactly as scripts/make_fixtures.py does, whose row_nll is imported): f32
model, eager attention, each reference row of tests/fixtures/reference/<M>.json run alone
(batch 1); NLL summed over target positions in float64 from the f32 logits; a format's loss =
sum(nll) / sum(n_targets). peft-<M>.json["adapters"][<"peft"|"peft-rslora">]["formats"][fmt]:
    loss         PeftModel (unmerged) built in memory, as saved
    reload_loss  base + PeftModel.from_pretrained(saved dir) (asserted == loss)
    merged_loss  the reloaded model after merge_and_unload() (asserted ~= loss)
    nll_sum, n_targets  per row (unmerged).

SGD step (adapter "peft" only): base + PeftModel.from_pretrained(dir, is_trainable=True);
loss = (sum of target NLL over all kept "text" rows, each row run separately) / (total text
target tokens); backward; torch.optim.SGD(trainable LoRA params, lr=0.5).step().
peft-<M>-sgd.safetensors holds, under the key names of adapter_model.safetensors
(e.g. "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"):
    "after.<key>"  adapter weight after the step (f32)
    "grad.<key>"   its gradient (f32)
The JSON's "sgd" object has lr, sgd_loss_before and sgd_loss_after (same text loss after the step).

Check mode (verifies a tallow-written PEFT adapter and measures it):

    /work/pyref/bin/python scripts/make_peft_fixtures.py --check-adapter ADAPTER_DIR \\
        --model tests/fixtures/models/M --out FILE.json [--reference REF.json]

loads the base model and ADAPTER_DIR with PeftModel.from_pretrained (so PEFT must accept the
directory), checks that every tensor in ADAPTER_DIR/adapter_model.safetensors was loaded into
a LoRA parameter and every LoRA parameter came from the file (PEFT itself silently ignores
unexpected keys), and writes the per-format loss / merged_loss / nll_sum / n_targets (same
computation, rows from REF.json, default tests/fixtures/reference/<basename of M>.json) to
FILE.json.
"""

import argparse
import hashlib
import json
import math
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

import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

import fixturelib as fl  # noqa: E402  (sgd_step, save_tensors, ...)
import make_fixtures as mf  # noqa: E402  (row_nll, load_model, VERSIONS, PINNED, write_json)

REPO = mf.REPO
FIX = mf.FIX
# new models go last: each model's seeds follow from its index
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-phi3", "tiny-gemma3"]
SEED = 20240607 + 7000
INIT_STD = 0.2
SGD_LR = 0.5
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "peft": dict(r=4, lora_alpha=8, use_rslora=False, target_modules=ALL_TARGETS),
    "peft-rslora": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
}
MERGE_TOL = 1e-4  # |merged_loss - loss| (f32 weight merge vs. unmerged f32 path)
# Phi3ForCausalLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj (PEFT's names)
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def targets_for(name, targets):
    """The modules of model `name` that `targets` (Llama names) mean: on tiny-phi3 the fused
    module of each, once."""
    if name != "tiny-phi3":
        return list(targets)
    out = []
    for t in targets:
        if FUSED.get(t, t) not in out:
            out.append(FUSED.get(t, t))
    return out


def lora_config(spec, **kw):
    """The adapters' LoraConfig (no dropout, no bias) for spec's r, lora_alpha and target_modules,
    with `kw` (use_rslora, use_dora) on top."""
    return LoraConfig(
        r=spec["r"],
        lora_alpha=spec["lora_alpha"],
        lora_dropout=0.0,
        target_modules=list(spec["target_modules"]),
        task_type="CAUSAL_LM",
        bias="none",
        **kw,
    )


def file_key_to_param(key: str, adapter_name: str = "default") -> str:
    """adapter_model.safetensors key -> PeftModel parameter name."""
    for part in (".lora_A.", ".lora_B."):
        if part in key:
            head, tail = key.split(part, 1)
            return f"{head}{part}{adapter_name}.{tail}"
    raise ValueError(f"not a LoRA A/B key: {key}")


def lora_params(model):
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


def check_loaded(model, adapter_dir: Path, key_to_param=None):
    """Every tensor of the file landed in a LoRA parameter (bit-exact); every LoRA param covered.
    `key_to_param` maps a file key to its parameter name (default: LoRA A / B keys)."""
    key_to_param = key_to_param or file_key_to_param
    sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = lora_params(model)
    seen = set()
    for k, t in sd.items():
        pn = key_to_param(k)
        if pn not in params:
            raise AssertionError(f"{adapter_dir}: tensor {k} does not match any LoRA parameter ({pn})")
        p = params[pn]
        if tuple(p.shape) != tuple(t.shape) or not torch.equal(p.detach().cpu(), t.to(p.dtype)):
            raise AssertionError(f"{adapter_dir}: tensor {k} {tuple(t.shape)} not loaded as-is into {pn}")
        seen.add(pn)
    missing = sorted(set(params) - seen)
    if missing:
        raise AssertionError(f"{adapter_dir}: LoRA parameters not in the file: {missing}")
    return sorted(sd)


def eval_losses(model, ref):
    """Per-format loss (as make_fixtures.py): rows separately, f64 NLL sums / total targets."""
    out = {}
    with torch.no_grad():
        for fmt, f in ref["formats"].items():
            nlls, ns = [], []
            for r in f["rows"]:
                nll, _ = mf.row_nll(model, r["ids"], r["targets"])
                nlls.append(nll.item())
                ns.append(sum(r["targets"]))
            out[fmt] = {"loss": sum(nlls) / sum(ns), "nll_sum": nlls, "n_targets": ns}
    return out


def text_loss(model, ref):
    rows = ref["formats"]["text"]["rows"]
    total = sum(mf.row_nll(model, r["ids"], r["targets"])[0] for r in rows)
    return total / sum(sum(r["targets"]) for r in rows)


def text_sgd(model, adapter_dir: Path, ref, lr, key_to_param=None, must_decrease=True):
    """One SGD step (lr) on text_loss of `model`, PEFT's trainable model of adapter_dir (whose
    trainable parameters must be the file's tensors; `key_to_param` as in check_loaded): the loss
    before and after the step (which must be lower), the step's tensors (fixturelib.sgd_step,
    under the file's keys) and the file's tensors."""
    trainable, key_of, sd = fl.adapter_trainables(model, adapter_dir, key_to_param or file_key_to_param)
    before, tensors = fl.sgd_step(trainable, key_of, lambda: text_loss(model, ref), lr)
    with torch.no_grad():
        after = text_loss(model, ref).item()
    assert after < before or not must_decrease, (before, after)
    return before, after, tensors, sd


def load_peft(model_dir: Path, adapter_dir: Path, trainable=False):
    base = mf.load_model(model_dir)
    m = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    if not trainable:
        m.eval()
    return m


def merged_losses(peft_model, ref):
    merged = peft_model.merge_and_unload()
    merged.eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    return eval_losses(merged, ref)


def randomize_adapter(model, seed, magnitude_std=None):
    """Every lora_A / lora_B weight <- INIT_STD * randn and, with magnitude_std, every DoRA
    magnitude vector *= 1 + magnitude_std * randn (one seeded generator, in named_parameters
    order): {"ab": how many A / B weights, "m": how many magnitude vectors}."""
    gen = torch.Generator().manual_seed(seed)
    counts = {"ab": 0, "m": 0}
    with torch.no_grad():
        for pn, p in model.named_parameters():
            if ".lora_A." in pn or ".lora_B." in pn:
                p.copy_(INIT_STD * torch.randn(p.shape, generator=gen, dtype=torch.float32))
                counts["ab"] += 1
            elif magnitude_std is not None and ".lora_magnitude_vector." in pn:
                p.mul_(1 + magnitude_std * torch.randn(p.shape, generator=gen, dtype=torch.float32))
                counts["m"] += 1
            else:
                assert ".lora_" not in pn, pn
    return counts


def save_adapter(model, name, out: Path):
    """PeftModel.save_pretrained into `out`, base_model_name_or_path = name (the model's dir
    name); the README.md model card it writes is deleted. Returns adapter_config.json."""
    model.peft_config["default"].base_model_name_or_path = name
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # model card boilerplate, not needed
    return json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))


def reload_formats(model_dir: Path, adapter_dir: Path, ref, mem, key_to_param=None, tag=()):
    """The saved adapter, reloaded by PEFT: its tensors as-is (check_loaded, `key_to_param` as
    there), the same losses as `mem` (eval_losses of the model it was saved from), merged losses
    within MERGE_TOL (`tag` heads the assertion messages). Returns (the file's keys, per format
    loss / reload_loss / merged_loss / nll_sum / n_targets)."""
    re = load_peft(model_dir, adapter_dir)
    keys = check_loaded(re, adapter_dir, key_to_param)
    rel = eval_losses(re, ref)
    for fmt in mem:
        assert rel[fmt]["nll_sum"] == mem[fmt]["nll_sum"], (*tag, fmt, rel[fmt], mem[fmt])
    mrg = merged_losses(re, ref)
    formats = {}
    for fmt in mem:
        d = abs(mrg[fmt]["loss"] - mem[fmt]["loss"])
        assert d < MERGE_TOL, (*tag, fmt, mem[fmt]["loss"], mrg[fmt]["loss"])
        formats[fmt] = {
            "loss": mem[fmt]["loss"],
            "reload_loss": rel[fmt]["loss"],
            "merged_loss": mrg[fmt]["loss"],
            "nll_sum": mem[fmt]["nll_sum"],
            "n_targets": mem[fmt]["n_targets"],
        }
    return keys, formats


# --------------------------------------------------------------------------------------


def build_adapter(name, model_dir: Path, ref, kind, spec, seed):
    out = FIX / "adapters" / f"{name}-{kind}"
    shutil.rmtree(out, ignore_errors=True)
    spec = dict(spec, target_modules=targets_for(name, spec["target_modules"]))
    base = mf.load_model(model_dir)
    model = get_peft_model(base, lora_config(spec, use_rslora=spec["use_rslora"]))
    n_lora = randomize_adapter(model, seed)["ab"]
    layers = model.base_model.model.config.num_hidden_layers  # 2, tiny-gemma2 4
    assert n_lora == layers * 2 * len(spec["target_modules"]), n_lora  # layers x (A, B) x targets
    model.eval()
    mem = eval_losses(model, ref)

    cfg = save_adapter(model, name, out)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"], files
    assert cfg["base_model_name_or_path"] == name, cfg["base_model_name_or_path"]
    assert cfg["r"] == spec["r"] and cfg["lora_alpha"] == spec["lora_alpha"]
    assert cfg["use_rslora"] == spec["use_rslora"]
    assert sorted(cfg["target_modules"]) == sorted(spec["target_modules"])

    # reload with PEFT: same tensors, same losses (bit-identical computation)
    keys, formats = reload_formats(model_dir, out, ref, mem, tag=(name, kind))

    scaling = spec["lora_alpha"] / (math.sqrt(spec["r"]) if spec["use_rslora"] else spec["r"])
    res = {
        "adapter_dir": str(out.relative_to(REPO)),
        "seed": seed,
        "init_std": INIT_STD,
        "r": spec["r"],
        "lora_alpha": spec["lora_alpha"],
        "use_rslora": spec["use_rslora"],
        "scaling": scaling,
        "target_modules": sorted(spec["target_modules"]),
        "keys": keys,
        "formats": formats,
    }
    return out, res


def sgd_step(name, model_dir: Path, adapter_dir: Path, ref):
    model = load_peft(model_dir, adapter_dir, trainable=True)
    model.eval()  # dropout is 0 anyway; keeps the forward identical to the eval path
    # lr 0.5 overshoots on tiny-gemma3's adapter (text loss 6.8990 -> 6.9212): the step is
    # compared with PEFT's, whatever its direction
    before, after, tensors, sd = text_sgd(
        model, adapter_dir, ref, SGD_LR, must_decrease=name != "tiny-gemma3"
    )
    # the trainable parameters (one a file tensor) are the LoRA A / B weights
    assert sd and all(".lora_A." in k or ".lora_B." in k for k in sd), sorted(sd)
    assert abs(before - ref["_peft_text_loss"]) < 1e-12, (before, ref["_peft_text_loss"])
    for k in sd:
        want = sd[k] - SGD_LR * tensors[f"grad.{k}"]
        assert torch.equal(tensors[f"after.{k}"], want), k
    # the state dict PEFT would save now uses the same names
    saved = get_peft_model_state_dict(model)
    assert set(saved) == set(sd), set(saved) ^ set(sd)
    for k, v in saved.items():
        assert torch.equal(v, tensors[f"after.{k}"]), k
    path = FIX / "reference" / f"peft-{name}-sgd.safetensors"
    fl.save_tensors(tensors, path)
    return path, {
        "adapter": "peft",
        "lr": SGD_LR,
        "sgd_loss_before": before,
        "sgd_loss_after": after,
        "n_text_targets": sum(ref["formats"]["text"]["n_targets"]),
        "tensors": str(path.relative_to(REPO)),
    }


def generate():
    written = []
    summary = {}
    for mi, name in enumerate(MODELS):
        model_dir = FIX / "models" / name
        ref = json.loads((FIX / "reference" / f"{name}.json").read_text(encoding="utf-8"))
        out = {
            "versions": mf.VERSIONS,
            "model": name,
            "model_dir": str(model_dir.relative_to(REPO)),
            "reference": f"tests/fixtures/reference/{name}.json",
            "adapters": {},
        }
        for ai, (kind, spec) in enumerate(ADAPTERS.items()):
            adir, res = build_adapter(name, model_dir, ref, kind, spec, SEED + 100 * mi + ai)
            out["adapters"][kind] = res
            written += sorted(adir.iterdir())
        # the SGD step's text loss (grad path) must equal the eval path's sum / count
        t = out["adapters"]["peft"]["formats"]["text"]
        ref["_peft_text_loss"] = sum(t["nll_sum"]) / sum(t["n_targets"])
        spath, sgd = sgd_step(name, model_dir, FIX / "adapters" / f"{name}-peft", ref)
        out["sgd"] = sgd
        jpath = FIX / "reference" / f"peft-{name}.json"
        mf.write_json(jpath, out)
        written += [jpath, spath]
        summary[name] = out

    print("versions:", mf.VERSIONS)
    for name, out in summary.items():
        print(f"\n{name}")
        for kind, res in out["adapters"].items():
            print(f"  {kind} (r={res['r']} alpha={res['lora_alpha']} rslora={res['use_rslora']} "
                  f"scaling={res['scaling']:.6f})")
            for fmt, f in res["formats"].items():
                print(f"    {fmt:18s} loss={f['loss']:.9f} merged={f['merged_loss']:.9f} "
                      f"|d|={abs(f['loss'] - f['merged_loss']):.2e}")
        s = out["sgd"]
        print(f"  sgd lr={s['lr']} loss_before={s['sgd_loss_before']:.9f} loss_after={s['sgd_loss_after']:.9f}")
    total = 0
    print()
    for p in written:
        sz = p.stat().st_size
        total += sz
        h = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
        print(f"{sz:>9d}  {h}  {p.relative_to(REPO)}")
    print(f"{total:>9d}  total bytes")


def check_adapter(adapter_dir: Path, model_dir: Path, out_path: Path, ref_path):
    if ref_path is None:
        ref_path = FIX / "reference" / f"{model_dir.resolve().name}.json"
    ref = json.loads(Path(ref_path).read_text(encoding="utf-8"))
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    m = load_peft(model_dir, adapter_dir)
    keys = check_loaded(m, adapter_dir)
    res = eval_losses(m, ref)
    mrg = merged_losses(m, ref)
    out = {
        "versions": mf.VERSIONS,
        "model": ref.get("model", model_dir.resolve().name),
        "model_dir": str(model_dir),
        "reference": str(ref_path),
        "adapter_dir": str(adapter_dir),
        "adapter_config": cfg,
        "keys": keys,
        "formats": {
            fmt: {
                "loss": res[fmt]["loss"],
                "merged_loss": mrg[fmt]["loss"],
                "nll_sum": res[fmt]["nll_sum"],
                "n_targets": res[fmt]["n_targets"],
            }
            for fmt in res
        },
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    mf.write_json(out_path, out)
    for fmt, f in out["formats"].items():
        print(f"{fmt:18s} loss={f['loss']:.9f} merged={f['merged_loss']:.9f}")
    print(f"wrote {out_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check-adapter", type=Path, metavar="ADAPTER_DIR")
    ap.add_argument("--model", type=Path, metavar="MODEL_DIR")
    ap.add_argument("--out", type=Path, metavar="FILE.json")
    ap.add_argument("--reference", type=Path, metavar="REF.json")
    args = ap.parse_args()

    fl.warn_unpinned(mf.VERSIONS, mf.PINNED, "; fixtures may differ")
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # consequence of the offline lookup above (no target is an embedding layer, so harmless)
    warnings.filterwarnings("ignore", message=r"Unable to fetch remote file due to the following error")
    warnings.filterwarnings("ignore", message=r"Could not find a config file in .* will assume")

    if args.check_adapter is not None:
        if args.model is None or args.out is None:
            ap.error("--check-adapter needs --model and --out")
        check_adapter(args.check_adapter, args.model, args.out, args.reference)
    else:
        if args.model or args.out or args.reference:
            ap.error("--model/--out/--reference are only for --check-adapter")
        generate()


if __name__ == "__main__":
    main()
