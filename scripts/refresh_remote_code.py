"""Copy the model files into every shipped checkpoint, so that `trust_remote_code=True` users run today's code.

Run after any change under modeling_kdsa/ (tests/test_checkpoint.py fails until you do):

    .venv/bin/python scripts/refresh_remote_code.py

A checkpoint folder is one under checkpoints/ whose config.json has an `auto_map`. Every `modeling_kdsa/*.py` but
`__init__.py` is copied (the files `save_pretrained` would copy are a subset of these); remote-code files the
package no longer has are removed.
"""

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "modeling_kdsa"


def model_files() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def checkpoint_folders() -> list[Path]:
    folders = []
    for config in sorted((ROOT / "checkpoints").glob("*/config.json")):
        if "auto_map" in json.loads(config.read_text()):
            folders.append(config.parent)
    return folders


def main() -> None:
    sources = model_files()
    names = {p.name for p in sources}
    for folder in checkpoint_folders():
        changed = []
        for source in sources:
            target = folder / source.name
            if not target.exists() or target.read_bytes() != source.read_bytes():
                shutil.copyfile(source, target)
                changed.append(source.name)
        for stale in sorted(folder.glob("*.py")):
            if stale.name not in names:
                stale.unlink()
                changed.append(f"-{stale.name}")
        print(f"{folder.relative_to(ROOT)}: {', '.join(changed) if changed else 'up to date'}")


if __name__ == "__main__":
    main()
