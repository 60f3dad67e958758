"""The hand-written CPU kernel of the token-by-token KDA recurrence (modeling_kdsa/cpu_kda_recurrent.py, docs/kda.md
§9): its output and final state against `kda_ops.recurrent_kda`, the cases it leaves to that reference, its two-thread
split and its input checks; that the KDA layer steps a verification of up to 16 tokens through one call and that a
rollback's replay is one call with the stepped state's bits; that a decode step reaches it eagerly and compiled:
test_graph_mode.py."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_avx2_builds_pass, count_calls, needs_kernel_build, runs_avx512_builds, tiny_config

from modeling_kdsa import cpu_extension, cpu_kda_recurrent
from modeling_kdsa import kernels as kernels_module
from modeling_kdsa.cache import KDAReplayRecord, KDSACache
from modeling_kdsa.cpu_kda_recurrent import MAX_STEPPED_TOKENS, cpu_recurrent_kda, kernel_applies
from modeling_kdsa.kda import KDSAKimiDeltaAttention
from modeling_kdsa.kda_ops import recurrent_kda

pytestmark = pytest.mark.usefixtures("kernels_at_this_thread_count", "no_grad")


def kda_case(batch=2, tokens=1, heads=3, key_dim=64, value_dim=32, seed=0, v_dtype=torch.bfloat16):
    """Inputs as the layer passes them: L2-normalised fp32 q and k, v in the model dtype, per-key log decays from -3
    to 0, beta in (0, 1), an fp32 state."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator)

    q = F.normalize(randn(batch, tokens, heads, key_dim), dim=-1)
    k = F.normalize(randn(batch, tokens, heads, key_dim), dim=-1)
    v = randn(batch, tokens, heads, value_dim).to(v_dtype)
    g = -3 * torch.rand(batch, tokens, heads, key_dim, generator=generator)
    beta = torch.rand(batch, tokens, heads, generator=generator)
    state = randn(batch, heads, key_dim, value_dim)
    return q, k, v, g, beta, state


@needs_kernel_build
@pytest.mark.parametrize(
    "batch, tokens, heads, key_dim, value_dim",
    [
        (1, 1, 16, 64, 64),  # a decode step at the benchmark shape
        (2, 1, 3, 64, 32),  # two sequences: per-sequence offsets
        (2, 5, 3, 20, 48),  # several tokens (a rollback's replay); K not a multiple of the vector width (exp's tail)
        (1, 3, 2, 128, 16),  # Kimi-Linear's head size of keys
    ],
)
@pytest.mark.parametrize("with_state, scale", [(True, None), (False, 0.3)])
def test_kernel_equals_the_reference(batch, tokens, heads, key_dim, value_dim, with_state, scale):
    """Output (in v's dtype) and fp32 final state as `recurrent_kda` gives them, up to fp32 summation order; the
    initial state is left as it was."""
    q, k, v, g, beta, state = kda_case(batch, tokens, heads, key_dim, value_dim)
    initial = state if with_state else None
    before = state.clone()
    assert kernel_applies(q, v)
    got, got_state = cpu_recurrent_kda(q, k, v, g, beta, scale, initial, output_final_state=True)
    expected, expected_state = recurrent_kda(q, k, v, g, beta, scale, initial, output_final_state=True)
    assert torch.equal(state, before)
    assert got.dtype == v.dtype and got_state.dtype == torch.float32
    torch.testing.assert_close(got_state, expected_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)  # bf16 output: at most one ulp
    fp32_out, _ = cpu_recurrent_kda(q, k, v.float(), g, beta, scale, initial)
    torch.testing.assert_close(
        fp32_out, recurrent_kda(q, k, v.float(), g, beta, scale, initial)[0], rtol=1e-5, atol=1e-5
    )
    assert cpu_recurrent_kda(q, k, v, g, beta, scale, initial)[1] is None  # no final state unless asked


@needs_kernel_build
def test_each_token_starts_from_the_previous_tokens_state():
    """Two tokens in one call equal two calls of one token, the second from the first's state (exactly: the same
    kernel arithmetic)."""
    q, k, v, g, beta, state = kda_case(tokens=2, heads=2, key_dim=32, value_dim=16, seed=1)
    both, both_state = cpu_recurrent_kda(q, k, v, g, beta, None, state, True)
    first, first_state = cpu_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], None, state, True)
    second, second_state = cpu_recurrent_kda(
        q[:, 1:], k[:, 1:], v[:, 1:], g[:, 1:], beta[:, 1:], None, first_state, True
    )
    assert identical((both, both_state), (torch.cat([first, second], dim=1), second_state))


