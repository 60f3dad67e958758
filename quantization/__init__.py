"""Layered quantization of KDSA models (docs/design.md §4): the HF quantization config and quantizer (`quant_method:
"kdsa"`), and the numeric formats' reference definitions (`formats`, re-exported from `modeling_kdsa.numeric_formats`).

`register()` adds "kdsa" to transformers' quantization registries; `import modeling_kdsa` calls it.
"""

from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from modeling_kdsa.numeric_formats import QUANT_METHOD

from .config import KDSAQuantizationConfig
from .quantizer import KDSAQuantizer


def register() -> None:
    """Register the config and quantizer under "kdsa" (idempotent: transformers refuses a second registration)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(KDSAQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(KDSAQuantizer)


__all__ = ["KDSAQuantizationConfig", "KDSAQuantizer", "register"]
