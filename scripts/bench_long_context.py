"""Long-context benchmark: KDSA vs transformers' DeepseekV32 / KimiLinear / Glm5Next on CPU, side by side in one run.

What it measures, at each context (default 4k, 16k, 64k; batch 1; bf16; `torch.inference_mode()`). Every
comparison interleaves its two (or three) sides step by step, A B A B ..., in batches of `--repeats` rounds, and
takes more batches until each batch's ratio (the median of its pair-by-pair ratios) moves by at most 10 % from the
previous batch's (at most `--max-batches`; prefill: `--prefill-max-batches`); the JSON holds min and median times,
the batches run, whether the 10 % criterion was met and the spread of the pair-by-pair ratios (`steadiness`):
  1. one DSA layer's decode step: ours (index_topk 512) eager and compiled (the layer's step as the compiled decode
     step runs it: static cache, fixed-shape kernels, inductor), ours dense (index_topk >= context, same weights) and
     transformers' `DeepseekV32Attention` with the same dims and weights (eager, its own cache), each as a % of its
     limit: the bytes the step must read (`dsa_layer_bytes_per_step`: indexer keys, selected rows, the layer's
     weights) over the bandwidth measured in the same run (`--dsa-layer-only` runs this section alone);
  2. whole-model decode step (tokens/s): KDSA at its benchmark shape (KDSAConfig defaults), and two same-weight
     pairs: transformers builds `KimiLinearForCausalLM` and `Glm5NextForConditionalGeneration` in the bench size with
     their families' components, saves them, and `KDSAForCausalLM.from_pretrained` loads those folders. Each pair
     decodes from identical caches (one set of random tensors written into both; `fill_same_caches`): the speed-up,
     and whether both pick the same greedy tokens over `--token-steps` steps, in bf16 (as timed) and in fp32 copies
     of the same weights (bf16 logits tie often enough that two correct implementations may pick different tokens);
  3. whole-model prefill at one context (default 16k): ours for real; each same-weight pair interleaved (peer /
     KDSA ratio) when the estimated memory of the peer's attention (`--peer-prefill-attn`, e.g. sdpa at 4k) fits
     (`--max-prefill-gib`), otherwise the peer is skipped with the estimate; then each pair prefills one real prompt
     (`--token-prompt`) and generates greedily, fp32 and bf16: same tokens or not;
  4. peak RSS growth per measurement, cache bytes per token, and the physical limit: bytes a decode step must read
     divided by this machine's memory bandwidth, measured in the same run, as the fraction of it achieved;
  5. graph mode (torch.compile) on/off for the DSA kernels, and cold/warm compile time in fresh processes; and at the
     smallest and largest context the whole decode step eager (paged and static cache) vs compiled by generate()'s
     own compile call (also timed with dynamo's guard evaluation skipped, measured only), with an operator profile
     (top operators, aten calls per step) of each (scripts/bench_graph_mode.py) and the compiled step's fraction of the
     bandwidth limit; the same for the decode step compiled ahead of time (`modeling_kdsa.aot`, one AOTInductor
     package per static-cache capacity, timed through the model's forward as generate() calls it; `--skip-aot`
     leaves it out); --quick sizes both contexts' static caches alike, so the step compiles once.

Long caches are not filled by prefill (a 64k eager prefill would allocate [H, T, T]): caches are filled directly with
random tensors of the right shapes and dtypes through each cache's update API, then decode is timed. A pair is
skipped at a context where the peer's eager decode step is estimated above `--max-peer-decode-gib`.

Usage:  .venv/bin/python scripts/bench_long_context.py [--quick] [--contexts 4096 16384 65536] [--out PATH]
Writes JSON (default runs/bench_long_context.json) and prints one table per section.
"""

import argparse
import copy
import ctypes
import functools
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from torch import nn
from tqdm import tqdm
from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_dsv32
from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from modeling_kdsa import KDSAConfig, KDSAForCausalLM  # noqa: E402
from modeling_kdsa.cache import KDSACache, KDSAPagedKPoolLayer, KDSAPagedLayer, KDSAPagedMLALayer  # noqa: E402
from modeling_kdsa.configuration_kdsa import DSA_LAYER, KDA_LAYER  # noqa: E402
from modeling_kdsa.dsa import KDSASparseAttention  # noqa: E402
from modeling_kdsa.rotary import KDSARotaryEmbedding  # noqa: E402
from modeling_kdsa.static_cache import KDSAStaticCache  # noqa: E402

DTYPE = torch.bfloat16
BATCH = 1
GIB = 1024**3


# ---------------------------------------------------------------------------------------------------------------
# Configs: ours (the benchmark shape = KDSAConfig defaults) and the same-weight peers in two families' shapes


def kdsa_config(quick: bool = False) -> KDSAConfig:
    """The benchmark shape is exactly KDSAConfig's defaults. Only the position limit is raised (default 65536) so
    that 64k cached tokens plus the decode steps fit; with default RoPE this changes no computation. `quick` (the
    smoke run) keeps the layer layout, the attention and indexer dims and top-k, and narrows the rest (hidden 256,
    4 KDA heads, FFN widths, vocab 2048) so that its six models build in seconds."""
    if not quick:
        return KDSAConfig(max_position_embeddings=1 << 17)
    return KDSAConfig(
        max_position_embeddings=1 << 17, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        linear_num_heads=4, vocab_size=2048,
    )  # fmt: skip


# Same-weight peers: the bench size in two published families' shapes. transformers builds each model, saves it,
# and KDSA loads that folder with `KDSAForCausalLM.from_pretrained` (docs/checkpoint-conversion.md §1), so both
# sides of a comparison compute with the same weights.
FAMILIES = ("kimi_linear", "glm5_next")
PEER_NAMES = {"kimi_linear": "KimiLinear", "glm5_next": "Glm5Next"}


def _kda_and_attention_layers(config: KDSAConfig) -> tuple[list[int], list[int]]:
    """Indices of our KDA layers and of our DSA layers (3 : 1 in the bench shape)."""
    attention = [i for i, t in enumerate(config.layer_types) if t == DSA_LAYER]
    return [i for i in range(config.num_hidden_layers) if i not in attention], attention


def kimi_linear_config(config: KDSAConfig) -> KimiLinearConfig:
    """Kimi-Linear's architecture at the bench size: dense NoPE MLA where our DSA layers are (written as Moonshot's
    config.json does, 1-based `kda_layers` / `full_attn_layers`), no query LoRA, Kimi's routed scaling 2.446 and
    norm eps 1e-5; our widths everywhere else."""
    kda, attention = _kda_and_attention_layers(config)
    return KimiLinearConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        num_experts=config.n_routed_experts, num_shared_experts=config.n_shared_experts,
        num_experts_per_token=config.num_experts_per_tok, num_expert_group=1, topk_group=1,
        kv_lora_rank=config.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=config.qk_rope_head_dim,
        qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim,
        first_k_dense_replace=config.mlp_layer_types.count("dense"), model_max_length=config.max_position_embeddings,
        routed_scaling_factor=2.446, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        linear_attn_config={
            "kda_layers": [i + 1 for i in kda], "full_attn_layers": [i + 1 for i in attention],
            "num_heads": config.linear_num_heads, "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim,
        },
    )  # fmt: skip


