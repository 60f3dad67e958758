"""Tensor parallelism through transformers' own loading (`from_pretrained(path, tp_plan="auto")` /
`distributed_config=DistributedConfig(tp_size=2)`, docs/parallel.md §10), on gloo with 2 processes spawned by
torch.multiprocessing (the launcher's `env://` variables set as torchrun sets them).

Each group of processes runs once per module (a fixture) and writes what it saw to disk; the tests read it. The
single-process reference is the same checkpoint loaded whole in each rank. Tolerance for logits 1e-4 absolute, as in
tests/test_parallel_distributed.py (fp32; only the partial sums over the tp ranks differ in summation order). The
generated tokens must be equal, on both ranks.
"""

import contextlib
import math
import os
import resource
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import free_port, run_on_ranks_in_folder
from test_parallel_distributed import _expect_error

CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "kdsa-tiny")
LOGIT_TOLERANCE = 1e-4
GREEDY_STEPS = 32
# The published families' tiny folders loaded with tp_plan="auto", and the vocabulary their prompts draw from.
FAMILIES = {"kimi_linear": 100, "deepseek_v32": 100, "glm5_next": 100, "glm5_next_runtime": 100, "kimi_k3": 200}
EP_BATCH = 3  # not a multiple of ep: the ep ranks' shares differ (2 + 1 rows)
# The family folders loaded with tp 2 × ep 2 (Kimi K3 in the layout tp can cut: unquantized experts, no LatentMoE).
TP_EP_FAMILIES = ("kimi_linear", "deepseek_v32", "glm5_next", "kimi_k3")


def EP_FAMILIES(out_dir: str) -> dict:  # noqa: N802
    """Published layouts loaded with ep = 2: each family's hub layout (per-expert tensors; Kimi-Linear's
    `block_sparse_moe` names) and Kimi K3's packed MXFP4 experts."""
    return {"kimi_linear": (os.path.join(out_dir, "kimi_linear"), 100),
            "deepseek_v32": (os.path.join(out_dir, "deepseek_v32"), 100),
            "glm5_next": (os.path.join(out_dir, "glm5_next"), 100),
            "kimi_k3_mxfp4": (os.path.join(out_dir, "kimi_k3_mxfp4"), 200)}  # fmt: skip


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 19), generator=torch.Generator().manual_seed(1))


def _parameter_bytes(model) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def _tiny_with_biases():
    """The tiny fixture with MLA biases, non-zero: `o_proj`'s bias must be added once over the summed tp ranks."""
    from conftest import tiny_model

    model = tiny_model(attention_bias=True)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.bias"):
                param.normal_(0.0, 0.5, generator=generator)
    return model


