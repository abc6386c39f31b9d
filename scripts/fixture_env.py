"""The start every PEFT fixture script shares (dev-only), before torch is imported.

PEFT's LoraConfig keeps target_modules as a set and adapter_config.json lists it in set order,
which depends on str hashing: the script re-executes itself with PYTHONHASHSEED=0 so the files
are reproducible. base_model_name_or_path is a bare dir name ("tiny-llama"), which PEFT's
save / load treat as a Hub repo id and try to fetch: stay offline.
"""

import os
import sys
from pathlib import Path


def pin_hash_seed_and_go_offline(script: str):
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(
            sys.executable,
            [sys.executable, str(Path(script).resolve())] + sys.argv[1:],
            dict(os.environ, PYTHONHASHSEED="0"),
        )
    os.environ["HF_HUB_OFFLINE"] = "1"
