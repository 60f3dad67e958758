"""What every family's checkpoint conversion shares (docs/checkpoint-conversion.md §2): the plan a translation
returns, the ledger that makes every source config field be mapped, checked or refused by name, the fields whose
meaning is the same in every family, and the weight mappings more than one family needs (stacked experts, KDA names
and decay layout)."""

from dataclasses import dataclass, field

from transformers.configuration_utils import PreTrainedConfig
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter

from .configuration_kdsa import KDA_LAYER, KDSAConfig

# PreTrainedConfig's own bookkeeping fields: they describe the file or the training run, not the network.
METADATA_FIELDS = {
    "_name_or_path", "architectures", "transformers_version", "model_type", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "auto_map",
}  # fmt: skip
# Fields that configure training only (auxiliary losses, router-logit outputs) or deployment (expert-parallel size):
# they do not change what a forward pass computes.
_TRAINING_ONLY_FIELDS = {"output_router_logits", "aux_loss_alpha", "seq_aux", "ep_size", "router_aux_loss_coef"}
# Rope types whose frequencies and YaRN attention factor come from transformers' own init functions and whose
# softmax mscale `mla_softmax_scale` reproduces (tests/test_foreign_checkpoints.py).
_SUPPORTED_ROPE_TYPES = ("default", "yarn")


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
    # model parameter an FP8 checkpoint weight loads into -> whether a converter merges it (`fp8_targets`).
    fp8_targets: dict[str, bool] = field(default_factory=dict)
    # checkpoint key of an MTP layer's copy of a shared tensor -> the model's parameter it must equal (`mtp_plan`).
    mtp_copies: dict[str, str] = field(default_factory=dict)


class ConfigFields:
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


def metadata_fields(fields: ConfigFields) -> None:
    """PreTrainedConfig's own fields, present in every (sub)config."""
    fields.drop(METADATA_FIELDS)
    fields.drop(_TRAINING_ONLY_FIELDS & fields.pending)
    fields.require("chunk_size_feed_forward", (0,), "no chunked feed-forward")
    fields.require("is_encoder_decoder", (False,), "decoder-only")


def common_fields(fields: ConfigFields, source_names: dict[str, str] | None = None) -> dict:
    """Fields whose meaning is the same in every family and in KDSAConfig; `source_names`: KDSA field -> the
    source's name where they differ."""
    source_names = source_names or {}
    metadata_fields(fields)
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


def routing_fields(fields: ConfigFields, mapped: dict) -> None:
    """Group-limited routing (DeepSeek-V3 `n_group` / `topk_group`, same semantics in all three families)."""
    n_group, topk_group = fields.take("n_group"), fields.take("topk_group")
    mapped["n_group"] = 1 if n_group is None else n_group
    mapped["topk_group"] = 1 if topk_group is None else topk_group


def rope_fields(fields: ConfigFields, mapped: dict) -> None:
    rope = dict(fields.take("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{fields.model_type} config field rope_parameters.rope_type={rope_type!r} is not supported by KDSA; "
            f"supported: {_SUPPORTED_ROPE_TYPES}"
        )
    rope.pop("type", None)  # legacy alias of rope_type kept by transformers' standardisation
    mapped["rope_parameters"] = rope


def stacked_experts(gate: str, up: str, down: str) -> list:
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


def kda_fields(fields: ConfigFields, mapped: dict, mlp_activations: tuple[str, ...] = ("silu",)) -> None:
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


def kda_key_mapping(layer_types: list[str]) -> dict[str, str]:
    """The hub stores KDA mixers under `self_attn` like attention; KDSA names them `linear_attn` (so that a
    tensor-parallel plan entry can never hit the wrong mixer): a rename that depends on the layer index."""
    kda = [str(i) for i, t in enumerate(layer_types) if t == KDA_LAYER]
    if not kda:
        return {}
    return {rf"\.layers\.({'|'.join(kda)})\.self_attn\.": r".layers.\1.linear_attn."}


# KDSA (like Kimi-Linear) keeps the KDA decay `A_log` as `[1, 1, H, 1]`.
DECAY_SHAPE = (1, 1, -1, 1)


def only_tensor(input_dict: dict):
    """The one source tensor of a one-to-one conversion (transformers passes it alone or in a one-element list)."""
    tensor = next(iter(input_dict.values()))
    return tensor[0] if isinstance(tensor, list) else tensor


class Reshape(ConversionOps):
    """Reshapes the one source tensor to `shape`; the reverse op (used when saving) reshapes it back to
    `source_shape`. GLM's flat KDA decay `[H]`, for instance, loads with `Reshape(DECAY_SHAPE, (-1,))`."""

    def __init__(self, shape: tuple[int, ...], source_shape: tuple[int, ...]):
        self.shape, self.source_shape = tuple(shape), tuple(source_shape)

    def __repr__(self):
        return f"Reshape({self.source_shape} -> {self.shape})"

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: only_tensor(input_dict).reshape(self.shape)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Reshape(self.source_shape, self.shape)


def build_plan(model_type: str, mapped: dict, overrides: dict, **plan) -> ForeignCheckpointPlan:
    """The KDSAConfig and the plan, with the KDA mixers' rename (`kda_key_mapping`) of every family that has them
    (`plan_foreign_load` extends an FP8 checkpoint's converters to dequantize)."""
    fp8_block = mapped.pop("_fp8_block", None)
    key_mapping = kda_key_mapping(mapped["layer_types"])
    config = KDSAConfig(**mapped, **overrides)
    return ForeignCheckpointPlan(
        model_type=model_type, config=config, fp8_block=fp8_block, key_mapping=key_mapping, **plan
    )
