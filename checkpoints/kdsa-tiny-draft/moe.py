"""Feed-forward layers: the dense GLU MLP and the DeepSeek-V3 / Kimi-Linear style mixture of experts.

Router math: docs/design.md §2 (sigmoid scores in fp32, the score-correction bias only selects, renormalise,
routed scaling; group-limited routing as in DeepSeek-V3, arXiv:2412.19437, and its `noaux_tc` gate). Parameter
names and layouts follow transformers' `DeepseekV3MoE` so that
checkpoints map one to one and the config's tensor-parallel plan (`packed_colwise`, `rowwise`, `moe_tp_experts`)
applies unchanged.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def clamp_swiglu_inputs(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3-Flash's SwiGLU clamp: `gate <= limit`, `-limit <= up <= limit` (the gate is only bounded above: its
    SiLU is already bounded below). `limit=None` returns both unchanged."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


class KDSAMLP(nn.Module):
    """Gated MLP `down(act(gate(x)) * up(x))`, `[..., D]` → `[..., D]`; also the MoE's shared experts. With
    `config.swiglu_limit` the gate and up activations are clamped first (`clamp_swiglu_inputs`)."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        hidden_size = config.hidden_size
        intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu_limit = config.swiglu_limit

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_swiglu_inputs(self.gate_proj(hidden_states), self.up_proj(hidden_states), self.swiglu_limit)
        return self.down_proj(self.act_fn(gate) * up)


class KDSATopkRouter(nn.Module):
    """Sigmoid top-k router with a score-correction bias (kda.md §4.2).

    `weight: [E, D]` fp32 parameter; `e_score_correction_bias: [E]` fp32 buffer (saved in checkpoints, not trained
    by the optimizer: load balancing adjusts it outside backprop), as in transformers' DeepseekV3TopkRouter.
    With `n_group > 1` the choice is group-limited: the E experts form `n_group` consecutive groups, a group scores
    the sum of its two best bias-corrected scores, and the top-k is taken among the experts of the best `topk_group`
    groups only (the config checks the group sizes).
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states: [N, D]` → `(topk_indices [N, k] int64, topk_weights [N, k] fp32)`."""
        router_logits = F.linear(hidden_states.float(), self.weight.float())  # [N, E]
        scores = router_logits.sigmoid()
        # The bias steers which experts are chosen (load balancing) but never how much they weigh.
        scores_for_choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            scores_for_choice = self._keep_best_groups(scores_for_choice)
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1).indices
        topk_weights = scores.gather(-1, topk_indices)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_indices, topk_weights * self.routed_scaling_factor

    def _keep_best_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """`[N, E]` biased scores with the experts outside the `topk_group` best groups set to -inf."""
        grouped = scores_for_choice.view(scores_for_choice.shape[0], self.n_group, -1)  # [N, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        best_groups = group_scores.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores_for_choice)


