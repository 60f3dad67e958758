"""kernel_backend="npu" (modeling_kdsa/npu_kernels.py) over a fake torch_npu written from the op docs
(tests/fake_torch_npu.py): the backend feeds the fused ops the documented layouts, and their documented results equal
our `cpu` backend. No Ascend hardware runs here (docs/backends.md §2, §3)."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_torch_npu
import pytest
import torch
from conftest import store_kernels, tiny_config, tiny_model
from modeling_kdsa.parallel import context_parallel_prefill, single_process_mesh
from test_dsa_paged_ops import left_padding, paged

from modeling_kdsa import dsa_ops, kda_device_ops, kda_ops, kernels, npu_kernels, triton_kernels
from modeling_kdsa.cache import KDSACache, KDSAPagedLayer
from modeling_kdsa.dsa import paged_dense_attention, paged_indexer_topk, paged_sparse_attention
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_fused import paged_indexer_topk_fused
from modeling_kdsa.dsa_paged_reference import gather_pages
from modeling_kdsa.kernels import kernel_set
from modeling_kdsa.npu_kernels import (
    paged_dense_mla_npu,
    paged_indexer_topk_npu,
    paged_kpool_indexer_topk_npu,
    paged_sparse_mla_npu,
)
from modeling_kdsa.numeric_formats import CacheFormats, PackedKVRows, SplitRows

REPO = Path(__file__).resolve().parents[1]
# Dims the fused ops accept (npu_kernels constants) and a page size they accept (a multiple of 16).
INDEX_DIM, LATENT, ROPE, PAGE = 128, 512, 64, 16
# bf16 attention, fp32-exact fake vs the cpu kernel's bf16 GEMMs (tests/test_dsa_paged_ops.py's bounds).
BF16_ATOL = 3e-2


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.setattr(npu_kernels, "_PROLOG_STREAMS", {})  # side streams of this test's fake, made on first use
    return fake_torch_npu.install(monkeypatch, available=True)


@pytest.fixture
def npu_dsa_ops(npu, monkeypatch):
    """The npu backend with KDA decode on the torch kernel, for exact token comparisons of the DSA ops: the npu KDA op
    keeps its state in bf16 (docs/backends.md §2), and a random tiny model's greedy tokens can flip on that rounding
    (test_npu_kda_decode_follows_the_cpu_backend checks it with a bound)."""
    npu_kernels = kernels._npu_kernels()
    dsa_only = dataclasses.replace(npu_kernels, kda_recurrent=kernels.TORCH_KERNELS.kda_recurrent)
    monkeypatch.setitem(kernels._BACKENDS, "npu", lambda: dsa_only)
    return npu


def ternary(shape, generator) -> torch.Tensor:
    """Values in {-1, 0, 1} as bf16: every q·k over 128 channels is an integer <= 128, exact in bf16, so the cpu
    kernel's bf16 GEMM and the fake's fp32 math give the same products."""
    return torch.randint(-1, 2, shape, generator=generator).to(torch.bfloat16)


def indexer_case(num_keys, num_queries, seed, heads=4):
    generator = torch.Generator().manual_seed(seed)
    q_index = ternary((2, num_queries, heads, INDEX_DIM), generator)
    weights = torch.randn(2, num_queries, heads, generator=generator)
    k_index = ternary((2, num_keys, INDEX_DIM), generator)
    index_pages, block_table = paged(k_index, PAGE, generator)  # shuffled pages, NaN where no sequence owns
    return q_index, weights, k_index, index_pages, block_table


def assert_same_selection(got, expected, scores):
    """Same top-k up to the order of equal scores: as many keys per row, and the same multiset of scores (a key
    that is not visible, a duplicate or a lower-ranked key changes it)."""
    assert got.shape == expected.shape and got.dtype == torch.int64
    assert torch.equal((got >= 0).sum(-1), (expected >= 0).sum(-1))
    assert torch.equal(got >= 0, expected >= 0)  # valid entries first, -1 after
    for indices in (got, expected):
        for row in indices.flatten(0, 1).tolist():
            valid = [i for i in row if i >= 0]
            assert len(set(valid)) == len(valid)

    def selected_scores(indices):
        picked = scores.gather(-1, indices.clamp(min=0)).masked_fill(indices < 0, 0.0)
        return picked.sort(dim=-1).values

    torch.testing.assert_close(selected_scores(got), selected_scores(expected), rtol=1e-5, atol=1e-5)


def test_npu_indexer_drops_padded_keys_even_when_they_score_highest(npu):
    """Left padding: the op has no padding mask, so the padded keys it ranks first must be removed and the next real
    keys take their place (here the pads carry the highest scores)."""
    num_keys, index_topk = 48, 8
    q_index, weights, k_index, index_pages, block_table = indexer_case(num_keys, 1, seed=3)
    weights = weights.abs()
    q_index[:] = 1
    padding = left_padding(2, num_keys, pad=20)
    strong = torch.ones(INDEX_DIM, dtype=torch.bfloat16)
    for position in range(20):  # the padded keys of sequence 1 match the query perfectly
        page = block_table[1, position // PAGE]
        index_pages[page, position % PAGE] = strong
        k_index[1, position] = strong
    args = (q_index, weights, PagedKeys(index_pages, block_table, num_keys, num_keys - 1, padding), index_topk)
    got = paged_indexer_topk_npu(*args)
    assert (got[1] >= 20).all()
    visible = dsa_ops.visible_keys_mask(num_keys - 1, 1, num_keys, padding, q_index.device)
    scores = dsa_ops.indexer_scores(q_index, weights, k_index, visible)
    assert_same_selection(got, paged_indexer_topk_fused(*args), scores)


def sparse_case(num_keys, num_queries, seed, heads=2, num_selected=8):
    generator = torch.Generator().manual_seed(seed)
    q_latent = (torch.randn(2, num_queries, heads, LATENT, generator=generator) / 8).to(torch.bfloat16)
    q_pe = (torch.randn(2, num_queries, heads, ROPE, generator=generator) / 8).to(torch.bfloat16)
    rows = torch.randn(2, num_keys, LATENT + ROPE, generator=generator).to(torch.bfloat16)
    kv_pages, block_table = paged(rows, PAGE, generator)
    indices = torch.stack(
        [torch.randperm(num_keys, generator=generator)[:num_selected] for _ in range(2 * num_queries)]
    ).view(2, num_queries, num_selected)
    indices[0, 0, 3:] = -1  # a row with few keys
    indices[1, -1] = -1  # a row with none: zero output
    indices[0, -1, 2] = -1  # a hole before valid entries (the op stops at the first -1: the backend compacts)
    return q_latent, q_pe, kv_pages, block_table, indices


# ---------------------------------------------------------------------------------------------------------------
# The fake follows the docs (independent of our kernels)


def test_fake_indexer_right_down_causal_and_minus_one_padding(npu):
    """sparse_mode=3: query i of a batch sees keys j <= Lk - Lq + i; slots after the visible keys are -1."""
    key = torch.zeros(1, 16, 1, INDEX_DIM, dtype=torch.bfloat16)
    key[0, :5, 0, 0] = torch.arange(1, 6, dtype=torch.bfloat16)  # key j scores j + 1: later keys score higher
    query = torch.ones(1, 2, 1, INDEX_DIM, dtype=torch.bfloat16)
    indices, _ = npu.npu_lightning_indexer(
        query,
        key,
        torch.ones(1, 2, 1),
        actual_seq_lengths_query=torch.tensor([2], dtype=torch.int32),
        actual_seq_lengths_key=torch.tensor([5], dtype=torch.int32),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        layout_key="PA_BSND",
        sparse_count=6,
    )
    assert indices.dtype == torch.int32 and indices.shape == (1, 2, 1, 6)
    assert indices[0, 0, 0].tolist() == [3, 2, 1, 0, -1, -1]
    assert indices[0, 1, 0].tolist() == [4, 3, 2, 1, 0, -1]


def test_fake_sparse_attention_stops_at_the_first_minus_one(npu):
    key = torch.randn(1, 16, 1, LATENT).to(torch.bfloat16)
    key_rope = torch.randn(1, 16, 1, ROPE).to(torch.bfloat16)
    query = torch.randn(1, 1, 1, LATENT).to(torch.bfloat16)
    query_rope = torch.randn(1, 1, 1, ROPE).to(torch.bfloat16)

    def attend(selection):
        out, _, _ = npu.npu_sparse_flash_attention(
            query,
            key,
            key,
            torch.tensor(selection, dtype=torch.int32).view(1, 1, 1, -1),
            0.1,
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            actual_seq_lengths_kv=torch.tensor([16], dtype=torch.int32),
            query_rope=query_rope,
            key_rope=key_rope,
            layout_kv="PA_BSND",
            sparse_mode=0,
            attention_mode=2,
        )
        return out

    assert torch.equal(attend([2, -1, 5]), attend([2, -1, -1]))
    assert not torch.equal(attend([2, 5, -1]), attend([2, -1, -1]))
    assert (attend([-1, 3]) == 0).all()


def _indexer_call_args():
    q_index, weights, _, index_pages, block_table = indexer_case(40, 1, seed=0)
    return (q_index, index_pages.unsqueeze(2), weights), dict(
        actual_seq_lengths_query=torch.ones(2, dtype=torch.int32),
        actual_seq_lengths_key=torch.full((2,), 40, dtype=torch.int32),
        block_table=block_table.to(torch.int32),
        layout_key="PA_BSND",
        sparse_count=8,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a, k: k.update(block_table=k["block_table"].long()), "block_table must be int32"),
        (lambda a, k: k.update(actual_seq_lengths_key=k["actual_seq_lengths_key"].long()), "must be int32"),
        (lambda a, k: k.update(actual_seq_lengths_key=None), "required"),
        (lambda a, k: a.__setitem__(1, a[1].squeeze(2)), r"\[block_count, block_size, 1, D\]"),
        (lambda a, k: a.__setitem__(1, a[1].transpose(0, 1)), "block_size"),
        (lambda a, k: a.__setitem__(0, a[0].float()), "bfloat16 or float16"),
        (lambda a, k: a.__setitem__(0, torch.cat([a[0], a[0]], dim=-1)[..., ::2]), "contiguous"),
        (lambda a, k: k.update(sparse_count=2049), "sparse_count"),
    ],
)
def test_fake_indexer_rejects_what_the_docs_forbid(npu, change, message):
    args, kwargs = _indexer_call_args()
    args = list(args)
    change(args, kwargs)
    with pytest.raises(RuntimeError, match=message):
        npu.npu_lightning_indexer(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Backend selection and refusals


def test_auto_picks_npu_for_npu_tensors():
    """`auto` resolves to `npu` for tensors on an NPU (device type "npu", which torch_npu registers; simulated in a
    fresh process so the rename does not leak into other tests) and binds the torch_npu kernels."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        import pytest, torch, fake_torch_npu
        from modeling_kdsa.kernels import kernel_set, resolve_kernel_backend
        from modeling_kdsa.npu_kernels import paged_indexer_topk_npu, paged_sparse_mla_npu
        torch.utils.rename_privateuse1_backend("npu")
        with pytest.MonkeyPatch.context() as patch:
            fake_torch_npu.install(patch, available=True)
            backend = resolve_kernel_backend("auto", torch.device("npu"))
            assert backend == "npu", backend
            kernels = kernel_set("auto", torch.device("npu"))
            assert (kernels.indexer_topk, kernels.sparse_mla) == (paged_indexer_topk_npu, paged_sparse_mla_npu)
            assert resolve_kernel_backend("auto", torch.device("cpu")) == "cpu"
            fake_torch_npu.install(patch, available=False)
            try:
                kernel_set(backend)
            except ValueError as error:
                assert "is_available" in str(error)
            else:
                raise AssertionError("no error without an available NPU")
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_npu_backend_needs_torch_npu_and_an_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(ValueError, match="needs torch_npu"):
        kernel_set("npu")
    fake_torch_npu.install(monkeypatch, available=False)
    with pytest.raises(ValueError, match="is_available"):
        kernel_set("npu")


