"""transformers' training conventions: MoE router logits and the load-balancing loss (`output_router_logits`,
`router_aux_loss_coef`), and gradient checkpointing through the residual-stream objects (docs/design.md §9, §10)."""

import pytest
import torch
from conftest import tiny_config, tiny_model
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from modeling_kdsa import KDSACache, KDSAForCausalLM
from modeling_kdsa.moe import KDSAMoE, load_balancing_loss


def ids(batch=2, length=12, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------- router logits


def test_router_logits_are_each_moe_layers_logits_and_change_nothing_else(model):
    """One `[B·T, E]` fp32 tensor per MoE layer (layer 0 is dense: 3 of 4), each the router's logits of the tokens
    that MoE layer saw; the LM logits are bit-identical to a forward without them."""
    moe_inputs = []
    hooks = [
        layer.mlp.register_forward_hook(lambda m, args, out: moe_inputs.append(args[0]))
        for layer in model.model.layers
        if isinstance(layer.mlp, KDSAMoE)
    ]
    tokens = ids()
    out = model(tokens, output_router_logits=True)
    for hook in hooks:
        hook.remove()
    plain = model(tokens)
    assert torch.equal(out.logits, plain.logits)
    assert plain.router_logits is None and plain.aux_loss is None
    assert len(out.router_logits) == 3 == len(moe_inputs)
    moe_layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, KDSAMoE)]
    for logits, moe, moe_input in zip(out.router_logits, moe_layers, moe_inputs, strict=True):
        assert logits.shape == (2 * 12, 4) and logits.dtype == torch.float32
        expected = moe_input.reshape(-1, moe_input.shape[-1]).float() @ moe.gate.weight.float().T
        torch.testing.assert_close(logits, expected)


def test_output_router_logits_defaults_to_the_config():
    model = tiny_model(output_router_logits=True)
    out = model(ids())
    assert len(out.router_logits) == 3 and out.aux_loss is not None
    assert model(ids(), output_router_logits=False).router_logits is None


def test_router_logits_without_moe_layers_is_a_clear_error():
    model = tiny_model(first_k_dense_replace=4)
    with pytest.raises(ValueError, match="output_router_logits=True but the model has no MoE layer"):
        model(ids(), output_router_logits=True)


def test_router_aux_loss_coef_is_validated():
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        tiny_config(router_aux_loss_coef=-0.1)


# ------------------------------------------------------------------------------------------ aux loss


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    """Oracle: transformers' `load_balancing_loss_func` (Mixtral's, which Glm5Next applies to its sigmoid router)."""
    generator = torch.Generator().manual_seed(0)
    batch, length, experts, top_k = 3, 7, 8, 2
    logits = tuple(torch.randn(batch * length, experts, generator=generator) * 3 for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, :4] = 0
        mask[2, :1] = 0
    expected = load_balancing_loss_func(logits, experts, top_k, mask)
    torch.testing.assert_close(load_balancing_loss(logits, top_k, mask), expected, rtol=1e-6, atol=1e-6)


def test_aux_loss_is_added_to_the_lm_loss_times_the_coefficient():
    model = tiny_model(router_aux_loss_coef=0.25)
    tokens = ids()
    plain = model(tokens, labels=tokens)
    out = model(tokens, labels=tokens, output_router_logits=True)
    expected_aux = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(out.aux_loss, expected_aux)
    torch.testing.assert_close(out.loss, plain.loss + 0.25 * expected_aux)
    # Without labels: no loss, the aux loss still reported (transformers' convention).
    assert model(tokens, output_router_logits=True).loss is None


def test_aux_loss_leaves_padding_out():
    """A left-padded row counts only its real tokens: the loss equals the one over the unpadded tokens' logits."""
    model = tiny_model()
    tokens = ids()
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0
    out = model(tokens, attention_mask=mask, output_router_logits=True)
    keep = mask.reshape(-1).bool()
    expected = load_balancing_loss_func(tuple(logits[keep] for logits in out.router_logits), 4, 2)
    torch.testing.assert_close(out.aux_loss, expected)


