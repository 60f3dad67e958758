"""The draft schedule of speculative.py: "adaptive" (the default) drafts while drafting rounds commit more tokens per
second than plain rounds and probes back with a doubling interval; "always" drafts every round. Checked here:

- the rule itself on chosen costs and acceptances (the exact sequence of choices);
- the option reaches the schedule through generate(), and bad values are refused before decoding;
- with a clock that makes drafting expensive, adaptive decoding turns to plain rounds and still returns plain greedy's
  tokens;
- the drafters read the context lazily (positions committed by plain rounds are fed in one call before the next
  draft): every draft equals that of a fresh drafter fed the whole committed prefix at once.
"""

import itertools

import pytest
import torch
from conftest import left_padded_batch, tiny_model
from test_speculative_drafters import random_dspark
from transformers import LogitsProcessorList

from modeling_kdsa import speculative
from modeling_kdsa.speculative import DraftSchedule, DSparkDrafter, MTPDrafter, Sampler

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

pytestmark = pytest.mark.usefixtures("one_thread")


def choices(schedule: DraftSchedule, rounds: int, draft_tokens, draft_seconds: float, plain_seconds: float):
    """Run `rounds` rounds on fixed costs; `draft_tokens(i)` is the tokens the i-th drafting round commits."""
    made, drafting_rounds = [], 0
    for _ in range(rounds):
        drafting = schedule.should_draft()
        made.append("D" if drafting else "p")
        if drafting:
            schedule.record(True, draft_tokens(drafting_rounds), draft_seconds)
            drafting_rounds += 1
        else:
            schedule.record(False, 1, plain_seconds)
    return "".join(made)


def test_always_drafts_every_round():
    assert choices(DraftSchedule("always"), 12, lambda i: 1, draft_seconds=9.0, plain_seconds=1.0) == "D" * 12


def test_adaptive_measures_both_sides_then_keeps_drafting_while_it_pays():
    # 2 tokens in 1.5 s beats 1 token in 1 s: after the plain round that measures it, every round drafts.
    assert choices(DraftSchedule(), 10, lambda i: 2, draft_seconds=1.5, plain_seconds=1.0) == "Dp" + "D" * 8


def test_adaptive_probes_with_a_doubling_interval_while_drafting_does_not_pay():
    # 1.4 tokens in 1.5 s loses to 1 token in 1 s: a probe after 1, 2, 4, then every 8 plain rounds (the cap here).
    schedule = DraftSchedule(max_probe_interval=8)
    made = choices(schedule, 40, lambda i: 1.4, draft_seconds=1.5, plain_seconds=1.0)
    assert made == ("Dp" + "Dpp" + "Dpppp" + "Dpppppppp" * 4)[:40]
    assert schedule.probe_interval == 8


def test_a_probe_that_pays_resumes_drafting():
    # Unpredictable text (1 token per drafting round), then predictable (4): the first probe on the predictable part
    # pulls the averages over the line and drafting resumes every round.
    tokens = lambda i: 1 if i < 4 else 4  # noqa: E731
    made = choices(DraftSchedule(), 30, tokens, draft_seconds=1.5, plain_seconds=1.0)
    assert made == "Dp" + "Dpp" + "Dpppp" + "Dpppppppp" + "D" * 11


def test_an_unknown_schedule_is_refused_before_decoding():
    with pytest.raises(ValueError, match=r"draft_schedule must be one of \('adaptive', 'always'\), got 'sometimes'"):
        DraftSchedule("sometimes")
    model = tiny_model(num_mtp_layers=1)
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="draft_schedule must be one of"):
        model.generate(ids, max_new_tokens=4, use_mtp=True, draft_schedule="sometimes", **GREEDY)
    assert calls == []  # refused before the prefill
    with pytest.raises(ValueError, match="draft_schedule applies to use_mtp=True and speculation_type='dspark'"):
        model.generate(ids, max_new_tokens=4, draft_schedule="always", **GREEDY)


class FakeClock:
    """`time.perf_counter` for the loop: a target forward costs 1 per call, a drafter's `propose` `propose_cost`."""

    def __init__(self, propose_cost: float):
        self.now, self.propose_cost = 0.0, propose_cost

    def perf_counter(self) -> float:
        return self.now


def with_fake_clock(monkeypatch, model, propose_cost: float) -> FakeClock:
    clock = FakeClock(propose_cost)
    monkeypatch.setattr(speculative, "time", clock)
    model.register_forward_pre_hook(lambda *args: setattr(clock, "now", clock.now + 1.0))
    original = MTPDrafter.propose

    def propose(self, *args, **kwargs):
        clock.now += clock.propose_cost
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MTPDrafter, "propose", propose)
    return clock


