"""Numeric formats (modeling_kdsa/numeric_formats.py) against the spec, computed independently here (OCP MX v1.0 for
MXFP8, DeepSeek-V3.2's ue8m0 rule for FP8 tiles). No third-party oracle: these run in every environment; the
comparison with torchao's MX code lives in test_quantization_torchao.py.
"""

import math

import pytest
import torch

from modeling_kdsa.numeric_formats import (
    E4M3_MAX,
    QuantizedRows,
    e8m0_to_float,
    fp8_tile_dequantize,
    fp8_tile_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
)


def random_blocks(seed: int, rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes 2^-40 .. 2^40, some heavy-tailed blocks and a few exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x = x * torch.exp2(torch.randint(-40, 41, (rows, 1), generator=generator).float())
    x[::5] = x[::5] ** 3
    x[3, 32:64] = 0.0
    return x


# ------------------------------------------------------------------------------------ spec properties (ours)


def spec_mx_exponent(amax: float, rule: str) -> int:
    """The spec's scale exponent from exact Python floats (float64 holds every fp32 exactly; frexp is exact)."""
    if amax == 0:
        return -127
    mantissa, exponent = math.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    floor_log2 = exponent - 1
    if rule == "floor":
        e = floor_log2 - 8
    else:
        e = floor_log2 - 8 + (2 * mantissa > 1.75)
    return max(e, -127)


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp8_scale_rule_and_error_bound(rule):
    """Scales equal the spec's exponent computed independently; every element is within half an E4M3 step of its
    value (relative 2^-4 for normals, 2^-10·X absolute in the subnormal range), except block maxima the floor rule
    clips to 448·X, which ceil never does."""
    x = random_blocks(7)
    elements, scales = mxfp8_quantize(x, rule)
    amax = x.reshape(64, -1, 32).abs().amax(-1)
    expected = torch.tensor([[spec_mx_exponent(a, rule) + 127 for a in row] for row in amax.tolist()])
    assert torch.equal(scales.view(torch.uint8).int(), expected.int())
    scale = e8m0_to_float(scales).repeat_interleave(32, dim=-1)
    error = (mxfp8_dequantize(elements, scales) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    clipped = x.abs() > E4M3_MAX * scale
    assert (error <= bound)[~clipped].all()
    if rule == "ceil":
        assert not clipped.any()
    else:
        assert clipped.any()  # the data has block maxima in (448, 512)·X


def test_mxfp8_shapes_and_errors():
    x = torch.randn(2, 3, 4, 64)
    elements, scales = mxfp8_quantize(x)
    assert elements.shape == x.shape and elements.dtype == torch.float8_e4m3fn
    assert scales.shape == (2, 3, 4, 2) and scales.dtype == torch.float8_e8m0fnu
    assert mxfp8_dequantize(elements, scales, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 32.*48"):
        mxfp8_quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp8_quantize(x, "nearest")


# ---------------------------------------------------------------------------------------------- FP8 tiles


def test_fp8_tile_scales_and_round_trip():
    """Scale = the smallest power of two s with max(amax, 1e-4) <= 448·s (fp32); error <= half an E4M3 step:
    relative 2^-4 (normals) or 2^-10·s absolute; an all-zero tile gets s = 2^-22 and exact zeros."""
    x = random_blocks(3, rows=16, cols=512).reshape(16, 2, 256)
    x[0, 0, :128] = 0.0
    elements, scales = fp8_tile_quantize(x)
    assert scales.shape == (16, 2, 2) and scales.dtype == torch.float32
    amax = x.reshape(16, 2, 2, 128).abs().amax(-1).clamp(min=1e-4)
    mantissa, exponent = torch.frexp(scales)
    assert (mantissa == 0.5).all(), "power-of-two scales"
    assert (amax <= E4M3_MAX * scales).all() and (amax > E4M3_MAX * scales / 2).all()
    assert scales[0, 0, 0].item() == 2.0**-22
    restored = fp8_tile_dequantize(elements, scales)
    assert (restored[0, 0, :128] == 0).all()
    scale = scales.repeat_interleave(128, dim=-1)
    assert ((restored - x).abs() <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()


def test_fp8_tile_matches_deepseek_rule_on_ordinary_data():
    """DeepSeek-V3.2 act_quant with ue8m0 (docs/quantization.md §2): s = 2^ceil(log2(max(amax, 1e-4) / 448)) from the
    fp32 quotient; equal to ours away from the fp32 rounding boundary (see the RCEIL departure above)."""
    x = torch.randn(32, 4, 128) * torch.exp2(torch.randint(-20, 20, (32, 1, 1)).float())
    amax = x.abs().amax(-1).clamp(min=1e-4)
    deepseek_scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    deepseek_elements = (x / deepseek_scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    elements, scales = fp8_tile_quantize(x)
    assert torch.equal(scales.squeeze(-1), deepseek_scale)
    assert torch.equal(elements.view(torch.uint8), deepseek_elements.view(torch.uint8))


def test_fp8_tile_special_values_and_errors():
    x = torch.ones(2, 128)
    x[1, 5] = float("inf")
    elements, scales = fp8_tile_quantize(x)
    assert scales[0].item() == 2.0**-8  # 1 <= 448 · 2^-8 = 1.75
    assert scales[1].isnan().all() and fp8_tile_dequantize(elements, scales)[1].isnan().all()
    with pytest.raises(ValueError, match="multiple of 128.*64"):
        fp8_tile_quantize(torch.randn(3, 64))
    elements, scales = fp8_tile_quantize(torch.randn(3, 64), tile_size=64)
    assert scales.shape == (3, 1)


def test_quantized_rows_dequantize_selected_rows_only():
    """`QuantizedRows` of rows `[latent | rope]`: gathering rows then dequantizing equals dequantizing everything
    then gathering (bit for bit), and the unquantized part comes back unchanged."""
    rows = torch.randn(10, 4, 128 + 16, dtype=torch.bfloat16)
    elements, scales = fp8_tile_quantize(rows[..., :128])
    stored = QuantizedRows(elements, scales, rows[..., 128:])
    everything = stored.dequantize(torch.bfloat16)
    picked = stored.map(lambda part: part.flatten(0, 1)[torch.tensor([3, 17, 39])]).dequantize(torch.bfloat16)
    assert torch.equal(picked, everything.flatten(0, 1)[[3, 17, 39]])
    assert torch.equal(everything[..., 128:], rows[..., 128:])
