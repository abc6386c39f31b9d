#!/usr/bin/env python3
"""Generate tallow's 8-bit blockwise quantization fixtures from bitsandbytes (dev-only).

Run from the repository root:

    /work/pyref/bin/pip install bitsandbytes==0.50.2
    /work/pyref/bin/python scripts/make_quant_fixtures.py

Pinned stack (scripts/requirements-fixtures.txt): torch==2.8.0, bitsandbytes==0.50.2,
safetensors==0.8.0, numpy==2.4.6. Runs on the CPU, deterministic (fixed seed).

Writes tests/fixtures/reference/quant-dynamic.safetensors (about 50 KB):

    map.signed, map.unsigned          f32 (256,)  bitsandbytes.functional.create_dynamic_map(signed)
    {case}.x                          the input (f32, or bf16 for case `bf16`)
    {case}.codes, {case}.absmax       u8 (n,), f32 (ceil(n/256),): quantize_blockwise with the
                                      reference ("default", pure torch) backend of bitsandbytes
    {case}.codes_cpu_native           u8 (n,): the same call through bitsandbytes' native CPU
                                      kernel (csrc/cpu_ops.cpp), which is not exactly nearest

and the metadata key `cases` (comma-separated `name:signed|unsigned`). The Rust side is
tests/tests/quant_dynamic.rs.
"""

import os

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
from safetensors.torch import save_file

OUT = os.path.join("tests", "fixtures", "reference", "quant-dynamic.safetensors")
BLOCK = 256

torch.manual_seed(0)
torch.set_num_threads(1)

op = torch.ops.bitsandbytes.quantize_blockwise.default
# The "default" kernel is registered for CompositeExplicitAutograd; redispatching there skips the
# native CPU kernel that plain calls on CPU tensors get.
REFERENCE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def nasty(n):
    """Normal values over several decades, with zeros, tiny and huge values and a zero block."""
    x = torch.randn(n) * torch.pow(10.0, torch.randint(-6, 2, (n,)).float())
    x[torch.rand(n) < 0.05] = 0.0
    x[3] = 1e-30
    x[n // 3] = -3e30
    x[BLOCK : 2 * BLOCK] = 0.0  # a whole block of zeros
    return x


cases = {
    # name: (input, signed)
    "signed": (nasty(2000), True),  # 7 full blocks + 208
    "unsigned": (nasty(1800).abs(), False),  # 7 blocks + 8
    "adam_m": (torch.randn(1024) * 1e-3, True),  # a multiple of 256
    "bf16": (nasty(700).to(torch.bfloat16), True),  # bf16 input, 2 blocks + 188
}

tensors = {
    "map.signed": F.create_dynamic_map(signed=True),
    "map.unsigned": F.create_dynamic_map(signed=False),
}
for name, (x, signed) in cases.items():
    code = F.create_dynamic_map(signed=signed)
    # bitsandbytes' default kernel casts to f32 itself (A.float()).
    codes, absmax = op.redispatch(REFERENCE, x, code.clone(), BLOCK)
    native, native_absmax = op(x, code.clone(), BLOCK)
    assert torch.equal(absmax, native_absmax)
    tensors[f"{name}.x"] = x.contiguous()
    tensors[f"{name}.codes"] = codes
    tensors[f"{name}.absmax"] = absmax
    tensors[f"{name}.codes_cpu_native"] = native
    print(
        f"{name}: n={x.numel()} codes differing native vs reference: "
        f"{(codes != native).sum().item()}"
    )

meta = {
    "cases": ",".join(f"{n}:{'signed' if s else 'unsigned'}" for n, (_, s) in cases.items()),
    "bitsandbytes": bnb.__version__,
    "torch": torch.__version__,
    "block": str(BLOCK),
}
save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
print("wrote", OUT, os.path.getsize(OUT), "bytes")
