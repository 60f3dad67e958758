"""Memory plan: what one rank holds when a KDSA model (native, or a published family checkpoint converted at load) is
spread over `tp × ep` devices, and the largest context and batch that fit (docs/memory-plan.md).

    python -m modeling_kdsa.parallel.plan deepseek-v3.2 --devices 16 --device-memory 80GiB --context 131072

The weights are counted on a meta-device build of the model (`KDSAForCausalLM(config)` under `torch.device("meta")`,
nothing allocated), tensor by tensor, each put in a format (bf16, fp32 kept by `_keep_in_fp32_modules_strict`, held
FP8 E4M3 with its block scales, packed MXFP4 with its E8M0 scales) and a sharding group (`shard_group`: split by tp,
by ep, by both, or replicated; docs/memory-plan.md §2). Cache bytes come from the cache's own code: the paged DSA /
MLA stores' `bytes_per_token` and the KDA layer's `memory_bytes` (modeling_kdsa/cache.py). Activations are an
estimate whose formula is `ACTIVATION_FORMULA` (docs/memory-plan.md §4).

The layouts are those the package plans for sharded loading (tp for heads, dense widths and the vocabulary rows of
the embedding and head, ep for whole routed experts). The package runs these layouts for dense routed experts
(`apply_expert_parallel`, docs/parallel.md §9) and ep alone for LatentMoE and packed MXFP4 experts; with tp > 1 their
layout (whole experts over all tp × ep ranks) is planned here but not runnable yet.
"""

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modeling_kdsa.cache import KDAReplayLayer, attention_store_class
from modeling_kdsa.configuration_kdsa import DSA_LAYER, KDA_LAYER, MLA_LAYER, KDSAConfig
from modeling_kdsa.conversion import FOREIGN_MODEL_TYPES, checkpoint_keys, fp8_held_layers, plan_foreign_load
from modeling_kdsa.modeling_kdsa import KDSAForCausalLM
from modeling_kdsa.numeric_formats import INDEXER_FORMATS, KV_CACHE_FORMATS, CacheFormats

from .tensor_parallel import vocab_split_error

GiB = 2**30

# The published configs shipped with the repository as test data (docs/memory-plan.md §1 names their sources).
CONFIG_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "configs"
FAMILIES = {
    "kimi-linear-48b-a3b": "kimi-linear-48b-a3b.json",
    "deepseek-v3.2": "deepseek-v3.2.json",
    "glm-5.3-flash": "glm-5.3-flash.json",
    "kimi-k3": "kimi-k3.json",
}

# Weight formats a load can give: every weight in the load dtype (FP8 checkpoints dequantized at load, the default),
# FP8 held (`fp8_weights="hold"`, docs/checkpoint-conversion.md §9), packed MXFP4 routed experts as Kimi K3 stores
# them (docs/kimi-k3.md §4).
WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4-experts")
# Sharding groups (docs/memory-plan.md §2): divided by tp, divided by tp × ep (the routed experts), whole on every rank.
GROUPS = ("tp", "ep_tp", "replicated")
# Byte kinds a rank holds its weights in.
FORMAT_KINDS = ("bf16", "fp32", "fp8_values", "fp8_scales", "mxfp4_values", "mxfp4_scales")

ACTIVATION_BYTES = 2  # bf16 activations
MOE_IMBALANCE = 2.0  # routed tokens one rank's experts may receive, relative to the balanced share
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_RESERVE = "2GiB"
ACTIVATION_FORMULA = (
    "P = min(prefill_chunk, batch*context) tokens per forward, a = 2 bytes; "
    "stream = P*D*a*S (S = 1 plain, hc_mult for mHC, AttnRes blocks + 1 for Block AttnRes); "
    "layer = 4*P*D*a (normed input, mixer output, FFN input and output); "
    "mixer = max(KDA: P*H/tp*(3K+V)*4 + P*H/tp*(2K+V)*a, MLA/DSA: P*H/tp*(qk_head_dim+2*v_head_dim)*a + "
    "P*index_n_heads*index_head_dim*a); "
    "ffn = max(dense: 3*P*I/tp*a, MoE: P*E*4 router + 2*P*k*D_e*a dispatch/combine + "
    f"{MOE_IMBALANCE:g}*(P*k/(tp*ep))*3*I_e*a expert work + 3*P*I_shared/tp*a); "
    "logits = batch*vocab*4; total = stream + layer + mixer + ffn + logits"
)


