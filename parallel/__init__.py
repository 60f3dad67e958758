"""CP × TP parallelism for KDSA prefill (docs/parallel.md): a (cp, tp) mesh, the Zigzag layout, KDA state passing,
DSA with all-gathered keys, and a head / intermediate-dim / vocabulary tensor-parallel plan; expert parallelism over
a (tp, ep) mesh with all-to-all dispatch and combine (docs/parallel.md §9); the hand-over from a (cp, tp) prefill to a
(tp, ep) decode on the same ranks (docs/parallel.md §11); KDSA's styles for transformers' own tensor-parallel
loading, `from_pretrained(..., tp_plan="auto")` (docs/parallel.md §10). See README "Parallelism"."""

from .context_parallel import MeshSequenceContext, PrefillOutput, PrefillStats, context_parallel_prefill
from .expert_parallel import (
    AllToAllTraffic,
    ExpertParallelExperts,
    ExpertParallelMesh,
    apply_expert_parallel,
    expert_parallel_errors,
    init_expert_parallel_mesh,
)
from .handover import DecodeHandOver, hand_over_errors, hand_over_to_decode
from .hf_plans import (
    check_tensor_parallel_load,
    expert_parallel_mesh_of,
    finish_tensor_parallel_load,
    tensor_parallel_mesh,
)
from .mesh import CommLog, ParallelMesh, init_parallel_mesh, raise_on_all_ranks, single_process_mesh
from .state_passing import SegmentSummary, fold_start_states, summarize_segment
from .tensor_parallel import apply_tensor_parallel, tensor_parallel_errors
from .zigzag import LAYOUTS, Segment, SequenceLayout

__all__ = [
    "LAYOUTS",
    "AllToAllTraffic",
    "CommLog",
    "DecodeHandOver",
    "ExpertParallelExperts",
    "ExpertParallelMesh",
    "MeshSequenceContext",
    "ParallelMesh",
    "PrefillOutput",
    "PrefillStats",
    "Segment",
    "SegmentSummary",
    "SequenceLayout",
    "apply_expert_parallel",
    "apply_tensor_parallel",
    "check_tensor_parallel_load",
    "context_parallel_prefill",
    "expert_parallel_errors",
    "expert_parallel_mesh_of",
    "finish_tensor_parallel_load",
    "fold_start_states",
    "hand_over_errors",
    "hand_over_to_decode",
    "init_expert_parallel_mesh",
    "init_parallel_mesh",
    "raise_on_all_ranks",
    "single_process_mesh",
    "summarize_segment",
    "tensor_parallel_errors",
    "tensor_parallel_mesh",
]
