"""The kernel registry: every kernel a KDSA model calls, named, per backend, and the device policy that picks a backend
(docs/backends.md §1).

A backend is a `KernelSet`: one field per kernel, each defaulting to the torch reference, so a backend names only what
it replaces. A field set to None means the backend does not implement that kernel; `KernelSet.require` then raises a
ValueError naming the backend and the kernel. The `npu` and `triton` sets are built on first use, because building
them imports torch_npu / triton (and fla), which the other backends never need.

Kernels and their contracts:
- `indexer_topk`, `sparse_mla`, `kpool_indexer_topk`, `dense_mla`: read the paged DSA / MLA store, which they take
  as one `dsa_paged_common.PagedKeys` (the plane read, block table, key count, first query position, padding mask,
  the k-pool store's pools and origin), after the queries:
  `indexer_topk(q_index, weights, keys, index_topk)`, `sparse_mla(q_latent, q_pe, keys, indices, softmax_scale)`,
  `kpool_indexer_topk(q_index, weights, keys, index_topk, ape, select_tail)`,
  `dense_mla(q_latent, q_pe, keys, softmax_scale)` (shapes in `dsa_paged_reference.paged_*_reference`, docs/dsa.md
  §4, §8, §9; one file per backend: dsa_paged_reference.py, dsa_paged_cpu.py over dsa_paged_fused.py,
  dsa_paged_compiled.py).
- `kda_chunk` (prefill) and `kda_recurrent` (decode, and the replay of a rollback): the KDA delta rule (signatures of
  `kda_ops.chunk_kda` / `kda_ops.recurrent_kda`, docs/kda.md §3, §5); `kda_recurrent_stepwise` (`(q, v) -> bool`):
  whether `kda_recurrent` computes a call of these T tokens bit for bit as T one-token calls, so that a verification
  of a few drafted tokens and a rollback's replay make one call (the cpu kernel, docs/kda.md §9).
- `static_indexer_topk`, `static_kpool_indexer_topk`, `static_sparse_mla`, `static_dense_mla`: the fixed-shape reads
  of a compiled static-cache step, with the signatures above (`dsa_paged_static.static_*`, docs/graph-mode.md §3);
  the torch ones for every backend, except that the cpu backend's `static_indexer_topk`, `static_kpool_indexer_topk`
  and `static_sparse_mla` run a decode step through the C++ kernels (docs/dsa.md §11, §12), as does its
  `kda_recurrent` (docs/kda.md §9).
- `kv_store`: the layout the paged store keeps kv rows in, the one its attention kernels read
  (`(formats, kv_rows, latent_width) -> stored rows`).
- `dsa_decode_prolog`: the projections of a DSA decode step (`(layer, hidden_states, position_embeddings)`, the
  values of `KDSASparseAttention.project`), in order by default, on several streams on a device.
- The products of the layers (signatures and references in `linear_ops`): `row_linear` (every linear layer,
  `F.linear`'s arguments), `head_matmul` / `head_linear` (MLA's absorbed per-head products, docs/dsa.md §13),
  `expert_linear` (each row through its routed expert's matrix, docs/graph-mode.md §12) with `experts_in_place`
  (`(x, weight) -> bool`: whether `expert_linear` reads the experts' stacked weights in place for these rows, which
  makes `KDSAExperts` take its gathered path), `fp8_dequantize` and `fp8_row_linear` (FP8-held weights,
  docs/checkpoint-conversion.md §9). The `cpu` entries run the C++ kernels where they apply and the reference
  elsewhere; so `torch` runs no `kdsa::` op anywhere.
"""

import dataclasses
from collections.abc import Callable

import torch

from .cpu_expert_linear import cpu_expert_linear, expert_linear_applies
from .cpu_expert_linear import kernel_available as expert_linear_available
from .cpu_fp8_dequantize import cpu_fp8_dequantize, cpu_fp8_row_linear
from .cpu_fp8_dequantize import kernel_available as fp8_kernels_available
from .cpu_head_products import cpu_head_linear, cpu_head_matmul
from .cpu_head_products import kernel_available as head_products_available
from .cpu_indexer import kernel_available as indexer_available
from .cpu_kda_recurrent import cpu_recurrent_kda
from .cpu_kda_recurrent import kernel_applies as kda_recurrent_kernel_applies
from .cpu_kda_recurrent import kernel_available as kda_recurrent_available
from .cpu_row_linear import cpu_row_linear
from .cpu_row_linear import kernel_available as row_linear_available
from .cpu_sparse_mla import kernel_available as sparse_mla_available
from .dsa_paged_compiled import (
    paged_dense_mla_compiled,
    paged_indexer_topk_compiled,
    paged_kpool_indexer_topk_compiled,
    paged_sparse_mla_compiled,
)
from .dsa_paged_cpu import (
    paged_indexer_topk_cpu,
    paged_kpool_indexer_topk_cpu,
    paged_sparse_mla_cpu,
    static_indexer_topk_cpu,
    static_kpool_indexer_topk_cpu,
    static_sparse_mla_cpu,
)
from .dsa_paged_fused import paged_dense_mla_fused
from .dsa_paged_reference import (
    paged_dense_mla_reference,
    paged_indexer_topk_reference,
    paged_kpool_indexer_topk_reference,
    paged_sparse_mla_reference,
)
from .dsa_paged_static import static_dense_mla, static_indexer_topk, static_kpool_indexer_topk, static_sparse_mla
from .kda_ops import chunk_kda, recurrent_kda, recurrent_kda_stepwise
from .linear_ops import (
    dequantize_tiles_torch,
    expert_linear,
    experts_gathered,
    fp8_linear,
    linear,
    per_head_linear,
    per_head_matmul,
)


