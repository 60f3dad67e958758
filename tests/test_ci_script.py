"""`.ci/run` exits non-zero when any step fails: run in a scratch tree whose bootstrap, lint, test and Triton steps are
stubs that succeed or fail on demand."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CI_SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "run"
STEPS = {  # stub path -> the step it stands for
    "scripts/bootstrap.sh": "bootstrap",
    ".venv/bin/ruff": "ruff",
    ".venv/bin/python": "pytest",
    "scripts/test_triton_interpret.sh": "triton",
}


def run_ci(tmp_path: Path, failing: str | None) -> tuple[int, list[str]]:
    """The CI script's exit status and the steps it ran, when the step named `failing` (or none) fails."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI_SCRIPT, tmp_path / ".ci" / "run")
    log = tmp_path / "steps.log"
    for path, step in STEPS.items():
        stub = tmp_path / path
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text(f"#!/usr/bin/env bash\necho {step} >> {log}\nexit {1 if step == failing else 0}\n")
        stub.chmod(0o755)
    result = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True,
                            env=dict(os.environ), timeout=60)  # fmt: skip
    return result.returncode, log.read_text().split() if log.exists() else []


def test_ci_runs_every_step_and_passes_when_all_pass(tmp_path):
    assert run_ci(tmp_path, None) == (0, ["bootstrap", "ruff", "pytest", "triton"])


@pytest.mark.parametrize("failing", ["bootstrap", "ruff", "pytest", "triton"])
def test_ci_fails_when_any_step_fails(tmp_path, failing):
    """A failed bootstrap or lint must not skip the tests and still exit 0 (`set -e` ignores a failure inside an `&&`
    list unless it is the last command)."""
    status, steps = run_ci(tmp_path, failing)
    assert status != 0
    assert steps[-1] == failing  # nothing runs after the failed step