def parse_bytes(text: str | int | float, name: str = "device_memory") -> int:
    """`80GiB`, `80 GB`, `85899345920`, `1.5TiB` → bytes. ValueError naming `name` otherwise."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*", str(text))
        if match is None:
            raise ValueError(f"{name}={text!r} is not a size such as 80GiB, 80GB or a byte count")
        value, unit = float(match.group(1)), match.group(2) or ""
    scale = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30,
             "TiB": 2**40}[unit]  # fmt: skip
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return int(value * scale)


# ------------------------------------------------------------------------------------------------- the source


@dataclass
class Source:
    """A config to plan: its name, where it came from, the raw config.json dict and the checkpoint's tensor names
    (a folder's shard index; empty for a bare config)."""

    name: str
    path: str
    raw: dict
    keys: list[str] = field(default_factory=list)


def read_source(spec: str) -> Source:
    """A family name (`FAMILIES`), a checkpoint folder or a config.json path."""
    family = FAMILIES.get(str(spec).lower())
    if family is not None:
        path = CONFIG_DIR / family
        if not path.is_file():
            raise ValueError(
                f"family {spec!r}: its published config {path} is not here (the configs ship in the repository's "
                "tests/data/configs); pass the path of a config.json instead"
            )
        return Source(str(spec).lower(), str(path), json.loads(path.read_text()))
    path = Path(spec)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ValueError(f"source {spec!r}: folder has no config.json")
        return Source(path.name, str(path), json.loads(config.read_text()), checkpoint_keys(str(path)))
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"source {spec!r}: not a JSON config ({error})") from None
        return Source(path.stem, str(path), raw)
    raise ValueError(f"source {spec!r} is neither a family name ({', '.join(FAMILIES)}) nor a folder or config.json")


@dataclass
class ModelSpec:
    """The KDSAConfig a source loads as, its checkpoint's FP8 block (None if not FP8) and, for a folder, the layers
    `fp8_weights="hold"` would keep FP8 (None: derived from the module structure, `fp8_held_modules`)."""

    config: KDSAConfig
    fp8_block: tuple[int, int] | None
    held_from_checkpoint: list[str] | None


def model_spec(source: Source, mtp: bool | None = None) -> ModelSpec:
    """The converter's config for a family checkpoint (`plan_foreign_load`), or the native KDSAConfig. `mtp=False`
    drops the MTP layers as `from_pretrained(..., num_mtp_layers=0)` does; None keeps what the config declares."""
    model_type = source.raw.get("model_type")
    if model_type in FOREIGN_MODEL_TYPES:
        overrides = {"num_mtp_layers": 0} if mtp is False else None
        plan = plan_foreign_load(source.raw, source.keys, overrides)
        held = None
        if plan.fp8_block is not None and any(k.endswith("_scale_inv") for k in source.keys):
            held = fp8_held_layers(plan, source.keys)
        return ModelSpec(plan.config, plan.fp8_block, held)
    if model_type == "kdsa":
        config = KDSAConfig.from_dict(source.raw)
        if mtp is False:
            config.num_mtp_layers = 0
        return ModelSpec(config, None, None)
    raise ValueError(
        f"source {source.name!r}: model_type={model_type!r} is neither 'kdsa' nor a family KDSA converts "
        f"{FOREIGN_MODEL_TYPES}"
    )


def meta_model(config: KDSAConfig) -> KDSAForCausalLM:
    """The model on the meta device: every tensor's shape and dtype, no storage."""
    with torch.device("meta"):
        return KDSAForCausalLM(config)


# ----------------------------------------------------------------------------------------------- the weights

# Parameter-name rules, first match wins (docs/memory-plan.md §2; the tp column is docs/parallel.md §5).
_SHARD_RULES = [
    # KDA: everything cut by head; the rank-K / rank-V first halves of the low-rank gates and the per-head-dim norm
    # are shared by all heads.
    (r"\.linear_attn\.(f_a_proj|g_a_proj|o_norm)\.", "replicated"),
    (r"\.linear_attn\.", "tp"),
    # MLA / DSA: per-head projections and the output; the latent down-projections, their norms and the indexer are
    # whole on every rank.
    (r"\.self_attn\.(q_b_proj|q_proj|kv_b_proj|g_proj|o_proj)\.", "tp"),
    (r"\.self_attn\.", "replicated"),
    (r"\.mlp\.shared_experts\.", "tp"),
    (r"\.mlp\.experts\.", "ep_tp"),
    (r"\.mlp\.(gate|routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)\.", "replicated"),
    (r"\.mlp\.(gate_proj|up_proj|down_proj)\.", "tp"),
    # The input embedding and the head by vocabulary rows (a tied head is the embedding's tensor, counted once).
    (r"^(model\.embed_tokens|lm_head)\.", "tp"),
]


def experts_split_by_tp(config) -> bool:
    """How the routed experts spread over the tp × ep ranks (the bytes per rank are the same either way): dense
    experts go to ep groups by expert and are cut by width inside a tp group (today's `apply_tensor_parallel`);
    LatentMoE (the latent norm needs the summed partials) and packed MXFP4 experts (no slicing inside a packed row)
    stay whole, each of the tp × ep ranks holding its own experts."""
    return config.routed_expert_hidden_size is None and config.routed_expert_weight_format == "dense"


