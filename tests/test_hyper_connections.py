"""mHC hyper-connections (modeling_kdsa/hyper_connections.py, docs/hyper-connections.md) against transformers'
GLM-5.3-Flash (`glm5_next`): the per-sublayer module, and whole models whose layers are all KDA (GLM's attention
layers always run its k-pool indexer, so the indexer-free comparison of the full residual stream uses KDA layers;
the DSA layers are covered by our own prefill == decode and padding checks on a mixed KDA + DSA stack).
"""

import pytest
import torch
from conftest import tiny_config
from transformers import DynamicCache
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection, Glm5NextTextModel

from modeling_kdsa import KDSAConfig, KDSAForCausalLM
from modeling_kdsa.cache import KDSACache
from modeling_kdsa.hyper_connections import HyperConnectionStream, KDSAHyperConnection, sinkhorn_normalize
from modeling_kdsa.modeling_kdsa import KDSAModel

HC_MULT, HIDDEN = 4, 32


def assert_close_rel(actual, expected, rel=4e-5):
    """|actual - expected| <= rel · max|expected| elementwise. The default fits fp32 models compared through a whole
    stack: measured up to 1.3e-5 on an Intel Xeon with AMX (oneDNN's fp32 products round differently there than on
    AMD Zen 4, where 1e-5 held); an mHC eps of 1e-4 instead of 1e-6 on the pre weights, or Sinkhorn stopped after 3
    iterations, already fails it."""
    torch.testing.assert_close(actual, expected, atol=rel * expected.abs().max().item(), rtol=0)


def glm_text_config(**overrides) -> Glm5NextTextConfig:
    """A tiny all-KDA GLM-5.3-Flash text model with every family feature of this module on: mHC ×4, the bounded KDA
    gate, the SwiGLU clamp; one dense and two MoE layers."""
    fields = dict(
        vocab_size=96,
        hidden_size=HIDDEN,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        layer_types=["linear_attention"] * 3,
        mlp_layer_types=["dense", "sparse", "sparse"],
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        swiglu_limit=1.0,
        hc_mult=HC_MULT,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-5,
        pad_token_id=0,
    )
    config = Glm5NextTextConfig(**(fields | overrides))
    config._experts_implementation = "eager"
    return config


def kdsa_config_like(glm: Glm5NextTextConfig) -> KDSAConfig:
    """The same model as a KDSAConfig (the converter's job for real checkpoints; spelled out here)."""
    return KDSAConfig(
        vocab_size=glm.vocab_size,
        hidden_size=glm.hidden_size,
        intermediate_size=glm.intermediate_size,
        moe_intermediate_size=glm.moe_intermediate_size,
        num_hidden_layers=glm.num_hidden_layers,
        layer_types=list(glm.layer_types),
        mlp_layer_types=list(glm.mlp_layer_types),
        linear_num_heads=glm.linear_num_heads,
        linear_head_dim=glm.linear_head_dim,
        linear_conv_kernel_dim=glm.linear_conv_kernel_dim,
        linear_lower_bound=glm.linear_lower_bound,
        n_routed_experts=glm.n_routed_experts,
        num_experts_per_tok=glm.num_experts_per_tok,
        n_shared_experts=glm.n_shared_experts,
        routed_scaling_factor=glm.routed_scaling_factor,
        norm_topk_prob=glm.norm_topk_prob,
        swiglu_limit=glm.swiglu_limit,
        hc_mult=glm.hc_mult,
        hc_eps=glm.hc_eps,
        hc_sinkhorn_iters=glm.hc_sinkhorn_iters,
        rms_norm_eps=glm.rms_norm_eps,
        attn_res_block_size=0,
        pad_token_id=glm.pad_token_id,
    )


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every tensor random (ones/zeros-initialised norms, biases and gains included, so a wrong mapping cannot hide);
    the KDA gate parameters in ranges where the bounded gate is neither saturated nor constant."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name.endswith("A_log"):
                tensor.uniform_(-1.0, 1.0, generator=gen)
            elif name.endswith(("dt_bias", "hc.base", "e_score_correction_bias")):
                tensor.normal_(0.0, 0.5, generator=gen)
            elif name.endswith(("norm.weight", "layernorm.weight", "hc.scale")):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=gen))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) / tensor.shape[-1] ** 0.5)


