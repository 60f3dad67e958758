"""GLM-5.3-Flash indexer variants (docs/dsa.md §9, §10): the k-pool indexer and shared-indexer layers, against
transformers' Glm5NextTextIndexer / Glm5NextTextAttention, on every kernel backend, through the paged cache.

Ties: 16 indexer heads with random weights, so an exact-zero pool score (every head's ReLU zero) has probability
~2^-16 per (query, pool); no exact ties occur in these cases. Equal scores would go to the earlier pool on our side.
Selections are compared as sets (transformers turns them into a mask; the order never matters for a set).
"""

import pytest
import torch
from conftest import store_kernels, tiny_config, tiny_model
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextIndexer

from modeling_kdsa import KDSAConfig
from modeling_kdsa.cache import KDSACache, KDSAPagedKPoolLayer, KDSAPagedMLALayer
from modeling_kdsa.dsa import KDSAIndexer, KDSASparseAttention, paged_kpool_indexer_topk
from modeling_kdsa.dsa_ops import ScoredPairs, kpool_indexer_topk, kpool_keys
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.kernels import kernel_set
from modeling_kdsa.numeric_formats import CacheFormats

KPOOL, TOPK, HIDDEN, INDEX_HEADS, INDEX_DIM = 4, 16, 32, 16, 16
BACKENDS = ["torch", "cpu", pytest.param("compiled", marks=pytest.mark.slow)]


def glm_config(**overrides) -> Glm5NextTextConfig:
    fields = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=0,
        v_head_dim=8,
        index_n_heads=INDEX_HEADS,
        index_head_dim=INDEX_DIM,
        index_topk=TOPK,
        index_kpool=KPOOL,
        layer_types=["indexed_attention", "indexed_attention"],
        indexer_types=["full", "full"],
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    config = Glm5NextTextConfig(**fields)
    config._attn_implementation = "eager"
    return config


def kdsa_config(glm: Glm5NextTextConfig, **overrides) -> KDSAConfig:
    fields = dict(
        hidden_size=glm.hidden_size,
        num_hidden_layers=glm.num_hidden_layers,
        num_attention_heads=glm.num_attention_heads,
        layer_types=list(glm.layer_types),
        q_lora_rank=glm.q_lora_rank,
        kv_lora_rank=glm.kv_lora_rank,
        qk_nope_head_dim=glm.qk_nope_head_dim,
        qk_rope_head_dim=0,
        v_head_dim=glm.v_head_dim,
        index_n_heads=glm.index_n_heads,
        index_head_dim=glm.index_head_dim,
        index_topk=glm.index_topk,
        index_kpool=glm.index_kpool,
        index_kpool_always_select_tail=glm.index_kpool_always_select_tail,
        indexer_types=list(glm.indexer_types),
        rms_norm_eps=glm.rms_norm_eps,
        first_k_dense_replace=glm.num_hidden_layers,
        attn_res_block_size=0,
    )
    fields.update(overrides)
    return KDSAConfig(**fields)


def perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (ones/zeros-initialised ones included), so a wrong mapping cannot hide."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return module.eval()


def left_padded_mask(seq_len: int, pads: tuple[int, ...]) -> torch.Tensor:
    mask = torch.ones(len(pads), seq_len, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, :pad] = False
    return mask


def as_sets(indices: torch.Tensor) -> list:
    return [[sorted(i for i in row.tolist() if i >= 0) for row in seq] for seq in indices]


# ------------------------------------------------------------------------------------------- (a) indexer top-k
@pytest.mark.parametrize("seq_len", [10, 3 * TOPK + 7])
@pytest.mark.parametrize("select_tail", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_topk_matches_glm(seq_len, select_tail, backend):
    glm_cfg = glm_config(index_kpool_always_select_tail=select_tail)
    theirs = perturbed(Glm5NextTextIndexer(glm_cfg, 0), seed=1)
    config = kdsa_config(glm_cfg, kernel_backend=backend)
    ours = KDSAIndexer(config, 0).eval()
    ours.load_state_dict(theirs.state_dict())
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, seq_len, HIDDEN, generator=generator)
    q_resid = torch.randn(2, seq_len, glm_cfg.q_lora_rank, generator=generator)
    mask = left_padded_mask(seq_len, (0, 3))
    expected = theirs(hidden, q_resid, mask, None)

    q_index, weights, rows = ours(hidden, q_resid, None)
    ape = ours.index_kpool_compress_ape
    assert as_sets(kpool_indexer_topk(q_index, weights, rows, ape, TOPK, 0, mask, select_tail)) == as_sets(expected)
    store = KDSAPagedKPoolLayer.from_config(config, page_size=16)
    store.append(torch.zeros(2, seq_len, store.kv_width), rows, mask, ape)
    # Two query blocks, as the layer runs a long prefill.
    half = seq_len // 2
    selected = [
        paged_kpool_indexer_topk(
            store_kernels(store), store, q_index[:, block], weights[:, block], block.start, TOPK, mask, ape, select_tail
        )
        for block in (slice(0, half), slice(half, seq_len))
    ]
    assert as_sets(selected[0]) == as_sets(expected[:, :half])
    assert as_sets(selected[1]) == as_sets(expected[:, half:])


