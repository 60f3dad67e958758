"""Tensor parallelism for KDSA: our own head / intermediate-dim plan, applied in place to a loaded model.

docs/parallel.md §5 (Megatron-style column-parallel projections, row-parallel outputs, all-reduce after them);
docs/design.md §2 (the trap of plans matching the wrong mixer, which our distinct `linear_attn` / `self_attn` names
avoid).

Why not transformers' `tp_plan`: the KDA layer needs its short-conv weights, `A_log` `[1, 1, H, 1]`, `dt_bias` `[H·K]`,
`b_proj` and the low-rank gate's second projections cut by the same heads, which no built-in style does, and the
DTensor parameters it creates would also have to pass through our kernels. The plan here is small and explicit:

| module | split | after it |
|---|---|---|
| KDA `q/k/v_proj`, `q/k/v_conv1d`, `f_b_proj`, `dt_bias`, `A_log`, `b_proj`, `g_b_proj` or `g_proj` | by KDA head | – |
| KDA `o_proj` | input columns by head | all-reduce |
| MLA `q_b_proj` (`q_proj`), `kv_b_proj`, output gate `g_proj` | by attention head | – |
| MLA `o_proj` | input columns by head | all-reduce |
| MoE experts `gate_up_proj` / `down_proj`, shared experts, dense MLP | intermediate dim | one all-reduce per MLP |
| embeddings, norms, router, `q_a_proj`, `kv_a_proj_with_mqa`, `f_a_proj`, `g_a_proj`, `lm_head` | replicated | – |

The Lightning Indexer stays whole on every rank: splitting its heads would need an all-reduce of the `[T, S]`
scores before top-k, more bytes than the whole latent all-gather. Under context parallelism the TP group instead
splits the indexer's *queries* (sequence parallel inside the TP group) and all-gathers the `[T, k]` selected
indices (context_parallel.py). Each layer's head counts (`num_heads`, `key_dim`, `value_dim`) are set to the local
values, so the model's own forward (and `generate`) runs unchanged on every rank; forward hooks do the all-reduces.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from modeling_kdsa.fp8_linear import KDSAFP8Linear
from modeling_kdsa.kda import KDSAKimiDeltaAttention
from modeling_kdsa.moe import KDSAMLP, KDSAMoE

from .mesh import ParallelMesh


def tensor_parallel_errors(config, tp_size: int) -> str | None:
    """Why `config` cannot be split `tp_size` ways, or None."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "linear_num_heads": config.linear_num_heads,
        "moe_intermediate_size": config.moe_intermediate_size,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        return f"tp={tp_size} must divide the sharded sizes; not divisible: {', '.join(bad)}"
    if tp_size > 1 and config.routed_expert_hidden_size is not None:
        # The latent norm must see the sum over all ranks' expert partials, which the per-MLP all-reduce comes after.
        latent = config.routed_expert_hidden_size
        return f"tensor parallelism does not support LatentMoE (routed_expert_hidden_size={latent})"
    if tp_size > 1 and config.routed_expert_weight_format != "dense":
        return (
            "tensor parallelism does not support packed routed experts "
            f"(routed_expert_weight_format={config.routed_expert_weight_format!r})"
        )
    return None


@dataclass(frozen=True)
class ParameterCut:
    """One parameter split over the tp ranks: `owner.<name>` is cut along `dim` into `tp` equal pieces and rank r keeps
    piece r. With `blocks` > 1, `dim` holds `blocks` equal consecutive blocks (a stacked `gate_up_proj`: the gate rows,
    then the up rows) and rank r keeps piece r of every block, concatenated in block order. The one description of the
    cut serves both the in-place slicing (`apply_tensor_parallel`) and transformers' shard-on-read loading, whose
    DTensor placement is `placement()` (parallel/hf_plans.py)."""

    owner: nn.Module
    name: str
    dim: int
    blocks: int = 1
    # Read whole by transformers' sharded load and cut right after it (parallel/hf_plans.py): small per-head tensors
    # whose stored layout differs between checkpoint families, so that the family's conversion sees the whole tensor.
    read_whole: bool = False

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s piece of the whole tensor `full`."""
        pieces = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([piece.chunk(size, dim=self.dim)[rank] for piece in pieces], dim=self.dim)

    def whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece, in rank order: the inverse of `local`."""
        blocks = [piece.chunk(self.blocks, dim=self.dim) for piece in pieces]
        return torch.cat([torch.cat([of_rank[b] for of_rank in blocks], dim=self.dim) for b in range(self.blocks)],
                         dim=self.dim)  # fmt: skip

    def placement(self):
        """The torch DTensor placement of this cut over a 1-D tp mesh: `Shard(dim)`, or `_StridedShard` for blocks."""
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.placement_types import _StridedShard

        return Shard(self.dim) if self.blocks == 1 else _StridedShard(self.dim, split_factor=self.blocks)


