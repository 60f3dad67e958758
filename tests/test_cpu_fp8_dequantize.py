"""The hand-written CPU kernels of block-scaled E4M3 weights (modeling_kdsa/cpu_fp8_dequantize.py,
docs/checkpoint-conversion.md §9): the dequantization, bit for bit torch's `values.float() * scales` (and its cast to
bf16) over every E4M3 value, tile shapes and edges, the cases `dequantize_tiles` keeps on the torch path, and the op's
input checks; the fused row product of a held layer, bit for bit the dequantized layer's, where it runs and where it
does not, and its input checks."""

import os

import pytest
import torch
from conftest import (
    assert_avx2_builds_pass,
    count_calls,
    graph_recorder,
    graph_targets,
    needs_kernel_build,
    runs_avx512_builds,
)

from modeling_kdsa import cpu_extension, cpu_fp8_dequantize
from modeling_kdsa.fp8_linear import KDSAFP8Linear, dequantize_tiles
from modeling_kdsa.kernels import CPU_KERNELS
from modeling_kdsa.linear_ops import dequantize_tiles_torch

linear = CPU_KERNELS.row_linear  # the row kernel where it applies, else the torch reference

ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN included (0x7f, 0xff)


def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit where the expected value is a number; NaN where it is NaN (torch's NaN bits differ between its
    vectorised and scalar casts)."""
    nan = expected.isnan()
    integer = torch.int16 if expected.dtype == torch.bfloat16 else torch.int32
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(integer)[~nan], expected.view(integer)[~nan])


def case(shape, block, seed=0, scale_range=(-12, 2)):
    """E4M3 values cycling through all 256 codes (a random permutation) and log-uniform positive scales."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    low, high = scale_range
    scale_inv = torch.pow(2.0, low + (high - low) * torch.rand(grid, generator=generator))
    return values, scale_inv


@needs_kernel_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape, block",
    [
        ((40, 70), (16, 16)),  # partial tiles on both edges; a masked last step of 6 columns
        ((3, 40, 70), (16, 32)),  # stacked experts [E, N, K], each with its own grid
        ((130, 300), (128, 128)),  # DeepSeek's blocks, edge tiles of 2 rows and 44 columns
        ((9, 50), (4, 24)),  # column blocks that are not a multiple of 16: each lane finds its own scale
        ((5, 7), (2, 3)),  # narrower than one vector
    ],
)
def test_kernel_equals_the_torch_path(shape, block, dtype):
    values, scale_inv = case(shape, block)
    assert cpu_fp8_dequantize.kernel_applies(values, scale_inv, dtype)
    got = dequantize_tiles(values, scale_inv, block, dtype)
    assert got.dtype == dtype and got.shape == values.shape
    assert same_bits(got, dequantize_tiles_torch(values, scale_inv, block, dtype))


@needs_kernel_build
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 3.0e-3, 2.0**-140, 1.0e30])
def test_every_e4m3_value(dtype, scale):
    """All 256 codes (zeros of both signs, subnormals, the largest normals, NaN) with one scale: exact, an fp32
    product that rounds, one that is an fp32 subnormal, and one that overflows to infinity."""
    values = ALL_E4M3.view(16, 16)
    scale_inv = torch.full((1, 1), scale)
    got = dequantize_tiles(values, scale_inv, (16, 16), dtype)
    assert same_bits(got, dequantize_tiles_torch(values, scale_inv, (16, 16), dtype))


def held_layer(rows: int, cols: int, block: tuple[int, int], bias: bool = False, seed: int = 1) -> KDSAFP8Linear:
    """A held layer with E4M3 values from a Gaussian (no NaN code, whose products have no bits to compare) and
    log-uniform tile scales; a bf16 bias."""
    generator = torch.Generator().manual_seed(seed)
    _, scale_inv = case((rows, cols), block, seed=seed, scale_range=(-10, -6))
    values = (torch.randn(rows, cols, generator=generator) * 50).to(torch.float8_e4m3fn)
    b = torch.randn(rows, generator=generator).bfloat16() if bias else None
    return KDSAFP8Linear(values, scale_inv, block, b)


