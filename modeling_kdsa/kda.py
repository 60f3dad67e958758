"""KDA token mixer (Kimi Delta Attention) with Moonshot's Kimi-Linear checkpoint names (docs/kda.md §1).

Data flow per head (docs/kda.md §1): q, k, v projections → causal depthwise short conv + SiLU →
L2-normalised q, k; per-channel fp32 decay `g` from a low-rank gate; `β = sigmoid(b_proj(x))`; the delta-rule
recurrence (`kda_chunk` for prefill, `kda_recurrent` for decode: the kernel registry's, kernels.py); head-wise RMSNorm
with a sigmoid output gate; `o_proj`.
"""

from functools import partial

import torch
from torch import nn
from transformers.cache_utils import Cache

from .cache import KDAReplayRecord, KDSACache
from .configuration_kdsa import KDA_LAYER
from .cpu_kda_recurrent import MAX_STEPPED_TOKENS
from .kda_ops import causal_short_conv, causal_short_conv_step, kda_gate, l2norm
from .kernels import kernel_set
from .linear import KDSALinear
from .norms import token_segments
from .sequence_parallel import SequenceParallelContext

# A prefill longer than this runs in segments of this many tokens (docs/kda.md §8), a multiple of the chunk size.
PREFILL_SEGMENT = 2048


