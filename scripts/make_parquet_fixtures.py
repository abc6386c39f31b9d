"""Parquet copies of the JSONL fixtures (dev only; pinned in scripts/requirements-fixtures.txt).

    python scripts/make_parquet_fixtures.py

Writes tests/fixtures/data/{text,prompt_completion,messages}.parquet with the same rows as the
.jsonl files, snappy-compressed, in row groups of 2 rows (so readers must cross row groups), the
way `datasets` / the hub's parquet converter store them (messages as a list of structs).
"""
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA = Path(__file__).resolve().parent.parent / "tests/fixtures/data"

for name in ["text", "prompt_completion", "messages"]:
    rows = [json.loads(l) for l in open(DATA / f"{name}.jsonl") if l.strip()]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, DATA / f"{name}.parquet", compression="snappy", row_group_size=2)
    print(name, table.num_rows, "rows,", pq.ParquetFile(DATA / f"{name}.parquet").num_row_groups, "row groups")
