"""kernel_backend="triton" (modeling_kdsa/triton_kernels.py) under Triton's interpreter on CPU, against our `cpu` /
`torch` kernels: what tests/test_kernel_registry.py (also run there: every kernel of the set, fla's recurrent KDA
included) does not cover. Needs an environment with triton (never the CPU .venv: triton there breaks transformers'
KimiLinear fallback): run `scripts/test_triton_interpret.sh` (docs/backends.md §4). Skipped when triton is absent or
TRITON_INTERPRET is not 1 (the CPU has no Triton driver)."""

import dataclasses
import importlib.util
import os

import pytest
import torch
from test_dsa_paged_ops import paged

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs triton and TRITON_INTERPRET=1 (scripts/test_triton_interpret.sh)", allow_module_level=True)

from modeling_kdsa import kernels  # noqa: E402
from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.dsa_paged_fused import paged_sparse_mla_fused  # noqa: E402
from modeling_kdsa.dsa_paged_reference import paged_sparse_mla_reference  # noqa: E402
from modeling_kdsa.triton_kernels import paged_sparse_mla_triton  # noqa: E402


@pytest.mark.parametrize(("heads", "latent", "rope"), [(4, 32, 8), (20, 48, 0)])
def test_triton_sparse_attention_equals_cpu(heads, latent, rope):
    """Head counts that are not a multiple of the 16-head block and NoPE, in fp32. The bf16 cases of every backend are
    in tests/test_kernel_registry.py."""
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
    args = (q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 0.2)
    got = paged_sparse_mla_triton(*args)
    assert (got[1, 1] == 0).all()
    torch.testing.assert_close(got, paged_sparse_mla_fused(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, paged_sparse_mla_reference(*args), rtol=1e-5, atol=1e-5)


def test_device_check_dry_run_with_the_triton_backend(tmp_path, monkeypatch):
    """scripts/device_check.py end to end for `triton`: kernels vs cpu, fla's recurrent KDA vs kda_ops, and a greedy
    generate equal to `torch`. fla's chunk_kda does not run under the interpreter (docs/backends.md §4): prefill runs
    the torch kernel here."""
    from test_device_check import load_script

    interpretable = dataclasses.replace(kernels._triton_kernels(), kda_chunk=kernels.TORCH_KERNELS.kda_chunk)
    monkeypatch.setitem(kernels._BACKENDS, "triton", lambda: interpretable)

    out = tmp_path / "device_check.json"
    assert load_script().main(["--dry-run", "--backends", "triton", "--skip-graph-mode", "--out", str(out)]) == 0
