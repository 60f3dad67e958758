"""Block speculative decoding for KDSA targets: a drafter proposes up to n tokens, one target forward verifies them,
the accepted prefix is committed and the cache is cropped (KDA states replayed, DSA pages truncated; cache.py).

Drafters:
- `MTPDrafter`: the checkpoint's own multi-token-prediction layers (`generate(use_mtp=True)`; DeepSeek-V3 technical
  report §2.2, arXiv 2412.19437; mtp.py). The layer is chained for several drafts (vLLM does the same): each further
  draft feeds the layer its own previous output in place of the target's hidden state.
- `DSparkDrafter`: a DSpark draft model (`generate(assistant_model=draft, speculation_type="dspark")`; DSpark paper,
  arXiv 2607.05147 §3; dspark.py): one backbone forward per round drafts a whole block, then the Markov head samples
  it left to right and the confidence head prunes it.

One round, for a batch of B left-padded rows (docs/speculative.md):
1. The committed tokens are in the target cache except the last one, the anchor (sampled, not yet fed).
2. The drafter proposes d_1..d_n (and the processed draft logits q, from which it sampled them).
3. One target forward over [anchor, d_1..d_n] gives p_0..p_n, each processed by the logits processors with its own
   prefix, exactly as plain decoding would process it.
4. Accept rule (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1): d_k is kept with probability
   min(1, p(d_k) / q(d_k)), left to right; at the first rejection the next token is drawn from norm(max(0, p − q));
   if all are kept, a bonus token is drawn from p_n. Greedy is the one-hot case: keep while d_k = argmax p_{k−1},
   then take argmax p. Each emitted token is a sample of the target's own distribution, so greedy output is plain
   greedy's and sampling keeps the target's distribution. That holds for the distributions the forwards compute:
   greedy output is plain greedy's bit for bit where the verify forward gives each position its one-token step's
   logits (the `cpu` backend in bf16, up to 16 positions; docs/speculative.md §2). Where it rounds differently, plain
   greedy's top two scores may be within rounding of each other (a near-tie, common in bf16) and the verify pick the
   other one; the outputs part from there. `first_difference` finds where two outputs part and whether it is such a
   near-tie.
5. Batch: every row commits the same count a + 1, a = the fewest drafts any unfinished row accepted. A row that
   accepted more emits its accepted draft at slot a (itself a valid target sample), so nothing is lost but drafts.
6. The target cache is cropped to the committed length; the drafter takes the target's hidden states at the
   committed positions (no extra target pass). It reads them lazily: all the positions committed since its last
   round are fed in one call right before it drafts again.

Whether a round drafts at all is `DraftSchedule`'s choice: "adaptive" (the default) drafts only while drafting
rounds commit more tokens per second than plain steps, measured as decoding goes; "always" drafts every round.

With `prompt_lookup_num_tokens` the loop is a hybrid (`PromptLookup`): a round first looks for the text's own
continuation (the first earlier occurrence of its last n-gram, as prompt lookup does) and verifies that when every
row has one; otherwise the model drafter drafts. Each source has its own schedule, so lookup is dropped where it does
not pay (e.g. recall of unseen values) and the model drafter where it does not. SuffixDecoding's hybrid with a
trained speculator chooses per round between the two in the same way (Oliaro et al., arXiv 2411.04975; Snowflake
ArcticInference, docs/suffix-decoding.rst, "Combining with Arctic Speculator").
On a model cut by tensor parallelism the ranks of its group run every forward together, so they must make the same
choice: each round's seconds are the slowest rank's (one all-reduce per round), docs/parallel.md §12.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import ROLLBACK_TOKENS, KDSACache


@dataclass
class SpeculationStats:
    """What the last speculative `generate()` did: `rounds` target verify forwards (the prefill not counted),
    `drafted` draft tokens verified, `accepted` draft tokens committed, `emitted` tokens appended per row,
    `plain_rounds` of the rounds decoded one token without drafting (the adaptive schedule's choice, or no room
    left before `max_length`), `lookup_rounds` of the rounds that verified prompt lookup's draft instead of the
    model drafter's (the hybrid of `prompt_lookup_num_tokens`)."""

    method: str
    rounds: int = 0
    plain_rounds: int = 0
    lookup_rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def tokens_per_round(self) -> float:
        """τ: mean tokens committed per target verify forward (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / max(self.rounds, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def position_ids_from_mask(attention_mask: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """transformers' generation positions: the cumulative count of real tokens − 1 (padding: 0)."""
    if attention_mask is None:
        return torch.arange(length, device=device)[None]
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


