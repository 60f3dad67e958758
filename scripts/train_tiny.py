"""Train the tiny KDSA checkpoint shipped in `checkpoints/kdsa-tiny/`, or its speculative-decoding draft, on
synthetic long-context tasks.

    .venv/bin/python scripts/train_tiny.py                 # the target: <= 20 min on 2 CPU cores, seed 0
    .venv/bin/python scripts/train_tiny.py --model draft   # the draft (checkpoints/kdsa-tiny-draft), same tokenizer

Tasks (modeling_kdsa.eval.synthetic): multi-query associative recall over up to 64 key-value pairs, the compositional
variant (recalled value → its successor), and copying up to 64 keys. Loss only on answer tokens. Adaptive
curriculum per task: problems start at 8 pairs / keys and grow once the model solves them.

Training runs the DSA layers **densely** (every causal key; DeepSeek-V3.2's "dense warm-up" stage) with an explicit
softmax, and trains the Lightning Indexer on the side to imitate that attention: KL(attention ‖ softmax(indexer
logits)), summed over heads, on detached inputs so the indexer loss never moves the rest of the model (reference
dsa.md §1). The top-k selection has no gradient, so without this loss the indexer of a trained model would stay
random and sparse inference would drop the needle. The shipped config sets `index_topk = 64`; inference and
evaluation run the real sparse layer.

Data parallel over `--procs` processes (default 2, one per core of the 2-core machine this must fit), one torch thread
each, gradients averaged with a gloo all-reduce (one process with two OpenMP threads ran slower than with one,
measured). Each process draws its own batches; curriculum decisions use the all-reduced accuracy, so every process
grows the problems at the same step. With a fixed seed and process count a rerun repeats the run.

Writes the best checkpoint (by validation accuracy, checked every `--eval-every` steps): weights, config, tokenizer and
a model card holding the training config and final metrics. No code: `save_pretrained`'s copy of the model files and
the config's `auto_map` are removed (a Hub upload gets them from `save_pretrained` / `push_to_hub` of the loaded model).
"""

import argparse
import json
import math
import os
import random
import socket
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from modeling_kdsa.eval import synthetic
from modeling_kdsa.eval.accuracy import CONFIGURATIONS, evaluate, format_table, set_index_topk
from modeling_kdsa.eval.make_data import SPLITS, TASKS, load_docs
from tqdm import tqdm

from modeling_kdsa import KDSAConfig, KDSAForCausalLM
from modeling_kdsa.dsa import KDSASparseAttention
from modeling_kdsa.dsa_ops import indexer_scores

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"
CHECKPOINT_NAMES = {"tiny": "kdsa-tiny", "draft": "kdsa-tiny-draft"}  # --model → folder under checkpoints/


def tiny_config(vocab_size: int, index_topk: int, **changes) -> KDSAConfig:
    """The target: KDA, DSA, KDA, DSA; AttnRes blocks of 4 sublayers; MoE (4 experts, top 2) after the first layer.
    KDA keys are 32-wide per head (2 heads), half the 64 pairs of a recall context. `changes`: fields that differ
    from it (the quick model of scripts/bench_graph_mode.py)."""
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        linear_num_heads=2,
        linear_head_dim=32,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=index_topk,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        first_k_dense_replace=1,
        attn_res_block_size=4,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return KDSAConfig(**{**fields, **changes})


def draft_config(vocab_size: int, index_topk: int) -> KDSAConfig:
    """The draft for speculative decoding: one KDA and one DSA layer, dense MLPs (so the target's MoE fields go
    unused), plain residual stream — fewer and cheaper kernel calls per token than the target (a tiny model's decode
    step costs what its ops' overheads cost)."""
    return tiny_config(
        vocab_size, index_topk, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        layer_types=["linear_attention", "indexed_attention"], q_lora_rank=None, kv_lora_rank=48, index_n_heads=2,
        first_k_dense_replace=2, attn_res_block_size=0,
    )  # fmt: skip


MODELS = {"tiny": tiny_config, "draft": draft_config}


# ------------------------------------------------------------------------------------ dense training forward


