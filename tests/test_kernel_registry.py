"""The kernel registry (modeling_kdsa/kernels.py): every registered backend × every kernel against the torch
reference, so a new backend is checked by being registered. `npu` runs over the fake torch_npu (tests/fake_torch_npu.py,
written from the op docs); `triton` needs triton and TRITON_INTERPRET=1 (scripts/test_triton_interpret.sh runs this
file there) and is skipped otherwise; `compiled` compiles each kernel (slow). Inputs have the dims the Ascend ops take
(index head dim 128, latent 512, RoPE 64, bf16, pages of 16) so that one set of cases serves every backend.

A kernel a backend does not implement (None) must be refused by name; a backend kernel must call its device op
(the fake records the torch_npu ops it runs)."""

import contextlib
import dataclasses
import importlib.util
import os

import fake_torch_npu
import pytest
import torch
from conftest import tiny_model
from test_dsa_paged_ops import left_padding, paged

from modeling_kdsa import dsa, dsa_ops, kda_ops
from modeling_kdsa.cache import KDSACache, KDSAPagedKPoolLayer, KDSAPagedLayer, KDSAPagedMLALayer
from modeling_kdsa.configuration_kdsa import KERNEL_BACKENDS
from modeling_kdsa.cpu_extension import kernel_isa
from modeling_kdsa.dsa_paged_common import PagedKeys, read_pages
from modeling_kdsa.fp8_linear import KDSAFP8Linear
from modeling_kdsa.kernels import (
    BACKEND_NAMES,
    CPU_KERNELS,
    KERNEL_NAMES,
    TORCH_KERNELS,
    kernel_set,
    resolve_kernel_backend,
)
from modeling_kdsa.linear import KDSALinear
from modeling_kdsa.numeric_formats import CacheFormats
from modeling_kdsa.static_cache import StaticKPoolLayer

INDEX_DIM, LATENT, ROPE, PAGE = 128, 512, 64, 16
BF16_REL_FRO = 8e-3  # bf16 attention outputs against the reference on the same bf16 values (a few roundings)
KDA_REL_FRO = 1e-2  # bf16-representable KDA inputs: the npu op rounds its state and output to bf16 (2^-8 relative)
# (num_keys, num_queries, query_start): a prefill block, a block with cached keys after it, decode at and after a page
# boundary.
CASES = [(40, 40, 0), (70, 10, 50), (64, 1, 63), (65, 1, 64), (97, 1, 96)]
BACKENDS = [pytest.param(name, marks=pytest.mark.slow) if name == "compiled" else name for name in BACKEND_NAMES]
# The torch_npu op each npu kernel must call (the fake records them).
NPU_OPS = {
    "indexer_topk": "npu_lightning_indexer",
    "kpool_indexer_topk": "npu_lightning_indexer",
    "sparse_mla": "npu_sparse_flash_attention",
    "dense_mla": "npu_sparse_flash_attention",
    "kda_recurrent": "npu_recurrent_gated_delta_rule",
}
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_KERNELS_BUILD = kernel_isa() is not None  # an x86 CPU with AVX2 (or better) and $KDSA_CPU_KERNELS not "off"


@pytest.fixture(params=BACKENDS)
def kernels(request, monkeypatch):
    backend = request.param
    if backend == "npu":
        fake_torch_npu.install(monkeypatch, available=True)
    if backend == "triton" and (importlib.util.find_spec("triton") is None or not TRITON_INTERPRETED):
        pytest.skip("kernel_backend='triton' needs triton and TRITON_INTERPRET=1 (scripts/test_triton_interpret.sh)")
    return kernel_set(backend)


def run(kernels, name: str, *args):
    """`kernels.<name>(*args)`, checking that an npu kernel ran its torch_npu op."""
    fake_torch_npu.calls.clear()
    out = kernels.require(name)(*args)
    if kernels.name == "npu" and name in NPU_OPS:
        assert NPU_OPS[name] in fake_torch_npu.calls, (name, fake_torch_npu.calls)
    return out


def require_or_refused(kernels, name: str):
    """The kernel, or skip after checking that a backend without it refuses it by name."""
    if getattr(kernels, name) is None:
        with pytest.raises(ValueError, match=rf"kernel_backend='{kernels.name}' does not implement the {name} kernel"):
            kernels.require(name)
        pytest.skip(f"{kernels.name} does not implement {name} (refused by name)")


