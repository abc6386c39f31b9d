#!/usr/bin/env python3
"""Generate the README quickstart's tiny model and dataset (dev-only), and simulate its run.

Run (from the repository root):

    /work/pyref/bin/python scripts/make_quickstart.py             # writes examples/quickstart/
    /work/pyref/bin/python scripts/make_quickstart.py --simulate  # PyTorch + PEFT stand-in for
                                                                  # `tallow train` on it; prints
                                                                  # the numbers in its README

or, in any virtualenv: `pip install -r scripts/requirements-fixtures.txt`, then the same with
`python`. Pinned reference stack (see scripts/requirements-fixtures.txt):

    torch==2.8.0  transformers==4.57.1  tokenizers==0.22.2  peft==0.17.1
    safetensors==0.8.0  numpy==2.4.6

What it writes (deterministic: fixed seeds, no network; everything below is deleted and
rewritten, except examples/quickstart/README.md, which is written by hand):

    examples/quickstart/model/        a tiny *random* Qwen2ForCausalLM (f32 safetensors, tied
                                      embeddings) with the ChatML test tokenizer copied from
                                      tests/fixtures/tokenizers/chatml/ (tokenizer.json,
                                      tokenizer_config.json with its chat template)
    examples/quickstart/train.jsonl   N_TRAIN prompt_completion rows
    examples/quickstart/eval.jsonl    N_EVAL rows whose words are not in train.jsonl
    examples/quickstart/train_pairs.jsonl, eval_pairs.jsonl   the preference quickstart
                                      (configs/quickstart-dpo.toml): the first N_PAIRS train
                                      rows and every eval row as pairs, chosen the upper-cased
                                      word, rejected the word echoed in lower case; `--pairs`
                                      writes only these two, from train.jsonl and eval.jsonl

The skill: upper-case a short made-up word, e.g.

    {"prompt": "upper: smoke =", "completion": " SMOKE"}

Words are 3-5 letters, built from English-like syllables (onset + vowel + coda) so that they
tokenize like real words (the tokenizer's merges such as "st", "er", " s" show up), and every
letter a-z occurs. The base model is random: it has no skill at all (greedy accuracy 0, eval
loss above ln(vocab)); no pre-training is done (a base pre-trained on generic synthetic text
was tried and did not make LoRA learn this task better, see examples/quickstart/README.md).
The init range is 0.1 rather than HF's 0.02: with frozen tied embeddings of std 0.02 the logits
cannot grow large enough for a confident answer, and LoRA plateaus.

Tokenization is tallow's prompt_completion rule: ids = tok(prompt + completion) + [eos]
(<|im_end|>), targets = positions >= len(tok(prompt)); only the completion and the EOS are
trained. `--simulate` re-implements `tallow train` semantics in PyTorch: LoRA (PEFT, A
Kaiming-uniform, B zero) on all 7 linear modules, AdamW (torch), HF schedules with warmup (the
first step has lr 0), global-norm clipping 1.0, each optimizer step's loss = target-token NLL
summed over the step / its target tokens, a seeded permutation of the rows every epoch. The
shuffle order and LoRA init differ from tallow's RNG, so tallow's numbers are close, not equal.
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "examples" / "quickstart"
MODEL = OUT / "model"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizers" / "chatml"

SEED = 20240607
N_TRAIN = 1000
N_EVAL = 50

# The model: about 0.63 M parameters, 2.5 MB in f32.
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=True,
    use_sliding_window=False,
)

# The recommended tallow run (configs/quickstart.toml); --simulate uses these by default.
RUN = dict(
    rank=16,
    alpha=32.0,
    dropout=0.0,
    lr=2e-3,
    schedule="cosine",
    warmup_steps=20,
    epochs=8,  # 1000 rows / micro-batch 8 = 125 steps per epoch -> 1000 steps
    micro_batch_size=8,
    grad_accum=1,
    max_seq_len=64,
    max_grad_norm=1.0,
    weight_decay=0.0,
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# --------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------

ONSETS = ["", "", "", "b", "bl", "br", "c", "ch", "cl", "cr", "d", "dr", "f", "fl", "fr", "g",
          "gl", "gr", "h", "j", "k", "l", "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk",
          "sl", "sm", "sn", "sp", "st", "sw", "t", "th", "tr", "v", "w", "wh", "y", "z"]
NUCLEI = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "oa",
          "ie"]
CODAS = ["", "", "b", "ck", "d", "g", "k", "l", "ll", "m", "n", "nd", "ng", "nk", "nt", "p", "r",
         "rd", "rk", "rn", "s", "sh", "sk", "st", "t", "th", "x", "ze", "ve", "ne", "te", "ke",
         "pe", "me", "le", "se", "de"]


def make_words(n, rng):
    """n distinct 3-5 letter lowercase words from English-like syllables."""
    words, seen = [], set()
    while len(words) < n:
        w = rng.choice(ONSETS) + rng.choice(NUCLEI) + rng.choice(CODAS)
        if rng.random() < 0.25:
            w += rng.choice(NUCLEI[:5]) + rng.choice(["", "n", "r", "s", "t", "l"])
        if 3 <= len(w) <= 5 and w not in seen:
            seen.add(w)
            words.append(w)
    return words


def row(word):
    return {"prompt": f"upper: {word} =", "completion": " " + word.upper()}


def build_rows():
    rng = random.Random(SEED)
    words = make_words(N_TRAIN + N_EVAL, rng)
    train, evl = words[:N_TRAIN], words[N_TRAIN:]
    assert not set(train) & set(evl)
    letters = set("".join(train))
    assert letters == set("abcdefghijklmnopqrstuvwxyz"), sorted(letters)
    return [row(w) for w in train], [row(w) for w in evl]


N_PAIRS = 400


def pairs(rows):
    """Preference pairs from prompt_completion rows: chosen the upper-cased completion, rejected
    the same word in lower case (the skill not done)."""
    return [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"].lower()}
            for r in rows]


def write_pairs():
    write_jsonl(OUT / "train_pairs.jsonl", pairs(read_jsonl(OUT / "train.jsonl")[:N_PAIRS]))
    write_jsonl(OUT / "eval_pairs.jsonl", pairs(read_jsonl(OUT / "eval.jsonl")))


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def build_model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok_cfg = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    ids = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    vocab = max(ids.values()) + 1  # 256 bytes + 64 merges + 3 specials = 323
    cfg = Qwen2Config(
        vocab_size=vocab,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        max_window_layers=MODEL_CONFIG["num_hidden_layers"],
        dtype="float32",
        **MODEL_CONFIG,
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    if MODEL.exists():
        shutil.rmtree(MODEL)
    MODEL.mkdir(parents=True)
    model.save_pretrained(MODEL, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, MODEL / name)
    return sum(p.numel() for p in model.parameters())


def generate():
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.mkdir(parents=True, exist_ok=True)
    train, evl = build_rows()
    write_jsonl(OUT / "train.jsonl", train)
    write_jsonl(OUT / "eval.jsonl", evl)
    write_pairs()
    n_params = build_model()
    print(f"wrote {OUT.relative_to(REPO)}: {len(train)} train rows, {len(evl)} eval rows, "
          f"model {n_params} parameters")
    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            print(f"  {p.relative_to(REPO)}  {p.stat().st_size} bytes")


# --------------------------------------------------------------------------------------
# Simulation of `tallow train --config configs/quickstart.toml`
# --------------------------------------------------------------------------------------


def simulate(args):
    import torch
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                              get_linear_schedule_with_warmup)

    if not (MODEL / "model.safetensors").exists():
        sys.exit(f"{MODEL} is missing: run this script without --simulate first")
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(MODEL)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")

    def encode(r):
        ids = tok(r["prompt"] + r["completion"])["input_ids"]
        if not ids or ids[-1] != eos:
            ids = ids + [eos]
        p = len(tok(r["prompt"])["input_ids"])
        ids = ids[: RUN["max_seq_len"]]
        tgt = [i >= max(p, 1) for i in range(len(ids))]
        return ids, tgt

    train = [encode(r) for r in read_jsonl(OUT / "train.jsonl")]
    evl_rows = read_jsonl(OUT / "eval.jsonl")
    evl = [encode(r) for r in evl_rows]

    def batch(rows):
        t = max(len(i) for i, _ in rows)
        ids = torch.full((len(rows), t), pad)
        mask = torch.zeros((len(rows), t), dtype=torch.long)
        lab = torch.full((len(rows), t), -100)
        for b, (i, g) in enumerate(rows):
            ids[b, : len(i)] = torch.tensor(i)
            mask[b, : len(i)] = 1
            lab[b, : len(i)] = torch.tensor([x if y else -100 for x, y in zip(i, g)])
        return ids, mask, lab

    def nll_sum(model, rows):
        ids, mask, lab = batch(rows)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        t = lab[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), t.reshape(-1), ignore_index=-100, reduction="sum")
        return nll, int((t != -100).sum())

    @torch.no_grad()
    def eval_loss(model):
        model.eval()
        s, n = 0.0, 0
        bs = max(RUN["micro_batch_size"], 4)
        for k in range(0, len(evl), bs):
            l, c = nll_sum(model, evl[k : k + bs])
            s, n = s + l.item(), n + c
        return s / n

    @torch.no_grad()
    def greedy(model, show=0):
        model.eval()
        ok, samples = 0, []
        for r in evl_rows:
            x = torch.tensor([tok(r["prompt"])["input_ids"]])
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
            new = out[0, x.shape[1] :].tolist()
            if eos in new:
                new = new[: new.index(eos)]
            text = tok.decode(new)
            ok += text == r["completion"]
            samples.append((r["prompt"], text, r["completion"]))
        hits = [x for x in samples if x[1] == x[2]][:show]
        misses = [x for x in samples if x[1] != x[2]][: max(show // 2, 1)]
        return ok / len(evl_rows), hits + misses

    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32,
                                                attn_implementation="eager")
    n_base = sum(p.numel() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=RUN["rank"], lora_alpha=RUN["alpha"],
                                            lora_dropout=RUN["dropout"],
                                            target_modules=LORA_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(train) / (RUN["micro_batch_size"] * RUN["grad_accum"]))
    total = args.steps or args.epochs * steps_per_epoch
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=RUN["weight_decay"])
    make_sched = {"cosine": get_cosine_schedule_with_warmup,
                  "linear": get_linear_schedule_with_warmup}.get(args.schedule)
    sched = (make_sched(opt, args.warmup, total) if make_sched
             else get_constant_schedule_with_warmup(opt, args.warmup))

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"peft {peft.__version__}, {args.threads} threads, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()})")
    print(f"model {n_base} params, LoRA "
          f"{sum(p.numel() for p in params)} trainable; {len(train)} train rows "
          f"({sum(sum(g) for _, g in train)} target tokens), {len(evl)} eval rows "
          f"({sum(sum(g) for _, g in evl)} target tokens)")
    print(f"run: rank {RUN['rank']} alpha {RUN['alpha']} lr {args.lr} {args.schedule} warmup "
          f"{args.warmup}, {total} steps of {RUN['micro_batch_size']} x {RUN['grad_accum']} rows")
    t_all = time.time()
    before = eval_loss(model)
    acc_before, _ = greedy(model)
    print(f"step 0: eval loss {before:.4f}, greedy accuracy {acc_before:.2f}")

    rows_per_step = RUN["micro_batch_size"] * RUN["grad_accum"]
    train_time, train_cpu, log, step = 0.0, 0.0, [], 0
    for epoch in range(math.ceil(total / steps_per_epoch)):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        order = torch.randperm(len(train), generator=g).tolist()
        for k in range(0, len(order), rows_per_step):
            if step == total:
                break
            t0, c0 = time.time(), time.process_time()
            model.train()
            step_rows = [train[i] for i in order[k : k + rows_per_step]]
            micro = [step_rows[j : j + RUN["micro_batch_size"]]
                     for j in range(0, len(step_rows), RUN["micro_batch_size"])]
            n_tgt = sum(sum(gg) - int(gg[0]) for _, gg in step_rows)
            loss = 0.0
            for m in micro:
                l, _ = nll_sum(model, m)
                (l / n_tgt).backward()
                loss += l.item() / n_tgt
            torch.nn.utils.clip_grad_norm_(params, RUN["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            train_time += time.time() - t0
            train_cpu += time.process_time() - c0
            log.append(loss)
            if step % args.log_every == 0 or step == total:
                recent = log[-args.log_every :]
                print(f"step {step:4d}: train loss {sum(recent) / len(recent):.4f}"
                      f"  ({train_time:.1f} s)", flush=True)
        if step % steps_per_epoch == 0 and step < total:
            print(f"  epoch {epoch + 1}: eval loss {eval_loss(model):.4f}")
    after = eval_loss(model)
    acc_after, samples = greedy(model, show=args.show)
    wall = time.time() - t_all
    print(f"step {total}: eval loss {after:.4f}, greedy accuracy {acc_after:.2f}")
    for p, got, want in samples:
        print(f"  {'ok  ' if got == want else 'MISS'} {p!r:24} -> {got!r:10} (want {want!r})")
    drop = 100 * (1 - after / before)
    print(f"RESULT eval loss {before:.3f} -> {after:.3f} ({drop:.0f}% lower), "
          f"greedy accuracy {acc_before:.2f} -> {acc_after:.2f} ({len(evl_rows)} eval prompts), "
          f"training {train_time:.1f} s wall ({1000 * train_time / total:.1f} ms/step, "
          f"{total} steps; {train_cpu:.1f} s CPU time), whole simulation {wall:.1f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--simulate", action="store_true",
                    help="write nothing; run the PyTorch + PEFT stand-in for the quickstart")
    ap.add_argument("--pairs", action="store_true",
                    help="write only train_pairs.jsonl and eval_pairs.jsonl (from train/eval.jsonl)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=RUN["lr"])
    ap.add_argument("--schedule", default=RUN["schedule"], choices=["constant", "linear", "cosine"])
    ap.add_argument("--warmup", type=int, default=RUN["warmup_steps"])
    ap.add_argument("--epochs", type=int, default=RUN["epochs"])
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps; 0 runs --epochs")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--show", type=int, default=6,
                    help="correct eval answers to print after training (and half as many misses)")
    args = ap.parse_args()
    if args.simulate:
        simulate(args)
    elif args.pairs:
        write_pairs()
    else:
        generate()


if __name__ == "__main__":
    main()
