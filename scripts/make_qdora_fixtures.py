#!/usr/bin/env python3
"""QDoRA reference from PEFT over bitsandbytes' NF4 (dev-only): a DoRA adapter on the 4-bit
tiny-qwen2 checkpoint, its loss and one SGD step's gradients, with and without LoRA dropout.

Run (from the repository root, after make_nf4_fixtures.py and make_dora_dropout_fixtures.py's
prerequisites, the LoRA dropout masks):

    /work/pyref/bin/python scripts/make_qdora_fixtures.py

Pinned stack: scripts/requirements-fixtures.txt (torch 2.8.0, transformers 4.57.1, peft 0.17.1,
bitsandbytes 0.50.2, whose CPU backend runs NF4 without a GPU).

The base is tests/fixtures/models/tiny-qwen2-bnb-4bit (NF4, double quant, compute dtype f32),
loaded by transformers as Linear4bit layers. PEFT's DoRA reads the weight through
`bitsandbytes.functional.dequantize_4bit` (for the weight norm, and for W xd with dropout), and
the base output comes from Linear4bit. bitsandbytes 0.50.2's CPU kernels index the absmax per row,
which is wrong where in_features is not a multiple of the blocksize (down_proj, 160 wide: up to
0.19 off on weights of at most 0.41; see make_nf4_fixtures.bnb_model); both are routed through
the default backend's flat dequantization (make_nf4_fixtures.dequantize_flat, what the CUDA kernels
compute). On every other weight the CPU kernel's result is bit-identical to it (asserted), and the
base model's loss is reference/tiny-qwen2-bnb-4bit.json's (asserted).

The adapter: LoRA r=4, alpha=8, use_dora=True on all seven linears; lora_A / lora_B <- 0.2 * randn
(seeded), then each magnitude m <- ||W + s B A|| * u, u uniform in [0.8, 1.2] per output row
(W the dequantized weight), so m / n is far from 1 on both sides, and m is far from ||W||.
Writes (deleting the adapter dir first):

    tests/fixtures/adapters/tiny-qwen2-bnb-4bit-peft-dora/   PeftModel.save_pretrained
    tests/fixtures/reference/peft-qdora-tiny-qwen2-bnb-4bit.json
        adapter.formats.<fmt>: loss (PEFT on the NF4 base, the rows of reference/tiny-qwen2.json),
            loss_no_magnitude (m/n taken as 1), loss_unquantized (the adapter on dense tiny-qwen2)
        sgd: one SGD step (lr 0.5, no dropout, text rows): sgd_loss_before / after, effects
            (update moved by: magnitude ignored, the base unquantized)
        dropout_sgd: the same step with lora.dropout 0.3 and tallow's masks injected
            (make_dora_dropout_fixtures.dropout_step; the masks of tiny-qwen2, whose adapters have
            the same modules and so the same adapter ids), with its effects
    tests/fixtures/reference/peft-qdora-tiny-qwen2-bnb-4bit-sgd.safetensors          "after.<key>",
    tests/fixtures/reference/peft-qdora-tiny-qwen2-bnb-4bit-dropout-sgd.safetensors  "grad.<key>"
"""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_env import pin_hash_seed_and_go_offline  # noqa: E402

if __name__ == "__main__":
    pin_hash_seed_and_go_offline(__file__)

import warnings  # noqa: E402

import bitsandbytes  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import get_peft_model  # noqa: E402
from peft.utils.integrations import dequantize_module_weight  # noqa: E402

import fixturelib as fl  # noqa: E402
import make_dora_dropout_fixtures as mdd  # noqa: E402  (variants, grads, dropout_step)
import make_dora_fixtures as md  # noqa: E402  (dora_config, file_key_to_param, SPEC)
import make_fixtures as mf  # noqa: E402
import make_nf4_fixtures as nf  # noqa: E402  (dequantize_flat)
import make_peft_fixtures as mp  # noqa: E402

FIX = mf.FIX
REPO = mf.REPO
MODEL = "tiny-qwen2-bnb-4bit"
DENSE = "tiny-qwen2"  # the unquantized model: its reference rows, its dropout masks
SEED = md.SEED + 5000
MAG_RANGE = (0.8, 1.2)
STEM = f"peft-qdora-{MODEL}"
VERSIONS = dict(mf.VERSIONS, bitsandbytes=bitsandbytes.__version__)
CPU_DEQUANTIZE_4BIT = bitsandbytes.functional.dequantize_4bit


