"""save_pretrained of a sharded model (docs/parallel.md §10), on gloo: every rank calls it, the cut tensors are
gathered over the tp group and the routed experts over the ep group, global rank 0 writes, and the folder loads whole
in one process with the whole model's tensors, bit for bit: tp = 2 and ep = 2 (2 processes), tp 2 × ep 2 (4)."""

import json
import os
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_ranks_in_folder

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "kdsa-tiny")


def _state(model) -> dict:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _scenario(rank: int, results: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_tensor_parallel, init_parallel_mesh
    from modeling_kdsa.parallel.tensor_parallel import gather_whole_state_dict

    from modeling_kdsa import KDSAForCausalLM

    # A tp_plan load of the shipped checkpoint, saved and loaded back whole.
    sharded = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32)
    loaded_folder = os.path.join(out_dir, "from_tp_plan")
    sharded.save_pretrained(loaded_folder)
    results["tp_plan_files"] = sorted(os.listdir(loaded_folder))
    results["tp_plan_saved"] = _state(KDSAForCausalLM.from_pretrained(loaded_folder, dtype=torch.float32))
    results["whole"] = _state(KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32))
    with open(os.path.join(loaded_folder, "config.json")) as file:
        results["tp_plan_config"] = json.load(file)
    with open(os.path.join(CHECKPOINT, "config.json")) as file:
        results["checkpoint_config"] = json.load(file)
    # The saved folder loads sharded again: this rank's pieces equal those of the first load.
    again = KDSAForCausalLM.from_pretrained(loaded_folder, tp_plan="auto", dtype=torch.float32)
    first, second = _state(sharded), _state(again)
    results["resharded_equal"] = first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    # The base model through AutoModel: the same gather (its embedding is cut too; it has no head).
    from transformers import AutoModel

    base_folder = os.path.join(out_dir, "base_from_tp_plan")
    AutoModel.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32).save_pretrained(base_folder)
    results["base_saved"] = _state(AutoModel.from_pretrained(base_folder, dtype=torch.float32))
    results["base_whole"] = _state(AutoModel.from_pretrained(CHECKPOINT, dtype=torch.float32))

    # apply_tensor_parallel on a model with MLA biases (o_proj's is kept on tp rank 0 only), saved whole.
    torch.manual_seed(0)  # the same random model on both ranks
    model = tiny_model(attention_bias=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5)
    results["tiny_whole"] = _state(model)
    mesh = init_parallel_mesh(cp_size=1, tp_size=2)
    apply_tensor_parallel(model, mesh)
    results["tiny_local_o_bias_norm"] = model.model.layers[1].self_attn.o_proj.bias.norm().item()
    results["tiny_gathered"] = gather_whole_state_dict(model, model.state_dict(), mesh.tp_group)  # on every rank
    tiny_folder = os.path.join(out_dir, "from_apply_tensor_parallel")
    model.save_pretrained(tiny_folder)
    results["tiny_saved"] = _state(KDSAForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32))

    # Expert parallelism, ep = 2: the shipped checkpoint, and Kimi K3's packed MXFP4 LatentMoE experts.
    k3_folder = os.path.join(out_dir, "kimi_k3_mxfp4")
    if rank == 0:
        from test_distributed_loading import _write_kimi_k3_folder

        _write_kimi_k3_folder(Path(k3_folder), published=True)
    dist.barrier()
    for name, folder in (("ep_checkpoint", CHECKPOINT), ("ep_k3", k3_folder)):
        ep_model = KDSAForCausalLM.from_pretrained(folder, distributed_config={"tp_size": 1, "ep_size": 2})
        experts = next(layer.mlp.experts for layer in ep_model.model.layers if hasattr(layer.mlp, "experts"))
        results[f"{name}_experts"] = (experts.local_experts.num_experts, ep_model.config.n_routed_experts)
        ep_model.save_pretrained(os.path.join(out_dir, name))
        results[f"{name}_saved"] = _state(KDSAForCausalLM.from_pretrained(os.path.join(out_dir, name)))
        results[f"{name}_whole"] = _state(KDSAForCausalLM.from_pretrained(folder))
    dist.barrier()


def _scenario_four(rank: int, results: dict, out_dir: str) -> None:
    """tp 2 × ep 2 on 4 processes: the experts are cut by tp inside each ep rank's block, gathered over both."""
    from modeling_kdsa import KDSAForCausalLM

    model = KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config={"tp_size": 2, "ep_size": 2})
    experts = model.model.layers[1].mlp.experts.local_experts
    results["local_expert_shape"] = tuple(experts.down_proj.shape)
    model.save_pretrained(os.path.join(out_dir, "tp2_ep2"))
    results["saved"] = _state(KDSAForCausalLM.from_pretrained(os.path.join(out_dir, "tp2_ep2")))
    results["whole"] = _state(KDSAForCausalLM.from_pretrained(CHECKPOINT))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario, 2, timeout_s=400)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario_four, 4, timeout_s=400)


def _assert_same_state(saved: dict, whole: dict) -> None:
    assert saved.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(saved[name], tensor), name


def test_tp_plan_load_saves_the_whole_model(two_ranks):
    for result in two_ranks:
        _assert_same_state(result["tp_plan_saved"], result["whole"])
        assert "model.safetensors" in result["tp_plan_files"]
        assert result["resharded_equal"]
        # No layout of the load leaks into the saved config.
        saved, original = result["tp_plan_config"], result["checkpoint_config"]
        assert not {"distributed_config", "tp_size", "tp_plan"} & saved.keys()
        for key in ("hidden_size", "num_attention_heads", "linear_num_heads", "moe_intermediate_size"):
            assert saved[key] == original[key]


def test_base_model_loaded_by_auto_model_saves_the_whole_model(two_ranks):
    for result in two_ranks:
        _assert_same_state(result["base_saved"], result["base_whole"])


def test_apply_tensor_parallel_model_saves_the_whole_model_with_its_biases(two_ranks):
    """The row-parallel o_proj bias lives on tp rank 0 only; the saved folder holds it once, unchanged."""
    assert two_ranks[0]["tiny_local_o_bias_norm"] > 0 and two_ranks[1]["tiny_local_o_bias_norm"] == 0
    for result in two_ranks:
        _assert_same_state(result["tiny_saved"], result["tiny_whole"])
        _assert_same_state(result["tiny_gathered"], result["tiny_whole"])  # rank 1 too: its zero biases summed in


@pytest.mark.parametrize("name", ["ep_checkpoint", "ep_k3"])
def test_expert_parallel_model_saves_the_whole_model(two_ranks, name):
    """Each rank holds half the routed experts (stacked weights, or K3's packed MXFP4 buffers); the saved folder has
    them all, in order, under the unsharded names."""
    for result in two_ranks:
        local, total = result[f"{name}_experts"]
        assert local * 2 == total
        _assert_same_state(result[f"{name}_saved"], result[f"{name}_whole"])


def test_tensor_and_expert_parallel_model_saves_the_whole_model(four_ranks):
    whole = four_ranks[0]["whole"]["model.layers.1.mlp.experts.down_proj"]
    for result in four_ranks:
        experts, width, intermediate = whole.shape
        assert result["local_expert_shape"] == (experts // 2, width, intermediate // 2)
        _assert_same_state(result["saved"], result["whole"])
