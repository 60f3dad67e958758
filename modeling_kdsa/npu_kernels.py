"""Ascend NPU backend (`kernel_backend="npu"`): the paged DSA store read by torch_npu's fused Lightning Indexer and
Sparse Flash Attention (docs/backends.md §2). Contract-tested on CPU against a fake torch_npu written from the op
docs; not run on Ascend hardware.

Public sources for the op contracts (Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/):
- `torch_npu-npu_lightning_indexer.md`: `npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query,
  actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_count, sparse_mode, ...)`; query BSND
  `[B, S1, N1, 128]` bf16/fp16, N1 <= 64; key PA_BSND `[block_count, block_size, 1, 128]`, block_size a multiple of
  16 up to 1024; weights `[B, S1, N1]` (fp32 allowed on A2/A3); lengths int32 `[B]`, per batch for BSND / PA_BSND;
  block_table int32 `[B, >= ceil(max Lk / block_size)]`; sparse_count in [1, 2048] or {3072, ..., 8192}; sparse_mode
  3 = rightDownCausal (query i of a batch sees `j <= Lk - Lq + i`); no input may be non-contiguous. Returns int32
  `[B, S1, 1, sparse_count]` logical positions; unused slots are -1 (vllm-project/vllm-ascend
  csrc/attention/lightning_indexer/op_kernel/lightning_indexer_common.h, INVALID_IDX).
- `torch_npu-npu_sparse_flash_attention.md`: `npu_sparse_flash_attention(query, key, value, sparse_indices,
  scale_value, *, block_table, actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope,
  sparse_block_size, layout_query, layout_kv, sparse_mode, attention_mode, ...)`; attention_mode 2 = MLA-absorb
  (`[q_nope | q_rope]·[k_nope | k_rope]`, key and value one tensor), D = 512 and rope D = 64, N1 in {1, 2, 4, ...,
  128}; sparse_indices int32 `[B, S1, 1, K]` with the valid entries first; sparse_mode 0 = only the selection.

How vllm-ascend drives the same ops for DeepSeek-V3.2 (vllm_ascend/attention/sfa_v1.py): PA_BSND caches, int32 block
tables, per-request key lengths, `sparse_mode=3` for the indexer, `attention_mode=2` for the attention.

Our side of the contract (same signatures and results as the `cpu` backend's kernels, dsa_paged_cpu.py):
- Indexer: `index_pages` `[N, P, DI]` viewed as `[N, P, 1, DI]` (a free view, contiguous), the block table cast to
  int32, `Lq = T`, `Lk = query_start + T`, so that rightDownCausal gives exactly "query at `query_start + i` sees
  `s <= query_start + i`". The head weights are pre-multiplied by `HI^-0.5 · DI^-0.5` (docs/dsa.md §1; the op has no
  scale, and a positive scale does not change the order). The op has no padding mask: with one, it is asked for
  `topk + (most padded keys of a row)` keys, padded ones are dropped and the rest moved to the front, which keeps
  exactly the top-k real keys (a real key of the real top-k has at most `pads` padded keys above it).
- Sparse attention: the op reads the latent and RoPE parts as two contiguous pools `[N, P, 1, C]` / `[N, P, 1, R]`
  ("key", "key_rope": not non-contiguous), so on this backend the store keeps them as two planes (`SplitRows`, as
  vllm-ascend's `kv_cache[0]` / `kv_cache[1]`) and the op reads the pages in place, no copy per call. `sparse_mode=0`:
  our indices are already causal and the kernel's contract is "attend exactly these keys", so `actual_seq_lengths_kv`
  covers every mapped page of the sequence and no mask is added.
- Dense MLA (`"full_attention"` layers) is the same op selecting every key (`paged_dense_mla_npu`), with
  rightDownCausal masking. NoPE models (`qk_rope_head_dim = 0`) pass zero RoPE columns (the op needs 64).
- The k-pool indexer (GLM-5.3-Flash, docs/dsa.md §9) is the indexer op over the stored pooled keys, one batch entry
  per query (`paged_kpool_indexer_topk_npu`). KDA decode is in kda_device_ops (docs/backends.md §2).
- `kv_cache="fp8"` (E4M3 latent, fp32 scale per 128-wide tile, RoPE part in the model dtype) is what
  `npu_kv_quant_sparse_flash_attention` (`torch_npu-npu_kv_quant_sparse_flash_attention.md`) reads, packed as one
  656-byte row per token `[512 E4M3 | 64 RoPE values | 4 fp32 scales]`, key = value `[N, P, 1, 656]`, query
  `[q_nope | q_rope]` 576 wide, key/value_quant_mode 2 (per tile), tile_size 128, quant_scale_repo_mode 1 (scales
  stored with the data). The store packs its rows so (`PackedKVRows`). float8_e4m3fn keys are documented for the
  Ascend 950 only (A2/A3 take int8 keys, a format KDSA has no counterpart of), and there sparse_block_size is 1.
  The dequantization is `element · scale` per tile (the doc gives `Dequant(K, Scale_K)` only; ours stores
  multiplying scales).
- MXFP8 indexer keys are refused: `npu_quant_lightning_indexer` (`torch_npu-npu_quant_lightning_indexer.md`) takes
  one dequant scale per key row and per query head (quant mode 0, per-token-head), not an E8M0 scale per 32 elements.
- A decode step's projections run on three streams (`three_stream_prolog`, called from the DSA layer's `project`).
"""

