"""The hand-written CPU kernel that dequantizes block-scaled E4M3 weights (modeling_kdsa/cpu_fp8_dequantize.py,
docs/checkpoint-conversion.md §9): bit for bit torch's `values.float() * scales` (and its cast to bf16) over every
E4M3 value, tile shapes and edges, the cases `dequantize_tiles` keeps on the torch path, and the op's input checks."""

import pytest
import torch
from conftest import needs_cpu_kernels

from modeling_kdsa import cpu_fp8_dequantize
from modeling_kdsa.fp8_linear import KDSAFP8Linear, dequantize_tiles, dequantize_tiles_torch

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


@needs_cpu_kernels
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


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 3.0e-3, 2.0**-140, 1.0e30])
def test_every_e4m3_value(dtype, scale):
    """All 256 codes (zeros of both signs, subnormals, the largest normals, NaN) with one scale: exact, an fp32
    product that rounds, one that is an fp32 subnormal, and one that overflows to infinity."""
    values = ALL_E4M3.view(16, 16)
    scale_inv = torch.full((1, 1), scale)
    got = dequantize_tiles(values, scale_inv, (16, 16), dtype)
    assert same_bits(got, dequantize_tiles_torch(values, scale_inv, (16, 16), dtype))


@needs_cpu_kernels
def test_held_layer_reaches_the_kernel(monkeypatch):
    """A `KDSAFP8Linear` forward dequantizes through the kernel (once per forward) and gives the torch path's result."""
    _, scale_inv = case((48, 40), (16, 16), scale_range=(-10, -6))
    values = (torch.randn(48, 40, generator=torch.Generator().manual_seed(1)) * 50).to(torch.float8_e4m3fn)  # no NaN
    layer = KDSAFP8Linear(values, scale_inv, (16, 16))
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


@needs_cpu_kernels
def test_compiled_forward_leaves_the_conversion_to_inductor():
    """Inside a compile the torch path is traced (inductor fuses the conversion into the product's loop,
    docs/graph-mode.md §9): the captured graph holds no kernel call, and gives the eager forward's result."""
    _, scale_inv = case((48, 40), (16, 16), scale_range=(-10, -6))
    values = (torch.randn(48, 40, generator=torch.Generator().manual_seed(1)) * 50).to(torch.float8_e4m3fn)
    layer = KDSAFP8Linear(values, scale_inv, (16, 16))
    x = torch.randn(1, 1, 40).bfloat16()
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(layer, backend=recording, fullgraph=True)(x)
        assert torch.equal(got, layer(x))
    torch._dynamo.reset()
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes]
    assert graphs and not any("dequantize_fp8_tiles" in target for target in targets)
