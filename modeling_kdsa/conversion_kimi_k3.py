"""Kimi K3 (`kimi_k3`) checkpoints (docs/kimi-k3.md §1, §4): the multimodal wrapper's text model — Kimi-Linear's
fields plus gated NoPE MLA, the full-rank KDA gate, Block AttnRes, LatentMoE and SiTU — with its MXFP4 routed experts
kept packed; the vision tower, projector and MTP blocks are skipped."""

from transformers import CONFIG_MAPPING
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter, WeightRenaming

from .conversion_common import (
    DECAY_SHAPE,
    METADATA_FIELDS,
    ConfigFields,
    ForeignCheckpointPlan,
    Reshape,
    build_plan,
    only_tensor,
    stacked_experts,
)
from .conversion_kimi import KIMI_LINEAR_ATTN_KEYS, kimi_mtp_plan, kimi_text_fields

# K3's additions to linear_attn_config (docs/kimi-k3.md §1): the bounded forget gate and the full-rank output gate.
_KIMI_K3_ATTN_KEYS = KIMI_LINEAR_ATTN_KEYS | {"gate_lower_bound", "use_full_rank_gate"}
# Top-level fields of the multimodal wrapper that belong to the vision side, which KDSA does not load.
_K3_VISION_FIELDS = ("vision_config", "media_placeholder_token_id")
# Top-level fields that the text config also has: the wrapper's value applies to the text model.
_K3_SHARED_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
_K3_TOP_LEVEL_METADATA = METADATA_FIELDS | {"torch_dtype", "dtype"}


class DecayFromPadded(ConversionOps):
    """K3 stores the KDA decay `A_log` flat with zero padding after the H logical values (96 of 128 in the release;
    engines read the first H). KDSA keeps `[1, 1, H, 1]`; a non-zero pad entry is refused (a layout not understood)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        tensor = only_tensor(input_dict).reshape(-1)
        if tensor.numel() < self.num_heads or bool(tensor[self.num_heads :].ne(0).any()):
            raise ValueError(
                f"A_log has {tensor.numel()} values; expected the {self.num_heads} heads' values followed by zero "
                "padding"
            )
        return {target_patterns[0]: tensor[: self.num_heads].reshape(DECAY_SHAPE)}

    @property
    def reverse_op(self) -> ConversionOps:
        return Reshape((-1,), DECAY_SHAPE)


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


def kimi_k3_plan(raw: dict, checkpoint_keys: list[str], overrides: dict) -> ForeignCheckpointPlan:
    """Kimi K3 (docs/kimi-k3.md §1): a multimodal wrapper whose `text_config` is a `kimi_linear` config with K3's
    fields; the text model loads, the vision tower is skipped."""
    text_raw, top_dtype = _k3_top_level(raw)
    fields = ConfigFields(CONFIG_MAPPING["kimi_linear"].from_dict(text_raw), "kimi_k3 text_config")
    mapped = kimi_text_fields(fields, mlp_activations=("silu", "situ"), attn_keys=_KIMI_K3_ATTN_KEYS)
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
    skipped = kimi_mtp_plan("kimi_k3", mapped, checkpoint_keys, "language_model.model.", overrides).skipped
    skipped[r"^vision_tower\."] = "kimi_k3 vision tower vision_tower.*"
    skipped[r"^mm_projector\."] = "kimi_k3 multimodal projector mm_projector.*"
    if mapped["routed_expert_weight_format"] == "mxfp4":
        experts = [_stacked(["w1", "w3"], "gate_up_proj", suffix) for suffix in ("weight_packed", "weight_scale")] + [
            _stacked(["w2"], "down_proj", suffix) for suffix in ("weight_packed", "weight_scale")
        ]
    else:
        experts = stacked_experts("w1", "w3", "w2")
    attn_res = [
        # K3 stores each AttnRes pseudo-query as a `[1, D]` linear weight; KDSADepthAttention keeps `query: [D]`.
        WeightConverter(f"{source}_proj.weight", f"{target}.query", operations=[Reshape((-1,), (1, -1))])
        for source, target in (("self_attention_res", "attention_res"), ("mlp_res", "mlp_res"),
                               ("output_attn_res", "output_attn_res"))
    ] + [
        WeightRenaming(rf"\.{source}_norm\.weight$", f".{target}.key_norm.weight")
        for source, target in (("self_attention_res", "attention_res"), ("mlp_res", "mlp_res"),
                               ("output_attn_res", "output_attn_res"))
    ]  # fmt: skip
    return build_plan(
        "kimi_k3",
        mapped,
        overrides,
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
    {packed|scale}` buffer `[E, rows, cols]` (w1 rows before w3 rows), as `stacked_experts` stacks dense weights."""
    operations = [MergeModulelist(dim=0)] + ([Concatenate(dim=1)] if len(sources) > 1 else [])
    kind = "packed" if suffix == "weight_packed" else "scale"
    return WeightConverter(
        source_patterns=[f"mlp.experts.*.{w}.{suffix}" for w in sources],
        target_patterns=f"mlp.experts.{target}_{kind}",
        operations=operations,
    )
