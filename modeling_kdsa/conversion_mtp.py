"""The multi-token-prediction layers of DeepSeek-V3.2 and GLM-5.3-Flash checkpoints (docs/checkpoint-conversion.md
§10): which stored layers load into `mtp.layers`, which are skipped, and the check that an MTP layer's copies of the
embedding and lm_head equal the model's."""

import json
import os
import re
from dataclasses import dataclass

import torch
from transformers.core_model_loading import WeightRenaming

from .conversion_common import ForeignCheckpointPlan


def _extra_layers(num_layers: int, checkpoint_keys: list[str], prefix: str) -> list[int]:
    """Indices of the checkpoint's `{prefix}layers.{i}.` blocks after the trunk (MTP layers are stored there)."""
    pattern = re.escape(prefix) + r"layers\.(\d+)\."
    indices = {int(m.group(1)) for k in checkpoint_keys if (m := re.match(pattern, k))}
    return sorted(indices - set(range(num_layers)))


# Tensors of a hub MTP layer outside its decoder block (DeepSeek-V3 / GLM names); the rest of `layers.{N+k}.*` is the
# block. `embed_tokens` and `shared_head.head` are the layer's copies of the model's embedding and lm_head.
_MTP_OWN = r"(enorm|hnorm|eh_proj|shared_head\.norm|shared_head\.head|embed_tokens)"
_MTP_COPIES = {"embed_tokens": "model.embed_tokens.weight", "shared_head.head": "lm_head.weight"}


@dataclass
class MTPPlan:
    num_mtp_layers: int
    renamings: list
    skipped: dict[str, str]
    copies: dict[str, str]


def mtp_plan(
    model_type: str, num_layers: int, declared: int, checkpoint_keys: list[str], prefix: str, overrides: dict
) -> MTPPlan:
    """The multi-token-prediction layers of a hub checkpoint (docs/checkpoint-conversion.md §10): `declared`
    (`num_nextn_predict_layers`) layers stored as `{prefix}layers.{N+k}.*` after the N trunk layers load into
    `mtp.layers.{k}`: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` by name, every other tensor into the decoder
    `block` (so a tensor the block does not have, e.g. an `hc_*` of a multi-stream MTP layer, is unexpected and
    refused by name, and a missing one is missing). The layer's copies of the shared tensors (`embed_tokens`,
    `shared_head.head`) are not loaded: `load_foreign` checks that each equals the model's embedding / lm_head and
    refuses it by name otherwise (KDSA's MTP shares them, as DeepSeek-V3 §2.2 defines it).

    `from_pretrained(folder, num_mtp_layers=0)` skips the MTP layers (one info line each); any other value must be
    the declared one. Layers after the declared ones are not described by the config: skipped, one info line each.
    `prefix`: the checkpoint's key prefix of the layers (plain text); the renamings act on keys whose family prefix
    is already renamed to `model.`."""
    requested = overrides.pop("num_mtp_layers", None)
    if requested is not None and requested not in (0, declared):
        raise ValueError(
            f"num_mtp_layers={requested!r}: a {model_type} checkpoint loads its declared num_nextn_predict_layers="
            f"{declared} MTP layers, or none with num_mtp_layers=0"
        )
    count = declared if requested is None else requested
    extra = _extra_layers(num_layers, checkpoint_keys, prefix)
    skipped = {
        rf"(^|\.)layers\.{index}\.": f"{model_type} layer {index} (multi-token-prediction block)"
        for index in extra
        if index >= num_layers + count
    }
    renamings, copies = [], {}
    for k in range(count):
        index = num_layers + k
        renamings += [
            WeightRenaming(rf"^model\.layers\.{index}\.{_MTP_OWN}\.", rf"mtp.layers.{k}.\1."),
            WeightRenaming(rf"^model\.layers\.{index}\.", f"mtp.layers.{k}.block."),
        ]
        for name, target in _MTP_COPIES.items():
            key = f"{prefix}layers.{index}.{name}.weight"
            if key in checkpoint_keys:
                if key + "_scale_inv" in checkpoint_keys:
                    raise ValueError(
                        f"{model_type} checkpoint tensor {key} is FP8-quantized: KDSA compares an MTP layer's copy of "
                        "a shared tensor exactly and reads it unquantized only"
                    )
                copies[key] = target
    if copies:
        skipped[rf"^mtp\.layers\.\d+\.({'|'.join(re.escape(n) for n in _MTP_COPIES)})\.weight$"] = (
            f"{model_type} MTP copies of the embedding / lm_head (checked equal to the model's)"
        )
    return MTPPlan(count, renamings, skipped, copies)


def _shard_of(folder: str, key: str) -> str:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return os.path.join(folder, json.load(f)["weight_map"][key])
    return os.path.join(folder, "model.safetensors")


def check_mtp_copies(folder: str, plan: ForeignCheckpointPlan, model) -> None:
    """An MTP layer's copy of the embedding or of the lm_head (`mtp_plan`) must equal the model's tensor as loaded
    (compared in the model's dtype, so a bf16 load rounds both the same way); KDSA's MTP shares the model's, so a
    copy that differs would be dropped silently: refused by name (docs/checkpoint-conversion.md §10)."""
    from safetensors import safe_open

    parameters = dict(model.named_parameters())
    for key, target in plan.mtp_copies.items():
        with safe_open(_shard_of(folder, key), framework="pt") as f:
            copy = f.get_tensor(key)
        ours = parameters[target]
        if copy.shape != ours.shape or not torch.equal(copy.to(ours.dtype), ours.detach().cpu()):
            raise ValueError(
                f"{plan.model_type} checkpoint tensor {key} differs from the model's {target}: KDSA's MTP layers share "
                "the model's embedding and lm_head (DeepSeek-V3 §2.2) and cannot use a separate copy"
            )
