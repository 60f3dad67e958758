"""Page bookkeeping of the paged DSA store: after every crop, reorder, reset and append, the reference counts equal
the block-table entries that point at each page, free pages are exactly the unreferenced ones, and
`memory_bytes()["in_use"]` counts exactly the referenced pages. Data tests (test_cache.py) cannot see a leak: a crop
that forgets to release its pages still reads back the right tokens."""

from collections import Counter

import pytest
import torch
from conftest import tiny_model

from modeling_kdsa.cache import PAGE_SIZE, ROLLBACK_TOKENS, KDSACache, KDSAPagedLayer
from modeling_kdsa.numeric_formats import CacheFormats


def store_of(formats: CacheFormats | None = None) -> KDSAPagedLayer:
    return KDSAPagedLayer(kv_width=136, index_width=32, kernel_backend="torch", formats=formats, latent_width=128)


def append(store: KDSAPagedLayer, tokens: int, batch: int = 2) -> None:
    store.append(torch.randn(batch, tokens, 136), torch.randn(batch, tokens, 32))


def assert_consistent(store: KDSAPagedLayer) -> None:
    """Refcounts = block-table references; free list = unreferenced pages, each once; in_use = referenced pages;
    the table maps exactly the pages the tokens need."""
    table = store.block_table
    references = Counter(page for page in table.reshape(-1).tolist() if page >= 0)
    assert store.page_refcount == [references.get(page, 0) for page in range(len(store.page_refcount))]
    assert sorted(store.free_pages) == [page for page, count in enumerate(store.page_refcount) if count == 0]
    assert (table[:, : -(-store.num_tokens // store.page_size)] >= 0).all()
    assert table.shape[1] == -(-store.num_tokens // store.page_size), "no page held past the last token"
    in_use = len(references) * store.page_size * store.bytes_per_token()
    assert store.memory_bytes()["in_use"] == in_use


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8+mxfp8"])
def test_refcounts_after_crop_and_reuse(quantized):
    formats = CacheFormats(indexer="mxfp8", kv_cache="fp8") if quantized else None
    store = store_of(formats)
    append(store, 3 * PAGE_SIZE + 5)
    assert_consistent(store)
    pool = len(store.page_refcount)
    in_use_before = store.memory_bytes()["in_use"]
    store.crop(PAGE_SIZE - 3)  # drop 3 of the 4 pages of each sequence
    assert_consistent(store)
    assert store.memory_bytes()["in_use"] == in_use_before // 4
    assert len(store.free_pages) == pool - 2
    # Regrowing takes the released pages back: the pool does not grow (no leak across speculative rounds).
    for _ in range(5):
        append(store, 2 * PAGE_SIZE)
        assert_consistent(store)
        store.crop(-2 * PAGE_SIZE)
        assert_consistent(store)
    assert len(store.page_refcount) == pool
    append(store, 3 * PAGE_SIZE + 3)  # back to 4 full pages per sequence
    assert_consistent(store)
    assert len(store.page_refcount) == pool and store.num_tokens == 4 * PAGE_SIZE


def test_refcounts_after_reorder_crop_and_reset():
    """Beams sharing pages: crop releases one reference per beam, shared pages stay until the last one goes."""
    store = store_of()
    append(store, 2 * PAGE_SIZE + 10, batch=3)
    store.reorder_cache(torch.tensor([0, 0, 1]))
    assert_consistent(store)
    append(store, 1, batch=3)  # copy-on-write of the shared partial page
    assert_consistent(store)
    store.crop(PAGE_SIZE + 1)
    assert_consistent(store)
    shared = store.block_table[0, 0].item()
    assert store.page_refcount[shared] == 2
    store.reorder_cache(torch.tensor([2, 2, 2]))
    assert_consistent(store)
    assert store.page_refcount[shared] == 0 and shared in store.free_pages
    store.crop(0)
    assert_consistent(store)
    assert store.memory_bytes()["in_use"] == 0 and len(store.free_pages) == len(store.page_refcount)
    store.reset()
    assert store.memory_bytes() == {"allocated": 0, "in_use": 0}


def test_speculative_generation_does_not_leak_pages():
    """Prompt lookup crops the cache after every verification: at the end, the pages in use are exactly those the
    tokens need, in every DSA layer."""
    model = tiny_model(index_topk=4)
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 30])
    cache = KDSACache(model.config, rollback_tokens=ROLLBACK_TOKENS)
    model.generate(prompt, past_key_values=cache, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=8)
    stores = [layer for layer in cache.layers if isinstance(layer, KDSAPagedLayer)]
    assert stores
    for store in stores:
        assert_consistent(store)
        assert sum(count > 0 for count in store.page_refcount) == -(-store.num_tokens // PAGE_SIZE)
