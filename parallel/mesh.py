"""The 2-D (cp, tp) device mesh, collective helpers that count bytes, and size checks that fail on every rank.

docs/parallel.md §1; transformers `integrations/tensor_parallel.py` (backend map `{"cuda": "nccl", "cpu": "gloo"}`,
`init_device_mesh`); gloo runs all_gather, all_reduce and `init_device_mesh` on CPU.

Launch with `torchrun --nproc_per_node N` or `accelerate launch --num_processes N`: both set the `env://` variables
(`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) that `init_process_group` reads. Rank `cp_rank · tp + tp_rank`: the tp
group is innermost, so tensor-parallel partners are neighbouring ranks (the same node on a cluster).

Failing without hanging: a check that fails on one rank only (e.g. ranks launched with different arguments) must
not leave the others waiting in a collective. `raise_on_all_ranks` therefore exchanges every rank's verdict (one
small all-gather that all ranks reach) and raises the same `ValueError` everywhere when any rank failed.
"""

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def default_device_and_backend() -> tuple[str, str]:
    """`("cuda", "nccl")` with CUDA, `("npu", "hccl")` with torch_npu, else `("cpu", "gloo")`."""
    if torch.cuda.is_available():
        return "cuda", "nccl"
    if hasattr(torch, "npu") and torch.npu.is_available():
        return "npu", "hccl"
    return "cpu", "gloo"


def raise_on_all_ranks(error: str | None, group=None) -> None:
    """Every rank of `group` calls this with its own verdict (`None` = fine). If any rank has an error, every rank
    raises a `ValueError` carrying the first failing rank's message. A collective: all ranks of `group` must call."""
    verdicts = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, error, group=group)
    failed = [(rank, message) for rank, message in enumerate(verdicts) if message is not None]
    if failed:
        rank, message = failed[0]
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise ValueError(f"rank {rank}{others}: {message}")


@dataclass
class CommLog:
    """Bytes each rank receives, by tag. Conventions: an all-gather of `n` bytes per rank over `P` ranks receives
    `(P−1)·n`; an all-reduce of `n` bytes receives `2·(P−1)/P·n` (ring algorithm). Groups of size 1 cost 0."""

    bytes_by_tag: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_tag: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, tag: str, num_bytes: float) -> None:
        self.bytes_by_tag[tag] += int(num_bytes)
        self.calls_by_tag[tag] += 1

    def reset(self) -> None:
        self.bytes_by_tag.clear()
        self.calls_by_tag.clear()


@dataclass
class ParallelMesh:
    """Sizes, ranks and process groups of the (cp, tp) mesh. `device_mesh` is the torch `DeviceMesh`
    (dims `("cp", "tp")`), or None for a single process."""

    cp_size: int
    tp_size: int
    cp_rank: int
    tp_rank: int
    cp_group: object
    tp_group: object
    device: torch.device
    device_mesh: DeviceMesh | None = None
    comm: CommLog = field(default_factory=CommLog)

    @property
    def is_first(self) -> bool:
        return self.cp_rank == 0 and self.tp_rank == 0

    def all_gather(self, tensor: torch.Tensor, dim: str, tag: str) -> list[torch.Tensor]:
        """All-gather `tensor` (same shape on every rank) over the `dim` ("cp" or "tp") group; rank order."""
        group, size = self._group(dim)
        if size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        self.comm.add(tag, (size - 1) * tensor.nbytes)
        return parts

    def all_reduce(self, tensor: torch.Tensor, dim: str, tag: str) -> torch.Tensor:
        """Sum `tensor` in place over the `dim` group and return it."""
        group, size = self._group(dim)
        if size == 1:
            return tensor
        dist.all_reduce(tensor, group=group)
        self.comm.add(tag, 2 * (size - 1) / size * tensor.nbytes)
        return tensor

    def _group(self, dim: str):
        if dim == "cp":
            return self.cp_group, self.cp_size
        if dim == "tp":
            return self.tp_group, self.tp_size
        raise ValueError(f"mesh dim must be 'cp' or 'tp', got {dim!r}")


def single_process_mesh(device: torch.device | str = "cpu") -> ParallelMesh:
    """cp = tp = 1 without torch.distributed: the parallel code paths run, every collective is a no-op."""
    return ParallelMesh(1, 1, 0, 0, None, None, torch.device(device))


