"""KDA device adapters (modeling_kdsa/kda_device_ops.py) at their boundary, where the device kernel cannot run here:

- fla's Triton `chunk_kda` / `fused_recurrent_kda` (the `triton` backend) are replaced by fla's own pure-torch
  references (`fla/ops/kda/naive.py`, tests/fla_oracle.py) behind fla's signature, so the argument mapping (layout,
  log-space gate, scale, state dtype and shape, final state, in-kernel preprocessing switched off) is checked against
  kda_ops without Triton or a GPU;
- the fake `npu_recurrent_gated_delta_rule` (tests/fake_torch_npu.py) follows the op doc: state slots per token,
  `num_accepted_tokens`, a V-first state, refusals. Equality of the `npu` kernel with kda_ops is in
  tests/test_kernel_registry.py."""

import fake_torch_npu
import pytest
import torch
from fla_oracle import naive_chunk_kda, naive_recurrent_kda
from test_kernel_registry import KDA_REL_FRO, kda_case, rel_fro

from modeling_kdsa import kda_device_ops, kda_ops

fla_calls: list[str] = []  # which fla kernel each adapter call reached


def fla_signature(naive):
    """fla's public signature over its naive reference: fla's documented preprocessing flags act as documented
    (l2norm of q, k; sigmoid of beta; the gate computed from a raw input, which needs A_log), and `chunk_kda`'s
    fp32-state assertion holds."""

    def kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **flags):
        fla_calls.append({naive_chunk_kda: "chunk_kda", naive_recurrent_kda: "fused_recurrent_kda"}[naive])
        if flags.get("use_gate_in_kernel"):
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True`")  # as fla's chunk_kda
        assert initial_state is None or initial_state.dtype == torch.float32, "initial_state must be in float32."
        if flags.get("use_qk_l2norm_in_kernel"):
            q, k = kda_ops.l2norm(q.float()), kda_ops.l2norm(k.float())
        if flags.get("use_beta_sigmoid_in_kernel"):
            beta = beta.float().sigmoid()
        if naive is naive_chunk_kda and q.shape[1] % 64:
            naive_kernel = naive_recurrent_kda  # fla's naive chunk form needs whole chunks; same recurrence
        else:
            naive_kernel = naive
        return naive_kernel(q, k, v, g, beta, scale, initial_state, output_final_state)

    return kernel


@pytest.fixture
def fla_naive(monkeypatch):
    monkeypatch.setattr(
        kda_device_ops, "_fla_kda_ops", lambda: (fla_signature(naive_chunk_kda), fla_signature(naive_recurrent_kda))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("adapter", "reference", "seq_len"),
    [
        (kda_device_ops.fla_chunk_kda, kda_ops.chunk_kda, 128),
        (kda_device_ops.fla_chunk_kda, kda_ops.chunk_kda, 70),
        (kda_device_ops.fla_recurrent_kda, kda_ops.recurrent_kda, 1),
        (kda_device_ops.fla_recurrent_kda, kda_ops.recurrent_kda, 5),
    ],
)
def test_fla_adapters_map_our_contract_onto_fla(fla_naive, adapter, reference, seq_len, dtype):
    fla_calls.clear()
    for with_state, scale in ((True, None), (False, 0.3)):
        q, k, v, g, beta, state = kda_case(seq_len, seed=seq_len, with_state=with_state)
        v = v.to(dtype)
        got, got_state = adapter(q, k, v, g, beta, scale, state, True)
        expected, expected_state = reference(q, k, v, g, beta, scale, initial_state=state, output_final_state=True)
        assert got.dtype == dtype and got.shape == expected.shape
        assert got_state.dtype == torch.float32 and got_state.shape == expected_state.shape
        # fp32 math on both sides (the adapter casts to fp32): summation order, then o's rounding to v's dtype.
        tolerance = 1e-5 if dtype == torch.float32 else KDA_REL_FRO
        assert rel_fro(got, expected) < tolerance
        assert rel_fro(got_state, expected_state) < tolerance
        assert adapter(q, k, v, g, beta, scale, state)[1] is None
    expected_kernel = "chunk_kda" if reference is kda_ops.chunk_kda else "fused_recurrent_kda"
    assert fla_calls == [expected_kernel] * 4  # prefill on the chunked kernel, decode on the recurrent one


def test_fla_adapters_check_shapes_and_need_fla(monkeypatch):
    q, k, v, g, beta, state = kda_case(3, seed=0)
    with pytest.raises(ValueError, match="initial_state must be"):
        kda_device_ops.fla_recurrent_kda(q, k, v, g, beta, None, state[:1], True)

    def missing():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(kda_device_ops, "_fla_kda_ops", missing)
    with pytest.raises(ValueError, match="install flash-linear-attention"):
        kda_device_ops.require_fla()


def test_fla_chunk_adapter_refuses_a_key_head_dim_fla_asserts_on(fla_naive):
    q, k, v, g, beta, _ = kda_case(3, seed=0)
    wide = [torch.cat([x] * 9, dim=-1) for x in (q, k, g)]  # K = 288, past fla's chunk_kda limit
    assert wide[0].shape[-1] > kda_device_ops.FLA_CHUNK_MAX_HEAD_DIM
    with pytest.raises(ValueError, match="linear_head_dim <= 256"):
        kda_device_ops.fla_chunk_kda(wide[0], wide[1], v, wide[2], beta)


# ---------------------------------------------------------------------------------------------------------------
# The fake recurrent gated delta rule follows its doc


@pytest.fixture
def npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch, available=True)


def gdr_inputs(lengths, key_heads=2, value_heads=4, key_dim=8, value_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def bf16(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    q = kda_ops.l2norm(bf16(tokens, key_heads, key_dim).float()).to(torch.bfloat16)
    k = kda_ops.l2norm(bf16(tokens, key_heads, key_dim).float()).to(torch.bfloat16)
    return dict(
        query=q,
        key=k,
        value=bf16(tokens, value_heads, value_dim),
        state=bf16(tokens + 2, value_heads, value_dim, key_dim),
        beta=torch.rand(tokens, value_heads, generator=generator).to(torch.bfloat16),
        scale=key_dim**-0.5,
        actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32),
        ssm_state_indices=torch.randperm(tokens + 2, generator=generator)[:tokens].to(torch.int32),
        gk=-torch.rand(tokens, value_heads, key_dim, generator=generator),
    )


def test_fake_gdr_is_the_doc_formula_with_state_slots(npu):
    """Two sequences (3 and 2 tokens), grouped value heads (Nv = 2·Nk), slots in shuffled order; against the doc's
    formula written per token in the `[Dv, Dk]` state convention, and a second call with num_accepted_tokens = 2
    (sequence 0 restarts from the state after its 2nd token)."""
    inputs = gdr_inputs([3, 2])
    initial = inputs["state"].clone()
    out = npu.npu_recurrent_gated_delta_rule(**{**inputs, "state": inputs["state"]})
    slots = inputs["ssm_state_indices"].long()
    q, k = (inputs[name].float().repeat_interleave(2, dim=1) for name in ("query", "key"))
    v, beta, gk = inputs["value"].float(), inputs["beta"].float(), inputs["gk"]
    for first, length in ((0, 3), (3, 2)):
        S = initial[slots[first]].float()
        for t in range(first, first + length):
            for h in range(4):
                decayed = S[h] @ torch.diag(gk[t, h].exp())
                S[h] = decayed + beta[t, h] * torch.outer(v[t, h] - decayed @ k[t, h], k[t, h])
                torch.testing.assert_close(out[t, h].float(), (S[h] @ q[t, h]) * inputs["scale"], atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(inputs["state"][slots[t]].float(), S, atol=2e-2, rtol=2e-2)
    untouched = [i for i in range(initial.shape[0]) if i not in slots.tolist()]
    assert torch.equal(inputs["state"][untouched], initial[untouched])

    after_second = inputs["state"][slots[1]].clone()
    state = inputs["state"]
    state[slots[0]] = 0  # must not be read: sequence 0 starts from its 2nd token's slot
    accepted = torch.tensor([2, 1], dtype=torch.int32)
    out2 = npu.npu_recurrent_gated_delta_rule(**{**inputs, "state": state}, num_accepted_tokens=accepted)
    S = after_second.float()
    S = S * gk[0].exp()[:, None, :]
    S = S + beta[0][:, None, None] * (v[0] - (S @ k[0][:, :, None])[..., 0])[:, :, None] * k[0][:, None, :]
    torch.testing.assert_close(out2[0].float(), inputs["scale"] * (S @ q[0][:, :, None])[..., 0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(actual_seq_lengths=torch.tensor([9], dtype=torch.int32)), r"\[1, 8\]"),
        (dict(beta=None), "beta is required"),
        (dict(scale=None), "scale is required"),
        (dict(gk="fp16"), "gk must be float32"),
        (dict(state="fp32"), "state must be bfloat16"),
        (dict(ssm_state_indices="int64"), "ssm_state_indices: int32"),
    ],
)
def test_fake_gdr_rejects_what_the_doc_forbids(npu, change, message):
    inputs = gdr_inputs([5])
    for name, value in change.items():
        if value == "fp16":
            value = inputs[name].half()
        elif value == "fp32":
            value = inputs[name].float()
        elif value == "int64":
            value = inputs[name].long()
        inputs[name] = value
    if "actual_seq_lengths" in change:
        inputs = {**gdr_inputs([9]), **change}
    with pytest.raises(RuntimeError, match=message):
        npu.npu_recurrent_gated_delta_rule(**inputs)


def test_npu_recurrent_kda_refuses_shapes_the_op_does_not_take(npu):
    q, k, v, g, beta, state = kda_case(1, seed=0)
    wide = [torch.cat([x] * 20, dim=-1) for x in (q, k, v, g)]  # head dim 640 > 512
    with pytest.raises(ValueError, match="linear_head_dim must be <= 512"):
        kda_device_ops.npu_recurrent_kda(*wide, beta)
