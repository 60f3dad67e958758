"""KDA kernels and layer (modeling_kdsa/kda_ops.py, modeling_kdsa/kda.py) against independent oracles: fla's naive
references (fla `fla/ops/kda/naive.py`) and transformers' `KimiLinearDeltaAttention` (docs/design.md §7), plus the
consistency properties the layer promises: chunked == recurrent, cached decode == full forward, padding is inert.
"""

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from fla_oracle import naive_chunk_kda, naive_recurrent_kda
from transformers import DynamicCache
from transformers.models.glm5_next import modeling_glm5_next
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

from modeling_kdsa import KDSAConfig, kernels
from modeling_kdsa import kda as kda_module
from modeling_kdsa.cache import KDSACache
from modeling_kdsa.kda import KDSAKimiDeltaAttention
from modeling_kdsa.kda_ops import (
    causal_short_conv,
    causal_short_conv_step,
    chunk_kda,
    kda_gate,
    l2norm,
    recurrent_kda,
)

HIDDEN, HEADS, HEAD_DIM, CONV = 64, 2, 32, 4


def kda_inputs(batch=2, seq_len=37, heads=2, k_dim=16, v_dim=32, seed=0, gate_scale=1.0):
    """Random kernel inputs: unit q, k (the layer L2-normalises them), log decays g <= 0, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, seq_len, heads, k_dim, generator=gen))
    k = l2norm(torch.randn(batch, seq_len, heads, k_dim, generator=gen))
    v = torch.randn(batch, seq_len, heads, v_dim, generator=gen)
    g = gate_scale * F.logsigmoid(2 * torch.randn(batch, seq_len, heads, k_dim, generator=gen))
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    state = torch.randn(batch, heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# 1. Kernels vs fla's naive references


@pytest.mark.parametrize("with_state", [False, True])
def test_kernels_match_fla_naive_recurrent(with_state):
    q, k, v, g, beta, state = kda_inputs(seq_len=37)
    initial_state = state if with_state else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
    for kernel in (recurrent_kda, chunk_kda):
        o, s = kernel(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)
        # fp32, same recurrence evaluated in another order: rounding only (measured <= 3e-6 on O(1) values).
        torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-5)


def test_chunk_matches_fla_naive_chunk():
    q, k, v, g, beta, state = kda_inputs(seq_len=128)
    o_ref, s_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    # fp32, same chunked algebra (fla forms exp(G_i - G_j) pairwise, we split it at sub-chunk anchors): rounding only.
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# 2. Chunked == recurrent


@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 200])
def test_chunk_equals_recurrent_fp32(seq_len):
    q, k, v, g, beta, state = kda_inputs(seq_len=seq_len, seed=seq_len)
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_chunk, s_chunk = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    # fp32 both ways: rounding only (measured <= 3e-6).
    torch.testing.assert_close(o_chunk, o_rec, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_rec, atol=2e-5, rtol=1e-5)
    assert s_chunk.dtype == s_rec.dtype == torch.float32
    o_none, s_none = chunk_kda(q, k, v, g, beta)
    assert s_none is None and o_none.shape == (2, seq_len, 2, 32)


@pytest.mark.parametrize("seq_len", [63, 200])
def test_chunk_equals_recurrent_bf16_inputs(seq_len):
    q, k, v, g, beta, state = kda_inputs(seq_len=seq_len, seed=seq_len)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_chunk, s_chunk = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert o_rec.dtype == o_chunk.dtype == torch.bfloat16
    # Both upcast the same bf16 inputs and compute in fp32; o is then rounded to bf16, so nearly equal fp32 values
    # may land one bf16 ulp apart (2**-8 relative).
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-2, rtol=8e-3)
    # The state is never rounded to bf16: fp32 tolerance.
    torch.testing.assert_close(s_chunk, s_rec, atol=2e-5, rtol=1e-5)


def test_chunk_gradients_equal_recurrent_gradients():
    """Training backpropagates through chunk_kda: every input's gradient equals the recurrent kernel's (fp32
    rounding). Guards the in-place temporaries of the intra-chunk products (autograd keeps exp's output)."""
    inputs = [x.requires_grad_() for x in kda_inputs(seq_len=40, seed=3)]
    probe = torch.randn(2, 40, 2, 32, generator=torch.Generator().manual_seed(4))
    grads = []
    for kernel in (chunk_kda, recurrent_kda):
        o, s = kernel(*inputs[:5], initial_state=inputs[5], output_final_state=True)
        grads.append(torch.autograd.grad((o * probe).sum() + s.sum(), inputs))
    for name, chunked, recurrent in zip("q k v g beta state".split(), *grads, strict=True):
        assert chunked.abs().max() > 0, name
        torch.testing.assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4, msg=name)


