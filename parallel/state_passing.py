"""KDA context parallelism by state passing: affine segment summaries and their prefix fold (FlashKDA CP / FLA KCP).

docs/kda.md §5 (a chunk's state transition is affine, `S_end = M·S_start + S_ext`, and so are its outputs),
docs/parallel.md §3 (FLA KCP: summaries `[S_ext | M]` in fp32, one all-gather, fold `S ← M_j S + S_ext,j`; zigzag
compatibility: every rank summarises both of its segments, all `2·cp` pairs arrive in one all-gather, any arrival
order works).

Shapes follow kda_ops: `q, k, g: [B, T, H, K]`, `v: [B, T, H, V]`, `beta: [B, T, H]`, states `[B, H, K, V]` (rows are
key channels). Everything here is fp32 (the M chain must stay fp32, kda.md §3.5).

How a segment is summarised without knowing its start state `S_in`: the delta-rule recurrence
`S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ` acts on each column of the state separately. So one
`chunk_kda` pass over the segment with the *augmented* values `[0_K | v]` (width K + V) and the augmented start state
`[I_K | 0]` carries both parts at once:
- final state `[M | S_ext]`: `M` (`[K, K]` per head) is the product of the segment's transition matrices, `S_ext` the
  end state from a zero start;
- outputs `[o_state | o_zero]`: `o_zero` the output from a zero start and `o_state` (`[T, H, K]`) the rows
  `(scale·q_t)ᵀ M_{≤t}`, so that the true output is `o_t = o_zero_t + o_state_t · S_in` once `S_in` is known.
Finishing a segment is therefore one small matmul, not a second pass over its tokens.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from modeling_kdsa.kda_ops import chunk_kda


@dataclass
class SegmentSummary:
    """The affine map of one segment. `transition` M `[B, H, K, K]`, `state_ext` `[B, H, K, V]`, `out_zero`
    `[B, T, H, V]`, `out_state` `[B, T, H, K]`, all fp32."""

    transition: torch.Tensor
    state_ext: torch.Tensor
    out_zero: torch.Tensor
    out_state: torch.Tensor

    def end_state(self, start_state: torch.Tensor) -> torch.Tensor:
        """`M·S_in + S_ext`, `[B, H, K, V]`."""
        return self.transition @ start_state.float() + self.state_ext

    def outputs(self, start_state: torch.Tensor) -> torch.Tensor:
        """The segment's outputs for start state `S_in`: `o_zero + o_state·S_in`, `[B, T, H, V]` fp32."""
        return self.out_zero + torch.einsum("bthk,bhkv->bthv", self.out_state, start_state.float())


def summarize_segment(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    kda_chunk: Callable = chunk_kda,
) -> SegmentSummary:
    """One chunked KDA pass over a segment that returns its affine summary (see the module docstring).
    q, k must be L2-normalised (as for `chunk_kda`); `scale` defaults to `K ** -0.5`. `kda_chunk`: the prefill kernel
    that runs the pass, the kernel registry's `kda_chunk` of the model's backend (docs/backends.md §1; the torch
    reference by default)."""
    batch, _, num_heads, head_k_dim = k.shape
    head_v_dim = v.shape[-1]
    values = torch.cat([v.new_zeros(*v.shape[:3], head_k_dim), v], dim=-1).float()  # [0_K | v]
    start = torch.zeros(batch, num_heads, head_k_dim, head_k_dim + head_v_dim, dtype=torch.float32, device=k.device)
    start[..., :head_k_dim] = torch.eye(head_k_dim, device=k.device)  # [I_K | 0]
    out, final = kda_chunk(q, k, values, g, beta, scale=scale, initial_state=start, output_final_state=True)
    return SegmentSummary(
        transition=final[..., :head_k_dim],
        state_ext=final[..., head_k_dim:],
        out_zero=out[..., head_k_dim:],
        out_state=out[..., :head_k_dim],
    )


def fold_start_states(
    transitions: list[torch.Tensor], state_exts: list[torch.Tensor], initial_state: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Start state of every segment from the summaries of segments `0 … N−1` in sequence order, by the fold
    `S ← M_j S + S_ext,j` (docs/parallel.md §3), in fp32. Returns `N + 1` states: `[S_in(0), …, S_in(N−1), S_end]`.
    A zero `initial_state` (None) is a sequence start."""
    if len(transitions) != len(state_exts) or not transitions:
        raise ValueError(f"need as many transitions as state_exts (>= 1), got {len(transitions)} and {len(state_exts)}")
    state = torch.zeros_like(state_exts[0]) if initial_state is None else initial_state.float()
    states = [state]
    for transition, state_ext in zip(transitions, state_exts, strict=True):
        state = transition @ state + state_ext
        states.append(state)
    return states


__all__ = ["SegmentSummary", "summarize_segment", "fold_start_states"]
