"""Fused paged DSA kernels in torch (docs/dsa.md §7): the indexer scores, weights and selects in one pass over blocks
of pages with a running top-k, so memory does not grow with the context and the `[T, S]` logits are never
materialised (an exact fused score + top-k was proposed in vLLM RFC #53563); sparse attention gathers only the selected
rows from the pages; dense MLA runs an online softmax over blocks of keys. Same signatures and results as
dsa_paged_reference.py. The `cpu` backend runs these where its C++ decode kernels do not apply (dsa_paged_cpu.py), the
`compiled` backend runs their per-block functions compiled (dsa_paged_compiled.py), and the fixed-shape kernels of a
compiled static step reuse the per-block functions (dsa_paged_static.py). Page layout and legend:
dsa_paged_common.py.
"""

import torch

from .dsa_ops import ScoredPairs, kpool_expand, kpool_origin, scaled_index_weights
from .dsa_paged_common import (
    PagedKeys,
    ceil_div,
    check_dense_inputs,
    check_indexer_inputs,
    check_kpool_inputs,
    check_sparse_inputs,
    page_geometry,
    read_pages,
    read_rows,
)
from .linear_ops import product
from .numeric_formats import PLANAR_ROWS

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

# Running top-k keys (see `pack_scores`): the score's order-preserving int32 image in the high 32 bits, the
# reversed key position in the low 32 bits. Keys below this bound carry the score -inf (masked key).
_LOW_BITS = 0xFFFFFFFF
_NEG_INF_ORDERED = -int(torch.tensor(float("inf")).view(torch.int32))  # minus the magnitude bits of inf
_MASKED_KEY_BOUND = (_NEG_INF_ORDERED + 1) * (1 << 32)


