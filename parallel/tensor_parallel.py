"""Tensor parallelism for KDSA: our own head / intermediate-dim plan, applied in place to a loaded model.

docs/parallel.md §5 (Megatron-style column-parallel projections, row-parallel outputs, all-reduce after them);
docs/design.md §2 (the trap of plans matching the wrong mixer, which our distinct `linear_attn` / `self_attn` names
avoid).

Why not transformers' `tp_plan`: the KDA layer needs its short-conv weights, `A_log` `[1, 1, H, 1]`, `dt_bias` `[H·K]`,
`b_proj` and the low-rank gate's second projections cut by the same heads, which no built-in style does, and the
DTensor parameters it creates would also have to pass through our kernels. The plan here is small and explicit:

| module | split | after it |
|---|---|---|
| KDA `q/k/v_proj`, `q/k/v_conv1d`, `f_b_proj`, `dt_bias`, `A_log`, `b_proj`, `g_b_proj` or `g_proj` | by KDA head | – |
| KDA `o_proj` | input columns by head | all-reduce |
| MLA `q_b_proj` (`q_proj`), `kv_b_proj`, output gate `g_proj` | by attention head | – |
| MLA `o_proj` | input columns by head | all-reduce |
| MoE experts `gate_up_proj` / `down_proj`, shared experts, dense MLP | intermediate dim | one all-reduce per MLP |
| embeddings, norms, router, `q_a_proj`, `kv_a_proj_with_mqa`, `f_a_proj`, `g_a_proj`, `lm_head` | replicated | – |

The Lightning Indexer stays whole on every rank: splitting its heads would need an all-reduce of the `[T, S]`
scores before top-k, more bytes than the whole latent all-gather. Under context parallelism the TP group instead
splits the indexer's *queries* (sequence parallel inside the TP group) and all-gathers the `[T, k]` selected
indices (context_parallel.py). Each layer's head counts (`num_heads`, `key_dim`, `value_dim`) are set to the local
values, so the model's own forward (and `generate`) runs unchanged on every rank; forward hooks do the all-reduces.
"""

import torch
from torch import nn

from modeling_kdsa.fp8_linear import KDSAFP8Linear
from modeling_kdsa.kda import KDSAKimiDeltaAttention
from modeling_kdsa.moe import KDSAMLP, KDSAMoE

from .mesh import ParallelMesh


