"""Context-parallel prefill, then decoding over a `(tp, ep)` mesh on the same ranks: the hand-over of the weights and
of the cache from the prefill layout to the decode layout (docs/parallel.md §11).

A long prompt is prefilled over a `(cp, tp)` mesh (`context_parallel_prefill`, §8), then the same `cp·tp` ranks
regroup into `(ep, tp')` with `tp'·ep = cp·tp` and decode with `generate()` (§5, §9). What a rank holds after the
prefill (context_parallel.py): the whole batch's DSA / MLA latent rows and indexer keys for the whole sequence (they
are all-gathered over cp, and not cut by head), and the final KDA conv window and recurrent state of its tp shard of
heads (every cp rank folds the same start states, §3). So no token moves, only what a decode rank keeps changes:
- `tp' = tp` (e.g. cp 2 × tp 2 → tp 2 × ep 2). Rank `r` is `cp_rank·tp + tp_rank` in the prefill mesh and
  `ep_rank·tp + tp_rank` in the decode mesh (tp innermost in both): it keeps its tp rank, so its attention, KDA and
  expert slices and its KDA states are already the decode's; with ep > 1 it keeps the routed experts of its ep
  block (`ep_rank = cp_rank`), and nothing of the model is ever whole on a rank when tp > 1.
- `tp = 1` (e.g. cp 2 → tp 2): every rank prefilled with the whole model; it cuts the model for its decode
  `(tp', ep)` rank (`apply_expert_parallel`, or `apply_tensor_parallel` when ep = 1) and keeps the KDA states of its
  tp' heads (the same contiguous head blocks `kda_shard_plan` cuts the projections by).
- any other prefill tp (e.g. cp 2 × tp 2 → tp 4, or tp 2 → ep 2): the head shards move (`_recut`). Layer by
  layer, the rank gathers the layer's cut tensors whole over the prefill's tp group into a fresh whole layer built
  from the config, gathers the KDA state of that layer's heads whole the same way, keeps its decode tp rank's heads
  of the state, and cuts the fresh layer for its decode tp rank and its experts for its ep block; the embedding and
  `lm_head` are gathered and cut again in place. A rank holds at most one whole decoder layer (or the embedding, or
  the head) beyond its decode shards.
With ep > 1 each ep rank then decodes its own consecutive share of the batch (`ExpertParallelMesh.batch_rows`, §9),
so the cache keeps those rows only.

Exactness: the cache a decode rank holds is, value for value, the slice of the single-process prefill cache that
rank would have built for its heads and rows, up to the fp32 summation order of the CP prefill (§8); the decode then
runs the TP / EP forward of §5 and §9 unchanged.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from modeling_kdsa.cache import KDAReplayLayer, KDSACache
from modeling_kdsa.configuration_kdsa import KDA_LAYER
from modeling_kdsa.moe import KDSAMoE

from .expert_parallel import (
    ExpertParallelExperts,
    ExpertParallelMesh,
    _keep_experts,
    apply_expert_parallel,
    expert_parallel_errors,
    expert_parallel_mesh,
)
from .mesh import ParallelMesh, default_device_and_backend, raise_on_all_ranks
from .tensor_parallel import (
    apply_tensor_parallel,
    gather_plan_tensors,
    layer_shard_plans,
    shard_plans,
    tensor_parallel_errors,
    tied_head,
    vocab_shard_plans,
)


@dataclass
class DecodeHandOver:
    """What a rank decodes with after `hand_over_to_decode`: the `model` cut for its decode rank (the prefill's
    model, changed in place), the `cache` holding its heads and batch rows (the prefill's cache, changed in place),
    the decode `mesh` and `rows`, this rank's share of the batch (`input_ids[rows]` is what it generates from)."""

    model: object
    cache: KDSACache
    mesh: ExpertParallelMesh
    rows: slice


def _cache_batch_size(cache) -> int | None:
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, KDAReplayLayer) and layer.has_previous_state[0]:
            return layer.recurrent_states[0].shape[0]
        if getattr(layer, "is_initialized", False) and hasattr(layer, "block_table"):
            return layer.batch_size
    return None


def _model_tp_size(model) -> int:
    """How many ways the model's token mixers are cut (1: whole), from the first layer's head count."""
    config, layer = model.config, getattr(model, "model", model).layers[0]
    if layer.layer_type == KDA_LAYER:
        return config.linear_num_heads // layer.linear_attn.num_heads
    return config.num_attention_heads // layer.self_attn.num_heads


