"""The block-drafting loop of speculative.py (the one `generate(use_mtp=True)` and `speculation_type="dspark"` run),
tested with a scripted drafter so that every accept/reject pattern is chosen by the test:

- greedy returns plain greedy's tokens at batch 1 and batch 4 left-padded, with drafts that are right, wrong at
  chosen slots, or cut short, and the cache holds exactly the committed tokens after each round;
- the accept rule keeps the target's distribution: exactly, by enumeration, on a small vocabulary, and end to end
  through generate() (sampled, batched) against the model's exact joint probabilities, with a stated tolerance;
- what the loop refuses.
"""

import itertools

import pytest
import torch
from conftest import left_padded_batch, tiny_model

from modeling_kdsa import speculative
from modeling_kdsa.cache import KDSACache
from modeling_kdsa.speculative import accept

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def every_round_drafts(monkeypatch):
    """These tests check the drafting mechanics round by round: every round drafts (test_draft_schedule.py tests
    the adaptive schedule)."""
    monkeypatch.setattr(speculative, "DEFAULT_DRAFT_SCHEDULE", "always")


class ScriptedDrafter:
    """Drafts `script(length, k)` at slot k of a round that starts with `length` committed tokens (prompt + emitted),
    by handing the loop's sampler logits that favour that token by `margin` (a large margin makes it the draw).
    Records what the loop tells it, so the test can check the committed counts."""

    method = "scripted"

    def __init__(self, script, num_draft_tokens, vocab_size, margin=50.0, base_logits=None):
        self.script, self.num_draft_tokens, self.vocab_size = script, num_draft_tokens, vocab_size
        self.margin, self.base_logits = margin, base_logits
        self.committed = 0
        self.observed: list[int] = []

    def observe(self, hidden_states, next_ids, attention_mask, position_ids):
        assert all(h.shape[1] == next_ids.shape[1] for h in hidden_states)
        assert position_ids.shape == next_ids.shape
        self.committed += next_ids.shape[1]
        if attention_mask is not None:
            assert attention_mask.shape[1] == self.committed
        self.observed.append(next_ids.shape[1])

    def propose(self, num_tokens, anchor, anchor_position, attention_mask, sample):
        batch = anchor.shape[0]
        tokens, logits = [], []
        for k in range(num_tokens):
            wanted = self.script(self.committed + 1, k)
            if wanted is None:
                break
            row = torch.zeros(batch, self.vocab_size)
            if self.base_logits is not None:
                row = self.base_logits.expand(batch, -1).clone()
            row[torch.arange(batch), wanted] += self.margin
            token, processed = sample(row, k)
            tokens.append(token)
            logits.append(processed)
        if not tokens:
            return anchor.new_zeros(batch, 0), None
        return torch.stack(tokens, 1), torch.stack(logits, 1)


def use_drafter(monkeypatch, drafter):
    monkeypatch.setattr(speculative, "_drafter", lambda *args, **kwargs: drafter)


def left_padded(batch, seed=0):
    return left_padded_batch([9, 17, 5, 12][:batch], seed=seed)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("pattern", ["right", "wrong_at_2", "alternating", "short_blocks"])
def test_greedy_equals_plain_greedy(monkeypatch, batch, pattern):
    """Drafts that follow plain greedy's continuation except where the pattern breaks them: the output is plain
    greedy's token for token, rows of different lengths included (batch 4, left-padded)."""
    model = tiny_model()
    ids, mask = left_padded(batch)
    if batch == 1:
        mask = None
    steps = 24
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=steps, **GREEDY)
    prompt = ids.shape[1]

    def script(length, k):
        position = length + k  # the index in `reference` this slot drafts
        if position >= reference.shape[1]:
            return reference[:, -1]
        right = reference[:, position]
        if pattern == "wrong_at_2" and k == 2:
            return (right + 1) % 128
        if pattern == "alternating" and (length + k) % 2:
            return (right + 1) % 128
        if pattern == "short_blocks" and k >= (length % 3):
            return None
        return right

    drafter = ScriptedDrafter(script, num_draft_tokens=5, vocab_size=128)
    use_drafter(monkeypatch, drafter)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, use_mtp=True, **GREEDY)
    assert torch.equal(out, reference)
    stats = model.speculation_stats
    assert stats.emitted == steps
    # The drafter saw the prompt, then each round's committed tokens (the last round's only if generation goes on).
    assert drafter.observed[0] == prompt
    assert drafter.observed[1:] == [a + 1 for a in stats.accepted_per_round][: len(drafter.observed) - 1]
    if pattern == "right":
        assert stats.acceptance_rate == 1.0 and stats.rounds < steps // 3


def test_cache_holds_the_committed_tokens_after_every_round(monkeypatch):
    """After each round the target cache holds every committed token but the anchor: a further plain forward over
    the anchor from that cache gives the logits plain decoding gives."""
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(3))
    reference = model.generate(ids, max_new_tokens=12, **GREEDY)
    drafter = ScriptedDrafter(lambda length, k: (reference[:, length + k] + (k == 1)) % 128, 4, 128)
    use_drafter(monkeypatch, drafter)
    out = model.generate(ids, max_new_tokens=12, use_mtp=True, return_dict_in_generate=True, **GREEDY)
    cache = out.cache
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    step = model(out.sequences[:, -1:], cache=cache).logits[:, -1]
    fresh = model(out.sequences).logits[:, -1]
    torch.testing.assert_close(step, fresh, atol=1e-5, rtol=1e-5)