import functools

import torch

from .dsa_ops import kpool_expand, kpool_origin, scaled_index_weights
from .dsa_paged_common import (
    PagedKeys,
    check_dense_inputs,
    check_indexer_inputs,
    check_kpool_inputs,
    check_sparse_inputs,
    page_geometry,
)
from .numeric_formats import PackedKVRows, QuantizedRows, SplitRows

INDEXER_HEAD_DIM = 128  # npu_lightning_indexer: D of query and key
INDEXER_MAX_HEADS = 64  # npu_lightning_indexer: N1 <= 64 (A2/A3)
LATENT_DIM = 512  # npu_sparse_flash_attention: D of query, key and value
ROPE_DIM = 64  # npu_sparse_flash_attention: D of query_rope and key_rope
ATTENTION_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # npu_sparse_flash_attention: N1
SPARSE_COUNTS = (*range(1, 2049), 3072, 4096, 5120, 6144, 7168, 8192)  # npu_lightning_indexer: sparse_count
OP_DTYPES = (torch.bfloat16, torch.float16)
KV_QUANT_MODE = 2  # npu_kv_quant_sparse_flash_attention: key/value_quant_mode 2 = per-tile
KV_QUANT_TILE = 128  # npu_kv_quant_sparse_flash_attention: tile_size


def torch_npu_module():
    """`torch_npu`, imported on first use; ValueError when it is missing or no NPU is available."""
    try:
        import torch_npu
    except ImportError as error:
        raise ValueError(
            "kernel_backend='npu' needs torch_npu (Ascend CANN); it is not installed. Use kernel_backend='auto'"
        ) from error
    if not torch.npu.is_available():
        raise ValueError("kernel_backend='npu': torch_npu is installed but torch.npu.is_available() is False")
    return torch_npu


def _require_plain_index_keys(pages) -> None:
    if isinstance(pages, QuantizedRows):
        raise ValueError(
            "kernel_backend='npu' does not read MXFP8 indexer keys (quantization_config.indexer='mxfp8'): torch_npu's "
            "npu_quant_lightning_indexer takes one dequant scale per key row (per-token-head), not an E8M0 scale per "
            "32 elements (docs/backends.md §2); use indexer='bf16' or another kernel_backend"
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"kernel_backend='npu': {message}")


def _check_page_size(page_size: int) -> None:
    _require(page_size % 16 == 0 and page_size <= 1024, f"page size {page_size} must be a multiple of 16, <= 1024")


def _valid_first(indices: torch.Tensor) -> torch.Tensor:
    """Entries >= 0 moved to the front of each row in their order, -1 after them (the layout the ops read)."""
    order = (indices < 0).to(torch.int8).argsort(dim=-1, stable=True)
    return indices.gather(-1, order)


def _sparse_count(wanted: int) -> int:
    """The smallest sparse_count npu_lightning_indexer accepts that is >= wanted."""
    for count in SPARSE_COUNTS:
        if count >= wanted:
            return count
    raise ValueError(
        f"kernel_backend='npu': the indexer would need sparse_count={wanted} (index_topk plus the padded keys of a "
        f"row), more than npu_lightning_indexer's maximum {SPARSE_COUNTS[-1]}"
    )


