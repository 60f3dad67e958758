"""The `kdsa` quantization method of transformers (`quant_method: "kdsa"`, docs/design.md §4): its config
(`KDSAQuantizationConfig`), its quantizer (`KDSAQuantizer`, transformers `quantizers/base.py: HfQuantizer`) and
`register()`, which adds both to transformers' registries; `import modeling_kdsa` calls it. The public import path is
`modeling_kdsa.quantization` (the `quantization/` folder), which builds on this file: the model package never imports
that folder (docs/design.md §1).

    from modeling_kdsa.quantization import KDSAQuantizationConfig
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KDSAQuantizationConfig())

Per-module choices (user-facing names; the defaults are docs/design.md §4's layering):
- `indexer="mxfp8"` | `"bf16"`: Lightning Indexer keys stored MXFP8 (E4M3 + one E8M0 scale per 32) in the paged
  cache, queries MXFP8-rounded dynamically before scoring. Indexer head weights stay fp32.
- `kv_cache="fp8"` | `"bf16"`: the normalised MLA latent stored FP8 E4M3 per token in tiles of `kv_cache_tile_size`
  (128, as DeepSeek-V3.2 / FlashMLA) with fp32 power-of-two scales; the RoPE key part stays in the model dtype.
- `mxfp8_scale_rule="ceil"` | `"floor"`: the MXFP8 scale rule — ceil (default) never clips (cuBLAS RCEIL / DeepSeek
  ue8m0), floor is the OCP spec's rule (clips block maxima in (448, 512)·X to 448).
- `kv_cache_tile_size=128`: must divide `kv_lora_rank` (64 suits checkpoints with a 64-wide latent).
Projections (attention, KDA, MoE), router, gates, AttnRes and norms are never touched: weights stay as stored, so a
quantized checkpoint's weights are the BF16 ones and only the run-time cache formats change.

The choices are carried in `config.json` under `quantization_config`; the model files read them
(`numeric_formats.CacheFormats.from_config`) when a cache is built.

What the quantizer quantizes is the cache, not the weights: indexer keys/queries (MXFP8) and the MLA latent cache (FP8
tiles) are produced at run time by the model's own cache code (`numeric_formats.py`, `cache.py`), chosen from
`config.quantization_config` when a `KDSACache` (or a cache-less forward's private store) is built. So loading swaps no
module and converts no weight; the quantizer's jobs are:
- check, before any weight is read, that the model's widths fit the chosen blocks (`index_head_dim % 32`,
  `kv_lora_rank % kv_cache_tile_size`), with an error naming the field;
- let transformers attach the config to `model.config` (`postprocess_model`), which `save_pretrained` writes into
  `config.json` and `from_pretrained` reads back (`pre_quantized`), so the choice round-trips.
"""

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from .configuration_kdsa import KDSAConfig
from .numeric_formats import FP8_TILE_SIZE, QUANT_METHOD, CacheFormats


class KDSAQuantizationConfig(QuantizationConfigMixin):
    """Quantization config of KDSA models (module doc for the fields). Raises ValueError on an unknown value or
    field, so a typo never silently leaves a module unquantized."""

    def __init__(
        self,
        indexer: str = "mxfp8",
        kv_cache: str = "fp8",
        mxfp8_scale_rule: str = "ceil",
        kv_cache_tile_size: int = FP8_TILE_SIZE,
        **kwargs,
    ):
        method = kwargs.pop("quant_method", QUANT_METHOD)
        method = getattr(method, "value", method)
        if method != QUANT_METHOD:
            raise ValueError(f"KDSAQuantizationConfig is quant_method {QUANT_METHOD!r}, got {method!r}")
        if kwargs:
            raise ValueError(
                f"unknown KDSAQuantizationConfig field(s) {sorted(kwargs)}; fields: indexer, kv_cache, "
                "mxfp8_scale_rule, kv_cache_tile_size"
            )
        self.quant_method = QUANT_METHOD
        self.indexer = indexer
        self.kv_cache = kv_cache
        self.mxfp8_scale_rule = mxfp8_scale_rule
        self.kv_cache_tile_size = kv_cache_tile_size
        self.cache_formats()  # validates the values

    def cache_formats(self) -> CacheFormats:
        """The formats the KDSA cache uses for this config."""
        return CacheFormats(self.indexer, self.kv_cache, self.mxfp8_scale_rule, self.kv_cache_tile_size)

    def to_dict(self) -> dict:
        return {
            "quant_method": self.quant_method,
            "indexer": self.indexer,
            "kv_cache": self.kv_cache,
            "mxfp8_scale_rule": self.mxfp8_scale_rule,
            "kv_cache_tile_size": self.kv_cache_tile_size,
        }


class KDSAQuantizer(HfQuantizer):
    requires_calibration = False  # dynamic scales: nothing to calibrate

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = model.config
        if not isinstance(config, KDSAConfig):
            raise ValueError(f"quant_method 'kdsa' applies to KDSA models only, got a {type(config).__name__}")
        self.quantization_config.cache_formats().check_shapes(config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        # Weights are untouched BF16 and training forwards use no cache.
        return True


def register() -> None:
    """Register the config and quantizer under "kdsa" (idempotent: transformers refuses a second registration)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(KDSAQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(KDSAQuantizer)


__all__ = ["KDSAQuantizationConfig", "KDSAQuantizer", "register"]
