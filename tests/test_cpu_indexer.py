"""The hand-written CPU kernel of the indexer's decode step (modeling_kdsa/cpu_indexer.py, docs/dsa.md §11): its
selection against the torch reference, the block table, padding, the callers that route to it and its fallbacks (other
inputs, more threads, no kernel); its build: test_cpu_extension.py."""

import pytest
import torch
from conftest import assert_avx2_builds_pass, count_calls, needs_kernel_build, runs_avx512_builds

from modeling_kdsa import cpu_extension, cpu_indexer, dsa_paged_cpu, dsa_paged_static
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_cpu import paged_indexer_topk_cpu, static_indexer_topk_cpu
from modeling_kdsa.dsa_paged_reference import paged_indexer_topk_reference
from modeling_kdsa.dsa_paged_static import static_indexer_topk

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count")


def exact_case(batch=2, heads=16, dim=64, page_size=64, num_keys=1000, seed=0):
    """Inputs whose scores are exact in fp32 whatever the summation order: small integer queries and keys (exact in
    bf16), head weights ±2^j, and HI · DI = 16 · 64 so that the weight scale HI^-0.5 · DI^-0.5 is 2^-5. Many scores
    tie, so the tie rule (earlier key first) is exercised too. The pages are shuffled and one spare page is unused."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_sequence = -(-num_keys // page_size)
    num_pages = batch * pages_per_sequence + 1
    pages = torch.randint(-2, 3, (num_pages, page_size, dim), generator=generator).float()
    table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_sequence].view(batch, -1)
    q_index = torch.randint(-2, 3, (batch, 1, heads, dim), generator=generator).float()
    sign = torch.randint(0, 2, (batch, 1, heads), generator=generator).float() * 2 - 1
    weights = sign * 2.0 ** torch.randint(-3, 3, (batch, 1, heads), generator=generator).float()
    return q_index, weights, pages, table


def padding_mask(batch, num_keys, pads=(0, 37)):
    mask = torch.ones(batch, num_keys, dtype=torch.bool)
    for row, pad in enumerate(pads[:batch]):
        mask[row, :pad] = False
    return mask


@needs_kernel_build
@pytest.mark.parametrize(
    "batch, heads, dim, num_keys, top_k, padded",
    [
        (2, 16, 64, 1000, 64, True),  # shuffled pages, a padded row, ties
        (2, 16, 64, 1003, 7, False),  # a last group of 3 keys (the scalar tail)
        (2, 16, 64, 5, 64, True),  # fewer visible keys than top_k: -1 past them
        (1, 64, 128, 300, 20, True),  # DeepSeek-V3.2's indexer geometry (64 heads of 128)
    ],
)
def test_kernel_selects_exactly_the_references_keys(batch, heads, dim, num_keys, top_k, padded):
    q_index, weights, pages, table = exact_case(batch, heads, dim, num_keys=num_keys)
    mask = padding_mask(batch, num_keys) if padded else None
    expected = paged_indexer_topk_reference(
        q_index, weights, PagedKeys(pages, table, num_keys, num_keys - 1, mask), top_k
    )
    q16, pages16 = q_index.bfloat16(), pages.bfloat16()
    assert cpu_indexer.decode_kernel_applies(q16, pages16)
    got = paged_indexer_topk_cpu(q16, weights, PagedKeys(pages16, table, num_keys, num_keys - 1, mask), top_k)
    assert torch.equal(got, expected)


@needs_kernel_build
@pytest.mark.parametrize(
    "batch, queries, num_keys, top_k, padded",
    [
        (2, 2, 1000, 64, True),  # two queries (a verification of one drafted token), a padded row
        (2, 8, 1003, 7, False),  # eight queries, a scalar tail
        (1, 16, 300, 20, True),  # sixteen queries (the most that take the kernel)
        (2, 8, 12, 64, True),  # early queries see fewer keys than top_k: -1 past them
    ],
)
def test_several_queries_select_exactly_the_references_keys(monkeypatch, batch, queries, num_keys, top_k, padded):
    """Up to MAX_KERNEL_QUERIES queries per sequence (a verification) go through one kernel call, each query a row
    that sees the keys up to its own position (the later ones masked like padding): the reference's selection for
    every query, -1 where it sees fewer keys than the width."""
    calls = count_calls(monkeypatch, dsa_paged_cpu, "indexer_topk_decode")
    q_index, weights, pages, table = exact_case(batch, num_keys=num_keys)
    generator = torch.Generator().manual_seed(queries)
    q_index = torch.randint(-2, 3, (batch, queries, 16, 64), generator=generator).float()
    weights = weights.expand(batch, queries, 16) * (1 + torch.arange(queries)[None, :, None] % 3)
    mask = padding_mask(batch, num_keys, pads=(0, 5)) if padded else None
    start = num_keys - queries
    expected = paged_indexer_topk_reference(q_index, weights, PagedKeys(pages, table, num_keys, start, mask), top_k)
    got = paged_indexer_topk_cpu(
        q_index.bfloat16(), weights, PagedKeys(pages.bfloat16(), table, num_keys, start, mask), top_k
    )
    assert len(calls) == 1 and calls[0][0].shape[0] == batch * queries
    assert got.shape == expected.shape == (batch, queries, min(top_k, num_keys))
    assert torch.equal(got, expected)


@needs_kernel_build
def test_more_queries_than_the_kernel_takes_keep_the_blocked_path(monkeypatch):
    """17 queries (a prefill block) keep the blocked torch path, which reads each key once for all of them."""
    calls = count_calls(monkeypatch, dsa_paged_cpu, "indexer_topk_decode")
    q_index, weights, pages, table = exact_case(batch=1, num_keys=200)
    q_index, weights = q_index.expand(1, 17, 16, 64), weights.expand(1, 17, 16)
    expected = paged_indexer_topk_reference(q_index, weights, PagedKeys(pages, table, 200, 183), 32)
    got = paged_indexer_topk_cpu(q_index.bfloat16(), weights, PagedKeys(pages.bfloat16(), table, 200, 183), 32)
    assert torch.equal(got, expected)
    assert not calls


def test_more_threads_than_the_kernel_was_measured_with_keep_the_torch_path():
    """The kernel runs on one thread: with more than MAX_THREADS intra-op threads the torch path, which uses them all,
    is kept; up to MAX_THREADS the kernel applies."""
    q_index, _, pages, _ = exact_case(batch=1, num_keys=64)
    q16, pages16 = q_index.bfloat16(), pages.bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(cpu_extension.MAX_THREADS + 1)
        assert not cpu_indexer.decode_kernel_applies(q16, pages16)
        torch.set_num_threads(cpu_extension.MAX_THREADS)
        assert cpu_indexer.decode_kernel_applies(q16, pages16) == cpu_indexer.kernel_available()
    finally:
        torch.set_num_threads(threads)


@needs_kernel_build
def test_bf16_scores_are_the_fp32_products_of_the_bf16_inputs():
    """On random bf16 data the kernel's selection is the fp32 selection on the upcast inputs (the torch bf16 path
    rounds each head's product to bf16 and may differ at near ties; the kernel must not)."""
    generator = torch.Generator().manual_seed(3)
    pages = torch.randn(20, 64, 64, generator=generator).bfloat16()
    table = torch.arange(20).view(1, 20)
    q_index = torch.randn(1, 1, 8, 64, generator=generator).bfloat16()
    weights = torch.randn(1, 1, 8, generator=generator)
    expected = paged_indexer_topk_reference(q_index.float(), weights, PagedKeys(pages.float(), table, 1270, 1269), 128)
    got = paged_indexer_topk_cpu(q_index, weights, PagedKeys(pages, table, 1270, 1269), 128)
    assert torch.equal(got, expected)


