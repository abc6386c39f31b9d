"""Torch-level steps the fixture scripts share (dev-only): imported after torch is set up, by
scripts run as `python scripts/X.py` (scripts/ on sys.path), under transformers 4.57 or 5.x.
"""

import sys

import torch
from safetensors.torch import load_file, save_file


def warn_unpinned(versions, pinned, note=""):
    """A warning on stderr for every package whose version is not the pinned one."""
    for k, v in pinned.items():
        if not versions[k].startswith(v):
            print(f"WARNING: {k} {versions[k]} != pinned {v}{note}", file=sys.stderr)


def deterministic():
    """Single-threaded CPU torch with deterministic algorithms (every fixture is reproducible)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def save_tensors(tensors, path):
    """A safetensors file with the tensors in key order, as every reference file is written."""
    save_file(dict(sorted(tensors.items())), str(path), metadata={"format": "pt"})


def adapter_trainables(model, adapter_dir, key_to_param):
    """The trainable parameters of a PEFT model loaded from adapter_dir, by name; the file key of
    each (key_to_param maps an adapter_model.safetensors key to its parameter name); the file's
    tensors. Asserts that the file and the trainable parameters are the same set."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key_of = {key_to_param(k): k for k in sd}
    assert set(key_of) == set(trainable), set(key_of) ^ set(trainable)
    return trainable, key_of, sd


def sgd_step(trainable, key_of, loss_fn, lr):
    """One torch.optim.SGD(lr) step of `trainable` on loss_fn(): (the loss before the step, its
    tensors): "grad.<key>" (the gradient) and "after.<key>" (the parameter after the step), f32,
    under each parameter's file key key_of[name]."""
    opt = torch.optim.SGD(list(trainable.values()), lr=lr)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    tensors = {}
    for pn, p in trainable.items():
        assert p.grad is not None, pn
        tensors[f"grad.{key_of[pn]}"] = p.grad.detach().float().clone().contiguous()
    opt.step()
    for pn, p in trainable.items():
        tensors[f"after.{key_of[pn]}"] = p.detach().float().clone().contiguous()
    return loss.item(), tensors


def greedy(model, ids, **kw):
    """transformers' greedy `generate` on one prompt (a list of ids), with `kw` (max_new_tokens,
    pad_token_id, ...): the ids generated after the prompt."""
    x = torch.tensor([ids])
    with torch.no_grad():
        y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, **kw)
    return y[0, x.shape[1]:].tolist()


def stopped_at_eos(model, generated):
    """Whether the last generated id is one of the model's generation_config EOS ids."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return bool(generated) and generated[-1] in eos
