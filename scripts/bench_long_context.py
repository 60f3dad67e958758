"""Long-context benchmark: KDSA vs transformers' DeepseekV32 / KimiLinear / Glm5Next on CPU, side by side in one run.

What it measures, at each context (default 4k, 16k, 64k; batch 1; bf16; `torch.inference_mode()`; median of a few
repeats after warm-up):
  1. one DSA layer's decode step: ours (index_topk 512), ours dense (index_topk >= context, same weights) and
     transformers' `DeepseekV32Attention` with the same dims and weights (eager, its own cache);
  2. whole-model decode step (tokens/s): KDSA vs transformers' `KimiLinear` (KDA + dense MLA) and `Glm5Next` text
     model (KDA + kpool DSA) of the closest possible shape;
  3. whole-model prefill at one context (default 16k): ours for real; the peers only when the estimated memory of
     their eager attention fits (`--max-prefill-gib`), otherwise skipped with the estimate;
  4. peak RSS growth per measurement, cache bytes per token, and the physical limit: bytes a decode step must read
     divided by this machine's memory bandwidth, measured in the same run, as the fraction of it achieved;
  5. graph mode (torch.compile) on/off and cold/warm compile time: LATER, printed as "n/a (not implemented)".

Long caches are not filled by prefill (a 64k eager prefill would allocate [H, T, T]): each model's cache is filled
directly with random tensors of the right shapes and dtypes through the cache's update API, then decode is timed.

Usage:  .venv/bin/python scripts/bench_long_context.py [--quick] [--contexts 4096 16384 65536] [--out PATH]
Writes JSON (default runs/bench_long_context.json) and prints one table per section.
"""

import argparse
import copy
import ctypes
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch import nn
from tqdm import tqdm
from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_dsv32
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa import KDSAConfig, KDSAForCausalLM  # noqa: E402
from modeling_kdsa.cache import KDSACache, KDSAPagedLayer  # noqa: E402
from modeling_kdsa.configuration_kdsa import DSA_LAYER  # noqa: E402
from modeling_kdsa.dsa import KDSASparseAttention  # noqa: E402
from modeling_kdsa.rotary import KDSARotaryEmbedding  # noqa: E402

DTYPE = torch.bfloat16
BATCH = 1
GIB = 1024**3


# ---------------------------------------------------------------------------------------------------------------
# Configs: ours (the benchmark shape = KDSAConfig defaults) and the peers of the closest possible shape


def kdsa_config() -> KDSAConfig:
    """The benchmark shape is exactly KDSAConfig's defaults (`--quick` keeps it and only shrinks the contexts).
    Only the position limit is raised (default 65536) so that 64k cached tokens plus the decode steps fit; with
    default RoPE this changes no computation."""
    return KDSAConfig(max_position_embeddings=1 << 17)


def kimi_linear_config(config: KDSAConfig) -> KimiLinearConfig:
    """KimiLinear (KDA + dense NoPE MLA) with our dims. Its MLA layers replace our DSA layers one for one."""
    layer_types = ["full_attention" if t == DSA_LAYER else "linear_attention" for t in config.layer_types]
    return KimiLinearConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        n_shared_experts=config.n_shared_experts,
        num_local_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        routed_scaling_factor=config.routed_scaling_factor,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        linear_num_heads=config.linear_num_heads,
        linear_head_dim=config.linear_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        layer_types=layer_types,
        mlp_layer_types=list(config.mlp_layer_types),
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def glm5_next_config(config: KDSAConfig) -> Glm5NextTextConfig:
    """Glm5Next text model (KDA + NoPE MLA with a kpool DSA indexer) with our dims where its config allows."""
    return Glm5NextTextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        n_shared_experts=config.n_shared_experts,
        n_routed_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        routed_scaling_factor=config.routed_scaling_factor,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        # NoPE is enforced: keep the q·k width (nope + rope) by giving all of it to the nope part.
        qk_nope_head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
        qk_rope_head_dim=0,
        v_head_dim=config.v_head_dim,
        index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
        linear_num_heads=config.linear_num_heads,
        linear_head_dim=config.linear_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        layer_types=list(config.layer_types),
        mlp_layer_types=list(config.mlp_layer_types),
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=None,
    )


def deepseek_v32_layer_config(config: KDSAConfig) -> DeepseekV32Config:
    """A one-layer DeepseekV32 config whose attention has exactly our DSA dims."""
    return DeepseekV32Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        index_n_heads=config.index_n_heads,
        index_head_dim=config.index_head_dim,
        index_topk=config.index_topk,
        rope_parameters=dict(config.rope_parameters),
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        n_routed_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_group=1,
        topk_group=1,
    )


