"""Train the DSpark draft of `checkpoints/kdsa-tiny` (written to `checkpoints/kdsa-tiny-dspark/`, speculators format).

    .venv/bin/python scripts/train_dspark.py          # about 5 min on one CPU thread (2 min data, 2.6 min training)

Data: prompts of the tiny target's own tasks (`modeling_kdsa.eval.synthetic`: key-value recall / compose queries and
copies, 8-64 pairs or keys, the training distribution of scripts/train_tiny.py) continued by the frozen target's
greedy decoding. One target forward over each whole sequence with `output_hidden_states=True` gives the context
features (the target layers' outputs, `hidden_states[id + 1]`) and the target's next-token distributions; both are
computed once, before training.

Draft: a Qwen3-style backbone of `--layers` layers with the target's hidden size, the target's embeddings and LM
head shared and frozen (full vocabulary), a vanilla Markov head and a confidence head. Anchors are sampled over the
generated positions (copy sequences weighted by `--copy-weight` per generated token); each block
`[anchor, MASK × (γ−1)]` sees the context before its anchor.

Initialisation (`--lookup-init`, on by default): the attention starts as a one-hop lookup (`lookup_init`). On copy
prompts kdsa-tiny's greedy continuation copies a few tokens, jumps, and falls into short loops, so most next tokens
follow an earlier occurrence of the anchor. The draft's context rows never attend to each other and the target's
hidden states at a source position do not carry the previous token (a linear probe reads it 2 % of the time, chance
0.8 %), so the draft cannot match the anchor against "the token before this row". What the rows do carry is their own
token (99 %) and, where the target has seen the pattern, its prediction of the next one (64-82 %). `lookup_init`
fits `fc` so that each context row holds both, matches the block token against the first and reads out the second.
From a random start no configuration tried learnt this (copy τ 1.01-1.04).

Loss (DSpark paper eq. 9-12): per slot k, `0.1·CE(label) + 0.9·TV(p_draft, p_target) + 1.0·BCE(σ(c_k), 1 − TV)` with
the TV detached in the confidence target, weighted by `exp(−k/4)` normalised over the supervised slots; p_draft is the
teacher-forced Markov-corrected distribution.

Reported on held-out prompts (the lm-eval test docs of eval/tasks/data, never trained on): the analytic τ
`1 + Σ_k Π_{j≤k} (1 − TV_j)` at every generated anchor, and greedy speculative decoding simulated through the
draft's inference API (`extend_context` / `propose`): tokens per target forward (accepted drafts + 1) and the
acceptance of each slot.
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from modeling_kdsa.eval import synthetic
from modeling_kdsa.eval.make_data import load_docs
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_kdsa.dspark import DSparkConfig, DSparkDraftModel, expected_accepted_length, total_variation

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "checkpoints" / "kdsa-tiny"
OUTPUT = ROOT / "checkpoints" / "kdsa-tiny-dspark"
SIZES = (8, 16, 24, 32, 40, 48, 56, 64)
KEY_VALUE, COPY = "key_value", "copy"
NEW_TOKENS = {KEY_VALUE: 32, COPY: None}  # copy: the copy itself (= its length) plus COPY_EXTRA tokens
COPY_EXTRA = 8
EVAL_TASKS = ("recall_near", "recall_mid", "recall_far", "compose", "copy")
CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT, DECAY = 0.1, 0.9, 1.0, 4.0


def prompt_words(rng: random.Random, task: str, size: int) -> list[str]:
    """A prompt of the target's training distribution: key-value pairs and one recall (`?`) or compose (`+`) query
    up to the queried key, or a copy source up to its `|`."""
    if task == KEY_VALUE:
        words, _ = synthetic.key_value_example(rng, size, num_queries=1)
        return words[:-1]
    words, _ = synthetic.copy_example(rng, size)
    return words[: size + 2]


@torch.no_grad()
def greedy_continue(target, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's greedy continuation of a batch of equal-length prompts, decoded step by step with its cache."""
    out = target(ids, use_cache=True)
    cache, tokens = out.cache, [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = target(tokens[-1][:, None], cache=cache, use_cache=True)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)