def test_chunk_sizes_and_strong_gates_agree():
    """Decays as strong as exp(-30) per step (the unbounded Kimi gate) must not overflow the chunked form, whose
    naive version would need exp(+30·64)."""
    q, k, v, g, beta, state = kda_inputs(seq_len=150, gate_scale=15.0)
    assert g.min() < -25
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    for chunk_size in (16, 32, 64):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True, chunk_size=chunk_size)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        # fp32, rounding only.
        torch.testing.assert_close(o, o_rec, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s, s_rec, atol=2e-5, rtol=1e-5)


def test_ops_reject_bad_shapes():
    q, k, v, g, beta, state = kda_inputs(seq_len=5)
    for kernel in (recurrent_kda, chunk_kda):
        with pytest.raises(ValueError, match="k must match q"):
            kernel(q, k[:, :4], v, g, beta)
        with pytest.raises(ValueError, match="beta must be"):
            kernel(q, k, v, g, beta[..., :1])
        with pytest.raises(ValueError, match="initial_state must be"):
            kernel(q, k, v, g, beta, initial_state=state[:, :, :3])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=18)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(torch.zeros(1, 2, 3, 4), torch.zeros(2), torch.zeros(12))


def test_gate_and_short_conv_helpers():
    raw = torch.randn(2, 3, 2, 4)
    A_log, dt_bias = torch.tensor([0.0, 1.0]), torch.randn(8)
    g = kda_gate(raw.bfloat16(), A_log.bfloat16(), dt_bias)
    assert g.dtype == torch.float32 and (g < 0).all()
    expected = -torch.tensor([1.0, torch.e]).view(2, 1) * F.softplus(raw.bfloat16().float() + dt_bias.view(2, 4))
    torch.testing.assert_close(g, expected)  # same fp32 formula: default fp32 tolerance

    # Conv: one pass over the whole sequence == a prefix pass, then step-by-step decode with the cached inputs.
    x, weight = torch.randn(2, 6, 9), torch.randn(6, 1, CONV)
    full = causal_short_conv(x, weight)
    reference = F.silu(F.conv1d(F.pad(x, (CONV - 1, 0)), weight, groups=6))
    torch.testing.assert_close(full, reference)
    steps = [causal_short_conv(x[..., :5], weight)]
    for t in range(5, 9):
        steps.append(causal_short_conv_step(x[..., t : t + 1], weight, x[..., :t]))
    torch.testing.assert_close(torch.cat(steps, dim=-1), full)
    torch.testing.assert_close(causal_short_conv(x[..., 5:], weight, left_context=x[..., :5]), full[..., 5:])


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels", [6, 448])
def test_short_conv_steps_of_several_tokens_equal_one_token_steps(weight_dtype, channels):
    """`causal_short_conv_step` over T tokens (a verification of drafted tokens) gives each token the bits of its
    one-token step, bf16 and fp32 (a single sum over `[B, C, T, W]` adds in another order for some shapes); a conv
    state shorter than W - 1 is refused."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, channels, 12, generator=gen).to(weight_dtype)
    weight = torch.randn(channels, 1, CONV, generator=gen).to(weight_dtype)
    state = torch.randn(3, channels, 5, generator=gen).to(weight_dtype)
    inputs = torch.cat([state, x], dim=-1)
    one_by_one = [causal_short_conv_step(x[..., t : t + 1], weight, inputs[..., : 5 + t]) for t in range(12)]
    assert torch.equal(causal_short_conv_step(x, weight, state), torch.cat(one_by_one, dim=-1))
    with pytest.raises(ValueError, match="conv_state"):
        causal_short_conv_step(x, weight, state[..., : CONV - 2])


def test_short_conv_is_bit_identical_to_channel_major_conv1d():
    """`causal_short_conv` convolves token-major (a channels-last conv2d) but gives exactly the values of the
    channel-major `F.conv1d` over the zero- or context-padded sequence, for bf16 and fp32 (GLM) weights."""
    gen = torch.Generator().manual_seed(9)
    tokens = torch.randn(2, 37, 48, generator=gen).bfloat16()  # [B, T, C], as the layer's projections give them
    context = torch.randn(2, 48, 5, generator=gen).bfloat16()
    for weight_dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(48, 1, CONV, generator=gen).to(weight_dtype)
        for left in (None, context):
            pad = tokens.new_zeros(2, 48, CONV - 1) if left is None else left[..., -(CONV - 1) :]
            padded = torch.cat([pad, tokens.transpose(1, 2)], dim=-1).to(weight_dtype)
            reference = F.silu(F.conv1d(padded, weight, groups=48)).bfloat16()
            assert torch.equal(causal_short_conv(tokens.transpose(1, 2), weight, left_context=left), reference)


# ---------------------------------------------------------------------------------------------------------------
# Layer helpers


def kdsa_config(**overrides) -> KDSAConfig:
    fields = dict(
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        hidden_size=HIDDEN,
        linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV,
        rms_norm_eps=1e-5,
    )
    fields.update(overrides)
    return KDSAConfig(**fields)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Deterministic non-trivial weights. The gate parameters follow the Kimi init ranges (docs/kda.md §2):
    decay rates exp(A_log) in [1, 16] and dt_bias the inverse softplus of dt in [1e-3, 1e-1]."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(param.shape).uniform_(-6.9, -2.3, generator=gen).exp()
                param.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


def make_layer(seed: int = 0, dtype: torch.dtype = torch.float32) -> KDSAKimiDeltaAttention:
    layer = KDSAKimiDeltaAttention(kdsa_config(), layer_idx=0)
    randomize_(layer, seed)
    layer = layer.to(dtype)
    # What the model's `_keep_in_fp32_modules_strict` does for the decay parameters.
    layer.A_log.data = layer.A_log.data.float()
    layer.dt_bias.data = layer.dt_bias.data.float()
    return layer.eval()


def new_cache() -> DynamicCache:
    return DynamicCache(config=kdsa_config())


# ---------------------------------------------------------------------------------------------------------------
# 3. Layer vs transformers' KimiLinearDeltaAttention


def _implementation_behind(fn):
    """The function transformers' `use_kernel_func_from_hub_with_fallback` resolved for `fn` (fla's or torch's)."""
    cells = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ()), strict=True))
    return cells["implementation"]