def shape_mapping(ours: KDSAConfig, kimi: KimiLinearConfig, glm: Glm5NextTextConfig) -> list[tuple[str, str, str, str]]:
    """(field, ours, KimiLinear, Glm5Next) rows for the printed mapping."""

    def dsa_layers(types):
        return sum(t in (DSA_LAYER, "full_attention") for t in types)

    def experts(c):
        routed = getattr(c, "n_routed_experts", None) or c.num_local_experts
        return f"{routed} (top-{c.num_experts_per_tok}, {c.moe_intermediate_size}, {c.n_shared_experts})"

    rows = [
        ("hidden / layers", f"{ours.hidden_size} / {ours.num_hidden_layers}", "", ""),
        (
            "KDA : attention layers",
            f"{ours.num_hidden_layers - dsa_layers(ours.layer_types)} : {dsa_layers(ours.layer_types)} DSA",
            f"{kimi.num_hidden_layers - dsa_layers(kimi.layer_types)} : {dsa_layers(kimi.layer_types)} dense MLA",
            f"{glm.num_hidden_layers - dsa_layers(glm.layer_types)} : {dsa_layers(glm.layer_types)} kpool DSA",
        ),
        ("MLA heads", str(ours.num_attention_heads), str(kimi.num_attention_heads), str(glm.num_attention_heads)),
        ("q_lora / kv_lora", *(f"{c.q_lora_rank} / {c.kv_lora_rank}" for c in (ours, kimi, glm))),
        (
            "qk nope / rope / v",
            f"{ours.qk_nope_head_dim} / {ours.qk_rope_head_dim} / {ours.v_head_dim}",
            f"{kimi.qk_nope_head_dim} / {kimi.qk_rope_head_dim} (no RoPE applied) / {kimi.v_head_dim}",
            f"{glm.qk_nope_head_dim} / {glm.qk_rope_head_dim} (NoPE enforced) / {glm.v_head_dim}",
        ),
        ("KDA heads x dim", *(f"{c.linear_num_heads} x {c.linear_head_dim}" for c in (ours, kimi, glm))),
        (
            "indexer heads x dim / topk",
            f"{ours.index_n_heads} x {ours.index_head_dim} / {ours.index_topk}",
            "no indexer",
            f"{glm.index_n_heads} x {glm.index_head_dim} / {glm.index_topk} (pools of {glm.index_kpool} + tail)",
        ),
        ("experts (top-k, width, shared)", *(experts(c) for c in (ours, kimi, glm))),
        ("dense FFN layers", *(str(c.mlp_layer_types.count("dense")) for c in (ours, kimi, glm))),
        (
            "residual stream",
            f"Block AttnRes (block {ours.attn_res_block_size})",
            "plain",
            f"hyper-connections x{glm.hc_mult} (their default)",
        ),
        ("vocab", *(str(c.vocab_size) for c in (ours, kimi, glm))),
    ]  # fmt: skip
    return rows


UNMATCHED = [
    "KimiLinear: dense MLA (no indexer, no top-k), no RoPE in MLA (it still caches the rope key), plain residual.",
    "Glm5Next: NoPE MLA is enforced (qk_rope_head_dim=0), so qk_nope_head_dim = 64 + 32 = 96 keeps the q.k width; "
    "its indexer scores pools of 16 tokens (index_kpool) plus the tail and caches [key | pool gate | valid] per "
    "token; hyper-connections (hc_mult 4) instead of AttnRes; SwiGLU clamp; no lm_head in the text model (the "
    "benchmark adds one Linear(hidden, vocab) so that all three compute logits).",
    "Ours: Block AttnRes (block 4) has no counterpart in either peer.",
]


# ---------------------------------------------------------------------------------------------------------------
# Builders


def build_kdsa(config: KDSAConfig) -> KDSAForCausalLM:
    # `_from_config(dtype=bf16)` keeps the model's fp32 modules (gates, router, indexer head weights) in fp32.
    return KDSAForCausalLM._from_config(config, dtype=DTYPE).eval()


def build_peer_kimi_linear(config: KimiLinearConfig, attn_implementation: str) -> KimiLinearForCausalLM:
    return KimiLinearForCausalLM._from_config(config, dtype=DTYPE, attn_implementation=attn_implementation).eval()


class Glm5NextTextLM(nn.Module):
    """Glm5Next's text model plus an lm_head (transformers has no text-only causal LM class for it), so that its
    decode step computes logits like the other two."""

    def __init__(self, config: Glm5NextTextConfig, attn_implementation: str):
        super().__init__()
        self.model = Glm5NextTextModel._from_config(config, dtype=DTYPE, attn_implementation=attn_implementation)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=DTYPE)
        self.config = self.model.config

    def forward(self, input_ids, cache=None, use_cache=True, logits_to_keep=1):
        hidden = self.model(input_ids=input_ids, cache=cache, use_cache=use_cache).last_hidden_state
        return self.lm_head(hidden[:, -logits_to_keep:])


def build_peer_glm5_next(config: Glm5NextTextConfig, attn_implementation: str) -> Glm5NextTextLM:
    return Glm5NextTextLM(config, attn_implementation).eval()


def build_dsa_layer(config: KDSAConfig, layer_idx: int, source: KDSASparseAttention | None = None):
    """Our DSA layer in bf16 with the indexer head weights in fp32 (as in the model); weights copied from `source`."""
    layer = KDSASparseAttention(config, layer_idx).to(DTYPE)
    layer.indexer.weights_proj.float()
    if source is None:
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith("norm.bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02)
    else:
        layer.load_state_dict(source.state_dict(), strict=True)
    return layer.eval()


def build_dense_dsa_layer(source: KDSASparseAttention, config: KDSAConfig, num_keys: int):
    """Ours dense: the same layer and weights with index_topk >= every key it will see, so top-k keeps them all."""
    dense_config = copy.deepcopy(config)
    dense_config.index_topk = num_keys
    return build_dsa_layer(dense_config, source.layer_idx, source)


def build_peer_deepseek_v32_attention(source: KDSASparseAttention, config: DeepseekV32Config):
    config._attn_implementation = "eager"
    layer = hf_dsv32.DeepseekV32Attention(config, layer_idx=0).to(DTYPE).eval()
    layer.load_state_dict(source.state_dict(), strict=True)  # DeepSeek parameter names on both sides
    return layer


# ---------------------------------------------------------------------------------------------------------------
# Cache access: the only code that knows what each cache stores. KDSA's cache is the paged `KDSACache` when the
# package has it, else transformers' `DynamicCache`: `new_kdsa_cache`, `fill_cache_kdsa`, `cached_tokens` and
# `cache_bytes` handle both, and nothing else in this script looks inside a cache.


def _random(shape, dtype, generator, scale=1.0):
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * scale).to(dtype)


