"""Context-parallel prefill, then tensor × expert-parallel decode on the same ranks (parallel/handover.py,
docs/parallel.md §11), on real process groups (gloo, CPU) spawned as in tests/test_parallel_distributed.py.

Every rank builds the same model (same seed, or the shipped checkpoint) and the same prompts, prefills all but each
prompt's last token over the (cp, tp) mesh, hands the model and the cache over to the (tp, ep) decode mesh and
generates 32 greedy tokens with `generate()` from that cache; the reference is the single-process `generate()` on the
same prompts (with its own cache). Tolerance for the logits of every decode step, 1e-4 absolute, as in
tests/test_parallel_distributed.py (fp32; the CP prefill, the tp partial sums and the per-rank batch shapes change
the summation order only). A KDA state given to the wrong heads, or a cache row to the wrong sequence, changes the
logits by > 1e-2.
"""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, run_on_ranks, run_on_ranks_in_folder
from test_parallel_distributed import _expect_error, _prompt

LOGIT_TOLERANCE = 1e-4
PROMPT_LEN = 37  # the prefill takes 36 tokens: 4 zigzag chunks of 9 at cp = 2
GENERATE_STEPS = 32
CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"


def _parameter_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _first_kda_heads(model) -> int | None:
    """The head count of the model's first KDA layer (None: it has none)."""
    return next((layer.linear_attn.num_heads for layer in model.model.layers if hasattr(layer, "linear_attn")), None)


def _prefill_then_decode(results: dict, name: str, make_model, ids, cp: int, tp: int, decode_tp: int, ep: int):
    """Prefill `ids[:, :-1]` over (cp, tp), hand over to (decode_tp, ep), generate; record tokens and logits against
    the single-process generate() on this rank's rows."""
    from modeling_kdsa.parallel import apply_tensor_parallel, context_parallel_prefill, init_parallel_mesh
    from modeling_kdsa.parallel.handover import hand_over_to_decode

    from modeling_kdsa.cache import KDSACache

    options = dict(max_new_tokens=GENERATE_STEPS, min_new_tokens=GENERATE_STEPS, do_sample=False,
                   return_dict_in_generate=True, output_logits=True)  # fmt: skip
    whole = make_model()
    reference = whole.generate(ids, **options)
    full_bytes = _parameter_bytes(whole)

    mesh = init_parallel_mesh(cp_size=cp, tp_size=tp)
    model = apply_tensor_parallel(make_model(), mesh)
    cache = KDSACache(model.config)
    prefill_bytes = _parameter_bytes(model)
    context_parallel_prefill(model, ids[:, :-1], mesh, cache=cache, last_token_only=True)
    handed = hand_over_to_decode(model, cache, mesh, tp_size=decode_tp, ep_size=ep)
    rows = handed.rows
    out = handed.model.generate(ids[rows], cache=handed.cache, synced_gpus=ep > 1, **options)
    results[f"{name}_generated"] = out.sequences.shape[1] - ids.shape[1]
    results[f"{name}_tokens_equal"] = bool(torch.equal(out.sequences, reference.sequences[rows]))
    errors = [
        (mine - theirs[rows]).abs().max().item() for mine, theirs in zip(out.logits, reference.logits, strict=True)
    ]
    results[f"{name}_logits_error"] = max(errors)
    results[f"{name}_bytes"] = (prefill_bytes, _parameter_bytes(handed.model), full_bytes)
    results[f"{name}_local_kda_heads"] = _first_kda_heads(handed.model)
    results[f"{name}_kda_heads"] = _first_kda_heads(whole)
    results[f"{name}_rows"] = rows
    results[f"{name}_head_is_embedding"] = handed.model.lm_head.weight is handed.model.model.embed_tokens.weight


