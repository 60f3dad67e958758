"""Rotary position embedding for the DSA layers: one model-level table and the two ways of applying it.

docs/dsa.md §1, §2: MLA rotates `q_pe`/`k_pe` in the interleaved DeepSeek layout (pairs `(x0, x1),
(x2, x3), ...`), while the Lightning Indexer rotates the first `qk_rope_head_dim` channels of its vectors in the
NeoX half-split layout (pairs `(x_i, x_{i+R/2})`). Both use the same frequencies (YaRN etc. via transformers'
`ROPE_INIT_FUNCTIONS`), so the model computes `(cos, sin)` once and each layer applies the layout it needs.
"""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


class KDSARotaryEmbedding(nn.Module):
    """Computes `(cos, sin)` for the rope slice (`qk_rope_head_dim` channels) of every DSA layer.

    The config sets `head_dim = qk_rope_head_dim`, which is what transformers' rope init functions read. The model
    does not create this module for NoPE configs (`qk_rope_head_dim == 0`).
    """

    def __init__(self, config):
        super().__init__()
        if config.qk_rope_head_dim <= 0:
            raise ValueError(
                f"KDSARotaryEmbedding needs qk_rope_head_dim > 0, got {config.qk_rope_head_dim} (NoPE has no RoPE)"
            )
        self.config = config
        # Attributes read by transformers' `dynamic_rope_update` for the dynamic/longrope types.
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        if self.rope_type == "default":
            inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """Plain RoPE: `inv_freq[i] = theta^(-2i/R)` for `i < R/2`; no attention scaling."""
        base = config.rope_parameters["rope_theta"]
        dim = config.qk_rope_head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` gives device and dtype; `position_ids` `[B, T]`. Returns `cos, sin`, each `[B, T, R]` laid out as
        `cat(freqs, freqs)` (the first half holds one angle per rotated pair)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA RoPE (DeepSeek pairs): rotates `(x[2i], x[2i+1])` by angle `i`, keeping each pair in place.

    x: `[..., R]`; cos, sin: `cat(freqs, freqs)` layout `[..., R]`, broadcastable to `x` (unsqueeze the head
    dimension first). Returns a tensor shaped like `x`.
    """
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return rotated.flatten(-2)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer RoPE (NeoX half-split): rotates `(x[i], x[i + R/2])` by angle `i`.

    x: `[..., R]`; cos, sin: `[..., R]` broadcastable to `x`. Returns a tensor shaped like `x`.
    """
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


__all__ = ["KDSARotaryEmbedding", "apply_rotary_interleaved", "apply_rotary_half"]
