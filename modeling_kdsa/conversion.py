"""Loading published checkpoints of the family (DeepSeek-V3.2, Kimi-Linear, GLM-5.3-Flash, Kimi K3) into KDSA models.

docs/checkpoint-conversion.md §2 (families §3-§5 and §8, FP8 §6 and §9; Kimi K3: docs/kimi-k3.md §1, §4). Two
halves per family:

- config translation: the raw config.json is parsed by transformers' own config class for its `model_type` (which
  resolves attribute_map aliases, Kimi's 1-based `linear_attn_config` layer lists, GLM's nested `text_config`), then
  every field is either mapped into a `KDSAConfig`, checked to hold a value whose meaning KDSA reproduces, or
  refused with a `ValueError` naming it. Nothing is dropped silently.
- weight mapping: transformers' conversion machinery (`WeightRenaming` / `WeightConverter` with `MergeModulelist`,
  `Concatenate`, ...) applied while the safetensors shards stream in, registered under the model class only for
  the duration of one `from_pretrained` call (`load_foreign`), and a strict check of missing / unexpected tensors.
"""

import json
import logging
import os
import re
import threading
from dataclasses import dataclass, field

import torch
from transformers import CONFIG_MAPPING
from transformers.configuration_utils import PreTrainedConfig
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from .configuration_kdsa import DSA_LAYER, KDA_LAYER, MLA_LAYER, KDSAConfig
from .fp8_linear import check_tile_grid, dequantize_tiles

logger = logging.getLogger(__name__)

FOREIGN_MODEL_TYPES = ("deepseek_v32", "kimi_linear", "glm5_next", "kimi_k3")

# PreTrainedConfig's own bookkeeping fields: they describe the file or the training run, not the network.
_METADATA_FIELDS = {
    "_name_or_path", "architectures", "transformers_version", "model_type", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "auto_map",
}  # fmt: skip
# Fields that configure training only (auxiliary losses, router-logit outputs) or deployment (expert-parallel size):
# they do not change what a forward pass computes.
_TRAINING_ONLY_FIELDS = {"output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size", "router_aux_loss_coef"}
# Rope types whose frequencies and YaRN attention factor come from transformers' own init functions and whose
# softmax mscale `mla_softmax_scale` reproduces (tests/test_foreign_checkpoints.py).
_SUPPORTED_ROPE_TYPES = ("default", "yarn")
_FP8_QUANT_METHOD = "fp8"
# KDSAConfig fields no source config has; a caller may set them as from_pretrained keyword arguments.
_KDSA_ONLY_FIELDS = ("kernel_backend", "num_mtp_layers")
# `from_pretrained(folder, fp8_weights=...)` for FP8 checkpoints (docs/checkpoint-conversion.md §9).
FP8_WEIGHTS_CHOICES = ("dequantize", "hold")
# Linear layers whose `.weight` is read by code other than their forward (MLA weight absorption): kept dequantized.
_FP8_WEIGHT_READ_DIRECTLY = ("kv_b_proj",)


@dataclass
class ForeignCheckpointPlan:
    """What `KDSAForCausalLM.from_pretrained` needs to load one foreign folder."""

    model_type: str
    config: KDSAConfig
    key_mapping: dict[str, str] = field(default_factory=dict)
    conversions: list = field(default_factory=list)
    # regex over the (renamed) checkpoint keys -> what is skipped, for the one info line logged per entry.
    skipped: dict[str, str] = field(default_factory=dict)
    # (rows, cols) of the checkpoint's FP8 weight blocks; None for an unquantized checkpoint.
    fp8_block: tuple[int, int] | None = None
    # checkpoint key of an MTP layer's copy of a shared tensor -> the model's parameter it must equal (`_mtp_plan`).
    mtp_copies: dict[str, str] = field(default_factory=dict)


class _Fields:
    """The translation's ledger: every field of the parsed source config must be consumed exactly once, so that a
    field nobody handles becomes a `ValueError` (`unhandled`) instead of a silent default."""

    def __init__(self, source: PreTrainedConfig, model_type: str):
        self.source = source
        self.model_type = model_type
        self.pending = set(source.to_dict())

    def take(self, name: str):
        # to_dict() writes an aliased field under its stored name (Kimi: `num_experts_per_tok` is stored as
        # `num_experts_per_token`); getattr resolves the alias through the attribute_map.
        self.pending.discard(name)
        self.pending.discard(self.source.attribute_map.get(name, name))
        return getattr(self.source, name)

    def require(self, name: str, allowed, why: str):
        value = self.take(name) if name in self.pending else getattr(self.source, name, allowed[0])
        if value not in allowed:
            raise ValueError(
                f"{self.model_type} config field {name}={value!r} is not supported by KDSA ({why}); supported: "
                f"{', '.join(repr(a) for a in allowed)}"
            )
        return value

    def drop(self, names) -> None:
        self.pending.difference_update(names)

    def unhandled(self) -> None:
        if self.pending:
            raise ValueError(
                f"{self.model_type} config has fields KDSA does not implement or translate: {sorted(self.pending)}; "
                "refusing to load a model that might silently compute something else"
            )


