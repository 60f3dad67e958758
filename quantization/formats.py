"""Reference definitions of KDSA's numeric formats (docs/design.md §4; docs/quantization.md).

The implementations live in `modeling_kdsa/numeric_formats.py`, next to the kernels, because the cache uses them at
run time and a remote-code copy of the model files must not import this folder (docs/design.md §1). They are re-exported
here so that quantization code has one place to import them from:

| name | elements | scale | block | use |
|---|---|---|---|---|
| MXFP8 (OCP MX v1.0) | E4M3 (max 448) | E8M0 `2^e`, e in [-127, 127], 0xFF = NaN | 32 | indexer keys + queries |
| FP8 tile | E4M3 (max 448) | fp32 power of two, amax floored at 1e-4 | 128 | MLA latent cache |

Scale rules: MXFP8 `"floor"` is the spec's `2^(floor(log2 amax) - 8)` (can clip block maxima in (448, 512)·X to 448);
`"ceil"` (default) is the smallest power of two with `amax <= 448 · X` (cuBLAS RCEIL / DeepSeek ue8m0: never clips).
FP8 tiles always use the ceil rule. Exponents come from the bits of the fp32 amax, never from fp32 `log2`.
"""

from modeling_kdsa.numeric_formats import (
    E4M3_MAX,
    FP8_AMAX_FLOOR,
    FP8_TILE_SIZE,
    MX_BLOCK_SIZE,
    MX_SCALE_RULES,
    CacheFormats,
    QuantizedRows,
    dequantize_blocks,
    e8m0_to_float,
    fp8_tile_dequantize,
    fp8_tile_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
)

__all__ = [
    "CacheFormats",
    "E4M3_MAX",
    "FP8_AMAX_FLOOR",
    "FP8_TILE_SIZE",
    "MX_BLOCK_SIZE",
    "MX_SCALE_RULES",
    "QuantizedRows",
    "dequantize_blocks",
    "e8m0_to_float",
    "fp8_tile_dequantize",
    "fp8_tile_quantize",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]
