"""Tensor parallelism through transformers' own loading: `KDSAForCausalLM.from_pretrained(path, tp_plan="auto")` or
`distributed_config=DistributedConfig(tp_size=N)`, one process per rank (torchrun), each rank reading only its shard.

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
intermediate dim) — each taking its cuts from `parallel/tensor_parallel.py`'s `ShardPlan`s, the same description
`apply_tensor_parallel` slices a loaded model by. The style turns each cut parameter into a DTensor placeholder
(`ParameterCut.placement()`: `Shard(dim)`, or `_StridedShard` for the stacked gate / up rows), sets the module's local
sizes, and hooks the all-reduce after `o_proj` / the MLP. After loading, `finish_tensor_parallel_load` swaps each
DTensor for its local piece (a plain tensor, no copy) and zeroes row-parallel biases off rank 0, so the model's own
forward, kernels and `generate` run as after `apply_tensor_parallel`.

Registration happens when this module is imported: by `import modeling_kdsa.parallel`, or by
`KDSAForCausalLM.from_pretrained` when it is asked for tensor parallelism (a lazy import there: the model files ship
as transformers remote code and do not import this package at import time).
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers.distributed import DistributedConfig
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from .mesh import ParallelMesh, default_device_and_backend, raise_on_all_ranks
from .tensor_parallel import (
    ShardPlan,
    all_reduce_output_hook,
    feed_forward_shard_plan,
    kda_shard_plan,
    mla_shard_plan,
    tensor_parallel_errors,
)

STYLE_PLANS = {
    "kdsa_kda_heads": kda_shard_plan,
    "kdsa_mla_heads": mla_shard_plan,
    "kdsa_feed_forward": feed_forward_shard_plan,
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
        plan: ShardPlan = self.plan_of(module)
        for cut in plan.cuts:
            placeholder = cut.owner._parameters[cut.name]
            sharded = distribute_tensor(placeholder, mesh, [cut.placement()], src_data_rank=None)
            cut.owner._parameters[cut.name] = nn.Parameter(sharded, requires_grad=placeholder.requires_grad)
        plan.localize(mesh.size())
        parallel_mesh = _parallel_mesh(mesh)
        plan.reduced.register_forward_hook(all_reduce_output_hook(parallel_mesh, plan.tag))
        module._kdsa_shard_plan = plan
        module._kdsa_parallel_mesh = parallel_mesh
        # A load that does not go through KDSAForCausalLM.from_pretrained (AutoModel: `KDSAModel`) finishes here.
        module.register_forward_pre_hook(lambda module, args: _localize(module))
        return module


for _name, _plan_of in STYLE_PLANS.items():
    ALL_PARALLEL_STYLES.register(_name, KDSAHeadShardStyle(_plan_of))


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
    if module._kdsa_parallel_mesh.tp_rank != 0:
        with torch.no_grad():
            for linear in module._kdsa_shard_plan.summed_biases:
                if linear.bias is not None:
                    linear.bias.zero_()
    module._kdsa_localized = True


def finish_tensor_parallel_load(model: nn.Module) -> nn.Module:
    """After transformers loaded the shards: every planned module's parameters become plain local tensors
    (`_localize`); KDSAForCausalLM.from_pretrained calls this, and each planned module does it before its first
    forward otherwise."""
    for module in model.modules():
        if "_kdsa_shard_plan" in module.__dict__:
            _localize(module)
    return model


def tensor_parallel_mesh(model: nn.Module) -> ParallelMesh | None:
    """The `ParallelMesh` a tp-loaded model's all-reduces run over (its `comm` counts their bytes), or None."""
    for module in model.modules():
        if "_kdsa_parallel_mesh" in module.__dict__:
            return module._kdsa_parallel_mesh
    return None


def _requested_config(kwargs: dict) -> tuple[DistributedConfig | None, str | None]:
    """The `DistributedConfig` that from_pretrained's keyword arguments ask for (None: no parallelism), or an error."""
    distributed_config = kwargs.get("distributed_config")
    tp_plan, tp_size = kwargs.get("tp_plan"), kwargs.get("tp_size")
    if distributed_config is None and tp_plan is None and tp_size is None:
        return None, None
    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        return None, "pass either distributed_config= or tp_plan= / tp_size=, not both"
    try:
        if distributed_config is None:
            distributed_config = DistributedConfig(tp_plan=tp_plan, tp_size=tp_size)
        elif isinstance(distributed_config, dict):
            distributed_config = DistributedConfig.from_dict(distributed_config)
    except ValueError as error:
        return None, str(error)
    return distributed_config, None


def _layout_error(distributed_config: DistributedConfig, config, fp8_weights) -> str | None:
    plan = distributed_config.tp_plan
    if plan is not None and plan != "auto":
        return (
            f"tp_plan={plan!r}: KDSA shards by its own plan (KDA heads, MLA heads, MLP / expert intermediate dim, "
            "docs/parallel.md §10); pass tp_plan='auto' or DistributedConfig(tp_size=N)"
        )
    others = {
        "ep_size": distributed_config.ep_size,
        "fsdp_size": distributed_config.fsdp_size,
        "dp_replicate_size": distributed_config.dp_replicate_size,
        "pp_size": distributed_config.pp_size,
    }
    if any(size != 1 for size in others.values()):
        return (
            f"only tensor parallelism loads through transformers here, got {others}; expert parallelism is "
            "modeling_kdsa.parallel.apply_expert_parallel (docs/parallel.md §9)"
        )
    tp_size = distributed_config.tp_size
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world_size != tp_size:
        return (
            f"tp_size={tp_size} but the world size is {world_size}: launch one process per tp rank "
            f"(torchrun --nproc-per-node {tp_size})"
        )
    if fp8_weights == "hold":
        return "tensor parallelism does not shard FP8-held weights (fp8_weights='hold'); use fp8_weights='dequantize'"
    return tensor_parallel_errors(config, tp_size)


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


def check_tensor_parallel_load(config, kwargs: dict) -> bool:
    """Called by `KDSAForCausalLM.from_pretrained` before transformers sets up any mesh: whether tensor parallelism
    was asked for (tp > 1), after checking the layout against `config` (the checkpoint's, with the call's overrides).
    A bad layout raises the same ValueError on every rank, before any collective of the load."""
    distributed_config, error = _requested_config(kwargs)
    if distributed_config is None and error is None:
        return False
    if error is None:
        error = _layout_error(distributed_config, config, kwargs.get("fp8_weights"))
    _agree(error)
    return distributed_config.tp_size > 1


__all__ = [
    "KDSAHeadShardStyle",
    "STYLE_PLANS",
    "check_tensor_parallel_load",
    "finish_tensor_parallel_load",
    "tensor_parallel_mesh",
]