def _compare(results: dict, name: str, sharded, reference, vocab: int) -> None:
    """Logits, greedy, seeded sampling and a left-padded batch: sharded against the single-process model."""
    from conftest import left_padded_batch

    ids = _prompts(vocab)
    with torch.no_grad():
        results[f"{name}_logits_error"] = (sharded(ids).logits - reference(ids).logits).abs().max().item()
    runs = {
        "greedy": dict(input_ids=ids, max_new_tokens=GREEDY_STEPS, do_sample=False),
        "sampled": dict(input_ids=ids, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20),
    }
    padded, mask = left_padded_batch([7, 16, 11], vocab=vocab, seed=3)
    runs["left_padded"] = dict(input_ids=padded, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for run, arguments in runs.items():
        tokens = []
        for model in (sharded, reference):
            torch.manual_seed(7)
            # min_new_tokens: no early end of sequence, every run decodes all its steps
            tokens.append(model.generate(**arguments, min_new_tokens=arguments["max_new_tokens"], pad_token_id=0))
        results[f"{name}_{run}_tokens"] = tokens[0]
        results[f"{name}_{run}_equal"] = bool(torch.equal(tokens[0], tokens[1]))


def _write_kimi_k3_folder(folder: Path, published: bool = False) -> None:
    """A Kimi K3 folder in K3's published layout (tests/test_kimi_k3.py: zero-padded `A_log`, per-expert `w1/w3/w2`,
    AttnRes pseudo-queries as `[1, D]` weights); with `published`, K3's LatentMoE and packed MXFP4 experts, else
    unquantized experts without LatentMoE (tensor parallelism refuses both, docs/parallel.md §5)."""
    from modeling_kdsa.eval.kimi_k3_fixtures import k3_raw_config, perturbed_model
    from test_kimi_k3 import write_k3_folder

    from modeling_kdsa.conversion import plan_foreign_load

    raw = k3_raw_config(quantized=published)
    if not published:
        for name in ("routed_expert_hidden_size", "latent_moe_use_norm"):
            del raw["text_config"][name]
    write_k3_folder(folder, perturbed_model(plan_foreign_load(raw, []).config), raw)


def _write_family_folders(out_dir: str) -> None:
    """The published families' tiny folders (the names of `FAMILIES`), converted at load."""
    from modeling_kdsa.eval import family_fixtures

    for family in ("kimi_linear", "deepseek_v32", "glm5_next"):
        torch.manual_seed(0)
        reference = getattr(family_fixtures, f"{family}_model")()
        family_fixtures.perturb_constants(reference)
        reference.save_pretrained(os.path.join(out_dir, family), max_shard_size="40KB")
        if family == "glm5_next":  # transformers' runtime layout: one fused conv1d [3C, 1, W], stacked experts
            reference.save_pretrained(os.path.join(out_dir, "glm5_next_runtime"), save_original_format=False)
    _write_kimi_k3_folder(Path(out_dir) / "kimi_k3")


def _state_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _expert_bytes(model) -> int:
    from modeling_kdsa.moe import KDSAMoE

    layers = [layer for layer in model.model.layers if isinstance(layer.mlp, KDSAMoE)]
    return sum(_state_bytes(layer.mlp.experts) for layer in layers)


@contextlib.contextmanager
def _counting_reads():
    """The elements transformers' loader reads from the checkpoint files inside the block: whole tensors
    (`_materialize_copy`) and this rank's slices (`DtensorShardOperation.shard_tensor`; None for an expert this rank
    does not own)."""
    from transformers import core_model_loading
    from transformers.distributed.sharding_utils import DtensorShardOperation

    read, whole_copy, shard = [], core_model_loading._materialize_copy, DtensorShardOperation.shard_tensor

    def counted(function):
        def wrapper(*args, **kwargs):
            tensor = function(*args, **kwargs)
            read.append(0 if tensor is None else tensor.numel())
            return tensor

        return wrapper

    core_model_loading._materialize_copy, DtensorShardOperation.shard_tensor = counted(whole_copy), counted(shard)
    try:
        yield read
    finally:
        core_model_loading._materialize_copy, DtensorShardOperation.shard_tensor = whole_copy, shard


def _cut_after_read(model, tp: int, folder: str) -> int:
    """Elements a load reads beyond what it keeps: the KDA short convs and `A_log`, read whole and cut after (tp > 1),
    and the zero padding of a stored `A_log` (Kimi K3's), dropped by its conversion."""
    import glob

    from safetensors import safe_open

    layers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    kept = sum(a.q_conv1d.weight.numel() + a.k_conv1d.weight.numel() + a.v_conv1d.weight.numel() + a.A_log.numel()
               for a in layers)  # fmt: skip
    stored = 0
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as file:
            stored += sum(math.prod(file.get_slice(k).get_shape()) for k in file.keys() if k.endswith("A_log"))
    padding = stored - sum(a.A_log.numel() for a in layers) * tp
    return kept * (tp - 1) + padding


def _compare_expert_parallel(results: dict, name: str, sharded, reference, vocab: int) -> None:
    """An ep load against the single-process model: each ep rank runs its share of the batch (`batch_rows`);
    logits on those rows, and 32 greedy steps (`synced_gpus`: no rank leaves the all-to-alls early)."""
    from modeling_kdsa.parallel import expert_parallel_mesh_of

    mesh = expert_parallel_mesh_of(sharded)
    ids = torch.randint(3, vocab, (EP_BATCH, 19), generator=torch.Generator().manual_seed(2))
    rows = mesh.batch_rows(EP_BATCH)
    results[f"{name}_rows"] = (rows.start, rows.stop)
    with torch.no_grad():
        results[f"{name}_logits_error"] = (sharded(ids[rows]).logits - reference(ids).logits[rows]).abs().max().item()
    greedy = dict(max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)
    tokens = sharded.generate(ids[rows], synced_gpus=True, **greedy)
    results[f"{name}_greedy_tokens"] = tokens
    results[f"{name}_greedy_equal"] = bool(torch.equal(tokens, reference.generate(ids, **greedy)[rows]))
    results[f"{name}_bytes"] = (_state_bytes(sharded), _state_bytes(reference), _expert_bytes(reference))
    results[f"{name}_local_experts"] = [
        layer.mlp.experts.local_experts.num_experts for layer in sharded.model.layers if hasattr(layer.mlp, "experts")
    ]
    results[f"{name}_traffic_calls"] = mesh.traffic.calls


def _expert_parallel_checks(results: dict, layout, folders: dict, odd_experts_folder: str) -> None:
    """`from_pretrained(distributed_config=layout)` with ep > 1 on each of `folders` (name -> (folder, vocab)), against
    the single-process model; the elements each load reads; the layouts it refuses (the same ValueError on every
    rank)."""
    from modeling_kdsa import KDSAForCausalLM

    tp, ep = (layout["tp_size"], layout["ep_size"]) if isinstance(layout, dict) else (layout.tp_size, layout.ep_size)
    prefix = f"tp{tp}_ep{ep}"
    for name, (folder, vocab) in folders.items():
        with _counting_reads() as read:
            sharded = KDSAForCausalLM.from_pretrained(folder, distributed_config=layout, dtype=torch.float32)
        kept = sum(tensor.numel() for tensor in sharded.state_dict().values())
        results[f"{prefix}_{name}_read"] = (sum(read), kept + _cut_after_read(sharded, tp, folder))
        reference = KDSAForCausalLM.from_pretrained(folder, dtype=torch.float32)
        _compare_expert_parallel(results, f"{prefix}_{name}", sharded, reference, vocab)
        if name == "checkpoint":
            results[f"{prefix}_error_mtp"] = _expect_error(
                lambda m=sharded: m.generate(torch.tensor([[5, 6, 7]]), use_mtp=True, max_new_tokens=4)
            )
    results[f"{prefix}_error_experts"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(odd_experts_folder, distributed_config=layout)
    )


def _beams_and_quantized_cache(results: dict, sharded, reference, ids: torch.Tensor) -> None:
    """Beam search on the `tp_plan="auto"` load, and greedy decoding with the layered quantized cache (FP8 latent,
    MXFP8 indexer keys: `quantization_config` with `tp_plan`), against the single process."""
    from modeling_kdsa import KDSAForCausalLM, KDSAQuantizationConfig

    beams = dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False, pad_token_id=0)
    results["beams_tokens"] = sharded.generate(ids, **beams)
    results["beams_equal"] = bool(torch.equal(results["beams_tokens"], reference.generate(ids, **beams)))
    load = dict(dtype=torch.float32, quantization_config=KDSAQuantizationConfig(kv_cache_tile_size=64))
    quantized = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto", **load)
    quantized_reference = KDSAForCausalLM.from_pretrained(CHECKPOINT, **load)
    greedy = dict(max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)
    tokens = quantized.generate(ids, **greedy)
    results["quantized_equal"] = bool(torch.equal(tokens, quantized_reference.generate(ids, **greedy)))
    # The quantized cache took effect: its tokens are not the plain cache's.
    results["quantized_differs_from_plain"] = not torch.equal(tokens, reference.generate(ids, **greedy))


