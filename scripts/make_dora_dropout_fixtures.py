#!/usr/bin/env python3
"""DoRA with LoRA dropout from PEFT, tallow's masks injected (dev-only).

Run (from the repository root, after make_dora_fixtures.py and the LoRA dropout masks):

    cargo run -p tallow-tests --bin dropout-masks      # reference/dropout-<M>-masks.safetensors
    /work/pyref/bin/python scripts/make_dora_dropout_fixtures.py

Pinned stack: scripts/requirements-fixtures.txt (torch 2.8.0, transformers 4.57.1, peft 0.17.1).

With dropout active PEFT's DoRA (`DoraLinearVariant.forward`, training mode) computes

    y = W x + b + (m / n - 1) W xd + (m / n) s B A xd        xd = dropout(x), n = ||W + s B A||

which the fixtures without dropout never reach. tallow's masks are a pure function of (seed, step,
micro-batch, adapter id); the adapter ids of a DoRA adapter are those of the LoRA adapter on the
same modules, so the masks are the LoRA dropout fixture's (reference/dropout-<M>-masks.safetensors,
micro-batch 0 of step 0, lora.dropout = 0.3, train.seed = 7, the 4 text rows right-padded to the
longest); tests/tests/dora.rs checks tallow still draws exactly those for the DoRA adapter. Each
LoRA layer's `lora_dropout` module is replaced by make_dropout_fixtures.FixedMask (x * keep /
(1 - p), what nn.Dropout does with that draw) and the layer put in training mode (PEFT's DoRA takes
its dropout branch only when `module.training`; the rest of the model stays in eval).

For M in DROPOUT_MODELS, from tests/fixtures/adapters/<M>-peft-dora (magnitudes at ±10% of
||W + s B A||): loss = (sum of target NLL over the 4 text rows, dropout on) / (text target
tokens); backward; torch.optim.SGD(lr=0.5).step(). Writes:

    tests/fixtures/reference/peft-dora-dropout-<M>.json    p, seed, lr, loss, loss_without_dropout,
        effects: how far the loss ("loss") and the update ("update": max over tensors of
        max |g' - g| / max |g|) move under each broken forward of VARIANTS, so the tests can check
        that their tolerances sit well below what they guard
    tests/fixtures/reference/peft-dora-dropout-<M>-sgd.safetensors   "after.<key>", "grad.<key>"
"""

import json
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_env import pin_hash_seed_and_go_offline  # noqa: E402

if __name__ == "__main__":
    pin_hash_seed_and_go_offline(__file__)

import warnings  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from peft.tuners.lora.variants import DoraLinearVariant  # noqa: E402
from peft.utils.integrations import dequantize_module_weight  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import fixturelib as fl  # noqa: E402
import make_dora_fixtures as md  # noqa: E402  (file_key_to_param)
import make_dropout_fixtures as mdr  # noqa: E402  (FixedMask, P, SEED)
import make_fixtures as mf  # noqa: E402
import make_peft_fixtures as mp  # noqa: E402

FIX = mf.FIX
REPO = mf.REPO
DROPOUT_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-phi3", "tiny-gemma2"]
P = mdr.P  # tallow_tests::DROPOUT_P
SEED = mdr.SEED  # tallow_tests::DROPOUT_SEED
LR = mp.SGD_LR

# The forwards the effect sizes are measured with, each a way to get DoRA-with-dropout wrong (b is
# in `result`, PEFT's base output on x). "peft" is PEFT's own formula, recomputed here: it must
# give PEFT's loss and gradients, which checks this machinery.
VARIANTS = {
    "peft": "W x + b + (m/n - 1) W xd + (m/n) s B A xd",
    "no_rescaled_base": "W x + b + (m/n) s B A xd: the (m/n - 1) W xd term dropped",
    "base_on_x": "(m/n) (W x + s B A xd) + b: dropout on the LoRA branch only (the no-dropout form)",
    "no_magnitude": "W x + b + s B A xd: m/n taken as 1 (plain LoRA)",
}


def variant_forward(variant):
    """A DoraLinearVariant.forward computing VARIANTS[variant] (the weight norm as PEFT's: of the
    dequantized weight plus s B A, detached)."""

    def forward(module, active_adapter, x, result):
        lora_a = module.lora_A[active_adapter]
        lora_b = module.lora_B[active_adapter]
        s = module.scaling[active_adapter]
        dora = module.lora_magnitude_vector[active_adapter]
        xd = module.lora_dropout[active_adapter](x)  # identity without dropout
        w = dequantize_module_weight(module.get_base_layer()).to(x.dtype)  # (out, in)
        n = dora.get_weight_norm(w, (lora_b.weight @ lora_a.weight).detach(), s).detach()
        ms = (dora.weight / n).view(1, -1)  # (1, out)
        lora_d = lora_b(lora_a(xd)) * s
        if variant == "peft":
            return result + (ms - 1) * F.linear(xd, w) + ms * lora_d
        if variant == "no_rescaled_base":
            return result + ms * lora_d
        if variant == "base_on_x":
            return result + (ms - 1) * F.linear(x, w) + ms * lora_d
        if variant == "no_magnitude":
            return result + lora_d
        raise ValueError(variant)

    return forward


@contextmanager
def dora_variant(variant):
    """PEFT's DoRA forward replaced by variant_forward(variant) inside the block."""
    orig = DoraLinearVariant.__dict__["forward"]  # the staticmethod itself
    DoraLinearVariant.forward = staticmethod(variant_forward(variant))
    try:
        yield
    finally:
        DoraLinearVariant.forward = orig