def convert_glm_state(state: dict[str, torch.Tensor], heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """GLM-5.3-Flash text-model tensors → ours (all-KDA layers): `self_attn.` → `linear_attn.`, the fused conv split
    into q/k/v, `forget_gate.` dropped, A_log `[H]` → `[1, 1, H, 1]`. `attn_hc.*` / `ffn_hc.*` map unchanged."""
    converted = {}
    for name, tensor in state.items():
        name = name.replace(".self_attn.", ".linear_attn.").replace(".forget_gate.", ".")
        if name.endswith("linear_attn.conv1d.weight"):
            prefix = name.removesuffix("conv1d.weight")
            for part, piece in zip("qkv", tensor.split(heads * head_dim, dim=0), strict=True):
                converted[f"{prefix}{part}_conv1d.weight"] = piece
            continue
        if name.endswith("A_log"):
            tensor = tensor.reshape(1, 1, heads, 1)
        converted[name] = tensor
    return converted


def model_pair(seed: int = 0, **overrides):
    glm_config = glm_text_config(**overrides)
    theirs = Glm5NextTextModel(glm_config).eval()
    randomize_(theirs, seed)
    ours = KDSAModel(kdsa_config_like(glm_config)).eval()
    state = convert_glm_state(theirs.state_dict(), glm_config.linear_num_heads, glm_config.linear_head_dim)
    ours.load_state_dict(state, strict=True)
    return theirs, ours, glm_config


# ------------------------------------------------------------------------------------------------ the module


def hc_pair(seed: int = 0):
    glm_config = glm_text_config()
    theirs = Glm5NextTextHyperConnection(glm_config)
    randomize_(theirs, seed)
    ours = KDSAHyperConnection(kdsa_config_like(glm_config))
    ours.load_state_dict(theirs.state_dict(), strict=True)  # fn, base, scale: the same names and shapes
    return theirs, ours


@torch.no_grad()
def test_module_matches_transformers_glm5_next():
    """post, comb and the collapsed input; fp32, 1e-6 relative (same operations in the same order)."""
    theirs, ours = hc_pair()
    streams = torch.randn(2, 7, HC_MULT, HIDDEN, generator=torch.Generator().manual_seed(1))
    for mine, reference in zip(ours(streams), theirs(streams), strict=True):
        assert_close_rel(mine, reference, rel=1e-6)
    assert ours.base.dtype == ours.scale.dtype == torch.float32


def test_mixing_matrix_is_doubly_stochastic_and_weights_in_range():
    _, ours = hc_pair(seed=2)
    streams = torch.randn(3, 5, HC_MULT, HIDDEN, generator=torch.Generator().manual_seed(3))
    pre, post, comb = ours.mixing_weights(streams)
    # 20 Sinkhorn iterations: column sums (the last normalisation) are 1 to round-off, row sums close to 1.
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(3, 5, HC_MULT), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(3, 5, HC_MULT), atol=1e-3, rtol=0)
    assert bool((pre > 0).all() and (pre <= 1 + 1e-6).all() and (post >= 0).all() and (post <= 2).all())


def test_sinkhorn_order_and_eps():
    """Column normalisation first and last, eps inside each denominator: one iteration is a column normalisation."""
    comb = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    torch.testing.assert_close(sinkhorn_normalize(comb, 1, 0.5), comb / (comb.sum(0, keepdim=True) + 0.5))
    two = comb / (comb.sum(0, keepdim=True) + 0.5)
    two = two / (two.sum(1, keepdim=True) + 0.5)
    two = two / (two.sum(0, keepdim=True) + 0.5)
    torch.testing.assert_close(sinkhorn_normalize(comb, 2, 0.5), two)