def _speculative_with_rank_clocks(rank: int, results: dict, sharded, reference) -> None:
    """`generate(use_mtp=True)` under the adaptive schedule on the `tp_plan="auto"` load, each rank on its own fake
    clock (tests/test_speculative_parallel.py's `_RankClock`): the round seconds are agreed over the load's tp mesh
    (`sharded_group`, docs/parallel.md §12), so both ranks draft in the same rounds."""
    import torch.distributed as dist
    from test_parallel_distributed import _prompt
    from test_speculative_parallel import NEW_TOKENS, _RankClock

    import modeling_kdsa.speculative as speculative

    group = speculative.sharded_group(sharded)
    results["sharded_group_size"] = None if group is None else dist.get_world_size(group)
    results["has_apply_tp_group"] = getattr(sharded, "tensor_parallel_group", None) is not None
    results["whole_group"] = speculative.sharded_group(reference)
    half = _prompt(12, batch=2, seed=4)
    ids = torch.cat([half, half, half[:, :5]], dim=1)
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = reference.generate(ids, **greedy)
    clock, real_time = _RankClock(per_drafted_token=10.0 * rank), speculative.time
    speculative.time = clock
    hook = sharded.register_forward_pre_hook(clock.forward_pre_hook, with_kwargs=True)
    try:
        tokens = sharded.generate(ids, use_mtp=True, **greedy)
    finally:
        hook.remove()
        speculative.time = real_time
    results["mtp_tokens"] = tokens
    results["mtp_equal"] = bool(torch.equal(tokens, expected))
    stats = sharded.speculation_stats
    results["mtp_rounds"] = (stats.rounds, stats.plain_rounds, stats.drafted, stats.accepted)