@torch.no_grad()
def capture(target, draft: DSparkDraftModel, sequences: torch.Tensor):
    """One target forward over whole sequences: context features `[B, S, m·H]` and next-token logits `[B, S, V]`."""
    out = target(sequences, output_hidden_states=True, use_cache=False)
    return draft.context_features(out.hidden_states), out.logits.float(), out.hidden_states


def build_dataset(target, draft, tokenizer, prompts: list[tuple[str, list[str]]], batch_size: int,
                  keep_hidden: bool = False):  # fmt: skip
    """Groups prompts of one task and length, continues them greedily, captures the target once. Returns buckets:
    dicts with `ids [N, S]`, `features [N, S, m·H]`, `logits [N, S, V]`, `prompt_len`, `task`."""
    groups: dict[tuple[str, int], list[list[str]]] = {}
    for task, words in prompts:
        groups.setdefault((task, len(words)), []).append(words)
    buckets = []
    for (task, length), members in sorted(groups.items()):
        new_tokens = NEW_TOKENS[task] or (length - 2 + COPY_EXTRA)
        for start in range(0, len(members), batch_size):
            ids = torch.tensor([tokenizer.convert_tokens_to_ids(w) for w in members[start : start + batch_size]])
            sequences = greedy_continue(target, ids, new_tokens)
            features, logits, hidden_states = capture(target, draft, sequences)
            buckets.append({"task": task, "prompt_len": length, "ids": sequences, "features": features,
                            "logits": logits, "hidden_states": hidden_states if keep_hidden else None})  # fmt: skip
    return buckets


def sample_anchors(generator: torch.Generator, batch: int, prompt_len: int, seq_len: int, count: int):
    """`[batch, count]` anchor positions in `[prompt_len, seq_len − 2]` (the anchor is a generated token and at least
    one token follows it), without repetition where the range allows."""
    span = seq_len - 1 - prompt_len
    if span >= count:
        return torch.stack([torch.randperm(span, generator=generator)[:count] for _ in range(batch)]) + prompt_len
    return torch.randint(prompt_len, seq_len - 1, (batch, count), generator=generator)


def block_targets(bucket, rows: torch.Tensor, anchors: torch.Tensor, gamma: int):
    """For blocks at `anchors` `[B, A]`: labels `[B, A, γ]` (token at p+k+1), the target's logits at p+k
    `[B, A, γ, V]`, and which slots exist (p+k+1 < S)."""
    ids, logits = bucket["ids"][rows], bucket["logits"][rows]
    seq_len = ids.shape[1]
    slots = anchors[:, :, None] + torch.arange(gamma)  # position p + k
    valid = slots + 1 < seq_len
    slots = slots.clamp(max=seq_len - 2)
    batch, count = anchors.shape
    labels = ids.gather(1, (slots + 1).view(batch, -1)).view(batch, count, gamma)
    target_logits = logits.gather(1, slots.view(batch, -1, 1).expand(-1, -1, logits.shape[-1]))
    return labels, target_logits.view(batch, count, gamma, -1), valid


