"""Expert parallelism on real process groups (gloo, CPU): 2 and 4 processes spawned with torch.multiprocessing.

Each group of processes runs once per module (a fixture) and writes what it saw to disk; the tests below read it.
Every rank builds the same models (same seeds) and the same batch of prompts, runs its own share of the batch
(`ExpertParallelMesh.batch_rows`, DeepSeek-V3's data-parallel layout outside the experts, docs/parallel.md §9) and
compares with the single-process model on the whole batch. The packed / FP8 / checkpoint cases and the 4-process
scenario are marked slow: each is one more group of processes that import torch, on top of the default ep = 2 one.

Tolerance for logits, 1e-4 absolute (logits are O(1)), as in tests/test_parallel_distributed.py: each expert sees
the same rows in the same order as in one process and the combine adds in the same order, so what differs is the
batch size of the attention / KDA matmuls (a rank runs 1-2 of the 3 rows) and, under tp, the partial sums over tp
ranks. A token sent to the wrong expert or weighted by the wrong slot changes logits by > 1e-2.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, run_on_ranks
from test_parallel_distributed import _expect_error, _prompt

LOGIT_TOLERANCE = 1e-4
PROMPT_LEN = 37
BATCH = 3  # not a multiple of ep: the shares differ (2 + 1 rows at ep = 2)
GENERATE_STEPS = 32
CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"


def _model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _expert_bytes(model) -> int:
    from modeling_kdsa.moe import KDSAMoE

    return sum(_model_bytes(layer.mlp.experts) for layer in model.model.layers if isinstance(layer.mlp, KDSAMoE))


def _compare(results: dict, name: str, make_model, mesh, ids, generate: bool = False) -> None:
    """`results[name + "_error"]`: max |logits − single process| on this rank's rows; with `generate`, whether 32
    greedy tokens (with the cache) equal the single-process ones."""
    from modeling_kdsa.parallel import apply_expert_parallel

    reference_model = make_model()
    rows = mesh.batch_rows(ids.shape[0]) if hasattr(mesh, "batch_rows") else slice(None)
    sharded = apply_expert_parallel(make_model(), mesh)
    with torch.no_grad():
        results[f"{name}_error"] = (sharded(ids[rows]).logits - reference_model(ids).logits[rows]).abs().max().item()
    if generate:
        options = dict(max_new_tokens=GENERATE_STEPS, min_new_tokens=GENERATE_STEPS, do_sample=False)
        # synced_gpus: a rank whose sequences all ended keeps calling the model, so no rank waits in an all-to-all.
        tokens = sharded.generate(ids[rows], synced_gpus=True, **options)
        reference_tokens = reference_model.generate(ids, **options)[rows]
        results[f"{name}_generate_equal"] = bool(torch.equal(tokens, reference_tokens))
        results[f"{name}_generated"] = tokens.shape[1] - ids.shape[1]


def _latent_mxfp4_model():
    """Kimi K3's LatentMoE with packed MXFP4 routed experts, filled with random MXFP4 weights (not zeros)."""
    from conftest import tiny_model

    from modeling_kdsa.numeric_formats import mxfp4_quantize

    model = tiny_model(routed_expert_hidden_size=32, latent_moe_use_norm=True, routed_expert_weight_format="mxfp4")
    generator = torch.Generator().manual_seed(3)
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        for name in ("gate_up_proj", "down_proj") if experts is not None else ():
            packed = getattr(experts, f"{name}_packed")
            values = torch.randn(*packed.shape[:-1], packed.shape[-1] * 2, generator=generator) * 0.1
            packed_values, scales = mxfp4_quantize(values)
            packed.copy_(packed_values)
            getattr(experts, f"{name}_scale").copy_(scales)
    return model


def _fp8_held_model():
    """The tiny model with its shared experts and dense MLP held FP8 (`KDSAFP8Linear`, 16×16 blocks), as
    `fp8_weights="hold"` loads them; the routed experts stay stacked (they load dequantized)."""
    from conftest import tiny_model

    from modeling_kdsa.fp8_linear import KDSAFP8Linear

    model = tiny_model()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".mlp." in n]
    for name in names:
        linear = model.get_submodule(name)
        held = KDSAFP8Linear.like(linear, (16, 16))
        with torch.no_grad():
            held.weight.copy_((linear.weight * 64).to(torch.float8_e4m3fn))
            held.weight_scale_inv.fill_(1 / 64)
        model.set_submodule(name, held)
    return model


# ------------------------------------------------------------------------------------------------ the workers


