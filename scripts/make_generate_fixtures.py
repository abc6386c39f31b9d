#!/usr/bin/env python3
"""Reference token ids for `tallow generate` from transformers' greedy `generate` (dev-only).

Run (from the repository root, after scripts/make_fixtures.py has made the tiny models):

    /work/pyref/bin/python scripts/make_generate_fixtures.py

Pinned stack: see scripts/requirements-fixtures.txt (torch 2.8.0, transformers 4.57.1, peft 0.17.1).

Writes tests/fixtures/reference/generate.json:

    {"versions": {...}, "max_new_tokens": 24,
     "cases": [{"name", "model", "adapter" (dir name under tests/fixtures/adapters, or null),
                "prompt", "chat" (bool), "repetition_penalty",
                "prompt_ids", "generated_ids", "stopped_at_eos"}]}

Each case: the f32 model (eager attention, + PEFT adapter when named) runs
`generate(do_sample=False, max_new_tokens=24, repetition_penalty=R)` with the model dir's
generation_config.json (its eos_token_id stops generation; the EOS id is then the last generated
id, as transformers returns it). prompt_ids: `tok(prompt)` (add_special_tokens=True) for a plain
prompt; `tok.apply_chat_template([{"role": "user", "content": prompt}],
add_generation_prompt=True)` for a chat one. generated_ids: the output after the prompt.
The script checks that generate with use_cache=False gives the same ids.

"stop_at_eos": {"case", "eos_token_id", "generated_ids"}: the llama-plain case generated again
with eos_token_id = [an id that first appears mid-way in its output]; generation stops right
after it.
"""

import json
import sys
from pathlib import Path

import peft
import torch
import transformers
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixturelib as fl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures"
MAX_NEW_TOKENS = 24

# (name, model, adapter, prompt, chat, repetition_penalty)
CASES = [
    ("llama-plain", "tiny-llama", None, "The quick brown fox", False, 1.0),
    ("llama-chat", "tiny-llama", None, "What is the capital of France?", True, 1.0),
    ("llama-adapter", "tiny-llama", "tiny-llama-peft", "The quick brown fox", False, 1.0),
    ("qwen2-plain", "tiny-qwen2", None, "Once upon a time", False, 1.0),
    ("qwen2-chat", "tiny-qwen2", None, "Tell me a story.", True, 1.0),
    ("qwen2-adapter", "tiny-qwen2", "tiny-qwen2-peft", "Once upon a time", False, 1.0),
    ("qwen2-repetition-penalty", "tiny-qwen2", None, "Once upon a time", False, 1.3),
    ("qwen3-plain", "tiny-qwen3", None, "hello world", False, 1.0),
    ("qwen3-chat", "tiny-qwen3", None, "Hi! How are you?", True, 1.0),
    ("qwen3-adapter", "tiny-qwen3", "tiny-qwen3-peft", "hello world", False, 1.0),
    # tiny-mistral's sliding_window is 8: prompt + 24 new tokens pass it, so the KV cache must
    # drop the keys that left the window (the plain prompt alone is longer than the window)
    ("mistral-plain", "tiny-mistral", None, "Once upon a time there was a small robot", False, 1.0),
    ("mistral-chat", "tiny-mistral", None, "What is the capital of France?", True, 1.0),
    ("mistral-adapter", "tiny-mistral", "tiny-mistral-peft", "The quick brown fox", False, 1.0),
    # tiny-phi3's original_max_position_embeddings is 16: prompt + 24 new tokens pass it, so the
    # cached generation is recomputed with the long factors there (as transformers does)
    ("phi3-plain", "tiny-phi3", None, "The quick brown fox", False, 1.0),
    ("phi3-chat", "tiny-phi3", None, "What is the capital of France?", True, 1.0),
    ("phi3-adapter", "tiny-phi3", "tiny-phi3-peft", "The quick brown fox", False, 1.0),
    # tiny-gemma2: sliding (window 8) and global layers, soft-capped scores and logits; the chat
    # case stops on <end_of_turn> (generation_config eos [<eos>, <end_of_turn>]) if it comes
    ("gemma2-plain", "tiny-gemma2", None, "Once upon a time there was a small robot", False, 1.0),
    ("gemma2-chat", "tiny-gemma2", None, "What is the capital of France?", True, 1.0),
    ("gemma2-adapter", "tiny-gemma2", "tiny-gemma2-peft", "The quick brown fox", False, 1.0),
    # tiny-gemma3: sliding (window 8, local rope base) and global layers (scaled rope); the
    # plain prompt alone is longer than the window
    ("gemma3-plain", "tiny-gemma3", None, "Once upon a time there was a small robot", False, 1.0),
    ("gemma3-chat", "tiny-gemma3", None, "What is the capital of France?", True, 1.0),
    ("gemma3-adapter", "tiny-gemma3", "tiny-gemma3-peft", "The quick brown fox", False, 1.0),
]


def main():
    torch.manual_seed(0)
    fl.deterministic()
    out = []
    for name, model_name, adapter, prompt, chat, rp in CASES:
        mdir = FIX / "models" / model_name
        tok = AutoTokenizer.from_pretrained(mdir)
        model = AutoModelForCausalLM.from_pretrained(
            mdir, torch_dtype=torch.float32, attn_implementation="eager"
        )
        if adapter:
            model = PeftModel.from_pretrained(model, FIX / "adapters" / adapter)
        model.eval()
        if chat:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
        else:
            ids = tok(prompt)["input_ids"]
        gen = {}
        for use_cache in (True, False):
            gen[use_cache] = fl.greedy(
                model,
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                repetition_penalty=rp,
                use_cache=use_cache,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            )
        if model_name == "tiny-phi3" and transformers.__version__.startswith("4."):
            # transformers 4.57's cached generate goes wrong once a LongRoPE sequence passes
            # original_max_position_embeddings (its Phi3 prepare_inputs_for_generation drops the
            # cache there but does not recompute the earlier positions); the uncached generate
            # (every step recomputed: the model's own maths) is the reference, and 5.x's cached
            # generate gives the same ids (v5/reference/generate.json, checked there)
            gen[True] = gen[False]
        assert gen[True] == gen[False], f"{name}: cache changes transformers' ids"
        stopped = fl.stopped_at_eos(model, gen[True])
        print(f"{name}: {len(ids)} prompt ids, {len(gen[True])} generated, eos={stopped}")
        out.append(
            {
                "name": name,
                "model": model_name,
                "adapter": adapter,
                "prompt": prompt,
                "chat": chat,
                "repetition_penalty": rp,
                "prompt_ids": ids,
                "generated_ids": gen[True],
                "stopped_at_eos": stopped,
            }
        )
    # A reference that stops at EOS: llama-plain again, with a stop id that first appears
    # mid-way in its greedy output (the first id at position >= 3 not seen before), given to
    # generate as eos_token_id; tests/generate_cli.rs writes it into generation_config.json.
    base = next(c for c in out if c["name"] == "llama-plain")
    full = base["generated_ids"]
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    stop = full[k]
    mdir = FIX / "models" / base["model"]
    model = AutoModelForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    stopped = fl.greedy(model, base["prompt_ids"], max_new_tokens=MAX_NEW_TOKENS,
                        eos_token_id=[stop], pad_token_id=0)
    assert stopped[-1] == stop and len(stopped) == k + 1, (stopped, k)
    print(f"stop at eos: id {stop}, {len(stopped)} ids")
    stop_case = {"case": "llama-plain", "eos_token_id": [stop], "generated_ids": stopped}
    doc = {
        "stop_at_eos": stop_case,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": out,
    }
    path = FIX / "reference" / "generate.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