def _check_indexer_op(q_index: torch.Tensor, pages, num_keys: int, query_start: int) -> None:
    """What npu_lightning_indexer takes (module doc), for the plain and the k-pool indexer; `pages` is the plane the
    op reads as its PA_BSND pool."""
    _require_plain_index_keys(pages)
    num_queries, num_heads, head_dim = q_index.shape[1:]
    _require(head_dim == INDEXER_HEAD_DIM, f"index_head_dim must be {INDEXER_HEAD_DIM}, got {head_dim}")
    _require(num_heads <= INDEXER_MAX_HEADS, f"index_n_heads must be <= {INDEXER_MAX_HEADS}, got {num_heads}")
    _require(q_index.dtype in OP_DTYPES, f"the indexer runs in bf16 or fp16, got q_index {q_index.dtype}")
    _check_page_size(page_geometry(pages)[1])
    _require(
        query_start + num_queries <= num_keys,
        f"queries at {query_start}..{query_start + num_queries - 1} must lie inside the {num_keys} cached keys",
    )


def paged_indexer_topk_npu(q_index, weights, keys: PagedKeys, index_topk: int) -> torch.Tensor:
    """Lightning Indexer top-k through `torch_npu.npu_lightning_indexer` (module doc), same signature and result
    as `dsa_paged_fused.paged_indexer_topk_fused` (indices as a set per row: the op leaves the order of equal scores
    unspecified). Returns int64 `[B, T, min(index_topk, S')]`, -1 = no key."""
    check_indexer_inputs(q_index, weights, keys, index_topk)
    index_pages, block_table, num_keys, query_start, key_padding_mask = keys[:5]
    _check_indexer_op(q_index, index_pages, num_keys, query_start)
    batch, num_queries, num_heads, head_dim = q_index.shape
    num_selected = min(index_topk, query_start + num_queries)
    extra = 0
    if key_padding_mask is not None:
        padding = ~key_padding_mask[:, : query_start + num_queries].bool()
        extra = int(padding.sum(dim=1).max())
    torch_npu = torch_npu_module()
    device = q_index.device
    scaled_weights = scaled_index_weights(weights, head_dim)
    indices, _ = torch_npu.npu_lightning_indexer(
        q_index.contiguous(),
        index_pages.unsqueeze(2),
        scaled_weights.contiguous(),
        actual_seq_lengths_query=torch.full((batch,), num_queries, dtype=torch.int32, device=device),
        actual_seq_lengths_key=torch.full((batch,), query_start + num_queries, dtype=torch.int32, device=device),
        block_table=block_table.to(torch.int32).contiguous(),
        layout_query="BSND",
        layout_key="PA_BSND",
        sparse_count=_sparse_count(num_selected + extra),
        sparse_mode=3,
    )
    indices = indices[:, :, 0].long()  # [B, T, sparse_count]
    if key_padding_mask is not None:
        real = key_padding_mask.bool().gather(1, indices.clamp(min=0).flatten(1)).view_as(indices)
        indices = _valid_first(indices.masked_fill(~real, -1))
    return indices[..., :num_selected]