def kimi_pair(seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' Kimi-Linear KDA layer and ours, holding the same weights."""
    kimi_config = KimiLinearConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV,
        rms_norm_eps=1e-5,
    )
    theirs = modeling_kimi_linear.KimiLinearDeltaAttention(kimi_config, layer_idx=0)
    randomize_(theirs, seed)
    ours = KDSAKimiDeltaAttention(kdsa_config(), layer_idx=0)
    state = theirs.state_dict()
    q_conv, k_conv, v_conv = state.pop("conv1d.weight").split(HEADS * HEAD_DIM, dim=0)  # packed [3·H·K, 1, W]
    state.update(q_conv1d=q_conv, k_conv1d=k_conv, v_conv1d=v_conv)
    state = {f"{name}.weight" if name.endswith("conv1d") else name: value for name, value in state.items()}
    state = {name.removeprefix("forget_gate."): value for name, value in state.items()}  # f_a/f_b, dt_bias, A_log
    ours.load_state_dict(state, strict=True)
    return theirs.to(dtype).eval(), ours.to(dtype).eval(), kimi_config


def test_transformers_oracle_runs_its_torch_fallback():
    """fla is installed without triton: transformers must have fallen back to its own torch functions, otherwise
    this comparison would not be against the torch reference."""
    with pytest.raises(ImportError):
        importlib.import_module("fla.ops.kda")
    for fn in (
        modeling_kimi_linear.chunk_kimi_delta_attention,
        modeling_kimi_linear.recurrent_kimi_delta_attention,
        modeling_kimi_linear.causal_conv1d_fn,
        modeling_kimi_linear.causal_conv1d_update,
    ):
        assert _implementation_behind(fn) is fn.__wrapped__, fn.__name__


