"""CP × TP on real process groups (gloo, CPU): 2 and 4 processes spawned with torch.multiprocessing.

Each group of processes runs once per module (a fixture) and writes what it saw to disk; the tests below read it.
All ranks build the same tiny mixed KDA/DSA model (tests/conftest.py, same seed) and the same prompts, whose
lengths are not multiples of 2·cp, so the end padding is always exercised.

Tolerance for logits, 1e-4 absolute (logits are O(1)): everything runs in fp32 and a parallel run differs from the
single process only in summation order (KDA chunk boundaries at segment starts, the affine fold, partial sums over tp
ranks, matmul shapes), each ~1e-7 relative; measured max errors are 2.5e-7 to 3.4e-6. Mistakes in token mixing
(a wrong causal limit, start state or halo) change logits by > 1e-2.
"""


import pytest
import torch
from gloo_ranks import run_on_ranks

LOGIT_TOLERANCE = 1e-4
PROMPT_LEN = 37  # not a multiple of 2·cp for cp = 2, 4; > index_topk (8) so the DSA layers are really sparse
LONG_PROMPT_LEN = 130  # load balance at cp = 4: ~16 tokens per chunk, not a multiple of 8
DECODE_STEPS = 4


def _prompt(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def _greedy_decode(model, cache, first_logits: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode from a filled cache: returns the tokens `[B, steps]` and the logits of each step."""
    tokens, logits = [], []
    next_token = first_logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        tokens.append(next_token)
        step_logits = model(next_token, cache=cache).logits
        logits.append(step_logits)
        next_token = step_logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, 1), torch.cat(logits, 1)


def _expect_error(action) -> str | None:
    try:
        action()
    except ValueError as error:
        return str(error)
    return None


# ------------------------------------------------------------------------------------------------ the workers


def _scenario_two(rank: int, results: dict) -> None:
    """2 processes: cp = 2 (zigzag and contiguous, + decode from the CP-built cache), tp = 2, error paths."""
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_tensor_parallel, context_parallel_prefill, init_parallel_mesh

    from modeling_kdsa.cache import KDSACache

    reference_model = tiny_model()
    ids = _prompt(PROMPT_LEN)
    reference = reference_model(ids).logits

    cp_mesh = init_parallel_mesh(cp_size=2, tp_size=1)
    for layout in ("zigzag", "contiguous"):
        out = context_parallel_prefill(reference_model, ids, cp_mesh, layout=layout)
        results[f"cp2_{layout}_error"] = (out.logits - reference).abs().max().item()

    # Prefill under CP into a cache, then decode in a single process from that cache.
    cache = KDSACache(reference_model.config)
    out = context_parallel_prefill(reference_model, ids, cp_mesh, cache=cache, last_token_only=True)
    results["cp2_last_logits_error"] = (out.logits[:, -1] - reference[:, -1]).abs().max().item()
    if rank == 0:
        tokens, logits = _greedy_decode(reference_model, cache, out.logits, DECODE_STEPS)
        reference_cache = KDSACache(reference_model.config)
        reference_prefill = reference_model(ids, cache=reference_cache).logits
        ref_tokens, ref_logits = _greedy_decode(reference_model, reference_cache, reference_prefill, DECODE_STEPS)
        results["decode_tokens_equal"] = bool(torch.equal(tokens, ref_tokens))
        results["decode_logits_error"] = (logits - ref_logits).abs().max().item()

    # Tensor parallelism: the model's own forward and generate() on a tp = 2 mesh.
    tp_mesh = init_parallel_mesh(cp_size=1, tp_size=2)
    sharded = apply_tensor_parallel(tiny_model(), tp_mesh)
    results["tp2_error"] = (sharded(ids).logits - reference).abs().max().item()
    results["tp2_local_heads"] = sharded.model.layers[0].linear_attn.num_heads
    generated = sharded.generate(ids, max_new_tokens=DECODE_STEPS, do_sample=False)
    reference_generated = reference_model.generate(ids, max_new_tokens=DECODE_STEPS, do_sample=False)
    results["tp2_generate_equal"] = bool(torch.equal(generated, reference_generated))
    out = context_parallel_prefill(sharded, ids, tp_mesh)  # the CP code path with cp = 1: indexer split over tp
    results["tp2_cp_path_error"] = (out.logits - reference).abs().max().item()

    # Dense MLA layers (Kimi-Linear's "full_attention") with the unrotated rope slice and grouped routing.
    kimi_fields = dict(
        layer_types=["linear_attention", "indexed_attention", "full_attention", "full_attention"],
        mla_use_nope=True,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
    )
    kimi_model = tiny_model(**kimi_fields)
    kimi_reference = kimi_model(ids).logits
    out = context_parallel_prefill(kimi_model, ids, cp_mesh)
    results["mla_cp2_error"] = (out.logits - kimi_reference).abs().max().item()
    kimi_sharded = apply_tensor_parallel(tiny_model(**kimi_fields), tp_mesh)
    results["mla_tp2_error"] = (kimi_sharded(ids).logits - kimi_reference).abs().max().item()

    # GLM-5.3-Flash's features (bounded KDA gate, SwiGLU clamp, mHC ×4): under cp = 2 and under tp = 2.
    glm_features = dict(attn_res_block_size=0, hc_mult=4, linear_lower_bound=-5.0, swiglu_limit=0.5)
    glm_model = tiny_model(**glm_features)
    glm_reference = glm_model(ids).logits
    out = context_parallel_prefill(glm_model, ids, cp_mesh)
    results["glm_cp2_error"] = (out.logits - glm_reference).abs().max().item()
    glm_sharded = apply_tensor_parallel(tiny_model(**glm_features), tp_mesh)
    results["glm_tp2_error"] = (glm_sharded(ids).logits - glm_reference).abs().max().item()

    # GLM-5.3-Flash's k-pool indexer (with the always-selected tail) and a shared-indexer layer: under cp = 2, and
    # under the CP path at tp = 2 (the tp ranks split the indexer queries, selections up to index_topk + kp - 1 wide).
    kpool_features = dict(
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        qk_rope_head_dim=0,
        index_kpool=4,
        index_n_heads=8,
    )
    kpool_model = tiny_model(**kpool_features)
    kpool_reference = kpool_model(ids).logits
    out = context_parallel_prefill(kpool_model, ids, cp_mesh)
    results["kpool_cp2_error"] = (out.logits - kpool_reference).abs().max().item()
    kpool_sharded = apply_tensor_parallel(tiny_model(**kpool_features), tp_mesh)
    out = context_parallel_prefill(kpool_sharded, ids, tp_mesh)
    results["kpool_tp2_cp_path_error"] = (out.logits - kpool_reference).abs().max().item()

    # Kimi K3's features: gated NoPE MLA, full-rank KDA gate with the lower bound, SiTU; under cp = 2 and tp = 2.
    # LatentMoE with MXFP4 experts under cp = 2 only (tensor parallelism refuses both by name).
    k3_features = dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mla_use_nope=True,
        mla_use_output_gate=True,
        linear_use_full_rank_gate=True,
        linear_lower_bound=-5.0,
        hidden_act="situ",
    )
    k3_model = tiny_model(**k3_features)
    k3_reference = k3_model(ids).logits
    out = context_parallel_prefill(k3_model, ids, cp_mesh)
    results["k3_cp2_error"] = (out.logits - k3_reference).abs().max().item()
    k3_sharded = apply_tensor_parallel(tiny_model(**k3_features), tp_mesh)
    results["k3_tp2_error"] = (k3_sharded(ids).logits - k3_reference).abs().max().item()
    latent = dict(routed_expert_hidden_size=32, latent_moe_use_norm=True, routed_expert_weight_format="mxfp4")
    k3_latent_model = tiny_model(**k3_features, **latent)
    out = context_parallel_prefill(k3_latent_model, ids, cp_mesh)
    results["k3_latent_cp2_error"] = (out.logits - k3_latent_model(ids).logits).abs().max().item()

    # Error paths: each must raise a ValueError on every rank, and return (no rank left waiting).
    results["error_short_sequence"] = _expect_error(
        lambda: context_parallel_prefill(reference_model, ids[:, :3], cp_mesh)
    )
    results["error_ragged_inputs"] = _expect_error(
        lambda: context_parallel_prefill(reference_model, ids[:, : PROMPT_LEN - rank], cp_mesh)
    )
    results["error_world_size"] = _expect_error(lambda: init_parallel_mesh(cp_size=2, tp_size=2))
    results["error_mixed_sizes"] = _expect_error(lambda: init_parallel_mesh(cp_size=2 - rank, tp_size=1 + rank))
    results["error_heads"] = _expect_error(lambda: apply_tensor_parallel(tiny_model(linear_num_heads=3), tp_mesh))
    results["error_not_sharded"] = _expect_error(lambda: context_parallel_prefill(tiny_model(), ids, tp_mesh))
    results["error_short_sequence_only_rank1"] = _expect_error(
        lambda: context_parallel_prefill(reference_model, ids[:, : 3 if rank == 1 else PROMPT_LEN], cp_mesh)
    )


def _scenario_four(rank: int, results: dict) -> None:
    """4 processes: cp = 2 × tp = 2; cp = 4 zigzag and contiguous with measured indexer work per rank."""
    from conftest import tiny_model
    from modeling_kdsa.parallel import apply_tensor_parallel, context_parallel_prefill, init_parallel_mesh

    reference_model = tiny_model()
    ids = _prompt(PROMPT_LEN)
    reference = reference_model(ids).logits
    mesh = init_parallel_mesh(cp_size=2, tp_size=2)
    sharded = apply_tensor_parallel(tiny_model(), mesh)
    out = context_parallel_prefill(sharded, ids, mesh)
    results["cp2_tp2_error"] = (out.logits - reference).abs().max().item()
    results["cp2_tp2_comm_bytes"] = dict(mesh.comm.bytes_by_tag)

    long_ids = _prompt(LONG_PROMPT_LEN, batch=1)
    long_reference = reference_model(long_ids).logits
    cp4 = init_parallel_mesh(cp_size=4, tp_size=1)
    for layout in ("zigzag", "contiguous"):
        out = context_parallel_prefill(reference_model, long_ids, cp4, layout=layout)
        results[f"cp4_{layout}_error"] = (out.logits - long_reference).abs().max().item()
        results[f"cp4_{layout}_indexer_pairs"] = out.stats.indexer_pairs


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_scenario_two, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_on_ranks(_scenario_four, 4)


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp2_logits_match_single_process(two_ranks, layout):
    for result in two_ranks:
        assert result[f"cp2_{layout}_error"] < LOGIT_TOLERANCE


def test_dense_mla_under_cp2_and_tp2_matches_single_process(two_ranks):
    for result in two_ranks:
        assert result["mla_cp2_error"] < LOGIT_TOLERANCE
        assert result["mla_tp2_error"] < LOGIT_TOLERANCE


def test_cp2_prefill_then_single_process_decode(two_ranks):
    for result in two_ranks:
        assert result["cp2_last_logits_error"] < LOGIT_TOLERANCE
    assert two_ranks[0]["decode_tokens_equal"]
    assert two_ranks[0]["decode_logits_error"] < LOGIT_TOLERANCE


def test_tp2_model_forward_and_generate(two_ranks):
    for result in two_ranks:
        assert result["tp2_local_heads"] == 1  # 2 KDA heads split over 2 ranks: really sharded
        assert result["tp2_error"] < LOGIT_TOLERANCE
        assert result["tp2_generate_equal"]
        assert result["tp2_cp_path_error"] < LOGIT_TOLERANCE


def test_glm_features_under_cp2_and_tp2(two_ranks):
    """The bounded KDA gate, SwiGLU clamp and mHC need nothing rank-specific: CP runs the layers' own gate code and the
    model's own residual stream; TP shards the gate's A_log / dt_bias by head and the clamp is
    elementwise on the intermediate slice."""
    for result in two_ranks:
        assert result["glm_cp2_error"] < LOGIT_TOLERANCE
        assert result["glm_tp2_error"] < LOGIT_TOLERANCE


def test_glm_kpool_and_shared_indexer_under_cp2_and_tp2(two_ranks):
    """The k-pool indexer and a shared-indexer layer run through the layers' own code under CP (the pooled keys are
    built from the gathered keys); under tp the ranks split the indexer queries and gather the selections."""
    for result in two_ranks:
        assert result["kpool_cp2_error"] < LOGIT_TOLERANCE
        assert result["kpool_tp2_cp_path_error"] < LOGIT_TOLERANCE


def test_kimi_k3_features_under_cp2_and_tp2(two_ranks):
    """K3's gates are per head like the attention output they multiply: TP shards `g_proj` by head; CP calls the
    layers' own gate code. LatentMoE / MXFP4 experts run position-wise under CP (tensor parallelism refuses them)."""
    for result in two_ranks:
        assert result["k3_cp2_error"] < LOGIT_TOLERANCE
        assert result["k3_tp2_error"] < LOGIT_TOLERANCE
        assert result["k3_latent_cp2_error"] < LOGIT_TOLERANCE


@pytest.mark.parametrize(
    "key, words",
    [
        ("error_short_sequence", "shorter than the 2·cp = 4 chunks"),
        ("error_ragged_inputs", "same shape on every rank"),
        ("error_world_size", "world size 2 != cp·tp"),
        ("error_mixed_sizes", "different (cp, tp) sizes"),
        ("error_heads", "linear_num_heads=3"),
        ("error_not_sharded", "apply_tensor_parallel"),
        ("error_short_sequence_only_rank1", "rank 1: sequence of 3 tokens"),
    ],
)
def test_bad_sizes_raise_on_every_rank(two_ranks, key, words):
    for rank, result in enumerate(two_ranks):
        assert result[key] is not None, f"rank {rank} did not raise for {key}"
        assert words in result[key], result[key]


def test_cp2_tp2_logits_match_single_process(four_ranks):
    for result in four_ranks:
        assert result["cp2_tp2_error"] < LOGIT_TOLERANCE
        tags = result["cp2_tp2_comm_bytes"]
        assert tags["cp.dsa_latent_and_index_keys"] > 0 and tags["cp.kda_state_summaries"] > 0
        assert tags["tp.indexer_indices"] > 0 and tags["tp.kda_o_proj"] > 0


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_cp4_logits_match_single_process(four_ranks, layout):
    for result in four_ranks:
        assert result[f"cp4_{layout}_error"] < LOGIT_TOLERANCE


def test_cp4_measured_indexer_balance(four_ranks):
    """The (query, key) pairs each rank's indexer kernels scored (`ScoredPairs`, counted in the kernels): the fused CPU
    kernel scores a block of n queries starting at position s against the keys up to its last query, rounded up to
    whole pages of 64 (segments here are < 128 queries, one block each). Measured == that count from the layout,
    exactly. At 130 tokens page rounding dominates (zigzag 1.150, contiguous 1.416); zigzag still balances better."""
    from conftest import tiny_config
    from modeling_kdsa.parallel import SequenceLayout

    from modeling_kdsa.cache import PAGE_SIZE

    dsa_layers = tiny_config().layer_types.count("indexed_attention")
    ratios = {}
    for layout in ("zigzag", "contiguous"):
        sequence = SequenceLayout(LONG_PROMPT_LEN, 4, layout)
        work = [result[f"cp4_{layout}_indexer_pairs"] for result in four_ranks]
        expected = [
            dsa_layers
            * sum(s.num_real * -(-(s.start + s.num_real) // PAGE_SIZE) * PAGE_SIZE for s in sequence.segments_of(rank))
            for rank in range(4)
        ]
        assert work == expected
        ratios[layout] = max(work) / (sum(work) / len(work))
    assert 1.0 <= ratios["zigzag"] < 1.2 < 1.4 < ratios["contiguous"], ratios
