"""CP × TP parallelism for KDSA prefill (docs/parallel.md): a (cp, tp) mesh, the Zigzag layout, KDA state passing,
DSA with all-gathered keys, and a head / intermediate-dim tensor-parallel plan. See README "Parallelism"."""

from .context_parallel import MeshSequenceContext, PrefillOutput, PrefillStats, context_parallel_prefill
from .mesh import CommLog, ParallelMesh, init_parallel_mesh, raise_on_all_ranks, single_process_mesh
from .state_passing import SegmentSummary, fold_start_states, summarize_segment
from .tensor_parallel import apply_tensor_parallel, tensor_parallel_errors
from .zigzag import LAYOUTS, Segment, SequenceLayout

__all__ = [
    "LAYOUTS",
    "CommLog",
    "MeshSequenceContext",
    "ParallelMesh",
    "PrefillOutput",
    "PrefillStats",
    "Segment",
    "SegmentSummary",
    "SequenceLayout",
    "apply_tensor_parallel",
    "context_parallel_prefill",
    "fold_start_states",
    "init_parallel_mesh",
    "raise_on_all_ranks",
    "single_process_mesh",
    "summarize_segment",
    "tensor_parallel_errors",
]
