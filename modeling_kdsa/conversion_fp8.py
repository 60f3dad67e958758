"""Block-scaled FP8 (E4M3) checkpoints of DeepSeek-V3.2 and GLM-5.3-Flash (docs/checkpoint-conversion.md §6, §9): the
config check, the dequantizing converters, and the layers `fp8_weights="hold"` keeps in FP8."""

import json
import os

import torch
from transformers.core_model_loading import WeightConverter, WeightRenaming
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from .conversion_common import ConfigFields, ForeignCheckpointPlan
from .fp8_linear import check_tile_grid, dequantize_tiles

_FP8_QUANT_METHOD = "fp8"

# `from_pretrained(folder, fp8_weights=...)` for FP8 checkpoints (docs/checkpoint-conversion.md §9).
FP8_WEIGHTS_CHOICES = ("dequantize", "hold")
# Linear layers whose `.weight` is read by code other than their forward (MLA weight absorption): kept dequantized.
_FP8_WEIGHT_READ_DIRECTLY = ("kv_b_proj",)

_FP8_CONFIG_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "dequantize",
                    "modules_to_not_convert"}  # fmt: skip


def fp8_quantization_fields(fields: ConfigFields, mapped: dict) -> None:
    """Only the DeepSeek / GLM fine-grained FP8 layout (E4M3 weights, one `weight_scale_inv` per weight block) is
    read, and dequantized while the shards stream in (`BlockFP8Dequantize`); the KDSA model holds the weights in its
    load dtype (or keeps the linear layers FP8 with `fp8_weights="hold"`, §9) and has no quantization_config
    (docs/checkpoint-conversion.md §6). Sets `mapped["_fp8_block"]`."""
    quantization = getattr(fields.source, "quantization_config", None)
    fields.pending.discard("quantization_config")
    if quantization is None:
        return
    q = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = getattr(q.get("quant_method"), "value", q.get("quant_method"))
    if method != _FP8_QUANT_METHOD:
        raise ValueError(
            f"{fields.model_type} config field quantization_config.quant_method={method!r} is not supported for "
            f"conversion; KDSA reads {_FP8_QUANT_METHOD!r} (block-scaled E4M3 weights) only"
        )
    unknown = set(q) - _FP8_CONFIG_KEYS
    if unknown:
        raise ValueError(f"quantization_config has fields KDSA does not read: {sorted(unknown)}")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt={q['fmt']!r} is not supported; only 'e4m3'")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={q['activation_scheme']!r} is not supported; only 'dynamic' "
            "(static activation scales would be needed at every matmul)"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be two positive ints (rows, cols)")
    mapped["_fp8_block"] = tuple(block)


class BlockFP8Dequantize(Fp8Dequantize):
    """transformers' FP8 dequantize op with the block size taken from the config instead of inferred from the scale
    grid: DeepSeek's grids round up (`kv_a_proj_with_mqa` has 576 rows = 4.5 blocks of 128, scale grid 5 rows),
    which the inferring op rejects. Output: the destination parameter's dtype (fp32 when unknown). The tiles go
    through `kernel_backend`'s `fp8_dequantize`, the model's own backend (kernels.py)."""

    def __init__(self, block_size: tuple[int, int], kernel_backend: str):
        super().__init__(hf_quantizer=None)
        self.block_size = block_size
        self.kernel_backend = kernel_backend

    def _dequantize_one(self, quantized, scales, output_dtype=None):
        # Without a quantizer the loader has already cast the E4M3 values to the load dtype; E4M3 -> fp32 / bf16 is
        # exact, the scales are rounded to bf16 in a bf16 load (2^-9 relative, far below E4M3's 2^-4).
        check_tile_grid(quantized, scales, self.block_size)
        return dequantize_tiles(quantized, scales, self.block_size, output_dtype or torch.float32, self.kernel_backend)