def glm5_next_config(config: KDSAConfig) -> Glm5NextConfig:
    """GLM-5.3-Flash's architecture at the bench size, its components on: NoPE MLA (the q.k width 64 + 32 all
    NoPE), k-pool indexer over pools of 4 tokens with the tail always selected, mHC with 4 streams, SwiGLU clamp 10,
    KDA forget-gate lower bound -5; our widths and top-k 512 everywhere else. Every DSA layer has its own indexer:
    KDSA's shared-indexer layer must follow a DSA layer directly, which the 3 : 1 layout never has. A one-block
    vision tower (transformers' class needs one; KDSA skips it)."""
    text = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
        n_routed_experts=config.n_routed_experts, n_shared_experts=config.n_shared_experts,
        num_experts_per_tok=config.num_experts_per_tok, routed_scaling_factor=2.5,
        kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim, qk_rope_head_dim=0,
        v_head_dim=config.v_head_dim, index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk, index_kpool=4, index_kpool_always_select_tail=True,
        linear_num_heads=config.linear_num_heads, linear_head_dim=config.linear_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim, layer_types=list(config.layer_types),
        mlp_layer_types=list(config.mlp_layer_types), max_position_embeddings=config.max_position_embeddings,
        swiglu_limit=10.0, linear_lower_bound=-5.0, hc_mult=4, pad_token_id=None,
    )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=config.hidden_size,
        projection_intermediate_size=32, patch_size=2, image_size=8, spatial_merge_size=1, temporal_patch_size=1,
    )  # fmt: skip
    return Glm5NextConfig(text_config=text, vision_config=vision)


def deepseek_v32_layer_config(config: KDSAConfig) -> DeepseekV32Config:
    """A one-layer DeepseekV32 config whose attention has exactly our DSA dims."""
    shared = (
        "vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps",
        "max_position_embeddings", "n_routed_experts", "num_experts_per_tok",
    )  # fmt: skip
    return DeepseekV32Config(
        **{name: getattr(config, name) for name in shared},  # named alike in both configs
        num_hidden_layers=1,
        num_key_value_heads=config.num_attention_heads,
        rope_parameters=dict(config.rope_parameters),
        n_group=1,
        topk_group=1,
    )


# ---------------------------------------------------------------------------------------------------------------
# Builders


def build_kdsa(config: KDSAConfig) -> KDSAForCausalLM:
    # `_from_config(dtype=bf16)` keeps the model's fp32 modules (gates, router, indexer head weights) in fp32.
    return KDSAForCausalLM._from_config(config, dtype=DTYPE).eval()


class SameWeightPair(NamedTuple):
    """transformers' model of one family and KDSA's load of the folder it saved."""

    family: str
    peer: nn.Module
    kdsa: KDSAForCausalLM
    checkpoint_bytes: int


