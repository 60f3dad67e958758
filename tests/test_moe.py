"""MoE (modeling_kdsa/moe.py): grouped experts against a per-token loop, the router's rules (kda.md §4.2), and
transformers' DeepseekV3MoE as an independent oracle."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP, Glm5NextTextMoE, Glm5NextTextTopkRouter

from modeling_kdsa.configuration_kdsa import KDSAConfig
from modeling_kdsa.moe import KDSAMLP, KDSAExperts, KDSAMoE, KDSATopkRouter, clamp_swiglu_inputs

HIDDEN = 32


def make_config(**overrides) -> KDSAConfig:
    fields = dict(
        hidden_size=HIDDEN,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    return KDSAConfig(**(fields | overrides))


def make_moe(config: KDSAConfig, seed: int = 0) -> KDSAMoE:
    """A MoE with random weights and a random, non-zero score-correction bias (the model's `_init_weights` is not
    under test here)."""
    moe = KDSAMoE(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*moe.named_parameters(), *moe.named_buffers()]:
            scale = 0.2 if name.endswith("e_score_correction_bias") else 0.3
            tensor.copy_(scale * torch.randn(tensor.shape, generator=generator))
    return moe


def naive_moe_forward(moe: KDSAMoE, hidden_states: torch.Tensor) -> torch.Tensor:
    """Per-token loop written from kda.md §4.2, reading only the module's parameters, in the parameters' dtype with
    the routing in fp32."""
    top_k = moe.gate.top_k
    experts = moe.experts
    tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
    outputs = []
    for x in tokens:
        scores = torch.sigmoid(moe.gate.weight.float() @ x.float())  # [E]
        chosen = torch.topk(scores + moe.gate.e_score_correction_bias, top_k).indices
        weights = scores[chosen]
        if moe.gate.norm_topk_prob:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * moe.gate.routed_scaling_factor
        y = torch.zeros(x.shape, dtype=torch.float32)
        for expert, weight in zip(chosen.tolist(), weights, strict=True):
            gate, up = (experts.gate_up_proj[expert] @ x).chunk(2)
            y = y + weight * (experts.down_proj[expert] @ (F.silu(gate) * up)).float()
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(x).float()
        outputs.append(y.to(hidden_states.dtype))
    return torch.stack(outputs).reshape(hidden_states.shape)


def assert_close_to_scale(actual, expected, rel):
    """Elementwise |actual - expected| <= rel · max|expected| (round-off scales with the tensor, not the entry)."""
    torch.testing.assert_close(actual, expected, atol=rel * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("shape", [(2, 7), (1, 1), (3, 1)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_matches_naive_fp32(shape, norm_topk_prob):
    """fp32; measured worst error 5.2e-7 of the output's scale over 10 seeds."""
    moe = make_moe(make_config(norm_topk_prob=norm_topk_prob))
    hidden = torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_to_scale(moe(hidden), naive_moe_forward(moe, hidden), rel=2e-6)


def test_grouped_matches_naive_bf16():
    """bf16 grouped against the same per-token loop run in fp32 on the bf16 weights and inputs; measured worst error
    8.5e-3 of the output's scale over 10 seeds (bf16 rounding of the matmuls, about one ulp; the per-token loop
    run in bf16 is as far off)."""
    moe = make_moe(make_config(n_routed_experts=16, num_experts_per_tok=4), seed=2)
    hidden = torch.randn(4, 16, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    moe_bf16 = moe.bfloat16()
    with torch.no_grad():
        output = moe_bf16(hidden)
        moe_fp32 = make_moe(make_config(n_routed_experts=16, num_experts_per_tok=4), seed=2)
        moe_fp32.load_state_dict({k: v.float() for k, v in moe_bf16.state_dict().items()})
        expected = naive_moe_forward(moe_fp32, hidden.float())
    assert output.dtype == torch.bfloat16
    assert_close_to_scale(output.float(), expected, rel=2e-2)


def test_grouped_gradients_match_naive():
    moe = make_moe(make_config(), seed=4)
    hidden = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(5))
    probe = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(6))
    grads = []
    for forward in (moe, lambda h: naive_moe_forward(moe, h)):
        moe.zero_grad()
        (forward(hidden) * probe).sum().backward()
        grads.append({name: p.grad.clone() for name, p in moe.named_parameters()})
    for name, grad in grads[0].items():
        assert grad.abs().max() > 0, f"no gradient reached {name}"
        assert_close_to_scale(grad, grads[1][name], rel=2e-6)