def _scenario_two(rank: int, results: dict, out_dir: str) -> None:
    import torch.distributed as dist
    from conftest import tiny_config
    from modeling_kdsa.parallel import (
        apply_tensor_parallel,
        context_parallel_prefill,
        init_parallel_mesh,
        tensor_parallel_mesh,
    )
    from transformers import AutoModel
    from transformers.distributed import DistributedConfig

    from modeling_kdsa import KDSAForCausalLM

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sharded = KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32)
    results["rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    results["sharded_bytes"] = _parameter_bytes(sharded)
    results["sharded_state"] = {name: value.clone() for name, value in sharded.state_dict().items()}
    reference = KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    results["full_bytes"] = _parameter_bytes(reference)
    # The same model cut in place by apply_tensor_parallel: what each rank must hold, tensor for tensor.
    expected = apply_tensor_parallel(KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32),
                                     init_parallel_mesh(cp_size=1, tp_size=2))  # fmt: skip
    results["expected_state"] = {name: value.clone() for name, value in expected.state_dict().items()}
    results["expected_bytes"] = _parameter_bytes(expected)
    results["local_kda_heads"] = sharded.model.layers[0].linear_attn.num_heads
    results["local_mla_heads"] = sharded.model.layers[1].self_attn.num_heads
    mesh = tensor_parallel_mesh(sharded)
    _compare(results, "checkpoint", sharded, reference, sharded.config.vocab_size)
    results["comm_tags"] = dict(mesh.comm.bytes_by_tag)
    # The context-parallel code path with cp = 1 over the loaded model's tp group: the indexer's queries split over tp.
    ids = _prompts(sharded.config.vocab_size)
    with torch.no_grad():
        split = context_parallel_prefill(sharded, ids, mesh).logits
        results["cp_path_error"] = (split - reference(ids).logits).abs().max().item()
    results["indexer_indices_bytes"] = mesh.comm.bytes_by_tag["tp.indexer_indices"]
    _beams_and_quantized_cache(results, sharded, reference, ids)
    # AutoModel loads the base model; its planned modules finish the load before their first forward.
    base = AutoModel.from_pretrained(CHECKPOINT, tp_plan="auto", dtype=torch.float32)
    with torch.no_grad():
        hidden = base(ids).last_hidden_state
        results["base_model_error"] = (hidden - reference.model(ids).last_hidden_state).abs().max().item()
    results["base_model_heads"] = base.layers[0].linear_attn.num_heads
    _speculative_with_rank_clocks(rank, results, sharded, reference)

    # The tiny fixture (tests/conftest.py), saved by rank 0 (transformers saves on rank 0 only), loaded with
    # DistributedConfig.
    tiny_folder, odd_folder = os.path.join(out_dir, "tiny"), os.path.join(out_dir, "odd_heads")
    odd_experts_folder = os.path.join(out_dir, "odd_experts")
    if rank == 0:
        _tiny_with_biases().save_pretrained(tiny_folder)
        tiny_config(linear_num_heads=3).save_pretrained(odd_folder)  # the config alone: the check reads nothing else
        tiny_config(n_routed_experts=3, num_experts_per_tok=1).save_pretrained(odd_experts_folder)
    dist.barrier()
    config = DistributedConfig(tp_size=2)
    tiny_sharded = KDSAForCausalLM.from_pretrained(tiny_folder, distributed_config=config, dtype=torch.float32)
    results["tiny_bytes"] = (_parameter_bytes(tiny_sharded), _parameter_bytes(_tiny_with_biases()))
    results["tiny_o_proj_bias_norm"] = tiny_sharded.model.layers[1].self_attn.o_proj.bias.norm().item()
    _compare(results, "tiny", tiny_sharded, _tiny_with_biases(), 128)

    # Converted families: the folder converts at load (conversion.py) and each rank reads its shards; what it holds
    # is apply_tensor_parallel's cut of the whole converted model, tensor for tensor.
    if rank == 0:
        _write_family_folders(out_dir)
    dist.barrier()
    tp_mesh = init_parallel_mesh(cp_size=1, tp_size=2)
    greedy = dict(max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, do_sample=False, pad_token_id=0)
    for family, vocab in FAMILIES.items():
        folder = os.path.join(out_dir, family)
        family_sharded = KDSAForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
        family_whole = KDSAForCausalLM.from_pretrained(folder, dtype=torch.float32)
        family_expected = apply_tensor_parallel(KDSAForCausalLM.from_pretrained(folder, dtype=torch.float32), tp_mesh)
        results[f"{family}_bytes"] = (_parameter_bytes(family_sharded), _parameter_bytes(family_whole))
        loaded, expected = family_sharded.state_dict(), family_expected.state_dict()
        results[f"{family}_state_equal"] = loaded.keys() == expected.keys() and all(
            torch.equal(loaded[name], tensor) for name, tensor in expected.items()
        )
        _compare(results, family, family_sharded, family_whole, vocab)
        # Prompt lookup (transformers' assisted decoding) on a prompt that repeats itself, so that it drafts, against
        # the single process's plain greedy decoding (what lookup must return).
        source = _prompts(vocab)[:1]
        repeated = torch.cat([source, source], dim=1)
        tokens = family_sharded.generate(repeated, prompt_lookup_num_tokens=3, **greedy)
        results[f"{family}_lookup_equal"] = bool(torch.equal(tokens, family_whole.generate(repeated, **greedy)))

    # Bad layouts: the same ValueError on every rank, before the load starts.
    results["error_heads"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(odd_folder, distributed_config=DistributedConfig(tp_size=2))
    )
    results["error_world_size"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config=DistributedConfig(tp_size=4))
    )
    own_plan = DistributedConfig(tp_size=2, tp_plan={"layers.*.mlp.up_proj": "colwise"})
    results["error_own_plan"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config=own_plan)
    )
    results["error_ep_world"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config=DistributedConfig(tp_size=2, ep_size=2))
    )
    results["error_fsdp"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config={"tp_size": 1, "fsdp_size": 2})
    )
    # Expert parallelism, ep = 2 (DistributedConfig itself refuses tp_size=1, ep_size=2 without FSDP: a dict).
    if rank == 0:  # Kimi K3's own layout: LatentMoE with packed MXFP4 experts (ep alone: tp refuses both, §5)
        _write_kimi_k3_folder(Path(out_dir) / "kimi_k3_mxfp4", published=True)
    dist.barrier()
    folders = {"checkpoint": (CHECKPOINT, 200), "tiny": (tiny_folder, 128), **EP_FAMILIES(out_dir)}
    _expert_parallel_checks(results, {"tp_size": 1, "ep_size": 2}, folders, odd_experts_folder)
    # Ranks launched with different sizes: rank 1 alone asks for 4, both raise rank 1's message.
    results["error_mixed"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_size=2 if rank == 0 else 4, tp_plan="auto")
    )


