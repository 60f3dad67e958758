"""Loading published checkpoints of the family (DeepSeek-V3.2, Kimi-Linear, GLM-5.3-Flash, Kimi K3) into KDSA models:
the public entry (`plan_foreign_load`, `load_foreign`, used by `KDSAForCausalLM.from_pretrained`).

docs/checkpoint-conversion.md §2 (families §3-§5 and §8, FP8 §6 and §9; Kimi K3: docs/kimi-k3.md §1, §4). Two
halves per family:

- config translation: the raw config.json is parsed by transformers' own config class for its `model_type` (which
  resolves attribute_map aliases, Kimi's 1-based `linear_attn_config` layer lists, GLM's nested `text_config`), then
  every field is either mapped into a `KDSAConfig`, checked to hold a value whose meaning KDSA reproduces, or
  refused with a `ValueError` naming it. Nothing is dropped silently.
- weight mapping: transformers' conversion machinery (`WeightRenaming` / `WeightConverter` with `MergeModulelist`,
  `Concatenate`, ...) applied while the safetensors shards stream in, registered under the model class only for
  the duration of one `from_pretrained` call (`load_foreign`), and a strict check of missing / unexpected tensors.

The files by concern: conversion_common.py (the plan, the field ledger, what every family shares), one file per
family (conversion_deepseek.py, conversion_kimi.py, conversion_kimi_k3.py, conversion_glm.py), conversion_fp8.py
(block-scaled FP8 weights) and conversion_mtp.py (MTP layers).
"""

import json
import logging
import os
import re
import threading

from transformers import CONFIG_MAPPING
from transformers.conversion_mapping import register_checkpoint_conversion_mapping

from .conversion_common import ConfigFields, ForeignCheckpointPlan
from .conversion_deepseek import deepseek_v32_plan
from .conversion_fp8 import (
    FP8_WEIGHTS_CHOICES,
    dequantizing,
    fp8_held_layers,
    fp8_targets,
    fp8_unreadable,
    holding,
)
from .conversion_glm import glm5_next_plan
from .conversion_kimi import kimi_linear_plan
from .conversion_kimi_k3 import kimi_k3_plan
from .conversion_mtp import check_mtp_copies

logger = logging.getLogger(__name__)

FOREIGN_MODEL_TYPES = ("deepseek_v32", "kimi_linear", "glm5_next", "kimi_k3")

# KDSAConfig fields no source config has; a caller may set them as from_pretrained keyword arguments.
_KDSA_ONLY_FIELDS = ("kernel_backend", "num_mtp_layers")

_TRANSLATORS = {"deepseek_v32": deepseek_v32_plan, "kimi_linear": kimi_linear_plan, "glm5_next": glm5_next_plan}


def checkpoint_keys(folder: str) -> list[str]:
    """Tensor names of a local safetensors checkpoint (the shard index, or the single file's header); [] if the
    folder has neither (transformers then raises its own error)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return list(f.keys())
    return []


def plan_foreign_load(raw_config: dict, keys: list[str], overrides: dict | None = None) -> ForeignCheckpointPlan:
    """Translate a foreign config.json dict (model_type in FOREIGN_MODEL_TYPES) and build the weight mapping.
    `keys`: the checkpoint's tensor names; `overrides`: KDSA-only config fields (`_KDSA_ONLY_FIELDS`)."""
    model_type = raw_config.get("model_type")
    if model_type not in FOREIGN_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not one KDSA converts; supported: {FOREIGN_MODEL_TYPES}")
    if model_type == "kimi_k3":  # transformers has no config class for the wrapper; its text config is kimi_linear
        plan = kimi_k3_plan(dict(raw_config), keys, overrides or {})
    elif model_type in _TRANSLATORS:
        source = CONFIG_MAPPING[model_type].from_dict(dict(raw_config))
        plan = _TRANSLATORS[model_type](ConfigFields(source, model_type), keys, overrides or {})
    else:
        raise ValueError(f"loading {model_type!r} checkpoints into KDSA is not implemented yet")
    if plan.fp8_block is not None:
        # FP8 checkpoints: the converters also dequantize (conversion_fp8.py).
        plan.conversions = dequantizing(plan.conversions, plan.fp8_block, plan.config.kernel_backend)
        plan.fp8_targets = fp8_targets(plan, keys)
    return plan


# Held while a foreign folder's conversions are registered under the class name, and by native loads of KDSA
# models (KDSAForCausalLM.from_pretrained), which would otherwise see them.
REGISTRATION_LOCK = threading.RLock()