def test_eos_and_stop_mid_block(monkeypatch):
    """A row that meets EOS inside an accepted block stops there and is padded after it, as in plain decoding."""
    model = tiny_model()
    ids, mask = left_padded(4, seed=5)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    # Pick an EOS that plain greedy emits in row 1 mid-way.
    eos = int(plain[1, ids.shape[1] + 6])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)  # fmt: skip
    drafter = ScriptedDrafter(lambda length, k: plain[:, min(length + k, plain.shape[1] - 1)], 6, 128)
    use_drafter(monkeypatch, drafter)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                         eos_token_id=eos, use_mtp=True)  # fmt: skip
    assert torch.equal(out, reference)


def exact_emission_distribution(p, q, draft_order):
    """Probability of each emitted first token under the accept rule, by enumeration over the draft: the draft d is
    drawn from q, kept with min(1, p/q), else the token comes from norm(max(0, p − q))."""
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum() if residual.sum() > 0 else p
    out = torch.zeros_like(p)
    for d in draft_order:
        keep = min(1.0, float(p[d] / q[d])) if q[d] > 0 else 0.0
        out[d] += q[d] * keep
        out += q[d] * (1 - keep) * residual
    return out


def test_accept_rule_is_exact_on_a_small_vocabulary():
    """Enumeration: the first emitted token of the rule is distributed as p, for q far from p and q with support
    outside p's (top-k-cut targets)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(6, generator=generator) * 2, -1)
        q = torch.softmax(torch.randn(6, generator=generator) * 2, -1)
        p[torch.rand(6, generator=generator) < 0.3] = 0
        p = p / p.sum()
        torch.testing.assert_close(exact_emission_distribution(p, q, range(6)), p, atol=1e-6, rtol=0)


def test_accept_rule_samples_the_target_distribution():
    """`accept` itself, sampled: 200k rows with a 2-token draft from q. The first emitted token and the pair of the
    first two follow p (the target's two-step distribution) within 0.01 total variation (sampling noise at this size
    is ~0.003); q differs from p everywhere."""
    torch.manual_seed(0)
    vocab, rows = 4, 200_000
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p2 = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25] * 4, [0.0, 0.0, 0.5, 0.5]])
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q2 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    d1 = torch.multinomial(q1, rows, replacement=True)
    d2 = torch.multinomial(q2, rows, replacement=True)
    drafts = torch.stack([d1, d2], 1)
    q = torch.stack([q1.expand(rows, -1), q2.expand(rows, -1)], 1).log()
    # p at slot 1 depends on the first draft (the target saw it), slot 2 on the second: the bonus distribution.
    p = torch.stack([p1.expand(rows, -1), p2[d1], torch.full((rows, vocab), 0.25)], 1).clamp(min=1e-30).log()
    accepted, next_tokens = accept(drafts, q, p, do_sample=True)
    first = next_tokens[:, 0]
    second = torch.where(accepted >= 1, next_tokens[:, 1], -1)  # the second token exists only if d1 was kept
    first_freq = torch.bincount(first, minlength=vocab).float() / rows
    assert 0.5 * (first_freq - p1).abs().sum() < 0.01
    # Pairs where the first token was the kept draft d1: the second emitted token must follow p2[d1].
    for t in range(vocab):
        rows_t = (first == t) & (accepted >= 1)
        if rows_t.sum() < 5000:
            continue
        freq = torch.bincount(second[rows_t], minlength=vocab).float() / rows_t.sum()
        assert 0.5 * (freq - p2[t]).abs().sum() < 0.02, t


def test_greedy_accept_keeps_matches_then_takes_the_argmax():
    target = torch.zeros(2, 4, 10)
    best = torch.tensor([[3, 4, 5, 6], [7, 7, 7, 7]])
    target.scatter_(-1, best[..., None], 1.0)
    drafts = torch.tensor([[3, 4, 9], [1, 7, 7]])
    accepted, next_tokens = accept(drafts, None, target, do_sample=False)
    assert accepted.tolist() == [2, 0]
    assert torch.equal(next_tokens, best)


@pytest.mark.slow
@torch.no_grad()
def test_sampled_generate_keeps_the_models_distribution(monkeypatch):
    """generate(do_sample=True, top_k=2) with a drafter whose q disagrees with the model: the joint distribution of
    the first three tokens (8 outcomes under top-2) matches the model's exact one within 0.04 total variation
    (2048 samples: noise ~0.02). The drafter's top-2 is not the model's, so drafts outside the target's support are
    rejected and resampled."""
    model = tiny_model()
    prompt = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(9))
    base = torch.randn(128, generator=torch.Generator().manual_seed(1)) * 3
    drafter = ScriptedDrafter(lambda length, k: torch.tensor([5]), 2, 128, margin=0.0, base_logits=base)
    use_drafter(monkeypatch, drafter)
    batch, samples = 64, []
    torch.manual_seed(0)
    for _ in range(32):
        drafter.committed = 0
        ids = prompt.expand(batch, -1)
        out = model.generate(ids, max_new_tokens=3, do_sample=True, top_k=2, temperature=1.0, pad_token_id=0,
                             eos_token_id=None, use_mtp=True)  # fmt: skip
        samples.append(out[:, -3:])
    samples = torch.cat(samples)

    def top2(logits):
        values, index = logits.topk(2)
        return index, values.softmax(-1)

    exact = {}
    first_index, first_p = top2(model(prompt).logits[0, -1])
    for i, a in enumerate(first_index.tolist()):
        second_index, second_p = top2(model(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1])
        for j, b in enumerate(second_index.tolist()):
            third_index, third_p = top2(model(torch.cat([prompt, torch.tensor([[a, b]])], 1)).logits[0, -1])
            for k, c in enumerate(third_index.tolist()):
                exact[(a, b, c)] = float(first_p[i] * second_p[j] * third_p[k])
    observed = {}
    for row in samples.tolist():
        observed[tuple(row)] = observed.get(tuple(row), 0) + 1
    assert set(observed) <= set(exact)
    tv = 0.5 * sum(abs(observed.get(key, 0) / len(samples) - value) for key, value in exact.items())
    assert tv < 0.04, (tv, exact, observed)


def test_refusals():
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 5))
    with pytest.raises(ValueError, match="num_mtp_layers=0"):
        model.generate(ids, max_new_tokens=3, use_mtp=True, **GREEDY)
    with pytest.raises(ValueError, match="needs assistant_model"):
        model.generate(ids, max_new_tokens=3, speculation_type="dspark", **GREEDY)
    for extra in ({"assistant_model": model}, {}):
        with pytest.raises(ValueError, match="speculation_type='dflash' is not supported"):
            model.generate(ids, max_new_tokens=3, speculation_type="dflash", **extra, **GREEDY)
    with pytest.raises(ValueError, match="can roll back"):
        model.generate(ids, max_new_tokens=3, use_mtp=True, cache=KDSACache(model.config), **GREEDY)


def test_every_pattern_of_three_drafts_commits_the_right_count(monkeypatch):
    """All 8 right/wrong patterns of a 3-token draft: the round commits the first run of right drafts plus one."""
    model = tiny_model()
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    reference = model.generate(ids, max_new_tokens=5, **GREEDY)
    for pattern in itertools.product([True, False], repeat=3):
        rounds = []

        def script(length, k, pattern=pattern, rounds=rounds):
            if length + k >= reference.shape[1]:
                return reference[:, -1]
            right = reference[:, length + k]
            return right if pattern[k] else (right + 1) % 128

        drafter = ScriptedDrafter(script, 3, 128)
        use_drafter(monkeypatch, drafter)
        out = model.generate(ids, max_new_tokens=5, use_mtp=True, **GREEDY)
        assert torch.equal(out, reference)
        first_run = next((k for k, right in enumerate(pattern) if not right), 3)
        assert model.speculation_stats.accepted_per_round[0] == first_run


def test_prefix_dependent_processors_see_each_slots_prefix(monkeypatch):
    """repetition_penalty and no_repeat_ngram_size depend on the prefix: each verified slot is processed with the
    committed ids plus the drafts before it, so greedy still returns plain greedy's tokens."""
    model = tiny_model()
    ids, mask = left_padded(2, seed=7)
    processors = dict(repetition_penalty=1.8, no_repeat_ngram_size=2)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=20, **processors, **GREEDY)
    drafter = ScriptedDrafter(lambda length, k: reference[:, min(length + k, reference.shape[1] - 1)], 5, 128)
    use_drafter(monkeypatch, drafter)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, use_mtp=True, **processors, **GREEDY)
    assert torch.equal(out, reference)
    assert model.speculation_stats.tokens_per_round > 3


def test_scores_logits_and_streamer_follow_plain_decoding(monkeypatch):
    """return_dict_in_generate with output_scores / output_logits gives one entry per new token, equal to plain
    decoding's (within fp32 rounding: verification rows against one-token steps), and a streamer sees the prompt
    then every new column."""
    model = tiny_model()
    ids, mask = left_padded(2, seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.3, **GREEDY)  # fmt: skip
    plain = model.generate(ids, **kwargs)
    use_drafter(monkeypatch, ScriptedDrafter(lambda length, k: plain.sequences[:, min(length + k, 20)], 4, 128))

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value)

        def end(self):
            self.ended = True

    streamer = Collect()
    out = model.generate(ids, use_mtp=True, streamer=streamer, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    for ours, theirs in ((out.scores, plain.scores), (out.logits, plain.logits)):
        assert len(ours) == len(theirs) == 12
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert streamer.ended and torch.equal(streamer.chunks[0], ids)
    assert torch.equal(torch.stack(streamer.chunks[1:], 1), out.sequences[:, ids.shape[1] :])