@dataclass
class ShardPlan:
    """How one token mixer or feed-forward of a decoder layer is cut over tp ranks (docs/parallel.md §5).

    `cuts`: the split parameters (everything else in the module stays whole on every rank); `summed_biases`: the
    row-parallel linears whose bias is added once, on tp rank 0 (their outputs are summed over the ranks);
    `reduced`: the module whose output is all-reduced over the tp group (`tag` names it in the byte log);
    `localize(size)` sets the module's head counts and layer widths to one rank's share, so its own forward runs
    unchanged on the local pieces."""

    cuts: list[ParameterCut]
    summed_biases: list[nn.Module]
    reduced: nn.Module
    tag: str
    localize: Callable[[int], None]


def _column(linear: nn.Module) -> list[ParameterCut]:
    """Output features split (weight rows, and the bias with them)."""
    return [ParameterCut(linear, name, 0) for name in ("weight", "bias") if getattr(linear, name, None) is not None]


def _narrow_linears(size: int, columns: list[nn.Module], rows: list[nn.Module]) -> None:
    for linear in columns:
        linear.out_features //= size
    for linear in rows:
        linear.in_features //= size


def kda_shard_plan(attn: KDSAKimiDeltaAttention) -> ShardPlan:
    """KDA heads: q/k/v projections and short convs, the decay's `f_b_proj`, `dt_bias`, `A_log` `[1, 1, H, 1]`,
    `b_proj`, the output gate's `g_b_proj` (or full-rank `g_proj`) by head; `o_proj` by input column."""
    gate = attn.g_proj if attn.full_rank_gate else attn.g_b_proj
    columns = [attn.q_proj, attn.k_proj, attn.v_proj, attn.f_b_proj, attn.b_proj, gate]
    convs = [attn.q_conv1d, attn.k_conv1d, attn.v_conv1d]
    cuts = [cut for linear in columns for cut in _column(linear)]
    # The short convs (`[C, 1, W]`; one fused `[3C, 1, W]` in transformers' runtime layout) and `A_log` (`[H]` in
    # GLM's files, zero-padded in Kimi K3's) are read whole by a sharded load (docs/parallel.md §10).
    cuts += [ParameterCut(conv, "weight", 0, read_whole=True) for conv in convs]
    cuts += [ParameterCut(attn, "dt_bias", 0), ParameterCut(attn, "A_log", 2, read_whole=True)]
    cuts += [ParameterCut(attn.o_proj, "weight", 1)]

    def localize(size: int) -> None:
        _narrow_linears(size, columns, [attn.o_proj])
        for conv in convs:
            conv.in_channels //= size
            conv.out_channels //= size
            conv.groups //= size
        attn.num_heads //= size
        attn.key_dim //= size
        attn.value_dim //= size

    return ShardPlan(cuts, [attn.o_proj], attn.o_proj, "tp.kda_o_proj", localize)


def mla_shard_plan(attn) -> ShardPlan:
    """MLA heads (DSA and dense MLA layers): `q_b_proj` (or `q_proj`), `kv_b_proj` and the per-head output gate
    `g_proj` by head, `o_proj` by input column; the latent projections and the indexer stay whole."""
    query = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    columns = [query, attn.kv_b_proj] + ([attn.g_proj] if attn.g_proj is not None else [])
    cuts = [cut for linear in columns for cut in _column(linear)] + [ParameterCut(attn.o_proj, "weight", 1)]

    def localize(size: int) -> None:
        _narrow_linears(size, columns, [attn.o_proj])
        attn.num_heads //= size

    return ShardPlan(cuts, [attn.o_proj], attn.o_proj, "tp.mla_o_proj", localize)


def _mlp_cuts(mlp: KDSAMLP) -> tuple[list[ParameterCut], Callable[[int], None]]:
    columns = [mlp.gate_proj, mlp.up_proj]
    cuts = [cut for linear in columns for cut in _column(linear)] + [ParameterCut(mlp.down_proj, "weight", 1)]
    return cuts, lambda size: _narrow_linears(size, columns, [mlp.down_proj])


def feed_forward_shard_plan(mlp: KDSAMLP | KDSAMoE) -> ShardPlan:
    """The intermediate dim of a dense MLP, of every routed expert (`gate_up_proj` `[E, 2I, D]` in gate and up blocks,
    `down_proj` `[E, D, I]`) and of the shared experts; the router stays whole. One all-reduce after the whole MLP."""
    if getattr(mlp, "experts", None) is None:  # by attribute: remote-code copies of the classes shard too
        cuts, localize = _mlp_cuts(mlp)
        return ShardPlan(cuts, [mlp.down_proj], mlp, "tp.mlp", localize)
    experts = mlp.experts
    cuts = [ParameterCut(experts, "gate_up_proj", 1, blocks=2), ParameterCut(experts, "down_proj", 2)]
    summed, localize_shared = [], lambda size: None
    if mlp.shared_experts is not None:
        shared_cuts, localize_shared = _mlp_cuts(mlp.shared_experts)
        cuts += shared_cuts
        summed.append(mlp.shared_experts.down_proj)
    return ShardPlan(cuts, summed, mlp, "tp.mlp", localize_shared)


