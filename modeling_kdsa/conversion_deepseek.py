"""DeepSeek-V3.2 (`deepseek_v32`) checkpoints: DSA layers with YaRN, grouped routing, FP8 weights and MTP layers
(docs/checkpoint-conversion.md §3)."""

from .configuration_kdsa import DSA_LAYER
from .conversion_common import (
    ConfigFields,
    ForeignCheckpointPlan,
    build_plan,
    common_fields,
    rope_fields,
    routing_fields,
    stacked_experts,
)
from .conversion_fp8 import fp8_quantization_fields
from .conversion_mtp import mtp_plan


def deepseek_v32_plan(fields: ConfigFields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    mapped = common_fields(fields)
    routing_fields(fields, mapped)
    rope_fields(fields, mapped)
    fp8_quantization_fields(fields, mapped)
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
    mtp = mtp_plan("deepseek_v32", mapped["num_hidden_layers"], declared or 0, checkpoint_keys, "model.", overrides)
    mapped["num_mtp_layers"] = mtp.num_mtp_layers
    return build_plan(
        "deepseek_v32",
        mapped,
        overrides,
        conversions=[*mtp.renamings, *stacked_experts("gate_proj", "up_proj", "down_proj")],
        skipped=mtp.skipped,
        mtp_copies=mtp.copies,
    )