def _scenario_two(rank: int, results: dict) -> None:
    """2 processes: ep = 2 on the tiny model (mesh and bare group), traffic, bytes, error paths."""
    import torch.distributed as dist
    from conftest import tiny_model
    from modeling_kdsa.parallel import (
        apply_expert_parallel,
        apply_tensor_parallel,
        init_expert_parallel_mesh,
        init_parallel_mesh,
    )

    ids = _prompt(PROMPT_LEN, batch=BATCH)
    mesh = init_expert_parallel_mesh(tp_size=1, ep_size=2)
    results["rows"] = mesh.batch_rows(BATCH)
    _compare(results, "ep2", tiny_model, mesh, ids, generate=True)
    _compare(results, "ep2_group", tiny_model, dist.group.WORLD, ids[:1])  # every rank the same one row

    # Traffic of one forward of this rank's rows, and what each rank holds.
    reference = tiny_model()
    sharded = apply_expert_parallel(tiny_model(), mesh)
    mesh.traffic.reset()
    with torch.no_grad():
        sharded(ids[mesh.batch_rows(BATCH)])
    results["traffic"] = dict(vars(mesh.traffic))
    results["bytes"] = _model_bytes(sharded)
    results["reference_bytes"], results["reference_expert_bytes"] = _model_bytes(reference), _expert_bytes(reference)
    results["local_expert_shape"] = tuple(sharded.model.layers[1].mlp.experts.local_experts.gate_up_proj.shape)
    results["first_expert"] = sharded.model.layers[1].mlp.experts.first_expert
    # One MoE layer alone (top-3 of 8, so that the order of the additions matters), each rank on its consecutive share
    # of 111 tokens (the grouped expert path in both).
    top3 = dict(n_routed_experts=8, num_experts_per_tok=3)
    layer, sharded_layer = tiny_model(**top3).model.layers[1].mlp, apply_expert_parallel(tiny_model(**top3), mesh)
    tokens = torch.randn(BATCH * PROMPT_LEN, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
    share = mesh.batch_rows(tokens.shape[0])
    with torch.no_grad():
        expected = layer(tokens[None])[0, share]
        output = sharded_layer.model.layers[1].mlp(tokens[None, share])[0]
    results["moe_layer_error"] = (output - expected).abs().max().item()

    # Error paths: each must raise a ValueError on every rank, and return (no rank left waiting).
    results["error_experts"] = _expect_error(lambda: apply_expert_parallel(tiny_model(n_routed_experts=3), mesh))
    results["error_experts_only_rank1"] = _expect_error(
        lambda: apply_expert_parallel(tiny_model(n_routed_experts=3 if rank == 1 else 4), mesh)
    )
    results["error_world_size"] = _expect_error(lambda: init_expert_parallel_mesh(tp_size=2, ep_size=2))
    results["error_mixed_sizes"] = _expect_error(lambda: init_expert_parallel_mesh(tp_size=1 + rank, ep_size=2 - rank))
    results["error_twice"] = _expect_error(lambda: apply_expert_parallel(sharded, mesh))
    tp_mesh = init_parallel_mesh(cp_size=1, tp_size=2)
    results["error_after_tp"] = _expect_error(
        lambda: apply_expert_parallel(apply_tensor_parallel(tiny_model(), tp_mesh), mesh)
    )
    dense_only = dict(mlp_layer_types=["dense"] * 4)
    results["error_no_experts"] = _expect_error(lambda: apply_expert_parallel(tiny_model(**dense_only), mesh))
    try:
        apply_expert_parallel(tiny_model(), 2)
    except TypeError as error:
        results["error_type"] = str(error)


def _scenario_two_formats(rank: int, results: dict) -> None:
    """2 processes: ep = 2 on LatentMoE with packed MXFP4 experts, FP8-held MLPs, grouped routing with top-3, and
    the shipped checkpoint."""
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_expert_parallel, init_expert_parallel_mesh

    from modeling_kdsa import KDSAForCausalLM

    ids = _prompt(PROMPT_LEN, batch=BATCH)
    mesh = init_expert_parallel_mesh(tp_size=1, ep_size=2)
    _compare(results, "ep2_latent_mxfp4", _latent_mxfp4_model, mesh, ids, generate=True)
    _compare(results, "ep2_fp8_held", _fp8_held_model, mesh, ids)
    grouped = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    _compare(results, "ep2_grouped", lambda: tiny_model(**grouped), mesh, ids)
    if (CHECKPOINT / "config.json").is_file():
        load = lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT).eval()  # noqa: E731
        _compare(results, "ep2_checkpoint", load, mesh, ids, generate=True)
    latent = apply_expert_parallel(_latent_mxfp4_model(), mesh)
    results["latent_bytes"] = _model_bytes(latent)
    results["latent_reference_bytes"] = _model_bytes(_latent_mxfp4_model())
    results["latent_reference_expert_bytes"] = _expert_bytes(_latent_mxfp4_model())