def test_a_model_on_a_missing_backend_fails_on_its_first_forward(monkeypatch):
    fake_torch_npu.install(monkeypatch, available=False)
    model = npu_shaped_model("npu")
    with pytest.raises(ValueError, match="is_available"):
        model(torch.randint(3, 128, (1, 5)), cache=KDSACache(model.config))
    monkeypatch.setattr(triton_kernels, "triton", None)
    with pytest.raises(ValueError, match="needs the triton package"):
        kernel_set("triton")


def test_triton_backend_refuses_the_kpool_indexer(monkeypatch):
    """The Triton indexer scores one key per token: the k-pool indexer (docs/dsa.md §9) is refused by name, at config
    time and by the kernel registry (its triton / fla requirements stubbed: neither imports here)."""
    with pytest.raises(ValueError, match=r"k-pool indexer \(index_kpool=2\)"):
        tiny_config(kernel_backend="triton", index_kpool=2, qk_rope_head_dim=0, index_topk=8)
    monkeypatch.setattr(triton_kernels, "triton", object())
    monkeypatch.setattr(kda_device_ops, "require_fla", lambda: None)
    with pytest.raises(ValueError, match="'triton' does not implement the kpool_indexer_topk kernel"):
        kernel_set("triton").require("kpool_indexer_topk")