def join_process_group(sizes: dict[str, int], backend: str | None = None) -> tuple[str, torch.device]:
    """Join (or start, from the `env://` variables of torchrun / accelerate) the default process group for a mesh of
    `sizes` (dim name -> size, in the order the error messages name them) and pick this process's device. Raises the
    same `ValueError` on every rank when a size is not positive, the world size is not their product, or the ranks
    were started with different sizes; the verdicts are exchanged before any mesh group is created. Returns the device
    type (for `init_device_mesh`) and the device."""
    device_type, default_backend = default_device_and_backend()
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or default_backend)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    names, values = list(sizes), tuple(sizes.values())
    error = None
    if min(values) < 1:
        given = ", ".join(f"{name}={size}" for name, size in sizes.items())
        error = f"{' and '.join(names)} must be >= 1, got {given}"
    elif world_size != math.prod(values):
        error = f"world size {world_size} != {'·'.join(names)} = {'·'.join(map(str, values))} = {math.prod(values)}"
    all_sizes = [None] * world_size
    dist.all_gather_object(all_sizes, values)
    if error is None and len(set(all_sizes)) > 1:
        error = f"ranks were started with different ({', '.join(names)}) sizes: {all_sizes}"
    raise_on_all_ranks(error)
    device = torch.device("cpu")
    if device_type != "cpu":  # one accelerator per process, picked by the launcher's LOCAL_RANK
        device_module = getattr(torch, device_type)
        device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", rank % device_module.device_count())))
        device_module.set_device(device)
    return device_type, device


def init_parallel_mesh(cp_size: int, tp_size: int, backend: str | None = None) -> ParallelMesh:
    """Join (or start, from the `env://` variables of torchrun / accelerate) the default process group and build the
    (cp, tp) mesh. Raises `ValueError` on every rank when `world size != cp · tp` or a size is not positive."""
    device_type, device = join_process_group({"cp": cp_size, "tp": tp_size}, backend)
    device_mesh = init_device_mesh(device_type, (cp_size, tp_size), mesh_dim_names=("cp", "tp"))
    return ParallelMesh(
        cp_size=cp_size,
        tp_size=tp_size,
        cp_rank=device_mesh.get_local_rank("cp"),
        tp_rank=device_mesh.get_local_rank("tp"),
        cp_group=device_mesh.get_group("cp"),
        tp_group=device_mesh.get_group("tp"),
        device=device,
        device_mesh=device_mesh,
    )


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> ParallelMesh:
    """The `ParallelMesh` of a torch `DeviceMesh` that has a "cp" and / or a "tp" dim and no other dim of size > 1, e.g.
    the one accelerate's `ParallelismConfig(cp_size=..., tp_size=...).build_device_mesh(device_type)` builds (dims
    `dp_replicate, dp_shard, cp, sp, tp` in that order, tp innermost, as `init_parallel_mesh`; docs/parallel.md §11).
    Raises `ValueError` (the same on every rank: the mesh is the same everywhere) for another layout."""
    names = device_mesh.mesh_dim_names or ()
    others = [name for name in names if name not in ("cp", "tp") and device_mesh[name].size() > 1]
    if others or not set(names) & {"cp", "tp"}:
        sizes = dict(zip(names, device_mesh.shape, strict=True))
        raise ValueError(f"a (cp, tp) mesh needs 'cp' / 'tp' dims and no other dim of size > 1, got {sizes}")

    def dim(name: str):
        if name not in names:
            return 1, 0, None
        sub = device_mesh[name]
        return sub.size(), sub.get_local_rank(), sub.get_group()

    (cp_size, cp_rank, cp_group), (tp_size, tp_rank, tp_group) = dim("cp"), dim("tp")
    device = torch.device("cpu")
    if device_mesh.device_type != "cpu":
        device_module = getattr(torch, device_mesh.device_type)
        device = torch.device(device_mesh.device_type, device_module.current_device())
    return ParallelMesh(cp_size, tp_size, cp_rank, tp_rank, cp_group, tp_group, device, device_mesh)


__all__ = [
    "CommLog",
    "ParallelMesh",
    "default_device_and_backend",
    "init_parallel_mesh",
    "join_process_group",
    "mesh_from_device_mesh",
    "raise_on_all_ranks",
    "single_process_mesh",
]