def _check_attention_shapes(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_pages) -> int:
    """What npu_sparse_flash_attention (`SplitRows` pages) or npu_kv_quant_sparse_flash_attention (`PackedKVRows`)
    takes (module doc); returns the page size."""
    _require(
        isinstance(kv_pages, (SplitRows, PackedKVRows)),
        "kv pages must be SplitRows (model dtype) or PackedKVRows (kv_cache='fp8'), the npu store's layouts that the "
        f"attention ops read in place; got {type(kv_pages).__name__}",
    )
    latent_width, rope_width, num_heads = q_latent.shape[-1], q_pe.shape[-1], q_latent.shape[2]
    _require(latent_width == LATENT_DIM, f"kv_lora_rank must be {LATENT_DIM}, got {latent_width}")
    _require(rope_width in (0, ROPE_DIM), f"qk_rope_head_dim must be {ROPE_DIM} or 0 (NoPE), got {rope_width}")
    _require(num_heads in ATTENTION_HEADS, f"num_attention_heads must be one of {ATTENTION_HEADS}, got {num_heads}")
    _require(q_latent.dtype in OP_DTYPES, f"attention runs in bf16 or fp16, got {q_latent.dtype}")
    if isinstance(kv_pages, PackedKVRows):
        _require(
            rope_width == ROPE_DIM,
            f"kv_cache='fp8' needs qk_rope_head_dim={ROPE_DIM} (npu_kv_quant_sparse_flash_attention: rope_head_dim "
            "64 only; a NoPE model's zero RoPE columns would have to be packed into every cached row)",
        )
        tile = latent_width // kv_pages.rows().scales.shape[-1]
        _require(tile == KV_QUANT_TILE, f"kv_cache_tile_size must be {KV_QUANT_TILE} (the op's tile_size), got {tile}")
    dtype = kv_pages.rope_dtype if isinstance(kv_pages, PackedKVRows) else kv_pages.latent.dtype
    _require(dtype == q_latent.dtype, f"kv pages {dtype} and queries {q_latent.dtype} must agree")
    page_size = page_geometry(kv_pages)[1]
    _check_page_size(page_size)
    return page_size


