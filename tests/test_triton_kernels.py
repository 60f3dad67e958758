"""kernel_backend="triton" (modeling_kdsa/triton_kernels.py) and fla's Triton KDA kernels under Triton's interpreter
on CPU, against our `cpu` / `torch` kernels. Needs an environment with triton (never the CPU .venv: triton there
breaks transformers' KimiLinear fallback): run `scripts/test_triton_interpret.sh` (docs/backends.md §4). Skipped
when triton is absent or TRITON_INTERPRET is not 1 (the CPU has no Triton driver)."""

import importlib.util
import os

import pytest
import torch
from test_dsa_paged_ops import left_padding, paged

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs triton and TRITON_INTERPRET=1 (scripts/test_triton_interpret.sh)", allow_module_level=True)

from modeling_kdsa import dsa_ops  # noqa: E402
from modeling_kdsa.dsa_paged_ops import (  # noqa: E402
    dsa_kernels,
    paged_indexer_topk_fused,
    paged_sparse_mla_fused,
    paged_sparse_mla_reference,
)
from modeling_kdsa.kda_ops import recurrent_kda  # noqa: E402
from modeling_kdsa.triton_kernels import paged_indexer_topk_triton, paged_sparse_mla_triton  # noqa: E402

CASES = [(40, 40, 0), (70, 10, 50), (64, 1, 63), (97, 1, 96)]


def test_registry_binds_the_triton_kernels():
    assert dsa_kernels("triton") == (paged_indexer_topk_triton, paged_sparse_mla_triton)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("num_keys", "num_queries", "query_start"), CASES)
def test_triton_indexer_equals_cpu(num_keys, num_queries, query_start, padded):
    generator = torch.Generator().manual_seed(num_keys)
    q_index = torch.randn(2, num_queries, 4, 32, generator=generator)
    weights = torch.randn(2, num_queries, 4, generator=generator)
    k_index = torch.randn(2, num_keys, 32, generator=generator)
    index_pages, block_table = paged(k_index, 16, generator)
    padding = left_padding(2, num_keys, pad=5) if padded else None
    args = (q_index, weights, index_pages, block_table, num_keys, 8, query_start, padding)
    got, expected = paged_indexer_topk_triton(*args), paged_indexer_topk_fused(*args)
    assert got.shape == expected.shape and got.dtype == torch.int64
    visible = dsa_ops.visible_keys_mask(query_start, num_queries, num_keys, padding, q_index.device)
    scores = dsa_ops.indexer_scores(q_index, weights, k_index, visible)

    def selected(indices):
        return scores.gather(-1, indices.clamp(min=0)).masked_fill(indices < 0, 0.0).sort(dim=-1).values

    assert torch.equal(got >= 0, expected >= 0)
    torch.testing.assert_close(selected(got), selected(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "latent", "rope"), [(4, 32, 8), (20, 48, 0)])
def test_triton_sparse_attention_equals_cpu(heads, latent, rope):
    generator = torch.Generator().manual_seed(heads)
    num_keys, num_queries = 70, 5
    q_latent = torch.randn(2, num_queries, heads, latent, generator=generator)
    q_pe = torch.randn(2, num_queries, heads, rope, generator=generator)
    kv_pages, block_table = paged(torch.randn(2, num_keys, latent + rope, generator=generator), 16, generator)
    indices = torch.stack([torch.randperm(num_keys, generator=generator)[:20] for _ in range(2 * num_queries)])
    indices = indices.view(2, num_queries, 20)
    indices[0, 0, 5:] = -1
    indices[1, 1] = -1  # no key: zero output
    indices[0, 2, 3] = -1  # a hole
    args = (q_latent, q_pe, kv_pages, block_table, indices, 0.2)
    got = paged_sparse_mla_triton(*args)
    assert (got[1, 1] == 0).all()
    torch.testing.assert_close(got, paged_sparse_mla_fused(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, paged_sparse_mla_reference(*args), rtol=1e-5, atol=1e-5)


def test_fla_fused_recurrent_kda_equals_our_decode_kernel():
    """fla's Triton recurrent KDA (the dependency made for the CUDA path) against kda_ops.recurrent_kda, with an
    initial state, over a few steps (fla's chunk_kda does not run under the interpreter)."""
    from fla.ops.kda import fused_recurrent_kda

    generator = torch.Generator().manual_seed(0)
    batch, steps, heads, dim = 2, 6, 2, 16
    q = torch.nn.functional.normalize(torch.randn(batch, steps, heads, dim, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, steps, heads, dim, generator=generator), dim=-1)
    v = torch.randn(batch, steps, heads, dim, generator=generator)
    g = -torch.rand(batch, steps, heads, dim, generator=generator)
    beta = torch.rand(batch, steps, heads, generator=generator)
    state = torch.randn(batch, heads, dim, dim, generator=generator)
    expected, expected_state = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    got, got_state = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state, expected_state, rtol=1e-4, atol=1e-4)


def test_device_check_dry_run_with_the_triton_backend(tmp_path):
    """scripts/device_check.py end to end for `triton`: kernels vs cpu and a greedy generate equal to `torch`."""
    from test_device_check import load_script

    out = tmp_path / "device_check.json"
    assert load_script().main(["--dry-run", "--backends", "triton", "--out", str(out)]) == 0
