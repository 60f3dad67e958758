"""Speculative decoding on a tensor-parallel model (docs/parallel.md §12), on 2 gloo processes spawned as in
tests/test_parallel_distributed.py.

`generate(use_mtp=True)` (KDSA's drafting loop, modeling_kdsa/speculative.py) and `prompt_lookup_num_tokens`
(transformers' assisted decoding) on `checkpoints/kdsa-tiny` cut by `apply_tensor_parallel` over 2 ranks must give
the single-process greedy tokens. The adaptive draft schedule decides from measured seconds; here each rank's clock
is a fake one (`speculative.time`) that advances only when the target model runs a forward, by a cost that differs
per rank: on rank 0 a verify forward costs as much as a plain step (drafting always pays), on rank 1 each drafted
token adds 10 steps (drafting never pays). On their own clocks the two ranks would draft in different rounds and call
the tp all-reduces with different token counts; with the seconds agreed over the tp group they draft in the same
rounds. A model whole in each process (independent data-parallel processes) must not sync: there each rank decodes
its own prompt with its own number of rounds.
"""

from pathlib import Path

import pytest
import torch
from gloo_ranks import run_on_ranks
from test_parallel_distributed import _expect_error, _prompt

CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "kdsa-tiny"
NEW_TOKENS = 32


class _RankClock:
    """`time.perf_counter` for speculative.py: advances only in a forward of the target model, by 1 plus
    `per_drafted_token` for each token after the first (a plain step feeds one token, a verify 1 + drafts)."""

    def __init__(self, per_drafted_token: float):
        self.now, self.per_drafted_token = 0.0, per_drafted_token

    def perf_counter(self) -> float:
        return self.now

    def forward_pre_hook(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.now += 1.0 + self.per_drafted_token * (ids.shape[1] - 1)


def _load():
    from modeling_kdsa import KDSAForCausalLM

    return KDSAForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


def _scenario_tp2(rank: int, results: dict) -> None:
    import torch.distributed as dist
    from modeling_kdsa.parallel import apply_expert_parallel, apply_tensor_parallel, init_parallel_mesh

    import modeling_kdsa.speculative as speculative

    clock = _RankClock(per_drafted_token=10.0 * rank)
    speculative.time = clock
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    reference_model = _load()
    half = _prompt(12, batch=2, seed=4)
    ids = torch.cat([half, half, half[:, :5]], dim=1)  # repeats: prompt lookup finds n-grams to draft
    reference = reference_model.generate(ids, **greedy)

    mesh = init_parallel_mesh(cp_size=1, tp_size=2)
    model = apply_tensor_parallel(_load(), mesh)
    model.register_forward_pre_hook(clock.forward_pre_hook, with_kwargs=True)
    tokens = model.generate(ids, use_mtp=True, **greedy)
    results["mtp_adaptive_equal"] = bool(torch.equal(tokens, reference))
    stats = model.speculation_stats
    results["mtp_adaptive_rounds"] = (stats.rounds, stats.plain_rounds, stats.drafted, stats.accepted)
    tokens = model.generate(ids, use_mtp=True, draft_schedule="always", **greedy)
    results["mtp_always_equal"] = bool(torch.equal(tokens, reference))
    tokens = model.generate(ids[:1], prompt_lookup_num_tokens=3, **greedy)  # transformers' loop takes one row
    results["prompt_lookup_equal"] = bool(torch.equal(tokens, reference[:1]))

    # Whole models, one per process, each decoding its own prompt for its own number of tokens: no sync, no hang.
    own = dict(greedy, max_new_tokens=NEW_TOKENS - 12 * rank, min_new_tokens=NEW_TOKENS - 12 * rank)
    whole = _load()
    whole.register_forward_pre_hook(clock.forward_pre_hook, with_kwargs=True)
    own_ids = ids[rank : rank + 1]
    tokens = whole.generate(own_ids, use_mtp=True, **own)
    results["whole_equal"] = bool(torch.equal(tokens, reference_model.generate(own_ids, **own)))
    results["whole_generated"] = tokens.shape[1] - own_ids.shape[1]

    # Expert parallelism: the ep ranks decode different sequences; speculative decoding is refused on every rank.
    ep_model = apply_expert_parallel(_load(), dist.group.WORLD)
    results["error_ep"] = _expect_error(lambda: ep_model.generate(ids[rank : rank + 1], use_mtp=True, **greedy))
    results["error_ep_lookup"] = _expect_error(
        lambda: ep_model.generate(ids[rank : rank + 1], prompt_lookup_num_tokens=3, **greedy)
    )


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Both ranks' results; a hang (ranks in different collectives) fails the test (gloo_ranks.SPAWN_TIMEOUT_S)."""
    return run_on_ranks(_scenario_tp2, 2)


def test_mtp_adaptive_schedule_under_tp2_with_different_clocks(two_ranks):
    """Plain greedy's tokens on both ranks, and both ranks drafted in the same rounds: the slowest rank's seconds
    (rank 1's: drafting does not pay) decide, so some rounds are plain and the probes still draft."""
    rounds = [result["mtp_adaptive_rounds"] for result in two_ranks]
    assert rounds[0] == rounds[1]
    total, plain, drafted, _ = rounds[0]
    assert 0 < plain < total and drafted > 0
    for result in two_ranks:
        assert result["mtp_adaptive_equal"]
        assert result["mtp_always_equal"]


def test_prompt_lookup_under_tp2(two_ranks):
    for result in two_ranks:
        assert result["prompt_lookup_equal"]


def test_whole_models_in_each_process_do_not_sync(two_ranks):
    """Rank 0 decodes 32 tokens, rank 1 20 tokens, each its own prompt with its own clock: a sync over the world
    would leave rank 0 waiting once rank 1 stops."""
    assert [result["whole_generated"] for result in two_ranks] == [NEW_TOKENS, NEW_TOKENS - 12]
    for result in two_ranks:
        assert result["whole_equal"]


def test_speculative_decoding_refused_under_expert_parallelism(two_ranks):
    for result in two_ranks:
        assert "not supported under expert parallelism" in result["error_ep"]
        assert "not supported under expert parallelism" in result["error_ep_lookup"]
