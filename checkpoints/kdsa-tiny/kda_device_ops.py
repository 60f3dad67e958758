"""KDA on accelerators: adapters from our KDA kernel contract (`kda_ops.chunk_kda` / `recurrent_kda`: q, k, g
`[B, T, H, K]` with q, k L2-normalised by the caller, v `[B, T, H, V]`, beta `[B, T, H]` after the sigmoid, g the
natural-log decay, fp32 state `[B, H, K, V]`, `o` in v's dtype) to the device kernels (docs/backends.md §2, §4).

- CUDA (`kernel_backend="triton"`): fla's Triton `chunk_kda` (prefill) and `fused_recurrent_kda` (decode), from
  fla-org/flash-linear-attention `fla/ops/kda/`. Same layout `[B, T, H, K]`, same log-space gate and state layout
  `[N, H, K, V]` (fp32; `chunk_kda` asserts it), same default scale. Every in-kernel preprocessing is switched off
  (`use_qk_l2norm_in_kernel`, `use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`), because the layer has applied
  each already. Inputs go in fp32, the dtype our kernels compute in (fla's own layer feeds bf16 q, k, v), so this
  backend's KDA should differ from the torch kernels by summation order, plus TF32 rounding wherever fla's fp32 dots
  run in TF32 on the GPU (not measured, docs/backends.md §4). `chunk_kda` asserts K <= 256;
  the adapter refuses a wider key head with a ValueError instead.
- Ascend (`kernel_backend="npu"`): decode through `torch_npu.npu_recurrent_gated_delta_rule` (Ascend/op-plugin
  `docs/zh/custom_APIs/torch_npu/torch_npu-npu_recurrent_gated_delta_rule.md`, op-plugin 7.3.0 and later): tokens
  flattened to TND `[T, N, D]`; per-key decay `gk = g` (`[T, Nv, Dk]` fp32, the op's decay is `exp(gk)`); state
  slots `[BlockNum, Nv, Dv, Dk]`, i.e. the transpose of ours; bf16 q, k, v, beta and state (the only dtype the op
  takes); at most 8 tokens per sequence and call. There is no chunked torch_npu op with a per-key decay, so prefill
  stays on the torch kernel.
"""

import importlib

import torch

from .kda_ops import _check_kda_inputs


def _fla_kda_ops():
    """fla's Triton `(chunk_kda, fused_recurrent_kda)`, imported on first use (fla's package imports triton). Not an
    import statement: transformers requires every package a remote-code file imports to be installed, and only the
    triton backend needs fla."""
    kda = importlib.import_module("fla.ops.kda")
    return kda.chunk_kda, kda.fused_recurrent_kda


def require_fla() -> None:
    """ValueError unless fla's Triton KDA kernels import."""
    try:
        _fla_kda_ops()
    except ImportError as error:
        raise ValueError(
            "kernel_backend='triton' runs KDA through fla's Triton kernels: install flash-linear-attention"
        ) from error


def _fla_call(which: int, q, k, v, g, beta, scale, initial_state, output_final_state):
    """fla's kernel `which` (0 = chunk_kda, 1 = fused_recurrent_kda) under our contract."""
    _check_kda_inputs(q, k, v, g, beta, initial_state)
    o, final_state = _fla_kda_ops()[which](
        q.float(),
        k.float(),
        v.float(),
        g.float(),
        beta.float(),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
    )
    return o.to(v.dtype), (final_state.float() if output_final_state else None)


FLA_CHUNK_MAX_HEAD_DIM = 256  # fla's chunk_kda asserts K <= 256


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """`kda_ops.chunk_kda`'s contract on fla's Triton `chunk_kda`; ValueError for a key head dim it does not take."""
    if q.dim() == 4 and q.shape[-1] > FLA_CHUNK_MAX_HEAD_DIM:
        raise ValueError(
            f"kernel_backend='triton': fla's chunk_kda takes linear_head_dim <= {FLA_CHUNK_MAX_HEAD_DIM}, got "
            f"{q.shape[-1]}"
        )
    return _fla_call(0, q, k, v, g, beta, scale, initial_state, output_final_state)


