"""Normalisation layers shared by every KDSA sublayer. Statistics are computed in fp32 (docs/design.md §6)."""

import torch
from torch import nn

# Position-wise work on a long sequence runs in segments of this many tokens (docs/design.md §12).
TOKEN_SEGMENT = 1024


def token_segments(seq_len: int, size: int | None = None) -> list[slice]:
    """Consecutive slices covering `seq_len` positions, `size` (default `TOKEN_SEGMENT`) each but the last, which
    takes the remainder: every slice holds at least `size` positions (one slice when `seq_len < 2·size`). Inside a
    compile or export one slice: the segments only bound eager temporaries, and their bounds would specialise a
    symbolic length."""
    size = TOKEN_SEGMENT if size is None else size
    if torch.compiler.is_compiling():
        return [slice(0, seq_len)]
    starts = list(range(0, max(seq_len - size, 0) + 1, size))
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], seq_len], strict=True)]


def join_segments(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The per-segment results concatenated along `dim`; a single segment (every decode step) is returned as is."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class KDSARMSNorm(nn.Module):
    """RMSNorm: `x / sqrt(mean(x²) + eps) * weight`, normalised in fp32 and cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalises each vector along the last dim; a long second-to-last dim (the tokens of a prefill) in
        segments (docs/design.md §12), which gives the same values."""
        if hidden_states.dim() == 1:
            return self._normalize(hidden_states)
        segments = token_segments(hidden_states.shape[-2])
        return join_segments([self._normalize(hidden_states[..., part, :]) for part in segments], dim=-2)

    def _normalize(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
