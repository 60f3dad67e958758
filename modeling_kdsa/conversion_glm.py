"""GLM-5.3-Flash (`glm5_next`) checkpoints: KDA and k-pool DSA layers, shared-indexer layers, mHC, SwiGLU clamp, the
KDA gate lower bound, FP8 weights and MTP layers; the vision tower is skipped (docs/checkpoint-conversion.md §5)."""

from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

from .configuration_kdsa import DSA_LAYER, KDA_LAYER
from .conversion_common import (
    DECAY_SHAPE,
    ConfigFields,
    ForeignCheckpointPlan,
    Reshape,
    build_plan,
    common_fields,
    kda_fields,
    metadata_fields,
    routing_fields,
    stacked_experts,
)
from .conversion_fp8 import fp8_quantization_fields
from .conversion_mtp import mtp_plan


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


def _glm_components(text: ConfigFields, mapped: dict) -> None:
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


def _glm_mtp_fields(text: ConfigFields, top: dict) -> int:
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


def glm5_next_plan(fields: ConfigFields, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    metadata_fields(fields)
    fields.drop(_GLM_VISION_FIELDS)
    tie = fields.take("tie_word_embeddings")
    dtype = fields.take("dtype")
    quantization = {}
    fp8_quantization_fields(fields, quantization)  # top-level in GLM's config.json
    fields.take("text_config")
    top_mtp = {name: fields.take(name) for name in _GLM_MTP_FIELDS if name in fields.pending}
    fields.unhandled()

    text = ConfigFields(fields.source.text_config, "glm5_next text_config")
    mapped = common_fields(text)
    if mapped["tie_word_embeddings"] != tie:
        raise ValueError(f"glm5_next tie_word_embeddings={tie} but text_config.tie_word_embeddings differs")
    if dtype is not None:
        mapped["dtype"] = dtype
    mapped.update(quantization)
    text.drop(["quantization_config"])
    routing_fields(text, mapped)
    kda_fields(text, mapped)
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
    mtp = mtp_plan("glm5_next", mapped["num_hidden_layers"], declared, checkpoint_keys, prefix, overrides)
    mapped["num_mtp_layers"] = mtp.num_mtp_layers
    skipped = mtp.skipped
    skipped[r"^model\.visual\."] = "glm5_next vision tower model.visual.*"
    if mapped["index_kpool"] == 1:
        # Pools of one token: the pooling softmax weighs the single key by exactly 1, so transformers' compression
        # tensors are inert, and KDSA's per-token indexer has none.
        skipped[r"\.indexer\.index_kpool_compress_(ape|gate)$"] = "glm5_next k-pool compression of index_kpool=1"
    return build_plan(
        "glm5_next",
        mapped,
        overrides,
        conversions=[
            WeightRenaming(r"^model\.language_model\.", "model."),
            *mtp.renamings,
            *_GLM_HC_RENAMES,
            *_kda_runtime_layout(),
            WeightConverter(
                source_patterns="linear_attn.A_log",
                target_patterns="linear_attn.A_log",
                operations=[Reshape(DECAY_SHAPE, (-1,))],  # GLM stores A_log flat, [H]
            ),
            *stacked_experts("gate_proj", "up_proj", "down_proj"),
        ],
        skipped=skipped,
        mtp_copies=mtp.copies,
    )
