"""generate() with the real drafters — the model's MTP layer (`use_mtp=True`) and a DSpark draft
(`assistant_model=draft, speculation_type="dspark"`) — returns plain greedy's tokens at batch 1 and batch 4
left-padded, chained MTP drafts and confidence pruning included; sampling runs through the same loop. The drafts here
have random weights, so most drafts are rejected (the scripted tests in test_speculative_loop.py choose every
accept/reject pattern); the shipped, trained drafts are tested in test_checkpoint.py."""

import pytest
import torch
from conftest import left_padded_batch, needs_kernel_build, tiny_model, verify_and_steps_logits

from modeling_kdsa import DSparkConfig, DSparkDraftModel, cpu_extension, speculative

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def every_round_drafts(monkeypatch):
    """These tests check the drafting mechanics round by round: every round drafts (test_draft_schedule.py tests
    the adaptive schedule)."""
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")


def left_padded(batch, seed=0):
    ids, mask = left_padded_batch([13, 6, 21, 9][:batch], seed=seed)
    return ids, (mask if batch > 1 else None)


def random_dspark(model, seed=0, **overrides) -> DSparkDraftModel:
    """A DSpark draft for the tiny test model with random weights (two context layers, a Markov and a confidence
    head)."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=model.config.vocab_size, hidden_size=model.config.hidden_size, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, target_layer_ids=[0, 2], num_target_layers=4, block_size=5,
        mask_token_id=3, markov_rank=16,
    )  # fmt: skip
    fields.update(overrides)
    return DSparkDraftModel(DSparkConfig(**fields)).eval()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_mtp_greedy_equals_plain_greedy(batch, draft_tokens):
    model = tiny_model(num_mtp_layers=1)
    ids, mask = left_padded(batch)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, use_mtp=True, mtp_draft_tokens=draft_tokens,
                         **GREEDY)  # fmt: skip
    assert torch.equal(out, reference)
    stats = model.speculation_stats
    assert stats.method == "mtp" and stats.rounds > 0
    assert stats.drafted <= stats.rounds * draft_tokens


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_dspark_greedy_equals_plain_greedy(batch, threshold):
    model = tiny_model()
    draft = random_dspark(model)
    ids, mask = left_padded(batch, seed=1)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, assistant_model=draft,
                         speculation_type="dspark", dspark_confidence_threshold=threshold, **GREEDY)  # fmt: skip
    assert torch.equal(out, reference)
    stats = model.speculation_stats
    assert stats.method == "dspark"
    if threshold == 0.0:  # no pruning: every round verifies a whole block (γ = 5) until the end is near
        assert stats.drafted >= (stats.rounds - 4) * 5


def test_confidence_pruning_reaches_the_verify_forward():
    """A threshold above every confidence verifies no draft at all (each round is a plain step); none prunes
    nothing: the count of drafted tokens follows the threshold."""
    model = tiny_model()
    draft = random_dspark(model)
    ids, _ = left_padded(1)
    drafted = {}
    for threshold in (0.0, 1.01):
        model.generate(ids, max_new_tokens=12, assistant_model=draft, speculation_type="dspark",
                       dspark_confidence_threshold=threshold, **GREEDY)  # fmt: skip
        drafted[threshold] = model.speculation_stats.drafted
    assert drafted[1.01] == 0 and drafted[0.0] > 0


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_sampling_runs_batched(method):
    """do_sample with top-p through both drafters, batch 4 left-padded: every row gets its tokens (the distribution
    itself is tested in test_speculative_loop.py)."""
    model = tiny_model(num_mtp_layers=1)
    ids, mask = left_padded(4, seed=2)
    extra = {"use_mtp": True, "mtp_draft_tokens": 2} if method == "mtp" else {
        "assistant_model": random_dspark(model), "speculation_type": "dspark"}  # fmt: skip
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_p=0.9, temperature=0.8,
                         pad_token_id=0, eos_token_id=None, **extra)  # fmt: skip
    assert out.shape == (4, ids.shape[1] + 16)
    stats = model.speculation_stats
    assert stats.method == method and stats.emitted == 16 and stats.rounds + 1 <= 16


def test_bad_drafter_arguments_are_refused():
    model = tiny_model(num_mtp_layers=1)
    ids, _ = left_padded(1)
    with pytest.raises(ValueError, match="mtp_draft_tokens must be >= 1"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, mtp_draft_tokens=0, **GREEDY)
    with pytest.raises(ValueError, match="pass no assistant_model"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, assistant_model=random_dspark(model), **GREEDY)
    with pytest.raises(ValueError, match="needs assistant_model=<a DSparkDraftModel>"):
        model.generate(ids, max_new_tokens=4, speculation_type="dspark", assistant_model=tiny_model(), **GREEDY)
    wrong_layers = random_dspark(model, target_layer_ids=[3], num_target_layers=None)
    with pytest.raises(ValueError, match="final layer"):
        model.generate(ids, max_new_tokens=4, speculation_type="dspark", assistant_model=wrong_layers, **GREEDY)


@torch.no_grad()
def test_propose_stops_at_the_end_of_the_longest_confident_run():
    """With a threshold, `propose` returns the unpruned block cut where the longest run of confident slots of any
    row ends, and samples no slot past it."""
    model = tiny_model()
    draft = random_dspark(model, block_size=8).bind_target(model)
    ids, mask = left_padded(4, seed=3)
    out = model(ids, attention_mask=mask, output_hidden_states=True)
    cache = draft.new_cache(4)
    draft.extend_context(cache, out.hidden_states, mask)
    anchor = out.logits[:, -1].argmax(-1)
    position = mask.sum(1)
    full, _, confidence = draft.propose(cache, anchor, position)
    for threshold in confidence.flatten().tolist() + [1.01]:
        runs = (confidence >= threshold).long().cumprod(1).sum(1)
        sampled = []

        def sample(logits, k, sampled=sampled):
            sampled.append(k)
            return logits.argmax(-1), logits

        tokens, logits, _ = draft.propose(cache, anchor, position, sample, confidence_threshold=threshold)
        assert torch.equal(tokens, full[:, : int(runs.max())])
        assert sampled == list(range(int(runs.max())))


@pytest.mark.parametrize("method", ["mtp", "dspark"])
@torch.no_grad()
def test_kda_states_after_speculation_match_plain_decoding(method):
    """After a speculative generate(), every KDA layer's conv window and fp32 state are plain greedy's over the same
    tokens. Replay itself is bit for bit stepping of the recorded inputs (tests/test_speculative.py,
    tests/test_cpu_kda_recurrent.py); end to end the recorded inputs come from projections over a verification's
    several rows instead of one, whose fp32 rounding differs (measured 4e-8), so the states agree within 1e-6."""
    from modeling_kdsa.cache import KDAReplayLayer

    model = tiny_model(num_mtp_layers=1)
    ids, mask = left_padded(4, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, return_dict_in_generate=True, **GREEDY)
    plain = model.generate(ids, **kwargs)
    extra = {"use_mtp": True, "mtp_draft_tokens": 3} if method == "mtp" else {
        "assistant_model": random_dspark(model), "speculation_type": "dspark", "dspark_confidence_threshold": 0.0}
    spec = model.generate(ids, **kwargs, **extra)
    assert torch.equal(spec.sequences, plain.sequences)
    assert spec.cache.get_seq_length() == plain.cache.get_seq_length()
    pairs = zip(plain.cache.layers, spec.cache.layers, strict=True)
    kda_layers = [(a, b) for a, b in pairs if isinstance(a, KDAReplayLayer)]
    assert kda_layers
    for ours, theirs in kda_layers:
        torch.testing.assert_close(theirs.recurrent_states[0], ours.recurrent_states[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(theirs.conv_states[0], ours.conv_states[0], atol=1e-6, rtol=0)
        assert theirs.num_tokens == ours.num_tokens and not theirs.records  # committed: nothing left pending


@pytest.mark.slow
@torch.no_grad()
def test_shipped_model_mtp_and_dspark_equal_plain_greedy_batched():
    """The shipped checkpoint with its MTP layer and the shipped DSpark draft, on held-out copy and recall prompts of
    different lengths, batch 1 and batch 4 left-padded: plain greedy's tokens, 40 steps."""
    from pathlib import Path

    from modeling_kdsa.eval.make_data import load_docs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(__file__).resolve().parent.parent / "checkpoints"
    model = AutoModelForCausalLM.from_pretrained(root / "kdsa-tiny", dtype=torch.float32).eval()
    draft = DSparkDraftModel.from_pretrained(root / "kdsa-tiny-dspark")
    tokenizer = AutoTokenizer.from_pretrained(root / "kdsa-tiny")
    tokenizer.padding_side = "left"
    texts = [d["context"] for d in load_docs("copy")[:2] + load_docs("recall_mid")[:2]]
    greedy = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=model.config.pad_token_id)
    for batch in (texts[:1], texts):
        inputs = tokenizer(batch, return_tensors="pt", padding=True)
        plain = model.generate(**inputs, **greedy)
        assert torch.equal(model.generate(**inputs, use_mtp=True, **greedy), plain)
        assert torch.equal(model.generate(**inputs, assistant_model=draft, speculation_type="dspark", **greedy), plain)