@needs_kernel_build
def test_static_cpu_indexer_uses_the_kernel_and_equals_the_torch_static_indexer(monkeypatch):
    """The cpu backend's fixed-shape indexer (a compiled step's) goes through the kernel, reading the static store's
    pages in sequence order (no block table), and selects what the torch one selects: only the keys up to the query's
    position, -1 padding included."""
    q_index, weights, pages, _ = exact_case(batch=2, num_keys=256)  # 2 x 4 pages in sequence order + a spare
    pages = pages[:8]
    mask = padding_mask(2, 256, pads=(0, 9))
    keys = PagedKeys(pages, None, torch.tensor(200), torch.tensor(150), mask)  # the query at 150 sees keys 0 … 150
    expected = static_indexer_topk(q_index, weights, keys, 64)
    calls = count_calls(monkeypatch, dsa_paged_cpu, "indexer_topk_decode")
    got = static_indexer_topk_cpu(q_index.bfloat16(), weights, bf16_pages(keys), 64)
    assert len(calls) == 1 and torch.equal(got, expected)


@needs_kernel_build
def test_compiled_static_cpu_indexer_is_one_graph():
    """Inside torch.compile(fullgraph=True) the kernel is one opaque op (a `torch.library` op with a fake
    implementation): inductor compiles around it and the result is the eager one; `opcheck` checks the fake against
    the real op."""
    q_index, weights, pages, _ = exact_case(batch=1, num_keys=128)
    q16, pages16 = q_index.bfloat16(), pages[:2].bfloat16()
    keys = PagedKeys(pages16, None, torch.tensor(120), torch.tensor(119))
    expected = static_indexer_topk_cpu(q16, weights, keys, 16)
    torch._dynamo.reset()
    compiled = torch.compile(static_indexer_topk_cpu, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q16, weights, keys, 16), expected)
    # The op's registration as torch.library checks it: schema, fake implementation (the shape a graph plans
    # with) against the real output, dispatch under AOT tracing.
    op_args = (q16[:, 0].contiguous(), weights[:, 0], pages16, torch.arange(2)[None], torch.tensor(120), None, 16, 16)
    torch.library.opcheck(torch.ops.kdsa.indexer_topk_decode.default, op_args)


