"""FP8-held linear layers for checkpoints published with block-scaled E4M3 weights (DeepSeek-V3.2, GLM-5.3-Flash):
the E4M3 values and their fp32 `weight_scale_inv` block grid stay in memory (about half the bytes of BF16), and
every forward dequantizes the weight to the activation dtype before the matmul (docs/checkpoint-conversion.md §9).
Both go through the kernel registry's `fp8_dequantize` and `fp8_row_linear` (kernels.py; torch references in
`linear_ops`, C++ kernels on the `cpu` backend: `cpu_fp8_dequantize`).
"""

import torch
from torch import nn

from .kernels import kernel_set


def check_tile_grid(values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """One scale per `block` tile of the last two dims (leading dims alike), the grid rounded up: edge tiles may be
    partial."""
    rows, cols = values.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != (*values.shape[:-2], *grid):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(values.shape)} in "
            f"blocks of {tuple(block)} (expected grid {grid})"
        )


def dequantize_tiles(
    values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype, kernel_backend: str = "auto"
) -> torch.Tensor:
    """`values * scale_inv` tile by tile over the last two dims, in fp32, then cast to `dtype`, by `kernel_backend`'s
    `fp8_dequantize` (`auto`: the device policy); the held layers and the dequantize-at-load path both call this, and
    every backend's result is bit-identical to the reference `linear_ops.dequantize_tiles_torch`. Partial edge tiles
    are cropped. (numeric_formats.dequantize_blocks is the 1-D per-row-block counterpart used by the KV-cache
    formats.) On the `cpu` backend E4M3 values on an x86 CPU go through a vectorised C++ kernel
    (`cpu_fp8_dequantize`): torch converts float8 element by element."""
    return kernel_set(kernel_backend, values.device).fp8_dequantize(values, scale_inv, block, dtype)


class KDSAFP8Linear(nn.Module):
    """`nn.Linear` whose `weight` is float8_e4m3fn with one fp32 `weight_scale_inv` per `block` tile."""

    def __init__(
        self, values: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], bias=None, kernel_backend="auto"
    ):
        super().__init__()
        self.kernel_backend = kernel_backend
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"KDSAFP8Linear weight must be float8_e4m3fn, got {values.dtype}")
        check_tile_grid(values, scale_inv, block)
        rows, cols = values.shape
        self.block = tuple(block)
        self.in_features, self.out_features = cols, rows
        self.weight = nn.Parameter(values, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)
        self.bias = bias

    @classmethod
    def like(cls, layer: nn.Module, block: tuple[int, int]) -> "KDSAFP8Linear":
        """An uninitialised FP8 layer of `layer`'s shape and kernel backend, for the checkpoint's values and scales to
        load into."""
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"only nn.Linear layers can hold FP8 weights, got a {type(layer).__name__}")
        rows, cols = layer.weight.shape
        device = layer.weight.device
        values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
        scale_inv = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32, device=device)
        return cls(values, scale_inv, block, layer.bias, getattr(layer, "kernel_backend", "auto"))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_tiles(self.weight, self.weight_scale_inv, self.block, dtype, self.kernel_backend)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The product with the dequantized weight, `fp8_row_linear` of the layer's backend; on `cpu` a few bf16 rows
        on an x86 CPU go through the fused kernel, which dequantizes inside the row product (bit-identical, no weight
        copy written: docs/checkpoint-conversion.md §9)."""
        fp8_row_linear = kernel_set(self.kernel_backend, hidden_states.device).fp8_row_linear
        return fp8_row_linear(hidden_states, self.weight, self.weight_scale_inv, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


__all__ = ["KDSAFP8Linear", "check_tile_grid", "dequantize_tiles"]