# ------------------------------------------------------------------------------- (b) whole DSA attention layer
def _glm_and_ours(backend: str, seed: int = 3, **glm_overrides):
    glm_cfg = glm_config(**glm_overrides)
    theirs = [perturbed(Glm5NextTextAttention(glm_cfg, i), seed=seed + i) for i in range(2)]
    config = kdsa_config(glm_cfg, kernel_backend=backend)
    ours = [KDSASparseAttention(config, i).eval() for i in range(2)]
    for mine, other in zip(ours, theirs, strict=True):
        mine.load_state_dict(other.state_dict())
    return glm_cfg, config, theirs, ours


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_prefill_and_decode_match_glm(backend):
    seq_len, pads = 3 * TOPK + 5, (0, 5)
    _, config, theirs, ours = _glm_and_ours(backend)
    hidden = torch.randn(2, seq_len, HIDDEN, generator=torch.Generator().manual_seed(4))
    mask = left_padded_mask(seq_len, pads)
    with torch.no_grad():
        expected = theirs[0](hidden, mask, None)[0]
        valid = mask[..., None]
        prefill = ours[0](hidden, attention_mask=mask, cache=KDSACache(config))
        assert _relative_error(prefill * valid, expected * valid) < 1e-5

        # Token by token through the cache: a short prefill, then one token per step.
        cache = KDSACache(config)
        steps = [ours[0](hidden[:, :6], attention_mask=mask[:, :6], cache=cache)]
        for t in range(6, seq_len):
            steps.append(ours[0](hidden[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache))
        decoded = torch.cat(steps, dim=1)
        assert _relative_error(decoded * valid, expected * valid) < 1e-5


# ------------------------------------------------------------------------------------- (c) shared-indexer layers
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_shared_layer_reuses_previous_selection_as_glm(backend):
    seq_len = 3 * TOPK + 3
    _, config, theirs, ours = _glm_and_ours(backend, indexer_types=["full", "shared"])
    assert ours[1].indexer is None and not any("indexer" in name for name, _ in ours[1].named_parameters())
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, seq_len, HIDDEN, generator=generator)
    hidden_next = torch.randn(2, seq_len, HIDDEN, generator=generator)
    mask = left_padded_mask(seq_len, (0, 2))
    with torch.no_grad():
        _, _, glm_topk = theirs[0](hidden, mask, None)
        expected = theirs[1](hidden_next, mask, None, prev_topk_indices=glm_topk)[0]
        cache = KDSACache(config)
        ours[0].query_block_size = 7  # the handed-over selection is assembled from blocks of different widths
        _, topk = ours[0](hidden, attention_mask=mask, cache=cache, return_topk_indices=True)
        assert as_sets(topk) == as_sets(glm_topk)
        actual = ours[1](hidden_next, attention_mask=mask, cache=cache, topk_indices=topk)
    valid = mask[..., None]
    assert _relative_error(actual * valid, expected * valid) < 1e-5
    assert type(cache.layers[1]) is KDSAPagedMLALayer  # latent rows only: no indexer keys, no pooled keys
    assert cache.layers[1].bytes_per_token() == config.kv_lora_rank * 4