def test_first_difference_finds_the_earliest_token_and_its_gap():
    """`first_difference`: the earliest new token any row differs at, plain greedy's score gap there in spacings of
    the model's dtype (bf16 at 10.6875: 0.0625), None for equal outputs, a refusal for outputs of different shapes."""
    plain = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]])
    other = torch.tensor([[5, 1, 2, 4], [5, 1, 4, 3]])  # row 0 differs at new token 2, row 1 at new token 1
    scores = tuple(torch.zeros(2, 6) for _ in range(3))
    scores[1][1, 2], scores[1][1, 4] = 10.6875, 10.6875  # row 1, new token 1: a tie between tokens 2 and 4
    difference = speculative.first_difference(plain, other, scores, torch.bfloat16)
    assert (difference.row, difference.position, difference.plain_token, difference.token) == (1, 1, 2, 4)
    assert difference.gap == 0 and difference.ulp == 0.0625 and difference.near_tie
    scores[1][1, 4] = 10.6875 - 5 * 0.0625  # five spacings below: more than rounding
    assert not speculative.first_difference(plain, other, scores, torch.bfloat16).near_tie
    assert speculative.first_difference(plain, other, scores, torch.float32).ulp == 2.0**-23 * 8
    assert speculative.first_difference(plain, plain.clone(), scores, torch.bfloat16) is None
    with pytest.raises(ValueError, match="outputs of one shape"):
        speculative.first_difference(plain, other[:, :3], scores, torch.bfloat16)


