"""The split -> files table that tallow's hub dataset resolver (crates/hub/src/datafiles.rs) is
checked against, made by the `datasets` library's own resolver (dev only; never needed by tallow
or its tests).

    python -m venv --system-site-packages /tmp/dsvenv     # from the fixture venv (pyarrow 26)
    /tmp/dsvenv/bin/pip install datasets==4.4.1             # pulls fsspec 2025.10
    /tmp/dsvenv/bin/python scripts/make_datafiles_cases.py

Each case is a repo file list (empty files in a temp dir) plus an optional README.md; for the
default config and each README config, `datasets.load_dataset_builder(dir, name=config)` gives
`builder.config.data_files` (split -> files, in order) and the inferred module (json, parquet,
csv, ...), or the error it raises. Writes tests/fixtures/data/datafiles_cases.json.
"""
import json
import tempfile
from pathlib import Path

import datasets

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/data/datafiles_cases.json"

CONFIGS_README = """---
license: mit
configs:
- config_name: chat
  data_files:
  - split: train
    path: "chat/train-*.parquet"
  - split: test
    path:
    - chat/test.parquet
  default: true
- config_name: plain
  data_files: plain/*.jsonl
- config_name: dir
  data_dir: bydir
dataset_info:
  features:
  - name: text
    dtype: string
---
# A card
"""

CASES = [
    ("sharded parquet", [
        "data/train-00000-of-00003.parquet", "data/train-00001-of-00003.parquet",
        "data/train-00002-of-00003.parquet", "data/test-00000-of-00001.parquet",
        "README.md", ".gitattributes",
    ], None),
    ("sharded, custom split", [
        "data/random-00000-of-00002.jsonl", "data/random-00001-of-00002.jsonl",
        "data/train-00000-of-00001.jsonl", "data/validation-00000-of-00001.jsonl",
    ], None),
    ("split files", ["train.jsonl", "test.jsonl", "validation.jsonl", "notes.txt.bak"], None),
    ("split dirs", [
        "train/a.jsonl", "train/b.jsonl", "dev/x.jsonl", "eval/y.jsonl", "other/z.jsonl",
    ], None),
    ("keywords in names", [
        "my_train_1.json", "my_train_0.json", "my-test.json", "trainer.json", "other.json",
    ], None),
    ("everything is train", ["data.jsonl", "more/stuff.jsonl", "README.md", "config.json"], None),
    ("most common format wins", [
        "train/a.parquet", "train/b.parquet", "train/c.jsonl",
    ], None),
    ("hidden and special dirs", [
        ".hidden/train.jsonl", "__pycache__/train.jsonl", "train.jsonl", "sub/.x/test.jsonl",
    ], None),
    ("csv", ["train.csv", "test.csv"], None),
    ("README configs", [
        "chat/train-0.parquet", "chat/train-1.parquet", "chat/test.parquet", "chat/extra.jsonl",
        "plain/b.jsonl", "plain/a.jsonl", "bydir/train.jsonl", "bydir/test.jsonl",
        "README.md",
    ], CONFIGS_README),
    ("README configs, none default", ["a/x.jsonl", "b/y.jsonl", "README.md"], """---
configs:
- config_name: a
  data_files: a/*.jsonl
- config_name: b
  data_files: b/*.jsonl
---
"""),
    ("README config named default", ["a/x.jsonl", "b/y.jsonl", "README.md"], """---
configs:
- config_name: b
  data_files: b/*.jsonl
- config_name: default
  data_files:
  - split: train
    path: a/*.jsonl
---
"""),
    ("README without configs", ["train.jsonl", "README.md"], "---\nlicense: mit\n---\n# x\n"),
]


def resolve(root: Path, config):
    try:
        b = datasets.load_dataset_builder(str(root), name=config)
    except Exception as e:  # noqa: BLE001: the error is the expected outcome
        return {"error": type(e).__name__, "message": str(e)[:300]}
    splits = {}
    for split, files in b.config.data_files.items():
        splits[str(split)] = [Path(f).resolve().relative_to(root.resolve()).as_posix() for f in files]
    return {"config": b.config.name, "module": type(b).__module__.split(".")[-2], "splits": splits}


def main():
    cases = []
    for name, files, readme in CASES:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            for f in files:
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                (root / f).write_bytes(b"")
            if readme is not None:
                (root / "README.md").write_text(readme)
            configs = [None]
            if readme and "config_name" in readme:
                configs += [line.split(":", 1)[1].strip() for line in readme.splitlines()
                            if "config_name:" in line]
            results = [{"config_asked": c, **resolve(root, c)} for c in configs]
        cases.append({"name": name, "files": files, "readme": readme, "results": results})
    OUT.write_text(json.dumps({"datasets_version": datasets.__version__, "cases": cases}, indent=1) + "\n")
    for c in cases:
        for r in c["results"]:
            print(c["name"], r.get("config_asked"), r.get("module"), r.get("splits") or r.get("error"))


if __name__ == "__main__":
    main()