def perturb_constants(model: nn.Module, seed: int = 0) -> None:
    """Noise on every tensor initialised to one value (norm weights, biases, k-pool and mHC constants), so that the
    comparison runs on weights where a wrong mapping would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if tensor.is_floating_point() and tensor.numel() > 0 and bool((tensor == tensor.flatten()[0]).all()):
                noise = 0.1 * torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensor.add_(noise.to(tensor.dtype))


def build_same_weight_pair(family: str, config: KDSAConfig, folder: Path, attn_implementation: str) -> SameWeightPair:
    """transformers' model of `family` at the bench size (bf16), saved to `folder` in the hub layout, and
    `KDSAForCausalLM.from_pretrained(folder, dtype=bf16)`: the same weights on both sides. Every weight is rounded
    to bf16 first, so that the ones either side keeps in fp32 hold the same values too."""
    torch.manual_seed(0)
    if family == "kimi_linear":
        peer_class, peer_config = KimiLinearForCausalLM, kimi_linear_config(config)
    else:
        peer_class, peer_config = Glm5NextForConditionalGeneration, glm5_next_config(config)
    peer = peer_class._from_config(peer_config, dtype=DTYPE, attn_implementation=attn_implementation).eval()
    perturb_constants(peer)
    with torch.no_grad():  # transformers keeps some weights in fp32 (GLM's KDA conv) that KDSA holds in bf16
        for param in peer.parameters():
            param.copy_(param.to(DTYPE))
    peer.save_pretrained(folder)
    kdsa = KDSAForCausalLM.from_pretrained(folder, dtype=DTYPE).eval()
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return SameWeightPair(family, peer, kdsa, size)


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


def fill_cache_kdsa(
    config: KDSAConfig, context: int, seed: int = 0, layers: list[int] | None = None, capacity: int | None = None
):
    """KDSA cache holding `context` tokens (only the layers in `layers`, if given): a paged `KDSACache`, or with
    `capacity` a `KDSAStaticCache` of that many tokens (the compiled decode step's cache).

    DSA layers: rows `[c | k_pe]` `[B, S, C+R]` and indexer keys `[B, S, DI]` through the paged layer's `append`
    (the model-level token count through `begin_forward`). KDA layers: conv state `[B, 2HK+HV, W]` and fp32 recurrent
    state `[B,H,K,V]`."""
    generator = torch.Generator().manual_seed(seed)
    cache = new_kdsa_cache(config) if capacity is None else KDSAStaticCache(config, capacity)
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


def fill_same_caches(
    pair: SameWeightPair, context: int, seed: int = 0, dtype: torch.dtype = DTYPE
) -> tuple[DynamicCache, KDSACache]:
    """transformers' cache and ours holding the same `context` tokens: one set of random tensors written into both
    through their update APIs, so both models decode from identical state.

    KDA layers: conv state `[B, 2HK+HV, W]` (bf16, q|k|v channels, the last W pre-conv inputs) and fp32 recurrent
    state `[B, H, K, V]`. Attention layers: the normalised latent `[B, 1, S, C]` and the (unrotated) rope key
    `[B, 1, S, R]` (R = 0 for GLM) as transformers' keys / values, `[c | k_pe]` rows in our paged store. A DSA layer
    adds the indexer rows: GLM's k-pool indexer caches `[key | gate scores | valid = 1]` per token, ours
    `[key | gate scores]` and pools each complete pool of 4 on append with the layer's own `index_kpool_compress_ape`;
    a shared-indexer layer caches the latent only, on both sides. `dtype`: of everything but the fp32 KDA state."""
    config = pair.kdsa.config
    generator = torch.Generator().manual_seed(seed)
    theirs, ours = DynamicCache(config=pair.peer.config.get_text_config()), KDSACache(config)
    for idx, layer_type in enumerate(config.layer_types):
        if layer_type == KDA_LAYER:
            heads, dim, width = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
            conv = _random((BATCH, 3 * heads * dim, width), dtype, generator)
            state = _random((BATCH, heads, dim, dim), torch.float32, generator, scale=0.1)
            for cache in (theirs, ours):  # copies: transformers' decode updates its conv state in place
                cache.update_conv_state(conv.clone(), idx, conv_kernel_size=width)
                cache.update_recurrent_state(state.clone(), idx)
            continue
        latent = _random((BATCH, 1, context, config.kv_lora_rank), dtype, generator)
        k_rope = _random((BATCH, 1, context, config.qk_rope_head_dim), dtype, generator)
        theirs.update(latent, k_rope, idx)
        rows = torch.cat([latent, k_rope], dim=-1).view(BATCH, context, -1)
        store = ours.layers[idx]
        if isinstance(store, KDSAPagedKPoolLayer):
            index_rows = _random((BATCH, context, 2 * config.index_head_dim), dtype, generator)
            theirs.update_indexer(torch.cat([index_rows, torch.ones(BATCH, context, 1, dtype=dtype)], dim=-1), idx)
            ape = pair.kdsa.model.layers[idx].self_attn.indexer.index_kpool_compress_ape
            store.append(rows, index_rows, None, ape)
        elif isinstance(store, KDSAPagedLayer):
            index_keys = _random((BATCH, context, config.index_head_dim), dtype, generator)
            theirs.update_indexer(index_keys, idx)
            store.append(rows, index_keys)
        else:
            store.append(rows)
    ours.begin_forward(context)
    return theirs, ours


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
        if isinstance(layer, KDSAPagedMLALayer):  # ours: dense MLA, DSA, or DSA with the k-pool indexer
            if not layer.is_initialized:
                continue
            itemsize = layer.kv_pages.element_size()
            latent = layer.kv_width * itemsize
            indexer = sum(layer.row_widths[1:]) * itemsize  # indexer key (k-pool: key + gate scores)
            if isinstance(layer, KDSAPagedKPoolLayer):
                indexer += layer.index_width * itemsize / layer.index_kpool  # one pooled key per pool
            layers.append(
                dict(
                    kind="indexed" if isinstance(layer, KDSAPagedLayer) else "dense",
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


STEADY_TOLERANCE = 0.10  # stop once every ratio moved by at most this between consecutive batches


def time_repeated(step, warmup: int, repeats: int, max_batches: int = 1) -> dict:
    """Median, min and all wall-clock times (s) of `step()` after `warmup` untimed calls, with the peak RSS growth.

    With `max_batches > 1` the steps run in batches of `repeats` until two consecutive batches' medians agree within
    STEADY_TOLERANCE (a step timed alone has no partner to interleave with), and the median is taken over those two
    batches: a transient left by the previous measurement (cold caches, pages) does not set it. `steadiness` records
    the batches, their medians and whether they agreed; without agreement the median is over every timed step."""
    for _ in range(warmup):
        step()
    times, batch_medians, last_change = [], [], None
    with PeakRSS() as peak:
        for _ in range(max_batches):
            batch = []
            for _ in range(repeats):
                start = time.perf_counter()
                step()
                batch.append(time.perf_counter() - start)
            times += batch
            batch_medians.append(statistics.median(batch))
            if len(batch_medians) >= 2:
                last_change = abs(batch_medians[-1] / batch_medians[-2] - 1)
                if last_change <= STEADY_TOLERANCE:
                    break
    met = last_change is not None and last_change <= STEADY_TOLERANCE
    steady = times[-2 * repeats :] if met else times
    return dict(
        median_s=statistics.median(steady), min_s=min(times), times_s=times, peak_rss_growth_bytes=peak.growth_bytes,
        steadiness=dict(batches=len(batch_medians), batch_rounds=repeats, max_batches=max_batches, criterion_met=met,
                        tolerance=STEADY_TOLERANCE, batch_medians_s=batch_medians,
                        last_change=last_change),
    )  # fmt: skip


def time_interleaved(steps: dict, warmup: int, batch: int, max_batches: int) -> tuple[dict, dict]:
    """Time the named `steps` (callables; the first is the reference) in turns, A B A B ..., so that every step sees
    the same machine state. After `warmup` untimed rounds (each step's first call, warm-up or timed, runs under its
    own `PeakRSS`), batches of `batch` rounds run until each batch's ratio to the reference (the median of its
    pair-by-pair ratios) is within `STEADY_TOLERANCE` of the previous batch's, i.e. two independent measurements
    agree (at least two batches), or `max_batches` ran.

    Returns `(results, steadiness)`: per step its median, min and all times (s) and the peak RSS growth of one call;
    `steadiness` says how many batches ran, whether the criterion was met, each batch's ratio and, per
    non-reference step, the spread of all pair-by-pair ratios (min, median, max)."""
    names = list(steps)
    peaks = {}

    def call(name):
        if name in peaks:
            steps[name]()
            return
        with PeakRSS() as peak:
            steps[name]()
        peaks[name] = peak.growth_bytes

    for _ in range(warmup):
        for name in names:
            call(name)
    times = {name: [] for name in names}
    history = []
    met = False
    for _ in range(max_batches):
        for _ in range(batch):
            for name in names:
                start = time.perf_counter()
                call(name)
                times[name].append(time.perf_counter() - start)
        # This batch's own ratio (median of its pair-by-pair ratios), independent of the earlier batches'.
        batch_ratios = {
            name: statistics.median(t / r for t, r in zip(times[name][-batch:], times[names[0]][-batch:], strict=True))
            for name in names[1:]
        }
        history.append(batch_ratios)
        if len(history) >= 2 and all(
            abs(history[-1][name] / history[-2][name] - 1) <= STEADY_TOLERANCE for name in names[1:]
        ):
            met = True
            break
    results = {
        name: dict(median_s=statistics.median(values), min_s=min(values), times_s=values,
                   peak_rss_growth_bytes=peaks[name])
        for name, values in times.items()
    }  # fmt: skip
    pair_ratios = {}
    for name in names[1:]:
        ratios = [t / r for t, r in zip(times[name], times[names[0]], strict=True)]
        pair_ratios[name] = dict(min=min(ratios), median=statistics.median(ratios), max=max(ratios),
                                 relative_spread=(max(ratios) - min(ratios)) / statistics.median(ratios))  # fmt: skip
    steadiness = dict(
        reference=names[0],
        batches=len(history),
        batch_rounds=batch,
        max_batches=max_batches,
        tolerance=STEADY_TOLERANCE,
        criterion_met=met,
        ratio_per_batch=history,
        last_change=max((abs(history[-1][n] / history[-2][n] - 1) for n in names[1:]), default=0.0)
        if len(history) >= 2
        else None,
        pair_ratios=pair_ratios,
    )
    return results, steadiness


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


def dsa_decode_stepper(layer, context: int, fill_cache, rotary):
    """`(step, cache)`: a decode step of one DSA layer (ours or DeepseekV32) on a cache holding `context` tokens.
    Each call appends one token, so the context grows by the number of steps timed (negligible)."""
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

    return step, cache


def compiled_dsa_decode_stepper(layer, context: int, fill_cache, rotary):
    """`(step, cache)` as `dsa_decode_stepper`, for our layer's decode step as the compiled whole-model step runs it:
    a `KDSAStaticCache` (`fill_cache` builds one), the fixed-shape kernels, inductor, one graph (docs/graph-mode.md
    §2, §3). The layer alone is compiled here, not inside generate()'s model graph. The first call, which compiles,
    runs here, untimed."""
    cache = fill_cache(context)
    hidden = _random((BATCH, 1, layer.hidden_size), DTYPE, torch.Generator().manual_seed(1))

    def layer_step(hidden, cache):
        position_ids = cache.get_seq_length().view(1, 1).expand(BATCH, 1)
        position_embeddings = rotary(hidden, position_ids)
        cache.begin_forward(1)
        return layer(hidden, position_embeddings=position_embeddings, cache=cache)

    compiled = torch.compile(layer_step, fullgraph=True, dynamic=False)
    compiled(hidden, cache)
    return (lambda: compiled(hidden, cache)), cache


def model_decode_stepper(model, cache):
    """`(step, record)`: greedy one-token decode steps of a whole model (backbone + lm_head on that token) on a
    pre-filled cache, starting from token 7; `record` collects every step's greedy token, its margin (top-1 minus
    top-2 logit) and the first step's logits."""
    token = torch.tensor([[7]], dtype=torch.long)
    record = dict(tokens=[], margins=[], first_logits=None)

    def step():
        nonlocal token
        logits = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        top2 = logits.topk(2, dim=-1)
        token = top2.indices[:, :1]
        record["tokens"].append(int(token))
        record["margins"].append(float(top2.values[0, 0] - top2.values[0, 1]))
        if record["first_logits"] is None:
            record["first_logits"] = logits[0]

    return step, record


def time_model_decode(model, cache, warmup: int, repeats: int, extra_steps: int = 0, max_batches: int = 1) -> dict:
    """`model_decode_stepper` timed alone: `warmup` untimed steps, `repeats` timed ones (in batches until steady, see
    `time_repeated`), then `extra_steps` untimed ones. Returns the timings, every step's greedy token and margin, and
    the first step's logits."""
    step, record = model_decode_stepper(model, cache)
    result = time_repeated(step, warmup, repeats, max_batches)
    for _ in range(extra_steps):
        step()
    result.update(tokens_per_s=1.0 / result["median_s"], tokens=record["tokens"], margins=record["margins"])
    result["first_logits"] = record["first_logits"]  # dropped before the JSON is written
    return result