@torch.no_grad()
def test_layer_matches_transformers_kimi_linear_fp32():
    theirs, ours, kimi_config = kimi_pair()
    x = torch.randn(2, 100, HIDDEN, generator=torch.Generator().manual_seed(1))
    # fp32 throughout; the kernels differ only in evaluation order (measured ~1e-6).
    torch.testing.assert_close(ours(x), theirs(x), atol=2e-5, rtol=1e-5)

    # Cached: prefill 70 tokens, then 3 decode steps (their recurrent path vs ours).
    their_cache, our_cache = DynamicCache(config=kimi_config), new_cache()
    torch.testing.assert_close(ours(x[:, :70], cache=our_cache), theirs(x[:, :70], cache=their_cache))
    for t in range(70, 73):
        step = x[:, t : t + 1]
        torch.testing.assert_close(ours(step, cache=our_cache), theirs(step, cache=their_cache), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        our_cache.get_recurrent_state(0), their_cache.get_recurrent_state(0), atol=2e-5, rtol=1e-5
    )


@torch.no_grad()
def test_layer_matches_transformers_kimi_linear_bf16():
    theirs, ours, _ = kimi_pair(dtype=torch.bfloat16)
    x = torch.randn(2, 100, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    ours_out, theirs_out = ours(x), theirs(x)
    assert ours_out.dtype == torch.bfloat16
    # bf16 projections/conv are identical; the kernel outputs are rounded to bf16 and may differ by one ulp, which
    # the bf16 norm and o_proj carry on (a few bf16 ulps of O(1) outputs).
    torch.testing.assert_close(ours_out, theirs_out, atol=3e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# 4. Cached prefill + decode == one full forward


@torch.no_grad()
@pytest.mark.parametrize("prefill_len", [2, 66])
def test_prefill_then_decode_equals_full_forward(prefill_len):
    layer = make_layer()
    x = torch.randn(2, prefill_len + 6, HIDDEN, generator=torch.Generator().manual_seed(2))
    full_cache = new_cache()
    full = layer(x, cache=full_cache)
    assert layer(x).allclose(full)  # the cache does not change a single forward

    cache = new_cache()
    outs = [layer(x[:, :prefill_len], cache=cache)]
    for t in range(prefill_len, x.shape[1]):
        outs.append(layer(x[:, t : t + 1], cache=cache))
    # fp32: chunked prefill vs token-by-token recurrence differ by rounding only (measured ~1e-6).
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.get_recurrent_state(0), full_cache.get_recurrent_state(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.get_conv_state(0), full_cache.get_conv_state(0))  # same raw inputs: exact


@torch.no_grad()
def test_prefill_in_two_chunks_equals_full_forward():
    """Multi-token continuation (T > 1 with a previous state, e.g. speculative verification)."""
    layer = make_layer(seed=3)
    x = torch.randn(2, 90, HIDDEN, generator=torch.Generator().manual_seed(3))
    full = layer(x)
    cache = new_cache()
    first, second = layer(x[:, :50], cache=cache), layer(x[:, 50:], cache=cache)
    # fp32, chunk boundaries fall elsewhere: rounding only.
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_cache", [False, True])
def test_segmented_prefill_is_bit_identical(monkeypatch, dtype, with_cache):
    """A prefill longer than `PREFILL_SEGMENT` runs as consecutive segments (docs/kda.md §8): with the same chunk
    boundaries and the state handed over in fp32, outputs and cached states are exactly those of one pass. 97
    tokens in segments of 32: the last segment takes the remainder (33 tokens; a one-token segment would run its
    projections as matrix-vector products, rounded differently). One row is left-padded."""
    layer = make_layer(seed=5, dtype=dtype)
    x = torch.randn(2, 97, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    mask = torch.ones(2, 97, dtype=torch.long)
    mask[1, :9] = 0
    results, mix_calls = [], []
    mix = layer._mix
    monkeypatch.setattr(layer, "_mix", lambda *args: mix_calls.append(args[0].shape[1]) or mix(*args))
    for segment in (1 << 30, 32):
        monkeypatch.setattr(kda_module, "PREFILL_SEGMENT", segment)
        cache = new_cache() if with_cache else None
        out = layer(x, attention_mask=mask, cache=cache)
        results.append((out, cache))
    assert mix_calls == [97, 32, 32, 33]  # one pass, then the segments (the comparison is not of one pass twice)
    (full, full_cache), (segmented, cache) = results
    assert torch.equal(segmented, full)
    if with_cache:
        assert torch.equal(cache.get_recurrent_state(0), full_cache.get_recurrent_state(0))
        assert torch.equal(cache.get_conv_state(0), full_cache.get_conv_state(0))


# ---------------------------------------------------------------------------------------------------------------
# 5. Left padding


@torch.no_grad()
def test_left_padded_row_equals_unpadded_prompt():
    layer = make_layer(seed=4)
    gen = torch.Generator().manual_seed(4)
    pad, prompt_len = 7, 12
    prompt, other = (
        torch.randn(1, prompt_len, HIDDEN, generator=gen),
        torch.randn(1, pad + prompt_len, HIDDEN, generator=gen),
    )
    junk = 5 * torch.randn(1, pad, HIDDEN, generator=gen)  # padding embeddings must not leak into anything
    batch = torch.cat([torch.cat([junk, prompt], dim=1), other])
    mask = torch.ones(2, pad + prompt_len, dtype=torch.long)
    mask[0, :pad] = 0
    next_tokens = torch.randn(2, 1, HIDDEN, generator=gen)

    cache = new_cache()
    padded_out = layer(batch, attention_mask=mask, cache=cache)
    padded_step = layer(next_tokens, attention_mask=torch.ones(2, 1), cache=cache)
    alone_cache = new_cache()
    alone_out = layer(prompt, cache=alone_cache)
    alone_step = layer(next_tokens[:1], cache=alone_cache)

    # fp32, identical math up to where chunk boundaries fall: rounding only.
    torch.testing.assert_close(padded_out[0, pad:], alone_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded_step[0], alone_step[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded_out).all()
    # The unpadded row is unaffected by its neighbour's padding.
    torch.testing.assert_close(padded_out[1], layer(other)[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("pad_len", [1, 3])
def test_padding_steps_leave_the_recurrent_state_unchanged(pad_len):
    """Padding inside a continuation (after real context) must be an identity step: beta = 0 and g = 0. The zeroed
    input alone would not do: the conv still sees earlier real tokens, and the decay would still shrink the state."""
    layer = make_layer(seed=5)
    gen = torch.Generator().manual_seed(5)
    cache = new_cache()
    layer(torch.randn(2, 10, HIDDEN, generator=gen), cache=cache)
    before = cache.get_recurrent_state(0).clone()
    out = layer(torch.randn(2, pad_len, HIDDEN, generator=gen), attention_mask=torch.zeros(2, pad_len), cache=cache)
    assert torch.equal(cache.get_recurrent_state(0), before)  # exp(0) = 1 and beta = 0: exactly unchanged
    assert torch.isfinite(out).all()


def test_layer_rejects_bad_inputs():
    layer = make_layer()
    x = torch.randn(2, 5, HIDDEN)
    with pytest.raises(ValueError, match="attention_mask must be"):
        layer(x, attention_mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="hidden_states must be"):
        layer(x[..., :10])
    with pytest.raises(ValueError, match="linear_attention"):
        KDSAKimiDeltaAttention(
            kdsa_config(num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"]), 1
        )


# ---------------------------------------------------------------------------------------------------------------
# 6. fp32 gates and state in a bf16 layer


@torch.no_grad()
def test_gates_and_state_stay_fp32_in_bf16_layer(monkeypatch):
    seen = []

    def spy(kernel):
        def wrapped(q, k, v, g, beta, **kwargs):
            state = kwargs["initial_state"]
            seen.append((kernel.__name__, g.dtype, beta.dtype, None if state is None else state.dtype))
            return kernel(q, k, v, g, beta, **kwargs)

        return wrapped

    spied = dataclasses.replace(kernels.CPU_KERNELS, kda_chunk=spy(chunk_kda), kda_recurrent=spy(recurrent_kda))
    monkeypatch.setitem(kernels._BACKENDS, "cpu", lambda: spied)  # the layer's kernel_backend "auto" on CPU
    layer = make_layer(dtype=torch.bfloat16)
    assert layer.q_proj.weight.dtype == torch.bfloat16 and layer.A_log.dtype == torch.float32
    cache = new_cache()
    x = torch.randn(1, 9, HIDDEN).bfloat16()
    assert layer(x[:, :8], cache=cache).dtype == torch.bfloat16
    assert cache.get_recurrent_state(0).dtype == torch.float32
    layer(x[:, 8:], cache=cache)
    assert cache.get_recurrent_state(0).dtype == torch.float32
    fp32 = torch.float32
    assert seen == [("chunk_kda", fp32, fp32, None), ("recurrent_kda", fp32, fp32, fp32)]


# ---------------------------------------------------------------------------------------------------------------
# 7. GLM-5.3-Flash's bounded forget gate (`linear_lower_bound`) vs transformers' Glm5NextTextLinearAttention

LOWER_BOUND = -5.0


def glm_pair(seed: int = 0):
    """transformers' GLM-5.3-Flash KDA layer and ours (`linear_lower_bound=-5`), holding the same weights. The gate
    parameters are drawn so that `exp(A_log)·(f + dt_bias)` spans the sigmoid's whole range (GLM initialises
    A_log = 0, dt_bias ~ -5: nearly constant gates that would hide a wrong formula)."""
    glm_config = Glm5NextTextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        linear_num_heads=HEADS,
        linear_head_dim=HEAD_DIM,
        linear_conv_kernel_dim=CONV,
        linear_lower_bound=LOWER_BOUND,
        rms_norm_eps=1e-5,
    )
    theirs = modeling_glm5_next.Glm5NextTextLinearAttention(glm_config, layer_idx=0)
    randomize_(theirs, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        theirs.forget_gate.A_log.uniform_(-1.0, 1.0, generator=gen)
        theirs.forget_gate.dt_bias.normal_(0.0, 1.0, generator=gen)
    ours = KDSAKimiDeltaAttention(kdsa_config(linear_lower_bound=LOWER_BOUND), layer_idx=0)
    # The converter's renames: the fused conv is split into q/k/v, `forget_gate.` is dropped, A_log [H] → [1,1,H,1].
    state = theirs.state_dict()
    q_conv, k_conv, v_conv = state.pop("conv1d.weight").split(HEADS * HEAD_DIM, dim=0)
    state.update({"q_conv1d.weight": q_conv, "k_conv1d.weight": k_conv, "v_conv1d.weight": v_conv})
    state = {name.removeprefix("forget_gate."): value for name, value in state.items()}
    state["A_log"] = state["A_log"].reshape(1, 1, HEADS, 1)
    ours.load_state_dict(state, strict=True)
    return theirs.eval(), ours.eval(), glm_config


def assert_close_rel(actual, expected, rel=1e-5):
    """|actual - expected| <= rel · max|expected| elementwise."""
    torch.testing.assert_close(actual, expected, atol=rel * expected.abs().max().item(), rtol=0)


def test_bounded_gate_formula():
    """`g = lb · sigmoid(exp(A_log) · (raw + dt_bias))`, written out; every value in (lb, 0)."""
    gen = torch.Generator().manual_seed(0)
    raw, A_log, dt_bias = torch.randn(2, 3, 2, 4, generator=gen), torch.randn(2, generator=gen), torch.randn(8)
    expected = LOWER_BOUND * torch.sigmoid(A_log.exp()[:, None] * (raw + dt_bias.reshape(2, 4)))
    g = kda_gate(raw, A_log, dt_bias, lower_bound=LOWER_BOUND)
    torch.testing.assert_close(g, expected)
    assert g.dtype == torch.float32 and bool(((g > LOWER_BOUND) & (g < 0)).all())


@torch.no_grad()
def test_layer_with_lower_bound_matches_transformers_glm5_next():
    """Prefill (chunked kernel) and token-by-token decode (recurrent kernel) through a KDSACache, against GLM's
    layer with its DynamicCache; fp32, 1e-5 relative to each output's scale (measured ~1e-7)."""
    theirs, ours, glm_config = glm_pair()
    x = torch.randn(2, 100, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert_close_rel(ours(x), theirs(x))

    their_cache, our_cache = DynamicCache(config=glm_config), KDSACache(kdsa_config(linear_lower_bound=LOWER_BOUND))
    assert_close_rel(ours(x[:, :70], cache=our_cache), theirs(x[:, :70], cache=their_cache))
    for t in range(70, 76):
        step = x[:, t : t + 1]
        assert_close_rel(ours(step, cache=our_cache), theirs(step, cache=their_cache))
    assert_close_rel(our_cache.get_recurrent_state(0), their_cache.get_recurrent_state(0))
    # The Kimi gate on the same weights is far off: the comparison sees the gate.
    unbounded = KDSAKimiDeltaAttention(kdsa_config(), layer_idx=0)
    unbounded.load_state_dict(ours.state_dict())
    assert (unbounded.eval()(x) - theirs(x)).abs().max() > 1e-2 * theirs(x).abs().max()


@torch.no_grad()
def test_lower_bound_rollback_replays_the_recorded_gate():
    """Speculative rollback replays the recorded g: verify 6 draft tokens, crop to 3 accepted, continue; equals a
    cache that only ever saw the accepted tokens."""
    _, layer, _ = glm_pair(seed=2)
    config = kdsa_config(linear_lower_bound=LOWER_BOUND)
    x = torch.randn(2, 20, HIDDEN, generator=torch.Generator().manual_seed(2))

    def run(tokens, cache):
        cache.begin_forward(tokens.shape[1])  # what the model does before its layers run
        return layer(tokens, cache=cache)

    cache = KDSACache(config, rollback_tokens=16)
    run(x[:, :10], cache)
    cache.crop(0)
    run(x[:, 10:16], cache)  # the draft
    cache.crop(13)
    reference = KDSACache(config)
    run(x[:, :13], reference)
    assert_close_rel(cache.get_recurrent_state(0), reference.get_recurrent_state(0))
    assert_close_rel(run(x[:, 13:14], cache), run(x[:, 13:14], reference))


def test_lower_bound_must_be_negative():
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="linear_lower_bound"):
            kdsa_config(linear_lower_bound=bad)


def test_short_conv_runs_in_the_weights_dtype():
    """GLM-5.3-Flash keeps its conv weights in fp32 and convolves bf16 inputs in fp32: with fp32 weights our conv
    (prefill and decode step) is the fp32 conv rounded once to bf16."""
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(2, 6, 9, generator=gen).bfloat16(), torch.randn(6, 1, CONV, generator=gen)
    expected = causal_short_conv(x.float(), weight).bfloat16()
    full = causal_short_conv(x, weight)
    assert full.dtype == torch.bfloat16 and torch.equal(full, expected)
    step = causal_short_conv_step(x[..., 8:], weight, x[..., :8])
    assert step.dtype == torch.bfloat16
    torch.testing.assert_close(step, expected[..., 8:], atol=0, rtol=8e-3)  # fp32 sum order: at most one bf16 ulp


@torch.no_grad()
def test_layer_with_lower_bound_matches_glm5_next_bf16_with_fp32_conv():
    """bf16 weights with the conv (as GLM's `_keep_in_fp32_modules_strict` keeps it) and the gate parameters in fp32.
    The kernels' bf16 roundings differ slightly (GLM's beta sigmoid runs in bf16), so: a few bf16 ulps of O(1)."""
    theirs, ours, _ = glm_pair()
    theirs, ours = theirs.bfloat16(), ours.bfloat16()
    for module, names in ((theirs, ("conv1d",)), (ours, ("q_conv1d", "k_conv1d", "v_conv1d"))):
        for name in names:
            getattr(module, name).float()
    for module in (theirs.forget_gate, ours):
        module.A_log.data, module.dt_bias.data = module.A_log.data.float(), module.dt_bias.data.float()
    x = torch.randn(2, 70, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    ours_out, theirs_out = ours(x), theirs(x)
    assert ours_out.dtype == torch.bfloat16
    torch.testing.assert_close(ours_out, theirs_out, atol=3e-2 * theirs_out.abs().max().item(), rtol=2e-2)
