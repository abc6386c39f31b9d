#!/usr/bin/env python3
"""Reference fixtures for tallow's preference tuning (DPO sigmoid / IPO, ORPO), made by TRL's own
trainers (dev-only).

TRL's pins (datasets, fsspec) stay out of /work/pyref: a venv beside it sees its packages
through a .pth file and adds TRL and datasets (scripts/requirements-fixtures-trl.txt):

    python -m venv /tmp/trlvenv
    echo /work/pyref/lib/python3.11/site-packages > /tmp/trlvenv/lib/python3.11/site-packages/pyref.pth
    /tmp/trlvenv/bin/pip install -r scripts/requirements-fixtures-trl.txt
    /tmp/trlvenv/bin/python scripts/make_preference_fixtures.py

(from the repository root, after scripts/make_fixtures.py and make_peft_fixtures.py). Stack:
trl==0.23.0 datasets==4.4.1 over torch==2.8.0 transformers==4.57.1 tokenizers==0.22.2
peft==0.17.1 accelerate==1.15.0 safetensors==0.8.0; the versions are written into the JSON.

Writes (and only these):

    tests/fixtures/data/preference.jsonl            4 pairs, prompt / chosen / rejected strings
    tests/fixtures/data/preference_messages.jsonl   4 pairs in TRL's conversational form
    tests/fixtures/data/preference_rules.jsonl      4 string pairs for the tokenization rules
    tests/fixtures/reference/preference.json        per case: the loss, TRL's metrics, the rows
    tests/fixtures/reference/preference.safetensors per case: "<case>.after.<key>", the weights
                                                    after the step

Every number comes from one `trainer.train()` of TRL's `DPOTrainer` / `ORPOTrainer` (its
`maybe_extract_prompt`, `maybe_apply_chat_template`, `tokenize_row`, collator, concatenated
forward, `dpo_loss` / `odds_ratio_loss` and metrics) running one step: `optim="sgd"`, lr 0.5,
constant schedule, no clipping (`max_grad_norm=0`), f32 (`bf16=False`), eager attention, batch 4
(the 4 pairs, in file order: a sequential sampler), dropout off (TRL's `disable_dropout`). The
loss and metrics are what `get_batch_loss_metrics` returned for that batch (the trainer's log
rounds the loss to 4 digits); "rows" are the token ids TRL fed the model, per pair
{"chosen", "rejected"}: {"ids", "prompt_len"} (ids = prompt ids + completion ids, unpadded).

Cases: for M in tiny-llama, tiny-qwen2, tiny-qwen3, from the non-zero PEFT adapter
tests/fixtures/adapters/<M>-peft (r 4, alpha 8, every linear; DPO's reference is the same model
under PEFT's disable_adapter(), as TRL does for a PeftModel):

    dpo-sigmoid      beta 0.1                       (string, messages and rules data)
    dpo-sigmoid-ls   beta 0.2, label_smoothing 0.1  (string data)
    dpo-ipo          beta 0.1, loss_type "ipo"      (string data)
    orpo             beta (tallow's lambda) 0.1     (string, messages and rules data)

Full-weight cases (preference.full): tiny-llama, string data, every parameter trainable (no
adapter): "dpo-sigmoid" with precompute_ref_log_probs=True (the reference is the model before
the step) and "orpo"; key "tiny-llama/<case>-full/string", tensors "<key>.after.<name>" for
FULL_TENSORS only.

The two trainers tokenize differently, and the rules data shows where (TRL 0.23):
- DPOTrainer.tokenize_row: prompt and completion tokenized apart without special tokens, EOS
  appended to every completion, even one already ending with it;
- ORPOTrainer.tokenize_row: prompt + completion tokenized together and split after the prompt's
  own tokens (one token earlier when the last prompt token merged across the boundary), BOS
  prepended when the tokenizer has one and the prompt does not start with it, EOS appended only
  when the completion does not already end with it.

Mixture of experts (`--moe`, writing only tests/fixtures/reference/preference-moe.json and
.safetensors, in the same form): tiny-qwen3-moe and tiny-mixtral (scripts/make_moe_fixtures.py:
`output_router_logits` with coefficient 0.05) from their PEFT adapters on attention and
experts, "dpo-sigmoid" and "orpo" on the string data. TRL adds coef * the concatenated forward's
`aux_loss` to the loss (and logs it as the metric "aux_loss"); the re-implementation below has
no aux term, so these cases are not cross-checked. They run with gradient_checkpointing=False:
with TRL's default (True) transformers 4.57 records a checkpointed layer's router logits
without a graph, and the aux loss adds its value to the loss but nothing to the gradient.

Cross-check: a plain PyTorch re-implementation of the losses (case_loss below: TRL's formulas
written out) on the token ids TRL produced, one torch.optim.SGD step, must agree with the
trainer to float error (asserted; the largest differences are printed).
"""