def store_layout(kernels, keys: PagedKeys) -> PagedKeys:
    """`keys` with kv pages `[N, P, C + R]` as the backend's store keeps them (its `kv_store`: on `npu` latent and RoPE
    planes, the layout its attention op reads in place, docs/backends.md §2), each plane contiguous as in the store."""
    stored = kernels.require("kv_store")(CacheFormats(), keys.pages, LATENT)
    stored = stored.contiguous() if isinstance(stored, torch.Tensor) else stored.map(torch.Tensor.contiguous)
    return keys._replace(pages=stored)


def rel_fro(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def ternary(shape, generator) -> torch.Tensor:
    """Values in {-1, 0, 1} as bf16: every q·k over 128 channels is an integer, exact in bf16 and fp32 alike."""
    return torch.randint(-1, 2, shape, generator=generator).to(torch.bfloat16)


def same_selection(got, expected, scores):
    """Same top-k up to the order of equal scores: the same number of keys per row, valid entries first, no duplicate,
    the same multiset of scores."""
    assert got.shape == expected.shape and got.dtype == torch.int64
    assert torch.equal(got >= 0, expected >= 0)
    for row in got.flatten(0, 1).tolist():
        valid = [i for i in row if i >= 0]
        assert len(set(valid)) == len(valid)

    def selected_scores(indices):
        return scores.gather(-1, indices.clamp(min=0)).masked_fill(indices < 0, 0.0).sort(dim=-1).values

    torch.testing.assert_close(selected_scores(got), selected_scores(expected), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# The registry itself


def test_every_config_backend_is_registered_and_fields_default_to_the_torch_reference():
    assert KERNEL_BACKENDS == ("auto", *BACKEND_NAMES)
    assert TORCH_KERNELS.kda_chunk is kda_ops.chunk_kda and TORCH_KERNELS.kda_recurrent is kda_ops.recurrent_kda
    assert set(KERNEL_NAMES) == {
        "indexer_topk", "sparse_mla", "kpool_indexer_topk", "dense_mla", "kda_chunk", "kda_recurrent",
        "kda_recurrent_stepwise",
        "static_indexer_topk", "static_kpool_indexer_topk", "static_sparse_mla", "static_dense_mla", "kv_store",
        "dsa_decode_prolog", "row_linear", "head_matmul", "head_linear", "expert_linear", "experts_in_place",
        "fp8_dequantize", "fp8_row_linear",
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown kernel_backend 'cuda'"):
        kernel_set("cuda")
    with pytest.raises(ValueError, match="needs the device"):
        kernel_set("auto")
    with pytest.raises(ValueError, match="unknown kernel 'topk'"):
        TORCH_KERNELS.require("topk")


def test_auto_policy():
    assert resolve_kernel_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_kernel_backend("auto", torch.device("meta")) == "torch"  # any other device: the reference
    assert resolve_kernel_backend("compiled", torch.device("cpu")) == "compiled"
    assert kernel_set("auto", torch.device("cpu")).name == "cpu"


def test_npu_kernel_set_keeps_the_torch_prefill_for_kda(monkeypatch):
    """torch_npu has no chunked gated delta rule with a per-key decay (docs/backends.md §2): prefill stays torch."""
    fake_torch_npu.install(monkeypatch, available=True)
    assert kernel_set("npu").kda_chunk is kda_ops.chunk_kda
    assert kernel_set("npu").kda_recurrent is not kda_ops.recurrent_kda


# ---------------------------------------------------------------------------------------------------------------
# Every backend × every kernel against the torch reference


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("num_keys", "num_queries", "query_start"), CASES)
def test_indexer_topk(kernels, num_keys, num_queries, query_start, padded):
    generator = torch.Generator().manual_seed(num_keys + num_queries)
    q_index = ternary((2, num_queries, 4, INDEX_DIM), generator)
    weights = torch.randn(2, num_queries, 4, generator=generator)
    k_index = ternary((2, num_keys, INDEX_DIM), generator)
    index_pages, block_table = paged(k_index, PAGE, generator)
    padding = left_padding(2, num_keys, pad=5) if padded else None
    visible = dsa_ops.visible_keys_mask(query_start, num_queries, num_keys, padding, q_index.device)
    scores = dsa_ops.indexer_scores(q_index, weights, k_index, visible)
    for index_topk in (8, 200):
        args = (q_index, weights, PagedKeys(index_pages, block_table, num_keys, query_start, padding), index_topk)
        same_selection(run(kernels, "indexer_topk", *args), TORCH_KERNELS.indexer_topk(*args), scores)


def sparse_case(num_keys, num_queries, seed, rope=ROPE):
    generator = torch.Generator().manual_seed(seed)
    q_latent = (torch.randn(2, num_queries, 2, LATENT, generator=generator) / 8).to(torch.bfloat16)
    q_pe = (torch.randn(2, num_queries, 2, rope, generator=generator) / 8).to(torch.bfloat16)
    rows = torch.randn(2, num_keys, LATENT + rope, generator=generator).to(torch.bfloat16)
    kv_pages, block_table = paged(rows, PAGE, generator)
    return q_latent, q_pe, kv_pages, block_table


@pytest.mark.parametrize("rope", [ROPE, 0])
@pytest.mark.parametrize(("num_keys", "num_queries"), [(40, 12), (97, 1)])
def test_sparse_mla(kernels, num_keys, num_queries, rope):
    q_latent, q_pe, kv_pages, block_table = sparse_case(num_keys, num_queries, seed=num_keys, rope=rope)
    generator = torch.Generator().manual_seed(1)
    indices = torch.stack([torch.randperm(num_keys, generator=generator)[:8] for _ in range(2 * num_queries)])
    indices = indices.view(2, num_queries, 8)
    indices[0, 0, 3:] = -1  # a row with few keys
    indices[1, -1] = -1  # a row with none: zero output
    indices[0, -1, 2] = -1  # a hole before valid entries
    keys = PagedKeys(kv_pages, block_table)
    got = run(kernels, "sparse_mla", q_latent, q_pe, store_layout(kernels, keys), indices, 0.07)
    expected = TORCH_KERNELS.sparse_mla(q_latent, q_pe, keys, indices, 0.07)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert (got[1, -1] == 0).all()
    assert rel_fro(got, expected) < BF16_REL_FRO
    # Pages as a strided view: refused by every backend's input check (the kernels read rows by flat slot id).
    strided = torch.cat([kv_pages, kv_pages], dim=-1)[..., : kv_pages.shape[-1]]
    with pytest.raises(ValueError, match="kv_pages must be contiguous"):
        kernels.require("sparse_mla")(q_latent, q_pe, PagedKeys(strided, block_table), indices, 0.07)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("num_keys", "num_queries", "query_start"), CASES)
def test_dense_mla(kernels, num_keys, num_queries, query_start, padded):
    q_latent, q_pe, kv_pages, block_table = sparse_case(num_keys, num_queries, seed=num_keys + num_queries)
    kv_pages = kv_pages.nan_to_num()  # the cpu kernels read whole pages and mask the scores: finite values there
    padding = left_padding(2, num_keys, pad=5) if padded else None
    keys = PagedKeys(kv_pages, block_table, num_keys, query_start, padding)
    got = run(kernels, "dense_mla", q_latent, q_pe, store_layout(kernels, keys), 0.07)
    expected = TORCH_KERNELS.dense_mla(q_latent, q_pe, keys, 0.07)
    assert got.dtype == expected.dtype and not got.isnan().any()
    assert rel_fro(got, expected) < BF16_REL_FRO
    if padded and query_start == 0:
        assert (got[1, :5] == 0).all()  # left-padded queries see no key


@pytest.mark.parametrize("select_tail", [True, False])
def test_kpool_indexer_topk(kernels, select_tail):
    """Stored pooled keys (GLM-5.3-Flash, docs/dsa.md §9), left padding that shifts every sequence's pools
    differently, pools completed across appends, prefill blocks and decode; the same pools as the torch reference, as
    sets (equal scores may come in any order)."""
    require_or_refused(kernels, "kpool_indexer_topk")
    generator = torch.Generator().manual_seed(8)
    kpool, num_keys, index_topk, pads = 4, 150, 32, (0, 5, 38)
    mask = torch.ones(3, num_keys, dtype=torch.bool)
    for b, pad in enumerate(pads):
        mask[b, :pad] = False
    ape = torch.randn(kpool, INDEX_DIM, generator=generator).to(torch.bfloat16)
    store = KDSAPagedKPoolLayer(8, INDEX_DIM, "torch", page_size=64, index_kpool=kpool)
    rows = torch.randn(3, num_keys, 2 * INDEX_DIM, generator=generator).to(torch.bfloat16)
    for start, stop in ((0, 97), (97, 98), (98, num_keys)):
        store.append(torch.zeros(3, stop - start, 8, dtype=torch.bfloat16), rows[:, start:stop], mask[:, :stop], ape)
    q_index = torch.randn(3, 40, 8, INDEX_DIM, generator=generator).to(torch.bfloat16)
    weights = torch.randn(3, 40, 8, generator=generator)
    for query_start, num_queries in ((num_keys - 40, 40), (30, 40), (num_keys - 1, 1)):
        keys = PagedKeys(store.index_pages, store.block_table, num_keys, query_start, mask, store.pool_pages)
        args = (q_index[:, :num_queries], weights[:, :num_queries], keys, index_topk, ape, select_tail)
        got = run(kernels, "kpool_indexer_topk", *args)
        expected = TORCH_KERNELS.kpool_indexer_topk(*args)
        assert got.shape == expected.shape
        assert [set(row) for row in got.flatten(0, 1).tolist()] == [set(row) for row in expected.flatten(0, 1).tolist()]


@pytest.mark.parametrize("select_tail", [True, False])
def test_static_kpool_indexer_topk(kernels, select_tail):
    """The fixed-shape k-pool path of a compiled static-cache step (docs/graph-mode.md §3): pools written by
    `StaticKPoolLayer` (a fixed number of candidates per append) and scored over every slot under the mask, against the
    torch reference, which pools again from the token rows. Left padding gives each sequence another pool phase;
    appends of 97, 1 and 94 tokens complete pools within and across them, the last one up to the capacity (where a
    candidate past the context wraps around). fp32 (in bf16 near-equal scores of the reference, which pools at every
    call, may round apart): the same sets; extra slots -1."""
    generator = torch.Generator().manual_seed(9)
    kpool, index_topk, pads, capacity = 4, 32, (0, 5, 38), 192
    ape = torch.randn(kpool, INDEX_DIM, generator=generator)
    store = StaticKPoolLayer(capacity, kv_width=8, index_width=INDEX_DIM, kernel_backend=kernels.name, page_size=64,
                             index_kpool=kpool)  # fmt: skip
    rows = torch.randn(3, capacity, 2 * INDEX_DIM, generator=generator)
    if kernels.kpool_indexer_topk is None:  # a backend without the k-pool indexer: the read is refused by name
        mask = torch.ones(3, capacity, dtype=torch.bool)
        store.append(torch.zeros(3, 97, 8), rows[:, :97], mask, ape)
        q_index, weights = torch.zeros(3, 1, 8, INDEX_DIM), torch.zeros(3, 1, 8)
        with pytest.raises(ValueError, match="does not implement the kpool_indexer_topk kernel"):
            dsa.paged_kpool_indexer_topk(kernels, store, q_index, weights, 96, index_topk, mask, ape, select_tail)
        return
    q_index = torch.randn(3, 40, 8, INDEX_DIM, generator=generator)
    weights = torch.randn(3, 40, 8, generator=generator)
    for start, num_keys in ((0, 97), (97, 98), (98, capacity)):
        mask = torch.zeros(3, capacity, dtype=torch.bool)  # capacity-padded, as the model passes it
        for b, pad in enumerate(pads):
            mask[b, pad:num_keys] = True
        store.append(torch.zeros(3, num_keys - start, 8), rows[:, start:num_keys], mask, ape)
        for query_start, num_queries in ((num_keys - 40, 40), (30, 40), (num_keys - 1, 1)):
            queries = (q_index[:, :num_queries], weights[:, :num_queries])
            keys = PagedKeys(store.index_pages, store.block_table, num_keys, query_start, mask[:, :num_keys])
            keys = keys._replace(pool_pages=store.pool_pages)
            expected = TORCH_KERNELS.kpool_indexer_topk(*queries, keys, index_topk, ape, select_tail)
            static_keys = keys._replace(num_keys=torch.tensor(num_keys), query_start=torch.tensor(query_start))
            static_keys = static_keys._replace(key_padding_mask=mask)
            got = run(kernels, "static_kpool_indexer_topk", *queries, static_keys, index_topk, ape, select_tail)
            assert got.shape[-1] == index_topk + (kpool - 1 if select_tail else 0)
            as_sets = [{i for i in row if i >= 0} for row in got.flatten(0, 1).tolist()]
            assert as_sets == [{i for i in row if i >= 0} for row in expected.flatten(0, 1).tolist()]


def kda_case(seq_len: int, seed: int, with_state: bool = True):
    """bf16-representable KDA inputs (q, k, v, beta and the state rounded to bf16, v in bf16) with an fp32 log gate,
    so a backend whose op takes bf16 loses nothing on the way in."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, seq_len, 3, 32)

    def bf16(x):
        return x.to(torch.bfloat16).float()

    q = bf16(kda_ops.l2norm(torch.randn(shape, generator=generator)))
    k = bf16(kda_ops.l2norm(torch.randn(shape, generator=generator)))
    v = torch.randn(shape, generator=generator).to(torch.bfloat16)
    g = -torch.rand(shape, generator=generator) * torch.rand(shape[2:], generator=generator) * 2  # per-key decays
    beta = bf16(torch.rand(shape[:3], generator=generator))
    state = bf16(torch.randn(2, 3, 32, 32, generator=generator)) if with_state else None
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("name", "seq_len"), [("kda_chunk", 70), ("kda_recurrent", 1), ("kda_recurrent", 11)])
def test_kda_kernels(kernels, name, seq_len):
    """Prefill (a partial last chunk) and decode (one token; 11 tokens cross the npu op's 8-token limit), with and
    without an initial state, against kda_ops: output in v's dtype, the fp32 final state."""
    if kernels.name == "triton" and name == "kda_chunk" and TRITON_INTERPRETED:
        pytest.skip("fla's chunk_kda does not run under Triton's interpreter (docs/backends.md §4)")
    reference = {"kda_chunk": kda_ops.chunk_kda, "kda_recurrent": kda_ops.recurrent_kda}[name]
    for with_state, scale in ((True, None), (False, 0.3)):
        q, k, v, g, beta, state = kda_case(seq_len, seed=seq_len, with_state=with_state)
        got, got_state = run(kernels, name, q, k, v, g, beta, scale, state, True)
        expected, expected_state = reference(q, k, v, g, beta, scale, initial_state=state, output_final_state=True)
        assert got.dtype == v.dtype and got_state.dtype == torch.float32
        assert rel_fro(got, expected) < KDA_REL_FRO
        assert rel_fro(got_state, expected_state) < KDA_REL_FRO
        assert run(kernels, name, q, k, v, g, beta)[1] is None  # no final state unless asked


@torch.no_grad()
def test_kda_recurrent_stepwise(kernels):
    """Where a backend says its `kda_recurrent` steps a T-token call as T one-token calls (then a verification and a
    rollback's replay make one call), outputs and final state are those of the one-token calls bit for bit; the cpu
    kernel says so (where it builds), the torch reference does not."""
    q, k, v, g, beta, state = kda_case(5, seed=3)
    v = v.float()
    stepwise = kernels.require("kda_recurrent_stepwise")(q, v)
    if kernels.name in ("cpu", "torch"):
        assert stepwise == (kernels.name == "cpu" and CPU_KERNELS_BUILD)
    if not stepwise:
        pytest.skip(f"{kernels.name}'s kda_recurrent does not step a call token by token")
    recurrent = kernels.require("kda_recurrent")
    out, final = recurrent(q, k, v, g, beta, None, state, True)
    steps, step_state = [], state
    for t in range(q.shape[1]):
        token = slice(t, t + 1)
        step_out, step_state = recurrent(q[:, token], k[:, token], v[:, token], g[:, token], beta[:, token], None,
                                         step_state, True)  # fmt: skip
        steps.append(step_out)
    assert torch.equal(out, torch.cat(steps, dim=1)) and torch.equal(final, step_state)


def test_static_kernels(kernels):
    """The fixed-shape kernels a compiled static-cache step runs (docs/graph-mode.md §3) score / attend over every slot
    of the block table under a mask (0-d tensor lengths, a mask as wide as the capacity); they select what the paged
    reference selects (extra slots -1) and attend to the same keys. fp32, so the selections are equal as lists."""
    generator = torch.Generator().manual_seed(3)
    batch, page_size, pages_per_row, num_keys, topk = 2, 4, 5, 13, 6
    pool = batch * pages_per_row
    table = torch.randperm(pool, generator=generator).view(batch, pages_per_row)  # any mapping, not just arange
    index_pages = torch.randn(pool, page_size, 16, generator=generator)
    kv_pages = torch.randn(pool, page_size, 24, generator=generator)
    padding = torch.ones(batch, pages_per_row * page_size, dtype=torch.bool)
    padding[0, :3] = False
    for num_queries in (1, 3):
        query_start = num_keys - num_queries
        lengths = (torch.tensor(num_keys), torch.tensor(query_start))
        q_index = torch.randn(batch, num_queries, 2, 16, generator=generator)
        weights = torch.randn(batch, num_queries, 2, generator=generator)
        keys = PagedKeys(index_pages, table, num_keys, query_start, padding[:, :num_keys])
        expected = TORCH_KERNELS.indexer_topk(q_index, weights, keys, topk)
        static_keys = PagedKeys(index_pages, table, *lengths, padding)
        got = run(kernels, "static_indexer_topk", q_index, weights, static_keys, topk)
        assert got.shape[-1] == topk
        assert torch.equal(got[..., : expected.shape[-1]], expected)
        assert bool((got[..., expected.shape[-1] :] == -1).all())

        q_latent = torch.randn(batch, num_queries, 3, 16, generator=generator)
        q_pe = torch.randn(batch, num_queries, 3, 8, generator=generator)
        got = run(kernels, "static_sparse_mla", q_latent, q_pe, PagedKeys(kv_pages, table), expected, 0.3)
        torch.testing.assert_close(
            got, TORCH_KERNELS.sparse_mla(q_latent, q_pe, PagedKeys(kv_pages, table), expected, 0.3)
        )

        reference = TORCH_KERNELS.dense_mla(q_latent, q_pe, keys._replace(pages=kv_pages), 0.3)
        got = run(kernels, "static_dense_mla", q_latent, q_pe, static_keys._replace(pages=kv_pages), 0.3)
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=1e-5)


def test_static_indexer_topk_bf16(kernels):
    """bf16 takes the fixed-shape kernel's own all-heads product (`keys @ qᵀ`, docs/graph-mode.md §9): ternary
    values keep every product exact, so it selects what the paged reference selects, up to the order of equal
    scores."""
    generator = torch.Generator().manual_seed(4)
    batch, page_size, pages_per_row, num_keys, topk = 2, 4, 6, 21, 8
    pool = batch * pages_per_row
    table = torch.randperm(pool, generator=generator).view(batch, pages_per_row)
    k_index = ternary((batch, pages_per_row * page_size, INDEX_DIM), generator)
    index_pages = torch.empty(pool, page_size, INDEX_DIM, dtype=torch.bfloat16)
    index_pages[table.reshape(-1)] = k_index.view(pool, page_size, INDEX_DIM)  # page table[b, p] holds block p of b
    padding = torch.ones(batch, pages_per_row * page_size, dtype=torch.bool)
    padding[1, :2] = False
    for num_queries in (1, 3):
        query_start = num_keys - num_queries
        q_index = ternary((batch, num_queries, 4, INDEX_DIM), generator)
        weights = torch.randn(batch, num_queries, 4, generator=generator)
        visible = dsa_ops.visible_keys_mask(query_start, num_queries, num_keys, padding[:, :num_keys], q_index.device)
        scores = dsa_ops.indexer_scores(q_index, weights, k_index[:, :num_keys], visible)
        expected = TORCH_KERNELS.indexer_topk(
            q_index, weights, PagedKeys(index_pages, table, num_keys, query_start, padding[:, :num_keys]), topk
        )
        static_keys = PagedKeys(index_pages, table, torch.tensor(num_keys), torch.tensor(query_start), padding)
        got = run(kernels, "static_indexer_topk", q_index, weights, static_keys, topk)
        same_selection(got[..., : expected.shape[-1]], expected, scores)
        assert bool((got[..., expected.shape[-1] :] == -1).all())


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_kv_store(kernels, kv_cache):
    """The layout a backend's store keeps kv rows in reads back as the rows the reference stores (bf16: the rows
    themselves; fp8: the same tile-quantized values)."""
    rows = torch.randn(2, PAGE, LATENT + ROPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    formats = CacheFormats(kv_cache=kv_cache)
    stored = run(kernels, "kv_store", formats, rows, LATENT)
    expected = TORCH_KERNELS.kv_store(formats, rows, LATENT)
    as_rows = read_pages(stored, torch.arange(2), torch.float32)
    assert torch.equal(as_rows, read_pages(expected, torch.arange(2), torch.float32))


@torch.no_grad()
def test_dsa_decode_prolog(kernels):
    """A DSA decode step's projections (on the npu backend on three streams, under the fake's stream checks): the
    values of the in-order projections."""
    model = tiny_model(
        seed=5, kernel_backend=kernels.name, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
        attn_res_block_size=0, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, index_head_dim=INDEX_DIM, index_n_heads=16,
    ).to(torch.bfloat16)  # fmt: skip
    layer = model.model.layers[1].self_attn
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    position_embeddings = model.model.rotary_emb(hidden, torch.tensor([[70], [70]]))
    expected = TORCH_KERNELS.dsa_decode_prolog(layer, hidden, position_embeddings)
    with fake_torch_npu.check_streams() if kernels.name == "npu" else contextlib.nullcontext():
        got = run(kernels, "dsa_decode_prolog", layer, hidden, position_embeddings)
        for got_tensor, expected_tensor in zip([*got[:4], *got[4]], [*expected[:4], *expected[4]], strict=True):
            assert torch.equal(got_tensor, expected_tensor)


# ---------------------------------------------------------------------------------------------------------------
# The layers' products (references in linear_ops; the C++ kernels of the cpu backend where they apply)

# The `kdsa::` op each product runs on the cpu backend where its kernel applies.
PRODUCT_OPS = {
    "row_linear": "kdsa::row_linear",
    "head_matmul": "kdsa::head_matmul",
    "head_linear": "kdsa::head_linear",
    "expert_linear": "kdsa::expert_linear",
    "fp8_dequantize": "kdsa::dequantize_fp8_tiles",
    "fp8_row_linear": "kdsa::fp8_row_linear",
}


def kdsa_ops_run(function):
    """`function()` and the names of the `kdsa::` ops it ran (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = function()
    return out, {event.name for event in profile.events() if event.name.startswith("kdsa::")}


def fp8_weight(rows: int, cols: int, block: int, generator):
    """E4M3 ternary values and power-of-two fp32 scales: every dequantized element and product is exact."""
    values = ternary((rows, cols), generator).to(torch.float8_e4m3fn)
    grid = (-(-rows // block), -(-cols // block))
    scale_inv = 2.0 ** torch.randint(-3, 4, grid, generator=generator).float()
    return values, scale_inv


def product_args(name: str, rows: int, dtype: torch.dtype, generator) -> tuple:
    """Arguments of product `name` for `rows` rows in `dtype`, ternary values: products and fp32 sums are exact, so
    every backend must give the reference's bits. The head weights are strided slices, as `kv_b_proj`'s W_UK / W_UV."""

    def values(*shape):
        return ternary(shape, generator).to(dtype)

    if name == "row_linear":
        return values(rows, 96), values(80, 96), values(80)
    if name == "head_matmul":
        return values(1, rows, 4, 32), values(4, 48, 64)[:, :32]
    if name == "head_linear":
        return values(1, rows, 4, 64), values(4, 48, 64)[:, 32:]
    if name == "expert_linear":
        return values(rows, 64), values(5, 48, 64), torch.randint(0, 5, (rows,), generator=generator)
    if name == "fp8_dequantize":
        return (*fp8_weight(70, 96, 32, generator), (32, 32), dtype)
    return (values(rows, 96), *fp8_weight(80, 96, 32, generator), (32, 32), values(80))  # fp8_row_linear


@pytest.mark.parametrize(
    ("rows", "dtype"),
    [(1, torch.bfloat16), (3, torch.bfloat16), (16, torch.bfloat16), (20, torch.bfloat16), (3, torch.float32)],
)
@pytest.mark.parametrize("name", list(PRODUCT_OPS))
@torch.no_grad()
def test_products(kernels, name, rows, dtype):
    """Each product of each backend equals the torch entry bit for bit (exact inputs), and runs its C++ kernel exactly
    where the cpu backend's applies: bf16, 1 to 16 rows (the expert kernel: any number of rows; dequantization: any
    E4M3 weight); elsewhere, and on every other backend, no `kdsa::` op at all."""
    args = product_args(name, rows, dtype, torch.Generator().manual_seed(rows))
    expected = getattr(TORCH_KERNELS, name)(*args)
    got, ops = kdsa_ops_run(lambda: run(kernels, name, *args))
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    applies = name == "fp8_dequantize" or (dtype == torch.bfloat16 and (rows <= 16 or name == "expert_linear"))
    cpu_products = kernels.row_linear is CPU_KERNELS.row_linear
    if not (cpu_products and CPU_KERNELS_BUILD):
        assert ops == set()
    elif applies:
        assert ops == {PRODUCT_OPS[name]}
    else:  # the FP8 weight dequantized by its kernel, then the reference product
        assert ops == ({"kdsa::dequantize_fp8_tiles"} if name == "fp8_row_linear" else set())
    if name == "expert_linear":
        # The MoE layer takes its gathered path where `experts_in_place` says the kernel reads the stacked weights.
        assert kernels.require("experts_in_place")(args[0], args[1]) == bool(ops)
        assert torch.equal(run(kernels, name, args[0], args[1][args[2]], None), expected)  # pre-gathered (MXFP4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@torch.no_grad()
def test_fp8_held_layer_follows_its_backend(backend):
    """A `KDSAFP8Linear` (and `like`, which the model's FP8 loading uses) runs its backend's FP8 products."""
    generator = torch.Generator().manual_seed(0)
    values, scale_inv = fp8_weight(80, 96, 32, generator)
    layer = KDSAFP8Linear(values, scale_inv, (32, 32), kernel_backend=backend)
    assert (
        KDSAFP8Linear.like(KDSALinear(96, 80, bias=False, kernel_backend=backend), (32, 32)).kernel_backend == backend
    )
    x = ternary((2, 96), generator).bfloat16()
    got, ops = kdsa_ops_run(lambda: (layer(x), layer.dequantized_weight(torch.bfloat16)))
    assert torch.equal(got[0], TORCH_KERNELS.fp8_row_linear(x, values, scale_inv, (32, 32)))
    assert torch.equal(got[1], TORCH_KERNELS.fp8_dequantize(values, scale_inv, (32, 32), torch.bfloat16))
    cpu_ops = {"kdsa::fp8_row_linear", "kdsa::dequantize_fp8_tiles"} if CPU_KERNELS_BUILD else set()
    assert ops == (cpu_ops if backend == "cpu" else set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_torch_backend_runs_no_cpu_kernel(dtype):
    """kernel_backend='torch' is the pure torch reference: a forward and a generate (prefill, decode steps, a
    left-padded batch, and MTP drafting with the model's MTP layer) run no `kdsa::` op; the same on `cpu` runs the C++
    kernels (where they build), so the check sees them."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ops, logits = {}, {}
    for backend in ("torch", "cpu"):
        model = tiny_model(kernel_backend=backend, num_mtp_layers=1).to(dtype)

        def forward_and_generate(model=model):
            out = model(input_ids=ids, attention_mask=mask).logits
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_mtp=True,
                           draft_schedule="always")  # fmt: skip
            return out

        logits[backend], ops[backend] = kdsa_ops_run(forward_and_generate)
    assert ops["torch"] == set()
    if dtype == torch.float32:  # the same model up to the order of sums (bf16: tests/test_bf16_model.py's bounds)
        assert rel_fro(logits["cpu"], logits["torch"]) < 1e-6
    if not CPU_KERNELS_BUILD:
        pytest.skip("no C++ kernel builds on this machine: nothing to see on the cpu backend")
    bf16_products = {"kdsa::row_linear", "kdsa::head_matmul", "kdsa::head_linear", "kdsa::expert_linear"}
    assert {"kdsa::kda_recurrent"} | (bf16_products if dtype == torch.bfloat16 else set()) <= ops["cpu"]


@pytest.mark.parametrize("missing", ["sparse_mla", "indexer_topk", "dense_mla"])
def test_a_backend_without_a_read_kernel_is_refused_before_the_store_is_written(monkeypatch, missing):
    """The attention layers pick their paged kernels from the registry; one the backend lacks is refused by name
    before the layer appends its rows, so its paged store keeps what it had."""
    layer_types = ["full_attention"] * 2 if missing == "dense_mla" else None
    model = tiny_model(**({"layer_types": layer_types, "num_hidden_layers": 2} if layer_types else {}))
    ids = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = KDSACache(model.config)
    model(input_ids=ids, cache=cache)
    stores = [layer for layer in cache.layers if isinstance(layer, (KDSAPagedLayer, KDSAPagedMLALayer))]
    lacking = dataclasses.replace(kernel_set("torch"), **{missing: None})
    monkeypatch.setattr(dsa, "kernel_set", lambda *args, **kwargs: lacking)
    with pytest.raises(ValueError, match=f"does not implement the {missing} kernel"):
        model(input_ids=ids[:, :1], cache=cache)
    assert stores and all(int(store.num_tokens) == ids.shape[1] for store in stores)
