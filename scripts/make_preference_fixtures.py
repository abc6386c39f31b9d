#!/usr/bin/env python3
"""Reference fixtures for tallow's preference tuning (DPO sigmoid / IPO, ORPO), dev-only.

Run from the repository root (after scripts/make_fixtures.py and make_peft_fixtures.py):

    /work/pyref/bin/python scripts/make_preference_fixtures.py

Pinned stack (scripts/requirements-fixtures.txt): torch==2.8.0 transformers==4.57.1
tokenizers==0.22.2 peft==0.17.1 safetensors==0.8.0. TRL is not imported: its definitions
(TRL 0.23.0, `DPOTrainer.tokenize_row`, `maybe_apply_chat_template`, `concatenated_forward`,
`dpo_loss`; `ORPOTrainer.odds_ratio_loss` and its chosen NLL) are written out below.

Writes (and only these):

    tests/fixtures/data/preference.jsonl            4 pairs, prompt / chosen / rejected strings
    tests/fixtures/data/preference_messages.jsonl   4 pairs in TRL's conversational form
    tests/fixtures/reference/preference.json        per case: the loss and TRL's metrics
    tests/fixtures/reference/preference.safetensors per case: "<case>.after.<key>", the adapter
                                                    after one step

Cases: for M in tiny-llama, tiny-qwen2, tiny-qwen3, from the non-zero PEFT adapter
tests/fixtures/adapters/<M>-peft (r 4, alpha 8, every linear): one torch.optim.SGD(lr=0.5)
step on all 4 pairs as one batch (chosen rows, then rejected rows, right-padded), no clipping,
f32, eager attention, for

    dpo-sigmoid      beta 0.1                       (string and messages data)
    dpo-sigmoid-ls   beta 0.2, label_smoothing 0.1  (string data)
    dpo-ipo          beta 0.1, loss ipo             (string data)
    orpo             lambda 0.1                     (string and messages data)

Full-weight cases (preference.full): tiny-llama, string data, every parameter trainable (no
adapter), the same SGD step for "dpo-sigmoid" (beta 0.1; the reference log-probs computed from
the model before the step, as a precomputed reference) and "orpo" (lambda 0.1); key
"tiny-llama/<case>-full/string", tensors "<key>.after.<name>" for FULL_TENSORS only.

Tokenization (TRL's DPO, used for ORPO too): prompt and completion tokenized apart with
add_special_tokens=False, EOS appended to each completion; conversational rows rendered with
the chat template (the prompt with the generation prompt, each completion as the text after the
longest common prefix of prompt and prompt + chosen). Log-probs: sum of the completion tokens'
log-softmax (f32); IPO and ORPO divide by the completion length. DPO's reference: the same
model under PeftModel.disable_adapter(), no grad. ORPO's NLL: cross-entropy over the chosen
rows' every non-padding token after the first (prompt included, as TRL's ORPO computes it),
mean over those tokens.
"""

import json
import math
import sys
from itertools import takewhile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_env import pin_hash_seed_and_go_offline  # noqa: E402

if __name__ == "__main__":
    pin_hash_seed_and_go_offline(__file__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peft import PeftModel  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import fixturelib as fl  # noqa: E402
import make_fixtures as mf  # noqa: E402
import make_peft_fixtures as mp  # noqa: E402

FIX = mf.FIX
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
LR = 0.5

STRING_ROWS = [
    {"prompt": "The sky is", "chosen": " blue today.", "rejected": " green and odd."},
    {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, or maybe six."},
    {"prompt": "Water boils at", "chosen": " a hundred degrees.", "rejected": " thirty."},
    {"prompt": "Cats like", "chosen": " fish and naps.", "rejected": " taxes."},
]
MESSAGE_ROWS = [
    {
        "prompt": [{"role": "user", "content": "What colour is the sky?"}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green, I think."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Two plus two?"},
        ],
        "chosen": [{"role": "assistant", "content": "Four."}],
        "rejected": [{"role": "assistant", "content": "Five."}],
    },
    {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a fruit."},
        ],
        "chosen": [{"role": "assistant", "content": "An apple."}],
        "rejected": [{"role": "assistant", "content": "A chair."}],
    },
    {
        "prompt": [{"role": "user", "content": "Where do fish live?"}],
        "chosen": [{"role": "assistant", "content": "In water."}],
        "rejected": [{"role": "assistant", "content": "In trees."}],
    },
]
DATA = {"string": ("preference.jsonl", STRING_ROWS), "messages": ("preference_messages.jsonl", MESSAGE_ROWS)}
CASES = [
    ("dpo-sigmoid", dict(kind="dpo", beta=0.1, loss="sigmoid", ls=0.0), ["string", "messages"]),
    ("dpo-sigmoid-ls", dict(kind="dpo", beta=0.2, loss="sigmoid", ls=0.1), ["string"]),
    ("dpo-ipo", dict(kind="dpo", beta=0.1, loss="ipo", ls=0.0), ["string"]),
    ("orpo", dict(kind="orpo", lam=0.1), ["string", "messages"]),
]


FULL_CASES = [("dpo-sigmoid", CASES[0][1]), ("orpo", CASES[3][1])]
FULL_TENSORS = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
    "model.embed_tokens.weight",
]


def trl_tokenize(tok, row):
    """TRL 0.23: maybe_apply_chat_template, then DPOTrainer.tokenize_row (no special tokens)."""
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if isinstance(prompt, list):
        p = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        pc = tok.apply_chat_template(prompt + chosen, tokenize=False)
        p = "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(p, pc)))
        pr = tok.apply_chat_template(prompt + rejected, tokenize=False)
        prompt, chosen, rejected = p, pc[len(p):], pr[len(p):]
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(prompt), enc(chosen) + [tok.eos_token_id], enc(rejected) + [tok.eos_token_id]