def shard_group(name: str, config) -> str:
    """The sharding group of parameter / buffer `name` of `config`'s model: `tp` (divided by tp), `ep_tp` (the
    routed experts, divided by tp × ep: `experts_split_by_tp`) or `replicated`."""
    for pattern, group in _SHARD_RULES:
        if re.search(pattern, name):
            return group
    return "replicated"


def group_divisor(group: str, tp: int, ep: int) -> int:
    return {"tp": tp, "ep_tp": ep * tp, "replicated": 1}[group]


# Modules an FP8 family checkpoint stores in bf16 beyond the common ones (router, indexer head weights, kv_b_proj):
# GLM-5.3-Flash keeps every KDA layer and the whole indexer bf16 (its 62 shard headers as read by public serving
# stacks, e.g. Modular MAX's GLM-5.3-Flash precision map; docs/memory-plan.md §3).
_BF16_IN_FP8_CHECKPOINT = {"glm5_next": r"(\.linear_attn\.|\.indexer\.)"}


def fp8_held_modules(model: KDSAForCausalLM, model_type: str | None = None) -> list[str]:
    """The linear layers a FP8 checkpoint keeps FP8 under `fp8_weights="hold"`, from the module structure: every 2-D
    linear weight of a decoder or MTP layer except the router, the indexer's head weights (not FP8 in the published
    checkpoints), `kv_b_proj` (dequantized at load: the MLA absorption reads it) and what the family stores in bf16
    (`_BF16_IN_FP8_CHECKPOINT`); the stacked routed experts are dequantized at load too
    (docs/checkpoint-conversion.md §9). For a folder the checkpoint's own names decide
    (`conversion.fp8_held_layers`)."""
    family_bf16 = _BF16_IN_FP8_CHECKPOINT.get(model_type)
    held = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not re.match(r"(model|mtp)\.layers\.\d+\.", name):
            continue
        if re.search(r"(\.mlp\.gate|\.indexer\.weights_proj|\.kv_b_proj)$", name):
            continue
        if family_bf16 is not None and re.search(family_bf16, name + "."):
            continue
        held.append(name)
    return held


def _fp32_pattern(model: KDSAForCausalLM) -> re.Pattern | None:
    """transformers' matching of `_keep_in_fp32_modules_strict` (a dotted name component): these stay fp32 in a bf16
    load."""
    entries = sorted(model._keep_in_fp32_modules_strict)
    if not entries:
        return None
    return re.compile("|".join(rf"((^|\.){re.escape(entry)}($|\.))" for entry in entries))


@dataclass
class TensorEntry:
    """One tensor of the model: name, shape, sharding group, bytes by kind (whole tensor), logical weights (a packed
    MXFP4 byte holds two; scales hold none) and whether it is an nn.Parameter."""

    name: str
    shape: tuple[int, ...]
    group: str
    bytes: dict[str, int]
    weights: int
    is_parameter: bool


def weight_entries(
    model: KDSAForCausalLM, weights: str, fp8_block=(128, 128), held=None, model_type: str | None = None
) -> list[TensorEntry]:
    """Every tensor of the state dict (parameters and persistent buffers, tied ones once) with its bytes in the
    format `weights` loads it in (`held`: the FP8-held module names, default `fp8_held_modules`)."""
    config = model.config
    fp32 = _fp32_pattern(model)
    held = set(fp8_held_modules(model, model_type) if held is None else held) if weights == "fp8" else set()
    parameters = {id(p) for p in model.parameters()}
    entries, seen = [], set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        numel = tensor.numel()
        module = name.rsplit(".", 1)[0]
        if name.endswith("_packed") and tensor.dtype == torch.uint8:
            sizes, count = {"mxfp4_values": numel}, 2 * numel
        elif name.endswith("_scale") and tensor.dtype == torch.uint8 and ".experts." in name:
            sizes, count = {"mxfp4_scales": numel}, 0
        elif module in held and name.endswith(".weight"):
            rows, cols = tensor.shape
            grid = math.ceil(rows / fp8_block[0]) * math.ceil(cols / fp8_block[1])
            sizes, count = {"fp8_values": numel, "fp8_scales": 4 * grid}, numel
        elif not tensor.is_floating_point():
            raise ValueError(f"tensor {name} has dtype {tensor.dtype}, which the plan does not know how to count")
        elif fp32 is not None and fp32.search(name):
            sizes, count = {"fp32": 4 * numel}, numel
        else:
            sizes, count = {"bf16": 2 * numel}, numel
        group = shard_group(name, config)
        entries.append(TensorEntry(name, tuple(tensor.shape), group, sizes, count, id(tensor) in parameters))
    return entries


