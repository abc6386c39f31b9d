#!/usr/bin/env python3
"""LoRA dropout reference from PEFT with tallow's masks injected (dev-only).

Run (from the repository root, after make_fixtures.py and make_peft_fixtures.py):

    cargo run -p tallow-tests --bin dropout-masks      # tallow's masks -> reference/dropout-<M>-masks.safetensors
    /work/pyref/bin/python scripts/make_dropout_fixtures.py

Pinned stack: scripts/requirements-fixtures.txt (torch 2.8.0, transformers 4.57.1, peft 0.17.1).

tallow draws its dropout masks from a counter-based hash of (seed, adapter, element index)
(crates/model/src/kernels/dropout.rs), not from torch's generator, so PEFT is given those masks: each
LoRA layer's `lora_dropout` module (nn.Dropout in PEFT) is replaced by one that multiplies its
input by the keep flags / (1 - p), exactly what nn.Dropout does with that draw. The masks are
those of micro-batch 0 of step 0 of a run with lora.dropout = P, train.seed = SEED and the 4
text rows in one micro-batch right-padded to the longest row (rows, T, in); each row runs alone
here (batch 1, as every reference), with its rows of the mask: mask[r, :len_r].

For M in tiny-llama, tiny-qwen2, tiny-qwen3, tiny-mistral, tiny-gemma2, tiny-phi3, tiny-gemma3, from tests/fixtures/adapters/<M>-peft (is_trainable):
loss = (sum of target NLL over the 4 text rows, dropout on) / (text target tokens); backward;
torch.optim.SGD(lr=0.5).step(). Writes:

    tests/fixtures/reference/dropout-<M>.json            p, seed, lr, loss (with dropout),
                                                         loss_without_dropout (same adapter)
    tests/fixtures/reference/dropout-<M>-sgd.safetensors "after.<key>", "grad.<key>" (f32)
"""

import json
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixturelib as fl  # noqa: E402
import make_fixtures as mf  # noqa: E402
import make_peft_fixtures as mp  # noqa: E402  (file_key_to_param)

FIX = mf.FIX
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-phi3", "tiny-gemma3"]
P = 0.3  # tallow_tests::DROPOUT_P
SEED = 7  # tallow_tests::DROPOUT_SEED
LR = 0.5


class FixedMask(torch.nn.Module):
    """nn.Dropout with a given draw: x * keep / (1 - p); `keep` set per row."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.keep = None

    def forward(self, x):  # x: (1, T, in)
        return x * self.keep[: x.shape[1]].unsqueeze(0) / (1.0 - self.p)


def main():
    torch.manual_seed(0)
    fl.deterministic()
    for name in MODELS:
        ref = json.loads((FIX / "reference" / f"{name}.json").read_text())
        rows = ref["formats"]["text"]["rows"]
        masks = load_file(str(FIX / "reference" / f"dropout-{name}-masks.safetensors"))
        adapter = FIX / "adapters" / f"{name}-peft"
        model = PeftModel.from_pretrained(mf.load_model(FIX / "models" / name), str(adapter), is_trainable=True)
        model.eval()  # the injected masks apply whatever the mode
        layers = {}
        for mod_name, mod in model.named_modules():
            if hasattr(mod, "lora_dropout") and "default" in mod.lora_dropout:
                fm = FixedMask(P)
                mod.lora_dropout["default"] = fm
                layers[mod_name] = fm
        assert set(layers) == set(masks), set(layers) ^ set(masks)
        n_targets = sum(sum(r["targets"]) for r in rows)

        def loss_fn(dropout):
            total = 0.0
            for b, r in enumerate(rows):
                for k, fm in layers.items():
                    fm.keep = masks[k][b].float() if dropout else torch.full_like(masks[k][b].float(), 1.0 - P)
                total = total + mf.row_nll(model, r["ids"], r["targets"])[0]
            return total / n_targets

        with torch.no_grad():
            plain = loss_fn(False).item()
        trainable, key_of, _ = fl.adapter_trainables(model, adapter, mp.file_key_to_param)
        loss, tensors = fl.sgd_step(trainable, key_of, lambda: loss_fn(True), LR)
        fl.save_tensors(tensors, FIX / "reference" / f"dropout-{name}-sgd.safetensors")
        doc = {"versions": mf.VERSIONS, "p": P, "seed": SEED, "lr": LR, "loss": loss,
               "loss_without_dropout": plain, "adapter": str(adapter.relative_to(mf.REPO))}
        mf.write_json(FIX / "reference" / f"dropout-{name}.json", doc)
        print(name, doc["loss"], "without dropout", plain)


if __name__ == "__main__":
    main()
