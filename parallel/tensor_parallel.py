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
| `embed_tokens` | vocabulary rows (ids outside a rank's rows look up zeros) | all-reduce |
| `lm_head` (a tied head is the cut embedding) | vocabulary rows (output columns) | all-gather of the logits |
| norms, router, `q_a_proj`, `kv_a_proj_with_mqa`, `f_a_proj`, `g_a_proj` | replicated | – |

The Lightning Indexer stays whole on every rank: splitting its heads would need an all-reduce of the `[T, S]`
scores before top-k, more bytes than the whole latent all-gather. Under context parallelism the TP group instead
splits the indexer's *queries* (sequence parallel inside the TP group) and all-gathers the `[T, k]` selected
indices (context_parallel.py). Each layer's head counts (`num_heads`, `key_dim`, `value_dim`) are set to the local
values, so the model's own forward (and `generate`) runs unchanged on every rank; forward hooks do the all-reduces.

The vocabulary is cut as Megatron-LM's `VocabParallelEmbedding` and vLLM's `VocabParallelEmbedding` /
`ParallelLMHead` cut it: rank r holds rows `vocab_ranges(V, tp)[r]` of the embedding and of the head, `ceil(V / tp)`
rows each and the rest on the last rank (torch.chunk's split, which a DTensor `Shard(0)` also uses, so a sharded load
reads the same rows). A vocabulary that tp does not divide is cut unevenly, without padding (the shipped
checkpoints/kdsa-tiny has 201 ids); only a layout that would leave a rank no rows is refused. The embedding's output is
all-reduced (each id is looked up on the one rank holding it, the others add zeros: exact); the head's logits are
all-gathered, so every rank returns the whole `[..., V]` logits (generate, MTP, DSpark and the context-parallel
prefill read them unchanged).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from modeling_kdsa.fp8_linear import KDSAFP8Linear
from modeling_kdsa.kda import KDSAKimiDeltaAttention
from modeling_kdsa.moe import KDSAMLP, KDSAMoE

from .mesh import ParallelMesh


def vocab_ranges(vocab_size: int, tp_size: int) -> list[range]:
    """The vocabulary rows of each tp rank: `ceil(vocab_size / tp_size)` each in rank order, the last rank the rest
    (torch.chunk's split and a DTensor `Shard(0)`'s; empty ranges where the ids run out)."""
    block = -(-vocab_size // tp_size)
    return [range(min(rank * block, vocab_size), min((rank + 1) * block, vocab_size)) for rank in range(tp_size)]


def vocab_split_error(vocab_size: int, tp_size: int) -> str | None:
    """Why the vocabulary cannot be cut `tp_size` ways (a rank would hold no rows), or None."""
    empty = [rank for rank, rows in enumerate(vocab_ranges(vocab_size, tp_size)) if not rows]
    if empty:
        block = -(-vocab_size // tp_size)
        return (
            f"tp={tp_size} leaves tp rank(s) {empty} no vocabulary rows: vocab_size={vocab_size} is cut in blocks of "
            f"ceil({vocab_size}/{tp_size}) = {block} rows (docs/parallel.md §5)"
        )
    return None


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
    vocab_error = vocab_split_error(config.vocab_size, tp_size)
    if vocab_error is not None:
        return vocab_error
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
    # The vocabulary rows (embedding, head): the whole length along `dim`, cut by `vocab_ranges`, unevenly where tp
    # does not divide it. 0: every other cut, into `tp` equal pieces.
    vocab: int = 0

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s piece of the whole tensor `full`."""
        if self.vocab:
            rows = vocab_ranges(self.vocab, size)[rank]
            return full.narrow(self.dim, rows.start, len(rows))
        pieces = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([piece.chunk(size, dim=self.dim)[rank] for piece in pieces], dim=self.dim)

    def piece_lengths(self, local_length: int, size: int) -> list[int]:
        """The length along `dim` of every rank's piece, given this rank's (`local_length`)."""
        if self.vocab:
            return [len(rows) for rows in vocab_ranges(self.vocab, size)]
        return [local_length] * size

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
    `reduced`: the module whose output is all-reduced over the tp group (`tag` names it in the byte log), or, with
    `gathered_vocab` > 0 (the vocab-parallel `lm_head`), all-gathered into the whole `[..., gathered_vocab]` output;
    `localize(rank, size)` sets the module's head counts, layer widths or vocabulary offset to tp rank `rank`'s
    share, so its own forward runs unchanged on the local pieces."""

    cuts: list[ParameterCut]
    summed_biases: list[nn.Module]
    reduced: nn.Module
    tag: str
    localize: Callable[[int, int], None]
    gathered_vocab: int = 0


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

    def localize(rank: int, size: int) -> None:
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

    def localize(rank: int, size: int) -> None:
        _narrow_linears(size, columns, [attn.o_proj])
        attn.num_heads //= size

    return ShardPlan(cuts, [attn.o_proj], attn.o_proj, "tp.mla_o_proj", localize)


def _mlp_cuts(mlp: KDSAMLP) -> tuple[list[ParameterCut], Callable[[int], None]]:
    columns = [mlp.gate_proj, mlp.up_proj]
    cuts = [cut for linear in columns for cut in _column(linear)] + [ParameterCut(mlp.down_proj, "weight", 1)]
    return cuts, lambda rank, size: _narrow_linears(size, columns, [mlp.down_proj])


def feed_forward_shard_plan(mlp: KDSAMLP | KDSAMoE) -> ShardPlan:
    """The intermediate dim of a dense MLP, of every routed expert (`gate_up_proj` `[E, 2I, D]` in gate and up blocks,
    `down_proj` `[E, D, I]`) and of the shared experts; the router stays whole. One all-reduce after the whole MLP."""
    if getattr(mlp, "experts", None) is None:  # by attribute: remote-code copies of the classes shard too
        cuts, localize = _mlp_cuts(mlp)
        return ShardPlan(cuts, [mlp.down_proj], mlp, "tp.mlp", localize)
    experts = getattr(mlp.experts, "local_experts", mlp.experts)  # behind expert parallelism's dispatch, or bare
    cuts = [ParameterCut(experts, "gate_up_proj", 1, blocks=2), ParameterCut(experts, "down_proj", 2)]
    summed, localize_shared = [], lambda rank, size: None
    if mlp.shared_experts is not None:
        shared_cuts, localize_shared = _mlp_cuts(mlp.shared_experts)
        cuts += shared_cuts
        summed.append(mlp.shared_experts.down_proj)
    return ShardPlan(cuts, summed, mlp, "tp.mlp", localize_shared)


def layer_shard_plans(layer) -> list[ShardPlan]:
    """The plans of one decoder layer: its token mixer, then its feed-forward."""
    mixer = kda_shard_plan(layer.linear_attn) if hasattr(layer, "linear_attn") else mla_shard_plan(layer.self_attn)
    return [mixer, feed_forward_shard_plan(layer.mlp)]


def embedding_shard_plan(embed: nn.Module) -> ShardPlan:
    """The input embedding by vocabulary rows (`vocab_ranges`); its output is all-reduced. The module must be a
    `KDSAEmbedding` (by attribute, `vocab_start`: remote-code copies shard too), whose lookup zeroes the ids outside
    its rows."""
    if not hasattr(embed, "vocab_start"):
        raise ValueError(
            f"tensor parallelism cuts the input embedding by vocabulary rows and needs KDSA's KDSAEmbedding "
            f"(modeling_kdsa/embedding.py), got {type(embed).__name__}"
        )

    def localize(rank: int, size: int) -> None:
        embed.vocab_start = vocab_ranges(embed.num_embeddings, size)[rank].start

    cut = ParameterCut(embed, "weight", 0, vocab=embed.num_embeddings)
    return ShardPlan([cut], [], embed, "tp.embed_tokens", localize)


def lm_head_shard_plan(head: nn.Module) -> ShardPlan:
    """The output head by vocabulary rows (its output columns); the logits are all-gathered over tp, so the module
    still returns `[..., out_features]` (`out_features` stays the whole vocabulary)."""
    vocab = head.out_features
    names = [name for name in ("weight", "bias") if getattr(head, name, None) is not None]
    cuts = [ParameterCut(head, name, 0, vocab=vocab) for name in names]
    return ShardPlan(cuts, [], head, "tp.lm_head", lambda rank, size: None, gathered_vocab=vocab)


def vocab_shard_plans(model) -> list[ShardPlan]:
    """The input embedding's plan and, for a `KDSAForCausalLM`, the head's. A tied head (`tie_word_embeddings`) is
    cut by its own plan as well (the same rows as the embedding); the callers tie it back to the cut embedding."""
    plans = [embedding_shard_plan(getattr(model, "model", model).embed_tokens)]
    head = getattr(model, "lm_head", None)
    if head is not None:
        plans.append(lm_head_shard_plan(head))
    return plans


def tied_head(model) -> bool:
    """Whether `model`'s `lm_head` holds the input embedding's parameter itself (`tie_word_embeddings`)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model, "model", model).embed_tokens
    return head is not None and head._parameters.get("weight") is embed._parameters.get("weight")


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
    plan.localize(rank, size)


def _padded(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`tensor` zero-padded at the end of `dim` to `length`: uneven vocabulary shares padded to the first rank's for an
    all-gather, which needs one shape on every rank (the receivers trim them again)."""
    dim %= tensor.dim()
    short = length - tensor.shape[dim]
    return F.pad(tensor, [0, 0] * (tensor.dim() - 1 - dim) + [0, short]) if short > 0 else tensor


def _gather_pieces(local: torch.Tensor, cut: ParameterCut, group) -> list[torch.Tensor]:
    """Every rank's piece of `cut`, in rank order (uneven pieces, the vocabulary rows, padded and trimmed)."""
    size = dist.get_world_size(group)
    lengths = cut.piece_lengths(local.shape[cut.dim], size)
    padded = _padded(local, cut.dim, lengths[0])
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return [piece.narrow(cut.dim, 0, length) for piece, length in zip(pieces, lengths, strict=True)]


def gather_plan_tensors(plan: ShardPlan, group, wholes: dict[int, torch.Tensor]) -> None:
    """Add to `wholes`, keyed by the id of the local parameter, every cut parameter of `plan` gathered whole over the
    tp `group` (the inverse of each `ParameterCut`) and every summed bias taken back from tp rank 0 (the other ranks
    hold zeros). A parameter already in `wholes` (a tied head's weight is the embedding's) is not gathered again. A
    collective: every rank of `group` calls it for the same plans in the same order."""
    for cut in plan.cuts:
        param = getattr(cut.owner, cut.name)
        if id(param) not in wholes:
            wholes[id(param)] = cut.whole(_gather_pieces(param.detach().contiguous(), cut, group))
    for linear in plan.summed_biases:
        if linear.bias is not None:
            bias = linear.bias.detach().clone()
            dist.all_reduce(bias, group=group)  # rank 0's bias plus zeros: exact
            wholes[id(linear.bias)] = bias


def gather_whole_state_dict(model, state_dict: dict, group) -> dict:
    """`state_dict` of a tp-sharded `model` (`apply_tensor_parallel`, or a `tp_plan` load after it finished) with
    every cut tensor gathered whole over the tp `group` and every row-parallel bias taken back from tp rank 0: the
    state dict of the whole model, bit for bit (`gather_plan_tensors`). A collective: every rank of `group` calls it,
    in the same layer order (save_pretrained, docs/parallel.md §10). A parameter under several names (a tied head) is
    gathered once and written under each of its names in `state_dict`."""
    wholes: dict[int, torch.Tensor] = {}
    plans = [plan for layer in getattr(model, "model", model).layers for plan in layer_shard_plans(layer)]
    for plan in plans + vocab_shard_plans(model):
        gather_plan_tensors(plan, group, wholes)
    whole = dict(state_dict)
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in wholes and name in whole:
            whole[name] = wholes[id(param)]
    return whole


def all_reduce_output_hook(mesh: ParallelMesh, tag: str):
    """A forward hook that sums the module's output over the mesh's tp group (in place) and counts the bytes."""

    def hook(module, inputs, output):
        return mesh.all_reduce(output, "tp", tag)

    return hook


def all_gather_vocab_hook(mesh: ParallelMesh, vocab_size: int, tag: str):
    """A forward hook that all-gathers the module's `[..., rows]` output (this rank's `vocab_ranges` columns) over the
    mesh's tp group into the whole `[..., vocab_size]`, the same on every rank. Uneven shares are padded to the first
    rank's for the all-gather (one shape on every rank) and trimmed after."""
    ranges = vocab_ranges(vocab_size, mesh.tp_size)
    block = len(ranges[0])

    def hook(module, inputs, output):
        parts = mesh.all_gather(_padded(output, -1, block), "tp", tag)
        return torch.cat([part[..., : len(rows)] for part, rows in zip(parts, ranges, strict=True)], dim=-1)

    return hook


def output_hook(plan: ShardPlan, mesh: ParallelMesh):
    """The forward hook that combines `plan.reduced`'s output over the tp ranks: the vocabulary all-gather for the
    head, the all-reduce for everything else."""
    if plan.gathered_vocab:
        return all_gather_vocab_hook(mesh, plan.gathered_vocab, plan.tag)
    return all_reduce_output_hook(mesh, plan.tag)


def shard_plans(plans: list[ShardPlan], mesh: ParallelMesh) -> None:
    """Cut each plan's module for the mesh's tp rank (`shard_in_place`) and hook the all-reduce or all-gather of its
    output over the tp group."""
    for plan in plans:
        shard_in_place(plan, mesh.tp_rank, mesh.tp_size)
        # Kept on the module (as parallel/hf_plans.py does), so that a re-cut (parallel/handover.py) can take it off.
        plan.reduced.tensor_parallel_hook = plan.reduced.register_forward_hook(output_hook(plan, mesh))


def apply_tensor_parallel(model, mesh: ParallelMesh):
    """Shard `model` (a `KDSAForCausalLM` or `KDSAModel`, identical weights on every rank) over the mesh's tp group,
    in place, and return it: the decoder layers by head and intermediate dim, the embedding and `lm_head` by
    vocabulary rows (a tied head shares the cut embedding). Raises `ValueError` on every rank when a sharded size is
    not divisible by tp or the vocabulary would leave a rank no rows. Under tp = 1 this does nothing."""
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
    tied = tied_head(model)
    shard_plans([plan for layer in base.layers for plan in layer_shard_plans(layer)] + vocab_shard_plans(model), mesh)
    if tied:  # the head cut its own copy of the same rows: it shares the cut embedding again
        model.lm_head.weight = base.embed_tokens.weight
    # The group whose ranks run every forward together: speculative decoding agrees on its drafting rounds over it.
    model.tensor_parallel_group = mesh.tp_group
    return model


__all__ = [
    "ParameterCut",
    "ShardPlan",
    "all_gather_vocab_hook",
    "all_reduce_output_hook",
    "apply_tensor_parallel",
    "embedding_shard_plan",
    "feed_forward_shard_plan",
    "gather_plan_tensors",
    "gather_whole_state_dict",
    "kda_shard_plan",
    "layer_shard_plans",
    "lm_head_shard_plan",
    "mla_shard_plan",
    "output_hook",
    "shard_in_place",
    "shard_plans",
    "tensor_parallel_errors",
    "tied_head",
    "vocab_ranges",
    "vocab_shard_plans",
    "vocab_split_error",
]
