"""Token layouts for context parallelism: Zigzag (causally load-balanced) and contiguous, for comparison.

docs/parallel.md §2 (the head-tail / zigzag layout of ring-flash-attention, torch's `_HeadTailLoadBalancer`,
Megatron; SGLang's in-seq-split for DSA; zigzag matters mostly for the indexer, whose causal work grows with the
query position).

A sequence of `seq_len` tokens is cut into `2·cp` chunks of consecutive tokens whose sizes differ by at most one
(the first `seq_len mod 2cp` chunks hold one token more). Zigzag: rank r holds chunks `r` and `2cp−1−r`, so every
rank holds one early and one late chunk and the causal work `Σ (position + 1)` is (nearly) the same on every rank.
Contiguous: rank r holds chunks `2r` and `2r+1`. Either way a rank holds exactly two chunks, in increasing position
order, each in a slot of `chunk_len = ceil(seq_len / 2cp)` tokens so that all ranks hold tensors of one shape (what
collectives need); a shorter chunk leaves one padding slot at its end, marked by position -1. Each chunk is a
*segment* (a run of consecutive positions) for the KDA state passing. Padding slots never influence a real token:
the KDA layers run them as identity steps, the DSA layers drop them from the gathered keys and skip their queries.
Splitting the remainder over the chunks, rather than padding the sequence's end, keeps zigzag balanced for lengths
that are not multiples of `2·cp` (end padding would leave rank 0's late chunk short).
"""

from dataclasses import dataclass

import torch

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Segment:
    """One chunk held by a rank: `chunk` its index in the sequence, `start` its first position, `local_offset`
    where its slot starts in the rank's local tokens, `num_real` its tokens (the rest of the slot is padding)."""

    chunk: int
    start: int
    local_offset: int
    num_real: int


@dataclass(frozen=True)
class SequenceLayout:
    """How `seq_len` tokens are spread over `cp_size` ranks. Raises `ValueError` for a bad size or layout name."""

    seq_len: int
    cp_size: int
    kind: str = "zigzag"

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.kind!r}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if self.seq_len < self.num_chunks:
            raise ValueError(
                f"sequence of {self.seq_len} tokens is shorter than the 2·cp = {self.num_chunks} chunks context "
                f"parallelism cuts it into (cp={self.cp_size}); use a smaller cp or a longer prompt"
            )

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp_size

    @property
    def chunk_len(self) -> int:
        """Slot width: the size of the largest chunk."""
        return -(-self.seq_len // self.num_chunks)

    @property
    def local_len(self) -> int:
        """Local tokens per rank, padding slots included: two chunk slots."""
        return 2 * self.chunk_len

    def chunk_size(self, chunk: int) -> int:
        base, remainder = divmod(self.seq_len, self.num_chunks)
        return base + (1 if chunk < remainder else 0)

    def chunk_start(self, chunk: int) -> int:
        base, remainder = divmod(self.seq_len, self.num_chunks)
        return chunk * base + min(chunk, remainder)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank `rank` holds, in increasing order."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}), got {rank}")
        if self.kind == "zigzag":
            return rank, self.num_chunks - 1 - rank
        return 2 * rank, 2 * rank + 1

    def segments_of(self, rank: int) -> list[Segment]:
        return [
            Segment(chunk, self.chunk_start(chunk), i * self.chunk_len, self.chunk_size(chunk))
            for i, chunk in enumerate(self.chunks_of(rank))
        ]

    def positions_of(self, rank: int) -> torch.Tensor:
        """Original positions of rank `rank`'s local tokens, int64 `[local_len]`; -1 marks a padding slot."""
        positions = torch.full((self.local_len,), -1, dtype=torch.long)
        for segment in self.segments_of(rank):
            slot = slice(segment.local_offset, segment.local_offset + segment.num_real)
            positions[slot] = torch.arange(segment.start, segment.start + segment.num_real)
        return positions

    def gathered_order(self) -> torch.Tensor:
        """Positions of the tokens in the order an all-gather over the cp ranks returns them (rank-major),
        `[cp · local_len]`, -1 for padding slots."""
        return torch.cat([self.positions_of(rank) for rank in range(self.cp_size)])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1, pad_value: float | int = 0) -> torch.Tensor:
        """Rank `rank`'s local part of `x` (sequence along `dim`, length `seq_len`), padding slots = `pad_value`."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"expected {self.seq_len} tokens along dim {dim}, got shape {tuple(x.shape)}")
        positions = self.positions_of(rank).to(x.device)
        local = x.index_select(dim, positions.clamp(min=0))
        padding = (positions < 0).view([-1 if d == dim % x.dim() else 1 for d in range(x.dim())])
        return local.masked_fill(padding, pad_value)

    def unshard(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of `shard` over all ranks: `gathered` holds the ranks' local parts concatenated rank-major along
        `dim` (`cp · local_len` entries); returns the real tokens in their original order (`seq_len` entries)."""
        order = self.gathered_order()
        if gathered.shape[dim] != order.numel():
            raise ValueError(f"expected {order.numel()} gathered tokens along dim {dim}, got {tuple(gathered.shape)}")
        real_slots = (order >= 0).nonzero().squeeze(1)
        restore = real_slots[torch.argsort(order[real_slots])]
        return gathered.index_select(dim, restore.to(gathered.device))

    def causal_pairs(self, rank: int) -> int:
        """Causal (query, key) pairs of rank `rank`'s queries: `Σ (p + 1)` over its positions `p`. This is the
        indexer's work, which scores every earlier key (docs/parallel.md §2)."""
        positions = self.positions_of(rank)
        return int((positions[positions >= 0] + 1).sum())

    def imbalance(self) -> float:
        """max / mean over ranks of `causal_pairs`: 1.0 is perfect balance."""
        work = [self.causal_pairs(rank) for rank in range(self.cp_size)]
        return max(work) / (sum(work) / len(work))


__all__ = ["LAYOUTS", "Segment", "SequenceLayout"]