def test_aux_loss_under_the_static_cache_leaves_padding_out():
    """With a `KDSAStaticCache` the mask is padded to the capacity: the aux loss still counts only the current real
    tokens, in the prefill (left padding) and in a decode step, as with the paged cache."""
    from modeling_kdsa.static_cache import KDSAStaticCache

    model = tiny_model()
    tokens = ids()
    mask = torch.ones_like(tokens)
    mask[0, :5] = 0
    step = torch.tensor([[7], [9]])
    caches = {"paged": KDSACache(model.config), "static": KDSAStaticCache(model.config, max_cache_len=32)}
    aux = {}
    for name, cache in caches.items():
        prefill = model(tokens, attention_mask=mask, cache=cache, output_router_logits=True)
        decode = model(
            step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), cache=cache, output_router_logits=True
        )
        aux[name] = (prefill.aux_loss, decode.aux_loss)
    keep = mask.reshape(-1).bool()
    expected = load_balancing_loss_func(tuple(logits[keep] for logits in prefill.router_logits), 4, 2)
    torch.testing.assert_close(aux["static"][0], expected)
    torch.testing.assert_close(aux["static"], aux["paged"])


def test_aux_loss_trains_the_router():
    model = tiny_model()
    out = model(ids(), output_router_logits=True)
    out.aux_loss.backward()
    for layer in model.model.layers:
        if isinstance(layer.mlp, KDSAMoE):
            assert layer.mlp.gate.weight.grad is not None and layer.mlp.gate.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------- gradient checkpointing

# KDA, DSA, dense MLA and KDA; a dense MLP then three MoE layers.
MIXED_LAYERS = ["linear_attention", "indexed_attention", "full_attention", "linear_attention"]
RESIDUAL_STREAMS = {
    "plain": dict(attn_res_block_size=0),
    "attn_res": dict(attn_res_block_size=3),  # blocks straddle layers: phase-1 statistics cross a checkpoint
    "mhc": dict(attn_res_block_size=0, hc_mult=2),
}


def _gradients(model: KDSAForCausalLM, tokens, mask) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(tokens, attention_mask=mask, labels=tokens, output_router_logits=True)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, out.loss.detach()


@pytest.mark.parametrize("stream", list(RESIDUAL_STREAMS))
def test_gradient_checkpointing_gives_the_same_gradients(stream):
    """Gradients (LM loss + router aux loss) with every layer checkpointed equal those without, for each residual
    stream; the layers really are replayed (each token mixer runs twice per step)."""
    model = tiny_model(layer_types=MIXED_LAYERS, **RESIDUAL_STREAMS[stream]).train()
    tokens = ids(length=12)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    expected, expected_loss = _gradients(model, tokens, mask)
    assert len(expected) > 0

    model.gradient_checkpointing_enable()
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: calls.append(m)) for layer in model.model.layers]
    got, loss = _gradients(model, tokens, mask)
    for hook in hooks:
        hook.remove()
    assert len(calls) == len(model.model.layers)  # the module hooks run once (transformers checkpoints `forward`)
    assert torch.equal(loss, expected_loss)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_replays_each_layer():
    model = tiny_model(layer_types=MIXED_LAYERS).train()
    model.gradient_checkpointing_enable()
    runs = []
    mixers = [getattr(layer, "linear_attn", None) or layer.self_attn for layer in model.model.layers]
    hooks = [mixer.register_forward_hook(lambda m, a, o: runs.append(m)) for mixer in mixers]
    model(ids(), labels=ids()).loss.backward()
    for hook in hooks:
        hook.remove()
    assert len(runs) == 2 * len(mixers)


def test_reentrant_gradient_checkpointing_is_refused():
    model = tiny_model().train()
    with pytest.raises(ValueError, match="use_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})  # torch's default is reentrant


def test_gradient_checkpointing_drops_a_cache_in_training():
    """The replay would write the cache twice: as in transformers, training with checkpointing runs without it."""
    model = tiny_model().train()
    model.gradient_checkpointing_enable()
    cache = KDSACache(model.config)
    out = model(ids(), cache=cache, labels=ids())
    assert cache.get_seq_length() == 0 and out.cache is None
    # Without gradients (generate from a model in train mode) the cache is used as usual.
    with torch.no_grad():
        model(ids(), cache=cache)
    assert cache.get_seq_length() == 12


def test_gradient_checkpointing_keeps_inference_unchanged(model):
    tokens = ids()
    expected = model(tokens).logits
    model.gradient_checkpointing_enable()
    assert torch.equal(model(tokens).logits, expected)