def _scenario_two(rank: int, results: dict, out_dir: str) -> None:
    """2 processes: cp 2 → tp 2 on the tiny fixture, the shipped checkpoint and the family folders; error paths."""
    import torch.distributed as dist
    from conftest import tiny_model
    from modeling_kdsa.parallel import context_parallel_prefill, init_parallel_mesh
    from modeling_kdsa.parallel.handover import hand_over_to_decode
    from test_distributed_loading import TP_EP_FAMILIES, _write_family_folders

    from modeling_kdsa import KDSAForCausalLM
    from modeling_kdsa.cache import KDSACache

    ids = _prompt(PROMPT_LEN, batch=2)
    _prefill_then_decode(results, "tiny", tiny_model, ids, cp=2, tp=1, decode_tp=2, ep=1)
    # Each published family's tiny folder, converted at load (written by rank 0 as tests/test_distributed_loading.py
    # writes them).
    if rank == 0:
        _write_family_folders(out_dir)
    dist.barrier()
    for family in TP_EP_FAMILIES:
        folder = os.path.join(out_dir, family)
        load_family = functools.partial(KDSAForCausalLM.from_pretrained, folder, dtype=torch.float32)
        _prefill_then_decode(results, family, load_family, ids, cp=2, tp=1, decode_tp=2, ep=1)

    def load():
        return KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()

    _prefill_then_decode(
        results, "checkpoint", load, _prompt(PROMPT_LEN, batch=2, seed=3), cp=2, tp=1, decode_tp=2, ep=1
    )
    # cp 2 → ep 2 (tp 1): each rank decodes one of the two sequences with half the experts.
    _prefill_then_decode(results, "ep2", tiny_model, ids, cp=2, tp=1, decode_tp=1, ep=2)
    # tp 2 → ep 2: the head shards move back together (each rank gathers whole layers and keeps half the experts).
    _prefill_then_decode(results, "tp2_ep2", tiny_model, ids, cp=1, tp=2, decode_tp=1, ep=2)
    tied = functools.partial(tiny_model, tie_word_embeddings=True)
    _prefill_then_decode(results, "tp2_ep2_tied", tied, ids, cp=1, tp=2, decode_tp=1, ep=2)
    # The same from transformers' sharded load (`tp_plan="auto"`): the checkpoint's 201-id vocabulary, cut unevenly.
    from modeling_kdsa.parallel import tensor_parallel_mesh

    checkpoint_ids = _prompt(PROMPT_LEN, batch=2, seed=3)
    options = dict(max_new_tokens=GENERATE_STEPS, min_new_tokens=GENERATE_STEPS, do_sample=False)
    reference = load().generate(checkpoint_ids, **options)
    sharded = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32).eval()
    tp_mesh = tensor_parallel_mesh(sharded)
    cache = KDSACache(sharded.config)
    context_parallel_prefill(sharded, checkpoint_ids[:, :-1], tp_mesh, cache=cache, last_token_only=True)
    handed = hand_over_to_decode(sharded, cache, tp_mesh, tp_size=1, ep_size=2)
    out = handed.model.generate(checkpoint_ids[handed.rows], cache=handed.cache, synced_gpus=True, **options)
    results["tp_plan_tp2_ep2_tokens_equal"] = bool(torch.equal(out, reference[handed.rows]))
    # Saved after the hand-over (tp 1 now, experts over ep): the whole checkpoint again, bit for bit.
    handed.model.save_pretrained(os.path.join(out_dir, "after_hand_over"))
    saved = KDSAForCausalLM.from_pretrained(os.path.join(out_dir, "after_hand_over"), dtype=torch.float32).state_dict()
    whole = load().state_dict()
    results["tp_plan_tp2_ep2_saved_equal"] = saved.keys() == whole.keys() and all(
        torch.equal(saved[name], whole[name]) for name in whole
    )

    # Error paths: each must raise a ValueError on every rank (the verdicts are exchanged), before any change.
    mesh = init_parallel_mesh(cp_size=2, tp_size=1)

    def prefilled(batch: int = 2, model=None):
        model = model or tiny_model()
        cache = KDSACache(model.config)
        context_parallel_prefill(model, ids[:batch, :-1], mesh, cache=cache)
        return model, cache

    model, cache = prefilled()
    results["error_world"] = _expect_error(lambda: hand_over_to_decode(model, cache, mesh, tp_size=2, ep_size=2))
    model, cache = prefilled(batch=1)
    results["error_batch"] = _expect_error(lambda: hand_over_to_decode(model, cache, mesh, tp_size=1, ep_size=2))
    model, cache = prefilled()
    given = KDSACache(model.config) if rank == 1 else cache  # rank 1 passes an empty cache
    results["error_empty_cache_only_rank1"] = _expect_error(lambda: hand_over_to_decode(model, given, mesh, 2))
    results["error_experts"] = _expect_error(
        lambda: hand_over_to_decode(*prefilled(model=tiny_model(n_routed_experts=3)), mesh, tp_size=1, ep_size=2)
    )


