"""`KDSAQuantizer`: the HF quantizer of `quant_method: "kdsa"` (transformers `quantizers/base.py: HfQuantizer`;
docs/design.md §4).

What it quantizes is the cache, not the weights: indexer keys/queries (MXFP8) and the MLA latent cache (FP8 tiles)
are produced at run time by the model's own cache code (`modeling_kdsa/numeric_formats.py`, `cache.py`), chosen from
`config.quantization_config` when a `KDSACache` (or a cache-less forward's private store) is built. So loading swaps no
module and converts no weight; the quantizer's jobs are:
- check, before any weight is read, that the model's widths fit the chosen blocks (`index_head_dim % 32`,
  `kv_lora_rank % kv_cache_tile_size`), with an error naming the field;
- let transformers attach the config to `model.config` (`postprocess_model`), which `save_pretrained` writes into
  `config.json` and `from_pretrained` reads back (`pre_quantized`), so the choice round-trips.
"""

from transformers.quantizers import HfQuantizer

from modeling_kdsa.configuration_kdsa import KDSAConfig


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


__all__ = ["KDSAQuantizer"]
