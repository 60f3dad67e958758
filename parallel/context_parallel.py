"""Context-parallel prefill of a whole KDSA model: every rank runs the layers on its own tokens only.

docs/parallel.md §2 (zigzag layout), §3 (KDA state passing with zigzag, halo tokens for the short conv), §4 (DSA
under CP: all-gather the latent and indexer keys, restore the causal order, each rank runs the indexer and sparse
attention for its own queries with per-segment causal limits).

One forward, per rank, composed from the layers' public pieces (nothing in the model files changes):
- embeddings of the local tokens, rotary tables at their original positions;
- KDA layer: projections and gates on the local tokens; the short conv gets its `W−1` halo tokens before each
  segment from the ranks that hold them; every segment is summarised as an affine map of its start state
  (state_passing.py); one all-gather of the `2·cp` summaries; each rank folds the prefix in fp32 and finishes its
  segments locally (no rank-to-rank chain);
- DSA layer: queries, latent `[c | k_pe]` and indexer keys on the local tokens; one all-gather of the keys, put back
  in sequence order into a paged store (the `KDSACache` layer when a cache is built); each segment's queries run the
  indexer top-k and the sparse attention with the causal limit of their own positions. Under tensor parallelism
  the tp ranks split those queries for the indexer and all-gather the selected indices;
- dense MLA layer (`"full_attention"`): the same with the latent rows only and no indexer: each segment's queries
  attend densely to every gathered key up to their own position (docs/dsa.md §8);
- MoE / MLP (SwiGLU clamp included) / AttnRes / mHC hyper-connections / norms are position-wise: they run on the
  local tokens as they are (the model's own `residual_stream`);
- final norm and head on the local tokens, logits gathered and put back in order (or only the last token's).

Limits: batches of equal-length prompts without padding mask (prefill from an empty cache); no autograd.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modeling_kdsa.cache import KDSACache, KDSAPagedLayer, KDSAPagedMLALayer
from modeling_kdsa.configuration_kdsa import DSA_LAYER, KDA_LAYER
from modeling_kdsa.dsa_ops import ScoredPairs
from modeling_kdsa.kda_ops import causal_short_conv, kda_gate, l2norm
from modeling_kdsa.static_cache import KDSAStaticCache

from .mesh import ParallelMesh, raise_on_all_ranks
from .state_passing import fold_start_states, summarize_segment
from .tensor_parallel import tensor_parallel_errors
from .zigzag import LAYOUTS, SequenceLayout


@dataclass
class PrefillStats:
    """What one rank did: `indexer_pairs` (query, key) pairs the indexer kernels scored on this rank (summed over the
    batch; counted by the kernels, `dsa_ops.ScoredPairs`: the fused CPU kernel scores whole pages), `indexer_seconds`,
    seconds per layer kind, and the mesh's `CommLog` bytes by tag."""

    indexer_pairs: int = 0
    indexer_seconds: float = 0.0
    seconds_by_kind: dict[str, float] = field(default_factory=dict)

    def add_time(self, kind: str, seconds: float) -> None:
        self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + seconds


@dataclass
class PrefillOutput:
    """`logits` `[B, T, V]` in the original order (or `[B, 1, V]` for the last token only), the filled `cache`
    (or None) and this rank's `stats`."""

    logits: torch.Tensor
    cache: KDSACache | None
    stats: PrefillStats


@dataclass
class _RankView:
    """What the layer functions need to know about this rank's share of the sequence."""

    mesh: ParallelMesh
    layout: SequenceLayout
    positions: torch.Tensor  # [L] original positions of the local tokens, -1 for padding slots
    real: torch.Tensor  # [L] bool, False for padding slots
    stats: PrefillStats

    @property
    def segments(self):
        return self.layout.segments_of(self.mesh.cp_rank)


# ------------------------------------------------------------------------------------------------------ checks


