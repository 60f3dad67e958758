"""Published checkpoints of the family load into `KDSAForCausalLM` with transformers' logits, or are refused by name.

Each family's tiny model is built by transformers' own class, every tensor it initialises to a constant (norm
weights, biases, correction bias) is perturbed so that a wrong mapping cannot hide behind ones and zeros, and it is
saved with `save_pretrained` in small shards (the hub layout: per-expert tensors, split convolutions). Indexer ties:
the Lightning Indexer's score is a sum of ReLU'd dot products, so keys whose every head is negative tie at exactly
zero and either implementation may pick any of them; with 16 indexer heads such a tie has probability 2^-16 per
(query, key) pair, so the fixtures have none at the top-k boundary (docs/checkpoint-conversion.md §7).
"""

import json
import logging
import re
import shutil
import textwrap

import pytest
import torch
from conftest import (
    count_calls,
    cpu_compile_config,
    graph_recorder,
    graph_targets,
    needs_kernel_build,
    run_without_the_package,
)
from modeling_kdsa.eval.family_fixtures import (
    BUILDERS,
    LONG,
    SHORT,
    Family,
    deepseek_v32_model,
    edit_config,
    fp8_copy,
    glm5_next_model,
    kimi_linear_model,
    perturb_constants,
    quantize_fp8,
    relative_error,
)
from modeling_kdsa.parallel.mesh import ParallelMesh
from modeling_kdsa.parallel.tensor_parallel import apply_tensor_parallel
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
)

from modeling_kdsa import KDSAConfig, KDSAForCausalLM, KDSAQuantizationConfig, cpu_fp8_dequantize, fp8_linear
from modeling_kdsa.conversion import plan_foreign_load
from modeling_kdsa.cpu_row_linear import MAX_ROWS
from modeling_kdsa.fp8_linear import KDSAFP8Linear

FAMILIES = sorted(BUILDERS)
# A tensor the strict check must miss by name when it is deleted from the checkpoint (hub name, KDSA name).
VICTIMS = {
    "deepseek_v32": (
        "model.layers.1.self_attn.indexer.k_norm.bias",
        r"model\.layers\.1\.self_attn\.indexer\.k_norm\.bias",
    ),
    "kimi_linear": ("model.layers.1.self_attn.A_log", r"model\.layers\.1\.linear_attn\.A_log"),
    "glm5_next": ("model.language_model.layers.3.self_attn.A_log", r"model\.layers\.3\.linear_attn\.A_log"),
}
# Families whose checkpoints carry multi-token-prediction layers after the trunk: the key prefix of the layers.
MTP_PREFIX = {"deepseek_v32": "model.layers.", "glm5_next": "model.language_model.layers."}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return Family(request.param, tmp_path_factory.mktemp(request.param) / "hub")


def greedy(model, ids: torch.Tensor, steps: int, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0, **kwargs)


# ------------------------------------------------------------------------------------------- equal to transformers


