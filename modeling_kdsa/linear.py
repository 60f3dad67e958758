"""The model's linear layer: `nn.Linear` (same parameters, same checkpoint keys) whose product is the kernel
registry's `row_linear` for the layer's `kernel_backend` (kernels.py, docs/backends.md §1): on `torch` the reference
(`linear_ops.linear`), on `cpu` a C++ kernel for 1 to 16 bf16 rows where it applies (`cpu_row_linear`,
docs/graph-mode.md §10).
"""

import torch
from torch import nn

from .kernels import kernel_set


class KDSALinear(nn.Linear):
    """`nn.Linear` whose forward is `row_linear` of `kernel_backend`'s KernelSet (`auto`: the device policy,
    `kernels.resolve_kernel_backend`); the model's layers pass `config.kernel_backend`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        kernel_backend: str = "auto",
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.kernel_backend = kernel_backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        row_linear = kernel_set(self.kernel_backend, hidden_states.device).row_linear
        return row_linear(hidden_states, self.weight, self.bias)


__all__ = ["KDSALinear"]
