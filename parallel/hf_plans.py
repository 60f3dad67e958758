"""Tensor and expert parallelism through transformers' own loading: `KDSAForCausalLM.from_pretrained(path,
tp_plan="auto")`, `distributed_config=DistributedConfig(tp_size=N)` or `DistributedConfig(tp_size=N, ep_size=M)`, one
process per rank (torchrun), each rank reading only its shard.

How transformers does it (5.24: `distributed/mixin.py`, `distributed/tensor_parallel.py`,
`distributed/sharding_utils.py`): the model is built on the meta device; for every module the tp plan names
(`base_model_tp_plan` in the config, prefixed with `model.`), the named style from the `ParallelInterface` registry
`ALL_PARALLEL_STYLES` replaces parameters with DTensor placeholders and installs its forward; then each checkpoint
tensor whose parameter is a DTensor is read as this rank's slice only (`DtensorShardOperation` slices the safetensors
file, so no rank reads the whole tensor).

Its built-in styles cut one linear at a time, while a KDA head spans its q/k/v projections and short convs, `f_b_proj`,
`dt_bias`, `A_log` `[1, 1, H, 1]`, `b_proj` and the output gate, and the layer's head counts must shrink with them
(docs/parallel.md §5, §6). So KDSA registers one style per module kind — `kdsa_kda_heads` (a KDA layer),
`kdsa_mla_heads` (an MLA / DSA layer; the indexer stays whole), `kdsa_feed_forward` (a dense MLP or an MoE: the
intermediate dim), `kdsa_vocab_embedding` and `kdsa_vocab_head` (the input embedding and `lm_head` by vocabulary rows,
unevenly where tp does not divide the vocabulary; each rank reads only its rows) — each taking its cuts from
`parallel/tensor_parallel.py`'s `ShardPlan`s, the same description `apply_tensor_parallel` slices a loaded model by.
The style turns each cut parameter into a DTensor placeholder (`ParameterCut.placement()`: `Shard(dim)`, or
`_StridedShard` for the stacked gate / up rows), sets the module's local sizes, and hooks the all-reduce after
`o_proj` / the MLP / the embedding (the all-gather of the logits after the head). After loading,
`finish_tensor_parallel_load` swaps each DTensor for its local piece (a plain tensor, no copy), ties a tied head back
to the cut embedding and zeroes row-parallel biases off rank 0, so the model's own
forward, kernels and `generate` run as after `apply_tensor_parallel`. `A_log` and the short-conv weights are the
exception (`ParameterCut.read_whole`): some families store them in another layout (flat, zero-padded, fused), which
the slicing of the stored tensor cannot follow, so they are read whole, converted and cut after the load.

Expert parallelism (`ep_size` > 1): KDSA's `(ep, tp)` layout (docs/parallel.md §9), which transformers' own expert
plans cannot express (docs/parallel.md §10). `check_tensor_parallel_load` swaps the caller's config for an
`ExpertParallelLoad`, on which transformers builds nothing, and `KDSAForCausalLM.maybe_distribute_model` (transformers'
hook before the weights load) cuts the meta model over the `(ep, tp)` mesh here, the experts as DTensors on both dims,
so the same shard-on-read gives each rank only its experts; the experts then go behind the all-to-all dispatch.

FP8 folders (`weight_scale_inv` per weight block): transformers slices each scale grid by its weight's cut, right only
when every piece is a whole number of scale blocks. `check_tensor_parallel_load` checks each cut before the load
(`_fp8_whole_reads`): a dense weight off its grid is read whole and cut after the load (a `ShardedLoad` names it),
routed experts off their grid are refused (docs/parallel.md §10).

Registration happens when this module is imported: by `import modeling_kdsa.parallel`, or by
`KDSAForCausalLM.from_pretrained` when it is asked for tensor parallelism (a lazy import there: the model files ship
as transformers remote code and do not import this package at import time).
"""

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers.distributed import DistributedConfig
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from .expert_parallel import init_expert_parallel_mesh, wrap_local_experts
from .mesh import ParallelMesh, default_device_and_backend, raise_on_all_ranks
from .tensor_parallel import (
    ShardPlan,
    embedding_shard_plan,
    feed_forward_shard_plan,
    kda_shard_plan,
    lm_head_shard_plan,
    mla_shard_plan,
    output_hook,
    tensor_parallel_errors,
    tied_head,
    vocab_shard_plans,
)

