"""The `cpu` backend's paged DSA kernels (kernels.py, docs/backends.md §1): a decode step, and a verification of up
to `MAX_KERNEL_QUERIES` queries per sequence, through the hand-written C++ kernels where they apply (`cpu_indexer`,
docs/dsa.md §11; `cpu_sparse_mla`, docs/dsa.md §12); everything else through the fused torch kernels
(dsa_paged_fused.py), and for a compiled static step through the fixed-shape ones (dsa_paged_static.py). Same
signatures and results as dsa_paged_reference.py. Page layout and legend: dsa_paged_common.py.
"""

import torch

from .cpu_indexer import decode_kernel_applies, indexer_topk_decode
from .cpu_sparse_mla import decode_kernel_applies as sparse_decode_kernel_applies
from .cpu_sparse_mla import sparse_mla_decode_cpu
from .dsa_ops import kpool_expand, kpool_origin, scaled_index_weights
from .dsa_paged_common import PagedKeys, ceil_div, check_indexer_inputs, check_kpool_inputs, check_sparse_inputs
from .dsa_paged_fused import (
    attend_selected,
    blocked_indexer_topk,
    blocked_kpool_indexer_topk,
    chunked_sparse_mla,
    score_block,
    score_pool_block,
)
from .dsa_paged_static import (
    sequence_order_table,
    static_indexer_topk,
    static_kpool_indexer_topk,
    static_kpool_origin,
    static_sparse_mla,
    visible_limit,
)


