"""fla's pure-torch KDA references (`fla/ops/kda/naive.py`), loaded by file path (docs/design.md §7).

Importing `fla.ops.kda` would run its `__init__`, which imports the Triton kernels; triton is deliberately not
installed on CPU, so the one file is loaded on its own. Its only imports are torch and einops.
"""

import importlib.util
from pathlib import Path


def _load_naive_module():
    fla_spec = importlib.util.find_spec("fla")  # locates the package without executing its __init__
    if fla_spec is None or not fla_spec.submodule_search_locations:
        raise ImportError("flash-linear-attention is not installed (pip install '.[test]')")
    path = Path(fla_spec.submodule_search_locations[0]) / "ops" / "kda" / "naive.py"
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_naive = _load_naive_module()
naive_recurrent_kda = _naive.naive_recurrent_kda
naive_chunk_kda = _naive.naive_chunk_kda

__all__ = ["naive_recurrent_kda", "naive_chunk_kda"]