def dense_training_forward(self: KDSASparseAttention, hidden_states, position_embeddings=None, attention_mask=None,
                           cache=None):  # fmt: skip
    """Dense causal MLA (MHA form, explicit softmax) plus the indexer-distillation loss, appended to
    `self.indexer_losses`. Training batches are unpadded and uncached, so `attention_mask`/`cache` are unused."""
    batch, seq_len, _ = hidden_states.shape
    q_nope, q_pe, query_input = self.project_queries(hidden_states, position_embeddings)
    latent, k_pe = self.project_latent(hidden_states, position_embeddings)
    kv = self.kv_b_proj(latent).view(batch, seq_len, self.num_heads, -1)
    k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, H, T, Dn + R]
    key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.num_heads, -1)], dim=-1).transpose(1, 2)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=hidden_states.device).tril()
    scores = (query @ key.transpose(-1, -2)).float() * self.softmax_scale
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [B, H, T, T]
    out = (probs.to(value.dtype) @ value.transpose(1, 2)).transpose(1, 2).reshape(batch, seq_len, -1)

    q_index, weights, k_index = self.indexer(hidden_states.detach(), query_input.detach(), position_embeddings)
    log_index = indexer_scores(q_index, weights, k_index, causal[None]).log_softmax(dim=-1)
    target = probs.detach().sum(dim=1)
    target = target / target.sum(dim=-1, keepdim=True)
    # KL(target ‖ indexer) up to the target's entropy (a constant); masked entries have target 0.
    self.indexer_losses.append(-(target * log_index.masked_fill(~causal, 0.0)).sum(-1).mean())
    return self.o_proj(out)


def use_dense_training_attention(model: KDSAForCausalLM, enabled: bool) -> list[KDSASparseAttention]:
    layers = [m for m in model.modules() if isinstance(m, KDSASparseAttention)]
    for layer in layers:
        if enabled:
            layer.forward = types.MethodType(dense_training_forward, layer)
            layer.indexer_losses = []
        else:
            del layer.forward, layer.indexer_losses
    return layers


# -------------------------------------------------------------------------------------------------- data


KEY_VALUE, COPY = "key_value", "copy"
TASK_SHARE = {KEY_VALUE: 2 / 3, COPY: 1 / 3}  # key-value batches mix recall and compose queries
FULL_SIZE = {KEY_VALUE: synthetic.EVAL_NUM_PAIRS, COPY: synthetic.EVAL_COPY_LENGTH}
START_SIZE, SIZE_STEP, LEVEL_UP_ACCURACY = 8, 16, 0.8
QUERIES_PER_EXAMPLE = 24


