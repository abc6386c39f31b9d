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
"""

import json
import tempfile
from pathlib import Path

import transformers
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
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
    return {"model_type": cls.model_type, "keys": dict(sorted(full.items()))}


CLASSES = (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma2Config, Phi3Config, Gemma3TextConfig)


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
