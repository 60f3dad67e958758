"""Vocab-parallel `embed_tokens` and `lm_head` under tensor parallelism (docs/parallel.md §5): each tp rank holds its
rows of the vocabulary (`vocab_ranges`: `ceil(V / tp)` rows each, the rest on the last rank), the embedding's partial
lookups are all-reduced and the head's logits all-gathered, so every rank returns the whole logits.

On 2 gloo processes spawned as in tests/test_distributed_loading.py, through both tp paths (`apply_tensor_parallel`
and `from_pretrained(..., tp_plan="auto")`): `checkpoints/kdsa-tiny` (vocab_size 201, cut 101 + 100) and the tiny
fixture with `tie_word_embeddings=True` (vocab_size 128) give the single-process greedy tokens for 32 steps; each rank
holds exactly its rows of the embedding and the head; the `tp_plan` load reads only them from the files; a tied head
stays the cut embedding's parameter; save_pretrained of a tied sharded model reloads bit for bit; a DSpark draft bound
to a sharded target (it shares the target's embedding and head) gives the target's greedy tokens. One-process tests
cover the split, the masked lookup and the refusals.
"""

import os

import pytest
import torch
from gloo_ranks import run_on_ranks_in_folder
from test_parallel_distributed import _expect_error

ROOT = os.path.join(os.path.dirname(__file__), "..")
CHECKPOINT = os.path.join(ROOT, "checkpoints", "kdsa-tiny")
DSPARK = os.path.join(ROOT, "checkpoints", "kdsa-tiny-dspark")
DRAFT = os.path.join(ROOT, "checkpoints", "kdsa-tiny-draft")
GREEDY_STEPS = 32
GREEDY = dict(max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _vocab_checks(results: dict, name: str, sharded, whole, ids: torch.Tensor, expected_tokens) -> None:
    """The embedding and head bytes this rank holds (against the whole model's), the tie, the tokens, the logits."""
    embed, head = sharded.model.embed_tokens, sharded.lm_head
    results[f"{name}_embed_bytes"] = (_bytes(embed.weight), _bytes(whole.model.embed_tokens.weight))
    results[f"{name}_head_bytes"] = (_bytes(head.weight), _bytes(whole.lm_head.weight))
    results[f"{name}_embed_rows"] = (embed.vocab_start, embed.weight.shape[0])
    results[f"{name}_embed_local"] = embed.weight.detach().clone()
    results[f"{name}_tied"] = head.weight is embed.weight
    with torch.no_grad():
        results[f"{name}_logits_error"] = (sharded(ids).logits - whole(ids).logits).abs().max().item()
    tokens = sharded.generate(ids, **GREEDY)
    results[f"{name}_tokens"] = tokens
    results[f"{name}_prompt_length"] = ids.shape[1]
    results[f"{name}_equal"] = bool(torch.equal(tokens, expected_tokens))


def _scenario(rank: int, results: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from conftest import tiny_config, tiny_model
    from modeling_kdsa.parallel import apply_tensor_parallel, init_parallel_mesh, tensor_parallel_mesh
    from test_distributed_loading import _counting_reads, _cut_after_read

    from modeling_kdsa import DSparkDraftModel, KDSAForCausalLM

    mesh = init_parallel_mesh(cp_size=1, tp_size=2)

    # The shipped checkpoint: vocab_size 201, not divisible by tp = 2.
    whole = KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    results["checkpoint_vocab"] = whole.config.vocab_size
    ids = torch.randint(3, whole.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    expected = whole.generate(ids, **GREEDY)
    applied = apply_tensor_parallel(KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32), mesh)
    mesh.comm.reset()
    _vocab_checks(results, "checkpoint_apply", applied, whole, ids, expected)
    results["checkpoint_apply_comm"] = dict(mesh.comm.bytes_by_tag)
    with _counting_reads() as read:
        loaded = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32)
    kept = sum(tensor.numel() for tensor in loaded.state_dict().values())
    results["checkpoint_read"] = (sum(read), kept + _cut_after_read(loaded, 2, CHECKPOINT))
    _vocab_checks(results, "checkpoint_tp_plan", loaded, whole, ids, expected)
    results["checkpoint_tp_plan_comm"] = dict(tensor_parallel_mesh(loaded).comm.bytes_by_tag)

    # A DSpark draft (full vocabulary: it shares the target's embedding and head) bound to the sharded target.
    draft = DSparkDraftModel.from_pretrained(DSPARK, target=applied)
    tokens = applied.generate(ids, assistant_model=draft, speculation_type="dspark", **GREEDY)
    results["dspark_equal"] = bool(torch.equal(tokens, expected))
    # A separate draft model, whole on every rank, assisting the sharded target (transformers' assisted loop, one row).
    assistant = KDSAForCausalLM.from_pretrained(DRAFT, dtype=torch.float32)
    tokens = loaded.generate(ids[:1], assistant_model=assistant, **GREEDY)
    results["assisted_equal"] = bool(torch.equal(tokens, whole.generate(ids[:1], **GREEDY)))

    # The tiny fixture with a tied head, saved by rank 0, through both paths; then saved sharded and reloaded.
    tied_folder = os.path.join(out_dir, "tied")
    if rank == 0:
        tiny_model(tie_word_embeddings=True).save_pretrained(tied_folder)
    dist.barrier()
    tied_whole = KDSAForCausalLM.from_pretrained(tied_folder, dtype=torch.float32)
    results["tied_whole_is_tied"] = tied_whole.lm_head.weight is tied_whole.model.embed_tokens.weight
    tied_ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    tied_expected = tied_whole.generate(tied_ids, **GREEDY)
    tied_applied = apply_tensor_parallel(KDSAForCausalLM.from_pretrained(tied_folder, dtype=torch.float32), mesh)
    _vocab_checks(results, "tied_apply", tied_applied, tied_whole, tied_ids, tied_expected)
    tied_loaded = KDSAForCausalLM.from_pretrained(tied_folder, tp_plan="auto", dtype=torch.float32)
    _vocab_checks(results, "tied_tp_plan", tied_loaded, tied_whole, tied_ids, tied_expected)
    whole_state = {name: tensor.clone() for name, tensor in tied_whole.state_dict().items()}
    for name, model in (("tied_apply", tied_applied), ("tied_tp_plan", tied_loaded)):
        folder = os.path.join(out_dir, f"saved_{name}")
        model.save_pretrained(folder)
        saved = KDSAForCausalLM.from_pretrained(folder, dtype=torch.float32)
        state = saved.state_dict()
        results[f"{name}_saved_equal"] = state.keys() == whole_state.keys() and all(
            torch.equal(state[key], tensor) for key, tensor in whole_state.items()
        )
        results[f"{name}_saved_tied"] = saved.lm_head.weight is saved.model.embed_tokens.weight

    # A vocabulary that leaves a rank no rows: the same ValueError on every rank, from both paths.
    one_id = dict(vocab_size=1, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    results["error_apply"] = _expect_error(lambda: apply_tensor_parallel(tiny_model(**one_id), mesh))
    one_id_folder = os.path.join(out_dir, "one_id")
    if rank == 0:
        tiny_config(**one_id).save_pretrained(one_id_folder)  # the config alone: the check reads nothing else
    dist.barrier()
    results["error_tp_plan"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(one_id_folder, tp_plan="auto", dtype=torch.float32)
    )


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario, 2, timeout_s=300)


# ------------------------------------------------------------------------------------------------ distributed


@pytest.mark.parametrize("name", ["checkpoint_apply", "checkpoint_tp_plan", "tied_apply", "tied_tp_plan"])
def test_tp2_gives_the_single_process_greedy_tokens(two_ranks, name):
    for result in two_ranks:
        assert result[f"{name}_logits_error"] < 1e-4
        assert result[f"{name}_equal"], name
        assert result[f"{name}_tokens"].shape[1] == result[f"{name}_prompt_length"] + GREEDY_STEPS
    assert torch.equal(two_ranks[0][f"{name}_tokens"], two_ranks[1][f"{name}_tokens"])


@pytest.mark.parametrize("name", ["checkpoint_apply", "checkpoint_tp_plan", "tied_apply", "tied_tp_plan"])
def test_each_rank_holds_its_rows_of_the_embedding_and_head(two_ranks, name):
    """Measured per-rank bytes: rank r holds `vocab_ranges(V, 2)[r]` of the rows, 1/tp of the whole (101 + 100 of
    kdsa-tiny's 201 rows, 64 + 64 of the fixture's 128); the ranks' rows are disjoint and cover the vocabulary."""
    from modeling_kdsa.parallel.tensor_parallel import vocab_ranges

    vocab = two_ranks[0]["checkpoint_vocab"] if name.startswith("checkpoint") else 128
    ranges = vocab_ranges(vocab, 2)
    for rank, result in enumerate(two_ranks):
        for part in ("embed", "head"):
            local, whole = result[f"{name}_{part}_bytes"]
            assert local * vocab == whole * len(ranges[rank]), (rank, part, local, whole)
        assert result[f"{name}_embed_rows"] == (ranges[rank].start, len(ranges[rank]))
    assert sum(result[f"{name}_embed_bytes"][0] for result in two_ranks) == two_ranks[0][f"{name}_embed_bytes"][1]
    assert not torch.equal(two_ranks[0][f"{name}_embed_local"][:64], two_ranks[1][f"{name}_embed_local"][:64])


def test_vocab_collectives_run(two_ranks):
    for result in two_ranks:
        for name in ("checkpoint_apply", "checkpoint_tp_plan"):
            tags = result[f"{name}_comm"]
            assert tags["tp.embed_tokens"] > 0 and tags["tp.lm_head"] > 0, tags


def test_tp_plan_load_reads_only_this_ranks_rows(two_ranks):
    """Every element read from the files is kept (the KDA convs and `A_log` aside, read whole by design): no rank
    reads the whole embedding or head."""
    for result in two_ranks:
        read, kept = result["checkpoint_read"]
        assert read == kept


def test_a_tied_head_stays_the_cut_embedding(two_ranks):
    for result in two_ranks:
        assert result["tied_whole_is_tied"]
        assert result["tied_apply_tied"] and result["tied_tp_plan_tied"]
        assert not result["checkpoint_apply_tied"] and not result["checkpoint_tp_plan_tied"]


def test_save_pretrained_of_a_tied_sharded_model_reloads_bit_for_bit(two_ranks):
    for result in two_ranks:
        for name in ("tied_apply", "tied_tp_plan"):
            assert result[f"{name}_saved_equal"], name
            assert result[f"{name}_saved_tied"], name


def test_dspark_draft_on_a_sharded_target(two_ranks):
    for result in two_ranks:
        assert result["dspark_equal"]


def test_assistant_model_on_a_sharded_target(two_ranks):
    """kdsa-tiny-draft assisting the `tp_plan="auto"` load gives the single process's greedy tokens."""
    for result in two_ranks:
        assert result["assisted_equal"]


@pytest.mark.parametrize("key", ["error_apply", "error_tp_plan"])
def test_a_vocabulary_leaving_a_rank_no_rows_is_refused_on_every_rank(two_ranks, key):
    for rank, result in enumerate(two_ranks):
        assert result[key] is not None, f"rank {rank} did not raise"
        assert "leaves tp rank(s) [1] no vocabulary rows" in result[key], result[key]
    assert two_ranks[0][key] == two_ranks[1][key]


# ------------------------------------------------------------------------------------------------ one process


def test_vocab_ranges_split_like_torch_chunk():
    from modeling_kdsa.parallel.tensor_parallel import vocab_ranges, vocab_split_error

    assert vocab_ranges(201, 2) == [range(0, 101), range(101, 201)]
    assert vocab_ranges(163840, 8) == [range(r * 20480, (r + 1) * 20480) for r in range(8)]
    for vocab, tp in ((201, 2), (10, 4), (129280, 16), (7, 3)):
        chunks = torch.arange(vocab).chunk(tp)
        assert [list(rows) for rows in vocab_ranges(vocab, tp)] == [chunk.tolist() for chunk in chunks]
        assert vocab_split_error(vocab, tp) is None
    assert vocab_ranges(5, 4)[3] == range(5, 5)
    assert "leaves tp rank(s) [3] no vocabulary rows" in vocab_split_error(5, 4)


def test_published_vocabularies_split_evenly():
    """The shipped published configs' vocabularies divide by every power-of-two tp up to 256: no uneven cut there."""
    import json

    sizes = []
    for name in ("deepseek-v3.2", "glm-5.3-flash", "kimi-linear-48b-a3b", "kimi-k3"):
        with open(os.path.join(os.path.dirname(__file__), "data", "configs", f"{name}.json")) as file:
            raw = json.load(file)
        sizes.append(raw.get("vocab_size") or raw["text_config"]["vocab_size"])
    assert all(size % 256 == 0 for size in sizes), sizes


def test_tensor_parallel_errors_name_the_vocabulary():
    from conftest import tiny_config
    from modeling_kdsa.parallel import tensor_parallel_errors

    assert tensor_parallel_errors(tiny_config(vocab_size=201), 2) is None
    error = tensor_parallel_errors(tiny_config(vocab_size=1, pad_token_id=0, bos_token_id=0, eos_token_id=0), 2)
    assert "vocab_size=1" in error and "no vocabulary rows" in error


def test_cut_embedding_looks_up_its_rows_and_zeros():
    """The pieces' lookups of the uneven split sum to the whole lookup, exactly; ids outside a piece give zeros."""
    from modeling_kdsa.parallel.tensor_parallel import vocab_ranges

    from modeling_kdsa.embedding import KDSAEmbedding

    torch.manual_seed(0)
    whole = KDSAEmbedding(11, 6, padding_idx=0)
    ids = torch.tensor([[0, 3, 4, 10], [7, 1, 8, 5]])
    total = torch.zeros(2, 4, 6)
    for rows in vocab_ranges(11, 3):
        piece = KDSAEmbedding(11, 6)
        piece.weight = torch.nn.Parameter(whole.weight.detach()[rows.start : rows.stop].clone())
        piece.vocab_start = rows.start
        out = piece(ids)
        inside = (ids >= rows.start) & (ids < rows.stop)
        assert torch.equal(out[~inside], torch.zeros_like(out[~inside]))
        total += out
    assert torch.equal(total, whole(ids))


def test_tied_head_cut_in_one_process_shares_the_embedding():
    """apply_tensor_parallel's slicing needs no collective: rank 0 of tp = 2 with a tied head keeps one parameter of
    half the rows for both, and the head's `out_features` stays the whole vocabulary."""
    from conftest import tiny_model
    from modeling_kdsa.parallel.mesh import ParallelMesh
    from modeling_kdsa.parallel.tensor_parallel import apply_tensor_parallel

    model = tiny_model(tie_word_embeddings=True)
    whole = model.model.embed_tokens.weight.detach().clone()
    mesh = ParallelMesh(cp_size=1, tp_size=2, cp_rank=0, tp_rank=1, cp_group=None, tp_group=None, device="cpu")
    apply_tensor_parallel(model, mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, whole[64:])
    assert model.model.embed_tokens.vocab_start == 64
    assert (model.lm_head.out_features, model.model.embed_tokens.num_embeddings) == (128, 128)
