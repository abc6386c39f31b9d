#!/usr/bin/env python3
"""Generate tallow's NF4 (QLoRA) reference fixtures from bitsandbytes (dev-only).

Run (from the repository root, after scripts/make_fixtures.py):

    /work/pyref/bin/python scripts/make_nf4_fixtures.py

Pinned reference stack: scripts/requirements-fixtures.txt (bitsandbytes==0.50.2; its CPU
backend runs `quantize_4bit` / `dequantize_4bit` / `quantize_blockwise` without a GPU).

Writes (deleting what was there):

    tests/fixtures/nf4/blocks.safetensors
        For each case k (see CASES), from bitsandbytes.functional.quantize_4bit(blocksize=64,
        quant_type="nf4") on the CPU:
          {k}.input          the weight, in its own dtype (f32 or bf16)
          {k}.packed         u8 (n/2,): two 4-bit codes per byte, first element in the high nibble
          {k}.absmax         f32 (n/64,): compress_statistics=False
          {k}.dequant        f32 (out, in): dequantize_4bit of that (not for "tall": size;
                             every case has in_features a multiple of 64, where bitsandbytes'
                             CPU dequantize_4bit is right, see bnb_model)
          {k}.dq.absmax      u8 (n/64,): compress_statistics=True, the absmax codes
          {k}.dq.nested_absmax f32 (ceil(n/64/256),): absmax of the nested 256-blocks
          {k}.dq.offset      f32 (1,): the mean subtracted before nested quantization
          {k}.dq.dequant     f32 (out, in): dequantize_4bit of the double-quantized state
    tests/fixtures/models/tiny-qwen2-bnb-4bit/
        tiny-qwen2 loaded by transformers with BitsAndBytesConfig(load_in_4bit, nf4, double quant,
        compute dtype f32) on the CPU and saved with save_pretrained: the exact key layout of
        `*-bnb-4bit` hub repos (packed `weight` (n/2, 1) u8, `weight.absmax`, `weight.quant_map`,
        `weight.nested_absmax`, `weight.nested_quant_map`,
        `weight.quant_state.bitsandbytes__nf4`), tokenizer files copied from tiny-qwen2.
    tests/fixtures/reference/tiny-qwen2-bnb-4bit.json
        loss of that quantized model (transformers, each 4-bit linear as bitsandbytes' default
        backend dequantization + F.linear, CPU, f32 compute; see bnb_model for why) on the
        "text" rows of reference/tiny-qwen2.json, computed as make_fixtures.py computes losses.
"""

import json
import shutil
import sys
from pathlib import Path

import bitsandbytes
import bitsandbytes.functional as F
import torch
import transformers
from safetensors.torch import save_file
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
SEED = 20240611

# (name, (out, in), dtype). "rows5": 40 blocks, one partial nested block; "tall": 320 blocks, so
# the nested blocks are 256 + a partial 64 (total not a multiple of 256); "bf16": bf16 input;
# "spiky": a few large outliers and an all-zero block.
CASES = [
    ("rows5", (8, 320), torch.float32),
    ("tall", (320, 64), torch.bfloat16),
    ("bf16", (48, 128), torch.bfloat16),
    ("spiky", (16, 192), torch.float32),
]


def make_input(name, shape, dtype, gen):
    w = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.05
    if name == "spiky":
        w[3, 7] = 1.5
        w[9, 100] = -2.25
        w[0, :64] = 0.0  # a block whose absmax is 0
    return w.to(dtype)


def blocks():
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name, shape, dtype in CASES:
        w = make_input(name, shape, dtype, gen)
        out[f"{name}.input"] = w
        q, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        out[f"{name}.packed"] = q.reshape(-1).contiguous()
        out[f"{name}.absmax"] = st.absmax.float().contiguous()
        if name != "tall":  # (size: the other cases cover dequantization)
            out[f"{name}.dequant"] = F.dequantize_4bit(q, st).float().contiguous()
        q2, st2 = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        assert torch.equal(q, q2), "double quant does not change the 4-bit codes"
        assert st2.state2.blocksize == 256
        out[f"{name}.dq.absmax"] = st2.absmax.contiguous()
        out[f"{name}.dq.nested_absmax"] = st2.state2.absmax.float().contiguous()
        out[f"{name}.dq.offset"] = st2.offset.float().reshape(1).contiguous()
        if name != "tall":
            out[f"{name}.dq.dequant"] = F.dequantize_4bit(q2, st2).float().contiguous()
    dest = FIX / "nf4"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    meta = {
        "bitsandbytes": bitsandbytes.__version__,
        "torch": torch.__version__,
        "seed": str(SEED),
    }
    save_file(out, str(dest / "blocks.safetensors"), metadata=meta)


def dequantize_flat(packed, qs):
    """bitsandbytes' default-backend dequantize_4bit (flat blocks), nested absmax included."""
    absmax = qs.absmax
    if qs.nested:
        absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    return _dequantize_4bit_compute(
        packed.reshape(-1), absmax.float(), qs.code, qs.blocksize, qs.shape, torch.float32
    )


def bnb_model():
    src = FIX / "models" / "tiny-qwen2"
    dest = FIX / "models" / "tiny-qwen2-bnb-4bit"
    shutil.rmtree(dest, ignore_errors=True)
    cfg = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=cfg, device_map="cpu", dtype=torch.float32
    )
    model.eval()
    model.save_pretrained(dest)
    # bitsandbytes 0.50.2's CPU 4-bit kernels index the absmax per row: its Linear4bit forward
    # fails when in_features is not a multiple of the blocksize (down_proj has 160: "shape
    # '[64, 2]' is invalid") and its CPU dequantize_4bit reads the wrong absmax there. The
    # blocks are flat (row-major over the whole weight), as quantize_4bit makes them and as the
    # CUDA kernels and the default backend read them; compute each 4-bit linear as the default
    # backend's dequantization + F.linear.
    for mod in model.modules():
        if isinstance(mod, bitsandbytes.nn.Linear4bit):
            mod.forward = lambda x, m=mod: torch.nn.functional.linear(
                x, dequantize_flat(m.weight.data, m.weight.quant_state).to(x.dtype), m.bias
            )
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(src / f, dest / f)

    # Loss on the "text" rows of the tiny-qwen2 reference, each row alone (as make_fixtures.py).
    ref = json.loads((FIX / "reference" / "tiny-qwen2.json").read_text())
    nll_sum, n_targets = 0.0, 0
    with torch.no_grad():
        for row in ref["formats"]["text"]["rows"]:
            ids = torch.tensor([row["ids"]])
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits.double(), dim=-1)
            for i, t in enumerate(row["targets"]):
                if t:
                    nll_sum -= lp[i - 1, row["ids"][i]].item()
                    n_targets += 1
    out = {
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__,
        },
        "model": "tiny-qwen2-bnb-4bit",
        "format": "text",
        "max_seq_len": ref["max_seq_len"],
        "nll_sum": nll_sum,
        "n_targets": n_targets,
        "loss": nll_sum / n_targets,
        "loss_unquantized": ref["formats"]["text"]["loss"],
    }
    path = FIX / "reference" / "tiny-qwen2-bnb-4bit.json"
    path.write_text(json.dumps(out, indent=1) + "\n")


def main():
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    if not (FIX / "models" / "tiny-qwen2").exists():
        sys.exit("run scripts/make_fixtures.py first")
    blocks()
    bnb_model()


if __name__ == "__main__":
    main()
