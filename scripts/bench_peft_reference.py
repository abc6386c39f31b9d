"""PyTorch + PEFT side of `scripts/bench_cpu.sh` and `scripts/bench_cuda.sh`: the same LoRA job
as tallow's, timed.

Dev-only (pinned versions: scripts/requirements-fixtures.txt; QLoRA also needs bitsandbytes and
CUDA). Usage:
    python scripts/bench_peft_reference.py make-model OUT_DIR --hidden 512 --layers 8 ...
    python scripts/bench_peft_reference.py make-model OUT_DIR --config benchmarks/models/X.json [--shrink]
    python scripts/bench_peft_reference.py train --model DIR --data FILE --steps N --micro-batch B --seq S --threads T
        [--device cpu|cuda] [--dtype f32|bf16] [--quantize none|nf4] [--checkpointing]
Prints one JSON line: {"tokens_per_s": ..., "step_s": [...], "loss_first": ..., "loss_last": ...,
"tokens": [...], "peak": {...}}; {"skipped": REASON} when the job cannot run here (QLoRA without
CUDA or bitsandbytes), {"oom": ...} when CUDA runs out of memory.

`make-model --config` is the Python twin of `tests/src/bin/make-random-model.rs` (for machines
without a Rust toolchain, e.g. a GPU machine): random weights of a hand-written config.json's
shapes (N(0, 0.02), norms 1, biases 0: transformers' own init), the same fixture tokenizer
(tests/fixtures/tokenizers/bos) and the same bench.jsonl rows (same generator, byte-identical).
"""
import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


# The word list and generator of tests/src/bin/make-random-model.rs (bench.jsonl rows).
BENCH_WORDS = ("the of and to in is was for on that with as by at from his her their which "
               "this be are model train data memory layer weight").split()

# --shrink: the architecture of the config (family, biases, tying, rope scaling) at toy sizes.
# The vocabulary shrinks to just above the fixture tokenizer's 325 ids (bos 320, eos 321).
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
          "bos_token_id": 320, "eos_token_id": 321}


def bench_rows(n_rows, row_words):
    """The rows make-random-model writes: `row_words` words from BENCH_WORDS by a 64-bit LCG."""
    s, mask, rows = 1, (1 << 64) - 1, []
    for _ in range(n_rows):
        words = []
        for _ in range(row_words):
            s = (s * 6364136223846793005 + 1442695040888963407) & mask
            words.append(BENCH_WORDS[(s >> 33) % len(BENCH_WORDS)])
        rows.append(json.dumps({"text": " ".join(words)}, separators=(",", ":")))
    return rows