def hand_over_errors(model, cache, prefill_mesh: ParallelMesh, tp_size: int, ep_size: int) -> str | None:
    """Why this rank cannot hand `model` and `cache` from `prefill_mesh` over to a `(tp_size, ep_size)` decode mesh,
    or None."""
    world = prefill_mesh.cp_size * prefill_mesh.tp_size
    if tp_size < 1 or ep_size < 1:
        return f"tp and ep must be >= 1, got tp={tp_size}, ep={ep_size}"
    if tp_size * ep_size != world:
        return (
            f"the decode mesh tp·ep = {tp_size}·{ep_size} = {tp_size * ep_size} must hold the prefill's "
            f"cp·tp = {prefill_mesh.cp_size}·{prefill_mesh.tp_size} = {world} ranks"
        )
    if _model_tp_size(model) != prefill_mesh.tp_size:
        return (
            f"the model is cut {_model_tp_size(model)} ways but the prefill mesh has tp={prefill_mesh.tp_size}: pass "
            "the model context_parallel_prefill ran"
        )
    if not isinstance(cache, KDSACache) or cache.get_seq_length() == 0:
        return "cache must be the KDSACache that context_parallel_prefill filled (a non-empty KDSACache)"
    if any(isinstance(layer, KDAReplayLayer) and layer.pending_tokens for layer in cache.layers):
        return "the cache holds KDA replay records (a forward after the prefill): hand it over right after the prefill"
    batch_size = _cache_batch_size(cache)
    if ep_size > batch_size:
        return (
            f"ep={ep_size} > the batch of {batch_size} sequence(s): each ep rank decodes its own share of the batch "
            "(docs/parallel.md §9) and needs at least one sequence"
        )
    if prefill_mesh.tp_size == 1:
        return expert_parallel_errors(model, tp_size, ep_size)
    # The model is cut by the prefill's tp already (and re-cut for the decode's, `_recut`): the experts' split remains.
    moes = [layer.mlp for layer in getattr(model, "model", model).layers if isinstance(layer.mlp, KDSAMoE)]
    if any(isinstance(moe.experts, ExpertParallelExperts) for moe in moes):
        return "the model's experts are already sharded by apply_expert_parallel"
    if ep_size > 1 and not moes:
        return f"ep={ep_size}: the model has no routed experts (mlp_layer_types has no 'sparse' layer)"
    if model.config.n_routed_experts % ep_size:
        return f"ep={ep_size} must divide n_routed_experts={model.config.n_routed_experts} (whole experts per rank)"
    return tensor_parallel_errors(model.config, tp_size)


def _kda_head_slice(layer: KDAReplayLayer, attn, rank: int, size: int) -> None:
    """Keep tp rank `rank`'s contiguous block of the KDA heads of `attn` (whole, `H` heads) in `layer`'s live state:
    the conv window's q, k and v channel blocks (`[B, 2·H·K + H·V, W]`, q | k | v as kda.py concatenates them) and
    the fp32 state `[B, H, K, V]`."""
    heads = attn.num_heads // size
    key_dim, head_k, head_v = attn.key_dim, attn.head_k_dim, attn.head_v_dim
    conv = layer.conv_states[0]
    q_k_v = (
        conv[:, rank * heads * head_k : (rank + 1) * heads * head_k],
        conv[:, key_dim + rank * heads * head_k : key_dim + (rank + 1) * heads * head_k],
        conv[:, 2 * key_dim + rank * heads * head_v : 2 * key_dim + (rank + 1) * heads * head_v],
    )
    layer.conv_states[0] = torch.cat(q_k_v, dim=1).contiguous()
    layer.recurrent_states[0] = layer.recurrent_states[0][:, rank * heads : (rank + 1) * heads].contiguous()


def _gather_kda_state(layer: KDAReplayLayer, attn, mesh: ParallelMesh) -> None:
    """Replace `layer`'s live state, this prefill tp rank's block of the KDA heads of `attn` (whole, `H` heads), by
    the state of all `H` heads gathered over the mesh's tp group: the conv window's q, k and v channel blocks in head
    order (`[B, 2·H·K + H·V, W]`) and the fp32 state `[B, H, K, V]`. A collective."""
    size = mesh.tp_size
    conv_pieces = [torch.empty_like(layer.conv_states[0]) for _ in range(size)]
    dist.all_gather(conv_pieces, layer.conv_states[0].contiguous(), group=mesh.tp_group)
    local_key, local_value = attn.key_dim // size, attn.value_dim // size
    blocks = [piece.split([local_key, local_key, local_value], dim=1) for piece in conv_pieces]
    layer.conv_states[0] = torch.cat([block[part] for part in range(3) for block in blocks], dim=1)
    state_pieces = [torch.empty_like(layer.recurrent_states[0]) for _ in range(size)]
    dist.all_gather(state_pieces, layer.recurrent_states[0].contiguous(), group=mesh.tp_group)
    layer.recurrent_states[0] = torch.cat(state_pieces, dim=1)


