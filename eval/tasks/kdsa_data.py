"""lm-eval `custom_dataset` loader for the KDSA synthetic tasks.

lm-eval imports this file by path from the YAML's folder (`!function kdsa_data.load`), so it resolves the JSONL
files relative to itself: the tasks work from any working directory, installed or not, with no network.
"""

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"


def load(name: str, **metadata):
    """`name` (from the YAML's `dataset_kwargs`): the task's data file stem. `metadata`: whatever lm-eval passes on
    (task version, model args); unused. Returns `{"test": Dataset}`."""
    from datasets import Dataset

    path = DATA_DIR / f"{name}_test.jsonl"
    with path.open() as f:
        rows = [json.loads(line) for line in f]
    return {"test": Dataset.from_list(rows)}
