"""MLA layers: dense causal MLA (`KDSAMultiLatentAttention`, docs/dsa.md §8) and the DSA layer built on it, MLA with a
Lightning Indexer and top-k sparse attention over the compressed latent cache (`KDSASparseAttention`).

docs/dsa.md §1 (indexer: `[rope | nope]` vectors, NeoX RoPE, LayerNorm-with-bias `k_norm`, fp32 head
weights), §2.1 (MLA projections, scale `qk_head_dim^-0.5 · mscale²`), §2.3 (absorbed form), §5 (one path for
prefill and decode; context <= index_topk equals dense causal MLA). Weight names follow DeepSeek /
transformers' DeepseekV32 so checkpoints load by name. Kernels live in dsa_ops.py.

Legend: `B` batch, `T` current tokens, `S` cached + current tokens, `D` hidden_size, `H` heads, `C` kv_lora_rank,
`R` qk_rope_head_dim, `Dn` qk_nope_head_dim, `Dv` v_head_dim, `HI`/`DI` indexer heads / head dim.
"""

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KDSAPagedMLALayer, PageView, attention_store_class
from .dsa_ops import QUERY_BLOCK_SIZE
from .dsa_paged_common import PagedKeys
from .kernels import KernelSet, kernel_set
from .linear import KDSALinear
from .norms import KDSARMSNorm
from .rotary import apply_rotary_half, apply_rotary_interleaved
from .sequence_parallel import SequenceParallelContext

# Query rows (batch × tokens) up to which `absorbed_weights` hands out views: the most rows the CPU head kernels take
# (`cpu_row_linear.MAX_ROWS`); more rows run the einsums of the reference on contiguous copies.
FEW_QUERY_ROWS = 16


# ------------------------------------------------------------------------------------ paged reads (docs/dsa.md §14)
# The layer picks the kernel (from its backend's KernelSet, kernels.py) and runs it over a store's planes and page
# view; the store allocates, encodes and counts, and says only whether the read must take the fixed-shape `static_*`
# kernels (a static store inside a compiled region, static_cache.py). Contracts: dsa_paged_reference.py.
def paged_keys(view: PageView, pages, pool_pages=None) -> PagedKeys:
    """The kernels' paged-key argument (`PagedKeys`, dsa_paged_common.py): the plane `pages` read through `view`."""
    return PagedKeys(
        pages, view.block_table, view.num_tokens, view.query_start, view.key_padding_mask, pool_pages, view.pool_origin
    )


def paged_kernel(kernels: KernelSet, name: str, view: PageView):
    """The kernel `name` of `kernels`, or its fixed-shape `static_*` form when the view asks for it."""
    return kernels.require(f"static_{name}" if view.fixed_shape else name)


