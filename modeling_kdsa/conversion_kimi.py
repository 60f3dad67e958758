"""Kimi-Linear (`kimi_linear`) checkpoints: KDA and dense NoPE MLA layers, 1-based layer lists, plain residual stream
(docs/checkpoint-conversion.md §4); the text fields Kimi K3 shares with it (conversion_kimi_k3.py)."""

from transformers.core_model_loading import WeightRenaming

from .configuration_kdsa import KDA_LAYER, MLA_LAYER
from .conversion_common import (
    ConfigFields,
    ForeignCheckpointPlan,
    build_plan,
    common_fields,
    kda_fields,
    routing_fields,
    stacked_experts,
)
from .conversion_fp8 import fp8_quantization_fields
from .conversion_mtp import MTPPlan, mtp_plan

KIMI_LINEAR_ATTN_KEYS = {"kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size"}


def kimi_linear_plan(fields: ConfigFields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    mapped = kimi_text_fields(fields, mlp_activations=("silu",), attn_keys=KIMI_LINEAR_ATTN_KEYS)
    mapped.pop("_linear_attn_config")
    fp8_quantization_fields(fields, mapped)
    fields.unhandled()
    mtp = kimi_mtp_plan("kimi_linear", mapped, checkpoint_keys, "model.", overrides)
    return build_plan(
        "kimi_linear",
        mapped,
        overrides,
        conversions=[
            # MoE and dense MLPs are both `block_sparse_moe` in the hub layout.
            WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
            *stacked_experts("w1", "w3", "w2"),
        ],
        skipped=mtp.skipped,
    )


def kimi_text_fields(fields: ConfigFields, mlp_activations: tuple[str, ...], attn_keys: set[str]) -> dict:
    """The fields Kimi-Linear and Kimi K3's text config share; returns the mapped KDSAConfig fields and the
    `linear_attn_config` dict under "_linear_attn_config" (for K3's extra keys)."""
    mapped = common_fields(fields, {"n_routed_experts": "num_local_experts"})
    routing_fields(fields, mapped)
    kda_fields(fields, mapped, mlp_activations)
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


def kimi_mtp_plan(model_type: str, mapped: dict, checkpoint_keys: list[str], prefix: str, overrides: dict) -> MTPPlan:
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
    return mtp_plan(model_type, mapped["num_hidden_layers"], 0, checkpoint_keys, prefix, overrides)