def test_shared_layer_config_follows_transformers_handover():
    """transformers hands a selection only from a full DSA layer to the layer right after it (its decoder loop
    passes each layer's return value to the next; KDA and shared layers return none): anything else raises."""
    layer_types = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    layer_types += ["indexed_attention", "indexed_attention"]
    base = dict(num_hidden_layers=6, layer_types=layer_types, qk_rope_head_dim=0, mlp_layer_types=["dense"] * 6)
    tiny_config(**base, indexer_types=["full", "full", "shared", "shared", "full", "shared"])  # KDA entries ignored
    for bad, index in ((["full", "shared", "full", "full", "full", "full"], 1),
                       (["full", "full", "shared", "full", "shared", "full"], 4),
                       (["full", "full", "shared", "full", "full", "xyz"], 5)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"indexer_types\[{index}\]"):
            tiny_config(**base, indexer_types=bad)
    # transformers itself fails at run time for a shared layer after a KDA layer.
    glm_cfg = glm_config(indexer_types=["full", "shared"])
    with pytest.raises(ValueError, match="Shared DSA layers require"):
        Glm5NextTextAttention(glm_cfg, 1)(torch.randn(1, 3, HIDDEN), torch.ones(1, 3, dtype=torch.bool), None)


def test_model_with_kpool_and_shared_layers_decodes_like_prefill():
    """Whole model: layers KDA, DSA full, DSA shared, KDA; left-padded prefill then decode == one prefill."""
    layer_types = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    model = tiny_model(
        layer_types=layer_types,
        indexer_types=["full", "full", "shared", "full"],
        qk_rope_head_dim=0,
        index_kpool=4,
        index_n_heads=8,
        kernel_backend="cpu",
    )
    assert model.model.layers[2].self_attn.indexer is None
    assert model.model.layers[1].hands_over_topk and not model.model.layers[2].hands_over_topk
    input_ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(6))
    mask = left_padded_mask(30, (0, 3))
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask).logits
        cache = KDSACache(model.config)
        steps = [model(input_ids[:, :11], attention_mask=mask[:, :11], cache=cache).logits]
        for t in range(11, 30):
            steps.append(model(input_ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
    decoded = torch.cat(steps, dim=1)
    valid = mask[..., None]
    assert _relative_error(decoded * valid, full * valid) < 1e-5


# --------------------------------------------------------------------------------------- (d) cache bookkeeping
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_crop_across_pool_boundary_then_redecode_equals_fresh_run(backend):
    _, config, _, ours = _glm_and_ours(backend)
    attn = ours[0]
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 40, HIDDEN, generator=generator)
    other = torch.randn(1, 40, HIDDEN, generator=generator)
    with torch.no_grad():
        fresh_cache = KDSACache(config)
        fresh = attn(torch.cat([hidden[:, :26], other[:, 26:]], 1), cache=fresh_cache)
        cache = KDSACache(config)
        attn(hidden[:, :20], cache=cache)
        for t in range(20, 30):  # pools end at 23 and 27: both are completed, then cut
            attn(hidden[:, t : t + 1], cache=cache)
        cache.layers[0].crop(26)  # pool 24..27 is cut in half: incomplete again
        redone = [attn(other[:, t : t + 1], cache=cache) for t in range(26, 40)]
    torch.testing.assert_close(torch.cat(redone, 1), fresh[:, 26:], rtol=1e-5, atol=1e-6)


def test_fp8_latent_cache_with_kpool_matches_its_torch_reference():
    """kv_cache='fp8' quantizes the latent rows only; the k-pool planes stay in the model dtype. cpu == torch."""
    outputs = {}
    for backend in ("torch", "cpu"):
        _, config, _, ours = _glm_and_ours(backend)
        config.quantization_config = {"quant_method": "kdsa", "kv_cache": "fp8", "kv_cache_tile_size": 16}
        cache = KDSACache(config)
        assert cache.layers[0].formats.kv_cache == "fp8"
        hidden = torch.randn(1, 50, HIDDEN, generator=torch.Generator().manual_seed(10))
        with torch.no_grad():
            steps = [ours[0](hidden[:, :30], cache=cache)]
            steps += [ours[0](hidden[:, t : t + 1], cache=cache) for t in range(30, 50)]
        outputs[backend] = torch.cat(steps, 1)
    torch.testing.assert_close(outputs["cpu"], outputs["torch"], rtol=1e-5, atol=1e-6)


def test_memory_bytes_counts_pooled_keys():
    _, config, _, ours = _glm_and_ours("cpu")
    cache = KDSACache(config)
    with torch.no_grad():
        ours[0](torch.randn(2, 70, HIDDEN), cache=cache)
    store = cache.layers[0]
    itemsize = 4
    per_token = (config.kv_lora_rank + 2 * INDEX_DIM) * itemsize + INDEX_DIM * itemsize // KPOOL
    assert store.bytes_per_token() == per_token
    pages = sum(1 for count in store.page_refcount if count > 0)
    assert store.memory_bytes()["in_use"] == pages * store.page_size * per_token
    assert store.pool_pages.shape[1:] == (store.page_size // KPOOL, INDEX_DIM)
    planes = store.kv_pages.nbytes + store.index_pages.nbytes + store.pool_pages.nbytes
    assert store.memory_bytes()["allocated"] == planes
    # reorder_cache moves pools with their pages, and the pool origin with its sequence.
    mask = left_padded_mask(4, (0, 2))
    store2 = KDSAPagedKPoolLayer.from_config(config, page_size=4)
    store2.append(torch.zeros(2, 4, store2.kv_width), torch.randn(2, 4, 2 * INDEX_DIM), mask, torch.zeros(4, 16))
    store2.reorder_cache(torch.tensor([1, 1]))
    assert store2.pool_origin.tolist() == [2, 2]


def test_kpool_store_refuses_unsupported_formats_and_masks():
    with pytest.raises(ValueError, match="index_kpool=3 must be >= 2 and divide the page size"):
        KDSAPagedKPoolLayer(16, 16, "torch", page_size=64, index_kpool=3)
    with pytest.raises(ValueError, match="indexer='mxfp8' cache format is not implemented for the k-pool"):
        KDSAPagedKPoolLayer(16, 32, "torch", formats=CacheFormats(indexer="mxfp8"), index_kpool=4)
    quantization = {"quant_method": "kdsa", "indexer": "mxfp8"}
    with pytest.raises(ValueError, match="indexer='mxfp8' cache format is not implemented for the k-pool"):
        tiny_config(qk_rope_head_dim=0, index_kpool=4, index_head_dim=32, quantization_config=quantization)
    store = KDSAPagedKPoolLayer(16, 16, "torch", index_kpool=4)
    right_padded = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="left padding"):
        store.append(torch.zeros(1, 3, 16), torch.zeros(1, 3, 32), right_padded, torch.zeros(4, 16))
    for bad in (dict(index_kpool=3), dict(index_kpool=4, qk_rope_head_dim=8)):
        with pytest.raises(ValueError, match="index_kpool"):
            tiny_config(**bad)


# ----------------------------------------------------------------------------- (e) fused / compiled vs reference
@pytest.mark.parametrize("backend", ["cpu", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("select_tail", [True, False])
def test_fused_kernels_equal_reference_at_a_few_hundred_tokens(backend, select_tail):
    generator = torch.Generator().manual_seed(8)
    num_keys, page_size, index_topk = 300, 16, 64
    pads = (0, 5, 37)
    mask = left_padded_mask(num_keys, pads)
    ape = torch.randn(KPOOL, INDEX_DIM, generator=generator)
    store = KDSAPagedKPoolLayer(8, INDEX_DIM, "torch", page_size=page_size, index_kpool=KPOOL)
    # Appended in uneven pieces, so pools complete inside and across appends; then a crop cuts a pool.
    rows = torch.randn(3, num_keys + 20, 2 * INDEX_DIM, generator=generator)
    full_mask = left_padded_mask(num_keys + 20, pads)
    for start, stop in ((0, 97), (97, 98), (98, 251), (251, 320)):
        store.append(torch.zeros(3, stop - start, 8), rows[:, start:stop], full_mask[:, :stop], ape)
    store.crop(num_keys - 11)  # cuts a pool in every sequence; the new rows differ from the dropped ones
    new_rows = torch.randn(3, 11, 2 * INDEX_DIM, generator=generator)
    store.append(torch.zeros(3, 11, 8), new_rows, mask, ape)
    rows = torch.cat([rows[:, : num_keys - 11], new_rows], dim=1)
    # Every complete pool's stored key is the pooling of its tokens as they are now (a stale pool is off by O(1);
    # 1e-6 allows the summation-order differences between thread counts, not bit-exact across them).
    for b, pad in enumerate(pads):
        ends = torch.arange(pad + KPOOL - 1, num_keys, KPOOL)
        tokens = ends[:, None] - torch.arange(KPOOL - 1, -1, -1)
        expected_keys = kpool_keys(rows[b, tokens, :INDEX_DIM], rows[b, tokens, INDEX_DIM:], ape)
        slots = store.block_table[b, ends // page_size] * (page_size // KPOOL) + (ends % page_size) // KPOOL
        torch.testing.assert_close(store.pool_pages.view(-1, INDEX_DIM)[slots], expected_keys, rtol=1e-6, atol=1e-6)
    q_index = torch.randn(3, 40, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(3, 40, INDEX_HEADS, generator=generator)
    for query_start in (num_keys - 40, 100):
        keys = PagedKeys(store.index_pages, store.block_table, num_keys, query_start, mask, store.pool_pages)
        args = (q_index, weights, keys, index_topk, ape, select_tail)
        expected = kernel_set("torch").kpool_indexer_topk(*args)
        actual = kernel_set(backend).kpool_indexer_topk(*args)
        assert actual.shape == expected.shape
        assert as_sets(actual) == as_sets(expected)
        # Same tie rule, same order: identical tensors, not only identical sets.
        assert torch.equal(actual, expected)


def test_fused_kpool_kernel_reports_the_pooled_keys_it_scores():
    """`ScoredPairs` counts the work of every indexer kernel: the fused k-pool kernel scores one pooled-key slot per
    group of kp tokens on every page it reads (a kernel that does not report counts 0)."""
    page_size, num_keys, num_queries = 16, 40, 3
    store = KDSAPagedKPoolLayer(8, INDEX_DIM, "cpu", page_size=page_size, index_kpool=KPOOL)
    ape = torch.zeros(KPOOL, INDEX_DIM)
    store.append(torch.zeros(2, num_keys, 8), torch.randn(2, num_keys, 2 * INDEX_DIM), None, ape)
    q_index, weights = torch.randn(2, num_queries, INDEX_HEADS, INDEX_DIM), torch.randn(2, num_queries, INDEX_HEADS)
    with ScoredPairs() as scored:
        paged_kpool_indexer_topk(
            store_kernels(store), store, q_index, weights, num_keys - num_queries, TOPK, None, ape, True
        )
    pages_read = -(-num_keys // page_size)
    assert scored.pairs == 2 * num_queries * pages_read * (page_size // KPOOL)


def test_shared_layer_gets_the_selection_of_the_layer_right_before_it():
    """Four DSA layers full, shared, full, shared: layer 3 must attend to layer 2's selection, not layer 0's."""
    model = tiny_model(
        layer_types=["indexed_attention"] * 4,
        indexer_types=["full", "shared", "full", "shared"],
        qk_rope_head_dim=0,
        index_kpool=4,
        index_n_heads=8,
        mlp_layer_types=["dense"] * 4,
    )
    seen, returned = {}, {}

    def record(module, args, kwargs, output):
        seen[module.layer_idx] = kwargs.get("topk_indices")
        returned[module.layer_idx] = output[1] if isinstance(output, tuple) else None

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(9)))
    assert seen[0] is None and seen[2] is None
    assert returned[1] is None and returned[3] is None
    assert seen[1] is returned[0] and seen[3] is returned[2]
    assert not torch.equal(returned[0], returned[2])


def test_prompt_lookup_generation_with_kpool_and_shared_layers_equals_greedy():
    """Speculative decoding crops after every verification, cutting pools anywhere: greedy output must not change.
    Left-padded (assisted generation takes one sequence), so pools start off the page grid."""
    model = tiny_model(
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        qk_rope_head_dim=0,
        index_kpool=4,
        index_n_heads=8,
        kernel_backend="cpu",
    )
    pattern = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(11))
    prompt = pattern.repeat(5)[None]
    mask = left_padded_mask(prompt.shape[1], (6,))
    prompt[0, :6] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    plain = model.generate(prompt, **kwargs)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=5, **kwargs)
    assert torch.equal(lookup, plain)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_model_with_kpool_and_shared_layers_runs_close_to_fp32(backend):
    """bf16 weights and cache (pooled keys in bf16, pooling softmax in fp32) run, and stay as near fp32 as the
    per-token indexer does on this tiny random model (bf16 flips some selections: 5-8% here, 8-16% per-token)."""
    overrides = dict(
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        qk_rope_head_dim=0,
        index_kpool=4,
        index_n_heads=8,
        kernel_backend=backend,
    )
    model = tiny_model(**overrides)
    input_ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(12))
    mask = left_padded_mask(24, (0, 3))
    with torch.no_grad():
        reference = model(input_ids, attention_mask=mask).logits
        model = model.to(torch.bfloat16)
        cache = KDSACache(model.config)
        steps = [model(input_ids[:, :16], attention_mask=mask[:, :16], cache=cache).logits]
        steps += [
            model(input_ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits for t in range(16, 24)
        ]
    decoded = torch.cat(steps, 1).float()
    assert cache.layers[1].pool_pages.dtype == torch.bfloat16
    valid = mask[..., None]
    assert _relative_error(decoded * valid, reference * valid) < 0.15