def _scenario_four(rank: int, results: dict, out_dir: str) -> None:
    """4 processes: tp 2 × ep 2 through `DistributedConfig(tp_size=2, ep_size=2)`, and its refusals."""
    import torch.distributed as dist
    from conftest import tiny_config
    from transformers.distributed import DistributedConfig

    from modeling_kdsa import KDSAForCausalLM

    tiny_folder, odd_heads, odd_experts = (os.path.join(out_dir, name) for name in ("tiny", "odd_heads", "odd_experts"))
    dist.init_process_group("gloo")  # from_pretrained joins it too; the barrier below needs it first
    if rank == 0:
        _tiny_with_biases().save_pretrained(tiny_folder)
        tiny_config(linear_num_heads=3).save_pretrained(odd_heads)  # the config alone: the check reads nothing else
        tiny_config(n_routed_experts=3, num_experts_per_tok=1).save_pretrained(odd_experts)
        _write_family_folders(out_dir)
    dist.barrier()
    layout = DistributedConfig(tp_size=2, ep_size=2)
    folders = {"checkpoint": (CHECKPOINT, 200), "tiny": (tiny_folder, 128)}
    folders |= {family: (os.path.join(out_dir, family), FAMILIES[family]) for family in TP_EP_FAMILIES}
    _expert_parallel_checks(results, layout, folders, odd_experts)
    results["error_heads"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(odd_heads, distributed_config=layout)
    )
    results["error_world_size"] = _expect_error(
        lambda: KDSAForCausalLM.from_pretrained(CHECKPOINT, distributed_config=DistributedConfig(tp_size=2))
    )


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks_in_folder(_scenario_four, 4)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    # Many loads in one spawn (the checkpoint, the tiny fixture and five family folders, tp and ep): a longer limit.
    return run_on_ranks_in_folder(_scenario_two, 2, timeout_s=300)