def test_npu_backend_refuses_shapes_the_ops_do_not_take(npu):
    q_index, weights, _, index_pages, block_table = indexer_case(40, 1, seed=0)
    keys = PagedKeys(index_pages, block_table, 40, 39)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        paged_indexer_topk_npu(q_index.float(), weights, keys._replace(pages=index_pages.float()), 8)
    small_pages = index_pages[..., :64].contiguous()
    with pytest.raises(ValueError, match="index_head_dim must be 128"):
        paged_indexer_topk_npu(q_index[..., :64].contiguous(), weights, keys._replace(pages=small_pages), 8)
    q_latent, q_pe, kv_pages, block_table, indices = sparse_case(40, 2, seed=0)
    with pytest.raises(ValueError, match="must be SplitRows"):
        paged_sparse_mla_npu(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.1)  # one [N, P, C + R] tensor
    with pytest.raises(ValueError, match="kv_lora_rank must be 512"):
        small = SplitRows.split(kv_pages[..., 256:], 256)
        paged_sparse_mla_npu(q_latent[..., :256], q_pe, PagedKeys(small, block_table), indices, 0.1)
    three_heads = q_latent[:, :, :1].expand(-1, -1, 3, -1)
    with pytest.raises(ValueError, match="num_attention_heads"):
        split = SplitRows.split(kv_pages, LATENT)
        paged_sparse_mla_npu(
            three_heads, q_pe[:, :, :1].expand(-1, -1, 3, -1), PagedKeys(split, block_table), indices, 0.1
        )
    assert fake_torch_npu.calls == []