@needs_kernel_build
def test_held_layer_reaches_the_kernel(monkeypatch):
    """A `KDSAFP8Linear` forward dequantizes through the kernel (once per forward) and gives the torch path's result."""
    layer = held_layer(48, 40, (16, 16))
    x = torch.randn(2, 3, 40).bfloat16()
    calls = []
    kernel = cpu_fp8_dequantize.dequantize_fp8_tiles
    monkeypatch.setattr(cpu_fp8_dequantize, "dequantize_fp8_tiles", lambda *a: calls.append(a) or kernel(*a))
    with torch.no_grad():
        got = layer(x)
    assert len(calls) == 1
    monkeypatch.setattr(cpu_fp8_dequantize, "kernel_available", lambda: False)
    with torch.no_grad():
        assert torch.equal(got, layer(x))
    assert len(calls) == 1


def test_torch_path_where_the_kernel_does_not_apply(monkeypatch):
    """fp16 results, values already cast (the dequantize-at-load path receives them in the load dtype), autograd
    through the scales, or no kernel: the torch path."""
    values, scale_inv = case((20, 20), (8, 8))
    assert not cpu_fp8_dequantize.kernel_applies(values, scale_inv, torch.float16)
    assert not cpu_fp8_dequantize.kernel_applies(values.float(), scale_inv, torch.float32)
    assert not cpu_fp8_dequantize.kernel_applies(values, scale_inv.requires_grad_(), torch.float32)
    scale_inv.requires_grad_(False)
    half = dequantize_tiles(values, scale_inv, (8, 8), torch.float16)
    assert same_bits(half.float(), dequantize_tiles_torch(values, scale_inv, (8, 8), torch.float16).float())
    monkeypatch.setattr(cpu_fp8_dequantize, "kernel_available", lambda: False)
    assert not cpu_fp8_dequantize.kernel_applies(values, scale_inv, torch.bfloat16)


def test_bad_input_is_a_value_error():
    if not cpu_fp8_dequantize.kernel_available():
        pytest.skip("the kernel is not built on this CPU")
    values, scale_inv = case((20, 20), (8, 8))
    op = cpu_fp8_dequantize.dequantize_fp8_tiles
    for args in (
        (values.float(), scale_inv, 8, 8, torch.bfloat16),  # not E4M3
        (values, scale_inv.double(), 8, 8, torch.bfloat16),  # fp64 scales
        (values, scale_inv[:2], 8, 8, torch.bfloat16),  # a grid one row short
        (values, scale_inv, 16, 8, torch.bfloat16),  # a grid that does not match the blocks
        (values, scale_inv, 0, 8, torch.bfloat16),  # an empty block
        (values, scale_inv, 8, 8, torch.float16),  # an fp16 result
        (values.t(), scale_inv, 8, 8, torch.bfloat16),  # non-contiguous values
        (values[0], scale_inv[0], 8, 8, torch.bfloat16),  # 1-D values
    ):
        with pytest.raises(ValueError, match="dequantize_fp8_tiles takes contiguous float8_e4m3fn"):
            op(*args)


@needs_kernel_build
def test_compiled_forward_leaves_the_conversion_to_inductor():
    """Inside a compile the torch path is traced (inductor fuses the conversion into the product's loop,
    docs/graph-mode.md §9): the captured graph holds no kernel call, and gives the eager forward's result."""
    layer = held_layer(48, 40, (16, 16))
    x = torch.randn(1, 1, 40).bfloat16()
    recording, graphs = graph_recorder()

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(layer, backend=recording, fullgraph=True)(x)
        assert torch.equal(got, layer(x))
    torch._dynamo.reset()
    assert graphs and not any("dequantize_fp8_tiles" in target for target in graph_targets(graphs))


