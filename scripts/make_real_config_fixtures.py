#!/usr/bin/env python3
"""Tiny random models with the key sets of real checkpoints' config.json (dev-only), for
tests/tests/real_configs.rs: tallow ignores the keys transformers never reads, and this shows, on
the key sets real Hub repos publish, that ignoring them changes nothing transformers computes.

Run under transformers 4.57 first (it makes the models), then under 5.x (it adds its numbers):

    /work/pyref/bin/python  scripts/make_real_config_fixtures.py   # transformers 4.57.1
    /work/pyref5/bin/python scripts/make_real_config_fixtures.py   # transformers 5.x

For every distinct key set of tests/fixtures/real-configs/*.json (architecture and the names of
its keys; files sharing one are the same case), a tiny model under
tests/fixtures/real-configs/tiny/<first file's name>/:

- config.json: the real file with every key kept, in the file's order and with its values,
  except the sizes, which shrink (vocab 128, hidden 32, intermediate 64, 4 heads with the file's
  kind of key/value grouping, head_dim 8 where the file sets one, 2 layers (Gemma 3: 6, so one
  is global)), the shapes that follow them (LongRoPE's factor lists cut to the rotary pairs;
  its original context 16, and max_position_embeddings 16 times the file's ratio, so rows
  longer than 16 take the long factors with the file's attention factor; `layer_types` cut to
  the layers), a numeric `sliding_window` of 8 (shorter than the rows), and token ids past the
  vocabulary taken modulo 128. Gemma 3 image-text files get a tiny vision tower (the real
  vision keys, sizes shrunk).
- model.safetensors: random weights (N(0, 0.1); norms 1 + N(0, 0.1)), bf16, saved by
  transformers 4.57 for its class.
- reference.json / reference.safetensors: the rows (2 x 24 token ids), and per transformers
  version the f32 loss (labels = ids) and logits of the class loaded from this dir with eager
  attention (`<version>.logits`).
- config-v5.json: the config as transformers 5 saves it again (its layout: `rope_parameters`,
  `dtype`), which tallow must read to the same numbers.

Files whose `quantization_config` tallow refuses (GPTQ, FP8) and the bitsandbytes 4-bit one
(its weights need bitsandbytes; tiny-qwen2-bnb-4bit covers that path) are left out.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixturelib import deterministic, save_tensors  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fixtures" / "real-configs"
OUT = CORPUS / "tiny"
MAJOR = int(transformers.__version__.split(".")[0])
VOCAB, HIDDEN, INTER, HEADS, HEAD_DIM = 128, 32, 64, 4, 8
ROWS, T = 2, 24
SEED = 0


def kept(d):
    qc = d.get("quantization_config")
    return qc is None


def key_set(d):
    ks = tuple(sorted(d))
    if isinstance(d.get("text_config"), dict):
        ks += tuple("text_config." + k for k in sorted(d["text_config"]))
    return (d["architectures"][0], ks)


def groups():
    seen = {}
    for f in sorted(CORPUS.glob("*.json")):
        d = json.loads(f.read_text())
        if not kept(d):
            continue
        seen.setdefault(key_set(d), f)
    return sorted(seen.values())


def small_id(v):
    if isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
        return v % VOCAB
    if isinstance(v, list):
        return [small_id(x) for x in v]
    return v


def shrink_text(c, gemma3):
    """The text model's keys with the sizes shrunk (see the module doc)."""
    c = dict(c)
    heads0 = c.get("num_attention_heads")
    kv0 = c.get("num_key_value_heads")
    layers = 6 if gemma3 else 2
    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                 num_hidden_layers=layers, num_attention_heads=HEADS)
    if kv0 is None and heads0 is None and gemma3:
        kv = 2  # Gemma3TextConfig's default grouping (8 heads, 4 kv heads)
    elif kv0 is None or kv0 == heads0:
        kv = HEADS
    elif kv0 == 1:
        kv = 1
    else:
        kv = 2
    sizes["num_key_value_heads"] = kv
    for k, v in sizes.items():
        c[k] = v
    if "head_dim" in c or gemma3 or c.get("model_type") == "gemma2":
        c["head_dim"] = HEAD_DIM
    if isinstance(c.get("layer_types"), list):
        c["layer_types"] = c["layer_types"][:layers]
    if isinstance(c.get("sliding_window"), int):
        c["sliding_window"] = 8
    rs = c.get("rope_scaling")
    if isinstance(rs, dict) and rs.get("type", rs.get("rope_type")) in ("longrope", "su"):
        partial = c.get("partial_rotary_factor", 1.0)
        pairs = int(HEAD_DIM * partial) // 2
        rs = dict(rs)
        for k in ("short_factor", "long_factor"):
            rs[k] = rs[k][:pairs]
        c["rope_scaling"] = rs
        orig = c.get("original_max_position_embeddings", 4096)
        ratio = c.get("max_position_embeddings", orig) / orig
        c["original_max_position_embeddings"] = 16
        c["max_position_embeddings"] = int(16 * ratio)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in c:
            c[k] = small_id(c[k])
    return c