def test_callers_keep_the_torch_path_where_the_kernel_does_not_apply(monkeypatch):
    """fp32 queries, prefill blocks, head counts that are not a multiple of 8 and pages not stored contiguously never
    reach the kernel (nor do quantized pages: not a plain tensor), and nothing does when it is unavailable: the torch
    path's result comes back."""
    q_index, weights, pages, table = exact_case(batch=1, num_keys=200)
    q16, pages16 = q_index.bfloat16(), pages.bfloat16()
    assert not cpu_indexer.decode_kernel_applies(q_index, pages16)  # fp32 queries
    assert not cpu_indexer.decode_kernel_applies(q16, pages)  # fp32 pages
    assert not cpu_indexer.decode_kernel_applies(q16.expand(1, 2, 16, 64), pages16)  # two queries
    assert not cpu_indexer.decode_kernel_applies(q16[:, :, :12], pages16)  # 12 heads
    assert not cpu_indexer.decode_kernel_applies(q16, pages16.transpose(1, 2).contiguous().transpose(1, 2))
    monkeypatch.setattr(cpu_indexer, "kernel_available", lambda: False)
    assert not cpu_indexer.decode_kernel_applies(q16, pages16)
    monkeypatch.setattr(dsa_paged_cpu, "indexer_topk_decode", None)  # would raise if called
    expected = paged_indexer_topk_reference(q_index, weights, PagedKeys(pages, table, 200, 199), 32)
    assert torch.equal(paged_indexer_topk_cpu(q16, weights, PagedKeys(pages16, table, 200, 199), 32), expected)


@needs_kernel_build
def test_kernel_refuses_inputs_it_cannot_read():
    """The op reads raw pointers: a wrong dtype, a strided tensor or an empty selection is a ValueError, not a crash."""
    assert cpu_indexer.kernel_available()  # loads the op's CPU kernel
    q_index, weights, pages, table = exact_case(batch=1, num_keys=64)
    good = [q_index[:, 0].bfloat16(), weights[:, 0], pages.bfloat16(), table, torch.tensor(64), None, 8, 8]
    assert cpu_indexer.indexer_topk_decode(*good).shape == (1, 8)
    for position, bad in [
        (0, q_index[:, 0]),  # fp32 queries
        (2, pages.bfloat16().transpose(1, 2)),  # strided pages
        (3, table.int()),  # int32 block table
        (5, torch.ones(1, 64, dtype=torch.uint8)),  # a byte mask instead of bool
        (6, 0),  # top_k 0
        (4, torch.tensor(65)),  # more keys than the block table maps
        (4, torch.tensor(64.0)),  # a float key count
        (1, weights[:, 0, :8].contiguous()),  # weights for 8 of the 16 heads
        (5, torch.ones(1, 63, dtype=torch.bool)),  # a mask narrower than the keys
    ]:
        with pytest.raises(ValueError, match="indexer_topk_decode takes"):
            cpu_indexer.indexer_topk_decode(*good[:position], bad, *good[position + 1 :])


def bf16_pages(keys: PagedKeys) -> PagedKeys:
    """`keys` with its pages (and pooled keys) in bf16."""
    pool_pages = None if keys.pool_pages is None else keys.pool_pages.bfloat16()
    return keys._replace(pages=keys.pages.bfloat16(), pool_pages=pool_pages)