def inject_masks(model, masks):
    """Every LoRA layer's lora_dropout <- FixedMask(P) and the layer in training mode (only the
    layer itself: PEFT's DoRA reads `module.training`); {PEFT module name: its FixedMask}, whose
    names must be the masks file's."""
    layers = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_dropout") and "default" in mod.lora_dropout:
            fm = mdr.FixedMask(P)
            mod.lora_dropout["default"] = fm
            mod.training = True
            layers[name] = fm
    assert set(layers) == set(masks), set(layers) ^ set(masks)
    return layers


def masked_text_loss(model, ref, layers, masks, dropout=True):
    """The text rows' loss (each row alone, as every reference) with row b's masks
    masks[k][b, :len_b] (dropout) or all-kept masks (no dropout: x * (1 - p) / (1 - p) = x)."""
    rows = ref["formats"]["text"]["rows"]
    total = 0.0
    for b, r in enumerate(rows):
        for k, fm in layers.items():
            keep = masks[k][b].float()
            fm.keep = keep if dropout else torch.full_like(keep, 1.0 - P)
        total = total + mf.row_nll(model, r["ids"], r["targets"])[0]
    return total / sum(sum(r["targets"]) for r in rows)


def grads(trainable, key_of, loss_fn):
    """(loss, {file key: gradient}) of loss_fn() without stepping (0 for a parameter the loss does
    not use: the magnitude under "no_magnitude")."""
    names = list(trainable)
    loss = loss_fn()
    gs = torch.autograd.grad(loss, [trainable[n] for n in names], allow_unused=True)
    return loss.item(), {
        key_of[n]: torch.zeros_like(trainable[n]) if g is None else g.detach().clone()
        for n, g in zip(names, gs)
    }


def update_rel(g, ref):
    """max over tensors of max |g - ref| / max |ref| (the tests' measure of an update)."""
    return max(((g[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item() for k in ref)


def effects(trainable, key_of, loss_fn, variants):
    """PEFT's loss and gradients, and for each variant how far the loss and the update move from
    them; "peft" (the formula recomputed) must agree with PEFT within rounding."""
    loss, g = grads(trainable, key_of, loss_fn)
    out = {"loss": {}, "update": {}}
    for v in variants:
        with dora_variant(v):
            lv, gv = grads(trainable, key_of, loss_fn)
        out["loss"][v] = abs(lv - loss)
        out["update"][v] = update_rel(gv, g)
    if "peft" in variants:
        assert out["loss"].pop("peft") < 1e-6 and out["update"].pop("peft") < 1e-4, out
    return loss, g, out


def dropout_step(load, adapter_dir: Path, ref, masks_path: Path, out_stem: str):
    """One SGD step (LR) with the injected masks from the DoRA adapter in adapter_dir, on the
    trainable PeftModel load() returns: writes reference/<out_stem>-sgd.safetensors and returns
    the JSON's fields."""
    masks = load_file(str(masks_path))
    model = load()
    model.eval()
    layers = inject_masks(model, masks)
    trainable, key_of, sd = fl.adapter_trainables(model, adapter_dir, md.file_key_to_param)
    assert any(k.endswith(".lora_magnitude_vector") for k in sd)

    def loss_fn(dropout=True):
        return masked_text_loss(model, ref, layers, masks, dropout)

    with torch.no_grad():
        plain = loss_fn(False).item()
    loss0, g0, eff = effects(trainable, key_of, loss_fn, list(VARIANTS))
    _, g_plain = grads(trainable, key_of, lambda: loss_fn(False))
    eff["loss"]["no_dropout"] = abs(plain - loss0)
    eff["update"]["no_dropout"] = update_rel(g_plain, g0)

    loss, tensors = fl.sgd_step(trainable, key_of, loss_fn, LR)
    assert loss == loss0, (loss, loss0)
    for k in sd:
        assert torch.equal(tensors[f"grad.{k}"], g0[k]), k
    path = FIX / "reference" / f"{out_stem}-sgd.safetensors"
    fl.save_tensors(tensors, path)
    return {
        "p": P,
        "seed": SEED,
        "lr": LR,
        "masks": str(masks_path.relative_to(REPO)),
        "loss": loss,
        "loss_without_dropout": plain,
        "effects": eff,
        "variants": VARIANTS,
        "tensors": str(path.relative_to(REPO)),
    }


def main():
    fl.warn_unpinned(mf.VERSIONS, mf.PINNED)
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"Unable to fetch remote file")
    warnings.filterwarnings("ignore", message=r"Could not find a config file")
    for name in DROPOUT_MODELS:
        ref = json.loads((FIX / "reference" / f"{name}.json").read_text(encoding="utf-8"))
        adapter = FIX / "adapters" / f"{name}-peft-dora"
        masks = FIX / "reference" / f"dropout-{name}-masks.safetensors"
        stem = f"peft-dora-dropout-{name}"
        model_dir = FIX / "models" / name
        load = lambda: mp.load_peft(model_dir, adapter, trainable=True)  # noqa: E731
        res = dropout_step(load, adapter, ref, masks, stem)
        doc = {"versions": mf.VERSIONS, "model": name, "adapter": str(adapter.relative_to(REPO)),
               **res}
        mf.write_json(FIX / "reference" / f"{stem}.json", doc)
        print(name, "loss", res["loss"], "without dropout", res["loss_without_dropout"])
        for what in ("loss", "update"):
            print(f"  {what:6s}", {k: f"{v:.3g}" for k, v in res["effects"][what].items()})


if __name__ == "__main__":
    main()