def _fill_kda_layer(cache, layer_idx, channels, conv_width, num_heads, head_k_dim, head_v_dim, generator):
    """A KDA layer's state: conv state `[B, channels, W]` (bf16; the last W pre-conv q|k|v inputs) and the fp32
    recurrent state `[B, H, K, V]`. The first `update_conv_state` marks the layer as having a previous state."""
    conv = _random((BATCH, channels, conv_width), DTYPE, generator)
    cache.update_conv_state(conv, layer_idx, conv_kernel_size=conv_width)
    state = _random((BATCH, num_heads, head_k_dim, head_v_dim), torch.float32, generator, scale=0.1)
    cache.update_recurrent_state(state, layer_idx)


def _fill_latent(cache, layer_idx, context, kv_lora_rank, rope_dim, generator):
    """MLA latent `[B, 1, S, C]` as keys and the rope key `[B, 1, S, R]` as values (R may be 0)."""
    latent = _random((BATCH, 1, context, kv_lora_rank), DTYPE, generator)
    k_rope = _random((BATCH, 1, context, rope_dim), DTYPE, generator)
    cache.update(latent, k_rope, layer_idx)


def new_kdsa_cache(config: KDSAConfig) -> KDSACache:
    return KDSACache(config)


def fill_cache_kdsa(config: KDSAConfig, context: int, seed: int = 0, layers: list[int] | None = None):
    """KDSA cache holding `context` tokens (only the layers in `layers`, if given).

    DSA layers (paged `KDSACache`): rows `[c | k_pe]` `[B, S, C+R]` and indexer keys `[B, S, DI]` through the paged
    layer's `append` (the model-level token count through `begin_forward`). KDA layers: conv state
    `[B, 2HK+HV, W]` and fp32 recurrent state `[B,H,K,V]`."""
    generator = torch.Generator().manual_seed(seed)
    cache = new_kdsa_cache(config)
    for idx, layer_type in enumerate(config.layer_types):
        if layers is not None and idx not in layers:
            continue
        if layer_type == DSA_LAYER:
            rows = _random((BATCH, context, config.kv_lora_rank + config.qk_rope_head_dim), DTYPE, generator)
            cache.layers[idx].append(rows, _random((BATCH, context, config.index_head_dim), DTYPE, generator))
        else:
            heads, dim = config.linear_num_heads, config.linear_head_dim
            channels = 3 * heads * dim
            _fill_kda_layer(cache, idx, channels, config.linear_conv_kernel_dim, heads, dim, dim, generator)
    cache.begin_forward(context)
    return cache


def cached_tokens(cache, layer_idx: int) -> int:
    """Tokens held by one attention layer of any of these caches (the next decode position)."""
    return cache.layers[layer_idx].get_seq_length()


def fill_cache_kimi_linear(config: KimiLinearConfig, context: int, seed: int = 0):
    """KimiLinear: MLA layers are plain `DynamicLayer`s holding the latent and rope key; KDA layers as ours."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=config)
    for idx, layer_type in enumerate(config.layer_types):
        if layer_type == "full_attention":
            _fill_latent(cache, idx, context, config.kv_lora_rank, config.qk_rope_head_dim, generator)
        else:
            heads, dim = config.linear_num_heads, config.linear_head_dim
            _fill_kda_layer(cache, idx, 3 * heads * dim, config.linear_conv_kernel_dim, heads, dim, dim, generator)
    return cache


def fill_cache_glm5_next(config: Glm5NextTextConfig, context: int, seed: int = 0):
    """Glm5Next: MLA latent (NoPE: an empty rope key) and, via `update_indexer`, packed per-token indexer states
    `[B, S, DI (key) + DI (pool gate score) + 1 (valid flag = 1)]`; KDA layers as ours."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=config)
    for idx, layer_type in enumerate(config.layer_types):
        if layer_type == "indexed_attention":
            _fill_latent(cache, idx, context, config.kv_lora_rank, config.qk_rope_head_dim, generator)
            keys_and_gates = _random((BATCH, context, 2 * config.index_head_dim), DTYPE, generator)
            valid = torch.ones(BATCH, context, 1, dtype=DTYPE)
            cache.update_indexer(torch.cat([keys_and_gates, valid], dim=-1), idx)
        else:
            heads, dim = config.linear_num_heads, config.linear_head_dim
            _fill_kda_layer(cache, idx, 3 * heads * dim, config.linear_conv_kernel_dim, heads, dim, dim, generator)
    return cache


def fill_cache_deepseek_v32_layer(config: DeepseekV32Config, context: int, seed: int = 0):
    """One DeepseekV32 indexed layer: latent, rope key and indexer keys `[B, S, DI]`."""
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=config)
    _fill_latent(cache, 0, context, config.kv_lora_rank, config.qk_rope_head_dim, generator)
    cache.update_indexer(_random((BATCH, context, config.index_head_dim), DTYPE, generator), 0)
    return cache


def cache_bytes(cache) -> list[dict]:
    """Per cache layer: `kind`, bytes that grow with the context (`per_token_bytes`, split into `latent` = keys +
    values and `indexer`) and fixed state bytes (`state_bytes`: conv + recurrent). Paged layers also report
    `allocated_bytes` (the page pool, which grows by doubling). Layers left empty are omitted."""
    layers = []
    for layer in cache.layers:
        if isinstance(layer, KDSAPagedLayer):
            if not layer.is_initialized:
                continue
            itemsize = layer.kv_pages.element_size()
            latent, indexer = layer.kv_width * itemsize, layer.index_width * itemsize
            layers.append(
                dict(
                    kind="indexed",
                    state_bytes=0,
                    per_token_bytes=latent + indexer,
                    latent_bytes=latent,
                    indexer_bytes=indexer,
                    allocated_bytes=layer.memory_bytes()["allocated"],
                )
            )
            continue
        if isinstance(layer, LinearAttentionCacheLayerMixin):  # KDA: transformers' layer or our replay layer
            states = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
            layers.append(dict(kind="linear", state_bytes=sum(t.nbytes for t in states), per_token_bytes=0))
            continue
        assert isinstance(layer, DynamicLayer), type(layer)
        seq_len = layer.get_seq_length()
        if seq_len == 0:  # a layer left empty (single-layer measurements fill only the layer they time)
            continue
        latent = (layer.keys.nbytes + layer.values.nbytes) / seq_len
        indexer = layer.indexer_keys.nbytes / seq_len if isinstance(layer, DynamicIndexedLayer) else 0.0
        kind = "indexed" if isinstance(layer, DynamicIndexedLayer) else "dense"
        layers.append(
            dict(kind=kind, state_bytes=0, per_token_bytes=latent + indexer, latent_bytes=latent, indexer_bytes=indexer)
        )
    return layers


