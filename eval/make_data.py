"""Write the held-out lm-eval data of the synthetic tasks (`eval/tasks/data/*.jsonl`).

    python -m modeling_kdsa.eval.make_data          # rewrites the shipped files; deterministic

The seeds differ from training's (`scripts/train_tiny.py --seed 0`), and training refuses to run if any of its
examples shares a context with these docs. `validation` docs pick training's best checkpoint; `test` docs are what
lm-eval and the accuracy runner report.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from . import synthetic

DATA_DIR = Path(__file__).resolve().parent / "tasks" / "data"
SPLITS = {"test": (1234, 300), "validation": (4321, 64)}  # seed, docs per task


@dataclass(frozen=True)
class TaskSpec:
    description: str
    chance: str  # accuracy of guessing, as printed in tables
    compose: bool | None  # key-value tasks: recall (False) or compose (True); None: copy
    distances: tuple[int, int] = (0, 0)  # key-value tasks: needle distance range in tokens


TASKS = {
    "recall_near": TaskSpec("recall, needle 1-31 tokens back", "1/64", False, (1, 31)),
    "recall_mid": TaskSpec("recall, needle 33-63 tokens back", "1/64", False, (33, 63)),
    "recall_far": TaskSpec("recall, needle 65-129 tokens back (beyond index_topk = 64)", "1/64", False, (65, 129)),
    "compose": TaskSpec("successor of the recalled value, needle 1-129 back", "1/64", True, (1, 129)),
    "copy": TaskSpec("copy 64 keys, exact", "~0", None),
}


def make_docs(task: str, split: str) -> list[dict]:
    seed, count = SPLITS[split]
    rng = random.Random(f"{seed}-{task}")
    spec = TASKS[task]
    if spec.compose is None:
        return [synthetic.copy_doc(rng) for _ in range(count)]
    return [synthetic.key_value_doc(rng, spec.compose, *spec.distances) for _ in range(count)]


def data_path(task: str, split: str = "test") -> Path:
    return DATA_DIR / f"{task}_{split}.jsonl"


def load_docs(task: str, split: str = "test") -> list[dict]:
    with data_path(task, split).open() as f:
        return [json.loads(line) for line in f]


def main():
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for task in TASKS:
            docs = make_docs(task, split)
            data_path(task, split).write_text("".join(json.dumps(doc) + "\n" for doc in docs))
            print(f"{data_path(task, split)}: {len(docs)} docs")


if __name__ == "__main__":
    main()
