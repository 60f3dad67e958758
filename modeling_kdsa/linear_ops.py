"""The model's products in torch: the reference entries of the kernel registry's `row_linear`, `head_matmul`,
`head_linear`, `expert_linear`, `fp8_dequantize` and `fp8_row_linear` (kernels.py, docs/backends.md §1), and the
helpers the other torch kernels share (`product`). The `cpu` backend's entries run C++ kernels where they apply and
these where they do not (`cpu_row_linear`, `cpu_head_products`, `cpu_expert_linear`, `cpu_fp8_dequantize`).

Besides `F.linear`, two torch forms of a product (no `kdsa::` op in either):
- one row in a compiled graph on CPU as one fused multiply-and-sum (`row_times_weight`, docs/graph-mode.md §9):
  batch-1 decode multiplies every weight matrix by one row, and oneDNN's bf16 GEMV for that shape reads a cold weight
  at about half the memory bandwidth a plain streaming pass reaches or less; written as `(w * x).sum(-1)`, inductor
  generates one vectorised reduction that reads each weight element once at close to streaming speed, and for
  gathered expert weights it fuses the gather into that read (no copy);
- bf16 products on a CPU without native bf16 products as fp32 products of the widened operands, rounded once
  (`slow_bf16_products`, docs/graph-mode.md §13).
Everywhere else (fp32 eagerly, GPUs, NPUs) `linear` is exactly `F.linear`.

Legend: `P` rows, `K` input width, `N` output width, `H` heads, `E` experts.
"""

from functools import partial

import torch
import torch.nn.functional as F

from .cpu_extension import cpu_has_bf16_products, plain_tensor


def fuses_on_cpu(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product may take the fused form at all: inside a compile for inductor (not `torch.export`, whose
    program other runtimes run op by op), on CPU, a plain weight of the activations' dtype (no tensor subclass such
    as a quantized weight, no autocast: there `F.linear` decides the dtypes)."""
    return (
        torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and hidden_states.device.type == "cpu"
        and plain_tensor(weight)
        and weight.dtype == hidden_states.dtype
        and not torch.is_autocast_enabled("cpu")
    )


def streams_weight(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product with `hidden_states` takes the fused single-row form: `fuses_on_cpu` and one row."""
    return fuses_on_cpu(hidden_states, weight) and hidden_states.numel() == hidden_states.shape[-1]