def _scenario_four(rank: int, results: dict) -> None:
    """4 processes: tp = 2 × ep = 2 (logits, generate, traffic, bytes), ep = 4, tp-side errors."""
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_expert_parallel, apply_tensor_parallel, init_expert_parallel_mesh

    ids = _prompt(PROMPT_LEN, batch=BATCH)
    mesh = init_expert_parallel_mesh(tp_size=2, ep_size=2)
    results["tp_rank"], results["ep_rank"] = mesh.tp.tp_rank, mesh.ep_rank
    results["rows"] = mesh.batch_rows(BATCH)
    _compare(results, "tp2_ep2", tiny_model, mesh, ids, generate=True)

    sharded = apply_expert_parallel(tiny_model(), mesh)
    mesh.traffic.reset()
    with torch.no_grad():
        sharded(ids[mesh.batch_rows(BATCH)])
    results["traffic"] = dict(vars(mesh.traffic))
    results["bytes"] = _model_bytes(sharded)
    tp_only = apply_tensor_parallel(tiny_model(), mesh.tp)
    results["tp_only_rest_bytes"] = _model_bytes(tp_only) - _expert_bytes(tp_only)
    results["reference_expert_bytes"] = _expert_bytes(tiny_model())

    ep4 = init_expert_parallel_mesh(tp_size=1, ep_size=4)
    _compare(results, "ep4", tiny_model, ep4, _prompt(PROMPT_LEN, batch=4))

    results["error_heads"] = _expect_error(lambda: apply_expert_parallel(tiny_model(linear_num_heads=3), mesh))
    latent = dict(routed_expert_hidden_size=32, routed_expert_weight_format="mxfp4")
    results["error_latent_tp"] = _expect_error(lambda: apply_expert_parallel(tiny_model(**latent), mesh))
    results["error_experts"] = _expect_error(lambda: apply_expert_parallel(tiny_model(n_routed_experts=6), ep4))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_scenario_two, 2)


@pytest.fixture(scope="module")
def two_ranks_formats() -> list[dict]:
    return run_on_ranks(_scenario_two_formats, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_scenario_four, 4)


# ------------------------------------------------------------------------------------------------------ tests


def test_ep2_logits_and_generate_match_single_process(two_ranks):
    """Rank 0 runs rows 0-1 of the batch, rank 1 row 2; with the bare process group both run row 0."""
    assert [result["rows"] for result in two_ranks] == [slice(0, 2), slice(2, 3)]
    for result in two_ranks:
        assert result["ep2_error"] < LOGIT_TOLERANCE
        assert result["ep2_group_error"] < LOGIT_TOLERANCE
        assert result["ep2_generated"] == GENERATE_STEPS
        assert result["ep2_generate_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ep2_latent_mxfp4", "ep2_fp8_held", "ep2_grouped"])
def test_ep2_formats_match_single_process(two_ranks_formats, case):
    for result in two_ranks_formats:
        assert result[f"{case}_error"] < LOGIT_TOLERANCE
    if case == "ep2_latent_mxfp4":
        assert all(result[f"{case}_generate_equal"] for result in two_ranks_formats)


@pytest.mark.slow
@pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(), reason="checkpoints/kdsa-tiny is not in this checkout")
def test_ep2_shipped_checkpoint(two_ranks_formats):
    """checkpoints/kdsa-tiny has 3 MoE layers of 4 routed experts and a shared expert."""
    for result in two_ranks_formats:
        assert result["ep2_checkpoint_error"] < LOGIT_TOLERANCE
        assert result["ep2_checkpoint_generated"] == GENERATE_STEPS
        assert result["ep2_checkpoint_generate_equal"]


def test_ep2_moe_layer_is_bit_identical(two_ranks):
    """With consecutive token shares each expert multiplies the same rows in the same order as one process, and each
    token's k outputs are weighted and added in the same (expert) order: the MoE layer's output is the same bits
    (top-3, where adding in slot order instead gives other bits)."""
    for result in two_ranks:
        assert result["moe_layer_error"] == 0.0


def test_ep2_all_to_all_volume_is_the_routed_pairs(two_ranks):
    """One forward of a rank's rows: it dispatches every routed (token, expert) pair's row once, whatever rank owns
    the expert (3 MoE layers × tokens × top-2 × hidden 64), and the ranks together send back as many elements."""
    from conftest import tiny_config

    config = tiny_config()
    moe_layers = config.mlp_layer_types.count("sparse")
    total_dispatched = total_combined = 0
    for result in two_ranks:
        traffic = result["traffic"]
        rows = result["rows"].stop - result["rows"].start
        pairs = moe_layers * rows * PROMPT_LEN * config.num_experts_per_tok
        assert traffic["calls"] == moe_layers
        assert traffic["dispatched_rows"] == pairs
        assert traffic["dispatched_elements"] == pairs * config.hidden_size
        assert 0 < traffic["remote_rows"] < pairs
        assert traffic["count_elements"] == moe_layers * config.n_routed_experts
        total_dispatched += traffic["dispatched_elements"]
        total_combined += traffic["combined_elements"]
    assert total_combined == total_dispatched == moe_layers * BATCH * PROMPT_LEN * 2 * config.hidden_size


