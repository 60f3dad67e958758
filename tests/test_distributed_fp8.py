"""Sharded loading of block-scaled FP8 folders (DeepSeek-V3.2, GLM-5.3-Flash; docs/parallel.md §10), on gloo with
2 processes: transformers' shard-on-read slices each `weight_scale_inv` by its weight's own cut, so a tp cut that
falls on the scale blocks reads each rank's slice of both, a cut of a dense weight that does not is read whole and
cut after the load, and a cut of the routed experts that does not is refused on every rank.

The tiny fixtures' FP8 copies (eval/family_fixtures.py `fp8_copy`) quantize every decoder-layer linear weight, the
KDA projections too. At tp = 2 with 16 × 16 blocks the KDA `b_proj` (2 heads: one row per rank) is the one weight
off its grid; with 32 × 32 blocks the DeepSeek fixture's `q_b_proj` (48 rows per rank), dense MLP (48) and experts
(16 rows per rank) are.
"""

import os
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_ranks_in_folder
from test_distributed_loading import _compare, _compare_expert_parallel, _counting_reads
from test_parallel_distributed import _expect_error

VOCAB = 100
LOGIT_TOLERANCE = 1e-4
GREEDY_STEPS = 32
EP_LAYOUT = {"tp_size": 1, "ep_size": 2}  # DistributedConfig refuses ep_size > tp_size without FSDP: a dict


def _folders(out_dir: str) -> dict[str, str]:
    return {name: os.path.join(out_dir, name) for name in ("glm_fp8_16", "deepseek_fp8_16", "deepseek_fp8_32")}


def _write_folders(out_dir: str) -> None:
    from modeling_kdsa.eval import family_fixtures

    for family in ("glm5_next", "deepseek_v32"):
        torch.manual_seed(0)
        reference = getattr(family_fixtures, f"{family}_model")()
        family_fixtures.perturb_constants(reference)
        reference.save_pretrained(os.path.join(out_dir, family), max_shard_size="40KB")
    folders = _folders(out_dir)
    family_fixtures.fp8_copy(Path(out_dir) / "glm5_next", Path(folders["glm_fp8_16"]), block=16)
    family_fixtures.fp8_copy(Path(out_dir) / "deepseek_v32", Path(folders["deepseek_fp8_16"]), block=16)
    family_fixtures.fp8_copy(Path(out_dir) / "deepseek_v32", Path(folders["deepseek_fp8_32"]), block=32)


def _tp_checks(results: dict, folders: dict, names: tuple[str, ...]) -> None:
    """tp = 2 (`tp_plan="auto"`) on each named FP8 folder: what each rank reads, which weights it reads whole, its
    tensors against `apply_tensor_parallel`'s cut of the whole dequantized load, logits and `generate()` against the
    single process."""
    from modeling_kdsa.parallel import apply_tensor_parallel, init_parallel_mesh

    from modeling_kdsa import KDSAForCausalLM

    for name in names:
        with _counting_reads() as read:
            sharded = KDSAForCausalLM.from_pretrained(folders[name], tp_plan="auto", dtype=torch.float32)
        with _counting_reads() as read_by_one:
            whole = KDSAForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
        results[f"{name}_read"] = (sum(read), sum(read_by_one))
        results[f"{name}_read_whole"] = getattr(sharded.config.distributed_config, "kdsa_read_whole", ())
        one = KDSAForCausalLM.from_pretrained(folders[name], dtype=torch.float32)
        expected = apply_tensor_parallel(one, init_parallel_mesh(cp_size=1, tp_size=2)).state_dict()
        loaded = sharded.state_dict()
        results[f"{name}_state_equal"] = loaded.keys() == expected.keys() and all(
            torch.equal(loaded[key], tensor) for key, tensor in expected.items()
        )
        _compare(results, name, sharded, whole, VOCAB)


def _expert_checks(results: dict, layout: dict, folders: dict, names: tuple[str, ...], **load) -> None:
    """Expert parallelism (`layout`) on each named FP8 folder, against the single process (`load`: more arguments)."""
    from modeling_kdsa import KDSAForCausalLM

    prefix = f"tp{layout['tp_size']}_ep{layout['ep_size']}"
    for name in names:
        sharded = KDSAForCausalLM.from_pretrained(folders[name], distributed_config=layout, dtype=torch.float32, **load)
        results[f"{prefix}_{name}_read_whole"] = sharded.config.distributed_config.kdsa_read_whole
        whole = KDSAForCausalLM.from_pretrained(folders[name], dtype=torch.float32, **load)
        _compare_expert_parallel(results, f"{prefix}_{name}", sharded, whole, VOCAB)