def fla_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """`kda_ops.recurrent_kda`'s contract on fla's Triton `fused_recurrent_kda`."""
    return _fla_call(1, q, k, v, g, beta, scale, initial_state, output_final_state)


NPU_GDR_MAX_TOKENS = 8  # npu_recurrent_gated_delta_rule: 1 <= L_i <= 8 tokens per sequence
NPU_GDR_MAX_HEADS = 256  # N_k, N_v <= 256
NPU_GDR_MAX_DIM = 512  # D_k, D_v <= 512


def _tnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, L, ...]` -> sequence-major TND `[B·L, ...]`, contiguous, in `dtype`."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).to(dtype).contiguous()


def npu_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """`kda_ops.recurrent_kda`'s contract on `torch_npu.npu_recurrent_gated_delta_rule`, in windows of at most 8
    tokens per sequence. Each window gives every token its own state slot (`ssm_state_indices` = 0..B·L-1, sequence
    `b` at slots `b·L ... b·L + L-1`): the op starts a sequence from the slot of its first token (no
    `num_accepted_tokens`) and writes the state after token `t` to slot `t`, so the state after a window is the slot
    of each sequence's last token. The state is rounded to bf16 between windows (the op's state dtype)."""
    from .npu_kernels import torch_npu_module

    _check_kda_inputs(q, k, v, g, beta, initial_state)
    torch_npu = torch_npu_module()
    batch, seq_len, num_heads, head_k_dim = q.shape
    head_v_dim = v.shape[-1]
    if num_heads > NPU_GDR_MAX_HEADS:
        raise ValueError(f"kernel_backend='npu': linear_num_heads must be <= {NPU_GDR_MAX_HEADS}, got {num_heads}")
    if max(head_k_dim, head_v_dim) > NPU_GDR_MAX_DIM:
        raise ValueError(f"kernel_backend='npu': linear_head_dim must be <= {NPU_GDR_MAX_DIM}, got {head_k_dim}")
    scale = head_k_dim**-0.5 if scale is None else scale
    state = q.new_zeros(batch, num_heads, head_k_dim, head_v_dim, dtype=torch.float32)
    if initial_state is not None:
        state = initial_state.float()
    outputs = []
    for start in range(0, seq_len, NPU_GDR_MAX_TOKENS):
        window = min(NPU_GDR_MAX_TOKENS, seq_len - start)
        q_t, k_t, v_t, beta_t = (_tnd(x[:, start : start + window], torch.bfloat16) for x in (q, k, v, beta))
        slots = state.new_zeros(batch * window, num_heads, head_v_dim, head_k_dim, dtype=torch.bfloat16)
        slots[::window] = state.transpose(-1, -2).to(torch.bfloat16)
        out = torch_npu.npu_recurrent_gated_delta_rule(
            q_t,
            k_t,
            v_t,
            slots,
            beta=beta_t,
            scale=float(scale),
            actual_seq_lengths=torch.full((batch,), window, dtype=torch.int32, device=q.device),
            ssm_state_indices=torch.arange(batch * window, dtype=torch.int32, device=q.device),
            g=None,
            gk=_tnd(g[:, start : start + window], torch.float32),
        )
        outputs.append(out.view(batch, window, num_heads, head_v_dim))
        state = slots[window - 1 :: window].float().transpose(-1, -2)
    o = torch.cat(outputs, dim=1) if outputs else v.new_zeros(batch, 0, num_heads, head_v_dim)
    return o.to(v.dtype), (state.contiguous() if output_final_state else None)


__all__ = ["fla_chunk_kda", "fla_recurrent_kda", "npu_recurrent_kda", "require_fla"]