STYLE_PLANS = {
    "kdsa_kda_heads": kda_shard_plan,
    "kdsa_mla_heads": mla_shard_plan,
    "kdsa_feed_forward": feed_forward_shard_plan,
    "kdsa_vocab_embedding": embedding_shard_plan,
    "kdsa_vocab_head": lm_head_shard_plan,
}

_PARALLEL_MESHES: dict[int, tuple[object, ParallelMesh]] = {}


def _parallel_mesh(device_mesh) -> ParallelMesh:
    """One `ParallelMesh` (tp = the 1-D device mesh, cp = 1) per device mesh, so its byte log covers every layer. The
    device mesh is kept with it, so its id is not reused by another mesh."""
    key = id(device_mesh)
    if key not in _PARALLEL_MESHES:
        kind = device_mesh.device_type
        device = torch.device(kind) if kind == "cpu" else torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)))
        mesh = ParallelMesh(
            cp_size=1,
            tp_size=device_mesh.size(),
            cp_rank=0,
            tp_rank=device_mesh.get_local_rank(),
            cp_group=None,
            tp_group=device_mesh.get_group(),
            device=device,
        )
        _PARALLEL_MESHES[key] = (device_mesh, mesh)
    return _PARALLEL_MESHES[key][1]


class KDSAHeadShardStyle(TensorParallelLayer):
    """A transformers tensor-parallel style that cuts one KDSA module by its `ShardPlan` (see the module docstring).
    `install_forward` is the hook transformers calls once per planned module, before the weights load."""

    def __init__(self, plan_of):
        self.plan_of = plan_of

    def install_forward(self, module: nn.Module, mesh) -> nn.Module:
        plan = _marked_whole_reads(self.plan_of(module))
        for cut in plan.cuts:
            if cut.read_whole:  # loaded whole, cut by `_localize`
                continue
            placeholder = cut.owner._parameters[cut.name]
            sharded = distribute_tensor(placeholder, mesh, [cut.placement()], src_data_rank=None)
            cut.owner._parameters[cut.name] = nn.Parameter(sharded, requires_grad=placeholder.requires_grad)
        plan.localize(mesh.get_local_rank(), mesh.size())
        parallel_mesh = _parallel_mesh(mesh)
        plan.reduced.tensor_parallel_hook = plan.reduced.register_forward_hook(output_hook(plan, parallel_mesh))
        module._kdsa_shard_plan = plan
        module._kdsa_parallel_mesh = parallel_mesh
        # A load that does not go through KDSAForCausalLM.from_pretrained (AutoModel: `KDSAModel`) finishes here.
        module.register_forward_pre_hook(lambda module, args: _localize(module))
        return module


for _name, _plan_of in STYLE_PLANS.items():
    ALL_PARALLEL_STYLES.register(_name, KDSAHeadShardStyle(_plan_of))


def _marked_whole_reads(plan: ShardPlan) -> ShardPlan:
    """`plan` with the cuts `ShardedLoad.prepare_meta_model` marked on their owner read whole too."""
    marked = [
        replace(cut, read_whole=True) if cut.name in cut.owner.__dict__.get("_kdsa_read_whole", ()) else cut
        for cut in plan.cuts
    ]
    return replace(plan, cuts=marked)


def _localize(module: nn.Module) -> None:
    """Once per planned module, after the load: its DTensor parameters become their local pieces (plain parameters
    over the same storage) and its row-parallel biases are kept on tp rank 0 only (the ranks' outputs are summed)."""
    if module.__dict__.get("_kdsa_localized"):
        return
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if isinstance(param, DTensor):
                local = param.to_local().detach()
                submodule._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
    mesh = module._kdsa_parallel_mesh
    for cut in module._kdsa_shard_plan.cuts:
        if cut.read_whole:  # a copy: the whole tensor is freed
            whole = cut.owner._parameters[cut.name]
            local = cut.local(whole.detach(), mesh.tp_rank, mesh.tp_size).clone()
            cut.owner._parameters[cut.name] = nn.Parameter(local, requires_grad=whole.requires_grad)
    if mesh.tp_rank != 0:
        with torch.no_grad():
            for linear in module._kdsa_shard_plan.summed_biases:
                if linear.bias is not None:
                    linear.bias.zero_()
    module._kdsa_localized = True