import json
import math
import sys
import tempfile
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
PINNED_TRL = {"trl": "0.23.0", "datasets": "4.4.1"}

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
# Completions that already end with an EOS token (Qwen's <|im_end|>, Llama's <|end_of_text|>;
# the other model reads the string as text): DPO appends a second EOS, ORPO none. A prompt
# ending with a space, whose last token merges with the completion's first when tokenized
# together: ORPO moves the boundary, DPO keeps the prompt's own tokens.
RULE_ROWS = [
    {"prompt": "The sky is", "chosen": " blue.<|im_end|>", "rejected": " green."},
    {"prompt": "Two plus two is", "chosen": " four.<|end_of_text|>", "rejected": " five."},
    {"prompt": "Cats like ", "chosen": "fish and naps.", "rejected": "taxes."},
    {"prompt": "Water boils at", "chosen": " a hundred degrees.", "rejected": " thirty.<|im_end|>"},
]
DATA = {
    "string": ("preference.jsonl", STRING_ROWS),
    "messages": ("preference_messages.jsonl", MESSAGE_ROWS),
    "rules": ("preference_rules.jsonl", RULE_ROWS),
}
CASES = [
    ("dpo-sigmoid", dict(kind="dpo", beta=0.1, loss="sigmoid", ls=0.0), ["string", "messages", "rules"]),
    ("dpo-sigmoid-ls", dict(kind="dpo", beta=0.2, loss="sigmoid", ls=0.1), ["string"]),
    ("dpo-ipo", dict(kind="dpo", beta=0.1, loss="ipo", ls=0.0), ["string"]),
    ("orpo", dict(kind="orpo", lam=0.1), ["string", "messages", "rules"]),
]
FULL_CASES = [("dpo-sigmoid", CASES[0][1]), ("orpo", CASES[3][1])]
FULL_TENSORS = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
    "model.embed_tokens.weight",
]
# TRL's metrics that tallow reports (TRL also logs the mean logits).
METRICS = [
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen",
    "aux_loss",
]
MOE_MODELS = ["tiny-qwen3-moe", "tiny-mixtral"]
MOE_CASES = [("dpo-sigmoid", CASES[0][1]), ("orpo", CASES[3][1])]
# The re-implementation against the trainer (measured: loss <= 6e-7 relative, metrics <= 8e-6
# absolute, updates <= 1.3e-5 relative: float order only).
CROSS = {"loss": 1e-5, "metric": 1e-4, "update": 1e-4}


def one_step_trainer(cls):
    """TRL's trainer class, batches in file order, recording what each batch's loss was."""
    from torch.utils.data import SequentialSampler

    class OneStep(cls):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def get_batch_loss_metrics(self, model, batch, train_eval="train"):
            loss, metrics = super().get_batch_loss_metrics(model, batch, train_eval)
            self.seen.append((loss.item(), metrics, {k: v for k, v in batch.items() if torch.is_tensor(v)}))
            return loss, metrics

    return OneStep


def trl_step(model, tok, case, rows, precompute_ref=False, checkpointing=True):
    """One SGD step of TRL's trainer for `case` on `rows`: (loss, metrics, rows as TRL tokenized
    them). `model` is updated in place. `checkpointing`: TRL's `gradient_checkpointing` (its
    configs' default is True)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, ORPOConfig, ORPOTrainer

    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=len(rows), gradient_accumulation_steps=1,
        max_steps=1, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, bf16=False, fp16=False, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, padding_value=0, seed=0, disable_tqdm=True,
        gradient_checkpointing=checkpointing,
    )
    if case["kind"] == "dpo":
        args = DPOConfig(
            beta=case["beta"], loss_type=case["loss"], label_smoothing=case["ls"],
            precompute_ref_log_probs=precompute_ref, **common,
        )
        cls = one_step_trainer(DPOTrainer)
    else:
        args = ORPOConfig(beta=case["lam"], **common)
        cls = one_step_trainer(ORPOTrainer)
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.seen = []
    trainer.train()
    assert len(trainer.seen) == 1, len(trainer.seen)
    loss, metrics, batch = trainer.seen[0]
    metrics = {k: v for k, v in metrics.items() if k in METRICS}
    return loss, metrics, fed_rows(case["kind"], batch)


def fed_rows(kind, b):
    """Per pair, {"chosen", "rejected"}: {"ids", "prompt_len"}, unpadded, from TRL's batch."""
    out = []
    for i in range(b["chosen_input_ids"].shape[0]):
        pair = {}
        for part in ("chosen", "rejected"):
            if kind == "dpo":
                # Prompt left-padded, completions right-padded, kept apart.
                p = b["prompt_input_ids"][i][b["prompt_attention_mask"][i] == 1].tolist()
                c = b[f"{part}_input_ids"][i][b[f"{part}_attention_mask"][i] == 1].tolist()
                pair[part] = {"ids": p + c, "prompt_len": len(p)}
            else:
                # The whole sequence, labels -100 over its prompt.
                keep = b[f"{part}_attention_mask"][i] == 1
                ids = b[f"{part}_input_ids"][i][keep].tolist()
                labels = b[f"{part}_labels"][i][keep].tolist()
                n = sum(1 for x in labels if x == -100)
                assert all(x == -100 for x in labels[:n]), labels
                pair[part] = {"ids": ids, "prompt_len": n}
        out.append(pair)
    return out