def paged_indexer_topk_cpu(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """`dsa_paged_fused.paged_indexer_topk_fused` (same signature and result; shapes in
    `dsa_paged_reference.paged_indexer_topk_reference`) with a bf16 decode step, and up to MAX_KERNEL_QUERIES queries
    per sequence (a verification, each query a row masked past its own position), through the C++ kernel where it
    applies (`cpu_indexer`, docs/dsa.md §11)."""
    check_indexer_inputs(q_index, weights, keys, index_topk)
    num_queries = q_index.shape[1]
    num_visible = min(keys.num_keys, keys.query_start + num_queries)  # the keys up to the last query
    num_selected = min(index_topk, num_visible)
    if num_selected > 0 and num_queries == 1 and decode_kernel_applies(q_index, keys.pages):
        # A decode step: the hand-written kernel reads the pages through the block table (docs/dsa.md §11).
        visible = torch.tensor(num_visible)
        return _decode_topk_cpu(
            q_index, weights, keys.pages, keys.block_table, visible, keys.key_padding_mask, num_selected
        )
    few_queries = 1 < num_queries <= MAX_KERNEL_QUERIES
    if num_selected > 0 and few_queries and decode_kernel_applies(q_index[:, :1], keys.pages):
        # A few queries (a verification of drafted tokens): the same kernel, each query a row of its own.
        return _queries_topk_cpu(q_index, weights, keys, num_visible, num_selected)
    return blocked_indexer_topk(q_index, weights, keys, index_topk, score_block)


# The most queries per sequence the CPU decode kernels (`cpu_indexer`, `cpu_sparse_mla`) take as rows of their own: a
# verification of up to 15 drafted tokens and the anchor. More (a prefill) keep the blocked torch paths, which read
# each key once for all queries.
MAX_KERNEL_QUERIES = 16


def _queries_topk_cpu(q_index, weights, keys: PagedKeys, num_visible: int, width: int) -> torch.Tensor:
    """`_decode_topk_cpu` for T queries `[B, T, HI, DI]` at cache positions `query_start …`: the B·T queries are rows of
    one kernel call over the first `num_visible` keys, each row's later keys masked as padding (query t sees the keys up
    to `query_start + t`, and the sequence's own padding), so each row selects what a decode step at its position
    would. Returns int64 `[B, T, width]`, -1 where a query sees fewer keys."""
    batch, num_queries = q_index.shape[:2]
    positions = torch.arange(num_visible, device=q_index.device)
    last_key = keys.query_start + torch.arange(num_queries, device=q_index.device)
    visible = (positions[None, :] <= last_key[:, None]).expand(batch, num_queries, num_visible)
    if keys.key_padding_mask is not None:
        visible = visible & keys.key_padding_mask[:, None, :num_visible].bool()
    rows = batch * num_queries
    selected = _decode_topk_cpu(
        q_index.reshape(rows, 1, *q_index.shape[2:]), weights.reshape(rows, 1, -1), keys.pages,
        keys.block_table.repeat_interleave(num_queries, dim=0), torch.tensor(num_visible),
        visible.reshape(rows, num_visible), width,
    )  # fmt: skip
    return selected.view(batch, num_queries, width)


def _decode_topk_cpu(q_index, weights, pages, block_table, num_visible, key_mask, num_selected) -> torch.Tensor:
    """`cpu_indexer.indexer_topk_decode` for q_index `[B, 1, HI, DI]` over the keys `pages` (indexer keys, or pooled
    keys) through `block_table`, `key_mask` bool `[B, n]` (True = a key the query may select) or None: int64
    `[B, 1, num_selected]`, best first, -1 where fewer keys are visible; the head weights scaled as
    `blocked_indexer_topk` scales them."""
    scaled_weights = scaled_index_weights(weights[:, 0], q_index.shape[-1]).contiguous()
    padding = None if key_mask is None else key_mask.bool().contiguous()
    selected = indexer_topk_decode(
        q_index[:, 0].contiguous(), scaled_weights, pages, block_table.long().contiguous(), num_visible,
        padding, num_selected, num_selected,
    )  # fmt: skip
    return selected.unsqueeze(1)


def paged_kpool_indexer_topk_cpu(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """`dsa_paged_fused.paged_kpool_indexer_topk_fused` (same signature and result) with a decode step through
    `cpu_indexer`'s kernel over the pooled keys where it applies (docs/dsa.md §9, §11)."""
    check_kpool_inputs(q_index, weights, keys, index_topk, ape)
    if not decode_kernel_applies(q_index, keys.pool_pages):
        return blocked_kpool_indexer_topk(q_index, weights, keys, index_topk, ape, select_tail, score_pool_block)
    # One query per sequence: `_kpool_slots_topk_cpu` over the `ceil(num_visible / kp)` slots that can hold a pool
    # ending by the query.
    batch, kpool = q_index.shape[0], ape.shape[0]
    num_visible = min(keys.num_keys, keys.query_start + 1)
    origin = keys.pool_origin
    if origin is None:
        origin = kpool_origin(keys.key_padding_mask, batch, num_visible, q_index.device)
    num_selected = min(index_topk // kpool, num_visible // kpool)
    if num_selected == 0:
        empty = torch.empty(batch, 1, 0, dtype=torch.int64, device=q_index.device)
        return kpool_expand(empty, kpool, keys.query_start, origin, select_tail)
    num_slots, last_visible_key = ceil_div(num_visible, kpool), num_visible - 1
    return _kpool_slots_topk_cpu(
        q_index, weights, keys, origin, kpool, num_slots, last_visible_key, num_selected, select_tail
    )


def _kpool_slots_topk_cpu(
    q_index, weights, keys: PagedKeys, origin, kpool: int, num_slots: int, last_visible_key, width: int, select_tail
) -> torch.Tensor:
    """The k-pool selection of one query per sequence with `cpu_indexer`'s kernel: the first `num_slots` pooled-key
    slots of the block table (`keys.pool_pages` through `keys.block_table`) are its keys (slot `s` holds the pool
    ending at `s·kp + phase`), the visibility rule (from each sequence's first pool end, from `origin`, up to
    `last_visible_key`) is its key mask, and the `width` slots it selects become pool ends, then token positions
    (`kpool_expand`)."""
    first_pool_end = origin + kpool - 1
    phase = first_pool_end % kpool
    pool_ends = kpool * torch.arange(num_slots, device=q_index.device)[None, :] + phase[:, None]
    visible = (pool_ends <= last_visible_key) & (pool_ends >= first_pool_end[:, None])
    num_slots = torch.tensor(num_slots)
    selected = _decode_topk_cpu(q_index, weights, keys.pool_pages, keys.block_table, num_slots, visible, width)
    ends = torch.where(selected >= 0, selected * kpool + phase[:, None, None], -1)  # [B, 1, width], -1 = none
    return kpool_expand(ends, kpool, keys.query_start, origin, select_tail)


def paged_sparse_mla_cpu(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """`dsa_paged_fused.paged_sparse_mla_fused` (same signature and result; shapes in
    `dsa_paged_reference.paged_sparse_mla_reference`) with a bf16 decode step (one query per sequence), and up to
    MAX_KERNEL_QUERIES queries per sequence (a verification) as rows of one call, through the C++ kernel where it
    applies (`cpu_sparse_mla`, docs/dsa.md §12)."""
    check_sparse_inputs(q_latent, q_pe, keys, indices)
    kv_pages, block_table = keys.pages, keys.block_table
    if sparse_decode_kernel_applies(q_latent, q_pe, kv_pages):
        return sparse_mla_decode_cpu(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale)
    batch, num_queries = q_latent.shape[:2]
    if 1 < num_queries <= MAX_KERNEL_QUERIES and sparse_decode_kernel_applies(q_latent[:, :1], q_pe[:, :1], kv_pages):
        # A few queries (a verification): each attends to its own selection, so the B·T queries are the rows of one
        # decode-kernel call, each with its sequence's block table.
        rows = batch * num_queries
        out = sparse_mla_decode_cpu(
            q_latent.reshape(rows, 1, *q_latent.shape[2:]), q_pe.reshape(rows, 1, *q_pe.shape[2:]), kv_pages,
            block_table.repeat_interleave(num_queries, dim=0), indices.reshape(rows, 1, -1), softmax_scale,
        )  # fmt: skip
        return out.view(q_latent.shape)
    return chunked_sparse_mla(q_latent, q_pe, keys, indices, softmax_scale, attend_selected)


def static_indexer_topk_cpu(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """`static_indexer_topk` for the cpu backend: a decode step where `cpu_indexer` applies goes through its kernel
    (one opaque op in the compiled graph, docs/dsa.md §11), anything else through `static_indexer_topk`."""
    if not decode_kernel_applies(q_index, keys.pages):
        return static_indexer_topk(q_index, weights, keys, index_topk)
    block_table = _static_table(keys.pages, keys.block_table, q_index.shape[0])
    capacity = block_table.shape[1] * keys.pages.shape[1]
    num_visible = torch.minimum(keys.query_start + 1, keys.num_keys)
    width = min(index_topk, capacity)
    return _decode_topk_cpu(q_index, weights, keys.pages, block_table, num_visible, keys.key_padding_mask, width)


def _static_table(pages, block_table: torch.Tensor | None, batch: int) -> torch.Tensor:
    """The block table the C++ kernels read: a static store's own, or its pages' sequence order (None)."""
    return sequence_order_table(pages, batch) if block_table is None else block_table


def static_kpool_indexer_topk_cpu(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """`static_kpool_indexer_topk` for the cpu backend: a decode step where `cpu_indexer` applies goes through its
    kernel over the pooled-key slots (the slot visibility of `static_kpool_indexer_topk` as its key mask; one opaque
    op in the compiled graph), anything else through `static_kpool_indexer_topk`."""
    if not decode_kernel_applies(q_index, keys.pool_pages):
        return static_kpool_indexer_topk(q_index, weights, keys, index_topk, ape, select_tail)
    batch, kpool = q_index.shape[0], ape.shape[0]
    keys = keys._replace(block_table=_static_table(keys.pool_pages, keys.block_table, batch))
    num_slots = keys.block_table.shape[1] * keys.pool_pages.shape[1]
    origin = static_kpool_origin(keys.key_padding_mask, batch, q_index.device)
    last_visible_key = visible_limit(keys.query_start, 1, keys.num_keys)
    width = min(index_topk // kpool, num_slots)
    return _kpool_slots_topk_cpu(q_index, weights, keys, origin, kpool, num_slots, last_visible_key, width, select_tail)


def static_sparse_mla_cpu(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """`static_sparse_mla` for the cpu backend: a decode step where `cpu_sparse_mla` applies goes through its kernel
    (one opaque op in the compiled graph, docs/dsa.md §12), anything else through `static_sparse_mla`."""
    if not sparse_decode_kernel_applies(q_latent, q_pe, keys.pages):
        return static_sparse_mla(q_latent, q_pe, keys, indices, softmax_scale)
    return sparse_mla_decode_cpu(q_latent, q_pe, keys.pages, keys.block_table, indices, softmax_scale)


__all__ = [
    "MAX_KERNEL_QUERIES",
    "paged_indexer_topk_cpu",
    "paged_kpool_indexer_topk_cpu",
    "paged_sparse_mla_cpu",
    "static_indexer_topk_cpu",
    "static_kpool_indexer_topk_cpu",
    "static_sparse_mla_cpu",
]