def _scenario_four(rank: int, results: dict) -> None:
    """4 processes: cp 2 × tp 2 → tp 2 × ep 2 (no rank ever holds the whole model), and refusals."""
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_tensor_parallel, context_parallel_prefill, init_parallel_mesh
    from modeling_kdsa.parallel.handover import hand_over_to_decode

    from modeling_kdsa.cache import KDSACache

    ids = _prompt(PROMPT_LEN, batch=3)
    _prefill_then_decode(results, "cp2tp2_tp2ep2", tiny_model, ids, cp=2, tp=2, decode_tp=2, ep=2)
    # tp 2 → tp 4: the head shards move (a model whose KDA heads split 4 ways).
    _prefill_then_decode(
        results, "cp2tp2_tp4", functools.partial(tiny_model, linear_num_heads=4, tie_word_embeddings=True), ids,
        cp=2, tp=2, decode_tp=4, ep=1,
    )  # fmt: skip
    mesh = init_parallel_mesh(cp_size=2, tp_size=2)
    model = apply_tensor_parallel(tiny_model(), mesh)
    cache = KDSACache(model.config)
    context_parallel_prefill(model, ids[:, :-1], mesh, cache=cache)
    results["error_heads"] = _expect_error(lambda: hand_over_to_decode(model, cache, mesh, tp_size=4))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario_two, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_scenario_four, 4)


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", ["tiny", "checkpoint", "kimi_linear", "deepseek_v32", "glm5_next", "kimi_k3"])
def test_cp2_prefill_then_tp2_decode_matches_single_process(two_ranks, name):
    """32 greedy tokens equal the single-process generate() on both ranks; every step's logits within 1e-4; each
    rank decodes with half the KDA heads (DeepSeek-V3.2 has none) and fewer parameter bytes than the whole model."""
    for result in two_ranks:
        assert result[f"{name}_generated"] == GENERATE_STEPS
        assert result[f"{name}_tokens_equal"]
        assert result[f"{name}_logits_error"] < LOGIT_TOLERANCE
        if name == "deepseek_v32":  # no KDA layer
            assert result[f"{name}_local_kda_heads"] is None
        else:
            assert 2 * result[f"{name}_local_kda_heads"] == result[f"{name}_kda_heads"]
        prefill_bytes, decode_bytes, full_bytes = result[f"{name}_bytes"]
        assert prefill_bytes == full_bytes > decode_bytes


def test_tp_plan_load_prefill_then_ep2_decode_moves_the_head_shards(two_ranks):
    """A model loaded by transformers' tp_plan (its hooks installed by parallel/hf_plans.py) hands over as well, and
    saves the whole model afterwards (no longer cut by tp: its experts gathered over ep)."""
    assert all(result["tp_plan_tp2_ep2_tokens_equal"] for result in two_ranks)
    assert all(result["tp_plan_tp2_ep2_saved_equal"] for result in two_ranks)


@pytest.mark.parametrize("name", ["tp2_ep2", "tp2_ep2_tied"])
def test_tp2_prefill_then_ep2_decode_moves_the_head_shards(two_ranks, name):
    """tp 2 → ep 2 (tp 1): every rank gathers the layers' heads and the KDA states whole, then keeps its sequence's
    rows and half the experts; fewer bytes than the whole model, more than its tp 2 shard. A tied head is the
    embedding again."""
    assert [result[f"{name}_rows"] for result in two_ranks] == [slice(0, 1), slice(1, 2)]
    for result in two_ranks:
        assert result[f"{name}_generated"] == GENERATE_STEPS
        assert result[f"{name}_tokens_equal"]
        assert result[f"{name}_logits_error"] < LOGIT_TOLERANCE
        assert result[f"{name}_local_kda_heads"] == 2  # all of them
        assert result[f"{name}_head_is_embedding"] == name.endswith("tied")
        prefill_bytes, decode_bytes, full_bytes = result[f"{name}_bytes"]
        assert prefill_bytes < decode_bytes < full_bytes