def test_npu_backend_refuses_mxfp8_indexer_keys(npu):
    """npu_quant_lightning_indexer takes one scale per key row (per-token-head), not MXFP8's E8M0 per 32 values."""
    store = KDSAPagedLayer(
        LATENT + ROPE, INDEX_DIM, "npu", page_size=PAGE, formats=CacheFormats(indexer="mxfp8"), latent_width=LATENT
    )
    store.append(torch.randn(2, 20, LATENT + ROPE).to(torch.bfloat16), torch.randn(2, 20, INDEX_DIM).bfloat16())
    q_index, weights = torch.randn(2, 1, 4, INDEX_DIM).bfloat16(), torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="MXFP8 indexer keys.*per-token-head"):
        paged_indexer_topk(store_kernels(store), store, q_index, weights, 19, 8)
    assert fake_torch_npu.calls == []


def fp8_stores(rope: int, generator):
    """The same rows in an fp8 store on the npu backend (packed rows) and on the cpu backend (three planes)."""
    rows = torch.randn(2, 40, LATENT + rope, generator=generator).to(torch.bfloat16)
    keys = torch.randn(2, 40, INDEX_DIM, generator=generator).to(torch.bfloat16)
    stores = {}
    for backend in ("npu", "cpu"):
        formats = CacheFormats(kv_cache="fp8")
        store = KDSAPagedLayer(LATENT + rope, INDEX_DIM, backend, page_size=PAGE, formats=formats, latent_width=LATENT)
        store.append(rows[:, :39], keys[:, :39])
        store.append(rows[:, 39:], keys[:, 39:])
        stores[backend] = store
    return stores


def test_npu_fp8_cache_through_the_kv_quant_attention_op(npu):
    """kv_cache="fp8" on the npu backend: the store packs each row as the KV-quant op's 656 bytes (E4M3 latent,
    bf16 RoPE part, fp32 tile scales), holding exactly the cpu store's values; sparse and dense attention run
    npu_kv_quant_sparse_flash_attention over the pool in place and equal the cpu backend's fp8 attention."""
    generator = torch.Generator().manual_seed(6)
    stores = fp8_stores(ROPE, generator)
    packed = stores["npu"].kv_pages
    assert isinstance(packed, PackedKVRows) and packed.buffer.dtype == torch.uint8 and packed.buffer.shape[-1] == 656
    assert stores["npu"].bytes_per_token() == stores["cpu"].bytes_per_token()  # the same bytes, packed
    for part, reference in zip(packed.rows(), stores["cpu"].kv_pages, strict=True):
        got = gather_pages(part, stores["npu"].block_table, 40).view(torch.uint8)
        assert torch.equal(got, gather_pages(reference, stores["cpu"].block_table, 40).view(torch.uint8))
    q_latent = (torch.randn(2, 1, 2, LATENT, generator=generator) / 8).to(torch.bfloat16)
    q_pe = (torch.randn(2, 1, 2, ROPE, generator=generator) / 8).to(torch.bfloat16)
    indices = torch.randint(0, 40, (2, 1, 8), generator=generator)
    for read in ("sparse", "dense"):
        fake_torch_npu.calls.clear()
        outputs = {}
        for backend, store in stores.items():
            if read == "sparse":
                outputs[backend] = paged_sparse_attention(store_kernels(store), store, q_latent, q_pe, indices, 0.1)
            else:
                outputs[backend] = paged_dense_attention(store_kernels(store), store, q_latent, q_pe, 39, 0.1)
        assert fake_torch_npu.calls == ["npu_kv_quant_sparse_flash_attention"]
        seen = fake_torch_npu.inputs["npu_kv_quant_sparse_flash_attention"]
        assert _same_storage(seen["key"], packed.buffer) and seen["key"].dtype == torch.float8_e4m3fn
        assert outputs["npu"].shape == outputs["cpu"].shape == q_latent.shape
        torch.testing.assert_close(outputs["npu"].float(), outputs["cpu"].float(), atol=BF16_ATOL, rtol=0)


