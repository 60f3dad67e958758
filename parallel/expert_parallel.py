"""Expert parallelism for KDSA: each ep rank holds a contiguous block of whole routed experts, and the routed
(token, expert) pairs travel to their expert's rank and back by all-to-all (docs/parallel.md §9).

The layout is DeepSeek-V3's for serving (arXiv:2412.19437 §3.4): outside the routed experts the ep ranks are data
parallel. Each ep rank runs its own sequences (its share of the batch) through its own copy of the attention, KDA,
router, shared experts and dense MLPs (replicated, or cut by a tp group as in tensor_parallel.py); inside each MoE
layer every rank sends each routed pair's token row to the rank that owns the expert (dispatch), each rank runs its
own experts on the rows it received, and the expert outputs go back to the rows' ranks (combine), which weight and
sum them. Nothing is dropped (no capacity factor): all-to-all with per-rank split sizes moves exactly the routed pairs.

Exactness: a rank receives its experts' rows ordered by source rank, then by position in the source's token order,
so when the ranks hold consecutive shares of a batch each expert sees the same rows, in the same order, as in one
process; the owner returns unweighted outputs and the source weights them in fp32 and adds each token's k outputs in
expert order, as `KDSAExperts.forward` does.

Mesh `(ep, tp)` with tp innermost (rank `ep_rank · tp + tp_rank`, as parallel/mesh.py orders `(cp, tp)`): the ranks
of a tp group hold the same tokens and cut every expert by its intermediate dim (`apply_tensor_parallel`); the ranks
of an ep group (same tp rank) hold different tokens and different experts. A rank dispatches within its ep group, the
owner computes its slice of the expert, and the tp all-reduce after the MoE sums the slices. LatentMoE and packed
MXFP4 experts move whole (an expert's packed rows and scale bytes are never cut) and run with tp = 1 only, as
tensor parallelism refuses them (docs/parallel.md §5). FP8-held linear layers (`fp8_weights="hold"`) are never
routed experts (those load dequantized, docs/checkpoint-conversion.md §9), so they stay whole on every rank.

gloo runs `all_to_all_single` with uneven split sizes on CPU tensors (its list form `all_to_all` requires equal
sizes), as do nccl and hccl.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from modeling_kdsa.fp8_linear import KDSAFP8Linear
from modeling_kdsa.moe import KDSAExperts, KDSAMoE

from .mesh import ParallelMesh, join_process_group, raise_on_all_ranks, single_process_mesh
from .tensor_parallel import apply_tensor_parallel, tensor_parallel_errors


@dataclass
class AllToAllTraffic:
    """What this rank sent in the expert all-to-alls since the last `reset`, in elements (multiply by the activation
    itemsize for bytes). Rows sent to this rank itself are counted too: they equal this rank's routed pairs.

    `dispatched_rows`: routed (token, expert) pairs this rank sent; `dispatched_elements`: their rows' elements
    (pairs × expert width: hidden size, or the latent width under LatentMoE); `remote_rows`: the pairs whose expert
    lives on another rank; `combined_elements`: expert-output elements this rank sent back; `count_elements`: the
    per-expert counts exchanged first (int64, n_routed_experts per layer call); `calls`: MoE layer calls."""

    dispatched_rows: int = 0
    remote_rows: int = 0
    dispatched_elements: int = 0
    combined_elements: int = 0
    count_elements: int = 0
    calls: int = 0

    def reset(self) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)


@dataclass
class ExpertParallelMesh:
    """The ep group of this rank and the tp mesh inside it. `tp` is a `ParallelMesh` with cp = 1 (what
    `apply_tensor_parallel` takes); `traffic` counts the expert all-to-alls of every layer sharded over this mesh."""

    ep_size: int
    ep_rank: int
    ep_group: object
    tp: ParallelMesh
    traffic: AllToAllTraffic = field(default_factory=AllToAllTraffic)
    device_mesh: object = None  # the torch `DeviceMesh` with dims ("ep", "tp"), when built by `expert_parallel_mesh`

    @property
    def tp_size(self) -> int:
        return self.tp.tp_size

    def batch_rows(self, batch_size: int) -> slice:
        """This ep rank's consecutive share of `batch_size` sequences (shares differ by at most one; the first ranks
        take the larger ones). With these shares every expert sees its rows in the single-process order."""
        base, extra = divmod(batch_size, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, extra)
        return slice(start, start + base + (self.ep_rank < extra))


def init_expert_parallel_mesh(tp_size: int, ep_size: int, backend: str | None = None) -> ExpertParallelMesh:
    """Join (or start, from torchrun's `env://` variables) the default process group and build the `(ep, tp)` mesh.
    Raises the same `ValueError` on every rank when `world size != tp · ep`, a size is not positive, or the ranks
    were started with different sizes; the verdicts are exchanged before the mesh's groups are created."""
    device_type, device = join_process_group({"tp": tp_size, "ep": ep_size}, backend)
    return expert_parallel_mesh(device_type, tp_size, ep_size, device)


def expert_parallel_mesh(device_type: str, tp_size: int, ep_size: int, device: torch.device) -> ExpertParallelMesh:
    """The `(ep, tp)` mesh over all ranks of the default process group, tp innermost; a collective."""
    device_mesh = init_device_mesh(device_type, (ep_size, tp_size), mesh_dim_names=("ep", "tp"))
    tp = ParallelMesh(
        cp_size=1,
        tp_size=tp_size,
        cp_rank=0,
        tp_rank=device_mesh.get_local_rank("tp"),
        cp_group=None,
        tp_group=device_mesh.get_group("tp"),
        device=device,
    )
    ep_rank, ep_group = device_mesh.get_local_rank("ep"), device_mesh.get_group("ep")
    return ExpertParallelMesh(ep_size, ep_rank, ep_group, tp, device_mesh=device_mesh)


def expert_parallel_errors(model, tp_size: int, ep_size: int) -> str | None:
    """Why `model` cannot be sharded over `tp × ep` ranks by `apply_expert_parallel`, or None."""
    config = model.config
    if tp_size < 1 or ep_size < 1:
        return f"tp and ep must be >= 1, got tp={tp_size}, ep={ep_size}"
    layers = getattr(model, "model", model).layers
    moes = [layer.mlp for layer in layers if isinstance(layer.mlp, KDSAMoE)]
    if any(isinstance(moe.experts, ExpertParallelExperts) for moe in moes):
        return "the model's experts are already sharded by apply_expert_parallel"
    if any(moe.experts.down_proj.shape[-1] != config.moe_intermediate_size for moe in moes if not moe.experts.mxfp4):
        return (
            "the routed experts are already cut by apply_tensor_parallel; pass the unsharded model to "
            "apply_expert_parallel, which applies the tp part of the mesh itself"
        )
    if ep_size > 1 and not moes:
        return f"ep={ep_size}: the model has no routed experts (mlp_layer_types has no 'sparse' layer)"
    if config.n_routed_experts % ep_size:
        return f"ep={ep_size} must divide n_routed_experts={config.n_routed_experts} (whole experts per rank)"
    if tp_size > 1:
        error = tensor_parallel_errors(config, tp_size)
        if error is not None:
            return error
        if any(isinstance(module, KDSAFP8Linear) for module in model.modules()):
            return (
                f"tp={tp_size}: apply_tensor_parallel does not shard FP8-held weights (fp8_weights='hold'); use "
                "tp = 1 (ep alone keeps them whole) or load the checkpoint with fp8_weights='dequantize'"
            )
    return None


class ExpertParallelExperts(nn.Module):
    """Stands in for a `KDSAExperts` (same call, `[N, D]` tokens with their top-k experts and weights → `[N, D]`) on
    one ep rank: `local_experts` holds experts `[first_expert, first_expert + E/ep)`; the forward dispatches the routed
    pairs to their experts' ranks, runs the local experts on what it received and combines the returned outputs.
    A collective: every rank of the ep group must call it once per MoE layer call, also with no tokens of its own."""

    def __init__(self, local_experts: KDSAExperts, num_experts: int, mesh: ExpertParallelMesh):
        super().__init__()
        self.local_experts = local_experts
        self.num_experts = num_experts
        self.experts_per_rank = local_experts.num_experts
        self.first_expert = mesh.ep_rank * self.experts_per_rank
        self.ep_size, self.ep_rank, self.ep_group = mesh.ep_size, mesh.ep_rank, mesh.ep_group
        self.traffic = mesh.traffic

    def forward(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """`hidden_states: [N, D]`, `topk_indices: [N, k]` (global expert ids), `topk_weights: [N, k]` → `[N, D]`."""
        if torch.compiler.is_compiling():
            raise RuntimeError("expert parallelism runs eagerly: its split sizes are known only on the host")
        num_tokens, num_slots = topk_indices.shape
        width = hidden_states.shape[-1]
        flat_experts = topk_indices.reshape(-1)  # [N·k], token-major
        # Pairs by expert; the experts of a rank are consecutive, so also by destination rank.
        order = flat_experts.argsort(stable=True)
        send_rows = hidden_states[order // num_slots]  # [N·k, D]
        send_counts = torch.bincount(flat_experts, minlength=self.num_experts)  # [E] int64
        received_counts = torch.empty_like(send_counts)  # [ep · E_local]: by source rank, then local expert
        dist.all_to_all_single(received_counts, send_counts, group=self.ep_group)
        # One host sync: rows to each rank, rows from each rank.
        rows_per_rank = torch.stack([send_counts, received_counts]).view(2, self.ep_size, self.experts_per_rank)
        send_splits, received_splits = rows_per_rank.sum(-1).tolist()

        received_rows = send_rows.new_empty(sum(received_splits), width)
        dist.all_to_all_single(received_rows, send_rows, received_splits, send_splits, group=self.ep_group)
        # Each received row through its expert (top-1 with weight 1.0, which leaves the output as the expert's own).
        local_experts = torch.arange(self.experts_per_rank, device=received_counts.device).repeat(self.ep_size)
        local_expert_of_row = local_experts.repeat_interleave(received_counts)  # [R]
        if received_rows.shape[0]:
            ones = torch.ones(received_rows.shape[0], 1, dtype=torch.float32, device=received_rows.device)
            expert_outputs = self.local_experts(received_rows, local_expert_of_row.unsqueeze(-1), ones)
        else:
            expert_outputs = received_rows
        returned = send_rows.new_empty(send_rows.shape)
        dist.all_to_all_single(returned, expert_outputs, send_splits, received_splits, group=self.ep_group)

        self.traffic.calls += 1
        self.traffic.dispatched_rows += send_rows.shape[0]
        self.traffic.remote_rows += send_rows.shape[0] - send_splits[self.ep_rank]
        self.traffic.dispatched_elements += send_rows.numel()
        self.traffic.combined_elements += expert_outputs.numel()
        self.traffic.count_elements += send_counts.numel()

        # Back to token-major pairs, each token's slots in expert order, summed in fp32 in that order.
        pair_outputs = torch.empty_like(returned)
        pair_outputs[order] = returned
        slot_order = topk_indices.argsort(dim=-1)
        pair_outputs = pair_outputs.view(num_tokens, num_slots, width)
        pair_outputs = pair_outputs.gather(1, slot_order.unsqueeze(-1).expand(-1, -1, width))
        weights = topk_weights.gather(-1, slot_order).float()
        output = pair_outputs[:, 0].float() * weights[:, :1]
        for slot in range(1, num_slots):
            output = output + pair_outputs[:, slot].float() * weights[:, slot : slot + 1]
        return output.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        last = self.first_expert + self.experts_per_rank - 1
        return f"experts {self.first_expert}..{last} of {self.num_experts} (ep rank {self.ep_rank} of {self.ep_size})"


def wrap_local_experts(model, mesh: ExpertParallelMesh) -> None:
    """Put each MoE layer's experts, already holding only this ep rank's block (and tp slice), behind the all-to-all
    dispatch (`ExpertParallelExperts`), and mark the model as one whose ep ranks run different sequences."""
    num_experts = model.config.n_routed_experts
    for layer in getattr(model, "model", model).layers:
        if isinstance(layer.mlp, KDSAMoE):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, num_experts, mesh)
    if mesh.ep_size > 1:  # the ep ranks run different sequences: speculative decoding refuses such a model
        model.expert_parallel_group = mesh.ep_group


def gather_expert_parallel_state_dict(model, state_dict: dict) -> dict:
    """`state_dict` of an expert-parallel `model` with each MoE layer's routed experts gathered whole over its ep
    group, under the unsharded model's names (`….mlp.experts.gate_up_proj`, not `….experts.local_experts.…`): every
    stacked weight and packed MXFP4 buffer, concatenated by expert in ep-rank order (rank r holds experts
    `[r·E/ep, (r+1)·E/ep)`). Expert tensors cut by tp must be gathered whole over tp first
    (`tensor_parallel.gather_whole_state_dict`). A collective over the ep group: every rank calls it (save_pretrained,
    docs/parallel.md §10)."""
    whole = dict(state_dict)
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        local_prefix = f"{prefix}.local_experts."
        for key in [key for key in state_dict if key.startswith(local_prefix)]:
            local = whole.pop(key).contiguous()
            pieces = [torch.empty_like(local) for _ in range(module.ep_size)]
            dist.all_gather(pieces, local, group=module.ep_group)
            whole[prefix + "." + key.removeprefix(local_prefix)] = torch.cat(pieces)
    return whole


def _keep_experts(experts: KDSAExperts, start: int, end: int) -> None:
    """Keep experts `[start, end)` of every stacked weight (whole experts: packed MXFP4 rows and their scales move
    as stored), in place."""
    for name, tensor in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        local = tensor.detach()[start:end].clone()
        if isinstance(tensor, nn.Parameter):
            setattr(experts, name, nn.Parameter(local, requires_grad=False))
        else:
            setattr(experts, name, local)
    experts.num_experts = end - start


def _as_mesh(group_or_mesh) -> tuple[ExpertParallelMesh, object]:
    """The mesh to shard over and the group whose ranks must agree on the layout."""
    if isinstance(group_or_mesh, ExpertParallelMesh):
        return group_or_mesh, None
    if isinstance(group_or_mesh, dist.ProcessGroup):
        group = group_or_mesh
        mesh = ExpertParallelMesh(
            dist.get_world_size(group), dist.get_rank(group), group, single_process_mesh(torch.device("cpu"))
        )
        return mesh, group
    raise TypeError(
        "apply_expert_parallel takes an ExpertParallelMesh (init_expert_parallel_mesh) or a torch.distributed "
        f"ProcessGroup (ep group, tp = 1), got {type(group_or_mesh).__name__}"
    )


def apply_expert_parallel(model, group_or_mesh):
    """Shard `model` (a `KDSAForCausalLM` or `KDSAModel`, identical weights on every rank) in place and return it:
    each decoder layer's routed experts are split over the ep ranks (rank r keeps experts `[r·E/ep, (r+1)·E/ep)`) and
    run by all-to-all dispatch and combine; with a mesh whose tp > 1 the rest is also cut by `apply_tensor_parallel`
    (the experts by intermediate dim inside each tp group). `group_or_mesh`: an `ExpertParallelMesh`
    (`init_expert_parallel_mesh`), or a `ProcessGroup` whose ranks are the ep group (tp = 1).

    A bad layout raises the same `ValueError` on every rank (the verdicts are exchanged) before anything is changed
    or sent: experts not divisible by ep, no routed experts with ep > 1, sizes not divisible by tp, LatentMoE, packed
    or FP8-held weights with tp > 1, a model already sharded. The MTP draft layers keep all their experts."""
    mesh, group = _as_mesh(group_or_mesh)
    raise_on_all_ranks(expert_parallel_errors(model, mesh.tp_size, mesh.ep_size), group)
    moes = [layer.mlp for layer in getattr(model, "model", model).layers if isinstance(layer.mlp, KDSAMoE)]
    num_experts = model.config.n_routed_experts
    per_rank = num_experts // mesh.ep_size
    for moe in moes:
        _keep_experts(moe.experts, mesh.ep_rank * per_rank, (mesh.ep_rank + 1) * per_rank)
    apply_tensor_parallel(model, mesh.tp)
    wrap_local_experts(model, mesh)
    return model


__all__ = [
    "AllToAllTraffic",
    "ExpertParallelExperts",
    "ExpertParallelMesh",
    "apply_expert_parallel",
    "expert_parallel_errors",
    "expert_parallel_mesh",
    "gather_expert_parallel_state_dict",
    "init_expert_parallel_mesh",
    "wrap_local_experts",
]