def row_times_weight(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`rows @ weight.T (+ bias)` as a multiply-and-sum over the input dim, accumulated in fp32 like a GEMM, returned
    in `rows`' dtype. rows `[..., in]` broadcasts against weight `[..., out, in]`: `[..., out]`."""
    out = (weight.float() * rows.float().unsqueeze(-2)).sum(-1)
    return (out if bias is None else out + bias.float()).to(rows.dtype)


def slow_bf16_products(x: torch.Tensor) -> bool:
    """Whether a product with the bf16 operand `x` runs faster as an fp32 product of the widened operands, rounded to
    bf16 once: eagerly, without autograd or autocast, on a CPU without native bf16 products. There torch's bf16 GEMMs
    ran at a flat ~2.5 G multiply-adds/s (AMD Zen 1, one thread), 7x slower than its fp32 GEMM for 128 rows, where
    widening the operands costs one pass over them (docs/graph-mode.md §13). Same arithmetic: fp32 sums of exact
    products, rounded once."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not cpu_has_bf16_products()
    )


# Up to this many rows keep torch's bf16 product on a CPU without native bf16 products: widening the weight would
# cost more than one slow read of it (docs/graph-mode.md §13). The `cpu` backend's row kernel takes such products
# where it applies (`cpu_row_linear`).
WIDEN_ABOVE_ROWS = 4


def widens_to_fp32(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs a product as an fp32 GEMM (`slow_bf16_products`): more than `WIDEN_ABOVE_ROWS` rows and
    a plain bf16 weight."""
    return (
        hidden_states.numel() > WIDEN_ABOVE_ROWS * hidden_states.shape[-1]
        and plain_tensor(weight)
        and weight.dtype == torch.bfloat16
        and slow_bf16_products(hidden_states)
    )


def product(function, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`function(a, b)`, a product of two bf16 operands such as `torch.bmm`; in fp32 on the widened operands, rounded
    to bf16 once, where `slow_bf16_products(a)`."""
    if slow_bf16_products(a):
        return function(a.float(), b.float()).to(torch.bfloat16)
    return function(a, b)


def linear(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`row_linear`'s reference, `F.linear(hidden_states [..., K], weight [N, K], bias [N])` → `[..., N]`: in the
    fused single-row form when `streams_weight`, as an fp32 GEMM of the widened operands when `widens_to_fp32`."""
    if streams_weight(hidden_states, weight):
        return row_times_weight(hidden_states, weight, bias)
    if widens_to_fp32(hidden_states, weight):
        wide_bias = None if bias is None else bias.float()
        return F.linear(hidden_states.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(hidden_states, weight, bias)


def per_head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`head_matmul`'s reference: `x[..., h, :] @ weight[h]` for every head, x `[B, T, H, N]`, weight `[H, N, K]`
    (any head stride) → `[B, T, H, K]` (MLA's query absorption, docs/dsa.md §3). The einsum runs on a contiguous
    weight: on strided views torch's bf16 einsum is ~100x slower on CPU (docs/dsa.md §13)."""
    return product(partial(torch.einsum, "bthn,hnk->bthk"), x, weight.contiguous())


def per_head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`head_linear`'s reference: `x[..., h, :] @ weight[h]ᵀ` for every head, x `[B, T, H, K]`, weight `[H, N, K]`
    (any head stride) → `[B, T, H, N]` (MLA's latent output expansion, docs/dsa.md §3); contiguous weight as in
    `per_head_matmul`."""
    return product(partial(torch.einsum, "bthk,hnk->bthn"), x, weight.contiguous())


def expert_linear(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor | None) -> torch.Tensor:
    """`expert_linear`'s reference: each row of `x` `[P, K]` times its expert's matrix, `weight[experts[p]] @ x[p]`,
    weight `[E, N, K]`, experts `[P]` → `[P, N]`; `experts=None`: `weight` `[P, N, K]` holds each row's matrix already
    (dequantized MXFP4 experts). The matrices are gathered, then one batched product; inside a compile on CPU the
    fused multiply-and-sum, which folds the gather into its read of the weights (docs/graph-mode.md §9)."""
    gathered = weight if experts is None else weight[experts]
    if fuses_on_cpu(x, gathered):
        return row_times_weight(x, gathered)
    return torch.matmul(gathered, x.unsqueeze(-1)).squeeze(-1)


def experts_gathered(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`experts_in_place`'s reference answer: False, `expert_linear` gathers the rows' matrices (`KDSAExperts` then
    runs each expert over its tokens instead, docs/graph-mode.md §12)."""
    return False


def dequantize_tiles_torch(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype):
    """`fp8_dequantize`'s reference: `values * scale_inv` tile by tile over the last two dims (one scale per `block`
    tile, edge tiles cropped), in fp32, then cast to `dtype` (docs/checkpoint-conversion.md §9)."""
    rows, cols = values.shape[-2:]
    block_rows, block_cols = block
    scales = scale_inv.float().repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)
    return (values.float() * scales[..., :cols]).to(dtype)


def fp8_linear(
    hidden_states: torch.Tensor, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], bias=None
) -> torch.Tensor:
    """`fp8_row_linear`'s reference: an FP8-held layer's product, `linear` with the weight dequantized to the
    activations' dtype first (`dequantize_tiles_torch`)."""
    return linear(hidden_states, dequantize_tiles_torch(values, scale_inv, block, hidden_states.dtype), bias)


__all__ = [
    "WIDEN_ABOVE_ROWS",
    "dequantize_tiles_torch",
    "expert_linear",
    "experts_gathered",
    "fp8_linear",
    "fuses_on_cpu",
    "linear",
    "per_head_linear",
    "per_head_matmul",
    "product",
    "row_times_weight",
    "slow_bf16_products",
    "streams_weight",
    "widens_to_fp32",
]