def test_npu_fp8_cache_refuses_nope(npu):
    stores = fp8_stores(0, torch.Generator().manual_seed(7))
    q_latent, q_pe = torch.randn(2, 1, 2, LATENT).bfloat16(), torch.randn(2, 1, 2, 0).bfloat16()
    with pytest.raises(ValueError, match="kv_cache='fp8' needs qk_rope_head_dim=64"):
        paged_sparse_attention(
            store_kernels(stores["npu"]), stores["npu"], q_latent, q_pe, torch.zeros(2, 1, 4, dtype=torch.long), 0.1
        )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("rope", [ROPE, 0], ids=["rope", "nope"])
def test_npu_attention_reads_the_store_pages_in_place(npu, rope):
    """The npu store keeps the latent and RoPE parts as two planes (SplitRows) and every attention call hands the op
    views of those planes: no per-call copy of the pool (O(context) bytes per decode step). Other backends keep one
    `[N, P, C + R]` plane."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 40, LATENT + rope, generator=generator).to(torch.bfloat16)
    keys = torch.randn(2, 40, INDEX_DIM, generator=generator).to(torch.bfloat16)
    stores = {}
    for backend in ("npu", "cpu"):
        store = KDSAPagedLayer(LATENT + rope, INDEX_DIM, backend, page_size=PAGE, latent_width=LATENT)
        store.append(rows[:, :39], keys[:, :39])  # prefill, then one decode step's row
        store.append(rows[:, 39:], keys[:, 39:])
        assert torch.equal(gather_pages(store.kv_pages, store.block_table, 40), rows)
        stores[backend] = store
    assert isinstance(stores["npu"].kv_pages, SplitRows) and isinstance(stores["cpu"].kv_pages, torch.Tensor)
    planes = stores["npu"].kv_pages
    q_latent = (torch.randn(2, 1, 2, LATENT, generator=generator) / 8).to(torch.bfloat16)
    q_pe = (torch.randn(2, 1, 2, rope, generator=generator) / 8).to(torch.bfloat16)
    indices = torch.randint(0, 40, (2, 1, 8), generator=generator)
    zero_rope = None
    for read in ("sparse", "dense"):
        outputs = {}
        for backend, store in stores.items():
            if read == "sparse":
                outputs[backend] = paged_sparse_attention(store_kernels(store), store, q_latent, q_pe, indices, 0.1)
            else:
                outputs[backend] = paged_dense_attention(store_kernels(store), store, q_latent, q_pe, 39, 0.1)
        seen = fake_torch_npu.inputs["npu_sparse_flash_attention"]
        assert _same_storage(seen["key"], planes.latent) and _same_storage(seen["value"], planes.latent)
        if rope:
            assert _same_storage(seen["key_rope"], planes.rope)
        else:  # NoPE: one zero RoPE pool per pool size, not one per call
            assert zero_rope is None or seen["key_rope"] is zero_rope
            zero_rope = seen["key_rope"]
        torch.testing.assert_close(outputs["npu"].float(), outputs["cpu"].float(), atol=BF16_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Three-stream prolog (npu_kernels.three_stream_prolog) under the fake's stream checks


def decode_step_inputs(model, seed: int):
    """The DSA layer of `npu_shaped_model` and a decode step's inputs: hidden states `[2, 1, D]`, (cos, sin)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=generator).to(torch.bfloat16)
    position_embeddings = model.model.rotary_emb(hidden, torch.tensor([[70], [70]]))
    return model.model.layers[1].self_attn, hidden, position_embeddings


def sequential_projections(layer, hidden, position_embeddings):
    q_nope, q_pe, query_input = layer.project_queries(hidden, position_embeddings)
    latent, k_pe = layer.project_latent(hidden, position_embeddings)
    return q_nope, q_pe, latent, k_pe, layer.indexer(hidden, query_input, position_embeddings)


