"""Small whole-dataset repos for the loopback hub (tests/src/hub_server.rs), dev only.

    /work/pyref/bin/python scripts/make_hub_dataset_fixtures.py

Needs pyarrow (pinned in scripts/requirements-fixtures.txt: pyarrow==26.0.1). Writes, under
tests/fixtures/hub_datasets/, one directory per dataset repo (served file by file) plus the
same rows as plain local JSONL (`<repo>.<split>.jsonl`, rows in shard order) for the tests that
compare a hub run with a local one:

- sharded/: data/train-0000{0,1,2}-of-00003.parquet (4 messages rows each, with extra int /
  float / bool / null columns, snappy, row groups of 3 so a shard crosses row groups) and
  data/test-00000-of-00001.parquet (3 rows), the layout `push_to_hub` writes.
- jsonl/: train/part-0.jsonl, train/part-1.jsonl.gz (gzip), test/part-0.jsonl (text rows):
  splits found from directory names.
- configs/: README.md with `configs:`: "chat" (default: true; parquet shards under chat/) and
  "text" (train and test named by {split, path} entries), all parquet (`datasets` reads every
  config in the format of the first one's files).
"""
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent / "tests/fixtures/hub_datasets"

WORDS = ["fox", "dog", "sea", "star", "book", "robot", "tree", "rain", "moon", "song", "bread",
         "river"]


def chat_rows(n, start):
    rows = []
    for i in range(start, start + n):
        w, v = WORDS[i % len(WORDS)], WORDS[(i * 5 + 3) % len(WORDS)]
        rows.append({
            "id": i,
            "messages": [
                {"role": "user", "content": f"Tell me about the {w}."},
                {"role": "assistant", "content": f"The {w} is near the {v}, row {i}."},
            ],
            "score": i / 4,
            "ok": i % 2 == 0,
            "note": None if i % 3 else f"note {i}",
        })
    return rows


def text_rows(n, start):
    return [{"text": f"Row {i}: the {WORDS[i % len(WORDS)]} and the {WORDS[(i + 4) % len(WORDS)]}."}
            for i in range(start, start + n)]


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy", row_group_size=3)


def jsonl_text(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(jsonl_text(rows))


def main():
    # sharded: 3 train shards of 4 rows, 1 test shard of 3.
    train = [chat_rows(4, 4 * k) for k in range(3)]
    for k, rows in enumerate(train):
        write_parquet(ROOT / f"sharded/data/train-{k:05d}-of-00003.parquet", rows)
    test = chat_rows(3, 100)
    write_parquet(ROOT / "sharded/data/test-00000-of-00001.parquet", test)
    (ROOT / "sharded/README.md").write_text("# sharded\n\nNo front matter: the default patterns.\n")
    write_jsonl(ROOT / "sharded.train.jsonl", [r for rows in train for r in rows])
    write_jsonl(ROOT / "sharded.test.jsonl", test)

    # jsonl: dirs named by split, one gzip shard.
    t0, t1, tt = text_rows(3, 0), text_rows(3, 3), text_rows(2, 50)
    write_jsonl(ROOT / "jsonl/train/part-0.jsonl", t0)
    gz = ROOT / "jsonl/train/part-1.jsonl.gz"
    # mtime=0: the same bytes on every run.
    gz.write_bytes(gzip.compress(jsonl_text(t1).encode(), mtime=0))
    write_jsonl(ROOT / "jsonl/test/part-0.jsonl", tt)
    write_jsonl(ROOT / "jsonl.train.jsonl", t0 + t1)
    write_jsonl(ROOT / "jsonl.test.jsonl", tt)

    # configs: README configs.
    chat = [chat_rows(2, 200), chat_rows(2, 202)]
    for k, rows in enumerate(chat):
        write_parquet(ROOT / f"configs/chat/part-{k}.parquet", rows)
    text_train, text_test = text_rows(4, 300), text_rows(2, 400)
    # Parquet too: `datasets` reads every config with the format of the first config's files.
    write_parquet(ROOT / "configs/text/train.parquet", text_train)
    write_parquet(ROOT / "configs/text/test.parquet", text_test)
    (ROOT / "configs/README.md").write_text("""---
license: mit
configs:
- config_name: chat
  data_files:
  - split: train
    path: "chat/part-*.parquet"
  default: true
- config_name: text
  data_files:
  - split: train
    path: text/train.parquet
  - split: test
    path: [text/test.parquet]
---
# configs

Two configs: `chat` (the default) and `text`.
""")
    write_jsonl(ROOT / "configs.chat.train.jsonl", [r for rows in chat for r in rows])
    write_jsonl(ROOT / "configs.text.train.jsonl", text_train)
    for p in sorted(ROOT.rglob("*")):
        if p.is_file():
            print(p.relative_to(ROOT), p.stat().st_size)


if __name__ == "__main__":
    main()
