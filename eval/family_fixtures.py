"""Tiny checkpoints of the published families, built by transformers' own classes, for the conversion tests
(tests/test_foreign_checkpoints.py) and the figures of docs/checkpoint-conversion.md §7
(scripts/foreign_checkpoint_figures.py).

Each family's tiny model has every tensor it initialises to a constant (norm weights, biases, correction bias)
perturbed, so that a wrong mapping cannot hide behind ones and zeros, and is saved with `save_pretrained` in small
shards (the hub layout: per-expert tensors, split convolutions). `fp8_copy` quantizes a saved folder's linear weights
as DeepSeek-V3.2 / GLM publish them.
"""

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    KimiLinearConfig,
    KimiLinearForCausalLM,
)

from modeling_kdsa import KDSAForCausalLM

VOCAB = 128
INDEX_TOPK = 8
SHORT, LONG = INDEX_TOPK - 2, 4 * INDEX_TOPK  # T < index_topk (dense) and T >= 3 * index_topk (really sparse)


def perturb_constants(model: torch.nn.Module, seed: int = 0) -> None:
    """Add noise to every floating tensor whose elements are all equal (ones, zeros, a constant bias)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if tensor.is_floating_point() and tensor.numel() > 0 and bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype))


def deepseek_v32_model() -> torch.nn.Module:
    config = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=8, topk_group=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=INDEX_TOPK, index_head_dim=16, index_n_heads=16,
        first_k_dense_replace=1, max_position_embeddings=512, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
        # YaRN with mscale_all_dim: frequencies, the cos/sin attention factor and the softmax mscale² all differ
        # from plain RoPE.
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.9, "mscale_all_dim": 1.1, "beta_fast": 32, "beta_slow": 1,
        },
    )  # fmt: skip
    return DeepseekV32ForCausalLM(config)


def kimi_linear_model() -> torch.nn.Module:
    """KDA, KDA, KDA, dense MLA (1-based kda_layers / full_attn_layers as Moonshot's config.json writes them)."""
    config = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_shared_experts=1, num_experts_per_token=2,
        num_expert_group=1, topk_group=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        first_k_dense_replace=1, model_max_length=512, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={
            "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    )  # fmt: skip
    return KimiLinearForCausalLM(config)


def glm5_next_model(**text_overrides) -> torch.nn.Module:
    """KDA, DSA, DSA, KDA with GLM's components on: mHC with 4 streams and forget-gate lower bound -5 (defaults),
    the k-pool indexer over pools of 4 tokens (GLM-5.3-Flash's value) with the incomplete tail always selected, the
    second DSA layer sharing the first one's selection, the SwiGLU clamp at 0.1 so that it bites on these small
    activations (GLM's 10 would never be reached); a one-block vision tower."""
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=INDEX_TOPK,
        index_head_dim=16, index_n_heads=16, index_kpool=4, index_kpool_always_select_tail=True,
        indexer_types=["full", "full", "shared", "full"], linear_num_heads=2, linear_head_dim=16,
        max_position_embeddings=512, pad_token_id=0, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        swiglu_limit=0.1,
    )  # fmt: skip
    text.update(text_overrides)
    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
        projection_intermediate_size=32, patch_size=2, image_size=8, spatial_merge_size=1, temporal_patch_size=1,
    )  # fmt: skip
    return Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision))


BUILDERS = {
    "deepseek_v32": deepseek_v32_model,
    "kimi_linear": kimi_linear_model,
    "glm5_next": lambda: glm5_next_model(),
}
REFERENCE_KWARGS = {}


class Family:
    def __init__(self, name: str, folder):
        torch.manual_seed(0)
        self.name = name
        self.reference_kwargs = REFERENCE_KWARGS.get(name, {})
        self.reference = BUILDERS[name]().eval()
        perturb_constants(self.reference)
        self.folder = folder
        self.reference.save_pretrained(folder, max_shard_size="40KB")
        self.model = KDSAForCausalLM.from_pretrained(folder).eval()
        self.ids = torch.randint(3, VOCAB, (2, LONG), generator=torch.Generator().manual_seed(1))


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def edit_config(folder, text_config: bool = False, **changes) -> None:
    """Change config.json fields (of its `text_config` when asked)."""
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    (config["text_config"] if text_config else config).update(changes)
    config_file.write_text(json.dumps(config))


def quantize_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's weight layout: E4M3 values and one fp32 `weight_scale_inv` per `block x block` tile (partial tiles at
    the edges, grid rounded up), `weight ≈ e4m3 * scale_inv` with `scale_inv = amax / 448`."""
    rows, cols = weight.shape
    grid_rows, grid_cols = -(-rows // block), -(-cols // block)
    padded = torch.zeros(grid_rows * block, grid_cols * block)
    padded[:rows, :cols] = weight
    tiles = padded.view(grid_rows, block, grid_cols, block)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    quantized = (tiles / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized, scale_inv


def fp8_copy(folder, destination, block: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantize every linear weight of the decoder layers as DeepSeek-V3.2 / GLM publish them (the router and the
    indexer's head weights stay high precision); returns {name: (e4m3, scale_inv)}."""
    shutil.copytree(folder, destination)
    index_file = destination / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    quantized = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(destination / shard)
        for name in list(tensors):
            keep = name.endswith("mlp.gate.weight") or "weights_proj" in name
            if re.search(r"layers\.\d+\..*\.weight$", name) and tensors[name].dim() == 2 and not keep:
                values, scale_inv = quantize_fp8(tensors[name], block)
                tensors[name] = values
                tensors[name + "_scale_inv"] = scale_inv
                index["weight_map"][name + "_scale_inv"] = shard
                quantized[name] = (values, scale_inv)
        save_file(tensors, destination / shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    edit_config(
        destination,
        quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block],
        },
    )  # fmt: skip
    return quantized