def test_experts_without_tokens_and_single_token():
    """Decode-sized input: one token reaches k of many experts; the others are skipped."""
    config = make_config(n_routed_experts=64, num_experts_per_tok=2)
    moe = make_moe(config, seed=7)
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert_close_to_scale(moe(hidden), naive_moe_forward(moe, hidden), rel=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_path_is_bit_identical_to_the_grouped_path(dtype):
    """A single token (batch-1 decode) skips the sort / count / scatter, and must give the grouped path's bits: the
    same one-row GEMV per expert, summed in fp32 in expert order. Two tokens on disjoint experts make the grouped path
    run the same one-row GEMVs, so each token's row must equal the one-token path's output exactly."""
    config = make_config(n_routed_experts=64, num_experts_per_tok=4)
    experts = make_moe(config, seed=7).experts.to(dtype)
    generator = torch.Generator().manual_seed(8)
    for _ in range(10):
        hidden = torch.randn(2, HIDDEN, generator=generator).to(dtype)
        indices = torch.randperm(64, generator=generator)[:8].reshape(2, 4)  # disjoint, in no particular order
        weights = torch.rand(2, 4, generator=generator).to(dtype)
        with torch.no_grad():
            grouped = experts(hidden, indices, weights)
            for row in range(2):
                alone = experts(hidden[row : row + 1], indices[row : row + 1], weights[row : row + 1])
                assert torch.equal(alone[0], grouped[row]), (row, indices[row])


def routed_case(norm_topk_prob: bool, routed_scaling_factor: float):
    """A router over 8 experts with a bias large enough to change many choices; returns the router, the inputs,
    the unbiased scores and the router's output."""
    config = make_config(norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    router = KDSATopkRouter(config)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator) / HIDDEN**0.5)
        router.e_score_correction_bias.copy_(torch.tensor([0.3, -0.3, 0.2, -0.2, 0.1, -0.1, 0.0, 0.25]))
    hidden = torch.randn(64, HIDDEN, generator=generator)
    scores = torch.sigmoid(hidden @ router.weight.T)
    with torch.no_grad():
        indices, weights = router(hidden)
    return router, scores, indices, weights


def test_router_selects_by_biased_score_but_weights_are_unbiased():
    router, scores, indices, weights = routed_case(norm_topk_prob=False, routed_scaling_factor=1.0)
    biased = scores + router.e_score_correction_bias
    expected_choice = torch.topk(biased, k=3).indices
    assert torch.equal(indices.sort(-1).values, expected_choice.sort(-1).values)
    unbiased_choice = torch.topk(scores, k=3).indices.sort(-1).values
    assert (indices.sort(-1).values != unbiased_choice).any(dim=-1).sum() >= 10, "the bias must change choices here"
    assert weights.dtype == torch.float32
    # Without renormalisation and scaling the weights are exactly the unbiased sigmoid scores of the chosen experts;
    # a bias leaking into them would shift each weight by up to 0.3.
    torch.testing.assert_close(weights, scores.gather(-1, indices), atol=1e-6, rtol=0)


def test_router_renormalises_and_scales():
    _, scores, indices, weights = routed_case(norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5), atol=1e-6, rtol=0)
    chosen = scores.gather(-1, indices)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True), atol=1e-6, rtol=0)

    _, scores, indices, weights = routed_case(norm_topk_prob=False, routed_scaling_factor=2.5)
    torch.testing.assert_close(weights, 2.5 * scores.gather(-1, indices), atol=1e-6, rtol=0)


