"""Loading published checkpoints of the family (DeepSeek-V3.2, Kimi-Linear, GLM-5.3-Flash) into KDSA models.

docs/checkpoint-conversion.md §2 (families §3-§5, FP8 §6). Two halves per family:

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

logger = logging.getLogger(__name__)

FOREIGN_MODEL_TYPES = ("deepseek_v32", "kimi_linear", "glm5_next")

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
_KDSA_ONLY_FIELDS = ("kernel_backend",)


@dataclass
class ForeignCheckpointPlan:
    """What `KDSAForCausalLM.from_pretrained` needs to load one foreign folder."""

    model_type: str
    config: KDSAConfig
    key_mapping: dict[str, str] = field(default_factory=dict)
    conversions: list = field(default_factory=list)
    # regex over the (renamed) checkpoint keys -> what is skipped, for the one info line logged per entry.
    skipped: dict[str, str] = field(default_factory=dict)


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
    load dtype and has no quantization_config (docs/checkpoint-conversion.md §6). Sets `mapped["_fp8_block"]`."""
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
        rows, cols = quantized.shape[-2:]
        block_rows, block_cols = self.block_size
        grid = (-(-rows // block_rows), -(-cols // block_cols))
        if tuple(scales.shape[-2:]) != grid:
            raise ValueError(
                f"weight_scale_inv shape {tuple(scales.shape)} does not match weight {tuple(quantized.shape)} in "
                f"blocks of {self.block_size} (expected grid {grid})"
            )
        scales = (scales.float() - 127.0).exp2() if scales.dtype == torch.uint8 else scales.float()  # E8M0 bytes
        scales = scales.repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)
        return (quantized.float() * scales[..., :cols]).to(output_dtype or torch.float32)


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


def _layer_skips(model_type: str, num_layers: int, checkpoint_keys: list[str], prefix: str) -> dict[str, str]:
    """MTP (next-token-prediction) layers are stored after the trunk as `layers.{N..}`; KDSA skips them."""
    skipped = {}
    extra = sorted(
        {int(m.group(1)) for k in checkpoint_keys if (m := re.match(prefix + r"layers\.(\d+)\.", k))}
        - set(range(num_layers))
    )
    for index in extra:
        skipped[rf"(^|\.)layers\.{index}\."] = f"{model_type} layer {index} (multi-token-prediction block)"
    return skipped


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
    fields.drop(["num_nextn_predict_layers"])  # MTP layers: skipped by tensor name below
    fields.drop(["rope_theta", "rope_scaling"])  # folded into rope_parameters by transformers
    fields.unhandled()
    return _build(
        "deepseek_v32",
        mapped,
        overrides,
        conversions=_stacked_experts("gate_proj", "up_proj", "down_proj"),
        skipped=_layer_skips("deepseek_v32", mapped["num_hidden_layers"], checkpoint_keys, r"model\."),
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


def _kda_fields(fields: _Fields, mapped: dict) -> None:
    for name in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        mapped[name] = fields.take(name)
    if mapped["hidden_act"] != "silu":
        # transformers applies hidden_act after the KDA short convolution too; KDSA's convolution is SiLU.
        raise ValueError(
            f"{fields.model_type} config field hidden_act={mapped['hidden_act']!r} is not supported with KDA layers "
            "(their short convolution uses SiLU); only 'silu'"
        )


def _kda_key_mapping(layer_types: list[str]) -> dict[str, str]:
    """The hub stores KDA mixers under `self_attn` like attention; KDSA names them `linear_attn` (so that a
    tensor-parallel plan entry can never hit the wrong mixer): a rename that depends on the layer index."""
    kda = [str(i) for i, t in enumerate(layer_types) if t == KDA_LAYER]
    if not kda:
        return {}
    return {rf"\.layers\.({'|'.join(kda)})\.self_attn\.": r".layers.\1.linear_attn."}


def _kimi_linear(fields: _Fields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    mapped = _common_fields(fields, {"n_routed_experts": "num_local_experts"})
    _routing(fields, mapped)
    _kda_fields(fields, mapped)
    linear_attn_config = fields.take("linear_attn_config") if "linear_attn_config" in fields.pending else {}
    unknown = set(linear_attn_config or {}) - _KIMI_LINEAR_ATTN_KEYS
    if unknown:
        raise ValueError(f"kimi_linear config field linear_attn_config has keys KDSA does not implement: {unknown}")
    # transformers resolved linear_attn_config's 1-based kda_layers / full_attn_layers into layer_types; Kimi's
    # "full_attention" is dense MLA, KDSA's layer type of the same name.
    layer_types = fields.take("layer_types")
    for i, layer_type in enumerate(layer_types):
        if layer_type not in (KDA_LAYER, MLA_LAYER):
            raise ValueError(f"kimi_linear config field layer_types[{i}]={layer_type!r} is not supported by KDSA")
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
    fields.drop(["use_grouped_topk", "num_nextn_predict_layers", "rope_theta", "rope_scaling", "rope_parameters"])
    _quantization(fields, mapped)
    fields.unhandled()
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


def _glm5_next(fields: _Fields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    _metadata_fields(fields)
    fields.drop(_GLM_VISION_FIELDS)
    tie = fields.take("tie_word_embeddings")
    dtype = fields.take("dtype")
    quantization = {}
    _quantization(fields, quantization)  # top-level in GLM's config.json
    fields.take("text_config")
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
    text.unhandled()
    skipped = _layer_skips("glm5_next", mapped["num_hidden_layers"], checkpoint_keys, r"model\.language_model\.")
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
    return ForeignCheckpointPlan(model_type=model_type, config=config, conversions=conversions, **plan)


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
    plan = plan_foreign_load(raw_config, keys, overrides)
    want_info = kwargs.pop("output_loading_info", False)
    # Size mismatches come back in the loading info, so that the strict check below names them (transformers'
    # own error does not say which tensor); they are never ignored.
    kwargs["ignore_mismatched_sizes"] = True
    with REGISTRATION_LOCK:
        ignored_before = cls._keys_to_ignore_on_load_unexpected
        register_checkpoint_conversion_mapping(cls.__name__, plan.conversions, overwrite=True)
        cls._keys_to_ignore_on_load_unexpected = list(plan.skipped)
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
            register_checkpoint_conversion_mapping(cls.__name__, [], overwrite=True)
    model._keys_to_ignore_on_load_unexpected = set(ignored_before or [])
    model._weight_conversions = []
    problems = {
        k: sorted(map(str, info[k])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)
    }
    if problems:
        raise ValueError(f"{plan.model_type} checkpoint {path!r} does not map onto KDSA exactly: {problems}")
    for pattern, what in plan.skipped.items():
        count = sum(1 for k in keys if re.search(pattern, k))
        if count:
            logger.info("skipped %s: %d tensors", what, count)
    return (model, info) if want_info else model


__all__ = [
    "REGISTRATION_LOCK",
    "FOREIGN_MODEL_TYPES",
    "ForeignCheckpointPlan",
    "checkpoint_keys",
    "load_foreign",
    "plan_foreign_load",
]