def layer_shard_plans(layer) -> list[ShardPlan]:
    """The plans of one decoder layer: its token mixer, then its feed-forward."""
    mixer = kda_shard_plan(layer.linear_attn) if hasattr(layer, "linear_attn") else mla_shard_plan(layer.self_attn)
    return [mixer, feed_forward_shard_plan(layer.mlp)]


def shard_in_place(plan: ShardPlan, rank: int, size: int) -> None:
    """Replace every cut parameter by tp rank `rank`'s piece (a copy), zero the summed biases off rank 0 and set the
    local sizes. No hooks, no communication."""
    for cut in plan.cuts:
        full = getattr(cut.owner, cut.name).detach()
        setattr(cut.owner, cut.name, nn.Parameter(cut.local(full, rank, size).clone(), requires_grad=False))
    if rank != 0:
        for linear in plan.summed_biases:
            if linear.bias is not None:
                linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    plan.localize(size)


def gather_whole_state_dict(model, state_dict: dict, group) -> dict:
    """`state_dict` of a tp-sharded `model` (`apply_tensor_parallel`, or a `tp_plan` load after it finished) with
    every cut tensor gathered whole over the tp `group` and every row-parallel bias taken back from tp rank 0 (the
    other ranks hold zeros): the state dict of the whole model, bit for bit. A collective: every rank of `group`
    calls it, in the same layer order (save_pretrained, docs/parallel.md §10)."""
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
    size = dist.get_world_size(group)
    whole = dict(state_dict)
    for layer in getattr(model, "model", model).layers:
        for plan in layer_shard_plans(layer):
            for cut in plan.cuts:
                param = getattr(cut.owner, cut.name)
                local = param.detach().contiguous()
                pieces = [torch.empty_like(local) for _ in range(size)]
                dist.all_gather(pieces, local, group=group)
                whole[names[id(param)]] = cut.whole(pieces)
            for linear in plan.summed_biases:
                if linear.bias is not None:
                    bias = linear.bias.detach().clone()
                    dist.all_reduce(bias, group=group)  # rank 0's bias plus zeros: exact
                    whole[names[id(linear.bias)]] = bias
    return whole


def all_reduce_output_hook(mesh: ParallelMesh, tag: str):
    """A forward hook that sums the module's output over the mesh's tp group (in place) and counts the bytes."""

    def hook(module, inputs, output):
        return mesh.all_reduce(output, "tp", tag)

    return hook


def apply_tensor_parallel(model, mesh: ParallelMesh):
    """Shard `model` (a `KDSAForCausalLM` or `KDSAModel`, identical weights on every rank) over the mesh's tp group,
    in place, and return it. Raises `ValueError` on every rank when a sharded size is not divisible by tp.
    Under tp = 1 this does nothing."""
    config = model.config
    if mesh.tp_size == 1:
        return model
    if any(isinstance(module, KDSAFP8Linear) for module in model.modules()):
        # Slicing the E4M3 weight would leave its block-scale grid whole (docs/checkpoint-conversion.md §9).
        raise ValueError(
            "apply_tensor_parallel does not shard FP8-held weights (fp8_weights='hold'); load the checkpoint with "
            "fp8_weights='dequantize' (the default) to shard it"
        )
    error = tensor_parallel_errors(config, mesh.tp_size)
    if error is not None:  # same config on every rank, so every rank raises here: nothing to agree on
        raise ValueError(error)
    base = getattr(model, "model", model)
    rank, size = mesh.tp_rank, mesh.tp_size
    for layer in base.layers:
        for plan in layer_shard_plans(layer):
            shard_in_place(plan, rank, size)
            plan.reduced.register_forward_hook(all_reduce_output_hook(mesh, plan.tag))
    # The group whose ranks run every forward together: speculative decoding agrees on its drafting rounds over it.
    model.tensor_parallel_group = mesh.tp_group
    return model


__all__ = [
    "ParameterCut",
    "ShardPlan",
    "all_reduce_output_hook",
    "apply_tensor_parallel",
    "feed_forward_shard_plan",
    "gather_whole_state_dict",
    "kda_shard_plan",
    "layer_shard_plans",
    "mla_shard_plan",
    "shard_in_place",
    "tensor_parallel_errors",
]
