"""Fixed-shape paged DSA kernels of a compiled static-cache step (docs/graph-mode.md §3): every slot of the block
table under a mask, so that shapes depend on the capacity `L` (pages per row · P), never on the context. The `static_*`
kernels of every backend's set (kernels.py); the `cpu` backend's run a decode step through its C++ kernels instead
(dsa_paged_cpu.py). Page layout and legend: dsa_paged_common.py.
"""

import torch

from .dsa_ops import kpool_expand, scaled_index_weights
from .dsa_paged_common import PagedKeys, sequence_rows
from .dsa_paged_fused import (
    attend_selected,
    dense_block,
    dense_softmax_output,
    dense_softmax_start,
    score_block,
    score_pool_block,
    unpack_indices,
)


def visible_limit(query_start: torch.Tensor, num_queries: int, num_keys: torch.Tensor) -> torch.Tensor:
    """int64 `[T]`: query `t` (at position `query_start + t`) sees the keys `<= limit[t]` (causal, and the context's
    end `num_keys - 1`). Both inputs are 0-d tensors, so nothing here depends on their values at trace time."""
    positions = query_start + torch.arange(num_queries, device=query_start.device)
    return torch.minimum(positions, num_keys - 1)


def static_indexer_topk(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """Indexer top-k over every slot of the block table: q_index `[B, T, HI, DI]`, weights `[B, T, HI]` fp32; keys:
    index_pages `[N, P, DI]` (or quantized), block_table `[B, n]` fully mapped, num_keys / query_start 0-d int64
    tensors, key_padding_mask bool `[B, L]` or None. Returns int64 `[B, T, min(index_topk, L)]`, best first, -1 = no
    key. The selection equals `paged_indexer_topk_*`'s (same scores, same tie rule: `pack_scores`); only the width
    differs, the extra slots being -1. block_table None: the pages are in sequence order (`sequence_rows`)."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    rows = sequence_rows(keys.pages, keys.block_table, batch, q_index.dtype)
    capacity = rows.shape[1]
    scaled_weights = scaled_index_weights(weights, head_dim)
    key_positions = torch.arange(capacity, device=q_index.device)
    limit = visible_limit(keys.query_start, num_queries, keys.num_keys)
    padding = None if keys.key_padding_mask is None else keys.key_padding_mask.bool()
    packed = score_block(q_index.contiguous(), scaled_weights, rows, key_positions, limit, padding)
    return unpack_indices(packed.topk(min(index_topk, capacity), dim=-1).values)


def sequence_order_table(pages: torch.Tensor, batch: int) -> torch.Tensor:
    """The block table of a static store's pages (`sequence_rows` with no table): sequence `b` owns pages `b·n … b·n +
    n - 1`. For the C++ kernels, which read through a table."""
    return torch.arange(pages.shape[0], device=pages.device).view(batch, -1)


def static_kpool_origin(key_padding_mask: torch.Tensor | None, batch: int, device) -> torch.Tensor:
    """First real key of every sequence (where its k-pools start, docs/dsa.md §9) from a left-padding mask padded to
    the capacity (`[B, L]`, False past the context): the number of leading padding slots, `L` for a row without a
    real key. No host read, unlike `dsa_ops.kpool_origin` (which also checks the mask is left padding). int64 `[B]`."""
    if key_padding_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return (~key_padding_mask.bool()).long().cumprod(dim=-1).sum(dim=-1)


def static_kpool_indexer_topk(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """k-pool indexer top-k over every pooled-key slot of the block table (docs/dsa.md §9, docs/graph-mode.md §3).

    Arguments as `paged_kpool_indexer_topk_*` (`keys.pages` is not read: the store pools keys when they complete; nor
    `keys.pool_origin`: the origin comes from the mask), except num_keys / query_start: 0-d int64 tensors,
    key_padding_mask: bool `[B, L]` padded to the capacity, and block_table None: the pages are in sequence order
    (`sequence_rows`).
    Slot `r` of a sequence holds the pool ending in its `r`-th group of `kp` tokens, at `r·kp + (origin + kp - 1) mod
    kp`; a query sees it when that end is at or after the first pool's end and at or before the query and the last
    cached token (a pool is written when its last token arrives, so nothing later is read). Returns int64 `[B, T,
    min(index_topk // kp, L // kp) · kp (+ kp - 1 with the tail)]`, -1 = none: the paged kernels' selection (same
    scores and tie rule) with extra -1 slots."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    kpool = ape.shape[0]
    pooled = sequence_rows(keys.pool_pages, keys.block_table, batch, q_index.dtype)
    num_slots = pooled.shape[1]
    origin = static_kpool_origin(keys.key_padding_mask, batch, q_index.device)
    first_pool_end = origin + kpool - 1
    pool_ends = kpool * torch.arange(num_slots, device=q_index.device)[None, :] + (first_pool_end % kpool)[:, None]
    scaled_weights = scaled_index_weights(weights, head_dim)
    limit = visible_limit(keys.query_start, num_queries, keys.num_keys)
    packed = score_pool_block(q_index.contiguous(), scaled_weights, pooled, pool_ends, limit, first_pool_end)
    best = packed.topk(min(index_topk // kpool, num_slots), dim=-1).values
    return kpool_expand(unpack_indices(best), kpool, keys.query_start, origin, select_tail)


def static_sparse_mla(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA over the selected slots: `attend_selected` (already fixed-shape for a fixed K)."""
    q_latent, q_pe = q_latent.contiguous(), q_pe.contiguous()
    return attend_selected(q_latent, q_pe, keys.pages, keys.block_table, indices, softmax_scale)


def static_dense_mla(q_latent, q_pe, keys: PagedKeys, softmax_scale: float) -> torch.Tensor:
    """Dense causal absorbed MLA over every slot of the block table under the visibility mask: one `dense_block`
    step (the online-softmax block the paged kernels use) over all `L` rows.
    Shapes as `paged_dense_mla_fused` (block_table None: pages in sequence order, `sequence_rows`); returns
    `[B, T, H, C]`."""
    batch, num_queries, num_heads, latent_width = q_latent.shape
    query = torch.cat([q_latent, q_pe], dim=-1).contiguous()
    rows = sequence_rows(keys.pages, keys.block_table, batch, query.dtype)
    key_positions = torch.arange(rows.shape[1], device=query.device)
    limit = visible_limit(keys.query_start, num_queries, keys.num_keys)
    visible = (key_positions[None, :] <= limit[:, None])[None]
    if keys.key_padding_mask is not None:
        visible = visible & keys.key_padding_mask.bool()[:, None, :]
    start = dense_softmax_start(batch, num_queries, num_heads, latent_width, query.device)
    _, running_sum, accumulator = dense_block(query, rows, visible, softmax_scale, *start)
    return dense_softmax_output(running_sum, accumulator).to(q_latent.dtype)


__all__ = [
    "sequence_order_table",
    "static_dense_mla",
    "static_indexer_topk",
    "static_kpool_indexer_topk",
    "static_kpool_origin",
    "static_sparse_mla",
    "visible_limit",
]
