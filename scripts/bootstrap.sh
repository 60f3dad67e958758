#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with the CPU build of torch and this package (editable).
# torch is installed first and pinned, so that nothing pulls a multi-GB CUDA build. Never installs triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Always run pip (a few seconds when everything is there), so a dependency added to pyproject.toml is installed
# into an existing .venv too.
.venv/bin/pip install -q -U pip
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test,eval]"
if .venv/bin/python -c "import triton" >/dev/null 2>&1; then
  echo "bootstrap: triton is installed in .venv; it breaks CPU fallbacks (see README). Remove it: .venv/bin/pip uninstall -y triton" >&2
  exit 1
fi