@torch.no_grad()
def test_stream_update_and_final_written_out():
    """Expansion, `X'_j = post_j · out + Σ_i comb[i, j] X_i` and the final plain mean, written out per stream (the
    final norm would hide a sum-for-mean swap, so it is checked here before any norm)."""
    _, hc = hc_pair(seed=4)
    embeddings = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(5))
    output = torch.randn(2, 3, HIDDEN, generator=torch.Generator().manual_seed(6))
    stream = HyperConnectionStream(embeddings, [hc])
    streams = embeddings.unsqueeze(2).repeat(1, 1, HC_MULT, 1)
    pre, post, comb = hc.mixing_weights(streams)
    torch.testing.assert_close(stream.input_for(0), (pre.unsqueeze(-1) * streams).sum(2))
    stream.add_output(0, output)
    expected = torch.stack(
        [post[..., j, None] * output + sum(comb[..., i, j, None] * streams[:, :, i] for i in range(HC_MULT))
         for j in range(HC_MULT)],
        dim=2,
    )  # fmt: skip
    torch.testing.assert_close(stream.streams, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(stream.final(), expected.mean(dim=2))


def test_stream_misuse_raises():
    _, hc = hc_pair()
    stream = HyperConnectionStream(torch.randn(1, 2, HIDDEN), [hc, hc])
    with pytest.raises(ValueError, match="must follow input_for"):
        stream.add_output(0, torch.randn(1, 2, HIDDEN))
    stream.input_for(0)
    with pytest.raises(ValueError, match="out of order"):
        stream.input_for(1)
    stream.add_output(0, torch.randn(1, 2, HIDDEN))
    with pytest.raises(ValueError, match="final"):
        stream.final()


# ----------------------------------------------------------------------------------------- whole all-KDA model


@torch.no_grad()
def test_all_kda_model_matches_transformers_glm5_next():
    """Embedding expansion, per-sublayer mHC around KDA (bounded gate) and dense / MoE (clamped) sublayers, the
    final stream mean and norm: last hidden states against Glm5NextTextModel; fp32, 1e-5 relative (measured ~1e-7).
    Then prefill + 5 token-by-token decode steps through KDSACache against GLM's DynamicCache."""
    theirs, ours, glm_config = model_pair()
    ids = torch.randint(1, glm_config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    expected = theirs(ids, use_cache=False).last_hidden_state
    assert_close_rel(ours(ids, use_cache=False).last_hidden_state, expected)

    # GLM's cache cannot count tokens when every layer is linear attention: give it the positions.
    def their_step(start, end, cache):
        positions = torch.arange(start, end).unsqueeze(0)
        return theirs(ids[:, start:end], cache=cache, use_cache=True, position_ids=positions).last_hidden_state

    their_cache, our_cache = DynamicCache(config=glm_config), KDSACache(ours.config)
    assert_close_rel(ours(ids[:, :30], cache=our_cache).last_hidden_state, their_step(0, 30, their_cache))
    for t in range(30, 35):
        mine = ours(ids[:, t : t + 1], cache=our_cache).last_hidden_state
        assert_close_rel(mine, their_step(t, t + 1, their_cache))
        assert_close_rel(mine, expected[:, t : t + 1])


@torch.no_grad()
def test_all_kda_model_left_padding_matches_transformers_glm5_next():
    """Left padding: GLM zeroes the padded inputs of its KDA layers, we also make them identity steps; from a
    sequence start both leave the state at zero, so the real positions agree (fp32, 1e-5 relative)."""
    theirs, ours, glm_config = model_pair(seed=1)
    ids = torch.randint(1, glm_config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    expected = theirs(ids, attention_mask=mask, use_cache=False).last_hidden_state
    mine = ours(ids, attention_mask=mask, use_cache=False).last_hidden_state
    assert_close_rel(mine[0, 5:], expected[0, 5:])
    assert_close_rel(mine[1], expected[1])


@torch.no_grad()
def test_parameter_names_map_by_prefix_only():
    """GLM's `layers.N.attn_hc.{fn,base,scale}` / `ffn_hc.*` are ours under the same names."""
    theirs, ours, _ = model_pair()
    hc_names = {name for name in theirs.state_dict() if "_hc." in name}
    assert hc_names == {name for name in ours.state_dict() if "_hc." in name}
    assert len(hc_names) == 3 * 2 * 3


# ------------------------------------------------------------------------------- GLM-shaped KDA + DSA stack


def glm_shaped_model(seed: int = 0) -> KDSAForCausalLM:
    """KDA, DSA, KDA, DSA with a dense first layer and MoE after, mHC ×4, bounded gate, SwiGLU clamp, NoPE MLA."""
    torch.manual_seed(seed)
    config = tiny_config(
        attn_res_block_size=0,
        hc_mult=HC_MULT,
        linear_lower_bound=-5.0,
        swiglu_limit=1.0,
        qk_rope_head_dim=0,
    )
    model = KDSAForCausalLM(config).eval()
    randomize_(model, seed)
    return model


@torch.no_grad()
def test_glm_shaped_stack_prefill_equals_decode_and_generates():
    """The stream state is per token: decode caches nothing for it. Prefill of 20 tokens == prefill of 12 then 8
    single-token steps (fp32, 1e-5 relative to the logit scale); index_topk = 8 < 20 so DSA really selects."""
    model = glm_shaped_model()
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    full = model(ids).logits
    cache = KDSACache(model.config)
    steps = [model(ids[:, :12], cache=cache).logits]
    for t in range(12, 20):
        steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert_close_rel(torch.cat(steps, dim=1), full)
    model.generation_config.eos_token_id = None  # compare all 5 steps, no early stop
    out = model.generate(ids[:, :6], max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 11)
    # Greedy generate == argmax of full forwards.
    sequence = ids[:, :6]
    for _ in range(5):
        sequence = torch.cat([sequence, model(sequence).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, sequence)


@torch.no_grad()
def test_glm_shaped_stack_left_padding():
    """A left-padded row gives the logits of its unpadded prompt (prefill and one decode step)."""
    model = glm_shaped_model(seed=1)
    gen = torch.Generator().manual_seed(6)
    prompt, other = torch.randint(3, 128, (1, 10), generator=gen), torch.randint(3, 128, (1, 14), generator=gen)
    batch = torch.cat([torch.cat([torch.full((1, 4), 0), prompt], dim=1), other])
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :4] = 0
    cache, alone_cache = KDSACache(model.config), KDSACache(model.config)
    padded = model(batch, attention_mask=mask, cache=cache).logits
    alone = model(prompt, cache=alone_cache).logits
    assert_close_rel(padded[0, 4:], alone[0])
    step = torch.tensor([[7], [9]])
    padded_step = model(step, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=cache)
    assert_close_rel(padded_step.logits[0], model(step[:1], cache=alone_cache).logits[0])


def test_hc_and_attn_res_refused_together():
    with pytest.raises(ValueError, match=r"hc_mult=4.*attn_res_block_size=2"):
        tiny_config(hc_mult=4)
    for field, value in (("hc_mult", 0), ("hc_sinkhorn_iters", 0), ("hc_eps", -1.0)):
        with pytest.raises(ValueError, match=field):
            tiny_config(attn_res_block_size=0, **{field: value})


def test_defaults_build_no_hyper_connections():
    model = KDSAModel(tiny_config())
    assert not any("_hc." in name for name in model.state_dict())
