"""Feed-forward layers: the dense GLU MLP and the DeepSeek-V3 / Kimi-Linear / Kimi K3 style mixture of experts.

Router math: docs/design.md §2 (sigmoid scores in fp32, the score-correction bias only selects, renormalise,
routed scaling; group-limited routing as in DeepSeek-V3, arXiv:2412.19437, and its `noaux_tc` gate). Kimi K3's
LatentMoE, SiTU activation and MXFP4 routed experts: docs/kimi-k3.md §3-§4. Parameter
names and layouts follow transformers' `DeepseekV3MoE` so that checkpoints map one to one.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .cpu_row_linear import MAX_ROWS
from .kernels import kernel_set
from .linear import KDSALinear
from .norms import KDSARMSNorm
from .numeric_formats import mxfp4_dequantize


def clamp_swiglu_inputs(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.3-Flash's SwiGLU clamp: `gate <= limit`, `-limit <= up <= limit` (the gate is only bounded above: its
    SiLU is already bounded below). `limit=None` returns both unchanged."""
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi K3's SiTU GLU (docs/kimi-k3.md §3): `β·tanh(gate/β)·σ(gate) · β_lin·tanh(up/β_lin)` in fp32, returned in
    the input dtype. A SwiGLU whose gate (|·| < β) and linear branch (|·| < β_lin) are smoothly soft-capped."""
    gate32, up32 = gate.float(), up.float()
    capped_gate = beta * torch.tanh(gate32 / beta) * torch.sigmoid(gate32)
    return (capped_gate * (linear_beta * torch.tanh(up32 / linear_beta))).to(gate.dtype)


class GatedActivation(nn.Module):
    """`act(gate) * up` for `config.hidden_act` (after the GLM SwiGLU clamp when `swiglu_limit` is set), or Kimi
    K3's SiTU for `hidden_act="situ"` with the config's two betas."""

    def __init__(self, config):
        super().__init__()
        self.situ = config.hidden_act == "situ"
        if self.situ:
            self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        elif config.hidden_act not in ACT2FN:
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported; use 'situ' or one of transformers' ACT2FN"
            )
        else:
            self.act_fn = ACT2FN[config.hidden_act]
        self.swiglu_limit = config.swiglu_limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.situ:
            return situ_and_mul(gate, up, self.beta, self.linear_beta)
        gate, up = clamp_swiglu_inputs(gate, up, self.swiglu_limit)
        return self.act_fn(gate) * up


class KDSAMLP(nn.Module):
    """Gated MLP `down(act(gate(x)) * up(x))`, `[..., D]` → `[..., D]`; also the MoE's shared experts. With
    `config.swiglu_limit` the gate and up activations are clamped first (`clamp_swiglu_inputs`); `hidden_act="situ"`
    is Kimi K3's SiTU (`GatedActivation`)."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        hidden_size = config.hidden_size
        intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        projection = partial(KDSALinear, bias=False, kernel_backend=config.kernel_backend)
        self.gate_proj = projection(hidden_size, intermediate_size)
        self.up_proj = projection(hidden_size, intermediate_size)
        self.down_proj = projection(intermediate_size, hidden_size)
        self.activation = GatedActivation(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(hidden_states), self.up_proj(hidden_states)))


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
        self.kernel_backend = config.kernel_backend
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden_states: [N, D]` → `(topk_indices [N, k] int64, topk_weights [N, k] fp32)`."""
        return self.route(self.logits(hidden_states))

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The router logits `[N, E]` in fp32 (before the sigmoid): what `output_router_logits` returns."""
        row_linear = kernel_set(self.kernel_backend, hidden_states.device).row_linear
        return row_linear(hidden_states.float(), self.weight.float())

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`router_logits: [N, E]` → `(topk_indices [N, k] int64, topk_weights [N, k] fp32)`."""
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

    `gate_up_proj: [E, 2·I, D]` (gate rows first, then up rows), `down_proj: [E, D, I]`, with `D` the expert width
    (`routed_expert_hidden_size` under LatentMoE, else hidden_size). Under tensor parallelism each rank holds a slice
    of `I`, so the forward reads `I` from the weights, never from the config. With `config.swiglu_limit` each expert
    clamps its gate and up activations (`clamp_swiglu_inputs`).

    `routed_expert_weight_format="mxfp4"` (docs/kimi-k3.md §4): the same matrices stay packed as stored, uint8
    buffers `gate_up_proj_packed [E, 2·I, D/2]`, `gate_up_proj_scale [E, 2·I, D/32]`, `down_proj_packed [E, D, I/2]`,
    `down_proj_scale [E, D, I/32]`; each expert's two matrices are dequantized to the activation dtype when it runs.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.kernel_backend = config.kernel_backend
        width = config.hidden_size if config.routed_expert_hidden_size is None else config.routed_expert_hidden_size
        intermediate_size = config.moe_intermediate_size
        self.mxfp4 = config.routed_expert_weight_format == "mxfp4"
        if self.mxfp4:
            # Buffers: they are not trained, and transformers never casts integer tensors to the load dtype.
            shapes = {
                "gate_up_proj": (2 * intermediate_size, width),
                "down_proj": (width, intermediate_size),
            }
            for name, (rows, cols) in shapes.items():
                self.register_buffer(
                    f"{name}_packed", torch.zeros(self.num_experts, rows, cols // 2, dtype=torch.uint8)
                )
                self.register_buffer(
                    f"{name}_scale", torch.zeros(self.num_experts, rows, cols // 32, dtype=torch.uint8)
                )
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * intermediate_size, width))
            self.down_proj = nn.Parameter(torch.empty(self.num_experts, width, intermediate_size))
        self.activation = GatedActivation(config)

    def expert_weights(self, expert: int | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s `gate_up [2I, D]` and `down [D, I]` in `dtype` (MXFP4: dequantized now, exactly); an
        index tensor `[n]` gives the stacked `[n, 2I, D]` and `[n, D, I]`."""
        if not self.mxfp4:
            return self.gate_up_proj[expert], self.down_proj[expert]
        gate_up = mxfp4_dequantize(self.gate_up_proj_packed[expert], self.gate_up_proj_scale[expert], dtype)
        down = mxfp4_dequantize(self.down_proj_packed[expert], self.down_proj_scale[expert], dtype)
        return gate_up, down

    def forward(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """`hidden_states: [N, D]`, `topk_indices: [N, k]`, `topk_weights: [N, k]` → `[N, D]` in the input dtype.

        Grouped compute: the N·k (token, slot) pairs are sorted by expert once, so each expert that received
        tokens runs one matmul pair over a contiguous slice; results are weighted and summed back per token.
        """
        # Up to MAX_ROWS (16) tokens (a decode step of several sequences, a verification) through the expert kernel:
        # two calls, no host sync, each chosen expert read once.
        in_place = 0 < hidden_states.shape[0] <= MAX_ROWS and self._reads_in_place(hidden_states)
        if torch.compiler.is_compiling():
            # The grouped loop below needs per-expert counts on the host; a compiled graph takes a fixed-shape path.
            if in_place or topk_indices.numel() <= self.num_experts:
                return self._forward_gathered(hidden_states, topk_indices, topk_weights)
            return self._forward_dense(hidden_states, topk_indices, topk_weights)
        if in_place:
            return self._forward_gathered(hidden_states, topk_indices, topk_weights)
        if hidden_states.shape[0] == 1:
            return self._forward_one_token(hidden_states, topk_indices, topk_weights)
        num_slots = topk_indices.shape[-1]
        flat_experts = topk_indices.reshape(-1)  # [N·k]
        order = flat_experts.argsort(stable=True)
        token_of_pair = order // num_slots  # token index of each pair, in expert order
        weight_of_pair = topk_weights.reshape(-1)[order].float()
        # One host sync for the per-expert slice lengths.
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts).tolist()

        # Each expert gathers its tokens and scatters its weighted outputs itself: the temporaries are one expert's
        # rows, never all N·k pairs at once (at 16k tokens those were several 64-128 MiB tensors per layer).
        output = hidden_states.new_zeros(hidden_states.shape, dtype=torch.float32)
        start = 0
        for expert, count in enumerate(tokens_per_expert):
            if count == 0:
                continue
            pairs = slice(start, start + count)
            expert_output = self._run_expert(hidden_states[token_of_pair[pairs]], expert)
            weighted = expert_output.float() * weight_of_pair[pairs].unsqueeze(-1)  # [count, D] fp32
            # Sum each token's k weighted expert outputs in fp32, in expert order.
            output.index_add_(0, token_of_pair[pairs], weighted)
            start += count
        return output.to(hidden_states.dtype)

    def _forward_one_token(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """One token (batch-1 decode) where the expert kernel does not run (`_reads_in_place`): its k experts in turn,
        without the sort, counts and scatter of the grouped path. Each expert's weights are read in place; eagerly,
        the gathered batched GEMV of `_forward_gathered` would first copy them (about 2.5x slower on CPU at the
        benchmark shape). Bit-identical to `forward`: the same GEMVs, summed in fp32 in the same (expert) order."""
        weights = topk_weights.reshape(-1, 1).float()  # [k, 1]
        output = None
        for slot, expert in sorted(enumerate(topk_indices.reshape(-1).tolist()), key=lambda pair: pair[1]):
            weighted = self._run_expert(hidden_states, expert).float() * weights[slot]
            output = weighted if output is None else output + weighted
        return output.to(hidden_states.dtype)

    def _run_expert(self, inputs: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert`'s gated MLP on `inputs: [n, D]` → `[n, D]`, in the inputs' dtype."""
        gate_up_weight, down_weight = self.expert_weights(expert, inputs.dtype)
        row_linear = kernel_set(self.kernel_backend, inputs.device).row_linear
        gate, up = row_linear(inputs, gate_up_weight).chunk(2, dim=-1)
        return row_linear(self.activation(gate, up), down_weight)

    def _reads_in_place(self, inputs: torch.Tensor) -> bool:
        """Whether the backend's `expert_linear` reads each row's expert in place from the stacked weights
        (`experts_in_place`: on `cpu` the C++ kernel, `cpu_expert_linear`)."""
        return not self.mxfp4 and kernel_set(self.kernel_backend, inputs.device).experts_in_place(
            inputs, self.gate_up_proj
        )

    def _expert_mlp(self, inputs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row of `inputs [n, D]` through its own expert `experts [n]`'s gated MLP → `[n, D]`, by the backend's
        `expert_linear`: the stacked weights and the indices, or MXFP4 experts dequantized per row first."""
        expert_linear = kernel_set(self.kernel_backend, inputs.device).expert_linear
        if self.mxfp4:
            gate_up, down = self.expert_weights(experts, inputs.dtype)  # [n, 2I, D], [n, D, I]
            experts = None
        else:
            gate_up, down = self.gate_up_proj, self.down_proj
        gate, up = expert_linear(inputs, gate_up, experts).chunk(2, dim=-1)
        return expert_linear(self.activation(gate, up), down, experts)

    def _forward_gathered(
        self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Fixed-shape decode path (docs/graph-mode.md §4), also the eager path of up to MAX_ROWS tokens where the
        expert kernel runs: each (token, slot) pair multiplies by its expert's weights, selected by index, in one
        batched GEMV pair; only the selected experts' weights are read, and nothing syncs. Each token's slots are taken
        in expert order and summed in fp32 in that order (torch adds up to 16 rows in order), as `forward`'s grouped
        loop adds them: with the kernel, whose products are the row kernel's, the result is bit for bit the grouped
        path's (docs/graph-mode.md §12)."""
        num_tokens, num_slots = topk_indices.shape
        topk_indices, order = topk_indices.sort(dim=-1)
        topk_weights = topk_weights.gather(-1, order)
        inputs = hidden_states.repeat_interleave(num_slots, dim=0)  # [N·k, D]
        outputs = self._expert_mlp(inputs, topk_indices.reshape(-1))  # token-major pairs
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
            output = output + self._run_expert(hidden_states, expert).float() * combine[:, expert, None]
        return output.to(hidden_states.dtype)


class KDSAMoE(nn.Module):
    """Routed experts plus optional always-on shared experts: `[B, T, D]` → `[B, T, D]`.

    `shared_experts` is one `KDSAMLP` of width `moe_intermediate_size · n_shared_experts` (the shared experts
    fused, as DeepSeek-V3 stores them); it is absent (`None`) when `n_shared_experts == 0`.

    LatentMoE (`routed_expert_hidden_size`, Kimi K3, docs/kimi-k3.md §3): the router reads the full-width token; the
    routed experts read `routed_expert_down_proj(x)` (one projection per token, shared by its experts), their weighted
    sum is RMS-normalised by `routed_expert_norm` (`latent_moe_use_norm`) and brought back by `routed_expert_up_proj`;
    the shared experts read the full-width token.
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
        latent = config.routed_expert_hidden_size
        self.latent = latent is not None
        if self.latent:
            projection = partial(KDSALinear, bias=False, kernel_backend=config.kernel_backend)
            self.routed_expert_down_proj = projection(config.hidden_size, latent)
            self.routed_expert_up_proj = projection(latent, config.hidden_size)
            self.routed_expert_norm = (
                KDSARMSNorm(latent, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
            )

    def forward(
        self, hidden_states: torch.Tensor, output_router_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`[B, T, D]` → `[B, T, D]`; with `output_router_logits`, also the router logits `[B·T, E]` fp32."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [N, D]
        router_logits = self.gate.logits(tokens)
        topk_indices, topk_weights = self.gate.route(router_logits)
        if self.latent:
            routed = self.experts(self.routed_expert_down_proj(tokens), topk_indices, topk_weights)
            if self.routed_expert_norm is not None:
                routed = self.routed_expert_norm(routed)
            output = self.routed_expert_up_proj(routed).reshape(hidden_states.shape)
        else:
            output = self.experts(tokens, topk_indices, topk_weights).reshape(hidden_states.shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return (output, router_logits) if output_router_logits else output


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (arXiv:2101.03961 eqs. 4-6) in transformers' MoE convention
    (docs/design.md §9): per token, a softmax over each layer's router logits `[N, E]` and its top-`top_k` experts;
    `f_e` = share of (token, slot) assignments to expert e, `P_e` = mean softmax probability of e, both pooled over
    all layers; loss = `E · Σ_e f_e · P_e` (`top_k` when perfectly balanced). `token_mask: [N]` (1 = real token)
    leaves padding out. Returns a 0-d fp32 tensor."""
    num_experts = router_logits[0].shape[-1]
    assignments = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    probability_sums = router_logits[0].new_zeros(num_experts, dtype=torch.float32)
    weights = None if token_mask is None else token_mask.reshape(-1, 1).float()
    tokens = 0.0
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)  # [N, E]
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(dim=1).float()  # [N, E]
        if weights is not None:
            probs, chosen = probs * weights, chosen * weights
        assignments = assignments + chosen.sum(dim=0)
        probability_sums = probability_sums + probs.sum(dim=0)
        tokens = tokens + (probs.shape[0] if weights is None else weights.sum())
    return num_experts * ((assignments / tokens) * (probability_sums / tokens)).sum()


__all__ = [
    "GatedActivation",
    "load_balancing_loss",
    "KDSAMLP",
    "KDSATopkRouter",
    "KDSAExperts",
    "KDSAMoE",
    "situ_and_mul",
]