@pytest.mark.parametrize("batch", [1, 3])
def test_expensive_drafts_turn_to_plain_rounds_with_plain_tokens(monkeypatch, batch):
    """Drafting that costs 5 target forwards a round cannot pay on the tiny model: adaptive decoding runs mostly
    plain rounds, "always" none, and both return plain greedy's tokens."""
    model = tiny_model(num_mtp_layers=1)
    ids, mask = left_padded_batch([11, 7, 14][:batch], seed=4)
    mask = mask if batch > 1 else None
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=40, **GREEDY)
    with_fake_clock(monkeypatch, model, propose_cost=5.0)
    rounds = {}
    for schedule in ("adaptive", "always"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=40, use_mtp=True, mtp_draft_tokens=2,
                             draft_schedule=schedule, **GREEDY)  # fmt: skip
        assert torch.equal(out, reference), schedule
        rounds[schedule] = model.speculation_stats
    assert rounds["always"].plain_rounds <= 1  # only a last round with no room before max_length
    adaptive = rounds["adaptive"]
    assert adaptive.plain_rounds > 0.6 * adaptive.rounds
    drafting_rounds = adaptive.rounds - adaptive.plain_rounds
    assert 2 * drafting_rounds - 1 <= adaptive.drafted <= 2 * drafting_rounds


def test_cheap_drafts_keep_drafting(monkeypatch):
    """Drafts that cost nothing pay as soon as one is accepted: after the measuring rounds, the adaptive schedule
    drafts (almost) every round, as "always" does."""
    model = tiny_model(num_mtp_layers=1)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    with_fake_clock(monkeypatch, model, propose_cost=0.0)
    reference = model.generate(ids, max_new_tokens=30, **GREEDY)
    out = model.generate(ids, max_new_tokens=30, use_mtp=True, draft_schedule="adaptive", **GREEDY)
    assert torch.equal(out, reference)
    # A verify over two tokens costs one forward, as a plain step does: a drafting round never loses. Plain rounds:
    # the one that measures plain steps, and a last one if no room for a draft is left before max_length.
    assert model.speculation_stats.plain_rounds <= 2
    assert model.speculation_stats.rounds >= 10


def fixed_pattern(monkeypatch, pattern: str):
    """Make the schedule follow `pattern` ("D" drafts, "p" plain), cycling."""
    steps = itertools.cycle(pattern)
    monkeypatch.setattr(DraftSchedule, "should_draft", lambda self: next(steps) == "D")


def recorded_proposals(monkeypatch, drafter_class):
    """Wrap `drafter_class.propose` to record (anchor position, draft tokens, draft logits) per drafting round."""
    records = []
    original = drafter_class.propose

    def propose(self, num_tokens, anchor, anchor_position, attention_mask, sample):
        tokens, logits = original(self, num_tokens, anchor, anchor_position, attention_mask, sample)
        records.append((int(anchor_position[0]), num_tokens, tokens.clone(), None if logits is None else logits))
        return tokens, logits

    monkeypatch.setattr(drafter_class, "propose", propose)
    return records


@pytest.mark.parametrize("method", ["mtp", "dspark"])
@torch.no_grad()
def test_lazy_context_drafts_equal_a_fresh_drafter_fed_the_whole_prefix(monkeypatch, method):
    """Rounds drafted after plain stretches of different lengths: the drafts, and the draft logits they were
    sampled from, equal those of a fresh drafter that observes the whole committed prefix in one call (the target's
    hidden states from one uncached forward)."""
    model = tiny_model(num_mtp_layers=1)
    draft = random_dspark(model)
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(6))
    extra = (dict(use_mtp=True, mtp_draft_tokens=2) if method == "mtp" else
             dict(assistant_model=draft, speculation_type="dspark", dspark_confidence_threshold=0.0))  # fmt: skip
    drafter_class = MTPDrafter if method == "mtp" else DSparkDrafter
    fixed_pattern(monkeypatch, "DpDppDpppD")
    records = recorded_proposals(monkeypatch, drafter_class)
    out = model.generate(ids, max_new_tokens=26, **extra, **GREEDY)
    assert torch.equal(out, model.generate(ids, max_new_tokens=26, **GREEDY))
    assert len(records) >= 6
    monkeypatch.undo()  # the original propose for the fresh drafters
    for anchor_position, num_tokens, tokens, logits in records:
        committed = out[:, : anchor_position + 1]
        hidden = model(committed[:, :-1], output_hidden_states=True).hidden_states
        fresh = MTPDrafter(model, 2) if method == "mtp" else DSparkDrafter(model, draft, 1, 0.0)
        positions = torch.arange(anchor_position)[None]
        fresh.observe(hidden, committed[:, 1:], None, positions)
        sample = Sampler(LogitsProcessorList(), do_sample=False).drafting(committed)
        expected_tokens, expected_logits = fresh.propose(
            num_tokens, committed[:, -1], torch.tensor([anchor_position]), None, sample
        )
        assert torch.equal(tokens, expected_tokens), anchor_position
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