def tensor_parallel_mesh(model: nn.Module) -> ParallelMesh | None:
    """The `ParallelMesh` a tp-loaded model's all-reduces run over (its `comm` counts their bytes), or None."""
    for module in model.modules():
        if "_kdsa_parallel_mesh" in module.__dict__:
            return module._kdsa_parallel_mesh
    return None


@dataclass(frozen=True)
class _Request:
    """What from_pretrained's keyword arguments ask for: tensor parallelism over `tp` ranks, expert parallelism over
    `ep` groups of them (world = tp·ep, docs/parallel.md §9), or why not (`error`)."""

    tp: int = 1
    ep: int = 1
    error: str | None = None


# The `DistributedConfig` fields KDSA reads; every other field must be unset or hold its default.
_READ_FIELDS = ("tp_size", "tp_plan", "ep_size", "enable_expert_parallel")


def _requested_layout(kwargs: dict) -> _Request | None:
    """The layout from_pretrained's keyword arguments ask for (None: no parallelism). A `DistributedConfig` with
    `ep_size` > 1 is read by KDSA, not by transformers (see `check_tensor_parallel_load`); a dict is read field by
    field, because `DistributedConfig` itself refuses `ep_size` > `tp_size` without FSDP (`tp_size=1, ep_size=2`)."""
    distributed_config = kwargs.get("distributed_config")
    tp_plan, tp_size = kwargs.get("tp_plan"), kwargs.get("tp_size")
    if distributed_config is None and tp_plan is None and tp_size is None:
        return None
    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        return _Request(error="pass either distributed_config= or tp_plan= / tp_size=, not both")
    if distributed_config is None:
        fields = {"tp_plan": tp_plan, "tp_size": tp_size}
    elif isinstance(distributed_config, dict):
        fields = dict(distributed_config)
    else:
        fields = {name: getattr(distributed_config, name) for name in DistributedConfig.__dataclass_fields__}
    unknown = sorted(set(fields) - set(DistributedConfig.__dataclass_fields__))
    if unknown:
        return _Request(error=f"distributed_config has fields DistributedConfig does not define: {unknown}")
    plan = fields.get("tp_plan")
    if plan is not None and plan != "auto":
        return _Request(
            error=f"tp_plan={plan!r}: KDSA shards by its own plan (KDA heads, MLA heads, MLP / expert intermediate "
            "dim, docs/parallel.md §10); pass tp_plan='auto' or DistributedConfig(tp_size=N)"
        )
    default = DistributedConfig()
    others = {
        name: fields[name]
        for name in DistributedConfig.__dataclass_fields__
        if name not in _READ_FIELDS and fields.get(name) not in (None, getattr(default, name))
    }
    if others:
        return _Request(
            error=f"KDSA loads with tensor and expert parallelism only (tp_size, ep_size), got {others} "
            "(docs/parallel.md §10)"
        )
    ep = fields.get("ep_size") or 1
    if fields.get("enable_expert_parallel") and ep == 1:
        return _Request(error="enable_expert_parallel=True: pass ep_size (docs/parallel.md §10)")
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    tp = fields.get("tp_size")
    if tp is None:  # tp_plan="auto" alone: every rank is a tp rank (transformers' rule), or the ep groups' share
        tp = max(world_size // ep, 1)
    if tp < 1 or ep < 1:
        return _Request(error=f"tp_size and ep_size must be >= 1, got tp_size={tp}, ep_size={ep}")
    if world_size != tp * ep:
        if ep == 1:
            error = (
                f"tp_size={tp} but the world size is {world_size}: launch one process per tp rank "
                f"(torchrun --nproc-per-node {tp})"
            )
        else:
            error = (
                f"tp_size={tp} × ep_size={ep} = {tp * ep} but the world size is {world_size}: KDSA's ep ranks are "
                f"data parallel outside the experts, each a group of tp ranks (torchrun --nproc-per-node {tp * ep}, "
                "docs/parallel.md §9)"
            )
        return _Request(tp, ep, error)
    return _Request(tp, ep)


def _config_error(request: _Request, config, fp8_weights) -> str | None:
    """Why `config` cannot load over `request`'s layout, or None."""
    tp, ep = request.tp, request.ep
    if ep > 1:
        if "sparse" not in list(config.mlp_layer_types):
            return f"ep_size={ep}: the model has no routed experts (mlp_layer_types has no 'sparse' layer)"
        if config.n_routed_experts % ep:
            return f"ep_size={ep} must divide n_routed_experts={config.n_routed_experts} (whole experts per rank)"
    if tp > 1 and fp8_weights == "hold":
        return "tensor parallelism does not shard FP8-held weights (fp8_weights='hold'); use fp8_weights='dequantize'"
    return tensor_parallel_errors(config, tp)


def _fp8_cut_misaligned(cut, shape: torch.Size, block: tuple[int, int], tp: int) -> bool:
    """Whether transformers' shard-on-read would cut an FP8 weight and its `weight_scale_inv` grid at different
    places. It slices the scales by the weight's own placement (torch.chunk's ceil split of the scale rows or columns),
    which lines up with the weight's piece only when every piece is a whole number of scale blocks; a stacked `[E, out,
    in]` expert parameter loads from one `[out, in]` weight per expert, each cut alone (its gate and up weights too)."""
    stacked = len(shape) == 3
    length = shape[cut.dim] // cut.blocks
    block_length = block[cut.dim - stacked]
    if cut.blocks > 1 and not stacked and length % block_length:  # the second block's piece starts off the grid
        return True
    return -(-length // tp) % block_length != 0


def _fp8_whole_reads(config, foreign_plan, tp: int) -> tuple[tuple[str, ...], str | None]:
    """For an FP8 folder loaded with tp > 1 (`foreign_plan.fp8_block`): the parameters whose tp cut does not fall on
    their scale blocks (`_fp8_cut_misaligned`). Each is read whole and cut after the load, as the convs are. Routed
    experts are never read whole (every rank would read all of them): a misaligned expert cut is the error returned."""
    if foreign_plan is None or foreign_plan.fp8_block is None or tp == 1:
        return (), None
    from ..modeling_kdsa import KDSAForCausalLM

    with torch.device("meta"):
        model = KDSAForCausalLM(config)
    names = {module: name for name, module in model.named_modules()}
    whole, experts = [], []
    for _, plan in _shard_plans(model):
        for cut in plan.cuts:
            name = f"{names[cut.owner]}.{cut.name}"
            shape = getattr(cut.owner, cut.name).shape
            if cut.read_whole or name not in foreign_plan.fp8_targets:
                continue
            if _fp8_cut_misaligned(cut, shape, foreign_plan.fp8_block, tp):
                (experts if len(shape) == 3 else whole).append(name)
    if experts:
        return (), (
            f"tp_size={tp} cuts the FP8 routed experts {experts} off their {list(foreign_plan.fp8_block)} scale "
            "blocks: shard-on-read slices each weight_scale_inv by its weight's cut, so moe_intermediate_size / tp "
            "must be a multiple of the block (docs/parallel.md §10)"
        )
    return tuple(whole), None


def _agree(error: str | None) -> None:
    """Raise the same ValueError on every rank: exchange the verdicts when there is a process group (joining the
    launcher's `env://` group first, as transformers would right after), else raise here."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1 and "MASTER_ADDR" in os.environ:
        device_type, backend = default_device_and_backend()
        if device_type != "cpu":
            getattr(torch, device_type).set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
    if dist.is_initialized():
        raise_on_all_ranks(error)
    elif error is not None:
        raise ValueError(error)


@dataclass
class ShardedLoad(DistributedConfig):
    """A tensor-parallel load of an FP8 folder some of whose cut weights are read whole (`_fp8_whole_reads`), as
    `check_tensor_parallel_load` hands it to transformers in place of the caller's arguments.
    `KDSAForCausalLM.maybe_distribute_model` calls `prepare_meta_model` before transformers applies the tp plan."""

    kdsa_read_whole: tuple[str, ...] = ()

    def prepare_meta_model(self, model: nn.Module) -> None:
        """Mark each parameter to read whole on its module (`_marked_whole_reads` reads the marks)."""
        for name in self.kdsa_read_whole:
            module_name, _, param_name = name.rpartition(".")
            module = model.get_submodule(module_name)
            module.__dict__.setdefault("_kdsa_read_whole", set()).add(param_name)


@dataclass
class ExpertParallelLoad(ShardedLoad):
    """An expert-parallel load over a `(ep, tp)` mesh (world = tp·ep), as `check_tensor_parallel_load` hands it to
    transformers in place of the caller's `distributed_config`. Its own sizes are 1, so transformers builds no mesh
    and applies no plan; `KDSAForCausalLM.maybe_distribute_model` calls `distribute_meta_model` instead."""

    kdsa_tp_size: int = 1
    kdsa_ep_size: int = 1

    def distribute_meta_model(self, model: nn.Module) -> nn.Module:
        return _distribute_for_experts(model, self.kdsa_tp_size, self.kdsa_ep_size)


# The packed MXFP4 expert weights and their E8M0 scales (modeling_kdsa/moe.py `KDSAExperts`).
_PACKED_EXPERT_BUFFERS = ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed", "down_proj_scale")


def _shard_for_experts(module: nn.Module, plan: ShardPlan, mesh, is_moe: bool) -> None:
    """`KDSAHeadShardStyle.install_forward` over the `(ep, tp)` mesh: the routed experts' cut parameters become
    DTensors on both dims (`Shard(0)`: this ep rank's block of whole experts; the tp cut, or `Replicate` at tp = 1),
    everything else the plan cuts on the tp dim only (left whole at tp = 1). Packed MXFP4 experts (uint8 buffers, tp =
    1 only, §5) become `Shard(0)` DTensors too: transformers loads them as parameters, `_finish_expert_parallel` turns
    them back into buffers."""
    tp_size = mesh.tp_size
    plan = _marked_whole_reads(plan)
    experts = module.experts if is_moe else None
    if experts is not None and experts.mxfp4:
        for name in _PACKED_EXPERT_BUFFERS:
            placeholder = experts._buffers[name]
            experts._buffers[name] = distribute_tensor(placeholder, mesh.device_mesh, [Shard(0), Replicate()],
                                                       src_data_rank=None)  # fmt: skip
    for cut in plan.cuts:
        if cut.read_whole or (cut.owner is not experts and tp_size == 1):
            continue
        if cut.owner is experts:
            tp_placement = cut.placement() if tp_size > 1 else Replicate()
            device_mesh, placements = mesh.device_mesh, [Shard(0), tp_placement]
        else:
            device_mesh, placements = mesh.device_mesh["tp"], [cut.placement()]
        placeholder = cut.owner._parameters.get(cut.name)
        if placeholder is None:  # packed MXFP4 experts: buffers, not parameters
            continue
        sharded = distribute_tensor(placeholder, device_mesh, placements, src_data_rank=None)
        cut.owner._parameters[cut.name] = nn.Parameter(sharded, requires_grad=placeholder.requires_grad)
    if tp_size > 1:
        plan.localize(mesh.tp.tp_rank, tp_size)
        plan.reduced.tensor_parallel_hook = plan.reduced.register_forward_hook(output_hook(plan, mesh.tp))
    if experts is not None:
        experts.num_experts //= mesh.ep_size
    module._kdsa_shard_plan = plan
    module._kdsa_parallel_mesh = mesh.tp


def _shard_plans(model: nn.Module) -> list[tuple[nn.Module, ShardPlan]]:
    """Every module the tp styles cut (`base_model_tp_plan`) with its plan: each decoder layer's token mixer and
    feed-forward, then the embedding and head."""
    plans = []
    for layer in getattr(model, "model", model).layers:
        kda = hasattr(layer, "linear_attn")
        mixer = layer.linear_attn if kda else layer.self_attn
        plans.append((mixer, (kda_shard_plan if kda else mla_shard_plan)(mixer)))
        plans.append((layer.mlp, feed_forward_shard_plan(layer.mlp)))
    return plans + [(plan.reduced, plan) for plan in vocab_shard_plans(model)]


def _distribute_for_experts(model: nn.Module, tp_size: int, ep_size: int) -> nn.Module:
    """Cut the meta model for this rank of the `(ep, tp)` mesh before the weights load, so that transformers reads
    only this rank's experts (and tp slices); `finish_tensor_parallel_load` puts the experts behind the all-to-all.
    Under ep alone only the MoE feed-forwards are cut (their experts); the embedding and head stay whole."""
    mesh = init_expert_parallel_mesh(tp_size=tp_size, ep_size=ep_size)
    for module, plan in _shard_plans(model):
        is_moe = getattr(module, "experts", None) is not None
        if tp_size > 1 or is_moe:
            _shard_for_experts(module, plan, mesh, is_moe)
    model.__dict__["_kdsa_expert_parallel_mesh"] = mesh
    return model


def _localize_all(model: nn.Module) -> None:
    """`_localize` every planned module of a loaded model. transformers ties a tied head to the embedding's DTensor
    after the load, and each module's `_localize` gives it a local parameter of its own (the same storage): the head
    is tied back to the embedding's."""
    tied = tied_head(model)
    for module in model.modules():
        if "_kdsa_shard_plan" in module.__dict__:
            _localize(module)
    if tied:
        model.lm_head.weight = getattr(model, "model", model).embed_tokens.weight


def _finish_expert_parallel(model: nn.Module, mesh) -> None:
    """After the load: local tensors, this rank's block of packed experts, the experts behind the all-to-all."""
    _localize_all(model)
    for layer in getattr(model, "model", model).layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and experts.mxfp4:
            for name in _PACKED_EXPERT_BUFFERS:
                loaded = getattr(experts, name)
                experts._parameters.pop(name, None)
                experts._buffers[name] = loaded.to_local().detach() if isinstance(loaded, DTensor) else loaded
    wrap_local_experts(model, mesh)
    if mesh.tp_size > 1:  # speculative decoding's tp agreement reads it (refused under ep > 1 anyway, §12)
        model.tensor_parallel_group = mesh.tp.tp_group


def check_tensor_parallel_load(config, kwargs: dict, foreign_plan=None) -> bool:
    """Called by `KDSAForCausalLM.from_pretrained` before transformers sets up any mesh: whether tensor or expert
    parallelism was asked for (tp·ep > 1), after checking the layout against `config` (the checkpoint's, with the
    call's overrides; `foreign_plan`: the conversion of a published family's folder). A bad layout raises the same
    ValueError on every rank, before any collective of the load.

    With ep > 1 the distributed arguments become an `ExpertParallelLoad`, which transformers passes through to
    `KDSAForCausalLM.maybe_distribute_model` (its hook between building the meta model and reading the weights):
    KDSA's own (ep, tp) layout, which transformers' expert parallelism cannot express (docs/parallel.md §10)."""
    request = _requested_layout(kwargs)
    if request is None:
        return False
    error, whole = request.error or _config_error(request, config, kwargs.get("fp8_weights")), ()
    if error is None:
        whole, error = _fp8_whole_reads(config, foreign_plan, request.tp)
    _agree(error)
    if request.ep > 1 or whole:
        for name in ("tp_plan", "tp_size"):
            kwargs.pop(name, None)
    if request.ep > 1:
        kwargs["distributed_config"] = ExpertParallelLoad(
            kdsa_read_whole=whole, kdsa_tp_size=request.tp, kdsa_ep_size=request.ep
        )
        return True
    if whole:
        kwargs["distributed_config"] = ShardedLoad(tp_size=request.tp, kdsa_read_whole=whole)
    return request.tp > 1


def finish_tensor_parallel_load(model: nn.Module) -> nn.Module:
    """After transformers loaded the model. A tp load: every planned module's parameters become plain local tensors
    (`_localize`; each planned module does it before its first forward otherwise, e.g. under `AutoModel`). An ep load
    (`ExpertParallelLoad`): the same, and the experts go behind the all-to-all dispatch (`ExpertParallelExperts`)."""
    mesh = expert_parallel_mesh_of(model)
    if mesh is not None:
        _finish_expert_parallel(model, mesh)
        return model
    _localize_all(model)
    return model


def expert_parallel_mesh_of(model: nn.Module):
    """The `ExpertParallelMesh` of a model loaded with `ep_size` > 1 (its `batch_rows(B)` is this rank's share of a
    batch, its `traffic` counts the all-to-alls), or None."""
    return model.__dict__.get("_kdsa_expert_parallel_mesh")


__all__ = [
    "ExpertParallelLoad",
    "KDSAHeadShardStyle",
    "STYLE_PLANS",
    "check_tensor_parallel_load",
    "expert_parallel_mesh_of",
    "finish_tensor_parallel_load",
    "tensor_parallel_mesh",
]
