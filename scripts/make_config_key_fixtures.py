#!/usr/bin/env python3
"""The full key set of each family's transformers config class, for the config-key test (dev-only).

Run once per transformers major version (each adds its own entry, the others are kept):

    /work/pyref/bin/python  scripts/make_config_key_fixtures.py   # transformers 4.57.1
    /work/pyref5/bin/python scripts/make_config_key_fixtures.py   # transformers 5.x

Writes tests/fixtures/reference/config-keys.json:

    {"<transformers version>": {"<HF class>": {"model_type": ..., "keys": {key: default value}}}}

where the keys are `ConfigClass().to_dict()` (every attribute a config of that class carries,
generic PretrainedConfig ones included) merged with the keys `save_pretrained` writes for a small
instance with rope scaling (`config.json` as transformers writes it). Values that are not JSON
become their repr.

Each class also gets `"reads"`: every name that transformers itself reads from a config of that
class, which a `config.json` key of that name would set. It is the union of
- the parameters of the config class's `__init__` (and PretrainedConfig's);
- the names its `__init__` / `__post_init__` and the rotary conversion pop from the keyword
  arguments (`kwargs.pop("rope_theta")`, found in the source with `ast`);
- every attribute read from the config object (its `__getattribute__` traced) while
  transformers builds `<Class>ForCausalLM`, runs a forward with padding and labels, the
  backward, and a greedy `generate` of 3 tokens, in eager and sdpa attention. Attribute
  reads by `getattr(config, "name", default)` are caught too (`head_dim` in Qwen2's
  attention, `partial_rotary_factor` in the rotary init, `is_causal` in the masks), names
  defined on the class as methods are left out.
tallow's rule (docs/models.md, `tallow_model::config::hf_keys`): a key in `reads` must be read by
tallow, known not to change the output, or refused; any other key is ignored, as transformers
ignores it. tests/tests/config_json.rs checks that for every class and version.
"""

import ast
import inspect
import os

import json
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "reference" / "config-keys.json"
SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def jsonable(v):
    try:
        json.dumps(v)
        return v
    except TypeError:
        return repr(v)


def keys_of(cls):
    full = {k: jsonable(v) for k, v in cls().to_dict().items()}
    major = int(transformers.__version__.split(".")[0])
    rope = {"rope_type": "linear", "factor": 2.0}
    if cls is Phi3Config:  # Phi3Config takes longrope only (one factor per rotary pair)
        rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    kw = dict(SMALL)
    if major >= 5 and cls is Gemma3TextConfig:  # one object per layer type
        kw["rope_parameters"] = {
            "full_attention": dict(rope, rope_theta=1e6),
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    elif major >= 5:
        kw["rope_parameters"] = dict(rope, rope_theta=1e6)
    else:
        kw.update(rope_theta=1e6, rope_scaling=rope)
    with tempfile.TemporaryDirectory() as d:
        cls(**kw).save_pretrained(d)
        saved = json.loads((Path(d) / "config.json").read_text())
    for k, v in saved.items():
        full.setdefault(k, jsonable(v))
    return {"model_type": cls.model_type, "keys": dict(sorted(full.items())), "reads": reads_of(cls)}


MODELS = {
    LlamaConfig: LlamaForCausalLM,
    MistralConfig: MistralForCausalLM,
    Qwen2Config: Qwen2ForCausalLM,
    Qwen3Config: Qwen3ForCausalLM,
    Gemma2Config: Gemma2ForCausalLM,
    Phi3Config: Phi3ForCausalLM,
    Gemma3TextConfig: Gemma3ForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
    MixtralConfig: MixtralForCausalLM,
    Qwen2MoeConfig: Qwen2MoeForCausalLM,
}

# The functions that turn `config.json`'s keys into the config object's attributes.
INIT_FUNCTIONS = {"__init__", "__post_init__", "convert_rope_params_to_dict", "standardize_rope_params"}


def popped_kwargs(cls):
    """Names the config's init functions take out of **kwargs (`kwargs.pop("rope_theta")`)."""
    root = Path(transformers.__file__).parent
    files = {root / "configuration_utils.py", root / "modeling_rope_utils.py", Path(inspect.getfile(cls))}
    names = set()
    for f in files:
        for fn in ast.walk(ast.parse(f.read_text())):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in INIT_FUNCTIONS):
                continue
            for n in ast.walk(fn):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                        and n.func.attr in ("pop", "get", "setdefault")
                        and isinstance(n.func.value, ast.Name) and n.func.value.id == "kwargs"
                        and n.args and isinstance(n.args[0], ast.Constant)):
                    names.add(n.args[0].value)
    return names


def traced_reads(cls):
    """Attribute names read from a config of `cls` while its model is built, trained one step and
    generates (the class's `__getattribute__` replaced for the run)."""
    reads = set()
    inherited = cls.__getattribute__

    def logging_getattribute(self, name):
        reads.add(name)
        return inherited(self, name)

    cls.__getattribute__ = logging_getattribute
    try:
        for impl in ("eager", "sdpa"):
            torch.manual_seed(0)
            kw = dict(SMALL, pad_token_id=0)
            if cls is MistralConfig:
                kw["sliding_window"] = 4  # shorter than the rows: the window's mask path
            cfg = cls(**kw)
            cfg._attn_implementation = impl
            try:
                model = MODELS[cls](cfg)
            except ValueError:  # Gemma 2 in transformers 5 has no sdpa
                continue
            ids = torch.randint(1, SMALL["vocab_size"], (2, 12))
            mask = torch.ones_like(ids)
            mask[1, :3] = 0
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
            model.eval()
            with torch.no_grad():
                model.generate(ids[:1, :5], attention_mask=mask[:1, :5], max_new_tokens=3, do_sample=False)
    finally:
        del cls.__getattribute__
    return {n for n in reads if not n.startswith("__") and not callable(getattr(cls, n, None))}


def reads_of(cls):
    params = set()
    for c in (cls, transformers.PretrainedConfig):
        params |= {p for p in inspect.signature(c.__init__).parameters if p not in ("self", "kwargs")}
    return sorted(params | popped_kwargs(cls) | traced_reads(cls))


CLASSES = tuple(MODELS)


def main():
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    doc[transformers.__version__] = {
        # Gemma3TextConfig is Gemma3ForCausalLM's
        cls.__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM"): keys_of(cls)
        for cls in CLASSES
    }
    OUT.write_text(json.dumps(dict(sorted(doc.items())), indent=1, sort_keys=True) + "\n")
    for v, classes in doc.items():
        print(v, {c: len(x["keys"]) for c, x in classes.items()})


if __name__ == "__main__":
    main()