# ---------------------------------------------------------------------------------------------------------------
# Measurement helpers


def _malloc_trim():
    """Give freed heap pages back to the OS (glibc) so that RSS before a measurement is not inflated."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM (peak RSS) to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident-set growth of this process during a block: VmHWM after minus VmRSS before, with VmHWM reset
    at the start (/proc/self/clear_refs). Falls back to `ru_maxrss` (lifetime peak), which only grows, when the
    reset is unavailable; `method` says which. Measures host memory actually touched (weights are already
    resident), so it is the working set a step adds: activations, the cache copy DynamicCache makes per step, etc."""

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self.before_kib = _proc_status_kib("VmRSS")
        self.resettable = _reset_peak_rss() and self.before_kib is not None
        self.lifetime_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return self

    def __exit__(self, *exc):
        if self.resettable:
            self.growth_bytes = max(0, (_proc_status_kib("VmHWM") - self.before_kib) * 1024)
            self.method = "VmHWM-after minus VmRSS-before (peak reset via /proc/self/clear_refs)"
        else:
            lifetime_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.growth_bytes = max(0, (lifetime_after - self.lifetime_before_kib) * 1024)
            self.method = "growth of ru_maxrss (lifetime peak; 0 when below an earlier peak)"
        return False


def time_repeated(step, warmup: int, repeats: int) -> dict:
    """Median and all wall-clock times (s) of `step()` after `warmup` untimed calls, with the peak RSS growth."""
    for _ in range(warmup):
        step()
    times = []
    with PeakRSS() as peak:
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    return dict(median_s=statistics.median(times), times_s=times, peak_rss_growth_bytes=peak.growth_bytes)


def measure_bandwidth(size_mib: int = 512, repeats: int = 5) -> dict:
    """Memory bandwidth with torch's threads: a large fp32 reduction (bytes read / time) and a large copy
    ((bytes read + bytes written) / time); median of `repeats`, GB/s = 1e9 bytes/s. The buffer is far larger than
    the caches, so this is DRAM bandwidth. The physical limit below uses the larger of the two."""
    numel = size_mib * 1024 * 1024 // 4
    src = torch.empty(numel, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    src.sum()
    read_times, copy_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        read_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - start)
    read_gbs = src.nbytes / statistics.median(read_times) / 1e9
    copy_gbs = 2 * src.nbytes / statistics.median(copy_times) / 1e9
    return dict(buffer_mib=size_mib, read_gbs=read_gbs, copy_gbs=copy_gbs, best_gbs=max(read_gbs, copy_gbs))


# ---------------------------------------------------------------------------------------------------------------
# Timed operations


def time_dsa_decode_step(layer, context: int, warmup: int, repeats: int, fill_cache, rotary) -> dict:
    """Decode step of one DSA layer (ours or DeepseekV32) on a cache holding `context` tokens. Each call appends
    one token, so the context grows by warmup + repeats tokens during the measurement (negligible)."""
    cache = fill_cache(context)
    generator = torch.Generator().manual_seed(1)
    hidden = _random((BATCH, 1, layer.hidden_size), DTYPE, generator)
    is_ours = isinstance(layer, KDSASparseAttention)

    def step():
        position = cached_tokens(cache, layer.layer_idx)
        position_ids = torch.full((BATCH, 1), position, dtype=torch.long)
        position_embeddings = rotary(hidden, position_ids)
        if is_ours:
            return layer(hidden, position_embeddings=position_embeddings, cache=cache)
        # DeepseekV32 takes an additive 4-D mask [B, 1, T, S+T]; all zeros = every cached key visible.
        mask = torch.zeros(BATCH, 1, 1, position + 1, dtype=DTYPE)
        return layer(hidden, position_embeddings, mask, cache=cache, position_ids=position_ids)[0]

    result = time_repeated(step, warmup, repeats)
    result["cache_bytes"] = cache_bytes(cache)
    return result


def time_model_decode(model, cache, warmup: int, repeats: int) -> dict:
    """One-token decode step of a whole model (backbone + lm_head on that token) on a pre-filled cache."""
    token = torch.tensor([[7]], dtype=torch.long)

    def step():
        return model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)

    result = time_repeated(step, warmup, repeats)
    result["tokens_per_s"] = 1.0 / result["median_s"]
    return result