def _prefill_error(model, input_ids: torch.Tensor, mesh: ParallelMesh, layout: str, cache) -> str | None:
    config = model.config
    if input_ids.dim() != 2:
        return f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}"
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    seq_len = input_ids.shape[1]
    if seq_len < 2 * mesh.cp_size:
        return (
            f"sequence of {seq_len} tokens is shorter than the 2·cp = {2 * mesh.cp_size} chunks context parallelism "
            f"cuts it into (cp={mesh.cp_size}); use a smaller cp or a longer prompt"
        )
    if seq_len > config.max_position_embeddings:
        return f"sequence length {seq_len} exceeds max_position_embeddings={config.max_position_embeddings}"
    if config.output_router_logits:
        return (
            "context-parallel prefill does not return router logits (output_router_logits=True): it returns the "
            "logits only; set config.output_router_logits=False for the prefill"
        )
    if config.index_kpool > 1:
        return f"context-parallel prefill does not support the k-pool indexer (index_kpool={config.index_kpool})"
    layer_kinds = zip(config.layer_types, config.indexer_types, strict=True)
    shared = [i for i, kinds in enumerate(layer_kinds) if kinds == (DSA_LAYER, "shared")]
    if shared:
        return f"context-parallel prefill does not support shared-indexer DSA layers (indexer_types 'shared': {shared})"
    tp_error = tensor_parallel_errors(config, mesh.tp_size)
    if tp_error is not None:
        return tp_error
    first_layer = model.model.layers[0]
    if first_layer.layer_type == KDA_LAYER:
        mixer, full_heads = first_layer.linear_attn, config.linear_num_heads
    else:
        mixer, full_heads = first_layer.self_attn, config.num_attention_heads
    if mixer.num_heads * mesh.tp_size != full_heads:
        return (
            f"the model holds {mixer.num_heads} of {full_heads} heads per layer but tp={mesh.tp_size}: call "
            "apply_tensor_parallel(model, mesh) once before the prefill"
        )
    if isinstance(cache, KDSAStaticCache):
        return (
            "the static cache (KDSAStaticCache, cache_implementation='static') is not supported by context-parallel "
            "prefill: pass an empty KDSACache"
        )
    if cache is not None and (not isinstance(cache, KDSACache) or cache.get_seq_length() != 0):
        return "cache must be an empty KDSACache (context-parallel prefill starts a sequence)"
    return None


def _check_all_ranks(model, input_ids, mesh: ParallelMesh, layout: str, cache) -> None:
    """Validate on every rank, then agree: every rank raises the same error if any rank failed (no rank is left
    waiting in a collective). The input shape must also be the same on every rank."""
    error = _prefill_error(model, input_ids, mesh, layout, cache)
    if not dist.is_initialized():
        if error is not None:
            raise ValueError(error)
        return
    raise_on_all_ranks(error)
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, tuple(input_ids.shape))
    if len(set(shapes)) > 1:  # every rank holds the same list, so every rank raises
        raise ValueError(f"input_ids must have the same shape on every rank, got {shapes}")


# --------------------------------------------------------------------------------------------------- KDA layer


def _values_at_positions(x: torch.Tensor, view: _RankView, wanted: torch.Tensor) -> torch.Tensor:
    """`x[..., p]` for the original positions `wanted` `[N]`, wherever they live: `x` `[B, C, L]` holds this rank's
    tokens. Each rank writes the positions it holds into a zero buffer and the buffers are summed over cp (every
    position is held by one rank; negative positions, before the sequence, stay 0). Returns `[B, C, N]`."""
    lookup = torch.full((view.layout.seq_len,), -1, dtype=torch.long, device=x.device)
    lookup[view.positions[view.real]] = view.real.nonzero().squeeze(1)
    local_index = torch.where(wanted >= 0, lookup[wanted.clamp(min=0)], -1)
    buffer = x.new_zeros(*x.shape[:-1], wanted.numel())
    held = local_index >= 0
    buffer[..., held] = x[..., local_index[held]]
    return view.mesh.all_reduce(buffer, "cp", "cp.kda_conv_halo")