def dequantized_forward(layer: KDSAFP8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the held layer computed before the fused kernel: the dequantized weight, then `linear` (the row kernel)."""
    return linear(x, layer.dequantized_weight(x.dtype), layer.bias)


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
@pytest.mark.parametrize(
    "rows, cols, block, x_rows, bias",
    [
        (48, 40, (16, 32), (1, 1), False),  # one step of 32 and a masked tail of 8; partial edge tiles
        (130, 300, (128, 128), (2, 1), True),  # every loop: 2 unrolled steps, a step of 32, a tail of 12; edge tiles
        (64, 1024, (128, 128), (4,), False),  # unrolled steps only, four rows
        (130, 300, (128, 128), (2, 8), True),  # sixteen rows (a verification): groups of 4 over blocks of weight rows
        (9, 96, (4, 32), (5,), False),  # five rows: groups of 4 and 1
        (9, 96, (4, 32), (3,), True),  # each vector of 32 columns its own tile
        (5, 20, (1, 64), (1,), False),  # narrower than one vector
        (8, 256, (8, 64), (1,), False),  # two tiles within each unrolled step of 128 columns
    ],
)
def test_fused_row_product_is_the_dequantized_layers_product(monkeypatch, rows, cols, block, x_rows, bias):
    """A held layer's forward of 1 to 16 bf16 rows runs the fused kernel once and gives, bit for bit, the dequantized
    weight's row product (the same vectors in the same order); strided rows (a slice of wider activations) too."""
    calls = count_calls(monkeypatch, cpu_fp8_dequantize, "fp8_row_linear")
    layer = held_layer(rows, cols, block, bias)
    wide = torch.randn(*x_rows, cols + 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    x = wide[..., :cols].contiguous()
    with torch.no_grad():
        assert cpu_fp8_dequantize.fp8_row_linear_applies(x, layer.weight, layer.weight_scale_inv, block, layer.bias)
        got = layer(x)
        assert got.shape == (*x_rows, rows) and torch.equal(got, dequantized_forward(layer, x))
        assert torch.equal(layer(wide[..., :cols]), got)
    assert len(calls) == 2


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
def test_fused_row_product_adds_in_the_row_kernels_order():
    """fp32 sums depend on their order. Products 2^24, 1, 1, -2^24 in four columns, then 1 in a last column the loop
    takes apart, add to 3, 2 or 1 depending on the order; each build's fused product must give its row kernel's sum.
    AVX512-BF16 (columns 0, 32, 64, 96 in its four accumulators, column 128 in the masked last step, added to the
    second): 3; adding the last column to the first accumulator gives 1 (2^24 + 1 rounds to 2^24), pairing (first +
    third) + (second + fourth) gives 2. AVX2 (columns 0, 8, 16, 24 in its four chains, summed in chain order, column 32
    added last on its own): 1; summing the chains pairwise gives 2."""
    avx2 = cpu_extension.kernel_isa() == "avx2"
    columns, k, expected = ([0, 8, 16, 24, 32], 33, 1.0) if avx2 else ([0, 32, 64, 96, 128], 129, 3.0)
    values = torch.zeros(1, k)
    values[0, columns] = torch.tensor([256.0, 1.0, 1.0, -256.0, 1.0])
    scale_inv = torch.ones(1, -(-k // 32))
    layer = KDSAFP8Linear(values.to(torch.float8_e4m3fn), scale_inv, (1, 32))
    x = torch.zeros(1, k).bfloat16()
    x[0, columns] = torch.tensor([2.0**16, 1.0, 1.0, 2.0**16, 1.0]).bfloat16()  # 256 · 2^16 = 2^24
    with torch.no_grad():
        assert cpu_fp8_dequantize.fp8_row_linear_applies(x, layer.weight, layer.weight_scale_inv, (1, 32), None)
        assert layer(x).item() == dequantized_forward(layer, x).item() == expected


@needs_kernel_build
def test_fused_row_product_splits_weight_rows_over_two_threads(monkeypatch):
    """Over the kernel's grain (~512 KiB of values per thread) the weight rows are split between two threads: the
    result is still the dequantized layer's. (That the split happens at all needs the OpenMP build:
    test_cpu_extension.py.)"""
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_extension, "MAX_THREADS", 2)
    torch.set_num_threads(2)
    try:
        layer = held_layer(4100, 256, (128, 128), bias=True)  # grain: 2048 rows of 256
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
        with torch.no_grad():
            assert torch.equal(layer(x), dequantized_forward(layer, x))
    finally:
        torch.set_num_threads(threads)


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
def test_dequantized_product_where_the_fused_kernel_does_not_apply(monkeypatch):
    """17 rows, fp32 activations, tiles of 48 columns, an fp32 bias, strided values or scales, autograd, autocast,
    more threads than MAX_THREADS, export and an unavailable kernel: the layer dequantizes, then multiplies, as
    before."""
    calls = count_calls(monkeypatch, cpu_fp8_dequantize, "fp8_row_linear")
    layer = held_layer(32, 96, (16, 32))  # a 2 x 3 grid of scales
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    applies = cpu_fp8_dequantize.fp8_row_linear_applies
    scale_inv = layer.weight_scale_inv
    refused = [
        (x.expand(17, 96), layer.weight, scale_inv, (16, 32), None),
        (x.float(), layer.weight, scale_inv, (16, 32), None),
        (x, layer.weight, scale_inv, (16, 48), None),
        (x, layer.weight, scale_inv, (16, 32), torch.zeros(32)),
        (x, layer.weight.float(), scale_inv, (16, 32), None),
        (x, layer.weight.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn), scale_inv, (16, 32), None),
        (x, layer.weight, scale_inv.double(), (16, 32), None),
        (x, layer.weight, scale_inv.t().contiguous().t(), (16, 32), None),
    ]
    with torch.no_grad():
        assert applies(x, layer.weight, scale_inv, (16, 32), None)
        for args in refused:
            assert not applies(*args)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not applies(x, layer.weight, scale_inv, (16, 32), None)
        many_rows = x.expand(17, 96)
        assert torch.equal(layer(many_rows), dequantized_forward(layer, many_rows))
    assert not applies(x, layer.weight, scale_inv, (16, 32), None)  # autograd on
    with torch.no_grad():
        monkeypatch.setattr(cpu_extension, "MAX_THREADS", torch.get_num_threads() - 1)
        assert not applies(x, layer.weight, scale_inv, (16, 32), None)
        monkeypatch.setattr(cpu_extension, "MAX_THREADS", torch.get_num_threads())
        program = torch.export.export(layer, (x,), strict=False)
        assert not any("fp8_row_linear" in str(node.target) for node in program.graph.nodes)
        monkeypatch.setattr(cpu_fp8_dequantize, "kernel_available", lambda: False)
        assert not applies(x, layer.weight, scale_inv, (16, 32), None)
        assert torch.equal(layer(x), dequantized_forward(layer, x))
    assert not calls


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
def test_compiled_held_layer_holds_the_fused_kernel_as_one_op():
    """Compiled (a decode step with held layers), a bf16 row goes through the fused kernel as one opaque op, with the
    eager result: inductor's own fusion of the traced conversion into the product took 9x longer."""
    layer = held_layer(32, 96, (16, 32), bias=True)
    x = torch.randn(1, 1, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    recording, graphs = graph_recorder()

    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, backend=recording, fullgraph=True)(x), dequantized_forward(layer, x))
        assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x), dequantized_forward(layer, x))
    torch._dynamo.reset()
    targets = graph_targets(graphs)
    assert any("fp8_row_linear" in target for target in targets)
    assert not any("dequantize_fp8_tiles" in target for target in targets)


