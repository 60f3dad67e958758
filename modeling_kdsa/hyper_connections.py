"""mHC: manifold-constrained hyper-connections, GLM-5.3-Flash's residual stream (docs/hyper-connections.md).

Math: docs/hyper-connections.md §1 (the per-sublayer pre / post / mixing weights), §2 (Sinkhorn normalisation of
the mixing matrix), §3 (the stream through the model: expansion, per-sublayer update, final mean). Source:
Xie et al. (DeepSeek), "mHC: Manifold-Constrained Hyper-Connections", as GLM-5.3-Flash ships it (transformers'
`glm5_next`).

Each token carries `N = hc_mult` copies of the hidden state (streams, `[B, T, N, D]`). Every sublayer (token mixer or
FFN) owns a `KDSAHyperConnection` that reads all N streams of a token and returns how to collapse them into the
sublayer input (pre), how to spread the sublayer output over the streams (post), and a doubly stochastic N×N matrix
mixing the old streams into the new ones (comb). Like AttnRes, nothing here reads another token: the streams need no
cache entries, and decode (`T = 1`) runs the same code.
"""

import copy

import torch
from torch import nn

from .kernels import kernel_set


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Make `comb: [..., N, N]` (positive) approximately doubly stochastic: `iters` normalisations, each dividing by
    the column sums (`+ eps`) after dividing by the row sums, the first one by the column sums only
    (docs/hyper-connections.md §2)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class KDSAHyperConnection(nn.Module):
    """One sublayer's mHC weights (docs/hyper-connections.md §1). N = `hc_mult`, D = `hidden_size`.

    Parameters (GLM-5.3-Flash's `attn_hc.*` / `ffn_hc.*` tensors, same names and shapes):
    `fn: [(N + 2)·N, N·D]` — one projection of the RMS-normalised, flattened streams giving the N pre, N post and
    N·N mixing logits; `base: [(N + 2)·N]` fp32 — their biases; `scale: [3]` fp32 — one gain per group.
    """

    def __init__(self, config):
        super().__init__()
        self.hc_mult = config.hc_mult
        self.kernel_backend = config.kernel_backend
        self.hc_eps = config.hc_eps
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        # The flattened streams are normalised without a gain, with the model's RMSNorm eps (not hc_eps).
        self.norm_eps = config.rms_norm_eps
        num_logits = (2 + self.hc_mult) * self.hc_mult
        self.fn = nn.Parameter(torch.empty(num_logits, self.hc_mult * config.hidden_size))
        self.base = nn.Parameter(torch.empty(num_logits, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def mixing_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`streams: [B, T, N, D]` → fp32 `pre: [B, T, N]`, `post: [B, T, N]`, `comb: [B, T, N, N]`
        (`comb[i, j]`: weight of old stream i in new stream j)."""
        n = self.hc_mult
        flat = streams.reshape(*streams.shape[:2], -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + self.norm_eps)
        logits = kernel_set(self.kernel_backend, flat.device).row_linear(flat, self.fn.float())
        pre_logit, post_logit, comb_logit = logits.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_logit * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post_logit * post_scale + post_base)
        comb_logit = comb_logit.reshape(*comb_logit.shape[:-1], n, n) * comb_scale + comb_base.reshape(n, n)
        comb = torch.softmax(comb_logit, dim=-1) + self.hc_eps
        return pre, post, sinkhorn_normalize(comb, self.sinkhorn_iters, self.hc_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`streams: [B, T, N, D]` → `(post, comb, collapsed)`: the weights `add_output` needs and the sublayer input
        `collapsed = Σ_i pre_i · stream_i`, `[B, T, D]` in the streams' dtype."""
        pre, post, comb = self.mixing_weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


class HyperConnectionStream:
    """The residual stream of one forward pass under mHC (docs/hyper-connections.md §3), with the interface of
    `PlainResidualStream` and `BlockAttnResStream`: `h = stream.input_for(s)`, `stream.add_output(s, f_s(norm(h)))`
    for s = 0, 1, … (`2·layer` the token mixer, `2·layer + 1` the FFN), then `stream.final()`.

    The embedding `[B, T, D]` is copied into N streams. Sublayer s maps streams X to
    `post ⊗ f_s(norm(Σ_i pre_i X_i)) + combᵀ X`; the final value is the plain mean over the streams.
    """

    def __init__(self, embeddings: torch.Tensor, hyper_connections: list[KDSAHyperConnection]):
        """`embeddings: [B, T, D]`; `hyper_connections[s]` is sublayer s's module, one per sublayer."""
        if not hyper_connections:
            raise ValueError("hyper_connections is empty: mHC needs one KDSAHyperConnection per sublayer")
        self.hyper_connections = hyper_connections
        hc_mult = hyper_connections[0].hc_mult
        self.streams = embeddings.unsqueeze(2).expand(-1, -1, hc_mult, -1).contiguous()  # [B, T, N, D]
        self.next_sublayer = 0
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (post, comb) of the running sublayer

    def input_for(self, sublayer_idx: int) -> torch.Tensor:
        """Collapsed input `[B, T, D]` of sublayer `sublayer_idx` (call before its `add_output`)."""
        if self.pending is not None or sublayer_idx != self.next_sublayer:
            expected = "add_output" if self.pending is not None else "input_for"
            raise ValueError(f"input_for({sublayer_idx}) out of order: expected {expected}({self.next_sublayer})")
        if sublayer_idx >= len(self.hyper_connections):
            raise ValueError(f"sublayer {sublayer_idx} has no hyper-connection ({len(self.hyper_connections)} given)")
        post, comb, collapsed = self.hyper_connections[sublayer_idx](self.streams)
        self.pending = (post, comb)
        return collapsed

    def add_output(self, sublayer_idx: int, output: torch.Tensor) -> None:
        """Write sublayer `sublayer_idx`'s output `[B, T, D]` into the streams: `post ⊗ output + combᵀ streams`."""
        if self.pending is None or sublayer_idx != self.next_sublayer:
            raise ValueError(f"add_output({sublayer_idx}) must follow input_for({sublayer_idx})")
        post, comb = self.pending
        dtype = self.streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), self.streams)  # new stream j = Σ_i comb[i, j] X_i
        self.streams = post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed
        self.pending = None
        self.next_sublayer += 1

    def copy(self) -> "HyperConnectionStream":
        """An independent stream in the same state (tensors shared, never modified in place; docs/design.md §10)."""
        return copy.copy(self)

    def final(self, depth_attention: None = None) -> torch.Tensor:
        """The mean over the N streams `[B, T, D]`, to be fed to the final norm, after every sublayer has run.
        (`depth_attention` exists for interface parity with `BlockAttnResStream.final`; mHC has none.)"""
        if depth_attention is not None:
            raise ValueError("mHC has no final depth attention (output_attn_res belongs to Block AttnRes)")
        if self.pending is not None or self.next_sublayer != len(self.hyper_connections):
            raise ValueError(f"final() called after {self.next_sublayer} of {len(self.hyper_connections)} sublayers")
        return self.streams.mean(dim=2)


__all__ = ["KDSAHyperConnection", "HyperConnectionStream", "sinkhorn_normalize"]