# ---------------------------------------------------------------------------------------------
# The cross-check: TRL's formulas written out, on the ids TRL produced.


def batch(rows):
    """Chosen rows then rejected rows, right-padded: ids, attention mask, completion mask."""
    seqs = [(r[part]["ids"], r[part]["prompt_len"]) for part in ("chosen", "rejected") for r in rows]
    width = max(len(ids) for ids, _ in seqs)
    ids, att, comp = [], [], []
    for s, p in seqs:
        n = len(s)
        ids.append(s + [0] * (width - n))
        att.append([1] * n + [0] * (width - n))
        comp.append([0] * p + [1] * (n - p) + [0] * (width - n))
    return torch.tensor(ids), torch.tensor(att), torch.tensor(comp)


def logps(model, ids, att, comp):
    """Per-row completion log-prob sums (f32) and the logits."""
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    mask = comp[:, 1:].bool()
    return (lp * mask).sum(-1), logits


def case_loss(model, case, ids, att, comp, ref=None):
    """DPO (`dpo_loss`, sigmoid with label smoothing / ipo on mean log-probs) or ORPO
    (`odds_ratio_loss` on mean log-probs, the NLL over the chosen rows' every token after the
    first), with TRL's metrics."""
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


def cross_check(key, model, trainable, key_of, case, rows, want, after, worst, ref=None):
    """The re-implementation's step from the same start: asserts agreement with the trainer's
    loss, metrics and weights after the step (`after`, by file key); updates `worst`."""
    ids, att, comp = batch(rows)
    holder = {}

    def loss_fn():
        loss, metrics = case_loss(model, case, ids, att, comp, ref=ref)
        holder["metrics"] = metrics
        return loss

    before = {key_of[n]: p.detach().clone() for n, p in trainable.items()}
    loss, step = fl.sgd_step(trainable, key_of, loss_fn, LR)
    d_loss = abs(loss - want["loss"]) / abs(want["loss"])
    d_metric = max(abs(holder["metrics"][k] - v) for k, v in want["metrics"].items())
    d_update = 0.0
    for k, a in after.items():
        ours, theirs = step[f"after.{k}"] - before[k], a - before[k]
        d_update = max(d_update, ((ours - theirs).abs().max() / theirs.abs().max().clamp_min(1e-12)).item())
    assert d_loss < CROSS["loss"] and d_metric < CROSS["metric"] and d_update < CROSS["update"], (
        key, d_loss, d_metric, d_update)
    for name, d in (("loss", d_loss), ("metric", d_metric), ("update", d_update)):
        worst[name] = max(worst[name], d)