def pack_scores(scores: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
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


def unpack_indices(packed: torch.Tensor) -> torch.Tensor:
    """Key positions from `pack_scores` keys; -1 where the score was -inf (not visible)."""
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


def score_block(
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
    Returns int64 `[B, T, n]` (`pack_scores`).
    """
    scores = _weighted_head_scores(q_index, scaled_weights, keys)
    hidden = (key_positions[None, :] > last_visible_key[:, None])[None]  # [1, T, n]
    if key_padding is not None:
        hidden = hidden | ~key_padding[:, None, :]
    return pack_scores(scores.masked_fill_(hidden, float("-inf")), key_positions)


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


def merge_top(best: torch.Tensor | None, packed: torch.Tensor, width: int) -> torch.Tensor:
    """The running top-k of the blocked indexers: the best `width` of `best` (None before the first block) and the
    new block's packed scores `packed` `[B, T, n]` (`pack_scores`), in descending order."""
    ScoredPairs.add(packed)
    if best is not None:
        packed = torch.cat([best, packed], dim=-1)
    return packed.topk(min(width, packed.shape[-1]), dim=-1).values


def blocked_indexer_topk(q_index, weights, keys: PagedKeys, index_topk: int, score_block) -> torch.Tensor:
    """Score + weight + top-k in one pass over blocks of pages with a running top-k; `score_block` is
    `score_block` or its compiled version. Inputs already checked."""
    index_pages, block_table, num_keys, query_start, key_padding_mask = keys[:5]
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
    num_pages_read = ceil_div(num_visible, page_size)
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
            block_keys = read_pages(index_pages, page_ids, q_index.dtype)
        else:
            # Consecutive pages: the block is a slice of the pool, scored in place (the copy is a second pass over
            # every key, ~0.3 ms of a 64k decode step on one core).
            block_keys = index_pages[first_pool_page + first_page : first_pool_page + last_page]
        block_keys = block_keys.view(batch, -1, head_dim)
        block = slice(first_page * page_size, last_page * page_size)
        key_positions = torch.arange(block.start, block.stop, device=q_index.device)
        # Contiguous, so that every block has the same strides (a compiled block step never recompiles for them).
        key_padding = None if key_padding_mask is None else key_padding_mask[:, block].contiguous()
        packed = score_block(q_index, scaled_weights, block_keys, key_positions, last_visible_key, key_padding)
        best = merge_top(best, packed, num_selected)
    return unpack_indices(best)


def paged_indexer_topk_fused(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """Fused paged indexer: scores, head weighting and top-k in one pass over blocks of pages (docs/dsa.md
    §4, §7), same signature and result as `paged_indexer_topk_reference`.

    q_index: `[B, T, HI, DI]`; weights: `[B, T, HI]` fp32; keys: `index_pages` `[num_pages, P, DI]` and the rest of
    `PagedKeys`. Returns int64 `[B, T, min(index_topk, S')]`, `S' = min(num_keys, query_start + T)`.

    Keys are read in blocks of whole pages (one `index_select` each, or a slice of the pool when a single sequence's
    pages are consecutive, docs/dsa.md §7; at most KEY_BLOCK_ELEMENTS products per sequence) and merged into a
    running top-k, so the `[T, S]` logits are never materialised. fp32 inputs give
    exactly the reference's indices (same products, same head order, same tie rule). bf16 inputs multiply q·k in
    bf16 (fp32 accumulation inside the GEMM, bf16 result) and do ReLU, weighting and the head sum in fp32. The `cpu`
    backend runs a decode step and a verification through its C++ kernel instead where it applies
    (`dsa_paged_cpu.paged_indexer_topk_cpu`, docs/dsa.md §11).
    """
    check_indexer_inputs(q_index, weights, keys, index_topk)
    return blocked_indexer_topk(q_index, weights, keys, index_topk, score_block)


def score_pool_block(
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
    Returns int64 `[B, T, n]` (`pack_scores` with the pool end as the key position).
    """
    scores = _weighted_head_scores(q_index, scaled_weights, keys)
    visible = (pool_ends[:, None, :] <= last_visible_key[None, :, None]) & (pool_ends >= first_pool_end[:, None])[
        :, None, :
    ]
    scores = scores.masked_fill(~visible, float("-inf"))
    return pack_scores(scores, pool_ends[:, None, :])


def blocked_kpool_indexer_topk(
    q_index, weights, keys: PagedKeys, index_topk: int, ape, select_tail: bool, score_block
) -> torch.Tensor:
    """Score + weight + running top-k over blocks of pages of stored pooled keys (`keys.pool_pages`). Inputs already
    checked."""
    _, block_table, num_keys, query_start, key_padding_mask, pool_pages, origin = keys
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
    num_pages_read = ceil_div(num_visible, page_size)
    pages_per_block = _key_block_pages(num_queries, num_heads, head_dim, page_size // kpool, copies_keys=True)
    best = None
    for first_page in range(0, num_pages_read, pages_per_block):
        last_page = min(first_page + pages_per_block, num_pages_read)
        page_ids = block_table[:, first_page:last_page].reshape(-1)
        pooled = read_pages(pool_pages, page_ids, q_index.dtype).view(batch, -1, head_dim)
        group_starts = torch.arange(first_page * page_size, last_page * page_size, kpool, device=q_index.device)
        pool_ends = group_starts[None, :] + phase[:, None]
        packed = score_block(q_index, scaled_weights, pooled, pool_ends, last_visible_key, first_pool_end)
        best = merge_top(best, packed, num_selected)
    return kpool_expand(unpack_indices(best), kpool, query_start, origin, select_tail)


def paged_kpool_indexer_topk_fused(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """Fused k-pool indexer: scores only the stored pooled keys (`keys.pool_pages`, one row per complete pool,
    written by `KDSACache` when a pool's last token arrives), with a running top-k over blocks of pages, so a decode
    step reads `S / kp` keys and never the `[T, S]` logits. Same signature and result as the reference."""
    check_kpool_inputs(q_index, weights, keys, index_topk, ape)
    return blocked_kpool_indexer_topk(q_index, weights, keys, index_topk, ape, select_tail, score_pool_block)


def attend_selected(
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


def chunked_sparse_mla(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float, attend) -> torch.Tensor:
    """Runs `attend` (`attend_selected` or its compiled version) on chunks of queries of ATTENTION_ROWS_ELEMENTS
    rows."""
    kv_pages, block_table = keys.pages, keys.block_table
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


def paged_sparse_mla_fused(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA reading only the selected rows from the pages (docs/dsa.md §3, §4, §6), same
    signature and result as `paged_sparse_mla_reference`.

    q_latent: `[B, T, H, C]`; q_pe: `[B, T, H, R]`; keys: `kv_pages` `[num_pages, P, C + R]` and the block table;
    indices `[B, T, K]` logical positions, -1 = none. Returns `[B, T, H, C]` in q_latent's dtype.
    Queries are processed in chunks whose gathered rows stay within ATTENTION_ROWS_ELEMENTS (28 queries at K = 512,
    C + R = 288): about 10 MB per chunk in bf16, whatever T and the context length. The `cpu` backend runs a decode
    step and a verification through its C++ kernel instead where it applies (`dsa_paged_cpu.paged_sparse_mla_cpu`,
    docs/dsa.md §12).
    """
    check_sparse_inputs(q_latent, q_pe, keys, indices)
    return chunked_sparse_mla(q_latent, q_pe, keys, indices, softmax_scale, attend_selected)


def dense_block(
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
    # Whole `[c | k_pe]` rows, then drop the k_pe columns (see `attend_selected`).
    values = product(torch.bmm, probs.to(rows.dtype).view(batch, num_queries * num_heads, -1), rows)[..., :latent_width]
    accumulator = accumulator * correction + values.view_as(accumulator).float()
    return new_max, running_sum, accumulator


def dense_softmax_start(batch: int, num_queries: int, num_heads: int, latent_width: int, device) -> tuple:
    """The `(running_max, running_sum, accumulator)` that `dense_block` starts from (no key seen yet)."""
    running_max = torch.full(
        (batch, num_queries, num_heads, 1), torch.finfo(torch.float32).min, dtype=torch.float32, device=device
    )
    accumulator = torch.zeros(batch, num_queries, num_heads, latent_width, dtype=torch.float32, device=device)
    return running_max, torch.zeros_like(running_max), accumulator


def dense_softmax_output(running_sum: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
    """The normalised fp32 output of `dense_block`'s state; a row that saw no key gives 0."""
    return accumulator / running_sum.clamp(min=torch.finfo(torch.float32).tiny)


def blocked_dense_mla(q_latent, q_pe, keys: PagedKeys, softmax_scale: float, block_step) -> torch.Tensor:
    """Dense MLA in chunks of queries, each an online softmax over blocks of whole pages (`block_step` is
    `dense_block` or its compiled version). Inputs already checked."""
    kv_pages, block_table, num_keys, query_start, key_padding_mask = keys[:5]
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
        state = dense_softmax_start(batch, last - first, num_heads, latent_width, device)
        running_max, running_sum, accumulator = state
        num_pages_read = ceil_div(num_visible, page_size)
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
        outputs.append(dense_softmax_output(running_sum, accumulator))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return out.to(q_latent.dtype)


def paged_dense_mla_fused(q_latent, q_pe, keys: PagedKeys, softmax_scale: float) -> torch.Tensor:
    """Dense causal absorbed MLA straight from the pages with an online (flash-style) softmax, same signature and
    result as `paged_dense_mla_reference`.

    Queries are processed in chunks and keys in blocks of whole pages, so the scores, the rows read and the fp32
    accumulator each stay within DENSE_BLOCK_ELEMENTS per sequence whatever the context length: a `[T, S]` score
    matrix is never built. Pages after a chunk's last query are not read.
    """
    check_dense_inputs(q_latent, q_pe, keys)
    return blocked_dense_mla(q_latent, q_pe, keys, softmax_scale, dense_block)


__all__ = [
    "ATTENTION_ROWS_ELEMENTS",
    "DENSE_BLOCK_ELEMENTS",
    "KEY_BLOCK_ELEMENTS",
    "attend_selected",
    "blocked_dense_mla",
    "blocked_indexer_topk",
    "blocked_kpool_indexer_topk",
    "chunked_sparse_mla",
    "dense_block",
    "dense_softmax_output",
    "dense_softmax_start",
    "merge_top",
    "pack_scores",
    "paged_dense_mla_fused",
    "paged_indexer_topk_fused",
    "paged_kpool_indexer_topk_fused",
    "paged_sparse_mla_fused",
    "score_block",
    "score_pool_block",
    "unpack_indices",
]
