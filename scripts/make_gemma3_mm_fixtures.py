#!/usr/bin/env python3
"""An image-text Gemma 3 checkpoint whose text tower is tiny-gemma3, for tallow's text-tower
loading (dev-only).

Run (from the repository root, after scripts/make_fixtures.py has made tiny-gemma3):

    /work/pyref/bin/python scripts/make_gemma3_mm_fixtures.py          # transformers 4.57.1
    /work/pyref5/bin/python scripts/make_gemma3_mm_fixtures.py --v5    # transformers 5.x

Writes (4.57):

    tests/fixtures/models/tiny-gemma3-mm/        Gemma3ForConditionalGeneration (config.json:
                                                 `text_config` = tiny-gemma3's, a tiny SigLIP
                                                 `vision_config`), saved by transformers 4.57,
                                                 which writes the names of the checkpoints on the
                                                 Hub (google/gemma-3-4b-it):
                                                 `language_model.model.*`, `vision_tower.*`,
                                                 `multi_modal_projector.*` (lm_head tied); the
                                                 language model's weights are tiny-gemma3's
    tests/fixtures/adapters/tiny-gemma3-mm-peft/ a PEFT LoRA adapter (r 4, alpha 8, random A and B)
                                                 on the language model's seven linears of
                                                 tiny-gemma3-mm, `target_modules` the regex tallow
                                                 writes for a text tower
    tests/fixtures/reference/tiny-gemma3-mm.json per format of reference/tiny-gemma3.json: the
                                                 image-text model's text loss (asserted equal to
                                                 Gemma3ForCausalLM's, within 1e-6, and its logits
                                                 within 1e-5) and the PEFT adapter's loss

and with --v5: tests/fixtures/v5/models/tiny-gemma3-mm/ (the 4.57 model loaded and saved by
transformers 5: `text_config` with `rope_parameters` per layer type; its weights renamed to the
module names, `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
as a state dict of the 4.5x+ class is written by tools that skip transformers' save-time
renaming; transformers 5 loads it to the same losses) and
tests/fixtures/v5/reference/tiny-gemma3-mm.json (its text loss; the adapter's loss under PEFT
0.21). Losses as make_fixtures.py computes them (rows alone, f32, eager, NLL sums in float64).
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixturelib as fl  # noqa: E402
import make_fixtures as mf  # noqa: E402

FIX = mf.FIX
TEXT = "tiny-gemma3"
NAME = "tiny-gemma3-mm"
# tallow's `peft::text_tower_targets` for the seven linears, sorted
TARGETS = r".*\.language_model\..*\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)"
SIDE = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def losses(forward, ref):
    """Per format: loss over the reference rows, `forward(ids)` giving (T, V) f32 logits."""
    out = {}
    with torch.no_grad():
        for fmt, f in ref["formats"].items():
            nll = 0.0
            for r in f["rows"]:
                logits = forward(r["ids"])
                lp = torch.log_softmax(logits.double(), dim=-1)
                pos = [i for i, t in enumerate(r["targets"]) if t and i >= 1]
                nll += -lp[[i - 1 for i in pos], [r["ids"][i] for i in pos]].sum().item()
            out[fmt] = {"loss": nll / sum(f["n_targets"])}
    return out


def logits_of(model):
    return lambda ids: model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def load_mm(d: Path):
    m = Gemma3ForConditionalGeneration.from_pretrained(str(d), attn_implementation="eager", dtype=torch.float32)
    m.eval()
    return m


def build():
    text_dir = FIX / "models" / TEXT
    ref = json.loads((FIX / "reference" / f"{TEXT}.json").read_text())
    causal = mf.load_model(text_dir)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text_cfg.pop(k, None)
    vocab = text_cfg["vocab_size"]
    cfg = Gemma3Config(
        text_config=text_cfg,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=1,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
        dtype="float32",
    )
    torch.manual_seed(mf.SEED)
    mm = Gemma3ForConditionalGeneration(cfg)
    # the language model's weights are tiny-gemma3's
    sd = causal.model.state_dict()
    missing, unexpected = mm.model.language_model.load_state_dict(sd, strict=True)
    assert not missing and not unexpected
    mm.eval()
    out = FIX / "models" / NAME
    shutil.rmtree(out, ignore_errors=True)
    mm.save_pretrained(str(out), safe_serialization=True)
    for f in SIDE:
        shutil.copy(text_dir / f, out / f)
    keys = set(load_file(str(out / "model.safetensors")))
    assert "language_model.model.layers.0.self_attn.q_norm.weight" in keys, sorted(keys)[:5]
    assert any(k.startswith("vision_tower.") for k in keys)
    assert "language_model.lm_head.weight" not in keys  # tied

    # it loads in transformers to the text model's logits
    doc = {"versions": mf.VERSIONS, "model": NAME, "formats": {}}
    want = losses(logits_of(causal), ref)
    for d in (out,):
        m = load_mm(d)
        got = losses(logits_of(m), ref)
        for fmt in want:
            assert abs(got[fmt]["loss"] - want[fmt]["loss"]) < 1e-6, (d, fmt, got, want)
            assert abs(got[fmt]["loss"] - ref["formats"][fmt]["loss"]) < 1e-6
        ids = ref["formats"]["text"]["rows"][2]["ids"]
        diff = (logits_of(m)(ids) - logits_of(causal)(ids)).abs().max().item()
        assert diff < 1e-5, (d, diff)
    doc["formats"] = got

    # a PEFT adapter on the language model only
    m = load_mm(out)
    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", target_modules=TARGETS,
                      task_type="CAUSAL_LM")
    pm = get_peft_model(m, lcfg)
    names = [n for n, _ in pm.named_parameters() if "lora_" in n]
    assert names and all(".language_model." in n for n in names), names
    assert len(names) == 2 * 7 * text_cfg["num_hidden_layers"], len(names)
    g = torch.Generator().manual_seed(mf.SEED + 7)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    adir = FIX / "adapters" / f"{NAME}-peft"
    shutil.rmtree(adir, ignore_errors=True)
    pm.save_pretrained(str(adir))
    (adir / "README.md").unlink(missing_ok=True)
    ac = json.loads((adir / "adapter_config.json").read_text())
    assert ac["target_modules"] == TARGETS, ac["target_modules"]
    ac["base_model_name_or_path"] = NAME
    mf.write_json(adir / "adapter_config.json", ac)
    pm.eval()
    doc["peft"] = losses(logits_of(pm), ref)
    reloaded = PeftModel.from_pretrained(load_mm(out), str(adir))
    reloaded.eval()
    again = losses(logits_of(reloaded), ref)
    for fmt in again:
        assert abs(again[fmt]["loss"] - doc["peft"][fmt]["loss"]) < 1e-9
    mf.write_json(FIX / "reference" / f"{NAME}.json", doc)
    print(NAME, {f: round(v["loss"], 6) for f, v in doc["formats"].items()},
          "peft", {f: round(v["loss"], 6) for f, v in doc["peft"].items()})


def build_v5():
    ref = json.loads((FIX / "reference" / f"{TEXT}.json").read_text())
    out = FIX / "v5" / "models" / NAME
    shutil.rmtree(out, ignore_errors=True)
    m = load_mm(FIX / "models" / NAME)
    m.save_pretrained(str(out))
    for f in SIDE:
        shutil.copy(FIX / "models" / NAME / f, out / f)
    c = json.loads((out / "config.json").read_text())
    assert "rope_parameters" in c["text_config"], c["text_config"]
    # the module names (transformers saves the Hub's older names, as 4.57 does)
    renames = [("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
               ("multi_modal_projector.", "model.multi_modal_projector.")]
    t = load_file(str(out / "model.safetensors"))
    new = {next(n + k[len(p):] for p, n in renames if k.startswith(p)): v for k, v in t.items()}
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in new
    m = load_mm(out)
    doc = {"versions": mf.VERSIONS | {"transformers": transformers.__version__}, "model": NAME,
           "formats": losses(logits_of(m), ref)}
    pm = PeftModel.from_pretrained(m, str(FIX / "adapters" / f"{NAME}-peft"))
    pm.eval()
    doc["peft"] = losses(logits_of(pm), ref)
    mf.write_json(FIX / "v5" / "reference" / f"{NAME}.json", doc)
    print("v5", NAME, doc["formats"], doc["peft"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--v5", action="store_true")
    a = ap.parse_args()
    fl.deterministic()
    transformers.logging.set_verbosity_error()
    build_v5() if a.v5 else build()


if __name__ == "__main__":
    main()
