"""The model's linear layers: `nn.Linear` whose product with a few rows on CPU streams the weight once instead of
calling a GEMM: in bf16 through a C++ kernel for 1 to 16 rows, eagerly and compiled (`cpu_row_linear`,
docs/graph-mode.md §10); otherwise, for one row in a compiled graph, through one fused multiply-and-sum
(docs/graph-mode.md §9).

Batch-1 decode multiplies every weight matrix by one row. On CPU, oneDNN's bf16 GEMV for that shape reads a cold
weight at about half the memory bandwidth a plain streaming pass reaches or less; written as `(w * x).sum(-1)`,
inductor generates one vectorised reduction that reads each weight element once at close to streaming speed, and for
gathered expert weights it fuses the gather into that read (no copy). Everywhere else (more rows, fp32 eagerly, GPUs,
NPUs) the layer is exactly `nn.Linear`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_extension import cpu_has_bf16_products, plain_tensor
from .cpu_row_linear import row_linear, row_linear_applies


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


# Where the row kernel does not take a product (no AVX2, more than `MAX_ROWS` rows), up to this many rows keep torch's
# bf16 product: widening the weight would cost more than one slow read of it (docs/graph-mode.md §13).
WIDEN_ABOVE_ROWS = 4


def widens_to_fp32(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs a product that the row kernel does not take as an fp32 GEMM (`slow_bf16_products`): more
    than `WIDEN_ABOVE_ROWS` rows and a plain bf16 weight."""
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
    """`F.linear`: 1 to `MAX_ROWS` (16) bf16 rows through the C++ row kernel where it applies (`cpu_row_linear`,
    docs/graph-mode.md §10), else in the fused single-row form when `streams_weight(hidden_states, weight)`; other
    products of more than `WIDEN_ABOVE_ROWS` bf16 rows on a CPU without native bf16 products as an fp32 GEMM
    (`widens_to_fp32`)."""
    if row_linear_applies(hidden_states, weight, bias):
        return row_linear(hidden_states.contiguous(), weight, bias)  # a batch's last-token slice is strided
    if streams_weight(hidden_states, weight):
        return row_times_weight(hidden_states, weight, bias)
    if widens_to_fp32(hidden_states, weight):
        wide_bias = None if bias is None else bias.float()
        return F.linear(hidden_states.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(hidden_states, weight, bias)


class KDSALinear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint keys) whose forward is `linear` above."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return linear(hidden_states, self.weight, self.bias)


__all__ = [
    "WIDEN_ABOVE_ROWS",
    "KDSALinear",
    "fuses_on_cpu",
    "linear",
    "product",
    "row_times_weight",
    "slow_bf16_products",
    "streams_weight",
    "widens_to_fp32",
]