class _ReportCapture(logging.Handler):
    """Collects the `CONVERSION` rows (tensor name and error) of transformers' load report."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.conversion_rows: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())
        for line in text.splitlines():
            if "| CONVERSION |" in line:
                self.conversion_rows.append(re.sub(r"\s+", " ", line).strip())
            elif self.conversion_rows and "Error" in line and not self.conversion_rows[-1].endswith(line.strip()):
                self.conversion_rows[-1] += " " + line.strip()


def load_foreign(cls, path: str, raw_config: dict, model_args: tuple, kwargs: dict):
    """`cls.from_pretrained` for a foreign folder: translated config, conversions registered under `cls.__name__`
    for this call only (a permanent registration would also rewrite native saves), strict missing / unexpected
    check, and `_weight_conversions = []` so that `save_pretrained` writes the native KDSA layout."""
    for name in ("config", "key_mapping"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}= cannot be combined with a {raw_config.get('model_type')!r} checkpoint folder")
    if not os.path.isdir(path):
        raise ValueError(f"foreign checkpoints load from a local folder; {path!r} is not one")
    keys = checkpoint_keys(path)
    # KDSA-only settings (e.g. kernel_backend="cpu") given as keyword arguments apply to the translated config, as
    # transformers applies them to a loaded one.
    overrides = {name: kwargs.pop(name) for name in list(kwargs) if name in _KDSA_ONLY_FIELDS}
    fp8_weights = kwargs.pop("fp8_weights", "dequantize")
    if fp8_weights not in FP8_WEIGHTS_CHOICES:
        raise ValueError(f"fp8_weights={fp8_weights!r} must be one of {FP8_WEIGHTS_CHOICES}")
    plan = plan_foreign_load(raw_config, keys, overrides)
    if plan.fp8_block is not None:
        unreadable = fp8_unreadable(path, keys)
        if unreadable:
            raise ValueError(
                f"{plan.model_type} checkpoint {path!r} has FP8 tensors KDSA cannot read as stored: {unreadable} "
                "(each E4M3 weight needs an F32 weight_scale_inv)"
            )
    held = {}
    if fp8_weights == "hold":
        if plan.fp8_block is None:
            raise ValueError(f"fp8_weights='hold': {path!r} has no FP8 quantization_config (nothing to hold in FP8)")
        held = dict.fromkeys(fp8_held_layers(plan, keys), plan.fp8_block)
        plan.conversions = holding(plan.conversions, plan.fp8_block, plan.config.kernel_backend)
    want_info = kwargs.pop("output_loading_info", False)
    # Size mismatches come back in the loading info, so that the strict check below names them (transformers'
    # own error does not say which tensor); they are never ignored.
    kwargs["ignore_mismatched_sizes"] = True
    with REGISTRATION_LOCK:
        ignored_before = cls._keys_to_ignore_on_load_unexpected
        register_checkpoint_conversion_mapping(cls.__name__, plan.conversions, overwrite=True)
        cls._keys_to_ignore_on_load_unexpected = list(plan.skipped)
        cls._fp8_held_layers = held  # read by KDSAForCausalLM.__init__: these layers are built as KDSAFP8Linear
        report = _ReportCapture()
        report_logger = logging.getLogger("transformers")  # the load report comes from one of its child loggers
        report_logger.addHandler(report)
        try:
            model, info = super(cls, cls).from_pretrained(
                path,
                *model_args,
                config=plan.config,
                key_mapping=plan.key_mapping or None,
                output_loading_info=True,
                **kwargs,
            )
        except RuntimeError as error:
            # transformers raises a RuntimeError for a tensor its conversion ops rejected (e.g. an FP8 scale grid
            # that does not fit its weight) and names the tensor only in the load report it logged.
            if not report.conversion_rows:
                raise
            raise ValueError(
                f"{plan.model_type} checkpoint {path!r}: tensors could not be converted: {report.conversion_rows}"
            ) from error
        finally:
            report_logger.removeHandler(report)
            cls._keys_to_ignore_on_load_unexpected = ignored_before
            cls._fp8_held_layers = {}
            register_checkpoint_conversion_mapping(cls.__name__, [], overwrite=True)
    model._keys_to_ignore_on_load_unexpected = set(ignored_before or [])
    model._weight_conversions = []
    problems = {
        k: sorted(map(str, info[k])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)
    }
    if problems:
        raise ValueError(f"{plan.model_type} checkpoint {path!r} does not map onto KDSA exactly: {problems}")
    check_mtp_copies(path, plan, model)
    for pattern, what in plan.skipped.items():
        count = sum(1 for k in keys if re.search(pattern, k))
        if count:
            logger.info("skipped %s: %d tensors", what, count)
    return (model, info) if want_info else model


__all__ = [
    "REGISTRATION_LOCK",
    "FOREIGN_MODEL_TYPES",
    "ForeignCheckpointPlan",
    "FP8_WEIGHTS_CHOICES",
    "checkpoint_keys",
    "fp8_held_layers",
    "fp8_targets",
    "load_foreign",
    "plan_foreign_load",
]