def _kda_forward(attn, hidden: torch.Tensor, view: _RankView, cache: KDSACache | None) -> torch.Tensor:
    """KDA layer on the local tokens `[B, L, D]` with state passing over the cp ranks (same math as the layer's own
    forward, `modeling_kdsa/kda.py`)."""
    batch, local_len, _ = hidden.shape
    width = attn.conv_kernel_size
    layout = view.layout
    # Padding tokens are zeroed before the conv and run as identity steps (β = 0, g = 0), as the layer does.
    hidden = hidden * view.real[None, :, None].to(hidden.dtype)
    qkv = torch.cat([attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)], dim=-1).transpose(1, 2)
    conv_weight = torch.cat([attn.q_conv1d.weight, attn.k_conv1d.weight, attn.v_conv1d.weight], dim=0)

    # Halo: the W−1 inputs before every chunk start; with a cache also the last W inputs (its conv window).
    halo_offsets = torch.arange(-(width - 1), 0)
    wanted = [layout.chunk_start(chunk) + halo_offsets for chunk in range(layout.num_chunks)]
    if cache is not None:
        wanted.append(torch.arange(layout.seq_len - width, layout.seq_len))
    context = _values_at_positions(qkv, view, torch.cat(wanted).to(hidden.device))

    conv_parts = []
    for segment in view.segments:
        tokens = slice(segment.local_offset, segment.local_offset + layout.chunk_len)
        halo = context[..., segment.chunk * (width - 1) : (segment.chunk + 1) * (width - 1)]
        conv_parts.append(causal_short_conv(qkv[..., tokens], conv_weight, left_context=halo))
    qkv_conv = torch.cat(conv_parts, dim=-1).transpose(1, 2)

    heads_k = (batch, local_len, attn.num_heads, attn.head_k_dim)
    heads_v = (batch, local_len, attn.num_heads, attn.head_v_dim)
    q, k, v = qkv_conv.split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    q = l2norm(q.reshape(heads_k).float())
    k = l2norm(k.reshape(heads_k).float())
    v = v.reshape(heads_v)
    g = kda_gate(attn.f_b_proj(attn.f_a_proj(hidden)).reshape(heads_k), attn.A_log, attn.dt_bias, attn.lower_bound)
    beta = attn.b_proj(hidden).float().sigmoid()
    g = g.masked_fill(~view.real[None, :, None, None], 0.0)
    beta = beta.masked_fill(~view.real[None, :, None], 0.0)

    # Affine summary of each local segment, one all-gather of all 2·cp summaries, prefix fold in fp32.
    summaries = []
    for segment in view.segments:
        tokens = slice(segment.local_offset, segment.local_offset + layout.chunk_len)
        summaries.append(summarize_segment(q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens]))
    payload = torch.stack([torch.cat([s.transition, s.state_ext], dim=-1) for s in summaries])  # [2, B, H, K, K+V]
    gathered = view.mesh.all_gather(payload, "cp", "cp.kda_state_summaries")
    by_chunk = {}
    for rank, rank_payload in enumerate(gathered):
        for i, chunk in enumerate(layout.chunks_of(rank)):
            by_chunk[chunk] = rank_payload[i]
    ordered = [by_chunk[chunk] for chunk in range(layout.num_chunks)]
    start_states = fold_start_states(
        [p[..., : attn.head_k_dim] for p in ordered], [p[..., attn.head_k_dim :] for p in ordered]
    )
    o = torch.cat([s.outputs(start_states[seg.chunk]) for s, seg in zip(summaries, view.segments, strict=True)], 1)

    if cache is not None:
        cache.update_conv_state(context[..., -width:], attn.layer_idx, conv_kernel_size=width)
        cache.update_recurrent_state(start_states[-1], attn.layer_idx)
        # No replay inputs are recorded here: the prefilled tokens are committed (a later crop reaches back to them).
        cache.layers[attn.layer_idx].commit_unrecorded(layout.seq_len)

    o = attn.o_norm(o.to(v.dtype), attn.output_gate(hidden).reshape(heads_v)).reshape(batch, local_len, -1)
    return attn.o_proj(o)


# --------------------------------------------------------------------------------------------------- DSA layer