def dspark_loss(draft, bucket, rows, anchors):
    """The paper's loss over the blocks at `anchors`; also returns the per-slot TV `[B, A, γ]` and validity."""
    gamma = draft.config.block_size
    out = draft(bucket["ids"][rows], bucket["features"][rows], anchors)
    labels, target_logits, valid = block_targets(bucket, rows, anchors, gamma)
    tv = total_variation(out.logits, target_logits)
    ce = F.cross_entropy(out.logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(tv)
    weights = torch.exp(-torch.arange(gamma, dtype=torch.float) / DECAY) * valid
    weights = weights / weights.sum()
    loss = CE_WEIGHT * ce + TV_WEIGHT * tv
    if out.confidence_logits is not None:
        confidence_target = (1 - tv).detach()
        loss = loss + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(
            out.confidence_logits, confidence_target, reduction="none"
        )
    return (loss * weights).sum(), tv.detach(), valid


@torch.no_grad()
def lookup_init(draft, target, buckets, generator: torch.Generator, rows: int = 20000, gain: float = 3.0) -> None:
    """Initialises every draft layer's attention as a one-hop lookup: match the block token against the context row
    holding the same token, read the target's next-token prediction stored at that row. `fc` is fitted by least
    squares on the captured data so that the projected context row is `[P1·E[token] ; P2·U[target's argmax]]` (E the
    target's embeddings, U its LM head, P1 / P2 orthonormal 64-row projections); q / k read the first half through
    the 12 lowest-frequency RoPE dims of each head (almost unrotated over a few hundred positions), v / o carry the
    second half back into the residual stream, where the shared LM head reads it. The MLPs start at zero."""
    config = draft.config
    hidden, head_dim = config.hidden_size, config.head_dim
    embed = target.get_input_embeddings().weight.float()
    head = target.get_output_embeddings().weight.float()
    half = hidden // 2
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=generator))[0]
    p1, p2 = basis[:half], basis[half:]
    features, current, predicted = [], [], []
    for bucket in buckets:
        features.append(bucket["features"].flatten(0, 1))
        current.append(bucket["ids"].flatten())
        predicted.append(bucket["logits"].argmax(-1).flatten())
    features, current, predicted = torch.cat(features), torch.cat(current), torch.cat(predicted)
    pick = torch.randperm(features.shape[0], generator=generator)[:rows]
    x, cur, nxt = features[pick].float(), current[pick], predicted[pick]
    y = torch.cat([embed[cur] @ p1.T, head[nxt] @ p2.T], dim=1)
    y = y / y.pow(2).mean(-1, keepdim=True).sqrt()
    x1 = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
    solution = torch.linalg.solve(x1.T @ x1 + 1e-2 * torch.eye(x1.shape[1]), x1.T @ y)
    draft.fc.weight.copy_(solution[:-1].T)
    low = torch.cat([torch.arange(head_dim // 2 - 6, head_dim // 2), torch.arange(head_dim - 6, head_dim)])
    groups = config.num_attention_heads // config.num_key_value_heads
    for layer in draft.layers:
        attention = layer.self_attn
        for weight in (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight,
                       attention.o_proj.weight, layer.mlp.down_proj.weight):  # fmt: skip
            weight.zero_()
        per_kv = half // config.num_key_value_heads
        for kv in range(config.num_key_value_heads):
            mix = torch.randn(low.numel(), half, generator=generator) / half**0.5
            attention.k_proj.weight[kv * head_dim + low, :half] = mix
            value_rows = torch.arange(per_kv) + half + kv * per_kv
            attention.v_proj.weight[kv * head_dim + torch.arange(per_kv), value_rows] = 1.0
            for h in range(kv * groups, (kv + 1) * groups):
                attention.q_proj.weight[h * head_dim + low] = mix @ p1
                out_cols = h * head_dim + torch.arange(per_kv)
                attention.o_proj.weight[:, out_cols] = gain * p2[kv * per_kv : (kv + 1) * per_kv].T / groups
        attention.q_norm.weight.fill_(gain)


@torch.no_grad()
def analytic_tau(draft, buckets) -> float:
    """Mean analytic τ over every anchor whose whole block lies inside the sequence."""
    gamma, taus = draft.config.block_size, []
    for bucket in buckets:
        count, seq_len = bucket["ids"].shape
        anchors = torch.arange(bucket["prompt_len"], seq_len - gamma)
        if anchors.numel() == 0:
            continue
        rows = torch.arange(count)
        anchors = anchors[None].expand(count, -1)
        _, tv, _ = dspark_loss(draft, bucket, rows, anchors)
        taus.append(expected_accepted_length(tv).flatten())
    return float(torch.cat(taus).mean())


@torch.no_grad()
def simulate_greedy(draft, buckets) -> dict:
    """Greedy speculative decoding of the known greedy continuations through `extend_context` / `propose` (batch 1):
    each round proposes γ tokens at the anchor, accepts the longest prefix equal to the target's tokens, and feeds the
    anchor and the accepted tokens to the context. Returns tokens per target forward (τ) per task and overall, and
    the acceptance rate of each slot given that the slots before it were accepted."""
    gamma = draft.config.block_size
    per_task: dict[str, list[int]] = {}
    reached, accepted = [0] * gamma, [0] * gamma
    for bucket in buckets:
        for row in range(bucket["ids"].shape[0]):
            ids = bucket["ids"][row : row + 1]
            hidden = [h[row : row + 1] for h in bucket["hidden_states"]]
            seq_len, position = ids.shape[1], bucket["prompt_len"]
            cache = draft.new_cache(1)
            draft.extend_context(cache, [h[:, :position] for h in hidden])
            while position < seq_len - 1:
                tokens, _, _ = draft.propose(cache, ids[:, position], torch.tensor([position]))
                n = min(gamma, seq_len - 1 - position)
                matches = (tokens[0, :n] == ids[0, position + 1 : position + 1 + n]).long()
                count = int(matches.cumprod(0).sum())
                for k in range(min(count + 1, n)):
                    reached[k] += 1
                    accepted[k] += int(k < count)
                per_task.setdefault(bucket["task_name"], []).append(count + 1)
                draft.extend_context(cache, [h[:, position : position + count + 1] for h in hidden])
                position += count + 1
    everything = [v for values in per_task.values() for v in values]
    return {
        "tau": sum(everything) / len(everything),
        "tau_per_task": {task: sum(v) / len(v) for task, v in per_task.items()},
        "slot_acceptance": [a / r if r else None for a, r in zip(accepted, reached, strict=True)],
    }


def model_card(training: dict, results: dict) -> str:
    per_task = "\n".join(f"| {task} | {tau:.2f} |" for task, tau in results["greedy"]["tau_per_task"].items())
    data_time = "loaded from --data-cache" if training["data_cached"] else f"{training['data_seconds']:.0f} s"
    slots = ", ".join(f"{a:.2f}" for a in results["greedy"]["slot_acceptance"] if a is not None)
    init = (
        "The attention starts as a one-hop lookup (`lookup_init`: `fc` fitted by least squares so that a context row "
        "holds its own token and the target's next-token prediction; q / k match the first through the lowest RoPE "
        "frequencies, v / o carry the second to the LM head); from a random start copy stays at τ ≈ 1.0."
        if training["lookup_init"]
        else "Random initialisation."
    )
    return f"""---
license: apache-2.0
library_name: transformers
tags: [kdsa, dspark, speculative-decoding, speculators, synthetic, tiny]
---

# kdsa-tiny-dspark

A DSpark draft for `checkpoints/kdsa-tiny`, in the `speculators` DSpark format (`speculators_model_type: "dspark"`).
DSpark (DeepSeek's DSpark paper, github.com/deepseek-ai/DeepSpec) drafts a whole block in one forward: a
{training["layers"]}-layer Qwen3-style backbone reads the block `[anchor, MASK × {training["block_size"] - 1}]` and
attends to K/V made from the target's hidden states at target layers {training["target_layer_ids"]}
(`aux_hidden_state_layer_ids` {[i + 1 for i in training["target_layer_ids"]]}), then a Markov head (rank
{training["markov_rank"]}, vanilla) samples the {training["block_size"]} slots left to right and a confidence head
scores each. The draft uses the target's embeddings and LM head (full vocabulary; the folder holds neither), so it
only works bound to kdsa-tiny. {training["parameters"]:,} parameters of its own.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from modeling_kdsa import DSparkDraftModel

model = AutoModelForCausalLM.from_pretrained("checkpoints/kdsa-tiny")
tokenizer = AutoTokenizer.from_pretrained("checkpoints/kdsa-tiny")
draft = DSparkDraftModel.from_pretrained("checkpoints/kdsa-tiny-dspark", target=model)
ids = tokenizer("copy k7 k100 k3 k42 |", return_tensors="pt").input_ids
out = model.generate(ids, assistant_model=draft, speculation_type="dspark", do_sample=False, max_new_tokens=8)
```

## Measured (held-out prompts: the lm-eval test docs, {results["eval_sequences"]} sequences)

{results["eval_sequences"] // len(EVAL_TASKS)} docs per task, continued by kdsa-tiny's greedy decoding
({NEW_TOKENS[KEY_VALUE]} new tokens after a key-value query, the copy length + {COPY_EXTRA} after a copy
prompt); the continuations are replayed as greedy speculation through the draft's own inference API
(`extend_context` / `propose`, γ = {training["block_size"]}, no pruning): τ = tokens per target forward = accepted
drafts + 1.

| prompts | τ (greedy) |
|---|---|
{per_task}
| all | {results["greedy"]["tau"]:.2f} |

Acceptance of slot k given slots < k accepted: {slots}.
Analytic τ `1 + Σ_k Π_(j≤k) (1 − TV_j)` (temperature 1, every generated anchor): {results["analytic_tau"]:.2f}.
Before training: greedy τ {results["untrained_greedy_tau"]:.2f}, analytic τ {results["untrained_analytic_tau"]:.2f}.

## Training

`{training["command"]}` — {training["train_sequences"]} prompts of kdsa-tiny's task distribution (key-value
recall / compose queries and copies of 8-64 pairs or keys), continued by kdsa-tiny's own greedy decoding; the
target's hidden states and logits captured once ({data_time}). {training["steps"]} steps of
{training["batch_size"]} sequences × {training["anchors"]} anchors, AdamW lr {training["lr"]} (warm-up
{training["warmup"]}, cosine to 10 %), loss 0.1·CE + 0.9·TV + 1.0·BCE(confidence, 1 − TV) with slot weights
exp(−k/4); copy sequences sampled with weight {training["copy_weight"]} per generated token relative to key-value
ones. {init} Training: {training["train_seconds"] / 60:.1f} min on one CPU thread ({training["total_seconds"] / 60:.1f}
min in all, on a 2-core machine shared with other jobs).

## Limits

- **Copy needs a lookup the context cannot index directly.** On copy prompts kdsa-tiny's own greedy continuation
  copies a few tokens, jumps, then loops (on the held-out copy docs about 52 % of its next tokens follow the anchor's
  occurrence in the source, 75 % follow an earlier occurrence in its own output). DSpark's context rows do not
  attend to each other, and the target's hidden states at a source position do not carry the previous token (linear
  probe: 2 %, chance 0.8 %), so "find the row after the anchor's occurrence" is out of reach of one attention hop.
  The lookup this draft does (see Training) matches the anchor against each row's own token and reads the target's
  next-token prediction stored at that row, which is right where the target has already seen the continuation (its
  own loops), and mostly for slot 0 only: later slots would need a chain of lookups.
- Greedy τ here is the replayed acceptance; the speed of `generate(..., speculation_type="dspark")` also depends on
  the verify cost of the target (see `scripts/bench_speculative.py`). `generate` prunes the block at the first slot
  whose confidence is under `dspark_confidence_threshold` (default: transformers' `assistant_confidence_threshold`);
  pass `dspark_confidence_threshold=0` to verify whole blocks.
"""


def command_line(args) -> str:
    """The training command with every argument spelt out (output and data cache left out)."""
    parts = ["python scripts/train_dspark.py"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key in ("output", "data_cache"):
            continue
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            parts.append(f"{flag} {' '.join(map(str, value))}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--markov-rank", type=int, default=64)
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--train-prompts", type=int, default=1024)
    parser.add_argument("--copy-weight", type=float, default=1.0,
                        help="sampling weight of copy sequences relative to key-value ones (per generated token)")
    parser.add_argument("--eval-docs", type=int, default=16, help="test docs per eval task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookup-init", action=argparse.BooleanOptionalAction, default=True,
                        help="start the attention as a one-hop lookup of the target's next-token prediction")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument(
        "--data-cache",
        type=Path,
        default=None,
        help="reuse the captured data of an earlier run with the same data arguments (a .pt file)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    target = AutoModelForCausalLM.from_pretrained(TARGET).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    tc = target.config
    config = DSparkConfig(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=2 * tc.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        target_hidden_size=tc.hidden_size,
        target_layer_ids=args.target_layer_ids,
        num_target_layers=tc.num_hidden_layers,
        block_size=args.block_size,
        mask_token_id=tokenizer.convert_tokens_to_ids(synthetic.UNK),
        markov_rank=args.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=args.markov_rank > 0,
    )
    draft = DSparkDraftModel(config).bind_target(target)

    rng = random.Random(f"dspark-{args.seed}")
    prompts = []
    for _ in range(args.train_prompts):
        task = KEY_VALUE if rng.random() < 0.5 else COPY
        prompts.append((task, prompt_words(rng, task, rng.choice(SIZES))))
    held_out = {" ".join(words) for _, words in prompts}
    eval_prompts = []
    for task in EVAL_TASKS:
        for doc in load_docs(task, "test")[: args.eval_docs]:
            words = doc["context"].split()
            if " ".join(words) in held_out:
                raise ValueError(f"a training prompt equals a held-out {task} doc")
            eval_prompts.append((task, words))
    data_cached = args.data_cache is not None and args.data_cache.exists()
    if data_cached:
        train, evaluation = torch.load(args.data_cache)
    else:
        train = build_dataset(target, draft, tokenizer, prompts, batch_size=32)
        evaluation = []
        for task, words in eval_prompts:  # one bucket per doc: the task name is kept for the per-task τ
            kind = COPY if task == "copy" else KEY_VALUE
            (bucket,) = build_dataset(target, draft, tokenizer, [(kind, words)], batch_size=1, keep_hidden=True)
            bucket["task_name"] = task
            evaluation.append(bucket)
        if args.data_cache is not None:
            torch.save((train, evaluation), args.data_cache)
    data_seconds = time.perf_counter() - start
    print(f"data: {sum(b['ids'].shape[0] for b in train)} training sequences, {len(evaluation)} held-out, "
          f"{data_seconds:.0f} s", flush=True)  # fmt: skip

    if args.lookup_init:
        lookup_init(draft, target, train, torch.Generator().manual_seed(args.seed))
    draft.eval()
    untrained = {"untrained_analytic_tau": analytic_tau(draft, evaluation),
                 "untrained_greedy_tau": simulate_greedy(draft, evaluation)["tau"]}  # fmt: skip
    print(untrained, flush=True)

    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    weights = torch.tensor(
        [b["ids"].shape[0] * (b["ids"].shape[1] - b["prompt_len"]) * (args.copy_weight if b["task"] == COPY else 1.0)
         for b in train],
        dtype=torch.float,
    )
    generator = torch.Generator().manual_seed(args.seed)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    draft.train()
    train_start = time.perf_counter()
    running = None
    for step in range(args.steps):
        bucket = train[int(torch.multinomial(weights, 1, generator=generator))]
        count, seq_len = bucket["ids"].shape
        rows = torch.randint(count, (min(args.batch_size, count),), generator=generator)
        anchors = sample_anchors(generator, rows.numel(), bucket["prompt_len"], seq_len, args.anchors)
        loss, tv, valid = dspark_loss(draft, bucket, rows, anchors)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        tau = float(expected_accepted_length(tv * valid + (~valid)).mean())
        running = tau if running is None else 0.98 * running + 0.02 * tau
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  train τ {running:.2f}  "
                  f"{time.perf_counter() - train_start:.0f} s", flush=True)  # fmt: skip
    train_seconds = time.perf_counter() - train_start

    draft.eval()
    results = {"analytic_tau": analytic_tau(draft, evaluation), "greedy": simulate_greedy(draft, evaluation),
               "eval_sequences": len(evaluation), **untrained}  # fmt: skip
    print(json.dumps(results, indent=2), flush=True)
    training = {
        "command": command_line(args),
        **{k: v for k, v in vars(args).items() if k not in ("output", "data_cache")},
        "train_sequences": sum(b["ids"].shape[0] for b in train),
        "parameters": sum(p.numel() for p in draft.parameters()),
        "data_seconds": data_seconds,
        "data_cached": data_cached,
        "train_seconds": train_seconds,
        "total_seconds": time.perf_counter() - start,
    }
    args.output.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(args.output, verifier_name_or_path="kdsa-tiny")
    # The folder holds weights, config and card only; the full record goes to stdout.
    print(json.dumps({"training": training}, indent=2))
    (args.output / "README.md").write_text(model_card(training, results))
    print(f"wrote {args.output} ({training['total_seconds'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