def _recut(model, cache: KDSACache, prefill_mesh: ParallelMesh, mesh: ExpertParallelMesh) -> None:
    """Move `model` and the KDA states of `cache` from the prefill's tp cut to the decode `mesh`'s (tp cut, then ep
    split of the experts), one module at a time (module docstring). A collective over the prefill's tp group."""
    base, config, wholes, decode_tp = getattr(model, "model", model), model.config, {}, mesh.tp
    for index, layer in enumerate(base.layers):
        for plan in layer_shard_plans(layer):
            gather_plan_tensors(plan, prefill_mesh.tp_group, wholes)
        state = {name: wholes.pop(id(tensor), tensor) for name, tensor in layer.state_dict(keep_vars=True).items()}
        with torch.device("meta"):
            fresh = type(layer)(config, index)
        fresh.load_state_dict(state, assign=True)
        fresh.train(layer.training).requires_grad_(False)
        layer_cache = cache.layers[index]
        if isinstance(layer_cache, KDAReplayLayer):
            _gather_kda_state(layer_cache, fresh.linear_attn, prefill_mesh)
            _kda_head_slice(layer_cache, fresh.linear_attn, decode_tp.tp_rank, decode_tp.tp_size)
        if decode_tp.tp_size > 1:
            shard_plans(layer_shard_plans(fresh), decode_tp)
        if mesh.ep_size > 1:
            _split_experts(fresh, config.n_routed_experts, mesh)
        base.layers[index] = fresh
    tied = tied_head(model)
    for plan in vocab_shard_plans(model):
        plan.reduced.tensor_parallel_hook.remove()
        gather_plan_tensors(plan, prefill_mesh.tp_group, wholes)
        for cut in plan.cuts:
            whole = wholes[id(getattr(cut.owner, cut.name))]
            setattr(cut.owner, cut.name, nn.Parameter(whole, requires_grad=False))
        if decode_tp.tp_size > 1:
            shard_plans([plan], decode_tp)
        else:
            plan.localize(0, 1)
    if tied:
        model.lm_head.weight = base.embed_tokens.weight
    model.tensor_parallel_group = decode_tp.tp_group if decode_tp.tp_size > 1 else None


def _split_experts(layer, num_experts: int, mesh: ExpertParallelMesh) -> None:
    """An MoE layer keeps the routed experts of its ep block (already cut by the mesh's tp) and routes through
    `ExpertParallelExperts`, as `apply_expert_parallel` leaves them."""
    if isinstance(layer.mlp, KDSAMoE):
        per_rank = num_experts // mesh.ep_size
        _keep_experts(layer.mlp.experts, mesh.ep_rank * per_rank, (mesh.ep_rank + 1) * per_rank)
        layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, num_experts, mesh)


@torch.no_grad()
def hand_over_to_decode(model, cache: KDSACache, prefill_mesh: ParallelMesh, tp_size: int, ep_size: int = 1):
    """Regroup the ranks of `prefill_mesh` into a `(tp_size, ep_size)` decode mesh after `context_parallel_prefill`
    filled `cache` with `model`, and return a `DecodeHandOver`. `model` and `cache` are changed in place.

    Then every rank continues with `model.generate(input_ids[rows], cache=cache, synced_gpus=ep_size > 1, ...)`: for
    generate() to equal the single-process call on the same prompts, prefill all but each prompt's last token
    (generate() feeds the tokens the cache does not hold yet). Bad sizes raise the same `ValueError` on every rank
    before anything is changed or sent (a collective over the default process group: every rank must call)."""
    error = hand_over_errors(model, cache, prefill_mesh, tp_size, ep_size)
    if dist.is_initialized():
        raise_on_all_ranks(error)
    elif error is not None:
        raise ValueError(error)
    # The (ep, tp) mesh over the prefill's ranks, tp innermost.
    mesh = expert_parallel_mesh(default_device_and_backend()[0], tp_size, ep_size, prefill_mesh.device)
    if prefill_mesh.tp_size not in (1, tp_size):
        _recut(model, cache, prefill_mesh, mesh)
    if prefill_mesh.tp_size == 1 and tp_size > 1:
        base = getattr(model, "model", model)
        for layer, layer_cache in zip(base.layers, cache.layers, strict=True):
            if isinstance(layer_cache, KDAReplayLayer):
                _kda_head_slice(layer_cache, layer.linear_attn, mesh.tp.tp_rank, tp_size)
    if prefill_mesh.tp_size == 1 and ep_size > 1:
        apply_expert_parallel(model, mesh)
    elif prefill_mesh.tp_size == 1:
        apply_tensor_parallel(model, mesh.tp)
    elif prefill_mesh.tp_size == tp_size and ep_size > 1:
        for layer in getattr(model, "model", model).layers:
            _split_experts(layer, model.config.n_routed_experts, mesh)
    if ep_size > 1:
        model.expert_parallel_group = mesh.ep_group
    rows = mesh.batch_rows(_cache_batch_size(cache))
    if ep_size > 1:
        cache.batch_select_indices(torch.arange(rows.start, rows.stop, device=prefill_mesh.device))
    return DecodeHandOver(model, cache, mesh, rows)


__all__ = ["DecodeHandOver", "hand_over_errors", "hand_over_to_decode"]