def rows_kv_store(formats, kv_rows: torch.Tensor, latent_width: int):
    """kv rows `[..., C + R]` as the paged store keeps them for the kernels that read them: one plane per part
    (`CacheFormats.encode_kv_rows`: the rows, or the quantized planes)."""
    return formats.encode_kv_rows(kv_rows, latent_width)


def in_order_prolog(layer, hidden_states: torch.Tensor, position_embeddings):
    """A DSA decode step's projections, one after the other on the current stream (`KDSASparseAttention.project`'s
    in-order path)."""
    return layer.project_in_order(hidden_states, position_embeddings)


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The kernels of one backend (`name`); None = not implemented by this backend."""

    name: str
    indexer_topk: Callable | None = paged_indexer_topk_reference
    sparse_mla: Callable | None = paged_sparse_mla_reference
    kpool_indexer_topk: Callable | None = paged_kpool_indexer_topk_reference
    dense_mla: Callable | None = paged_dense_mla_reference
    kda_chunk: Callable | None = chunk_kda
    kda_recurrent: Callable | None = recurrent_kda
    kda_recurrent_stepwise: Callable | None = recurrent_kda_stepwise
    static_indexer_topk: Callable | None = static_indexer_topk
    static_kpool_indexer_topk: Callable | None = static_kpool_indexer_topk
    static_sparse_mla: Callable | None = static_sparse_mla
    static_dense_mla: Callable | None = static_dense_mla
    kv_store: Callable | None = rows_kv_store
    dsa_decode_prolog: Callable | None = in_order_prolog
    row_linear: Callable | None = linear
    head_matmul: Callable | None = per_head_matmul
    head_linear: Callable | None = per_head_linear
    expert_linear: Callable | None = expert_linear
    experts_in_place: Callable | None = experts_gathered
    fp8_dequantize: Callable | None = dequantize_tiles_torch
    fp8_row_linear: Callable | None = fp8_linear

    def require(self, kernel: str) -> Callable:
        """The kernel named `kernel` (a field name); ValueError when this backend does not implement it."""
        if kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {kernel!r}; kernels are {KERNEL_NAMES}")
        function = getattr(self, kernel)
        if function is None:
            raise ValueError(
                f"kernel_backend={self.name!r} does not implement the {kernel} kernel (docs/backends.md §6); use a "
                "kernel_backend that does, e.g. 'cpu' or 'torch'"
            )
        return function


KERNEL_NAMES = tuple(field.name for field in dataclasses.fields(KernelSet) if field.name != "name")

TORCH_KERNELS = KernelSet("torch")
# The layers' products on CPU: the C++ kernels where they apply (`cpu` and `compiled`).
CPU_PRODUCTS = dict(
    row_linear=cpu_row_linear,
    head_matmul=cpu_head_matmul,
    head_linear=cpu_head_linear,
    expert_linear=cpu_expert_linear,
    experts_in_place=expert_linear_applies,
    fp8_dequantize=cpu_fp8_dequantize,
    fp8_row_linear=cpu_fp8_row_linear,
)
CPU_KERNELS = KernelSet(
    "cpu",
    indexer_topk=paged_indexer_topk_cpu,
    sparse_mla=paged_sparse_mla_cpu,
    kpool_indexer_topk=paged_kpool_indexer_topk_cpu,
    dense_mla=paged_dense_mla_fused,
    static_indexer_topk=static_indexer_topk_cpu,
    static_kpool_indexer_topk=static_kpool_indexer_topk_cpu,
    static_sparse_mla=static_sparse_mla_cpu,
    kda_recurrent=cpu_recurrent_kda,
    kda_recurrent_stepwise=kda_recurrent_kernel_applies,
    **CPU_PRODUCTS,
)
# The `kdsa::` ops the cpu set's kernels call (the `cpu_*.py` C++ kernels, docs/backends.md §7), each with the function
# that builds (or finds on disk) and registers its CPU kernel in this process, True when it is registered: what a
# program calling these ops needs first (aot/decode_step.py).
CPU_KERNEL_OPS: dict[str, Callable[[], bool]] = {
    "row_linear": row_linear_available,
    "fp8_row_linear": fp8_kernels_available,
    "dequantize_fp8_tiles": fp8_kernels_available,
    "head_linear": head_products_available,
    "head_matmul": head_products_available,
    "expert_linear": expert_linear_available,
    "indexer_topk_decode": indexer_available,
    "kda_recurrent": kda_recurrent_available,
    "sparse_mla_decode": sparse_mla_available,
}
COMPILED_KERNELS = KernelSet(
    "compiled",
    indexer_topk=paged_indexer_topk_compiled,
    sparse_mla=paged_sparse_mla_compiled,
    kpool_indexer_topk=paged_kpool_indexer_topk_compiled,
    dense_mla=paged_dense_mla_compiled,
    **CPU_PRODUCTS,
)


def _npu_kernels() -> KernelSet:
    """torch_npu's fused ops (docs/backends.md §2); ValueError unless torch_npu and an NPU are available."""
    # `from .module import` form (here and below): transformers' remote-code loader fetches only the modules it finds
    # imported that way, so this is how a Hub checkpoint's copy of these device modules reaches its users.
    from .kda_device_ops import npu_recurrent_kda
    from .npu_kernels import (
        npu_kv_store,
        paged_dense_mla_npu,
        paged_indexer_topk_npu,
        paged_kpool_indexer_topk_npu,
        paged_sparse_mla_npu,
        three_stream_prolog,
        torch_npu_module,
    )

    torch_npu_module()
    return KernelSet(
        "npu",
        indexer_topk=paged_indexer_topk_npu,
        sparse_mla=paged_sparse_mla_npu,
        kpool_indexer_topk=paged_kpool_indexer_topk_npu,
        dense_mla=paged_dense_mla_npu,
        # kda_chunk stays the torch reference: torch_npu's chunked gated delta rule takes a per-head decay only.
        kda_recurrent=npu_recurrent_kda,
        kv_store=npu_kv_store,
        dsa_decode_prolog=three_stream_prolog,
    )