def moe_main(versions):
    """The mixture-of-experts cases: TRL's step with the router's aux loss."""
    out, tensors = {"versions": versions, "lr": LR, "cases": {}}, {}
    for model_name in MOE_MODELS:
        model_dir = FIX / "models" / model_name
        adapter_dir = FIX / "adapters" / f"{model_name}-peft"
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        tok.pad_token = tok.pad_token or tok.eos_token
        for case_name, case in MOE_CASES:
            key = f"{model_name}/{case_name}/string"
            model = PeftModel.from_pretrained(mf.load_model(model_dir), str(adapter_dir), is_trainable=True)
            assert model.config.output_router_logits
            trainable, key_of, _ = fl.adapter_trainables(model, adapter_dir, mp.file_key_to_param)
            # Without gradient checkpointing: with it (TRL's default), transformers 4.57 records
            # each checkpointed layer's router logits in the no-grad forward, so the aux loss
            # adds its value but no gradient (measured: the updates then equal a step on the
            # loss with the aux term detached, to 1.5e-5).
            loss, metrics, rows = trl_step(model, tok, case, STRING_ROWS, checkpointing=False)
            # DPO logs the aux loss as a metric; ORPO only adds it to the loss
            assert math.isfinite(loss) and (case["kind"] == "orpo" or "aux_loss" in metrics), metrics
            for n, p in trainable.items():
                tensors[f"{key}.after.{key_of[n]}"] = p.detach().float().clone().contiguous()
            coef = model.config.router_aux_loss_coef
            out["cases"][key] = {"case": case, "loss": loss, "metrics": metrics, "rows": rows, "aux_coef": coef}
            print(key, round(loss, 6), "aux", metrics.get("aux_loss"))
    mf.write_json(FIX / "reference" / "preference-moe.json", out)
    fl.save_tensors(tensors, FIX / "reference" / "preference-moe.safetensors")


def main():
    import datasets
    import trl

    fl.deterministic()
    versions = dict(mf.VERSIONS, trl=trl.__version__, datasets=datasets.__version__)
    fl.warn_unpinned(versions, PINNED_TRL)
    if "--moe" in sys.argv:
        moe_main(versions)
        return
    for file, rows in DATA.values():
        mf.write_jsonl(FIX / "data" / file, rows)
    out, tensors = {"versions": versions, "lr": LR, "cases": {}}, {}
    worst = {"loss": 0.0, "metric": 0.0, "update": 0.0}
    for model_name in MODELS:
        model_dir = FIX / "models" / model_name
        adapter_dir = FIX / "adapters" / f"{model_name}-peft"
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        if tok.pad_token is None:
            # TRL's ORPO collator insists on one; padding is masked, so any id does.
            tok.pad_token = tok.eos_token
        for case_name, case, datas in CASES:
            for data in datas:
                key = f"{model_name}/{case_name}/{data}"

                def fresh():
                    model = PeftModel.from_pretrained(mf.load_model(model_dir), str(adapter_dir), is_trainable=True)
                    trainable, key_of, _ = fl.adapter_trainables(model, adapter_dir, mp.file_key_to_param)
                    return model, trainable, key_of

                model, trainable, key_of = fresh()
                loss, metrics, rows = trl_step(model, tok, case, DATA[data][1])
                assert math.isfinite(loss)
                after = {key_of[n]: p.detach().float().clone().contiguous() for n, p in trainable.items()}
                for k, v in after.items():
                    tensors[f"{key}.after.{k}"] = v
                want = {"case": case, "loss": loss, "metrics": metrics, "rows": rows}
                out["cases"][key] = want
                model, trainable, key_of = fresh()
                model.eval()
                cross_check(key, model, trainable, key_of, case, rows, want, after, worst)
                print(key, round(loss, 6), metrics["rewards/accuracies"])
    # Full-weight cases.
    model_name = "tiny-llama"
    model_dir = FIX / "models" / model_name
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.pad_token = tok.pad_token or tok.eos_token
    for case_name, case in FULL_CASES:
        key = f"{model_name}/{case_name}-full/string"
        model = mf.load_model(model_dir)
        loss, metrics, rows = trl_step(model, tok, case, STRING_ROWS, precompute_ref=case["kind"] == "dpo")
        params = dict(model.named_parameters())
        after = {n: params[n].detach().float().clone().contiguous() for n in FULL_TENSORS}
        for name, v in after.items():
            tensors[f"{key}.after.{name}"] = v
        want = {"case": case, "loss": loss, "metrics": metrics, "rows": rows, "full": True}
        out["cases"][key] = want
        model = mf.load_model(model_dir)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        ref = None
        if case["kind"] == "dpo":
            with torch.no_grad():
                ref, _ = logps(model, *batch(rows))
        cross_check(key, model, trainable, {n: n for n in trainable}, case, rows, want, after, worst, ref=ref)
        print(key, round(loss, 6))
    print(
        f"re-implementation vs TRL's trainers: loss {worst['loss']:.1e} relative, metrics "
        f"{worst['metric']:.1e} absolute, updates {worst['update']:.1e} relative"
    )
    mf.write_json(FIX / "reference" / "preference.json", out)
    fl.save_tensors(tensors, FIX / "reference" / "preference.safetensors")


if __name__ == "__main__":
    main()