def test_three_stream_prolog_equals_the_single_stream_path(npu):
    """Same tensors as the sequential projections; the side streams ran the indexer query and weights, are made
    once per device, and every cross-stream read waited and was recorded (else the fake raises)."""
    model = npu_shaped_model("npu")
    layer, hidden, position_embeddings = decode_step_inputs(model, seed=0)
    with torch.no_grad():
        expected = sequential_projections(layer, hidden, position_embeddings)
        for _ in range(2):
            with fake_torch_npu.check_streams():  # the comparison reads the outputs on the main stream
                got = npu_kernels.three_stream_prolog(layer, hidden, position_embeddings)
                for got_tensor, expected_tensor in zip([*got[:4], *got[4]], [*expected[:4], *expected[4]], strict=True):
                    assert torch.equal(got_tensor, expected_tensor)
    query_stream, weights_stream = npu_kernels._prolog_streams(hidden.device)
    assert query_stream.clock[query_stream] > 0 and weights_stream.clock[weights_stream] > 0
    assert fake_torch_npu._streams.created == 2  # two side streams, once for both calls


def test_the_fake_catches_a_missing_wait_or_record_stream(npu):
    x = torch.ones(4)
    side = torch.npu.Stream()
    with fake_torch_npu.check_streams():
        with torch.npu.stream(side):
            with pytest.raises(RuntimeError, match="record_stream"):
                x * 2  # x belongs to the main stream's allocator
            x.record_stream(side)
            y = x * 2
            done = torch.npu.Event()
            done.record(side)
        with pytest.raises(RuntimeError, match="wait_event missing"):
            y + 1
        torch.npu.current_stream().wait_event(done)
        with pytest.raises(RuntimeError, match="record_stream"):
            y + 1
        y.record_stream(torch.npu.current_stream())
        assert torch.equal(y + 1, torch.full((4,), 3.0))


@pytest.mark.parametrize("dropped", ["wait_event", "record_stream"])
def test_a_prolog_that_drops_a_wait_or_a_record_fails(npu, monkeypatch, dropped):
    model = npu_shaped_model("npu")
    layer, hidden, position_embeddings = decode_step_inputs(model, seed=1)
    if dropped == "wait_event":
        monkeypatch.setattr(fake_torch_npu.Stream, "wait_event", lambda self, event: None)
    else:
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, target: None)
    with torch.no_grad(), fake_torch_npu.check_streams(), pytest.raises(RuntimeError, match=dropped):
        npu_kernels.three_stream_prolog(layer, hidden, position_embeddings)


def test_decode_steps_run_the_prolog_on_streams(npu):
    """A generate on the npu backend: decode steps (one token) go through the three-stream prolog, prefill does
    not, under the stream checks; tokens equal the cpu backend's."""
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 128, (2, 20), generator=generator)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    calls = []
    original = kernels._npu_kernels().dsa_decode_prolog

    def counted(layer, hidden, position_embeddings):
        calls.append(hidden.shape[1])
        return original(layer, hidden, position_embeddings)

    with pytest.MonkeyPatch.context() as patch:
        counting = dataclasses.replace(kernels._npu_kernels(), dsa_decode_prolog=counted)
        patch.setitem(kernels._BACKENDS, "npu", lambda: counting)
        model = npu_shaped_model("npu")
        with fake_torch_npu.check_streams():
            got = model.generate(prompt, cache=KDSACache(model.config), **kwargs)
    assert calls == [1, 1]  # the two decode steps of the one DSA layer; the prefill runs on one stream
    assert npu_kernels._PROLOG_STREAMS  # the registered prolog is the three-stream one: it made its side streams
    cpu_model = npu_shaped_model("cpu")
    assert torch.equal(got, cpu_model.generate(prompt, cache=KDSACache(cpu_model.config), **kwargs))


# ---------------------------------------------------------------------------------------------------------------
# Whole model: generate through the fused ops equals the cpu backend


def npu_shaped_model(kernel_backend: str, **overrides):
    """A tiny KDA + DSA + dense-MLA model with the dims the fused ops take, in bf16. 16 indexer heads: with few heads
    every head's ReLU is zero for many keys, and those exact-zero scores tie at the top-k boundary, where the op and
    our kernels may pick different keys (the op leaves the order of equal scores unspecified)."""
    fields = dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "full_attention"],
        attn_res_block_size=0,
        num_attention_heads=2,
        kv_lora_rank=LATENT,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=16,
        index_head_dim=INDEX_DIM,
        index_n_heads=16,
        index_topk=8,
    )
    fields.update(overrides)
    return tiny_model(seed=5, kernel_backend=kernel_backend, **fields).to(torch.bfloat16)


SHARED_INDEXER = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared"],
)


