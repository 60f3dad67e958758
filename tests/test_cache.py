"""KDSACache: paged DSA store bookkeeping, kernels reading it, capacity, memory accounting, generate integration."""

import pytest
import torch
from conftest import store_kernels, tiny_model
from transformers import DynamicCache, StaticCache

from modeling_kdsa import dsa_ops
from modeling_kdsa.cache import PAGE_SIZE, ROLLBACK_TOKENS, KDAReplayLayer, KDSACache, KDSAPagedLayer
from modeling_kdsa.dsa import paged_indexer_topk, paged_sparse_attention
from modeling_kdsa.dsa_paged_reference import gather_pages
from modeling_kdsa.static_cache import KDSAStaticCache


def ids(batch, length, seed=0):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


def contiguous(store: KDSAPagedLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """What the store holds, in logical order: `[B, S, C + R]`, `[B, S, DI]`."""
    kv = gather_pages(store.kv_pages, store.block_table, store.num_tokens)
    index = gather_pages(store.index_pages, store.block_table, store.num_tokens)
    return kv, index


# ------------------------------------------------------------------------------------------ store bookkeeping


def test_store_round_trips_across_page_boundaries():
    store = KDSAPagedLayer(kv_width=5, index_width=3, kernel_backend="torch")
    kv, index = torch.randn(2, 200, 5), torch.randn(2, 200, 3)
    for start, stop in [(0, 63), (63, 64), (64, 65), (65, 130), (130, 200)]:
        assert store.append(kv[:, start:stop], index[:, start:stop]) == start
        got_kv, got_index = contiguous(store)
        assert torch.equal(got_kv, kv[:, :stop]) and torch.equal(got_index, index[:, :stop])
    assert store.block_table.shape == (2, -(-200 // PAGE_SIZE))
    assert len(set(store.block_table.reshape(-1).tolist())) == 2 * 4  # every sequence owns its pages


def test_reorder_shares_full_pages_and_copies_the_page_being_filled():
    """Beams 0 and 1 both continue sequence 0: the 70-token prefix's full page is shared, the partial page is
    copied on the first write, and the two beams then diverge without touching each other."""
    store = KDSAPagedLayer(kv_width=4, index_width=2, kernel_backend="torch")
    kv, index = torch.randn(2, 70, 4), torch.randn(2, 70, 2)
    store.append(kv, index)
    pages_before = store.memory_bytes()["in_use"]
    store.reorder_cache(torch.tensor([0, 0]))
    assert store.block_table[0].tolist() == store.block_table[1].tolist()
    assert store.memory_bytes()["in_use"] == pages_before // 2  # sequence 1's pages were released

    new_kv, new_index = torch.randn(2, 3, 4), torch.randn(2, 3, 2)
    store.append(new_kv, new_index)
    assert store.block_table[0, 0] == store.block_table[1, 0]  # full page still shared
    assert store.block_table[0, 1] != store.block_table[1, 1]  # partial page copied on write
    got_kv, got_index = contiguous(store)
    for beam in range(2):
        assert torch.equal(got_kv[beam], torch.cat([kv[0], new_kv[beam]]))
        assert torch.equal(got_index[beam], torch.cat([index[0], new_index[beam]]))


def test_crop_then_append_overwrites_only_the_cropped_tail():
    store = KDSAPagedLayer(kv_width=4, index_width=2, kernel_backend="torch")
    kv, index = torch.randn(1, 150, 4), torch.randn(1, 150, 2)
    store.append(kv, index)
    store.crop(100)
    assert store.num_tokens == 100 and store.block_table.shape[1] == 2
    tail_kv, tail_index = torch.randn(1, 30, 4), torch.randn(1, 30, 2)
    store.append(tail_kv, tail_index)
    got_kv, got_index = contiguous(store)
    assert torch.equal(got_kv, torch.cat([kv[:, :100], tail_kv], dim=1))
    assert torch.equal(got_index, torch.cat([index[:, :100], tail_index], dim=1))
    with pytest.raises(ValueError, match="cannot crop"):
        store.crop(500)


def test_store_rejects_wrong_widths_and_batch():
    store = KDSAPagedLayer(kv_width=4, index_width=2, kernel_backend="torch")
    with pytest.raises(ValueError, match="width"):
        store.append(torch.randn(1, 3, 5), torch.randn(1, 3, 2))
    store.append(torch.randn(1, 3, 4), torch.randn(1, 3, 2))
    with pytest.raises(ValueError, match="1 sequences"):
        store.append(torch.randn(2, 1, 4), torch.randn(2, 1, 2))
    assert store.num_tokens == 3


# --------------------------------------------------------------------------------------------- kernels on pages


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("context", [63, 64, 65, 130])
def test_paged_kernels_equal_the_contiguous_reference(backend, context):
    """The store's kernels (fused or reference) == dsa_ops' contiguous reference on the same data, fp32:
    identical index sets; outputs equal up to summation order (1e-5 relative)."""
    torch.manual_seed(context)
    heads, index_heads, latent, rope, index_dim, topk = 4, 2, 16, 8, 8, 16
    store = KDSAPagedLayer(kv_width=latent + rope, index_width=index_dim, kernel_backend=backend)
    kv, keys = torch.randn(2, context, latent + rope), torch.randn(2, context, index_dim)
    store.append(kv[:, : context // 2], keys[:, : context // 2])  # two appends: pages filled in two steps
    store.append(kv[:, context // 2 :], keys[:, context // 2 :])
    padding = torch.ones(2, context, dtype=torch.bool)
    padding[1, :5] = False  # left padding in row 1
    query_start, num_queries = context - 9, 9
    q_index = torch.randn(2, num_queries, index_heads, index_dim)
    weights = torch.randn(2, num_queries, index_heads)
    paged = paged_indexer_topk(store_kernels(store), store, q_index, weights, query_start, topk, padding)
    reference = dsa_ops.indexer_topk(q_index, weights, keys, topk, query_start, padding)
    assert torch.equal(paged, reference)

    q_latent, q_pe = torch.randn(2, num_queries, heads, latent), torch.randn(2, num_queries, heads, rope)
    out = paged_sparse_attention(store_kernels(store), store, q_latent, q_pe, paged, 0.3)
    expected = dsa_ops.sparse_mla_attention(q_latent, q_pe, kv[..., :latent], kv[..., latent:], reference, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_len", [63, 64, 65])
def test_generate_across_page_boundaries_matches_recompute(prompt_len):
    """Greedy tokens with the paged cache == recomputing the whole sequence without cache, for prompts ending
    just before, at and after a page boundary, decoding across the next one."""
    model = tiny_model()
    prompt = ids(2, prompt_len)
    kwargs = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, **kwargs)
    without_cache = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without_cache)


def test_reference_and_fused_backends_generate_the_same_tokens():
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
    prompt = ids(2, 40)
    reference = tiny_model(kernel_backend="torch").generate(prompt, **kwargs)
    fused = tiny_model(kernel_backend="cpu").generate(prompt, **kwargs)
    assert torch.equal(reference, fused)


# ------------------------------------------------------------------------------------- cache-level behaviour


def test_generate_uses_kdsa_cache_and_rejects_other_caches():
    model = tiny_model()
    out = model.generate(ids(1, 10), max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert isinstance(out.cache, KDSACache)
    with pytest.raises(ValueError, match="KDSACache"):
        model(ids(1, 10), cache=DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="cache_implementation"):
        model.generate(ids(1, 10), max_new_tokens=3, cache_implementation="offloaded", pad_token_id=0)



def test_caches_are_transformers_dynamic_and_static_caches():
    """`KDSACache` is a `DynamicCache` and `KDSAStaticCache` a `StaticCache` (not a `DynamicCache`), each with our
    layers, so code that asks transformers' cache classes (generate's static-cache checks, user code) sees what they
    are. generate() builds each from `cache_implementation`; transformers' own caches are still refused, since their
    layers hold no paged DSA store."""
    model = tiny_model()
    dynamic, static = KDSACache(model.config), KDSAStaticCache(model.config, max_cache_len=32)
    assert isinstance(dynamic, DynamicCache) and not isinstance(dynamic, StaticCache)
    assert isinstance(static, StaticCache) and not isinstance(static, (DynamicCache, KDSACache))
    for cache in (dynamic, static):
        kinds = [type(layer).__mro__ for layer in cache.layers]
        assert [KDAReplayLayer in mro for mro in kinds] == [t == "linear_attention" for t in model.config.layer_types]
        assert cache.is_linear == [t == "linear_attention" for t in model.config.layer_types]

    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert type(model.generate(ids(1, 10), **kwargs).cache) is KDSACache
    static_out = model.generate(ids(1, 10), cache_implementation="static", disable_compile=True, **kwargs)
    assert type(static_out.cache) is KDSAStaticCache
    assert int(static_out.cache.get_seq_length()) == 12  # prompt + the new tokens but the last
    assert torch.equal(static_out.sequences, model.generate(ids(1, 10), **kwargs).sequences)
    with pytest.raises(ValueError, match="KDSACache or a KDSAStaticCache"):
        model(ids(1, 10), cache=StaticCache(config=model.config, max_cache_len=32))


def test_transformers_cache_queries_on_kdsa_caches():
    """What transformers asks of a cache between forwards (cache_utils.Cache: lengths, mask sizes, the linear
    layers' state flag, the batch size, the capacity), answered by both KDSA caches after a prefill and a step."""
    model = tiny_model()
    kda, dsa = model.config.layer_types.index("linear_attention"), model.config.layer_types.index("indexed_attention")
    # The mask spans past + new tokens in the growing cache and the whole capacity (40 tokens in whole pages) in the
    # static one; only the static cache has a maximum length.
    caches = ((KDSACache(model.config), (6, 0), -1), (KDSAStaticCache(model.config, 40), (PAGE_SIZE, 0), 40))
    for cache, mask_sizes, max_length in caches:
        assert cache.get_seq_length() == 0 and cache.get_max_length() == max_length
        model(ids(2, 4), cache=cache, use_cache=True)
        model(ids(2, 1, seed=1), cache=cache, use_cache=True)
        assert int(cache.get_seq_length()) == 5 and int(cache.get_seq_length(dsa)) == 5
        assert cache.get_mask_sizes(1, dsa) == mask_sizes
        assert cache.get_mask_sizes(1, kda) == cache.get_mask_sizes(1, dsa)  # a linear layer answers for the first DSA
        assert cache.has_previous_state(kda) and cache.has_previous_state()
        assert cache.batch_size == 2


def test_capacity_error_is_raised_before_anything_is_written():
    model = tiny_model()
    prompt = ids(1, 40)
    cache = KDSACache(model.config, max_cache_tokens=32)
    with torch.no_grad():
        model(prompt[:, :28], cache=cache)
        with pytest.raises(ValueError, match="capacity exceeded"):
            model(prompt[:, 28:40], cache=cache)  # 28 + 12 > 32
        assert cache.get_seq_length() == 28
        assert all(layer.num_tokens == 28 for layer in cache.layers if isinstance(layer, KDSAPagedLayer))
        continued = model(prompt[:, 28:32], cache=cache).logits
        full = model(prompt[:, :32], use_cache=False).logits[:, 28:]
    # fp32; chunked vs recurrent KDA summation order only.
    torch.testing.assert_close(continued, full, atol=2e-5, rtol=0)


def test_memory_bytes_matches_the_layout():
    model = tiny_model()
    config = model.config
    batch, tokens = 2, 100
    cache = KDSACache(config, rollback_tokens=ROLLBACK_TOKENS)  # with KDA replay records, to count them too
    with torch.no_grad():
        model(ids(batch, tokens), cache=cache)
    usage = cache.memory_bytes()
    itemsize = 4  # fp32 model
    n_dsa = config.layer_types.count("indexed_attention")
    n_kda = config.num_hidden_layers - n_dsa
    row = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    assert usage["per_token"] == n_dsa * row * itemsize
    pages_per_sequence = -(-tokens // PAGE_SIZE)
    assert usage["dsa_in_use"] == n_dsa * batch * pages_per_sequence * PAGE_SIZE * row * itemsize
    channels = 3 * config.linear_num_heads * config.linear_head_dim
    conv = batch * channels * config.linear_conv_kernel_dim * itemsize
    recurrent = batch * config.linear_num_heads * config.linear_head_dim**2 * 4  # fp32 state
    assert usage["kda_states"] == n_kda * (conv + recurrent)
    pools = sum(
        layer.kv_pages.nbytes + layer.index_pages.nbytes for layer in cache.layers if isinstance(layer, KDSAPagedLayer)
    )
    assert usage["dsa_allocated"] == pools >= usage["dsa_in_use"]
    # Rollback records of the 100 pending tokens: pre-conv columns, k, v, g (fp32), beta (fp32) per token, plus the
    # checkpoint (the zero state the prompt started from), per KDA layer.
    key_dim = config.linear_num_heads * config.linear_head_dim
    per_pending = channels * itemsize + 2 * key_dim * 4 + key_dim * itemsize + config.linear_num_heads * 4
    assert usage["rollback_per_token"] == n_kda * per_pending
    assert usage["kda_rollback"] == n_kda * (batch * tokens * per_pending + conv + recurrent)
    assert usage["total"] == usage["dsa_allocated"] + usage["kda_states"] + usage["kda_rollback"]


def test_crop_without_rollback_records_is_refused_and_reset_empties():
    """By default (rollback_tokens=0, also what plain generate() uses) KDA layers keep no replay records: crop is
    refused, clearly. Rollback itself is tested in test_speculative.py."""
    model = tiny_model()
    cache = KDSACache(model.config)
    with torch.no_grad():
        model(ids(1, 20), cache=cache)
    assert not cache.is_croppable and cache.memory_bytes()["kda_rollback"] == 0
    with pytest.raises(ValueError, match="KDA rollback checkpoint is at 20 tokens"):
        cache.crop(10)
    assert cache.get_seq_length() == 20
    cache.reset()
    # DSA pages are dropped; KDA state buffers are kept (zeroed) at their static addresses, as transformers does.
    assert cache.get_seq_length() == 0 and cache.memory_bytes()["dsa_allocated"] == 0
    assert not cache.has_previous_state(0)
    with torch.no_grad():
        after_reset = model(ids(1, 12, seed=5), cache=cache).logits
        fresh = model(ids(1, 12, seed=5), cache=KDSACache(model.config)).logits
    assert torch.equal(after_reset, fresh)


def test_crop_on_a_dsa_only_model_continues_exactly():
    model = tiny_model(layer_types=["indexed_attention"] * 4)
    prompt = ids(1, 90)
    cache = KDSACache(model.config)
    with torch.no_grad():
        model(prompt[:, :80], cache=cache)
        cache.crop(70)
        continued = model(prompt[:, 70:90], cache=cache).logits
        full = model(prompt, use_cache=False).logits[:, 70:]
    # fp32; same kernels, only the query blocking differs.
    torch.testing.assert_close(continued, full, atol=1e-5, rtol=0)
