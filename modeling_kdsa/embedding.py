"""The model's input embedding: `nn.Embedding` (same parameter, same checkpoint key) that can hold one contiguous
range of the vocabulary's rows instead of all of them (vocab-parallel tensor parallelism, docs/parallel.md §5).

Whole (the default, `weight` has `num_embeddings` rows), it is `nn.Embedding`. Cut over the tp ranks
(modeling_kdsa.parallel sets `vocab_start` and leaves `weight` with rows `vocab_start ..
vocab_start + weight.shape[0]` only), each id outside that range looks up a zero vector; the parallel package's
forward hook sums the ranks' outputs (every id is inside exactly one rank's range), which gives the whole lookup.
"""

import torch
import torch.nn.functional as F
from torch import nn


class KDSAEmbedding(nn.Embedding):
    """`nn.Embedding` that may hold only the rows `vocab_start .. vocab_start + weight.shape[0]` of the vocabulary
    (`num_embeddings` stays the whole vocabulary, the ids it accepts)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, **kwargs):
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        self.vocab_start = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        if rows == self.num_embeddings:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < rows)
        # Ids outside the range read row 0 and are zeroed: the lookup stays in bounds without a branch per id.
        embeddings = F.embedding(torch.where(held, local, torch.zeros_like(local)), self.weight)
        return embeddings.masked_fill(~held.unsqueeze(-1), 0.0)


__all__ = ["KDSAEmbedding"]
