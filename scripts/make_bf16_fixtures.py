#!/usr/bin/env python3
"""bf16 references from transformers 4.57 (dev-only): whole-model logits and the ops whose upcasts
matter (RMSNorm, attention softmax, rotary embedding, the loss), so a bf16 test can tell bf16
done right from f32 and from bf16 done naively.

Run (from the repository root, after scripts/make_fixtures.py):

    /work/pyref/bin/python scripts/make_bf16_fixtures.py

Writes tests/fixtures/reference/bf16.safetensors:

    "<M>.text.<k>.logits"   bf16 logits of text row k (the rows of reference/<M>.json) from the
                            model cast to bfloat16 (model.to(torch.bfloat16), eager attention)
    "rmsnorm.x", "rmsnorm.w", "rmsnorm.y"       LlamaRMSNorm(eps 1e-6) in bf16: x (8, 256) with
                                                rows of very different scale, w near 1
    "rmsnorm.naive"         the same normalization in bf16 ops (no upcast; torch's bf16 mean
                            still accumulates in f32, so this is the mild case)
    "softmax.scores", "softmax.mask", "softmax.probs"
                            eager attention's softmax: softmax(scores + mask, dtype=float32)
                            .to(bfloat16); scores (1, 2, 16, 16) bf16, causal mask (0 / -inf)
    "softmax.naive"         softmax in bf16 (exp, sum and divide each rounded to bf16)
    "rope.x", "rope.cos", "rope.sin", "rope.y"  apply_rotary_pos_emb in bf16 (cos / sin computed
                            in f32 and cast, as LlamaRotaryEmbedding does); "rope.naive" with
                            the tables computed in bf16
    "loss.hidden", "loss.head", "loss.labels"   (32, 64) bf16 hidden states, (325, 64) bf16 head
    "loss.nll", "loss.nll_naive"                sum of NLL: logits in bf16 upcast to f32 before
                                                log_softmax (transformers' loss), and without
                                                the upcast (f32 scalars)
    "swiglu.g", "swiglu.u", "swiglu.dh"         (16, 128) bf16 gate, up and upstream gradient
    "swiglu.y", "swiglu.dg", "swiglu.du"        LlamaMLP's act_fn(gate) * up in bf16 and its
                                                autograd gradients in bf16 (torch's silu in f32
                                                rounded once; the product's backward per factor)
"""

import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402

FIX = mf.FIX
BF = torch.bfloat16


def main():
    torch.manual_seed(20240607)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    t = {}
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2", "tiny-phi3", "tiny-gemma3"):
        ref = json.loads((FIX / "reference" / f"{name}.json").read_text())
        m = mf.load_model(FIX / "models" / name).to(BF)
        with torch.no_grad():
            for k, r in enumerate(ref["formats"]["text"]["rows"]):
                t[f"{name}.text.{k}.logits"] = m(input_ids=torch.tensor([r["ids"]]), use_cache=False).logits[0]

    g = torch.Generator().manual_seed(1)
    # RMSNorm: rows from 1e-2 to 1e2 in scale
    x = (torch.randn(8, 256, generator=g) * torch.logspace(-2, 2, 8).unsqueeze(1)).to(BF)
    w = (1 + 0.2 * torch.randn(256, generator=g)).to(BF)
    norm = LlamaRMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w.float())
    norm = norm.to(BF)
    t["rmsnorm.x"], t["rmsnorm.w"] = x, w
    with torch.no_grad():
        t["rmsnorm.y"] = norm(x)
        t["rmsnorm.naive"] = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    # attention softmax with a causal mask
    s = (3 * torch.randn(1, 2, 16, 16, generator=g)).to(BF)
    mask = torch.full((16, 16), float("-inf")).triu(1)[None, None]
    t["softmax.scores"], t["softmax.mask"] = s, mask
    t["softmax.probs"] = torch.nn.functional.softmax(s + mask.to(BF), dim=-1, dtype=torch.float32).to(BF)
    # in bf16 throughout (torch's bf16 softmax upcasts inside, so spelled out)
    z = s + mask.to(BF)
    e = (z - z.amax(-1, keepdim=True)).exp()
    t["softmax.naive"] = e / e.sum(-1, keepdim=True)

    # rotary embedding: positions 0..31, head_dim 32, theta 1e6
    inv = 1.0 / (1e6 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = torch.arange(32).float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # (1, T, D)
    cos, sin = emb.cos().to(BF), emb.sin().to(BF)
    q = torch.randn(1, 2, 32, 32, generator=g).to(BF)
    y, _ = apply_rotary_pos_emb(q, q, cos, sin)
    t["rope.x"], t["rope.cos"], t["rope.sin"], t["rope.y"] = q, cos[:, None], sin[:, None], y
    # the tables computed in bf16 (positions x frequencies rounded before cos / sin)
    emb16 = (torch.arange(32).to(BF)[:, None] * inv.to(BF)[None, :])
    emb16 = torch.cat([emb16, emb16], dim=-1)[None]
    t["rope.naive"], _ = apply_rotary_pos_emb(q, q, emb16.cos(), emb16.sin())

    # loss: logits in bf16, upcast before log_softmax (transformers' ForCausalLMLoss)
    h = torch.randn(32, 64, generator=g).to(BF)
    head = (0.5 * torch.randn(325, 64, generator=g)).to(BF)
    labels = torch.randint(0, 325, (32,), generator=g)
    logits = h @ head.T  # bf16
    t["loss.hidden"], t["loss.head"], t["loss.labels"] = h, head, labels.to(torch.int64)
    nll = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
    naive = torch.nn.functional.cross_entropy(logits, labels, reduction="sum").float()
    t["loss.nll"], t["loss.nll_naive"] = nll.reshape(()), naive.reshape(())

    # SwiGLU in bf16, forward and backward (drawn after the others: their values stay)
    gs = (2 * torch.randn(16, 128, generator=g)).to(BF).requires_grad_()
    us = torch.randn(16, 128, generator=g).to(BF).requires_grad_()
    dh = torch.randn(16, 128, generator=g).to(BF)
    ys = torch.nn.functional.silu(gs) * us
    ys.backward(dh)
    t["swiglu.g"], t["swiglu.u"], t["swiglu.dh"] = gs.detach(), us.detach(), dh
    t["swiglu.y"], t["swiglu.dg"], t["swiglu.du"] = ys.detach(), gs.grad, us.grad
    save_file({k: v.contiguous() for k, v in sorted(t.items())}, str(FIX / "reference" / "bf16.safetensors"))
    print("wrote", len(t), "tensors; loss", nll.item(), "naive", naive.item())


if __name__ == "__main__":
    main()
