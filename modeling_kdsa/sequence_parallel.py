"""The hooks through which one forward of the model runs over a sequence cut across processes (context parallelism).

docs/parallel.md §7. The model, its decoder layers and its token mixers take an optional `sequence_parallel` context;
`None` (the default) is one process holding the whole sequence, and every hook below is then skipped by a plain
`if`, so the single-process forward is unchanged (and compiles unchanged). With a context, each process holds some
of the tokens (`positions`), and the layers call the hooks exactly where the math needs the other processes: the
KDA short conv (inputs before each local segment), the KDA recurrence (the state entering each segment), and the
MLA / DSA keys (all of them, in sequence order) with the queries each process runs. Everything else in a layer
(projections, gates, norms, MoE, residual streams) is position-wise and runs on the local tokens as it is.

This module defines only the interface: the model files never depend on how processes communicate. The
implementation (mesh, layout, collectives) is `parallel/context_parallel.py`.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch


class QuerySegment(NamedTuple):
    """A run of `count` local tokens at consecutive positions from `position`, followed by `padding` local slots that
    hold no token (their outputs are zero). The local tokens are the concatenation of the segments in order."""

    position: int
    count: int
    padding: int = 0


class SequenceParallelContext:
    """This process's share of a sequence of `seq_len` tokens and the collectives the layers need.

    The local tokens `[B, L, ...]` are runs of consecutive positions (`query_segments`), possibly with padding slots
    (`positions == -1`) so that every process holds tensors of one shape. A context serves one forward that starts a
    sequence (an empty cache), without a padding mask.
    """

    seq_len: int  # tokens of the whole sequence
    positions: torch.Tensor  # [L] int64: the original position of each local token, -1 for a padding slot

    def token_mask(self) -> torch.Tensor:
        """`[L]` bool, False for padding slots: the KDA layers run those as identity steps."""
        return self.positions >= 0

    def query_segments(self) -> list[QuerySegment]:
        """The local tokens as segments of consecutive positions, in local order."""
        raise NotImplementedError

    def short_conv(
        self, x: torch.Tensor, weight: torch.Tensor, keep_window: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The causal depthwise conv (`kda_ops.causal_short_conv`) of the local pre-conv columns `x` `[B, C, L]`,
        each segment continued from the `W − 1` inputs before it wherever they live. Returns the conv output
        `[B, C, L]` and, with `keep_window`, the whole sequence's last `W` inputs `[B, C, W]` (the cache's conv
        window; zeros before the sequence start), else None."""
        raise NotImplementedError

    def kda_recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        kda_chunk: Callable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The KDA recurrence (from a zero state) over the local tokens, each segment started from the state the
        tokens before it leave; `kda_chunk` is the layer's prefill kernel (the kernel registry's, `kda_ops.chunk_kda`'s
        contract). Returns the outputs `[B, L, H, V]` and the state after the last token of
        the whole sequence `[B, H, K, V]` fp32."""
        raise NotImplementedError

    def gather_sequence(self, parts: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Each `[B, L, n_i]` local part → `[B, seq_len, n_i]`: every token of the sequence in order, padding slots
        dropped (one collective for all parts; `name` labels it in communication logs)."""
        raise NotImplementedError

    def indexer_topk(
        self,
        select: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
        q_index: torch.Tensor,
        weights: torch.Tensor,
        position: int,
        width: int,
    ) -> torch.Tensor:
        """`select(q_index, weights, position)` for a block of `n` queries at `position …`: the Lightning Indexer's
        selection `[B, n, k]` (-1 = no key), `k <= width`. A context may split the queries among processes that share
        them and gather the selections (padded with -1 to `width`), and counts the work."""
        raise NotImplementedError


__all__ = ["QuerySegment", "SequenceParallelContext"]