# ------------------------------------------------------------------------------------------------ distributed


def test_each_rank_loads_exactly_the_apply_tensor_parallel_shard(two_ranks):
    """Shard-on-read gives every rank the tensors `apply_tensor_parallel` cuts from the whole model, bit for bit,
    and nothing more: half of every sharded tensor, the replicated ones whole."""
    for rank, result in enumerate(two_ranks):
        loaded, expected = result["sharded_state"], result["expected_state"]
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), f"rank {rank}: {name}"
        assert result["sharded_bytes"] == result["expected_bytes"] < result["full_bytes"]
        assert (result["local_kda_heads"], result["local_mla_heads"]) == (1, 2)
    # The ranks hold different halves of a sharded tensor.
    name = "model.layers.0.linear_attn.q_proj.weight"
    assert not torch.equal(two_ranks[0]["sharded_state"][name], two_ranks[1]["sharded_state"][name])


@pytest.mark.parametrize("name", ["checkpoint", "tiny", *FAMILIES])
def test_forward_and_generate_match_the_single_process(two_ranks, name):
    for result in two_ranks:
        assert result[f"{name}_logits_error"] < LOGIT_TOLERANCE
        for run in ("greedy", "sampled", "left_padded"):
            assert result[f"{name}_{run}_equal"], f"{name} {run}"
    assert two_ranks[0][f"{name}_greedy_tokens"].shape[1] == 19 + GREEDY_STEPS
    for run in ("greedy", "sampled", "left_padded"):
        assert torch.equal(two_ranks[0][f"{name}_{run}_tokens"], two_ranks[1][f"{name}_{run}_tokens"])


def test_beam_search_and_quantized_cache_on_the_loaded_shards(two_ranks):
    """`num_beams=3`, and 32 greedy steps with the FP8 latent / MXFP8 indexer cache, give the single process's tokens
    on both ranks; the quantized cache's tokens differ from the plain cache's, so it was in use."""
    for result in two_ranks:
        assert result["beams_equal"]
        assert result["quantized_equal"]
        assert result["quantized_differs_from_plain"]
    assert torch.equal(two_ranks[0]["beams_tokens"], two_ranks[1]["beams_tokens"])


