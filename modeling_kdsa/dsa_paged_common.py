"""What every paged DSA kernel shares (dsa_paged_reference.py, dsa_paged_fused.py, dsa_paged_cpu.py,
dsa_paged_compiled.py, dsa_paged_static.py, npu_kernels.py, triton_kernels.py): reading rows from the pages and the
input checks, which run eagerly, before any compiled code.

Page layout (owned by `KDSACache`): `kv_pages` `[num_pages, P, C + R]` rows `[normalised latent c | RoPE'd k_pe]`;
`index_pages` `[num_pages, P, DI]` indexer keys. Either store may instead be quantized (docs/design.md §4,
`numeric_formats.QuantizedRows` of the same `[num_pages, P, ...]` shape: FP8 latent tiles + fp32 scales + the RoPE part
unquantized, or MXFP8 indexer keys + E8M0 scales); every kernel then gathers the quantized pages / rows it reads and
dequantizes exactly those (`read_pages`, `read_rows`) into the query dtype, so the math after the read is the BF16
path's (on CPU an MXFP8 / FP8 GEMM is emulated as dequantize + GEMM, docs/quantization.md §3). On the `npu` backend
the model-dtype `kv_pages` are `numeric_formats.SplitRows` (latent and RoPE planes, the layout torch_npu's attention
reads in place, docs/backends.md §2); the other kernels read them as concatenated rows.
`block_table` int `[B, max_pages]`, logical token `s` of sequence `b` in page `block_table[b, s // P]`, slot `s % P`,
unused entries -1. All sequences of a call hold `num_keys` tokens (left padding is described by `key_padding_mask`).
A query at position `p` sees the keys `s <= p` that are not padding; queries of a call sit at `query_start + i`.
Every backend's paged kernels take these as one argument, `PagedKeys` (below): the contract is stated there once.

Legend: `B` batch, `T` queries, `S` keys (`num_keys`), `P` page size, `H` MLA heads, `HI` indexer heads, `DI`
indexer head dim, `C` kv_lora_rank, `R` qk_rope_head_dim (0 for NoPE), `K` selected keys per query.
"""

from typing import Any, NamedTuple

import torch

from .numeric_formats import PLANAR_ROWS, stored_planes


class PagedKeys(NamedTuple):
    """The paged keys a DSA / MLA read kernel takes: one argument, the same for every backend (kernels.py,
    docs/backends.md §1), as vLLM hands its attention backends one metadata object. The layer builds it from the
    store's page view (dsa.py, docs/dsa.md §14).

    - `pages`: the plane read: `index_pages` `[N, P, DI]` for the indexer, `kv_pages` `[N, P, C + R]` for attention
      (or quantized / split planes of that geometry); for the k-pool indexer the per-token `[key | gate]` rows
      `[N, P, 2·DI]`, which only the reference reads.
    - `block_table`: int `[B, max_pages]`; None for the fixed-shape `static_*` kernels: the pages in sequence order.
    - `num_keys`: cached tokens per sequence (an int; a 0-d int64 tensor for the `static_*` kernels).
    - `query_start`: the position of the first query (an int, or a 0-d tensor as `num_keys`). Sparse attention reads
      neither (nor the mask): its indices say which keys each query reads.
    - `key_padding_mask`: bool `[B, num_keys]` (for `static_*`: `[B, L]`, padded to the capacity), True = real key;
      None = no padding.
    - `pool_pages`, `pool_origin`: the k-pool store's pooled keys `[N, P // kp, DI]`, and each sequence's first real
      token int64 `[B]` as the store keeps it (None: found from the mask, as the `static_*` kernel always does).
    """

    pages: Any
    block_table: torch.Tensor | None
    num_keys: int | torch.Tensor | None = None
    query_start: int | torch.Tensor = 0
    key_padding_mask: torch.Tensor | None = None
    pool_pages: Any = None
    pool_origin: torch.Tensor | None = None


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def page_geometry(pages) -> tuple[int, int, int]:
    """`(num_pages, page_size, row width)` of plain pages `[N, P, W]` or planar ones (`QuantizedRows`, `SplitRows`)."""
    if isinstance(pages, PLANAR_ROWS):
        return (*pages[0].shape[:2], pages.width)
    if pages.dim() != 3:
        raise ValueError(f"pages must be [num_pages, page_size, width], got shape {tuple(pages.shape)}")
    return tuple(pages.shape)


def is_paged(pages) -> bool:
    return isinstance(pages, PLANAR_ROWS) or pages.dim() == 3


