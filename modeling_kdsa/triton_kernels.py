"""Triton kernels for the paged DSA store (`kernel_backend="triton"`, docs/backends.md §4): Lightning Indexer scores and
sparse absorbed MLA that read `KDSACache` pages directly through the block table. Tested under Triton's interpreter
(`TRITON_INTERPRET=1`, scripts/test_triton_interpret.sh), not run on a GPU.

- Indexer: one program per (query, block of keys) computes `Σ_h w[t,h] · HI^-0.5 · DI^-0.5 · ReLU(q[t,h]·k[s])`
  (docs/dsa.md §1) for the visible keys (causal and padding masks, -inf otherwise) straight from the pages; the top-k
  then runs on these logits with `torch.topk`. This is vLLM's pipeline (paged logits, then top-k: docs/dsa.md §4); it
  holds `[B, T, S']` fp32 logits per query block (T <= 128), not the single-pass running top-k of the `cpu` backend.
  Equal scores may come out in any order (as with torch_npu's indexer).
- Sparse attention: one program per (query, block of 16 heads) walks the selected indices in blocks, gathers each
  selected row `[c | k_pe]` from its page, and keeps an online (flash-style) softmax in fp32; the output is
  `Σ softmax(scale · (q_latent·c + q_pe·k_pe)) · c`, rows without a valid index give 0 (docs/dsa.md §3, §6).
- Products are fp32 (`input_precision="ieee"`), so the results equal the fp32 reference up to summation order.
- Dense MLA runs the torch reference; KDA runs fla's Triton kernels (kda_device_ops; the registry, kernels.py, binds
  them: docs/backends.md §4).
- Quantized stores are refused (ValueError): these kernels read plain pages.
"""

import torch

from .dsa_ops import scaled_index_weights
from .dsa_paged_common import PagedKeys, check_indexer_inputs, check_sparse_inputs, page_geometry
from .numeric_formats import QuantizedRows

try:  # optional: only the "triton" backend needs it (remote code must import without it)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

HEAD_BLOCK = 16  # heads per sparse-attention program (tl.dot needs >= 16 rows)
KEY_BLOCK = 16  # selected keys per step of the sparse-attention loop
SCORE_BLOCK = 64  # keys per indexer program


def require_triton():
    """ValueError unless triton is importable."""
    if triton is None:
        raise ValueError("kernel_backend='triton' needs the triton package (and a GPU, or TRITON_INTERPRET=1)")


def _require_plain(pages, field: str) -> None:
    if isinstance(pages, QuantizedRows):
        raise ValueError(f"kernel_backend='triton' does not read quantized pages ({field} is quantized)")


def _block(width: int) -> int:
    return max(16, triton.next_power_of_2(max(width, 1)))