@needs_kernel_build
@torch.no_grad()
def test_shipped_model_in_bf16_verifies_with_the_bits_of_one_token_steps():
    """A forward of 8 tokens from a cache gives each the logits of its one-token step bit for bit in bf16 on the
    `cpu` backend (the C++ products sum in one order whatever the number of rows, the KDA conv and recurrence step the
    tokens; docs/speculative.md §2), also split 2 + 6; so greedy speculative output is plain greedy's in bf16 too."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parent.parent / "checkpoints"
    model = AutoModelForCausalLM.from_pretrained(root / "kdsa-tiny", dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 200, (2, 70), generator=generator)
    new = torch.randint(4, 200, (2, 8), generator=generator)
    block, steps = verify_and_steps_logits(model, prompt, new)
    assert torch.equal(block, steps)
    cache = model(prompt, use_cache=True).cache
    split = [model(new[:, a:b], cache=cache, use_cache=True, logits_to_keep=b - a).logits for a, b in ((0, 2), (2, 8))]
    assert torch.equal(torch.cat(split, dim=1), block)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@torch.no_grad()
def test_shipped_model_in_bf16_gives_plain_greedy_tokens(backend):
    """The shipped model and drafts in bf16, every drafter, held-out prompts alone and as a left-padded batch: plain
    greedy's tokens. On the `cpu` backend (with its kernels) bit for bit by construction (the test above); on `torch`
    an output may part from plain greedy's only at a near-tie of plain greedy's scores (`first_difference`), where a
    verify forward may round differently from one-token steps. With the KDA replay removed both fail."""
    from pathlib import Path

    from modeling_kdsa.eval.make_data import load_docs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(__file__).resolve().parent.parent / "checkpoints"
    model = AutoModelForCausalLM.from_pretrained(root / "kdsa-tiny", dtype=torch.bfloat16, kernel_backend=backend)
    draft = DSparkDraftModel.from_pretrained(root / "kdsa-tiny-dspark", dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(root / "kdsa-tiny")
    docs = load_docs("recall_far")[2:4] + load_docs("recall_near")[3:4] + load_docs("copy")[:1]
    greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=model.config.pad_token_id)
    drafters = [dict(use_mtp=True), dict(assistant_model=draft, speculation_type="dspark"),
                dict(assistant_model=draft, speculation_type="dspark", prompt_lookup_num_tokens=10)]  # fmt: skip
    exact = backend == "cpu" and cpu_extension.kernel_isa() is not None
    tokenizer.padding_side = "left"
    batches = [[doc["context"]] for doc in docs] + [[doc["context"] for doc in docs]]  # each alone, then batch 4
    for texts in batches:
        inputs = tokenizer(texts, return_tensors="pt", padding=True)
        plain = model.eval().generate(**inputs, **greedy, output_scores=True, return_dict_in_generate=True)
        for extra in drafters:
            out = model.generate(**inputs, **greedy, **extra)
            difference = speculative.first_difference(plain.sequences, out, plain.scores, torch.bfloat16)
            assert difference is None or (not exact and difference.near_tie), (texts[0][:40], extra.keys(), difference)
