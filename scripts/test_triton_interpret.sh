#!/usr/bin/env bash
# The Triton kernels (modeling_kdsa/triton_kernels.py) and fla's Triton KDA under Triton's interpreter on CPU, in a
# separate environment: installing triton into .venv breaks transformers' KimiLinear CPU fallback (docs/backends.md
# §4). First run builds the environment (about 2 minutes; TRITON_VENV, default /tmp/kdsa-triton-venv), later runs
# only the tests (about a minute on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRITON_VENV:-/tmp/kdsa-triton-venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q triton==3.9.0 "transformers>=5.24,<5.25" safetensors accelerate tqdm pytest einops \
    flash-linear-attention==0.6.0 fla-core==0.6.0
fi
# This checkout's package (quantization/, parallel/, eval/ map into modeling_kdsa.* only when installed).
"$VENV/bin/pip" install -q --no-deps -e .
TRITON_INTERPRET=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -m "not slow" \
  tests/test_triton_kernels.py tests/test_kernel_registry.py "$@"