def test_ep2_each_rank_holds_half_the_routed_experts(two_ranks):
    """Bytes of parameters and buffers per rank = everything but the routed experts, plus 1/ep of them, exactly."""
    for rank, result in enumerate(two_ranks):
        rest = result["reference_bytes"] - result["reference_expert_bytes"]
        assert result["bytes"] == rest + result["reference_expert_bytes"] // 2
        assert result["local_expert_shape"][0] == 2
        assert result["first_expert"] == 2 * rank


@pytest.mark.slow
def test_ep2_packed_mxfp4_experts_move_whole(two_ranks_formats):
    """Packed MXFP4 experts: per rank, the rest plus half the packed bytes and scale bytes, as stored."""
    for result in two_ranks_formats:
        rest = result["latent_reference_bytes"] - result["latent_reference_expert_bytes"]
        assert result["latent_bytes"] == rest + result["latent_reference_expert_bytes"] // 2


@pytest.mark.parametrize(
    "key, words",
    [
        ("error_experts", "ep=2 must divide n_routed_experts=3"),
        ("error_experts_only_rank1", "rank 1: ep=2 must divide n_routed_experts=3"),
        ("error_world_size", "world size 2 != tp·ep = 2·2"),
        ("error_mixed_sizes", "different (tp, ep) sizes"),
        ("error_twice", "already sharded by apply_expert_parallel"),
        ("error_after_tp", "already cut by apply_tensor_parallel"),
        ("error_no_experts", "has no routed experts"),
    ],
)
def test_ep2_bad_layouts_raise_on_every_rank(two_ranks, key, words):
    for rank, result in enumerate(two_ranks):
        assert result[key] is not None, f"rank {rank} did not raise for {key}"
        assert words in result[key], result[key]


def test_ep2_wrong_argument_type(two_ranks):
    for result in two_ranks:
        assert "ExpertParallelMesh" in result["error_type"]


@pytest.mark.slow
def test_tp2_ep2_matches_single_process(four_ranks):
    """Ranks 0, 1 (ep rank 0) run rows 0-1, ranks 2, 3 (ep rank 1) row 2; tp innermost."""
    assert [(r["ep_rank"], r["tp_rank"]) for r in four_ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in four_ranks:
        assert result["tp2_ep2_error"] < LOGIT_TOLERANCE
        assert result["tp2_ep2_generated"] == GENERATE_STEPS
        assert result["tp2_ep2_generate_equal"]
        assert result["ep4_error"] < LOGIT_TOLERANCE


@pytest.mark.slow
def test_tp2_ep2_volume_and_bytes(four_ranks):
    """Each rank dispatches its tp group's tokens within its ep group (its tp slice of every expert); it holds the
    tp-sharded rest of the model plus 1/(tp·ep) of the routed experts."""
    from conftest import tiny_config

    config = tiny_config()
    moe_layers = config.mlp_layer_types.count("sparse")
    for result in four_ranks:
        rows = result["rows"].stop - result["rows"].start
        pairs = moe_layers * rows * PROMPT_LEN * config.num_experts_per_tok
        assert result["traffic"]["dispatched_elements"] == pairs * config.hidden_size
        assert result["bytes"] == result["tp_only_rest_bytes"] + result["reference_expert_bytes"] // 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, words",
    [
        ("error_heads", "linear_num_heads=3"),
        ("error_latent_tp", "does not support LatentMoE"),
        ("error_experts", "ep=4 must divide n_routed_experts=6"),
    ],
)
def test_tp2_ep2_bad_layouts_raise_on_every_rank(four_ranks, key, words):
    for rank, result in enumerate(four_ranks):
        assert result[key] is not None, f"rank {rank} did not raise for {key}"
        assert words in result[key], result[key]


@pytest.mark.slow
@pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(), reason="checkpoints/kdsa-tiny is not in this checkout")
def test_ep_generate_script_under_torchrun(tmp_path):
    """scripts/ep_generate.py as docs/parallel.md §9 launches it: 2 processes by torchrun, ep = 2, `--check`."""
    import subprocess

    root = CHECKPOINT.parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(root / "scripts" / "ep_generate.py"), str(CHECKPOINT), "--ep", "2", "--batch", "3",
               "--new-tokens", "8", "--check"]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0 (ep 0, tp 0)", "rank 1 (ep 1, tp 0)"], result.stdout
    assert all(line.endswith("tokens equal to one process: True") for line in lines), lines
    assert "rows 0-1" in lines[0] and "rows 2-2" in lines[1]