class KDSAExperts(nn.Module):
    """The routed experts as stacked weights (transformers 5.x layout).

    `gate_up_proj: [E, 2·I, D]` (gate rows first, then up rows), `down_proj: [E, D, I]`. Under tensor parallelism
    each rank holds a slice of `I`, so the forward reads `I` from the weights, never from the config. With
    `config.swiglu_limit` each expert clamps its gate and up activations (`clamp_swiglu_inputs`).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        hidden_size, intermediate_size = config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu_limit = config.swiglu_limit

    def forward(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """`hidden_states: [N, D]`, `topk_indices: [N, k]`, `topk_weights: [N, k]` → `[N, D]` in the input dtype.

        Grouped compute: the N·k (token, slot) pairs are sorted by expert once, so each expert that received
        tokens runs one matmul pair over a contiguous slice; results are weighted and summed back per token.
        """
        if torch.compiler.is_compiling():
            # The grouped loop below needs per-expert counts on the host; a compiled graph takes a fixed-shape path.
            if topk_indices.numel() <= self.num_experts:
                return self._forward_gathered(hidden_states, topk_indices, topk_weights)
            return self._forward_dense(hidden_states, topk_indices, topk_weights)
        num_slots = topk_indices.shape[-1]
        flat_experts = topk_indices.reshape(-1)  # [N·k]
        order = flat_experts.argsort(stable=True)
        token_of_pair = order // num_slots  # token index of each pair, in expert order
        weight_of_pair = topk_weights.reshape(-1)[order].float()
        # One host sync for the per-expert slice lengths.
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts).tolist()

        grouped_inputs = hidden_states[token_of_pair]  # [N·k, D]
        expert_outputs = []
        start = 0
        for expert, count in enumerate(tokens_per_expert):
            if count == 0:
                continue
            inputs = grouped_inputs[start : start + count]
            gate, up = F.linear(inputs, self.gate_up_proj[expert]).chunk(2, dim=-1)
            gate, up = clamp_swiglu_inputs(gate, up, self.swiglu_limit)
            expert_outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
            start += count

        weighted = torch.cat(expert_outputs).float() * weight_of_pair.unsqueeze(-1)  # [N·k, D] fp32
        output = hidden_states.new_zeros(hidden_states.shape, dtype=torch.float32)
        output.index_add_(0, token_of_pair, weighted)  # sum each token's k weighted expert outputs in fp32
        return output.to(hidden_states.dtype)

    def _expert_mlp(self, inputs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = clamp_swiglu_inputs(*torch.matmul(gate_up, inputs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1),
                                       self.swiglu_limit)  # fmt: skip
        return torch.matmul(down, (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)

    def _forward_gathered(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-shape decode path (docs/graph-mode.md §4): each (token, slot) pair multiplies by its expert's weights,
        gathered by index, in one batched GEMV pair; only the selected experts' weights are read. Same result as
        `forward` up to fp32 summation order."""
        num_tokens, num_slots = topk_indices.shape
        flat_experts = topk_indices.reshape(-1)  # [N·k], token-major
        inputs = hidden_states.repeat_interleave(num_slots, dim=0)  # [N·k, D]
        outputs = self._expert_mlp(inputs, self.gate_up_proj[flat_experts], self.down_proj[flat_experts])
        weighted = outputs.float() * topk_weights.reshape(-1, 1).float()
        return weighted.view(num_tokens, num_slots, -1).sum(dim=1).to(hidden_states.dtype)

    def _forward_dense(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-shape path for many tokens (a compiled prefill): every expert runs on every token and the routing
        weights (0 for unselected experts) combine them. `E / k` times the routed FLOPs, but no data-dependent shape."""
        combine = hidden_states.new_zeros(hidden_states.shape[0], self.num_experts, dtype=torch.float32)
        combine.scatter_(1, topk_indices, topk_weights.float())
        output = hidden_states.new_zeros(hidden_states.shape, dtype=torch.float32)
        for expert in range(self.num_experts):
            gate, up = F.linear(hidden_states, self.gate_up_proj[expert]).chunk(2, dim=-1)
            gate, up = clamp_swiglu_inputs(gate, up, self.swiglu_limit)
            expert_output = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
            output = output + expert_output.float() * combine[:, expert, None]
        return output.to(hidden_states.dtype)


class KDSAMoE(nn.Module):
    """Routed experts plus optional always-on shared experts: `[B, T, D]` → `[B, T, D]`.

    `shared_experts` is one `KDSAMLP` of width `moe_intermediate_size · n_shared_experts` (the shared experts
    fused, as DeepSeek-V3 stores them); it is absent (`None`) when `n_shared_experts == 0`.
    """

    def __init__(self, config):
        super().__init__()
        self.gate = KDSATopkRouter(config)
        self.experts = KDSAExperts(config)
        self.shared_experts = (
            KDSAMLP(config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [N, D]
        topk_indices, topk_weights = self.gate(tokens)
        output = self.experts(tokens, topk_indices, topk_weights).reshape(hidden_states.shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output


__all__ = ["KDSAMLP", "KDSATopkRouter", "KDSAExperts", "KDSAMoE"]