class KDSAGatedRMSNorm(nn.Module):
    """`y = x / sqrt(mean(x²) + eps) · weight · sigmoid(gate)` over the last dim, all in fp32 like fla's
    `FusedRMSNormGated` (docs/kda.md §4); returned in the dtype of x."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * hidden_states * torch.sigmoid(gate.float())).to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class KDSAKimiDeltaAttention(nn.Module):
    """KDA layer. H = `linear_num_heads`, K = V = `linear_head_dim`, W = `linear_conv_kernel_dim`.

    Cache (a transformers `Cache` whose entry for this layer is a linear-attention layer): one conv state, the last
    W pre-conv inputs of q, k and v concatenated on the channel dim (`[B, 2·H·K + H·V, W]`), and the fp32 recurrent
    state `[B, H, K, V]`. A `KDSACache` also receives each forward's replay inputs (`record_kda_inputs`).
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.layer_types[layer_idx] != KDA_LAYER:
            raise ValueError(
                f"layer_types[{layer_idx}] is {config.layer_types[layer_idx]!r}; KDSAKimiDeltaAttention needs "
                f"{KDA_LAYER!r}"
            )
        self.layer_idx = layer_idx
        self.kernel_backend = config.kernel_backend
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_k_dim = config.linear_head_dim
        self.head_v_dim = config.linear_head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.key_dim = key_dim = self.num_heads * self.head_k_dim
        self.value_dim = value_dim = self.num_heads * self.head_v_dim
        projection = partial(KDSALinear, bias=False, kernel_backend=config.kernel_backend)

        self.q_proj = projection(self.hidden_size, key_dim)
        self.k_proj = projection(self.hidden_size, key_dim)
        self.v_proj = projection(self.hidden_size, value_dim)
        self.q_conv1d = self._short_conv(key_dim)
        self.k_conv1d = self._short_conv(key_dim)
        self.v_conv1d = self._short_conv(value_dim)
        # Decay gate: low rank (rank K) projection, then -exp(A_log)·softplus(· + dt_bias), or with a lower bound
        # lb·sigmoid(exp(A_log)·(· + dt_bias)) (kda_ops.kda_gate); A_log and dt_bias kept in fp32.
        self.lower_bound = config.linear_lower_bound
        self.f_a_proj = projection(self.hidden_size, self.head_k_dim)
        self.f_b_proj = projection(self.head_k_dim, key_dim)
        self.dt_bias = nn.Parameter(torch.empty(key_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(1, 1, self.num_heads, 1, dtype=torch.float32))
        self.b_proj = projection(self.hidden_size, self.num_heads)
        # Output gate into the sigmoid of the gated norm: low rank (rank V, Kimi-Linear), or one full-rank projection
        # (Kimi K3's `use_full_rank_gate`, docs/kimi-k3.md §2).
        self.full_rank_gate = config.linear_use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = projection(self.hidden_size, value_dim)
        else:
            self.g_a_proj = projection(self.hidden_size, self.head_v_dim)
            self.g_b_proj = projection(self.head_v_dim, value_dim)
        self.o_norm = KDSAGatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.o_proj = projection(value_dim, self.hidden_size)

    def _short_conv(self, channels: int) -> nn.Conv1d:
        """Depthwise causal conv, weight `[channels, 1, W]`. Only its weight is used (`kda_ops.causal_short_conv`)."""
        return nn.Conv1d(
            channels,
            channels,
            kernel_size=self.conv_kernel_size,
            groups=channels,
            padding=self.conv_kernel_size - 1,
            bias=False,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        sequence_parallel: SequenceParallelContext | None = None,
    ) -> torch.Tensor:
        """hidden_states: `[B, T, D]`; attention_mask: `[B, T]` over the current tokens only (1 = token, 0 = padding;
        generate left-pads); cache: read and updated in place when given. Returns `[B, T, D]`.

        Padding is zeroed before the conv and runs as identity steps of the recurrence (β = 0, g = 0), so a
        left-padded row gives what the unpadded prompt gives.

        sequence_parallel: the T tokens are this process's share of a longer sequence that starts here (empty cache;
        docs/parallel.md §7): the conv and the recurrence run through its hooks, the rest is position-wise.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, T, D={self.hidden_size}], got shape {tuple(hidden_states.shape)}"
            )
        batch_size, seq_len, _ = hidden_states.shape
        mask = None
        if attention_mask is not None:
            if attention_mask.shape != (batch_size, seq_len):
                raise ValueError(
                    f"attention_mask must be [B, T] = {(batch_size, seq_len)} over the current tokens, got shape "
                    f"{tuple(attention_mask.shape)}"
                )
            mask = attention_mask.bool()
            hidden_states = hidden_states * mask.unsqueeze(-1).to(hidden_states.dtype)

        has_previous_state = cache is not None and cache.has_previous_state(self.layer_idx)
        conv_state = cache.get_conv_state(self.layer_idx) if has_previous_state else None
        recurrent_state = cache.get_recurrent_state(self.layer_idx) if has_previous_state else None
        decoding = has_previous_state and seq_len == 1
        # A long prefill runs as consecutive forwards of PREFILL_SEGMENT tokens, the last one taking the remainder
        # (docs/kda.md §8), on CPU only: the segments bound eager temporaries and only add kernel launches on an
        # accelerator (token_segments gives one segment inside a compile or export).
        segmentable = hidden_states.device.type == "cpu" and sequence_parallel is None
        segmentable = segmentable and not self._records_replay_inputs(cache)
        parts = token_segments(seq_len, PREFILL_SEGMENT) if segmentable else []
        if len(parts) <= 1:
            return self._mix(hidden_states, mask, cache, sequence_parallel, conv_state, recurrent_state, decoding)[0]
        # Each segment hands its pre-conv columns and final state to the next, as the cache would.
        outputs = []
        for part in parts:
            segment_mask = None if mask is None else mask[:, part]
            out, conv_state, recurrent_state = self._mix(
                hidden_states[:, part], segment_mask, cache, None, conv_state, recurrent_state, False, True
            )
            outputs.append(out)
        return torch.cat(outputs, dim=1)

    def _records_replay_inputs(self, cache: Cache | None) -> bool:
        """True when the cache keeps this layer's replay inputs for rollback (docs/kda.md §7): such a forward is not
        split into segments, so that one forward's tokens stay one record, as long as its rollback window."""
        return isinstance(cache, KDSACache) and cache.rollback_tokens > 0

    def _mix(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Cache | None,
        sequence_parallel: SequenceParallelContext | None,
        conv_state: torch.Tensor | None,
        recurrent_state: torch.Tensor | None,
        decoding: bool,
        need_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layer on `hidden_states: [B, T, D]` (padding already zeroed, `mask: [B, T]` bool or None) after the
        pre-conv columns `conv_state` and the recurrent state `recurrent_state` (both None at a sequence start);
        updates `cache` when given. Returns the output `[B, T, D]`, the pre-conv columns `[B, C, T]` and the final
        state (None unless `cache` or `need_final_state`)."""
        batch_size, seq_len, _ = hidden_states.shape
        # Short conv over q, k, v together: [B, C, T] with C = 2·H·K + H·V.
        qkv = torch.cat(
            [self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1
        ).transpose(1, 2)
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        conv_window = qkv  # the cache keeps the last W of these
        # A decode step, or a few tokens after a cached state (a verification of drafted tokens): the conv and, where
        # the kernel can, the recurrence step the tokens as decoding does, so each gets a decode step's bits
        # (docs/speculative.md §2).
        stepped = conv_state is not None and sequence_parallel is None and seq_len <= MAX_STEPPED_TOKENS
        if stepped:
            qkv_conv = causal_short_conv_step(qkv, conv_weight, conv_state)
        elif sequence_parallel is not None:
            qkv_conv, conv_window = sequence_parallel.short_conv(qkv, conv_weight, keep_window=cache is not None)
        else:
            qkv_conv = causal_short_conv(qkv, conv_weight, left_context=conv_state)

        heads_k = (batch_size, seq_len, self.num_heads, self.head_k_dim)
        heads_v = (batch_size, seq_len, self.num_heads, self.head_v_dim)
        q, k, v = qkv_conv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(heads_k).float())  # fp32 like fla's in-kernel l2norm
        k = l2norm(k.reshape(heads_k).float())
        v = v.reshape(heads_v)

        g = kda_gate(
            self.f_b_proj(self.f_a_proj(hidden_states)).reshape(heads_k), self.A_log, self.dt_bias, self.lower_bound
        )
        beta = self.b_proj(hidden_states).float().sigmoid()
        if mask is not None:
            g = g.masked_fill(~mask[:, :, None, None], 0.0)
            beta = beta.masked_fill(~mask[:, :, None], 0.0)

        kernels = kernel_set(self.kernel_backend, v.device)
        kernel = kernels.require("kda_recurrent" if decoding else "kda_chunk")
        if stepped and not decoding and kernels.kda_recurrent_stepwise(q, v):
            # Several tokens: a recurrent kernel that steps them all in one call (`kda_recurrent_stepwise`: the CPU
            # kernel), reading and writing the state once (docs/kda.md §9), where the chunked form's many small ops
            # cost more than the recurrence itself.
            kernel = kernels.kda_recurrent
        if sequence_parallel is not None:
            o, final_state = sequence_parallel.kda_recurrence(q, k, v, g, beta, kda_chunk=kernel)
        else:
            o, final_state = kernel(
                q,
                k,
                v,
                g,
                beta,
                initial_state=recurrent_state,
                output_final_state=cache is not None or need_final_state,
            )
        if cache is not None:
            if isinstance(cache, KDSACache) and sequence_parallel is None:
                # Speculative decoding: the cache keeps these tokens' conv columns and recurrence inputs so that
                # `crop` can replay them exactly. It must see the state from before this forward, so this comes
                # before the two updates below.
                cache.record_kda_inputs(self.layer_idx, KDAReplayRecord(qkv, k, v, g, beta), kernels)
            cache.update_conv_state(conv_window, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            cache.update_recurrent_state(final_state, self.layer_idx)
            if isinstance(cache, KDSACache) and sequence_parallel is not None:
                # This process holds only some of the tokens' replay inputs: the whole sequence is committed (a later
                # crop can reach back to its end, not into it).
                cache.layers[self.layer_idx].commit_unrecorded(sequence_parallel.seq_len)

        o = self.o_norm(o, self.output_gate(hidden_states).reshape(heads_v)).reshape(batch_size, seq_len, -1)
        return self.o_proj(o), qkv, final_state

    def output_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid output gate `[B, T, H·V]` of `hidden_states: [B, T, D]` (full-rank or low-rank)."""
        if self.full_rank_gate:
            return self.g_proj(hidden_states)
        return self.g_b_proj(self.g_a_proj(hidden_states))


__all__ = ["KDSAKimiDeltaAttention", "KDSAGatedRMSNorm"]