def test_router_runs_in_fp32_for_bf16_inputs():
    router, _, _, _ = routed_case(norm_topk_prob=True, routed_scaling_factor=1.0)
    hidden = torch.randn(5, HIDDEN).bfloat16()
    with torch.no_grad():
        indices, weights = router(hidden)
    expected = torch.sigmoid(hidden.float() @ router.weight.T).gather(-1, indices)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("n_shared_experts", [0, 2])
def test_matches_transformers_deepseek_v3_moe(norm_topk_prob, n_shared_experts):
    """transformers' DeepseekV3MoE (n_group = topk_group = 1) loads our state dict with strict key matching and
    gives the same output in fp32 (measured worst error 2.6e-7 of the output's scale over 10 seeds)."""
    config = make_config(norm_topk_prob=norm_topk_prob, n_shared_experts=n_shared_experts)
    moe = make_moe(config, seed=10)
    oracle_config = DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=config.moe_intermediate_size,
        n_routed_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_shared_experts=max(n_shared_experts, 1),  # DeepseekV3MoE always builds shared experts
        n_group=1,
        topk_group=1,
        routed_scaling_factor=config.routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        hidden_act=config.hidden_act,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    oracle_config._experts_implementation = "eager"
    oracle = DeepseekV3MoE(oracle_config)
    state = moe.state_dict()
    if n_shared_experts == 0:  # switch the oracle's shared experts off with zero down-projection
        state |= {k: torch.zeros_like(v) for k, v in oracle.state_dict().items() if k.startswith("shared_experts")}
    oracle.load_state_dict(state, strict=True)
    hidden = torch.randn(3, 11, HIDDEN, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        assert_close_to_scale(moe(hidden), oracle(hidden), rel=2e-6)


def test_no_shared_experts_leaves_no_weights():
    moe = KDSAMoE(make_config(n_shared_experts=0))
    assert moe.shared_experts is None
    assert not any(key.startswith("shared_experts") for key in moe.state_dict())


def test_layouts_and_dtypes():
    """Parameter shapes follow transformers 5.x (tp plans `packed_colwise` / `rowwise` / `moe_tp_experts`), the
    correction bias is a saved buffer, and the router stays fp32."""
    config = make_config()
    moe = KDSAMoE(config)
    experts, intermediate = config.n_routed_experts, config.moe_intermediate_size
    assert moe.experts.gate_up_proj.shape == (experts, 2 * intermediate, HIDDEN)
    assert moe.experts.down_proj.shape == (experts, HIDDEN, intermediate)
    assert moe.gate.weight.shape == (experts, HIDDEN) and moe.gate.weight.dtype == torch.float32
    assert "gate.e_score_correction_bias" in dict(moe.named_buffers())
    assert "gate.e_score_correction_bias" in moe.state_dict()
    assert moe.shared_experts.gate_proj.out_features == intermediate * config.n_shared_experts
    assert isinstance(moe.shared_experts, KDSAMLP) and isinstance(moe.experts, KDSAExperts)


def test_dense_mlp_is_a_gated_mlp():
    config = make_config()
    mlp = KDSAMLP(config)
    assert mlp.gate_proj.out_features == config.intermediate_size
    x = torch.randn(2, 3, HIDDEN)
    expected = mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ x[0, 0]) * (mlp.up_proj.weight @ x[0, 0]))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x)[0, 0], expected, atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- GLM-5.3-Flash's SwiGLU clamp

SWIGLU_LIMIT = 1.5


def glm_config(**overrides):
    """transformers' GLM-5.3-Flash text config with the shapes of `make_config`."""
    fields = dict(
        hidden_size=HIDDEN,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        swiglu_limit=SWIGLU_LIMIT,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
    )
    config = Glm5NextTextConfig(**(fields | overrides))
    config._experts_implementation = "eager"
    return config