def paged_dense_attention(
    kernels: KernelSet,
    store: KDSAPagedMLALayer,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    query_start,
    softmax_scale: float,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense causal absorbed-form attention over every cached token of `store` (queries at `query_start + i`)."""
    view = store.key_view(query_start, key_padding_mask)
    return paged_kernel(kernels, "dense_mla", view)(q_latent, q_pe, paged_keys(view, store.kv_pages), softmax_scale)


def paged_sparse_attention(
    kernels: KernelSet,
    store: KDSAPagedMLALayer,
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Absorbed-form attention over exactly the cached entries of `store` at `indices` `[B, T, K]` (-1 = none)."""
    view = store.selection_view()
    keys = paged_keys(view, store.kv_pages)
    return paged_kernel(kernels, "sparse_mla", view)(q_latent, q_pe, keys, indices, softmax_scale)


def paged_indexer_topk(
    kernels: KernelSet,
    store,
    q_index: torch.Tensor,
    weights: torch.Tensor,
    query_start,
    index_topk: int,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-`index_topk` cached positions per query over the indexer keys of a DSA `store` (`KDSAPagedLayer`); the
    queries are first encoded as the keys are stored (`encode_index_queries`: MXFP8-rounded with MXFP8 keys)."""
    q_index = store.encode_index_queries(q_index)
    view = store.key_view(query_start, key_padding_mask)
    keys = paged_keys(view, store.index_pages)
    return paged_kernel(kernels, "indexer_topk", view)(q_index, weights, keys, index_topk)


def paged_kpool_indexer_topk(
    kernels: KernelSet,
    store,
    q_index: torch.Tensor,
    weights: torch.Tensor,
    query_start,
    index_topk: int,
    key_padding_mask: torch.Tensor | None,
    ape: torch.Tensor,
    select_tail: bool,
) -> torch.Tensor:
    """k-pool indexer top-k over the pools of a `KDSAPagedKPoolLayer` store (docs/dsa.md §9): token positions
    `[B, T, K]`, -1 = none. The paged kernel takes the origin the store keeps (`view.pool_origin`, checked when
    written); the fixed-shape one finds it from the capacity-padded mask."""
    view = store.key_view(query_start, key_padding_mask)
    keys = paged_keys(view, store.index_pages, store.pool_pages)
    return paged_kernel(kernels, "kpool_indexer_topk", view)(q_index, weights, keys, index_topk, ape, select_tail)


def mla_softmax_scale(config) -> float:
    """`qk_head_dim^-0.5`, times `mscale²` for YaRN-style rope with `mscale_all_dim` (docs/dsa.md §2),
    as transformers' `yarn_apply_mscale`."""
    scale = config.qk_head_dim**-0.5
    rope_parameters = config.rope_parameters
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    factor = rope_parameters.get("factor", 1.0)
    if rope_parameters.get("rope_type", "default") != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class KDSAIndexer(nn.Module):
    """Lightning Indexer projections: per-head queries, one shared key and fp32 head weights per token.

    `wq_b` reads the MLA query latent (`q_a_layernorm(q_a_proj(x))`, width q_lora_rank) as in DeepSeek; when
    `q_lora_rank is None` there is no query latent and `wq_b` reads the hidden state (width hidden_size) instead.
    Vectors are laid out `[rope | nope]` with NeoX (half-split) RoPE on the first `qk_rope_head_dim` channels.
    Scoring and top-k are in dsa_ops (`indexer_topk`) because they read the cached keys.

    With `index_kpool > 1` (GLM-5.3-Flash, docs/dsa.md §9) keys are pooled over groups of `index_kpool` tokens:
    `index_kpool_compress_gate` `[DI, D]` gives each token per-channel gate scores, `index_kpool_compress_ape`
    `[kp, DI]` a learned bias per position in the pool; the cache pools `softmax_pool(gate + ape) · key`.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel_backend = config.kernel_backend
        projection = partial(KDSALinear, kernel_backend=config.kernel_backend)
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        query_input_dim = config.hidden_size if config.q_lora_rank is None else config.q_lora_rank
        self.wq_b = projection(query_input_dim, self.n_heads * self.head_dim, bias=False)
        self.wk = projection(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = projection(config.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        self.index_kpool = config.index_kpool
        if self.index_kpool > 1:
            # GLM-5.3-Flash's names, so its checkpoints load by name.
            self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.index_kpool, self.head_dim))
            self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, config.hidden_size))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rope, nope = x.split([self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
        return torch.cat((apply_rotary_half(rope, cos, sin), nope), dim=-1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        query_input: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states: `[B, T, D]`; query_input: `[B, T, q_lora_rank]` (or `[B, T, D]` without q LoRA);
        position_embeddings: `(cos, sin)` `[B, T, R]` or None (NoPE).

        Returns `q_index` `[B, T, HI, DI]`, `weights` `[B, T, HI]` fp32, `k_index` `[B, T, DI]` (to be cached; with
        the k-pool indexer `[B, T, 2·DI]`: the key, then its gate scores).
        """
        return (
            self.project_query(query_input, position_embeddings),
            self.project_weights(hidden_states),
            self.project_key(hidden_states, position_embeddings),
        )

    # The three branches of `forward`, separately: the npu backend runs them on different streams
    # (npu_kernels.three_stream_prolog).
    def project_query(self, query_input: torch.Tensor, position_embeddings) -> torch.Tensor:
        """`q_index` `[B, T, HI, DI]` from the query input, RoPE'd."""
        batch, seq_len, _ = query_input.shape
        q_index = self.wq_b(query_input).view(batch, seq_len, self.n_heads, self.head_dim)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q_index = self._rotate(q_index, cos[:, :, None], sin[:, :, None])
        return q_index

    def project_weights(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Head weights `[B, T, HI]` in fp32 (docs/dsa.md §1); the model keeps `weights_proj` in fp32 too."""
        row_linear = kernel_set(self.kernel_backend, hidden_states.device).row_linear
        return row_linear(hidden_states.float(), self.weights_proj.weight.float())

    def project_key(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """`k_index` `[B, T, DI]` (k-pool indexer: `[B, T, 2·DI]`, the key then its gate scores)."""
        k_index = self.wk(hidden_states)
        # LayerNorm statistics in fp32 whatever the parameter dtype (docs/dsa.md §1).
        k_index = F.layer_norm(
            k_index.float(),
            (self.head_dim,),
            self.k_norm.weight.float(),
            self.k_norm.bias.float(),
            self.k_norm.eps,
        ).to(hidden_states.dtype)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            k_index = self._rotate(k_index, cos, sin)
        if self.index_kpool > 1:
            row_linear = kernel_set(self.kernel_backend, hidden_states.device).row_linear
            gate_scores = row_linear(hidden_states, self.index_kpool_compress_gate.to(hidden_states.dtype))
            k_index = torch.cat([k_index, gate_scores], dim=-1)
        return k_index


class KDSAMultiLatentAttention(nn.Module):
    """Dense causal MLA (layer type `"full_attention"`, Kimi-Linear's attention layers; docs/dsa.md §8), and the base
    of the DSA layer, which adds the Lightning Indexer (`KDSASparseAttention`).

    Projections (docs/dsa.md §2): queries through the q LoRA (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) or `q_proj`;
    one shared latent `kv_a_proj_with_mqa(x) = [c | k_pe]`, `c` normalised by `kv_a_layernorm`; `kv_b_proj` holds the
    per-head key/value up-projections, absorbed into queries and outputs (§3). The cache keeps only `[c | k_pe]`
    per token. `mla_use_nope` keeps the rope slice of `q` and `k_pe` but never rotates it; `mla_layernorm_eps` is
    the eps of the two latent norms (None = rms_norm_eps); `mla_use_output_gate` gates the output (`output`).
    Attention runs in the absorbed form over the pages, `query_block_size` queries at a time, with the store's dense
    kernel (online softmax over blocks of pages).
    """

    store_class = KDSAPagedMLALayer

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.kernel_backend = config.kernel_backend
        projection = partial(KDSALinear, kernel_backend=config.kernel_backend)
        # MLA rotates its rope slice unless the config keeps it unrotated (Kimi-Linear).
        self.rotates = self.qk_rope_head_dim > 0 and not config.mla_use_nope
        # Read when a store is built (`_store`): `quantization_config` is attached after __init__ on load.
        self.config = config
        self.softmax_scale = mla_softmax_scale(config)
        # Bounds prefill memory (dsa_ops.QUERY_BLOCK_SIZE); results do not depend on it.
        self.query_block_size = QUERY_BLOCK_SIZE
        norm_eps = config.rms_norm_eps if config.mla_layernorm_eps is None else config.mla_layernorm_eps

        if self.q_lora_rank is None:
            self.q_proj = projection(self.hidden_size, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = projection(self.hidden_size, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = KDSARMSNorm(self.q_lora_rank, eps=norm_eps)
            self.q_b_proj = projection(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = projection(
            self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias
        )
        self.kv_a_layernorm = KDSARMSNorm(self.kv_lora_rank, eps=norm_eps)
        # No bias: absorbing W_UK / W_UV into the query / output needs a purely linear up-projection.
        self.kv_b_proj = projection(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = projection(self.num_heads * self.v_head_dim, self.hidden_size, bias=config.attention_bias)
        # Kimi K3's gated MLA (docs/kimi-k3.md §2): the attention output times sigmoid(g_proj(x)) before o_proj.
        self.g_proj = (
            projection(self.hidden_size, self.num_heads * self.v_head_dim, bias=False)
            if config.mla_use_output_gate
            else None
        )

    def output(self, attn_output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """`o_proj` of the attention output `[B, T, H·Dv]`, gated by `sigmoid(g_proj(hidden_states))` when the
        config has `mla_use_output_gate`. Returns `[B, T, D]`."""
        if self.g_proj is not None:
            attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn_output)

    @property
    def uses_position_embeddings(self) -> bool:
        """Whether forward needs `(cos, sin)`: only when something in the layer rotates."""
        return self.rotates

    def project_queries(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns `q_nope` `[B, T, H, Dn]`, `q_pe` `[B, T, H, R]` (RoPE'd unless `mla_use_nope`) and the indexer's
        query input (the q latent `[B, T, q_lora_rank]`, or `hidden_states` without q LoRA)."""
        batch, seq_len, _ = hidden_states.shape
        if self.q_lora_rank is None:
            query_input = hidden_states
            q = self.q_proj(hidden_states)
        else:
            query_input = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(query_input)
        q = q.view(batch, seq_len, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        if self.rotates:
            cos, sin = position_embeddings
            q_pe = apply_rotary_interleaved(q_pe, cos[:, :, None], sin[:, :, None])
        return q_nope, q_pe, query_input

    def project_latent(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns what the cache stores per token: the normalised latent `[B, T, C]` and `k_pe` `[B, T, R]`
        (RoPE'd unless `mla_use_nope`)."""
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)
        if self.rotates:
            cos, sin = position_embeddings
            k_pe = apply_rotary_interleaved(k_pe, cos, sin)
        return latent, k_pe

    def absorbed_weights(self, q_nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_UK` `[H, Dn, C]` and `W_UV` `[H, Dv, C]` from `kv_b_proj.weight` (docs/dsa.md §3), for the queries
        `q_nope` `[B, T, H, Dn]`: views for up to `FEW_QUERY_ROWS` query rows (a decode step or a verification: the
        backend's `head_matmul` / `head_linear` read them in place or copy them once, docs/dsa.md §13), else
        contiguous copies, made once for all query blocks of the forward."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        w_uk, w_uv = weight[:, : self.qk_nope_head_dim], weight[:, self.qk_nope_head_dim :]
        if q_nope.shape[0] * q_nope.shape[1] <= FEW_QUERY_ROWS:
            return w_uk, w_uv
        return w_uk.contiguous(), w_uv.contiguous()

    def _store(self, cache) -> KDSAPagedMLALayer:
        """This layer's paged store: the cache's, or a private one for a forward without cache, so that prefill and
        decode always run the same kernels over the same layout and formats (a quantized cache quantizes a
        cache-less forward too)."""
        if cache is None:
            return self.store_class.from_config(self.config)
        layers = getattr(cache, "layers", [])
        store = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        # Store classes extend each other by planes (a DSA store is a dense-MLA store with an indexer plane more):
        # the class must be exactly the one whose planes this layer writes (a fixed-capacity store names the paged
        # store whose planes it holds in `layout_class`, docs/graph-mode.md §2).
        if getattr(store, "layout_class", type(store)) is not self.store_class:
            raise ValueError(
                f"{type(self).__name__} layer {self.layer_idx} needs a KDSACache ({self.store_class.__name__} store); "
                f"got {type(cache).__name__}. Build it with `KDSACache(config)` or let generate() create it"
            )
        return store

    def _check_inputs(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [batch, seq_len, hidden_size={self.hidden_size}], "
                f"got shape {tuple(hidden_states.shape)}"
            )
        if not self.uses_position_embeddings:
            if position_embeddings is not None:
                raise ValueError(
                    "position_embeddings must be None for a NoPE layer, which rotates nothing (qk_rope_head_dim=0, or "
                    "mla_use_nope without an indexer)"
                )
            return
        if position_embeddings is None:
            raise ValueError(
                f"position_embeddings (cos, sin) are required: qk_rope_head_dim={self.qk_rope_head_dim} (use "
                "KDSARotaryEmbedding)"
            )
        expected = (*hidden_states.shape[:2], self.qk_rope_head_dim)
        for name, tensor in zip(("cos", "sin"), position_embeddings, strict=True):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"position_embeddings {name} must have shape {expected}, got {tuple(tensor.shape)}")

    def _require_read_kernels(self, kernels: KernelSet) -> None:
        """The paged kernels this layer reads its store with, or the backend's ValueError: checked before the store
        is written, so a backend without one leaves the cache as it was."""
        kernels.require("dense_mla")

    @staticmethod
    def _check_attention_mask(attention_mask: torch.Tensor | None, batch: int, num_keys: int) -> None:
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, num_keys):
            raise ValueError(
                f"attention_mask must be a 2-D padding mask [batch={batch}, past + current tokens={num_keys}], "
                f"got shape {tuple(attention_mask.shape)}"
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        sequence_parallel: SequenceParallelContext | None = None,
    ) -> torch.Tensor:
        """hidden_states `[B, T, D]`; position_embeddings `(cos, sin)` `[B, T, R]` for the current tokens, or None
        when the layer rotates nothing; attention_mask `[B, S]` over past + current keys (1 = real, 0 = padding) or
        None; cache: a `KDSACache` (the layer runs its backend's dense kernel over the cache's paged store for this
        layer), or None.
        Query `i` sits at cache position `past_len + i` and attends to every visible key `<= past_len + i`.
        sequence_parallel: the T tokens are this process's share of a sequence that starts here (docs/parallel.md
        §7): the keys of the whole sequence are gathered, the queries are the local ones at their own positions.
        Returns `[B, T, D]`."""
        self._check_inputs(hidden_states, position_embeddings)
        batch, seq_len, _ = hidden_states.shape
        q_nope, q_pe, _ = self.project_queries(hidden_states, position_embeddings)
        latent, k_pe = self.project_latent(hidden_states, position_embeddings)
        kv_rows = torch.cat([latent, k_pe], dim=-1)
        # Validate everything before the cache is written, so that bad input never leaves it half-updated.
        store = self._store(cache)
        self._check_attention_mask(attention_mask, batch, store.mask_width(seq_len))
        kernels = kernel_set(self.kernel_backend, q_nope.device)
        self._require_read_kernels(kernels)
        if sequence_parallel is not None:
            (kv_rows,) = sequence_parallel.gather_sequence([kv_rows], "mla_latent")
        past_len = store.append(kv_rows)  # int, or a 0-d tensor in a static cache

        w_uk, w_uv = self.absorbed_weights(q_nope)
        outputs = []
        for block, position, padding in self._query_blocks(seq_len, past_len, sequence_parallel):
            if block is None:  # padding slots of a sequence-parallel share: no query
                outputs.append(q_nope.new_zeros(batch, padding, self.num_heads, self.v_head_dim))
                continue
            q_latent = kernels.head_matmul(q_nope[:, block], w_uk)
            out_latent = paged_dense_attention(
                kernels, store, q_latent, q_pe[:, block].contiguous(), position, self.softmax_scale, attention_mask
            )
            outputs.append(kernels.head_linear(out_latent, w_uv))
        attn_output = torch.cat(outputs, dim=1).reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        return self.output(attn_output, hidden_states)

    def _query_blocks(self, seq_len: int, past_len, sequence_parallel: SequenceParallelContext | None):
        """The query loop of both layers, in local order: `(rows, position of the first row, 0)` per block of at most
        `query_block_size` queries, and `(None, None, n)` for `n` padding slots of a sequence-parallel share. One
        process: the `seq_len` current tokens from cache position `past_len`."""
        segments = [(past_len, seq_len, 0)] if sequence_parallel is None else sequence_parallel.query_segments()
        blocks, row = [], 0
        for position, count, padding in segments:
            for start in range(0, count, self.query_block_size):
                end = min(start + self.query_block_size, count)
                blocks.append((slice(row + start, row + end), position + start, 0))
            if padding:
                blocks.append((None, None, padding))
            row += count + padding
        return blocks


class KDSASparseAttention(KDSAMultiLatentAttention):
    """MLA whose queries attend only to the `index_topk` cached entries the indexer picks (one set for all heads).

    Prefill and decode share one path: indexer top-k, then sparse attention in the absorbed (latent) form over the
    selected `[c | k_pe]` entries, processed in blocks of `query_block_size` queries. The cache stores only the
    normalised latent `c` `[C]`, `k_pe` `[R]` and the indexer key `[DI]` per token. The indexer rotates its rope
    channels even under `mla_use_nope`.

    GLM-5.3-Flash variants: with `index_kpool > 1` the indexer scores pooled keys (docs/dsa.md §9); a layer marked
    `"shared"` in `indexer_types` has no indexer and attends to the selection of the layer before it (§10).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.index_topk = config.index_topk
        self.shares_indexer = config.indexer_types[layer_idx] == "shared"
        self.indexer = None if self.shares_indexer else KDSAIndexer(config, layer_idx)
        self.index_kpool = config.index_kpool
        self.index_kpool_always_select_tail = config.index_kpool_always_select_tail
        # The most keys one query's selection names: the k-pool indexer adds the query's incomplete pool (§9).
        tail = config.index_kpool - 1 if config.index_kpool > 1 and self.index_kpool_always_select_tail else 0
        self.selection_width = self.index_topk + tail
        self.store_class = attention_store_class(config, layer_idx)

    @property
    def uses_position_embeddings(self) -> bool:
        if self.indexer is None:
            return self.rotates
        return self.qk_rope_head_dim > 0  # the indexer rotates whatever MLA does

    def project(self, hidden_states: torch.Tensor, position_embeddings):
        """The projections of a step: `q_nope`, `q_pe`, the latent and `k_pe` to cache, and the indexer's `(q_index,
        weights, k_index)` (None for a shared-indexer layer). A decode step of a layer with its own indexer runs the
        backend's `dsa_decode_prolog` (on the npu backend three streams, npu_kernels.three_stream_prolog,
        docs/backends.md §2), with the same values."""
        if self.indexer is not None and hidden_states.shape[1] == 1 and not torch.compiler.is_compiling():
            prolog = kernel_set(self.kernel_backend, hidden_states.device).require("dsa_decode_prolog")
            return prolog(self, hidden_states, position_embeddings)
        return self.project_in_order(hidden_states, position_embeddings)

    def project_in_order(self, hidden_states: torch.Tensor, position_embeddings):
        """`project`'s values, computed one after the other on the current stream."""
        q_nope, q_pe, query_input = self.project_queries(hidden_states, position_embeddings)
        latent, k_pe = self.project_latent(hidden_states, position_embeddings)
        indexed = None if self.indexer is None else self.indexer(hidden_states, query_input, position_embeddings)
        return q_nope, q_pe, latent, k_pe, indexed

    def _require_read_kernels(self, kernels: KernelSet) -> None:
        kernels.require("sparse_mla")
        if not self.shares_indexer:
            kernels.require("kpool_indexer_topk" if self.index_kpool > 1 else "indexer_topk")

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        topk_indices: torch.Tensor | None = None,
        return_topk_indices: bool = False,
        sequence_parallel: SequenceParallelContext | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states `[B, T, D]`; position_embeddings `(cos, sin)` `[B, T, R]` for the current tokens or None
        (NoPE); attention_mask `[B, S]` over past + current keys (1 = real, 0 = padding) or None; cache: a
        `KDSACache` (the layer runs its backend's indexer and sparse-attention kernels over the cache's paged store
        for this layer), or None.
        Query `i` sits at cache position `past_len + i`. Returns `[B, T, D]`.

        topk_indices `[B, T, K]`: the selection of the previous layer, required by (and only by) a shared-indexer
        layer. `return_topk_indices`: also return this layer's selection `[B, T, K]` (-1 = none) for the next one.
        sequence_parallel: as in `KDSAMultiLatentAttention.forward`; the indexer top-k of each query block goes
        through its `indexer_topk` hook (docs/parallel.md §7).
        """
        self._check_inputs(hidden_states, position_embeddings)
        batch, seq_len, _ = hidden_states.shape
        if self.shares_indexer != (topk_indices is not None):
            raise ValueError(
                f"DSA layer {self.layer_idx} is {'a shared-indexer' if self.shares_indexer else 'a full-indexer'} "
                f"layer (indexer_types): topk_indices from the previous layer are "
                f"{'required' if self.shares_indexer else 'not accepted'}"
            )
        if topk_indices is not None and (topk_indices.dim() != 3 or tuple(topk_indices.shape[:2]) != (batch, seq_len)):
            raise ValueError(f"topk_indices must be [batch={batch}, {seq_len}, K], got {tuple(topk_indices.shape)}")
        q_nope, q_pe, latent, k_pe, indexed = self.project(hidden_states, position_embeddings)
        kv_rows = torch.cat([latent, k_pe], dim=-1)
        # Validate everything before the cache is written, so that bad input never leaves it half-updated.
        store = self._store(cache)
        self._check_attention_mask(attention_mask, batch, store.mask_width(seq_len))
        kernels = kernel_set(self.kernel_backend, q_nope.device)
        self._require_read_kernels(kernels)
        # `past_len`: an int, or a 0-d tensor in a static cache (docs/graph-mode.md §2).
        ape = None
        if self.shares_indexer:
            if sequence_parallel is not None:
                (kv_rows,) = sequence_parallel.gather_sequence([kv_rows], "mla_latent")
            past_len = store.append(kv_rows)
        else:
            q_index, index_weights, k_index = indexed
            if sequence_parallel is not None:
                kv_rows, k_index = sequence_parallel.gather_sequence([kv_rows, k_index], "dsa_latent_and_index_keys")
            ape = getattr(self.indexer, "index_kpool_compress_ape", None)
            if self.index_kpool > 1:
                past_len = store.append(kv_rows, k_index, attention_mask, ape)
            else:
                past_len = store.append(kv_rows, k_index)

        w_uk, w_uv = self.absorbed_weights(q_nope)
        outputs, selections = [], []
        for block, position, padding in self._query_blocks(seq_len, past_len, sequence_parallel):
            if block is None:  # padding slots of a sequence-parallel share: no query, no selection
                outputs.append(q_nope.new_zeros(batch, padding, self.num_heads, self.v_head_dim))
                if return_topk_indices:
                    selections.append(torch.full((batch, padding, 1), -1, dtype=torch.long, device=q_nope.device))
                continue
            if topk_indices is not None:
                indices = topk_indices[:, block]
            elif sequence_parallel is not None:
                select = partial(self._select_topk, store, attention_mask, ape)
                indices = sequence_parallel.indexer_topk(
                    select, q_index[:, block], index_weights[:, block], position, self.selection_width
                )
            else:
                indices = self._select_topk(
                    store, attention_mask, ape, q_index[:, block], index_weights[:, block], position
                )
            q_latent = kernels.head_matmul(q_nope[:, block], w_uk)
            out_latent = paged_sparse_attention(kernels, store, q_latent, q_pe[:, block], indices, self.softmax_scale)
            outputs.append(kernels.head_linear(out_latent, w_uv))
            if return_topk_indices:
                selections.append(indices)
        attn_output = torch.cat(outputs, dim=1).reshape(batch, seq_len, self.num_heads * self.v_head_dim)
        attn_output = self.output(attn_output, hidden_states)
        if not return_topk_indices:
            return attn_output
        # Blocks select up to different widths (early blocks see fewer keys): pad with -1 (no key).
        width = max(indices.shape[-1] for indices in selections)
        selections = [F.pad(indices, (0, width - indices.shape[-1]), value=-1) for indices in selections]
        return attn_output, torch.cat(selections, dim=1)

    def _select_topk(self, store, attention_mask, ape, q_index, weights, position) -> torch.Tensor:
        """The indexer's top-k `[B, n, k]` for a block of `n` queries at cache positions `position …`."""
        kernels = kernel_set(self.kernel_backend, q_index.device)
        if self.index_kpool > 1:
            return paged_kpool_indexer_topk(
                kernels, store, q_index, weights, position, self.index_topk, attention_mask, ape,
                self.index_kpool_always_select_tail,
            )  # fmt: skip
        return paged_indexer_topk(kernels, store, q_index, weights, position, self.index_topk, attention_mask)


__all__ = [
    "KDSAIndexer",
    "KDSAMultiLatentAttention",
    "KDSASparseAttention",
    "mla_softmax_scale",
    "paged_dense_attention",
    "paged_indexer_topk",
    "paged_kpool_indexer_topk",
    "paged_sparse_attention",
]
