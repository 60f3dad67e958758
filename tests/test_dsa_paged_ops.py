"""Paged DSA kernels (modeling_kdsa/dsa_paged_*.py): the fused and compiled paths against the reference (gather the
pages, then dsa_ops), on pages placed in shuffled order with unused pages, -1 padding entries and NaN in every
slot that no sequence owns, so that reading a wrong slot poisons the result."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modeling_kdsa import dsa_ops, dsa_paged_compiled, dsa_paged_fused
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_compiled import paged_indexer_topk_compiled, paged_sparse_mla_compiled
from modeling_kdsa.dsa_paged_fused import paged_indexer_topk_fused, paged_sparse_mla_fused
from modeling_kdsa.dsa_paged_reference import gather_pages, paged_indexer_topk_reference, paged_sparse_mla_reference

REPO = Path(__file__).resolve().parents[1]

# fp32 sparse attention: the fused path sums `[q_latent | q_pe]·[c | k_pe]` in one GEMM and normalises after the
# weighted sum, the reference in two GEMMs and before it; both are fp32 reassociations (measured max 9e-7).
FP32_ATOL, FP32_RTOL = 1e-5, 1e-5
# bf16 sparse attention vs the fp32 reference on the same bf16 values: the scores and the probabilities are each
# rounded to bf16 once (relative 2^-8 each), so the error is a few 2^-8 relative (measured: 3.7e-3 Frobenius,
# max 0.013 on outputs of magnitude <= 2).
BF16_REL_FRO, BF16_ATOL = 8e-3, 3e-2
# bf16 indexer: products rounded to bf16 swap near-equal scores at the top-k boundary (measured recall 0.997).
BF16_MIN_RECALL = 0.98


def paged(logical: torch.Tensor, page_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter `logical` `[B, S, W]` into pages: shuffled page ids, 3 pages no sequence owns, 2 spare -1 entries per
    row of the block table, NaN in unused pages and in the slots after the last token."""
    batch, num_tokens, width = logical.shape
    pages_per_sequence = -(-num_tokens // page_size)
    num_pages = batch * pages_per_sequence + 3
    pages = torch.full((num_pages, page_size, width), float("nan"), dtype=logical.dtype)
    page_ids = torch.randperm(num_pages, generator=generator)[: batch * pages_per_sequence]
    block_table = torch.full((batch, pages_per_sequence + 2), -1, dtype=torch.int64)
    block_table[:, :pages_per_sequence] = page_ids.view(batch, pages_per_sequence)
    positions = torch.arange(num_tokens)
    slots = block_table[:, positions // page_size] * page_size + positions % page_size  # [B, S]
    pages.view(-1, width)[slots.flatten()] = logical.flatten(0, 1)
    return pages, block_table


def random_values(shape, kind: str, generator: torch.Generator) -> torch.Tensor:
    """'gaussian', or 'integer': small integers, so that every product and sum is exact in fp32 whatever the
    summation order, and equal scores (ties) are frequent."""
    if kind == "integer":
        return torch.randint(-2, 3, shape, generator=generator).float()
    return torch.randn(shape, generator=generator)


def left_padding(batch: int, num_keys: int, pad: int) -> torch.Tensor:
    mask = torch.ones(batch, num_keys, dtype=torch.bool)
    mask[1:, :pad] = False  # the second sequence is left-padded
    return mask


@pytest.fixture
def one_page_blocks(monkeypatch):
    """Makes the fused indexer read one page per key block, so that short contexts cross many block boundaries."""
    monkeypatch.setattr(dsa_paged_fused, "KEY_BLOCK_ELEMENTS", 1)


# ---------------------------------------------------------------------------------------------------------------
# gather_pages


@pytest.mark.parametrize("num_keys", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("page_size", [16, 64])
def test_gather_pages_returns_the_logical_tensor(num_keys, page_size):
    generator = torch.Generator().manual_seed(num_keys)
    logical = torch.randn(2, num_keys, 5, generator=generator)
    pages, block_table = paged(logical, page_size, generator)
    gathered = gather_pages(pages, block_table, num_keys)
    assert gathered.is_contiguous()
    torch.testing.assert_close(gathered, logical, rtol=0, atol=0)
    prefix = min(3, num_keys)
    torch.testing.assert_close(gather_pages(pages, block_table, prefix), logical[:, :prefix], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Indexer top-k: fused == reference, exactly, in fp32

# (num_keys, queries, query_start): decode at page boundaries, prefill blocks, and blocks in the middle of a
# chunk whose later keys are already cached (they must stay invisible).
INDEXER_CASES = [
    (63, 1, 62),
    (64, 1, 63),
    (65, 1, 64),
    (64, 7, 57),
    (65, 65, 0),
    (200, 128, 72),
    (200, 7, 100),
    (1000, 1, 999),
    (1000, 128, 872),
    (1000, 128, 300),
    (100, 7, 97),  # queries past the last cached key see the whole context, never the page's unused slots
]


def indexer_inputs(num_keys, num_queries, kind, seed, heads=4, head_dim=16, page_size=16, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q_index = random_values((2, num_queries, heads, head_dim), kind, generator).to(dtype)
    weights = random_values((2, num_queries, heads), kind, generator)
    k_index = random_values((2, num_keys, head_dim), kind, generator).to(dtype)
    index_pages, block_table = paged(k_index, page_size, generator)
    return q_index, weights, k_index, index_pages, block_table


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("blocks", ["default", "one_page"])
@pytest.mark.parametrize("kind", ["gaussian", "integer"])
@pytest.mark.parametrize("index_topk", [16, 2000])
@pytest.mark.parametrize(("num_keys", "num_queries", "query_start"), INDEXER_CASES)
def test_fused_indexer_equals_reference(num_keys, num_queries, query_start, index_topk, kind, blocks, padded, request):
    if blocks == "one_page":
        request.getfixturevalue("one_page_blocks")
    q_index, weights, k_index, index_pages, block_table = indexer_inputs(num_keys, num_queries, kind, num_keys)
    padding = left_padding(2, num_keys, pad=5) if padded else None
    args = (q_index, weights, PagedKeys(index_pages, block_table, num_keys, query_start, padding), index_topk)
    expected = paged_indexer_topk_reference(*args)
    # The paged reference is dsa_ops' contiguous kernel on the logical keys.
    contiguous = dsa_ops.indexer_topk(q_index, weights, k_index, index_topk, query_start, padding)
    assert torch.equal(expected, contiguous)
    visible = min(num_keys, query_start + num_queries)
    assert expected.shape == (2, num_queries, min(index_topk, visible))
    fused = paged_indexer_topk_fused(*args)
    assert fused.dtype == torch.int64
    assert torch.equal(fused, expected)  # same keys, same order (equal scores: earlier key first), same -1


def consecutive_pages(logical: torch.Tensor, page_size: int, first: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence `[1, S, W]` in consecutive pool pages `first, first + 1, ...` (what the store hands a single
    sequence), NaN in the pages before and after and in the slots after the last token."""
    _, num_tokens, width = logical.shape
    num_pages = -(-num_tokens // page_size)
    pages = torch.full((first + num_pages + 2, page_size, width), float("nan"), dtype=logical.dtype)
    pages.view(-1, width)[first * page_size : first * page_size + num_tokens] = logical[0]
    block_table = torch.full((1, num_pages + 2), -1, dtype=torch.int64)
    block_table[0, :num_pages] = torch.arange(first, first + num_pages)
    return pages, block_table


@pytest.mark.parametrize("blocks", ["default", "one_page"])
@pytest.mark.parametrize("kind", ["gaussian", "integer"])
@pytest.mark.parametrize(("num_keys", "num_queries", "query_start"), INDEXER_CASES)
def test_fused_indexer_reads_consecutive_pages_in_place(num_keys, num_queries, query_start, kind, blocks, request):
    """A single sequence in consecutive pages is scored from slices of the pool (no copy of the keys), exactly as the
    reference in fp32; one page out of order falls back to the copying path, still exact."""
    if blocks == "one_page":
        request.getfixturevalue("one_page_blocks")
    q_index, weights, k_index, _, _ = indexer_inputs(num_keys, num_queries, kind, num_keys)
    q_index, weights, k_index = q_index[:1], weights[:1], k_index[:1]
    index_pages, block_table = consecutive_pages(k_index, 16)
    keys = PagedKeys(index_pages, block_table, num_keys, query_start)
    expected = dsa_ops.indexer_topk(q_index, weights, k_index, 16, query_start)
    assert torch.equal(paged_indexer_topk_fused(q_index, weights, keys, 16), expected)
    if block_table[0, 1] >= 0:  # two pages or more: swap the first two pages' contents and their table entries
        swapped_pages, swapped_table = index_pages.clone(), block_table.clone()
        swapped_pages[[2, 3]], swapped_table[0, :2] = index_pages[[3, 2]], torch.tensor([3, 2])
        swapped_keys = keys._replace(pages=swapped_pages, block_table=swapped_table)
        swapped = paged_indexer_topk_fused(q_index, weights, swapped_keys, 16)
        assert torch.equal(swapped, expected)


def test_fused_indexer_does_not_copy_consecutive_pages():
    """Decode over one sequence in consecutive pages: nothing as large as its keys `[S, DI]` is allocated (the
    products `[HI, S]` are the largest tensor), while shuffled pages are copied block by block."""
    num_keys, heads, head_dim = 1000, 4, 16
    q_index, weights, k_index, _, _ = indexer_inputs(num_keys, 1, "gaussian", seed=14, heads=heads, head_dim=head_dim)
    index_pages, block_table = consecutive_pages(k_index[:1], 16)
    keys = PagedKeys(index_pages, block_table, num_keys, num_keys - 1)
    assert largest_tensor(paged_indexer_topk_fused, q_index[:1], weights[:1], keys, 16) < num_keys * head_dim
    shuffled = keys._replace(block_table=block_table[:, [1, 0, *range(2, block_table.shape[1])]])
    assert largest_tensor(paged_indexer_topk_fused, q_index[:1], weights[:1], shuffled, 16) >= num_keys * head_dim


def test_packed_top_k_orders_like_the_reference_stable_sort():
    """The running top-k's packed keys rank exactly like dsa_ops.select_topk: descending score, equal scores
    (-0.0 == +0.0 included) by ascending position, -inf (not visible) as -1."""
    generator = torch.Generator().manual_seed(12)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5e-38, -2.5e-38, 3e38, -3e38, float("-inf")])
    scores = specials[torch.randint(0, len(specials), (3, 5, 300), generator=generator)]
    scores[0] = torch.randn(5, 300, generator=generator)
    packed = dsa_paged_fused.pack_scores(scores, torch.arange(300))
    for k in (1, 7, 300):
        got = dsa_paged_fused.unpack_indices(packed.topk(k, dim=-1).values)
        assert torch.equal(got, dsa_ops.select_topk(scores, k))


def test_integer_scores_really_tie():
    """The 'integer' inputs above exercise the tie rule: many selected keys share their score with another key."""
    q_index, weights, _, index_pages, block_table = indexer_inputs(1000, 7, "integer", seed=0)
    keys = gather_pages(index_pages, block_table, 1000)
    visible = dsa_ops.visible_keys_mask(993, 7, 1000, None, keys.device)
    scores = dsa_ops.indexer_scores(q_index, weights, keys, visible)
    top = scores.topk(16, dim=-1).values
    assert (top[..., 1:] == top[..., :-1]).float().mean() > 0.3


def test_fused_indexer_without_padding_and_with_no_visible_key():
    q_index, weights, _, index_pages, block_table = indexer_inputs(100, 3, "gaussian", seed=1)
    args = (q_index, weights, PagedKeys(index_pages, block_table, 100, 97), 8)
    assert torch.equal(paged_indexer_topk_fused(*args), paged_indexer_topk_reference(*args))
    # Query 0 of a sequence whose first key is padding sees nothing: all -1.
    padding = left_padding(2, 100, pad=2)
    args = (q_index, weights, PagedKeys(index_pages, block_table, 100, 0, padding), 8)
    fused = paged_indexer_topk_fused(*args)
    assert torch.equal(fused, paged_indexer_topk_reference(*args))
    assert (fused[1, 0] == -1).all() and (fused[1, 1] == -1).all() and (fused[0, 0, 1:] == -1).all()
    # No cached key at all.
    empty = paged_indexer_topk_fused(q_index, weights, PagedKeys(index_pages, block_table, 0, 0), 8)
    assert empty.shape == (2, 3, 0)


def test_fused_indexer_bf16_recall():
    num_keys, num_queries, index_topk = 1000, 128, 64
    q_index, weights, _, index_pages, block_table = indexer_inputs(
        num_keys, num_queries, "gaussian", seed=2, heads=8, head_dim=64, dtype=torch.bfloat16
    )
    keys = PagedKeys(index_pages, block_table, num_keys, num_keys - num_queries)
    fused = paged_indexer_topk_fused(q_index, weights, keys, index_topk)
    # fp32 reference on the very same (bf16-rounded) values: only the kernel's bf16 arithmetic differs.
    expected = paged_indexer_topk_reference(
        q_index.float(), weights, keys._replace(pages=index_pages.float()), index_topk
    )
    hits = sum(
        len(set(got.tolist()) & set(want.tolist()))
        for got, want in zip(fused.flatten(0, 1), expected.flatten(0, 1), strict=True)
    )
    recall = hits / expected.numel()
    assert recall >= BF16_MIN_RECALL, recall


# ---------------------------------------------------------------------------------------------------------------
# Memory: the fused indexer never holds [T, S]; the fused attention never copies the context


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) that any op allocates while active; views of existing tensors (e.g.
    of the whole page pool) allocate nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.max_numel = max(self.max_numel, tensor.numel())
        return out


def largest_tensor(function, *args) -> int:
    with LargestTensor() as recorder:
        function(*args)
    return recorder.max_numel


def test_fused_indexer_memory_does_not_grow_with_the_context(monkeypatch):
    # A budget of 8k elements per key block (the default 2M would need a 16k+ context to be visible here).
    monkeypatch.setattr(dsa_paged_fused, "KEY_BLOCK_ELEMENTS", 1 << 13)
    num_queries, index_topk = 32, 16

    def peak(function, num_keys):
        q_index, weights, _, index_pages, block_table = indexer_inputs(num_keys, num_queries, "gaussian", seed=3)
        keys = PagedKeys(index_pages, block_table, num_keys, num_keys - num_queries)
        return largest_tensor(function, q_index, weights, keys, index_topk)

    short, long = 2048, 8192
    queries_times_keys = 2 * num_queries * long  # the [B, T, S] logits of the long context
    assert peak(paged_indexer_topk_reference, long) >= queries_times_keys  # the recorder sees [T, S] tensors
    assert peak(paged_indexer_topk_fused, long) < queries_times_keys // 8
    # Bounded by the key block, not by the context.
    assert peak(paged_indexer_topk_fused, long) == peak(paged_indexer_topk_fused, short)


def test_fused_sparse_attention_reads_only_selected_rows():
    num_keys, heads, latent_dim, rope_dim = 4096, 4, 32, 8
    q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(num_keys, 1, 16, seed=4, heads=heads)
    args = (q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2)
    # The reference gathers the context up to the last selected key.
    context_elements = 2 * (int(indices.max()) + 1) * (latent_dim + rope_dim)
    assert largest_tensor(paged_sparse_mla_reference, *args) >= context_elements
    assert largest_tensor(paged_sparse_mla_fused, *args) <= 2 * 16 * (latent_dim + rope_dim)


# ---------------------------------------------------------------------------------------------------------------
# Sparse attention: fused == reference


def sparse_inputs(num_keys, num_queries, index_topk, seed, heads=4, latent_dim=32, rope_dim=8, dtype=torch.float32):
    """Queries, paged `[c | k_pe]` rows and top-k indices from the indexer (with -1 holes) for the last
    `num_queries` positions of a left-padded batch of 2."""
    generator = torch.Generator().manual_seed(seed)
    q_latent = torch.randn(2, num_queries, heads, latent_dim, generator=generator).to(dtype)
    q_pe = torch.randn(2, num_queries, heads, rope_dim, generator=generator).to(dtype)
    rows = torch.randn(2, num_keys, latent_dim + rope_dim, generator=generator).to(dtype)
    kv_pages, block_table = paged(rows, 16, generator)
    q_index, weights, _, index_pages, index_table = indexer_inputs(num_keys, num_queries, "gaussian", seed)
    padding = left_padding(2, num_keys, pad=3)
    indices = paged_indexer_topk_reference(
        q_index, weights, PagedKeys(index_pages, index_table, num_keys, num_keys - num_queries, padding), index_topk
    )
    # Holes anywhere in the list (FlashMLA allows -1 at any slot, docs/dsa.md §6).
    holes = torch.rand(indices.shape, generator=generator) < 0.2
    return q_latent, q_pe, rows, kv_pages, block_table, indices.masked_fill(holes, -1)


@pytest.mark.parametrize("chunks", ["default", "one_query"])
@pytest.mark.parametrize(("num_keys", "num_queries", "index_topk"), [(63, 1, 16), (65, 65, 2000), (200, 7, 64)])
def test_fused_sparse_attention_equals_reference_fp32(num_keys, num_queries, index_topk, chunks, monkeypatch):
    if chunks == "one_query":
        monkeypatch.setattr(dsa_paged_fused, "ATTENTION_ROWS_ELEMENTS", 1)
    q_latent, q_pe, rows, kv_pages, block_table, indices = sparse_inputs(num_keys, num_queries, index_topk, seed=5)
    scale = 40**-0.5
    expected = paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, scale)
    latent, k_pe = rows.split([32, 8], dim=-1)
    torch.testing.assert_close(
        expected, dsa_ops.sparse_mla_attention(q_latent, q_pe, latent, k_pe, indices, scale), rtol=0, atol=0
    )
    fused = paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, scale)
    torch.testing.assert_close(fused, expected, rtol=FP32_RTOL, atol=FP32_ATOL)


def test_fused_sparse_attention_nope():
    """qk_rope_head_dim = 0 (NoPE MLA): rows are the latent alone, q_pe is empty."""
    q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(200, 7, 64, seed=13, rope_dim=0)
    assert q_pe.shape[-1] == 0 and kv_pages.shape[-1] == 32
    torch.testing.assert_close(
        paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2),
        paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2),
        rtol=FP32_RTOL,
        atol=FP32_ATOL,
    )


def test_fused_sparse_attention_rows_without_keys_give_zero():
    q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(200, 7, 64, seed=6)
    indices[0, 2] = -1
    indices[1] = -1
    fused = paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2)
    assert torch.isfinite(fused).all()
    assert (fused[0, 2] == 0).all() and (fused[1] == 0).all()
    torch.testing.assert_close(
        fused,
        paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2),
        rtol=1e-5,
        atol=1e-5,
    )


def test_fused_sparse_attention_bf16():
    q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(
        1000, 128, 64, seed=7, heads=8, latent_dim=64, rope_dim=16, dtype=torch.bfloat16
    )
    scale = 80**-0.5
    fused = paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, scale)
    assert fused.dtype == torch.bfloat16
    expected = paged_sparse_mla_reference(
        q_latent.float(), q_pe.float(), PagedKeys(kv_pages.float(), block_table), indices, scale
    )
    error = fused.float() - expected
    assert error.norm() / expected.norm() <= BF16_REL_FRO
    assert error.abs().max() <= BF16_ATOL


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_raises_clear_errors():
    q_index, weights, _, index_pages, block_table = indexer_inputs(100, 3, "gaussian", seed=8)
    with pytest.raises(ValueError, match="index_pages width"):
        paged_indexer_topk_fused(q_index, weights, PagedKeys(index_pages[..., :8], block_table, 100, 97), 8)
    with pytest.raises(ValueError, match="does not fit the block table"):
        paged_indexer_topk_fused(q_index, weights, PagedKeys(index_pages, block_table[:, :3], 100, 97), 8)
    with pytest.raises(ValueError, match="no page"):
        holed = block_table.clone()
        holed[1, 2] = -1
        paged_indexer_topk_reference(q_index, weights, PagedKeys(index_pages, holed, 100, 97), 8)
    with pytest.raises(ValueError, match="key_padding_mask"):
        paged_indexer_topk_fused(
            q_index, weights, PagedKeys(index_pages, block_table, 100, 97, torch.ones(2, 99).bool()), 8
        )
    with pytest.raises(ValueError, match="index_topk"):
        paged_indexer_topk_fused(q_index, weights, PagedKeys(index_pages, block_table, 100, 97), 0)
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        paged_indexer_topk_fused(q_index, weights, PagedKeys(index_pages, block_table[:1], 100, 97), 8)

    q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(100, 3, 16, seed=9)
    with pytest.raises(ValueError, match="C \\+ R"):
        paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages[..., :-1], block_table), indices, 0.2)
    with pytest.raises(ValueError, match="does not map"):
        beyond = indices.clone()
        beyond[0, 0, 0] = block_table.shape[1] * 16
        paged_sparse_mla_fused(q_latent, q_pe, PagedKeys(kv_pages, block_table), beyond, 0.2)
    with pytest.raises(ValueError, match="does not map"):
        unmapped = block_table.clone()
        unmapped[0, 0] = -1
        paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, unmapped), indices.clamp(max=15).abs(), 0.2)


# ---------------------------------------------------------------------------------------------------------------
# Compiled variants (torch.compile, inductor C++ on CPU)


@pytest.mark.slow
def test_compiled_equals_reference_and_does_not_recompile_as_the_context_grows():
    from torch._dynamo.utils import counters

    # Warm up once per graph variant: prefill (T > 1) and decode (T = 1).
    for num_keys, num_queries, query_start in [(200, 7, 100), (64, 1, 63)]:
        for kind in ("integer", "gaussian"):
            q_index, weights, _, index_pages, block_table = indexer_inputs(num_keys, num_queries, kind, seed=10)
            padding = left_padding(2, num_keys, pad=5)
            args = (q_index, weights, PagedKeys(index_pages, block_table, num_keys, query_start, padding), 16)
            assert torch.equal(paged_indexer_topk_compiled(*args), paged_indexer_topk_reference(*args))
        q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(num_keys, num_queries, 16, seed=11)
        expected = paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2)
        compiled = paged_sparse_mla_compiled(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2)
        torch.testing.assert_close(compiled, expected, rtol=FP32_RTOL, atol=FP32_ATOL)

    graphs = counters["stats"]["unique_graphs"]
    for num_keys in (65, 66, 129, 300):  # decode steps: the context grows, the top-k fills up
        q_index, weights, _, index_pages, block_table = indexer_inputs(num_keys, 1, "gaussian", seed=num_keys)
        keys = PagedKeys(index_pages, block_table, num_keys, num_keys - 1, left_padding(2, num_keys, 5))
        args = (q_index, weights, keys, 100)
        assert torch.equal(paged_indexer_topk_compiled(*args), paged_indexer_topk_reference(*args))
        q_latent, q_pe, _, kv_pages, block_table, indices = sparse_inputs(num_keys, 1, 100, seed=num_keys)
        torch.testing.assert_close(
            paged_sparse_mla_compiled(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2),
            paged_sparse_mla_reference(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2),
            rtol=FP32_RTOL,
            atol=FP32_ATOL,
        )
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_cache_dir_default_and_override(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert dsa_paged_compiled.compile_cache_dir() == os.path.expanduser("~/.cache/kdsa/torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    assert dsa_paged_compiled.compile_cache_dir() == "/somewhere/else"


@pytest.mark.slow
def test_second_process_hits_the_on_disk_compile_cache(tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from torch._dynamo.utils import counters
        from modeling_kdsa.dsa_paged_common import PagedKeys
        from modeling_kdsa.dsa_paged_compiled import paged_sparse_mla_compiled
        keys = PagedKeys(torch.randn(4, 16, 40), torch.tensor([[2, 0]]))
        indices = torch.tensor([[[0, 5, 17, -1]]])
        paged_sparse_mla_compiled(torch.randn(1, 1, 4, 32), torch.randn(1, 1, 4, 8), keys, indices, 0.2)
        print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def run() -> str:
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        return result.stdout.strip().splitlines()[-1]

    assert run() == "hits 0 misses 1"
    assert run() == "hits 1 misses 0"