def test_cp2_prefill_then_ep2_decode_matches_single_process(two_ranks):
    """ep = 2 after cp = 2: each rank keeps its own sequence's cache rows and decodes it with half the experts."""
    assert [result["ep2_rows"] for result in two_ranks] == [slice(0, 1), slice(1, 2)]
    for result in two_ranks:
        assert result["ep2_generated"] == GENERATE_STEPS
        assert result["ep2_tokens_equal"]
        assert result["ep2_logits_error"] < LOGIT_TOLERANCE


@pytest.mark.parametrize(
    "key, words",
    [
        ("error_world", "must hold the prefill's cp·tp = 2·1 = 2 ranks"),
        ("error_batch", "ep=2 > the batch of 1 sequence"),
        ("error_empty_cache_only_rank1", "rank 1: cache must be the KDSACache that context_parallel_prefill filled"),
        ("error_experts", "must divide n_routed_experts=3"),
    ],
)
def test_bad_hand_overs_raise_on_every_rank(two_ranks, key, words):
    for rank, result in enumerate(two_ranks):
        assert result[key] is not None, f"rank {rank} did not raise for {key}"
        assert words in result[key], result[key]


@pytest.mark.slow
def test_cp2_tp2_prefill_then_tp2_ep2_decode(four_ranks):
    """4 processes: each rank keeps its tp rank's heads and slices from the prefill and the routed experts of its ep
    block (ep rank = cp rank); no rank ever holds the whole model; each ep rank decodes its share of 3 sequences."""
    assert [result["cp2tp2_tp2ep2_rows"] for result in four_ranks] == [slice(0, 2)] * 2 + [slice(2, 3)] * 2
    for result in four_ranks:
        assert result["cp2tp2_tp2ep2_generated"] == GENERATE_STEPS
        assert result["cp2tp2_tp2ep2_tokens_equal"]
        assert result["cp2tp2_tp2ep2_logits_error"] < LOGIT_TOLERANCE
        prefill_bytes, decode_bytes, full_bytes = result["cp2tp2_tp2ep2_bytes"]
        assert decode_bytes < prefill_bytes < full_bytes
        assert "linear_num_heads=2" in result["error_heads"]  # tp 4 cannot cut 2 KDA heads


@pytest.mark.slow
def test_cp2_tp2_prefill_then_tp4_decode_moves_the_head_shards(four_ranks):
    """cp 2 × tp 2 → tp 4: each rank gathers each layer's heads (and KDA states) over its prefill tp group and keeps a
    quarter; 32 greedy tokens and every step's logits as in one process."""
    for result in four_ranks:
        assert result["cp2tp2_tp4_generated"] == GENERATE_STEPS
        assert result["cp2tp2_tp4_tokens_equal"]
        assert result["cp2tp2_tp4_logits_error"] < LOGIT_TOLERANCE
        assert result["cp2tp2_tp4_local_kda_heads"] == 1  # of 4
        assert result["cp2tp2_tp4_head_is_embedding"]  # tied
        prefill_bytes, decode_bytes, full_bytes = result["cp2tp2_tp4_bytes"]
        assert decode_bytes < prefill_bytes < full_bytes


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_prefill_decode_script(tmp_path, launcher):
    """scripts/prefill_decode.py as docs/parallel.md §11 launches it, on 2 processes: cp 2 → tp 2 with `--check`;
    under `accelerate launch` the prefill mesh is accelerate's `ParallelismConfig(cp_size=2)` device mesh."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    binaries = Path(sys.executable).parent
    script = [str(root / "scripts" / "prefill_decode.py"), str(CHECKPOINT), "--cp", "2", "--decode-tp", "2", "--check"]
    if launcher == "torchrun":
        command = [str(binaries / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *script]
    else:
        command = [str(binaries / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                   "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                   str(free_port()), *script, "--mesh", "accelerate"]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all(line.endswith("tokens equal to one process: True") for line in lines), lines