def time_prefill(model, make_cache, context: int, warmup_tokens: int, repeats: int, budget_s: float) -> dict:
    """Real prefill of `context` tokens into a fresh cache (logits for the last token only).

    A short prefill of `warmup_tokens` runs first (warm-up); its time scaled linearly to `context` is the estimate.
    When that estimate exceeds `budget_s` (0 = no limit) the long prefill is not run and the estimate is reported
    instead, marked as such (linear scaling ignores the indexer's O(T^2) scoring, so it is a lower bound)."""
    generator = torch.Generator().manual_seed(2)
    vocab = model.config.get_text_config().vocab_size
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


def prefill_stepper(model, context: int, warmup_tokens: int):
    """`(step, estimate_s)`: a real prefill of `context` tokens into a fresh cache (logits for the last token only),
    after one short prefill of `warmup_tokens` (warm-up) whose time scaled linearly to `context` is the estimate."""
    generator = torch.Generator().manual_seed(2)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (BATCH, context), generator=generator)
    if isinstance(model, KDSAForCausalLM):
        make_cache = lambda: KDSACache(model.config)  # noqa: E731
    else:
        make_cache = lambda: DynamicCache(config=model.config.get_text_config())  # noqa: E731
    start = time.perf_counter()
    model(input_ids=ids[:, :warmup_tokens], cache=make_cache(), use_cache=True, logits_to_keep=1)
    estimate_s = (time.perf_counter() - start) * context / warmup_tokens

    def step():
        return model(input_ids=ids, cache=make_cache(), use_cache=True, logits_to_keep=1)

    return step, estimate_s


def time_graph_mode(model, config: KDSAConfig, contexts: list[int], warmup: int, repeats: int, quick: bool) -> dict:
    """Graph mode on/off: the same model decoding with the paged DSA kernels under torch.compile (cache built with
    `kernel_backend="compiled"`) vs eager fused kernels (`"cpu"`), per context; plus cold vs warm compile time of
    those kernels in two fresh processes sharing one new inductor cache directory (scripts/bench_dsa_kernels.py)."""
    eager_config, compiled_config = copy.deepcopy(config), copy.deepcopy(config)
    eager_config.kernel_backend, compiled_config.kernel_backend = "cpu", "compiled"
    rows = []
    for context in contexts:
        eager = time_model_decode(model, fill_cache_kdsa(eager_config, context), warmup, repeats)
        # One extra warm-up step: the first compiled call compiles (or loads from the on-disk cache).
        compiled = time_model_decode(model, fill_cache_kdsa(compiled_config, context), warmup + 1, repeats)
        rows.append(dict(context=context, eager_s=eager["median_s"], compiled_s=compiled["median_s"]))
    return dict(decode=rows, compile=sibling_script("bench_dsa_kernels").compile_times(quick))


def whole_step_figures(
    model, config: KDSAConfig, context: int, repeats: int, capacity: int | None = None, aot_dir: Path | None = None
) -> dict:
    """The whole decode step eager (paged `KDSACache`, and `KDSAStaticCache`) vs compiled by generate()'s own compile
    call on the static cache, interleaved per repeat, with an operator profile of each (scripts/bench_graph_mode.py,
    docs/graph-mode.md §6). `capacity`: the static caches' size (default: sized to `context`). `aot_dir`: where the
    AOTInductor packages of the step go (one per capacity, docs/graph-mode.md §14); None: no package."""
    return sibling_script("bench_graph_mode").measure_context(
        model, config, context, repeats, capacity=capacity, aot_dir=aot_dir
    )