if triton is not None:

    @triton.jit
    def _indexer_scores_kernel(
        q_ptr,  # [B*T, HI, DI] contiguous
        w_ptr,  # [B*T, HI] fp32, already scaled
        pages_ptr,  # [N * P, DI] contiguous
        table_ptr,  # [B, max_pages]
        padding_ptr,  # [B, num_keys] uint8 (1 = real), or a dummy when HAS_PADDING is False
        out_ptr,  # [B*T, num_visible] fp32
        num_queries,
        num_heads,
        head_dim,
        page_size,
        table_stride,
        num_keys,
        num_visible,
        query_start,
        HAS_PADDING: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        row = tl.program_id(0)
        batch = row // num_queries
        query = row % num_queries
        keys = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        in_range = keys < num_visible
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(
            q_ptr + row * num_heads * head_dim + heads[:, None] * head_dim + dims[None, :],
            mask=(heads[:, None] < num_heads) & (dims[None, :] < head_dim),
            other=0.0,
        ).to(tl.float32)
        page = tl.load(table_ptr + batch * table_stride + keys // page_size, mask=in_range, other=0)
        slots = page.to(tl.int64) * page_size + keys % page_size
        k = tl.load(
            pages_ptr + slots[:, None] * head_dim + dims[None, :],
            mask=in_range[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        ).to(tl.float32)
        products = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_S]
        w = tl.load(w_ptr + row * num_heads + heads, mask=heads < num_heads, other=0.0)
        scores = tl.sum(tl.maximum(products, 0.0) * w[:, None], axis=0)
        visible = in_range & (keys <= query_start + query)
        if HAS_PADDING:
            real = tl.load(padding_ptr + batch * num_keys + keys, mask=in_range, other=0)
            visible = visible & (real != 0)
        scores = tl.where(visible, scores, float("-inf"))
        tl.store(out_ptr + row * num_visible + keys, scores, mask=in_range)

    @triton.jit
    def _sparse_mla_kernel(
        q_ptr,  # [B*T, H, C] contiguous
        q_pe_ptr,  # [B*T, H, R] contiguous
        rows_ptr,  # [N * P, C + R] contiguous
        table_ptr,  # [B, max_pages]
        indices_ptr,  # [B*T, K] contiguous
        out_ptr,  # [B*T, H, C] fp32
        num_queries,
        num_heads,
        latent_width,
        rope_width,
        num_selected,
        page_size,
        table_stride,
        softmax_scale,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        row = tl.program_id(0)
        batch = row // num_queries
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_heads
        latent = tl.arange(0, BLOCK_C)
        rope = tl.arange(0, BLOCK_R)
        width = latent_width + rope_width
        q = tl.load(
            q_ptr + row * num_heads * latent_width + heads[:, None] * latent_width + latent[None, :],
            mask=head_ok[:, None] & (latent[None, :] < latent_width),
            other=0.0,
        ).to(tl.float32)
        q_pe = tl.load(
            q_pe_ptr + row * num_heads * rope_width + heads[:, None] * rope_width + rope[None, :],
            mask=head_ok[:, None] & (rope[None, :] < rope_width),
            other=0.0,
        ).to(tl.float32)
        running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_H], tl.float32)
        accumulator = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for start in range(0, num_selected, BLOCK_K):
            slots_in_row = start + tl.arange(0, BLOCK_K)
            index = tl.load(indices_ptr + row * num_selected + slots_in_row, mask=slots_in_row < num_selected, other=-1)
            valid = index >= 0
            position = tl.where(valid, index, 0)
            page = tl.load(table_ptr + batch * table_stride + position // page_size, mask=valid, other=0)
            slot = page.to(tl.int64) * page_size + position % page_size
            c = tl.load(
                rows_ptr + slot[:, None] * width + latent[None, :],
                mask=valid[:, None] & (latent[None, :] < latent_width),
                other=0.0,
            ).to(tl.float32)
            k_pe = tl.load(
                rows_ptr + slot[:, None] * width + latent_width + rope[None, :],
                mask=valid[:, None] & (rope[None, :] < rope_width),
                other=0.0,
            ).to(tl.float32)
            scores = tl.dot(q, tl.trans(c), input_precision="ieee")
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
            scores = tl.where(valid[None, :], scores * softmax_scale, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # A row that has seen no valid key keeps max -inf: subtract 0 instead (exp(-inf) = 0, never NaN).
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - shift[:, None])
            correction = tl.exp(running_max - shift)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            accumulator = accumulator * correction[:, None] + tl.dot(probs, c, input_precision="ieee")
            running_max = new_max
        out = accumulator / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(
            out_ptr + row * num_heads * latent_width + heads[:, None] * latent_width + latent[None, :],
            out,
            mask=head_ok[:, None] & (latent[None, :] < latent_width),
        )


def paged_indexer_topk_triton(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """Paged indexer logits in Triton, then `torch.topk`; same signature and result as
    `dsa_paged_fused.paged_indexer_topk_fused` (indices as a set per row: equal scores in any order)."""
    check_indexer_inputs(q_index, weights, keys, index_topk)
    index_pages, block_table, num_keys, query_start, key_padding_mask = keys[:5]
    _require_plain(index_pages, "index_cache")
    require_triton()
    batch, num_queries, num_heads, head_dim = q_index.shape
    num_visible = min(num_keys, query_start + num_queries)
    num_selected = min(index_topk, num_visible)
    if num_selected == 0:
        return torch.empty(batch, num_queries, 0, dtype=torch.int64, device=q_index.device)
    scores = torch.empty(batch * num_queries, num_visible, dtype=torch.float32, device=q_index.device)
    scaled_weights = scaled_index_weights(weights, head_dim).contiguous()
    padding = scores if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    grid = (batch * num_queries, triton.cdiv(num_visible, SCORE_BLOCK))
    _indexer_scores_kernel[grid](
        q_index.contiguous(), scaled_weights, index_pages.contiguous(), block_table.contiguous(), padding, scores,
        num_queries, num_heads, head_dim, page_geometry(index_pages)[1], block_table.stride(0), num_keys,
        num_visible, query_start,
        HAS_PADDING=key_padding_mask is not None, BLOCK_H=_block(num_heads), BLOCK_D=_block(head_dim),
        BLOCK_S=SCORE_BLOCK,
    )  # fmt: skip
    values, indices = scores.view(batch, num_queries, num_visible).topk(num_selected, dim=-1)
    return indices.masked_fill(values == float("-inf"), -1)


def paged_sparse_mla_triton(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA in one Triton kernel reading the selected rows from the pages; same signature and result
    as `dsa_paged_fused.paged_sparse_mla_fused`. Returns `[B, T, H, C]` in q_latent's dtype."""
    check_sparse_inputs(q_latent, q_pe, keys, indices)  # kv_pages contiguous: read by flat slot
    kv_pages, block_table = keys.pages, keys.block_table
    _require_plain(kv_pages, "kv_cache")
    require_triton()
    batch, num_queries, num_heads, latent_width = q_latent.shape
    rope_width, num_selected = q_pe.shape[-1], indices.shape[-1]
    out = torch.zeros(batch * num_queries, num_heads, latent_width, dtype=torch.float32, device=q_latent.device)
    if num_selected > 0:
        grid = (batch * num_queries, triton.cdiv(num_heads, HEAD_BLOCK))
        _sparse_mla_kernel[grid](
            q_latent.contiguous(), q_pe.contiguous(), kv_pages, block_table.contiguous(), indices.contiguous(), out,
            num_queries, num_heads, latent_width, rope_width, num_selected, page_geometry(kv_pages)[1],
            block_table.stride(0), softmax_scale,
            BLOCK_H=HEAD_BLOCK, BLOCK_K=KEY_BLOCK, BLOCK_C=_block(latent_width), BLOCK_R=_block(rope_width),
        )  # fmt: skip
    return out.view(q_latent.shape).to(q_latent.dtype)


__all__ = [
    "paged_indexer_topk_triton",
    "paged_sparse_mla_triton",
    "require_triton",
]