def _indexer_topk(attn, store: KDSAPagedLayer, q_index, weights, query_start: int, view: _RankView):
    """Top-k indices `[B, n, k']` for a block of `n` queries at positions `query_start + i`. With tp > 1 each tp rank
    scores a slice of the queries and the slices' indices (padded to `index_topk` with -1, which the attention
    ignores) are all-gathered: sequence parallelism inside the tp group for the indexer."""
    mesh, num_queries = view.mesh, q_index.shape[1]
    piece = -(-num_queries // mesh.tp_size)
    first, last = min(mesh.tp_rank * piece, num_queries), min((mesh.tp_rank + 1) * piece, num_queries)
    started = time.perf_counter()
    selected = None
    if last > first:
        with ScoredPairs() as scored:
            selected = store.indexer_topk(
                q_index[:, first:last], weights[:, first:last], query_start + first, attn.index_topk
            )
        view.stats.indexer_pairs += scored.pairs
    view.stats.indexer_seconds += time.perf_counter() - started
    if mesh.tp_size == 1:
        return selected
    # int32 on the wire: positions are < 2^31, and it halves the bytes.
    local = torch.full((q_index.shape[0], piece, attn.index_topk), -1, dtype=torch.int32, device=q_index.device)
    if selected is not None:
        local[:, : last - first, : selected.shape[-1]] = selected
    return torch.cat(mesh.all_gather(local, "tp", "tp.indexer_indices"), dim=1)[:, :num_queries].long()


def _dsa_forward(attn, hidden, position_embeddings, view: _RankView, cache: KDSACache | None) -> torch.Tensor:
    """DSA layer on the local tokens `[B, L, D]`: all-gathered keys, local queries (same math as `dsa.py`)."""
    batch, local_len, _ = hidden.shape
    q_nope, q_pe, query_input = attn.project_queries(hidden, position_embeddings)
    latent, k_pe = attn.project_latent(hidden, position_embeddings)
    q_index, index_weights, k_index = attn.indexer(hidden, query_input, position_embeddings)

    local_keys = torch.cat([latent, k_pe, k_index.to(latent.dtype)], dim=-1)  # [B, L, C + R + DI]
    gathered = torch.cat(view.mesh.all_gather(local_keys, "cp", "cp.dsa_latent_and_index_keys"), dim=1)
    keys = view.layout.unshard(gathered)  # [B, T, C + R + DI], sequence order, padding dropped
    kv_width = attn.kv_lora_rank + attn.qk_rope_head_dim
    if cache is not None:
        store = cache.layers[attn.layer_idx]
    else:
        store = KDSAPagedLayer.from_config(attn.config)  # the config's formats, as the layer's private store
    store.append(keys[..., :kv_width], keys[..., kv_width:].to(k_index.dtype))

    w_uk, w_uv = attn.absorbed_weights()
    out = hidden.new_zeros(batch, local_len, attn.num_heads, attn.v_head_dim)
    for segment in view.segments:
        for block_start in range(0, segment.num_real, attn.query_block_size):
            count = min(attn.query_block_size, segment.num_real - block_start)
            rows = slice(segment.local_offset + block_start, segment.local_offset + block_start + count)
            indices = _indexer_topk(
                attn, store, q_index[:, rows], index_weights[:, rows], segment.start + block_start, view
            )
            q_latent = torch.einsum("bthd,hdc->bthc", q_nope[:, rows], w_uk)
            out_latent = store.sparse_attention(q_latent, q_pe[:, rows], indices, attn.softmax_scale)
            out[:, rows] = torch.einsum("bthc,hvc->bthv", out_latent, w_uv)
    return attn.output(out.reshape(batch, local_len, -1), hidden)


def _mla_forward(attn, hidden, position_embeddings, view: _RankView, cache: KDSACache | None) -> torch.Tensor:
    """Dense MLA layer on the local tokens `[B, L, D]`: all-gathered latent rows, local queries that attend to every
    key up to their own position (same math as `dsa.py`'s `KDSAMultiLatentAttention`)."""
    batch, local_len, _ = hidden.shape
    q_nope, q_pe, _ = attn.project_queries(hidden, position_embeddings)
    latent, k_pe = attn.project_latent(hidden, position_embeddings)
    gathered = torch.cat(view.mesh.all_gather(torch.cat([latent, k_pe], dim=-1), "cp", "cp.mla_latent"), dim=1)
    store = cache.layers[attn.layer_idx] if cache is not None else KDSAPagedMLALayer.from_config(attn.config)
    store.append(view.layout.unshard(gathered))  # [B, T, C + R], sequence order, padding dropped

    w_uk, w_uv = attn.absorbed_weights()
    out = hidden.new_zeros(batch, local_len, attn.num_heads, attn.v_head_dim)
    for segment in view.segments:
        for block_start in range(0, segment.num_real, attn.query_block_size):
            count = min(attn.query_block_size, segment.num_real - block_start)
            rows = slice(segment.local_offset + block_start, segment.local_offset + block_start + count)
            q_latent = torch.einsum("bthd,hdc->bthc", q_nope[:, rows], w_uk)
            out_latent = store.dense_attention(
                q_latent, q_pe[:, rows].contiguous(), segment.start + block_start, attn.softmax_scale
            )
            out[:, rows] = torch.einsum("bthc,hvc->bthv", out_latent, w_uv)
    return attn.output(out.reshape(batch, local_len, -1), hidden)


# ------------------------------------------------------------------------------------------------------- model


@torch.no_grad()
def context_parallel_prefill(
    model,
    input_ids: torch.Tensor,
    mesh: ParallelMesh,
    layout: str = "zigzag",
    cache: KDSACache | None = None,
    last_token_only: bool = False,
) -> PrefillOutput:
    """Prefill `input_ids` `[B, T]` (the same on every rank) with a `KDSAForCausalLM` over the (cp, tp) mesh.

    The model must hold the same weights on every rank, already sharded by `apply_tensor_parallel` when tp > 1.
    `cache`: an empty `KDSACache` to fill (every rank ends with the full DSA keys in order and the KDA conv windows
    and final states of its tp shard of heads); `last_token_only`: return only the last position's logits.
    Bad sizes raise the same `ValueError` on every rank before any layer runs.
    """
    _check_all_ranks(model, input_ids, mesh, layout, cache)
    config, base = model.config, model.model
    batch, seq_len = input_ids.shape
    sequence = SequenceLayout(seq_len, mesh.cp_size, layout)
    input_ids = input_ids.to(mesh.device)
    positions = sequence.positions_of(mesh.cp_rank).to(mesh.device)
    view = _RankView(mesh, sequence, positions, positions >= 0, PrefillStats())

    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    hidden = base.embed_tokens(sequence.shard(input_ids, mesh.cp_rank, pad_value=pad_id))
    position_ids = positions.clamp(min=0).unsqueeze(0).expand(batch, -1)  # padding slots: any position
    position_embeddings = base.rotary_emb(hidden, position_ids) if base.rotary_emb is not None else None
    if cache is not None:
        cache.begin_forward(seq_len)

    stream = base.residual_stream(hidden)
    for layer in base.layers:
        started = time.perf_counter()
        mixer_input = layer.input_layernorm(stream.input_for(2 * layer.layer_idx))
        if layer.layer_type == KDA_LAYER:
            mixed, kind = _kda_forward(layer.linear_attn, mixer_input, view, cache), "kda"
        elif layer.layer_type == DSA_LAYER:
            mixed, kind = _dsa_forward(layer.self_attn, mixer_input, position_embeddings, view, cache), "dsa"
        else:
            mixed, kind = _mla_forward(layer.self_attn, mixer_input, position_embeddings, view, cache), "mla"
        stream.add_output(2 * layer.layer_idx, mixed)
        view.stats.add_time(kind, time.perf_counter() - started)
        started = time.perf_counter()
        mlp_input = layer.post_attention_layernorm(stream.input_for(2 * layer.layer_idx + 1))
        stream.add_output(2 * layer.layer_idx + 1, layer.mlp(mlp_input))
        view.stats.add_time("mlp", time.perf_counter() - started)
    hidden = base.norm(stream.final(getattr(base, "output_attn_res", None)))

    if last_token_only:
        last = hidden.new_zeros(batch, 1, hidden.shape[-1])
        held = (positions == seq_len - 1).nonzero()
        if held.numel():
            last[:, 0] = hidden[:, int(held[0, 0])]
        logits = model.lm_head(mesh.all_reduce(last, "cp", "cp.last_hidden"))
    else:
        local_logits = model.lm_head(hidden)
        logits = sequence.unshard(torch.cat(mesh.all_gather(local_logits, "cp", "cp.logits"), dim=1))
    return PrefillOutput(logits=logits, cache=cache, stats=view.stats)


__all__ = ["PrefillOutput", "PrefillStats", "context_parallel_prefill"]