def tensor_parallel_errors(config, tp_size: int) -> str | None:
    """Why `config` cannot be split `tp_size` ways, or None."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "linear_num_heads": config.linear_num_heads,
        "moe_intermediate_size": config.moe_intermediate_size,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tp_size]
    if bad:
        return f"tp={tp_size} must divide the sharded sizes; not divisible: {', '.join(bad)}"
    if tp_size > 1 and config.routed_expert_hidden_size is not None:
        # The latent norm must see the sum over all ranks' expert partials, which the per-MLP all-reduce comes after.
        latent = config.routed_expert_hidden_size
        return f"tensor parallelism does not support LatentMoE (routed_expert_hidden_size={latent})"
    if tp_size > 1 and config.routed_expert_weight_format != "dense":
        return (
            "tensor parallelism does not support packed routed experts "
            f"(routed_expert_weight_format={config.routed_expert_weight_format!r})"
        )
    return None


def _slice_param(parameter: nn.Parameter, dim: int, start: int, end: int) -> nn.Parameter:
    return nn.Parameter(parameter.detach().narrow(dim, start, end - start).clone(), requires_grad=False)


def _column_parallel(linear: nn.Linear, start: int, end: int) -> None:
    """Keep output features `[start, end)`."""
    linear.weight = _slice_param(linear.weight, 0, start, end)
    if linear.bias is not None:
        linear.bias = _slice_param(linear.bias, 0, start, end)
    linear.out_features = end - start


def _row_parallel(linear: nn.Linear, start: int, end: int, keeps_bias: bool) -> None:
    """Keep input features `[start, end)`; the bias is added once (on tp rank 0) since the outputs are summed."""
    linear.weight = _slice_param(linear.weight, 1, start, end)
    if linear.bias is not None and not keeps_bias:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = end - start


def _all_reduce_output(mesh: ParallelMesh, tag: str):
    def hook(module, inputs, output):
        return mesh.all_reduce(output, "tp", tag)

    return hook


def _shard_kda(attn: KDSAKimiDeltaAttention, rank: int, size: int) -> None:
    heads = attn.num_heads // size
    h0, h1 = rank * heads, (rank + 1) * heads
    k0, k1 = h0 * attn.head_k_dim, h1 * attn.head_k_dim
    v0, v1 = h0 * attn.head_v_dim, h1 * attn.head_v_dim
    for linear, (start, end) in (
        (attn.q_proj, (k0, k1)), (attn.k_proj, (k0, k1)), (attn.v_proj, (v0, v1)),
        (attn.f_b_proj, (k0, k1)), (attn.b_proj, (h0, h1)),
        (attn.g_proj if attn.full_rank_gate else attn.g_b_proj, (v0, v1)),
    ):  # fmt: skip
        _column_parallel(linear, start, end)
    for conv, (start, end) in ((attn.q_conv1d, (k0, k1)), (attn.k_conv1d, (k0, k1)), (attn.v_conv1d, (v0, v1))):
        conv.weight = _slice_param(conv.weight, 0, start, end)
        conv.in_channels = conv.out_channels = conv.groups = end - start
    attn.dt_bias = _slice_param(attn.dt_bias, 0, k0, k1)
    attn.A_log = _slice_param(attn.A_log, 2, h0, h1)
    _row_parallel(attn.o_proj, v0, v1, keeps_bias=rank == 0)
    attn.num_heads, attn.key_dim, attn.value_dim = heads, k1 - k0, v1 - v0


def _shard_mla(attn, rank: int, size: int) -> None:
    heads = attn.num_heads // size
    h0, h1 = rank * heads, (rank + 1) * heads
    query_proj = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
    _column_parallel(query_proj, h0 * attn.qk_head_dim, h1 * attn.qk_head_dim)
    per_head = attn.qk_nope_head_dim + attn.v_head_dim
    _column_parallel(attn.kv_b_proj, h0 * per_head, h1 * per_head)
    if attn.g_proj is not None:  # the output gate is per head like the attention output it multiplies
        _column_parallel(attn.g_proj, h0 * attn.v_head_dim, h1 * attn.v_head_dim)
    _row_parallel(attn.o_proj, h0 * attn.v_head_dim, h1 * attn.v_head_dim, keeps_bias=rank == 0)
    attn.num_heads = heads


def _shard_mlp(mlp: KDSAMLP, rank: int, size: int) -> None:
    width = mlp.gate_proj.out_features // size
    i0, i1 = rank * width, (rank + 1) * width
    _column_parallel(mlp.gate_proj, i0, i1)
    _column_parallel(mlp.up_proj, i0, i1)
    _row_parallel(mlp.down_proj, i0, i1, keeps_bias=rank == 0)


def _shard_moe(moe: KDSAMoE, rank: int, size: int) -> None:
    experts = moe.experts
    intermediate = experts.down_proj.shape[-1]
    width = intermediate // size
    i0, i1 = rank * width, (rank + 1) * width
    gate_up = experts.gate_up_proj.detach()  # [E, 2I, D]: gate rows, then up rows
    local = torch.cat([gate_up[:, i0:i1], gate_up[:, intermediate + i0 : intermediate + i1]], dim=1)
    experts.gate_up_proj = nn.Parameter(local.clone(), requires_grad=False)
    experts.down_proj = _slice_param(experts.down_proj, 2, i0, i1)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, size)


def apply_tensor_parallel(model, mesh: ParallelMesh):
    """Shard `model` (a `KDSAForCausalLM` or `KDSAModel`, identical weights on every rank) over the mesh's tp group,
    in place, and return it. Raises `ValueError` on every rank when a sharded size is not divisible by tp.
    Under tp = 1 this does nothing."""
    config = model.config
    if mesh.tp_size == 1:
        return model
    if any(isinstance(module, KDSAFP8Linear) for module in model.modules()):
        # Slicing the E4M3 weight would leave its block-scale grid whole (docs/checkpoint-conversion.md §9).
        raise ValueError(
            "apply_tensor_parallel does not shard FP8-held weights (fp8_weights='hold'); load the checkpoint with "
            "fp8_weights='dequantize' (the default) to shard it"
        )
    error = tensor_parallel_errors(config, mesh.tp_size)
    if error is not None:  # same config on every rank, so every rank raises here: nothing to agree on
        raise ValueError(error)
    base = getattr(model, "model", model)
    rank, size = mesh.tp_rank, mesh.tp_size
    for layer in base.layers:
        if hasattr(layer, "linear_attn"):
            _shard_kda(layer.linear_attn, rank, size)
            layer.linear_attn.o_proj.register_forward_hook(_all_reduce_output(mesh, "tp.kda_o_proj"))
        else:
            _shard_mla(layer.self_attn, rank, size)
            layer.self_attn.o_proj.register_forward_hook(_all_reduce_output(mesh, "tp.mla_o_proj"))
        if isinstance(layer.mlp, KDSAMoE):
            _shard_moe(layer.mlp, rank, size)
        else:
            _shard_mlp(layer.mlp, rank, size)
        layer.mlp.register_forward_hook(_all_reduce_output(mesh, "tp.mlp"))
    return model


__all__ = ["apply_tensor_parallel", "tensor_parallel_errors"]