def dequantize_4bit(A, quant_state=None, *args, **kwargs):
    """bitsandbytes.functional.dequantize_4bit as the default backend computes it (flat blocks);
    where bitsandbytes' CPU kernel is right (in_features a multiple of the blocksize) it must
    give the same bits."""
    assert not args and not kwargs, (args, kwargs)
    out = nf.dequantize_flat(A, quant_state)
    if quant_state.shape[-1] % quant_state.blocksize == 0:
        assert torch.equal(CPU_DEQUANTIZE_4BIT(A, quant_state), out)
    return out


def load_nf4_base():
    """The 4-bit checkpoint with every Linear4bit computing F.linear on the flat dequantization
    (and bitsandbytes.functional.dequantize_4bit, which PEFT calls, patched to it)."""
    bitsandbytes.functional.dequantize_4bit = dequantize_4bit
    model = mf.load_model(FIX / "models" / MODEL)
    n = 0
    for mod in model.modules():
        if isinstance(mod, bitsandbytes.nn.Linear4bit):
            mod.forward = lambda x, m=mod: torch.nn.functional.linear(
                x, dequantize_4bit(m.weight.data, m.weight.quant_state).to(x.dtype), m.bias
            )
            n += 1
    assert n == 14, n
    return model


def load_qdora(adapter_dir: Path, trainable=False):
    from peft import PeftModel

    m = PeftModel.from_pretrained(load_nf4_base(), str(adapter_dir), is_trainable=trainable)
    m.eval()
    return m


def build_adapter(ref):
    """The QDoRA adapter (see the docstring), saved; returns its dir and the JSON's fields."""
    out = FIX / "adapters" / f"{MODEL}-peft-dora"
    shutil.rmtree(out, ignore_errors=True)
    base = load_nf4_base()
    # the base alone gives the NF4 fixture's loss: the patched forward is the one it was made with
    want = json.loads((FIX / "reference" / f"{MODEL}.json").read_text(encoding="utf-8"))["loss"]
    with torch.no_grad():
        got = mp.text_loss(base, ref).item()
    assert abs(got - want) < 1e-12, (got, want)

    model = get_peft_model(base, md.dora_config(DENSE))
    counts = mp.randomize_adapter(model, SEED, magnitude_std=0.0)  # A, B <- 0.2 randn; m kept
    assert counts == {"ab": 28, "m": 14}, counts
    gen = torch.Generator().manual_seed(SEED + 1)
    over_norm, over_base = [], []
    with torch.no_grad():
        for _, mod in sorted(model.named_modules()):
            if not (hasattr(mod, "lora_magnitude_vector") and "default" in mod.lora_magnitude_vector):
                continue
            dora = mod.lora_magnitude_vector["default"]
            w = dequantize_module_weight(mod.get_base_layer())  # (out, in) f32
            ba = mod.lora_B["default"].weight @ mod.lora_A["default"].weight
            n = dora.get_weight_norm(w, ba, mod.scaling["default"])
            u = torch.empty(n.shape).uniform_(*MAG_RANGE, generator=gen)
            dora.weight.copy_(n * u)
            over_norm.append(u)
            over_base.append(dora.weight / w.norm(dim=1))
    model.eval()
    cfg = mp.save_adapter(model, MODEL, out)
    assert cfg["use_dora"] is True, cfg
    over_norm, over_base = torch.cat(over_norm), torch.cat(over_base)
    res = {
        "adapter_dir": str(out.relative_to(REPO)),
        "seed": SEED,
        "init_std": mp.INIT_STD,
        "r": md.SPEC["r"],
        "lora_alpha": md.SPEC["lora_alpha"],
        "scaling": md.SPEC["lora_alpha"] / md.SPEC["r"],
        "magnitude_over_norm": [over_norm.min().item(), over_norm.max().item()],
        "magnitude_over_base_norm": [over_base.min().item(), over_base.max().item()],
    }
    return out, res


