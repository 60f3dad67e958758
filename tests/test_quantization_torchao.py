"""Numeric formats (modeling_kdsa/numeric_formats.py) against an independent MX implementation.

Oracle: torchao 0.18's MX code (`torchao.prototype.mx_formats.mx_tensor.to_mx`, CPU), written by others. On ordinary
data it must agree byte for byte (elements and E8M0 scales) under both rules (FLOOR = spec, RCEIL = our "ceil").
Where torchao departs from the OCP spec (docs/quantization.md §1), a test pins torchao's behaviour *and* checks ours
against values computed from the spec text, so that either side changing is noticed. Skipped when torchao does not
import; the spec tests (test_quantization_formats.py) need no torchao.
"""

import pytest
import torch
from test_quantization_formats import random_blocks

from modeling_kdsa.numeric_formats import E4M3_MAX, mxfp8_dequantize, mxfp8_quantize

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is the MX oracle (test extra)")
RULES = {"floor": mx.ScaleCalculationMode.FLOOR, "ceil": mx.ScaleCalculationMode.RCEIL}


def torchao_mx(x: torch.Tensor, rule: str):
    """(elements bytes, scale bytes) from torchao, same layout as ours."""
    scales, elements = mx.to_mx(x, torch.float8_e4m3fn, 32, RULES[rule])
    return elements.view(torch.uint8), scales.view(torch.uint8).reshape(*x.shape[:-1], -1)


def ours_mx(x: torch.Tensor, rule: str):
    elements, scales = mxfp8_quantize(x, rule)
    return elements.view(torch.uint8), scales.view(torch.uint8)


def assert_same_as_torchao(x: torch.Tensor, rule: str):
    """Same scale bytes, and the same element bytes in every block whose scale is not NaN (the spec gives a NaN-scale
    block no element values: torchao stores E4M3 NaNs there, we store zeros)."""
    ours, theirs = ours_mx(x, rule), torchao_mx(x, rule)
    assert torch.equal(ours[1], theirs[1]), "E8M0 scales differ"
    meaningful = (ours[1] != 255).repeat_interleave(32, dim=-1)
    assert torch.equal(ours[0][meaningful], theirs[0][meaningful]), "E4M3 elements differ"


@pytest.mark.parametrize("rule", ["floor", "ceil"])
@pytest.mark.parametrize("seed", range(4))
def test_mxfp8_matches_torchao_on_random_data(rule, seed):
    x = random_blocks(seed)
    assert_same_as_torchao(x, rule)
    assert_same_as_torchao(x.to(torch.bfloat16), rule)


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp8_matches_torchao_on_extremes(rule):
    """One block per case: all zero, fp32 subnormals beside a normal maximum, exactly 448·2^k, above 448 (floor
    clips, ceil does not), the largest fp32, NaN (both: scale 0xFF)."""
    blocks = torch.zeros(7, 32)
    blocks[1, :4] = torch.tensor([1e-40, -3e-42, 1.0, 2.0**-130])
    blocks[2, 0], blocks[2, 1] = 448.0, -448.0 * 2.0**-9
    blocks[3, 0], blocks[3, 1:5] = 500.0, torch.tensor([480.0, 449.0, -511.0, 0.1])
    blocks[4, 0] = torch.finfo(torch.float32).max
    blocks[5, :5] = torch.tensor([float("nan"), 1.0, -2.0, 3.0, 0.0])
    blocks[6] = torch.linspace(-1000, 1000, 32)
    assert_same_as_torchao(blocks, rule)
    _, scales = ours_mx(blocks, rule)
    assert scales[0].item() == 0, "all-zero block: the smallest scale 2^-127"
    assert scales[5].item() == 255, "NaN block: scale NaN"


def real_activations() -> dict[str, torch.Tensor]:
    """Indexer queries and keys, the normalised MLA latent and the hidden state entering a DSA layer of a tiny model
    on a random prompt (captured with forward hooks)."""
    from conftest import tiny_model

    model = tiny_model(index_head_dim=32, kv_lora_rank=128)
    attention = model.model.layers[1].self_attn
    captured = {}

    def keep_indexer(module, inputs, outputs):
        captured["q_index"], _, captured["k_index"] = outputs
        captured["hidden"] = inputs[0]

    def keep_latent(module, inputs, output):
        captured["latent"] = output

    handles = [
        attention.indexer.register_forward_hook(keep_indexer),
        attention.kv_a_layernorm.register_forward_hook(keep_latent),
    ]
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return captured


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp8_matches_torchao_on_model_activations(rule):
    activations = real_activations()
    assert set(activations) == {"q_index", "k_index", "hidden", "latent"}
    for tensor in activations.values():
        assert_same_as_torchao(tensor.reshape(-1, tensor.shape[-1]), rule)


# ------------------------------------------------------------------------------ torchao's departures, pinned


def test_torchao_departure_inf_block():
    """Spec: a block holding ±Inf has scale NaN (0xFF), so it dequantizes to NaN. torchao gives a finite scale from
    the Inf (byte 247 FLOOR / 254 RCEIL) and saturates the Inf to 448."""
    x = torch.ones(1, 32)
    x[0, 3] = float("inf")
    for rule, torchao_byte in (("floor", 247), ("ceil", 254)):
        assert torchao_mx(x, rule)[1].item() == torchao_byte
        elements, scales = mxfp8_quantize(x, rule)
        assert scales.view(torch.uint8).item() == 255
        assert mxfp8_dequantize(elements, scales).isnan().all()


def test_torchao_departure_floor_tiny_amax():
    """Spec (floor): amax = 2^-120 gives e = -128 -> clamped to -127 (byte 0), elements V / 2^-127 = 128.
    torchao stores byte 0 but divides by 2^-126, giving elements 64 (values off by 2x)."""
    x = torch.full((1, 32), 2.0**-120)
    torchao_elements, torchao_scales = torchao_mx(x, "floor")
    assert torchao_scales.item() == 0
    assert torchao_elements.view(torch.float8_e4m3fn).float()[0, 0].item() == 64.0
    elements, scales = mxfp8_quantize(x, "floor")
    assert scales.view(torch.uint8).item() == 0
    assert elements.float()[0, 0].item() == 128.0
    assert torch.equal(mxfp8_dequantize(elements, scales), x)  # exact round trip


def test_torchao_departure_rceil_just_above_448():
    """amax = (1.75 + 2^-23)·2^-27, just above 448·2^-35: the smallest power of two X with amax <= 448·X is 2^-34.
    torchao computes `ceil(log2(amax / 448))` in fp32, where the quotient / log2 round down onto exactly -35: its
    scale is one power low and the block maximum clips to 448. Ours (exponent from the bits) never clips."""
    amax = torch.tensor([0x32600001], dtype=torch.int32).view(torch.float32)
    assert amax.item() == (1.75 + 2.0**-23) * 2.0**-27
    x = torch.cat([amax, torch.zeros(31)])[None]
    torchao_elements, torchao_scales = torchao_mx(x, "ceil")
    assert torchao_scales.item() == 127 - 35
    assert torchao_elements.view(torch.float8_e4m3fn).float()[0, 0].item() == E4M3_MAX  # clipped
    elements, scales = mxfp8_quantize(x, "ceil")
    assert scales.view(torch.uint8).item() == 127 - 34
    assert elements.float()[0, 0].item() == 224.0  # amax / 2^-34 = 224.0000001, rounded to E4M3