def kpool_case(batch=3, heads=16, dim=64, kpool=4, page_tokens=64, num_keys=300, pads=(0, 3, 6), seed=0):
    """A k-pool store (docs/dsa.md §9) with integer pooled keys (exact scores, many ties) in shuffled pool pages; left
    padding of 0, 3 and 6 tokens puts the three sequences' pools at three phases. The token rows are not read."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_sequence = -(-num_keys // page_tokens)
    num_pages = batch * pages_per_sequence + 1
    pool_pages = torch.randint(-2, 3, (num_pages, page_tokens // kpool, dim), generator=generator).float()
    index_pages = torch.zeros(num_pages, page_tokens, 2 * dim)
    table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_sequence].view(batch, -1)
    q_index = torch.randint(-2, 3, (batch, 1, heads, dim), generator=generator).float()
    sign = torch.randint(0, 2, (batch, 1, heads), generator=generator).float() * 2 - 1
    weights = sign * 2.0 ** torch.randint(-3, 3, (batch, 1, heads), generator=generator).float()
    return (
        q_index,
        weights,
        index_pages,
        pool_pages,
        table,
        padding_mask(batch, num_keys, pads),
        torch.zeros(kpool, dim),
    )


@needs_kernel_build
@pytest.mark.parametrize("query_back", [0, 9])  # the query at the context's end, or 9 tokens before it
def test_kpool_decode_step_selects_the_pools_the_torch_path_selects(monkeypatch, query_back):
    """GLM-5.3-Flash's k-pool indexer: a bf16 decode step scores the stored pooled keys with the kernel (the slot
    visibility as its key mask, its slots turned back into pool ends) and selects exactly what the torch path selects
    on the upcast inputs, the query's own incomplete pool (the tail) included."""
    q_index, weights, index_pages, pool_pages, table, mask, ape = kpool_case()
    keys = PagedKeys(index_pages, table, 300, 299 - query_back, mask, pool_pages)
    expected = dsa_paged_cpu.paged_kpool_indexer_topk_cpu(q_index, weights, keys, 32, ape)
    calls = count_calls(monkeypatch, dsa_paged_cpu, "indexer_topk_decode")
    got = dsa_paged_cpu.paged_kpool_indexer_topk_cpu(q_index.bfloat16(), weights, bf16_pages(keys), 32, ape)
    assert len(calls) == 1 and torch.equal(got, expected)


@needs_kernel_build
def test_static_kpool_decode_step_uses_the_kernel_and_equals_the_torch_static_one(monkeypatch):
    """The cpu backend's fixed-shape k-pool indexer (a compiled step's) reads the static store's pool pages in
    sequence order (no block table) through the kernel and selects what the torch one selects: only pools ending at
    or before the query and after each sequence's first pool; the mask padded to the capacity."""
    q_index, weights, index_pages, pool_pages, _, mask, ape = kpool_case(num_keys=256)
    pool_pages, index_pages = pool_pages[:12], index_pages[:12]  # 3 sequences x 4 pages in sequence order
    keys = PagedKeys(index_pages, None, torch.tensor(200), torch.tensor(150), mask, pool_pages)
    expected = dsa_paged_static.static_kpool_indexer_topk(q_index, weights, keys, 32, ape)
    calls = count_calls(monkeypatch, dsa_paged_cpu, "indexer_topk_decode")
    got = dsa_paged_cpu.static_kpool_indexer_topk_cpu(q_index.bfloat16(), weights, bf16_pages(keys), 32, ape)
    assert len(calls) == 1 and torch.equal(got, expected)


@needs_kernel_build
def test_kpool_decode_step_never_reads_a_pool_that_ends_after_the_query():
    """Scores that grow with the pool's position make the latest visible pools the best: at four consecutive query
    positions (every residue mod kp, for each of the three phases) the selection stops exactly at the last pool that
    ends by the query, as the torch path's does (a pool ending one token later holds a stale key)."""
    q_index, weights, index_pages, pool_pages, table, mask, ape = kpool_case()
    slots_per_page = pool_pages.shape[1]
    for sequence in range(table.shape[0]):
        for logical, page in enumerate(table[sequence].tolist()):
            slots = torch.arange(logical * slots_per_page, (logical + 1) * slots_per_page, dtype=torch.float32)
            pool_pages[page] = (slots / 64)[:, None]  # exact in bf16
    q_index, weights = torch.ones_like(q_index), torch.ones_like(weights)
    for query in range(290, 294):
        keys = PagedKeys(index_pages, table, 300, query, mask, pool_pages)
        expected = dsa_paged_cpu.paged_kpool_indexer_topk_cpu(q_index, weights, keys, 32, ape)
        got = dsa_paged_cpu.paged_kpool_indexer_topk_cpu(q_index.bfloat16(), weights, bf16_pages(keys), 32, ape)
        assert torch.equal(got, expected) and int(got.max()) == query


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) is the same source built without `vdpbf16ps`
    (`cpu_extension.PRELUDE`'s `dot_bf16_pairs`)."""
    assert_avx2_builds_pass(__file__)