def test_checkpoint_is_sharded_hub_layout(family):
    index = json.loads((family.folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 10
    assert any(".experts.0." in key for key in index["weight_map"])  # per-expert tensors, stacked at load


@pytest.mark.parametrize("seq_len", [SHORT, LONG], ids=["dense", "sparse"])
def test_logits_match_transformers(family, seq_len):
    ids = family.ids[:, :seq_len]
    with torch.no_grad():
        reference = family.reference(ids, **family.reference_kwargs).logits
        ours = family.model(ids).logits
    assert relative_error(ours, reference) < 1e-5


def test_greedy_32_tokens_match_transformers(family):
    ids = family.ids[:1, :LONG]
    assert torch.equal(greedy(family.model, ids, 32), greedy(family.reference, ids, 32, **family.reference_kwargs))


def test_cpu_backend_decode_64_tokens_matches_transformers(family):
    """Decode through KDSACache on the fused `cpu` kernels, step logits and tokens against transformers'."""
    model = KDSAForCausalLM.from_pretrained(family.folder, kernel_backend="cpu").eval()
    assert model.config.kernel_backend == "cpu"
    ids = family.ids[:1, :SHORT]
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    ours = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    reference = family.reference.generate(
        ids, output_logits=True, return_dict_in_generate=True, **kwargs, **family.reference_kwargs
    )
    assert torch.equal(ours.sequences, reference.sequences)
    for ours_step, reference_step in zip(ours.logits, reference.logits, strict=True):
        assert relative_error(ours_step, reference_step) < 1e-5


def test_save_writes_native_kdsa_that_reloads_identically(family, tmp_path):
    family.model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "kdsa" and "quantization_config" not in config
    reloaded = KDSAForCausalLM.from_pretrained(tmp_path).eval()
    assert set(reloaded.state_dict()) == set(family.model.state_dict())
    for name, tensor in family.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    # Bit-identical tensors; the logits may still differ in the last fp32 bit because CPU BLAS kernels depend on the
    # alignment of the (differently allocated) expert slices.
    with torch.no_grad():
        assert relative_error(reloaded(family.ids).logits, family.model(family.ids).logits) < 1e-6
    # A fresh model saved afterwards is native too: nothing of the conversion stays registered.
    KDSAForCausalLM(reloaded.config).save_pretrained(tmp_path / "fresh")
    assert set(load_file(tmp_path / "fresh" / "model.safetensors")) == set(family.model.state_dict())


@pytest.mark.slow
def test_saved_folder_reloads_by_remote_code(family, tmp_path):
    family.model.save_pretrained(tmp_path / "ckpt")
    torch.save(family.ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    # A fresh process that cannot import this package (conftest.run_without_the_package).
    result = run_without_the_package(script, cwd=tmp_path, HF_MODULES_CACHE=tmp_path / "modules")
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():  # see test_save_writes_native_kdsa_that_reloads_identically on the last bit
        assert relative_error(torch.load(tmp_path / "logits.pt"), family.model(family.ids).logits) < 1e-6


def test_bf16_load_keeps_router_and_decay_in_fp32(family):
    model = KDSAForCausalLM.from_pretrained(family.folder, dtype=torch.bfloat16).eval()
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    for name, param in params.items():
        if name.endswith(("A_log", "dt_bias")):
            assert param.dtype == torch.float32, name
    with torch.no_grad():
        # No numeric bound: the random tiny models' routing and indexer scores are near-tied, so bf16 rounding
        # flips expert and key choices; parity is checked in fp32 above.
        assert torch.isfinite(model(family.ids).logits).all()


def test_auto_class_keeps_transformers_own_class(family):
    auto = AutoModelForImageTextToText if family.name == "glm5_next" else AutoModelForCausalLM
    assert type(auto.from_pretrained(family.folder)) is type(family.reference)


# ------------------------------------------------------------------------------------------------ MTP and skips


def add_tensors(folder, tensors: dict[str, torch.Tensor]) -> None:
    """Append tensors to a sharded checkpoint as one more shard."""
    save_file(tensors, folder / "extra.safetensors", metadata={"format": "pt"})
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({name: "extra.safetensors" for name in tensors})
    index_file.write_text(json.dumps(index))


def remove_tensor(folder, name: str) -> None:
    """Delete one tensor from its shard and from the index."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = folder / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


def copy_of(family, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(family.folder, folder)
    return folder


# The trunk layer whose hub tensors the fixtures copy into an MTP block: a DSA layer with its own indexer and a MoE.
MTP_SOURCE_LAYER = {"deepseek_v32": 2, "glm5_next": 1}


def mtp_tensors(family, n: int) -> dict[str, torch.Tensor]:
    """A hub MTP layer at index `n`: a copy of a DSA + MoE trunk layer's tensors, perturbed, without mHC tensors
    (GLM's MTP layer is single-stream), plus enorm, hnorm, eh_proj, shared_head.norm and the copies of the embedding
    and lm_head (exact copies, as DeepSeek ships them)."""
    prefix = MTP_PREFIX[family.name]
    index = json.loads((family.folder / "model.safetensors.index.json").read_text())
    generator = torch.Generator().manual_seed(2)
    source = f"{prefix}{MTP_SOURCE_LAYER[family.name]}."
    tensors = {}
    for key, shard in index["weight_map"].items():
        if key.startswith(source) and ".hc_" not in key:
            tensor = load_file(family.folder / shard)[key]
            noise = 0.01 * torch.randn(tensor.shape, generator=generator) if tensor.is_floating_point() else 0
            tensors[f"{prefix}{n}." + key[len(source) :]] = tensor + noise
    hidden = family.model.config.hidden_size
    tensors[f"{prefix}{n}.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors[f"{prefix}{n}.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors[f"{prefix}{n}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=generator)
    tensors[f"{prefix}{n}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    tensors[f"{prefix}{n}.shared_head.head.weight"] = family.model.lm_head.weight.detach().clone()
    tensors[f"{prefix}{n}.embed_tokens.weight"] = family.model.model.embed_tokens.weight.detach().clone()
    return tensors


def with_mtp(family, tmp_path, changed: dict | None = None, **config_changes):
    """A copy of the family folder with one MTP layer declared (`num_nextn_predict_layers: 1`; GLM: in text_config)
    and stored (`changed`: tensors replaced or added); returns (folder, the MTP tensors)."""
    folder = copy_of(family, tmp_path)
    tensors = mtp_tensors(family, family.model.config.num_hidden_layers) | (changed or {})
    add_tensors(folder, tensors)
    edit_config(folder, text_config=family.name == "glm5_next", num_nextn_predict_layers=1, **config_changes)
    return folder, tensors


def mtp_name(family, key: str) -> str:
    """KDSA's name of a hub MTP tensor (one MTP layer at index num_hidden_layers)."""
    n = family.model.config.num_hidden_layers
    name = key.removeprefix(f"{MTP_PREFIX[family.name]}{n}.")
    if re.match(r"(enorm|hnorm|eh_proj|shared_head\.norm)\.", name):
        return f"mtp.layers.0.{name}"
    return f"mtp.layers.0.block.{name}"


def needs_mtp(family):
    if family.name not in MTP_PREFIX:
        pytest.skip(f"{family.name} checkpoints have no multi-token-prediction layers")


def test_mtp_layer_loads_tensor_by_tensor(family, tmp_path, caplog):
    needs_mtp(family)
    folder, tensors = with_mtp(family, tmp_path)
    with caplog.at_level(logging.INFO, logger="modeling_kdsa.conversion"):
        model = KDSAForCausalLM.from_pretrained(folder).eval()
    assert not [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]  # loaded, not skipped
    assert model.config.num_mtp_layers == 1 and model.mtp is not None
    ours = model.state_dict()
    checked = set()
    for key, tensor in tensors.items():
        if key.endswith(("shared_head.head.weight", "embed_tokens.weight")):
            continue  # the model's own lm_head / embedding (checked equal at load)
        if ".experts." in key:
            expert, proj = re.search(r"experts\.(\d+)\.(\w+)_proj", key).groups()
            kind = "down" if proj == "down" else "gate_up"
            stacked = mtp_name(family, key).split(".experts.")[0] + f".experts.{kind}_proj"
            part = ours[stacked][int(expert)]
            part = part if proj == "down" else part.chunk(2)[proj == "up"]
            assert torch.equal(part, tensor), key
            checked.add(stacked)
            continue
        assert torch.equal(ours[mtp_name(family, key)], tensor), key
        checked.add(mtp_name(family, key))
    assert checked == {name for name in ours if name.startswith("mtp.")}
    with torch.no_grad():  # the model's forward does not run the MTP layer
        assert torch.equal(model(family.ids).logits, family.model(family.ids).logits)


def test_mtp_layer_skipped_with_num_mtp_layers_0_and_one_info_line(family, tmp_path, caplog):
    needs_mtp(family)
    folder, _ = with_mtp(family, tmp_path)
    with caplog.at_level(logging.INFO, logger="modeling_kdsa.conversion"):
        model = KDSAForCausalLM.from_pretrained(folder, num_mtp_layers=0).eval()
    assert model.mtp is None and model.config.num_mtp_layers == 0
    n = family.model.config.num_hidden_layers
    lines = [
        r.getMessage() for r in caplog.records if r.name == "modeling_kdsa.conversion" and "layer" in r.getMessage()
    ]
    count = len(mtp_tensors(family, n))
    assert lines == [f"skipped {family.name} layer {n} (multi-token-prediction block): {count} tensors"]
    with torch.no_grad():
        assert torch.equal(model(family.ids).logits, family.model(family.ids).logits)
    with pytest.raises(ValueError, match="num_mtp_layers=2"):
        KDSAForCausalLM.from_pretrained(folder, num_mtp_layers=2)


def test_undeclared_mtp_layer_is_skipped_with_one_info_line(family, tmp_path, caplog):
    needs_mtp(family)
    folder = copy_of(family, tmp_path)
    n = family.model.config.num_hidden_layers
    add_tensors(folder, mtp_tensors(family, n))
    with caplog.at_level(logging.INFO, logger="modeling_kdsa.conversion"):
        model = KDSAForCausalLM.from_pretrained(folder).eval()
    assert model.mtp is None
    assert any(f"layer {n} (multi-token-prediction block)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("which", ["eh_proj.weight", "self_attn.indexer.wk.weight", "mlp.experts.1.up_proj.weight"])
def test_missing_mtp_tensor_is_refused_by_name(family, tmp_path, which):
    needs_mtp(family)
    folder, _ = with_mtp(family, tmp_path)
    n = family.model.config.num_hidden_layers
    key = f"{MTP_PREFIX[family.name]}{n}.{which}"
    remove_tensor(folder, key)
    expected = "mtp.layers.0.block.mlp.experts.gate_up_proj" if "experts" in which else mtp_name(family, key)
    with pytest.raises(ValueError, match=re.escape(expected)):
        KDSAForCausalLM.from_pretrained(folder)


def test_unexpected_mtp_tensor_is_refused_by_name(family, tmp_path):
    """A multi-stream (mHC) MTP layer's `hc_*` tensors: KDSA's MTP block is single-stream."""
    needs_mtp(family)
    n = family.model.config.num_hidden_layers
    folder, _ = with_mtp(family, tmp_path, {f"{MTP_PREFIX[family.name]}{n}.hc_attn_fn": torch.randn(24, 256)})
    with pytest.raises(ValueError, match=r"mtp\.layers\.0\.block\.(hc_attn_fn|attn_hc\.fn)"):
        KDSAForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("copy", ["shared_head.head", "embed_tokens"])
def test_mtp_copy_of_a_shared_tensor_that_differs_is_refused_by_name(family, tmp_path, copy):
    needs_mtp(family)
    key = f"{MTP_PREFIX[family.name]}{family.model.config.num_hidden_layers}.{copy}.weight"
    shared = family.model.lm_head if copy == "shared_head.head" else family.model.model.embed_tokens
    folder, _ = with_mtp(family, tmp_path, {key: shared.weight.detach() + 1e-3})
    with pytest.raises(ValueError, match=re.escape(key)):
        KDSAForCausalLM.from_pretrained(folder)


def test_kimi_mtp_layers_are_refused_by_name_unless_skipped():
    raw = kimi_linear_model().config.to_dict() | {"num_nextn_predict_layers": 1}
    with pytest.raises(ValueError, match="num_nextn_predict_layers=1"):
        plan_foreign_load(raw, [])
    keys = ["model.layers.4.eh_proj.weight"]
    plan = plan_foreign_load(raw, keys, {"num_mtp_layers": 0})
    assert plan.config.num_mtp_layers == 0 and list(plan.skipped.values()) == [
        "kimi_linear layer 4 (multi-token-prediction block)"
    ]


def test_glm_mtp_fields_are_read_from_text_config_or_top_level():
    raw = glm5_next_model().config.to_dict()
    raw["num_nextn_predict_layers"] = 1
    raw["text_config"]["index_share_for_mtp_iteration"] = True
    assert plan_foreign_load(raw, []).config.num_mtp_layers == 1
    raw["text_config"]["num_nextn_predict_layers"] = 2
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        plan_foreign_load(raw, [])
    raw["text_config"]["num_nextn_predict_layers"] = 1
    raw["text_config"]["index_share_for_mtp_iteration"] = "yes"
    with pytest.raises(ValueError, match="index_share_for_mtp_iteration"):
        plan_foreign_load(raw, [])


# ------------------------------------------------------------------------------------------------------ refusals


def test_unknown_config_field_is_refused(family, tmp_path):
    folder = copy_of(family, tmp_path)
    edit_config(folder, sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window"):
        KDSAForCausalLM.from_pretrained(folder)


def test_missing_tensor_is_refused_by_name(family, tmp_path):
    folder = copy_of(family, tmp_path)
    hub_name, kdsa_name = VICTIMS[family.name]
    remove_tensor(folder, hub_name)
    with pytest.raises(ValueError, match=rf"missing_keys.*{kdsa_name}"):
        KDSAForCausalLM.from_pretrained(folder)


def test_unexpected_tensor_is_refused_by_name(family, tmp_path):
    folder = copy_of(family, tmp_path)
    add_tensors(folder, {"model.layers.0.self_attn.rotary_gate.weight": torch.randn(4, 64)})
    with pytest.raises(ValueError, match=r"unexpected_keys.*rotary_gate"):
        KDSAForCausalLM.from_pretrained(folder)


def test_mismatched_tensor_is_refused_by_name(family, tmp_path):
    folder = copy_of(family, tmp_path)
    # the checkpoint's experts are 32 wide
    edit_config(folder, text_config=family.name == "glm5_next", moe_intermediate_size=16)
    with pytest.raises(ValueError, match="mlp.experts"):
        KDSAForCausalLM.from_pretrained(folder)


def test_foreign_config_is_refused_by_config_class(family):
    with pytest.raises(ValueError, match=f"describes a '{family.name}' model"):
        KDSAConfig.from_pretrained(family.folder)


def deepseek_raw(**changes) -> dict:
    raw = deepseek_v32_model().config.to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ({"n_group": 3, "topk_group": 1}, "n_group"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "quant_method"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt"),
        ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, "layer_types"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_deepseek_unsupported_values_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field):
        plan_foreign_load(deepseek_raw(**changes), [])


# The published config.json files, as their authors wrote them (legacy rope_scaling / rope_theta, torch_dtype, extra
# keys of the original remote code), shapes of the released models; only the translation runs.
DEEPSEEK_V32_HUB_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip
KIMI_LINEAR_HUB_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "eos_token_id": 163585,
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear", "moe_intermediate_size": 1024,
    "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27,
    "num_key_value_heads": 32, "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "transformers_version": "4.56.2", "use_cache": True, "use_grouped_topk": True,
    "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_deepseek_v32_hub_config_translates():
    plan = plan_foreign_load(DEEPSEEK_V32_HUB_CONFIG, ["model.layers.61.enorm.weight"])
    config = plan.config
    assert config.layer_types == ["indexed_attention"] * 61 and config.mlp_layer_types[2:4] == ["dense", "sparse"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 40
    assert (config.n_group, config.topk_group, config.mla_layernorm_eps) == (8, 4, 1e-6)
    assert config.attn_res_block_size == 0 and config.n_routed_experts == 256 and config.index_topk == 2048
    assert not hasattr(config, "quantization_config") or config.quantization_config is None
    assert plan.config.num_mtp_layers == 1 and plan.skipped == {}  # layer 61 loads as the MTP layer


def test_kimi_linear_hub_config_translates():
    config = plan_foreign_load(KIMI_LINEAR_HUB_CONFIG, []).config
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (256, 8, 1)
    assert config.max_position_embeddings == 1048576 and config.norm_topk_prob is True
    assert (config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim) == (32, 128, 4)
    assert config.mla_use_nope and config.mla_layernorm_eps == 1e-6 and config.q_lora_rank is None


def test_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="qwen3"):
        plan_foreign_load({"model_type": "qwen3"}, [])


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_expert_group": 3}, "n_group"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        (
            {"linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [], "gate_lower_bound": -5.0}},
            "gate_lower_bound",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_kimi_unsupported_values_are_refused_by_name(changes, field):
    raw = kimi_linear_model().config.to_dict()
    raw.update(changes)
    with pytest.raises(ValueError, match=field):
        plan_foreign_load(raw, [])


def test_kimi_one_based_layer_lists_are_translated():
    raw = kimi_linear_model().config.to_dict()
    del raw["layer_types"]
    raw["linear_attn_config"] = {"kda_layers": [1, 3, 4], "full_attn_layers": [2], "num_heads": 2, "head_dim": 16}
    plan = plan_foreign_load(raw, [])
    assert plan.config.layer_types == ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    assert plan.key_mapping == {r"\.layers\.(0|2|3)\.self_attn\.": r".layers.\1.linear_attn."}
    assert plan.config.mla_use_nope and plan.config.mla_layernorm_eps == 1e-6


# ------------------------------------------------------------------------------------------------ GLM-5.3-Flash


def test_glm_kpool_of_one_skips_its_inert_compression_tensors():
    raw = glm5_next_model(index_kpool=1).config.to_dict()
    keys = ["model.language_model.layers.1.self_attn.indexer.index_kpool_compress_ape"]
    plan = plan_foreign_load(raw, keys)
    assert plan.config.index_kpool == 1
    assert [re.search(p, keys[0]) is not None for p in plan.skipped] == [False, True]  # (vision, k-pool)
    assert not plan_foreign_load(glm5_next_model().config.to_dict(), keys).skipped.get(
        r"\.indexer\.index_kpool_compress_(ape|gate)$"
    )


def test_glm_shared_indexer_without_a_full_layer_before_it_is_refused_by_name():
    raw = glm5_next_model().config.to_dict()
    raw["text_config"]["indexer_types"] = ["full", "shared", "full", "full"]  # layer 0 is KDA
    with pytest.raises(ValueError, match="indexer_types"):
        plan_foreign_load(raw, [])


def kdsa_name(glm_name: str) -> str:
    name = glm_name.replace("model.language_model.", "model.")
    name = re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2", name)
    return re.sub(r"layers\.(0|3)\.self_attn\.(forget_gate\.)?", r"layers.\1.linear_attn.", name)


@pytest.mark.parametrize("original_format", [True, False], ids=["hub-layout", "runtime-layout"])
def test_glm_weights_map_tensor_by_tensor(tmp_path, caplog, original_format):
    """Hub layout: `model.language_model.` prefix, split q/k/v convs, `A_log [H]`, per-expert tensors. Runtime
    layout (`save_original_format=False`): fused `conv1d [3C, 1, W]`, `forget_gate.*`, stacked experts."""
    torch.manual_seed(0)
    reference = glm5_next_model()
    perturb_constants(reference)
    reference.save_pretrained(tmp_path / "glm", save_original_format=original_format)
    folder = tmp_path / "glm"
    tensors = load_file(folder / "model.safetensors")
    mtp = {"model.language_model.layers.4.eh_proj.weight": torch.randn(64, 128)}
    tensors = tensors | mtp
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="modeling_kdsa.conversion"):
        model = KDSAForCausalLM.from_pretrained(folder)
    lines = [r.getMessage() for r in caplog.records if r.name == "modeling_kdsa.conversion"]
    visual = sum(1 for k in tensors if k.startswith("model.visual."))
    assert lines == [
        "skipped glm5_next layer 4 (multi-token-prediction block): 1 tensors",
        f"skipped glm5_next vision tower model.visual.*: {visual} tensors",
    ]
    ours = model.state_dict()
    checked = set()
    for name, tensor in tensors.items():
        if name.startswith("model.visual.") or name in mtp:
            continue
        if ".experts." in name and not original_format:
            target = kdsa_name(name)
            assert torch.equal(ours[target], tensor), name
        elif ".experts." in name:
            expert, proj = re.search(r"experts\.(\d+)\.(\w+)_proj", name).groups()
            layer = kdsa_name(name).split(".experts.")[0]
            stacked = ours[f"{layer}.experts.{'down' if proj == 'down' else 'gate_up'}_proj"][int(expert)]
            part = {"gate": 0, "up": 1, "down": None}[proj]
            target = f"{layer}.experts.{'down' if proj == 'down' else 'gate_up'}_proj"
            assert torch.equal(stacked if part is None else stacked.chunk(2)[part], tensor), name
        elif name.endswith("conv1d.weight") and not original_format:
            layer = kdsa_name(name).rsplit(".", 2)[0]
            convs = [ours[f"{layer}.{p}_conv1d.weight"] for p in "qkv"]
            assert torch.equal(torch.cat(convs), tensor), name
            checked.update(f"{layer}.{p}_conv1d.weight" for p in "qkv")
            continue
        else:
            target = kdsa_name(name)
            expected = tensor.reshape(1, 1, -1, 1) if name.endswith("A_log") else tensor
            assert torch.equal(ours[target], expected), name
        checked.add(target)
    assert checked == set(ours)


def test_own_model_type_still_loads(tmp_path):
    KDSAConfig(num_hidden_layers=4).save_pretrained(tmp_path)
    assert KDSAConfig.from_pretrained(tmp_path).num_hidden_layers == 4


# ---------------------------------------------------------------------------------------------------------- FP8


def dequantize_fp8(quantized: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = quantized.shape
    expanded = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return quantized.float() * expanded


@pytest.fixture(scope="module", params=["deepseek_v32", "glm5_next"])
def fp8_family(request, tmp_path_factory):
    """The two families published in FP8."""
    return Family(request.param, tmp_path_factory.mktemp(f"{request.param}_fp8") / "hub")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return Family("deepseek_v32", tmp_path_factory.mktemp("deepseek_fp8") / "hub")


def test_fp8_checkpoint_matches_transformers_own_fp8_load(fp8_family, tmp_path):
    """Blocks of 8 divide every tiny dim, so transformers' own FP8 quantizer (which dequantizes on CPU) can load the
    folder too: the same FP8 weights must give the same logits; the save is native and unquantized."""
    deepseek = fp8_family
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=8)
    ours = KDSAForCausalLM.from_pretrained(tmp_path / "fp8").eval()
    reference = type(deepseek.reference).from_pretrained(tmp_path / "fp8").eval()
    with torch.no_grad():
        for seq_len in (SHORT, LONG):
            ids = deepseek.ids[:, :seq_len]
            assert relative_error(ours(ids).logits, reference(ids).logits) < 1e-5
    ours.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["model_type"] == "kdsa" and "quantization_config" not in config
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert not any(name.endswith("_scale_inv") for name in saved)
    assert all(t.dtype == torch.float32 for t in saved.values())
    with torch.no_grad():
        reloaded = KDSAForCausalLM.from_pretrained(tmp_path / "saved").eval()
        assert relative_error(reloaded(deepseek.ids).logits, ours(deepseek.ids).logits) < 1e-6


def test_fp8_partial_edge_blocks_dequantize_exactly(deepseek, tmp_path):
    """Blocks of 16 leave partial tiles (kv_a_proj_with_mqa has 40 rows: grid 3), as DeepSeek's 576-row projection
    does with blocks of 128; every weight equals e4m3 x scale_inv tile by tile, experts stacked after dequantizing,
    and each is within E4M3's rounding error (2^-4 relative) of the unquantized weight.

    transformers' own FP8 load cannot be the oracle here: it derives the block from the scale grid (rows // grid
    rows) and refuses a grid that does not divide the weight, so the tiles are checked against the formula. If that
    load starts to pass, compare logits with it as the block-8 test does."""
    quantized = fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    assert any(values.shape[0] % 16 for values, _ in quantized.values())
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        type(deepseek.reference).from_pretrained(tmp_path / "fp8")
    state = KDSAForCausalLM.from_pretrained(tmp_path / "fp8").state_dict()
    original = deepseek.model.state_dict()
    for name, (values, scale_inv) in quantized.items():
        expected = dequantize_fp8(values, scale_inv, 16)
        match = re.search(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if match:
            layer, expert, proj = match.group(1), int(match.group(2)), match.group(3)
            stacked = state[f"{layer}.{'down' if proj == 'down' else 'gate_up'}_proj"][expert]
            loaded = stacked if proj == "down" else stacked.chunk(2)[proj == "up"]
            unquantized = original[f"{layer}.{'down' if proj == 'down' else 'gate_up'}_proj"][expert]
            unquantized = unquantized if proj == "down" else unquantized.chunk(2)[proj == "up"]
        else:
            loaded, unquantized = state[name], original[name]
        assert torch.equal(loaded, expected), name
        assert (loaded - unquantized).abs().max() <= 2**-4 * unquantized.abs().max(), name


@pytest.mark.parametrize(
    "quantization, field",
    [
        ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static", "weight_block_size": [8, 8]}, "static"),
        ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [8, 8], "input_scale": 1.0}, "input_scale"),
    ],
    ids=["activation_scheme", "weight_block_size", "unknown"],
)
def test_fp8_unsupported_quantization_is_refused_by_name(quantization, field):
    with pytest.raises(ValueError, match=field):
        plan_foreign_load(deepseek_raw(quantization_config=quantization), [])


def test_fp8_scale_grid_that_does_not_fit_is_refused_by_name(deepseek, tmp_path):
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=8)
    edit_config(
        tmp_path / "fp8",
        quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
    )
    with pytest.raises(ValueError, match=r"could not be converted.*kv_a_proj_with_mqa\.weight.*weight_scale_inv shape"):
        KDSAForCausalLM.from_pretrained(tmp_path / "fp8")


def test_fp8_checkpoint_loads_in_bf16(deepseek, tmp_path):
    """`dtype=torch.bfloat16`: weights land in bf16 (router fp32) within bf16 rounding of the fp32 dequantization
    (the loader casts values and scales to bf16 before the op; E4M3 values are exact in bf16)."""
    quantized = fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    params = dict(KDSAForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16).named_parameters())
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for name in ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.self_attn.indexer.wq_b.weight"):
        expected = dequantize_fp8(*quantized[name], 16)
        assert params[name].dtype == torch.bfloat16
        torch.testing.assert_close(params[name].float(), expected, rtol=2**-7, atol=0)


# ---------------------------------------------------------------------------------------------- FP8 held in memory


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_fp8_linear_dequantizes_partial_edge_tiles_like_the_reference():
    """A 40 x 24 weight in blocks of 16 has partial tiles on both edges (grid 3 x 2): the forward equals a matmul
    with the test's own tile-by-tile dequantization, bit for bit."""
    torch.manual_seed(0)
    values, scale_inv = quantize_fp8(torch.randn(40, 24) * torch.logspace(-2, 1, 24), 16)
    assert tuple(scale_inv.shape) == (3, 2)
    layer = KDSAFP8Linear(values, scale_inv, (16, 16))
    x = torch.randn(5, 24)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize_fp8(values, scale_inv, 16)))
    with pytest.raises(ValueError, match=r"weight_scale_inv shape \(3, 2\).*expected grid \(5, 3\)"):
        KDSAFP8Linear(values, scale_inv, (8, 8))


def test_fp8_held_model_gives_the_dequantized_models_logits(fp8_family, tmp_path):
    """`fp8_weights="hold"`: every FP8 Linear reached by a plain rename is a `KDSAFP8Linear` (E4M3 + fp32 scales),
    stacked experts and kv_b_proj are dequantized at load; in fp32 the forward dequantizes to the very weights the
    default load holds (same fp32 products, same cast), so logits and greedy tokens are bit-identical."""
    quantized = fp8_copy(fp8_family.folder, tmp_path / "fp8", block=16)
    dequantized = KDSAForCausalLM.from_pretrained(tmp_path / "fp8").eval()
    held = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", fp8_weights="hold").eval()
    fp8_layers = {n: m for n, m in held.named_modules() if isinstance(m, KDSAFP8Linear)}
    assert len(fp8_layers) >= 4 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8_layers.values())
    assert not any(n.endswith("kv_b_proj") for n in fp8_layers)
    assert len(fp8_layers) < len(quantized)  # the routed experts' weights are not held
    by_suffix = {re.sub(r"^model\.(language_model\.)?", "", k): v for k, v in quantized.items()}
    compared = 0
    for name, layer in fp8_layers.items():  # the folder's own E4M3 values and fp32 scales, loaded as they are
        if (stored := by_suffix.get(name.removeprefix("model.") + ".weight")) is not None:
            assert torch.equal(layer.weight.view(torch.uint8), stored[0].view(torch.uint8)), name
            assert torch.equal(layer.weight_scale_inv, stored[1]), name
            compared += 1
    assert compared >= len(fp8_layers) // 2
    with torch.no_grad():
        for seq_len in (SHORT, LONG):
            ids = fp8_family.ids[:, :seq_len]
            assert torch.equal(held(ids).logits, dequantized(ids).logits)
    assert torch.equal(greedy(held, fp8_family.ids[:, :SHORT], 8), greedy(dequantized, fp8_family.ids[:, :SHORT], 8))


