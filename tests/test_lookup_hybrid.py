"""The lookup-first hybrid of speculative.py: `prompt_lookup_num_tokens` next to `use_mtp=True` or a DSpark draft.
A round verifies the text's own continuation (`PromptLookup`) when every unfinished row has one, else the model
drafter's block; each source keeps its own draft schedule. Checked here:

- the lookup itself: the first earlier occurrence of the longest matching suffix, capped at the room left, padding
  never matched, nothing proposed unless every unfinished row has a continuation, one-hot q;
- greedy through generate() returns plain greedy's tokens at batch 1 and batch 4 left-padded, for both drafters,
  with lookup rounds and model rounds both taken;
- sampling keeps the model's distribution (exact enumeration of the first three tokens under top-2);
- each source's schedule: with a clock on which lookup rounds lose, the adaptive hybrid stops verifying lookups and
  keeps the model drafter; bad option values are refused.
"""

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from test_draft_schedule import with_fake_clock
from test_speculative_drafters import random_dspark

from modeling_kdsa import speculative
from modeling_kdsa.speculative import PromptLookup

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_continuation_takes_the_first_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(num_tokens=3, max_ngram=2, vocab_size=50)
    # Suffix "7 8": earlier at 1-2 (followed by 9 10) and at 5-6 (followed by 20 21): the first wins.
    ids = torch.tensor([5, 7, 8, 9, 10, 7, 8, 20, 21, 30, 7, 8])
    assert lookup.continuation(ids, room=3).tolist() == [9, 10, 7]
    assert lookup.continuation(ids, room=1).tolist() == [9]
    # The 2-gram "4 8" never occurred; the 1-gram "8" did (first at 0): the longest match that exists wins.
    ids = torch.tensor([8, 1, 2, 3, 7, 7, 8, 2, 4, 8])
    assert lookup.continuation(ids, room=3).tolist() == [1, 2, 3]
    # A 2-gram match beats an earlier 1-gram one.
    ids = torch.tensor([8, 50, 3, 8, 40, 41, 3, 8])
    assert lookup.continuation(ids, room=2).tolist() == [40, 41]
    # Near the end the continuation is what exists; no recurring token: nothing.
    assert lookup.continuation(torch.tensor([1, 2, 3, 2]), room=5).tolist() == [3, 2]
    assert lookup.continuation(torch.tensor([1, 2, 3, 4]), room=5).tolist() == []
    assert lookup.continuation(torch.tensor([4]), room=5).tolist() == []


