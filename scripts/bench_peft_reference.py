"""PyTorch + PEFT side of `scripts/bench_cpu.sh`: the same LoRA job as tallow's, timed.

Dev-only (pinned versions: scripts/requirements-fixtures.txt). Usage:
    python scripts/bench_peft_reference.py make-model OUT_DIR --hidden 512 --layers 8 ...
    python scripts/bench_peft_reference.py train --model DIR --data FILE --steps N --micro-batch B --seq S --threads T
Prints one JSON line: {"tokens_per_s": ..., "step_s": [...], "loss_first": ..., "loss_last": ...}.
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parent.parent


def make_model(a):
    torch.manual_seed(0)
    tok_dir = REPO / "tests/fixtures/tokenizers/chatml"
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1e6,
        bos_token_id=None, eos_token_id=tok.eos_token_id,
    )
    model = Qwen2ForCausalLM(cfg)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    # Text rows of about `--row-tokens` tokens: words from a fixed list.
    words = "the of and to in is was for on that with as by at from his her their which this be are".split()
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(a.rows):
        n = a.row_words
        idx = torch.randint(0, len(words), (n,), generator=g).tolist()
        rows.append({"text": " ".join(words[i] for i in idx)})
    with open(out / "bench.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"params {sum(p.numel() for p in model.parameters())}")


def train(a):
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation=a.attn)
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    model.train()
    rows = []
    for line in open(a.data):
        ids = tok(json.loads(line)["text"]).input_ids + [tok.eos_token_id]
        rows.append(ids[: a.seq])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    step_s, losses, tokens = [], [], []
    for step in range(a.steps):
        batch = [rows[(step * a.micro_batch + i) % len(rows)] for i in range(a.micro_batch)]
        t = max(len(r) for r in batch)
        ids = torch.tensor([r + [tok.pad_token_id] * (t - len(r)) for r in batch])
        labels = torch.tensor([r + [-100] * (t - len(r)) for r in batch])
        att = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in batch])
        t0 = time.perf_counter()
        out = model(input_ids=ids, attention_mask=att, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        losses.append(out.loss.item())
        tokens.append(sum(len(r) for r in batch))
    warm = a.warmup
    tps = sum(tokens[warm:]) / sum(step_s[warm:])
    print(json.dumps({"tokens_per_s": tps, "step_s": step_s, "loss_first": losses[0], "loss_last": losses[-1],
                      "torch": torch.__version__, "threads": a.threads, "attn": a.attn}))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out")
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--intermediate", type=int, default=1408)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--rows", type=int, default=64)
    m.add_argument("--row-words", type=int, default=200)
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--steps", type=int, default=8)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--micro-batch", type=int, default=4)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--threads", type=int, default=os.cpu_count())
    t.add_argument("--attn", default="sdpa")
    a = ap.parse_args()
    {"make-model": make_model, "train": train}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
