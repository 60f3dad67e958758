"""Numerics the DSA kernels promise, with inputs sharp enough to see a broken promise:

- bf16 indexer: ReLU, head weighting and the head sum in fp32 (`paged_indexer_topk_fused` doc). With {-1, 0, 1}
  queries and keys every q·k product is an exact small integer in bf16, so the only rounding left is the fp32
  weighting and sum: the selected keys must be the exact top-k up to that fp32 error (a derived bound, ~1e-7
  relative). A bf16 weighting or head sum (error ~2^-9 relative) picks other keys.
- sparse attention: a softmax with max subtraction, so logits far beyond fp32 `exp`'s range (|logit| >= 100;
  exp overflows above 88.7 and underflows below -103) give the softmax of their differences.
"""

import pytest
import torch

from modeling_kdsa.dsa_paged_common import PagedKeys
from modeling_kdsa.kernels import kernel_set

# The compiled backend runs the same `score_block` / `attend_selected` code (test_dsa_paged_ops).
BACKENDS = ["torch", "cpu"]
FP32_UNIT_ROUNDOFF = 2.0**-24


def paged(rows: torch.Tensor, page_size: int = 64):
    """`[B, S, W]` → pages `[B·S/P, P, W]` in a scattered order, and the block table that maps them back."""
    batch, length, width = rows.shape
    num_pages = batch * length // page_size
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))
    pages = torch.empty(num_pages, page_size, width, dtype=rows.dtype)
    pages[order] = rows.reshape(num_pages, page_size, width)
    return pages, order.view(batch, length // page_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_indexer_weights_and_sums_heads_in_fp32(backend):
    indexer = kernel_set(backend).indexer_topk
    generator = torch.Generator().manual_seed(0)
    batch, queries, heads, head_dim, num_keys, topk = 2, 16, 8, 64, 512, 64
    q_index = torch.randint(-1, 2, (batch, queries, heads, head_dim), generator=generator).to(torch.bfloat16)
    keys = torch.randint(-1, 2, (batch, num_keys, head_dim), generator=generator).to(torch.bfloat16)
    weights = torch.randn(batch, queries, heads, generator=generator)  # fp32, as weights_proj gives them
    index_pages, block_table = paged(keys)
    query_start = num_keys - queries
    indices = indexer(q_index, weights, PagedKeys(index_pages, block_table, num_keys, query_start), topk)
    assert indices.shape == (batch, queries, topk) and (indices >= 0).all()

    # Exact scores in fp64 from the fp32 scaled weights the kernels use: products are exact integers (|p| <= 64).
    scaled = (weights * (heads**-0.5 * head_dim**-0.5)).double()  # fp32 product, then exact in fp64
    products = torch.einsum("bthd,bsd->bths", q_index.double(), keys.double())
    terms = products.relu() * scaled[..., None]  # [B, T, HI, S]
    exact = terms.sum(2)
    visible = torch.arange(num_keys)[None, :] <= torch.arange(query_start, num_keys)[:, None]
    exact = exact.masked_fill(~visible, float("-inf"))
    # fp32 weighting + sum of HI terms: |error| <= γ_{HI+1}·Σ|terms| (Higham, recursive summation), per key.
    bound = (heads + 1) * FP32_UNIT_ROUNDOFF * terms.abs().sum(2) * 1.01
    slack = 2 * bound.masked_fill(~visible, 0).amax(-1, keepdim=True)  # [B, T, 1]
    kth = exact.topk(topk, dim=-1).values[..., -1:]
    chosen = exact.gather(-1, indices)
    assert (chosen >= kth - slack).all(), "a selected key is below the k-th best score by more than fp32 error"
    assert all(len(set(row)) == topk for row in indices.reshape(-1, topk).tolist()), "keys selected twice"
    # Best first: the order follows the exact scores up to the same slack.
    assert (chosen[..., 1:] <= chosen[..., :-1] + slack).all()
    # The data are sharp: the bf16 rounding of the weights alone would move scores by more than the slack.
    bf16_weights = (weights.to(torch.bfloat16).double() * (heads**-0.5 * head_dim**-0.5))[..., None]
    assert ((products.relu() * bf16_weights).sum(2) - exact).masked_fill(~visible, 0).abs().amax() > 10 * slack.max()


def extreme_logit_inputs(offset: float):
    """Rows `c = b + 0.05·noise` around a unit direction `b`, queries `offset·b` (head 0) and `-offset·b` (head 1):
    logits `±offset + O(5)`, far outside fp32 exp's range, with a spread that keeps the softmax non-degenerate."""
    generator = torch.Generator().manual_seed(0)
    batch, queries, latent, rope, num_keys, selected = 1, 3, 32, 8, 64, 16
    direction = torch.randn(latent + rope, generator=generator)
    direction = direction / direction.norm()
    rows = direction + 0.05 * torch.randn(batch, num_keys, latent + rope, generator=generator)
    query = torch.stack([offset * direction, -offset * direction])  # [H, C + R]
    query = query.expand(batch, queries, 2, latent + rope).contiguous()
    indices = torch.stack(
        [torch.randperm(num_keys, generator=generator)[:selected] for _ in range(batch * queries)]
    ).view(batch, queries, selected)
    return rows, query[..., :latent], query[..., latent:], indices, latent


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [150.0, 300.0])
def test_sparse_attention_is_exact_for_logits_beyond_exp_range(backend, offset):
    attention = kernel_set(backend).sparse_mla
    rows, q_latent, q_pe, indices, latent = extreme_logit_inputs(offset)
    kv_pages, block_table = paged(rows)
    out = attention(q_latent, q_pe, PagedKeys(kv_pages, block_table), indices, 1.0)

    selected = rows[0][indices[0]].double()  # [T, K, C + R]
    logits = torch.einsum("thd,tkd->thk", torch.cat([q_latent, q_pe], -1)[0].double(), selected)
    assert logits[:, 0].min() > 88.8 and logits[:, 1].max() < -103.3, "beyond fp32 exp's range (overflow/underflow)"
    expected = torch.einsum("thk,tkc->thc", logits.softmax(-1), selected[..., :latent])
    assert torch.isfinite(out).all()
    # fp32 logits of magnitude ~offset carry absolute error ~offset·2^-24·(C+R); the softmax turns it into a relative
    # weight error of the same size; outputs are averages of |c| <= 1.5.
    tolerance = 4 * offset * FP32_UNIT_ROUNDOFF * (q_latent.shape[-1] + q_pe.shape[-1]) * 1.5 + 1e-6
    torch.testing.assert_close(out[0].double(), expected, rtol=0, atol=tolerance)