def test_propose_needs_every_unfinished_row_and_skips_padding():
    lookup = PromptLookup(num_tokens=4, max_ngram=2, vocab_size=16)
    ids = torch.tensor([[0, 0, 5, 6, 7, 5, 6], [1, 2, 3, 4, 5, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    tokens, logits = lookup.propose(ids, mask, torch.tensor([True, True]), room=10)
    assert tokens.tolist() == [[7, 5, 6, 0], [3, 4, 5, 1]]  # row 0 has 3 tokens, padded with 0
    assert torch.equal(logits.softmax(-1).argmax(-1), tokens)
    assert torch.equal(logits.softmax(-1).amax(-1), torch.ones(2, 4))  # one-hot q
    # Row 0's padding (token 0) is not text: a row ending in 0 with zeros only in its padding has no match.
    ids[0, -1] = 0
    assert lookup.propose(ids, mask, torch.tensor([True, True]), room=10) is None
    # A finished row does not hold the others back.
    tokens, _ = lookup.propose(ids, mask, torch.tensor([False, True]), room=2)
    assert tokens.tolist() == [[0, 0], [3, 4]]


def test_a_lookup_draft_is_emitted_with_the_targets_probability():
    """The accept rule on lookup's q for a fixed draft d: the emitted token follows p whatever d is (kept with
    probability p(d), else drawn from p without d), for d likely, unlikely and outside p's support. 100k rows per d,
    within 0.01 total variation (noise ~0.004)."""
    torch.manual_seed(0)
    lookup = PromptLookup(num_tokens=1, max_ngram=1, vocab_size=5)
    p = torch.tensor([0.6, 0.25, 0.15, 0.0, 0.0])
    rows = 100_000
    for d in (0, 2, 4):
        ids = torch.tensor([[3, d, 3]])  # the last token recurs: the draft is the token after it
        tokens, q_logits = lookup.propose(ids, None, torch.ones(1, dtype=torch.bool), room=1)
        assert tokens.tolist() == [[d]]
        target = p.clamp(min=1e-30).log().expand(rows, 2, -1)
        _, next_tokens = speculative.accept(tokens.expand(rows, -1), q_logits.expand(rows, -1, -1), target, True)
        freq = torch.bincount(next_tokens[:, 0], minlength=5).float() / rows
        assert 0.5 * (freq - p).abs().sum() < 0.01, (d, freq)


def repeating_prompts(batch: int):
    """Left-padded prompts whose rows repeat a random phrase three times: prompt lookup finds continuations."""
    ids, mask = left_padded_batch([6, 4, 7, 5][:batch], seed=3)
    phrases = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    width = 3 * max(len(p) for p in phrases)
    out = torch.zeros(batch, width, dtype=torch.long)
    out_mask = torch.zeros(batch, width, dtype=torch.long)
    for b, phrase in enumerate(phrases):
        text = phrase.repeat(3)
        out[b, width - len(text) :] = text
        out_mask[b, width - len(text) :] = 1
    return out, (out_mask if batch > 1 else None)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_greedy_hybrid_equals_plain_greedy(monkeypatch, method, batch):
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")
    model = tiny_model(num_mtp_layers=1)
    ids, mask = repeating_prompts(batch)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=24, **GREEDY)
    drafter = {"use_mtp": True, "mtp_draft_tokens": 2} if method == "mtp" else {
        "assistant_model": random_dspark(model), "speculation_type": "dspark"}  # fmt: skip
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, prompt_lookup_num_tokens=4, **drafter,
                         **GREEDY)  # fmt: skip
    assert torch.equal(out, reference)
    stats = model.speculation_stats
    assert stats.method == method
    assert stats.lookup_rounds > 0  # the repeated phrase gives continuations
    assert stats.rounds - stats.plain_rounds - stats.lookup_rounds >= 0
    if batch == 1:  # on one row a model round happens whenever lookup finds nothing
        assert stats.rounds - stats.lookup_rounds - stats.plain_rounds > 0


def test_without_lookup_no_round_is_a_lookup_round(monkeypatch):
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")
    model = tiny_model(num_mtp_layers=1)
    ids, _ = repeating_prompts(1)
    model.generate(ids, max_new_tokens=12, use_mtp=True, **GREEDY)
    assert model.speculation_stats.lookup_rounds == 0


@pytest.mark.slow
@torch.no_grad()
def test_sampled_hybrid_keeps_the_models_distribution(monkeypatch):
    """generate(do_sample=True, top_k=2) with lookup drafts on a prompt that holds every token of the vocabulary, so
    that every row of the batch finds a continuation in every round: lookup proposes what followed the last token,
    mostly outside the model's top-2 (rejected, resampled from p without it), sometimes inside (kept with
    probability p). The joint distribution of the first three tokens matches the model's exact one within 0.04 total
    variation (2048 samples: noise ~0.02)."""
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")
    model = tiny_model(num_mtp_layers=1)
    generator = torch.Generator().manual_seed(9)
    prompt = torch.cat([torch.randperm(128, generator=generator), torch.randperm(128, generator=generator)[:8]])[None]
    batch, samples, lookup_rounds = 64, [], 0
    torch.manual_seed(0)
    for _ in range(32):
        ids = prompt.expand(batch, -1)  # token 0 is text here: the mask says so (generate would take it for padding)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=True, top_k=2,
                             temperature=1.0, use_mtp=True, prompt_lookup_num_tokens=3, pad_token_id=0,
                             eos_token_id=None)  # fmt: skip
        samples.append(out[:, -3:])
        lookup_rounds += model.speculation_stats.lookup_rounds
    assert lookup_rounds == 32  # every round with room for a draft: the first after the prefill
    samples = torch.cat(samples)

    def top2(ids):
        values, index = model(ids).logits[0, -1].topk(2)
        return index.tolist(), values.softmax(-1).tolist()

    exact = {}
    for a, pa in zip(*top2(prompt), strict=True):
        for b, pb in zip(*top2(torch.cat([prompt, torch.tensor([[a]])], 1)), strict=True):
            for c, pc in zip(*top2(torch.cat([prompt, torch.tensor([[a, b]])], 1)), strict=True):
                exact[(a, b, c)] = pa * pb * pc
    observed = {}
    for row in samples.tolist():
        observed[tuple(row)] = observed.get(tuple(row), 0) + 1
    assert set(observed) <= set(exact)
    tv = 0.5 * sum(abs(observed.get(key, 0) / len(samples) - value) for key, value in exact.items())
    assert tv < 0.04, (tv, exact, observed)


def test_lookup_rounds_that_lose_are_dropped_and_the_drafter_goes_on(monkeypatch):
    """A clock on which a verify forward costs 1 plus 3 per lookup draft token and the MTP draft is free: lookup
    rounds commit fewer tokens per second than plain steps on this random model, so the adaptive hybrid probes them
    less and less, while MTP rounds (whose verify counts the same) keep going under their own schedule. The tokens
    stay plain greedy's."""
    model = tiny_model(num_mtp_layers=1)
    ids, _ = repeating_prompts(1)
    reference = model.generate(ids, max_new_tokens=40, **GREEDY)
    clock = with_fake_clock(monkeypatch, model, propose_cost=0.0)
    original = PromptLookup.propose

    def costly_propose(self, *args, **kwargs):
        proposal = original(self, *args, **kwargs)
        if proposal is not None:
            clock.now += 3.0 * proposal[0].shape[1]
        return proposal

    monkeypatch.setattr(PromptLookup, "propose", costly_propose)
    stats = {}
    for schedule in ("always", "adaptive"):
        out = model.generate(ids, max_new_tokens=40, use_mtp=True, prompt_lookup_num_tokens=4,
                             draft_schedule=schedule, **GREEDY)  # fmt: skip
        assert torch.equal(out, reference), schedule
        stats[schedule] = model.speculation_stats
    assert stats["adaptive"].lookup_rounds < stats["always"].lookup_rounds / 2
    mtp_rounds = stats["adaptive"].rounds - stats["adaptive"].lookup_rounds - stats["adaptive"].plain_rounds
    assert mtp_rounds > 0.5 * stats["adaptive"].rounds


def test_bad_lookup_options_are_refused():
    model = tiny_model(num_mtp_layers=1)
    ids, _ = repeating_prompts(1)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be >= 1"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, prompt_lookup_num_tokens=0, **GREEDY)
    with pytest.raises(ValueError, match="max_matching_ngram_size must be >= 1"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, prompt_lookup_num_tokens=3, max_matching_ngram_size=-1,
                       **GREEDY)  # fmt: skip