@needs_kernel_build
def test_fused_row_product_refuses_inputs_it_cannot_read():
    """The op reads raw pointers: wrong dtypes, 17 rows, a width or grid mismatch, tiles of 48 columns, strided
    values or a bias of the wrong size is a ValueError, not a crash; `opcheck` checks the fake against the op."""
    assert cpu_fp8_dequantize.kernel_available()
    layer = held_layer(16, 96, (16, 32), bias=True)
    values, scale_inv, bias = layer.weight.detach(), layer.weight_scale_inv.detach(), layer.bias
    x = torch.randn(1, 96).bfloat16()
    op = cpu_fp8_dequantize.fp8_row_linear
    for args in [
        (x.float(), values, scale_inv, 16, 32, bias),
        (x, values.float(), scale_inv, 16, 32, bias),
        (x, values, scale_inv.double(), 16, 32, bias),
        (x.expand(17, 96).contiguous(), values, scale_inv, 16, 32, bias),
        (x[:, :64].contiguous(), values, scale_inv, 16, 32, bias),
        (x, values, scale_inv[:, :2].contiguous(), 16, 32, bias),
        (x, values, scale_inv[:, :2].contiguous(), 16, 48, bias),  # tiles of 48 columns, their grid
        (x, values, scale_inv, 0, 32, bias),
        (x, values.view(torch.uint8).t().contiguous().t().view(torch.float8_e4m3fn), scale_inv, 16, 32, bias),
        (x, values, scale_inv, 16, 32, bias[:8].contiguous()),
        (x, values, scale_inv, 16, 32, bias.float()),
    ]:
        with pytest.raises(ValueError, match="fp8_row_linear takes contiguous bf16 x"):
            op(*args)
    # The schema check multiplies the inputs, which torch cannot do for float8: the fake is checked alone.
    args = (x, values, scale_inv, 16, 32, bias)
    torch.library.opcheck(torch.ops.kdsa.fp8_row_linear.default, args, test_utils="test_faketensor")


@needs_kernel_build
def test_the_process_runs_the_build_kdsa_cpu_kernels_asks_for():
    """Under KDSA_CPU_KERNELS=avx2 (the second process of the next test) the ops are the AVX2 build."""
    assert cpu_fp8_dequantize.kernel_available()
    if os.environ.get("KDSA_CPU_KERNELS") == "avx2":
        assert cpu_extension.kernel_isa() == "avx2"


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) implements the same ops from another source."""
    assert_avx2_builds_pass(__file__)
