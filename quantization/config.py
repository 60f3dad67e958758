"""`KDSAQuantizationConfig` (`quant_method: "kdsa"`): which KDSA cache stores are quantized (docs/design.md §4).

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
"""

from transformers.utils.quantization_config import QuantizationConfigMixin

from modeling_kdsa.numeric_formats import FP8_TILE_SIZE, QUANT_METHOD, CacheFormats


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


__all__ = ["KDSAQuantizationConfig"]
