"""DSA kernels over a paged cache: Lightning Indexer top-k and sparse MLA that read `KDSACache` pages directly, and
the dense causal MLA of the indexer-less layers (docs/dsa.md §8).

docs/dsa.md §4 (logical indices, physical slot `block_table[b, s // P] * P + s % P`; vLLM's pipeline: paged logits,
then top-k), §3 (absorbed sparse MLA: gather the selected `[c | k_pe]` rows, softmax over them), §5 (prefill vs
decode), §6 (-1 sentinel, rows without a valid key give 0), §7 (never materialise the `[T, S]` logits; an exact
fused score + top-k was proposed in vLLM RFC #53563).

Three implementations with the same signatures, registered per backend in `kernels.py` (docs/backends.md §1):
- `torch` (`paged_*_reference`): gather the pages into contiguous tensors, then run dsa_ops' reference kernels.
  Readable and exact: the oracle for the others.
- `cpu` (`paged_*_fused`): the indexer scores, weights and selects in one pass over blocks of pages with a running
  top-k, so memory does not grow with the context; sparse attention gathers only the selected rows from the pages.
- `compiled`: the same code with its per-block work compiled by `torch.compile` (inductor), cached on disk.

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

Legend: `B` batch, `T` queries, `S` keys (`num_keys`), `P` page size, `H` MLA heads, `HI` indexer heads, `DI`
indexer head dim, `C` kv_lora_rank, `R` qk_rope_head_dim (0 for NoPE), `K` selected keys per query.
"""

import os

import torch
import torch.fx.experimental._config

from .cpu_indexer import decode_kernel_applies, indexer_topk_decode
from .cpu_sparse_mla import decode_kernel_applies as sparse_decode_kernel_applies
from .cpu_sparse_mla import sparse_mla_decode_cpu
from .dsa_ops import (
    ScoredPairs,
    dense_mla_attention,
    indexer_topk,
    kpool_expand,
    kpool_indexer_topk,
    kpool_origin,
    scaled_index_weights,
    sparse_mla_attention,
)
from .linear_ops import product
from .numeric_formats import PLANAR_ROWS, stored_planes

# Bound on what the indexer holds per key block and sequence, the gathered keys `[n, DI]` (none when the block's
# pages are consecutive in the pool: the keys are then a view, see `_consecutive_pages`) plus the products
# `[T, HI, n]`: 2M elements whatever the context length (in bf16 the products are held twice, as the GEMM's bf16
# output and its fp32 copy: about 12 MiB per block). Blocks are as large as this allows because every block
# costs a fixed ~20 small ops and a top-k merge: a decode step (T = 1, HI 8, DI 64) reads 455 pages per block when
# it copies them, 4096 (a 256k context in one block) when they are consecutive; a prefill block of 128 queries 30
# or 32 pages.
KEY_BLOCK_ELEMENTS = 1 << 21

# Bound on the selected `[c | k_pe]` rows that sparse attention gathers at once: 4M elements (8 MiB in bf16), i.e.
# 28 queries at K = 512, C + R = 288. Prefill blocks are split into chunks of queries this size: besides bounding
# memory, this is 4x faster than one 128-query gather, because a fresh allocation above glibc's 32 MiB mmap
# threshold page-faults in on every call while smaller ones are reused from the heap.
ATTENTION_ROWS_ELEMENTS = 1 << 22

# Bound on one dense-MLA key block: its scores `[T, H, n]` and its rows `[n, C + R]` each stay within 1M elements per
# sequence, and the fp32 accumulator `[T, H, C]` of a chunk of queries too, whatever the context. Small enough to stay
# in the core's cache between the block's passes: the rows are read twice (scores, then values; 2 MiB in bf16, 3640
# rows of C + R = 288) and the fp32 scores several times (4 MiB). Against 4M-element blocks, on one thread: a 64k-key
# decode step (16 heads) 19-20 -> 8.1-8.9 ms per layer in an ad-hoc timing, a 128-query prefill block at 16k keys
# 215 -> 87 ms (scripts/bench_dsa_kernels.py). Gathering a block's pages still beats reading consecutive pages in
# place, whose rows then come from memory twice (10-11 ms at 64k).
DENSE_BLOCK_ELEMENTS = 1 << 20

# Running top-k keys (see `_pack_scores`): the score's order-preserving int32 image in the high 32 bits, the
# reversed key position in the low 32 bits. Keys below this bound carry the score -inf (masked key).
_LOW_BITS = 0xFFFFFFFF
_NEG_INF_ORDERED = -int(torch.tensor(float("inf")).view(torch.int32))  # minus the magnitude bits of inf
_MASKED_KEY_BOUND = (_NEG_INF_ORDERED + 1) * (1 << 32)

# Where inductor's FX graph and AOTAutograd caches live unless the user set TORCHINDUCTOR_CACHE_DIR.
DEFAULT_COMPILE_CACHE_DIR = os.path.join("~", ".cache", "kdsa", "torchinductor")


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def page_geometry(pages) -> tuple[int, int, int]:
    """`(num_pages, page_size, row width)` of plain pages `[N, P, W]` or planar ones (`QuantizedRows`, `SplitRows`)."""
    if isinstance(pages, PLANAR_ROWS):
        return (*pages[0].shape[:2], pages.width)
    if pages.dim() != 3:
        raise ValueError(f"pages must be [num_pages, page_size, width], got shape {tuple(pages.shape)}")
    return tuple(pages.shape)


def _is_paged(pages) -> bool:
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


# ----------------------------------------------------------------------------------------------------------------
# Input checks (shared by all backends; they run eagerly, before any compiled code)


def _check_block_table(pages: torch.Tensor, block_table: torch.Tensor, num_tokens: int, batch: int, name: str):
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
    used = block_table[:, : _ceil_div(num_tokens, page_size)]
    if ((used < 0) | (used >= num_pages)).any():
        raise ValueError(
            f"block_table maps some of the first {num_tokens} tokens to no page (-1) or to a page id >= "
            f"num_pages={num_pages}"
        )


def _check_indexer_inputs(q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, padding):
    if q_index.dim() != 4:
        raise ValueError(f"q_index must be [batch, queries, index_heads, index_head_dim], got {tuple(q_index.shape)}")
    if tuple(weights.shape) != tuple(q_index.shape[:3]):
        raise ValueError(f"weights must have shape {tuple(q_index.shape[:3])}, got {tuple(weights.shape)}")
    if index_pages is not None and _is_paged(index_pages) and page_geometry(index_pages)[-1] != q_index.shape[-1]:
        raise ValueError(
            f"index_pages width {page_geometry(index_pages)[-1]} != q_index head dim {q_index.shape[-1]} "
            "(index_head_dim)"
        )
    if index_topk <= 0:
        raise ValueError(f"index_topk must be > 0, got {index_topk}")
    if query_start < 0:
        raise ValueError(f"query_start must be >= 0, got {query_start}")
    if index_pages is not None:
        _check_block_table(index_pages, block_table, num_keys, q_index.shape[0], "index_pages")
    if padding is not None and tuple(padding.shape) != (q_index.shape[0], num_keys):
        raise ValueError(
            f"key_padding_mask must have shape (batch, num_keys) = {(q_index.shape[0], num_keys)}, "
            f"got {tuple(padding.shape)}"
        )