def shrink(d):
    arch = d["architectures"][0]
    if arch == "Gemma3ForConditionalGeneration":
        d = dict(d)
        d["text_config"] = shrink_text(d.get("text_config") or {}, True)
        v = dict(d.get("vision_config") or {})
        v.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, image_size=28, patch_size=14)
        d["vision_config"] = v
        d["mm_tokens_per_image"] = 1
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in d:
                d[k] = small_id(d[k])
        return d
    return shrink_text(d, arch == "Gemma3ForCausalLM")


def model_class(arch):
    return getattr(transformers, arch)


def load(dir_, arch):
    kw = {"attn_implementation": "eager"}
    kw["dtype" if MAJOR >= 5 else "torch_dtype"] = torch.float32
    model, info = model_class(arch).from_pretrained(str(dir_), output_loading_info=True, **kw)
    missing = [k for k in info["missing_keys"]]
    assert not missing and not info["unexpected_keys"], (dir_, info)
    model.eval()
    return model


def randomize(model):
    """N(0, 0.1) everywhere; RMSNorm weights around 1 (Gemma's `1 + w`: w around 0)."""
    gemma = "gemma" in type(model).__name__.lower()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            norm = name.endswith("norm.weight") and p.dim() == 1
            p.copy_(noise + (1.0 if norm and not gemma else 0.0))


def make(src):
    d = json.loads(src.read_text())
    arch = d["architectures"][0]
    tiny = shrink(d)
    out = OUT / src.stem
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    text = json.dumps(tiny, indent=2) + "\n"
    (out / "config.json").write_text(text)
    config_cls = model_class(arch).config_class
    cfg = config_cls.from_pretrained(str(out))
    torch.manual_seed(SEED)
    model = model_class(arch)(cfg)
    randomize(model)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    (out / "config.json").write_text(text)  # the real key set, not transformers' re-save
    (out / "generation_config.json").unlink(missing_ok=True)
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB - 8, (ROWS, T), generator=g)  # clear of image token ids
    ref = {"source": src.name, "ids": ids.tolist(), "versions": {}}
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    return out


def measure(out):
    ref = json.loads((out / "reference.json").read_text())
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    model = load(out, arch)
    ids = torch.tensor(ref["ids"])
    with torch.no_grad():
        res = model(input_ids=ids, labels=ids, use_cache=False)
    v = transformers.__version__
    ref["versions"][v] = {"loss": res.loss.item()}
    (out / "reference.json").write_text(json.dumps(ref, indent=1, sort_keys=True) + "\n")
    path = out / "reference.safetensors"
    tensors = load_file(str(path)) if path.exists() else {}
    tensors[f"{v}.logits"] = res.logits.float().contiguous()
    save_tensors(tensors, path)
    if MAJOR >= 5:
        with tempfile.TemporaryDirectory() as tmp:
            model.config.save_pretrained(tmp)
            shutil.copy(Path(tmp) / "config.json", out / "config-v5.json")
    return res.loss.item()


def main():
    deterministic()
    os.environ["HF_HUB_OFFLINE"] = "1"
    srcs = groups()
    if MAJOR < 5:
        shutil.rmtree(OUT, ignore_errors=True)
        for src in srcs:
            make(src)
    for src in srcs:
        loss = measure(OUT / src.stem)
        print(f"{transformers.__version__} {src.stem}: loss {loss:.6f}")


if __name__ == "__main__":
    main()