def time_prefill(model, make_cache, context: int, warmup_tokens: int, repeats: int, budget_s: float) -> dict:
    """Real prefill of `context` tokens into a fresh cache (logits for the last token only).

    A short prefill of `warmup_tokens` runs first (warm-up); its time scaled linearly to `context` is the estimate.
    When that estimate exceeds `budget_s` (0 = no limit) the long prefill is not run and the estimate is reported
    instead, marked as such (linear scaling ignores the indexer's O(T^2) scoring, so it is a lower bound)."""
    generator = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (BATCH, context), generator=generator)
    start = time.perf_counter()
    model(input_ids=ids[:, :warmup_tokens], cache=make_cache(), use_cache=True, logits_to_keep=1)
    estimate_s = (time.perf_counter() - start) * context / warmup_tokens
    if budget_s and estimate_s * repeats > budget_s:
        return dict(
            skipped=True,
            estimated_s=estimate_s,
            reason=f"estimated >= {estimate_s:.0f} s (linear from {warmup_tokens} tokens) > budget {budget_s:g} s",
        )

    def step():
        return model(input_ids=ids, cache=make_cache(), use_cache=True, logits_to_keep=1)

    result = time_repeated(step, 0, repeats)
    result["tokens_per_s"] = context / result["median_s"]
    result["estimated_s_before_run"] = estimate_s
    return result


def time_graph_mode(model, config: KDSAConfig, contexts: list[int], warmup: int, repeats: int, quick: bool) -> dict:
    """Graph mode on/off: the same model decoding with the paged DSA kernels under torch.compile (cache built with
    `kernel_backend="compiled"`) vs eager fused kernels (`"cpu"`), per context; plus cold vs warm compile time of
    those kernels in two fresh processes sharing one new inductor cache directory (scripts/bench_dsa_kernels.py)."""
    spec = importlib.util.spec_from_file_location("bench_dsa_kernels", Path(__file__).with_name("bench_dsa_kernels.py"))
    bench_dsa_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_dsa_kernels)

    eager_config, compiled_config = copy.deepcopy(config), copy.deepcopy(config)
    eager_config.kernel_backend, compiled_config.kernel_backend = "cpu", "compiled"
    rows = []
    for context in contexts:
        eager = time_model_decode(model, fill_cache_kdsa(eager_config, context), warmup, repeats)
        # One extra warm-up step: the first compiled call compiles (or loads from the on-disk cache).
        compiled = time_model_decode(model, fill_cache_kdsa(compiled_config, context), warmup + 1, repeats)
        rows.append(dict(context=context, eager_s=eager["median_s"], compiled_s=compiled["median_s"]))
    return dict(decode=rows, compile=bench_dsa_kernels.compile_times(quick))


def dsa_layer_prefill_memory(config: KDSAConfig, context: int) -> dict:
    """Peak RSS a single DSA layer's prefill of `context` tokens adds (bf16, fresh paged store, query blocks):
    the working set on top of its input hidden states."""
    layer = build_dsa_layer(config, config.layer_types.index(DSA_LAYER))
    generator = torch.Generator().manual_seed(3)
    hidden = _random((BATCH, context, config.hidden_size), DTYPE, generator)
    position_ids = torch.arange(context).unsqueeze(0)
    rotary = KDSARotaryEmbedding(config)
    with PeakRSS() as peak:
        start = time.perf_counter()
        layer(hidden, position_embeddings=rotary(hidden, position_ids), cache=KDSACache(config))
        seconds = time.perf_counter() - start
    return dict(context=context, seconds=seconds, peak_rss_growth_bytes=peak.growth_bytes)


def prefill_attention_bytes(num_heads: int, context: int, extra_per_pair: int, attn_implementation: str) -> int:
    """Peak bytes of an attention prefill at `context` tokens. Eager: per (head, query, key) the bf16 scores (2),
    their masked copy (2) alive while softmax writes fp32 (4) -> ~6 bytes live per element. sdpa: no per-head
    scores (its CPU kernel is blocked). Both: `extra_per_pair` bytes per (query, key) for masks built outside the
    heads. An estimate, counted before running anything."""
    per_head = 6 * num_heads if attn_implementation == "eager" else 0
    return (per_head + extra_per_pair) * context * context


def estimate_peer_prefill_bytes(kind: str, config, context: int, attn_implementation: str) -> int:
    if kind == "KimiLinear":
        return prefill_attention_bytes(config.num_attention_heads, context, 2, attn_implementation)  # bf16 mask
    # Glm5Next: int32 selection counts (4) + bool mask (1) + bf16 additive mask (2) per (query, key); the
    # indexer's pooled scores are smaller ([T, HI, T/kpool] fp32).
    return prefill_attention_bytes(config.num_attention_heads, context, 4 + 1 + 2, attn_implementation)


# ---------------------------------------------------------------------------------------------------------------
# Bytes a decode step must read


def parameter_bytes_touched_per_token(model: nn.Module, top_k: int, num_experts: int) -> dict:
    """Weights one decode token must read: every parameter in full, except the embedding table (one row) and the
    stacked routed experts (`*.experts.*`, `[E, ...]`: only top_k / E of them)."""
    total = dense = routed_touched = embedding_row = 0
    for name, param in model.named_parameters():
        total += param.nbytes
        if name.endswith("embed_tokens.weight"):
            embedding_row += param.nbytes // param.shape[0]
        elif ".experts." in name and param.dim() == 3 and param.shape[0] == num_experts:
            routed_touched += param.nbytes * top_k // num_experts
        else:
            dense += param.nbytes
    return dict(
        total_parameter_bytes=total,
        dense_bytes=dense,
        routed_expert_bytes_touched=routed_touched,
        embedding_row_bytes=embedding_row,
        touched_bytes=dense + routed_touched + embedding_row,
    )


