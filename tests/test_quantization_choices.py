"""Each quantization choice reaches the kernels and changes what it should, end to end through the model: the keys
the cache stores and the queries the indexer kernel receives are the MXFP8 encodings under the configured scale rule,
and the latent rows the FP8 tiles of the configured tile size. Data are chosen so that each alternative (unrounded
queries, the other scale rule) would give different bytes, so a choice silently dropped on the way fails."""

import dataclasses

import pytest
import torch
from conftest import tiny_model

from modeling_kdsa import KDSAQuantizationConfig, kernels
from modeling_kdsa.cache import KDSACache, KDSAPagedLayer
from modeling_kdsa.dsa_paged_reference import gather_pages
from modeling_kdsa.numeric_formats import CacheFormats, fp8_tile_quantize, mxfp8_dequantize, mxfp8_quantize

QUANTIZABLE = dict(index_head_dim=32, kv_lora_rank=128)


def mx_round(x: torch.Tensor, rule: str) -> torch.Tensor:
    return mxfp8_dequantize(*mxfp8_quantize(x, rule), dtype=x.dtype)


def test_quantize_index_queries_rounds_only_when_keys_are_mxfp8():
    queries = torch.randn(2, 3, 4, 64)
    for rule in ("ceil", "floor"):
        rounded = CacheFormats(indexer="mxfp8", mxfp8_scale_rule=rule).quantize_index_queries(queries)
        assert torch.equal(rounded, mx_round(queries, rule)) and not torch.equal(rounded, queries)
    assert not torch.equal(mx_round(queries, "floor"), mx_round(queries, "ceil"))  # the data tell the rules apart
    assert CacheFormats(indexer="bf16").quantize_index_queries(queries) is queries


def run_recording(model, ids, monkeypatch, backend="torch"):
    """Prefill + 2 decode steps through a KDSACache; returns the cache, each DSA layer's indexer keys and queries as
    the layer computed them (forward hook), and the queries the indexer kernel received."""
    captured, received = {}, {}

    def hook(layer_idx):
        def keep(module, inputs, outputs):
            q_index, _, k_index = outputs
            captured.setdefault(layer_idx, []).append((q_index.detach(), k_index.detach()))

        return keep

    reference = kernels.kernel_set(backend)
    reference_indexer = reference.indexer_topk

    def recording_indexer(q_index, *args, **kwargs):
        received.setdefault("q", []).append(q_index.detach())
        return reference_indexer(q_index, *args, **kwargs)

    recording = dataclasses.replace(reference, indexer_topk=recording_indexer)
    monkeypatch.setitem(kernels._BACKENDS, backend, lambda: recording)
    handles = [
        layer.self_attn.indexer.register_forward_hook(hook(i))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer, "self_attn")
    ]
    cache = KDSACache(model.config)
    with torch.no_grad():
        model(ids[:, :-2], cache=cache)
        for t in (-2, -1):
            model(ids[:, t:][:, :1], cache=cache)
    for handle in handles:
        handle.remove()
    return cache, captured, received["q"]


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_scale_rule_and_query_rounding_reach_the_kernel(rule, monkeypatch):
    """config.quantization_config → KDSACache stores → kernel: stored key bytes = MXFP8(keys, rule); queries handed to
    the indexer kernel = MXFP8-rounded(queries, rule), not the raw queries and not the other rule's."""
    other = {"floor": "ceil", "ceil": "floor"}[rule]
    model = tiny_model(kernel_backend="torch", **QUANTIZABLE)
    model.config.quantization_config = KDSAQuantizationConfig(mxfp8_scale_rule=rule)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    cache, captured, received = run_recording(model, ids, monkeypatch)

    layer_queries = [q for layer_idx in sorted(captured) for q, _ in captured[layer_idx]]
    # Forwards run layer by layer, so the kernel calls come in the same order as the hooked layer calls.
    order = [q for step in range(3) for layer_idx in sorted(captured) for q in [captured[layer_idx][step][0]]]
    assert len(received) == len(layer_queries) == len(order)
    for call, (raw, got) in enumerate(zip(order, received, strict=True)):
        assert torch.equal(got, mx_round(raw, rule))
        assert not torch.equal(got, raw)
        if call < len(captured):  # prefill: enough blocks that the two rules differ somewhere
            assert not torch.equal(got, mx_round(raw, other))

    for layer_idx, calls in captured.items():
        store = cache.layers[layer_idx]
        assert isinstance(store, KDSAPagedLayer) and store.formats.mxfp8_scale_rule == rule
        keys = torch.cat([k for _, k in calls], dim=1)  # [B, S, DI] in cache order
        stored_scales = gather_pages(store.index_pages.scales.view(torch.uint8), store.block_table, keys.shape[1])
        stored_elements = gather_pages(store.index_pages.elements.view(torch.uint8), store.block_table, keys.shape[1])
        elements, scales = mxfp8_quantize(keys, rule)
        assert torch.equal(stored_scales, scales.view(torch.uint8))
        assert torch.equal(stored_elements, elements.view(torch.uint8))
        assert not torch.equal(scales.view(torch.uint8), mxfp8_quantize(keys, other)[1].view(torch.uint8))


def test_kv_cache_tile_size_reaches_the_store():
    """kv_cache_tile_size=64 on a 128-wide latent: two scales per row, equal to FP8 tiles of 64 of the stored rows
    (tiles of 128 would give one scale and other bytes)."""
    model = tiny_model(kernel_backend="torch", **QUANTIZABLE)
    model.config.quantization_config = KDSAQuantizationConfig(kv_cache_tile_size=64)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    latents = {}
    handles = [
        layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda module, inputs, output, i=i: latents.__setitem__(i, output.detach())
        )
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer, "self_attn")
    ]
    cache = KDSACache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    for handle in handles:
        handle.remove()
    assert latents
    for layer_idx, latent in latents.items():
        store = cache.layers[layer_idx]
        scales = gather_pages(store.kv_pages.scales, store.block_table, ids.shape[1])
        assert scales.shape[-1] == 2
        assert torch.equal(scales, fp8_tile_quantize(latent, 64)[1])