def kda_layer_and_cache(seed=0):
    """A KDA layer of the tiny config (2 heads of 16, fp32) with random weights, and a one-layer `KDSACache` with
    rollback records, as speculative decoding builds it."""
    config = tiny_config(num_hidden_layers=1, layer_types=["linear_attention"])
    layer = KDSAKimiDeltaAttention(config, layer_idx=0)
    generator = torch.Generator().manual_seed(seed)
    for parameter in layer.parameters():
        parameter.data = 0.3 * torch.randn(parameter.shape, generator=generator)
    return layer.eval(), KDSACache(config, rollback_tokens=64)


def run_layer(layer, x, cache, mask=None):
    cache.begin_forward(x.shape[1])
    return layer(x, attention_mask=mask, cache=cache)


@needs_kernel_build
@pytest.mark.parametrize("tokens", [2, 8, MAX_STEPPED_TOKENS])
@pytest.mark.parametrize("padded", [False, True])
def test_a_verification_is_stepped_in_one_kernel_call(monkeypatch, tokens, padded):
    """After a cached state, up to MAX_STEPPED_TOKENS tokens (a verification of drafted tokens) run the recurrence as
    one call of the kernel: the output and state of the chunked form within fp32 rounding (the tolerance of
    test_kda.py's two-part prefill), and the state of stepping the tokens one forward at a time. With `padded`, some
    tokens of the second sequence are masked: identity steps in both forms."""
    layer, cache = kda_layer_and_cache()
    x = torch.randn(2, 10 + tokens, 64, generator=torch.Generator().manual_seed(tokens))
    mask = None
    if padded:
        mask = torch.ones(2, tokens, dtype=torch.long)
        mask[1, : tokens // 2] = 0
    run_layer(layer, x[:, :10], cache)
    chunked_cache, stepped_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    calls = count_calls(monkeypatch, cpu_kda_recurrent, "kda_recurrent")
    got = run_layer(layer, x[:, 10:], cache, mask)
    assert len(calls) == 1 and calls[0][0].shape[1] == tokens
    cpu_kernels = dataclasses.replace(kernels_module.CPU_KERNELS, kda_recurrent_stepwise=lambda *args: False)
    monkeypatch.setattr(kernels_module, "CPU_KERNELS", cpu_kernels)
    expected = run_layer(layer, x[:, 10:], chunked_cache, mask)
    assert len(calls) == 1  # the chunked form ran
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    state = cache.get_recurrent_state(0)
    torch.testing.assert_close(state, chunked_cache.get_recurrent_state(0), atol=1e-5, rtol=1e-5)
    for t in range(10, 10 + tokens):
        run_layer(layer, x[:, t : t + 1], stepped_cache, None if mask is None else mask[:, t - 10 : t - 9])
    torch.testing.assert_close(state, stepped_cache.get_recurrent_state(0), atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.get_conv_state(0), chunked_cache.get_conv_state(0))


@needs_kernel_build
def test_more_tokens_or_no_cached_state_keep_the_chunked_form(monkeypatch):
    """MAX_STEPPED_TOKENS + 1 tokens after a cached state, and a prefill without one, run the chunked kernel."""
    layer, cache = kda_layer_and_cache()
    x = torch.randn(1, 10 + MAX_STEPPED_TOKENS + 1, 64, generator=torch.Generator().manual_seed(1))
    calls = count_calls(monkeypatch, cpu_kda_recurrent, "kda_recurrent")
    run_layer(layer, x[:, :10], cache)
    run_layer(layer, x[:, 10:], cache)
    assert not calls


@needs_kernel_build
def test_crop_replays_the_kept_tokens_in_one_call_with_the_stepped_states_bits(monkeypatch):
    """A crop that keeps n of 12 verified tokens replays them from the checkpoint in one kernel call, and the state is
    bit for bit that of n one-token calls of the decode kernel on the recorded inputs (the replay the speculative
    tests rely on); the conv window is the checkpoint's followed by the kept columns."""
    layer, base = kda_layer_and_cache(seed=3)
    x = torch.randn(2, 22, 64, generator=torch.Generator().manual_seed(3))
    run_layer(layer, x[:, :10], base)
    base.crop(10)  # commit the prompt: the checkpoint is after 10 tokens
    run_layer(layer, x[:, 10:], base)
    kda = base.layers[0]
    recorded = KDAReplayRecord.concat(kda.records)
    conv0, state = kda.checkpoint
    stepped = [state]
    for t in range(12):
        step = recorded.tokens(t, t + 1)
        stepped.append(cpu_recurrent_kda(step.k, step.k, step.v, step.g, step.beta, None, stepped[-1], True)[1])
    for kept in range(1, 12):
        cache = copy.deepcopy(base)
        with monkeypatch.context() as patch:
            calls = count_calls(patch, cpu_kda_recurrent, "kda_recurrent")
            cache.crop(10 + kept)
        assert len(calls) == 1 and calls[0][0].shape[1] == kept
        assert torch.equal(cache.get_recurrent_state(0), stepped[kept])
        window = torch.cat([conv0, recorded.conv_inputs[..., :kept]], dim=-1)[..., -conv0.shape[-1] :]
        assert torch.equal(cache.get_conv_state(0), window)


@needs_kernel_build
def test_two_threads_give_the_one_thread_result():
    """With two threads 8 heads of a 64 x 64 state (4 per 64 KiB grain) split into two blocks of heads: the result is
    the one thread's, exactly (heads are independent). (That the split happens at all needs the OpenMP build:
    test_cpu_extension.py.)"""
    q, k, v, g, beta, state = kda_case(batch=2, heads=4, key_dim=64, value_dim=64, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_recurrent_kda(q, k, v, g, beta, None, state, True)
        torch.set_num_threads(2)
        two = cpu_recurrent_kda(q, k, v, g, beta, None, state, True)
    finally:
        torch.set_num_threads(threads)
    assert identical(one, two)


def identical(got, expected) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_reference_path_where_the_kernel_does_not_apply(monkeypatch):
    """A value head size that is not a multiple of 16, autograd, more than `MAX_THREADS` threads, or no kernel: the
    reference runs (bit-identical results)."""
    q, k, v, g, beta, state = kda_case(value_dim=8)
    assert not kernel_applies(q, v)
    assert identical(
        cpu_recurrent_kda(q, k, v, g, beta, None, state, True), recurrent_kda(q, k, v, g, beta, None, state, True)
    )
    q, k, v, g, beta, state = kda_case()
    assert not kernel_applies(q[:, :0], v[:, :0])  # no token: the first token is what writes the new state
    with torch.enable_grad():
        assert not kernel_applies(q, v)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_extension, "MAX_THREADS", 0)
        assert not kernel_applies(q, v)
    monkeypatch.setattr(cpu_kda_recurrent, "kernel_available", lambda: False)
    assert not kernel_applies(q, v)
    got = cpu_recurrent_kda(q, k, v, g, beta, None, state, True)
    assert identical(got, recurrent_kda(q, k, v, g, beta, None, state, True))


def test_bad_input_is_a_value_error():
    """The wrapper checks shapes as the reference does; the op itself refuses what its pointer arithmetic cannot
    take (another dtype, a non-contiguous or mis-shaped tensor, a value head size not a multiple of 16)."""
    q, k, v, g, beta, state = kda_case()
    with pytest.raises(ValueError, match="beta must be"):
        cpu_recurrent_kda(q, k, v, g, beta[..., :1], None, state)
    if not cpu_kda_recurrent.kernel_available():
        pytest.skip("the kernel is not built on this CPU")
    args = [x.float().contiguous() for x in (q, k, v, g, beta)]
    op = cpu_kda_recurrent.kda_recurrent
    for bad in (
        lambda a: a.__setitem__(0, a[0].double()),  # fp64 q
        lambda a: a.__setitem__(2, a[2].transpose(1, 2)),  # non-contiguous v (and mis-shaped)
        lambda a: a.__setitem__(2, a[2][..., :8].contiguous()),  # V = 8
        lambda a: a.__setitem__(4, a[4][..., :1].contiguous()),  # beta for one head
        lambda a: a.__setitem__(1, a[1][..., :8].contiguous()),  # k narrower than q
        lambda a: a.__setitem__(slice(0, 5), [x[:, :0].contiguous() for x in a]),  # no token
    ):
        bad_args = list(args)
        bad(bad_args)
        with pytest.raises(ValueError, match="kda_recurrent takes contiguous fp32"):
            op(*bad_args, None, 0.1)
    with pytest.raises(ValueError, match="kda_recurrent takes contiguous fp32"):
        op(*args, state[:, :2], 0.1)  # a state for 2 of 3 heads


@runs_avx512_builds
def test_the_avx2_builds_pass_every_test_of_this_file():
    """The AVX2 build (what CPUs without AVX512-BF16 run) is the same source with ATen's AVX2 vectors."""
    assert_avx2_builds_pass(__file__)