class Sampler:
    """Processes and samples the logits of one position the way plain `generate()` would: the logits processors see
    the committed ids plus every token drafted before this slot; greedy takes the argmax, sampling draws from the
    softmax (the global RNG, as transformers does)."""

    def __init__(self, logits_processor, do_sample: bool):
        self.logits_processor = logits_processor
        self.do_sample = do_sample

    def process(self, prefix_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(prefix_ids, logits.float())

    def draw(self, processed: torch.Tensor) -> torch.Tensor:
        if self.do_sample:
            return torch.multinomial(processed.softmax(-1), num_samples=1).squeeze(1)
        return processed.argmax(-1)

    def drafting(self, committed_ids: torch.Tensor):
        """A callback `sample(logits [B, V], k) -> (tokens [B], processed [B, V])` for a drafter, slot k = 0, 1, ...
        (it remembers the tokens it drew, which form the prefix of the next slot)."""
        drawn: list[torch.Tensor] = []

        def sample(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            if k != len(drawn):
                raise ValueError(f"draft slots must be sampled in order: slot {k} after {len(drawn)} slots")
            prefix = torch.cat([committed_ids, *[t[:, None] for t in drawn]], dim=1)
            processed = self.process(prefix, logits)
            tokens = self.draw(processed)
            drawn.append(tokens)
            return tokens, processed

        return sample


def accept(
    draft_tokens: torch.Tensor, draft_logits: torch.Tensor | None, target_logits: torch.Tensor, do_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accept rule per row. `draft_tokens [B, n]`, `draft_logits [B, n, V]` (processed q; unused when greedy),
    `target_logits [B, n + 1, V]` (processed p). Returns `(accepted [B], next_tokens [B, n + 1])`: how many drafts
    each row keeps, and for every slot j the token that row emits at slot j if it keeps exactly j drafts (the
    corrected or bonus token); at a slot j < accepted the row emits its draft d_{j+1}, which `next_tokens` holds too."""
    batch, n = draft_tokens.shape
    if not do_sample:
        target_tokens = target_logits.argmax(-1)
        keep = draft_tokens == target_tokens[:, :n]
        return keep.long().cumprod(1).sum(1), target_tokens
    p = target_logits.softmax(-1)
    next_tokens = torch.empty(batch, n + 1, dtype=torch.long, device=draft_tokens.device)
    if n:
        q = draft_logits.softmax(-1)
        p_d = p[:, :n].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_d = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
        keep = torch.rand_like(p_d) * q_d < p_d  # u < p/q without dividing (q(d) > 0: d was drawn from q)
        accepted = keep.long().cumprod(1).sum(1)
        residual = (p[:, :n] - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q leaves no residual mass; the rejection then has probability 0, any valid distribution will do.
        residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p[:, :n])
    else:
        accepted = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    # Only each row's slot `accepted` needs a fresh draw; the slots before it emit the drafts.
    rows = torch.arange(batch, device=draft_tokens.device)
    next_tokens[:, :n] = draft_tokens
    bonus = accepted == n
    choice = p[rows, accepted]
    if n:
        choice = torch.where(bonus[:, None], choice, residual[rows, accepted.clamp(max=n - 1)])
    next_tokens[rows, accepted] = torch.multinomial(choice, num_samples=1).squeeze(1)
    return accepted, next_tokens


# A difference between two greedy outputs counts as a near-tie where plain greedy's score for its own token exceeds
# its score for the other output's token by at most this many spacings of the model's dtype at that score: a verify
# forward that rounds differently from one-token steps (other kernels or summation orders) changes logits in their
# last bits, a spacing or two of bf16.
NEAR_TIE_ULPS = 4


@dataclass
class TokenDifference:
    """Where a greedy output first differs from plain greedy's: new token `position` of batch row `row`, where plain
    greedy chose `plain_token` and the other output `token`; `gap` is plain greedy's processed score for its own token
    minus its score for `token` (>= 0), `ulp` the spacing of the model's dtype at plain greedy's score."""

    row: int
    position: int
    plain_token: int
    token: int
    gap: float
    ulp: float

    @property
    def near_tie(self) -> bool:
        """Plain greedy's own scores ranked the two tokens within rounding of each other (`NEAR_TIE_ULPS`)."""
        return self.gap <= NEAR_TIE_ULPS * self.ulp


def first_difference(
    plain_sequences: torch.Tensor, sequences: torch.Tensor, plain_scores: tuple[torch.Tensor, ...], dtype: torch.dtype
) -> TokenDifference | None:
    """The earliest new token at which `sequences` differ from plain greedy's `plain_sequences` (both `[B, prompt +
    new]`, the same shape: pass `min_new_tokens`), with plain greedy's processed `plain_scores` (`generate(...,
    output_scores=True)`: one `[B, V]` per new token) and the model's `dtype`; None where they are equal."""
    if plain_sequences.shape != sequences.shape:
        raise ValueError(
            f"first_difference compares outputs of one shape (pass min_new_tokens = max_new_tokens); got "
            f"{tuple(plain_sequences.shape)} and {tuple(sequences.shape)}"
        )
    new = len(plain_scores)
    differs = plain_sequences[:, -new:] != sequences[:, -new:]
    if not differs.any():
        return None
    position = int(differs.any(0).nonzero()[0])
    row = int(differs[:, position].nonzero()[0])
    plain_token, token = int(plain_sequences[row, -new + position]), int(sequences[row, -new + position])
    scores = plain_scores[position][row].float()
    top = scores[plain_token].abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(top))
    return TokenDifference(row, position, plain_token, token, float(scores[plain_token] - scores[token]), float(ulp))


class MTPDrafter:
    """Drafts with the target's MTP layer (mtp.py). Its cache holds one entry per committed pair (h_i, x_{i+1}):
    the target's final normed hidden state at position i with the token after it, at position i. A round's chained
    drafts add entries that `observe` crops again before it feeds the newly committed pairs."""

    method = "mtp"

    def __init__(self, model, num_draft_tokens: int):
        if model.mtp is None:
            raise ValueError(
                "use_mtp=True needs MTP layers: this model's config has num_mtp_layers=0 (load a checkpoint that "
                "ships them, e.g. checkpoints/kdsa-tiny, a DeepSeek-V3.2 or GLM-5.3-Flash folder)"
            )
        if num_draft_tokens < 1:
            raise ValueError(f"mtp_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.mtp = model.mtp
        self.num_draft_tokens = num_draft_tokens
        self.cache = self.mtp.new_cache(rollback_tokens=ROLLBACK_TOKENS)
        self.pairs = 0  # committed pairs in the cache
        # The block output [B, 1, D] at the last committed pair and that pair's position [B, 1]: the first draft.
        self.last_output: torch.Tensor | None = None
        self.last_position: torch.Tensor | None = None

    def observe(self, hidden_states, next_ids, attention_mask, position_ids) -> None:
        """`hidden_states`: the target's tuple over T newly committed positions; `next_ids [B, T]`: the token after
        each; `attention_mask [B, pairs + T]` (or None); `position_ids [B, T]`."""
        if self.cache.get_seq_length() > self.pairs:
            self.cache.crop(self.pairs)
        out = self.mtp(0, hidden_states[-1], next_ids, attention_mask, position_ids, self.cache)
        self.pairs += next_ids.shape[1]
        self.last_output = out[:, -1:]
        self.last_position = position_ids[:, -1:]

    def propose(self, num_tokens: int, anchor, anchor_position, attention_mask, sample):
        tokens, logits = [], []
        out, position = self.last_output, self.last_position
        mask = None if attention_mask is None else attention_mask[:, :-1]  # the committed pairs' columns
        for k in range(num_tokens):
            if k:  # chain: the layer's own output stands in for the target's hidden state at the next position
                position = position + 1
                mask = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                out = self.mtp(0, out, tokens[-1][:, None], mask, position, self.cache)
            token, processed = sample(self.mtp.logits(0, out)[:, -1], k)
            tokens.append(token)
            logits.append(processed)
        return _stack(tokens, logits, anchor)


class DSparkDrafter:
    """Drafts with a `DSparkDraftModel` (dspark.py): its cache holds context rows (fc + hidden_norm of the target's
    hidden states at its layers) for the committed positions only; a block's own K/V are never kept."""

    method = "dspark"

    def __init__(self, model, draft, batch_size: int, confidence_threshold: float):
        draft.bind_target(model)
        self.draft = draft
        self.cache = draft.new_cache(batch_size)
        self.confidence_threshold = confidence_threshold
        self.num_draft_tokens = draft.config.block_size

    def observe(self, hidden_states, next_ids, attention_mask, position_ids) -> None:
        new_mask = None if attention_mask is None else attention_mask[:, -next_ids.shape[1] :]
        self.draft.extend_context(self.cache, hidden_states, new_mask, position_ids)

    def propose(self, num_tokens: int, anchor, anchor_position, attention_mask, sample):
        # DeepSpec's static rule inside `propose`: the block is cut at the first slot whose confidence is below the
        # threshold; in a batch, at the end of the longest confident run of any row (one forward verifies all rows).
        tokens, logits, _ = self.draft.propose(self.cache, anchor, anchor_position, sample, self.confidence_threshold)
        return tokens[:, :num_tokens], logits[:, :num_tokens]


class PromptLookup:
    """Drafts each row's own continuation: the tokens after the first earlier occurrence of the row's last n-gram
    (n = `max_ngram` down to 1, the longest match wins), as Saxena's prompt lookup decoding and transformers'
    `PromptLookupCandidateGenerator` do. The first occurrence, not the latest: a copy's source is the prompt, and a
    loop the output fell into also repeats from its start. The draft is a function of the committed tokens, so its q
    is one-hot: the accept rule keeps d with probability p(d) and otherwise draws from p without d, and greedy stays
    exact."""

    method = "prompt_lookup"

    def __init__(self, num_tokens: int, max_ngram: int, vocab_size: int):
        if num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1, got {num_tokens}")
        if max_ngram < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {max_ngram}")
        self.num_draft_tokens = num_tokens
        self.max_ngram = max_ngram
        self.vocab_size = vocab_size

    def continuation(self, ids: torch.Tensor, room: int) -> torch.Tensor:
        """Up to `room` tokens that followed the first earlier occurrence of the longest matching suffix of `ids`
        (1-D, committed tokens only); empty when no suffix recurs."""
        length = ids.shape[0]
        for size in range(min(self.max_ngram, length - 1), 0, -1):
            windows = ids[: length - 1].unfold(0, size, 1)  # every earlier n-gram; each has a token after it
            starts = (windows == ids[length - size :]).all(-1).nonzero()
            if starts.numel():
                follow = int(starts[0]) + size
                return ids[follow : follow + room]
        return ids[:0]

    def propose(self, input_ids: torch.Tensor, attention_mask, unfinished: torch.Tensor, room: int):
        """`(tokens [B, n], q logits [B, n, V])` with each unfinished row's continuation (rows padded with token 0,
        one-hot too), or None when some unfinished row has none."""
        room = min(room, self.num_draft_tokens)
        rows = []
        for b in range(input_ids.shape[0]):
            if not bool(unfinished[b]):
                rows.append(input_ids[b, :0])
                continue
            ids = input_ids[b] if attention_mask is None else input_ids[b][attention_mask[b].bool()]
            found = self.continuation(ids, room)
            if not found.numel():
                return None
            rows.append(found)
        n = max(row.shape[0] for row in rows)
        tokens = input_ids.new_zeros(input_ids.shape[0], n)
        for b, row in enumerate(rows):
            tokens[b, : row.shape[0]] = row
        logits = torch.full((*tokens.shape, self.vocab_size), float("-inf"), device=tokens.device)
        return tokens, logits.scatter_(-1, tokens[..., None], 0.0)


class DraftSchedule:
    """Decides, before each round, whether it drafts. "always": every round. "adaptive": the round drafts while
    drafting pays, i.e. while drafting rounds commit at least as many tokens per second as plain one-token rounds:

        tokens per drafting round / seconds per drafting round  >=  1 / seconds per plain round,

    each side an exponential moving average of the rounds measured so far (wall clock: the costs of the drafter,
    of a verify forward over several tokens and of a plain step are this machine's and this batch's, and no model of
    them holds across CPUs and GPUs; the same trade as the hardware-aware pruning of the DSpark paper, arXiv
    2607.05147, Alg. 1, made per round). The first round drafts and the second is plain, so that both sides are
    measured. While drafting does not pay, a probe round drafts after `probe_interval` plain rounds, to notice when
    the text turns predictable; each probe that leaves drafting unprofitable doubles the interval (up to
    `max_probe_interval`), and a profitable one resets it to 1. The choice changes only how many target forwards
    decoding takes, never the tokens: every committed token is a sample of the target's distribution."""

    SCHEDULES = ("adaptive", "always")

    def __init__(self, schedule: str = "adaptive", smoothing: float = 0.3, max_probe_interval: int = 32):
        if schedule not in self.SCHEDULES:
            raise ValueError(f"draft_schedule must be one of {self.SCHEDULES}, got {schedule!r}")
        self.adaptive = schedule == "adaptive"
        self.smoothing = smoothing
        self.max_probe_interval = max_probe_interval
        self.draft_tokens: float | None = None  # moving averages; None until measured
        self.draft_seconds: float | None = None
        self.plain_seconds: float | None = None
        self.probe_interval = 1
        self.plain_streak = 0

    def drafting_pays(self) -> bool:
        return self.draft_tokens * self.plain_seconds >= self.draft_seconds

    def should_draft(self) -> bool:
        if not self.adaptive or self.draft_seconds is None:
            return True
        if self.plain_seconds is None:
            return False
        return self.drafting_pays() or self.plain_streak >= self.probe_interval

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A finished round: whether it drafted, how many tokens each row committed, its wall time."""
        if not drafted:
            self.plain_seconds = self._average(self.plain_seconds, seconds)
            self.plain_streak += 1
            return
        self.draft_tokens = self._average(self.draft_tokens, float(tokens))
        self.draft_seconds = self._average(self.draft_seconds, seconds)
        self.plain_streak = 0
        if self.plain_seconds is not None:
            pays = self.drafting_pays()
            self.probe_interval = 1 if pays else min(2 * self.probe_interval, self.max_probe_interval)

    def _average(self, average: float | None, value: float) -> float:
        return value if average is None else (1 - self.smoothing) * average + self.smoothing * value


class PendingContext:
    """The target's hidden states at committed positions that the drafter has not read yet, kept in order and fed
    in one `observe` call when the drafter next drafts (a plain round then costs the drafter nothing)."""

    def __init__(self):
        self.parts: list[tuple] = []

    def add(self, hidden_states, next_ids, attention_mask, position_ids) -> None:
        self.parts.append((hidden_states, next_ids, attention_mask, position_ids))

    def flush_into(self, drafter) -> None:
        if not self.parts:
            return
        hidden_states = tuple(torch.cat(layer, dim=1) for layer in zip(*(part[0] for part in self.parts), strict=True))
        next_ids = torch.cat([part[1] for part in self.parts], dim=1)
        position_ids = torch.cat([part[3] for part in self.parts], dim=1)
        # The latest mask covers every committed pair, the pending ones last.
        drafter.observe(hidden_states, next_ids, self.parts[-1][2], position_ids)
        self.parts.clear()


def _stack(tokens: list, logits: list, anchor: torch.Tensor):
    if not tokens:
        return anchor.new_zeros(anchor.shape[0], 0), None
    return torch.stack(tokens, 1), torch.stack(logits, 1)


# generate() keywords (or GenerationConfig attributes) of KDSA's drafters: the draft tokens the MTP layer chains per
# round (default 1, transformers' use_mtp count), the DSpark pruning threshold (default: transformers'
# `assistant_confidence_threshold`), and whether rounds draft always or while it pays (`DraftSchedule`, default
# "adaptive").
SPECULATION_OPTIONS = ("mtp_draft_tokens", "dspark_confidence_threshold", "draft_schedule")
DEFAULT_DRAFT_SCHEDULE = "adaptive"
DEFAULT_MAX_NGRAM = 2  # transformers' default `max_matching_ngram_size` for prompt lookup


def _prompt_lookup(model, generation_config) -> PromptLookup | None:
    """The hybrid's lookup source when `prompt_lookup_num_tokens` is set next to `use_mtp` / dspark, else None."""
    num_tokens = generation_config.prompt_lookup_num_tokens
    if num_tokens is None:
        return None
    max_ngram = generation_config.max_matching_ngram_size or DEFAULT_MAX_NGRAM
    # `out_features`: the whole vocabulary also when tensor parallelism holds only some of the head's rows here.
    return PromptLookup(int(num_tokens), int(max_ngram), model.get_output_embeddings().out_features)


def _drafter(model, generation_config, batch_size: int, assistant_model):
    mtp_tokens = getattr(generation_config, "mtp_draft_tokens", None)
    threshold = getattr(generation_config, "dspark_confidence_threshold", None)
    if generation_config.use_mtp:
        if assistant_model is not None:
            raise ValueError("use_mtp=True drafts with the model's own MTP layers: pass no assistant_model")
        num_mtp_layers = getattr(model.config, "num_mtp_layers", 0)
        if num_mtp_layers > 1:
            raise ValueError(
                f"drafting with {num_mtp_layers} MTP layers is not supported: KDSA chains the first MTP layer "
                "(docs/speculative.md); the checkpoints of the family ship one"
            )
        return MTPDrafter(model, mtp_tokens if mtp_tokens is not None else 1)
    if assistant_model is None or not hasattr(assistant_model, "propose"):
        raise ValueError(
            "speculation_type='dspark' needs assistant_model=<a DSparkDraftModel> "
            f"(modeling_kdsa.DSparkDraftModel.from_pretrained(folder)); got {type(assistant_model).__name__}"
        )
    if threshold is None:
        threshold = generation_config.assistant_confidence_threshold or 0.0
    return DSparkDrafter(model, assistant_model, batch_size, float(threshold))


def sharded_group(model):
    """The process group whose ranks run every forward of `model` together on the same tokens, or None when the model
    is whole in this process: the tp group of a model cut by `parallel.apply_tensor_parallel` (its
    `tensor_parallel_group`) or loaded with transformers' `tp_plan` (`_tp_size` > 1, the "tp" mesh of its
    `_mesh_manager`). A `tensor_parallel_group` set to None (a hand-over to tp = 1, parallel/handover.py) overrides the
    load's mesh: the model is no longer cut."""
    if "tensor_parallel_group" in vars(model):
        return model.tensor_parallel_group
    manager = getattr(model, "_mesh_manager", None)
    if (getattr(model, "_tp_size", None) or 1) > 1 and manager is not None:
        return manager.get_mesh("tp").get_group()
    return None


def slowest_seconds(seconds: float, group, device) -> float:
    """The largest of every rank's `seconds` over `group` (a collective: every rank of the group calls it)."""
    measured = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    return float(measured.item())


def _check_supported(generation_config) -> None:
    if generation_config.num_return_sequences not in (None, 1):
        raise ValueError("speculative decoding (use_mtp / dspark) needs num_return_sequences=1")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "speculative decoding (use_mtp / dspark) returns no attentions or hidden states: KDA and DSA form no "
            "attention matrix, and a verify forward covers several tokens"
        )


@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    """generate()'s decoding loop for `use_mtp=True` and `speculation_type="dspark"` (called from
    `KDSAForCausalLM._assisted_decoding` with generate()'s own processors, stopping criteria and cache)."""
    _check_supported(generation_config)
    if assistant_tokenizer is not None:
        raise ValueError("DSpark and MTP drafts share the target's vocabulary: pass no assistant_tokenizer")
    cache = model_kwargs.get("cache")
    if not isinstance(cache, KDSACache) or not cache.is_croppable:
        raise ValueError(
            "speculative decoding needs a KDSACache that can roll back: let generate() build it, or pass "
            f"KDSACache(config, rollback_tokens={ROLLBACK_TOKENS})"
        )
    batch_size = input_ids.shape[0]
    drafter = _drafter(model, generation_config, batch_size, assistant_model)
    lookup = _prompt_lookup(model, generation_config)
    schedule_name = getattr(generation_config, "draft_schedule", None) or DEFAULT_DRAFT_SCHEDULE
    schedule = DraftSchedule(schedule_name)
    lookup_schedule = DraftSchedule(schedule_name) if lookup is not None else None
    # The ranks of a sharded model must draft in the same rounds: they agree on the measured seconds. A model whole in
    # this process syncs nothing (independent processes run their own numbers of rounds).
    sync_group = sharded_group(model) if schedule.adaptive else None
    sampler = Sampler(logits_processor, bool(generation_config.do_sample))
    pad = generation_config._pad_token_tensor
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # nothing padded: the model's fast path
    output = _Output(batch_size, input_ids.device, stopping_criteria, pad, streamer, generation_config)
    stats = SpeculationStats(method=drafter.method)
    model.speculation_stats = stats

    # Prefill: the prompt, with the hidden states the drafter reads.
    prompt_len = input_ids.shape[1]
    past = cache.get_seq_length()
    positions = position_ids_from_mask(attention_mask, prompt_len, input_ids.device)[:, past:].expand(batch_size, -1)
    out = model(
        input_ids=input_ids[:, past:], attention_mask=attention_mask, position_ids=positions, cache=cache,
        output_hidden_states=True, logits_to_keep=1,
    )  # fmt: skip
    processed = sampler.process(input_ids, out.logits[:, -1])
    input_ids, attention_mask = output.append(input_ids, attention_mask, sampler.draw(processed)[:, None],
                                              processed[:, None], out.logits[:, -1:])  # fmt: skip
    stats.emitted += 1
    pending = PendingContext()
    if output.unfinished_rows():
        pairs_mask = None if attention_mask is None else attention_mask[:, :prompt_len]
        pending.add(out.hidden_states, input_ids[:, past + 1 :], pairs_mask, positions)
    # Every committed token is real (left padding sits before the prompt): the anchor's position is the last
    # prompt position + 1, and each round's tokens follow it one by one.
    anchor_position = positions[:, -1] + 1

    max_length = generation_config.max_length
    while output.unfinished_rows() and input_ids.shape[1] < max_length:
        start = time.perf_counter()
        anchor = input_ids[:, -1]
        past = cache.get_seq_length()  # == input_ids.shape[1] - 1: every committed token but the anchor
        room = max_length - input_ids.shape[1] - 1
        proposal = None
        if room > 0 and lookup is not None and lookup_schedule.should_draft():
            proposal = lookup.propose(input_ids, attention_mask, output.unfinished, room)
        source = lookup_schedule if proposal is not None else None
        if source is None and room > 0 and schedule.should_draft():
            pending.flush_into(drafter)
            proposal = drafter.propose(
                min(room, drafter.num_draft_tokens), anchor, anchor_position, attention_mask,
                sampler.drafting(input_ids),
            )  # fmt: skip
            source = schedule
        draft_tokens, draft_logits = proposal if proposal is not None else (anchor.new_zeros(batch_size, 0), None)
        n = draft_tokens.shape[1]
        verify_mask = None
        if attention_mask is not None:
            verify_mask = torch.cat([attention_mask, attention_mask.new_ones(batch_size, n)], 1)
        positions = anchor_position[:, None] + torch.arange(n + 1, device=input_ids.device)
        out = model(
            input_ids=torch.cat([anchor[:, None], draft_tokens], dim=1), attention_mask=verify_mask,
            position_ids=positions, cache=cache, output_hidden_states=True, logits_to_keep=0,
        )  # fmt: skip
        target = torch.stack(
            [sampler.process(torch.cat([input_ids, draft_tokens[:, :k]], 1), out.logits[:, k]) for k in range(n + 1)],
            dim=1,
        )
        accepted_rows, next_tokens = accept(draft_tokens, draft_logits, target, sampler.do_sample)
        # Finished rows emit padding whatever they accept: they do not hold the batch back.
        accepted = int(torch.where(output.unfinished, accepted_rows, n).min())
        emit = next_tokens[:, : accepted + 1]
        stats.rounds += 1
        stats.plain_rounds += int(source is None)
        stats.lookup_rounds += int(source is not None and source is lookup_schedule)
        stats.drafted += n
        stats.accepted += accepted
        stats.accepted_per_round.append(accepted)
        stats.emitted += emit.shape[1]
        cache.crop(past + accepted + 1)
        input_ids, attention_mask = output.append(input_ids, attention_mask, emit, target[:, : accepted + 1],
                                                  out.logits[:, : accepted + 1])  # fmt: skip
        anchor_position = anchor_position + accepted + 1
        if output.unfinished_rows():
            kept = tuple(h[:, : accepted + 1] for h in out.hidden_states)
            pairs_mask = None if attention_mask is None else attention_mask[:, : past + accepted + 1]
            pending.add(kept, emit, pairs_mask, positions[:, : accepted + 1])
        if room > 0:  # a round with no room left before max_length measures neither side
            seconds = time.perf_counter() - start
            if sync_group is not None:
                seconds = slowest_seconds(seconds, sync_group, input_ids.device)
            if source is not None:
                source.record(True, accepted + 1, seconds)
            else:  # a plain round measures the side both sources compare against
                for plain in (schedule, lookup_schedule):
                    if plain is not None:
                        plain.record(False, 1, seconds)
    return output.result(input_ids, cache, generation_config)


class _Output:
    """What generate() returns, built as plain decoding builds it: tokens are appended one column at a time, a
    finished row gets padding, the stopping criteria see every prefix, the streamer every column, and the processed
    scores / raw logits of each appended token are kept when asked for."""

    def __init__(self, batch_size: int, device, stopping_criteria, pad, streamer, generation_config):
        self.stopping_criteria, self.pad, self.streamer = stopping_criteria, pad, streamer
        self.unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
        keep = generation_config.return_dict_in_generate
        self.scores = [] if keep and generation_config.output_scores else None
        self.raw_logits = [] if keep and generation_config.output_logits else None

    def unfinished_rows(self) -> bool:
        return bool(self.unfinished.any())

    def append(self, input_ids, attention_mask, tokens, processed, logits):
        """Append `tokens [B, m]` with their processed and raw logits `[B, m, V]`; stops once every row is
        finished. Returns the new `(input_ids, attention_mask)`."""
        for j in range(tokens.shape[1]):
            column = tokens[:, j]
            if self.pad is not None:
                column = torch.where(self.unfinished, column, self.pad.to(column.device))
            input_ids = torch.cat([input_ids, column[:, None]], dim=1)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], 1)
            if self.streamer is not None:
                self.streamer.put(column.cpu())
            if self.scores is not None:
                self.scores.append(processed[:, j])
            if self.raw_logits is not None:
                self.raw_logits.append(logits[:, j])
            self.unfinished &= ~self.stopping_criteria(input_ids, processed[:, j])
            if not self.unfinished_rows():
                break
        return input_ids, attention_mask

    def result(self, input_ids, cache, generation_config):
        if self.streamer is not None:
            self.streamer.end()
        if not generation_config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=None if self.scores is None else tuple(self.scores),
            logits=None if self.raw_logits is None else tuple(self.raw_logits),
            cache=cache,
        )