def training_batch(rng: random.Random, tokenizer, batch_size: int, max_sizes: dict[str, int]):
    """One batch of a single task and size (no padding): 2/3 key-value (recall/compose queries mixed), 1/3 copy;
    `max_size // 2 .. max_size` pairs or keys, `max_size = max_sizes[task]`. Returns the task, `input_ids` and
    `labels` (-100 except at answers)."""
    task = KEY_VALUE if rng.random() < TASK_SHARE[KEY_VALUE] else COPY
    size = rng.randint(max(4, max_sizes[task] // 2), max_sizes[task])
    if task == KEY_VALUE:
        examples = [synthetic.key_value_example(rng, size, num_queries=min(QUERIES_PER_EXAMPLE, size))
                    for _ in range(batch_size)]  # fmt: skip
    else:
        examples = [synthetic.copy_example(rng, size) for _ in range(batch_size)]
    ids = torch.tensor([tokenizer.convert_tokens_to_ids(words) for words, _ in examples])
    answer = torch.tensor([is_answer for _, is_answer in examples])
    labels = ids.masked_fill(~answer, -100)  # the model shifts labels by one inside its loss
    return task, ids, labels


class Curriculum:
    """Per task, the largest problem size drawn. A task's size grows by `SIZE_STEP` (up to the eval size) once the
    running mean of its answer accuracy reaches `LEVEL_UP_ACCURACY`. The lookup is learnt on short contexts (attention
    not yet spread over hundreds of keys); fixed full-size batches, or sizes grown on a fixed schedule, were still at
    chance after 600-700 steps (measured)."""

    def __init__(self):
        self.max_sizes = dict.fromkeys(TASK_SHARE, START_SIZE)
        self.accuracy = dict.fromkeys(TASK_SHARE, 0.0)
        self.levels = [(0, task, START_SIZE) for task in TASK_SHARE]

    def update(self, step: int, task: str, accuracy: float) -> None:
        self.accuracy[task] = 0.9 * self.accuracy[task] + 0.1 * accuracy
        if self.max_sizes[task] < FULL_SIZE[task] and self.accuracy[task] >= LEVEL_UP_ACCURACY:
            self.max_sizes[task] = min(self.max_sizes[task] + SIZE_STEP, FULL_SIZE[task])
            self.accuracy[task] = 0.0
            self.levels.append((step + 1, task, self.max_sizes[task]))


def held_out_signatures() -> set[str]:
    """Contexts of the shipped eval docs (test and validation): no training example may share one."""
    return {synthetic.context_signature(doc["context"].split())
            for task in TASKS for split in SPLITS for doc in load_docs(task, split)}  # fmt: skip


# ------------------------------------------------------------------------------------------------- train


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return values


def average_gradients(model: torch.nn.Module) -> None:
    """Data parallel by hand: one flat all-reduce per step (the model is ~1 M parameters, 4 MB of fp32 gradients)."""
    if not dist.is_initialized():
        return
    params = list(model.parameters())
    for param in params:  # every process must send the same layout, even if a parameter got no gradient here
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    flat = all_reduce_mean(torch.cat([param.grad.reshape(-1) for param in params]))
    for param, chunk in zip(params, flat.split([param.numel() for param in params]), strict=True):
        param.grad.copy_(chunk.view_as(param))


def train(rank: int, args: argparse.Namespace) -> None:
    """One data-parallel process. Every process holds the whole model (same seed, same initial weights) and draws its
    own batches; rank 0 evaluates, keeps the best weights and writes the checkpoint."""
    if args.procs > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    main_process = rank == 0
    # One thread per process: on a shared 2-core machine two OpenMP threads that wait for each other ran 5-8x slower
    # per step than one (measured); it also fixes the summation order, so a rerun with the same seed repeats the run.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # identical initial weights in every process
    rng = random.Random(f"{args.seed}-{rank}")  # distinct batches per process
    tokenizer = synthetic.build_tokenizer()
    model = KDSAForCausalLM(MODELS[args.model](len(tokenizer), args.index_topk))
    n_params = sum(p.numel() for p in model.parameters())
    if main_process:
        print(f"{args.model}: {n_params / 1e6:.2f} M parameters; {args.steps} steps of {args.procs} x "
              f"{args.batch_size} sequences")  # fmt: skip
    dsa_layers = use_dense_training_attention(model, enabled=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10 %
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    held_out = held_out_signatures()
    validation = {task: load_docs(task, split="validation") for task in TASKS}
    overlaps, best, history, curriculum = 0, None, [], Curriculum()
    start = time.time()
    progress = tqdm(range(args.steps), desc=f"train {args.model}", dynamic_ncols=True, disable=not main_process)
    for step in progress:
        model.train()
        task, ids, labels = training_batch(rng, tokenizer, args.batch_size, curriculum.max_sizes)
        overlaps += sum(synthetic.context_signature(tokenizer.convert_ids_to_tokens(row)) in held_out
                        for row in ids.tolist())  # fmt: skip
        for layer in dsa_layers:
            layer.indexer_losses.clear()
        output = model(ids, labels=labels, use_cache=False)
        loss = output.loss
        indexer_loss = sum(sum(layer.indexer_losses) for layer in dsa_layers)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        (loss + indexer_loss).backward()
        average_gradients(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        # Processes may draw different tasks at a step: average each task's accuracy over the processes that drew
        # it, so that every process makes the same curriculum decision.
        with torch.no_grad():
            answers = labels[:, 1:] != -100
            hits = (output.logits[:, :-1].argmax(-1) == labels[:, 1:])[answers].float().mean().item()
        stats = torch.zeros(2, len(TASK_SHARE))
        column = list(TASK_SHARE).index(task)
        stats[0, column], stats[1, column] = hits, 1.0
        stats = all_reduce_mean(stats)  # [mean hits, share of processes] per task
        for column, name in enumerate(TASK_SHARE):
            if stats[1, column] > 0:
                curriculum.update(step, name, (stats[0, column] / stats[1, column]).item())
        progress.set_postfix(loss=f"{loss.item():.3f}", indexer=f"{indexer_loss.item():.3f}",
                             size="/".join(str(v) for v in curriculum.max_sizes.values()))  # fmt: skip

        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            if main_process:
                model.eval()
                scores = evaluate(model, tokenizer, validation, stepwise=False)  # dense: the training forward
                mean = sum(scores.values()) / len(scores)
                history.append({"step": step + 1, "loss": round(loss.item(), 4),
                                "sizes": dict(curriculum.max_sizes), **scores})  # fmt: skip
                tqdm.write(f"step {step + 1}: loss {loss.item():.3f} validation " +
                           " ".join(f"{k}={v:.3f}" for k, v in scores.items()))  # fmt: skip
                if best is None or mean >= best[0]:
                    best = (mean, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
            if dist.is_initialized():
                dist.barrier()
    train_minutes = (time.time() - start) / 60
    if dist.is_initialized():
        total = torch.tensor([overlaps])
        dist.all_reduce(total)  # summed over processes
        overlaps = int(total.item())
        dist.destroy_process_group()
    if not main_process:
        return
    if overlaps:
        raise RuntimeError(f"{overlaps} training examples share a context with the held-out eval data")

    use_dense_training_attention(model, enabled=False)
    model.load_state_dict(best[2])
    model.eval()
    print(f"best validation mean {best[0]:.3f} at step {best[1]}; training took {train_minutes:.1f} min")

    # Final metrics with the real (paged, sparse) DSA layer on the held-out test docs.
    test_docs = {task: load_docs(task) for task in TASKS}
    results = {}
    for name in ("dense", "sparse_topk64"):
        CONFIGURATIONS[name].prepare(model)
        results[name] = evaluate(model, tokenizer, test_docs)
    set_index_topk(model, args.index_topk)  # the shipped config
    print(format_table(results, reference="dense"))

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    for code in args.out.glob("*.py"):  # weights, config, tokenizer and card only (docs/testing.md §3)
        code.unlink()
    config_file = args.out / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("auto_map", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    training = {
        "command": f"python scripts/train_tiny.py --model {args.model}" + "".join(
            f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "model", "port")),
        "model": args.model, "seed": args.seed, "steps": args.steps, "procs": args.procs,
        "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "curriculum_levels": curriculum.levels,
        "best_step": best[1], "train_minutes": round(train_minutes, 1), "parameters": n_params,
        "train_overlap_with_eval": overlaps, "torch_threads_per_process": torch.get_num_threads(),
    }  # fmt: skip
    (args.out / "training.json").write_text(json.dumps({"training": training, "history": history,
                                                        "test": results}, indent=2) + "\n")  # fmt: skip
    (args.out / "README.md").write_text(model_card(model.config, training, results))
    print(f"saved to {args.out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="tiny", help="tiny: the target; draft: its draft")
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--procs", type=int, default=2, help="data-parallel processes, one CPU core each")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per process and step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index-topk", type=int, default=64)
    parser.add_argument("--port", type=int, default=None, help="gloo rendezvous port (default: a free one)")
    parser.add_argument("--out", type=Path, default=None, help="default: checkpoints/kdsa-tiny[-draft]")
    args = parser.parse_args()
    if args.out is None:
        args.out = CHECKPOINTS / CHECKPOINT_NAMES[args.model]
    if args.procs < 1:
        parser.error("--procs must be >= 1")
    if args.procs == 1:
        train(0, args)
        return
    if args.port is None:
        with socket.socket() as probe:  # a port the OS reports free now (a fixed one may linger in TIME_WAIT)
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    mp.spawn(train, args=(args,), nprocs=args.procs, join=True)


def model_card(config: KDSAConfig, training: dict, results: dict) -> str:
    rows = "\n".join(
        f"| {task} | {results['dense'][task]:.3f} | {results['sparse_topk64'][task]:.3f} | {TASKS[task].chance} |"
        for task in TASKS
    )
    kinds = ", ".join("KDA" if t == "linear_attention" else "DSA" for t in config.layer_types)
    name = CHECKPOINT_NAMES[training["model"]]
    if training["model"] == "tiny":
        role = (
            f"Block AttnRes with blocks of {config.attn_res_block_size} sublayers; MoE with "
            f"{config.n_routed_experts} experts, top {config.num_experts_per_tok}, after a dense first layer"
        )
        purpose = (
            "It exists so that generate, evaluation and benchmarks of the `kdsa` package run out of the box "
            "with no download. `kdsa-tiny-draft` (same tokenizer) is its speculative-decoding draft."
        )
    else:
        role = "dense MLPs, plain residual stream"
        purpose = (
            "It is the speculative-decoding draft of `kdsa-tiny` (same tokenizer, same tasks): "
            "`model.generate(ids, assistant_model=draft, do_sample=False)` returns exactly kdsa-tiny's greedy "
            "tokens, faster when the draft agrees with it."
        )
    return f"""---
license: apache-2.0
library_name: transformers
tags: [kdsa, kda, dsa, synthetic, tiny]
---

# {name}

A {training["parameters"] / 1e6:.2f} M-parameter KDSA model ({kinds}; {role}; `index_topk = {config.index_topk}`)
trained from scratch on synthetic long-context tasks. {purpose} It knows nothing but its tasks. Vocabulary:
{config.vocab_size} words (word-level tokenizer, `AutoTokenizer` loads it).

```python
import modeling_kdsa  # registers the "kdsa" architecture with transformers' Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("checkpoints/{name}")
tokenizer = AutoTokenizer.from_pretrained("checkpoints/{name}")
ids = tokenizer("pairs k1 v5 k7 v9 k3 v0 ? k7", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1:]))  # v9
```

This folder holds weights, config, tokenizer and this card, no code. `model.save_pretrained(folder)` writes the
model's code beside the weights (`auto_map`), and that folder loads with `trust_remote_code=True` where the `kdsa`
package is not installed.

## Tasks

- **recall** `pairs k5 v12 k90 v3 ... ? k90` → `v3`: {synthetic.EVAL_NUM_PAIRS} key-value pairs (keys distinct out of
  128, values out of 64), one query; evaluated by how far back the needle sits (near 1–31 tokens, mid 33–63, far
  65–129: beyond `index_topk = 64`, so no window of the 64 most recent tokens holds it).
- **compose** `... + k90` → `v4`: the successor of the recalled value (lookup composed with a learned function).
- **copy** `copy k7 k100 ... | ` → the same {synthetic.EVAL_COPY_LENGTH} keys (exact match of all of them).

Metric: greedy exact match of the whole target (lm-eval `acc` of a `loglikelihood` task). Chance: 1/64 for
recall/compose.

## Results (held-out test docs, different seed, no context shared with training)

| task | dense | sparse (index_topk 64) | chance |
|---|---|---|---|
{rows}

## Training

`{training["command"]}` — seed {training["seed"]}, {training["steps"]} steps × {training["procs"]} processes ×
{training["batch_size"]} sequences, AdamW lr {training["lr"]} (warm-up {training["warmup"]}, cosine to 10 %), loss on
answer tokens only. Adaptive curriculum per task: problems start at {START_SIZE} pairs / keys and grow by {SIZE_STEP}
whenever the task reaches {LEVEL_UP_ACCURACY:.0%} answer accuracy (step, task, size:
{training["curriculum_levels"]}). DSA layers run densely in training while the Lightning Indexer learns to imitate
their attention (KL); best validation checkpoint at step {training["best_step"]}; {training["train_minutes"]} min,
{training["procs"]} processes of {training["torch_threads_per_process"]} CPU thread. Training examples sharing a
context with the eval docs: {training["train_overlap_with_eval"]}. Full history: `training.json`.
"""


if __name__ == "__main__":
    main()
