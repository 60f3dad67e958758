"""The `torch` backend's paged DSA kernels (kernels.py, docs/backends.md §1): gather the pages into contiguous tensors
(`dsa_paged_common.gather_pages`), then run dsa_ops' reference kernels. Readable and exact: the oracle for the other
backends (dsa_paged_fused.py, dsa_paged_cpu.py, dsa_paged_compiled.py, npu_kernels.py, triton_kernels.py), which share
these signatures: the queries, the paged keys as one `PagedKeys` (dsa_paged_common.py), then what the read needs.

docs/dsa.md §4 (logical indices, physical slot `block_table[b, s // P] * P + s % P`), §3 (absorbed sparse MLA), §8
(dense causal MLA of the indexer-less layers), §9 (the k-pool indexer). Page layout and legend: dsa_paged_common.py.
"""

import torch

from .dsa_ops import dense_mla_attention, indexer_topk, kpool_indexer_topk, sparse_mla_attention
from .dsa_paged_common import (
    PagedKeys,
    check_dense_inputs,
    check_indexer_inputs,
    check_kpool_inputs,
    check_sparse_inputs,
    gather_pages,
)


def paged_indexer_topk_reference(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """Indexer top-k over paged keys: `gather_pages` then `dsa_ops.indexer_topk` (docs/dsa.md §1, §4, §6).

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]` fp32 (raw `weights_proj` output); keys: `index_pages`
    `[num_pages, P, DI]`, the block table, `num_keys`, `query_start` and `key_padding_mask` `[B, num_keys]` or None
    (`PagedKeys`). Returns int64 `[B, T, min(index_topk, S')]` logical key positions, best first (equal scores:
    earlier key first), -1 = no key, where `S' = min(num_keys, query_start + T)`.
    """
    check_indexer_inputs(q_index, weights, keys, index_topk)
    k_index = gather_pages(keys.pages, keys.block_table, keys.num_keys, q_index.dtype)
    return indexer_topk(q_index, weights, k_index, index_topk, keys.query_start, keys.key_padding_mask)


def paged_sparse_mla_reference(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA over paged `[c | k_pe]` rows: `gather_pages` then `dsa_ops.sparse_mla_attention`
    (docs/dsa.md §3, §6).

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; keys: `kv_pages` `[num_pages, P, C + R]` and the block table
    (`PagedKeys`); indices `[B, T, K]` logical positions, -1 = none. Returns `[B, T, H, C]` in q_latent's dtype.
    """
    check_sparse_inputs(q_latent, q_pe, keys, indices)
    # Only the tokens up to the last selected one are needed.
    num_tokens = int(indices.max()) + 1 if indices.numel() else 0
    if num_tokens == 0:
        return q_latent.new_zeros(q_latent.shape)  # no valid key anywhere: every row gives 0 (§6)
    rows = gather_pages(keys.pages, keys.block_table, num_tokens, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    return sparse_mla_attention(q_latent, q_pe, latent, k_pe, indices, softmax_scale)


def paged_kpool_indexer_topk_reference(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """k-pool indexer over paged token rows: `gather_pages` then `dsa_ops.kpool_indexer_topk`, which pools every
    visible key again from the per-token `[key | gate]` rows `keys.pages` `[N, P, 2·DI]` (`keys.pool_pages`
    `[N, P // kp, DI]` is not read: this is the oracle of the stored pools too). q_index `[B, T, HI, DI]`; weights
    `[B, T, HI]`; ape `[kp, DI]`; `keys.key_padding_mask` `[B, num_keys]` left padding or None; `keys.pool_origin`
    `[B]`: the pools' first token per sequence as the store keeps it (validated when written), None = from the mask
    (`kpool_origin`, which checks it is left padding: a host read).
    Returns int64 `[B, T, min(index_topk // kp, S' // kp) · kp (+ kp - 1 with the tail)]`, -1 = none."""
    check_kpool_inputs(q_index, weights, keys, index_topk, ape)
    rows = gather_pages(keys.pages, keys.block_table, keys.num_keys, q_index.dtype)
    return kpool_indexer_topk(
        q_index, weights, rows, ape, index_topk, keys.query_start, keys.key_padding_mask, select_tail, keys.pool_origin
    )


def paged_dense_mla_reference(q_latent, q_pe, keys: PagedKeys, softmax_scale: float) -> torch.Tensor:
    """Dense causal absorbed MLA over paged `[c | k_pe]` rows: `gather_pages` then `dsa_ops.dense_mla_attention`.

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; keys: `kv_pages` `[num_pages, P, C + R]`, the block table; the
    sequences hold `num_keys` tokens; query `i` sits at `query_start + i` and sees the keys `s <= query_start + i`
    that `key_padding_mask` `[B, num_keys]` (or None) marks real. Returns `[B, T, H, C]` in q_latent's dtype; rows
    without a visible key give 0.
    """
    check_dense_inputs(q_latent, q_pe, keys)
    num_visible = min(keys.num_keys, keys.query_start + q_latent.shape[1])
    if num_visible == 0:
        return q_latent.new_zeros(q_latent.shape)
    rows = gather_pages(keys.pages, keys.block_table, num_visible, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    padding = None if keys.key_padding_mask is None else keys.key_padding_mask[:, :num_visible]
    return dense_mla_attention(q_latent, q_pe, latent, k_pe, softmax_scale, keys.query_start, padding)


__all__ = [
    "gather_pages",
    "paged_dense_mla_reference",
    "paged_indexer_topk_reference",
    "paged_kpool_indexer_topk_reference",
    "paged_sparse_mla_reference",
]