def dequantizing(conversions: list, block: tuple[int, int], kernel_backend: str) -> list:
    """The plan's converters also collect each weight's `weight_scale_inv` and dequantize first (before an expert
    merge), as transformers' quantizers extend a model's converters; one last converter dequantizes every other
    weight. `kernel_backend`: the loaded model's (`BlockFP8Dequantize`)."""
    extended = []
    for converter in conversions:
        sources = getattr(converter, "_original_source_patterns", None)
        # One-to-many converters (the fused KDA conv split) read convolution weights, which are never quantized.
        one_target = isinstance(converter, WeightConverter) and len(converter._original_target_patterns) == 1
        if one_target and all(src.endswith(".weight") for src in sources):
            with_scales = [name for src in sources for name in (src, src + "_scale_inv")]
            converter = converter.copy(
                with_scales,
                converter._original_target_patterns,
                operations=[BlockFP8Dequantize(block, kernel_backend), *converter.operations],
            )
        extended.append(converter)
    catch_all = WeightConverter(["weight", "weight_scale_inv"], "weight", [BlockFP8Dequantize(block, kernel_backend)])
    return [*extended, catch_all]


def fp8_unreadable(folder: str, keys: list[str]) -> list[str]:
    """FP8 checkpoint tensors that would load silently wrong, in either `fp8_weights` mode: E4M3 tensors without a
    `_scale_inv` (held layers are filled by name, so one would land as raw E4M3 values) and scales that are not F32
    (the loader casts a tensor to the load dtype before any conversion op sees it, so E8M0 bytes would become their
    integer values)."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    keys = set(keys)
    unscaled = []
    for shard in shards:
        with safe_open(os.path.join(folder, shard), framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype.startswith("F8") and key + "_scale_inv" not in keys:
                    unscaled.append(f"{key} (no weight_scale_inv)")
                if key.endswith("_scale_inv") and dtype != "F32":
                    unscaled.append(f"{key} ({dtype}, not F32)")
    return sorted(unscaled)


def fp8_targets(plan: ForeignCheckpointPlan, keys: list[str]) -> dict[str, bool]:
    """The model parameter each FP8 checkpoint weight loads into (transformers' own `rename_source_key` over the
    plan's `key_mapping`, renamings and converters) -> whether a converter merges it with others (stacked routed
    experts, one `[out, in]` weight per expert)."""
    from transformers.core_model_loading import rename_source_key

    renamings = [WeightRenaming(src, dst) for src, dst in plan.key_mapping.items()]
    renamings += [c for c in plan.conversions if isinstance(c, WeightRenaming)]
    # The plan's converters minus the last one, the catch-all that dequantizes every other weight (dequantizing).
    converters = [c for c in plan.conversions if isinstance(c, WeightConverter)][:-1]
    scaled = {k.removesuffix("_scale_inv") for k in keys if k.endswith(".weight_scale_inv")}
    targets = {}
    for key in sorted(scaled):
        name, converter = rename_source_key(key, renamings, converters)
        targets[name] = converter is not None
    return targets


def fp8_held_layers(plan: ForeignCheckpointPlan, keys: list[str]) -> list[str]:
    """The KDSA `nn.Linear`s that `fp8_weights="hold"` keeps FP8: every FP8 checkpoint weight that reaches the model
    by plain renames (`fp8_targets`), except weights a converter merges (stacked routed experts) and
    `_FP8_WEIGHT_READ_DIRECTLY` (docs/checkpoint-conversion.md §9)."""
    held = []
    for name, merged in fp8_targets(plan, keys).items():
        module_name = name.removesuffix(".weight")
        if not merged and module_name.rsplit(".", 1)[-1] not in _FP8_WEIGHT_READ_DIRECTLY:
            held.append(module_name)
    return held


def holding(conversions: list, block: tuple[int, int], kernel_backend: str) -> list:
    """`dequantizing`'s converters with the catch-all narrowed to `_FP8_WEIGHT_READ_DIRECTLY`: every other plainly
    renamed FP8 weight and its scale load as they are into a `KDSAFP8Linear`."""
    narrowed = [
        WeightConverter(
            [f"{name}.weight", f"{name}.weight_scale_inv"],
            f"{name}.weight",
            [BlockFP8Dequantize(block, kernel_backend)],
        )
        for name in _FP8_WEIGHT_READ_DIRECTLY
    ]
    return [*conversions[:-1], *narrowed]