def _check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices):
    if q_latent.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_latent.shape[:3]:
        raise ValueError(
            f"q_latent [B, T, H, C] and q_pe [B, T, H, R] must agree on B, T, H, got {tuple(q_latent.shape)} and "
            f"{tuple(q_pe.shape)}"
        )
    if indices.dim() != 3 or tuple(indices.shape[:2]) != tuple(q_latent.shape[:2]) or indices.is_floating_point():
        raise ValueError(f"indices must be integer [B, T, K] with B, T of q_latent, got {tuple(indices.shape)}")
    width = q_latent.shape[-1] + q_pe.shape[-1]
    if not _is_paged(kv_pages) or page_geometry(kv_pages)[-1] != width:
        shape = page_geometry(kv_pages) if _is_paged(kv_pages) else tuple(kv_pages.shape)
        raise ValueError(
            f"kv_pages must be [num_pages, page_size, C + R = {width}] (kv_lora_rank + qk_rope_head_dim), got {shape}"
        )
    if not all(part.is_contiguous() for part in stored_planes(kv_pages)):
        raise ValueError("kv_pages must be contiguous: the fused kernel reads its rows by flat slot id")
    _check_block_table(kv_pages, block_table, 0, q_latent.shape[0], "kv_pages")
    if torch.compiler.is_compiling():
        return  # host sync below; see _check_block_table
    # Every selected key must sit in a mapped page: reading page 0 instead would be a silent wrong answer.
    num_pages, page_size, _ = page_geometry(kv_pages)
    capacity = block_table.shape[1] * page_size
    logical_pages = (indices.clamp(0, capacity - 1) // page_size).flatten(1)
    physical_pages = block_table.gather(1, logical_pages).view_as(indices)
    unmapped = (indices >= capacity) | ((indices >= 0) & ((physical_pages < 0) | (physical_pages >= num_pages)))
    if unmapped.any():
        raise ValueError("indices select keys whose page the block table does not map (-1 or beyond the table)")


# ----------------------------------------------------------------------------------------------------------------
# Reference: gather the pages, then the contiguous dsa_ops kernels


def gather_pages(pages, block_table: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Contiguous copy of the first `num_tokens` tokens of every sequence (docs/dsa.md §4).

    pages: `[num_pages, P, width]` or quantized pages (dequantized into `dtype`, required then); block_table: int
    `[B, max_pages]`. Returns `[B, num_tokens, width]`.
    """
    _check_block_table(pages, block_table, num_tokens, block_table.shape[0], "pages")
    batch = block_table.shape[0]
    used = block_table[:, : _ceil_div(num_tokens, page_geometry(pages)[1])]
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
    _check_indexer_inputs(
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
    _check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices)
    # Only the tokens up to the last selected one are needed.
    num_tokens = int(indices.max()) + 1 if indices.numel() else 0
    if num_tokens == 0:
        return q_latent.new_zeros(q_latent.shape)  # no valid key anywhere: every row gives 0 (§6)
    rows = gather_pages(kv_pages, block_table, num_tokens, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    return sparse_mla_attention(q_latent, q_pe, latent, k_pe, indices, softmax_scale)


# ----------------------------------------------------------------------------------------------------------------
# Fused CPU kernels


def _pack_scores(scores: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """One int64 per score whose descending order is (score descending, key position ascending).

    scores: fp32 `[B, T, n]` (-inf = not visible); key_positions: int64 `[n]`. With unique keys, `topk` selects
    and orders exactly like the reference's stable sort, ties included (dsa_ops.select_topk: equal scores ->
    earlier key first), and a running top-k over blocks is exact: the top k of a union is the top k of the
    union of the parts' top k. A stable sort would do the same but costs ~6x more per block than `topk`.
    """
    bits = scores.view(torch.int32)
    # IEEE floats order like sign-magnitude integers: the magnitude bits times the sign (`bits >> 31 | 1` is -1 for
    # negative values, 1 otherwise) order like the floats, and -0.0 and +0.0 both give 0, as equal as the
    # reference's sort treats them (w · ReLU(q·k) = 0 carries the sign of w).
    ordered = (bits & 0x7FFFFFFF) * ((bits >> 31) | 1)
    return ordered.to(torch.int64) * (1 << 32) + (_LOW_BITS - key_positions)


def _unpack_indices(packed: torch.Tensor) -> torch.Tensor:
    """Key positions from `_pack_scores` keys; -1 where the score was -inf (not visible)."""
    positions = _LOW_BITS - (packed & _LOW_BITS)
    return positions.masked_fill(packed < _MASKED_KEY_BOUND, -1)


def _weighted_head_scores(q_index: torch.Tensor, scaled_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`Σ_h scaled_weights[h] · ReLU(q[h]·k)` fp32 `[B, T, n]` for keys `[B, n, DI]`.

    In bf16 a single query (a decode step) takes the all-heads GEMM as `keys @ qᵀ`, the keys as its row operand, read
    in place; more queries (prefill) take `q @ keysᵀ`, whose `[T·HI, n]` result the head sum reads without a copy
    (docs/graph-mode.md §9)."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    keys_t = keys.transpose(1, 2)  # [B, DI, n]
    if q_index.dtype == torch.float32:
        # One GEMM per head and the heads added one by one in the reference's order, the shapes
        # dsa_ops.indexer_scores uses: fp32 products and sums are then bit-identical to the reference's (a single
        # [T*HI, DI] GEMM would sum in another order for T = 1), so the top-k is exact.
        scores = None
        for head in range(num_heads):
            head_scores = torch.relu(torch.bmm(q_index[:, :, head], keys_t)) * scaled_weights[:, :, head, None]
            scores = head_scores if scores is None else scores + head_scores
        return scores
    # bf16: one GEMM for all heads (a per-head GEMV is ~7x slower in bf16 on CPU), its bf16 products made fp32, then
    # ReLU and the weighted head sum as one batched fp32 product `[1, HI] @ [HI, n]` per query: 4 ops whatever HI,
    # half the time of a loop over heads (the head sum's order is the GEMM's; bf16 is not bit-exact anyway).
    if num_queries == 1:
        products = product(torch.bmm, keys, q_index.flatten(1, 2).transpose(1, 2)).float().relu_()  # [B, n, HI]
        products = products.transpose(1, 2).unsqueeze(1)  # [B, 1, HI, n]
    else:
        products = product(torch.bmm, q_index.flatten(1, 2), keys_t).float().relu_()
        products = products.view(batch, num_queries, num_heads, -1)
    return torch.matmul(scaled_weights[:, :, None, :], products).squeeze(2)


def _score_block(
    q_index: torch.Tensor,
    scaled_weights: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    last_visible_key: torch.Tensor,
    key_padding: torch.Tensor | None,
) -> torch.Tensor:
    """Indexer logits of one block of keys, masked and packed for the running top-k (docs/dsa.md §1).

    q_index: `[B, T, HI, DI]`; scaled_weights: fp32 `[B, T, HI]` (head weights times `HI^-0.5 · DI^-0.5`); keys:
    `[B, n, DI]`; key_positions: int64 `[n]`; last_visible_key: int64 `[T]`, query `t` sees the keys at positions
    `<= last_visible_key[t]` (causal limit and end of the context); key_padding: bool `[B, n]` or None.
    Returns int64 `[B, T, n]` (`_pack_scores`).
    """
    scores = _weighted_head_scores(q_index, scaled_weights, keys)
    hidden = (key_positions[None, :] > last_visible_key[:, None])[None]  # [1, T, n]
    if key_padding is not None:
        hidden = hidden | ~key_padding[:, None, :]
    return _pack_scores(scores.masked_fill_(hidden, float("-inf")), key_positions)


def _key_block_pages(num_queries: int, num_heads: int, head_dim: int, page_size: int, copies_keys: bool) -> int:
    """Pages per indexer key block: the products `[T, HI, n]`, plus the keys `[n, DI]` when the block copies them,
    stay within KEY_BLOCK_ELEMENTS."""
    per_key = num_queries * num_heads + (head_dim if copies_keys else 0)
    return max(1, KEY_BLOCK_ELEMENTS // (per_key * page_size))


def _consecutive_pages(block_table: torch.Tensor, num_pages: int) -> int | None:
    """The first page id when the block table has one sequence whose first `num_pages` pages are consecutive ids
    (`first, first + 1, ...`: what the store hands a single sequence that grew without crops or shared pages), so
    that a block of pages is a slice of the pool; None otherwise. A host read, skipped (None) while compiling."""
    if block_table.shape[0] != 1 or num_pages == 0 or torch.compiler.is_compiling():
        return None
    used = block_table[0, :num_pages]
    first = int(used[0])
    consecutive = torch.arange(first, first + num_pages, dtype=used.dtype, device=used.device)
    return first if torch.equal(used, consecutive) else None


def _blocked_indexer_topk(
    q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, score_block
) -> torch.Tensor:
    """Score + weight + top-k in one pass over blocks of pages with a running top-k; `score_block` is
    `_score_block` or its compiled version. Inputs already checked."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    page_size = page_geometry(index_pages)[1]
    # Keys after the block's last query are never visible: they are not read at all.
    num_visible = min(num_keys, query_start + num_queries)
    num_selected = min(index_topk, num_visible)
    if num_selected == 0:
        return torch.empty(batch, num_queries, 0, dtype=torch.int64, device=q_index.device)
    q_index = q_index.contiguous()  # the same strides on every call (a compiled block step never recompiles)
    scaled_weights = scaled_index_weights(weights, head_dim)
    query_positions = torch.arange(query_start, query_start + num_queries, device=q_index.device)
    last_visible_key = query_positions.clamp(max=num_visible - 1)
    # Blocks are whole pages: the keys after the context's end in its last page are read but never visible.
    num_pages_read = _ceil_div(num_visible, page_size)
    if key_padding_mask is not None:
        key_padding_mask = torch.nn.functional.pad(
            key_padding_mask[:, :num_visible].bool(), (0, num_pages_read * page_size - num_visible)
        )

    # Plain pages that are consecutive in the pool are read in place; quantized ones are dequantized (a copy) anyway.
    in_place = not isinstance(index_pages, PLANAR_ROWS) and index_pages.is_contiguous()
    first_pool_page = _consecutive_pages(block_table, num_pages_read) if in_place else None
    copies_keys = first_pool_page is None
    pages_per_block = _key_block_pages(num_queries, num_heads, head_dim, page_size, copies_keys)
    best = None  # packed keys [B, T, <= num_selected], best first
    for first_page in range(0, num_pages_read, pages_per_block):
        last_page = min(first_page + pages_per_block, num_pages_read)
        if copies_keys:
            # One index_select per block copies its pages (never the whole context) into a contiguous [B, n, DI].
            page_ids = block_table[:, first_page:last_page].reshape(-1)
            keys = read_pages(index_pages, page_ids, q_index.dtype)
        else:
            # Consecutive pages: the block is a slice of the pool, scored in place (the copy is a second pass over
            # every key, ~0.3 ms of a 64k decode step on one core).
            keys = index_pages[first_pool_page + first_page : first_pool_page + last_page]
        keys = keys.view(batch, -1, head_dim)
        block = slice(first_page * page_size, last_page * page_size)
        key_positions = torch.arange(block.start, block.stop, device=q_index.device)
        # Contiguous, so that every block has the same strides (a compiled block step never recompiles for them).
        key_padding = None if key_padding_mask is None else key_padding_mask[:, block].contiguous()
        packed = score_block(q_index, scaled_weights, keys, key_positions, last_visible_key, key_padding)
        ScoredPairs.add(packed)
        if best is not None:
            packed = torch.cat([best, packed], dim=-1)
        best = packed.topk(min(num_selected, packed.shape[-1]), dim=-1).values
    return _unpack_indices(best)


def paged_indexer_topk_fused(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    index_topk: int,
    query_start: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused paged indexer: scores, head weighting and top-k in one pass over blocks of pages (docs/dsa.md
    §4, §7), same signature and result as `paged_indexer_topk_reference`.

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]` fp32; index_pages `[num_pages, P, DI]`; block_table int `[B,
    max_pages]`; key_padding_mask `[B, num_keys]` or None. Returns int64 `[B, T, min(index_topk, S')]`,
    `S' = min(num_keys, query_start + T)`.

    Keys are read in blocks of whole pages (one `index_select` each, or a slice of the pool when a single sequence's
    pages are consecutive, docs/dsa.md §7; at most KEY_BLOCK_ELEMENTS products per sequence) and merged into a
    running top-k, so the `[T, S]` logits are never materialised. fp32 inputs give
    exactly the reference's indices (same products, same head order, same tie rule). bf16 inputs multiply q·k in
    bf16 (fp32 accumulation inside the GEMM, bf16 result) and do ReLU, weighting and the head sum in fp32. A bf16
    decode step, and up to MAX_KERNEL_QUERIES queries per sequence (a verification, each query a row masked past its
    own position), go through the C++ kernel where it applies (`cpu_indexer`, docs/dsa.md §11).
    """
    _check_indexer_inputs(
        q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask
    )
    num_queries = q_index.shape[1]
    num_visible = min(num_keys, query_start + num_queries)  # the keys up to the last query
    num_selected = min(index_topk, num_visible)
    if num_selected > 0 and num_queries == 1 and decode_kernel_applies(q_index, index_pages):
        # A decode step: the hand-written kernel reads the pages through the block table (docs/dsa.md §11).
        visible = torch.tensor(num_visible)
        return _decode_topk_cpu(q_index, weights, index_pages, block_table, visible, key_padding_mask, num_selected)
    few_queries = 1 < num_queries <= MAX_KERNEL_QUERIES
    if num_selected > 0 and few_queries and decode_kernel_applies(q_index[:, :1], index_pages):
        # A few queries (a verification of drafted tokens): the same kernel, each query a row of its own.
        return _queries_topk_cpu(
            q_index, weights, index_pages, block_table, num_visible, query_start, key_padding_mask, num_selected
        )
    return _blocked_indexer_topk(
        q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, _score_block
    )


# The most queries per sequence the CPU decode kernels (`cpu_indexer`, `cpu_sparse_mla`) take as rows of their own: a
# verification of up to 15 drafted tokens and the anchor. More (a prefill) keep the blocked torch paths, which read
# each key once for all queries.
MAX_KERNEL_QUERIES = 16


def _queries_topk_cpu(q_index, weights, index_pages, block_table, num_visible, query_start, key_padding_mask, width):
    """`_decode_topk_cpu` for T queries `[B, T, HI, DI]` at cache positions `query_start …`: the B·T queries are rows of
    one kernel call over the first `num_visible` keys, each row's later keys masked as padding (query t sees the keys up
    to `query_start + t`, and the sequence's own padding), so each row selects what a decode step at its position
    would. Returns int64 `[B, T, width]`, -1 where a query sees fewer keys."""
    batch, num_queries = q_index.shape[:2]
    positions = torch.arange(num_visible, device=q_index.device)
    last_key = query_start + torch.arange(num_queries, device=q_index.device)
    visible = (positions[None, :] <= last_key[:, None]).expand(batch, num_queries, num_visible)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, :num_visible].bool()
    rows = batch * num_queries
    selected = _decode_topk_cpu(
        q_index.reshape(rows, 1, *q_index.shape[2:]), weights.reshape(rows, 1, -1), index_pages,
        block_table.repeat_interleave(num_queries, dim=0), torch.tensor(num_visible),
        visible.reshape(rows, num_visible), width,
    )  # fmt: skip
    return selected.view(batch, num_queries, width)


def _decode_topk_cpu(q_index, weights, index_pages, block_table, num_visible, key_padding_mask, num_selected):
    """`cpu_indexer.indexer_topk_decode` for q_index `[B, 1, HI, DI]`: int64 `[B, 1, num_selected]`, best first, -1
    where fewer keys are visible; the head weights scaled as `_blocked_indexer_topk` scales them."""
    scaled_weights = scaled_index_weights(weights[:, 0], q_index.shape[-1]).contiguous()
    padding = None if key_padding_mask is None else key_padding_mask.bool().contiguous()
    selected = indexer_topk_decode(
        q_index[:, 0].contiguous(), scaled_weights, index_pages, block_table.long().contiguous(), num_visible,
        padding, num_selected, num_selected,
    )  # fmt: skip
    return selected.unsqueeze(1)


def _score_pool_block(
    q_index: torch.Tensor,
    scaled_weights: torch.Tensor,
    keys: torch.Tensor,
    pool_ends: torch.Tensor,
    last_visible_key: torch.Tensor,
    first_pool_end: torch.Tensor,
) -> torch.Tensor:
    """k-pool indexer logits of one block of pooled keys, masked and packed (docs/dsa.md §9).

    keys: pooled keys `[B, n, DI]`; pool_ends: int64 `[B, n]` the last token of each pool slot; a query `t` sees a
    slot when `first_pool_end[b] <= end <= last_visible_key[t]` (slots before a sequence's first pool hold nothing).
    Returns int64 `[B, T, n]` (`_pack_scores` with the pool end as the key position).
    """
    scores = _weighted_head_scores(q_index, scaled_weights, keys)
    visible = (pool_ends[:, None, :] <= last_visible_key[None, :, None]) & (pool_ends >= first_pool_end[:, None])[
        :, None, :
    ]
    scores = scores.masked_fill(~visible, float("-inf"))
    return _pack_scores(scores, pool_ends[:, None, :])


def _check_kpool_inputs(q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
                        padding, ape):  # fmt: skip
    if ape is None or ape.dim() != 2 or ape.shape[1] != q_index.shape[-1]:
        raise ValueError(
            f"ape must be [index_kpool, index_head_dim={q_index.shape[-1]}], "
            f"got {None if ape is None else tuple(ape.shape)}"
        )
    kpool, head_dim = ape.shape
    num_pages, page_size, width = page_geometry(index_pages)
    if width != 2 * head_dim or page_geometry(pool_pages) != (num_pages, page_size // kpool, head_dim):
        raise ValueError(
            f"k-pool stores must be index_pages [N, P, 2·DI] (key | gate) and pool_pages [N, P // index_kpool, DI]; "
            f"got {page_geometry(index_pages)} and {page_geometry(pool_pages)} for index_kpool={kpool}, DI={head_dim}"
        )
    if index_topk % kpool:
        raise ValueError(f"index_topk ({index_topk}) must be a multiple of index_kpool ({kpool})")
    # The generic checks, on the pooled geometry's token view (same block table, DI-wide rows).
    _check_indexer_inputs(q_index, weights, None, block_table, num_keys, index_topk, query_start, padding)
    _check_block_table(index_pages, block_table, num_keys, q_index.shape[0], "index_pages")


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
    _check_kpool_inputs(
        q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
        key_padding_mask, ape,
    )  # fmt: skip
    rows = gather_pages(index_pages, block_table, num_keys, q_index.dtype)
    return kpool_indexer_topk(
        q_index, weights, rows, ape, index_topk, query_start, key_padding_mask, select_tail, origin
    )


def _blocked_kpool_indexer_topk(
    q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape, select_tail,
    origin, score_block,
) -> torch.Tensor:  # fmt: skip
    """Score + weight + running top-k over blocks of pages of stored pooled keys. Inputs already checked."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    kpool = ape.shape[0]
    page_size = page_geometry(pool_pages)[1] * kpool
    num_visible = min(num_keys, query_start + num_queries)
    if origin is None:
        origin = kpool_origin(key_padding_mask, batch, num_visible, q_index.device)
    num_selected = min(index_topk // kpool, num_visible // kpool)
    if num_selected == 0:
        empty = torch.empty(batch, num_queries, 0, dtype=torch.int64, device=q_index.device)
        return kpool_expand(empty, kpool, query_start, origin, select_tail)
    q_index = q_index.contiguous()
    scaled_weights = scaled_index_weights(weights, head_dim)
    query_positions = torch.arange(query_start, query_start + num_queries, device=q_index.device)
    last_visible_key = query_positions.clamp(max=num_visible - 1)
    first_pool_end = origin + kpool - 1
    # Pool ends sit at positions ≡ first_pool_end (mod kp): slot r of a page holds the pool ending in its r-th
    # group of kp tokens (docs/dsa.md §9).
    phase = first_pool_end % kpool
    num_pages_read = _ceil_div(num_visible, page_size)
    pages_per_block = _key_block_pages(num_queries, num_heads, head_dim, page_size // kpool, copies_keys=True)
    best = None
    for first_page in range(0, num_pages_read, pages_per_block):
        last_page = min(first_page + pages_per_block, num_pages_read)
        page_ids = block_table[:, first_page:last_page].reshape(-1)
        keys = read_pages(pool_pages, page_ids, q_index.dtype).view(batch, -1, head_dim)
        group_starts = torch.arange(first_page * page_size, last_page * page_size, kpool, device=q_index.device)
        pool_ends = group_starts[None, :] + phase[:, None]
        packed = score_block(q_index, scaled_weights, keys, pool_ends, last_visible_key, first_pool_end)
        ScoredPairs.add(packed)
        if best is not None:
            packed = torch.cat([best, packed], dim=-1)
        best = packed.topk(min(num_selected, packed.shape[-1]), dim=-1).values
    return kpool_expand(_unpack_indices(best), kpool, query_start, origin, select_tail)


def paged_kpool_indexer_topk_fused(
    q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
    key_padding_mask=None, ape=None, select_tail=True, origin=None,
) -> torch.Tensor:  # fmt: skip
    """Fused k-pool indexer: scores only the stored pooled keys (`pool_pages`, one row per complete pool, written by
    `KDSACache` when a pool's last token arrives), with a running top-k over blocks of pages, so a decode step reads
    `S / kp` keys and never the `[T, S]` logits. Same signature and result as the reference."""
    _check_kpool_inputs(
        q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
        key_padding_mask, ape,
    )  # fmt: skip
    if decode_kernel_applies(q_index, pool_pages):
        return _kpool_decode_topk_cpu(
            q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape,
            select_tail, origin,
        )  # fmt: skip
    return _blocked_kpool_indexer_topk(
        q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape,
        select_tail, origin, _score_pool_block,
    )  # fmt: skip


def _kpool_decode_topk_cpu(
    q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape, select_tail,
    origin,
) -> torch.Tensor:  # fmt: skip
    """`paged_kpool_indexer_topk_fused` for one query per sequence through `cpu_indexer`'s kernel
    (`_kpool_slots_topk_cpu` over the `ceil(num_visible / kp)` slots that can hold a pool ending by the query)."""
    batch, kpool = q_index.shape[0], ape.shape[0]
    num_visible = min(num_keys, query_start + 1)
    if origin is None:
        origin = kpool_origin(key_padding_mask, batch, num_visible, q_index.device)
    num_selected = min(index_topk // kpool, num_visible // kpool)
    if num_selected == 0:
        empty = torch.empty(batch, 1, 0, dtype=torch.int64, device=q_index.device)
        return kpool_expand(empty, kpool, query_start, origin, select_tail)
    return _kpool_slots_topk_cpu(
        q_index, weights, pool_pages, block_table, _ceil_div(num_visible, kpool), num_visible - 1, origin, kpool,
        num_selected, query_start, select_tail,
    )  # fmt: skip


def _kpool_slots_topk_cpu(
    q_index, weights, pool_pages, block_table, num_slots, last_visible_key, origin, kpool, width, query_start,
    select_tail,
) -> torch.Tensor:  # fmt: skip
    """The k-pool selection of one query per sequence with `cpu_indexer`'s kernel: the first `num_slots` pooled-key
    slots of the block table are its keys (slot `s` holds the pool ending at `s·kp + phase`), the visibility rule
    (from each sequence's first pool end up to `last_visible_key`) is its key mask, and the `width` slots it selects
    become pool ends, then token positions (`kpool_expand`)."""
    first_pool_end = origin + kpool - 1
    phase = first_pool_end % kpool
    pool_ends = kpool * torch.arange(num_slots, device=q_index.device)[None, :] + phase[:, None]
    visible = (pool_ends <= last_visible_key) & (pool_ends >= first_pool_end[:, None])
    selected = _decode_topk_cpu(q_index, weights, pool_pages, block_table, torch.tensor(num_slots), visible, width)
    ends = torch.where(selected >= 0, selected * kpool + phase[:, None, None], -1)  # [B, 1, width], -1 = none
    return kpool_expand(ends, kpool, query_start, origin, select_tail)


def paged_kpool_indexer_topk_compiled(
    q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
    key_padding_mask=None, ape=None, select_tail=True, origin=None,
) -> torch.Tensor:  # fmt: skip
    """`paged_kpool_indexer_topk_fused` with the per-block scoring compiled. Same shapes and results."""
    _check_kpool_inputs(
        q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
        key_padding_mask, ape,
    )  # fmt: skip
    return _blocked_kpool_indexer_topk(
        q_index, weights, pool_pages, block_table, num_keys, index_topk, query_start, key_padding_mask, ape,
        select_tail, origin, _compiled("score_pool_block"),
    )  # fmt: skip


def _attend(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sparse attention of one chunk of queries straight from the pages (the part `torch.compile` compiles).

    Shapes as `paged_sparse_mla_fused`; kv_pages contiguous.
    """
    batch, num_queries, num_selected = indices.shape
    _, page_size, width = page_geometry(kv_pages)
    valid = indices >= 0
    # Logical position -> physical slot `page * P + offset` (docs/dsa.md §4); -1 reads token 0, masked below.
    positions = indices.clamp(min=0).flatten(1)  # [B, T*K]
    pages = block_table.gather(1, torch.div(positions, page_size, rounding_mode="floor")).clamp(min=0)
    slots = pages * page_size + positions % page_size
    # Only the selected rows are copied, never the context.
    rows = read_rows(kv_pages, slots.flatten(), q_latent.dtype).view(batch, num_queries, num_selected, width)

    # Scores and the weighted sum as batched GEMMs over the B·T queries in the input dtype; softmax statistics in
    # fp32. `bmm` reads the transposed rows in place (a 4-D `matmul` copies them first). One query per sequence (a
    # decode step) takes the scores as `rows @ queryᵀ`, the rows as the row operand: in a compiled step the other
    # form copied the transposed rows first (as the indexer's keys, docs/graph-mode.md §9); 1.18x for this function
    # compiled, 1.05x eager, at the benchmark shape with the caches evicted (an ad-hoc A/B).
    query = torch.cat([q_latent, q_pe], dim=-1).flatten(0, 1)  # [B·T, H, C + R]
    rows = rows.flatten(0, 1)  # [B·T, K, C + R]
    if num_queries == 1:
        scores = product(torch.bmm, rows, query.transpose(1, 2)).transpose(1, 2)  # [B, H, K]
    else:
        scores = product(torch.bmm, query, rows.transpose(1, 2))  # [B·T, H, K]
    scores = scores.reshape(batch, num_queries, -1, num_selected)  # [B, T, H, K]
    scores = scores.float() * softmax_scale
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    # A row with no valid key would be NaN (all -inf): its weights become 0 and its output 0 (§6).
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
    probs = torch.exp(scores - row_max)
    denominator = probs.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    # Multiply by the whole `[c | k_pe]` rows and drop the k_pe columns afterwards: a GEMM on the strided `c`
    # columns alone makes torch copy them first, which costs 5x the 12% of extra products.
    out = product(torch.bmm, probs.to(rows.dtype).flatten(0, 1), rows).view(batch, num_queries, -1, width)
    return (out[..., : q_latent.shape[-1]].float() / denominator).to(q_latent.dtype)  # [B, T, H, C]


def _chunked_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale, attend) -> torch.Tensor:
    """Runs `attend` (`_attend` or its compiled version) on chunks of queries of ATTENTION_ROWS_ELEMENTS rows."""
    num_queries, num_selected = indices.shape[1:]
    chunk = max(1, ATTENTION_ROWS_ELEMENTS // max(1, num_selected * page_geometry(kv_pages)[-1]))
    outputs = []
    for start in range(0, num_queries, chunk):
        queries = slice(start, start + chunk)
        # Contiguous chunks: every call sees the same strides (a compiled `attend` never recompiles for them).
        outputs.append(
            attend(
                q_latent[:, queries].contiguous(),
                q_pe[:, queries].contiguous(),
                kv_pages,
                block_table,
                indices[:, queries].contiguous(),
                softmax_scale,
            )
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def paged_sparse_mla_fused(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Sparse absorbed MLA reading only the selected rows from the pages (docs/dsa.md §3, §4, §6), same
    signature and result as `paged_sparse_mla_reference`.

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; kv_pages `[num_pages, P, C + R]`; block_table int `[B,
    max_pages]`; indices `[B, T, K]` logical positions, -1 = none. Returns `[B, T, H, C]` in q_latent's dtype.
    Queries are processed in chunks whose gathered rows stay within ATTENTION_ROWS_ELEMENTS (28 queries at K = 512,
    C + R = 288): about 10 MB per chunk in bf16, whatever T and the context length. A bf16 decode step (one query per
    sequence) goes through the C++ kernel where it applies (`cpu_sparse_mla`, docs/dsa.md §12), and so do up to
    MAX_KERNEL_QUERIES queries per sequence (a verification), as rows of one call.
    """
    _check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices)
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
    return _chunked_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale, _attend)


# ----------------------------------------------------------------------------------------------------------------
# Dense causal MLA over the pages (the indexer-less "full_attention" layers, docs/dsa.md §8)


def _check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask):
    if q_latent.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_latent.shape[:3]:
        raise ValueError(
            f"q_latent [B, T, H, C] and q_pe [B, T, H, R] must agree on B, T, H, got {tuple(q_latent.shape)} and "
            f"{tuple(q_pe.shape)}"
        )
    width = q_latent.shape[-1] + q_pe.shape[-1]
    if not _is_paged(kv_pages) or page_geometry(kv_pages)[-1] != width:
        shape = page_geometry(kv_pages) if _is_paged(kv_pages) else tuple(kv_pages.shape)
        raise ValueError(
            f"kv_pages must be [num_pages, page_size, C + R = {width}] (kv_lora_rank + qk_rope_head_dim), got {shape}"
        )
    if query_start < 0:
        raise ValueError(f"query_start must be >= 0, got {query_start}")
    _check_block_table(kv_pages, block_table, num_keys, q_latent.shape[0], "kv_pages")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (q_latent.shape[0], num_keys):
        raise ValueError(
            f"key_padding_mask must have shape (batch, num_keys) = {(q_latent.shape[0], num_keys)}, "
            f"got {tuple(key_padding_mask.shape)}"
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
    _check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask)
    num_visible = min(num_keys, query_start + q_latent.shape[1])
    if num_visible == 0:
        return q_latent.new_zeros(q_latent.shape)
    rows = gather_pages(kv_pages, block_table, num_visible, q_latent.dtype)
    latent, k_pe = rows.split([q_latent.shape[-1], q_pe.shape[-1]], dim=-1)
    padding = None if key_padding_mask is None else key_padding_mask[:, :num_visible]
    return dense_mla_attention(q_latent, q_pe, latent, k_pe, softmax_scale, query_start, padding)


def _dense_block(
    query: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    softmax_scale: float,
    running_max: torch.Tensor,
    running_sum: torch.Tensor,
    accumulator: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One key block of the online softmax (the part `torch.compile` compiles).

    query: `[B, T, H, C + R]` (`[q_latent | q_pe]`); rows: `[B, n, C + R]`; visible: bool `[B or 1, T, n]`;
    running_max / running_sum: fp32 `[B, T, H, 1]` (the max starts at the lowest finite fp32, so that a row that
    has seen no visible key yet never computes `-inf - -inf`); accumulator: fp32 `[B, T, H, C]`, the unnormalised
    output. Returns the three updated.
    """
    batch, num_queries, num_heads, width = query.shape
    latent_width = accumulator.shape[-1]
    # One GEMM for all queries and heads, in the input dtype; softmax statistics in fp32.
    scores = product(torch.bmm, query.view(batch, num_queries * num_heads, width), rows.transpose(1, 2))
    scores = scores.view(batch, num_queries, num_heads, -1).float() * softmax_scale
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
    probs = torch.exp(scores - new_max)
    correction = torch.exp(running_max - new_max)
    running_sum = running_sum * correction + probs.sum(dim=-1, keepdim=True)
    # Whole `[c | k_pe]` rows, then drop the k_pe columns (see `_attend`).
    values = product(torch.bmm, probs.to(rows.dtype).view(batch, num_queries * num_heads, -1), rows)[..., :latent_width]
    accumulator = accumulator * correction + values.view_as(accumulator).float()
    return new_max, running_sum, accumulator


def _dense_softmax_start(batch: int, num_queries: int, num_heads: int, latent_width: int, device) -> tuple:
    """The `(running_max, running_sum, accumulator)` that `_dense_block` starts from (no key seen yet)."""
    running_max = torch.full(
        (batch, num_queries, num_heads, 1), torch.finfo(torch.float32).min, dtype=torch.float32, device=device
    )
    accumulator = torch.zeros(batch, num_queries, num_heads, latent_width, dtype=torch.float32, device=device)
    return running_max, torch.zeros_like(running_max), accumulator


def _dense_softmax_output(running_sum: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
    """The normalised fp32 output of `_dense_block`'s state; a row that saw no key gives 0."""
    return accumulator / running_sum.clamp(min=torch.finfo(torch.float32).tiny)


def _blocked_dense_mla(
    q_latent, q_pe, kv_pages, block_table, num_keys, query_start, softmax_scale, key_padding_mask, block_step
) -> torch.Tensor:
    """Dense MLA in chunks of queries, each an online softmax over blocks of whole pages (`block_step` is
    `_dense_block` or its compiled version). Inputs already checked."""
    batch, num_queries, num_heads, latent_width = q_latent.shape
    _, page_size, width = page_geometry(kv_pages)
    device = q_latent.device
    # Chunks small enough that the accumulator and the scores against one page both fit the bound.
    query_chunk = max(1, DENSE_BLOCK_ELEMENTS // (num_heads * max(width, page_size)))
    outputs = []
    for first in range(0, num_queries, query_chunk):
        last = min(first + query_chunk, num_queries)
        query = torch.cat([q_latent[:, first:last], q_pe[:, first:last]], dim=-1).contiguous()
        # Keys after the chunk's last query are never visible: they are not read at all.
        num_visible = min(num_keys, query_start + last)
        query_positions = torch.arange(query_start + first, query_start + last, device=device)
        last_visible_key = query_positions.clamp(max=num_visible - 1)
        state = _dense_softmax_start(batch, last - first, num_heads, latent_width, device)
        running_max, running_sum, accumulator = state
        num_pages_read = _ceil_div(num_visible, page_size)
        padding = None
        if key_padding_mask is not None:
            padding = torch.nn.functional.pad(
                key_padding_mask[:, :num_visible].bool(), (0, num_pages_read * page_size - num_visible)
            )
        keys_per_block = min(DENSE_BLOCK_ELEMENTS // ((last - first) * num_heads), DENSE_BLOCK_ELEMENTS // width)
        pages_per_block = max(1, keys_per_block // page_size)
        for first_page in range(0, num_pages_read, pages_per_block):
            last_page = min(first_page + pages_per_block, num_pages_read)
            page_ids = block_table[:, first_page:last_page].reshape(-1)
            rows = read_pages(kv_pages, page_ids, query.dtype).view(batch, -1, width)
            key_positions = torch.arange(first_page * page_size, last_page * page_size, device=device)
            visible = (key_positions[None, :] <= last_visible_key[:, None])[None]
            if padding is not None:
                visible = visible & padding[:, None, first_page * page_size : last_page * page_size]
            running_max, running_sum, accumulator = block_step(
                query, rows, visible, softmax_scale, running_max, running_sum, accumulator
            )
        outputs.append(_dense_softmax_output(running_sum, accumulator))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return out.to(q_latent.dtype)


def paged_dense_mla_fused(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages: torch.Tensor,
    block_table: torch.Tensor,
    num_keys: int,
    query_start: int,
    softmax_scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal absorbed MLA straight from the pages with an online (flash-style) softmax, same signature and
    result as `paged_dense_mla_reference`.

    Queries are processed in chunks and keys in blocks of whole pages, so the scores, the rows read and the fp32
    accumulator each stay within DENSE_BLOCK_ELEMENTS per sequence whatever the context length: a `[T, S]` score
    matrix is never built. Pages after a chunk's last query are not read.
    """
    _check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask)
    return _blocked_dense_mla(
        q_latent, q_pe, kv_pages, block_table, num_keys, query_start, softmax_scale, key_padding_mask, _dense_block
    )


# ----------------------------------------------------------------------------------------------------------------
# Compiled ("graph mode") variants

_compiled_functions: dict = {}


def compile_cache_dir() -> str:
    """The on-disk inductor cache: $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/kdsa/torchinductor."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser(DEFAULT_COMPILE_CACHE_DIR)


def _compiled(name: str):
    """`torch.compile` of `_score_block` / `_attend` / `_dense_block`, created once per process.

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
            ("score_block", _score_block),
            ("score_pool_block", _score_pool_block),
            ("sparse_mla", _attend),
            ("dense_mla", _dense_block),
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
    _check_indexer_inputs(
        q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask
    )
    return _blocked_indexer_topk(
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
    _check_sparse_inputs(q_latent, q_pe, kv_pages, block_table, indices)
    return _chunked_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale, _compiled("sparse_mla"))


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
    _check_dense_inputs(q_latent, q_pe, kv_pages, block_table, num_keys, query_start, key_padding_mask)
    return _blocked_dense_mla(
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


# ----------------------------------------------------------------------------------------------------------------
# Fixed-shape kernels of a compiled static-cache step (docs/graph-mode.md §3): every slot of the block table under a
# mask, so that shapes depend on the capacity `L` (pages per row · P), never on the context.


def _visible_limit(query_start: torch.Tensor, num_queries: int, num_keys: torch.Tensor) -> torch.Tensor:
    """int64 `[T]`: query `t` (at position `query_start + t`) sees the keys `<= limit[t]` (causal, and the context's
    end `num_keys - 1`). Both inputs are 0-d tensors, so nothing here depends on their values at trace time."""
    positions = query_start + torch.arange(num_queries, device=query_start.device)
    return torch.minimum(positions, num_keys - 1)


def static_indexer_topk(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages,
    block_table: torch.Tensor | None,
    num_keys: torch.Tensor,
    index_topk: int,
    query_start: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer top-k over every slot of the block table: q_index `[B, T, HI, DI]`, weights `[B, T, HI]` fp32,
    index_pages `[N, P, DI]` (or quantized), block_table `[B, n]` fully mapped, num_keys / query_start 0-d int64
    tensors, key_padding_mask bool `[B, L]` or None. Returns int64 `[B, T, min(index_topk, L)]`, best first, -1 = no
    key. The selection equals `paged_indexer_topk_*`'s (same scores, same tie rule: `_pack_scores`); only the width
    differs, the extra slots being -1. block_table None: the pages are in sequence order (`sequence_rows`)."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    keys = sequence_rows(index_pages, block_table, batch, q_index.dtype)
    capacity = keys.shape[1]
    scaled_weights = scaled_index_weights(weights, head_dim)
    key_positions = torch.arange(capacity, device=q_index.device)
    limit = _visible_limit(query_start, num_queries, num_keys)
    padding = None if key_padding_mask is None else key_padding_mask.bool()
    packed = _score_block(q_index.contiguous(), scaled_weights, keys, key_positions, limit, padding)
    return _unpack_indices(packed.topk(min(index_topk, capacity), dim=-1).values)


def static_indexer_topk_cpu(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages,
    block_table: torch.Tensor | None,
    num_keys: torch.Tensor,
    index_topk: int,
    query_start: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`static_indexer_topk` for the cpu backend: a decode step where `cpu_indexer` applies goes through its kernel
    (one opaque op in the compiled graph, docs/dsa.md §11), anything else through `static_indexer_topk`."""
    if not decode_kernel_applies(q_index, index_pages):
        return static_indexer_topk(
            q_index, weights, index_pages, block_table, num_keys, index_topk, query_start, key_padding_mask
        )
    batch = q_index.shape[0]
    block_table = _sequence_order_table(index_pages, batch) if block_table is None else block_table
    capacity = block_table.shape[1] * index_pages.shape[1]
    num_visible = torch.minimum(query_start + 1, num_keys)
    width = min(index_topk, capacity)
    return _decode_topk_cpu(q_index, weights, index_pages, block_table, num_visible, key_padding_mask, width)


def _sequence_order_table(pages: torch.Tensor, batch: int) -> torch.Tensor:
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
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages: torch.Tensor,
    pool_pages: torch.Tensor,
    block_table: torch.Tensor | None,
    num_keys: torch.Tensor,
    index_topk: int,
    query_start: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    select_tail: bool = True,
) -> torch.Tensor:
    """k-pool indexer top-k over every pooled-key slot of the block table (docs/dsa.md §9, docs/graph-mode.md §3).

    Arguments as `paged_kpool_indexer_topk_*` (`index_pages` is not read: the store pools keys when they complete),
    except num_keys / query_start: 0-d int64 tensors, key_padding_mask: bool `[B, L]` padded to the capacity, and
    block_table None: the pages are in sequence order (`sequence_rows`).
    Slot `r` of a sequence holds the pool ending in its `r`-th group of `kp` tokens, at `r·kp + (origin + kp - 1) mod
    kp`; a query sees it when that end is at or after the first pool's end and at or before the query and the last
    cached token (a pool is written when its last token arrives, so nothing later is read). Returns int64 `[B, T,
    min(index_topk // kp, L // kp) · kp (+ kp - 1 with the tail)]`, -1 = none: the paged kernels' selection (same
    scores and tie rule) with extra -1 slots."""
    batch, num_queries, num_heads, head_dim = q_index.shape
    kpool = ape.shape[0]
    keys = sequence_rows(pool_pages, block_table, batch, q_index.dtype)
    num_slots = keys.shape[1]
    origin = static_kpool_origin(key_padding_mask, batch, q_index.device)
    first_pool_end = origin + kpool - 1
    pool_ends = kpool * torch.arange(num_slots, device=q_index.device)[None, :] + (first_pool_end % kpool)[:, None]
    scaled_weights = scaled_index_weights(weights, head_dim)
    limit = _visible_limit(query_start, num_queries, num_keys)
    packed = _score_pool_block(q_index.contiguous(), scaled_weights, keys, pool_ends, limit, first_pool_end)
    best = packed.topk(min(index_topk // kpool, num_slots), dim=-1).values
    return kpool_expand(_unpack_indices(best), kpool, query_start, origin, select_tail)


def static_kpool_indexer_topk_cpu(
    q_index: torch.Tensor,
    weights: torch.Tensor,
    index_pages: torch.Tensor,
    pool_pages: torch.Tensor,
    block_table: torch.Tensor | None,
    num_keys: torch.Tensor,
    index_topk: int,
    query_start: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    select_tail: bool = True,
) -> torch.Tensor:
    """`static_kpool_indexer_topk` for the cpu backend: a decode step where `cpu_indexer` applies goes through its
    kernel over the pooled-key slots (the slot visibility of `static_kpool_indexer_topk` as its key mask; one opaque
    op in the compiled graph), anything else through `static_kpool_indexer_topk`."""
    if not decode_kernel_applies(q_index, pool_pages):
        return static_kpool_indexer_topk(
            q_index, weights, index_pages, pool_pages, block_table, num_keys, index_topk, query_start,
            key_padding_mask, ape, select_tail,
        )  # fmt: skip
    batch, kpool = q_index.shape[0], ape.shape[0]
    block_table = _sequence_order_table(pool_pages, batch) if block_table is None else block_table
    num_slots = block_table.shape[1] * pool_pages.shape[1]
    origin = static_kpool_origin(key_padding_mask, batch, q_index.device)
    last_visible_key = _visible_limit(query_start, 1, num_keys)
    width = min(index_topk // kpool, num_slots)
    return _kpool_slots_topk_cpu(
        q_index, weights, pool_pages, block_table, num_slots, last_visible_key, origin, kpool, width, query_start,
        select_tail,
    )  # fmt: skip


def static_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA over the selected slots: `_attend` (already fixed-shape for a fixed K)."""
    return _attend(q_latent.contiguous(), q_pe.contiguous(), kv_pages, block_table, indices, softmax_scale)


def static_sparse_mla_cpu(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale: float) -> torch.Tensor:
    """`static_sparse_mla` for the cpu backend: a decode step where `cpu_sparse_mla` applies goes through its kernel
    (one opaque op in the compiled graph, docs/dsa.md §12), anything else through `static_sparse_mla`."""
    if not sparse_decode_kernel_applies(q_latent, q_pe, kv_pages):
        return static_sparse_mla(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale)
    return sparse_mla_decode_cpu(q_latent, q_pe, kv_pages, block_table, indices, softmax_scale)


def static_dense_mla(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_pages,
    block_table: torch.Tensor | None,
    num_keys: torch.Tensor,
    query_start: torch.Tensor,
    softmax_scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal absorbed MLA over every slot of the block table under the visibility mask: one `_dense_block`
    step (the online-softmax block the paged kernels use) over all `L` rows.
    Shapes as `paged_dense_mla_fused` (block_table None: pages in sequence order, `sequence_rows`); returns
    `[B, T, H, C]`."""
    batch, num_queries, num_heads, latent_width = q_latent.shape
    query = torch.cat([q_latent, q_pe], dim=-1).contiguous()
    rows = sequence_rows(kv_pages, block_table, batch, query.dtype)
    key_positions = torch.arange(rows.shape[1], device=query.device)
    limit = _visible_limit(query_start, num_queries, num_keys)
    visible = (key_positions[None, :] <= limit[:, None])[None]
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.bool()[:, None, :]
    start = _dense_softmax_start(batch, num_queries, num_heads, latent_width, query.device)
    _, running_sum, accumulator = _dense_block(query, rows, visible, softmax_scale, *start)
    return _dense_softmax_output(running_sum, accumulator).to(q_latent.dtype)


__all__ = [
    "paged_kpool_indexer_topk_reference",
    "paged_kpool_indexer_topk_fused",
    "paged_kpool_indexer_topk_compiled",
    "compile_cache_dir",
    "gather_pages",
    "page_geometry",
    "read_pages",
    "read_rows",
    "sequence_rows",
    "paged_indexer_topk_reference",
    "paged_sparse_mla_reference",
    "paged_indexer_topk_fused",
    "paged_sparse_mla_fused",
    "paged_indexer_topk_compiled",
    "paged_sparse_mla_compiled",
    "paged_dense_mla_reference",
    "paged_dense_mla_fused",
    "paged_dense_mla_compiled",
    "static_dense_mla",
    "static_indexer_topk",
    "static_kpool_indexer_topk",
    "static_kpool_origin",
    "static_sparse_mla",
]