def whole_step_section(model, config: KDSAConfig, args, model_decode: list[dict], bandwidth: float) -> list[dict]:
    """Sections 5b and 5c: `whole_step_figures` at the smallest context (the graph-mode ratio) and the largest, each
    route's fraction of the bandwidth limit against the same bytes per step as section 2's eager KDSA decode at that
    context (`model_decode`); the AOTInductor package unless `args.skip_aot`. --quick: one static-cache capacity for
    both contexts, so the step compiles once and one package serves both (a second capacity recompiles the step: ~40
    s of the smoke test on a slow machine). The full run sizes each cache to its context: a dense MLA layer reads its
    cache's whole capacity, so a 64k-sized cache would slow the 4k step."""
    contexts = args.contexts
    shared_capacity = (
        sibling_script("bench_graph_mode").static_capacity(max(contexts), args.whole_step_repeats)
        if args.quick
        else None
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-aot-") as aot_dir:
        for context in sorted({contexts[0], contexts[-1]}):
            figures = whole_step_figures(
                model, config, context, args.whole_step_repeats, shared_capacity,
                None if args.skip_aot else Path(aot_dir),
            )  # fmt: skip
            eager = next(entry for entry in model_decode if entry["context"] == context)["models"]["KDSA"]
            figures["bytes_needed"] = eager["bytes_needed"]
            rows.append(add_limits(figures, eager["bytes_needed"]["total_bytes"], bandwidth))
    return rows


def add_limits(figures: dict, total_bytes: float, bandwidth: float) -> dict:
    """`figures` (`whole_step_figures`) with each timed route's fraction of the bandwidth limit for a step that must
    read `total_bytes`: `compiled_limit`, and `aot_limit` where the package ran."""
    for route, seconds in (("compiled", "compiled_static_s"), ("aot", "aot_package_s")):
        if seconds in figures:
            figures[f"{route}_limit"] = physical_limit(total_bytes, figures[seconds], bandwidth)
    return figures


@functools.cache
def sibling_script(name: str):
    """scripts/`name`.py as a module, loaded once per process."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def estimate_peer_decode_bytes(config, context: int) -> int:
    """Peak bytes a transformers peer's eager decode step adds at `context` cached tokens, counted before running:
    its MLA expands the whole cached latent into per-head keys and values (`[H, S, qk_head + v_head]`, bf16) and
    scores `[H, 1, S]` (bf16 + fp32 softmax), one layer at a time, and DynamicCache's concatenation copies that
    layer's latent rows once; plus the cache of every attention layer."""
    text = config.get_text_config()
    heads, qk_head = text.num_attention_heads, text.qk_nope_head_dim + text.qk_rope_head_dim
    row = (text.kv_lora_rank + text.qk_rope_head_dim + 2 * getattr(text, "index_head_dim", 0) + 1) * 2
    attention_layers = sum(t != KDA_LAYER for t in text.layer_types)
    per_token = heads * (qk_head + text.v_head_dim) * 2 + heads * 6 + row * (1 + attention_layers)
    return per_token * context


def compare_tokens(peer: dict, ours: dict) -> dict:
    """Greedy tokens of a same-weight pair decoding from identical caches: identical or not (the first step that
    differs and the peer's top-1 minus top-2 logit there: 0 is an exact tie), and how far the first step's logits
    (same cache, same input token) are apart relative to the peer's logit scale."""
    first_peer, first_ours = peer.pop("first_logits"), ours.pop("first_logits")
    mismatches = [i for i, (a, b) in enumerate(zip(peer["tokens"], ours["tokens"], strict=True)) if a != b]
    return dict(
        same_tokens=not mismatches,
        steps=len(peer["tokens"]),
        first_mismatch=mismatches[0] if mismatches else None,
        peer_margin_at_first_mismatch=peer["margins"][mismatches[0]] if mismatches else None,
        first_step_logits_relative_difference=float((first_peer - first_ours).abs().max() / first_peer.abs().max()),
    )


def same_tokens_after_prefill(pair: SameWeightPair, prompt_tokens: int, steps: int) -> dict:
    """Both models of `pair` prefill the same random prompt and greedily generate `steps` tokens with `generate`:
    the tokens, and the prompt's last logits apart relative to the peer's logit scale."""
    vocab = pair.peer.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (BATCH, prompt_tokens), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    theirs = pair.peer.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    ours = pair.kdsa.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens_peer = theirs.sequences[0, prompt_tokens:].tolist()
    tokens_ours = ours.sequences[0, prompt_tokens:].tolist()
    mismatches = [i for i, (a, b) in enumerate(zip(tokens_peer, tokens_ours, strict=True)) if a != b]
    first_peer, first_ours = theirs.logits[0].float(), ours.logits[0].float()
    return dict(
        dtype=str(next(pair.kdsa.parameters()).dtype).removeprefix("torch."),
        prompt_tokens=prompt_tokens,
        steps=steps,
        same_tokens=not mismatches,
        first_mismatch=mismatches[0] if mismatches else None,
        prompt_logits_relative_difference=float((first_peer - first_ours).abs().max() / first_peer.abs().max()),
        tokens_peer=tokens_peer,
        tokens_kdsa=tokens_ours,
        seconds=time.perf_counter() - start,
    )


def to_fp32(pair: SameWeightPair) -> SameWeightPair:
    """fp32 copies of both models (the same bf16-valued weights, upcast): the token checks' exact reference."""
    return pair._replace(peer=copy.deepcopy(pair.peer).float(), kdsa=copy.deepcopy(pair.kdsa).float())


def prefill_attention_bytes(num_heads: int, context: int, extra_per_pair: int, attn_implementation: str) -> int:
    """Peak bytes of an attention prefill at `context` tokens. Eager: per (head, query, key) the bf16 scores (2),
    their masked copy (2) alive while softmax writes fp32 (4) -> ~6 bytes live per element. sdpa: no per-head
    scores (its CPU kernel is blocked). Both: `extra_per_pair` bytes per (query, key) for masks built outside the
    heads. An estimate, counted before running anything."""
    per_head = 6 * num_heads if attn_implementation == "eager" else 0
    return (per_head + extra_per_pair) * context * context


def estimate_peer_prefill_bytes(kind: str, config, context: int, attn_implementation: str) -> int:
    config = config.get_text_config()
    if kind == "KimiLinear":
        return prefill_attention_bytes(config.num_attention_heads, context, 2, attn_implementation)  # bf16 mask
    # Glm5Next: int32 selection counts (4) + bool mask (1) + bf16 additive mask (2) per (query, key); the
    # indexer's pooled scores are smaller ([T, HI, T/kpool] fp32).
    return prefill_attention_bytes(config.num_attention_heads, context, 4 + 1 + 2, attn_implementation)


# ---------------------------------------------------------------------------------------------------------------
# Bytes a decode step must read


def parameter_bytes_touched_per_token(model: nn.Module, top_k: int, num_experts: int) -> dict:
    """Weights one decode token must read: every parameter in full, except the embedding table (one row), the
    stacked routed experts (`*.experts.*`, `[E, ...]`: only top_k / E of them) and a vision tower (none)."""
    total = dense = routed_touched = embedding_row = 0
    for name, param in model.named_parameters():
        if name.startswith("model.visual."):  # GLM's vision tower: not run when decoding text
            continue
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


def dsa_layer_bytes_per_step(config: KDSAConfig, layer: nn.Module, context: int, selected: int | None) -> dict:
    """Bytes one DSA layer's decode step must read at `context` cached tokens, from the dims (its floor):

        indexer_bytes = context · DI · b                  every cached indexer key is scored against the query
        latent_bytes  = min(K, context) · (C + R) · b     sparse attention reads only the K selected [c | k_pe] rows
        weight_bytes  = Σ parameter bytes of the layer    every weight is used once per token

    b: bytes per cached element (bf16: 2), DI index_head_dim, C kv_lora_rank, R qk_rope_head_dim, K = `selected`
    (index_topk; None = every row, the dense variant). Not counted: writing the new token's rows and the query-side
    activations (a few KiB)."""
    element = torch.finfo(DTYPE).bits // 8
    rows = context if selected is None else min(selected, context)
    indexer = context * config.index_head_dim * element
    latent = rows * (config.kv_lora_rank + config.qk_rope_head_dim) * element
    weights = layer_weight_bytes(layer)
    return dict(weight_bytes=weights, indexer_bytes=indexer, latent_bytes=latent, cache_read_bytes=indexer + latent,
                total_bytes=weights + indexer + latent)  # fmt: skip


def physical_limit(bytes_needed: float, measured_s: float, bandwidth_gbs: float) -> dict:
    """The step's floor `bytes_needed / bandwidth` and how close the measured step came to it."""
    limit_s = bytes_needed / (bandwidth_gbs * 1e9)
    return dict(limit_s=limit_s, fraction_achieved=limit_s / measured_s, percent_of_limit=100 * limit_s / measured_s)


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


def print_whole_step(whole_steps: list[dict]) -> None:
    """Sections 5b and 5c (`whole_step_section`) and the op profiles of their steps."""
    print_table(
        "5b. Whole decode step: eager (paged / static cache) vs compiled by generate()'s compile call (static cache), "
        "interleaved; the compiled step's fraction of the bandwidth limit",
        ["context", "eager paged", "eager static", "compiled", "eager static / compiled (median, min..max)",
         "compiled of limit", "graphs", "compiled, no guard eval (measured only)"],
        [[fmt_ctx(whole["context"]), fmt_ms(whole["eager_paged_s"]), fmt_ms(whole["eager_static_s"]),
          fmt_ms(whole["compiled_static_s"]),
          f"{whole['speedup_median']:.2f}x, {whole['speedup_min']:.2f}..{whole['speedup_max']:.2f}",
          f"{whole['compiled_limit']['fraction_achieved']:.1%}", str(whole["graphs_compiled"]),
          f"{fmt_ms(whole['compiled_unguarded_s'])} ({whole['unguarded_speedup_median']:.2f}x)"]
         for whole in whole_steps],
    )  # fmt: skip
    packaged = [whole for whole in whole_steps if "aot_package_s" in whole]
    if packaged:
        print_table(
            "5c. The decode step ahead of time (AOTInductor package, modeling_kdsa.aot) through the model's forward, "
            "interleaved with 5b's steps; whole generate() calls per token",
            ["context", "package", "eager static / package (median, min..max)", "package of limit", "compile",
             "generate(): eager paged / package ms per token"],
            [[fmt_ctx(whole["context"]), fmt_ms(whole["aot_package_s"]),
              f"{whole['aot_speedup_median']:.2f}x, {whole['aot_speedup_min']:.2f}..{whole['aot_speedup_max']:.2f}",
              f"{whole['aot_limit']['fraction_achieved']:.1%}",
              "cached" if whole["aot_compile_s"] is None else f"{whole['aot_compile_s']:.1f} s",
              f"{whole['generate_ms_per_token']['eager_paged']:.2f} / "
              f"{whole['generate_ms_per_token']['aot_package']:.2f} "
              f"({whole['generate_ms_per_token']['aot_package_speedup']:.2f}x)"]
             for whole in packaged],
        )  # fmt: skip
    for whole in whole_steps:
        for name, profile in whole["op_profile"].items():
            top = ", ".join(f"{op['name']} {op['self_ms_per_step']:.2f} ms x{op['calls_per_step']:.0f}"
                            for op in profile["top"][:5])  # fmt: skip
            print(f"   {fmt_ctx(whole['context'])} {name}: {profile['aten_calls_per_step']:.0f} aten calls/step, "
                  f"{profile['total_ms_per_step']:.2f} ms profiled; top: {top}")  # fmt: skip


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

    rows = []
    for family, info in report.get("same_weights", {}).items():
        kdsa = info["kdsa_config"]
        rows.append([
            family, info["peer"], f"{info['parameters']['peer'] / 1e6:.1f} M",
            f"{info['parameters']['kdsa'] / 1e6:.1f} M", fmt_bytes(info["checkpoint_bytes"]),
            " ".join("K" if t == "linear_attention" else "A" for t in kdsa["layer_types"]),
        ])  # fmt: skip
    if rows:
        print_table(
            "Same-weight pairs: transformers' model, saved, loaded by KDSAForCausalLM.from_pretrained (K KDA, A "
            "MLA/DSA)",
            ["family", "peer", "peer params", "KDSA params", "checkpoint", "layers"],
            rows,
        )

    rows = []
    for entry in report["dsa_layer_decode"]:
        for name in ("ours", "ours_compiled", "ours_dense", "DeepseekV32"):
            r = entry[name]
            rows.append(
                [
                    fmt_ctx(entry["context"]),
                    name,
                    fmt_ms(r["median_s"]),
                    fmt_bytes(r["bytes_needed"]["total_bytes"]),
                    fmt_ms(r["limit"]["limit_s"]),
                    f"{r['limit']['percent_of_limit']:.1f}%",
                    fmt_bytes(r["peak_rss_growth_bytes"]),
                ]
            )
    print_table(
        "1. One DSA layer, decode step (ms); limit: bytes a step must read (indexer keys, selected rows, weights) / "
        "bandwidth",
        ["context", "layer", "ms/step", "bytes must read", "limit ms", "% of limit", "peak RSS +"],
        rows,
    )
    if "model_decode" not in report:  # --dsa-layer-only
        return

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

    def tokens(check):
        if check["same_tokens"]:
            return f"{check['steps']} identical"
        return f"differ at step {check['first_mismatch']} (margin {check['peer_margin_at_first_mismatch']:.3f})"

    rows = []
    for entry in report["model_decode"]:
        for family, pair in entry["pairs"].items():
            if pair.get("skipped"):
                rows.append([fmt_ctx(entry["context"]), family, "skipped", pair["reason"], "", "", ""])
                continue
            rows.append([
                fmt_ctx(entry["context"]), family, f"{pair['speedup']:.1f}x", tokens(pair["bf16"]),
                f"{pair['bf16']['first_step_logits_relative_difference']:.1e}", tokens(pair["fp32"]),
                f"{pair['fp32']['first_step_logits_relative_difference']:.1e}",
            ])  # fmt: skip
    steady_rows = [
        [fmt_ctx(entry["context"]), "DSA layer: others / ours", entry["steadiness"]]
        for entry in report["dsa_layer_decode"]
    ]
    for entry in report["model_decode"]:
        steady_rows.append([fmt_ctx(entry["context"]), "KDSA alone", entry["models"]["KDSA"]["steadiness"]])
        for family, pair in entry["pairs"].items():
            if not pair.get("skipped"):
                steady_rows.append([fmt_ctx(entry["context"]), f"{PEER_NAMES[family]} / KDSA", pair["steadiness"]])
    for family, pair in report["prefill"]["pairs"].items():
        context = fmt_ctx(report["prefill"]["context"])
        steady_rows.append([f"{context} prefill", f"{PEER_NAMES[family]} / KDSA", pair["steadiness"]])

    def detail(st):
        if "pair_ratios" not in st:  # a step timed alone: its batches' medians
            return "batch medians " + ", ".join(fmt_ms(m) for m in st["batch_medians_s"]) + " ms"
        return "; ".join(f"{other} {r['min']:.2f}..{r['median']:.2f}..{r['max']:.2f}" for other, r in
                         st["pair_ratios"].items())  # fmt: skip

    print_table(
        "Steadiness: steps interleaved A B A B (a step alone: batches of steps), batches until every ratio (median) "
        "moves <= 10% (pair ratios: other / ref.)",
        ["context", "comparison", "batches", "10% met", "last change", "pair ratios min..median..max"],
        [[c, name, f"{st['batches']} x {st['batch_rounds']}", "yes" if st["criterion_met"] else "no",
          "-" if st["last_change"] is None else f"{st['last_change']:.1%}", detail(st)] for c, name, st in steady_rows],
    )  # fmt: skip

    print_table(
        "2b. Same weights, identical caches: transformers' whole model / KDSA decode step, greedy tokens "
        "(margin: the peer's top-1 minus top-2 logit there)",
        ["context", "family", "speed-up", "bf16 tokens", "bf16 step-1 logits", "fp32 tokens", "fp32 step-1 logits"],
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
        f"3. Whole-model prefill of {fmt_ctx(prefill['context'])} tokens (peers: {prefill['peer_attention']})",
        ["model", "s", "tokens/s", "peak RSS +", "note"],
        rows,
    )
    rows = [
        [family, f"{p['speedup']:.2f}x", f"{p['speedup_of_minima']:.2f}x"] for family, p in prefill["pairs"].items()
    ]
    print_table("3a. Same weights, prefill interleaved: peer s / KDSA s", ["family", "median", "of minima"], rows)

    rows = []
    for family, checks in report["same_tokens_after_prefill"].items():
        for c in checks:
            rows.append([
                family, c["dtype"], str(c["prompt_tokens"]), f"{c['steps']} " + ("identical" if c["same_tokens"] else
                f"DIFFER from step {c['first_mismatch']}"), f"{c['prompt_logits_relative_difference']:.1e}",
            ])  # fmt: skip
    print_table(
        "3b. Same weights, real prefill of one random prompt, then greedy generate",
        ["family", "dtype", "prompt", "greedy tokens", "prompt logits rel. diff"],
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
    print_whole_step(report["whole_step"])
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
    parser.add_argument(
        "--max-batches",
        type=int,
        default=5,
        help="decode comparisons: batches of --repeats interleaved rounds until the ratio moves <= 10%% (at most this)",
    )
    parser.add_argument("--prefill-repeats", type=int, default=1, help="interleaved prefill rounds per batch")
    parser.add_argument("--prefill-max-batches", type=int, default=3, help="prefill pairs: batches at most")
    parser.add_argument(
        "--whole-step-repeats",
        type=int,
        default=10,
        help="eager vs compiled whole step (smallest and largest context): repeats",
    )
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
    parser.add_argument(
        "--max-peer-decode-gib",
        type=float,
        default=8.0,
        help="skip a same-weight pair at a context where the peer's eager decode step is estimated above this",
    )
    parser.add_argument("--token-steps", type=int, default=8, help="greedy steps compared per same-weight pair")
    parser.add_argument("--token-prompt", type=int, default=None, help="prompt of the prefill token check (1024)")
    parser.add_argument("--layer-prefill-context", type=int, default=None, help="DSA-layer prefill (default 32768)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=str(REPO_ROOT / "runs" / "bench_long_context.json"))
    parser.add_argument(
        "--dsa-layer-only", action="store_true", help="only the bandwidth and section 1 (one DSA layer's decode step)"
    )
    parser.add_argument(
        "--skip-aot", action="store_true", help="section 5: no AOTInductor package step (saves its compile)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: narrow models (kdsa_config), contexts 256 and 512, 2 repeats"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts = args.contexts or [256, 512]
        args.prefill_context = args.prefill_context or 128
        args.layer_prefill_context = args.layer_prefill_context or 512
        args.warmup, args.repeats = 2, 2
        args.whole_step_repeats = 3
        args.token_prompt = args.token_prompt or 32
    args.contexts = sorted(args.contexts or [4096, 16384, 65536])
    args.prefill_context = args.prefill_context or 16384
    args.token_prompt = args.token_prompt or 1024
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
            (run_dsa_layer_only if args.dsa_layer_only else run_all)(args, report)
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
    # Progress: bandwidth + builds; per context 3 layer variants, 5 model decodes, 2 fp32 token checks; 5 prefills;
    # 4 token checks after a prefill.
    progress = tqdm(total=2 + 10 * len(contexts) + 5 + 2 * len(FAMILIES), desc="bench", unit="step", file=sys.stderr)

    def advance(label: str):
        progress.set_postfix_str(label)
        progress.update(1)

    report["bandwidth"] = measure_bandwidth()
    advance("bandwidth")

    config = kdsa_config(args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-same-weights-") as folder:
        pairs = {
            family: build_same_weight_pair(family, config, Path(folder) / family, args.peer_attn) for family in FAMILIES
        }
    # "KDSA": our benchmark shape (KDSAConfig defaults, its own random weights); "KDSA:<family>": KDSA running the
    # weights transformers' model of that family saved, next to that model.
    models = {"KDSA": build_kdsa(config)}
    for family, pair in pairs.items():
        models[f"KDSA:{family}"], models[PEER_NAMES[family]] = pair.kdsa, pair.peer
    # Top-k rows a decode step reads per indexed layer (None = all): the k-pool indexer adds an incomplete tail pool.
    glm = pairs["glm5_next"].kdsa.config
    selected = {
        "KDSA": config.index_topk,
        "KDSA:kimi_linear": None,
        "KimiLinear": None,
        "KDSA:glm5_next": glm.index_topk + glm.index_kpool - 1,
        "Glm5Next": glm.index_topk + glm.index_kpool - 1,
    }
    fp32_pairs = {family: to_fp32(pair) for family, pair in pairs.items()}
    weights = {}
    for name, model in models.items():
        kdsa = model if isinstance(model, KDSAForCausalLM) else models[f"KDSA:{name_family(name)}"]
        experts = (kdsa.config.num_experts_per_tok, kdsa.config.n_routed_experts)
        weights[name] = parameter_bytes_touched_per_token(model, *experts)
    report["config"] = config.to_diff_dict() | {"layer_types": config.layer_types}
    report["same_weights"] = {
        family: dict(
            peer=f"transformers {type(pair.peer).__name__}",
            checkpoint_bytes=pair.checkpoint_bytes,
            parameters=dict(
                kdsa=sum(p.numel() for p in pair.kdsa.parameters()),
                peer=sum(p.numel() for n, p in pair.peer.named_parameters() if not n.startswith("model.visual.")),
            ),
            peer_config=pair.peer.config.to_diff_dict(),
            kdsa_config=pair.kdsa.config.to_diff_dict() | {"layer_types": pair.kdsa.config.layer_types},
        )
        for family, pair in pairs.items()
    }
    report["parameters"] = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    report["weights"] = weights

    dsa_layers = DSALayerBench(config)
    advance("built models")

    bandwidth = report["bandwidth"]["best_gbs"]
    report["dsa_layer_decode"], report["model_decode"] = [], []
    cache_summary = {}

    def record(entry, name, cache, result):
        layers = cache_bytes(cache)  # after the steps: a paged pool may have grown (per-token bytes do not)
        result["bytes_needed"] = bytes_per_decode_step(weights[name]["touched_bytes"], layers, entry["context"],
                                                       selected[name])  # fmt: skip
        result["limit"] = physical_limit(result["bytes_needed"]["total_bytes"], result["median_s"], bandwidth)
        entry["models"][name] = result
        cache_summary[name] = dict(
            per_token_bytes=sum(c["per_token_bytes"] for c in layers),
            fixed_state_bytes=sum(c["state_bytes"] for c in layers),
            bytes_at_largest_context=sum(c["per_token_bytes"] for c in layers) * entry["context"]
            + sum(c["state_bytes"] for c in layers),
            paged_pool_bytes=sum(c.get("allocated_bytes", 0) for c in layers) or None,
            layers=layers,
        )

    for context in contexts:
        report["dsa_layer_decode"].append(dsa_layers.decode_entry(context, args, bandwidth, advance))

        model_entry = dict(context=context, models={}, pairs={})
        cache = fill_cache_kdsa(config, context)
        result = time_model_decode(models["KDSA"], cache, args.warmup, args.repeats, max_batches=args.max_batches)
        del result["first_logits"]
        record(model_entry, "KDSA", cache, result)
        del cache
        advance(f"{fmt_ctx(context)} model KDSA")
        for family, pair in pairs.items():
            peer_name = PEER_NAMES[family]
            estimate = estimate_peer_decode_bytes(pair.peer.config, context)
            if estimate > args.max_peer_decode_gib * GIB:
                model_entry["pairs"][family] = dict(
                    skipped=True,
                    estimated_bytes=estimate,
                    reason=f"{peer_name}'s eager decode step would need ~{estimate / GIB:.1f} GiB > "
                    f"{args.max_peer_decode_gib:g} GiB (--max-peer-decode-gib)",
                )
                for _ in range(3):
                    advance(f"{fmt_ctx(context)} {family} skipped")
                continue
            theirs, ours = fill_same_caches(pair, context)
            peer_step, peer_steps = model_decode_stepper(pair.peer, theirs)
            ours_step, ours_steps = model_decode_stepper(pair.kdsa, ours)
            timed, steadiness = time_interleaved(
                {f"KDSA:{family}": ours_step, peer_name: peer_step}, args.warmup, args.repeats, args.max_batches
            )
            while len(ours_steps["tokens"]) < args.token_steps:  # the token check compares `token_steps` steps
                peer_step()
                ours_step()
            peer_result, ours_result = timed[peer_name], timed[f"KDSA:{family}"]
            for result, steps_done in ((peer_result, peer_steps), (ours_result, ours_steps)):
                result.update(tokens_per_s=1.0 / result["median_s"], first_logits=steps_done["first_logits"],
                              tokens=steps_done["tokens"][: args.token_steps],
                              margins=steps_done["margins"][: args.token_steps])  # fmt: skip
            advance(f"{fmt_ctx(context)} model {peer_name}")
            advance(f"{fmt_ctx(context)} model KDSA:{family}")
            summary = dict(
                speedup=peer_result["median_s"] / ours_result["median_s"],
                speedup_of_minima=peer_result["min_s"] / ours_result["min_s"],
                steadiness=steadiness,
                peer_estimated_bytes=estimate,
            )
            summary["bf16"] = compare_tokens(peer_result, ours_result)
            record(model_entry, peer_name, theirs, peer_result)
            record(model_entry, f"KDSA:{family}", ours, ours_result)
            del theirs, ours
            # The same check in fp32 (caches filled with the same seed): bf16 logits tie or nearly tie often enough
            # that two correct implementations may pick different tokens; fp32 must not.
            exact = fp32_pairs[family]
            theirs, ours = fill_same_caches(exact, context, dtype=torch.float32)
            peer_result = time_model_decode(exact.peer, theirs, 0, args.token_steps)
            ours_result = time_model_decode(exact.kdsa, ours, 0, args.token_steps)
            summary["fp32"] = compare_tokens(peer_result, ours_result)
            del theirs, ours
            model_entry["pairs"][family] = summary
            advance(f"{fmt_ctx(context)} fp32 tokens {family}")
        report["model_decode"].append(model_entry)
    report["cache"] = cache_summary

    prefill = dict(context=args.prefill_context, max_gib=args.max_prefill_gib, models={}, pairs={})
    warmup_tokens = min(1024, args.prefill_context // 4)
    prefill["peer_attention"] = args.peer_prefill_attn
    model = models["KDSA"]
    prefill["models"]["KDSA"] = time_prefill(
        model, lambda: KDSACache(model.config), args.prefill_context, warmup_tokens, args.prefill_repeats,
        args.prefill_budget_s,
    )  # fmt: skip
    advance("prefill KDSA")
    for family, pair in pairs.items():
        # Same weights, ours and the peer's prefill interleaved (A B A B ...) until their ratio is steady.
        peer_name, ours_name = PEER_NAMES[family], f"KDSA:{family}"
        estimate = estimate_peer_prefill_bytes(peer_name, pair.peer.config, args.prefill_context,
                                               args.peer_prefill_attn)  # fmt: skip
        if estimate > args.max_prefill_gib * GIB:
            prefill["models"][peer_name] = dict(
                skipped=True,
                estimated_bytes=estimate,
                reason=f"{args.peer_prefill_attn} attention would allocate ~{estimate / GIB:.0f} GiB > "
                f"{args.max_prefill_gib:g} GiB",
            )
            prefill["models"][ours_name] = time_prefill(
                pair.kdsa, lambda pair=pair: KDSACache(pair.kdsa.config), args.prefill_context, warmup_tokens,
                args.prefill_repeats, args.prefill_budget_s,
            )  # fmt: skip
            advance(f"prefill {peer_name} skipped")
            advance(f"prefill {ours_name}")
            continue
        pair.peer.set_attn_implementation(args.peer_prefill_attn)  # same weights, maybe another attention kernel
        ours_step, ours_estimate = prefill_stepper(pair.kdsa, args.prefill_context, warmup_tokens)
        peer_step, peer_estimate = prefill_stepper(pair.peer, args.prefill_context, warmup_tokens)
        most_runs = args.prefill_repeats * args.prefill_max_batches
        if args.prefill_budget_s and (ours_estimate + peer_estimate) * most_runs > args.prefill_budget_s:
            reason = (f"estimated {ours_estimate:.0f} + {peer_estimate:.0f} s per pair of runs (linear from "
                      f"{warmup_tokens} tokens), x{most_runs} > budget {args.prefill_budget_s:g} s")  # fmt: skip
            for name, estimate_s in ((ours_name, ours_estimate), (peer_name, peer_estimate)):
                prefill["models"][name] = dict(skipped=True, estimated_s=estimate_s, reason=reason)
        else:
            timed, steadiness = time_interleaved({ours_name: ours_step, peer_name: peer_step}, 0,
                                                 args.prefill_repeats, args.prefill_max_batches)  # fmt: skip
            for name, estimate_s in ((ours_name, ours_estimate), (peer_name, peer_estimate)):
                timed[name].update(tokens_per_s=args.prefill_context / timed[name]["median_s"],
                                   estimated_s_before_run=estimate_s)  # fmt: skip
                prefill["models"][name] = timed[name]
            prefill["pairs"][family] = dict(
                speedup=timed[peer_name]["median_s"] / timed[ours_name]["median_s"],
                speedup_of_minima=timed[peer_name]["min_s"] / timed[ours_name]["min_s"],
                steadiness=steadiness,
            )
        pair.peer.set_attn_implementation(args.peer_attn)
        advance(f"prefill {peer_name}")
        advance(f"prefill {ours_name}")
    report["prefill"] = prefill

    report["same_tokens_after_prefill"] = {}
    for family in FAMILIES:
        checks = []
        for pair in (fp32_pairs[family], pairs[family]):
            checks.append(same_tokens_after_prefill(pair, args.token_prompt, args.token_steps))
            advance(f"same tokens {family} {checks[-1]['dtype']}")
        report["same_tokens_after_prefill"][family] = checks
    del fp32_pairs
    progress.close()

    report["graph_mode"] = time_graph_mode(models["KDSA"], config, contexts, args.warmup, args.repeats, args.quick)
    report["whole_step"] = whole_step_section(models["KDSA"], config, args, report["model_decode"], bandwidth)
    report["dsa_layer_prefill_memory"] = dsa_layer_prefill_memory(config, args.layer_prefill_context)
    report["memory_method"] = _memory_method_text()


class DSALayerBench:
    """Section 1: one DSA layer's decode step, ours (index_topk) eager and compiled (`compiled_dsa_decode_stepper`),
    ours dense (the same weights with top-k >= the context) and transformers' `DeepseekV32Attention` with the same
    dims and weights, interleaved."""

    def __init__(self, config: KDSAConfig):
        self.config = config
        self.layer_idx = config.layer_types.index(DSA_LAYER)
        self.ours = build_dsa_layer(config, self.layer_idx)
        self.dsv32_config = deepseek_v32_layer_config(config)
        self.dsv32 = build_peer_deepseek_v32_attention(self.ours, self.dsv32_config)
        self.our_rotary = KDSARotaryEmbedding(config)
        self.dsv32_rotary = hf_dsv32.DeepseekV32RotaryEmbedding(self.dsv32_config)

    def decode_entry(self, context: int, args, bandwidth_gbs: float, advance) -> dict:
        """The three variants at `context` cached tokens: times, steadiness, and each step's bytes and % of its limit
        (`dsa_layer_bytes_per_step`, checked against what the variant's cache holds per token)."""
        config, entry = self.config, dict(context=context)
        fill_ours = lambda s: fill_cache_kdsa(config, s, layers=[self.layer_idx])  # noqa: E731
        fill_dsv32 = lambda s: fill_cache_deepseek_v32_layer(self.dsv32_config, s)  # noqa: E731
        steps_at_most = args.warmup + args.repeats * args.max_batches
        dense_layer = build_dense_dsa_layer(self.ours, config, context + steps_at_most + 1)
        capacity = context + steps_at_most + 2  # + the compiling call
        fill_static = lambda s: fill_cache_kdsa(config, s, layers=[self.layer_idx], capacity=capacity)  # noqa: E731
        variants = {
            "ours": (self.ours, fill_ours, self.our_rotary, config.index_topk),
            "ours_compiled": (self.ours, fill_static, self.our_rotary, config.index_topk),
            "ours_dense": (dense_layer, fill_ours, self.our_rotary, None),
            "DeepseekV32": (self.dsv32, fill_dsv32, self.dsv32_rotary, config.index_topk),
        }  # fmt: skip
        steps, caches = {}, {}
        for name, (layer, fill, rotary, _) in variants.items():
            stepper = compiled_dsa_decode_stepper if name == "ours_compiled" else dsa_decode_stepper
            steps[name], caches[name] = stepper(layer, context, fill, rotary)
        results, entry["steadiness"] = time_interleaved(steps, args.warmup, args.repeats, args.max_batches)
        for name, (layer, _, _, top_k) in variants.items():
            result = results[name]
            result["bytes_needed"] = dsa_layer_bytes_per_step(config, layer, context, top_k)
            # The same bound from the bytes per token the variant's cache really holds (cache_bytes): equal unless
            # the formula above missed something a cache stores.
            layer_cache = [c for c in cache_bytes(caches[name]) if c["kind"] != "linear" or c["state_bytes"]]
            from_cache = bytes_per_decode_step(layer_weight_bytes(layer), layer_cache, context, top_k)
            result["bytes_needed"]["from_cache_total_bytes"] = from_cache["total_bytes"]
            if from_cache["total_bytes"] != result["bytes_needed"]["total_bytes"]:
                warnings.warn(
                    f"{name} at {context}: the floor from the dims ({result['bytes_needed']['total_bytes']} B) differs "
                    f"from what its cache holds ({from_cache['total_bytes']} B)",
                    stacklevel=1,
                )
            result["limit"] = physical_limit(result["bytes_needed"]["total_bytes"], result["median_s"], bandwidth_gbs)
            entry[name] = result
            advance(f"{fmt_ctx(context)} layer {name}")
        entry["speedup_vs_DeepseekV32"] = entry["DeepseekV32"]["median_s"] / entry["ours"]["median_s"]
        entry["ours_percent_of_limit"] = entry["ours"]["limit"]["percent_of_limit"]
        entry["ours_compiled_percent_of_limit"] = entry["ours_compiled"]["limit"]["percent_of_limit"]
        return entry


def run_dsa_layer_only(args, report: dict) -> None:
    """`--dsa-layer-only`: the bandwidth and section 1 alone (about a minute at 4k + 64k)."""
    report["bandwidth"] = measure_bandwidth()
    dsa_layers = DSALayerBench(kdsa_config(args.quick))
    bandwidth = report["bandwidth"]["best_gbs"]
    report["dsa_layer_decode"] = [
        dsa_layers.decode_entry(context, args, bandwidth, lambda label: None) for context in args.contexts
    ]


def name_family(name: str) -> str:
    """The family of a peer's row name ("KimiLinear" -> "kimi_linear")."""
    return next(family for family, peer in PEER_NAMES.items() if peer == name)


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