def _triton_kernels() -> KernelSet:
    """Our Triton DSA kernels and fla's Triton KDA (docs/backends.md §4); ValueError without triton or fla."""
    from .kda_device_ops import fla_chunk_kda, fla_recurrent_kda, require_fla
    from .triton_kernels import paged_indexer_topk_triton, paged_sparse_mla_triton, require_triton

    require_triton()
    require_fla()
    return KernelSet(
        "triton",
        indexer_topk=paged_indexer_topk_triton,
        sparse_mla=paged_sparse_mla_triton,
        kpool_indexer_topk=None,  # the Triton indexer scores one key per token (docs/backends.md §4)
        # dense_mla stays the torch reference (no Triton dense kernel).
        kda_chunk=fla_chunk_kda,
        kda_recurrent=fla_recurrent_kda,
    )


# Backend name -> its KernelSet (a function, so that device backends import their runtime only when chosen).
_BACKENDS: dict[str, Callable[[], KernelSet]] = {
    "torch": lambda: TORCH_KERNELS,
    "cpu": lambda: CPU_KERNELS,
    "compiled": lambda: COMPILED_KERNELS,
    "npu": _npu_kernels,
    "triton": _triton_kernels,
}
BACKEND_NAMES = tuple(_BACKENDS)


def resolve_kernel_backend(backend: str, device: torch.device) -> str:
    """The device policy: `auto` picks the fused kernels of the device, `cpu` on CPU and `npu` for tensors on an
    Ascend NPU; anything else (CUDA included: the Triton kernels are opt-in until they have run on a GPU) gets the
    torch reference. Any other name is returned as is."""
    if backend != "auto":
        return backend
    return {"cpu": "cpu", "npu": "npu"}.get(device.type, "torch")


def kernel_set(backend: str, device: torch.device | None = None) -> KernelSet:
    """The KernelSet of a backend name (`auto` resolved for `device`, which it then needs). ValueError for an unknown
    name, and for `npu` / `triton` when their runtime is missing."""
    if backend == "auto":
        if device is None:
            raise ValueError("kernel_backend='auto' needs the device of the tensors to pick a backend")
        backend = resolve_kernel_backend(backend, device)
    if backend not in _BACKENDS:
        raise ValueError(f"unknown kernel_backend {backend!r}; choose one of {('auto', *BACKEND_NAMES)}")
    return _BACKENDS[backend]()


__all__ = [
    "BACKEND_NAMES",
    "COMPILED_KERNELS",
    "CPU_KERNELS",
    "CPU_KERNEL_OPS",
    "KERNEL_NAMES",
    "KernelSet",
    "TORCH_KERNELS",
    "in_order_prolog",
    "kernel_set",
    "resolve_kernel_backend",
    "rows_kv_store",
]