def _metadata_fields(fields: _Fields) -> None:
    """PreTrainedConfig's own fields, present in every (sub)config."""
    fields.drop(_METADATA_FIELDS)
    fields.drop(_TRAINING_ONLY_FIELDS & fields.pending)
    fields.require("chunk_size_feed_forward", (0,), "no chunked feed-forward")
    fields.require("is_encoder_decoder", (False,), "decoder-only")


def _common_fields(fields: _Fields, source_names: dict[str, str] | None = None) -> dict:
    """Fields whose meaning is the same in every family and in KDSAConfig; `source_names`: KDSA field -> the
    source's name where they differ."""
    source_names = source_names or {}
    _metadata_fields(fields)
    fields.require("attention_dropout", (0, 0.0), "KDSA has no attention dropout")
    names = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
        "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id",
        "eos_token_id", "tie_word_embeddings", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "attention_bias", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
        "routed_scaling_factor", "norm_topk_prob", "mlp_layer_types",
    ]  # fmt: skip
    mapped = {name: fields.take(source_names.get(name, name)) for name in names}
    mapped["q_lora_rank"] = fields.take("q_lora_rank")
    # Derived by the source class: qk_head_dim and head_dim (= the rope slice, as in KDSAConfig) from the dims above,
    # mlp_layer_types from first_k_dense_replace.
    fields.drop(["qk_head_dim", "head_dim", "first_k_dense_replace"])
    heads, kv_heads = mapped["num_attention_heads"], fields.take("num_key_value_heads")
    if kv_heads != heads:
        raise ValueError(
            f"{fields.model_type} config field num_key_value_heads={kv_heads} != num_attention_heads={heads}: MLA "
            "up-projects one latent per head, KDSA does not support grouped MLA heads"
        )
    dtype = fields.take("dtype")
    if dtype is not None:
        mapped["dtype"] = dtype
    mapped["attn_res_block_size"] = 0  # these models use the plain pre-norm residual
    return mapped


def _routing(fields: _Fields, mapped: dict) -> None:
    """Group-limited routing (DeepSeek-V3 `n_group` / `topk_group`, same semantics in all three families)."""
    n_group, topk_group = fields.take("n_group"), fields.take("topk_group")
    mapped["n_group"] = 1 if n_group is None else n_group
    mapped["topk_group"] = 1 if topk_group is None else topk_group


def _rope(fields: _Fields, mapped: dict) -> None:
    rope = dict(fields.take("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{fields.model_type} config field rope_parameters.rope_type={rope_type!r} is not supported by KDSA; "
            f"supported: {_SUPPORTED_ROPE_TYPES}"
        )
    rope.pop("type", None)  # legacy alias of rope_type kept by transformers' standardisation
    mapped["rope_parameters"] = rope


_FP8_CONFIG_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "scale_fmt", "dequantize",
                    "modules_to_not_convert"}  # fmt: skip


def _quantization(fields: _Fields, mapped: dict) -> None:
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
    which the inferring op rejects. Output: the destination parameter's dtype (fp32 when unknown)."""

    def __init__(self, block_size: tuple[int, int]):
        super().__init__(hf_quantizer=None)
        self.block_size = block_size

    def _dequantize_one(self, quantized, scales, output_dtype=None):
        # Without a quantizer the loader has already cast the E4M3 values to the load dtype; E4M3 -> fp32 / bf16 is
        # exact, the scales are rounded to bf16 in a bf16 load (2^-9 relative, far below E4M3's 2^-4).
        check_tile_grid(quantized, scales, self.block_size)
        return dequantize_tiles(quantized, scales, self.block_size, output_dtype or torch.float32)


def _dequantizing(conversions: list, block: tuple[int, int]) -> list:
    """The plan's converters also collect each weight's `weight_scale_inv` and dequantize first (before an expert
    merge), as transformers' quantizers extend a model's converters; one last converter dequantizes every other
    weight."""
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
                operations=[BlockFP8Dequantize(block), *converter.operations],
            )
        extended.append(converter)
    return [*extended, WeightConverter(["weight", "weight_scale_inv"], "weight", [BlockFP8Dequantize(block)])]


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
class _MTPPlan:
    num_mtp_layers: int
    renamings: list
    skipped: dict[str, str]
    copies: dict[str, str]


def _mtp_plan(
    model_type: str, num_layers: int, declared: int, checkpoint_keys: list[str], prefix: str, overrides: dict
) -> _MTPPlan:
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
    return _MTPPlan(count, renamings, skipped, copies)


# --------------------------------------------------------------------------------------------------- DeepSeek-V3.2