def test_tiny_fixture_is_sharded_through_distributed_config(two_ranks):
    """Fewer bytes per rank; the row-parallel `o_proj` bias is kept on rank 0 only (the outputs are summed)."""
    for result in two_ranks:
        sharded, whole = result["tiny_bytes"]
        assert sharded < whole
    assert two_ranks[0]["tiny_o_proj_bias_norm"] > 0 and two_ranks[1]["tiny_o_proj_bias_norm"] == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_lookup_on_the_converted_families_loaded_shards(two_ranks, family):
    """Speculative decoding under tp = 2 on each family: prompt lookup on a `tp_plan="auto"` load gives the single
    process's 32 greedy tokens."""
    for result in two_ranks:
        assert result[f"{family}_lookup_equal"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_families_load_exactly_the_apply_tensor_parallel_shard(two_ranks, family):
    """GLM-5.3-Flash's flat `A_log` `[H]` and Kimi K3's zero-padded one are converted whole and cut after the load;
    everything else is read as this rank's slice (docs/parallel.md §10)."""
    for result in two_ranks:
        sharded, whole = result[f"{family}_bytes"]
        assert sharded < whole
        assert result[f"{family}_state_equal"]


def test_context_parallel_path_and_base_model_over_the_loaded_shards(two_ranks):
    """`context_parallel_prefill` with cp = 1 on the loaded model's mesh splits the indexer's queries over tp (as for
    `apply_tensor_parallel`, docs/parallel.md §8); `AutoModel` (the base model) finishes its load before its first
    forward."""
    for result in two_ranks:
        assert result["cp_path_error"] < LOGIT_TOLERANCE and result["indexer_indices_bytes"] > 0
        assert result["base_model_error"] < LOGIT_TOLERANCE and result["base_model_heads"] == 1


def test_mtp_adaptive_schedule_on_the_loaded_shards_with_different_clocks(two_ranks):
    """The `tp_plan="auto"` branch of `sharded_group` (transformers' tp mesh; the load sets no
    `tensor_parallel_group`): plain greedy's tokens on both ranks, drafted in the same rounds although rank 0's
    clock says drafting pays and rank 1's that it does not (docs/parallel.md §12)."""
    rounds = [result["mtp_rounds"] for result in two_ranks]
    assert rounds[0] == rounds[1]
    total, plain, drafted, _ = rounds[0]
    assert 0 < plain < total and drafted > 0
    for result in two_ranks:
        assert result["sharded_group_size"] == 2 and not result["has_apply_tp_group"]
        assert result["whole_group"] is None
        assert result["mtp_equal"]
    assert torch.equal(two_ranks[0]["mtp_tokens"], two_ranks[1]["mtp_tokens"])


def test_all_reduces_run_after_each_sharded_module(two_ranks):
    for result in two_ranks:
        tags = result["comm_tags"]
        assert tags["tp.kda_o_proj"] > 0 and tags["tp.mla_o_proj"] > 0 and tags["tp.mlp"] > 0


@pytest.mark.parametrize(
    "key, words",
    [
        ("error_heads", "linear_num_heads=3"),
        ("error_world_size", "tp_size=4 but the world size is 2"),
        ("error_own_plan", "KDSA shards by its own plan"),
        ("error_ep_world", "tp_size=2 × ep_size=2 = 4 but the world size is 2"),
        ("error_fsdp", "tensor and expert parallelism only"),
        ("error_mixed", "rank 1: tp_size=4 but the world size is 2"),
        ("tp1_ep2_error_experts", "ep_size=2 must divide n_routed_experts=3"),
        ("tp1_ep2_error_mtp", "not supported under expert parallelism"),
    ],
)
def test_bad_layouts_raise_the_same_error_on_every_rank(two_ranks, key, words):
    for rank, result in enumerate(two_ranks):
        assert result[key] is not None, f"rank {rank} did not raise for {key}"
        assert words in result[key], result[key]
    assert two_ranks[0][key] == two_ranks[1][key]


@pytest.mark.parametrize("name", ["checkpoint", "tiny", "kimi_linear", "deepseek_v32", "glm5_next", "kimi_k3_mxfp4"])
def test_expert_parallel_load_ep2_matches_the_single_process(two_ranks, name):
    """`distributed_config={"tp_size": 1, "ep_size": 2}`: each rank holds half of every layer's routed experts and
    everything else whole, runs its share of the batch, and gives the single-process logits and 32 greedy tokens."""
    _check_expert_parallel(two_ranks, f"tp1_ep2_{name}", ep=2, tp=1, rows=[(0, 2), (2, 3)])


@pytest.mark.parametrize("name", ["checkpoint", "tiny", "kimi_linear", "deepseek_v32", "glm5_next", "kimi_k3_mxfp4"])
def test_expert_parallel_load_reads_only_this_ranks_experts(two_ranks, name):
    """Every element read from the files is kept: the other rank's experts are never read (per-expert tensors of the
    hub layout, dense or packed MXFP4, are skipped; stacked ones sliced)."""
    for result in two_ranks:
        read, kept = result[f"tp1_ep2_{name}_read"]
        assert read == kept


@pytest.mark.slow
@pytest.mark.parametrize("name", ["checkpoint", "tiny", *TP_EP_FAMILIES])
def test_expert_parallel_load_tp2_ep2_matches_the_single_process(four_ranks, name):
    """`DistributedConfig(tp_size=2, ep_size=2)` on 4 processes: each rank holds a quarter of the routed expert
    bytes (its ep block, cut by tp) and its tp share of the rest; the tp pair of an ep rank decodes the same rows."""
    _check_expert_parallel(four_ranks, f"tp2_ep2_{name}", ep=2, tp=2, rows=[(0, 2), (2, 3)])
    for result in four_ranks:
        read, kept = result[f"tp2_ep2_{name}_read"]
        assert read == kept
    for pair in (four_ranks[:2], four_ranks[2:]):
        assert torch.equal(pair[0][f"tp2_ep2_{name}_greedy_tokens"], pair[1][f"tp2_ep2_{name}_greedy_tokens"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, words",
    [
        ("tp2_ep2_error_experts", "ep_size=2 must divide n_routed_experts=3"),
        ("error_heads", "linear_num_heads=3"),
        ("error_world_size", "tp_size=2 but the world size is 4"),
    ],
)
def test_expert_parallel_load_tp2_ep2_refusals_on_every_rank(four_ranks, key, words):
    assert all(result[key] is not None and words in result[key] for result in four_ranks), four_ranks[0][key]
    assert len({result[key] for result in four_ranks}) == 1


def _check_expert_parallel(ranks: list[dict], key: str, ep: int, tp: int, rows: list) -> None:
    for rank, result in enumerate(ranks):
        assert result[f"{key}_logits_error"] < LOGIT_TOLERANCE, rank
        assert result[f"{key}_greedy_equal"], rank
        assert result[f"{key}_greedy_tokens"].shape[1] == 19 + GREEDY_STEPS
        assert result[f"{key}_traffic_calls"] > 0
        sharded, whole, experts = result[f"{key}_bytes"]
        # Everything but the routed experts (cut by tp as docs/parallel.md §5 says), plus 1/(tp·ep) of the experts.
        assert sharded <= whole - experts + experts // (tp * ep) and sharded < whole
        assert set(result[f"{key}_local_experts"]) == {result[f"{key}_local_experts"][0]}
    assert [ranks[rank][f"{key}_rows"] for rank in range(0, len(ranks), tp)] == rows


# ------------------------------------------------------------------------------------------------ one process


def test_plan_is_declared_and_its_styles_registered():
    from modeling_kdsa.parallel import hf_plans
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    from modeling_kdsa import KDSAConfig, KDSAForCausalLM

    plan = {**KDSAConfig.base_model_tp_plan, **KDSAForCausalLM._tp_plan}
    assert set(plan.values()) == set(hf_plans.STYLE_PLANS)
    assert (plan["embed_tokens"], plan["lm_head"]) == ("kdsa_vocab_embedding", "kdsa_vocab_head")
    assert all(style in ALL_PARALLEL_STYLES for style in plan.values())
    assert KDSAConfig.base_model_pp_plan is None


def test_sharded_group_is_none_for_a_whole_model():
    """A model whole in its process syncs nothing in speculative decoding (docs/parallel.md §12)."""
    from modeling_kdsa import KDSAForCausalLM
    from modeling_kdsa.speculative import sharded_group

    assert sharded_group(KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32)) is None


def test_tp_size_without_a_launcher_is_refused(monkeypatch):
    from modeling_kdsa import KDSAForCausalLM

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="tp_size=2 but the world size is 1.*torchrun --nproc-per-node 2"):
        KDSAForCausalLM.from_pretrained(CHECKPOINT, tp_size=2, tp_plan="auto")


@pytest.mark.slow
def test_tp_generate_script_under_torchrun():
    """scripts/tp_generate.py as docs/parallel.md §10 launches it: 2 processes started by torchrun, `--check`."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    script, checkpoint = root / "scripts" / "tp_generate.py", root / "checkpoints" / "kdsa-tiny"
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), str(checkpoint)]
    command.append("--check")
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("tokens equal to one process: True" in line for line in lines), result.stdout


def test_load_memory_script_under_torchrun(tmp_path):
    """scripts/load_memory.py as docs/parallel.md §10 launches it (a smaller model): each tp rank holds about half of
    what one process holds, and its anonymous memory never grows by the whole model."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "load_memory.json"
    script = root / "scripts" / "load_memory.py"
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    command += ["--layers", "2", "--hidden", "512", "--out", str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    *ranks, whole = report["rows"]
    assert [row["load"] for row in ranks] == ["tp_size=2, rank 0", "tp_size=2, rank 1"]
    assert whole["held_mib"] > 0.95 * report["checkpoint_mib"]
    for row in ranks:
        assert 0.45 * whole["held_mib"] < row["held_mib"] < 0.55 * whole["held_mib"], row
        assert row["peak_anon_growth_mib"] < 0.5 * whole["held_mib"], row