def bytes_per_decode_step(weight_bytes: int, cache_layers: list[dict], context: int, selected: int | None) -> dict:
    """Bytes one decode step at `context` cached tokens must read (a lower bound on memory traffic):

        bytes = W_touched + Σ_KDA state_bytes + Σ_indexed (S · indexer_bytes_per_token + K · latent_bytes_per_token)
                + Σ_dense S · latent_bytes_per_token

    W_touched: dense weights + top_k/E of the routed experts + one embedding row (lm_head in full).
    state_bytes: KDA conv state + fp32 recurrent state (read once; the write-back is not counted).
    Indexed (DSA) layers read the indexer keys over the whole context and only the K = min(selected, S) latent
    rows top-k picks (`selected=None` means every row, i.e. dense attention); dense MLA reads all S latent rows.
    """
    state = sum(layer["state_bytes"] for layer in cache_layers if layer["kind"] == "linear")
    indexer = latent = 0.0
    for layer in cache_layers:
        if layer["kind"] == "indexed":
            rows = context if selected is None else min(selected, context)
            indexer += context * layer["indexer_bytes"]
            latent += rows * layer["latent_bytes"]
        elif layer["kind"] == "dense":
            latent += context * layer["latent_bytes"]
    cache_read = state + indexer + latent
    return dict(
        weight_bytes=weight_bytes,
        kda_state_bytes=state,
        indexer_bytes=indexer,
        latent_bytes=latent,
        cache_read_bytes=cache_read,
        total_bytes=weight_bytes + cache_read,
    )


def physical_limit(bytes_needed: float, measured_s: float, bandwidth_gbs: float) -> dict:
    limit_s = bytes_needed / (bandwidth_gbs * 1e9)
    return dict(limit_s=limit_s, fraction_achieved=limit_s / measured_s)


def layer_weight_bytes(layer: nn.Module) -> int:
    return sum(p.nbytes for p in layer.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Output


def fmt_ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_bytes(num) -> str:
    if num is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num) >= size:
            return f"{num / size:.2f} {unit}"
    return f"{num:.0f} B"