def _deepseek_v32(fields: _Fields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    mapped = _common_fields(fields)
    _routing(fields, mapped)
    _rope(fields, mapped)
    _quantization(fields, mapped)
    mapped["mla_layernorm_eps"] = 1e-6  # transformers builds q_a / kv_a layernorms with the RMSNorm default
    layer_types = fields.take("layer_types")
    if any(t != DSA_LAYER for t in layer_types):
        raise ValueError(f"deepseek_v32 config field layer_types={layer_types} must be all {DSA_LAYER!r}")
    mapped["layer_types"] = layer_types
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        mapped[name] = fields.take(name)
    fields.require("mlp_bias", (False,), "MLPs without bias")
    # Fields of DeepSeek's own config.json that transformers keeps as plain attributes.
    fields.require("scoring_func", ("sigmoid",), "sigmoid router scores")
    fields.require("topk_method", ("noaux_tc",), "top-k over bias-corrected scores")
    fields.require("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE")
    declared = fields.take("num_nextn_predict_layers") if "num_nextn_predict_layers" in fields.pending else 0
    fields.drop(["rope_theta", "rope_scaling"])  # folded into rope_parameters by transformers
    fields.unhandled()
    mtp = _mtp_plan("deepseek_v32", mapped["num_hidden_layers"], declared or 0, checkpoint_keys, "model.", overrides)
    mapped["num_mtp_layers"] = mtp.num_mtp_layers
    return _build(
        "deepseek_v32",
        mapped,
        overrides,
        conversions=[*mtp.renamings, *_stacked_experts("gate_proj", "up_proj", "down_proj")],
        skipped=mtp.skipped,
        mtp_copies=mtp.copies,
    )


def _stacked_experts(gate: str, up: str, down: str) -> list:
    """Per-expert `mlp.experts.N.{gate,up,down}` → KDSAExperts' stacked `gate_up_proj [E, 2I, D]` (gate rows first)
    and `down_proj [E, D, I]`, as transformers converts its own MoE checkpoints."""
    return [
        WeightConverter(
            source_patterns=[f"mlp.experts.*.{gate}.weight", f"mlp.experts.*.{up}.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns=f"mlp.experts.*.{down}.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


# ---------------------------------------------------------------------------------------------------- Kimi-Linear

_KIMI_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"}


def _kda_fields(fields: _Fields, mapped: dict, mlp_activations: tuple[str, ...] = ("silu",)) -> None:
    """KDA dims, and `hidden_act` checked against `mlp_activations`: Kimi-Linear and GLM-5.3-Flash apply it after
    the KDA short convolution too, which KDSA runs with SiLU; Kimi K3's convolution is SiLU whatever hidden_act is
    (docs/kimi-k3.md §1), so K3 also allows "situ" (the MLPs' activation)."""
    for name in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        mapped[name] = fields.take(name)
    if mapped["hidden_act"] not in mlp_activations:
        # transformers applies hidden_act after the KDA short convolution too; KDSA's convolution is SiLU.
        raise ValueError(
            f"{fields.model_type} config field hidden_act={mapped['hidden_act']!r} is not supported with KDA layers "
            f"(their short convolution uses SiLU); supported: {mlp_activations}"
        )


def _kda_key_mapping(layer_types: list[str]) -> dict[str, str]:
    """The hub stores KDA mixers under `self_attn` like attention; KDSA names them `linear_attn` (so that a
    tensor-parallel plan entry can never hit the wrong mixer): a rename that depends on the layer index."""
    kda = [str(i) for i, t in enumerate(layer_types) if t == KDA_LAYER]
    if not kda:
        return {}
    return {rf"\.layers\.({'|'.join(kda)})\.self_attn\.": r".layers.\1.linear_attn."}


def _kimi_linear(fields: _Fields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    mapped = _kimi_text(fields, mlp_activations=("silu",), attn_keys=_KIMI_LINEAR_ATTN_KEYS)
    mapped.pop("_linear_attn_config")
    _quantization(fields, mapped)
    fields.unhandled()
    mtp = _kimi_mtp("kimi_linear", mapped, checkpoint_keys, "model.", overrides)
    return _build(
        "kimi_linear",
        mapped,
        overrides,
        key_mapping=_kda_key_mapping(mapped["layer_types"]),
        conversions=[
            # MoE and dense MLPs are both `block_sparse_moe` in the hub layout.
            WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
            *_stacked_experts("w1", "w3", "w2"),
        ],
        skipped=mtp.skipped,
    )


def _kimi_text(fields: _Fields, mlp_activations: tuple[str, ...], attn_keys: set[str]) -> dict:
    """The fields Kimi-Linear and Kimi K3's text config share; returns the mapped KDSAConfig fields and the
    `linear_attn_config` dict under "_linear_attn_config" (for K3's extra keys)."""
    mapped = _common_fields(fields, {"n_routed_experts": "num_local_experts"})
    _routing(fields, mapped)
    _kda_fields(fields, mapped, mlp_activations)
    linear_attn_config = fields.take("linear_attn_config") if "linear_attn_config" in fields.pending else {}
    unknown = set(linear_attn_config or {}) - attn_keys
    if unknown:
        raise ValueError(
            f"{fields.model_type} config field linear_attn_config has keys KDSA does not implement: {sorted(unknown)}"
        )
    mapped["_linear_attn_config"] = dict(linear_attn_config or {})
    # transformers resolved linear_attn_config's 1-based kda_layers / full_attn_layers into layer_types; Kimi's
    # "full_attention" is dense MLA, KDSA's layer type of the same name.
    layer_types = fields.take("layer_types")
    for i, layer_type in enumerate(layer_types):
        if layer_type not in (KDA_LAYER, MLA_LAYER):
            raise ValueError(
                f"{fields.model_type} config field layer_types[{i}]={layer_type!r} is not supported by KDSA"
            )
    mapped["layer_types"] = layer_types
    # Kimi-Linear's MLA keeps the rope slice but never rotates it, and builds its q_a / kv_a layernorms with the
    # RMSNorm default eps 1e-6 whatever rms_norm_eps is.
    mapped["mla_use_nope"] = True
    mapped["mla_layernorm_eps"] = 1e-6
    fields.require("pretraining_tp", (1,), "no tensor-parallel-at-pretraining weight split")
    fields.require("moe_router_activation_func", ("sigmoid",), "sigmoid router scores")
    fields.require("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE")
    fields.require("mla_use_nope", (True,), "Kimi-Linear's MLA does not rotate")
    # Kimi-Linear has no rotary embedding anywhere (transformers' class builds none), so rope settings mean nothing;
    # use_grouped_topk only selects the grouped code path, whose groups n_group gives.
    fields.drop(["use_grouped_topk", "rope_theta", "rope_scaling", "rope_parameters"])
    nextn = fields.take("num_nextn_predict_layers") if "num_nextn_predict_layers" in fields.pending else 0
    mapped["_num_nextn_predict_layers"] = nextn or 0
    return mapped


def _kimi_mtp(model_type: str, mapped: dict, checkpoint_keys: list[str], prefix: str, overrides: dict) -> _MTPPlan:
    """Kimi MTP layers are refused: no public Kimi checkpoint ships them (the released configs declare
    `num_nextn_predict_layers: 0`), and vLLM's `KimiK3MTP` feeds them the trunk's hidden state *before* the final
    norm, where KDSA's MTP reads the normed state (DeepSeek-V3 §2.2): loading them would draft from the wrong input.
    `num_mtp_layers=0` loads the trunk and skips them (docs/checkpoint-conversion.md §10)."""
    declared = mapped.pop("_num_nextn_predict_layers")
    if declared and overrides.get("num_mtp_layers") != 0:
        raise ValueError(
            f"{model_type} config field num_nextn_predict_layers={declared}: Kimi MTP layers are not supported (their "
            "hidden-state input is the trunk's pre-norm state, KDSA's MTP reads the normed one); pass "
            "num_mtp_layers=0 to load the model without them"
        )
    return _mtp_plan(model_type, mapped["num_hidden_layers"], 0, checkpoint_keys, prefix, overrides)


# ------------------------------------------------------------------------------------------------------- Kimi K3

# K3's additions to linear_attn_config (docs/kimi-k3.md §1): the bounded forget gate and the full-rank output gate.
_KIMI_K3_ATTN_KEYS = _KIMI_LINEAR_ATTN_KEYS | {"gate_lower_bound", "use_full_rank_gate"}
# Top-level fields of the multimodal wrapper that belong to the vision side, which KDSA does not load.
_K3_VISION_FIELDS = ("vision_config", "media_placeholder_token_id")
# Top-level fields that the text config also has: the wrapper's value applies to the text model.
_K3_SHARED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
_K3_TOP_LEVEL_METADATA = _METADATA_FIELDS | {"torch_dtype", "dtype"}


class FlattenQuery(ConversionOps):
    """K3 stores each AttnRes pseudo-query as a `[1, D]` linear weight; KDSADepthAttention keeps `query: [D]`."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        return {target_patterns[0]: tensor.reshape(-1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return QueryToLinear()


class QueryToLinear(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        return {target_patterns[0]: tensor.reshape(1, -1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return FlattenQuery()


class DecayFromPadded(ConversionOps):
    """K3 stores the KDA decay `A_log` flat with zero padding after the H logical values (96 of 128 in the release;
    engines read the first H). KDSA keeps `[1, 1, H, 1]`; a non-zero pad entry is refused (a layout not understood)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = next(iter(input_dict.values()))
        tensor = (tensor[0] if isinstance(tensor, list) else tensor).reshape(-1)
        if tensor.numel() < self.num_heads or bool(tensor[self.num_heads :].ne(0).any()):
            raise ValueError(
                f"A_log has {tensor.numel()} values; expected the {self.num_heads} heads' values followed by zero "
                "padding"
            )
        return {target_patterns[0]: tensor[: self.num_heads].reshape(1, 1, -1, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return DecayToFlat()


# compressed-tensors quantization_config keys (and per-group `weights` keys) whose values are checked below.
_CT_CONFIG_KEYS = {"quant_method", "format", "ignore", "config_groups", "quantization_status", "kv_cache_scheme",
                   "sparsity_config", "global_compression_ratio", "version", "transform_config"}  # fmt: skip
_CT_WEIGHT_ARGS = {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group", "symmetric": True,
                   "dynamic": False}  # fmt: skip
_CT_IGNORED_WEIGHT_ARGS = {"observer", "observer_kwargs", "actorder", "block_structure", "scale_dtype", "zp_dtype"}
_MXFP4_FORMAT = "mxfp4-pack-quantized"


def _k3_quantization(quantization) -> str:
    """K3's routed-expert quantization: compressed-tensors `mxfp4-pack-quantized` with E2M1 weights in groups of 32
    and no activation quantization (docs/kimi-k3.md §4) -> routed_expert_weight_format "mxfp4"; anything else is a
    ValueError naming the key. Which tensors are packed is read from the tensor names: the load refuses a packed
    tensor anywhere but a routed expert (unexpected keys)."""
    if quantization is None:
        return "dense"
    q = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"kimi_k3 text_config field quantization_config.quant_method={method!r} is not supported; KDSA reads "
            "'compressed-tensors' MXFP4 routed experts"
        )
    unknown = set(q) - _CT_CONFIG_KEYS
    if unknown:
        raise ValueError(f"kimi_k3 quantization_config has fields KDSA does not read: {sorted(unknown)}")
    for key in ("kv_cache_scheme", "transform_config"):
        if q.get(key):
            raise ValueError(f"kimi_k3 quantization_config.{key}={q[key]!r} is not supported (must be null)")
    if q.get("sparsity_config"):
        raise ValueError(f"kimi_k3 quantization_config.sparsity_config={q['sparsity_config']!r} is not supported")
    if q.get("format", _MXFP4_FORMAT) != _MXFP4_FORMAT:
        raise ValueError(f"kimi_k3 quantization_config.format={q['format']!r} is not supported; only {_MXFP4_FORMAT!r}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"kimi_k3 quantization_config.config_groups must hold one group, got {sorted(groups)}")
    ((name, group),) = groups.items()
    where = f"kimi_k3 quantization_config.config_groups.{name}"
    unknown = set(group) - {"format", "targets", "weights", "input_activations", "output_activations"}
    if unknown:
        raise ValueError(f"{where} has fields KDSA does not read: {sorted(unknown)}")
    if group.get("format", _MXFP4_FORMAT) != _MXFP4_FORMAT:
        raise ValueError(f"{where}.format={group['format']!r} is not supported; only {_MXFP4_FORMAT!r}")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets={group.get('targets')!r} is not supported; only ['Linear']")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"{where}.{key}={group[key]!r}: KDSA runs MXFP4 weights with unquantized activations")
    weights = group.get("weights") or {}
    unknown = set(weights) - set(_CT_WEIGHT_ARGS) - _CT_IGNORED_WEIGHT_ARGS
    if unknown:
        raise ValueError(f"{where}.weights has fields KDSA does not read: {sorted(unknown)}")
    for key, expected in _CT_WEIGHT_ARGS.items():
        if weights.get(key, expected) != expected:
            raise ValueError(f"{where}.weights.{key}={weights[key]!r} is not supported; MXFP4 needs {expected!r}")
    if weights.get("scale_dtype") not in (None, "torch.uint8", "uint8"):
        raise ValueError(f"{where}.weights.scale_dtype={weights['scale_dtype']!r}: MXFP4 scales are E8M0 bytes")
    return "mxfp4"


def _k3_top_level(raw: dict) -> tuple[dict, dict]:
    """Split K3's multimodal wrapper (`model_type` "kimi_k3") into the text config dict (with the wrapper's token ids
    and tying applied) and the dtype; vision fields are left out (the vision tower is skipped), anything else is
    refused by name."""
    top = {k: v for k, v in raw.items() if k not in _K3_TOP_LEVEL_METADATA and k not in _K3_VISION_FIELDS}
    text = top.pop("text_config", None)
    if not isinstance(text, dict) or text.get("model_type") != "kimi_linear":
        raise ValueError("kimi_k3 config field text_config must be a dict with model_type 'kimi_linear'")
    text = dict(text)
    for name in _K3_SHARED_FIELDS:
        if name not in top:
            continue
        value = top.pop(name)
        if name in text and text[name] != value:
            raise ValueError(f"kimi_k3 config field {name}={value!r} but text_config.{name}={text[name]!r}")
        text[name] = value
    if "quantization_config" in top:  # some exports lift it to the wrapper (sglang reads either)
        if "quantization_config" in text:
            raise ValueError("kimi_k3 config has quantization_config both at the top level and in text_config")
        text["quantization_config"] = top.pop("quantization_config")
    if top:
        raise ValueError(f"kimi_k3 config has top-level fields KDSA does not implement or translate: {sorted(top)}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    return text, ({} if dtype is None else {"dtype": dtype})


def _kimi_k3(raw: dict, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    """Kimi K3 (docs/kimi-k3.md §1): a multimodal wrapper whose `text_config` is a `kimi_linear` config with K3's
    fields; the text model loads, the vision tower is skipped."""
    text_raw, top_dtype = _k3_top_level(raw)
    fields = _Fields(CONFIG_MAPPING["kimi_linear"].from_dict(text_raw), "kimi_k3 text_config")
    mapped = _kimi_text(fields, mlp_activations=("silu", "situ"), attn_keys=_KIMI_K3_ATTN_KEYS)
    if "dtype" not in mapped:
        mapped.update(top_dtype)
    linear_attn_config = mapped.pop("_linear_attn_config")
    mapped["linear_lower_bound"] = linear_attn_config.get("gate_lower_bound")
    mapped["linear_use_full_rank_gate"] = bool(linear_attn_config.get("use_full_rank_gate", False))
    for name in ("activation_situ_beta", "activation_situ_linear_beta", "routed_expert_hidden_size",
                 "latent_moe_use_norm", "mla_use_output_gate"):  # fmt: skip
        if name in fields.pending:
            mapped[name] = fields.take(name)
    # K3 counts AttnRes blocks in layers (a block starts at every layer l with l % block == 0, docs/kimi-k3.md §2);
    # KDSA counts sublayers, two per layer. The model-end aggregation (output_attn_res) is part of K3's layout.
    block = fields.take("attn_res_block_size") if "attn_res_block_size" in fields.pending else 0
    mapped["attn_res_block_size"] = 2 * (block or 0)
    mapped["attn_res_final_aggregation"] = True
    mapped["routed_expert_weight_format"] = _k3_quantization(getattr(fields.source, "quantization_config", None))
    fields.pending.discard("quantization_config")
    fields.unhandled()

    num_heads = mapped["linear_num_heads"]
    skipped = _kimi_mtp("kimi_k3", mapped, checkpoint_keys, "language_model.model.", overrides).skipped
    skipped[r"^vision_tower\."] = "kimi_k3 vision tower vision_tower.*"
    skipped[r"^mm_projector\."] = "kimi_k3 multimodal projector mm_projector.*"
    if mapped["routed_expert_weight_format"] == "mxfp4":
        experts = [_stacked(["w1", "w3"], "gate_up_proj", suffix) for suffix in ("weight_packed", "weight_scale")] + [
            _stacked(["w2"], "down_proj", suffix) for suffix in ("weight_packed", "weight_scale")
        ]
    else:
        experts = _stacked_experts("w1", "w3", "w2")
    attn_res = [
        WeightConverter(f"{source}_proj.weight", f"{target}.query", operations=[FlattenQuery()])
        for source, target in (("self_attention_res", "attention_res"), ("mlp_res", "mlp_res"),
                               ("output_attn_res", "output_attn_res"))
    ] + [
        WeightRenaming(rf"\.{source}_norm\.weight$", f".{target}.key_norm.weight")
        for source, target in (("self_attention_res", "attention_res"), ("mlp_res", "mlp_res"),
                               ("output_attn_res", "output_attn_res"))
    ]  # fmt: skip
    return _build(
        "kimi_k3",
        mapped,
        overrides,
        key_mapping=_kda_key_mapping(mapped["layer_types"]),
        conversions=[
            WeightRenaming(r"^language_model\.model\.", "model."),
            WeightRenaming(r"^language_model\.lm_head\.", "lm_head."),
            WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
            WeightConverter(
                source_patterns="linear_attn.A_log",
                target_patterns="linear_attn.A_log",
                operations=[DecayFromPadded(num_heads)],
            ),
            *attn_res,
            *experts,
        ],
        skipped=skipped,
    )


def _stacked(sources: list[str], target: str, suffix: str) -> WeightConverter:
    """Per-expert `mlp.experts.N.{w}.{suffix}` (one or two of w1 / w3 / w2) → the stacked `mlp.experts.{target}_
    {packed|scale}` buffer `[E, rows, cols]` (w1 rows before w3 rows), as `_stacked_experts` stacks dense weights."""
    operations = [MergeModulelist(dim=0)] + ([Concatenate(dim=1)] if len(sources) > 1 else [])
    kind = "packed" if suffix == "weight_packed" else "scale"
    return WeightConverter(
        source_patterns=[f"mlp.experts.*.{w}.{suffix}" for w in sources],
        target_patterns=f"mlp.experts.{target}_{kind}",
        operations=operations,
    )


# --------------------------------------------------------------------------------------------------- GLM-5.3-Flash


class DecayToHeadShape(ConversionOps):
    """GLM stores the KDA decay `A_log` as `[H]`; KDSA (like Kimi-Linear) keeps `[1, 1, H, 1]`."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        return {target_patterns[0]: tensor.reshape(1, 1, -1, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return DecayToFlat()


class DecayToFlat(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = next(iter(input_dict.values()))
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        return {target_patterns[0]: tensor.reshape(-1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return DecayToHeadShape()


def _kda_runtime_layout() -> list:
    """transformers' in-memory KDA layout (a folder saved with `save_original_format=False`): the forget gate as a
    submodule and one fused depthwise conv `[3C, 1, W]` (q, k, v channels in that order, equal widths)."""
    return [
        WeightRenaming(r"linear_attn\.forget_gate\.", "linear_attn."),
        WeightConverter(
            source_patterns="linear_attn.conv1d.weight",
            target_patterns=[
                "linear_attn.q_conv1d.weight",
                "linear_attn.k_conv1d.weight",
                "linear_attn.v_conv1d.weight",
            ],
            operations=[Chunk(dim=0)],
        ),
    ]


# Vision-only fields of the top-level config: the vision tower and its tokens are not part of KDSA.
_GLM_VISION_FIELDS = (
    "vision_config", "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
    "video_start_token_id", "video_end_token_id",
)  # fmt: skip


def _glm_components(text: _Fields, mapped: dict) -> None:
    """GLM-5.3-Flash's own components: KDA forget-gate lower bound, SwiGLU clamp, mHC hyper-connections, the k-pool
    indexer and shared-indexer layers (KDSAConfig validates their combinations and names the field)."""
    names = (
        "linear_lower_bound", "swiglu_limit", "hc_mult", "hc_eps", "hc_sinkhorn_iters", "index_kpool",
        "index_kpool_always_select_tail", "indexer_types",
    )  # fmt: skip
    for name in names:
        mapped[name] = text.take(name)


# GLM's hub names of the per-layer mHC tensors (DeepSeek-V4 style) -> KDSAHyperConnection's.
_GLM_HC_RENAMES = [
    WeightRenaming(rf"\.hc_{sublayer}_{tensor}$", f".{sublayer}_hc.{tensor}")
    for sublayer in ("attn", "ffn")
    for tensor in ("fn", "base", "scale")
]


# GLM's MTP fields, read from `text_config` or the top level of config.json (public loaders read either).
_GLM_MTP_FIELDS = ("num_nextn_predict_layers", "index_share_for_mtp_iteration")


def _glm_mtp_fields(text: _Fields, top: dict) -> int:
    """The declared MTP layer count. `index_share_for_mtp_iteration` is read and either value is accepted: it lets a
    serving engine reuse one draft step's indexer top-k for the next MTP draft steps (a speed choice of the drafting
    loop, the layer's weights are the same either way). KDSA runs the MTP layer's own indexer at every step; drafts
    never change the output, since the target verifies every drafted token (docs/checkpoint-conversion.md §10)."""
    values = {}
    for name in _GLM_MTP_FIELDS:
        inner = text.take(name) if name in text.pending else None
        outer = top.get(name)
        if inner is not None and outer is not None and inner != outer:
            raise ValueError(f"glm5_next config field {name}={outer!r} but text_config.{name}={inner!r}")
        values[name] = inner if inner is not None else outer
    share = values["index_share_for_mtp_iteration"]
    if share not in (None, True, False):
        raise ValueError(f"glm5_next config field index_share_for_mtp_iteration={share!r} must be a bool")
    declared = values["num_nextn_predict_layers"] or 0
    if not isinstance(declared, int) or declared < 0:
        raise ValueError(f"glm5_next config field num_nextn_predict_layers={declared!r} must be an int >= 0")
    return declared


def _glm5_next(fields: _Fields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    _metadata_fields(fields)
    fields.drop(_GLM_VISION_FIELDS)
    tie = fields.take("tie_word_embeddings")
    dtype = fields.take("dtype")
    quantization = {}
    _quantization(fields, quantization)  # top-level in GLM's config.json
    fields.take("text_config")
    top_mtp = {name: fields.take(name) for name in _GLM_MTP_FIELDS if name in fields.pending}
    fields.unhandled()

    text = _Fields(fields.source.text_config, "glm5_next text_config")
    mapped = _common_fields(text)
    if mapped["tie_word_embeddings"] != tie:
        raise ValueError(f"glm5_next tie_word_embeddings={tie} but text_config.tie_word_embeddings differs")
    if dtype is not None:
        mapped["dtype"] = dtype
    mapped.update(quantization)
    text.drop(["quantization_config"])
    _routing(text, mapped)
    _kda_fields(text, mapped)
    for name in ("index_n_heads", "index_head_dim", "index_topk", "layer_types"):
        mapped[name] = text.take(name)
    for i, layer_type in enumerate(mapped["layer_types"]):
        if layer_type not in (KDA_LAYER, DSA_LAYER):
            raise ValueError(f"glm5_next text_config layer_types[{i}]={layer_type!r} is not supported by KDSA")
    if mapped["qk_rope_head_dim"] != 0:
        raise ValueError(f"glm5_next text_config qk_rope_head_dim={mapped['qk_rope_head_dim']}: GLM's MLA is NoPE")
    _glm_components(text, mapped)
    declared = _glm_mtp_fields(text, top_mtp)
    text.unhandled()
    prefix = "model.language_model."
    mtp = _mtp_plan("glm5_next", mapped["num_hidden_layers"], declared, checkpoint_keys, prefix, overrides)
    mapped["num_mtp_layers"] = mtp.num_mtp_layers
    skipped = mtp.skipped
    skipped[r"^model\.visual\."] = "glm5_next vision tower model.visual.*"
    if mapped["index_kpool"] == 1:
        # Pools of one token: the pooling softmax weighs the single key by exactly 1, so transformers' compression
        # tensors are inert, and KDSA's per-token indexer has none.
        skipped[r"\.indexer\.index_kpool_compress_(ape|gate)$"] = "glm5_next k-pool compression of index_kpool=1"
    return _build(
        "glm5_next",
        mapped,
        overrides,
        key_mapping=_kda_key_mapping(mapped["layer_types"]),
        conversions=[
            WeightRenaming(r"^model\.language_model\.", "model."),
            *mtp.renamings,
            *_GLM_HC_RENAMES,
            *_kda_runtime_layout(),
            WeightConverter(
                source_patterns="linear_attn.A_log",
                target_patterns="linear_attn.A_log",
                operations=[DecayToHeadShape()],
            ),
            *_stacked_experts("gate_proj", "up_proj", "down_proj"),
        ],
        skipped=skipped,
        mtp_copies=mtp.copies,
    )


_TRANSLATORS = {"deepseek_v32": _deepseek_v32, "kimi_linear": _kimi_linear, "glm5_next": _glm5_next}


# ------------------------------------------------------------------------------------------------------- loading


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
        return _kimi_k3(dict(raw_config), keys, overrides or {})
    if model_type not in _TRANSLATORS:
        raise ValueError(f"loading {model_type!r} checkpoints into KDSA is not implemented yet")
    source = CONFIG_MAPPING[model_type].from_dict(dict(raw_config))
    return _TRANSLATORS[model_type](_Fields(source, model_type), keys, overrides or {})


def _build(model_type: str, mapped: dict, overrides: dict, **plan) -> ForeignCheckpointPlan:
    """The KDSAConfig and the plan; FP8 checkpoints get their converters extended to dequantize."""
    fp8_block = mapped.pop("_fp8_block", None)
    config = KDSAConfig(**mapped, **overrides)
    conversions = plan.pop("conversions", [])
    if fp8_block is not None:
        conversions = _dequantizing(conversions, fp8_block)
    return ForeignCheckpointPlan(
        model_type=model_type, config=config, conversions=conversions, fp8_block=fp8_block, **plan
    )


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
        unreadable = _fp8_unreadable(path, keys)
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
        plan.conversions = _holding(plan.conversions, plan.fp8_block)
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
    _check_mtp_copies(path, plan, model)
    for pattern, what in plan.skipped.items():
        count = sum(1 for k in keys if re.search(pattern, k))
        if count:
            logger.info("skipped %s: %d tensors", what, count)
    return (model, info) if want_info else model


def _shard_of(folder: str, key: str) -> str:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return os.path.join(folder, json.load(f)["weight_map"][key])
    return os.path.join(folder, "model.safetensors")


def _check_mtp_copies(folder: str, plan: ForeignCheckpointPlan, model) -> None:
    """An MTP layer's copy of the embedding or of the lm_head (`_mtp_plan`) must equal the model's tensor as loaded
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


def _fp8_unreadable(folder: str, keys: list[str]) -> list[str]:
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


def fp8_held_layers(plan: ForeignCheckpointPlan, keys: list[str]) -> list[str]:
    """The KDSA `nn.Linear`s that `fp8_weights="hold"` keeps FP8: every FP8 checkpoint weight that reaches the model
    by plain renames (transformers' own `rename_source_key` over the plan's `key_mapping` and renamings), except
    weights a converter merges (stacked routed experts) and `_FP8_WEIGHT_READ_DIRECTLY` (docs/checkpoint-conversion.md
    §9)."""
    from transformers.core_model_loading import rename_source_key

    renamings = [WeightRenaming(src, dst) for src, dst in plan.key_mapping.items()]
    renamings += [c for c in plan.conversions if isinstance(c, WeightRenaming)]
    # The plan's converters minus the last one, the catch-all that dequantizes every other weight (_dequantizing).
    converters = [c for c in plan.conversions if isinstance(c, WeightConverter)][:-1]
    scaled = {k.removesuffix("_scale_inv") for k in keys if k.endswith(".weight_scale_inv")}
    held = []
    for key in sorted(scaled):
        name, converter = rename_source_key(key, renamings, converters)
        module_name = name.removesuffix(".weight")
        if converter is None and module_name.rsplit(".", 1)[-1] not in _FP8_WEIGHT_READ_DIRECTLY:
            held.append(module_name)
    return held


def _holding(conversions: list, block: tuple[int, int]) -> list:
    """`_dequantizing`'s converters with the catch-all narrowed to `_FP8_WEIGHT_READ_DIRECTLY`: every other plainly
    renamed FP8 weight and its scale load as they are into a `KDSAFP8Linear`."""
    narrowed = [
        WeightConverter([f"{name}.weight", f"{name}.weight_scale_inv"], f"{name}.weight", [BlockFP8Dequantize(block)])
        for name in _FP8_WEIGHT_READ_DIRECTLY
    ]
    return [*conversions[:-1], *narrowed]


__all__ = [
    "REGISTRATION_LOCK",
    "FOREIGN_MODEL_TYPES",
    "ForeignCheckpointPlan",
    "FP8_WEIGHTS_CHOICES",
    "checkpoint_keys",
    "fp8_held_layers",
    "load_foreign",
    "plan_foreign_load",
]
