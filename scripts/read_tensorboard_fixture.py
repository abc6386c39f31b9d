"""Reads tallow's TensorBoard fixture with TensorBoard's own reader (dev only).

    /work/pyref/bin/pip install tensorboard==2.20.0
    TALLOW_REGEN_TB=1 cargo test -p tallow-trainer --lib tensorboard   # writes the event file
    python scripts/read_tensorboard_fixture.py                          # writes tensorboard.json

`tensorboard.backend.event_processing.event_accumulator.EventAccumulator` loads
tests/fixtures/tensorboard/ (it checks every record's masked CRC-32C and decodes the protobuf
`Event`s); every scalar it read, with step and wall time, goes to tensorboard.json, which
crates/trainer/src/tensorboard.rs compares with what the writer was given.
"""
import json
import pathlib

import tensorboard
from tensorboard.backend.event_processing import event_accumulator

root = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tensorboard"
acc = event_accumulator.EventAccumulator(str(root), size_guidance={"scalars": 0})
acc.Reload()
scalars = {
    tag: [{"step": e.step, "wall_time": e.wall_time, "value": e.value} for e in acc.Scalars(tag)]
    for tag in acc.Tags()["scalars"]
}
out = {
    "reader": f"tensorboard {tensorboard.__version__} EventAccumulator",
    "count": sum(len(v) for v in scalars.values()),
    "scalars": scalars,
}
(root / "tensorboard.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
print(f"{out['count']} scalars in {len(scalars)} tags")