def weight_table(entries: list[TensorEntry]) -> dict[str, dict[str, int]]:
    """Whole-model bytes by group, then by kind."""
    table = {group: dict.fromkeys(FORMAT_KINDS, 0) for group in GROUPS}
    for entry in entries:
        for kind, size in entry.bytes.items():
            table[entry.group][kind] += size
    return table


def per_rank_weights(table: dict[str, dict[str, int]], tp: int, ep: int) -> dict[str, dict[str, int]]:
    """Bytes one rank holds, by group and kind (sharded groups divided by their sizes, rounded up)."""
    return {
        group: {kind: -(-size // group_divisor(group, tp, ep)) for kind, size in kinds.items()}
        for group, kinds in table.items()
    }


# -------------------------------------------------------------------------------------------------- the cache


def kda_state_parts(model: KDSAForCausalLM, tp: int) -> dict[str, int]:
    """Bytes of every KDA layer's live state for one sequence on one rank (heads split by tp), as `conv_window` and
    `recurrent_state`: the cache's own `KDAReplayLayer` fed the short-conv window `[1, C, W]` (model dtype,
    C = 2·H·K + H·V) and then the fp32 state `[1, H, K, V]` the layer hands it (modeling_kdsa/kda.py), on the meta
    device, its `memory_bytes()["states"]` read after each."""
    parts = {"conv_window": 0, "recurrent_state": 0}
    for layer in model.model.layers:
        attn = getattr(layer, "linear_attn", None)
        if attn is None:
            continue
        heads = attn.num_heads // tp
        channels = heads * (2 * attn.head_k_dim + attn.head_v_dim)
        cache_layer = KDAReplayLayer(attn.conv_kernel_size, 0)
        cache_layer.update_conv_state(torch.empty(1, channels, 1, dtype=torch.bfloat16, device="meta"))
        conv = cache_layer.memory_bytes()["states"]
        cache_layer.update_recurrent_state(
            torch.empty(1, heads, attn.head_k_dim, attn.head_v_dim, dtype=torch.float32, device="meta")
        )
        parts["conv_window"] += conv
        parts["recurrent_state"] += cache_layer.memory_bytes()["states"] - conv
    return parts


def kda_state_bytes(model: KDSAForCausalLM, tp: int) -> int:
    """`kda_state_parts` summed: what one sequence's KDA layers hold on one rank."""
    return sum(kda_state_parts(model, tp).values())


def _store_bytes_per_token(config, layer_idx: int, formats: CacheFormats) -> int:
    store_class = attention_store_class(config, layer_idx)
    kwargs = store_class.config_kwargs(config)
    kwargs.update(formats=formats, kernel_backend="torch")
    store = store_class(**kwargs)
    store.lazy_initialization(*(torch.zeros(1, 0, width, dtype=torch.bfloat16) for width in store.row_widths))
    return store.bytes_per_token()


def attention_bytes_per_token(config, kv_cache: str = "bf16", indexer: str = "bf16") -> int:
    """Bytes one cached token adds to one sequence in every DSA / dense MLA layer's paged store (and the MTP layers'
    stores, when the model has them), in the given formats: the stores' own `bytes_per_token` (modeling_kdsa/cache.py).
    The latent and indexer keys are whole on every tp rank. ValueError (the cache's) for a format the layer cannot
    store."""
    formats = CacheFormats(indexer=indexer, kv_cache=kv_cache)
    formats.check_shapes(config)
    total = 0
    for idx, layer_type in enumerate(config.layer_types):
        if layer_type in (DSA_LAYER, MLA_LAYER):
            total += _store_bytes_per_token(config, idx, formats)
    if config.num_mtp_layers > 0:
        mtp = config.mtp_config()
        total += sum(_store_bytes_per_token(mtp, idx, formats) for idx in range(mtp.num_hidden_layers))
    return total


def cache_format_table(config) -> dict[str, int | str]:
    """Bytes per token for every (kv_cache, indexer) pair; the cache's refusal where a pair cannot be stored."""
    table = {}
    for kv_cache in KV_CACHE_FORMATS:
        for indexer in INDEXER_FORMATS:
            try:
                table[f"{kv_cache}/{indexer}"] = attention_bytes_per_token(config, kv_cache, indexer)
            except ValueError as error:
                table[f"{kv_cache}/{indexer}"] = f"n/a: {error}"
    return table


# -------------------------------------------------------------------------------------------------- activations


def activation_bytes(config, tp: int, ep: int, batch: int, context: int, prefill_chunk: int) -> dict[str, int]:
    """The estimate of `ACTIVATION_FORMULA`, per rank, by term."""
    a = ACTIVATION_BYTES
    tokens = min(prefill_chunk, batch * context)
    hidden = config.hidden_size
    if config.hc_mult > 1:
        streams = config.hc_mult
    elif config.attn_res_block_size > 0:
        streams = math.ceil(2 * config.num_hidden_layers / config.attn_res_block_size) + 1
    else:
        streams = 1
    terms = {"stream": tokens * hidden * a * streams, "layer": 4 * tokens * hidden * a}
    mixer = 0
    if KDA_LAYER in config.layer_types:
        heads, k, v = config.linear_num_heads // tp, config.linear_head_dim, config.linear_head_dim
        mixer = max(mixer, tokens * heads * (3 * k + v) * 4 + tokens * heads * (2 * k + v) * a)
    if DSA_LAYER in config.layer_types or MLA_LAYER in config.layer_types:
        heads = config.num_attention_heads // tp
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        attention = tokens * heads * (qk + 2 * config.v_head_dim) * a
        if DSA_LAYER in config.layer_types:
            attention += tokens * config.index_n_heads * config.index_head_dim * a
        mixer = max(mixer, attention)
    terms["mixer"] = mixer
    ffn = 0
    if "dense" in config.mlp_layer_types:
        ffn = 3 * tokens * (config.intermediate_size // tp) * a
    if "sparse" in config.mlp_layer_types:
        k = config.num_experts_per_tok
        width = config.routed_expert_hidden_size or hidden
        moe = tokens * config.n_routed_experts * 4 + 2 * tokens * k * width * a
        moe += int(MOE_IMBALANCE * math.ceil(tokens * k / (tp * ep)) * 3 * config.moe_intermediate_size * a)
        moe += 3 * tokens * (config.moe_intermediate_size * config.n_shared_experts // tp) * a
        ffn = max(ffn, moe)
    terms["ffn"] = ffn
    terms["logits"] = batch * config.vocab_size * 4
    terms["total"] = sum(terms.values())
    return terms


# ------------------------------------------------------------------------------------------------------ layouts


def layout_errors(config, tp: int, ep: int) -> list[str]:
    """Why `tp × ep` cannot split `config`: each size that is not divisible, by field name."""
    if tp < 1 or ep < 1:
        return [f"tp={tp} and ep={ep} must be >= 1"]
    errors = []
    sizes = {"num_attention_heads": config.num_attention_heads}
    if KDA_LAYER in config.layer_types:
        sizes["linear_num_heads"] = config.linear_num_heads
    if "dense" in config.mlp_layer_types:
        sizes["intermediate_size"] = config.intermediate_size
    if "sparse" in config.mlp_layer_types:
        if config.n_shared_experts:
            sizes["moe_intermediate_size * n_shared_experts"] = config.moe_intermediate_size * config.n_shared_experts
        if experts_split_by_tp(config):
            sizes["moe_intermediate_size"] = config.moe_intermediate_size
    errors += [f"tp={tp} does not divide {name}={value}" for name, value in sizes.items() if value % tp]
    vocab_error = vocab_split_error(config.vocab_size, tp)  # an uneven vocabulary split is fine, an empty rank not
    if vocab_error is not None:
        errors.append(vocab_error)
    if "sparse" in config.mlp_layer_types:
        experts = config.n_routed_experts
        if experts_split_by_tp(config) and experts % ep:
            errors.append(f"ep={ep} does not divide n_routed_experts={experts}")
        elif not experts_split_by_tp(config) and experts % (tp * ep):
            errors.append(f"tp × ep = {tp * ep} does not divide n_routed_experts={experts} (whole experts per rank)")
    elif ep != 1:
        errors.append(f"ep={ep}: the model has no routed experts (mlp_layer_types has no 'sparse' layer)")
    return errors


@dataclass
class Usage:
    """One rank's bytes at one (layout, context, batch)."""

    tp: int
    ep: int
    context: int
    batch: int
    weights: int
    kda_states: int
    attention_cache: int
    activations: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.kda_states + self.attention_cache + self.activations + self.reserve


class MemoryPlan:
    """Everything the plan needs from one config, computed once: the weight table of the meta model, the cache bytes
    per token in the chosen formats, the KDA state per sequence per tp size."""

    def __init__(
        self,
        source: Source,
        weights: str | None = None,
        kv_cache: str | None = None,
        indexer: str | None = None,
        mtp: bool | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        reserve: int = parse_bytes(DEFAULT_RESERVE),
    ):
        self.source = source
        spec = model_spec(source, mtp)
        self.config = config = spec.config
        configured = CacheFormats.from_config(config)  # a native config's own cache formats, else bf16
        kv_cache = configured.kv_cache if kv_cache is None else kv_cache
        indexer = configured.indexer if indexer is None else indexer
        packed = config.routed_expert_weight_format == "mxfp4"
        default = "mxfp4-experts" if packed else "bf16"
        weights = default if weights is None else weights
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights={weights!r} must be one of {WEIGHT_FORMATS}")
        if weights == "fp8" and spec.fp8_block is None:
            raise ValueError(
                f"weights='fp8' holds the FP8 weights of an FP8 checkpoint (fp8_weights='hold'); {source.name} is not "
                "one (its config has no FP8 quantization_config)"
            )
        if (weights == "mxfp4-experts") != packed:
            raise ValueError(
                f"weights={weights!r}: {source.name} loads its routed experts "
                f"{'packed MXFP4 (weights=mxfp4-experts)' if packed else 'unpacked (weights=bf16 or fp8)'}; the "
                "package keeps MXFP4 experts only as a checkpoint stores them"
            )
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        self.weights, self.kv_cache, self.indexer = weights, kv_cache, indexer
        self.prefill_chunk, self.reserve = prefill_chunk, reserve
        self.model = meta_model(config)
        self.entries = weight_entries(
            self.model, weights, spec.fp8_block or (128, 128), spec.held_from_checkpoint, source.raw.get("model_type")
        )
        self.table = weight_table(self.entries)
        self.per_token = attention_bytes_per_token(config, kv_cache, indexer)
        self.cache_formats = cache_format_table(config)
        self._kda = {}

    # -------------------------------------------------------------------------------------------------- counts
    def parameter_counts(self) -> dict[str, int]:
        """nn.Parameter elements (what `model.parameters()` counts), logical weights (packed MXFP4 bytes count two,
        scales none, buffers such as the router bias included), the MTP layers' share of the logical weights, and the
        weights one token reads in the trunk (`active_weights`: all but the routed experts, plus
        top-k / n_routed_experts of them; MTP layers excluded)."""
        config = self.config
        total = sum(e.weights for e in self.entries)
        trunk = [e for e in self.entries if not e.name.startswith("mtp.")]
        routed = sum(e.weights for e in trunk if e.group == "ep_tp")
        active = sum(e.weights for e in trunk) - routed
        if config.n_routed_experts:
            active += routed * config.num_experts_per_tok // config.n_routed_experts
        return {
            "parameters": sum(e.weights for e in self.entries if e.is_parameter),
            "weights": total,
            "mtp_weights": sum(e.weights for e in self.entries if e.name.startswith("mtp.")),
            "active_weights": active,
        }

    def kda_state(self, tp: int) -> int:
        if tp not in self._kda:
            self._kda[tp] = kda_state_bytes(self.model, tp)
        return self._kda[tp]

    def check_layout(self, tp: int, ep: int) -> None:
        errors = layout_errors(self.config, tp, ep)
        if errors:
            raise ValueError(f"{self.source.name}: " + "; ".join(errors))

    def rank_weights(self, tp: int, ep: int) -> dict[str, dict[str, int]]:
        return per_rank_weights(self.table, tp, ep)

    def usage(self, tp: int, ep: int, context: int, batch: int) -> Usage:
        weights = sum(sum(kinds.values()) for kinds in self.rank_weights(tp, ep).values())
        activations = activation_bytes(self.config, tp, ep, batch, context, self.prefill_chunk)["total"]
        return Usage(
            tp, ep, context, batch, weights, batch * self.kda_state(tp), batch * context * self.per_token,
            activations, self.reserve,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------------- searches
    def layouts(self, devices: int) -> list[tuple[int, int]]:
        """Every valid `(tp, ep)` with `tp · ep = devices`."""
        pairs = [(tp, devices // tp) for tp in range(1, devices + 1) if devices % tp == 0]
        return [(tp, ep) for tp, ep in pairs if not layout_errors(self.config, tp, ep)]

    def max_context(self, tp: int, ep: int, batch: int, memory: int) -> int:
        """The largest context (tokens per sequence, at most `max_position_embeddings`) whose usage fits; 0 if none."""
        return _largest(lambda c: self.usage(tp, ep, c, batch).total <= memory, self.config.max_position_embeddings)

    def max_batch(self, tp: int, ep: int, context: int, memory: int, limit: int = 1 << 20) -> int:
        return _largest(lambda b: self.usage(tp, ep, context, b).total <= memory, limit)

    def best_layout(self, devices: int, context: int, batch: int, memory: int) -> tuple[int, int]:
        """The valid layout of `devices` with the least usage at (context, batch). ValueError if none is valid."""
        layouts = self.layouts(devices)
        if not layouts:
            reasons = {f"tp={tp} ep={devices // tp}": layout_errors(self.config, tp, devices // tp)
                       for tp in range(1, devices + 1) if devices % tp == 0}  # fmt: skip
            raise ValueError(f"devices={devices}: no tp × ep layout splits {self.source.name}: {reasons}")
        return min(layouts, key=lambda layout: self.usage(*layout, context, batch).total)

    def smallest_devices(self, context: int, batch: int, memory: int, limit: int = 4096) -> tuple[int, int, int] | None:
        """The fewest devices (and their layout) on which (context, batch) fits; None up to `limit` devices."""
        for devices in range(1, limit + 1):
            for tp, ep in sorted(self.layouts(devices), key=lambda pair: self.usage(*pair, context, batch).total):
                if self.usage(tp, ep, context, batch).total <= memory:
                    return devices, tp, ep
        return None


def _largest(fits, limit: int) -> int:
    """The largest n in [0, limit] with fits(n) (fits monotone decreasing in n, fits(0) assumed)."""
    if not fits(1):
        return 0
    low, high = 1, limit
    if fits(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# ----------------------------------------------------------------------------------------------------- the report


def plan_report(
    source: str,
    devices: int | None = None,
    device_memory: str | int = "80GiB",
    context: int = 131072,
    batch: int = 1,
    tp: int | None = None,
    ep: int | None = None,
    weights: str | None = None,
    kv_cache: str | None = None,
    indexer: str | None = None,
    mtp: bool | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    reserve: str | int = DEFAULT_RESERVE,
) -> dict:
    """The plan as a dict (what `--json` prints). With `devices` (or `tp` / `ep`) the layout is fixed or chosen among
    that many devices; without, the smallest device count that fits (context, batch) is searched. ValueError names
    any bad input."""
    memory = parse_bytes(device_memory, "device_memory")
    reserve_bytes = parse_bytes(reserve, "reserve") if reserve not in (0, "0") else 0
    for name, value in (("context", context), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if devices is not None and devices < 1:
        raise ValueError(f"devices={devices} must be >= 1")
    fixed = tp is not None or ep is not None
    if fixed:
        tp, ep = tp or 1, ep or 1
        if devices is not None and devices != tp * ep:
            raise ValueError(f"devices={devices} != tp × ep = {tp} × {ep} = {tp * ep}")
    plan = MemoryPlan(read_source(source), weights, kv_cache, indexer, mtp, prefill_chunk, reserve_bytes)
    config = plan.config
    searched = None
    if fixed:
        plan.check_layout(tp, ep)
        devices = tp * ep
    elif devices is not None:
        tp, ep = plan.best_layout(devices, context, batch, memory)
    else:
        found = plan.smallest_devices(context, batch, memory)
        searched = found is not None
        if found is None:
            raise ValueError(
                f"{plan.source.name}: context={context} batch={batch} fits on no layout of up to 4096 devices"
            )
        devices, tp, ep = found
    usage = plan.usage(tp, ep, context, batch)
    rank = plan.rank_weights(tp, ep)
    counts = plan.parameter_counts()
    return {
        "source": plan.source.name,
        "config": plan.source.path,
        "weights_format": plan.weights,
        "kv_cache": plan.kv_cache,
        "indexer": plan.indexer,
        "layers": {
            "kda": config.layer_types.count(KDA_LAYER),
            "dsa": config.layer_types.count(DSA_LAYER),
            "mla": config.layer_types.count(MLA_LAYER),
            "mtp": config.num_mtp_layers,
        },
        **counts,
        "devices": devices,
        "tp": tp,
        "ep": ep,
        "smallest_devices_searched": searched,
        "device_memory": memory,
        "weights_whole_model": plan.table,
        "weights_per_rank": rank,
        "weights_per_rank_total": usage.weights,
        "kda_state_per_sequence_per_rank": plan.kda_state(tp),
        "kda_state_parts_per_sequence_per_rank": kda_state_parts(plan.model, tp),
        "attention_cache_per_token_per_rank": plan.per_token,
        "attention_cache_per_token_by_format": plan.cache_formats,
        "activations": activation_bytes(config, tp, ep, batch, context, prefill_chunk),
        "activation_formula": ACTIVATION_FORMULA,
        "prefill_chunk": prefill_chunk,
        "reserve": reserve_bytes,
        "context": context,
        "batch": batch,
        "usage": {
            "weights": usage.weights,
            "kda_states": usage.kda_states,
            "attention_cache": usage.attention_cache,
            "activations": usage.activations,
            "reserve": usage.reserve,
            "total": usage.total,
        },
        "fits": usage.total <= memory,
        "max_context_at_batch": plan.max_context(tp, ep, batch, memory),
        "max_position_embeddings": config.max_position_embeddings,
        "max_batch_at_context": plan.max_batch(tp, ep, context, memory),
    }


def _gib(n: int) -> str:
    """GiB with two decimals; a non-zero amount below 0.01 GiB in MiB (suffix M), so block scales stay visible."""
    if 0 < n < GiB / 100:
        return f"{n / 2**20:8.2f}M"
    return f"{n / GiB:9.2f}"


def format_report(report: dict) -> str:
    lines = [
        f"KDSA memory plan: {report['source']} ({report['config']})",
        f"  layers: {report['layers']['kda']} KDA, {report['layers']['dsa']} DSA, {report['layers']['mla']} dense MLA, "
        f"{report['layers']['mtp']} MTP; parameters {report['parameters'] / 1e9:.2f} B, logical weights "
        f"{report['weights'] / 1e9:.2f} B (MTP {report['mtp_weights'] / 1e9:.2f} B), active per token in the trunk "
        f"{report['active_weights'] / 1e9:.2f} B",
        f"  layout: {report['devices']} device(s) = tp {report['tp']} x ep {report['ep']}"
        + (" (smallest that fits)" if report["smallest_devices_searched"] else "")
        + f"; device memory {report['device_memory'] / GiB:.2f} GiB; weights {report['weights_format']}, "
        f"kv-cache {report['kv_cache']}, indexer {report['indexer']}",
        "",
        f"{'  weights per rank':<28}" + "".join(f"{g:>11}" for g in GROUPS) + "      total  (GiB; M = MiB)",
    ]
    rank = report["weights_per_rank"]
    for kind in FORMAT_KINDS:
        row = [rank[g][kind] for g in GROUPS]
        if any(row):
            lines.append(f"    {kind:<24}" + "".join(f"  {_gib(v)}" for v in row) + f"  {_gib(sum(row))}")
    totals = [sum(rank[g].values()) for g in GROUPS]
    lines.append(f"    {'total':<24}" + "".join(f"  {_gib(v)}" for v in totals) + f"  {_gib(sum(totals))}")
    lines += [
        "",
        f"  KDA state per sequence per rank: {report['kda_state_per_sequence_per_rank'] / 2**20:.2f} MiB = "
        f"short-conv window {report['kda_state_parts_per_sequence_per_rank']['conv_window'] / 2**20:.2f} MiB + fp32 "
        f"state {report['kda_state_parts_per_sequence_per_rank']['recurrent_state'] / 2**20:.2f} MiB",
        f"  DSA/MLA cache per token per rank: {report['attention_cache_per_token_per_rank']} bytes "
        f"({report['kv_cache']} latent, {report['indexer']} indexer keys); by format (latent/indexer):",
    ]
    for name, value in report["attention_cache_per_token_by_format"].items():
        lines.append(f"    {name:<12} {value if isinstance(value, str) else f'{value} bytes'}")
    act = report["activations"]
    lines += [
        f"  activations (prefill chunk {report['prefill_chunk']} tokens): {act['total'] / GiB:.2f} GiB = "
        + ", ".join(f"{k} {v / GiB:.2f}" for k, v in act.items() if k != "total"),
        f"    formula: {report['activation_formula']}",
        "",
        f"  at context {report['context']}, batch {report['batch']}: "
        + " + ".join(f"{k} {v / GiB:.2f}" for k, v in report["usage"].items() if k != "total")
        + f" = {report['usage']['total'] / GiB:.2f} GiB per rank -> {'fits' if report['fits'] else 'does NOT fit'}",
        f"  largest context at batch {report['batch']}: {report['max_context_at_batch']} tokens"
        + (
            " (= max_position_embeddings)"
            if report["max_context_at_batch"] == report["max_position_embeddings"]
            else ""
        ),
        f"  largest batch at context {report['context']}: {report['max_batch_at_context']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m modeling_kdsa.parallel.plan",
        description="Per-rank memory of a KDSA model over tp x ep devices (docs/memory-plan.md).",
    )
    parser.add_argument("source", help=f"a family name ({', '.join(FAMILIES)}), a checkpoint folder or a config.json")
    parser.add_argument("--devices", type=int, help="device count (default: the smallest that fits)")
    parser.add_argument("--device-memory", default="80GiB")
    parser.add_argument("--context", type=int, default=131072, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tp", type=int)
    parser.add_argument("--ep", type=int)
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, help="default: as the checkpoint loads by default")
    parser.add_argument("--kv-cache", choices=KV_CACHE_FORMATS, help="default: the config's own, else bf16")
    parser.add_argument("--indexer", choices=INDEXER_FORMATS, help="default: the config's own, else bf16")
    parser.add_argument("--no-mtp", action="store_true", help="plan without the MTP layers (num_mtp_layers=0)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="tokens per prefill forward")
    parser.add_argument("--reserve", default=DEFAULT_RESERVE, help="per-rank bytes set aside (runtime, fragmentation)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        report = plan_report(
            args.source, args.devices, args.device_memory, args.context, args.batch, args.tp, args.ep, args.weights,
            args.kv_cache, args.indexer, False if args.no_mtp else None, args.prefill_chunk, args.reserve,
        )  # fmt: skip
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