def batch(tok, rows):
    """Chosen rows then rejected rows, right-padded: ids, attention mask, completion mask."""
    seqs = []
    for part in (1, 2):
        for row in rows:
            t = trl_tokenize(tok, row)
            seqs.append((t[0], t[part]))
    width = max(len(p) + len(c) for p, c in seqs)
    ids, att, comp = [], [], []
    for p, c in seqs:
        n = len(p) + len(c)
        ids.append(p + c + [0] * (width - n))
        att.append([1] * n + [0] * (width - n))
        comp.append([0] * len(p) + [1] * len(c) + [0] * (width - n))
    return torch.tensor(ids), torch.tensor(att), torch.tensor(comp)


def logps(model, ids, att, comp):
    """Per-row completion log-prob sums (f32) and the logits."""
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    mask = comp[:, 1:].bool()
    return (lp * mask).sum(-1), logits


def case_loss(model, case, ids, att, comp, ref=None):
    m = ids.shape[0] // 2
    lens = comp[:, 1:].sum(-1).float()
    pol, logits = logps(model, ids, att, comp)
    metrics = {}
    if case["kind"] == "dpo":
        if ref is None:
            with model.disable_adapter(), torch.no_grad():
                ref, _ = logps(model, ids, att, comp)
        if case["loss"] == "ipo":
            pol, ref = pol / lens, ref / lens
        beta = case["beta"]
        margin = (pol[:m] - pol[m:]) - (ref[:m] - ref[m:])
        if case["loss"] == "sigmoid":
            ls = case["ls"]
            losses = -F.logsigmoid(beta * margin) * (1 - ls) - F.logsigmoid(-beta * margin) * ls
        else:
            losses = (margin - 1 / (2 * beta)) ** 2
        cr = beta * (pol[:m] - ref[:m]).detach()
        rr = beta * (pol[m:] - ref[m:]).detach()
        loss = losses.mean()
    else:
        lam = case["lam"]
        pol = pol / lens
        c, r = pol[:m], pol[m:]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        labels = torch.where(att == 1, ids, -100)[:m, 1:]
        nll = F.cross_entropy(logits[:m, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        loss = nll - (lam * ratio).mean()
        cr, rr = lam * c.detach(), lam * r.detach()
        metrics.update({
            "nll_loss": nll.item(),
            "log_odds_ratio": ratio.mean().item(),
            "log_odds_chosen": log_odds.mean().item(),
        })
    metrics.update({
        "rewards/chosen": cr.mean().item(),
        "rewards/rejected": rr.mean().item(),
        "rewards/accuracies": (cr > rr).float().mean().item(),
        "rewards/margins": (cr - rr).mean().item(),
        "logps/chosen": pol[:m].mean().item(),
        "logps/rejected": pol[m:].mean().item(),
    })
    return loss, metrics


def main():
    fl.deterministic()
    for name, (file, rows) in DATA.items():
        mf.write_jsonl(FIX / "data" / file, rows)
    out, tensors = {"versions": mf.VERSIONS, "lr": LR, "cases": {}}, {}
    for model_name in MODELS:
        model_dir = FIX / "models" / model_name
        adapter_dir = FIX / "adapters" / f"{model_name}-peft"
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        for case_name, case, datas in CASES:
            for data in datas:
                key = f"{model_name}/{case_name}/{data}"
                model = PeftModel.from_pretrained(mf.load_model(model_dir), str(adapter_dir), is_trainable=True)
                model.eval()
                trainable, key_of, _ = fl.adapter_trainables(model, adapter_dir, mp.file_key_to_param)
                ids, att, comp = batch(tok, DATA[data][1])
                holder = {}

                def loss_fn():
                    loss, metrics = case_loss(model, case, ids, att, comp)
                    holder["metrics"] = metrics
                    return loss

                loss, step = fl.sgd_step(trainable, key_of, loss_fn, LR)
                assert math.isfinite(loss)
                for k, v in step.items():
                    if k.startswith("after."):
                        tensors[f"{key}.{k}"] = v
                out["cases"][key] = {"case": case, "loss": loss, "metrics": holder["metrics"]}
                print(key, round(loss, 6), holder["metrics"]["rewards/accuracies"])
    # Full-weight cases.
    model_name = "tiny-llama"
    model_dir = FIX / "models" / model_name
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for case_name, case in FULL_CASES:
        key = f"{model_name}/{case_name}-full/string"
        model = mf.load_model(model_dir)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        ids, att, comp = batch(tok, STRING_ROWS)
        with torch.no_grad():
            ref, _ = logps(model, ids, att, comp)
        holder = {}

        def loss_fn():
            loss, metrics = case_loss(model, case, ids, att, comp, ref=ref)
            holder["metrics"] = metrics
            return loss

        loss, step = fl.sgd_step(trainable, {n: n for n in trainable}, loss_fn, LR)
        for name in FULL_TENSORS:
            tensors[f"{key}.after.{name}"] = step[f"after.{name}"]
        out["cases"][key] = {"case": case, "loss": loss, "metrics": holder["metrics"], "full": True}
        print(key, round(loss, 6))
    mf.write_json(FIX / "reference" / "preference.json", out)
    fl.save_tensors(tensors, FIX / "reference" / "preference.safetensors")


if __name__ == "__main__":
    main()
