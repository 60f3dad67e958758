"""A tiny Kimi K3 checkpoint: the published config.json with its sizes scaled down, and random K3-layout models, for
the K3 tests (tests/test_kimi_k3.py) and the MXFP4 figures of docs/kimi-k3.md §5 (scripts/kimi_k3_figures.py)."""

import torch

from modeling_kdsa import KDSAForCausalLM
from modeling_kdsa.configuration_kdsa import KDSAConfig
from modeling_kdsa.conversion import plan_foreign_load
from modeling_kdsa.numeric_formats import mxfp4_quantize

NUM_LAYERS = 8
KDA_LAYERS_1B = [1, 2, 3, 5, 6]  # 1-based, as published: KDA KDA KDA MLA, then MLA at the end
MLA_LAYERS_1B = [4, 7, 8]
KDA_HEADS = 4


def k3_raw_config(quantized: bool = True, **text_changes) -> dict:
    """The published K3 config.json (docs/kimi-k3.md §1), every field kept, sizes scaled down."""
    text = {
        "model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": NUM_LAYERS, "vocab_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 3,
        "intermediate_size": 96, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True, "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "num_heads": KDA_HEADS, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "kda_layers": KDA_LAYERS_1B, "full_attn_layers": MLA_LAYERS_1B,
        },
    }  # fmt: skip
    if quantized:
        text["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*shared_experts.*", "re:.*self_attn.*", "re:.*routed_expert_(down|up)_proj.*", "lm_head"],
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "group_size": 32},
                    "input_activations": None,
                }
            },
        }
    text.update(text_changes)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 163584 % 256, "eos_token_id": 163586 % 256, "pad_token_id": 163839 % 256,
        "media_placeholder_token_id": 163605 % 256, "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 32},
    }  # fmt: skip


def k3_config(quantized: bool = True, **text_changes) -> KDSAConfig:
    return plan_foreign_load(k3_raw_config(quantized, **text_changes), []).config


def perturbed_model(config: KDSAConfig, seed: int = 0) -> KDSAForCausalLM:
    """A random model whose constant-initialised tensors (norm gains, zero AttnRes queries, biases) are perturbed, so
    that a wrong mapping cannot hide behind ones and zeros; experts scaled up so that they matter in the logits."""
    torch.manual_seed(seed)
    model = KDSAForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not tensor.is_floating_point():
                continue
            if "A_log" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            elif bool((tensor == tensor.flatten()[0]).all()):
                tensor.add_(0.3 * torch.randn(tensor.shape, generator=generator))
    return model


def mxfp4_top1_agreement(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of 8 x 128 random tokens: does the model with its routed experts in MXFP4 (the spec's rounding of
    the unquantized weights, router and shared experts untouched) pick the unquantized model's top-1; is that top-1
    decisive (margin over the runner-up > 0.1 logit std); does the unquantized model run in bf16 pick it."""
    dense = perturbed_model(k3_config(quantized=False), seed=seed)
    quantized = KDSAForCausalLM(k3_config(quantized=True)).eval()
    state = dense.state_dict()
    for key in list(state):
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[key + "_packed"], state[key + "_scale"] = mxfp4_quantize(state.pop(key))
    quantized.load_state_dict(state, strict=True)
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        reference, mxfp4 = dense(ids).logits, quantized(ids).logits
        bf16 = dense.to(torch.bfloat16)(ids).logits.float()
    top2 = reference.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 0.1 * reference.std()
    return reference.argmax(-1) == mxfp4.argmax(-1), decisive, reference.argmax(-1) == bf16.argmax(-1)