def large_hidden(seed: int) -> torch.Tensor:
    """Inputs whose projections (std ~5 with the 0.3-scaled weights) reach far past the clamp on both sides."""
    return 3.0 * torch.randn(3, 11, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_clamp_matters(ours_unclamped: torch.Tensor, expected: torch.Tensor) -> None:
    """The same weights without the clamp give a clearly different output: the comparison exercised the clamp."""
    assert (ours_unclamped - expected).abs().max() > 0.1 * expected.abs().max()


def test_clamp_bounds_gate_above_and_up_on_both_sides():
    gate, up = torch.tensor([-9.0, 0.5, 9.0]), torch.tensor([-9.0, 0.5, 9.0])
    clamped_gate, clamped_up = clamp_swiglu_inputs(gate, up, SWIGLU_LIMIT)
    assert clamped_gate.tolist() == [-9.0, 0.5, SWIGLU_LIMIT]
    assert clamped_up.tolist() == [-SWIGLU_LIMIT, 0.5, SWIGLU_LIMIT]
    assert clamp_swiglu_inputs(gate, up, None) == (gate, up)


@torch.no_grad()
def test_dense_mlp_with_clamp_matches_transformers_glm5_next():
    """fp32, strict state-dict match (same names), 1e-6 of the output's scale."""
    mlp = KDSAMLP(make_config(swiglu_limit=SWIGLU_LIMIT))
    oracle = Glm5NextTextMLP(glm_config())
    generator = torch.Generator().manual_seed(20)
    for tensor in mlp.state_dict().values():
        tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
    oracle.load_state_dict(mlp.state_dict(), strict=True)
    hidden = large_hidden(21)
    expected = oracle(hidden)
    assert_close_to_scale(mlp(hidden), expected, rel=1e-6)
    unclamped = KDSAMLP(make_config())
    unclamped.load_state_dict(mlp.state_dict())
    assert_clamp_matters(unclamped(hidden), expected)


@torch.no_grad()
@pytest.mark.parametrize("n_shared_experts", [1, 2])
def test_moe_with_clamp_matches_transformers_glm5_next(n_shared_experts):
    """Router, clamped routed experts and clamped shared experts against Glm5NextTextMoE (n_group = topk_group = 1),
    strict state-dict match; fp32, 2e-6 of the output's scale (summation order differs: GLM sums experts in its
    own order, in the hidden dtype)."""
    config = make_config(swiglu_limit=SWIGLU_LIMIT, n_shared_experts=n_shared_experts)
    moe = make_moe(config, seed=22)
    oracle = Glm5NextTextMoE(glm_config(n_shared_experts=n_shared_experts))
    oracle.load_state_dict(moe.state_dict(), strict=True)
    hidden = large_hidden(23)
    expected = oracle(hidden)
    assert_close_to_scale(moe(hidden), expected, rel=2e-6)
    # The routed experts alone, on GLM's own routing: clamped like GLM's.
    tokens = hidden.reshape(-1, HIDDEN)
    _, weights, indices = oracle.gate(tokens)
    routed = oracle.experts(tokens, indices, weights)
    assert_close_to_scale(moe.experts(tokens, indices, weights), routed, rel=2e-6)
    unclamped = make_moe(make_config(n_shared_experts=n_shared_experts), seed=22)
    assert_clamp_matters(unclamped.experts(tokens, indices, weights), routed)
    assert_clamp_matters(unclamped(hidden), expected)


def test_router_matches_transformers_glm5_next():
    """Same experts and weights as GLM's router (which sorts nothing: compare as sets per token)."""
    moe = make_moe(make_config(), seed=24)
    oracle = Glm5NextTextTopkRouter(glm_config())
    oracle.load_state_dict(moe.gate.state_dict(), strict=True)
    tokens = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(25))
    indices, weights = moe.gate(tokens)
    _, their_weights, their_indices = oracle(tokens)
    order, their_order = indices.argsort(-1), their_indices.argsort(-1)
    assert torch.equal(indices.gather(-1, order), their_indices.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order), atol=1e-7, rtol=0)


def test_swiglu_limit_must_be_positive():
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="swiglu_limit"):
            make_config(swiglu_limit=bad)