def _scenario_two(rank: int, results: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from modeling_kdsa import KDSAForCausalLM

    dist.init_process_group("gloo")
    if rank == 0:
        _write_folders(out_dir)
    dist.barrier()
    folders = _folders(out_dir)
    _tp_checks(results, folders, ("glm_fp8_16", "deepseek_fp8_16"))
    _expert_checks(results, EP_LAYOUT, folders, ("glm_fp8_16", "deepseek_fp8_32"))
    results["ep2_hold"] = {}
    _expert_checks(results["ep2_hold"], EP_LAYOUT, folders, ("deepseek_fp8_32",), fp8_weights="hold")
    results["error_experts"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(folders["deepseek_fp8_32"], tp_plan="auto")
    )


def _scenario_four(rank: int, results: dict, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 0:
        _write_folders(out_dir)
    dist.barrier()
    _expert_checks(results, {"tp_size": 2, "ep_size": 2}, _folders(out_dir), ("glm_fp8_16",))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario_two, 2, timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario_four, 4, timeout_s=300)


def _check_generate(results: dict, name: str) -> None:
    assert results[f"{name}_logits_error"] < LOGIT_TOLERANCE, name
    for run in ("greedy", "sampled", "left_padded"):
        assert results[f"{name}_{run}_equal"], (name, run)


@pytest.mark.parametrize("name", ["glm_fp8_16", "deepseek_fp8_16"])
def test_tp2_fp8_load_is_the_cut_of_the_whole_dequantized_load(two_ranks, name):
    """Every rank holds `apply_tensor_parallel`'s cut of the one-process load, bit for bit, and generates its
    tokens; both ranks read well under what one process reads (half of each cut weight and of its scales)."""
    for results in two_ranks:
        assert results[f"{name}_state_equal"], name
        _check_generate(results, name)
        read, read_by_one = results[f"{name}_read"]
        assert read < 0.65 * read_by_one, (name, read, read_by_one)
    assert all(torch.equal(r[f"{name}_greedy_tokens"], two_ranks[0][f"{name}_greedy_tokens"]) for r in two_ranks)


def test_only_the_weights_off_their_scale_blocks_are_read_whole(two_ranks):
    """GLM's KDA `b_proj` (2 heads, one row per rank, 16-row blocks) is read whole and cut after the load; every
    DeepSeek cut falls on its 16 × 16 blocks, so that load is transformers' plain tp load."""
    for results in two_ranks:
        assert results["glm_fp8_16_read_whole"] == (
            "model.layers.0.linear_attn.b_proj.weight",
            "model.layers.3.linear_attn.b_proj.weight",
        )
        assert results["deepseek_fp8_16_read_whole"] == ()


@pytest.mark.parametrize("name", ["glm_fp8_16", "deepseek_fp8_32"])
def test_ep2_fp8_load_matches_the_single_process(two_ranks, name):
    """ep = 2 moves whole experts, so no cut meets a scale block: even the 32 × 32 blocks load."""
    for results in two_ranks:
        assert results[f"tp1_ep2_{name}_logits_error"] < LOGIT_TOLERANCE
        assert results[f"tp1_ep2_{name}_greedy_equal"]
        assert results[f"tp1_ep2_{name}_read_whole"] == ()
    assert [r[f"tp1_ep2_{name}_rows"] for r in two_ranks] == [(0, 2), (2, 3)]


def test_ep2_with_fp8_held_layers_matches_the_single_process(two_ranks):
    """`fp8_weights="hold"` under ep = 2: the held linear layers stay whole, the dequantized experts move."""
    for results in two_ranks:
        held = results["ep2_hold"]
        assert held["tp1_ep2_deepseek_fp8_32_logits_error"] < LOGIT_TOLERANCE
        assert held["tp1_ep2_deepseek_fp8_32_greedy_equal"]


def test_tp_cut_of_fp8_experts_off_their_blocks_is_refused_on_every_rank(two_ranks):
    for results in two_ranks:
        assert results["error_experts"].startswith("rank 0 (and 1 more rank(s)): tp_size=2 cuts the FP8 routed")
        assert "model.layers.1.mlp.experts.gate_up_proj" in results["error_experts"]
        assert "[32, 32] scale blocks" in results["error_experts"]


def test_tp2_ep2_fp8_load_reads_the_misaligned_weights_whole(four_ranks):
    """tp 2 × ep 2 (4 processes) on GLM's FP8 folder: the expert-parallel path marks the same `b_proj` weights."""
    for results in four_ranks:
        assert results["tp2_ep2_glm_fp8_16_logits_error"] < LOGIT_TOLERANCE
        assert results["tp2_ep2_glm_fp8_16_greedy_equal"]
        assert len(results["tp2_ep2_glm_fp8_16_read_whole"]) == 2
