"""The hand-written CPU kernel of a decode step's sparse attention (modeling_kdsa/cpu_sparse_mla.py, docs/dsa.md §12):
its output against the fp32 reference, the block table, unselected slots, the callers that route to it, its fallbacks
and its input checks; its build: test_cpu_extension.py."""

import pytest
import torch
from conftest import assert_avx2_builds_pass, count_calls, needs_kernel_build, runs_avx512_builds

from modeling_kdsa import cpu_extension, cpu_sparse_mla, dsa_paged_cpu
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_cpu import paged_sparse_mla_cpu, static_sparse_mla_cpu
from modeling_kdsa.dsa_paged_fused import attend_selected
from modeling_kdsa.dsa_paged_reference import paged_sparse_mla_reference
from modeling_kdsa.dsa_paged_static import static_sparse_mla
from modeling_kdsa.numeric_formats import CacheFormats

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count")


def sparse_case(batch=2, heads=16, latent=256, rope=32, page_size=64, num_keys=1000, selected=61, seed=0):
    """bf16 inputs of one decode step: shuffled pages (one spare page unused), `selected` distinct keys per sequence
    in random order with a few -1 (no key) among them; the softmax scale sharpens the scores so that a few rows
    dominate, as trained attention does."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_sequence = -(-num_keys // page_size)
    num_pages = batch * pages_per_sequence + 1
    width = latent + rope
    pages = torch.randn(num_pages, page_size, width, generator=generator).bfloat16()
    table = torch.randperm(num_pages, generator=generator)[: batch * pages_per_sequence].view(batch, -1)
    q_latent = torch.randn(batch, 1, heads, latent, generator=generator).bfloat16()
    q_pe = torch.randn(batch, 1, heads, rope, generator=generator).bfloat16()
    indices = torch.stack([torch.randperm(num_keys, generator=generator)[:selected] for _ in range(batch)])[:, None]
    indices[:, :, 3] = -1
    indices[0, 0, -5:] = -1
    return q_latent, q_pe, pages, table, indices, 2.0 * width**-0.5


def fp32_reference(q_latent, q_pe, pages, table, indices, scale):
    return paged_sparse_mla_reference(q_latent.float(), q_pe.float(), PagedKeys(pages.float(), table), indices, scale)


@needs_kernel_build
@pytest.mark.parametrize(
    "batch, heads, latent, rope, selected",
    [
        (2, 16, 256, 32, 61),  # the benchmark's geometry; 59 / 60 real keys: a padded last group of 8 rows
        (1, 16, 512, 64, 40),  # DeepSeek-V3.2's latent and rope widths (its 128 heads over 8 ranks)
        (3, 8, 32, 2, 9),  # the smallest widths the kernel takes
        (1, 8, 64, 0, 6),  # no rope part (NoPE, GLM-5.3-Flash's shape); fewer keys than one group of 8
    ],
)
def test_kernel_is_as_close_to_the_fp32_reference_as_the_torch_path(batch, heads, latent, rope, selected):
    """Against the fp32 reference on the upcast inputs, the kernel's output (fp32 sums of exact bf16 products, fp32
    softmax, probabilities rounded to bf16 as the torch path rounds them) is within bf16 rounding and no farther than
    the torch bf16 path's."""
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch, heads, latent, rope, selected=selected)
    assert cpu_sparse_mla.decode_kernel_applies(q_latent, q_pe, pages)
    expected = fp32_reference(q_latent, q_pe, pages, table, indices, scale)
    got = paged_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    torch_path = attend_selected(q_latent, q_pe, pages, table, indices, scale)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    error, torch_error = (got.float() - expected).abs().max(), (torch_path.float() - expected).abs().max()
    assert error <= 2**-8 * expected.abs().max()
    assert error <= torch_error * 1.01


@needs_kernel_build
@pytest.mark.parametrize("batch, queries", [(2, 2), (1, 8), (2, 16)])
def test_several_queries_are_rows_of_one_kernel_call(monkeypatch, batch, queries):
    """Up to MAX_KERNEL_QUERIES queries per sequence (a verification), each with its own selection: one kernel call,
    each query's output the kernel's output for that query alone, and as close to the fp32 reference as the torch
    path."""
    calls = count_calls(monkeypatch, dsa_paged_cpu, "sparse_mla_decode_cpu")
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch)
    generator = torch.Generator().manual_seed(queries)
    q_latent = torch.randn(batch, queries, 16, 256, generator=generator).bfloat16()
    q_pe = torch.randn(batch, queries, 16, 32, generator=generator).bfloat16()
    indices = torch.stack([torch.stack([torch.randperm(1000, generator=generator)[:61] for _ in range(queries)])
                           for _ in range(batch)])  # fmt: skip
    indices[:, :, 5] = -1
    got = paged_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    assert len(calls) == 1 and got.shape == q_latent.shape
    monkeypatch.undo()
    for t in range(queries):
        query = slice(t, t + 1)
        alone = paged_sparse_mla_cpu(
            q_latent[:, query], q_pe[:, query], PagedKeys(pages, table), indices[:, query], scale
        )
        assert torch.equal(got[:, t : t + 1], alone)
    expected = fp32_reference(q_latent, q_pe, pages, table, indices, scale)
    torch_path = attend_selected(q_latent, q_pe, pages, table, indices, scale)
    error, torch_error = (got.float() - expected).abs().max(), (torch_path.float() - expected).abs().max()
    assert error <= torch_error * 1.01


@needs_kernel_build
def test_a_sequence_without_keys_gets_zeros():
    """Every slot -1 (nothing selected): the output is 0, as the reference's (docs/dsa.md §6); the other sequence is
    unaffected."""
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch=2)
    indices[1] = -1
    got = paged_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    expected = fp32_reference(q_latent, q_pe, pages, table, indices, scale)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert (got[0].float() - expected[0]).abs().max() <= 2**-8 * expected[0].abs().max()