def left_padded_prompt(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 prompts of 70 tokens (longer than index_topk and a 64-token page), the second left-padded by 6."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 128, (2, 70), generator=generator)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :6] = 0
    prompt[1, :6] = 0
    return prompt, attention_mask


@pytest.mark.parametrize("layers", [{}, SHARED_INDEXER], ids=["dsa+dense", "shared-indexer"])
def test_generate_over_the_npu_ops_equals_cpu(npu_dsa_ops, layers):
    """Left-padded batch of 2, prompts longer than index_topk (really sparse) and than a 64-token page, greedy. A
    shared-indexer DSA layer (docs/dsa.md §10) reads its predecessor's selection through the npu sparse attention."""
    prompt, attention_mask = left_padded_prompt()
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    outputs = {}
    for backend in ("npu", "cpu"):
        model = npu_shaped_model(backend, **layers)
        cache = KDSACache(model.config)
        outputs[backend] = model.generate(prompt, cache=cache, **kwargs)
        if backend == "npu":
            assert {"npu_lightning_indexer", "npu_sparse_flash_attention"} <= set(fake_torch_npu.calls)
            npu_set = store_kernels(cache.layers[1])  # what the DSA and dense MLA layers read the stores with
            assert npu_set.indexer_topk is paged_indexer_topk_npu
            assert npu_set.sparse_mla is paged_sparse_mla_npu and npu_set.dense_mla is paged_dense_mla_npu
    assert torch.equal(outputs["npu"], outputs["cpu"])


def test_generate_with_the_fp8_cache_over_the_npu_ops_equals_cpu(npu_dsa_ops):
    """kv_cache="fp8": the DSA and dense-MLA layers read their packed FP8 pages through the KV-quant attention op;
    left-padded greedy generate equals the cpu backend's on the same FP8 cache."""
    prompt, attention_mask = left_padded_prompt()
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    outputs = {}
    for backend in ("npu", "cpu"):
        model = npu_shaped_model(backend, quantization_config={"quant_method": "kdsa", "kv_cache": "fp8"})
        cache = KDSACache(model.config)
        outputs[backend] = model.generate(prompt, cache=cache, **kwargs)
        if backend == "npu":
            assert all(isinstance(cache.layers[i].kv_pages, PackedKVRows) for i in (1, 2))
            assert "npu_kv_quant_sparse_flash_attention" in fake_torch_npu.calls
            assert "npu_sparse_flash_attention" not in fake_torch_npu.calls
    assert torch.equal(outputs["npu"], outputs["cpu"])


def bf16_state_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """kda_ops.recurrent_kda under the npu op's precision (its doc: bf16 q, k, v, beta, state and output): inputs and
    the state rounded to bf16, the math in fp32."""

    def bf16(x):
        return None if x is None else x.to(torch.bfloat16).float()

    o, state = kda_ops.recurrent_kda(bf16(q), bf16(k), bf16(v), g, bf16(beta), scale, bf16(initial_state), True)
    return o.to(torch.bfloat16).to(v.dtype), (bf16(state) if output_final_state else None)


@torch.no_grad()
def test_npu_kda_decode_follows_the_cpu_backend(npu, monkeypatch):
    """KDA decode through `npu_recurrent_gated_delta_rule` (prefill stays on the torch kernel: no chunked op with a
    per-key decay), teacher-forced over decode steps on a left-padded batch, against the cpu backend with its decode
    kernel rounding as the op does (bf16 inputs and state). Measured: 0.3-1.3% relative logit error against it; the
    unrounded cpu backend is up to 10% away at some steps of this random bf16 model, by the rounding alone (the
    rounded cpu backend is as far)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 128, (2, 70), generator=generator)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :6] = 0
    steps = torch.randint(3, 128, (2, 6), generator=generator)
    rounded = dataclasses.replace(kernels.CPU_KERNELS, kda_recurrent=bf16_state_recurrent_kda)
    monkeypatch.setitem(kernels._BACKENDS, "cpu", lambda: rounded)
    logits = {}
    for backend in ("npu", "cpu"):
        model = npu_shaped_model(backend)
        cache = KDSACache(model.config)
        fake_torch_npu.calls.clear()
        model(prompt, attention_mask=attention_mask, cache=cache)
        assert "npu_recurrent_gated_delta_rule" not in fake_torch_npu.calls
        mask, logits[backend] = attention_mask, []
        for t in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            logits[backend].append(model(steps[:, t : t + 1], attention_mask=mask, cache=cache).logits.float())
        if backend == "npu":
            assert fake_torch_npu.calls.count("npu_recurrent_gated_delta_rule") == steps.shape[1]
    for got, expected in zip(logits["npu"], logits["cpu"], strict=True):
        error = float((got - expected).norm() / expected.norm())
        assert error < 2e-2, error


@torch.no_grad()
def test_npu_kda_rollback_replays_with_the_npu_decode_kernel(npu):
    """A speculative crop rebuilds the KDA state by replaying the recorded steps with the backend's decode kernel, so
    on `npu` the rolled-back state is bit for bit the one decoding gave (the op rounds the state to bf16 each step;
    a replay on the torch kernel would not)."""
    model = npu_shaped_model("npu")
    cache = KDSACache(model.config, rollback_tokens=8)
    ids = torch.randint(3, 128, (2, 74), generator=torch.Generator().manual_seed(3))
    model(ids[:, :70], cache=cache)
    states = []
    for t in range(70, 74):
        model(ids[:, t : t + 1], cache=cache)
        states.append(cache.layers[0].recurrent_states[0].clone())
    fake_torch_npu.calls.clear()
    cache.crop(72)
    assert fake_torch_npu.calls.count("npu_recurrent_gated_delta_rule") == 2  # the two kept steps, replayed
    assert torch.equal(cache.layers[0].recurrent_states[0], states[1])


def test_gathered_pages_match_what_the_fake_reads(npu):
    """The view the backend hands the indexer (`[N, P, 1, DI]`) addresses the same rows as gather_pages."""
    _, _, k_index, index_pages, block_table = indexer_case(40, 1, seed=4)
    rows = fake_torch_npu._gather_tokens(index_pages.unsqueeze(2), block_table.to(torch.int32), 1, torch.arange(40))
    assert torch.equal(rows, gather_pages(index_pages, block_table, 40)[1].float())
    assert torch.equal(rows, k_index[1].float())


def test_context_parallel_prefill_runs_the_npu_ops(npu):
    """The CP path (cp = tp = 1, two segments) reads its stores through the same backend kernels: on the npu backend
    it calls the fused ops and its logits equal the plain forward's on the npu backend (the kernels see the same
    inputs; measured equal)."""
    ids = torch.randint(3, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    model = npu_shaped_model("npu")
    with torch.no_grad():
        plain = model(ids).logits.float()
        fake_torch_npu.calls.clear()
        parallel = context_parallel_prefill(model, ids, single_process_mesh()).logits.float()
    assert {"npu_lightning_indexer", "npu_sparse_flash_attention"} <= set(fake_torch_npu.calls)
    torch.testing.assert_close(parallel, plain, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# GLM-5.3-Flash k-pool indexer (docs/dsa.md §9) and NoPE attention on the npu backend


def test_generate_glm_shaped_model_over_the_npu_ops_equals_cpu(npu_dsa_ops):
    """NoPE MLA (the op gets zero RoPE columns), the k-pool indexer and a shared-indexer layer, as GLM-5.3-Flash's
    DSA layers; left-padded batch, greedy."""
    glm = dict(
        qk_rope_head_dim=0,
        index_kpool=4,
        index_topk=16,
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared"],
    )
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (2, 70), generator=generator)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :6] = 0
    prompt[1, :6] = 0
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    outputs = {}
    for backend in ("npu", "cpu"):
        model = npu_shaped_model(backend, **glm)
        cache = KDSACache(model.config)
        outputs[backend] = model.generate(prompt, cache=cache, **kwargs)
        if backend == "npu":
            assert {"npu_lightning_indexer", "npu_sparse_flash_attention"} <= set(fake_torch_npu.calls)
            assert store_kernels(cache.layers[1]).kpool_indexer_topk is paged_kpool_indexer_topk_npu
    assert torch.equal(outputs["npu"], outputs["cpu"])


def test_npu_ops_refuse_queries_past_the_cached_keys(npu):
    """npu_lightning_indexer and the dense path's rightDownCausal mask place the T queries at the last T of the
    `num_keys` keys; queries reaching past them (a caller's off-by-one) are a ValueError naming the range, before
    the op runs. The last query at the last key is accepted."""
    q_index, weights, _, index_pages, block_table = indexer_case(40, 2, seed=0)
    paged_indexer_topk_npu(q_index, weights, PagedKeys(index_pages, block_table, 40, 38), 8)
    fake_torch_npu.calls.clear()
    with pytest.raises(ValueError, match=r"queries at 39\.\.40 must lie inside the 40 cached keys"):
        paged_indexer_topk_npu(q_index, weights, PagedKeys(index_pages, block_table, 40, 39), 8)
    assert fake_torch_npu.calls == []
    q_latent, q_pe, kv_pages, block_table, _ = sparse_case(40, 2, seed=0)
    kv_pages = SplitRows.split(kv_pages, LATENT)
    paged_dense_mla_npu(q_latent, q_pe, PagedKeys(kv_pages, block_table, 40, 38), 0.07)
    fake_torch_npu.calls.clear()
    with pytest.raises(ValueError, match=r"queries at 39\.\.40 must lie inside the 40 cached keys"):
        paged_dense_mla_npu(q_latent, q_pe, PagedKeys(kv_pages, block_table, 40, 39), 0.07)
    assert fake_torch_npu.calls == []