@functools.lru_cache(maxsize=2)
def _zero_rope_pages(num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero key RoPE pool `[N, P, 1, 64]` for NoPE models, made once per pool size (the pool doubles when it grows),
    not on every call; the last two sizes are kept (an eighth of the latent pool's bytes each)."""
    return torch.zeros(num_pages, page_size, 1, ROPE_DIM, dtype=dtype, device=device)


def _sparse_flash_attention(q_latent, q_pe, kv_pages, block_table, sparse_indices, softmax_scale, **kwargs):
    """One attention op call over the store's pages, read in place: `_kv_quant_sparse_flash_attention` for FP8
    pages, else npu_sparse_flash_attention (below)."""
    if isinstance(kv_pages, PackedKVRows):
        return _kv_quant_sparse_flash_attention(
            q_latent, q_pe, kv_pages, block_table, sparse_indices, softmax_scale, **kwargs
        )
    return _plain_sparse_flash_attention(q_latent, q_pe, kv_pages, block_table, sparse_indices, softmax_scale, **kwargs)


def _kv_quant_sparse_flash_attention(q_latent, q_pe, kv_pages, block_table, sparse_indices, softmax_scale, **kwargs):
    """One npu_kv_quant_sparse_flash_attention call over `PackedKVRows` pages (`kv_cache="fp8"`): key = value = the
    packed byte rows viewed as float8_e4m3fn `[N, P, 1, 656]` (a free view), query = `[q_latent | q_pe]` 576 wide,
    per-tile dequantization (quant modes 2, tile_size 128, scales stored with the data: quant_scale_repo_mode 1).
    The doc says the output has the query's shape, the op's infershape gives D = 512: the first 512 columns are the
    latent output either way. Returns `[B, T, H, C]`."""
    torch_npu = torch_npu_module()
    key = kv_pages.buffer.view(torch.float8_e4m3fn).unsqueeze(2)
    out = torch_npu.npu_kv_quant_sparse_flash_attention(
        torch.cat([q_latent, q_pe], dim=-1).contiguous(),
        key,
        key,
        sparse_indices,
        softmax_scale,
        KV_QUANT_MODE,
        KV_QUANT_MODE,
        block_table=block_table.to(torch.int32).contiguous(),
        layout_query="BSND",
        layout_kv="PA_BSND",
        attention_mode=2,
        quant_scale_repo_mode=1,
        tile_size=KV_QUANT_TILE,
        rope_head_dim=ROPE_DIM,
        **kwargs,
    )
    return out[..., :LATENT_DIM]


def _plain_sparse_flash_attention(q_latent, q_pe, kv_pages, block_table, sparse_indices, softmax_scale, **kwargs):
    """One npu_sparse_flash_attention call in MLA-absorb mode over the store's `SplitRows` pages, read in place: the
    latent plane `[N, P, C]` and the RoPE plane `[N, P, R]` viewed as the op's PA_BSND pools `[N, P, 1, C]` /
    `[N, P, 1, R]` (free views of contiguous planes; the op refuses non-contiguous keys). `sparse_indices` int32
    `[B, T, 1, K]`; kwargs: lengths, sparse_block_size, sparse_mode. Returns `[B, T, H, C]`."""
    torch_npu = torch_npu_module()
    latent_pages = kv_pages.latent.unsqueeze(2)
    rope_pages = kv_pages.rope.unsqueeze(2)
    if q_pe.shape[-1] == 0:  # NoPE: the op needs a 64-wide RoPE part; zeros add nothing to the scores
        q_pe = q_pe.new_zeros(*q_pe.shape[:-1], ROPE_DIM)
        rope_pages = _zero_rope_pages(*latent_pages.shape[:2], latent_pages.dtype, latent_pages.device)
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_latent.contiguous(),
        latent_pages,
        latent_pages,
        sparse_indices,
        softmax_scale,
        block_table=block_table.to(torch.int32).contiguous(),
        query_rope=q_pe.contiguous(),
        key_rope=rope_pages,
        layout_query="BSND",
        layout_kv="PA_BSND",
        attention_mode=2,
        **kwargs,
    )
    return out


def paged_sparse_mla_npu(q_latent, q_pe, keys: PagedKeys, indices, softmax_scale: float) -> torch.Tensor:
    """Sparse absorbed MLA through `torch_npu.npu_sparse_flash_attention` (MLA-absorb mode, module doc), same
    signature and result as `dsa_paged_fused.paged_sparse_mla_fused`. Returns `[B, T, H, C]` in q_latent's dtype."""
    check_sparse_inputs(q_latent, q_pe, keys, indices)
    kv_pages, block_table = keys.pages, keys.block_table
    page_size = _check_attention_shapes(q_latent, q_pe, kv_pages)
    batch, num_queries, num_selected = indices.shape
    if num_selected == 0:
        return q_latent.new_zeros(q_latent.shape)
    device = q_latent.device
    # Every mapped page (the table maps a prefix of pages, -1 after): the selected keys all lie in them.
    mapped_tokens = ((block_table >= 0).sum(dim=1) * page_size).to(torch.int32)
    return _sparse_flash_attention(
        q_latent,
        q_pe,
        kv_pages,
        block_table,
        _valid_first(indices).to(torch.int32).unsqueeze(2).contiguous(),
        softmax_scale,
        actual_seq_lengths_query=torch.full((batch,), num_queries, dtype=torch.int32, device=device),
        actual_seq_lengths_kv=mapped_tokens,
        sparse_block_size=1,
        sparse_mode=0,
    )


def paged_dense_mla_npu(q_latent, q_pe, keys: PagedKeys, softmax_scale: float) -> torch.Tensor:
    """Dense causal absorbed MLA through `torch_npu.npu_sparse_flash_attention` selecting every key, same signature
    and result as `dsa_paged_fused.paged_dense_mla_fused`.

    rightDownCausal (`sparse_mode=3`, `Lq = T`, `Lkv = query_start + T`) limits query `i` to the keys
    `<= query_start + i`. Without padding the selection is every page as one block (`sparse_block_size` = page size,
    the op clips the last block at the causal limit): `ceil(Lkv / P)` indices per query. With a padding mask it is
    every real key, one token per index, in ascending order (the op has no mask of its own)."""
    check_dense_inputs(q_latent, q_pe, keys)
    kv_pages, block_table, num_keys, query_start, key_padding_mask = keys[:5]
    page_size = _check_attention_shapes(q_latent, q_pe, kv_pages)
    batch, num_queries = q_latent.shape[:2]
    num_visible = query_start + num_queries
    _require(
        num_visible <= num_keys,
        f"queries at {query_start}..{num_visible - 1} must lie inside the {num_keys} cached keys",
    )
    device = q_latent.device
    if key_padding_mask is None and not isinstance(kv_pages, PackedKVRows):
        _require(page_size <= 128 and page_size & (page_size - 1) == 0, f"page size {page_size}: a power of 2 <= 128")
        block = page_size
        selection = torch.arange(-(-num_visible // page_size), device=device).expand(batch, -1)
    else:
        block = 1  # also for FP8 pages: the KV-quant op takes sparse_block_size 1 only on the 950 (its fp8 keys)
        real = torch.ones(batch, num_visible, dtype=torch.bool, device=device)
        if key_padding_mask is not None:
            real = key_padding_mask[:, :num_visible].bool()
        positions = (~real).to(torch.int8).argsort(dim=-1, stable=True)  # real keys first, ascending
        selection = positions.masked_fill(~real.gather(1, positions), -1)
    sparse_indices = selection[:, None, None, :].expand(-1, num_queries, 1, -1).to(torch.int32).contiguous()
    return _sparse_flash_attention(
        q_latent,
        q_pe,
        kv_pages,
        block_table,
        sparse_indices,
        softmax_scale,
        actual_seq_lengths_query=torch.full((batch,), num_queries, dtype=torch.int32, device=device),
        actual_seq_lengths_kv=torch.full((batch,), num_visible, dtype=torch.int32, device=device),
        sparse_block_size=block,
        sparse_mode=3,
    )


def paged_kpool_indexer_topk_npu(
    q_index, weights, keys: PagedKeys, index_topk: int, ape: torch.Tensor, select_tail: bool = True
) -> torch.Tensor:
    """k-pool indexer (docs/dsa.md §9) through `torch_npu.npu_lightning_indexer` over the stored pooled keys, same
    signature and result as `dsa_paged_fused.paged_kpool_indexer_topk_fused` (pools as a set per row).

    The pooled-key plane `[N, P / kp, DI]` is the op's PA_BSND pool with block size `P / kp` and our block table:
    its logical slot `j` of sequence `b` holds the pool ending at token `j·kp + phase_b` (pools start at the first
    real token, `phase_b = (origin_b + kp - 1) mod kp`), written once that pool is complete. A query at `q` sees the
    slots `j <= (q - phase_b) / kp`, which do not follow the op's causal diagonal (one key per query step), so every
    query is its own batch entry (`Lq = 1`, `Lk` = its visible slots, the block table repeated). Slots before the
    first pool hold no pool: the op is asked for that many more and they are dropped, as the padded keys of
    `paged_indexer_topk_npu`. Selected slots become pool ends, then tokens and the tail (`dsa_ops.kpool_expand`)."""
    check_kpool_inputs(q_index, weights, keys, index_topk, ape)
    _, block_table, num_keys, query_start, key_padding_mask, pool_pages, origin = keys
    _check_indexer_op(q_index, pool_pages, num_keys, query_start)  # pool_pages: block size P / kp
    batch, num_queries, num_heads, head_dim = q_index.shape
    kpool = ape.shape[0]
    device = q_index.device
    num_visible = query_start + num_queries
    if origin is None:
        origin = kpool_origin(key_padding_mask, batch, num_visible, device)
    num_selected = min(index_topk // kpool, num_visible // kpool)
    if num_selected == 0:
        empty = torch.empty(batch, num_queries, 0, dtype=torch.int64, device=device)
        return kpool_expand(empty, kpool, query_start, origin, select_tail)
    first_pool_end = origin + kpool - 1
    phase = first_pool_end % kpool
    first_slot = first_pool_end // kpool  # [B]: slots below it hold no pool
    positions = torch.arange(query_start, query_start + num_queries, device=device)
    visible_slots = (torch.div(positions[None, :] - phase[:, None], kpool, rounding_mode="floor") + 1).clamp(min=0)
    torch_npu = torch_npu_module()
    scaled_weights = scaled_index_weights(weights, head_dim)
    rows = batch * num_queries
    slots, _ = torch_npu.npu_lightning_indexer(
        q_index.reshape(rows, 1, num_heads, head_dim).contiguous(),
        pool_pages.unsqueeze(2),
        scaled_weights.reshape(rows, 1, num_heads).contiguous(),
        actual_seq_lengths_query=torch.ones(rows, dtype=torch.int32, device=device),
        actual_seq_lengths_key=visible_slots.reshape(rows).to(torch.int32),
        block_table=block_table.to(torch.int32).repeat_interleave(num_queries, dim=0).contiguous(),
        layout_query="BSND",
        layout_key="PA_BSND",
        sparse_count=_sparse_count(num_selected + int(first_slot.max())),
        sparse_mode=0,
    )
    slots = slots.view(batch, num_queries, -1).long()
    slots = _valid_first(slots.masked_fill(slots < first_slot[:, None, None], -1))[..., :num_selected]
    pool_ends = torch.where(slots >= 0, slots * kpool + phase[:, None, None], -1)
    return kpool_expand(pool_ends, kpool, query_start, origin, select_tail)


# ----------------------------------------------------------------------------------------------------------------
# Three-stream prolog of a DSA decode step (docs/backends.md §2)
#
# As the CANN recipe's DeepSeek-V3.2 decode (hicann/cann-recipes-infer, models/deepseek_v3_2_exp/models/indexer.py):
# the indexer's query branch (wq_b + RoPE) on one side stream, its head-weights projection on another, the keys on
# the main stream, ordered by events. Stream semantics (Ascend/pytorch torch_npu/npu/streams.py, as torch.cuda's):
# `Stream.wait_event(e)` makes the work submitted to the stream afterwards wait for the work `e` captured when it was
# recorded. Allocator safety (PyTorch's CUDA semantics, "use of multiple streams"): memory is reused per allocating
# stream, so a tensor used on another stream than the one that allocated it is marked with `record_stream` there.

_PROLOG_STREAMS: dict[str, tuple] = {}


def _prolog_streams(device: torch.device) -> tuple:
    """The two side streams of the prolog on `device`, created once per device."""
    key = str(device)
    if key not in _PROLOG_STREAMS:
        _PROLOG_STREAMS[key] = (torch.npu.Stream(device), torch.npu.Stream(device))
    return _PROLOG_STREAMS[key]


def _event_on(stream):
    event = torch.npu.Event()
    event.record(stream)
    return event


def three_stream_prolog(layer, hidden_states: torch.Tensor, position_embeddings):
    """The projections of `KDSASparseAttention.project` (same values, same return) with the indexer's query branch
    and head weights on side streams: the weights stream starts once `hidden_states` is ready, the query stream
    once the MLA query latent is; the main stream computes the MLA queries, the latent and the indexer key
    meanwhile, and waits for both side streams before returning their outputs."""
    indexer = layer.indexer
    main = torch.npu.current_stream(hidden_states.device)
    query_stream, weights_stream = _prolog_streams(hidden_states.device)
    rope = () if position_embeddings is None else tuple(position_embeddings)

    inputs_ready = _event_on(main)
    hidden_states.record_stream(weights_stream)
    with torch.npu.stream(weights_stream):
        weights_stream.wait_event(inputs_ready)
        weights = indexer.project_weights(hidden_states)
        weights_done = _event_on(weights_stream)

    q_nope, q_pe, query_input = layer.project_queries(hidden_states, position_embeddings)
    query_ready = _event_on(main)
    for tensor in (query_input, *rope):
        tensor.record_stream(query_stream)
    with torch.npu.stream(query_stream):
        query_stream.wait_event(query_ready)
        q_index = indexer.project_query(query_input, position_embeddings)
        query_done = _event_on(query_stream)

    latent, k_pe = layer.project_latent(hidden_states, position_embeddings)
    k_index = indexer.project_key(hidden_states, position_embeddings)

    main.wait_event(weights_done)
    main.wait_event(query_done)
    weights.record_stream(main)
    q_index.record_stream(main)
    return q_nope, q_pe, latent, k_pe, (q_index, weights, k_index)


def npu_kv_store(formats, kv_rows: torch.Tensor, latent_width: int):
    """kv rows `[..., C + R]` in the layouts torch_npu's attention ops read in place (docs/backends.md §2):
    model-dtype rows as `SplitRows` (latent and RoPE planes, two contiguous page pools), FP8 rows as `PackedKVRows`
    (one packed byte row per token)."""
    if formats.kv_cache == "bf16":
        return SplitRows(kv_rows[..., :latent_width], kv_rows[..., latent_width:])
    return PackedKVRows.pack(formats.encode_kv_rows(kv_rows, latent_width))


__all__ = [
    "npu_kv_store",
    "paged_dense_mla_npu",
    "paged_indexer_topk_npu",
    "paged_kpool_indexer_topk_npu",
    "paged_sparse_mla_npu",
    "three_stream_prolog",
    "torch_npu_module",
]