@needs_kernel_build
def test_static_cpu_sparse_mla_uses_the_kernel(monkeypatch):
    """The cpu backend's fixed-shape sparse attention (a compiled step's) goes through the kernel and is as close to
    the fp32 reference as the torch one."""
    q_latent, q_pe, pages, table, indices, scale = sparse_case()
    calls = count_calls(monkeypatch, dsa_paged_cpu, "sparse_mla_decode_cpu")
    got = static_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    assert len(calls) == 1
    expected = fp32_reference(q_latent, q_pe, pages, table, indices, scale)
    torch_out = static_sparse_mla(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    torch_error = (torch_out.float() - expected).abs().max()
    assert (got.float() - expected).abs().max() <= min(torch_error * 1.01, 2**-8 * expected.abs().max())


@needs_kernel_build
def test_compiled_static_cpu_sparse_mla_is_one_graph():
    """Inside torch.compile(fullgraph=True) the kernel is one opaque op: inductor compiles around it and the result
    is the eager one; `opcheck` checks the fake against the real op."""
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch=1)
    expected = static_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale)
    torch._dynamo.reset()
    compiled = torch.compile(static_sparse_mla_cpu, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q_latent, q_pe, PagedKeys(pages, table), indices, scale), expected)
    op_args = (q_latent[:, 0].contiguous(), q_pe[:, 0].contiguous(), pages, table, indices[:, 0].contiguous(), scale)
    torch.library.opcheck(torch.ops.kdsa.sparse_mla_decode.default, op_args)


def test_callers_keep_the_torch_path_where_the_kernel_does_not_apply(monkeypatch):
    """fp32 queries, several queries per sequence (to the kernel itself: the caller splits them into rows), head counts
    that are not a multiple of 8, latent widths that are not a multiple of 32, pages not stored contiguously and
    quantized pages never reach the kernel, nor does anything with more threads than MAX_THREADS or when it is
    unavailable: the torch path's result comes back."""
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch=1, heads=8, latent=64, rope=16)
    rows = pages.shape[1] * pages.shape[0]
    two_queries = (q_latent.expand(1, 2, 8, 64), q_pe.expand(1, 2, 8, 16), pages)
    strided = pages.transpose(0, 1).contiguous().transpose(0, 1)
    quantized = CacheFormats(kv_cache="fp8", kv_cache_tile_size=32).encode_kv_rows(pages.reshape(rows, -1).float(), 64)
    for case in [
        (q_latent.float(), q_pe.float(), pages.float()),
        two_queries,
        (q_latent[:, :, :4], q_pe[:, :, :4], pages),
        (q_latent[..., :48], q_pe, pages[..., 16:]),
        (q_latent, q_pe, strided),
        (q_latent, q_pe, quantized),
    ]:
        assert not cpu_sparse_mla.decode_kernel_applies(*case)
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", torch.get_num_threads() - 1)
    assert not cpu_sparse_mla.decode_kernel_applies(q_latent, q_pe, pages)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_sparse_mla, "kernel_available", lambda: False)
    assert not cpu_sparse_mla.decode_kernel_applies(q_latent, q_pe, pages)
    monkeypatch.setattr(dsa_paged_cpu, "sparse_mla_decode_cpu", None)  # would raise if called
    expected = attend_selected(q_latent, q_pe, pages, table, indices, scale)
    assert torch.equal(paged_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale), expected)
    assert torch.equal(static_sparse_mla_cpu(q_latent, q_pe, PagedKeys(pages, table), indices, scale), expected)


@needs_kernel_build
def test_kernel_refuses_inputs_it_cannot_read():
    """The op reads raw pointers: a wrong dtype, a strided tensor, mismatched shapes or an index outside the block
    table's pages is a ValueError, not a crash."""
    assert cpu_sparse_mla.kernel_available()  # loads the op's CPU kernel
    q_latent, q_pe, pages, table, indices, scale = sparse_case(batch=1, num_keys=128)
    good = [q_latent[:, 0].contiguous(), q_pe[:, 0].contiguous(), pages, table, indices[:, 0].contiguous(), scale]
    assert cpu_sparse_mla.sparse_mla_decode(*good).shape == (1, 16, 256)
    hole = table.clone()
    hole[0, 1] = -1  # a page the selection reads is unmapped
    for position, bad in [
        (0, good[0].float()),  # fp32 queries
        (2, pages.transpose(1, 2).contiguous().transpose(1, 2)),  # strided pages
        (2, pages[..., :-2].contiguous()),  # rows narrower than C + R
        (1, good[1][:, :4].contiguous()),  # q_pe for 4 of the 16 heads
        (3, table.int()),  # int32 block table
        (4, good[4].int()),  # int32 indices
        (3, table[:, :1].contiguous()),  # a block table shorter than the selected positions
        (3, hole),
        (4, torch.cat([good[4], good[4]])),  # indices for two sequences
    ]:
        with pytest.raises(ValueError, match="sparse_mla_decode"):
            cpu_sparse_mla.sparse_mla_decode(*good[:position], bad, *good[position + 1 :])
    narrow = (good[0][:, :, :48].contiguous(), good[1], pages[..., :80].contiguous(), *good[3:])
    with pytest.raises(ValueError, match="sparse_mla_decode"):  # a latent width that is not a multiple of 32
        cpu_sparse_mla.sparse_mla_decode(*narrow)


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) is the same source built without `vdpbf16ps`: the scores
    through `cpu_extension.PRELUDE`'s `dot_bf16_pairs`, the weighted sum with FMAs of widened rows."""
    assert_avx2_builds_pass(__file__)
