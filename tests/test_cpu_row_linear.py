"""The hand-written CPU kernel of a single-row bf16 linear product (modeling_kdsa/cpu_row_linear.py, docs/graph-mode.md
§10): its result against `F.linear` and the fp32 product, the cases the `cpu` backend's `row_linear` (`linear` here)
routes to it and those it keeps on the torch reference, the compiled op and its input checks — for the build this CPU
runs, and on an AVX512-BF16 CPU again for the AVX2 build in a second process; its build: test_cpu_extension.py."""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    assert_avx2_builds_pass,
    assert_refused_like_every_cpu_kernel,
    count_calls,
    graph_recorder,
    graph_targets,
    needs_kernel_build,
    runs_avx512_builds,
)

from modeling_kdsa import cpu_extension, cpu_row_linear
from modeling_kdsa.kernels import CPU_KERNELS

linear = CPU_KERNELS.row_linear  # the kernel where it applies, else the torch reference

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count", "no_grad")


def integer_case(rows_out=7, width=100, bias=True, shape=(1, 1), seed=0):
    """Small integers: every product and sum is exact in fp32, so any summation order gives the same bf16 result."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (*shape, width), generator=generator).bfloat16()
    weight = torch.randint(-3, 4, (rows_out, width), generator=generator).bfloat16()
    b = torch.randint(-3, 4, (rows_out,), generator=generator).bfloat16() if bias else None
    return x, weight, b


@needs_kernel_build
@pytest.mark.parametrize(
    "rows_out, width, bias, shape",
    [
        (7, 100, True, (1, 1)),  # 3 steps of 32 + a masked step of 4
        (64, 1024, False, (1,)),  # only unrolled steps of 128
        (5, 300, True, (1, 1)),  # every loop: 2 unrolled steps, 1 step of 32, a masked step of 12
        (5, 31, True, ()),  # a single masked step; x [K]
        (3, 32, False, (1, 1, 1)),  # a single step of 32
        (7, 100, True, (2, 1)),  # two rows (a decode step of two sequences), a masked step
        (8, 64, False, (2,)),  # two rows, whole steps of 32
        (5, 300, True, (2,)),  # two rows through every loop
        (5, 300, False, (3, 1)),  # three rows
        (6, 300, True, (1, 4)),  # four rows
        # More than 4 rows (a verification of several tokens): groups of up to 4 over blocks of weight rows
        (7, 100, True, (1, 5)),  # a group of 4 and a group of 1
        (6, 300, False, (1, 8)),  # two groups of 4
        (70, 300, True, (13,)),  # groups of 4, 4, 4, 1 over three blocks of weight rows (27 rows of 300 each)
        (40, 1024, True, (2, 8)),  # 16 rows over five blocks of 8 weight rows
    ],
)
def test_kernel_equals_f_linear_on_exact_inputs(rows_out, width, bias, shape):
    x, weight, b = integer_case(rows_out, width, bias, shape)
    assert cpu_row_linear.row_linear_applies(x, weight, b)
    got = linear(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (*shape, rows_out)
    assert torch.equal(got, F.linear(x, weight, b))


@needs_kernel_build
def test_two_threads_each_compute_a_block_of_weight_rows(monkeypatch):
    """With two threads a weight over the kernel's grain (~512 KiB per thread) is split into two blocks of rows, one
    per thread: every output is still the exact product, for one and for four rows of x. (That the split happens at
    all needs the OpenMP build: test_cpu_extension.py.)"""
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", 2)
    torch.set_num_threads(2)
    try:
        for shape in [(1,), (4, 1)]:
            x, weight, b = integer_case(rows_out=2 * 1024 + 3, width=256, shape=shape)  # grain: 1024 rows of 256
            assert cpu_row_linear.row_linear_applies(x, weight, b)
            assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))
    finally:
        torch.set_num_threads(threads)


@needs_kernel_build
def test_random_bf16_rows_are_within_bf16_rounding_of_the_fp32_product():
    assert cpu_row_linear.kernel_available()  # loads the op, whichever test of the file runs first
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1000, generator=generator).bfloat16()
    weight = torch.randn(300, 1000, generator=generator).bfloat16()
    bias = torch.randn(300, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float())
    got = cpu_row_linear.row_linear(x, weight, bias)
    assert ((got.float() - expected).abs() <= 2**-8 * expected.abs() + 1e-6).all()  # one rounding of the fp32 sum


@needs_kernel_build
@pytest.mark.parametrize("width", [128, 1000, 2816])  # 1000: a tail of 8 columns and steps of 8 / 32
def test_each_row_has_the_same_bits_whatever_rows_share_the_call(width):
    """A verification of n drafted tokens must give each token the product bits of its one-token step (docs/
    speculative.md §2): every output row of a call with 2 to 16 rows equals that row alone, on random values where a
    different summation order shows in the last bf16 bit."""
    assert cpu_row_linear.kernel_available()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(16, width, generator=generator).bfloat16()
    weight = torch.randn(512, width, generator=generator).bfloat16()
    alone = torch.cat([torch.ops.kdsa.row_linear(x[i : i + 1], weight, None) for i in range(16)])
    for rows in (2, 3, 4, 5, 8, 16):
        assert torch.equal(torch.ops.kdsa.row_linear(x[:rows], weight, None), alone[:rows]), rows


@needs_kernel_build
def test_linear_routes_only_up_to_sixteen_bf16_rows_without_autograd_to_the_kernel(monkeypatch):
    """`linear` sends 1 to 16 eager bf16 rows to the kernel; 17 rows, fp32, autograd, autocast, a non-contiguous
    weight, a weight subclass, more threads than MAX_THREADS and an unavailable kernel keep `F.linear`."""
    calls = count_calls(monkeypatch, cpu_row_linear, "row_linear")
    x, weight, b = integer_case(rows_out=8, width=64)
    linear(x, weight, b)
    assert len(calls) == 1

    class Subclass(torch.Tensor):
        pass

    strided = torch.empty(64, 16).bfloat16().t()
    assert cpu_row_linear.row_linear_applies(x.expand(16, 1, 64), weight, b)
    cases = [(x.expand(17, 1, 64), weight, b), (x.float(), weight.float(), b.float()), (x, strided, None)]
    cases.append((x, weight.as_subclass(Subclass), b))
    for case in cases:
        assert not cpu_row_linear.row_linear_applies(*case)
        linear(*case)
    assert_refused_like_every_cpu_kernel(monkeypatch, cpu_row_linear.row_linear_applies, (x, weight, b), cpu_row_linear)
    assert len(calls) == 1


@needs_kernel_build
def test_compiled_linear_holds_the_kernel_as_one_op():
    """Compiled, a single bf16 row goes through the kernel as one opaque op (not inductor's fused multiply-and-sum)
    with the eager result; `opcheck` checks the fake against the real op."""
    x, weight, b = integer_case(rows_out=8, width=64)
    backend, graphs = graph_recorder()

    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True, dynamic=False, backend=backend)
    assert torch.equal(compiled(x, weight, b), linear(x, weight, b))
    assert any("row_linear" in target for target in graph_targets(graphs))
    torch.library.opcheck(torch.ops.kdsa.row_linear.default, (x, weight, b))


@needs_kernel_build
def test_kernel_refuses_inputs_it_cannot_read():
    """The op reads raw pointers: a wrong dtype, 17 rows, a width mismatch, a strided weight or a bias of the wrong
    size is a ValueError, not a crash."""
    assert cpu_row_linear.kernel_available()  # loads the op's CPU kernel
    x, weight, b = integer_case(rows_out=8, width=64)
    for bad in [
        (x.float(), weight, b),
        (x.expand(1, 17, 64).contiguous(), weight, b),
        (x[..., :0].contiguous(), weight[:, :0].contiguous(), b),
        (x[..., :63].contiguous(), weight, b),
        (x, weight.t().contiguous().t(), b),
        (x, weight, b[:7].contiguous()),
        (x, weight, b.float()),
    ]:
        with pytest.raises(ValueError, match="row_linear takes"):
            cpu_row_linear.row_linear(*bad)


@needs_kernel_build
def test_an_exported_program_keeps_f_linear():
    """`torch.export` records `F.linear`, not the op: an exported program may run where the kernel is not registered."""
    x, weight, b = integer_case(rows_out=8, width=64)

    class Layer(torch.nn.Module):
        def forward(self, x, weight, b):
            return linear(x, weight, b)

    for strict in (False, True):  # traced by dispatch on fake tensors, or by dynamo on the real ones
        program = torch.export.export(Layer(), (x, weight, b), strict=strict)
        targets = [str(node.target) for node in program.graph.nodes]
        assert not any("row_linear" in target for target in targets) and any("linear" in t for t in targets)


@needs_kernel_build
def test_a_strided_slice_of_two_sequences_goes_through_the_kernel(monkeypatch):
    """The last position of each of 2 sequences (`hidden[:, -1:]`, what the lm_head sees in a decode step) is a
    strided view: `linear` passes a contiguous copy of those rows to the kernel."""
    calls = count_calls(monkeypatch, cpu_row_linear, "row_linear")
    hidden, weight, b = integer_case(rows_out=8, width=64, shape=(2, 5))
    last = hidden[:, -1:]
    assert not last.is_contiguous()
    assert torch.equal(linear(last, weight, b), F.linear(last, weight, b)) and len(calls) == 1


@needs_kernel_build
def test_the_process_runs_the_build_kdsa_cpu_kernels_asks_for():
    """Under KDSA_CPU_KERNELS=avx2 (the second process of the next test) the op is the AVX2 build."""
    assert cpu_row_linear.kernel_available()
    if os.environ.get("KDSA_CPU_KERNELS") == "avx2":
        assert cpu_extension.kernel_isa() == "avx2"


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) implements the same op from another source."""
    assert_avx2_builds_pass(__file__)
