"""Context-parallel prefill of a whole KDSA model: every rank runs the model's own forward on its own tokens only.

docs/parallel.md §2 (zigzag layout), §3 (KDA state passing with zigzag, halo tokens for the short conv), §4 (DSA
under CP: all-gather the latent and indexer keys, restore the causal order, each rank runs the indexer and sparse
attention for its own queries with per-segment causal limits), §7 (the hooks).

There is no layer code here: `context_parallel_prefill` shards the ids, builds a `MeshSequenceContext` and calls the
model (`KDSAModel.forward(..., sequence_parallel=context)`), whose layers call the context's hooks
(`modeling_kdsa/sequence_parallel.py`) where a step needs other ranks' tokens:
- KDA short conv: the `W−1` inputs before each segment (halo) and the sequence's last `W` inputs (the cache's conv
  window), one all-reduce of a buffer each rank fills with the positions it holds;
- KDA recurrence: every segment summarised as an affine map of its start state (state_passing.py); one all-gather
  of the `2·cp` summaries; each rank folds the prefix in fp32 and finishes its segments locally (no rank chain);
- DSA / dense MLA keys: one all-gather of the latent rows (and indexer keys), put back in sequence order; the layer
  appends them to its store (the cache's, or its private one with the config's formats) and runs its own query-block
  loop over this rank's segments at their positions;
- indexer top-k: under tensor parallelism the tp ranks split each block's queries and all-gather the selected
  indices; the pairs the kernels score are counted (`ScoredPairs`).
Position-wise parts (MoE / MLP, norms, AttnRes, mHC) run on the local tokens as they are. After the model, the head
runs on the local tokens and the logits are gathered and put back in order (or only the last token's).

Limits: batches of equal-length prompts without padding mask (prefill from an empty cache); no autograd.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from modeling_kdsa.cache import KDSACache
from modeling_kdsa.configuration_kdsa import DSA_LAYER, KDA_LAYER
from modeling_kdsa.dsa_ops import ScoredPairs
from modeling_kdsa.kda_ops import causal_short_conv
from modeling_kdsa.sequence_parallel import QuerySegment, SequenceParallelContext
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


# ------------------------------------------------------------------------------------------------------ context


class MeshSequenceContext(SequenceParallelContext):
    """The model's sequence-parallel hooks (`modeling_kdsa/sequence_parallel.py`, docs/parallel.md §7) over the cp
    ranks of a mesh: this rank holds its two chunks of `layout`; tp ranks split the indexer's queries."""

    def __init__(self, mesh: ParallelMesh, layout: SequenceLayout, stats: PrefillStats):
        self.mesh, self.layout, self.stats = mesh, layout, stats
        self.seq_len = layout.seq_len
        self.positions = layout.positions_of(mesh.cp_rank).to(mesh.device)
        self.segments = layout.segments_of(mesh.cp_rank)

    def query_segments(self) -> list[QuerySegment]:
        return [QuerySegment(s.start, s.num_real, self.layout.chunk_len - s.num_real) for s in self.segments]

    def _refuse_autograd(self, *tensors: torch.Tensor) -> None:
        """The cp collectives (torch.distributed) pass no gradients: a forward that records autograd over cp > 1
        ranks would give gradients without the other ranks' contributions, silently."""
        if self.mesh.cp_size > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            raise ValueError(
                "MeshSequenceContext supports no autograd (training) over cp > 1 ranks: its collectives pass no "
                "gradients; run the forward under torch.no_grad() (context_parallel_prefill does)"
            )

    def _values_at_positions(self, x: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """`x[..., p]` for the original positions `wanted` `[N]`, wherever they live: `x` `[B, C, L]` holds this
        rank's tokens. Each rank writes the positions it holds into a zero buffer and the buffers are summed over cp
        (every position is held by one rank; negative positions, before the sequence, stay 0). Returns `[B, C, N]`."""
        real = self.token_mask()
        lookup = torch.full((self.seq_len,), -1, dtype=torch.long, device=x.device)
        lookup[self.positions[real]] = real.nonzero().squeeze(1)
        local_index = torch.where(wanted >= 0, lookup[wanted.clamp(min=0)], -1)
        buffer = x.new_zeros(*x.shape[:-1], wanted.numel())
        held = local_index >= 0
        buffer[..., held] = x[..., local_index[held]]
        return self.mesh.all_reduce(buffer, "cp", "cp.kda_conv_halo")

    def short_conv(self, x, weight, keep_window):
        """Halo: the `W−1` inputs before every chunk start (and with `keep_window` the last `W` inputs), one
        all-reduce; then each segment's conv continues from its halo."""
        self._refuse_autograd(x, weight)
        width = weight.shape[-1]
        halo_offsets = torch.arange(-(width - 1), 0)
        wanted = [self.layout.chunk_start(chunk) + halo_offsets for chunk in range(self.layout.num_chunks)]
        if keep_window:
            wanted.append(torch.arange(self.seq_len - width, self.seq_len))
        context = self._values_at_positions(x, torch.cat(wanted).to(x.device))
        parts = []
        for segment in self.segments:
            tokens = slice(segment.local_offset, segment.local_offset + self.layout.chunk_len)
            halo = context[..., segment.chunk * (width - 1) : (segment.chunk + 1) * (width - 1)]
            parts.append(causal_short_conv(x[..., tokens], weight, left_context=halo))
        return torch.cat(parts, dim=-1), context[..., -width:] if keep_window else None

    def kda_recurrence(self, q, k, v, g, beta, kda_chunk):
        """State passing (docs/parallel.md §3): an affine summary of each local segment (one `kda_chunk` pass each),
        one all-gather of all `2·cp` summaries, the prefix fold in fp32, then each segment's outputs from its start
        state."""
        self._refuse_autograd(q, k, v, g, beta)
        chunk_len, head_k_dim = self.layout.chunk_len, k.shape[-1]
        summaries = []
        for segment in self.segments:
            tokens = slice(segment.local_offset, segment.local_offset + chunk_len)
            part = (q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens])
            summaries.append(summarize_segment(*part, kda_chunk=kda_chunk))
        payload = torch.stack([torch.cat([s.transition, s.state_ext], dim=-1) for s in summaries])  # [2, B, H, K, K+V]
        gathered = self.mesh.all_gather(payload, "cp", "cp.kda_state_summaries")
        by_chunk = {}
        for rank, rank_payload in enumerate(gathered):
            for i, chunk in enumerate(self.layout.chunks_of(rank)):
                by_chunk[chunk] = rank_payload[i]
        ordered = [by_chunk[chunk] for chunk in range(self.layout.num_chunks)]
        start_states = fold_start_states([p[..., :head_k_dim] for p in ordered], [p[..., head_k_dim:] for p in ordered])
        outputs = [s.outputs(start_states[seg.chunk]) for s, seg in zip(summaries, self.segments, strict=True)]
        return torch.cat(outputs, dim=1).to(v.dtype), start_states[-1]

    def gather_sequence(self, parts, name):
        """One all-gather over cp of the parts side by side (in the first part's dtype), put back in sequence order."""
        self._refuse_autograd(*parts)
        widths = [part.shape[-1] for part in parts]
        local = torch.cat([part.to(parts[0].dtype) for part in parts], dim=-1)
        gathered = self.layout.unshard(torch.cat(self.mesh.all_gather(local, "cp", f"cp.{name}"), dim=1))
        return [whole.to(part.dtype) for whole, part in zip(gathered.split(widths, dim=-1), parts, strict=True)]

    def indexer_topk(self, select, q_index, weights, position, width):
        """With tp > 1 each tp rank scores a slice of the queries and the slices' indices (padded to a common width
        with -1, which the attention ignores) are all-gathered: sequence parallelism inside the tp group. Counts the
        pairs the kernels score (`ScoredPairs`) and the time."""
        mesh, num_queries = self.mesh, q_index.shape[1]
        piece = -(-num_queries // mesh.tp_size)
        first, last = min(mesh.tp_rank * piece, num_queries), min((mesh.tp_rank + 1) * piece, num_queries)
        started = time.perf_counter()
        selected = None
        if last > first:
            with ScoredPairs() as scored:
                selected = select(q_index[:, first:last], weights[:, first:last], position + first)
            self.stats.indexer_pairs += scored.pairs
        self.stats.indexer_seconds += time.perf_counter() - started
        if mesh.tp_size == 1:
            return selected
        # int32 on the wire: positions are < 2^31, and it halves the bytes.
        local = torch.full((q_index.shape[0], piece, width), -1, dtype=torch.int32, device=q_index.device)
        if selected is not None:
            local[:, : last - first, : selected.shape[-1]] = selected
        return torch.cat(mesh.all_gather(local, "tp", "tp.indexer_indices"), dim=1)[:, :num_queries].long()


# ------------------------------------------------------------------------------------------------------- model


class _SublayerTimer:
    """`PrefillStats.seconds_by_kind` from forward hooks on one kind of sublayer (a token mixer or a feed-forward):
    the seconds inside its forward, its collectives included (the norms and residual additions between sublayers
    are not counted). Host time: on an accelerator it is the launch time unless the kernels synchronise."""

    def __init__(self, stats: PrefillStats, kind: str):
        self.stats, self.kind, self.started = stats, kind, 0.0

    def start(self, module, args) -> None:
        self.started = time.perf_counter()

    def stop(self, module, args, output) -> None:
        self.stats.add_time(self.kind, time.perf_counter() - self.started)


@contextmanager
def _timed_sublayers(base, stats: PrefillStats):
    kinds = {KDA_LAYER: "kda", DSA_LAYER: "dsa"}
    handles = []
    try:
        for layer in base.layers:
            mixer = layer.linear_attn if layer.layer_type == KDA_LAYER else layer.self_attn
            for module, kind in ((mixer, kinds.get(layer.layer_type, "mla")), (layer.mlp, "mlp")):
                timer = _SublayerTimer(stats, kind)
                handles += [module.register_forward_pre_hook(timer.start), module.register_forward_hook(timer.stop)]
        yield
    finally:
        for handle in handles:
            handle.remove()


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
    config = model.config
    batch, seq_len = input_ids.shape
    sequence = SequenceLayout(seq_len, mesh.cp_size, layout)
    stats = PrefillStats()
    context = MeshSequenceContext(mesh, sequence, stats)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    local_ids = sequence.shard(input_ids.to(mesh.device), mesh.cp_rank, pad_value=pad_id)
    with _timed_sublayers(model.model, stats):
        hidden = model.model(
            local_ids, cache=cache, use_cache=cache is not None, output_router_logits=False, sequence_parallel=context
        ).last_hidden_state

    if last_token_only:
        last = hidden.new_zeros(batch, 1, hidden.shape[-1])
        held = (context.positions == seq_len - 1).nonzero()
        if held.numel():
            last[:, 0] = hidden[:, int(held[0, 0])]
        logits = model.lm_head(mesh.all_reduce(last, "cp", "cp.last_hidden"))
    else:
        local_logits = model.lm_head(hidden)
        logits = sequence.unshard(torch.cat(mesh.all_gather(local_logits, "cp", "cp.logits"), dim=1))
    return PrefillOutput(logits=logits, cache=cache, stats=stats)


__all__ = ["MeshSequenceContext", "PrefillOutput", "PrefillStats", "context_parallel_prefill"]