def read_pages(pages, page_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pages `page_ids` `[n]` as values `[n, P, W]`: plain pages as they are stored, quantized pages dequantized
    into `dtype` (only the pages read)."""
    if isinstance(pages, PLANAR_ROWS):
        return pages.map(lambda part: part.index_select(0, page_ids)).dequantize(dtype)
    return pages.index_select(0, page_ids)


def sequence_rows(pages, block_table: torch.Tensor | None, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """Every slot of every sequence, `[B, n·P, W]` values. block_table `[B, n]`: the pages are gathered (a copy of
    the whole pool). None: the pages are in sequence order, sequence `b` owning pages `b·n … b·n + n - 1` (the static
    store's fixed mapping), so plain pages are read in place, as a view of the pool (docs/graph-mode.md §3)."""
    if block_table is not None:
        return read_pages(pages, block_table.reshape(-1), dtype).view(batch, -1, page_geometry(pages)[2])
    values = pages.dequantize(dtype) if isinstance(pages, PLANAR_ROWS) else pages
    return values.view(batch, -1, values.shape[-1])


def read_rows(pages, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows at flat slot ids `slots` `[n]` (`page * P + offset`) as values `[n, W]`: plain rows as stored, quantized
    rows gathered with their scales and dequantized into `dtype` (only the rows read)."""
    if isinstance(pages, PLANAR_ROWS):
        return pages.map(lambda part: part.flatten(0, 1).index_select(0, slots)).dequantize(dtype)
    return pages.view(-1, pages.shape[-1]).index_select(0, slots)


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


# ----------------------------------------------------------------------------------------------------------------
# Input checks (shared by all backends; they run eagerly, before any compiled code)


def check_block_table(pages: torch.Tensor, block_table: torch.Tensor, num_tokens: int, batch: int, name: str):
    """block_table must be an integer `[batch, max_pages]` table that maps the first `num_tokens` tokens of every
    sequence to existing pages of `pages` `[num_pages, P, width]` (or quantized pages of that geometry)."""
    if not isinstance(pages, PLANAR_ROWS) and pages.dim() != 3:
        raise ValueError(f"{name} must be [num_pages, page_size, width], got shape {tuple(pages.shape)}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be an int64 (or int32) [batch, max_pages] tensor, got {block_table.dtype} "
            f"shape {tuple(block_table.shape)}"
        )
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, expected batch={batch}")
    num_pages, page_size, _ = page_geometry(pages)
    capacity = block_table.shape[1] * page_size
    if num_tokens < 0 or num_tokens > capacity:
        raise ValueError(
            f"num_keys={num_tokens} does not fit the block table: {block_table.shape[1]} pages of {page_size} tokens "
            f"hold {capacity}"
        )
    if torch.compiler.is_compiling():
        return  # the value checks below are host syncs; a compiled graph trusts the cache (docs/graph-mode.md §1)
    used = block_table[:, : ceil_div(num_tokens, page_size)]
    if ((used < 0) | (used >= num_pages)).any():
        raise ValueError(
            f"block_table maps some of the first {num_tokens} tokens to no page (-1) or to a page id >= "
            f"num_pages={num_pages}"
        )


def check_key_range(batch: int, keys: PagedKeys, pages_name: str | None) -> None:
    """`query_start`, the block table over `keys.pages` (named `pages_name` in errors; None = checked elsewhere) and
    the padding mask: what every read over the first `num_keys` keys checks."""
    if keys.query_start < 0:
        raise ValueError(f"query_start must be >= 0, got {keys.query_start}")
    if pages_name is not None:
        check_block_table(keys.pages, keys.block_table, keys.num_keys, batch, pages_name)
    padding = keys.key_padding_mask
    if padding is not None and tuple(padding.shape) != (batch, keys.num_keys):
        raise ValueError(
            f"key_padding_mask must have shape (batch, num_keys) = {(batch, keys.num_keys)}, got {tuple(padding.shape)}"
        )


def check_indexer_inputs(q_index, weights, keys: PagedKeys, index_topk: int, pages_name: str | None = "index_pages"):
    """The indexer's inputs; `pages_name` None: `keys.pages` is not the indexer's key plane (the k-pool indexer's)."""
    if q_index.dim() != 4:
        raise ValueError(f"q_index must be [batch, queries, index_heads, index_head_dim], got {tuple(q_index.shape)}")
    if tuple(weights.shape) != tuple(q_index.shape[:3]):
        raise ValueError(f"weights must have shape {tuple(q_index.shape[:3])}, got {tuple(weights.shape)}")
    width = page_geometry(keys.pages)[-1] if is_paged(keys.pages) else None
    if pages_name is not None and width is not None and width != q_index.shape[-1]:
        raise ValueError(f"index_pages width {width} != q_index head dim {q_index.shape[-1]} (index_head_dim)")
    if index_topk <= 0:
        raise ValueError(f"index_topk must be > 0, got {index_topk}")
    check_key_range(q_index.shape[0], keys, pages_name)


def check_latent_queries(q_latent, q_pe, kv_pages) -> None:
    """Absorbed MLA queries `[B, T, H, C]` / `[B, T, H, R]` against `[c | k_pe]` pages `[N, P, C + R]`."""
    if q_latent.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_latent.shape[:3]:
        raise ValueError(
            f"q_latent [B, T, H, C] and q_pe [B, T, H, R] must agree on B, T, H, got {tuple(q_latent.shape)} and "
            f"{tuple(q_pe.shape)}"
        )
    width = q_latent.shape[-1] + q_pe.shape[-1]
    if not is_paged(kv_pages) or page_geometry(kv_pages)[-1] != width:
        shape = page_geometry(kv_pages) if is_paged(kv_pages) else tuple(kv_pages.shape)
        raise ValueError(
            f"kv_pages must be [num_pages, page_size, C + R = {width}] (kv_lora_rank + qk_rope_head_dim), got {shape}"
        )


def check_sparse_inputs(q_latent, q_pe, keys: PagedKeys, indices) -> None:
    check_latent_queries(q_latent, q_pe, keys.pages)
    if indices.dim() != 3 or tuple(indices.shape[:2]) != tuple(q_latent.shape[:2]) or indices.is_floating_point():
        raise ValueError(f"indices must be integer [B, T, K] with B, T of q_latent, got {tuple(indices.shape)}")
    kv_pages, block_table = keys.pages, keys.block_table
    if not all(part.is_contiguous() for part in stored_planes(kv_pages)):
        raise ValueError("kv_pages must be contiguous: the fused kernel reads its rows by flat slot id")
    check_block_table(kv_pages, block_table, 0, q_latent.shape[0], "kv_pages")
    if torch.compiler.is_compiling():
        return  # host sync below; see check_block_table
    # Every selected key must sit in a mapped page: reading page 0 instead would be a silent wrong answer.
    num_pages, page_size, _ = page_geometry(kv_pages)
    capacity = block_table.shape[1] * page_size
    logical_pages = (indices.clamp(0, capacity - 1) // page_size).flatten(1)
    physical_pages = block_table.gather(1, logical_pages).view_as(indices)
    unmapped = (indices >= capacity) | ((indices >= 0) & ((physical_pages < 0) | (physical_pages >= num_pages)))
    if unmapped.any():
        raise ValueError("indices select keys whose page the block table does not map (-1 or beyond the table)")


def check_kpool_inputs(q_index, weights, keys: PagedKeys, index_topk: int, ape) -> None:
    if ape is None or ape.dim() != 2 or ape.shape[1] != q_index.shape[-1]:
        raise ValueError(
            f"ape must be [index_kpool, index_head_dim={q_index.shape[-1]}], "
            f"got {None if ape is None else tuple(ape.shape)}"
        )
    kpool, head_dim = ape.shape
    num_pages, page_size, width = page_geometry(keys.pages)
    if width != 2 * head_dim or page_geometry(keys.pool_pages) != (num_pages, page_size // kpool, head_dim):
        raise ValueError(
            f"k-pool stores must be index_pages [N, P, 2·DI] (key | gate) and pool_pages [N, P // index_kpool, DI]; "
            f"got {page_geometry(keys.pages)} and {page_geometry(keys.pool_pages)} for index_kpool={kpool}, "
            f"DI={head_dim}"
        )
    if index_topk % kpool:
        raise ValueError(f"index_topk ({index_topk}) must be a multiple of index_kpool ({kpool})")
    # The generic checks, on the pooled geometry's token view (same block table, DI-wide rows).
    check_indexer_inputs(q_index, weights, keys, index_topk, pages_name=None)
    check_block_table(keys.pages, keys.block_table, keys.num_keys, q_index.shape[0], "index_pages")


def check_dense_inputs(q_latent, q_pe, keys: PagedKeys) -> None:
    check_latent_queries(q_latent, q_pe, keys.pages)
    check_key_range(q_latent.shape[0], keys, "kv_pages")


__all__ = [
    "PagedKeys",
    "ceil_div",
    "check_block_table",
    "check_dense_inputs",
    "check_indexer_inputs",
    "check_key_range",
    "check_kpool_inputs",
    "check_latent_queries",
    "check_sparse_inputs",
    "gather_pages",
    "is_paged",
    "page_geometry",
    "read_pages",
    "read_rows",
    "sequence_rows",
]