def forward_losses(adapter_dir: Path, ref):
    """The adapter file's keys (each checked to land in its parameter as-is) and per format:
    PEFT's loss on the NF4 base, with m/n taken as 1, and on the dense model."""
    model = load_qdora(adapter_dir)
    keys = md.check_loaded(model, adapter_dir)
    peft = mp.eval_losses(model, ref)
    with mdd.dora_variant("peft"):
        again = mp.eval_losses(model, ref)
    with mdd.dora_variant("no_magnitude"):
        no_mag = mp.eval_losses(model, ref)
    dense = mp.eval_losses(mp.load_peft(FIX / "models" / DENSE, adapter_dir), ref)
    out = {}
    for fmt in peft:
        assert abs(again[fmt]["loss"] - peft[fmt]["loss"]) < 1e-6, fmt
        out[fmt] = {
            "loss": peft[fmt]["loss"],
            "loss_no_magnitude": no_mag[fmt]["loss"],
            "loss_unquantized": dense[fmt]["loss"],
            "nll_sum": peft[fmt]["nll_sum"],
            "n_targets": peft[fmt]["n_targets"],
        }
    return keys, out


def sgd_step(adapter_dir: Path, ref):
    """One SGD step without dropout, with the update's effects (magnitude ignored, dense base)."""
    model = load_qdora(adapter_dir, trainable=True)
    trainable, key_of, sd = fl.adapter_trainables(model, adapter_dir, md.file_key_to_param)
    loss0, g0, eff = mdd.effects(
        trainable, key_of, lambda: mp.text_loss(model, ref), ["peft", "no_magnitude"]
    )
    dense = mp.load_peft(FIX / "models" / DENSE, adapter_dir, trainable=True)
    tr_d, key_d, _ = fl.adapter_trainables(dense, adapter_dir, md.file_key_to_param)
    loss_d, g_d = mdd.grads(tr_d, key_d, lambda: mp.text_loss(dense, ref))
    eff["loss"]["unquantized"] = abs(loss_d - loss0)
    eff["update"]["unquantized"] = mdd.update_rel(g_d, g0)

    before, after, tensors, _ = mp.text_sgd(model, adapter_dir, ref, mp.SGD_LR, md.file_key_to_param)
    assert before == loss0, (before, loss0)
    for k in sd:
        assert torch.equal(tensors[f"grad.{k}"], g0[k]), k
    path = FIX / "reference" / f"{STEM}-sgd.safetensors"
    fl.save_tensors(tensors, path)
    return {
        "lr": mp.SGD_LR,
        "sgd_loss_before": before,
        "sgd_loss_after": after,
        "effects": eff,
        "tensors": str(path.relative_to(REPO)),
    }


def main():
    fl.warn_unpinned(VERSIONS, dict(mf.PINNED, bitsandbytes="0.50.2"))
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"Unable to fetch remote file")
    warnings.filterwarnings("ignore", message=r"Could not find a config file")
    ref = json.loads((FIX / "reference" / f"{DENSE}.json").read_text(encoding="utf-8"))
    adapter, res = build_adapter(ref)
    res["keys"], res["formats"] = forward_losses(adapter, ref)
    sgd = sgd_step(adapter, ref)
    masks = FIX / "reference" / f"dropout-{DENSE}-masks.safetensors"
    dropout = mdd.dropout_step(
        lambda: load_qdora(adapter, trainable=True), adapter, ref, masks, f"{STEM}-dropout"
    )
    doc = {
        "versions": VERSIONS,
        "model": MODEL,
        "reference": f"tests/fixtures/reference/{DENSE}.json",
        "adapter": res,
        "sgd": sgd,
        "dropout_sgd": dropout,
    }
    mf.write_json(FIX / "reference" / f"{STEM}.json", doc)
    print(MODEL, "m/n in", res["magnitude_over_norm"], "m/||W|| in", res["magnitude_over_base_norm"])
    for fmt, f in res["formats"].items():
        print(f"  {fmt:18s} loss={f['loss']:.9f} no_magnitude={f['loss_no_magnitude']:.9f}"
              f" unquantized={f['loss_unquantized']:.9f}")
    print(f"  sgd {sgd['sgd_loss_before']:.9f} -> {sgd['sgd_loss_after']:.9f}", sgd["effects"])
    print(f"  dropout {dropout['loss']:.9f} (without {dropout['loss_without_dropout']:.9f})",
          dropout["effects"])


if __name__ == "__main__":
    main()
