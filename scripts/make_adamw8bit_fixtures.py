#!/usr/bin/env python3
"""bitsandbytes AdamW8bit reference for tallow's adamw8bit update (dev-only).

Run (from the repository root):

    /work/pyref/bin/python scripts/make_adamw8bit_fixtures.py

Pinned stack: scripts/requirements-fixtures.txt (torch 2.8.0, bitsandbytes 0.50.2, whose CPU
backend runs the blockwise 8-bit update: dequantize both moments, the AdamW step in f32,
requantize with its quantize_blockwise kernel).

Two parameters, seeded: "0" (64 x 128 = 8192 elements: 8-bit moments, 32 blocks of 256) and
"1" (16 x 16: under min_8bit_size 4096, f32 moments). bnb.optim.AdamW8bit(lr=LR, betas=(0.9,
0.999), eps=1e-8, weight_decay=WD) runs STEPS steps on seeded gradients of a few scales (so the
blocks' absmax vary). Writes tests/fixtures/reference/adamw8bit.safetensors:

    "init.{i}"                          parameter before step 1 (f32)
    "grad.{k}.{i}"                      gradient of step k (1-based)
    "after.{k}.{i}.param"               parameter after step k
    "after.{k}.0.exp_avg.codes" / ".absmax", "after.{k}.0.exp_avg_sq.codes" / ".absmax"
                                        bnb's state1 / state2 (uint8 codes, flattened) and
                                        absmax1 / absmax2 (f32) after step k
    "after.{k}.0.exp_avg.fp32" / "after.{k}.0.exp_avg_sq.fp32"
                                        the f32 moments those codes quantize (flattened)
    "after.{k}.1.exp_avg" / "after.{k}.1.exp_avg_sq"   f32 moments of the small parameter

and tests/fixtures/reference/adamw8bit.json with lr, weight_decay, betas, eps, steps, versions.
"""

import json
from pathlib import Path

import bitsandbytes as bnb
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "reference"
LR, WD, STEPS = 1e-2, 0.01, 5
SHAPES = [(64, 128), (16, 16)]


def main():
    torch.manual_seed(20240607)
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    t = {f"init.{i}": p.detach().clone() for i, p in enumerate(params)}
    opt = bnb.optim.AdamW8bit(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    F = bnb.functional
    for k in range(1, STEPS + 1):
        # The f32 moments bitsandbytes quantizes at the end of step k (its CPU kernel's own ops:
        # dequantize, then m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2).
        st0 = opt.state.get(params[0], {})
        if "state1" in st0:
            m_prev = F.dequantize_blockwise(st0["state1"], absmax=st0["absmax1"], code=st0["qmap1"], blocksize=256)
            v_prev = F.dequantize_blockwise(st0["state2"], absmax=st0["absmax2"], code=st0["qmap2"], blocksize=256)
        else:
            m_prev = torch.zeros(SHAPES[0])
            v_prev = torch.zeros(SHAPES[0])
        for i, p in enumerate(params):
            # rows of different scale: blocks (2 rows of 128) get different absmax
            scale = torch.logspace(-3, 0, p.shape[0]).unsqueeze(1)
            g = torch.randn(p.shape) * scale * (0.5 if k % 2 else 2.0)
            p.grad = g
            t[f"grad.{k}.{i}"] = g.clone()
        g0 = t[f"grad.{k}.0"]
        t[f"after.{k}.0.exp_avg.fp32"] = (m_prev.float().mul(0.9).add(g0, alpha=0.1)).flatten()
        t[f"after.{k}.0.exp_avg_sq.fp32"] = (v_prev.float().mul(0.999).addcmul(g0, g0, value=0.001)).flatten()
        opt.step()
        for i, p in enumerate(params):
            st = opt.state[p]
            t[f"after.{k}.{i}.param"] = p.detach().clone()
            if i == 0:
                assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() == 32
                t[f"after.{k}.0.exp_avg.codes"] = st["state1"].flatten().clone()
                t[f"after.{k}.0.exp_avg.absmax"] = st["absmax1"].clone()
                t[f"after.{k}.0.exp_avg_sq.codes"] = st["state2"].flatten().clone()
                t[f"after.{k}.0.exp_avg_sq.absmax"] = st["absmax2"].clone()
            else:
                assert st["state1"].dtype == torch.float32
                t[f"after.{k}.1.exp_avg"] = st["state1"].clone()
                t[f"after.{k}.1.exp_avg_sq"] = st["state2"].clone()
    save_file({k: v.contiguous() for k, v in sorted(t.items())}, str(OUT / "adamw8bit.safetensors"))
    doc = {"lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8, "steps": STEPS,
           "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__}}
    (OUT / "adamw8bit.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", OUT / "adamw8bit.safetensors", len(t), "tensors")


if __name__ == "__main__":
    main()
