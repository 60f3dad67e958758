"""The `torch` backend's paged DSA kernels (kernels.py, docs/backends.md §1): gather the pages into contiguous tensors,
then run dsa_ops' reference kernels. Readable and exact: the oracle for the other backends (dsa_paged_fused.py,
dsa_paged_cpu.py, dsa_paged_compiled.py, npu_kernels.py, triton_kernels.py), which share these signatures.

docs/dsa.md §4 (logical indices, physical slot `block_table[b, s // P] * P + s % P`), §3 (absorbed sparse MLA), §8
(dense causal MLA of the indexer-less layers), §9 (the k-pool indexer). Page layout and legend: dsa_paged_common.py.
"""

import torch

from .dsa_ops import dense_mla_attention, indexer_topk, kpool_indexer_topk, sparse_mla_attention
from .dsa_paged_common import (
    ceil_div,
    check_block_table,
    check_dense_inputs,
    check_indexer_inputs,
    check_kpool_inputs,
    check_sparse_inputs,
    page_geometry,
    read_pages,
)


def gather_pages(pages, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contiguous copy of the first `num_tokens` tokens of every sequence (docs/dsa.md §4).

    pages: `[num_pages, P, width]` or quantized pages (dequantized into `dtype`, required then); block_table: int
    `[B, max_pages]`. Returns `[B, num_tokens, width]`.
    """
    check_block_table(pages, block_table, num_tokens, block_table.shape[0], "pages")
    batch = block_table.shape[0]
    used = block_table[:, : ceil_div(num_tokens, page_geometry(pages)[1])]
    rows = read_pages(pages, used.reshape(-1), dtype)
    return rows.view(batch, -1, rows.shape[-1])[:, :num_tokens].contiguous()


def paged_indexer_topk_reference(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    index_topk: int,
    query_start: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer top-k over paged keys: `gather_pages` then `dsa_ops.indexer_topk` (docs/dsa.md §1, §4, §6).

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]` fp32 (raw `weights_proj` output); index_pages `[num_pages, P,
    DI]`; block_table int `[B, max_pages]`; key_padding_mask `[B, num_keys]` bool or None. Returns int64 `[B, T,
    min(index_topk, S')]` logical key positions, best first (equal scores: earlier key first), -1 = no key, where
    `S' = min(num_keys, query_start + T)`.
    """
    check_indexer_inputs(
        q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask
    )
    k_index = gather_pages(index_pages, block_table, num_keys, q_index.dtype)
    return indexer_topk(q_index, weights, k_index, index_topk, query_start, key_padding_mask)


def paged_sparse_mla_reference(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sparse absorbed MLA over paged `[c | k_pe]` rows: `gather_pages` then `dsa_ops.sparse_mla_attention`
    (docs/dsa.md §3, §6).

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; kv_pages `[num_pages, P, C + R]`; block_table int `[B,
    max_pages]`; indices `[B, T, K]` logical positions, -1 = none. Returns `[B, T, H, C]` in q_latent's dtype.
    """
    check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices)
    # Only the tokens up to the last selected one are needed.
    num_tokens = int(indices.max()) + 1 if indices.numel() else 0
    if num_tokens == 0:
        return q_latent.new_zeros(q_latent.shape)  # no valid key anywhere: every row gives 0 (§6)
    rows = gather_pages(kv_pages, block_table, num_tokens, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    return sparse_mla_attention(q_latent, q_pe, latent, k_pe, indices, softmax_scale)


def paged_kpool_indexer_topk_reference(
    q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
    key_padding_mask=None, ape=None, select_tail=True, origin=None,
) -> torch.Tensor:  # fmt: skip
    """k-pool indexer over paged token rows: `gather_pages` then `dsa_ops.kpool_indexer_topk`, which pools every
    visible key again from the per-token `[key | gate]` rows (`pool_pages` is not read: this is the oracle of the
    stored pools too). q_index `[B, T, HI, DI]`; weights `[B, T, HI]`; index_pages `[N, P, 2·DI]`; pool_pages
    `[N, P // kp, DI]`; ape `[kp, DI]`; key_padding_mask `[B, num_keys]` left padding or None; origin `[B]`: the
    pools' first token per sequence as the store keeps it (`pool_origin`, validated when written), None = from the
    mask (`kpool_origin`, which checks it is left padding: a host read).
    Returns int64 `[B, T, min(index_topk // kp, S' // kp) · kp (+ kp - 1 with the tail)]`, -1 = none."""
    check_kpool_inputs(
        q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
        key_padding_mask, ape,
    )  # fmt: skip
    rows = gather_pages(index_pages, block_table, num_keys, q_index.dtype)
    return kpool_indexer_topk(
        q_index, weights, rows, ape, index_topk, query_start, key_padding_mask, select_tail, origin
    )


def paged_dense_mla_reference(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    query_start: int,
    softmax_scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal absorbed MLA over paged `[c | k_pe]` rows: `gather_pages` then `dsa_ops.dense_mla_attention`.

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; kv_pages `[num_pages, P, C + R]`; block_table int `[B,
    max_pages]`; the sequences hold `num_keys` tokens; query `i` sits at `query_start + i` and sees the keys
    `s <= query_start + i` that `key_padding_mask` `[B, num_keys]` (or None) marks real. Returns `[B, T, H, C]` in
    q_latent's dtype; rows without a visible key give 0.
    """
    check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask)
    num_visible = min(num_keys, query_start + q_latent.shape[1])
    if num_visible == 0:
        return q_latent.new_zeros(q_latent.shape)
    rows = gather_pages(kv_pages, block_table, num_visible, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    padding = None if key_padding_mask is None else key_padding_mask[:, :num_visible]
    return dense_mla_attention(q_latent, q_pe, latent, k_pe, softmax_scale, query_start, padding)


__all__ = [
    "gather_pages",
    "paged_dense_mla_reference",
    "paged_indexer_topk_reference",
    "paged_kpool_indexer_topk_reference",
    "paged_sparse_mla_reference",
]