def fmt_ctx(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print(line)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def print_report(report: dict) -> None:
    env, bw = report["environment"], report["bandwidth"]
    print(
        f"\nKDSA long-context benchmark: torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['threads']} threads, {env['dtype']}, batch {BATCH}, peers' attention = {env['peer_attention']}, "
        f"KDSA cache = {env['kdsa_cache']}"
    )
    print(
        f"memory bandwidth ({bw['buffer_mib']} MiB buffer): read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} "
        f"GB/s -> {bw['best_gbs']:.1f} GB/s used for the physical limit"
    )

    peers = report["peers"]
    rows = [list(r) for r in peers["mapping"]]
    rows.append(["parameters", *(f"{peers['parameters'][k] / 1e6:.1f} M" for k in ("KDSA", "KimiLinear", "Glm5Next"))])
    print_table("Shape mapping (ours -> peers)", ["field", "KDSA", "KimiLinear", "Glm5Next"], rows)
    for note in peers["unmatched"]:
        print(f"  not matched: {note}")

    rows = []
    for entry in report["dsa_layer_decode"]:
        for name in ("ours", "ours_dense", "DeepseekV32"):
            r = entry[name]
            rows.append(
                [
                    fmt_ctx(entry["context"]),
                    name,
                    fmt_ms(r["median_s"]),
                    fmt_bytes(r["bytes_needed"]["total_bytes"]),
                    fmt_ms(r["limit"]["limit_s"]),
                    f"{r['limit']['fraction_achieved']:.1%}",
                    fmt_bytes(r["peak_rss_growth_bytes"]),
                ]
            )
    print_table(
        "1. One DSA layer, decode step (ms)",
        ["context", "layer", "ms/step", "bytes must read", "limit ms", "of limit", "peak RSS +"],
        rows,
    )

    rows = []
    for entry in report["model_decode"]:
        for name, r in entry["models"].items():
            rows.append(
                [
                    fmt_ctx(entry["context"]),
                    name,
                    fmt_ms(r["median_s"]),
                    f"{r['tokens_per_s']:.2f}",
                    fmt_bytes(r["bytes_needed"]["total_bytes"]),
                    fmt_ms(r["limit"]["limit_s"]),
                    f"{r['limit']['fraction_achieved']:.1%}",
                    fmt_bytes(r["peak_rss_growth_bytes"]),
                ]
            )
    print_table(
        "2. Whole-model decode step",
        ["context", "model", "ms/token", "tokens/s", "bytes must read", "limit ms", "of limit", "peak RSS +"],
        rows,
    )

    prefill = report["prefill"]
    rows = []
    for name, r in prefill["models"].items():
        if r.get("skipped"):
            rows.append([name, "skipped", "-", "-", r["reason"]])
            continue
        rows.append(
            [name, f"{r['median_s']:.2f}", f"{r['tokens_per_s']:.0f}", fmt_bytes(r["peak_rss_growth_bytes"]), ""]
        )
    print_table(
        f"3. Whole-model prefill of {fmt_ctx(prefill['context'])} tokens",
        ["model", "s", "tokens/s", "peak RSS +", "note"],
        rows,
    )

    rows = []
    for name, c in report["cache"].items():
        rows.append(
            [
                name,
                f"{c['per_token_bytes']:.0f}",
                fmt_bytes(c["fixed_state_bytes"]),
                fmt_bytes(c["bytes_at_largest_context"]),
                fmt_bytes(c["paged_pool_bytes"]),
            ]
        )
    largest = fmt_ctx(report["contexts"][-1])
    headers = ["model", "bytes/token", "fixed KDA state", f"total at {largest}", "paged pool allocated"]
    print_table("4. Cache size (paged pool: after the timed steps; it grows by doubling)", headers, rows)

    graph = report["graph_mode"]
    rows = [
        [fmt_ctx(r["context"]), fmt_ms(r["eager_s"]), fmt_ms(r["compiled_s"]), f"{r['eager_s'] / r['compiled_s']:.2f}x"]
        for r in graph["decode"]
    ]
    print_table("5. Graph mode: whole-model decode step, DSA kernels eager vs torch.compile", ["context", "eager",
                "compiled", "speed-up"], rows)  # fmt: skip
    cold, warm = graph["compile"]["cold"], graph["compile"]["warm"]
    print_table(
        "   compile time of the DSA kernels in a fresh process (inductor on-disk cache empty / filled)",
        ["", "compile+run s", "process s", "fx-graph cache hits/misses"],
        [
            ["cold", f"{cold['seconds']:.1f}", f"{cold['process_seconds']:.1f}",
             f"{cold['fx_graph_cache_hits']}/{cold['fx_graph_cache_misses']}"],
            ["warm", f"{warm['seconds']:.1f}", f"{warm['process_seconds']:.1f}",
             f"{warm['fx_graph_cache_hits']}/{warm['fx_graph_cache_misses']}"],
        ],
    )  # fmt: skip
    memory = report["dsa_layer_prefill_memory"]
    print(
        f"\n6. One DSA layer's {fmt_ctx(memory['context'])}-token prefill: {memory['seconds']:.1f} s, "
        f"peak RSS +{fmt_bytes(memory['peak_rss_growth_bytes'])}"
    )
    print(f"\npeak RSS: {report['memory_method']}; process peak RSS {fmt_bytes(report['process_peak_rss_bytes'])}")
    print(
        f"load average at start / end: {env['load_average_at_start'][0]:.2f} / {env['load_average_at_end'][0]:.2f} "
        f"(this machine has {env['cpu_count']} cores; other processes make the timings noisy); "
        f"wall {env['wall_s']:.0f} s"
    )


# ---------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="cached tokens (default 4k 16k 64k)")
    parser.add_argument("--prefill-context", type=int, default=None, help="prefill length (default 16384)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-repeats", type=int, default=1)
    parser.add_argument("--max-prefill-gib", type=float, default=12.0, help="skip a peer prefill estimated above this")
    parser.add_argument(
        "--prefill-budget-s",
        type=float,
        default=300.0,
        help="skip a prefill whose estimated time exceeds this (0: never)",
    )
    parser.add_argument(
        "--peer-attn", default="eager", choices=["eager", "sdpa"], help="peers' attention backend for decode"
    )
    parser.add_argument(
        "--peer-prefill-attn",
        default="eager",
        choices=["eager", "sdpa"],
        help="peers' attention backend for the prefill (eager by default: with sdpa, KimiLinear's 16k prefill was "
        "OOM-killed on a 24 GiB machine, its torch KDA fallback and masks exceeding the estimate)",
    )
    parser.add_argument("--layer-prefill-context", type=int, default=None, help="DSA-layer prefill (default 32768)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_long_context.json"))
    parser.add_argument("--quick", action="store_true", help="tiny contexts (256, 512), 1 repeat: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [256, 512]
        args.prefill_context = args.prefill_context or 128
        args.layer_prefill_context = args.layer_prefill_context or 512
        args.warmup, args.repeats = 2, 2
    args.contexts = sorted(args.contexts or [4096, 16384, 65536])
    args.prefill_context = args.prefill_context or 16384
    args.layer_prefill_context = args.layer_prefill_context or 32768
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)  # restored below: main() may run inside another process (tests)
    torch.manual_seed(0)
    report = dict(
        contexts=args.contexts,
        environment=dict(
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            machine=platform.machine(),
            cpu_count=os.cpu_count(),
            threads=torch.get_num_threads(),
            dtype=str(DTYPE).removeprefix("torch."),
            batch=BATCH,
            peer_attention=args.peer_attn,
            kdsa_cache="KDSACache (paged)",
            warmup=args.warmup,
            repeats=args.repeats,
            quick=args.quick,
            load_average_at_start=os.getloadavg(),
        ),
    )
    try:
        with torch.inference_mode():
            run_all(args, report)
    finally:
        torch.set_num_threads(previous_threads)
    report["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["environment"]["load_average_at_end"] = os.getloadavg()
    report["environment"]["wall_s"] = time.perf_counter() - started

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nJSON written to {out}")
    return report


def run_all(args, report: dict) -> None:
    contexts = args.contexts
    # Progress: bandwidth + builds, 3 layer variants and 3 models per context, 3 prefills.
    progress = tqdm(total=2 + 6 * len(contexts) + 3, desc="bench", unit="step", file=sys.stderr)

    def advance(label: str):
        progress.set_postfix_str(label)
        progress.update(1)

    report["bandwidth"] = measure_bandwidth()
    advance("bandwidth")

    config = kdsa_config()
    kimi_config, glm_config = kimi_linear_config(config), glm5_next_config(config)
    models = {
        "KDSA": build_kdsa(config),
        "KimiLinear": build_peer_kimi_linear(kimi_config, args.peer_attn),
        "Glm5Next": build_peer_glm5_next(glm_config, args.peer_attn),
    }
    fillers = {
        "KDSA": lambda s: fill_cache_kdsa(config, s),
        "KimiLinear": lambda s: fill_cache_kimi_linear(kimi_config, s),
        "Glm5Next": lambda s: fill_cache_glm5_next(glm_config, s),
    }
    new_caches = {
        "KDSA": lambda: new_kdsa_cache(config),
        "KimiLinear": lambda: DynamicCache(config=kimi_config),
        "Glm5Next": lambda: DynamicCache(config=glm_config),
    }
    # Top-k rows a decode step reads per indexed layer (None = all): Glm5Next adds an incomplete tail pool.
    selected = {
        "KDSA": config.index_topk,
        "KimiLinear": None,
        "Glm5Next": glm_config.index_topk + glm_config.index_kpool - 1,
    }
    experts = {
        "KDSA": (config.num_experts_per_tok, config.n_routed_experts),
        "KimiLinear": (kimi_config.num_experts_per_tok, kimi_config.num_local_experts),
        "Glm5Next": (glm_config.num_experts_per_tok, glm_config.n_routed_experts),
    }
    weights = {name: parameter_bytes_touched_per_token(m, *experts[name]) for name, m in models.items()}
    report["config"] = config.to_diff_dict() | {"layer_types": config.layer_types}
    report["peers"] = dict(
        mapping=shape_mapping(config, kimi_config, glm_config),
        parameters={name: sum(p.numel() for p in m.parameters()) for name, m in models.items()},
        weights=weights,
        unmatched=UNMATCHED,
        kimi_linear_config=kimi_config.to_diff_dict(),
        glm5_next_config=glm_config.to_diff_dict(),
    )

    dsa_idx = config.layer_types.index(DSA_LAYER)
    ours_layer = build_dsa_layer(config, dsa_idx)
    dsv32_config = deepseek_v32_layer_config(config)
    dsv32_layer = build_peer_deepseek_v32_attention(ours_layer, dsv32_config)
    our_rotary = KDSARotaryEmbedding(config)
    dsv32_rotary = hf_dsv32.DeepseekV32RotaryEmbedding(dsv32_config)
    advance("built models")

    bandwidth = report["bandwidth"]["best_gbs"]
    report["dsa_layer_decode"], report["model_decode"] = [], []
    cache_summary = {}
    for context in contexts:
        entry = dict(context=context)
        fill_ours = lambda s: fill_cache_kdsa(config, s, layers=[dsa_idx])  # noqa: E731
        fill_dsv32 = lambda s: fill_cache_deepseek_v32_layer(dsv32_config, s)  # noqa: E731
        dense_layer = build_dense_dsa_layer(ours_layer, config, context + args.warmup + args.repeats + 1)
        variants = {
            "ours": (ours_layer, fill_ours, our_rotary, config.index_topk),
            "ours_dense": (dense_layer, fill_ours, our_rotary, None),
            "DeepseekV32": (dsv32_layer, fill_dsv32, dsv32_rotary, config.index_topk),
        }  # fmt: skip
        for name, (layer, fill, rotary, top_k) in variants.items():
            result = time_dsa_decode_step(layer, context, args.warmup, args.repeats, fill, rotary)
            layer_cache = [c for c in result.pop("cache_bytes") if c["kind"] != "linear" or c["state_bytes"]]
            result["bytes_needed"] = bytes_per_decode_step(layer_weight_bytes(layer), layer_cache, context, top_k)
            result["limit"] = physical_limit(result["bytes_needed"]["total_bytes"], result["median_s"], bandwidth)
            entry[name] = result
            advance(f"{fmt_ctx(context)} layer {name}")
        del dense_layer
        report["dsa_layer_decode"].append(entry)

        model_entry = dict(context=context, models={})
        for name, model in models.items():
            cache = fillers[name](context)
            result = time_model_decode(model, cache, args.warmup, args.repeats)
            layers = cache_bytes(cache)  # after the steps: a paged pool may have grown (per-token bytes do not)
            result["bytes_needed"] = bytes_per_decode_step(
                weights[name]["touched_bytes"], layers, context, selected[name]
            )
            result["limit"] = physical_limit(result["bytes_needed"]["total_bytes"], result["median_s"], bandwidth)
            model_entry["models"][name] = result
            cache_summary[name] = dict(
                per_token_bytes=sum(c["per_token_bytes"] for c in layers),
                fixed_state_bytes=sum(c["state_bytes"] for c in layers),
                bytes_at_largest_context=sum(c["per_token_bytes"] for c in layers) * context
                + sum(c["state_bytes"] for c in layers),
                paged_pool_bytes=sum(c.get("allocated_bytes", 0) for c in layers) or None,
                layers=layers,
            )
            del cache
            advance(f"{fmt_ctx(context)} model {name}")
        report["model_decode"].append(model_entry)
    report["cache"] = cache_summary

    prefill = dict(context=args.prefill_context, max_gib=args.max_prefill_gib, models={})
    warmup_tokens = min(1024, args.prefill_context // 4)
    prefill["peer_attention"] = args.peer_prefill_attn
    for name, model in models.items():
        if name != "KDSA":
            estimate = estimate_peer_prefill_bytes(name, model.config, args.prefill_context, args.peer_prefill_attn)
            if estimate > args.max_prefill_gib * GIB:
                prefill["models"][name] = dict(
                    skipped=True,
                    estimated_bytes=estimate,
                    reason=f"{args.peer_prefill_attn} attention would allocate ~{estimate / GIB:.0f} GiB > "
                    f"{args.max_prefill_gib:g} GiB",
                )
                advance(f"prefill {name} skipped")
                continue
            if args.peer_prefill_attn != args.peer_attn:
                backbone = model if isinstance(model, KimiLinearForCausalLM) else model.model
                backbone.set_attn_implementation(args.peer_prefill_attn)  # same weights, other attention kernel
        prefill["models"][name] = time_prefill(
            model, new_caches[name], args.prefill_context, warmup_tokens, args.prefill_repeats, args.prefill_budget_s
        )
        advance(f"prefill {name}")
    report["prefill"] = prefill
    progress.close()

    report["graph_mode"] = time_graph_mode(models["KDSA"], config, contexts, args.warmup, args.repeats, args.quick)
    report["dsa_layer_prefill_memory"] = dsa_layer_prefill_memory(config, args.layer_prefill_context)
    report["memory_method"] = _memory_method_text()


def _memory_method_text() -> str:
    if _reset_peak_rss():
        return (
            "growth of the process's peak RSS during the timed repeats (VmHWM reset through /proc/self/clear_refs "
            "before, VmRSS before subtracted; freed heap returned with malloc_trim first); weights and the filled "
            "cache were already resident, so it is the extra working set of a step"
        )
    return "growth of getrusage ru_maxrss (lifetime peak): 0 whenever an earlier measurement peaked higher"


if __name__ == "__main__":
    main()
