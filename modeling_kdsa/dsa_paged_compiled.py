"""The `compiled` backend's paged DSA kernels (kernels.py, docs/backends.md §1): the fused kernels of
dsa_paged_fused.py with their per-block work (`score_block`, `score_pool_block`, `attend_selected`, `dense_block`)
compiled by `torch.compile` (inductor), cached on disk. Same signatures and results as dsa_paged_reference.py.
"""

import os

import torch
import torch.fx.experimental._config

from .dsa_paged_common import (
    PagedKeys,
    check_dense_inputs,
    check_indexer_inputs,
    check_kpool_inputs,
    check_sparse_inputs,
)
from .dsa_paged_fused import (
    attend_selected,
    blocked_dense_mla,
    blocked_indexer_topk,
    blocked_kpool_indexer_topk,
    chunked_sparse_mla,
    dense_block,
    score_block,
    score_pool_block,
)

# Where inductor's FX graph and AOTAutograd caches live unless the user set TORCHINDUCTOR_CACHE_DIR.
DEFAULT_COMPILE_CACHE_DIR = os.path.join("~", ".cache", "kdsa", "torchinductor")


_compiled_functions: dict = {}


def compile_cache_dir() -> str:
    """The on-disk inductor cache: $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/kdsa/torchinductor."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser(DEFAULT_COMPILE_CACHE_DIR)


def _compiled(name: str):
    """`torch.compile` of `score_block` / `attend_selected` / `dense_block`, created once per process.

    `dynamic=True`: every size is symbolic from the first compile, so a context that grows each decode step (the
    key block's length, the running top-k's width, K, the number of pages) reuses one graph; only 0/1-sized
    dimensions (T = 1, B = 1) get graphs of their own. Duck sizing is off while compiling: it would assume that two
    sizes equal at the first call stay equal (e.g. K == page size == 64 early in a generation) and recompile when
    they part. Inductor's FX graph cache and AOTAutograd cache (on by default in torch 2.13, see
    `TORCHINDUCTOR_FX_GRAPH_CACHE` / `TORCHINDUCTOR_AUTOGRAD_CACHE`) persist the compiled code under
    `compile_cache_dir()`, so a second process skips inductor's code generation and C++ build.
    """
    if not _compiled_functions:
        # Inductor reads the variable when it first needs its cache; setdefault keeps a user's choice.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
        for key, function in (
            ("score_block", score_block),
            ("score_pool_block", score_pool_block),
            ("sparse_mla", attend_selected),
            ("dense_mla", dense_block),
        ):
            _compiled_functions[key] = _without_duck_sizing(torch.compile(function, dynamic=True))
    return _compiled_functions[name]


def _without_duck_sizing(compiled_function):
    def run(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled_function(*args)

    return run


def paged_indexer_topk_compiled(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """`paged_indexer_topk_fused` with the per-block scoring compiled (the loop over blocks stays in Python, so the
    number of blocks never triggers a recompile). Same shapes and results."""
    check_indexer_inputs(q_index, weights, keys, index_topk)
    return blocked_indexer_topk(q_index, weights, keys, index_topk, _compiled("score_block"))


def paged_sparse_mla_compiled(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """`paged_sparse_mla_fused` with each chunk of queries compiled as one graph. Same shapes and results."""
    check_sparse_inputs(q_latent, q_pe, keys, indices)
    return chunked_sparse_mla(q_latent, q_pe, keys, indices, softmax_scale, _compiled("sparse_mla"))


def paged_dense_mla_compiled(q_latent, q_pe, keys: PagedKeys, softmax_scale: float) -> torch.Tensor:
    """`paged_dense_mla_fused` with each key block's step compiled (the loops stay in Python). Same results."""
    check_dense_inputs(q_latent, q_pe, keys)
    return blocked_dense_mla(q_latent, q_pe, keys, softmax_scale, _compiled("dense_mla"))


def paged_kpool_indexer_topk_compiled(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """`paged_kpool_indexer_topk_fused` with the per-block scoring compiled. Same shapes and results."""
    check_kpool_inputs(q_index, weights, keys, index_topk, ape)
    score_pool_block = _compiled("score_pool_block")
    return blocked_kpool_indexer_topk(q_index, weights, keys, index_topk, ape, select_tail, score_pool_block)


__all__ = [
    "compile_cache_dir",
    "paged_dense_mla_compiled",
    "paged_indexer_topk_compiled",
    "paged_kpool_indexer_topk_compiled",
    "paged_sparse_mla_compiled",
]
