#!/usr/bin/env python3
"""Rewrites the memory figures of configs/*/*.toml headers and of configs/README.md's memory
column from `tallow estimate` (on CUDA, from the real models' config.json in benchmarks/models/),
so that a change to the estimate (or to what the trainer keeps) updates the docs in one command.
`crates/trainer/tests/configs.rs` fails when the README column and the estimate disagree.

Dev-only, standard library only. Run from the repository root after building tallow:

    cargo build -p tallow && python3 scripts/config_headers.py [--tallow target/debug/tallow]

Figures rewritten in each header (GiB, one decimal): "a X GiB peak", "Y GiB of it weights and
adapters", "... take Z GiB (peak W GiB)" (activations and peak without checkpointing) and
"Z GiB activations" (with the file's own checkpointing).
"""
import argparse
import json
import re
import subprocess
from pathlib import Path


def gib(b):
    return f"{b / 2**30:.1f}"


def estimate(tallow, cfg, model_json, *sets):
    args = [tallow, "estimate", "--config", str(cfg), "--set", f"model.path={model_json}",
            "--set", "train.device=cuda", "--json"]
    for s in sets:
        args += ["--set", s]
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def model_json(cfg_text):
    repo = re.search(r'^path = "(.*)"', cfg_text, re.M).group(1)
    return Path("benchmarks/models") / (repo.rsplit("/", 1)[-1].lower() + ".json")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tallow", default="target/debug/tallow")
    a = ap.parse_args()
    readme = Path("configs/README.md")
    table = readme.read_text()
    for cfg in sorted(Path("configs").glob("*/*.toml")):
        text = cfg.read_text()
        mj = model_json(text)
        e = estimate(a.tallow, cfg, mj)
        c = e["components"]
        total = gib(e["total_bytes"])
        weights = gib(c["frozen_weights"] + c["trainable_params"])
        new = re.sub(r"a [0-9.]+ GiB peak", f"a {total} GiB peak", text, count=1)
        new = re.sub(r"[0-9.]+ GiB of it( ?\n?# ?)weights and adapters",
                     lambda m: f"{weights} GiB of it{m.group(1)}weights and adapters", new, count=1)
        new = re.sub(r"[0-9.]+ GiB activations for", f"{gib(c['activations'])} GiB activations for",
                     new, count=1)
        if re.search(r"take [0-9.]+ GiB \(peak [0-9.]+ GiB\)", new):
            off = estimate(a.tallow, cfg, mj, "train.checkpointing=false")
            new = re.sub(r"take [0-9.]+ GiB \(peak [0-9.]+ GiB\)",
                         f"take {gib(off['components']['activations'])} GiB "
                         f"(peak {gib(off['total_bytes'])} GiB)", new, count=1)
        if new != text:
            cfg.write_text(new)
            print(f"{cfg}: rewritten ({total} GiB)")
        table = re.sub(rf"(\| `{re.escape(str(cfg))}` \|[^\n|]*\| )[0-9.]+ GiB \|",
                       lambda m: f"{m.group(1)}{total} GiB |", table)
    readme.write_text(table)


if __name__ == "__main__":
    main()