def test_fp8_held_weights_take_half_the_bytes_of_bf16(deepseek, tmp_path):
    """Parameter + buffer bytes of the held layers: E4M3 values (1 byte) + one fp32 scale per 16 x 16 tile, against
    the same layers loaded in bf16: 0.5x plus the scale grid (1/128 here, 1/8192 with DeepSeek's 128 x 128 blocks)."""
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    held = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, fp8_weights="hold")
    bf16 = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)
    names = [n for n, m in held.named_modules() if isinstance(m, KDSAFP8Linear)]
    held_bytes = sum(weight_bytes(held.get_submodule(n)) for n in names)
    bf16_bytes = sum(weight_bytes(bf16.get_submodule(n)) for n in names)
    assert 0.5 < held_bytes / bf16_bytes < 0.53
    assert weight_bytes(held) < weight_bytes(bf16)


@needs_kernel_build
@pytest.mark.usefixtures("kernels_at_this_thread_count")
def test_fp8_held_bf16_decode_runs_the_fused_kernel_eagerly_and_compiled(deepseek, tmp_path, monkeypatch):
    """A bf16 model held in FP8 with 32-column tiles: each eager decode step's held layers run the fused FP8 row kernel
    (docs/checkpoint-conversion.md §9), and generate()'s compiled static step holds it as ops of its one graph, with
    the eager tokens."""
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=32)
    held = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, fp8_weights="hold").eval()
    held_layers = sum(isinstance(m, KDSAFP8Linear) for m in held.modules())
    ids = deepseek.ids[:, : MAX_ROWS // 2 + 1]  # 2 sequences: a prompt of more rows than the kernel takes
    with monkeypatch.context() as spies, torch.no_grad():  # undone before the compile, which traces the op itself
        calls = count_calls(spies, cpu_fp8_dequantize, "fp8_row_linear")
        expected = greedy(held, ids, 6)
    assert len(calls) == 5 * held_layers  # the 5 decode steps
    recording, graphs = graph_recorder()

    config = cpu_compile_config(recording)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = greedy(held, ids, 6, cache_implementation="static", compile_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert len(graphs) == 1 and any("fp8_row_linear" in target for target in graph_targets(graphs))


@pytest.mark.parametrize("fp8_weights", ["hold", "dequantize"])
@pytest.mark.parametrize("kernel_backend", ["torch", "cpu"])
def test_fp8_load_dequantizes_with_the_models_backend(deepseek, tmp_path, monkeypatch, kernel_backend, fp8_weights):
    """The load's dequantization takes its `fp8_dequantize` from the model's `kernel_backend` (kernels.py), as the
    model's layers do: `torch` is the pure reference at load too, never the device policy's `auto`."""
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    asked = []
    choose = fp8_linear.kernel_set
    monkeypatch.setattr(fp8_linear, "kernel_set", lambda backend, device=None: asked.append(backend) or choose(backend))
    KDSAForCausalLM.from_pretrained(tmp_path / "fp8", kernel_backend=kernel_backend, fp8_weights=fp8_weights)
    assert asked and set(asked) == {kernel_backend}


@pytest.mark.parametrize("fp8_weights", ["hold", "dequantize"])
@pytest.mark.parametrize("damage", ["no scale", "E8M0 scale"])
def test_fp8_weight_without_an_fp32_scale_is_refused_by_name(deepseek, tmp_path, damage, fp8_weights):
    """An E4M3 tensor without its scale would land as raw E4M3 values in a held layer; an E8M0 (uint8) scale reaches
    either path already cast to the load dtype as an integer (x 2^(127+e) too large). Both are ValueErrors naming the
    tensor, whichever way the weights are loaded."""
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    key = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    index_file = tmp_path / "fp8" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = tmp_path / "fp8" / index["weight_map"][key]
    tensors = load_file(shard)
    if damage == "no scale":
        del tensors[key], index["weight_map"][key]
        expected = r"q_b_proj\.weight \(no weight_scale_inv\)"
    else:
        tensors[key] = (tensors[key].log2().round() + 127).to(torch.uint8)
        expected = r"q_b_proj\.weight_scale_inv \(U8, not F32\)"
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=expected):
        KDSAForCausalLM.from_pretrained(tmp_path / "fp8", fp8_weights=fp8_weights)


def test_fp8_held_model_refuses_save_and_tensor_parallel_by_name(deepseek, tmp_path):
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    held = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", fp8_weights="hold")
    with pytest.raises(ValueError, match="fp8_weights='dequantize'"):
        held.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    mesh = ParallelMesh(cp_size=1, tp_size=2, cp_rank=0, tp_rank=0, cp_group=None, tp_group=None, device="cpu")
    with pytest.raises(ValueError, match="fp8_weights='dequantize'"):
        apply_tensor_parallel(held, mesh)


def test_fp8_weights_option_is_refused_where_it_does_not_apply(deepseek, tmp_path):
    with pytest.raises(ValueError, match="fp8_weights='hold'.*no FP8 quantization_config"):
        KDSAForCausalLM.from_pretrained(deepseek.folder, fp8_weights="hold")
    with pytest.raises(ValueError, match="fp8_weights='keep' must be one of"):
        KDSAForCausalLM.from_pretrained(deepseek.folder, fp8_weights="keep")
    deepseek.model.save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match="fp8_weights= applies to FP8 checkpoints"):
        KDSAForCausalLM.from_pretrained(tmp_path / "native", fp8_weights="hold")


def test_fp8_held_weights_combine_with_the_kdsa_cache_quantizer(deepseek, tmp_path):
    """The FP8 folder's own quantization_config is translated, never handed to transformers, so the one quantizer of
    the load stays free for KDSA's cache formats (here the bf16 ones, so logits stay bit-identical)."""
    fp8_copy(deepseek.folder, tmp_path / "fp8", block=16)
    cache_formats = KDSAQuantizationConfig(indexer="bf16", kv_cache="bf16")
    held = KDSAForCausalLM.from_pretrained(tmp_path / "fp8", fp8_weights="hold", quantization_config=cache_formats)
    dequantized = KDSAForCausalLM.from_pretrained(tmp_path / "fp8")
    assert held.config.quantization_config.quant_method == "kdsa"
    assert any(isinstance(m, KDSAFP8Linear) for m in held.modules())
    with torch.no_grad():
        assert torch.equal(held.eval()(deepseek.ids).logits, dequantized.eval()(deepseek.ids).logits)