def make_model_from_config(a):
    """Random weights with the shapes of a config.json (see the module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.load(open(a.config))
    if a.shrink:
        raw.update(SHRINK)
        if "head_dim" in raw:
            raw["head_dim"] = SHRINK["hidden_size"] // SHRINK["num_attention_heads"]
        if "max_window_layers" in raw:
            raw["max_window_layers"] = SHRINK["num_hidden_layers"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    cfg = AutoConfig.from_pretrained(out)
    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # Built (and initialized) on the GPU where there is one: seconds for 8B parameters.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    tok_dir = REPO / "tests/fixtures/tokenizers/bos"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    with open(out / "bench.jsonl", "w") as f:
        for r in bench_rows(a.rows, a.row_words):
            f.write(r + "\n")
    n = sum(p.numel() for p in model.parameters())
    print(f"{n} parameters in {out} ({device}, {time.perf_counter() - t0:.1f} s)")


def make_model(a):
    if a.config:
        return make_model_from_config(a)
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

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


def skip_reason(a):
    """Why this job cannot run here, or None."""
    if a.quantize == "nf4":
        if (a.device != "cuda" or not torch.cuda.is_available()) and not a.cpu_4bit:
            return "PEFT QLoRA needs CUDA (bitsandbytes 4-bit on GPU); none here"
        for need in ("bitsandbytes", "accelerate"):  # transformers' 4-bit loading needs both
            try:
                __import__(need)
            except Exception as e:  # ImportError, or a bitsandbytes that fails to load its library
                msg = (str(e).splitlines() or [""])[0][:120]
                return f"PEFT QLoRA needs {need}: {type(e).__name__}: {msg}"
    elif a.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch"
    return None


def peak(a):
    """Peak memory so far: the CUDA caching allocator's (MiB figures come from these bytes), and
    the process's peak RSS."""
    p = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if a.device == "cuda":
        p["max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        p["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return p


def train(a):
    steps_done = []
    try:
        _train(a, steps_done)
    except torch.cuda.OutOfMemoryError as e:
        # Reported as a row, like tallow bench's OOM cells, with the peaks up to the failure.
        print(json.dumps({"oom": str(e).splitlines()[0][:200], "steps_done": len(steps_done),
                          "peak": peak(a), "torch": torch.__version__}))


def _train(a, step_s):
    info = {"torch": torch.__version__, "threads": a.threads, "attn": a.attn, "device": a.device,
            "dtype": a.dtype, "quantize": a.quantize, "checkpointing": a.checkpointing}
    reason = skip_reason(a)
    if reason:
        print(json.dumps({"skipped": reason, **info}))
        return
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    kw = {"dtype": dtype, "attn_implementation": a.attn}
    if a.quantize == "nf4":
        import bitsandbytes
        from transformers import BitsAndBytesConfig

        # tallow's model.quantize = "nf4" with double_quant: the decoder's linear weights in NF4
        # with 8-bit block scales, computing in the model dtype; embeddings / lm_head / norms stay.
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=torch.uint8)
        info["bitsandbytes"] = bitsandbytes.__version__
        kw["device_map"] = {"": 0 if a.device == "cuda" else "cpu"}  # quantized on the way
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, **kw)
    if a.quantize == "none":
        model.to(a.device)  # (no device_map: that would need accelerate)
    model.config.use_cache = False
    if a.checkpointing:
        # Each decoder layer recomputed in the backward, as tallow's train.checkpointing. No
        # prepare_model_for_kbit_training: it would upcast norms and embeddings to f32, which
        # tallow does not do.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # PEFT keeps the adapters in f32 over a bf16 base (autocast_adapter_dtype), as tallow does.
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    model.train()
    dev = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    rows = []
    for line in open(a.data):
        ids = tok(json.loads(line)["text"]).input_ids + [tok.eos_token_id]
        rows.append(ids[: a.seq])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    losses, tokens, t_start = [], [], []
    for step in range(a.steps):
        batch = [rows[(step * a.micro_batch + i) % len(rows)] for i in range(a.micro_batch)]
        t = max(len(r) for r in batch)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([r + [pad] * (t - len(r)) for r in batch], device=dev)
        labels = torch.tensor([r + [-100] * (t - len(r)) for r in batch], device=dev)
        att = torch.tensor([[1] * len(r) + [0] * (t - len(r)) for r in batch], device=dev)
        sync()
        t0 = time.perf_counter()
        t_start.append(t0)
        out = model(input_ids=ids, attention_mask=att, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # one device-to-host read per step, as tallow's
        sync()
        t_end = time.perf_counter()
        step_s.append(t_end - t0)
        tokens.append(sum(len(r) for r in batch))
    # Trained tokens over the wall time of the steps after the warm-up ones.
    warm = min(a.warmup, len(step_s) - 1)
    tps = sum(tokens[warm:]) / (t_end - t_start[warm])
    print(json.dumps({"tokens_per_s": tps, "step_s": step_s, "tokens": tokens, "warmup": warm,
                      "loss_first": losses[0], "loss_last": losses[-1], "peak": peak(a), **info}))


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
    m.add_argument("--config", help="a config.json to take the shapes from (see the module doc)")
    m.add_argument("--shrink", action="store_true", help="with --config: toy sizes, same architecture")
    m.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--steps", type=int, default=8)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--micro-batch", type=int, default=4)
    t.add_argument("--seq", type=int, default=256)
    t.add_argument("--threads", type=int, default=os.cpu_count())
    t.add_argument("--attn", default="sdpa")
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    t.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    t.add_argument("--quantize", default="none", choices=["none", "nf4"])
    t.add_argument("--checkpointing", action="store_true")
    t.add_argument("--cpu-4bit", action="store_true",
                   help="with --quantize nf4 on CPU: bitsandbytes' CPU 4-bit layers (a check of the pipeline, not a speed)")
    a = ap.parse_args()
    {"make-model": make_model, "train": train}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
