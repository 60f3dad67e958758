"""The `compiled` backend's paged DSA kernels (kernels.py, docs/backends.md §1): the fused kernels of
dsa_paged_fused.py with their per-block work (`score_block`, `score_pool_block`, `attend_selected`, `dense_block`)
compiled by `torch.compile` (inductor), cached on disk. Same signatures and results as dsa_paged_reference.py.
"""

import os

import torch
import torch.fx.experimental._config

from .dsa_paged_common import check_dense_inputs, check_indexer_inputs, check_kpool_inputs, check_sparse_inputs
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


def paged_indexer_topk_compiled(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    index_topk: int,
    query_start: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_indexer_topk_fused` with the per-block scoring compiled (the loop over blocks stays in Python, so the
    number of blocks never triggers a recompile). Same shapes and results."""
    check_indexer_inputs(
        q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask
    )
    return blocked_indexer_topk(
        q_index,
        weights,
        index_pages,
        block_table,
        num_keys,
        index_topk,
        query_start,
        key_padding_mask,
        _compiled("score_block"),
    )


def paged_sparse_mla_compiled(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """`paged_sparse_mla_fused` with each chunk of queries compiled as one graph. Same shapes and results."""
    check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices)
    return chunked_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale, _compiled("sparse_mla"))


def paged_dense_mla_compiled(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    query_start: int,
    softmax_scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_dense_mla_fused` with each key block's step compiled (the loops stay in Python). Same results."""
    check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask)
    return blocked_dense_mla(
        q_latent,
        q_pe,
        kv_pages,
        block_table,
        num_keys,
        query_start,
        softmax_scale,
        key_padding_mask,
        _compiled("dense_mla"),
    )


def paged_kpool_indexer_topk_compiled(
    q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
    key_padding_mask=None, ape=None, select_tail=True, origin=None,
) -> torch.Tensor:  # fmt: skip
    """`paged_kpool_indexer_topk_fused` with the per-block scoring compiled. Same shapes and results."""
    check_kpool_inputs(
        q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
        key_padding_mask, ape,
    )  # fmt: skip
    return blocked_kpool_indexer_topk(
        q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape,
        select_tail, origin, _compiled("score_pool_block"),
    )  # fmt: skip


__all__ = [
    "compile_cache_dir",
    "paged_dense_mla_compiled",
    "paged_indexer_topk_compiled",
    "paged_kpool_indexer_topk_compiled",
    "paged_sparse_mla_compiled",
]
